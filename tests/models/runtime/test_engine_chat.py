"""The engine's chat side: a model without a chat template serves completions only, unless the operator
gives one (SIMMER_CHAT_TEMPLATE); message text cannot forge turns on the real engine path either."""

from __future__ import annotations

import pytest

from models.errors import ModelNotChat
from models.runtime.engine import load_engine
from models.types import FinishEvent, GenerationParams, SamplingParams
from tests import chat_templates

HELLO = [{"role": "user", "content": "hello"}]


def test_engine_when_model_has_no_template_then_completions_only(tiny_base_model_dir) -> None:
    engine = load_engine(tiny_base_model_dir, variant="q4", threads=1, context_length=128)
    assert engine.can_chat is False
    with pytest.raises(ModelNotChat) as err:
        engine.chat_prompt(HELLO)
    assert err.value.code == "model_not_chat" and err.value.param == "model"
    assert "tiny-base" in err.value.message and "SIMMER_CHAT_TEMPLATE" in err.value.message
    greedy = GenerationParams(SamplingParams(temperature=0.0), max_tokens=3)
    events = list(engine.generate(engine.text_prompt("hello"), greedy))
    assert isinstance(events[-1], FinishEvent)


def test_engine_when_operator_gives_template_then_chat_with_it(tiny_base_model_dir, tiny_model_dir) -> None:
    engine = load_engine(
        tiny_base_model_dir, variant="q4", threads=1, context_length=128, chat_template=chat_templates.QWEN25
    )
    assert engine.can_chat is True
    text = engine.template.render(HELLO)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert engine.chat_prompt(HELLO).ids == engine.tokenizer.encode(text, add_special_tokens=False)
    # and it replaces a model's own template too
    own = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    other = load_engine(tiny_model_dir, variant="q4", threads=1, chat_template="{{ 'x' }}")
    assert own.chat_prompt(HELLO).ids != other.chat_prompt(HELLO).ids == other.tokenizer.encode("x")


def test_engine_when_message_holds_markers_then_they_are_text(tiny_model_dir) -> None:
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    tok = engine.tokenizer
    plain = engine.chat_prompt(HELLO).ids
    for marker in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        ids = engine.chat_prompt([{"role": "user", "content": "hello" + marker}]).ids
        assert [i for i in ids if i in tok.special_ids] == [i for i in plain if i in tok.special_ids]
        assert len(ids) > len(plain) + 1
    # /v1/completions keeps parsing them in raw prompts, as llama.cpp does
    assert tok.token_to_id("<|im_end|>") in engine.text_prompt("hello<|im_end|>").ids
