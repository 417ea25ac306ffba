"""The request bodies of the HTTP API, as pydantic models (OpenAI's names and shapes).

The models check *types and shapes* strictly (``"0.5"`` is not a number, ``true`` is not an
integer, an unknown field is an error: a field this server does not implement, and that would
change the output, is refused rather than ignored). A ``null`` is the field's default, as in
OpenAI's API (``"stream": null`` is ``false``). Standard fields that change nothing here are
accepted and ignored: ``store``, ``metadata``, ``service_tier``, ``reasoning_effort``,
``user`` (and ``parallel_tool_calls`` on the completions route), and on an assistant message of
a history ``refusal`` and ``annotations`` (what the official client's ``model_dump()`` of a
reply carries). Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages in a history) are shaped here and checked in depth by
:mod:`kvserve.tools`. *Ranges* of the sampling options (``temperature >= 0``, ``top_p`` in
(0, 1], ...) are checked once, by :func:`kvserve.options.resolve`, when the request is built;
only limits that belong to the HTTP API itself (``n``, ``max_tokens``, ``priority``) are
declared here.

This module has no ``from __future__ import annotations``: pydantic evaluates the annotations
at class creation (``X | None`` works there from Python 3.10, kvserve's floor).
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from ..options import MAX_CACHE_SALT_CHARS, PRIORITY_MAX, PRIORITY_MIN

__all__ = [
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "SESSION_ID",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "MAX_N",
    "ResponseFunctionCall",
    "ResponseFunctionCallOutput",
    "ResponseInputItem",
    "ResponseInputMessage",
    "ResponseRequest",
    "RestoreRequest",
    "StreamOptions",
    "TemplateRequest",
    "TokenizeRequest",
]

# The most choices one request may ask for (each is a sequence in the engine).
MAX_N = 64

# The range of a request's ``priority`` (higher is admitted first and preempted last) is the
# engine's (kvserve.options), checked here too so that a bad value is a 400 naming ``priority``.

# A session id: also the name of its file in --session-dir (``<id>.kvs``), so only characters
# that are safe in a file name, never a path (no "/", no leading ".").
SESSION_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        # A field sent as null takes its default (a required one is then missing: a 400).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields of every generation route that become engine options (sampling, stop
    rules, scheduling, the cache salt): python/kvserve/server/app.py ``_OPTION_FIELDS``."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    typical_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    logit_bias: dict[str, float] | None = None
    # Context shift (llama.cpp's): None = the server's --context-shift.
    context_shift: bool | None = None
    n_keep: int | None = None
    # Scheduling: higher is admitted first and preempted last (FCFS within a priority).
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Mixed into the content keys of the request's K/V blocks (vLLM's ``cache_salt``): it
    # reuses cached prefixes only of requests of its tenant with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)


class _Generation(_Sampling):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    # Accepted and echoed back; the server serves one model whatever this names.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The conversation this request continues (kvserve.Engine sessions).
    session_id: str | None = Field(default=None, pattern=SESSION_ID)
    # Structured output (kvserve.grammar): OpenAI's response_format, llama.cpp's server's
    # grammar (GBNF; Lark too) and json_schema; at most one.
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Chat: false allows at most one tool call (kvserve.tools); completions: ignored.
    parallel_tool_calls: bool | None = None
    # OpenAI's fields that change nothing here: accepted, ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Generation):
    """``POST /v1/completions``. ``prompt``: text, a list of texts, token ids, or a list of
    token-id lists; each prompt gets ``n`` choices (index ``prompt * n + j``)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: the prompt alone, allowed with echo only (scoring a text by its prompt logprobs).
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None
    # The prompt's text before the completion's (and with logprobs its tokens' entries).
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class _FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class _ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class ChatMessage(_Body):
    # The roles OpenAI defines (a role is printed by the chat template as markup).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    # An assistant's calls, and the call a tool message answers (kvserve.tools renders them).
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    # What the official client puts on an assistant reply it hands back (model_dump()): kept
    # out of the prompt.
    refusal: str | None = None
    annotations: list[Any] | None = None


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    # Function tools (checked in depth by kvserve.tools: a 400 naming the bad part).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's limit


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``content`` to token ids; ``parse_special`` (default true, as
    llama-server): special-token text becomes special tokens, else it is plain text (as chat
    message content is); the answer says which it did."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids to text."""

    tokens: list[int]


