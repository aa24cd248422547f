"""Byte-level BPE (`tokenizer.ggml.model = gpt2`: SmolLM2, Qwen 2.5) over compact arrays, `tokenizers`' ids.

Loading a tokenizer.json with `tokenizers` is one native call that holds the GIL for ~0.25 s on Qwen 2.5's
151,936 tokens and 151,387 merges: every other thread (a stream of another model between two of its
forward passes) waits that long. Here the converter writes the vocabulary as arrays (tokenizer.bpe.npz,
next to tokenizer.json, which stays for onnxruntime-genai and other readers) and loading is np.load of a few
arrays plus Python-level work, which the interpreter interrupts every few milliseconds:
- the token texts (GPT-2's printable stand-ins for bytes) as one UTF-8 blob with offsets, and their ids
  sorted by text, so a text is found by bisection;
- the merges as a sorted array of (left id << 32 | right id) with each merge's rank and the id it makes,
  also found by bisection (behind a small memo: one word asks for the same pairs again and again);
- the pre-tokenizer steps (pretokenize.py) and whether a piece that is a whole token stays one.

The ids are those of the `tokenizers` tokenizer the converter writes (whose ids equal llama.cpp's): added
tokens (control, unknown, user-defined) are found leftmost-longest in the raw text, control and unknown
ones only when specials are parsed; the text between them is split by the pre-tokenizer; each piece's
UTF-8 bytes start as one symbol each (a byte with no token is dropped, as `tokenizers` does without an
unknown token) and the adjacent pair with the lowest merge rank (then the leftmost) merges until none does,
with `tokenizers`' own check of a queued pair (word.rs merge_all).
"""

from __future__ import annotations

import bisect
import heapq
import json
import re
import zipfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from models.errors import InvalidModelFile
from models.runtime.pretokenize import PreTokenizer, Step
from models.runtime.spm import TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED, trie_pattern

VOCAB_FILE = "tokenizer.bpe.npz"
CACHE_PIECES = 10_000  # merged pieces kept (`tokenizers`' own cache size); mostly words of ~100 bytes each
CACHE_PIECE_CHARS = 64  # longer pieces are not kept
MEMO_PAIRS = 65_536  # merge lookups kept
Span = tuple[int, int]
ADDED_TYPES = (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_UNKNOWN)
ARRAYS = ("lengths", "types", "by_text", "merge_keys", "merge_ranks", "merge_ids")  # besides "text", "pre"


