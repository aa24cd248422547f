"""The compact byte-level BPE (models/runtime/bpe.py): the ids of the `tokenizers` tokenizer it replaces, its
own file, no JSON, and a load that never holds the GIL for long.

The golden llama.cpp ids of the synthetic byte-level families and of the real SmolLM2 are checked in
test_tokenizer_gguf.py (which now runs through bpe.py); here every id is compared with the `tokenizers`
path simmer used before (the converter's tokenizer.json), which is what must not change.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.convert.tokenizer_gguf import (
    PRE_TOKENIZERS,
    metadata_from_gguf,
    pre_tokenizer_steps,
    tokenizer_from_metadata,
)
from models.errors import InvalidModelFile
from models.runtime import unicode_classes
from models.runtime.bpe import VOCAB_FILE, BytePairEncoding, byte_chars
from models.runtime.pretokenize import PreTokenizer
from models.runtime.tokenizer import TOKENIZER_JSON, IncrementalDetokenizer, Tokenizer
from tests.fixtures.make_unicode_classes import CLASSES, tables
from tests.tiny_vocab import CONTROL, FAMILIES, FIXTURES, USER_DEFINED, Family, family_metadata

BPE_FAMILIES = sorted(n for n, f in FAMILIES.items() if f.model == "gpt2")

# Added tokens that overlap: `tokenizers` matches them leftmost-longest over all of them, then leaves the
# control ones as text when specials are not parsed (so "<c" never gets a chance inside "<ctl>").
OVERLAP = Family(
    "bpe-overlap",
    "gpt2",
    "qwen2",
    (("<|endoftext|>", CONTROL), ("<ctl>", CONTROL), ("<c", USER_DEFINED), ("<x", USER_DEFINED),
     ("x>yz", USER_DEFINED), ("  ", USER_DEFINED)),
    bos="<|endoftext|>",
    eos="<|endoftext|>",
)  # fmt: skip

TRICKY = [
    "",
    " ",
    "   ",
    "\t\t x",
    "\r\n",
    "a\r\n\r\nb\n \n",
    "hello   world  \n\n  indented\n",
    "I'm sure they'll say we've done what you'd expect. She's here, isn't she? THEY'RE 'S 'T 'Re",
    "In 2024 there were 1234567 users: 3.14159, 1,000,000; ٣٤٥ ² ½ Ⅻ 𝟘𝟙",
    "café naïve Ærøskøbing résumé e\u0301 a\u0308\u0301 ก่ า",
    "你好，世界！今天天气很好。日本語のテキスト、カタカナ。한국어",
    "Emoji: 🌍🎉 👍🏽 👩‍👩‍👧 🇫🇷🇯🇵 🦙",
    "def f(n):\n    return n * 2  # x\n\tif x <= 3 and y != 4: pass\n",
    "$100 + $200 = $300 <= 400 >= 50 ^ 2 ~ 3 | 4 ... !!! ??? ;;; ::: ---",
    "HTTPServer parseJSON getHTTPResponseCode camelCase snake_case https://example.org/a/b",
    "\u00a0\u2003\u3000 nbsp and ideographic spaces\u2028\u0085 \x1c\x1d",
    "\U00011de0\U00011de1 \u1c89\u1c8a new letters and digits",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> <|im_end|>x<|im_start|>",
    "<ctl><c<x<x>yzx>yz <tool_call>{}</tool_call><|fim_pad|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|python_tag|>",
    "[INST] hello [/INST]<s></s><unk>",
]


@cache
def compact(meta_key: str) -> Tokenizer:
    family = OVERLAP if meta_key == OVERLAP.name else FAMILIES[meta_key]
    return tokenizer_from_metadata(family_metadata(family))


def through_tokenizers(tok: Tokenizer) -> Tokenizer:
    """The same vocabulary through its `tokenizers` tokenizer: what simmer ran before."""
    assert tok.hf is not None
    return Tokenizer(
        tok.hf,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        eos_ids=tok.eos_ids,
        unk_id=tok.unk_id,
        add_bos=tok.add_bos,
        add_eos=tok.add_eos,
        kind=tok.kind,
    )


def facts(t: Tokenizer) -> tuple:
    return (
        t.vocab_size,
        t.special_ids,
        t.added_ids,
        t.bos_id,
        t.eos_id,
        t.eos_ids,
        t.add_bos,
        t.chat_template,
    )


def specials_in_spans(text: str, tok: Tokenizer) -> list[tuple[int, int]]:
    """Literal spans over every other occurrence of an added token, and one over the whole middle."""
    spans = []
    for i in sorted(tok.added_ids):
        t = tok.id_to_token(i)
        assert t is not None
        at = text.find(t)
        while at >= 0:
            if len(spans) % 2 == 0:
                spans.append((max(0, at - 1), at + len(t) - 1))
            else:
                spans.append((at, at + len(t)))
            at = text.find(t, at + 1)
    return sorted(spans) or [(len(text) // 3, 2 * len(text) // 3)]


def mismatches(ours: Tokenizer, ref: Tokenizer, texts: list[str]) -> list[str]:
    bad = []
    for text in texts:
        for add in (False, True):
            for parse in (False, True):
                got = ours.encode(text, add_special_tokens=add, parse_special=parse)
                want = ref.encode(text, add_special_tokens=add, parse_special=parse)
                if got != want:
                    bad.append(f"{text!r} add={add} parse={parse}: {got} != {want}")
        spans = specials_in_spans(text, ours)
        got, want = ours.encode(text, literal_spans=spans), ref.encode(text, literal_spans=spans)
        if got != want:
            bad.append(f"{text!r} literal {spans}: {got} != {want}")
    return bad


def mixed_texts(tok: Tokenizer, seed: int, n: int) -> list[str]:
    """Random texts from pieces of the tricky ones, random characters of every kind and added tokens."""
    rnd = random.Random(seed)
    added = sorted(t for i in tok.added_ids if (t := tok.id_to_token(i)) is not None)
    chars = [chr(c) for c in range(0x20, 0x800)] + list("\r\n\t  '0123456789sStTdDlLmMvVrReE")
    chars += ["😀", "👍🏽", "𝔘", "你", "好", "\u0301", "\u3000", "\U00011de0", "\u1c89", "٣", "²", "\x1c"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rnd.randint(1, 8)):
            r = rnd.random()
            if r < 0.15 and added:
                parts.append(rnd.choice(added))
            elif r < 0.4:
                t = rnd.choice(TRICKY)
                a = rnd.randint(0, len(t))
                parts.append(t[a : a + rnd.randint(0, 20)])
            else:
                parts.append("".join(rnd.choice(chars) for _ in range(rnd.randint(0, 12))))
        out.append("".join(parts))
    return out


# -- ids ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [*BPE_FAMILIES, OVERLAP.name])
def test_encode_when_tricky_texts_then_same_ids_as_tokenizers(family: str) -> None:
    tok = compact(family)
    assert tok.bpe is not None
    assert mismatches(tok, through_tokenizers(tok), TRICKY + mixed_texts(tok, 7, 150)) == []


def test_encode_when_ids_differ_then_parity_check_fails(tmp_path: Path) -> None:
    """The comparison can fail: with the merges' ranks reversed, some ids differ."""
    tok = compact("qwen2")
    tok.save(tmp_path)
    with np.load(tmp_path / VOCAB_FILE) as f:
        arrays = dict(f)
    np.savez(tmp_path / VOCAB_FILE, **(arrays | {"merge_ranks": -arrays["merge_ranks"]}))
    assert mismatches(Tokenizer.load(tmp_path), through_tokenizers(tok), TRICKY)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40), st.sampled_from(BPE_FAMILIES), st.booleans())
