"""Tokenizers built from GGUF metadata give llama.cpp's ids and pieces.

Golden fixtures (tests/fixtures/tokens_*.json, made by tests/fixtures/make_token_fixtures.py with
llama-cpp-python) cover synthetic Llama 3 / Qwen 2 / Qwen 3.5 / SmolLM / GPT-2 / default / Tekken BPE and
Llama 2 / Gemma style SentencePiece vocabularies, plus the real SmolLM2 and Gemma 3 GGUFs. When llama_cpp
is importable, the same texts and a few hundred random ones are also compared live.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from models.convert.tokenizer_gguf import (
    PRE_TOKENIZERS,
    build_hf_tokenizer,
    metadata_from_gguf,
    tokenizer_from_metadata,
)
from models.errors import InvalidModelFile, UnsupportedModel
from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_vocab import CONTROL, FAMILIES, FIXTURES, Family, family_metadata, write_vocab_gguf

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA_CPP = True
except ImportError:
    HAVE_LLAMA_CPP = False
needs_llama_cpp = pytest.mark.skipif(
    not HAVE_LLAMA_CPP,
    reason="llama_cpp (llama-cpp-python) is not installed; the golden fixtures made with it still ran",
)

SYNTHETIC = sorted(FAMILIES)
MODES = [(add, parse) for add in (False, True) for parse in (False, True)]


@cache
def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"tokens_{name}.json").read_text())


@cache
def synthetic(name: str) -> Tokenizer:
    return tokenizer_from_metadata(family_metadata(FAMILIES[name]))


def mismatches(tok: Tokenizer, doc: dict[str, Any]) -> list[str]:
    """Every way our tokenizer differs from llama.cpp's recorded ids, pieces and vocabulary facts."""
    bad = []
    for case in doc["cases"]:
        text = case["text"]
        for add, parse in MODES:
            want = case[f"ids_add{int(add)}_parse{int(parse)}"]
            got = tok.encode(text, add_special_tokens=add, parse_special=parse)
            if got != want:
                bad.append(f"{text!r} add={add} parse={parse}: {got} != llama.cpp {want}")
        # llama.cpp's token_to_piece without specials: control tokens render as nothing
        pieces = [b"" if i in tok.special_ids else tok.token_bytes(i) for i in case["ids_add1_parse1"]]
        if [p.hex() for p in pieces] != case["pieces"]:
            bad.append(f"{text!r}: pieces {pieces} != llama.cpp {[bytes.fromhex(p) for p in case['pieces']]}")
    facts = doc["vocab"]
    ours = {
        "n_tokens": tok.vocab_size,
        "bos": tok.bos_id,
        "eos": tok.eos_id,
        "add_bos": tok.add_bos,
        "add_eos": tok.add_eos,
        "eog_ids": sorted(tok.eos_ids),
        "special_ids": sorted(tok.special_ids),
        "user_defined_ids": sorted(tok.added_ids - tok.special_ids),
    }
    bad += [f"{k}: {ours[k]} != llama.cpp {v}" for k, v in facts.items() if ours[k] != v]
    return bad


# -- golden fixtures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SYNTHETIC)
def test_ids_when_synthetic_family_then_equal_llama_cpp(name: str) -> None:
    doc = fixture(name)
    assert doc["source"] == {"family": name}
    assert mismatches(synthetic(name), doc) == []


def test_fixtures_cover_every_pre_tokenizer_behaviour() -> None:
    """Each distinct pre-tokenizer (aliases aside) has a family; the fixtures hold the tricky texts."""
    tested = {PRE_TOKENIZERS[FAMILIES[n].pre or "default"] for n in SYNTHETIC if FAMILIES[n].model == "gpt2"}
    assert tested == set(PRE_TOKENIZERS.values()) - {PRE_TOKENIZERS["dbrx"]}
    texts = {c["text"] for c in fixture("gemma3")["cases"]}
    for needle in ["", "   hello", "\r\n", "\t\tx", "👩‍👩‍👧", "你好", "1234567890", "<end_of_turn>", "🦙"]:
        assert any(needle in t for t in texts) or needle in texts


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@cache
def real(path: Path) -> Tokenizer:
    return tokenizer_from_metadata(metadata_from_gguf(path))


@pytest.mark.slow
def test_ids_when_real_smollm2_then_equal_llama_cpp(smollm2_gguf: Path) -> None:
    doc = fixture("smollm2")
    assert doc["source"]["sha256"] == sha256(smollm2_gguf)
    assert mismatches(real(smollm2_gguf), doc) == []


