"""OpenAI's Responses API (``POST /v1/responses``) on kvserve's chat path and sessions: what
the route needs besides the chat route's steps (python/kvserve/server/app.py): the input
items as chat messages (function calls and their outputs as the chat route's tool calls and
tool messages), the response object, its output items and their stream events in OpenAI's
shapes, and the store of responses that ``previous_response_id`` continues.

State model. A stored response keeps its conversation (the input messages of its whole chain
and its own reply; ``instructions`` are not part of it, as OpenAI documents) and the engine
session whose K/V holds that conversation. A follow-up renders the whole conversation again
(instructions, the previous conversation, the new input) and runs as a chat turn *in that
session*, so it computes only its new tokens: the session reuses the longest prefix of the
tokens it holds. Each session is the *head* of at most one response: the last one that
extended it (claimed when the follow-up starts). A follow-up from a response that is no
longer its session's head (a second branch from the same response, or one whose session a
later turn took) starts a session of its own: the full conversation is rendered anyway, so
the answer is the same, and the prefix cache still maps the whole blocks it shares with the
other branch. A failed or cancelled turn gives the head back (the engine keeps what the
session held before the turn).

Bounds: at most ``max_entries`` responses are stored, least recently used first out; a
session is dropped when the response that heads it leaves the store (the engine's own
limits, ``--max-sessions``, ``--session-ttl`` and the watermarks, apply as to every session).
A continued response's conversation is the same list objects as its parent's (not a copy of
their text). Responses are scoped by tenant: another tenant's id is unknown (404), as are ids
of ``store: false`` responses. The store lives on the event loop (no locks).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._model import FINISH_STOP, GenerateResult
from ..tools import ToolCall, ToolPlan
from .http import ApiError
from .schemas import ResponseFunctionCall, ResponseFunctionCallOutput, ResponseRequest

__all__ = [
    "EventWriter",
    "ReplyItems",
    "ResponseStore",
    "StoredResponse",
    "engine_format",
    "input_messages",
    "refuse_unsupported",
    "reply_status",
    "response_object",
]


@dataclass
class StoredResponse:
    """A response that ``previous_response_id`` may continue and ``GET`` may read."""

    id: str
    tenant: str | None  # its tenant (None: the server has no tenants)
    conversation: tuple[dict[str, Any], ...]  # chat messages, its own reply last
    session: str | None  # the engine's id of the session that ran it
    cache_salt: str | None  # what its prefix keys were salted with
    body: dict[str, Any]  # the response object


class ResponseStore:
    """The stored responses (least recently used out past ``max_entries``) and each
    session's head. Event loop only."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.heads: dict[str, str] = {}  # engine session id -> the response its K/V holds

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The tenant's stored response ``response_id`` (None: unknown, or another
        tenant's); it becomes the most recently used."""
        entry = self.entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self.entries.move_to_end(response_id)
        return entry

    def claim(
        self, response_id: str, previous: StoredResponse | None, cache_salt: str | None, fresh: str
    ) -> str:
        """The session the new response ``response_id`` runs in, claimed for it at once:
        ``previous``'s session when that still holds ``previous``'s conversation (and the
        prefix keys are salted alike), else ``fresh`` (a new session)."""
        session = fresh
        if (
            previous is not None
            and previous.session is not None
            and self.heads.get(previous.session) == previous.id
            and previous.cache_salt == cache_salt
        ):
            session = previous.session
        self.heads[session] = response_id
        return session

    def release(self, response_id: str, session: str, previous: StoredResponse | None) -> list[str]:
        """``response_id`` failed or was cancelled in ``session``: the session heads
        ``previous`` again when it continued it (the engine keeps what the session held
        before a failed turn). Returns the sessions to drop (one no stored response heads)."""
        if self.heads.get(session) != response_id:
            return []
        if previous is not None and previous.session == session and previous.id in self.entries:
            self.heads[session] = previous.id
            return []
        del self.heads[session]
        return [session]

    def put(self, entry: StoredResponse) -> list[str]:
        """Stores ``entry``; returns the sessions to drop: those of the responses that left
        the store to make room, when they headed them."""
        self.entries[entry.id] = entry
        self.entries.move_to_end(entry.id)
        dropped: list[str] = []
        while len(self.entries) > self.max_entries:
            _, old = self.entries.popitem(last=False)
            dropped += self._unhead(old)
        return dropped

    def delete(self, response_id: str, tenant: str | None) -> list[str] | None:
        """Forgets the tenant's response ``response_id``; returns the sessions to drop (None:
        no such response)."""
        if self.get(response_id, tenant) is None:
            return None
        return self._unhead(self.entries.pop(response_id))

    def _unhead(self, entry: StoredResponse) -> list[str]:
        if entry.session is not None and self.heads.get(entry.session) == entry.id:
            del self.heads[entry.session]
            return [entry.session]
        return []