def test_encode_when_any_text_then_same_ids_as_tokenizers(text: str, family: str, parse: bool) -> None:
    text = "".join(c for c in text if not 0xD800 <= ord(c) < 0xE000)  # a str with a surrogate is no UTF-8
    tok = compact(family)
    ref = through_tokenizers(tok)
    assert tok.encode(text, parse_special=parse) == ref.encode(text, parse_special=parse)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_decode_when_encoded_then_same_bytes_text_and_stream_as_tokenizers(family: str) -> None:
    tok = compact(family)
    ref = through_tokenizers(tok)
    assert [tok.token_bytes(i) for i in range(tok.vocab_size)] == [
        ref.token_bytes(i) for i in range(ref.vocab_size)
    ]
    assert (tok.added_ids, tok.special_ids, tok.vocab_size) == (
        ref.added_ids,
        ref.special_ids,
        ref.vocab_size,
    )
    for text in TRICKY:
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.feed(i) for i in ids) + detok.flush() == ref.decode(ids)


def test_encode_when_byte_has_no_token_then_dropped_like_tokenizers() -> None:
    """Without an unknown token, `tokenizers` drops a byte the vocabulary lacks (its neighbours then meet)."""
    meta = family_metadata(FAMILIES["qwen2"])
    gone = {byte_chars()[b] for b in (0x01, 0x7F)}  # U+0001 and DEL
    assert not any(set(m.split(" ")) & gone for m in meta["tokenizer.ggml.merges"])
    keep = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if t not in gone]
    meta = meta | {
        "tokenizer.ggml.tokens": [meta["tokenizer.ggml.tokens"][i] for i in keep],
        "tokenizer.ggml.token_type": [meta["tokenizer.ggml.token_type"][i] for i in keep],
    }
    tok = tokenizer_from_metadata(meta)
    assert tok.bpe is not None and tok.token_to_id(byte_chars()[0x01]) is None
    texts = ["a\x01b", "\x01\x01 x\x7f", "caf\x7fé \x7f", *TRICKY]
    assert mismatches(tok, through_tokenizers(tok), texts) == []