@pytest.mark.slow
def test_ids_when_real_gemma3_then_equal_llama_cpp(gemma3_gguf: Path) -> None:
    doc = fixture("gemma3")
    assert doc["source"]["sha256"] == sha256(gemma3_gguf)
    tok = real(gemma3_gguf)
    assert mismatches(tok, doc) == []
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (
        "sentencepiece",
        2,
        1,
        True,
        False,
    )
    assert tok.token_to_id("<end_of_turn>") == 106 and 106 in tok.eos_ids
    assert tok.chat_template is None  # the base model: completions only
    # simmer runs the compact SentencePiece; the tokenizer.json written for other runtimes agrees too
    assert tok.spm is not None and tok.hf is not None
    from_json = Tokenizer(
        tok.hf,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        eos_ids=tok.eos_ids,
        unk_id=tok.unk_id,
        add_bos=tok.add_bos,
        add_space_prefix=tok.add_space_prefix,
        kind=tok.kind,
    )
    assert mismatches(from_json, doc) == []


# -- decoding ----------------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tok)
    return "".join(detok.feed(i) for i in ids) + detok.flush()


@pytest.mark.parametrize("name", SYNTHETIC)
def test_decode_when_text_encoded_then_round_trips_and_streams_llama_cpp_pieces(name: str) -> None:
    tok = synthetic(name)
    user_texts = [tok.text_of(i) for i in tok.added_ids - tok.special_ids]
    for case in fixture(name)["cases"]:
        text = case["text"]
        # llama.cpp puts a space after every user-defined token when it adds a space prefix
        if not (tok.add_space_prefix and any(u in text for u in user_texts)):
            assert tok.decode(tok.encode(text, parse_special=False)) == text
        ids = case["ids_add1_parse1"]
        llama_cpp_text = b"".join(bytes.fromhex(p) for p in case["pieces"]).decode("utf-8", errors="replace")
        assert stream(tok, ids) == llama_cpp_text


def test_token_bytes_when_sentencepiece_then_space_and_byte_tokens_raw() -> None:
    tok = synthetic("llama2")
    ids = tok.encode("🦙 a", add_special_tokens=False)  # the prefix space, then four <0xXX> tokens
    assert [tok.text_of(i) for i in ids[:5]] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " 🦙 a".encode()
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed(i) for i in ids] == [
        " ",
        "",
        "",
        "",
        "🦙",
        " a",
    ]  # bytes held until the character is whole
    assert tok.decode(ids) == "🦙 a"


# -- what is not supported -------------------------------------------------------------------------


def test_build_when_tokenizer_model_unknown_then_unsupported_model_names_it_and_the_supported() -> None:
    meta = family_metadata(FAMILIES["gpt2"]) | {"tokenizer.ggml.model": "t5"}
    with pytest.raises(UnsupportedModel, match=r"'t5'.*'gpt2'.*'llama'"):
        build_hf_tokenizer(meta)


@pytest.mark.parametrize("pre", ["gpt2", "jais-2", "chatglm-bpe", "kimi-k2"])
def test_build_when_pre_tokenizer_unknown_then_unsupported_model_names_it_and_the_supported(pre: str) -> None:
    meta = family_metadata(FAMILIES["gpt2"]) | {"tokenizer.ggml.pre": pre}
    with pytest.raises(UnsupportedModel, match=f"'{pre}'.*supported: .*llama-bpe.*qwen2.*smollm") as err:
        build_hf_tokenizer(meta)
    assert err.value.code == "unsupported_model"


def test_build_when_pre_tokenizer_missing_then_default_like_llama_cpp() -> None:
    meta = family_metadata(FAMILIES["default"])
    assert "tokenizer.ggml.pre" not in meta
    assert mismatches(synthetic("default"), fixture("default")) == []


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"tokenizer.ggml.merges": ["abc"]}, "merge"),
        ({"tokenizer.ggml.merges": ["a zzz-not-a-token"]}, "merge"),
        ({"tokenizer.ggml.tokens": []}, "vocabulary"),
        ({"tokenizer.ggml.token_type": [1]}, "token types"),
    ],
)
def test_build_when_metadata_broken_then_invalid_model_file(change: dict, error: str) -> None:
    with pytest.raises(InvalidModelFile, match=error):
        build_hf_tokenizer(family_metadata(FAMILIES["gpt2"]) | change)


def test_build_when_sentencepiece_without_scores_then_invalid_model_file() -> None:
    meta = family_metadata(FAMILIES["llama2"])
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(InvalidModelFile, match="scores"):
        build_hf_tokenizer(meta)


def test_metadata_from_gguf_when_not_a_gguf_then_invalid_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(InvalidModelFile, match="not a GGUF"):
        metadata_from_gguf(bad)
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(8) + b"\x05" + bytes(7) + b"\x40")  # ends inside a key
    with pytest.raises(InvalidModelFile, match="ends inside"):
        metadata_from_gguf(bad)


