"""Tool calls (kvserve.tools, the chat template's tool rendering, the Engine's and the server's
tools; issue 22).

Oracles: the ``jsonschema`` package validates each call's arguments against its tool's
parameters schema, and the output schema a request's tools make against hand-written replies
that it must accept or refuse; ``json.loads`` of a reply is the reference for what the parser
reads out of it, whole or fed in pieces; the official ``openai`` client's own stream
accumulator (``client.chat.completions.stream``) rebuilds the streamed calls, which must be
the non-streamed ones; the history a template renders must parse back into the calls it was
given."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve import Engine, Model
from kvserve.chat import ChatTemplate
from kvserve.grammar import GrammarError
from kvserve.server.app import create_app
from kvserve.server.config import ServerConfig
from kvserve.testing import live_server
from kvserve.tools import GENERIC, HERMES, ToolCall, ToolPlan, plan_tools

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time of a city",
            "parameters": CLOCK,
        },
    },
]
PARAMS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# A Hermes-style template (Qwen 2.5's tool format, shortened): reads ``tools``, prints calls as
# <tool_call> blocks with the arguments as an object, tool results as <tool_response> blocks.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Signatures: <tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _call(name: str, args: dict[str, Any], call_id: str = "call_1") -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {"id": call_id, "type": "function", "function": fn}


def _history(calls: list[dict[str, Any]], results: list[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}]
    for call, result in zip(calls, results, strict=True):
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return msgs


def _schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema a generic plan's constraint enforces (its llguidance grammar holds it)."""
    assert plan.constraint is not None
    grammar = json.loads(plan.constraint.source)["grammars"][0]
    schema: dict[str, Any] = grammar["json_schema"]
    schema.pop("x-guidance", None)
    return schema


def _events(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[ToolCall]]:
    parser = plan.parser()
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return parser.content(events), [e for e in events if isinstance(e, ToolCall)]