def test_encode_when_caches_overflow_then_same_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from models.runtime import bpe as bpe_module

    monkeypatch.setattr(bpe_module, "CACHE_PIECES", 3)
    monkeypatch.setattr(bpe_module, "MEMO_PAIRS", 5)
    tok = tokenizer_from_metadata(family_metadata(FAMILIES["smollm"]))
    ref = through_tokenizers(tok)
    for text in TRICKY + mixed_texts(tok, 3, 40):
        assert tok.encode(text) == ref.encode(text), text


# -- the pre-tokenizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_when_any_llama_cpp_name_then_tokenizers_pieces(pre: str) -> None:
    meta = family_metadata(FAMILIES["gpt2"]) | {"tokenizer.ggml.pre": pre}
    tok = tokenizer_from_metadata(meta)
    assert tok.hf is not None and tok.hf.pre_tokenizer is not None
    ours = PreTokenizer(pre_tokenizer_steps(PRE_TOKENIZERS[pre]))
    to_byte_level = dict(enumerate(byte_chars()))
    for text in TRICKY + mixed_texts(tok, 11, 100):
        want = [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str(text)]
        got = [p.encode().decode("latin-1").translate(to_byte_level) for p in ours.split(text)]
        assert got == want, text


@pytest.mark.slow
def test_unicode_classes_when_regenerated_then_the_committed_tables() -> None:
    """The tables still say what this `tokenizers` matches (python -m tests.fixtures.make_unicode_classes)."""
    for name, ranges in tables().items():
        words = [f"{a:x}" if a == b else f"{a:x}-{b:x}" for a, b in ranges]
        assert " ".join(words) == getattr(unicode_classes, name).strip(), name
    assert set(CLASSES) == {n for n in vars(unicode_classes) if n.isupper()}


# -- files -------------------------------------------------------------------------------------------


def test_load_when_compact_file_then_no_tokenizer_json_and_same_tokenizer(tmp_path: Path) -> None:
    tok = compact("qwen2")
    tok.save(tmp_path)
    assert (tmp_path / VOCAB_FILE).is_file() and (tmp_path / TOKENIZER_JSON).is_file()  # still for genai
    (tmp_path / TOKENIZER_JSON).write_text("not json")
    again = Tokenizer.load(tmp_path)
    assert again.hf is None and again.bpe is not None and again.kind == "byte_level"
    assert facts(again) == facts(tok)
    for text in TRICKY:
        for parse in (False, True):
            assert again.encode(text, parse_special=parse) == tok.encode(text, parse_special=parse), text
    assert [again.token_bytes(i) for i in range(again.vocab_size)] == [
        tok.token_bytes(i) for i in range(tok.vocab_size)
    ]


def test_load_when_no_compact_file_then_tokenizers_as_before(tmp_path: Path) -> None:
    """A folder of converter 13 or older: its tokenizer.json, read by `tokenizers`."""
    tok = compact("smollm")
    tok.save(tmp_path)
    (tmp_path / VOCAB_FILE).unlink()
    old = Tokenizer.load(tmp_path)
    assert old.bpe is None and old.hf is not None
    for text in TRICKY:
        assert old.encode(text) == tok.encode(text), text


