"""Chat templates: a list of messages rendered into the prompt text a model was trained on.

The template is the GGUF's ``tokenizer.chat_template`` (a Jinja template, as in the model's
Hugging Face ``tokenizer_config.json``), rendered the way ``transformers`` renders it: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the loop-control
extension, a ``{% generation %}`` block that renders its body, a ``tojson`` filter that keeps
non-ASCII text and does not escape HTML, the globals ``raise_exception(message)`` and
``strftime_now(format)``, and the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and ``tools`` (None unless a chat offers tools). A model without a
template gets ChatML.

Guarantees:
- Messages are checked before rendering: a list of dicts, each with a ``role`` string and a
  ``content`` that is a string or a list of OpenAI text parts (``{"type": "text", "text": ...}``;
  null only on an assistant message with ``tool_calls``); ``tool_calls`` a list of OpenAI calls
  (``{"id", "type": "function", "function": {"name", "arguments"}}``, ``arguments`` JSON text
  or an object) and ``tool_call_id`` a string; anything else is a ``ValueError`` naming the
  message's index and the field.
- Tools (:mod:`kvserve.tools`): ``render(messages, tools=...)`` renders a chat that offers
  tools, and a history with tool calls and tool results, in the template's tool format (the
  template's own when it has one kvserve knows, else the generic one); what the template
  expects of them (whether it prints ``tools``, tool calls, ``tool`` messages, and
  ``arguments`` as an object or as JSON text) is probed once per template
  (:attr:`ChatTemplate.tool_caps`).
- Text parts reach the template the way llama.cpp's server hands them over: a template that
  reads typed content (it iterates the parts and prints their text) gets the parts as they are;
  any other gets them joined with ``"\\n"``. Which kind a template is, is found once, by
  rendering two probe conversations.
- Any failure of the template (a syntax error, ``raise_exception`` in the template, an
  operation the sandbox forbids, an undefined variable used as a value, a Python error while
  rendering) is a ``ValueError`` starting with ``chat template``; nothing else escapes.
- :meth:`ChatTemplate.prompt` is what llama.cpp's ``llama-server`` feeds its tokenizer (and
  returns from ``/apply-template``): the rendered text without a leading BOS text when the
  tokenizer adds BOS itself, and without a trailing EOS text when it adds EOS, so that
  tokenizing it with the model's special tokens gives exactly one BOS (Gemma's template starts
  with ``{{ bos_token }}``; Gemma's tokenizer also adds BOS).
- Templates are compiled once per source text (a small LRU cache) and each model builds its
  :class:`ChatTemplate` once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "Message", "ToolCaps", "check_messages"]

Message = Mapping[str, Any]

# The template used when a model has none (the ChatML format).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# -- the environment -------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's part of a
    training example with it): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: object) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e


# -- messages --------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return type(value).__name__


def _not_a_string(where: str, value: object) -> ValueError:
    if value is None:
        return ValueError(f"{where} is missing")
    return ValueError(f"{where} must be a string, got {_type_name(value)}")


def check_messages(messages: object) -> list[dict[str, Any]]:
    """Validated copies of ``messages`` (a ``ValueError`` naming the index and the field for
    the first bad one). Content parts stay a list of ``{"type": "text", "text": str}``; other
    keys of a message are kept as they are."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {_type_name(messages)}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {_type_name(msg)}")
        role = msg.get("role")
        if not isinstance(role, str):
            raise _not_a_string(f"messages[{i}].role", role)
        calls = _check_tool_calls(i, msg.get("tool_calls"))
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise _not_a_string(f"messages[{i}].tool_call_id", call_id)
        if "content" not in msg and not calls:
            raise ValueError(f"messages[{i}].content is missing")
        content = msg.get("content")
        if isinstance(content, str) or (content is None and calls):
            pass
        elif isinstance(content, Sequence) and not isinstance(content, bytes):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, Mapping):
                    raise ValueError(f"{where} must be a dict, got {_type_name(part)}")
                if part.get("type") != "text":
                    raise ValueError(
                        f"{where}.type must be 'text' (only text parts are supported), "
                        f"got {part.get('type')!r}"
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise _not_a_string(f"{where}.text", text)
                parts.append({"type": "text", "text": text})
            content = parts
        else:
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {_type_name(content)}"
            )
        checked = {**msg, "role": role, "content": content}
        if calls:
            checked["tool_calls"] = calls
        else:
            checked.pop("tool_calls", None)
        out.append(checked)
    return out