def _calls(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- without a model ---------------------------------------------------------------------------


def test_bad_tools_and_choices_are_errors_naming_the_field() -> None:
    chatml = ChatTemplate(None)
    fn = TOOLS[0]["function"]
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": [{"type": "function", "function": {**fn, "parameters": {"type": "bogus"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name 'get_weather' is also"),
        (
            {"tools": [{"type": "function", "function": {**fn, "name": "a b"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name 'nope' is not one of the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice is 'required' but no tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        # strict refuses what cannot be enforced; not strict ignores it (below)
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {
                                "type": "object",
                                "properties": {"d": {"type": "string", "format": "no-such"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters: Unknown format",
        ),
    ]
    for kwargs, needle in bad:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            plan_tools(chatml, **kwargs)
    lax = {"type": "object", "properties": {"d": {"type": "string", "format": "no-such"}}}
    ok = plan_tools(chatml, [{"type": "function", "function": {"name": "f", "parameters": lax}}])
    assert ok is not None and ok.constraint is not None
    with pytest.raises(GrammarError):
        plan_tools(
            chatml, [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
        )
    assert plan_tools(chatml, None) is None and plan_tools(chatml, []) is None
    # The Responses API's flat tools are the same tools.
    flat = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    plan = plan_tools(chatml, flat, {"type": "function", "name": "get_weather"})
    assert plan is not None and plan.function == "get_weather"
    with pytest.raises(ValueError, match=r"^tool_choice\.name 'nope' is not one of the tools"):
        plan_tools(chatml, flat, {"type": "function", "name": "nope"})


def test_the_output_schema_allows_what_the_choice_allows() -> None:
    """The generic format's schema (oracle: jsonschema) for each tool_choice."""
    chatml = ChatTemplate(None)
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    clock = {"name": "get_time", "arguments": {"city": "Oslo"}}
    replies = {
        "one": {"tool_calls": [weather]},
        "two": {"tool_calls": [weather, clock]},
        "clock": {"tool_calls": [clock]},
        "response": {"response": "Hello."},
        "empty": {"tool_calls": []},
        "bad_args": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        "unknown": {"tool_calls": [{"name": "get_date", "arguments": {}}]},
    }
    named = {"type": "function", "function": {"name": "get_time"}}
    cases: list[tuple[Any, bool, set[str]]] = [
        ("auto", True, {"one", "two", "clock", "response"}),
        ("required", True, {"one", "two", "clock"}),
        ("required", False, {"one", "clock"}),
        (named, True, {"clock"}),
    ]
    for choice, parallel, accepted in cases:
        plan = plan_tools(chatml, TOOLS, choice, parallel)
        assert plan is not None and plan.format == GENERIC
        schema = _schema(plan)
        for name, reply in replies.items():
            valid = jsonschema.Draft202012Validator(schema).is_valid(reply)
            assert valid == (name in accepted), (choice, parallel, name)
    none = plan_tools(chatml, TOOLS, "none")
    assert none is not None and none.constraint is None and none.render_tools is None
    # A tool's own definitions move to the root with its references.
    defs = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}},
        "required": ["where"],
        "$defs": {"Place": {"type": "string", "enum": ["home", "work"]}},
    }
    plan = plan_tools(
        chatml, [{"type": "function", "function": {"name": "go", "parameters": defs}}], "required"
    )
    assert plan is not None
    validator = jsonschema.Draft202012Validator(_schema(plan))
    assert validator.is_valid({"tool_calls": [{"name": "go", "arguments": {"where": "home"}}]})
    assert not validator.is_valid({"tool_calls": [{"name": "go", "arguments": {"where": "mars"}}]})


def test_the_parser_reads_the_same_calls_whole_and_in_pieces() -> None:
    """Oracle: json.loads of each reply; the events of any split join to the whole parse."""
    chatml = ChatTemplate(None)
    plan = plan_tools(chatml, TOOLS, "auto")
    assert plan is not None
    weather = {"name": "get_weather", "arguments": {"city": 'Zürich "Z"', "unit": "celsius"}}
    clock = {"name": "get_time", "arguments": {"city": "Oslo"}}
    replies = [
        json.dumps({"tool_calls": [weather, clock]}, indent=2),
        json.dumps({"tool_calls": [weather]}, ensure_ascii=False),
        json.dumps({"response": 'Hi "you"\n\\ é 😀 \u2028 done'}),  # \uXXXX escapes, a pair
        json.dumps({"response": "Hi é 😀"}, ensure_ascii=False),
    ]
    rng = random.Random(3)
    for text in replies:
        want = json.loads(text)
        for split in range(6):
            if split == 0:
                pieces = [text]
            elif split == 1:
                pieces = list(text)
            else:
                cuts = sorted(rng.sample(range(1, len(text)), 6))
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            content, calls = _events(plan, pieces)
            if "response" in want:
                assert (content, calls) == (want["response"], []), pieces
            else:
                assert content is None
                assert _calls(calls) == [(c["name"], c["arguments"]) for c in want["tool_calls"]]
    # What does not parse is content as it came; a reply cut short keeps its whole calls.
    two = json.dumps({"tool_calls": [weather, clock]})
    for text, want_content, n in [
        ("I cannot use tools.", "I cannot use tools.", 0),
        (
            '{"tool_calls": [{"name": "get_weather", "argu',
            '{"tool_calls": [{"name": "get_weather", "argu',
            0,
        ),
        (two[: two.index("get_time") + 4], None, 1),
        ('{"response": "Hello, wor', "Hello, wor", 0),
    ]:
        for pieces in ([text], list(text)):
            content, calls = _events(plan, pieces)
            assert (content, len(calls)) == (want_content, n), (text, pieces)
    # parallel_tool_calls false: one call at most, whatever the text holds
    one = plan_tools(chatml, TOOLS, "auto", False)
    assert one is not None and len(_events(one, [two])[1]) == 1
    # Hermes: text around the calls is content, whitespace around them is not
    hermes = plan_tools(ChatTemplate(HERMES_TEMPLATE), TOOLS, "auto")
    assert hermes is not None and hermes.format == HERMES and hermes.constraint is None
    text = (
        "Let me look.\n<tool_call>\n"
        + json.dumps(weather)
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps(clock)
        + "\n</tool_call>\n"
    )
    for pieces in ([text], list(text)):
        content, calls = _events(hermes, pieces)
        assert content == "Let me look."
        assert _calls(calls) == [
            (weather["name"], weather["arguments"]),
            (clock["name"], clock["arguments"]),
        ]
    for text in ("No call here <tool", "<tool_call>not json</tool_call> after"):
        assert _events(hermes, list(text)) == (text, [])


def test_templates_render_tools_and_history_their_way() -> None:
    """A template that reads tools gets them and the history as it expects them; any other
    gets the generic section and the history in the format the parser reads (oracle: parsing
    the rendered assistant turn gives back the calls of the history)."""
    calls = [
        _call("get_weather", {"city": "Paris", "unit": "celsius"}),
        _call("get_time", {"city": "Paris"}, "call_2"),
    ]
    msgs = _history(calls, ["18 C, sunny", "14:05"])
    hermes = ChatTemplate(HERMES_TEMPLATE)
    caps = hermes.tool_caps
    assert caps.reads_tools and caps.reads_tool_calls and caps.object_arguments and caps.tool_role
    text = hermes.render(msgs, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text  # the template's own tools section
    assert '"arguments": {"city": "Paris", "unit": "celsius"}}' in text  # an object, not a string
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    # A template that prints the arguments as given gets JSON text.
    as_text = HERMES_TEMPLATE.replace(
        "{{ tc.function.arguments | tojson }}", "{{ tc.function.arguments }}"
    )
    plain = ChatTemplate(as_text)
    assert not plain.tool_caps.object_arguments
    assert '"arguments": {"city": "Paris", "unit": "celsius"}}' in plain.render(msgs, tools=TOOLS)

    chatml = ChatTemplate(None)
    assert not chatml.tool_caps.reads_tools and chatml.tool_caps.tool_role
    text = chatml.render(msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou can call these tools")
    for tool in TOOLS:
        fn = tool["function"]
        assert f"- {fn['name']}: {fn['description']}" in text
        assert json.dumps(fn["parameters"]) in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    plan = plan_tools(chatml, TOOLS)
    assert plan is not None
    content, parsed = plan.parse(turn)
    assert content is None and _calls(parsed) == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]
    results = [
        json.loads(r)
        for r in text.split("<|im_start|>tool\n")[1:]
        for r in [r.split("<|im_end|>")[0]]
    ]
    assert results == [
        {
            "tool_response": {
                "name": "get_weather",
                "tool_call_id": "call_1",
                "content": "18 C, sunny",
            }
        },
        {"tool_response": {"name": "get_time", "tool_call_id": "call_2", "content": "14:05"}},
    ]
    # A system prompt keeps its place; the section follows it.
    sys_text = chatml.render([{"role": "system", "content": "Be brief."}, *ASK], tools=TOOLS)
    assert sys_text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools")
    # A template without a tool role gets the results as one user turn (its roles alternate).
    strict = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    strict_text = ChatTemplate(strict).render(msgs, tools=TOOLS)
    assert strict_text.count("[user]") == 2 and "[tool]" not in strict_text
    assert '"content": "18 C, sunny"}}\n{"tool_response": {"name": "get_time"' in strict_text
    # Bad history calls are errors naming them.
    bad = _history(
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}], ["x"]
    )
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        chatml.render(bad)


# -- the engine --------------------------------------------------------------------------------


def _engine_calls(engine: Engine, **one: Any) -> list[Any]:
    """chat, then achat and stream_chat batched together: (result, result, stream events)."""
    r = engine.chat(ASK, 60, **one)

    async def stream() -> list[str | ToolCall]:
        return [e async for e in engine.stream_chat(ASK, 60, **one)]

    async def both() -> list[Any]:
        return list(await asyncio.gather(engine.achat(ASK, 60, **one), stream()))

    return [r, *asyncio.run(both())]


def test_engine_chat_returns_calls_on_both_models(model_path: Path, gemma_path: Path) -> None:
    """chat, achat and stream_chat with tools: calls whose arguments validate; the stream's
    events are the calls of the whole reply; tool_choice none is the chat without tools."""
    # (A model this small, free to make several calls, repeats them to max_tokens.)
    one: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    with Engine(model_path, parallel=2, ctx_size=1024) as engine:
        r, other, events = _engine_calls(engine, **one)
        assert r.finish_reason == "tool_calls" and r.text == "" and len(r.tool_calls) == 1
        for call in r.tool_calls:
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
        assert [e for e in events if isinstance(e, str)] == []
        assert _calls([e for e in events if isinstance(e, ToolCall)]) == _calls(r.tool_calls)
        assert _calls(other.tool_calls) == _calls(r.tool_calls)
        free = engine.chat(ASK, max_tokens=8, tools=TOOLS, tool_choice="none")
        assert free.tool_calls is None and free.text == engine.chat(ASK, max_tokens=8).text
        with pytest.raises(ValueError, match="response_format cannot be combined with tools"):
            engine.chat(ASK, 8, tools=TOOLS, response_format={"type": "json_object"})
    with Engine(gemma_path, parallel=1, ctx_size=1024) as engine:
        named = {"type": "function", "function": {"name": "get_time"}}
        r = engine.chat(ASK, 40, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
        assert (
            r.finish_reason == "tool_calls" and r.tool_calls and r.tool_calls[0].name == "get_time"
        )
        jsonschema.validate(json.loads(r.tool_calls[0].arguments), CLOCK)


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(model_path: Path) -> Iterator[str]:
    engine = Engine(model_path, parallel=4, ctx_size=2048)
    cfg = ServerConfig(model=str(model_path), ctx_size=2048)
    with engine, live_server(create_app(cfg, engine=engine)) as url:
        yield url


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def test_a_tool_call_round_trip(base: str) -> None:
    client = _client(base)
    first = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # The named function is the one called.
    named = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    named_calls = named.choices[0].message.tool_calls
    assert named_calls and {c.function.name for c in named_calls} == {"get_time"}
    # The SDK's own message back in the history, the tool's result, then the answer.
    history: list[Any] = [*ASK, choice.message.model_dump()]
    for call in calls:
        history.append(
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "sunny"}'}
        )
    final = client.chat.completions.create(
        model="m",
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    answer = final.choices[0]
    # The call ids are random and are part of the prompt, so the greedy answer varies from
    # run to run; about one in thirty runs past 40 tokens ("length").
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content
    # The prompt the server rendered holds the call and the result in the generic format.
    r = httpx.post(f"{base}/apply-template", json={"messages": history, "tools": TOOLS}, timeout=60)
    prompt = r.json()["prompt"]
    name, call_id = json.dumps(calls[0].function.name), json.dumps(calls[0].id)
    assert '{"tool_calls": [{"name": ' + name in prompt
    assert '"tool_call_id": ' + call_id in prompt and "You can call these tools" in prompt


def test_none_and_parallel_false(base: str) -> None:
    client = _client(base)
    none = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=12,
        temperature=0,
    )
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    # With false, one call (the output schema's maxItems: checked against jsonschema in
    # test_the_output_schema_allows_what_the_choice_allows); with true, at least one.
    for parallel in (False, True):
        r = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=70,
            temperature=0,
            parallel_tool_calls=parallel,
        )
        calls = r.choices[0].message.tool_calls
        assert calls
        if parallel:
            assert len(calls) >= 1
        else:
            assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_streaming_rebuilds_the_same_calls(base: str) -> None:
    client = _client(base)
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        contents = [e for e in stream if e.type == "content.delta"]
        done = stream.get_final_completion().choices[0]
    assert contents == []  # the JSON envelope is never content
    assert done.finish_reason == whole.finish_reason == "tool_calls"
    assert done.message.tool_calls and whole.message.tool_calls
    got = [(c.function.name, json.loads(c.function.arguments)) for c in done.message.tool_calls]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == want


def test_invalid_tools_are_400s_naming_the_field(base: str) -> None:
    url = f"{base}/v1/chat/completions"
    fn = TOOLS[0]["function"]
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": [{"type": "function", "function": {**fn, "parameters": {"type": "bogus"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": "get_weather"}, "tools"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())


