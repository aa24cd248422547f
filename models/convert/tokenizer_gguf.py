"""A GGUF's vocabulary as a Hugging Face `tokenizers` tokenizer that gives llama.cpp's token ids.

llama.cpp (src/llama-vocab.cpp) is the reference for every choice here; docs/tokenizer.md lists them.
Two tokenizer models are supported:

- `gpt2`: byte-level BPE with the GGUF's merges. The pre-tokenizer named by `tokenizer.ggml.pre` is a list
  of regexes applied in turn, each match becoming its own piece, exactly as llama.cpp's `regex_exprs`.
- `llama`: SentencePiece BPE. llama.cpp merges the adjacent pair whose joined text is the highest-scoring
  token; a BPE whose merges are ranked by that score does the same (Hugging Face's own GGUF import derives
  merges this way). Spaces become U+2581, a space is prepended after every special token and at the start
  when `add_space_prefix` says so, and characters missing from the vocabulary fall back to <0xXX> tokens.

Anything else raises UnsupportedModel rather than tokenizing silently differently from llama.cpp.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from models.errors import InvalidModelFile, UnsupportedModel
from models.gguf.reader import read_kv_section
from models.runtime.bpe import BytePairEncoding
from models.runtime.pretokenize import STEP_DIGITS, STEP_REGEX, Step
from models.runtime.spm import (
    SPACE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    SentencePiece,
)
from models.runtime.tokenizer import KIND_BYTE_LEVEL, KIND_SENTENCEPIECE, Tokenizer

GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)

# -- pre-tokenizers ---------------------------------------------------------------------------------
# The regexes are llama.cpp's, which sometimes adapt the original tokenizer.json's: (?i:'s|...) is
# spelled out as '[sS]|... because Unicode case folding would also match "'ſ"; Tekken's \p{Lu}/\p{Ll}
# become (?=\p{L})[^a-z] / (?=\p{L})[^A-Z], since llama.cpp only tells the case of ASCII letters.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_RE = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's pre-tokenizer types."""

    regexes: tuple[str, ...]  # applied in turn; each match becomes its own piece, as do the gaps
    digits: bool = False  # every digit its own piece first (SmolLM, StarCoder: llama.cpp's "\p{N}")
    ignore_merges: bool = False  # a piece that is a token as a whole is that token (Llama 3, Tekken)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


_GPT2 = PreTokenizer((GPT2_RE,))
_SMOLLM = PreTokenizer((GPT2_RE,), digits=True)
_LLAMA3 = PreTokenizer((LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_RE,))

# GGUF `tokenizer.ggml.pre` -> behaviour. Only names whose llama.cpp code path is one of these are listed.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(DEFAULT_RES),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "exaone4"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _SMOLLM),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_RE,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35_RE,)),
    "tekken": PreTokenizer((TEKKEN_RE,), ignore_merges=True, add_bos=True),
}
TOKENIZER_MODELS = ("gpt2", "llama")

# -- token types llama.cpp infers from the token text ------------------------------------------------
# Whatever the GGUF says, llama.cpp ends generation on tokens with these texts and types them as control.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# Fill-in-the-middle tokens, found by text when the GGUF does not name them; pad/rep/sep also end generation.
FIM_TEXTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "pre": (("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
             "<|code_prefix|>", "<|prefix|>"), False),
    "suf": (("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
             "<|code_suffix|>", "<|suffix|>"), False),
    "mid": (("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
             "<|code_middle|>", "<|middle|>"), False),
    "pad": (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"), True),
    "rep": (("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"), True),
    "sep": (("<|file_sep|>",), True),
}  # fmt: skip
# gpt-oss: llama.cpp always renders these, so they are user-defined whatever the GGUF says.
ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def metadata_from_gguf(path: str | Path) -> dict[str, Any]:
    """Read the tokenizer keys of a GGUF file as plain Python values (string arrays decoded).

    Reads the key-value section only: gguf.GGUFReader also maps every tensor, which takes many
    seconds on a 262,144-token vocabulary file."""
    try:
        with open(path, "rb") as f:
            return read_kv_section(f, set(GGUF_TOKENIZER_KEYS))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise InvalidModelFile(f"cannot read GGUF metadata from {path}: {e}") from e


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    """The tokenizer keys from an already opened gguf.GGUFReader (parsing a GGUF takes ~2 s)."""
    meta: dict[str, Any] = {}
    for key in GGUF_TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is not None:
            meta[key] = field.contents()
    return meta