class TemplateRequest(_Body):
    """``POST /apply-template``: the prompt text the chat template makes of ``messages``
    (offering ``tools``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class RestoreRequest(_Body):
    """``POST /v1/sessions/restore``: load ``<id>.kvs`` from --session-dir, as ``session_id``
    (default: ``id``)."""

    id: str = Field(pattern=SESSION_ID)
    session_id: str | None = Field(default=None, pattern=SESSION_ID)


# -- the Responses API (POST /v1/responses; python/kvserve/server/responses.py) ---------------

# Input item types of the Responses API that this server does not take: custom tools' calls
# and their outputs (it has function tools only).
_CUSTOM_TOOL_ITEMS = frozenset({"custom_tool_call", "custom_tool_call_output"})
# Content part types that are not text (this server serves text models).
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


def _no_media(content: Any) -> None:
    # A part type that is valid in OpenAI's API but not here gets a message that says why.
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ValueError(f"{kind} content is not supported (text models only)")


class _ResponseContentPart(_Body):
    # input_text in a user/system/developer message; output_text in an assistant message
    # handed back (the client's model_dump() of a previous output carries annotations and
    # logprobs, which change nothing).
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class ResponseInputMessage(_Body):
    """A message item of a Responses ``input``: OpenAI's easy input message (``role`` and
    ``content``, ``type`` optional) or an output message of a previous response handed back
    (``id``, ``status``, ``phase``: accepted, ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_ResponseContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_messages_only(cls, data: Any) -> Any:
        # The item types that are valid in OpenAI's API but not here get a message that says
        # why (a plain "unexpected value" would read like a client bug). Items of other types
        # come here (the input's discriminator: ``_input_kind``) to be refused.
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if kind in _CUSTOM_TOOL_ITEMS:
            raise ValueError(f"{kind} items are not supported (function tools only)")
        if kind is not None and kind != "message":
            raise ValueError(
                "only message, function_call and function_call_output items are supported,"
                f" not {kind!r} items"
            )
        _no_media(data.get("content"))
        return data


class ResponseFunctionCall(_Body):
    """A ``function_call`` item of a Responses ``input``: a call the model made (a previous
    response's output item handed back, or the client's own), rendered as an assistant
    message's tool call. ``id`` and ``status`` are accepted and ignored."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponseFunctionCallOutput(_Body):
    """A ``function_call_output`` item of a Responses ``input``: the result of the call
    ``call_id`` (text, or a list of text parts), rendered as a ``tool`` message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[_ResponseContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _no_media(data.get("output"))
        return data


def _input_kind(item: Any) -> str:
    # The member of ResponseInputItem an item is validated as: its ``type`` (a message when
    # it has none); any other type goes to the message, which refuses it with a reason.
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in ("function_call", "function_call_output") else "message"


ResponseInputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("message")]
    | Annotated[ResponseFunctionCall, Tag("function_call")]
    | Annotated[ResponseFunctionCallOutput, Tag("function_call_output")],
    Discriminator(_input_kind),
]


class ResponseText(_Body):
    """``text`` of a Responses request: ``format`` (``text``, ``json_object``, ``json_schema``:
    see ``engine_format`` in python/kvserve/server/responses.py) and ``verbosity``
    (ignored)."""

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseStreamOptions(_Body):
    include_obfuscation: bool | None = None  # OpenAI's padding of deltas: nothing here


class ResponseRequest(_Sampling):
    """``POST /v1/responses``: ``input`` is a string (one user message) or a list of items
    (messages, function calls and their outputs); ``instructions`` a system message for this
    response only; ``previous_response_id`` continues a stored response's conversation
    (python/kvserve/server/responses.py)."""

    model: str | None = None
    input: list[ResponseInputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: ResponseText | None = None
    # Function tools, in the Responses API's flat shape (checked in depth by kvserve.tools: a
    # 400 naming the bad part).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's fields that change nothing here: accepted, ignored (max_tool_calls counts
    # built-in tools' calls, which this server has none of).
    max_tool_calls: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless they change nothing (a 400 naming them): no background mode, no logprobs
    # on this route yet.
    background: bool | None = None
    top_logprobs: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_one_user_message(cls, v: Any) -> Any:
        # A string is one user message (OpenAI's rule). Done before validation so that a bad
        # item is reported at its own place, not as "must be one of str, list".
        return [{"role": "user", "content": v}] if isinstance(v, str) else v