def test_a_template_with_its_own_tool_format(model_path: Path) -> None:
    """A Hermes-style template (given with the server's chat template option): it gets the
    tools; required calls come as <tool_call> blocks (a Lark grammar), parsed into calls."""
    engine = Engine(Model(model_path, chat_template=HERMES_TEMPLATE), parallel=2, ctx_size=1024)
    cfg = ServerConfig(model=str(model_path), ctx_size=1024, chat_template=HERMES_TEMPLATE)
    with engine, live_server(create_app(cfg, engine=engine)) as url:
        plan = engine.tool_plan(TOOLS, "required")
        assert plan is not None and plan.format == HERMES and plan.constraint is not None
        client = _client(url)
        r = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        raw = engine.model.detokenize(
            engine.chat(
                ASK, 80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
            ).tokens
        )
        assert raw.lstrip().startswith("<tool_call>") and raw.rstrip().endswith("</tool_call>")
        assert raw.count("<tool_call>") == 1
        prompt = httpx.post(
            f"{url}/apply-template", json={"messages": ASK, "tools": TOOLS}, timeout=60
        )
        assert json.dumps(TOOLS[0]) in prompt.json()["prompt"]


def test_the_cluster_ingress_keys_a_tool_chat_as_the_replica_cached_it(model_path: Path) -> None:
    """The ingress routes a chat by the block keys of the prompt a replica will compute: with
    tools (rendered as the replica renders them) and a history the SDK dumped (nulls and
    all), every full block of its prompt is in the replica's cache after the replica served
    the same body."""
    from kvserve.cluster.ingress import PromptKeys

    body: dict[str, Any] = {
        "messages": [
            *ASK,
            {"role": "assistant", "content": "Let me check.", "refusal": None, "tool_calls": []},
            {"role": "user", "content": "Please do."},
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 1,
    }
    cfg = ServerConfig(model=str(model_path), ctx_size=2048)
    with Engine(model_path, parallel=2, ctx_size=2048) as engine:
        with live_server(create_app(cfg, engine=engine)) as url:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        ids = PromptKeys(cfg).ids("/v1/chat/completions", body)
        with_tools = len(ids)
        cached = engine._loop.kv.peek(ids, b"")
        plain = PromptKeys(cfg).ids("/v1/chat/completions", {**body, "tools": None})
    assert with_tools > len(plain) + 50  # the tools are in the prompt
    assert r.json()["usage"]["prompt_tokens"] == with_tools
    assert cached == (with_tools - 1) // 16 * 16 > 0
