"""Small synthetic tokenizer vocabularies for every supported tokenizer kind, as GGUF metadata.

No real Llama 3 / Qwen / Tekken / Llama 2 GGUF is at hand, so each family gets a vocabulary trained here
on a small corpus built to stress its pre-tokenizer: merges that cross spaces, newlines, digits,
apostrophes and punctuation, so a wrong regex changes the ids. The trained vocabularies are committed
(tests/fixtures/vocab_*.json, written by tests/fixtures/make_token_fixtures.py); llama.cpp loads the
same metadata written as a vocabulary-only GGUF, which is how the golden ids were made.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog doesn't care; it's asleep.",
    "I'm sure they'll say we've done what you'd expect. She's here, isn't she? THEY'RE HERE!",
    "In 2024 there were 1234567 users, up from 123456 in 2023 and 12345 in 2022: 3.14159, 1,000,000.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n\tprint(i)\n\tprint(i * 2)\n\n\nx = [1, 2, 3]; y = {'a': 4}\r\n",
    "Hello   world!  Hello  world!    Hello world.\n\n  indented line\n    more indented\n",
    "café naïve Ærøskøbing résumé façade über straße déjà vu — “quotes” and ‘single’ …",
    "你好，世界！今天天气很好。我们去公园散步吧。你好，世界！",
    "日本語のテキストです。カタカナとひらがな。한국어 텍스트입니다.",
    "Emoji: 🌍🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵 and 👨‍💻 👨‍💻 🎉🎉 🌍 🌍",
    "$100 + $200 = $300 <= 400 >= 50 ^ 2 ~ 3 | 4 ... !!! ??? ;;; ::: ---",
    "Ａｂｃ full width ＡＢＣ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text e\u0301 e\u0301 combining",
    "HTTPServer parseJSON getHTTPResponseCode XMLHttpRequest camelCase PascalCase snake_case",
    "getValue setValue getValue setValue HTTPServer XMLHttpRequest https://example.org/a/b/c //x",
    "the the the the and and and in in in to to to of of of a a a is is is",
    "0123456789 0123456789 00 000 0000 99 999 9999 2024-05-06 12:30:45",
    "\n\n\n\n  \n  \n\t\t\t    \t    end",
]

# Characters the SentencePiece vocabulary leaves out, so they fall back to <0xXX> byte tokens.
SPM_MISSING = set("ø𝔘𝔫𝔦𝔠𝔬𝔡𝔢🇫🇷🇯🇵👧")


def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def train_bpe(sequences: list[list[str]], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training: merge the most frequent adjacent pair (ties: the smallest pair), repeat."""
    seqs = [list(s) for s in sequences]
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        counts: Counter[tuple[str, str]] = Counter()
        for s in seqs:
            counts.update(itertools.pairwise(s))
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for k, s in enumerate(seqs):
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[k] = out
    return merges


def train_byte_level(n_merges: int = 500) -> dict[str, Any]:
    table = byte_unicode()
    merges = train_bpe([[table[b] for b in text.encode()] for text in CORPUS], n_merges)
    tokens = [table[b] for b in range(256)] + [a + b for a, b in merges]
    # Whole words no merge path reaches: only tokenizers that ignore merges for known pieces find them.
    tokens += [w for w in ("Ġunreachable", "Ġhello", "HTTP", "999") if w not in tokens]
    return {"tokens": tokens, "merges": [f"{a} {b}" for a, b in merges]}


def train_sentencepiece(n_merges: int = 500) -> dict[str, Any]:
    texts = ["▁" + t.replace(" ", "▁") for t in CORPUS]
    merges = train_bpe([[c for c in t if c not in SPM_MISSING] for t in texts], n_merges)
    pieces: list[str] = []
    for a, b in merges:
        if a + b not in pieces:
            pieces.append(a + b)
    chars = sorted({c for t in texts for c in t} - SPM_MISSING - set(pieces))
    return {"pieces": pieces, "chars": chars}


def load_vocab(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"vocab_{name}.json").read_text())


# -- families ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A synthetic model: a vocabulary kind, its pre-tokenizer, its special tokens."""

    name: str
    model: str  # tokenizer.ggml.model
    pre: str | None
    specials: tuple[tuple[str, int], ...]  # (text, GGUF token type), put before the learned tokens
    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more GGUF keys (add_bos_token, ...)