@dataclass
class Vocabulary:
    """The GGUF's tokens with the types llama.cpp ends up giving them, and its special ids."""

    model: str
    tokens: list[str]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: set[int]

    def special(self, i: int) -> bool:
        """Matched in text only when special tokens are parsed, skipped when decoding."""
        return self.types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN)


def read_vocabulary(meta: dict[str, Any]) -> Vocabulary:
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedModel(
            f"tokenizer model {model!r} is not supported (supported: "
            "'gpt2' = byte-level BPE, 'llama' = SentencePiece)"
        )
    raw = meta.get("tokenizer.ggml.tokens")
    if not raw:
        raise InvalidModelFile("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    # llama.cpp names empty tokens so they stay addressable.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(raw)]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)]
    if len(types) < len(tokens):
        raise InvalidModelFile(f"tokenizer has {len(tokens)} tokens but {len(types)} token types")
    types = types[: len(tokens)]
    if len(set(tokens)) != len(tokens):
        raise InvalidModelFile("tokenizer vocabulary has duplicate tokens")
    n = len(tokens)

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.get(key)
        if value is not None and 0 <= int(value) < n:
            return int(value)
        return default if default is not None and 0 <= default < n else None

    spm = model == "llama"
    # llama.cpp's defaults when a key is missing: SentencePiece (1, 2, unk 0, BOS added), BPE (11, 11).
    bos_id = token_id("tokenizer.ggml.bos_token_id", 1 if spm else 11)
    eos_id = token_id("tokenizer.ggml.eos_token_id", 2 if spm else 11)
    unk_id = token_id("tokenizer.ggml.unknown_token_id", 0 if spm else None)
    pad_id = token_id("tokenizer.ggml.padding_token_id", None)
    pre = None if spm else pre_tokenizer_for(meta)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", spm or (pre is not None and pre.add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos_id is None:
        raise InvalidModelFile("the tokenizer adds a BOS token but names none")
    if add_eos and eos_id is None:
        raise InvalidModelFile("the tokenizer adds an EOS token but names none")
    vocab = Vocabulary(
        model=model,
        tokens=tokens,
        types=types,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=unk_id,
        pad_id=pad_id,
        add_bos=bool(add_bos),
        add_eos=add_eos,
        add_space_prefix=spm and bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        eog_ids=set(),
    )
    _infer_types(vocab, meta)
    return vocab


def _infer_types(vocab: Vocabulary, meta: dict[str, Any]) -> None:
    """llama.cpp's load-time fix-ups (llama_vocab::impl::load): control tokens found by text, the set of
    tokens that end generation, and its exceptions."""
    types, index = vocab.types, {t: i for i, t in enumerate(vocab.tokens)}

    def make_control(i: int) -> None:
        if types[i] != TOKEN_CONTROL:
            types[i] = TOKEN_CONTROL

    for name, (texts, ends) in FIM_TEXTS.items():
        named = meta.get(f"tokenizer.ggml.fim_{name}_token_id")
        if named is not None and 0 <= int(named) < len(types):
            found = int(named)
        else:
            # llama.cpp takes the first match of a hash-map walk; vocabularies hold at most one of these.
            hits = sorted(index[t] for t in texts if t in index)
            if not hits:
                continue
            found = hits[0]
            make_control(found)
        if ends:
            vocab.eog_ids.add(found)
    for text in EOG_TEXTS:
        if text in index:
            vocab.eog_ids.add(index[text])
            make_control(index[text])
    for text in ALWAYS_USER_DEFINED:
        if text in index:
            types[index[text]] = TOKEN_USER_DEFINED
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and 0 <= int(value) < len(types):
            vocab.eog_ids.add(int(value))
    if vocab.eos_id is not None:
        vocab.eog_ids.add(vocab.eos_id)
    texts = {vocab.tokens[i]: i for i in vocab.eog_ids}
    # Harmony (gpt-oss) and Solar Open end turns with <|return|>/<|call|>, so <|end|> is ordinary there.
    if "<|end|>" in texts and (
        {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
    ):
        vocab.eog_ids.discard(texts["<|end|>"])
        types[texts["<|end|>"]] = TOKEN_USER_DEFINED
    # Gemma 4 and PLaMo use </s> as a normal token.
    if "</s>" in texts and ({"<|tool_response>", "<|plamo:eos|>"} & texts.keys()):
        vocab.eog_ids.discard(texts["</s>"])
        types[texts["</s>"]] = TOKEN_NORMAL


def pre_tokenizer_for(meta: dict[str, Any]) -> PreTokenizer:
    # llama.cpp treats a missing `pre` as "default" (with a warning); so do we.
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"tokenizer pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return PRE_TOKENIZERS[pre]


# -- building ---------------------------------------------------------------------------------------


def build_hf_tokenizer(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that reproduces llama.cpp's ids for this GGUF vocabulary."""
    return _build(read_vocabulary(meta), meta)


def _build(vocab: Vocabulary, meta: dict[str, Any]) -> tokenizers.Tokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.model == "gpt2":
        pre = pre_tokenizer_for(meta)
        merges = _gguf_merges(meta.get("tokenizer.ggml.merges") or [])
        try:
            bpe = models.BPE(
                vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges
            )
        except Exception as e:  # tokenizers raises a plain Exception for a merge of unknown tokens
            raise InvalidModelFile(f"the tokenizer's BPE merges do not fit its vocabulary: {e}") from e
        tok = tokenizers.Tokenizer(bpe)
        tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) < len(vocab.tokens):
            raise InvalidModelFile(
                "a SentencePiece tokenizer needs one score per token (tokenizer.ggml.scores)"
            )
        bpe = models.BPE(
            vocab=ids,
            merges=merges_from_scores(vocab.tokens, scores),
            unk_token=None if vocab.unk_id is None else vocab.tokens[vocab.unk_id],
            fuse_unk=False,
            byte_fallback=True,
        )
        tok = tokenizers.Tokenizer(bpe)
        replace = normalizers.Replace(" ", SPACE)
        # Prepend runs on every piece between added tokens: llama.cpp adds the space after each special.
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if vocab.add_space_prefix else replace
        )
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if vocab.add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)

    # Control and unknown tokens are matched whole in the input only when special tokens are parsed, and
    # skipped when decoding; user-defined tokens are always matched whole and stay in decoded text.
    added = [
        AddedToken(text, special=vocab.special(i), normalized=False)
        for i, text in enumerate(vocab.tokens)
        if vocab.types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
    ]
    if added:
        tok.add_tokens(added)  # already in the vocabulary, so they keep their ids
    tok.post_processor = _post_processor(vocab)
    return tok