def _check_tool_calls(i: int, calls: object) -> list[dict[str, Any]]:
    """A message's ``tool_calls`` checked (None and ``[]``: none): copies of the calls."""
    if calls is None:
        return []
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ValueError(f"messages[{i}].tool_calls must be a list, got {_type_name(calls)}")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{where} must be a dict, got {_type_name(call)}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {call.get('type')!r}")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _not_a_string(f"{where}.id", call_id)
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function must be a dict with a name and arguments")
        name = fn.get("name")
        if not isinstance(name, str):
            raise _not_a_string(f"{where}.function.name", name)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                raise ValueError(f"{where}.function.arguments is not valid JSON") from None
        elif not isinstance(args, Mapping):
            raise ValueError(
                f"{where}.function.arguments must be JSON text or an object, got {_type_name(args)}"
            )
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def _join_parts(parts: list[dict[str, str]]) -> str:
    return "\n".join(p["text"] for p in parts)


# -- templates -------------------------------------------------------------------------------

_PROBE = "kvserve-probe-3f9c"
_PROBE_TOOL = "kvserve_probe_fn"
_PROBE_ARGS = '{"kvs_arg": "kvs-probe-value"}'
_PROBE_RESULT = "kvserve-probe-result-7e1d"


@dataclass(frozen=True)
class ToolCaps:
    """What a chat template does with tools (probed by rendering, as llama.cpp's minja does):
    ``reads_tools`` (it prints the ``tools`` it is given), ``reads_tool_calls`` (it prints an
    assistant message's ``tool_calls``), ``object_arguments`` (it needs a call's
    ``arguments`` as an object: it cannot print them given as JSON text), ``tool_role`` (it
    prints the content of a ``tool`` message)."""

    reads_tools: bool = False
    reads_tool_calls: bool = False
    object_arguments: bool = False
    tool_role: bool = False


class _ProbeParts(list):  # type: ignore[type-arg]
    """Typed content for the capability probe: printed whole, it shows nothing, so the probe
    text appears only if the template iterates the parts."""

    def __str__(self) -> str:
        return ""

    __repr__ = __str__