def test_load_when_compact_file_broken_then_invalid_model_file(tmp_path: Path) -> None:
    compact("qwen2").save(tmp_path)
    with np.load(tmp_path / VOCAB_FILE) as f:
        arrays = dict(f)
    for broken in (
        {"lengths": arrays["lengths"][:-1]},
        {"merge_ids": arrays["merge_ids"][:-1]},
        {"merge_ids": arrays["merge_ids"] + 10**6},
        {"pre": np.frombuffer(b'{"steps": [["regex", "\\\\p{Zz}"]]}', dtype=np.uint8)},
    ):
        np.savez(tmp_path / VOCAB_FILE, **(arrays | broken))
        with pytest.raises(InvalidModelFile, match=VOCAB_FILE):
            Tokenizer.load(tmp_path)
    (tmp_path / VOCAB_FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(InvalidModelFile):
        Tokenizer.load(tmp_path)


def test_vocabulary_when_merge_does_not_fit_then_invalid_model_file() -> None:
    with pytest.raises(InvalidModelFile, match="merge"):
        BytePairEncoding.from_tokens(["a", "b"], [1, 1], [("a", "b")], steps=[], ignore_merges=False)


# -- loading beside other threads --------------------------------------------------------------------


def qwen_sized(folder: Path, n_tokens: int = 151_936, seed: int = 0) -> None:
    """A byte-level vocabulary of Qwen 2.5's size (its 151,936 tokens, one merge each beyond the bytes),
    written as the converter writes it: tokenizer.json and tokenizer.bpe.npz."""
    rnd = random.Random(seed)
    tokens = byte_chars()
    index = set(tokens)
    merges = []
    while len(tokens) < n_tokens:
        left, right = tokens[int(len(tokens) * rnd.random() ** 3)], tokens[rnd.randrange(256)]
        if left + right not in index:
            index.add(left + right)
            tokens.append(left + right)
            merges.append((left, right))
    hf = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    )
    hf.save(str(folder / TOKENIZER_JSON))
    steps = pre_tokenizer_steps(PRE_TOKENIZERS["qwen2"])
    BytePairEncoding.from_tokens(tokens, [1] * len(tokens), merges, steps=steps, ignore_merges=False).save(
        folder
    )


def longest_stall(work: Callable[[], object]) -> float:
    """How late, at worst, a thread that sleeps 1 ms at a time woke while `work` ran in this one: how long
    `work` kept the GIL at a stretch (plus this machine's scheduling noise)."""
    worst, done = 0.0, threading.Event()

    def tick() -> None:
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    worst = 0.0
    try:
        work()
    finally:
        done.set()
        ticker.join()
    return worst


@pytest.fixture(scope="module")
def qwen_sized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen-sized")
    qwen_sized(folder)
    return folder


def test_load_when_qwen_sized_vocabulary_then_gil_never_held_long(qwen_sized_dir: Path) -> None:
    """A stream of another model runs a pass every ~7.5 ms; `tokenizers` parsing this vocabulary holds the
    GIL ~250 ms in one call. The compact file loads in Python-level steps the interpreter interrupts."""
    stall = min(longest_stall(lambda: BytePairEncoding.load(qwen_sized_dir)) for _ in range(2))
    assert stall < 0.05
    # the probe sees a long hold: tokenizer.json through `tokenizers` (what loads without the compact file)
    assert longest_stall(lambda: tokenizers.Tokenizer.from_file(str(qwen_sized_dir / TOKENIZER_JSON))) > 0.05


# -- real vocabularies -------------------------------------------------------------------------------


@cache
def real(path: Path) -> Tokenizer:
    return tokenizer_from_metadata(metadata_from_gguf(path))


@pytest.mark.slow
def test_encode_when_real_smollm2_then_same_ids_as_tokenizers(smollm2_gguf: Path) -> None:
    tok = real(smollm2_gguf)
    assert tok.bpe is not None
    assert mismatches(tok, through_tokenizers(tok), TRICKY + mixed_texts(tok, 5, 300)) == []


@pytest.mark.slow
def test_encode_when_real_qwen25_then_same_ids_as_tokenizers(qwen_coder_05b_gguf: Path) -> None:
    tok = real(qwen_coder_05b_gguf)
    assert tok.bpe is not None
    assert mismatches(tok, through_tokenizers(tok), TRICKY + mixed_texts(tok, 6, 300)) == []
    text = (Path(__file__).parents[3] / "models" / "runtime" / "session.py").read_text()[:9000]
    assert tok.encode(text) == through_tokenizers(tok).encode(text)
    # and llama.cpp's own ids for its chat prompts (tests/fixtures/make_llamacpp_fixtures.py)
    doc = json.loads((FIXTURES / "qwen2.5_coder_0.5b_llamacpp.json").read_text(encoding="utf-8"))
    for case in doc["cases"]:
        assert tok.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"]
