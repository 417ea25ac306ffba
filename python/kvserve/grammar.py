"""Structured output: constraints on what a request may generate (a JSON schema, any JSON
object, a grammar), enforced token by token with llguidance.

Why llguidance (docs/STRUCTURED_OUTPUT.md has the measurements): one abi3 wheel without
dependencies; a grammar compiles in about a millisecond on both of our vocabularies (49,152 and
262,144 tokens) where outlines-core builds an index per schema up front (53 ms and 1.8 s, plus
15 s for Gemma's vocabulary); its masks take tens of microseconds a token; xgrammar's wheel
requires torch.

How a constraint works in the engine (:mod:`kvserve.engine.loop`):

- A request's constraint is checked and compiled when the request is built
  (:meth:`Grammars.matcher`): a bad schema or grammar is a :class:`GrammarError` (a
  ``ValueError``) naming the problem, before anything is queued. Compiled grammars are cached by
  content (an LRU of :data:`CACHE_SIZE`); each request gets its own matcher (a copy).
- Each step, the masks of the constrained rows are computed on a helper thread while the
  forward pass runs (the core releases the GIL; so does llguidance), then applied to the
  request's logits row before its sampler: forbidden tokens get ``-inf``. Constrained and free
  requests share a batch; a free request pays nothing.
- The sampled token advances the matcher. When the grammar can take no more tokens the request
  finishes (``stop``); an end-of-generation token is allowed exactly where the grammar may end.
  Running out of ``max_tokens`` first gives ``length`` with the text as far as it got (as
  OpenAI's API does).
- Log-probabilities stay those of the model's own distribution (the raw logits), as everywhere
  in kvserve.

Bounds: a schema or grammar of at most :data:`MAX_SOURCE_CHARS` characters; llguidance's
parser limits (:data:`LIMITS`) bound the compile work and each step's mask work.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._core import Model as CoreModel
    from ._model import Model

__all__ = [
    "CACHE_SIZE",
    "MAX_SOURCE_CHARS",
    "Constraint",
    "GrammarError",
    "Grammars",
    "constraint_from",
]

# The largest schema (as JSON text) or grammar a request may send.
MAX_SOURCE_CHARS = 64 * 1024
# Compiled grammars kept per engine (by content).
CACHE_SIZE = 64
# How JSON output is laid out: one line, with Python's json.dumps separators (", " and ": ").
# Free whitespace (even bounded, as llama.cpp's JSON grammars allow up to ~20 characters at
# each place) lets a small model spend its budget on newlines and indentation between values
# instead of writing them; a fixed layout leaves it only the values to choose.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that cannot be used (invalid, unsupported, or over a limit)."""