def _gguf_merges(raw: Sequence[str]) -> list[tuple[str, str]]:
    merges = []
    for m in raw:
        # llama.cpp splits at the first space after the first character (a merge may start with one).
        pos = m.find(" ", 1)
        if pos < 0:
            raise InvalidModelFile(f"malformed BPE merge {m!r}")
        merges.append((m[:pos], m[pos + 1 :]))
    return merges


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece's scores as BPE merges: every split of a token into two tokens is a merge, ranked by
    the joined token's score (highest first). Several splits of one token keep llama.cpp's choice: it
    merges whichever pair comes first, and all of them have that one score."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, text in enumerate(tokens):
        for k in range(1, len(text)):
            left = index.get(text[:k])
            if left is None:
                continue
            right = index.get(text[k:])
            if right is not None:
                found.append((-scores[i], i, -scores[left], -scores[right], k))
    found.sort()
    return [(str(tokens[i][:k]), str(tokens[i][k:])) for _, i, _, _, k in found]


def _byte_level_pre_tokenizer(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    # GPT-2 and SmolLM keep the shape of their Hugging Face tokenizer.json (ByteLevel's own regex is GPT-2's),
    # so other runtimes that know those files read ours too.
    if pre.regexes == (GPT2_RE,):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre.digits:
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    for r in pre.regexes:
        if r == r"\p{N}+":  # the same split; onnxruntime-genai's regex engine lacks \p{N}
            steps.append(pre_tokenizers.Digits(individual_digits=False))
        else:
            steps.append(pre_tokenizers.Split(Regex(r), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def pre_tokenizer_steps(pre: PreTokenizer) -> list[Step]:
    """The steps of _byte_level_pre_tokenizer's `tokenizers` pre-tokenizer, for models/runtime/pretokenize.py:
    ByteLevel's own regex is GPT-2's, so GPT-2 and SmolLM have it as their last step."""
    steps: list[Step] = [(STEP_DIGITS, "1")] if pre.digits else []
    for r in pre.regexes:
        steps.append((STEP_DIGITS, "") if r == r"\p{N}+" else (STEP_REGEX, r))
    return steps


def _post_processor(vocab: Vocabulary) -> processors.PostProcessor | None:
    parts, specials = [], []
    if vocab.add_bos and vocab.bos_id is not None:
        parts.append(vocab.tokens[vocab.bos_id])
        specials.append((vocab.tokens[vocab.bos_id], vocab.bos_id))
    parts.append("$A")
    if vocab.add_eos and vocab.eos_id is not None:
        parts.append(vocab.tokens[vocab.eos_id])
        if vocab.eos_id != vocab.bos_id:
            specials.append((vocab.tokens[vocab.eos_id], vocab.eos_id))
    if not specials:
        return None
    single = " ".join(parts)
    return processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=specials)


def tokenizer_from_metadata(meta: dict[str, Any], *, compact: bool = True) -> Tokenizer:
    """The runtime Tokenizer for a GGUF's tokenizer keys (see metadata_from_gguf). A SentencePiece
    vocabulary encodes with models.runtime.spm, a byte-level BPE with models.runtime.bpe, unless `compact` is
    False; the `tokenizers` tokenizer is built either way, for the tokenizer.json other runtimes read."""
    vocab = read_vocabulary(meta)
    hf = _build(vocab, meta)  # first: its errors name what does not fit
    spm, bpe = None, None
    if compact and vocab.model == "gpt2":
        pre = pre_tokenizer_for(meta)
        bpe = BytePairEncoding.from_tokens(
            vocab.tokens,
            vocab.types,
            _gguf_merges(meta.get("tokenizer.ggml.merges") or []),
            steps=pre_tokenizer_steps(pre),
            ignore_merges=pre.ignore_merges,
        )
    if compact and vocab.model == "llama":
        spm = SentencePiece.from_tokens(
            vocab.tokens,
            meta.get("tokenizer.ggml.scores") or [],
            vocab.types,
            add_space_prefix=vocab.add_space_prefix,
            unk_id=vocab.unk_id,
        )
    return Tokenizer(
        hf,
        spm=spm,
        bpe=bpe,
        kind=KIND_BYTE_LEVEL if vocab.model == "gpt2" else KIND_SENTENCEPIECE,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        eos_ids=vocab.eog_ids,
        unk_id=vocab.unk_id,
        pad_id=vocab.pad_id,
        add_bos=vocab.add_bos,
        add_eos=vocab.add_eos,
        add_space_prefix=vocab.add_space_prefix,
        chat_template=meta.get("tokenizer.chat_template") or None,
    )


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    return tokenizer_from_metadata(metadata_from_gguf(path))
