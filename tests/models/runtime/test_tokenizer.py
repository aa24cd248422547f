"""Tokenizer and incremental detokenizer: a tiny synthetic vocabulary, then the real SmolLM2 GGUF."""

from __future__ import annotations

import json

import pytest
import tokenizers

from models.convert.tokenizer_gguf import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    metadata_from_gguf,
    tokenizer_from_metadata,
)
from models.errors import InvalidModelFile
from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, byte_decoder
from tests.tiny_vocab import FAMILIES, family_metadata

KNOWN_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
KNOWN_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
STREAM_TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🌍🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "Mixed: café naïve Ærøskøbing — “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 2024-05-06",
]


def tiny_meta(*, pre: str = "smollm", add_bos: bool = False, **extra: object) -> dict:
    """Three control tokens, one user-defined token, the 256 byte tokens, then a few merges."""
    chars = sorted(byte_decoder(), key=lambda c: byte_decoder()[c])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, "<tool>", *chars, "Ġt", "he", "Ġthe", "12"]
    types = [TOKEN_CONTROL] * 3 + [TOKEN_USER_DEFINED] + [TOKEN_NORMAL] * (len(tokens) - 4)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "1 2"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    meta.update(extra)
    return meta


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return tokenizer_from_metadata(tiny_meta())


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


# -- tiny vocabulary ----------------------------------------------------------------------------------


def test_encode_when_merges_exist_then_bpe_applies_them(tiny_tokenizer: Tokenizer) -> None:
    assert pieces(tiny_tokenizer, "a the") == ["a", "Ġthe"]


def test_encode_when_pre_is_smollm_then_digits_split_even_with_a_merge(tiny_tokenizer: Tokenizer) -> None:
    assert pieces(tiny_tokenizer, "12") == ["1", "2"]
    plain = tokenizer_from_metadata(tiny_meta(pre="gpt-2"))
    assert pieces(plain, "12") == ["12"]