def test_metadata_from_gguf_when_written_by_gguf_package_then_same_keys(tmp_path: Path) -> None:
    meta = family_metadata(FAMILIES["llama2"])
    read = metadata_from_gguf(write_vocab_gguf(tmp_path / "v.gguf", meta))
    assert read == meta | {"tokenizer.ggml.scores": read["tokenizer.ggml.scores"]}
    assert read["tokenizer.ggml.scores"] == pytest.approx(meta["tokenizer.ggml.scores"])


# -- llama.cpp's typing of tokens by their text ----------------------------------------------------


def test_types_when_end_token_is_user_defined_then_control_and_end_of_generation() -> None:
    tok = synthetic("qwen2")
    pad = tok.token_to_id("<|fim_pad|>")  # user-defined in the GGUF
    assert pad in tok.special_ids and pad in tok.eos_ids
    assert tok.token_to_id("<tool_call>") not in tok.special_ids  # stays user-defined
    assert tok.encode("a<|fim_pad|>", parse_special=False) != tok.encode("a<|fim_pad|>")


def test_types_when_harmony_end_tokens_then_end_is_ordinary() -> None:
    specials = (("<|return|>", CONTROL), ("<|call|>", CONTROL), ("<|end|>", CONTROL), ("<|start|>", CONTROL))
    meta = family_metadata(Family("harmony", "gpt2", "gpt-2", specials, eos="<|return|>"))
    tok = tokenizer_from_metadata(meta)
    end, start = tok.token_to_id("<|end|>"), tok.token_to_id("<|start|>")
    assert end not in tok.eos_ids and end not in tok.special_ids  # user-defined: rendered, never a stop
    assert start not in tok.special_ids  # gpt-oss markup llama.cpp always renders
    assert {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")} <= tok.eos_ids


# -- live comparison with llama.cpp ----------------------------------------------------------------

POOL = [
    *"aAzZeEtTsSlLdD0123456789", *[" "] * 8, "\t", "\n", "\n", "\r", "'", "'s", "'LL", ".", ",", "!", "?",
    "$", "+", "<", "=", ">", "^", "~", "|", "`", "/", "-", "_", "{", "}", "é", "ø", "Æ", "e\u0301", "你",
    "好", "。", "，", "カ", "한", "𠜎", "🌍", "👩\u200d👩\u200d👧", "👍🏽", "🇫🇷", "🦙", "\u00a0", "\u3000",
    "\u2028", "\u0085", "\u200b", "\ue000", "Ａ", "𝔘", "\x00", "1234", "  ", "\n\n", " the", "HTTP", "Value",
    "<s>", "</s>", "<|im_end|>", "<|im_start|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<0x41>",
    "▁", "Ġ",
]  # fmt: skip


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def live_mismatches(tok: Tokenizer, gguf: Path, texts: list[str]) -> list[str]:
    from tests.fixtures.make_token_fixtures import LlamaCppVocab

    vocab = LlamaCppVocab(gguf)
    bad = []
    for text in texts:
        for add, parse in MODES:
            want = vocab.tokenize(text, add, parse)
            if tok.encode(text, add_special_tokens=add, parse_special=parse) != want:
                bad.append(f"{text!r} add={add} parse={parse}")
        ids = vocab.tokenize(text, True, True)
        if [b"" if i in tok.special_ids else tok.token_bytes(i) for i in ids] != [
            vocab.piece(i) for i in ids
        ]:
            bad.append(f"{text!r}: pieces")
    return bad


@needs_llama_cpp
@pytest.mark.parametrize("name", SYNTHETIC)
def test_live_when_llama_cpp_installed_then_synthetic_families_equal(name: str, tmp_path: Path) -> None:
    from tests.fixtures.make_token_fixtures import texts_for

    meta = family_metadata(FAMILIES[name])
    gguf = write_vocab_gguf(tmp_path / f"{name}.gguf", meta)
    texts = texts_for(meta) + random_texts(seed=len(name), n=150)
    assert live_mismatches(synthetic(name), gguf, texts) == []


@needs_llama_cpp
@pytest.mark.slow
def test_live_when_llama_cpp_installed_then_real_models_equal(smollm2_gguf: Path, gemma3_gguf: Path) -> None:
    from tests.fixtures.make_token_fixtures import texts_for

    for path in (smollm2_gguf, gemma3_gguf):
        texts = texts_for(metadata_from_gguf(path)) + random_texts(seed=7, n=300)
        texts.append(
            Path(__file__).read_text()
        )  # a long text: SentencePiece merges over thousands of symbols
        assert live_mismatches(real(path), path, texts) == [], path.name
