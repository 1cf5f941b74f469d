"""Tool calls over the OpenAI API with the official client: tools rendered by the model's own
chat template, `required` and a named function enforced by a grammar, the model's calls
parsed into `tool_calls` (streamed as deltas too) with finish_reason "tool_calls", and a
two-turn round trip with a `tool` message; the parser on its own; bad tool requests refused
by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from conftest import cluster_config
from specserve.gateway.tools import ToolCallStream, parse_tool_calls
from specserve.tools.local_cluster import LocalCluster

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {"priority": {"enum": ["low", "high"]}, "urgent": {"type": "boolean"}},
    "required": ["priority", "urgent"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "open_ticket", "description": "A ticket", "parameters": TICKET},
    },
]
SCHEMAS = {"get_weather": WEATHER, "open_ticket": TICKET}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_the_parser_splits_text_and_calls():
    text = 'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look." and calls == [("f", '{"x": 1}')]
    assert parse_tool_calls("no calls") == ("no calls", [])
    broken = '<tool_call>\n{"name": "f", "argu'  # (cut short: not a call)
    assert parse_tool_calls(broken) == (broken, [])
    # Streamed in pieces that split the markup: the same calls, text before them as content.
    stream, content, calls = ToolCallStream(), [], []
    for piece in [
        "Let me",
        " look.<tool",
        '_call>\n{"name": "f", ',
        '"arguments": {"x": 1}}\n</to',
        "ol_call>",
    ]:
        text_out, calls_out = stream.push(piece)
        content.append(text_out)
        calls += calls_out
    text_out, calls_out = stream.flush()
    assert "".join(content) + text_out == "Let me look." and calls + calls_out == [
        ("f", '{"x": 1}')
    ]


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_model_dir):
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path_factory.mktemp("tools"))
    cluster.start(timeout=180)
    port = cluster.procs["gateway"].http_port
    yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    cluster.stop()


def model_of(api) -> str:
    return api.models.list().data[0].id


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.cluster
def test_required_and_named_calls_are_parsed_tool_calls(api):
    model = model_of(api)
    for choice, name in [
        ("required", None),
        ({"type": "function", "function": {"name": "open_ticket"}}, "open_ticket"),
    ]:
        reply = api.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0
        )
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls"
        assert choice0.message.tool_calls and not choice0.message.content
        for call in choice0.message.tool_calls:
            check_call(call, name)


@pytest.mark.cluster
def test_streamed_calls_arrive_as_deltas_the_client_assembles(api):
    kwargs = dict(
        model=model_of(api),
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    whole = api.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in api.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


@pytest.mark.cluster
def test_a_tool_result_goes_back_in_a_second_turn(api):
    model = model_of(api)
    first = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    check_call(call)
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 4, "sky": "snow"}'},
    ]
    second = api.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].message.content is not None
    assert not second.choices[0].message.tool_calls
    # The call and its result were in the prompt the model saw.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.cluster
@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}
                ]
            },
            "tools",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
    ids=["unknown-function", "with-response-format", "bad-parameters", "bad-choice"],
)
def test_bad_tool_requests_are_refused_by_name(api, extra, param):
    kwargs = dict(model=model_of(api), messages=ASK, tools=TOOLS, max_tokens=4) | extra
    with pytest.raises(BadRequestError) as refused:
        api.chat.completions.create(**kwargs)
    assert refused.value.body["param"].startswith(param), refused.value.body