def test_encode_when_control_token_text_then_single_special_id(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("<|im_start|>the<|im_end|><tool>")
    assert ids[0] == 1 and ids[-2] == 2 and ids[-1] == 3
    assert tiny_tokenizer.special_ids == {0, 1, 2}
    # Control tokens vanish from decoded text; user-defined ones stay, as llama.cpp renders them.
    assert tiny_tokenizer.decode(ids) == "the<tool>"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>the<|im_end|><tool>"


def test_encode_when_add_bos_then_bos_first_unless_disabled() -> None:
    tok = tokenizer_from_metadata(tiny_meta(add_bos=True))
    assert tok.encode("the")[0] == 1
    assert tok.encode("the", add_special_tokens=False)[0] != 1
    assert tokenizer_from_metadata(tiny_meta()).encode("the")[0] != 1


def test_eos_ids_when_gguf_names_eos_and_eot_then_both_plus_control_end_tokens() -> None:
    tok = tokenizer_from_metadata(tiny_meta(**{"tokenizer.ggml.eot_token_id": 3}))
    # 2 = eos, 3 = eot, 0 = the control token <|endoftext|> (llama.cpp's end-of-generation list).
    assert tok.eos_id == 2
    assert tok.eos_ids == {0, 2, 3}
    assert 1 not in tok.eos_ids


def test_save_when_reloaded_then_same_ids_and_facts(tiny_tokenizer: Tokenizer, tmp_path) -> None:
    tok = tokenizer_from_metadata(tiny_meta(add_bos=True))
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    text = "<|im_start|>the 12 thé<|im_end|>"
    assert again.encode(text) == tok.encode(text)
    assert (again.bos_id, again.eos_id, again.eos_ids, again.add_bos) == (1, 2, tok.eos_ids, True)
    assert again.chat_template == tok.chat_template
    assert again.special_ids == tok.special_ids


def test_save_when_sentencepiece_reloaded_then_same_ids_bytes_and_kind(tmp_path) -> None:
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"]))
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert (again.kind, again.add_space_prefix, again.add_bos) == ("sentencepiece", True, True)
    text = "<s>Hello  world 🦙\n<|user|>x"
    assert again.encode(text) == tok.encode(text)
    assert again.encode(text, parse_special=False) == tok.encode(text, parse_special=False)
    assert [again.token_bytes(i) for i in tok.encode(text)] == [tok.token_bytes(i) for i in tok.encode(text)]
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_load_when_folder_predates_sentencepiece_then_byte_level(tiny_tokenizer: Tokenizer, tmp_path) -> None:
    tiny_tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for key in ("tokenizer_kind", "add_space_prefix", "add_eos_token"):
        del config[key]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    again = Tokenizer.load(tmp_path)
    assert again.kind == "byte_level"
    assert again.token_bytes(again.encode(" the")[0]) == b" the"


def test_tokenizer_when_kind_not_given_then_told_by_the_decoder() -> None:
    """A foreign folder's tokenizer.json (onnxruntime-genai) says nothing of our kinds."""
    for family, kind in (
        ("llama2", "sentencepiece"),
        ("spm-noprefix", "sentencepiece"),
        ("llama3", "byte_level"),
    ):
        built = tokenizer_from_metadata(family_metadata(FAMILIES[family]))
        foreign = Tokenizer(tokenizers.Tokenizer.from_str(built.hf.to_str()), bos_id=None, eos_id=None)
        assert foreign.kind == kind
        ids = built.encode(" ▁é 🦙", add_special_tokens=False)
        assert [foreign.token_bytes(i) for i in ids] == [built.token_bytes(i) for i in ids]
    metaspace = tokenizers.Tokenizer(tokenizers.models.BPE())
    metaspace.decoder = tokenizers.decoders.Metaspace()
    assert Tokenizer(metaspace, bos_id=None, eos_id=None).kind == "sentencepiece"


def test_load_when_folder_empty_then_invalid_model_file(tmp_path) -> None:
    with pytest.raises(InvalidModelFile):
        Tokenizer.load(tmp_path)


def test_token_bytes_when_byte_token_then_raw_byte(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("é")  # no merge for it: one token per UTF-8 byte
    assert [tiny_tokenizer.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]
    assert tiny_tokenizer.token_bytes(tiny_tokenizer.encode(" the")[0]) == b" the"
    assert tiny_tokenizer.token_bytes(2) == b"<|im_end|>"


def test_encode_when_special_tokens_not_parsed_then_marker_is_text(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("hi<|im_end|>", parse_special=False)
    assert 2 not in ids and len(ids) > 2
    assert tiny_tokenizer.decode(ids) == "hi<|im_end|>"
    assert (
        tiny_tokenizer.encode("hi<tool>", parse_special=False)[-1] == 3
    )  # user-defined tokens are always matched


def test_encode_when_literal_spans_then_markers_inside_are_text(tiny_tokenizer: Tokenizer) -> None:
    markup, content = "<|im_start|>user\n", "hi<|im_end|><|im_start|>system"
    text = markup + content + "<|im_end|>\n"
    span = (len(markup), len(markup) + len(content))
    ids = tiny_tokenizer.encode(text, add_special_tokens=False, literal_spans=[span])
    expected = [
        1,
        *tiny_tokenizer.encode("user\n"),
        *tiny_tokenizer.encode(content, parse_special=False),
        2,
        *tiny_tokenizer.encode("\n"),
    ]
    assert ids == expected
    assert ids.count(1) == 1 and ids.count(2) == 1  # only the markup's own markers are special
    # A span without markers changes nothing; a span cutting into a marker makes that marker text.
    assert tiny_tokenizer.encode(
        "<|im_start|>ab<|im_end|>", literal_spans=[(12, 14)]
    ) == tiny_tokenizer.encode("<|im_start|>ab<|im_end|>")
    cut = tiny_tokenizer.encode("ab<|im_end|>", literal_spans=[(0, 3)])
    assert 2 not in cut and cut == tiny_tokenizer.encode("ab<|im_end|>", parse_special=False)


def test_encode_when_literal_spans_and_bos_added_then_bos_once(tmp_path) -> None:
    tok = tokenizer_from_metadata(tiny_meta(add_bos=True))
    ids = tok.encode("x<|im_end|>", literal_spans=[(0, 11)])
    assert ids[0] == 1 and ids.count(1) == 1 and 2 not in ids


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.feed(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_when_characters_split_over_tokens_then_no_replacement_char(
    tiny_tokenizer: Tokenizer, text: str
) -> None:
    ids = tiny_tokenizer.encode(text)
    deltas = stream(tiny_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == text
    assert "" in deltas[:-1]  # some bytes really were held back


def test_detokenizer_when_special_tokens_then_skipped_like_decode(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("<|im_start|>你<|im_end|>")
    assert "".join(stream(tiny_tokenizer, ids)) == tiny_tokenizer.decode(ids) == "你"


def test_detokenizer_when_bytes_invalid_or_unfinished_then_same_as_decode(tiny_tokenizer: Tokenizer) -> None:
    b = byte_decoder()
    by_byte = {v: tiny_tokenizer.token_to_id(k) for k, v in b.items()}
    ids = [by_byte[0xFF], by_byte[ord("a")], by_byte[0xE4], by_byte[0xBD]]  # invalid byte, then a cut char
    deltas = stream(tiny_tokenizer, ids)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == "\ufffda\ufffd"


# -- the real SmolLM2 tokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_meta(smollm2_gguf) -> dict:
    return metadata_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return tokenizer_from_metadata(smol_meta)


@pytest.mark.slow
def test_metadata_from_gguf_when_smollm2_then_vocab_and_facts(smol_meta: dict) -> None:
    assert len(smol_meta["tokenizer.ggml.tokens"]) == 49152
    assert len(smol_meta["tokenizer.ggml.merges"]) == 48900
    assert smol_meta["tokenizer.ggml.pre"] == "smollm"
    assert smol_meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert isinstance(smol_meta["tokenizer.chat_template"], str)


@pytest.mark.slow
def test_encode_when_known_prompt_then_known_ids(smol: Tokenizer) -> None:
    assert smol.encode(KNOWN_PROMPT) == KNOWN_IDS
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    # <|im_end|> (eos), <|endoftext|> and <reponame> (a fill-in-the-middle end), as llama.cpp has them
    assert smol.eos_ids == {0, 2, 4} and smol.text_of(4) == "<reponame>"
    assert smol.vocab_size == 49152


@pytest.mark.slow
def test_encode_when_real_model_then_digits_one_per_token(smol: Tokenizer) -> None:
    ids = smol.encode("In 2024 there were 1234567 users")
    digit_pieces = [smol.decode([i]) for i in ids if smol.decode([i]).strip().isdigit()]
    assert "".join(digit_pieces) == "20241234567"
    assert all(len(p) == 1 for p in digit_pieces)


@pytest.mark.slow
@pytest.mark.parametrize("text", [*STREAM_TEXTS, "def f(x):\n    return x ** 2  # tabs\tand  spaces\n"])
def test_decode_when_real_model_then_round_trips(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text)) == text


@pytest.mark.slow
def test_save_when_real_model_reloaded_then_same_ids(smol: Tokenizer, tmp_path) -> None:
    smol.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    for text in [KNOWN_PROMPT, *STREAM_TEXTS]:
        assert again.encode(text) == smol.encode(text)
    assert again.eos_ids == smol.eos_ids
    assert again.chat_template == smol.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_when_real_model_streams_cjk_and_emoji_then_equals_full_decode(
    smol: Tokenizer, text: str
) -> None:
    ids = smol.encode(text)
    deltas = stream(smol, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smol.decode(ids) == text
    # The real vocabulary does split some of these characters across tokens.
    assert any("\ufffd" in smol.token_text(i) for i in ids)
