"""Chat template rendering: the real SmolLM2 template, the ChatML fallback, validation, the sandbox."""

from __future__ import annotations

import pytest

from models.convert.tokenizer_gguf import metadata_from_gguf, tokenizer_from_metadata
from models.errors import InvalidParameter, UnsupportedModel
from models.runtime.chat import CHATML_TEMPLATE, ChatTemplate, validate_messages
from models.runtime.tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
KNOWN_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_gguf) -> Tokenizer:
    return tokenizer_from_metadata(metadata_from_gguf(smollm2_gguf))


@pytest.fixture(scope="module")
def smol_template(smol: Tokenizer) -> ChatTemplate:
    tpl = ChatTemplate.from_tokenizer(smol)
    assert not tpl.is_fallback
    assert (tpl.bos_token, tpl.eos_token) == ("<|im_start|>", "<|im_end|>")
    return tpl


@pytest.mark.slow
def test_render_when_no_system_message_then_default_system_prompt(smol_template: ChatTemplate) -> None:
    assert smol_template.render(QUESTION) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_render_when_system_message_given_then_it_replaces_the_default(smol_template: ChatTemplate) -> None:
    text = smol_template.render([{"role": "system", "content": "Answer in French."}, *QUESTION])
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\n")
    assert DEFAULT_SYSTEM not in text


@pytest.mark.slow
def test_render_when_known_conversation_tokenized_then_known_ids(
    smol: Tokenizer, smol_template: ChatTemplate
) -> None:
    ids = smol.encode(smol_template.render(QUESTION), add_special_tokens=False)
    system_ids = smol.encode(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    assert ids == system_ids + KNOWN_IDS


@pytest.mark.slow
def test_render_when_no_generation_prompt_then_ends_after_last_turn(smol_template: ChatTemplate) -> None:
    assert smol_template.render(QUESTION, add_generation_prompt=False).endswith("France?<|im_end|>\n")


def test_render_when_model_has_no_template_then_plain_chatml() -> None:
    tpl = ChatTemplate(None)
    assert tpl.is_fallback and tpl.source == CHATML_TEMPLATE
    assert (
        tpl.render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_when_content_is_text_parts_then_joined_with_newlines() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "user", "content": parts}]
    assert "one\ntwo<|im_end|>" in ChatTemplate(None).render(messages)
    assert messages[0]["content"] is parts  # the caller's messages are not modified


def test_render_when_template_uses_blocks_then_trim_and_lstrip_like_hugging_face() -> None:
    src = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n"
        "{% endfor %}"
    )
    assert (
        ChatTemplate(src).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "[a]\n[b]\n"
    )


def test_render_when_template_passes_bos_and_tojson_then_available() -> None:
    src = "{{ bos_token }}{{ messages | tojson }}"
    out = ChatTemplate(src, bos_token="<s>").render([{"role": "user", "content": "é <b>"}])
    assert out == '<s>[{"role": "user", "content": "é <b>"}]'


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"content": "x"}], "messages[1].role"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
                }
            ],
            "messages[0].content[1]",
        ),
    ],
)
def test_validate_when_message_is_bad_then_invalid_parameter_names_it(messages: object, param: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        validate_messages(messages)
    assert err.value.param == param
    assert err.value.code == "invalid_parameter"


def test_validate_when_assistant_content_null_then_empty_string() -> None:
    out = validate_messages([{"role": "assistant", "content": None, "tool_calls": []}])
    assert out == [{"role": "assistant", "content": "", "tool_calls": []}]


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_render_when_template_reaches_for_internals_then_security_error(source: str) -> None:
    with pytest.raises(UnsupportedModel, match="unsafe"):
        ChatTemplate(source).render(QUESTION)


def test_render_when_template_raises_exception_then_invalid_parameter_with_its_message() -> None:
    src = (
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('System message first, please') }}{% endif %}"
    )
    with pytest.raises(InvalidParameter, match="System message first") as err:
        ChatTemplate(src).render(QUESTION)
    assert err.value.param == "messages"


def test_template_when_it_does_not_compile_then_unsupported_model() -> None:
    with pytest.raises(UnsupportedModel, match="does not compile"):
        ChatTemplate("{% for %}")