# -- the request ---------------------------------------------------------------------------------


def refuse_unsupported(body: ResponseRequest) -> None:
    """A 400 naming each field whose value would change the output in a way this server does
    not implement (fields that change nothing are accepted: python/kvserve/server/schemas.py)."""
    if body.background:
        raise _unsupported("background", "background mode is not supported")
    if body.top_logprobs:
        raise _unsupported("top_logprobs", "top_logprobs is not supported on /v1/responses yet")
    if body.include and "message.output_text.logprobs" in body.include:
        raise _unsupported("include", "message.output_text.logprobs is not supported yet")


def engine_format(body: ResponseRequest) -> dict[str, Any]:
    """The engine options for ``text.format``: the one place that maps it. The Responses API
    spells a schema flat (``{"type": "json_schema", "name", "schema", "strict"}``); the engine
    takes chat's ``response_format`` shape (kvserve.grammar)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    raise ApiError(
        400,
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}",
        param="text.format.type",
        code="invalid_value",
    )


def format_error(error: ApiError) -> ApiError:
    """An error the engine raised about ``response_format`` (what :func:`engine_format`
    made of ``text.format``), named as the Responses request's field."""
    if error.param is None or not error.param.startswith("response_format"):
        return error
    param = "text.format" + error.param.removeprefix("response_format").replace(
        ".json_schema", "", 1
    )
    message = error.message.replace(error.param, param, 1)
    return ApiError(error.status, message, param=param, code=error.code, headers=error.headers)


def _unsupported(field: str, message: str) -> ApiError:
    return ApiError(400, message, param=field, code="unsupported_parameter")


