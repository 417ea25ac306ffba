"""Tool calls: OpenAI function tools offered to a chat, rendered into its prompt, enforced on
its output where the format allows, and parsed back into calls.

A request's tools go through three steps, each here once for every entry point (the Engine's
``chat``/``achat``/``stream_chat`` and the server's routes):

1. **Checking** (:func:`plan_tools`): ``tools`` (``{"type": "function", "function": {"name",
   "description", "parameters", "strict"}}``; the Responses API's flat ``{"type": "function",
   "name", ...}`` too), ``tool_choice`` (``"auto"``, the default with tools; ``"none"``;
   ``"required"``; ``{"type": "function", "function": {"name": ...}}``) and
   ``parallel_tool_calls`` (false: at most one call). A bad one is a ``ValueError`` whose
   message starts with the path of the bad part (``tools[1].function.parameters: ...``,
   ``tool_choice ...``): names of 1 to 64 of ``a-z A-Z 0-9 _ -`` (OpenAI's rule), no duplicate
   names, at most :data:`MAX_TOOLS` tools, each parameters schema a JSON schema that
   llguidance accepts (with ``strict``: one whose every keyword it can enforce), a named
   ``tool_choice`` naming one of the tools.

2. **Rendering** (:func:`adapt_messages`, called by :meth:`kvserve.chat.ChatTemplate.render`
   with the ``tools`` it is given). Which format a chat uses is decided by its template
   (:func:`tool_format`):

   - **Hermes** (:data:`HERMES`): a template that reads ``tools`` and writes ``<tool_call>``
     (Qwen 2.5, Hermes 2/3 and their kin). The template gets ``tools``, the history's tool
     calls and tool results as the template expects them (probed once per template, as
     llama.cpp's minja probes: ``arguments`` as a dict when the template cannot print the
     JSON string, content ``""`` in place of null); the model answers ``<tool_call>{"name":
     ..., "arguments": {...}}</tool_call>``, text around the calls being its content.
   - **Generic** (:data:`GENERIC`, every other template, as llama.cpp's "generic" format):
     the tools are listed in a system-prompt section (name, description, the JSON schema of
     the arguments) with the exact JSON to answer with, ``{"tool_calls": [{"name": ...,
     "arguments": {...}}]}`` or ``{"response": "..."}``; a history's tool calls are rendered
     as that JSON in the assistant's content and each tool result as ``{"tool_response":
     {"name", "tool_call_id", "content"}}`` (in a ``tool`` message when the template prints
     one, else a ``user`` one), so a model sees its earlier turns in the format it must
     answer in. A template that reads ``tools`` in a format kvserve does not parse (Llama
     3.1's, Mistral's) is treated as generic: its tools are not passed to it, so the model
     gets one set of instructions, which the constraint matches.

3. **Constraining and parsing** (:class:`ToolPlan`): with the generic format the output is
   constrained (:mod:`kvserve.grammar`) by a JSON schema made of the tools: an ``anyOf`` of
   each tool's ``{"name": <const>, "arguments": <its parameters>}``; ``required`` allows only
   ``tool_calls`` (at least one), a named function only that tool, ``auto`` the calls or a
   ``response``, ``parallel_tool_calls: false`` at most one call (``maxItems: 1``). With the
   Hermes format, ``required`` and a named function are enforced by a Lark grammar (calls
   only, each ``<tool_call>`` block's JSON by the same schema); ``auto`` is left free and
   parsed. ``none`` renders no tools and constrains nothing (a history's calls still render).
   :class:`ToolCallParser` turns the text into content and :class:`ToolCall` items, fed
   piece by piece (streaming) or whole, with the same result either way: the generic
   format's JSON envelope is never content (a ``response`` string is decoded as it comes);
   an output that does not parse (only possible when free, or cut short by ``max_tokens``)
   is content as it was generated, and a reply cut short keeps the calls it completed (its
   finish reason stays ``length``; a reply that ends with calls finishes ``tool_calls``). A
   call to an unknown tool, or with arguments that are not a JSON object, is not a call (its
   text is content); with ``parallel_tool_calls: false`` calls after the first are dropped
   (possible only when the output is free).

Not done: the tool formats of Llama 3.x (``{"name", "parameters"}`` JSON or
``<|python_tag|>``), Mistral (``[TOOL_CALLS]``) and others are not parsed (those templates get
the generic format); ``auto`` with the Hermes format is not constrained; arguments are not
streamed in fragments (each call comes whole, as soon as it is complete).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from .grammar import JSON_OPTIONS, MAX_SOURCE_CHARS, Constraint, GrammarError

if TYPE_CHECKING:
    from .chat import ChatTemplate

__all__ = [
    "FINISH_TOOL_CALLS",
    "GENERIC",
    "HERMES",
    "MAX_TOOLS",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolPlan",
    "adapt_messages",
    "check_tools",
    "plan_tools",
    "tool_format",
]

# The finish reason of a reply that calls tools (OpenAI's).
FINISH_TOOL_CALLS = "tool_calls"
# The most tools one request may offer (OpenAI's limit).
MAX_TOOLS = 128
# The output formats (see the module docs).
GENERIC = "generic"
HERMES = "hermes"

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("auto", "none", "required")
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
# Arguments of a tool without ``parameters``: an empty object (OpenAI's rule).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Event = Union[str, "ToolCall"]


@dataclass(frozen=True)
class Tool:
    """One checked function tool: ``spec`` is what the request sent (the template's view)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool
    spec: dict[str, Any] = field(compare=False)


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is JSON text (an object), as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as chat completions' ``message.tool_calls`` items are."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- checking ----------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return type(value).__name__


def check_tools(tools: object) -> list[Tool]:
    """The tools of a request (None or ``[]``: none), checked for shape and names; their
    parameters schemas are checked by :func:`plan_tools`. ``ValueError`` naming the path."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of function tools, got {_type_name(tools)}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} tools, more than the limit {MAX_TOOLS}")
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be an object, got {_type_name(spec)}")
        if spec.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function', got {spec.get('type')!r}")
        fn: Mapping[str, Any] = spec
        if "function" in spec or "name" not in spec:  # chat's shape; the Responses API's is flat
            fn = spec.get("function")
            where += ".function"
            if fn is None:
                raise ValueError(f"{where} is missing (an object with a name)")
            if not isinstance(fn, Mapping):
                raise ValueError(f"{where} must be an object, got {_type_name(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{where}.name {name!r} is also the name of tools[{seen[name]}]")
        seen[name] = i
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = dict(_NO_PARAMETERS)
        elif not isinstance(parameters, Mapping):
            raise ValueError(
                f"{where}.parameters must be a JSON schema object, got {_type_name(parameters)}"
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.strict must be a boolean")
        out.append(Tool(name, description, dict(parameters), bool(strict), dict(spec)))
    return out


def _check_choice(tool_choice: object, tools: list[Tool]) -> tuple[str, str | None]:
    """``(mode, named function)`` of a ``tool_choice``; ``ValueError`` naming it."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ValueError(
                f"tool_choice must be 'auto', 'none', 'required' or a named function,"
                f" got {tool_choice!r}"
            )
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice is 'required' but no tools were given")
        return tool_choice, None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or"
            ' {"type": "function", "function": {"name": ...}}'
        )
    # The Responses API's is flat ({"type": "function", "name": ...}): named as it is sent.
    where = "tool_choice.function.name" if "function" in tool_choice else "tool_choice.name"
    fn = tool_choice.get("function", tool_choice)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f"{where} must be a string")
    if name not in {t.name for t in tools}:
        raise ValueError(f"{where} {name!r} is not one of the tools")
    return "function", name


