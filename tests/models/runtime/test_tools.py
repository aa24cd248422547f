"""Tool calls: format detection, prompts, grammars and reading calls back; on the tiny real model (random
weights: every call below parses because of the grammar)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from models.runtime.chat import ChatTemplate
from models.runtime.tools import FORMATS, CallReader, detect_format, prepare_messages, tool_grammar
from models.types import GenerationParams, SamplingParams, ToolCallDelta, ToolUse
from tests.chat_templates import GEMMA3, LLAMA3, QWEN25
from tests.models.runtime.helpers import TIME, WEATHER, calls_of, run

ASK = [{"role": "user", "content": "weather in Paris?"}]


def generate(tiny_decoder, use: ToolUse, seed: int, max_tokens: int = 200):
    # (the tools' description alone is longer than the tiny model's 256-token context)
    prompt = tiny_decoder.text_prompt("call")
    params = GenerationParams(SamplingParams(temperature=1.0, seed=seed), max_tokens=max_tokens, tools=use)
    return run(tiny_decoder, prompt, params)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_named_choice_when_sampled_then_one_valid_call_of_that_function(tiny_decoder, seed):
    tokens, fin = generate(tiny_decoder, ToolUse((WEATHER, TIME), choice="get_time", parallel=False), seed)
    assert fin.finish_reason == "tool_calls"
    (call,) = calls_of(tokens, fin)
    assert call["name"] == "get_time" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), TIME.parameters)
    assert "".join(t.text for t in tokens) + fin.text == ""  # no content around a forced call


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_required_when_parallel_then_every_call_valid_for_its_function(tiny_decoder, seed):
    tokens, fin = generate(tiny_decoder, ToolUse((WEATHER, TIME), choice="required"), seed, max_tokens=250)
    calls = calls_of(tokens, fin)
    assert calls
    schemas = {"get_weather": WEATHER.parameters, "get_time": TIME.parameters}
    complete = calls if fin.finish_reason == "tool_calls" else calls[:-1]  # length may cut the last one
    for call in complete:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def test_auto_when_sampled_then_text_or_valid_calls(tiny_decoder):
    seen = set()
    for seed in range(8):
        tokens, fin = generate(
            tiny_decoder, ToolUse((WEATHER,), choice="auto", parallel=False), seed, max_tokens=60
        )
        text = "".join(t.text for t in tokens) + fin.text
        calls = calls_of(tokens, fin)
        if calls:
            assert text == ""
            if fin.finish_reason == "tool_calls":
                jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER.parameters)
            seen.add("call")
        else:
            assert not text.startswith("<tool_call>")
            seen.add("text")
    assert "text" in seen  # random weights rarely open a call on their own


def test_none_when_chosen_then_no_grammar_and_tools_not_shown(tiny_decoder):
    use = ToolUse((WEATHER,), choice="none")
    assert tiny_decoder.chat_ids(ASK, use) == tiny_decoder.chat_ids(ASK)
    assert tool_grammar(use, FORMATS["simmer"]) is None


def test_prompt_when_template_without_tools_then_tools_described_in_system_message(tiny_decoder):
    shown = tiny_decoder.tokenizer.decode(
        tiny_decoder.chat_ids(ASK, ToolUse((WEATHER,))), skip_special_tokens=False
    )
    assert shown.startswith("<|im_start|>system\nYou can call functions")
    assert '"name": "get_weather"' in shown and "<tool_call>" in shown


def test_prompt_when_history_has_calls_and_results_then_written_as_text(tiny_decoder):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    messages, shown = prepare_messages(history, ToolUse((WEATHER,)), FORMATS["simmer"])
    assert shown is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert (
        messages[3]["content"]
        == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )
    tiny_decoder.chat_ids(history, ToolUse((WEATHER,)))  # renders


def test_prompt_when_template_renders_tools_then_it_gets_them_and_dict_arguments():
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]
    messages, shown = prepare_messages(history, ToolUse((WEATHER,)), FORMATS["hermes"])
    assert shown == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER.parameters,
            },
        }
    ]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    text = ChatTemplate(QWEN25).render(messages[:1], tools=shown)
    assert '"name": "get_weather"' in text


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (QWEN25.replace("# Tools", "# Tools <tool_call>"), "hermes"),
        (LLAMA3, "simmer"),
        (GEMMA3, "simmer"),
        (None, "simmer"),
    ],
)
def test_detect_format_when_template_then_its_call_format(source, name):
    assert detect_format(source).name == name


def test_detect_format_when_llama3_template_asks_for_parameters_then_llama3():
    asks = '"parameters": dictionary of argument name and its value}'
    source = LLAMA3 + '{{- \'Respond in the format {"name": function name, ' + asks + ".' }}"
    assert detect_format(source).name == "llama3"


# ---- the reader ------------------------------------------------------------------------------------


def read(fmt: str, text: str, piece: int) -> tuple[str, list[ToolCallDelta]]:
    reader = CallReader(FORMATS[fmt])
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = reader.feed(text[i : i + piece])
        content += c
        deltas += d
    c, d = reader.flush()
    return content + c, deltas + d


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_reader_when_hermes_calls_in_any_pieces_then_same_calls(piece):
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"s": "}\\"{", "n": [1, {"x": 2}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b_2", "arguments": {}}\n</tool_call>'
    )
    content, deltas = read("hermes", text, piece)
    assert content == ""
    assert [(d.index, d.name) for d in deltas if d.name] == [(0, "a"), (1, "b_2")]
    args = ["".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)]
    assert args == ['{"s": "}\\"{", "n": [1, {"x": 2}]}', "{}"]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reader_when_llama3_calls_then_parameters_read(piece):
    content, deltas = read(
        "llama3", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', piece
    )
    assert content == "" and [d.name for d in deltas if d.name] == ["f", "g"]


@pytest.mark.parametrize("text", ["Hello there", "<tool", "<tool_cal", "<b>bold</b>", ""])
def test_reader_when_text_then_all_content(text):
    assert read("simmer", text, 1) == (text, [])
