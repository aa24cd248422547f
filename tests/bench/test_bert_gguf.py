"""bench/bert_gguf.py: all-MiniLM-L6-v2 written as llama.cpp's `bert` GGUF, loaded by llama.cpp and read
the way simmer reads it (the same token ids, the same vectors, from the folder and from the GGUF); and the
small parts of `simmer bench embed`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bench.bert_gguf import phantom, vocabulary, write_bert_gguf
from bench.embed_bench import cpu_class, machine_busy_s
from bench.embed_sentences import sentences
from models.convert.encoder_convert import convert_encoder, convert_encoder_gguf
from tests.reference_bert import minilm_folder

TEXTS = [
    "hello world",
    "The cat sat on the mat.",
    "Unbelievably, the café's décor was ___ 100% \"retro\"; I'd go again!",
    "Ein Satz auf Deutsch, mit Umlauten: Grüße!",
    "HTTP/1.1 200 OK at 3.14159 s, twice.",
    *sentences(3),
]


def test_phantom_when_word_or_continuation_then_llama_cpp_spelling():
    assert (phantom("cat"), phantom("##s")) == ("\u2581cat", "s")
    assert phantom("[CLS]", 3) == "[CLS]"  # CONTROL: as it is
    assert phantom("[unused0]") == "\u2581[unused0]"  # a vocabulary entry that only looks special


def test_vocabulary_when_specials_and_gaps_then_control_unused_and_normal():
    tokenizer = {
        "model": {"type": "WordPiece", "vocab": {"[PAD]": 0, "[CLS]": 1, "cat": 2, "##s": 3, "hi": 5}},
        "added_tokens": [
            {"id": 0, "content": "[PAD]", "special": True},
            {"id": 1, "content": "[CLS]", "special": True},
            {"id": 5, "content": "hi", "special": False},
        ],
    }
    tokens, types = vocabulary(tokenizer, 6)
    # a non-special added token is respelled like any word (convert_hf_to_gguf.py keeps CONTROL alone)
    assert tokens == ["[PAD]", "[CLS]", "\u2581cat", "s", "[PAD4]", "\u2581hi"]
    assert types == [3, 3, 1, 1, 5, 4]  # CONTROL, CONTROL, NORMAL, NORMAL, UNUSED, USER_DEFINED


def test_cpu_class_when_flags_then_the_best_class(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert cpu_class(info, "x86_64") == "AVX-512 VNNI"
    info.write_text("flags\t\t: fpu sse2 avx2\n")
    assert cpu_class(info, "x86_64") == "AVX2"
    assert cpu_class(info, "aarch64") == "aarch64"


def test_machine_busy_when_stat_then_busy_jiffies_in_seconds(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 7 1 2 3 0 0\ncpu0 50 10 15 2500 3 0 1 1 0 0\n")
    assert machine_busy_s(stat) == pytest.approx(156 / os.sysconf("SC_CLK_TCK"))
    assert machine_busy_s(tmp_path / "absent") == 0.0


def test_sentences_when_same_count_then_same_distinct_list():
    a = sentences(300)
    assert a == sentences(300) and len(set(a)) == 300 and a[:10] == sentences(10)


@pytest.mark.slow
def test_write_when_all_minilm_then_llama_cpp_reads_simmers_tokens_and_vectors(tmp_path: Path):
    pytest.importorskip("llama_cpp")
    from bench.embed_sides import LlamaSide, SimmerSide

    src = minilm_folder()
    write_bert_gguf(src, tmp_path / "minilm.gguf")
    (tmp_path / "simmer").mkdir()
    convert_encoder(src, tmp_path / "simmer")
    simmer = SimmerSide(tmp_path / "simmer", threads=2)
    llama = LlamaSide(tmp_path / "minilm.gguf", threads=2, batch_tokens=256, flash_attn=False)

    assert llama.token_ids(TEXTS) == simmer.token_ids(TEXTS)
    # and simmer's reading of the GGUF itself (its vocabulary respelled back) tokenizes as llama.cpp does
    (tmp_path / "from-gguf").mkdir()
    convert_encoder_gguf(tmp_path / "minilm.gguf", tmp_path / "from-gguf")
    assert SimmerSide(tmp_path / "from-gguf", threads=2).token_ids(TEXTS) == llama.token_ids(TEXTS)
    ours, theirs = simmer.embed(TEXTS).astype(np.float64), llama.embed(TEXTS).astype(np.float64)
    cos = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    assert cos.min() >= 0.9999  # fp32 both: only the order of the sums differs