def byte_chars() -> list[str]:
    """GPT-2's table: byte -> the printable character standing for it in byte-level tokens."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= {*range(ord("®"), ord("ÿ") + 1)}
    out = [""] * 256
    n = 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_LEVEL = {b: c for b, c in enumerate(byte_chars())}  # for str.translate of latin-1 text


def _overlaps(start: int, end: int, spans: Sequence[Span]) -> bool:
    return any(start < b and a < end for a, b in spans)


class BytePairEncoding:
    """A byte-level BPE vocabulary that tokenizes as the converter's `tokenizers` tokenizer does (see the
    module docstring)."""

    def __init__(
        self,
        blob: bytes,
        lengths: np.ndarray,
        types: np.ndarray,
        by_text: np.ndarray,
        merge_keys: np.ndarray,
        merge_ranks: np.ndarray,
        merge_ids: np.ndarray,
        *,
        steps: Sequence[Step],
        ignore_merges: bool,
    ) -> None:
        n = len(lengths)
        ends = np.cumsum(lengths, dtype=np.int64)
        if n == 0 or ends[-1] != len(blob) or (lengths < 0).any():
            raise InvalidModelFile("byte-level BPE vocabulary: the token texts do not fit together")
        if len(types) != n or len(by_text) != n:
            raise InvalidModelFile(
                f"byte-level BPE vocabulary: {n} tokens but {len(types)} types and {len(by_text)} sorted ids"
            )
        if not len(merge_keys) == len(merge_ranks) == len(merge_ids):
            raise InvalidModelFile("byte-level BPE vocabulary: the merge arrays differ in length")
        if len(merge_ids) and (int(merge_ids.min()) < 0 or int(merge_ids.max()) >= n):
            raise InvalidModelFile("byte-level BPE vocabulary: a merge makes a token outside the vocabulary")
        self._blob = blob
        self._offsets = array("q", np.concatenate(([0], ends)).tobytes())
        self.types = np.asarray(types, dtype=np.uint8).tobytes()
        self._by_text = array("i", np.asarray(by_text, dtype=np.int32).tobytes())
        self._merge_keys = array("q", np.asarray(merge_keys, dtype=np.int64).tobytes())
        self._merge_ranks = array("i", np.asarray(merge_ranks, dtype=np.int32).tobytes())
        self._merge_ids = array("i", np.asarray(merge_ids, dtype=np.int32).tobytes())
        self.pre = PreTokenizer(steps)
        self.ignore_merges = ignore_merges
        # A byte's symbol: its one-character token, or -1 (dropped) when the vocabulary lacks it.
        self._byte_ids = [-1 if (t := self._find(c.encode("utf-8"))) is None else t for c in byte_chars()]
        added = np.flatnonzero(np.isin(np.frombuffer(self.types, dtype=np.uint8), ADDED_TYPES))
        self._added = {self.id_to_token(int(i)): int(i) for i in added}
        self._find_added: re.Pattern[str] | None = None  # compiled on first use
        self._cache: dict[str, list[int]] = {}
        self._memo: dict[int, tuple[int, int] | None] = {}

    @classmethod
    def from_tokens(
        cls,
        tokens: Sequence[str],
        types: Sequence[int],
        merges: Sequence[tuple[str, str]],
        *,
        steps: Sequence[Step],
        ignore_merges: bool,
    ) -> BytePairEncoding:
        """From the GGUF's tokens and merges (pairs of token texts; the later of two equal pairs wins, as in
        `tokenizers`' map of them)."""
        n = len(tokens)
        if len(types) < n:
            raise InvalidModelFile(f"byte-level BPE vocabulary: {n} tokens but {len(types)} types")
        data = [t.encode("utf-8", errors="surrogatepass") for t in tokens]
        index = {t: i for i, t in enumerate(tokens)}
        ranked: dict[int, tuple[int, int]] = {}
        for rank, (left, right) in enumerate(merges):
            a, b, joined = index.get(left), index.get(right), index.get(left + right)
            if a is None or b is None or joined is None:
                raise InvalidModelFile(f"the BPE merge {left!r} {right!r} does not fit the vocabulary")
            ranked[a << 32 | b] = (rank, joined)
        keys = np.array(sorted(ranked), dtype=np.int64)
        values = np.array([ranked[int(k)] for k in keys], dtype=np.int32).reshape(-1, 2)
        return cls(
            b"".join(data),
            np.fromiter((len(d) for d in data), dtype=np.int64, count=n),
            np.asarray(types[:n], dtype=np.int64) & 0xFF,
            np.array(sorted(range(n), key=data.__getitem__), dtype=np.int32),
            keys,
            values[:, 0],
            values[:, 1],
            steps=steps,
            ignore_merges=ignore_merges,
        )

    # -- the vocabulary ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._offsets) - 1

    def _text(self, token_id: int) -> bytes:
        return self._blob[self._offsets[token_id] : self._offsets[token_id + 1]]

    def _find(self, key: bytes) -> int | None:
        """The id of the token whose UTF-8 text is `key`: a bisection of the ids sorted by text."""
        order = self._by_text
        k = bisect.bisect_left(order, key, key=self._text)
        return order[k] if k < len(order) and self._text(order[k]) == key else None

    def id_to_token(self, token_id: int) -> str:
        return self._text(token_id).decode("utf-8", errors="surrogatepass")

    def token_to_id(self, text: str) -> int | None:
        return self._find(text.encode("utf-8", errors="surrogatepass"))

    # -- files ---------------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> None:
        pre = {"steps": [list(s) for s in self.pre.steps], "ignore_merges": self.ignore_merges}
        np.savez(
            Path(folder) / VOCAB_FILE,
            text=np.frombuffer(self._blob, dtype=np.uint8),
            lengths=np.diff(np.frombuffer(self._offsets, dtype=np.int64)).astype(np.int32),
            types=np.frombuffer(self.types, dtype=np.uint8),
            by_text=np.frombuffer(self._by_text, dtype=np.int32),
            merge_keys=np.frombuffer(self._merge_keys, dtype=np.int64),
            merge_ranks=np.frombuffer(self._merge_ranks, dtype=np.int32),
            merge_ids=np.frombuffer(self._merge_ids, dtype=np.int32),
            pre=np.frombuffer(json.dumps(pre).encode(), dtype=np.uint8),
        )

    @classmethod
    def load(cls, folder: str | Path) -> BytePairEncoding:
        try:
            with np.load(Path(folder) / VOCAB_FILE) as f:
                blob = f["text"].tobytes()
                pre = json.loads(f["pre"].tobytes())  # a few hundred bytes
                arrays = [f[k] for k in ARRAYS]
            steps = [(str(kind), str(arg)) for kind, arg in pre["steps"]]
            ignore_merges = bool(pre["ignore_merges"])
        except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise InvalidModelFile(f"cannot read {VOCAB_FILE} in {folder}: {e}") from e
        try:
            return cls(blob, *arrays, steps=steps, ignore_merges=ignore_merges)
        except InvalidModelFile as e:
            raise InvalidModelFile(f"{VOCAB_FILE} in {folder}: {e}") from e

    # -- encoding ------------------------------------------------------------------------------------

    def encode(
        self, text: str, *, parse_special: bool = True, literal_spans: Sequence[Span] = ()
    ) -> list[int]:
        """Ids for `text` without BOS/EOS (the caller adds them). Without `parse_special`, control and
        unknown tokens are text; with it, those inside `literal_spans` are (the runtime Tokenizer's rule
        over `tokenizers`: the text around the specials outside the spans is encoded without parsing)."""
        hits = self._added_hits(text)
        if parse_special and literal_spans:
            specials = [(s, e, i) for s, e, i in hits if self.types[i] in SPECIAL_TYPES]
            if any(_overlaps(s, e, literal_spans) for s, e, _ in specials):
                ids: list[int] = []
                pos = 0
                for start, end, token_id in specials:
                    if _overlaps(start, end, literal_spans):
                        continue
                    ids += self.encode(text[pos:start], parse_special=False)
                    ids.append(token_id)
                    pos = end
                return ids + self.encode(text[pos:], parse_special=False)
        if not parse_special:
            hits = [h for h in hits if self.types[h[2]] not in SPECIAL_TYPES]
        out: list[int] = []
        pos = 0
        for start, end, token_id in hits:
            if start > pos:
                self._encode_raw(text[pos:start], out)
            out.append(token_id)
            pos = end
        if pos < len(text):
            self._encode_raw(text[pos:], out)
        return out

    def _added_hits(self, text: str) -> list[tuple[int, int, int]]:
        """Every added token in `text`, leftmost-longest and not overlapping, as (start, end, id): the
        matching of `tokenizers`' added vocabulary (which then skips the specials when they are text)."""
        if not self._added or not text:
            return []
        if self._find_added is None:
            self._find_added = re.compile(trie_pattern(sorted(self._added)))
        added = self._added
        return [(m.start(), m.end(), added[m.group()]) for m in self._find_added.finditer(text)]

    def _encode_raw(self, text: str, out: list[int]) -> None:
        cache, merge = self._cache, self._merge
        for piece in self.pre.split(text):
            ids = cache.get(piece)
            if ids is None:
                ids = merge(piece)
                if len(piece) <= CACHE_PIECE_CHARS:
                    if len(cache) >= CACHE_PIECES:
                        cache.clear()  # cheaper than LRU bookkeeping; a new text refills it quickly
                    cache[piece] = ids
            out += ids

    def _merge(self, piece: str) -> list[int]:
        """`tokenizers`' BPE on one piece (models/bpe/word.rs merge_all): a queue of adjacent pairs by rank
        then position; a queued pair is merged if its left symbol is still there and, with its current
        right neighbour, still makes the queued token."""
        data = piece.encode("utf-8")
        if self.ignore_merges:
            whole = self._find(data.decode("latin-1").translate(_BYTE_LEVEL).encode("utf-8"))
            if whole is not None:
                return [whole]
        byte_ids = self._byte_ids
        sym = [t for b in data if (t := byte_ids[b]) >= 0]
        n = len(sym)
        if n < 2:
            return sym
        pair = self._pair
        heap = []
        for i in range(n - 1):
            found = pair(sym[i], sym[i + 1])
            if found is not None:
                heap.append((found[0], i, found[1]))
        if not heap:
            return sym
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        nxt = [*range(1, n), -1]
        prev = list(range(-1, n - 1))
        alive = [True] * n
        while heap:
            _, pos, new = pop(heap)
            right = nxt[pos]
            if not alive[pos] or right < 0:
                continue
            found = pair(sym[pos], sym[right])
            if found is None or found[1] != new:
                continue  # the pair changed since it was queued
            sym[pos] = new
            alive[right] = False
            after = nxt[right]
            nxt[pos] = after
            if after >= 0:
                prev[after] = pos
            before = prev[pos]
            if before >= 0 and (found := pair(sym[before], new)) is not None:
                push(heap, (found[0], before, found[1]))
            if after >= 0 and (found := pair(new, sym[after])) is not None:
                push(heap, (found[0], pos, found[1]))
        return [s for s, a in zip(sym, alive, strict=True) if a]

    def _pair(self, left: int, right: int) -> tuple[int, int] | None:
        """(rank, id made) of the merge of two adjacent tokens, or None."""
        key = left << 32 | right
        memo = self._memo
        if key in memo:
            return memo[key]
        keys = self._merge_keys
        k = bisect.bisect_left(keys, key)
        found = (self._merge_ranks[k], self._merge_ids[k]) if k < len(keys) and keys[k] == key else None
        if len(memo) >= MEMO_PAIRS:
            memo.clear()
        memo[key] = found
        return found