class ChatTemplate:
    """A compiled chat template plus the model facts its rendering needs.

    ``source``: the Jinja template (None: ChatML). ``bos_token``/``eos_token``: the texts of the
    model's BOS and EOS tokens (the template variables). ``add_bos``/``add_eos``: whether the
    model's tokenizer adds them itself (then :meth:`prompt` strips the template's own copy).
    A template that does not compile is a ``ValueError`` here."""

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> None:
        self.source = CHATML_TEMPLATE if source is None else source
        self.is_default = source is None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._template = _compile(self.source)
        self.typed_content = self._probe_typed_content()
        self._tool_caps: ToolCaps | None = None

    def _run(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools,
            )
        except jinja2.TemplateError as e:  # raise_exception, SecurityError, UndefinedError
            raise ValueError(f"chat template error: {e.message or type(e).__name__}") from e
        except RecursionError as e:
            raise ValueError("chat template error: recursion too deep") from e
        except Exception as e:  # a Python error inside the template ('a' + 1, 1 / 0, ...)
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e

    def _probe_typed_content(self) -> bool:
        """Whether the template prints the text of typed content parts (one user message whose
        content is one text part); llama.cpp's server passes parts only to such templates."""
        parts = _ProbeParts([{"type": "text", "text": _PROBE}])
        try:
            out = self._run([{"role": "user", "content": parts}], True)
        except ValueError:
            return False
        return _PROBE in out

    @property
    def tool_caps(self) -> ToolCaps:
        """What the template does with tools (:class:`ToolCaps`; probed on first use)."""
        if self._tool_caps is None:
            self._tool_caps = self._probe_tools()
        return self._tool_caps

    def _probe_tools(self) -> ToolCaps:
        def shows(needle: str, messages: list[dict[str, Any]], tools: Any = None) -> bool:
            try:
                return needle in self._run(messages, False, tools)
            except ValueError:
                return False

        user = {"role": "user", "content": "Hi"}
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
        reads_tools = shows(_PROBE_TOOL, [user], [tool])

        def calls(arguments: Any) -> list[dict[str, Any]]:
            fn = {"name": _PROBE_TOOL, "arguments": arguments}
            call = {"id": "call_probe", "type": "function", "function": fn}
            return [user, {"role": "assistant", "content": "", "tool_calls": [call]}]

        as_text = shows(_PROBE_ARGS, calls(_PROBE_ARGS))
        as_object = shows("kvs-probe-value", calls(json.loads(_PROBE_ARGS)))
        object_arguments = as_object and not as_text
        history = calls(json.loads(_PROBE_ARGS) if object_arguments else _PROBE_ARGS)
        reads_tool_calls = shows(_PROBE_TOOL, history)
        result = {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE_RESULT}
        tool_role = shows(_PROBE_RESULT, [*history, result])
        return ToolCaps(reads_tools, reads_tool_calls, object_arguments, tool_role)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The template's output for ``messages`` (checked first; see :func:`check_messages`)
        offering ``tools`` (OpenAI function tools; see :mod:`kvserve.tools`)."""
        msgs = check_messages(messages)
        if not self.typed_content:
            for m in msgs:
                if isinstance(m["content"], list):
                    m["content"] = _join_parts(m["content"])
        shown: list[dict[str, Any]] | None = None
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
            from .tools import adapt_messages

            msgs, shown = adapt_messages(self, msgs, tools)
        return self._run(msgs, bool(add_generation_prompt), shown)

    def segments(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[tuple[str, bool]] | None:
        """:meth:`prompt`'s text cut into (text, is_content) pieces: the messages' content
        (each text part) apart from the template's own markup, so content can be tokenized as
        plain text and only markup's special-token text becomes special tokens. Found by
        rendering with a unique marker in place of each content text and checking that the
        pieces join to exactly :meth:`prompt`'s text (content as given, or trimmed as a
        template that trims it prints it). None when the template does not print every content
        verbatim once, in order (it transforms or repeats it): no safe cut exists."""
        whole = self.prompt(messages, add_generation_prompt, tools)
        msgs = check_messages(messages)
        texts: list[str] = []

        def mark(text: str) -> str:
            texts.append(text)
            return f"\ue000kvs{len(texts) - 1}\ue001"

        for m in msgs:
            if isinstance(m["content"], str):
                m["content"] = mark(m["content"])
            elif m["content"] is not None:
                m["content"] = [{"type": "text", "text": mark(p["text"])} for p in m["content"]]
        marked = self.prompt(msgs, add_generation_prompt, tools)
        cuts = re.split("\ue000kvs(\\d+)\ue001", marked)
        order = [int(i) for i in cuts[1::2]]
        if order != list(range(len(texts))):
            return None
        for trim in (False, True):
            pieces: list[tuple[str, bool]] = []
            for k, markup in enumerate(cuts[0::2]):
                pieces.append((markup, False))
                if k < len(texts):
                    pieces.append((texts[k].strip() if trim else texts[k], True))
            if "".join(t for t, _ in pieces) == whole:
                return [(t, c) for t, c in pieces if t]
        return None

    def prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text to tokenize with the model's special tokens (llama.cpp's rule: the
        template's leading BOS text goes when the tokenizer adds BOS, its trailing EOS text when
        the tokenizer adds EOS)."""
        text = self.render(messages, add_generation_prompt, tools)
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text
