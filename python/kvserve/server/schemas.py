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
at class creation. It spells unions with ``Optional``/``Union``, written when Python 3.9 was
supported (``X | None`` fails there at run time); from 3.10, kvserve's floor, both spellings
work.
"""

from typing import Annotated, Any, Literal, Optional, Union

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

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    ignore_eos: bool = False
    typical_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repeat_last_n: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    # Context shift (llama.cpp's): None = the server's --context-shift.
    context_shift: Optional[bool] = None
    n_keep: Optional[int] = None
    # Scheduling: higher is admitted first and preempted last (FCFS within a priority).
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Mixed into the content keys of the request's K/V blocks (vLLM's ``cache_salt``): it
    # reuses cached prefixes only of requests of its tenant with the same salt.
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)


class _Generation(_Sampling):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    # Accepted and echoed back; the server serves one model whatever this names.
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # The conversation this request continues (kvserve.Engine sessions).
    session_id: Optional[str] = Field(default=None, pattern=SESSION_ID)
    # Structured output (kvserve.grammar): OpenAI's response_format, llama.cpp's server's
    # grammar (GBNF; Lark too) and json_schema; at most one.
    response_format: Optional[dict[str, Any]] = None
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    # Chat: false allows at most one tool call (kvserve.tools); completions: ignored.
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's fields that change nothing here: accepted, ignored.
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None


class CompletionRequest(_Generation):
    """``POST /v1/completions``. ``prompt``: text, a list of texts, token ids, or a list of
    token-id lists; each prompt gets ``n`` choices (index ``prompt * n + j``)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    # 0: the prompt alone, allowed with echo only (scoring a text by its prompt logprobs).
    max_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[int] = None
    # The prompt's text before the completion's (and with logprobs its tokens' entries).
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


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
    content: Union[str, list[_TextPart], None] = None
    name: Optional[str] = None
    # An assistant's calls, and the call a tool message answers (kvserve.tools renders them).
    tool_calls: Optional[list[_ToolCall]] = None
    tool_call_id: Optional[str] = None
    # What the official client puts on an assistant reply it hands back (model_dump()): kept
    # out of the prompt.
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    # Function tools (checked in depth by kvserve.tools: a 400 naming the bad part).
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # OpenAI's limit


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
    tools: Optional[list[dict[str, Any]]] = None


class RestoreRequest(_Body):
    """``POST /v1/sessions/restore``: load ``<id>.kvs`` from --session-dir, as ``session_id``
    (default: ``id``)."""

    id: str = Field(pattern=SESSION_ID)
    session_id: Optional[str] = Field(default=None, pattern=SESSION_ID)


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
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None


class ResponseInputMessage(_Body):
    """A message item of a Responses ``input``: OpenAI's easy input message (``role`` and
    ``content``, ``type`` optional) or an output message of a previous response handed back
    (``id``, ``status``, ``phase``: accepted, ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[_ResponseContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[str] = None

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
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ResponseFunctionCallOutput(_Body):
    """A ``function_call_output`` item of a Responses ``input``: the result of the call
    ``call_id`` (text, or a list of text parts), rendered as a ``tool`` message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[_ResponseContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

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
    Union[
        Annotated[ResponseInputMessage, Tag("message")],
        Annotated[ResponseFunctionCall, Tag("function_call")],
        Annotated[ResponseFunctionCallOutput, Tag("function_call_output")],
    ],
    Discriminator(_input_kind),
]


class ResponseText(_Body):
    """``text`` of a Responses request: ``format`` (``text``, ``json_object``, ``json_schema``:
    see ``engine_format`` in python/kvserve/server/responses.py) and ``verbosity``
    (ignored)."""

    format: Optional[dict[str, Any]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponseStreamOptions(_Body):
    include_obfuscation: Optional[bool] = None  # OpenAI's padding of deltas: nothing here


class ResponseRequest(_Sampling):
    """``POST /v1/responses``: ``input`` is a string (one user message) or a list of items
    (messages, function calls and their outputs); ``instructions`` a system message for this
    response only; ``previous_response_id`` continues a stored response's conversation
    (python/kvserve/server/responses.py)."""

    model: Optional[str] = None
    input: list[ResponseInputItem] = Field(min_length=1)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    stream: bool = False
    stream_options: Optional[ResponseStreamOptions] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    text: Optional[ResponseText] = None
    # Function tools, in the Responses API's flat shape (checked in depth by kvserve.tools: a
    # 400 naming the bad part).
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's fields that change nothing here: accepted, ignored (max_tool_calls counts
    # built-in tools' calls, which this server has none of).
    max_tool_calls: Optional[int] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    service_tier: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # Refused unless they change nothing (a 400 naming them): no background mode, no logprobs
    # on this route yet.
    background: Optional[bool] = None
    top_logprobs: Optional[int] = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_one_user_message(cls, v: Any) -> Any:
        # A string is one user message (OpenAI's rule). Done before validation so that a bad
        # item is reported at its own place, not as "must be one of str, list".
        return [{"role": "user", "content": v}] if isinstance(v, str) else v