@dataclass(frozen=True)
class Constraint:
    """What a request may generate: ``kind`` (``json_object``, ``json_schema``, ``grammar``),
    the llguidance grammar (its JSON text) that enforces it, and the request field it came
    from (named by errors)."""

    kind: str
    source: str
    what: str

    @property
    def key(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a dependency of kvserve: missing only from a broken install
        raise GrammarError(
            f"structured output needs the llguidance package: pip install llguidance ({e})"
        ) from None
    return llguidance


def _schema_text(schema: object, what: str) -> str:
    if isinstance(schema, str):
        text = schema
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    else:
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{what} is not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    if len(text) > MAX_SOURCE_CHARS:
        raise GrammarError(
            f"{what} has {len(text)} characters of JSON, more than the limit {MAX_SOURCE_CHARS}"
        )
    return text


def _json(schema_text: str, what: str, lenient: bool) -> str:
    llg = _llguidance()
    options = {**JSON_OPTIONS, "lenient": lenient}
    try:
        return str(llg.LLMatcher.grammar_from_json_schema(schema_text, defaults=options))
    except Exception as e:  # ValueError, or whatever else bad input makes of it
        raise GrammarError(f"{what}: {e}") from None


def constraint_from(
    response_format: Mapping[str, Any] | None = None,
    grammar: str | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
) -> Constraint | None:
    """The constraint a request asks for, or None (free text). At most one of:

    - ``response_format``: OpenAI's ``{"type": "text"}`` (none), ``{"type": "json_object"}``
      (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
      {...}, "strict": bool}}``; llama.cpp's server's ``{"type": "json_object", "schema":
      {...}}`` and ``{"type": "json_schema", "schema": {...}}`` too. ``strict`` (default
      false): true refuses a schema keyword that cannot be enforced, false ignores it.
    - ``grammar``: a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's);
    - ``json_schema``: a schema (llama.cpp's server field).

    Raises :class:`GrammarError` naming the problem; the grammar itself is compiled (and
    checked in depth) by :meth:`Grammars.matcher`."""
    given = [
        n for n, v in (("response_format", response_format), ("grammar", grammar)) if v is not None
    ]
    if json_schema is not None:
        given.append("json_schema")
    if len(given) > 1:
        raise GrammarError(f"send at most one of {', '.join(given)}")
    if json_schema is not None:
        text = _schema_text(json_schema, "json_schema")
        return Constraint("json_schema", _json(text, "json_schema", lenient=False), "json_schema")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("grammar must be a non-empty string (Lark or GBNF)")
        if len(grammar) > MAX_SOURCE_CHARS:
            raise GrammarError(
                f"grammar has {len(grammar)} characters, more than the limit {MAX_SOURCE_CHARS}"
            )
        llg = _llguidance()
        try:
            return Constraint("grammar", str(llg.grammar_from("grammar", grammar)), "grammar")
        except Exception as e:  # the GBNF converter is Python code: any error is bad input
            raise GrammarError(f"grammar: {e}") from None
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        what = "response_format.schema"
        text = '{"type": "object"}' if schema is None else _schema_text(schema, what)
        return Constraint("json_object", _json(text, what, lenient=False), what)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None and "schema" in response_format:
            spec = {"schema": response_format["schema"]}
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        if schema is None:  # OpenAI: a schema-less json_schema is any JSON object
            schema = {"type": "object"}
        what = "response_format.json_schema.schema"
        text = _schema_text(schema, what)
        return Constraint("json_schema", _json(text, what, lenient=not strict), what)
    raise GrammarError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


class Grammars:
    """A model's compiled grammars: the vocabulary as llguidance sees it (built once, on the
    first constrained request: ~0.1 s for 49k tokens, ~1.3 s for 262k) and an LRU of compiled
    grammars by content. Thread-safe."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)
        self.hits = 0  # cache hits
        self.compile_seconds = 0.0

    def tokenizer(self) -> Any:
        """The llguidance tokenizer of the model's vocabulary (built once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _build_tokenizer(self.model.core)
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for ``constraint`` (compiled once per content); ``GrammarError``
        when the grammar is invalid or over llguidance's limits."""
        key = constraint.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if template is None:
            llg = _llguidance()
            tk = self.tokenizer()
            t0 = time.perf_counter()
            # Drops the GIL while it builds the grammar; never raises for grammar errors (they
            # are its error state), but a surprise is still the request's fault, not ours.
            try:
                template = llg.LLMatcher(tk, constraint.source, log_level=0)
            except Exception as e:
                raise GrammarError(f"{constraint.what}: {e}") from None
            dt = time.perf_counter() - t0
            if template.is_error():
                raise GrammarError(f"{constraint.what}: {template.get_error()}")
            with self._lock:
                self.compiles += 1
                self.compile_seconds += dt
                self._cache[key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()


def _build_tokenizer(model: CoreModel) -> Any:
    """llguidance's view of the vocabulary: each token's bytes (control and user-defined
    tokens as ``0xFF`` + their text, llguidance's mark for special tokens), every
    end-of-generation token as an EOS, and the model's own tokenizer for text."""
    llg = _llguidance()
    tokens: list[bytes] = []
    special: list[int] = []
    for i in range(model.n_vocab):
        plain = model.token_to_piece(i, False)
        if not plain:
            text = model.token_to_piece(i, True)
            if text:
                special.append(i)
                plain = b"\xff" + text
        tokens.append(plain)
    eog = [i for i in special if model.is_eog(i)]
    eos = model.eos
    if eos is not None and eos not in eog:
        eog.append(eos)
    if not eog:
        raise GrammarError("structured output needs a model with an end-of-generation token")

    class _Vocab:
        eos_token_id = eog[0]
        bos_token_id = model.bos
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: str | bytes) -> list[int]:
            if isinstance(s, bytes):
                s = s.decode("utf-8", errors="replace")
            return model.tokenize(s, add_special=False, parse_special=False)

    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), eos_token=eog)
