"""The Responses API (python/kvserve/server/responses.py) with the official ``openai`` client.

Oracles: ``/v1/chat/completions`` for the same conversation with greedy decoding (a response
is the chat answer to its instructions, the conversation of its previous response and its
input); the SDK's own types, validated strictly (every object and event the server sends
parses as ``Response`` / ``ResponseStreamEvent``); the engine's token counts (a follow-up's
``cached_tokens`` cover the previous conversation, held by its session)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from kvserve import Engine
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.testing import inject, live_server, session_is

MAX = 12  # max_output_tokens of the test requests


class Live:
    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def live(model_path: Path) -> Iterator[Live]:
    engine = Engine(model_path, parallel=4, ctx_size=1024)
    cfg = ServerConfig(model=str(model_path), ctx_size=1024)
    with engine, live_server(create_app(cfg, engine=engine)) as url:
        yield Live(url, engine)


def _post(url: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kw)


def _respond(url: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """A response object, checked against the SDK's type (strict validation)."""
    r = _post(url, "/v1/responses", {"max_output_tokens": MAX, "temperature": 0, **body}, **kw)
    assert r.status_code == 200, r.text
    obj: dict[str, Any] = r.json()
    SdkResponse.model_validate(obj)
    return obj


def _text(obj: dict[str, Any]) -> str:
    (item,) = obj["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    return str(part["text"])


def _chat(url: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """The oracle: the chat route's greedy answer to ``messages``."""
    body = {"messages": messages, "max_tokens": MAX, "temperature": 0}
    r = _post(url, "/v1/chat/completions", body, **kw)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _same_as_chat(url: str, obj: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """``obj`` is what the chat route answers to ``messages``: text, status, token counts."""
    chat = _chat(url, messages)
    choice = chat["choices"][0]
    assert _text(obj) == choice["message"]["content"]
    want = "completed" if choice["finish_reason"] == "stop" else "incomplete"
    assert obj["status"] == want
    if want == "incomplete":
        assert obj["incomplete_details"] == {"reason": "max_output_tokens"}
    usage = obj["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def _cached(obj: dict[str, Any]) -> tuple[int, int]:
    """(cached tokens, of them held by the response's session)."""
    details = obj["usage"]["input_tokens_details"]
    return details["cached_tokens"], details["session_cached_tokens"]


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_a_response_is_the_chat_answer(live: Live) -> None:
    client, url = live.client, live.url
    r = client.responses.create(
        model="m", input="Name three colors.", instructions="Be brief.",
        max_output_tokens=MAX, temperature=0,
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.status is not None
    assert r.instructions == "Be brief." and r.previous_response_id is None
    msgs = [{"role": "system", "content": "Be brief."}, _user("Name three colors.")]
    assert r.output_text == _chat(url, msgs)["choices"][0]["message"]["content"]
    # The stored object, strictly: the same answer and counts as the chat route's.
    obj = httpx.get(f"{url}/v1/responses/{r.id}").json()
    SdkResponse.model_validate(obj)
    _same_as_chat(url, obj, msgs)
    assert obj["output"][0]["id"].startswith("msg_") and obj["store"] is True
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    # A list of items with text parts (and the unprefixed route) is the chat with text parts.
    parts = [
        {"type": "input_text", "text": "Name three"},
        {"type": "input_text", "text": "colors."},
    ]
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": parts}]  # fmt: skip
    r2 = _post(url, "/responses", {"input": items, "max_output_tokens": MAX, "temperature": 0})
    assert r2.status_code == 200, r2.text
    chat_parts = [{"type": "text", "text": p["text"]} for p in parts]
    developer = {"role": "developer", "content": "Be brief."}
    _same_as_chat(url, r2.json(), [developer, {"role": "user", "content": chat_parts}])
    assert httpx.get(f"{url}/responses/{r.id}").json() == obj


def test_a_streamed_response(live: Live) -> None:
    """Every event parses as the SDK's ResponseStreamEvent, numbered in order, in the
    Responses API's order; the deltas join to the final text, which is the non-streamed
    answer; the SDK's stream helper gets the final response."""
    url = live.url
    body = {"input": "Say hello to Bob.", "max_output_tokens": MAX, "temperature": 0}
    want = _respond(url, body)
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                events.append(TypeAdapter(ResponseStreamEvent).validate_python(event))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    final = "response.completed" if want["status"] == "completed" else "response.incomplete"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", final,
    ]  # fmt: skip
    assert deltas and "".join(e.delta for e in deltas) == _text(want)
    assert events[-4].text == _text(want) and events[-1].response.output_text == _text(want)
    assert events[-1].response.usage.output_tokens == want["usage"]["output_tokens"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The SDK's helpers parse it too.
    client = live.client
    with client.responses.stream(model="m", input="Say hello to Bob.",
                                 max_output_tokens=MAX, temperature=0) as stream:  # fmt: skip
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        if want["status"] == "completed":
            assert stream.get_final_response().output_text == _text(want)
    assert "".join(texts) == _text(want)


def test_previous_response_id_continues_the_conversation_in_its_session(live: Live) -> None:
    """A follow-up is the chat answer to the whole conversation, computing only its new
    tokens: its cached tokens cover the previous response's input, held by the session.
    instructions are not carried over."""
    url, client = live.url, live.client
    first = _respond(url, {"input": "My name is Ada. Greet me.", "instructions": "Be kind."})
    history = [_user("My name is Ada. Greet me."), {"role": "assistant", "content": _text(first)}]
    second = _respond(url, {"input": "What is my name?", "previous_response_id": first["id"]})
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    _same_as_chat(url, second, [*history, _user("What is my name?")])
    # The same conversation sent whole, with the SDK's own output items handed back.
    handed = [item.model_dump() for item in client.responses.retrieve(first["id"]).output]
    items = [history[0], *handed, _user("What is my name?")]
    assert _text(_respond(url, {"input": items, "store": False})) == _text(second)
    # (Without "Be kind." the template's own system prompt starts the conversation: the
    # session holds little of it. The follow-ups below keep their instructions.)
    third = _respond(url, {"input": "And my name backwards?", "instructions": "Be kind.",
                           "previous_response_id": second["id"]})  # fmt: skip
    convo = [*history, _user("What is my name?"), {"role": "assistant", "content": _text(second)}]
    _same_as_chat(url, third, [{"role": "system", "content": "Be kind."}, *convo,
                               _user("And my name backwards?")])  # fmt: skip
    fourth = _respond(url, {"input": "Thanks!", "instructions": "Be kind.",
                            "previous_response_id": third["id"]})  # fmt: skip
    cached, in_session = _cached(fourth)
    assert in_session == cached > 0
    # The whole previous conversation (its input and all but its last, unfinished token).
    seen = third["usage"]["input_tokens"] + third["usage"]["output_tokens"]
    assert seen - 2 <= cached <= fourth["usage"]["input_tokens"], (cached, seen)
    # The SDK: previous_response_id and output_text.
    fifth = client.responses.create(model="m", input="Bye.", instructions="Be kind.",
                                    previous_response_id=fourth["id"], max_output_tokens=MAX,
                                    temperature=0)  # fmt: skip
    assert fifth.previous_response_id == fourth["id"]
    assert fifth.usage is not None and fifth.usage.input_tokens_details.cached_tokens > 0


def test_branches_from_one_response(live: Live) -> None:
    """Two follow-ups of one response: each is the chat answer to its own conversation. The
    first continues the session; the second gets a session of its own whose prompt the
    prefix cache still serves in whole blocks; each branch then continues in its session."""
    url = live.url
    root = _respond(url, {"input": "Pick a number between one and ten."})
    history = [_user("Pick a number between one and ten."),
               {"role": "assistant", "content": _text(root)}]  # fmt: skip
    a = _respond(url, {"input": "Double it.", "previous_response_id": root["id"]})
    b = _respond(url, {"input": "Halve it.", "previous_response_id": root["id"]})
    _same_as_chat(url, a, [*history, _user("Double it.")])
    _same_as_chat(url, b, [*history, _user("Halve it.")])
    assert _cached(a)[1] > 0  # the root's session
    cached, in_session = _cached(b)
    assert in_session == 0 and cached >= 16  # a new session, whole blocks from the cache
    sessions = {s["id"] for s in httpx.get(f"{url}/v1/sessions").json()["data"]}
    assert {root["id"], b["id"]} <= sessions  # a runs in the root's session
    for branch, ask in ((a, "Double it."), (b, "Halve it.")):
        more = _respond(url, {"input": "Once more.", "previous_response_id": branch["id"]})
        convo = [*history, _user(ask), {"role": "assistant", "content": _text(branch)}]
        _same_as_chat(url, more, [*convo, _user("Once more.")])
        assert _cached(more)[1] > 0, branch["id"]  # each branch in its own session
    # The root again: its session now holds branch a's continuation, so a new one.
    again = _respond(url, {"input": "Double it.", "previous_response_id": root["id"]})
    assert _text(again) == _text(a) and _cached(again)[1] == 0


def test_a_failed_turn_gives_the_session_back(live: Live) -> None:
    """A follow-up that fails mid-stream ends with an error event and response.failed and is
    not stored; the session still holds the previous conversation for the next follow-up."""
    url, engine = live.url, live.engine
    first = _respond(url, {"input": "Tell me about cats."})
    body = {"input": "And dogs?", "previous_response_id": first["id"], "stream": True,
            "max_output_tokens": MAX, "temperature": 0}  # fmt: skip
    events = []

    def later(req: Any) -> bool:  # a few tokens in
        return session_is(first["id"])(req) and len(req.ids) > req.n_prompt + 2

    with inject(engine, "deliver", times=None, request=later) as fault:
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(TypeAdapter(ResponseStreamEvent).validate_json(line[6:]))
    assert fault.fired > 0
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.output_text.delta" in kinds
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert "deliver" in events[-2].message
    r = httpx.get(f"{url}/v1/responses/{failed.id}")
    assert r.status_code == 404
    again = _respond(url, {"input": "And dogs?", "previous_response_id": first["id"]})
    history = [_user("Tell me about cats."), {"role": "assistant", "content": _text(first)}]
    _same_as_chat(url, again, [*history, _user("And dogs?")])
    assert _cached(again)[1] > 0


def test_unknown_unstored_and_deleted_responses(live: Live) -> None:
    url, client = live.url, live.client
    for rid in ("resp_nope", "x" * 200):
        r = _post(url, "/v1/responses", {"input": "Hi", "previous_response_id": rid})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "previous_response_not_found"
        assert r.json()["error"]["param"] == "previous_response_id"
        assert httpx.get(f"{url}/v1/responses/{rid}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    # store: false is neither readable nor continuable, and holds no session.
    loose = _respond(url, {"input": "Hi there", "store": False})
    assert loose["store"] is False
    assert httpx.get(f"{url}/v1/responses/{loose['id']}").status_code == 404
    r = _post(url, "/v1/responses", {"input": "Hi", "previous_response_id": loose["id"]})
    assert r.status_code == 404
    assert httpx.get(f"{url}/v1/sessions/{loose['id']}").status_code == 404
    # A store: false follow-up of a stored response is its answer, and changes no session.
    kept = _respond(url, {"input": "Hi there"})
    follow = _respond(url, {"input": "Go on.", "previous_response_id": kept["id"], "store": False})
    convo = [_user("Hi there"), {"role": "assistant", "content": _text(kept)}, _user("Go on.")]
    _same_as_chat(url, follow, convo)
    # Delete: gone for GET and previous_response_id; its session is dropped.
    assert httpx.get(f"{url}/v1/sessions/{kept['id']}").status_code == 200
    client.responses.delete(kept["id"])
    assert httpx.get(f"{url}/v1/responses/{kept['id']}").status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{kept['id']}").status_code == 404
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/v1/sessions/{kept['id']}").status_code != 404:
        assert time.monotonic() < deadline, "the deleted response's session stayed"
        time.sleep(0.05)


def test_fields_that_change_nothing_are_accepted_and_the_rest_are_400s(live: Live) -> None:
    url = live.url
    base = {"input": "Count to three.", "max_output_tokens": MAX, "temperature": 0}
    want = _respond(url, base)
    ignored = {
        "model": "gpt-4o", "store": True, "metadata": {"team": "a"}, "user": "u-1",
        "parallel_tool_calls": True, "truncation": "disabled", "service_tier": "auto",
        "reasoning": {"effort": "low"}, "tools": [], "tool_choice": "auto", "include": [],
        "text": {"format": {"type": "text"}, "verbosity": "low"}, "prompt_cache_key": "k",
        "safety_identifier": "s", "background": False, "top_logprobs": 0,
        "stream_options": None, "instructions": None, "previous_response_id": None,
    }  # fmt: skip
    got = _respond(url, {**base, **ignored})
    assert _text(got) == _text(want) and got["metadata"] == {"team": "a"}
    assert got["user"] == "u-1" and got["tool_choice"] == "auto"
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    for field, value, code in (
        ("text", {"format": {"type": "xml"}}, "invalid_value"),
        ("background", True, "unsupported_parameter"),
        ("input", [{"role": "user", "content": [image]}], "invalid_value"),
        ("input", [reasoning], "invalid_value"),
        ("input", [], "invalid_value"),
        ("input", None, "invalid_value"),
        ("max_output_tokens", 0, "invalid_value"),
        ("temperature", -1.0, "invalid_value"),
        ("stream_options", {"include_obfuscation": False}, "invalid_value"),
        ("session_id", "s", "invalid_value"),
        ("prediction", {"type": "content", "content": "x"}, "invalid_value"),
    ):
        r = _post(url, "/v1/responses", {**base, field: value})
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        want_param = "text.format.type" if field == "text" else field
        assert (error["param"], error["code"]) == (want_param, code), (field, error)
    assert "input_image" in _post(url, "/v1/responses", {"input": [{"role": "user",
                                  "content": [image]}]}).text  # fmt: skip
    r = _post(url, "/v1/responses", {"input": "x" * 5000, "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"


KEYS = """
[tenants.alice]
key = "alice-secret-key"

[tenants.bob]
key = "bob-secret-key"
"""


def test_tenants_responses_are_their_own_and_the_store_is_bounded(
    model_path: Path, tmp_path: Path
) -> None:
    """Another tenant's response is unknown to every route (404); past
    max_stored_responses the least recently used response leaves the store, with its
    session."""
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS, encoding="utf-8")
    config = ServerConfig(api_keys_file=str(keys), max_stored_responses=2)
    alice = {"Authorization": "Bearer alice-secret-key"}
    bob = {"Authorization": "Bearer bob-secret-key"}
    with Engine(model_path, parallel=2, ctx_size=512) as engine:
        with live_server(create_app(config, engine=engine)) as url:
            mine = _respond(url, {"input": "My secret is 42."}, headers=alice)
            rid = mine["id"]
            assert httpx.get(f"{url}/v1/responses/{rid}", headers=alice).status_code == 200
            assert httpx.get(f"{url}/v1/responses/{rid}", headers=bob).status_code == 404
            follow = {"input": "What is my secret?", "previous_response_id": rid}
            assert _post(url, "/v1/responses", follow, headers=bob).status_code == 404
            assert httpx.delete(f"{url}/v1/responses/{rid}", headers=bob).status_code == 404
            # Alice's session is hers: listed for her under the response's id, not for Bob.
            listed = httpx.get(f"{url}/v1/sessions", headers=alice).json()["data"]
            assert [s["id"] for s in listed] == [rid]
            assert httpx.get(f"{url}/v1/sessions", headers=bob).json()["data"] == []
            more = _respond(url, follow, headers=alice)
            assert _cached(more)[1] > 0
            # The store holds 2: a third response pushes out the least recently used one
            # (mine: `more` was stored after it), whose session no response heads.
            other = _respond(url, {"input": "Hello."}, headers=alice)
            assert httpx.get(f"{url}/v1/responses/{rid}", headers=alice).status_code == 404
            for kept in (more, other):
                r = httpx.get(f"{url}/v1/responses/{kept['id']}", headers=alice)
                assert r.status_code == 200
            # mine's session is more's (it continued it): it stays while more is stored.
            ids = {s["id"] for s in httpx.get(f"{url}/v1/sessions", headers=alice).json()["data"]}
            assert ids == {rid, other["id"]}
            _respond(url, {"input": "Hi again."}, headers=alice)  # more leaves the store
            deadline = time.monotonic() + 10
            while rid in {s["id"] for s in httpx.get(f"{url}/v1/sessions",
                                                      headers=alice).json()["data"]}:  # fmt: skip
                assert time.monotonic() < deadline, "the session of a dropped response stayed"
                time.sleep(0.05)


def test_structured_output_with_text_format(live: Live) -> None:
    """``text.format`` is structured output (kvserve.grammar): the SDK's ``responses.parse``
    with a pydantic model gets a parsed object, the output validates against the schema
    (``jsonschema`` as the oracle), and a bad schema is a 400 naming ``text.format``."""
    import jsonschema
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=100_000_000)

    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    r = client.responses.parse(
        model="m", input="Describe a city.", text_format=City, max_output_tokens=80,
        temperature=0,
    )  # fmt: skip
    assert isinstance(r.output_parsed, City), r.output_text
    jsonschema.validate(json.loads(r.output_text), City.model_json_schema())
    # json_object: the 135M model may not close its object within the budget, but what it
    # writes is one (free text would not start with a brace).
    fmt = {"format": {"type": "json_object"}}
    obj = _respond(live.url, {"input": "Say hi.", "max_output_tokens": 8, "text": fmt})
    assert _text(obj).startswith("{"), _text(obj)
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}, "strict": True}
    r2 = _post(live.url, "/v1/responses", {"input": "x", "text": {"format": bad}})
    assert r2.status_code == 400, r2.text
    assert r2.json()["error"]["param"] == "text.format.schema", r2.text


# -- function tools ------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# The Responses API's flat tools, and the same tools as the chat route takes them.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "The current weather of a city",
     "parameters": WEATHER},
]  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]  # fmt: skip
ASK = "What is the weather like in Paris today?"
RESULT = '{"celsius": 18, "sky": "sunny"}'


def _reply(obj: dict[str, Any]) -> tuple[str | None, list[tuple[str, str]]]:
    """A response's output as a chat reply: (content, [(name, arguments)]). The message item
    (if any) comes first, with one text part; each function_call item is completed."""
    content, calls = None, []
    for i, item in enumerate(obj["output"]):
        if item["type"] == "message":
            assert i == 0 and item["id"].startswith("msg_")
            (part,) = item["content"]
            content = part["text"]
        else:
            assert item["type"] == "function_call" and item["status"] == "completed"
            assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
            calls.append((item["name"], item["arguments"]))
    return content, calls


def _same_reply_as_chat(url: str, obj: dict[str, Any], messages: list[Any], **tools: Any) -> None:
    """``obj`` is what the chat route answers to ``messages`` with the same tools: content,
    calls (names and argument texts), status and token counts."""
    body = {"messages": messages, "max_tokens": obj["max_output_tokens"], "temperature": 0}
    r = _post(url, "/v1/chat/completions", {**body, "tools": CHAT_TOOLS, **tools})
    assert r.status_code == 200, r.text
    chat = r.json()
    choice = chat["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]  # fmt: skip
    assert _reply(obj) == (message["content"], calls)
    assert obj["status"] == ("incomplete" if choice["finish_reason"] == "length" else "completed")
    assert obj["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert obj["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]


def _call_message(item: Any) -> dict[str, Any]:
    fn = {"name": item.name, "arguments": item.arguments}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": item.call_id, "type": "function", "function": fn}]}  # fmt: skip


def test_a_function_call_round_trip(live: Live) -> None:
    """tool_choice required gives a function_call item (its arguments valid by the tool's
    schema) equal to the chat route's call; its output handed back with previous_response_id
    continues in the session (cached_tokens cover the whole first turn) as the chat route
    continues that history; with tool_choice none the answer is text; the SDK's own output
    items handed back as input (no stored state) give the same answer."""
    import jsonschema

    url, client = live.url, live.client
    first = client.responses.create(
        model="m", input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    obj = httpx.get(f"{url}/v1/responses/{first.id}").json()
    SdkResponse.model_validate(obj)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.status == "completed" and first.output_text == ""
    assert first.tool_choice == "required" and first.parallel_tool_calls is False
    echoed = [t.model_dump(exclude_unset=True) for t in first.tools]
    assert echoed == [{**TOOLS[0], "strict": False}]
    _same_reply_as_chat(url, obj, [_user(ASK)], tool_choice="required", parallel_tool_calls=False)
    # The call's output, continuing the stored response (tool_choice auto: the default).
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    history = [_user(ASK), _call_message(call),
               {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}]  # fmt: skip
    body = {"input": [output], "tools": TOOLS, "max_output_tokens": 60}
    second = _respond(url, {**body, "previous_response_id": first.id})
    _same_reply_as_chat(url, second, history)
    cached, in_session = _cached(second)
    assert in_session == cached > 0
    usage = first.usage
    assert usage is not None and cached >= usage.input_tokens + usage.output_tokens - 2
    # tool_choice none: a text answer (a branch from the first response: its own session).
    text = _respond(url, {**body, "tool_choice": "none", "previous_response_id": first.id})
    assert [item["type"] for item in text["output"]] == ["message"] and _text(text)
    _same_reply_as_chat(url, text, history, tool_choice="none")
    assert text["tools"][0]["name"] == "get_weather" and text["tool_choice"] == "none"
    # Stateless: the SDK's own output items handed back, then the output.
    handed = [item.model_dump() for item in first.output]
    items = [_user(ASK), *handed, output]
    again = _respond(url, {**body, "input": items, "tool_choice": "none", "store": False})
    assert _reply(again) == _reply(text)


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    """The stream's events, each parsed strictly as the SDK's ResponseStreamEvent, numbered
    in order."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(TypeAdapter(ResponseStreamEvent).validate_json(line[6:]))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_tool_responses_have_the_same_items(live: Live) -> None:
    """Streamed, a response's items are the non-streamed ones: each call an item added with
    empty arguments, its arguments (delta, done), the item done, at increasing output
    indexes; with tools, content (a response the model gives instead of calls) opens the
    message item when it comes. The SDK's stream helper accumulates the same items."""
    url, client = live.url, live.client
    both = "What is the weather like in Paris and in Rome today?"
    haiku = "Write a haiku about the sea."
    for ask, choice, calls, limit in ((both, "required", 2, 60), (haiku, "auto", 0, 16)):
        body = {"input": ask, "tools": TOOLS, "tool_choice": choice, "max_output_tokens": limit,
                "temperature": 0}  # fmt: skip
        whole = _respond(url, body)
        content, made = _reply(whole)
        assert (content is None) == (calls > 0), whole["output"]
        if calls:
            # Whether this 135M model stops after its calls or repeats them up to the limit
            # turns on the last digits of its logits (greedy), which differ between builds
            # and hosts: either is a valid response, and the stream must give the same one.
            assert len(made) >= 1 and {name for name, _ in made} == {"get_weather"}, made
            assert whole["status"] in ("completed", "incomplete")
        else:
            assert not made and whole["status"] == "incomplete"
        if whole["status"] == "incomplete":
            assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        events = _events(url, body)
        final = events[-1].response
        assert events[-1].type == f"response.{whole['status']}"
        assert _reply(final.model_dump()) == _reply(whole)
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        added = [e for e in events if e.type == "response.output_item.added"]
        assert [e.output_index for e in added] == list(range(len(whole["output"])))
        for i, item in enumerate(final.output):
            mine = [e for e in events if getattr(e, "output_index", None) == i]
            if item.type == "function_call":
                assert [e.type for e in mine] == [
                    "response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done",
                ]  # fmt: skip
                assert mine[0].item.arguments == "" and mine[0].item.status == "in_progress"
                assert mine[1].delta == mine[2].arguments == item.arguments
                assert mine[3].item == item and {e.item_id for e in mine[1:3]} == {item.id}
            else:
                deltas = [e.delta for e in mine if e.type == "response.output_text.delta"]
                assert deltas and "".join(deltas) == item.content[0].text
                assert mine[-1].type == "response.output_item.done" and mine[-1].item == item
        # The SDK's accumulator: the arguments and the text it joins, and its final response.
        with client.responses.stream(model="m", **body) as stream:
            sdk = list(stream)
            got = stream.get_final_response() if whole["status"] == "completed" else None
        snapshots = [e.snapshot for e in sdk if e.type == "response.function_call_arguments.delta"]
        assert snapshots == [arguments for _, arguments in made]
        texts = [e.snapshot for e in sdk if e.type == "response.output_text.delta"]
        assert (texts[-1] if texts else None) == content
        assert got is None or _reply(got.model_dump()) == _reply(whole)


def test_bad_tools_are_400s_naming_the_field(live: Live) -> None:
    url = live.url
    flat = TOOLS[0]
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{**flat, "parameters": {"type": "bogus"}}]}, "tools[0].parameters"),
        ({"tools": [flat, flat]}, "tools[1].name"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [image]}]},
         "input"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": ""}]},
         "input"),
    ]  # fmt: skip
    for extra, param in cases:
        r = _post(url, "/v1/responses", {"input": ASK, "max_output_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (extra, error)
    assert "input_image" in r.text or "custom_tool_call" in r.text