_GPT2_END = (("<|endoftext|>", CONTROL),)
_CHATML = (("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL))
FAMILIES = {
    f.name: f
    for f in [
        Family(
            "llama3",
            "gpt2",
            "llama-bpe",
            (
                ("<|begin_of_text|>", CONTROL),
                ("<|end_of_text|>", CONTROL),
                ("<|start_header_id|>", CONTROL),
                ("<|end_header_id|>", CONTROL),
                ("<|eot_id|>", CONTROL),
                ("<|reserved_special_token_0|>", CONTROL),
                ("<|python_tag|>", USER_DEFINED),
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
        ),
        Family(
            "qwen2",
            "gpt2",
            "qwen2",
            # Qwen's FIM and tool tokens are user-defined in its GGUF; llama.cpp makes the FIM ones control.
            (*_CHATML, ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED),
             ("<|fim_pad|>", USER_DEFINED)),
            bos="<|endoftext|>",
            eos="<|im_end|>",
            extra={"tokenizer.ggml.add_bos_token": False},
        ),
        Family("qwen35", "gpt2", "qwen35", _CHATML, bos="<|endoftext|>", eos="<|im_end|>"),
        Family("smollm", "gpt2", "smollm", _CHATML, bos="<|im_start|>", eos="<|im_end|>"),
        Family("gpt2", "gpt2", "gpt-2", _GPT2_END, bos="<|endoftext|>", eos="<|endoftext|>"),
        Family("default", "gpt2", None, _GPT2_END, bos="<|endoftext|>", eos="<|endoftext|>"),
        Family(
            "tekken",
            "gpt2",
            "tekken",
            (("<unk>", CONTROL), ("<s>", CONTROL), ("</s>", CONTROL), ("[INST]", CONTROL),
             ("[/INST]", CONTROL)),
            bos="<s>",
            eos="</s>",
            unk="<unk>",
        ),
        Family(
            "llama2",
            "llama",
            None,
            (("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<|user|>", USER_DEFINED)),
            bos="<s>",
            eos="</s>",
            unk="<unk>",
        ),
        Family(
            "spm-noprefix",
            "llama",
            None,
            (("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL),
             ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED),
             ("  ", USER_DEFINED)),
            bos="<bos>",
            eos="<eos>",
            unk="<unk>",
            extra={"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True},
        ),
    ]
}  # fmt: skip


def family_metadata(family: Family) -> dict[str, Any]:
    """The GGUF tokenizer keys of a synthetic family, as metadata_from_gguf returns them."""
    specials = [t for t, _ in family.specials]
    types = [k for _, k in family.specials]
    meta: dict[str, Any] = {"tokenizer.ggml.model": family.model}
    if family.pre is not None:
        meta["tokenizer.ggml.pre"] = family.pre
    if family.model == "gpt2":
        vocab = load_vocab("byte_level")
        tokens = specials + [t for t in vocab["tokens"] if t not in specials]
        meta["tokenizer.ggml.merges"] = vocab["merges"]
        types += [NORMAL] * (len(tokens) - len(specials))
    else:
        vocab = load_vocab("sentencepiece")
        learned = [p for p in vocab["pieces"] + vocab["chars"] if p not in specials]
        tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + learned
        types += [BYTE] * 256 + [NORMAL] * len(learned)
        # SentencePiece BPE scores: merged pieces by merge order, then the single characters, lowest.
        n_pieces = len([p for p in vocab["pieces"] if p not in specials])
        scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(n_pieces)]
        scores += [-1000.0 - i for i in range(len(learned) - n_pieces)]
        meta["tokenizer.ggml.scores"] = scores
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = types
    for key, text in (("bos", family.bos), ("eos", family.eos), ("unknown", family.unk)):
        if text is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = tokens.index(text)
    meta.update(family.extra)
    return meta


def write_vocab_gguf(path: Path, meta: dict[str, Any]) -> Path:
    """A vocabulary-only GGUF (llama.cpp opens it with vocab_only=True): the tokenizer keys plus the
    few llama hyperparameters its loader reads before the vocabulary."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores([float(s) for s in meta["tokenizer.ggml.scores"]])
    setters = {
        "tokenizer.ggml.bos_token_id": w.add_bos_token_id,
        "tokenizer.ggml.eos_token_id": w.add_eos_token_id,
        "tokenizer.ggml.unknown_token_id": w.add_unk_token_id,
        "tokenizer.ggml.add_bos_token": w.add_add_bos_token,
        "tokenizer.ggml.add_eos_token": w.add_add_eos_token,
        "tokenizer.ggml.add_space_prefix": w.add_add_space_prefix,
        "tokenizer.chat_template": w.add_chat_template,
    }
    for key, setter in setters.items():
        if key in meta:
            setter(meta[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
