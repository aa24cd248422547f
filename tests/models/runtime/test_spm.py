"""The compact SentencePiece tokenizer (models/runtime/spm.py): llama.cpp's ids, its own file, no JSON.

The golden llama.cpp ids for the SentencePiece families and the real Gemma 3 vocabulary are checked in
test_tokenizer_gguf.py (which now runs through spm.py); here: what is specific to it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from models.convert.tokenizer_gguf import tokenizer_from_metadata
from models.errors import InvalidModelFile
from models.runtime import spm as spm_module
from models.runtime.spm import VOCAB_FILE, SentencePiece
from models.runtime.tokenizer import TOKENIZER_JSON, Tokenizer
from tests.tiny_vocab import (
    CONTROL,
    FAMILIES,
    UNKNOWN,
    USER_DEFINED,
    Family,
    family_metadata,
    write_vocab_gguf,
)

SPM_FAMILIES = ["llama2", "spm-noprefix"]

# Two user-defined tokens that overlap in "<x>yz": llama.cpp splits out the longer one first, wherever
# it is, so "<" stays text; a leftmost-longest matcher (Hugging Face's added tokens) takes "<x" first.
OVERLAP = Family(
    "spm-overlap",
    "llama",
    None,
    (("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<x", USER_DEFINED), ("x>yz", USER_DEFINED),
     ("<ctl>", CONTROL)),
    bos="<s>",
    eos="</s>",
    unk="<unk>",
)  # fmt: skip


def fixture_texts(name: str) -> list[str]:
    doc = json.loads((Path(__file__).parents[2] / "fixtures" / f"tokens_{name}.json").read_text())
    return [case["text"] for case in doc["cases"]]


def test_partition_when_user_defined_tokens_overlap_then_longest_first_like_llama_cpp() -> None:
    tok = tokenizer_from_metadata(family_metadata(OVERLAP))
    xyz, lt_x, lt = tok.token_to_id("x>yz"), tok.token_to_id("<x"), tok.encode("<", add_special_tokens=False)
    assert tok.encode("<x>yz", add_special_tokens=False) == [*lt, xyz]
    # "x>yz" twice first; then "<x" only where it overlaps neither; the "<" left over gets the prefix space
    assert tok.encode("<x<x>yzx>yz", add_special_tokens=False) == [lt_x, *lt, xyz, xyz]
    # without parse_special a control token is text; user-defined ones are still split out
    ctl = tok.encode("<ctl><x", add_special_tokens=False, parse_special=False)
    assert ctl[-1] == lt_x and tok.token_to_id("<ctl>") not in ctl


def test_partition_when_special_inside_literal_span_then_text() -> None:
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["spm-noprefix"]))
    text = "<start_of_turn>user\nsay <end_of_turn> please<end_of_turn>"
    inner = text.index("<end_of_turn>")
    ids = tok.encode(text, add_special_tokens=False, literal_spans=[(inner, inner + len("<end_of_turn>"))])
    end = tok.token_to_id("<end_of_turn>")
    assert end is not None and ids.count(end) == 1 and ids[-1] == end
    assert ids[0] == tok.token_to_id("<start_of_turn>")


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_load_when_sentencepiece_then_compact_file_and_no_tokenizer_json(family: str, tmp_path: Path) -> None:
    """Gemma 3's tokenizer.json is ~100 MB resident once parsed (300 MB while parsing): not read at all."""
    tok = tokenizer_from_metadata(family_metadata(FAMILIES[family]))
    tok.save(tmp_path)
    assert (tmp_path / VOCAB_FILE).is_file() and (tmp_path / TOKENIZER_JSON).is_file()  # still for genai
    (tmp_path / TOKENIZER_JSON).write_text("not json")
    again = Tokenizer.load(tmp_path)
    assert again.hf is None and again.spm is not None
    assert (again.vocab_size, again.special_ids, again.added_ids) == (
        tok.vocab_size,
        tok.special_ids,
        tok.added_ids,
    )
    assert (again.bos_id, again.eos_id, again.unk_id, again.eos_ids) == (
        tok.bos_id,
        tok.eos_id,
        tok.unk_id,
        tok.eos_ids,
    )
    for text in fixture_texts(family):
        for parse in (False, True):
            assert again.encode(text, parse_special=parse) == tok.encode(text, parse_special=parse), text
    assert [again.token_bytes(i) for i in range(again.vocab_size)] == [
        tok.token_bytes(i) for i in range(tok.vocab_size)
    ]