def input_messages(body: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (what ``/v1/chat/completions`` takes):
    string content stays a string, text parts become chat text parts; ``function_call``
    items become an assistant message's ``tool_calls`` (joining the assistant message just
    before them: a reply's text and calls are one chat message, as the chat route answers
    them) and each ``function_call_output`` a ``tool`` message."""
    out: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, ResponseFunctionCall):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None, "tool_calls": []}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, ResponseFunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _chat_content(item.output)})  # fmt: skip
        else:
            out.append({"role": item.role, "content": _chat_content(item.content)})
    return out


def _chat_content(content: str | list[Any]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


# -- the response ----------------------------------------------------------------------------------

# A stream event before it is numbered: its type and its fields.
Event = tuple[str, dict[str, Any]]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ReplyItems:
    """The ``output`` items of one reply and their stream events, built from the reply's
    pieces in the order they come (content text and whole :class:`kvserve.tools.ToolCall`
    items, as :class:`kvserve.tools.ToolCallParser` gives them), so that a streamed response
    and a whole one have the same items: one ``message`` item with one ``output_text`` part
    holding all the content, and one ``function_call`` item per call, each at the output
    index where it first came. Without tools (``parsing`` false) the message item opens at
    once; with tools it opens with the first content, and a reply that is only calls has
    none (a reply with neither has an empty one)."""

    def __init__(self, response_id: str, parsing: bool) -> None:
        suffix = response_id[len("resp_") :]
        self.message_id = f"msg_{suffix}"
        self.call_prefix = f"fc_{suffix}_"
        self.parsing = parsing
        self.output: list[dict[str, Any]] = []  # the items so far, by output index
        self.message_index: int | None = None  # the message item's, once it is open
        self.text = ""
        self.calls: list[ToolCall] = []

    def start(self) -> list[Event]:
        """The events that open the reply: the message item's, without tools."""
        return [] if self.parsing else self._open_message()

    def add(self, pieces: Sequence[str | ToolCall]) -> list[Event]:
        """Adds pieces of the reply; returns their events."""
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                events += self._call(piece)
                continue
            if not piece:
                continue
            if self.message_index is None:
                events += self._open_message()
            self.text += piece
            events.append(("response.output_text.delta", {**self._at(), "delta": piece,
                                                          "logprobs": []}))  # fmt: skip
        return events

    def close(self, status: str) -> list[Event]:
        """Ends the reply with ``status`` (the response's: the message item's too); returns
        the message item's closing events (opening it first when there is neither content
        nor a call)."""
        events: list[Event] = []
        if self.message_index is None and not self.calls:
            events += self._open_message()
        if self.message_index is None:
            return events
        item = _message_item(self.message_id, self.text, status)
        self.output[self.message_index] = item
        part = _text_part(self.text)
        events.append(("response.output_text.done", {**self._at(), "text": self.text,
                                                     "logprobs": []}))  # fmt: skip
        events.append(("response.content_part.done", {**self._at(), "part": part}))
        events.append(("response.output_item.done", {"output_index": self.message_index,
                                                     "item": item}))  # fmt: skip
        return events

    def chat_message(self) -> dict[str, Any]:
        """The reply as the assistant message of a chat history (what the chat route
        answers: content None when the reply is only calls)."""
        content = None if self.message_index is None else self.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        return message

    def _open_message(self) -> list[Event]:
        self.message_index = len(self.output)
        self.output.append(_message_item(self.message_id, None, "in_progress"))
        added = {"output_index": self.message_index, "item": self.output[-1]}
        return [
            ("response.output_item.added", added),
            ("response.content_part.added", {**self._at(), "part": _text_part("")}),
        ]

    def _call(self, call: ToolCall) -> list[Event]:
        index = len(self.output)
        item_id = f"{self.call_prefix}{len(self.calls)}"
        self.calls.append(call)
        item = {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}  # fmt: skip
        self.output.append(item)
        at = {"item_id": item_id, "output_index": index}
        started = {**item, "arguments": "", "status": "in_progress"}
        return [
            ("response.output_item.added", {"output_index": index, "item": started}),
            ("response.function_call_arguments.delta", {**at, "delta": call.arguments}),
            ("response.function_call_arguments.done", {**at, "arguments": call.arguments}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self.message_index,
                "content_index": 0}  # fmt: skip


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def reply_status(result: GenerateResult) -> str:
    """A finished reply's status: ``completed``, or ``incomplete`` (it stopped at
    ``max_output_tokens`` or at a full context)."""
    return "completed" if result.finish_reason == FINISH_STOP else "incomplete"


def _tools_echo(plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The request's tools as the response shows them (the SDK's ``FunctionTool``: flat,
    whichever shape they were sent in)."""
    if plan is None:
        return []
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": t.strict} for t in plan.tools]  # fmt: skip


def _tool_choice_echo(body: ResponseRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, dict):  # a named function (kvserve.tools checked it), flat
        fn = choice.get("function", choice)
        return {"type": "function", "name": fn["name"]}
    return "auto" if choice is None else choice


def response_object(
    body: ResponseRequest,
    response_id: str,
    model: str,
    created_at: int,
    *,
    plan: ToolPlan | None = None,
    status: str | None = None,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, int] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object (what the SDK's ``Response`` parses): ``in_progress`` without a
    ``status``, ``failed`` with an ``error``, else ``status`` (:func:`reply_status`) with the
    reply's ``output`` items (:class:`ReplyItems`). ``usage`` (the chat route's counts:
    prompt, cached, session-cached and completion tokens) comes with the output; ``plan``
    (the request's tools) is echoed."""
    incomplete = None
    if error is not None:
        status, output = "failed", None
    elif status is None:
        status, output = "in_progress", None
    elif status == "incomplete":
        incomplete = {"reason": "max_output_tokens"}
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": output or [],
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.store,
        "temperature": 0.0 if body.temperature is None else body.temperature,  # greedy default
        "text": {"format": {"type": "text"}},
        "tool_choice": _tool_choice_echo(body),
        "tools": _tools_echo(plan),
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
    }
    if usage is not None:
        obj["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["cached_tokens"],
                "cache_write_tokens": 0,
                # kvserve's own: the part of cached_tokens the response's session held.
                "session_cached_tokens": usage["session_cached_tokens"],
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        }
    return obj


def failure(error: ApiError) -> dict[str, Any]:
    """A response's ``error`` for a request that failed after it was queued: OpenAI's codes
    are a closed set, so a request fault (4xx) is ``invalid_prompt`` and any other
    ``server_error``; kvserve's own code goes in ``type``."""
    code = "invalid_prompt" if error.status < 500 else "server_error"
    return {"code": code, "message": error.message, "param": error.param, "type": error.code}


class EventWriter:
    """The Responses API's server-sent events of one response, numbered in order
    (``sequence_number``): ``event: <type>`` and ``data: <event object>``; the output items'
    events come from :class:`ReplyItems`."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def events(self, events: list[Event]) -> Iterator[bytes]:
        for kind, fields in events:
            yield self.event(kind, **fields)

    def opening(self, snapshot: dict[str, Any]) -> Iterator[bytes]:
        """``response.created`` and ``response.in_progress``."""
        yield self.event("response.created", response=snapshot)
        yield self.event("response.in_progress", response=snapshot)

    def closing(self, final: dict[str, Any]) -> bytes:
        """``response.completed`` (or ``response.incomplete``), ``final`` being the whole
        response object."""
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self.event(kind, response=final)

    def failed(self, error: ApiError, final: dict[str, Any]) -> Iterator[bytes]:
        """An ``error`` event (kvserve's code, as the other routes' errors), then
        ``response.failed`` with the failed response object."""
        yield self.event("error", code=error.code, message=error.message, param=error.param)
        yield self.event("response.failed", response=final)
