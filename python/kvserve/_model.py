"""The public :class:`Model`: a loaded GGUF model plus single-sequence text generation.

Generation contract:
- The prompt is tokenized with ``add_special=True`` (the model's own add-BOS rule) and
  ``parse_special=True`` (special-token text such as ``<|im_start|>`` becomes its token).
- The whole prompt is prefilled in one decode call (logits for the last position only), then
  one token is decoded per step.
- Generation ends at an end-of-generation token (not part of the result), after
  ``max_tokens`` tokens, when the context is full, or when a ``stop`` string appears (the text
  is cut before it; the tokens include the one that completed it).
- Streamed pieces are always complete UTF-8 characters: bytes of a character split across
  tokens are held back until the character is complete; invalid bytes become U+FFFD.
  Concatenating the pieces of :meth:`Model.stream` gives exactly :meth:`Model.generate`'s text.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import numpy.typing as npt
from typing_extensions import Unpack

from . import models
from .options import SamplingOptions, resolve
from .sampling import TokenLogprob, token_logprobs
from .textstream import TextStream

if TYPE_CHECKING:
    from .chat import ChatTemplate, Message
    from .tools import ToolCall

try:
    from . import _core
except ImportError as _e:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvserve's compiled extension kvserve._core is missing; "
        "install kvserve with `pip install .` (needs a Rust toolchain)"
    ) from _e

KvCacheFull = _core.KvCacheFull
EngineError = _core.EngineError
ModelError = _core.ModelError

__all__ = [
    "EngineError",
    "GenerateResult",
    "KvCacheFull",
    "Model",
    "ModelError",
    "TokenLogprob",
    "generate",
]

StrPath = Union[str, "os.PathLike[str]"]

# The values KVSERVE_SIMD accepts (the engine's SIMD levels, lowest first). A machine runs
# scalar and its own architecture's levels (x86-64: avx2, avx512, avx512vnni; aarch64: neon);
# the engine caps any other to them.
SIMD_LEVELS = ("scalar", "neon", "avx2", "avx512", "avx512vnni")

FINISH_STOP = "stop"  # end-of-generation token or stop string
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CONTEXT = "context"  # the context window is full
FINISH_TOOL_CALLS = "tool_calls"  # a chat reply that calls tools (kvserve.tools)

# Most tokens one decode call takes (a context's n_batch, llama.cpp's default): prompts are
# fed in batches of this many.
PROMPT_BATCH = 2048


@dataclass(frozen=True)
class GenerateResult:
    """Generated text and token ids (the prompt is not included); ``prompt_tokens`` counts the
    prompt's tokens and ``cached_tokens`` those whose K/V was reused from the model's prefix
    cache instead of computed (``session_cached_tokens`` of them: held by the request's
    resident session in :class:`kvserve.Engine`; the rest came from the prefix index).
    ``logprobs`` (when the ``logprobs`` option asked for them, else None): one
    :class:`kvserve.sampling.TokenLogprob` per generated token, in order; ``end_logprob``:
    then also the entry of the end-of-generation token that ended the generation (it is in
    neither ``tokens`` nor ``text``), None when none did. ``prompt_logprobs`` (when the
    :class:`kvserve.Engine` option ``prompt_logprobs`` asked for them, else None): one entry
    per prompt token, the first None (nothing precedes it), each other token's
    log-probability given the tokens before it.

    ``tool_calls``: for a chat offered ``tools`` (:meth:`kvserve.Engine.chat`), the
    :class:`kvserve.tools.ToolCall` items the reply made (None otherwise, and when it made
    none); ``text`` is then the reply's content ("" when it is only calls; the generated text
    itself is ``model.detokenize(tokens)``) and ``finish_reason`` is ``"tool_calls"`` when it
    made calls.

    ``prefix_wait_s``: in :class:`kvserve.Engine`, the seconds the request waited in the queue
    for a shared prefix of its prompt that another request was computing (it was then reused,
    not computed twice); 0.0 when it waited for none."""

    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    session_cached_tokens: int = 0
    tool_calls: list[ToolCall] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    end_logprob: TokenLogprob | None = None
    prefix_wait_s: float = 0.0


def _check_simd_env() -> None:
    """Rejects a ``KVSERVE_SIMD`` that names no SIMD level (the engine would ignore it)."""
    raw = os.environ.get("KVSERVE_SIMD", "")
    if raw.strip() and raw.strip().lower() not in SIMD_LEVELS:
        raise ValueError(
            f"KVSERVE_SIMD={raw!r} is not a SIMD level; valid values: {', '.join(SIMD_LEVELS)}"
        )


def token_logprob(model: Model, row: npt.ArrayLike, token: int, n: int) -> TokenLogprob:
    """``token``'s entry for ``GenerateResult.logprobs``: its log-probability under the raw
    logits ``row`` it was picked from and the ``n`` most probable tokens of that row."""
    logprob, top = token_logprobs(row, token, n)
    return TokenLogprob(token, model.token_to_piece(token), logprob, top)


def prompt_ids(model: Model, prompt: str) -> list[int]:
    """The prompt's token ids as generation feeds them: the model's BOS rule, special-token
    text parsed, and an empty prompt started from BOS (a ``ValueError`` without one)."""
    ids = model.tokenize(prompt, add_special=True, parse_special=True)
    if not ids:
        if model.bos is None:
            raise ValueError("the prompt is empty and the model has no BOS token to start from")
        ids = [model.bos]
    return ids


class Model:
    """A GGUF model loaded from disk (memory-mapped, read-only).

    ``threads``: worker threads for the engine; ``None`` lets the engine decide
    (``KVSERVE_THREADS`` or the number of physical cores). A ``KVSERVE_SIMD`` value that names
    no SIMD level is a ``ValueError``. ``chat_template``: a Jinja chat template that replaces the
    GGUF's ``tokenizer.chat_template`` (as llama-server's ``--chat-template-file``).
    """

    def __init__(
        self, path: StrPath, threads: int | None = None, *, chat_template: str | None = None
    ) -> None:
        spath = os.fspath(path)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        _check_simd_env()
        self.path = Path(spath)
        self.threads = threads
        self._core = _core.Model(spath, threads)
        self._chat_template_source = chat_template
        self._chat_template: ChatTemplate | None = None

    @classmethod
    def load(
        cls,
        path: StrPath | None = None,
        threads: int | None = None,
        *,
        chat_template: str | None = None,
    ) -> Model:
        """Load ``path``, or the default model (downloaded and cached on first use) if None."""
        return cls(models.pull() if path is None else path, threads, chat_template=chat_template)

    def __repr__(self) -> str:
        return f"Model(path={str(self.path)!r}, arch={self.arch!r}, n_vocab={self.n_vocab})"

    # -- model facts --------------------------------------------------------------------------
    @property
    def core(self) -> _core.Model:
        """The underlying binding object."""
        return self._core

    @property
    def n_vocab(self) -> int:
        return self._core.n_vocab

    @property
    def n_ctx_train(self) -> int:
        return self._core.n_ctx_train

    @property
    def bos(self) -> int | None:
        return self._core.bos

    @property
    def eos(self) -> int | None:
        return self._core.eos

    @property
    def add_bos(self) -> bool:
        return self._core.add_bos

    @property
    def arch(self) -> str:
        return self._core.arch

    @property
    def name(self) -> str:
        return self._core.name

    def metadata(self) -> dict[str, object]:
        return self._core.metadata()

    # -- tokenizer ----------------------------------------------------------------------------
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return self._core.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._core.detokenize(list(tokens))

    def token_to_piece(self, token: int) -> bytes:
        return self._core.token_to_piece(token)

    def is_eog(self, token: int) -> bool:
        return self._core.is_eog(token)

    # -- chat ---------------------------------------------------------------------------------
    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (see :mod:`kvserve.chat`), compiled on first use: the
        ``chat_template`` given at load, else the GGUF's ``tokenizer.chat_template``, else
        ChatML. A template that does not compile is a ``ValueError``."""
        if self._chat_template is None:
            from .chat import ChatTemplate

            source = self._chat_template_source
            if source is None:
                meta = self._core.metadata().get("tokenizer.chat_template")
                source = meta if isinstance(meta, str) and meta else None

            def text(tok: int | None) -> str:
                return "" if tok is None else self._core.token_to_piece(tok, True).decode()

            add_eos = self._core.metadata().get("tokenizer.ggml.add_eos_token") is True
            self._chat_template = ChatTemplate(
                source,
                bos_token=text(self.bos),
                eos_token=text(self.eos),
                add_bos=self.add_bos,
                add_eos=add_eos,
            )
        return self._chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` as llama.cpp's ``llama-server`` builds it (its
        ``/apply-template``): the chat template's output, less a leading BOS text that the
        tokenizer adds anyway. ``tools``: OpenAI function tools the chat offers (see
        :mod:`kvserve.tools`). Bad messages and template errors are ``ValueError``."""
        return self.chat_template.prompt(messages, add_generation_prompt, tools)

    def tokenize_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        special_in_content: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids a chat prompt feeds the model: :meth:`apply_chat_template`'s text
        tokenized as generation tokenizes prompts (the model's BOS rule), so the ids hold
        exactly one BOS when the model uses one.

        Message content is text: special-token text inside it (``<|im_end|>`` written by a
        user) is tokenized as plain text, and only the template's own markup becomes special
        tokens, so no message can forge a role. A prompt whose content holds no special-token
        text gives exactly the ids of the whole text (as llama.cpp's server tokenizes it);
        one whose content does is tokenized in pieces (markup, content, markup, ...), and a
        template that does not print such content verbatim is a ``ValueError``.
        ``special_in_content=True`` parses special-token text everywhere (llama.cpp's
        behaviour; for trusted input only). Other text fields of a message (``role``,
        ``name``, tool calls, ``tools``) become the template's markup, so without
        ``special_in_content`` one that holds special-token text is a ``ValueError``."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools=tools)
        if not special_in_content:
            self._check_markup_fields(messages, tools)
        if special_in_content or not self.content_has_special(messages):
            return prompt_ids(self, text)
        segments = self.chat_template.segments(messages, add_generation_prompt, tools)
        if segments is None:
            raise ValueError(
                "a message's content holds special-token text, and this chat template does not"
                " print message content verbatim, so it cannot be kept apart from the template's"
                " markup (pass special_in_content=True only for trusted input)"
            )
        ids: list[int] = []
        for k, (piece, is_content) in enumerate(segments):
            ids += self.tokenize(piece, add_special=k == 0, parse_special=not is_content)
        if not ids:
            return prompt_ids(self, text)
        return ids

    def _has_special(self, text: str) -> bool:
        return bool(text) and self.tokenize(text, False, True) != self.tokenize(text, False, False)

    def _check_markup_fields(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """``ValueError`` for a message text field other than content (the template prints
        it as markup: a role, a name, a tool call) or a tool that holds special-token text."""
        for i, m in enumerate(messages):
            for key, value in m.items():
                if key == "content" or value is None:
                    continue
                if not isinstance(value, str):
                    value = json.dumps(value, ensure_ascii=False, default=str)
                if self._has_special(value):
                    raise ValueError(
                        f"messages[{i}].{key} holds special-token text (only content may, and"
                        " it is read as plain text)"
                    )
        for i, tool in enumerate(tools or ()):
            if self._has_special(json.dumps(tool, ensure_ascii=False, default=str)):
                raise ValueError(f"tools[{i}] holds special-token text")

    def content_has_special(self, messages: Sequence[Message]) -> bool:
        """Whether some message's content (any text part) holds special-token text: text that
        tokenizes differently when special tokens are parsed."""
        from .chat import check_messages

        for m in check_messages(messages):
            content = m["content"]
            if content is None:
                continue
            texts = [content] if isinstance(content, str) else [p["text"] for p in content]
            for t in texts:
                if t and self.tokenize(t, False, True) != self.tokenize(t, False, False):
                    return True
        return False

    def new_context(
        self,
        n_ctx: int = 4096,
        kv_type: str = "f16",
        kv_memory: int | None = None,
        n_seq_max: int = 1,
        n_batch: int = PROMPT_BATCH,
    ) -> _core.Context:
        """A decoding context holding at most ``n_ctx`` tokens; ``kv_type`` is "f16", "q8_0"
        (half the memory) or "f32". Every context of a model (and of one ``kv_type``) shares one
        block pool and one prefix index: a prefix one context computed is found by the next, and
        one memory budget covers them all. The pool is made on first use, for ``kv_memory``
        bytes if given, else for ``max(n_ctx, 4096)`` tokens. On a model with sliding-window
        layers (Gemma 3) their memory is sized for ``n_seq_max`` sequences decoded at once and
        batches of at most ``n_batch`` tokens (a larger ``decode`` raises ``ValueError``)."""
        return self._core.new_context(
            n_ctx, kv_type=kv_type, kv_memory=kv_memory, n_seq_max=n_seq_max, n_batch=n_batch
        )

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        *,
        n_ctx: int | None = None,
        kv_type: str = "f16",
        **options: Unpack[SamplingOptions],
    ) -> GenerateResult:
        """Complete ``prompt``; see the module docs for when generation ends and
        :class:`kvserve.options.SamplingOptions` for ``options``."""
        return _Run(self, prompt, max_tokens, n_ctx, kv_type, options).result()

    def stream(
        self,
        prompt: str,
        max_tokens: int = 128,
        *,
        n_ctx: int | None = None,
        kv_type: str = "f16",
        **options: Unpack[SamplingOptions],
    ) -> Iterator[str]:
        """Like :meth:`generate`, yielding text pieces (complete characters) as they come."""
        yield from _Run(self, prompt, max_tokens, n_ctx, kv_type, options)

    def chat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        *,
        n_ctx: int | None = None,
        kv_type: str = "f16",
        **options: Unpack[SamplingOptions],
    ) -> GenerateResult:
        """Reply to ``messages`` (the chat template with the generation prompt, then
        :meth:`generate` from :meth:`tokenize_chat`'s ids); the result holds the reply only."""
        ids = self.tokenize_chat(messages)
        return _Run(self, ids, max_tokens, n_ctx, kv_type, options).result()


def _last_row(logits: _core.Logits) -> npt.NDArray[np.float32]:
    # memoryview(): numpy's stubs do not accept buffer-protocol objects directly; no copy.
    view = np.frombuffer(memoryview(logits), dtype=np.float32)
    row: npt.NDArray[np.float32] = view.reshape(logits.n_rows, logits.n_vocab)[-1]
    return row


class _Run:
    """One generation: iterate for text pieces; ``tokens``/``finish_reason`` fill in as it runs."""

    def __init__(
        self,
        model: Model,
        prompt: str | list[int],
        max_tokens: int,
        n_ctx: int | None,
        kv_type: str,
        options: SamplingOptions,
    ) -> None:
        self.kv_type = kv_type
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if n_ctx is not None and n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.model = model
        opts = resolve(options, n_vocab=model.n_vocab)
        self.sampler = opts.sampler
        self.n_logprobs = opts.logprobs
        self.stops = opts.stops
        self.ignore_eos = opts.ignore_eos
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_ids(model, prompt) if isinstance(prompt, str) else prompt
        n_prompt = len(self.prompt_tokens)
        limit = model.n_ctx_train if model.n_ctx_train > 0 else 4096
        self.n_ctx = n_ctx if n_ctx is not None else min(limit, n_prompt + max(max_tokens, 1))
        if n_prompt > self.n_ctx:
            raise KvCacheFull(
                f"the prompt has {n_prompt} tokens but the context holds {self.n_ctx}"
            )
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if opts.logprobs is None else []
        self.finish_reason = FINISH_LENGTH
        self.cached_tokens = 0
        self.end_logprob: TokenLogprob | None = None

    def result(self) -> GenerateResult:
        """Runs the generation to its end."""
        text = "".join(self)
        return GenerateResult(
            text=text,
            tokens=self.tokens,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_tokens),
            cached_tokens=self.cached_tokens,
            logprobs=self.logprobs,
            end_logprob=self.end_logprob,
        )

    def _token_ids(self) -> Generator[int, None, None]:
        if self.max_tokens == 0:
            self.finish_reason = FINISH_LENGTH
            return
        ctx = self.model.new_context(self.n_ctx, kv_type=self.kv_type)
        toks = self.prompt_tokens
        n = len(toks)
        # Whole blocks of the prompt that an earlier request on this model computed are reused.
        m = self.cached_tokens = ctx.match_prefix(0, toks)
        # In batches of at most PROMPT_BATCH tokens (the context's n_batch); logits of the last.
        for i in range(m, n, PROMPT_BATCH):
            j = min(i + PROMPT_BATCH, n)
            k = j - i
            logits = ctx.decode(toks[i:j], list(range(i, j)), [0] * k, [False] * (k - 1) + [j == n])
        pos = n
        is_eog = self.model.is_eog
        history = list(toks)  # the penalties' history: prompt, then generated tokens
        while True:
            row = _last_row(logits)
            tok = self.sampler(row, history)
            entry = None
            if self.n_logprobs is not None:
                entry = token_logprob(self.model, row, tok, self.n_logprobs)
            if is_eog(tok) and not self.ignore_eos:
                self.finish_reason = FINISH_STOP
                self.end_logprob = entry
                return
            if self.logprobs is not None and entry is not None:
                self.logprobs.append(entry)
            self.tokens.append(tok)
            history.append(tok)
            yield tok
            if len(self.tokens) >= self.max_tokens:
                self.finish_reason = FINISH_LENGTH
                return
            if pos >= ctx.n_ctx:
                self.finish_reason = FINISH_CONTEXT
                return
            logits = ctx.decode([tok], [pos], [0], [True])
            pos += 1

    def __iter__(self) -> Iterator[str]:
        text = TextStream(self.stops)
        ids = self._token_ids()
        for tok in ids:
            out = text.push(self.model.token_to_piece(tok))
            if out:
                yield out
            if text.stopped:
                self.finish_reason = FINISH_STOP
                ids.close()
                return
        out = text.finish()
        if out:
            yield out
        if text.stopped:
            self.finish_reason = FINISH_STOP


_default_lock = threading.Lock()
_default_model: Model | None = None


def generate(
    prompt: str,
    *,
    model: Model | StrPath | None = None,
    max_tokens: int = 128,
    **options: Unpack[SamplingOptions],
) -> GenerateResult:
    """Complete ``prompt`` with ``model`` (a :class:`Model`, a path, or None for the default
    model, which is loaded once and kept); ``options`` as :meth:`Model.generate`."""
    global _default_model
    if model is None:
        with _default_lock:
            if _default_model is None:
                _default_model = Model.load()
            m = _default_model
    elif isinstance(model, Model):
        m = model
    else:
        m = Model(model)
    return m.generate(prompt, max_tokens, **options)