def test_load_when_byte_level_then_no_sentencepiece_file(tmp_path: Path) -> None:
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["llama3"]))
    tok.save(tmp_path)
    assert not (tmp_path / VOCAB_FILE).exists()
    assert Tokenizer.load(tmp_path).spm is None  # its own compact file: test_bpe.py


def test_load_when_compact_file_broken_then_invalid_model_file(tmp_path: Path) -> None:
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"]))
    tok.save(tmp_path)
    with np.load(tmp_path / VOCAB_FILE) as f:
        arrays = dict(f)
    np.savez(tmp_path / VOCAB_FILE, **(arrays | {"lengths": arrays["lengths"][:-1]}))
    with pytest.raises(InvalidModelFile, match=VOCAB_FILE):
        Tokenizer.load(tmp_path)
    (tmp_path / VOCAB_FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(InvalidModelFile):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_tokenizer_json_when_sentencepiece_then_same_ids_as_compact(family: str) -> None:
    """The tokenizer.json still written for onnxruntime-genai gives the same ids as what simmer runs."""
    meta = family_metadata(FAMILIES[family])
    compact, hf = tokenizer_from_metadata(meta), tokenizer_from_metadata(meta, compact=False)
    assert compact.spm is not None and hf.spm is None
    texts = fixture_texts(family) + random_texts(7, 200)
    for text in texts:
        for parse in (False, True):
            assert compact.encode(text, parse_special=parse) == hf.encode(text, parse_special=parse), text


def test_cuts_when_any_token_then_never_inside_it() -> None:
    """A cut falls only between two characters that no token holds side by side."""
    spm = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"])).spm
    assert spm is not None
    tokens = [spm.id_to_token(i) for i in range(spm.vocab_size)]
    assert all(spm._cuts(t) == [] for t in tokens)
    assert spm._cuts("a🌍") == [1]  # no token holds "a🌍"


def test_encode_when_caches_overflow_then_same_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"]))
    texts = fixture_texts("llama2") + random_texts(3, 100)
    want = [tok.encode(t) for t in texts]
    monkeypatch.setattr(spm_module, "CACHE_PIECES", 2)
    monkeypatch.setattr(spm_module, "MEMO_KEYS", 3)
    fresh = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"]))
    assert [fresh.encode(t) for t in texts] == want
    assert [fresh.encode(t) for t in texts] == want  # again, from the (tiny) caches


def test_vocabulary_when_duplicate_tokens_then_invalid_model_file() -> None:
    with pytest.raises(InvalidModelFile, match="duplicate"):
        SentencePiece.from_tokens(["a", "b", "a"], [0.0] * 3, [1] * 3, add_space_prefix=False)


POOL = ["<", "x", ">", "y", "z", "<x", "x>yz", "<ctl>", " ", "  ", "\n", "a", "é", "🦙", "<s>", "</s>"]


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(0, 16))) for _ in range(n)]


def test_live_when_overlapping_specials_then_equal_llama_cpp(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama_cpp (llama-cpp-python) is not installed")
    from tests.fixtures.make_token_fixtures import LlamaCppVocab

    meta = family_metadata(OVERLAP)
    vocab = LlamaCppVocab(write_vocab_gguf(tmp_path / "overlap.gguf", meta))
    tok = tokenizer_from_metadata(meta)
    bad = []
    for text in random_texts(11, 300):
        for add in (False, True):
            for parse in (False, True):
                if tok.encode(text, add_special_tokens=add, parse_special=parse) != vocab.tokenize(
                    text, add, parse
                ):
                    bad.append((text, add, parse))
    assert bad == []
