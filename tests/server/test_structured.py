"""Structured output and forced tool calls through the official SDKs' helpers.

The model is tiny with random weights: left free, its text is noise. With a schema
or a forced tool, every reply must still parse and validate, because the server
only lets the model choose tokens the grammar allows. The pydantic models are
bounded (max lengths, enums, ranges) so that a random model's reply ends within the
token budget.
"""

import json
from typing import Literal, Optional

import openai
import pytest
from pydantic import BaseModel, Field

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "List a few things as JSON."}]
SEEDS = [1, 2, 3]


class Item(BaseModel):
    id: int = Field(ge=0, le=50)
    kind: Literal["tool", "food", "toy"]


class Things(BaseModel):
    title: str = Field(max_length=10)
    items: list[Item] = Field(min_length=1, max_length=3)
    done: bool
    color: Optional[Literal["red", "blue"]]


class GetWeather(BaseModel):
    """Weather for a city."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


def chat_parse(oai):
    # `client.beta.chat.completions.parse` is the documented helper; newer SDKs also
    # offer it as `client.chat.completions.parse`.
    return oai.beta.chat.completions.parse


@pytest.mark.parametrize("sampling", [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in SEEDS])
def test_chat_parse_with_a_pydantic_model(oai, model_id, sampling):
    r = chat_parse(oai)(
        model=model_id, messages=ASK, response_format=Things, max_tokens=300, extra_body=NO_THINK, **sampling
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(c.message.parsed, Things), c.message.content
    Things.model_validate_json(c.message.content)


@pytest.mark.parametrize("seed", SEEDS)
def test_responses_parse_with_a_pydantic_model(oai, model_id, seed):
    r = oai.responses.parse(
        model=model_id,
        input="List a few things as JSON.",
        text_format=Things,
        max_output_tokens=300,
        temperature=1.0,
        reasoning={"effort": "none"},
        extra_body={"seed": seed},
    )
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, Things), r.output_text


def test_an_unenforceable_schema_is_a_400_naming_the_keyword(oai, model_id):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=model_id,
            messages=ASK,
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    err = e.value.body
    assert err["param"] == "response_format.json_schema.schema", err
    assert "dependentSchemas" in err["message"], err


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_tool_choice_required_with_parsed_arguments(oai, model_id, seed):
    r = chat_parse(oai)(
        model=model_id,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        extra_body=NO_THINK,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        assert call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather)


def test_chat_named_tool_and_no_parallel_calls(oai, model_id):
    time_tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    }
    for seed in SEEDS:
        r = oai.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "Time?"}],
            tools=[openai.pydantic_function_tool(GetWeather), time_tool],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body=NO_THINK,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and len(calls) == 1, r
        assert calls[0].function.name == "get_time"
        assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("seed", SEEDS)
def test_responses_named_function(oai, model_id, seed):
    r = oai.responses.create(
        model=model_id,
        input="Weather?",
        tools=[{"type": "function", "name": "get_weather", "parameters": GetWeather.model_json_schema(), "strict": False}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=1.0,
        reasoning={"effort": "none"},
        extra_body={"seed": seed},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    # Parallel calls are allowed, and a random model may keep calling until the
    # token budget; a reply cut short must still have finished more than one call.
    assert r.status == "completed" or (r.incomplete_details.reason == "max_output_tokens" and len(calls) > 1), r
    assert calls, r
    assert calls[0].name == "get_weather"
    GetWeather.model_validate_json(calls[0].arguments)


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": GetWeather.model_json_schema(),
}
TIME_TOOL = {
    "name": "get_time",
    "description": "The time in a zone.",
    "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
}


@pytest.mark.parametrize(
    "choice, want",
    [
        ({"type": "any"}, None),
        ({"type": "tool", "name": "get_weather"}, "get_weather"),
        ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, "get_time"),
    ],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_anthropic_tool_forcing(claude, model_id, choice, want, seed):
    r = claude.messages.create(
        model=model_id,
        max_tokens=300,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
        thinking={"type": "disabled"},
        # Not parameters of every SDK version; the server reads them.
        extra_body={"temperature": 1.0, "seed": seed},
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses, r
    if choice.get("disable_parallel_tool_use"):
        assert r.stop_reason == "tool_use", r
        assert len(uses) == 1, r
    else:
        # Parallel calls are allowed, and a random model may keep calling until
        # max_tokens; a reply cut short must still have finished more than one call.
        # The last call of a cut reply may be unfinished: the others must be whole.
        assert r.stop_reason == "tool_use" or (r.stop_reason == "max_tokens" and len(uses) > 1), r
        if r.stop_reason == "max_tokens":
            uses = uses[:-1]
    for u in uses:
        if want:
            assert u.name == want
        if u.name == "get_weather":
            GetWeather.model_validate(u.input)
        else:
            assert u.input["zone"] in ("UTC", "CET")