def _validate_schema(schema: dict[str, Any], where: str, strict: bool) -> None:
    from .grammar import _llguidance

    llg = _llguidance()
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{where}: not JSON: {e}") from None
    if len(text) > MAX_SOURCE_CHARS:
        raise GrammarError(
            f"{where} has {len(text)} characters of JSON, more than the limit {MAX_SOURCE_CHARS}"
        )
    grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults={"lenient": not strict})
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"{where}: {problem}")


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: ``tools`` (checked), ``choice`` (``auto``, ``none``,
    ``required`` or ``function``, with ``function`` the named tool), ``parallel``,
    ``format`` (:data:`GENERIC` or :data:`HERMES`, from the chat template), ``constraint``
    (None: free output). :attr:`render_tools` goes to the chat template; :meth:`parser`
    reads the output."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None
    parallel: bool
    format: str
    constraint: Constraint | None

    @property
    def active(self) -> bool:
        """Whether the model is offered tools (and its output is parsed for calls)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def render_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` to render the prompt with (None: no tools in the prompt)."""
        return [t.spec for t in self.tools] if self.active else None

    def parser(self) -> ToolCallParser:
        """A fresh parser of one reply (one per choice)."""
        return ToolCallParser(self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply's ``(content, calls)``: what its streamed events join to."""
        p = self.parser()
        events = p.feed(text) + p.finish()
        return p.content(events), [e for e in events if isinstance(e, ToolCall)]


def plan_tools(
    template: ChatTemplate,
    tools: object,
    tool_choice: object = None,
    parallel_tool_calls: object = None,
) -> ToolPlan | None:
    """The plan of a request's tools for a chat rendered with ``template`` (None when it has
    none). ``ValueError`` naming the bad field (:class:`kvserve.grammar.GrammarError` for a
    parameters schema llguidance refuses)."""
    checked = check_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be a boolean")
    choice, function = _check_choice(tool_choice, checked)
    if not checked:
        return None
    fmt = tool_format(template)
    parallel = parallel_tool_calls is not False
    plan = ToolPlan(tuple(checked), choice, function, parallel, fmt, None)
    if not plan.active:
        return plan
    for i, tool in enumerate(checked):
        fn = ".function" if "function" in tool.spec else ""
        _validate_schema(tool.parameters, f"tools[{i}]{fn}.parameters", tool.strict)
    constraint = _constraint(plan)
    return ToolPlan(plan.tools, choice, function, parallel, fmt, constraint)


def tool_format(template: ChatTemplate) -> str:
    """The tool-call format of chats rendered with ``template`` (see the module docs)."""
    caps = template.tool_caps
    if caps.reads_tools and _HERMES_OPEN in template.source:
        return HERMES
    return GENERIC


# -- constraints -------------------------------------------------------------------------------


def _rewrite_refs(value: Any, prefix: str) -> Any:
    """``value`` with its local ``$ref``s to ``$defs``/``definitions`` renamed with ``prefix``
    (a tool's definitions move to the root of the combined schema)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str):
                for kind in ("#/$defs/", "#/definitions/"):
                    if v.startswith(kind):
                        v = f"#/$defs/{prefix}{v[len(kind) :]}"
                out[k] = v
            else:
                out[k] = _rewrite_refs(v, prefix)
        return out
    if isinstance(value, list):
        return [_rewrite_refs(v, prefix) for v in value]
    return value


def _calls_schema(plan: ToolPlan) -> dict[str, Any]:
    """The schema of one call (``{"name", "arguments"}``) of the tools the plan allows, their
    definitions hoisted to its root."""
    defs: dict[str, Any] = {}
    alternatives = []
    for i, tool in enumerate(plan.tools):
        if plan.function is not None and tool.name != plan.function:
            continue
        params = _rewrite_refs(tool.parameters, f"t{i}_")
        for kind in ("$defs", "definitions"):
            for name, sub in (params.pop(kind, None) or {}).items():
                defs[f"t{i}_{name}"] = sub
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _guidance() -> dict[str, Any]:
    # Lenient: a keyword llguidance cannot enforce is ignored (strict tools were checked alone).
    return {**JSON_OPTIONS, "lenient": True}


def _constraint(plan: ToolPlan) -> Constraint | None:
    from .grammar import _llguidance

    call = _calls_schema(plan)
    defs = call.pop("$defs", None)
    if plan.format == HERMES:
        if plan.choice == "auto":
            return None  # free text; the parser finds the calls
        body = {**call, "x-guidance": _guidance()}
        if defs:
            body["$defs"] = defs
        # The markers as text (a model whose vocabulary has them as tokens may use those: a
        # user-defined token's text is its text; the output holds them either way).
        calls = "call" if not plan.parallel else "call (WS? call)*"
        lark = (
            "%llguidance {}\n"
            f"start: WS? {calls} WS?\n"
            f"call: {json.dumps(_HERMES_OPEN)} WS? body WS? {json.dumps(_HERMES_CLOSE)}\n"
            f"body: %json {json.dumps(body)}\n"
            "WS: /[ \\t\\r\\n]{1,20}/\n"
        )
        source = _llguidance().grammar_from("grammar", lark)
        return _checked(Constraint("grammar", source, "tools"))
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not plan.parallel:
        array["maxItems"] = 1
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if plan.choice == "auto":
        response = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        schema = {"anyOf": [schema, response]}
    schema["x-guidance"] = _guidance()
    if defs:
        schema["$defs"] = defs
    text = json.dumps(schema)
    source = _llguidance().LLMatcher.grammar_from_json_schema(text)
    return _checked(Constraint("json_schema", source, "tools"))


def _checked(constraint: Constraint) -> Constraint:
    from .grammar import _llguidance

    if len(constraint.source) > 4 * MAX_SOURCE_CHARS:
        raise GrammarError(
            f"tools make a grammar of {len(constraint.source)} characters, more than the limit"
            f" {4 * MAX_SOURCE_CHARS}"
        )
    problem = _llguidance().LLMatcher.validate_grammar(constraint.source)
    if problem:
        raise GrammarError(f"tools: {problem}")
    return constraint


# -- rendering ---------------------------------------------------------------------------------


def _text(content: Any) -> str:
    """A message content as one string (text parts joined with newlines, null as empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content)


def _arguments(raw: Any) -> Any:
    """A history call's arguments as a value (a JSON string is parsed; bad JSON stays text)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _generic_section(tools: list[Tool]) -> str:
    lines = ["You can call these tools (the arguments of each follow its JSON schema):"]
    for t in tools:
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {t.name}{desc}\n  arguments: {json.dumps(t.parameters)}")
    lines.append(
        'Answer with one JSON object and nothing else: {"tool_calls": [{"name": <tool name>,'
        ' "arguments": <its arguments>}]} to call tools (their results come back as'
        ' {"tool_response": ...}), or {"response": <your answer as a string>} to answer.'
    )
    return "\n".join(lines)


def _generic_calls(content: Any, calls: list[dict[str, Any]]) -> str:
    envelope = {
        "tool_calls": [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
            for c in calls
        ]
    }
    text = _text(content)
    return (text + "\n" if text else "") + json.dumps(envelope, ensure_ascii=False)


def _hermes_calls(content: Any, calls: list[dict[str, Any]]) -> str:
    blocks = [
        f"{_HERMES_OPEN}\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
            ensure_ascii=False,
        )
        + f"\n{_HERMES_CLOSE}"
        for c in calls
    ]
    text = _text(content)
    return "\n".join(([text] if text else []) + blocks)


def adapt_messages(
    template: ChatTemplate, messages: list[dict[str, Any]], tools: object
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` as ``template`` renders them in its tool format (see the module
    docs): checked ``messages`` (:func:`kvserve.chat.check_messages`) with their tool calls
    and tool results adapted, and the ``tools`` to hand the template (None for the generic
    format, whose tools become a system-prompt section)."""
    checked = check_tools(tools)
    caps = template.tool_caps
    fmt = tool_format(template)
    native = fmt == HERMES
    names: dict[str, str] = {}  # call id -> function name, for tool results
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                if isinstance(c.get("id"), str):
                    names[c["id"]] = c["function"]["name"]
            if native and caps.reads_tool_calls:
                shaped = []
                for c in calls:
                    args = c["function"]["arguments"]
                    if caps.object_arguments:
                        args = _arguments(args)
                    elif not isinstance(args, str):
                        args = json.dumps(args, ensure_ascii=False)
                    fn = {"name": c["function"]["name"], "arguments": args}
                    shaped.append({**c, "type": "function", "function": fn})
                m = {**m, "content": _text(m.get("content")), "tool_calls": shaped}
            else:
                render = _hermes_calls if native else _generic_calls
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = render(m.get("content"), calls)
        elif m["role"] == "tool" and not (native and caps.tool_role):
            call_id = m.get("tool_call_id")
            if native:
                content = f"<tool_response>\n{_text(m['content'])}\n</tool_response>"
            else:
                response = {"name": names.get(call_id) if isinstance(call_id, str) else None}
                if call_id is not None:
                    response["tool_call_id"] = call_id
                response["content"] = _text(m["content"])
                content = json.dumps({"tool_response": response}, ensure_ascii=False)
            role = "tool" if caps.tool_role else "user"
            prev = out[-1] if out else None
            if role == "user" and prev is not None and prev.get("_kvs_tool_result"):
                prev["content"] += "\n" + content  # one user turn for a run of results
                continue
            m = {"role": role, "content": content}
            if role == "user":
                m["_kvs_tool_result"] = True
        out.append(m)
    for m in out:
        m.pop("_kvs_tool_result", None)
    if not checked:
        return out, None
    if native:
        return out, [t.spec for t in checked]
    section = _generic_section(checked)
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        text = _text(first["content"])
        out[0] = {**first, "content": (text + "\n\n" if text else "") + section}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out, None


# -- parsing -----------------------------------------------------------------------------------

_GENERIC_HEAD = re.compile(r'\s*\{\s*"(response|tool_calls)"\s*:\s*([\["])')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _could_be_head(text: str) -> bool:
    """Whether ``text`` may still grow into the generic envelope's head (``{"response": "``
    or ``{"tool_calls": [``)."""
    s = text.lstrip()
    if not s:
        return True
    if s[0] != "{":
        return False
    s = s[1:].lstrip()
    if not s:
        return True
    if s[0] != '"':
        return False
    s = s[1:]
    for key in ("response", "tool_calls"):
        if key.startswith(s):
            return True
        if s.startswith(key):
            rest = s[len(key) :]
            if not rest:
                return True
            if rest[0] != '"':
                continue
            rest = rest[1:].lstrip()
            if not rest or (rest[0] == ":" and not rest[1:].strip()):
                return True
    return False


class ToolCallParser:
    """Reads one reply of a :class:`ToolPlan`'s request: :meth:`feed` each piece of text as
    it comes, then :meth:`finish`; each returns events, content text (``str``) and
    :class:`ToolCall` items, in order. Feeding the whole text at once gives the same events
    joined (:meth:`ToolPlan.parse`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.names = {t.name for t in plan.tools}
        self.calls = 0
        self._raw: list[str] = []
        self._buf = ""
        self._mode: str | None = None  # generic: None, response, calls, done, text
        self._envelope: str | None = None  # generic: response or tool_calls, once known
        self._held = ""  # hermes: whitespace held back until more content follows
        # generic calls: the array scan
        self._start: int | None = None
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._pos = 0

    @staticmethod
    def content(events: list[Event]) -> str | None:
        """The content of a whole reply's events (None when it is only calls)."""
        text = "".join(e for e in events if isinstance(e, str))
        if not text and any(isinstance(e, ToolCall) for e in events):
            return None
        return text

    def feed(self, text: str) -> list[Event]:
        if not self.plan.active:
            return [text] if text else []
        self._raw.append(text)
        self._buf += text
        out: list[Event] = []
        if self.plan.format == HERMES:
            self._hermes(out, final=False)
        else:
            self._generic(out)
        return out

    def finish(self) -> list[Event]:
        if not self.plan.active:
            return []
        out: list[Event] = []
        if self.plan.format == HERMES:
            self._hermes(out, final=True)
            return out
        self._generic(out)
        if self._mode in (None, "text") and self._buf:
            out.append(self._buf)
        elif self._envelope == "tool_calls" and self.calls == 0:
            out.append("".join(self._raw))  # no call complete: the text as it came
        self._buf = ""  # (a response's escape cut short is dropped)
        return out

    # -- calls --
    def _call(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        if self.plan.function is not None and obj["name"] != self.plan.function:
            return None
        return ToolCall(_new_id(), obj["name"], json.dumps(args, ensure_ascii=False))

    def _add(self, call: ToolCall, out: list[Event]) -> None:
        if self.plan.parallel or self.calls == 0:
            self.calls += 1
            out.append(call)

    # -- the generic format --
    def _generic(self, out: list[Event]) -> None:
        while True:
            if self._mode is None:
                m = _GENERIC_HEAD.match(self._buf)
                if m is not None:
                    self._envelope = m.group(1)
                    self._mode = "response" if m.group(1) == "response" else "calls"
                    self._buf = self._buf[m.end() :]
                    continue
                if not _could_be_head(self._buf):
                    self._mode = "text"
                    continue
                return
            if self._mode == "text":
                if self._buf:
                    out.append(self._buf)
                self._buf = ""
                return
            if self._mode == "response":
                self._response(out)
                return
            if self._mode == "calls":
                self._array(out)
                return
            self._buf = ""  # done: the envelope's closing braces
            return

    def _response(self, out: list[Event]) -> None:
        buf, i, chars = self._buf, 0, []
        n = len(buf)
        while i < n:
            c = buf[i]
            if c == '"':
                self._mode = "done"
                i = n
                break
            if c != "\\":
                chars.append(c)
                i += 1
                continue
            if i + 1 >= n:
                break
            e = buf[i + 1]
            if e != "u":
                chars.append(_ESCAPES.get(e, e))
                i += 2
                continue
            if i + 6 > n:
                break
            try:
                code = int(buf[i + 2 : i + 6], 16)
            except ValueError:
                chars.append(buf[i : i + 6])
                i += 6
                continue
            if 0xD800 <= code < 0xDC00:
                rest = buf[i + 6 : i + 12]
                if len(rest) < 6 and ("\\u".startswith(rest) or rest.startswith("\\u")):
                    break  # the low half may follow
                try:
                    lo = int(rest[2:], 16) if rest.startswith("\\u") else -1
                except ValueError:
                    lo = -1
                if 0xDC00 <= lo < 0xE000:
                    chars.append(chr(0x10000 + ((code - 0xD800) << 10) + (lo - 0xDC00)))
                    i += 12
                    continue
                chars.append("\ufffd")
                i += 6
                continue
            chars.append("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))
            i += 6
        self._buf = buf[i:]
        if chars:
            out.append("".join(chars))

    def _array(self, out: list[Event]) -> None:
        buf = self._buf
        i = self._pos
        while i < len(buf):
            c = buf[i]
            if self._start is None:
                if c == "{":
                    self._start, self._depth = i, 1
                elif c == "]":
                    self._mode = "done"
                    self._buf, self._pos = "", 0
                    return
                elif not (c.isspace() or c == ","):
                    self._mode = "done"  # not a call list after all: nothing more to read
                    self._buf, self._pos = "", 0
                    return
            elif self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    try:
                        call = self._call(json.loads(buf[self._start : i + 1]))
                    except ValueError:
                        call = None
                    if call is not None:
                        self._add(call, out)
                    buf = buf[i + 1 :]
                    self._buf, self._start, i = buf, None, 0
                    continue
            i += 1
        if self._start is None:
            self._buf, self._pos = "", 0
        else:
            self._buf = buf[self._start :]
            self._pos = i - self._start
            self._start = 0

    # -- the Hermes format --
    def _content(self, text: str, out: list[Event]) -> None:
        """Content, with whitespace held back until more content follows it (so whitespace
        around calls is not content)."""
        if not text:
            return
        lead = text.rstrip()
        if not lead:
            self._held += text
            return
        out.append(self._held + lead)
        self._held = text[len(lead) :]

    def _hermes(self, out: list[Event], final: bool) -> None:
        while True:
            if self._mode != "call":
                at = self._buf.find(_HERMES_OPEN)
                if at >= 0:
                    self._content(self._buf[:at], out)
                    self._buf = self._buf[at + len(_HERMES_OPEN) :]
                    self._mode = "call"
                    continue
                keep = 0
                if not final:
                    for k in range(len(_HERMES_OPEN) - 1, 0, -1):
                        if self._buf.endswith(_HERMES_OPEN[:k]):
                            keep = k
                            break
                self._content(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return
            at = self._buf.find(_HERMES_CLOSE)
            if at < 0 and not final:
                return
            inner = self._buf if at < 0 else self._buf[:at]
            try:
                call = self._call(json.loads(inner))
            except ValueError:
                call = None
            if call is not None:
                self._add(call, out)
            else:
                closing = _HERMES_CLOSE if at >= 0 else ""
                self._content(_HERMES_OPEN + inner + closing, out)
            self._buf = "" if at < 0 else self._buf[at + len(_HERMES_CLOSE) :]
            self._mode = None
            if at < 0:
                return
