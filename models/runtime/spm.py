"""llama.cpp's SentencePiece tokenizer (`tokenizer.ggml.model = llama`) over compact arrays.

The same vocabulary as a Hugging Face BPE holds every token twice in Rust hash maps plus ~500,000 merges
derived from the scores: ~100 MB resident for Gemma 3's 262,144 tokens, and a 300 MB peak parsing its
tokenizer.json. Here it is one UTF-8 blob with offsets, an open-addressing hash table (text -> id) in
two int32 arrays, the scores as float32 and the token types as bytes: ~15 MB, read from a 5 MB .npz the
converter writes next to tokenizer.json (which stays, for onnxruntime-genai and other readers).

The algorithm is llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_spm and tokenizer_st_partition):
- special tokens are split out first, longest text first, each by its leftmost occurrences in what is
  still raw text; control and unknown tokens only when specials are parsed, user-defined ones always;
- each raw fragment gets a leading space when add_space_prefix says so and it follows a special token or
  starts the text; spaces become U+2581;
- from single characters, the adjacent pair whose joined text is the highest-scoring token is merged
  (ties: leftmost) until no pair joins into a token; a character that is no token becomes its UTF-8 bytes
  as <0xXX> tokens.

Speed: a pair of adjacent characters that occurs in no token can never be merged across, so the text is
cut there and the pieces (mostly words) are tokenized independently; this gives the same ids, since a
merge only ever looks at its own neighbours, and lets repeated pieces come from a small cache.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import re
import zipfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from models.errors import InvalidModelFile

VOCAB_FILE = "tokenizer.spm.npz"
SPACE = "\u2581"  # SentencePiece's visible space

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

CACHE_PIECES = 4096  # tokenized pieces kept (a piece is mostly one word: ~100 bytes each)
CACHE_PIECE_CHARS = 32  # longer pieces are not kept
MEMO_KEYS = 16384  # token lookups by text kept (~100 bytes each)
Span = tuple[int, int]


def _pair_keys(cps: np.ndarray) -> np.ndarray:
    cps = cps.astype(np.uint64)
    return (cps[:-1] << np.uint64(21)) | cps[1:]  # code points fit in 21 bits


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)


def trie_pattern(texts: Sequence[str]) -> str:
    """One regex matching any of `texts` at a position, longest first (a trie: a flat alternation of
    thousands of literals is tried branch by branch at every position)."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = True

    def build(node: dict) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:
            return body + "?" if len(branches) == 1 and len(branches[0]) == 1 else f"(?:{body})?"
        return body

    return build(trie)


class SentencePiece:
    """A SentencePiece vocabulary that tokenizes as llama.cpp does (see the module docstring).

    The tokens are one UTF-8 blob with offsets, found by text through an open-addressing hash table in
    two int32 arrays: ~10 MB for Gemma 3's 262,144 tokens, where a dict of bytes objects takes ~45 MB."""

    def __init__(
        self,
        blob: bytes,
        lengths: np.ndarray,
        scores: np.ndarray,
        types: np.ndarray,
        *,
        add_space_prefix: bool,
        unk_id: int | None = None,
        pairs: np.ndarray | None = None,
    ) -> None:
        n = len(lengths)
        if len(scores) != n or len(types) != n:
            raise InvalidModelFile(
                f"SentencePiece vocabulary: {n} tokens but {len(scores)} scores and {len(types)} types"
            )
        ends = np.cumsum(lengths, dtype=np.int64)
        if n == 0 or ends[-1] != len(blob) or (lengths < 0).any():
            raise InvalidModelFile("SentencePiece vocabulary: the token texts do not fit together")
        self._blob = blob
        self._offsets = array("q", np.concatenate(([0], ends)).tobytes())
        # float32 like llama.cpp's; indexing gives a Python float
        self.scores = array("f", np.ascontiguousarray(scores, dtype=np.float32).tobytes())
        self.types = np.asarray(types, dtype=np.uint8).tobytes()
        self.add_space_prefix = add_space_prefix
        self.unk_id = unk_id
        self._index()
        # computed once by the converter: finding them takes ~80 MB for a moment
        self._pairs = self._inner_pairs(blob, ends) if pairs is None else np.asarray(pairs, dtype=np.uint64)
        # llama.cpp's byte_to_token: <0xXX>, else the byte as a one-character token.
        hex_ids = [self._find(b"<0x%02X>" % b) for b in range(256)]
        self._byte_ids = [t if t is not None else self._find(bytes([b])) for b, t in enumerate(hex_ids)]
        # tokenizer_st_partition's order: longest text first (then lower id).
        kinds = (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
        specials = [i for i, t in enumerate(self.types) if t in kinds]
        specials.sort(key=lambda i: (self._offsets[i] - self._offsets[i + 1], i))
        self._specials = [(self.id_to_token(i), i) for i in specials]
        self._special_rank = {text: k for k, (text, _) in enumerate(self._specials)}
        # Two specials that match at one position: the shorter is a prefix of the longer.
        self._prefixes: dict[str, list[str]] = {}
        for t in self._special_rank:
            if shorter := [t[:k] for k in range(1, len(t)) if t[:k] in self._special_rank]:
                self._prefixes[t] = shorter
        self._find_specials: re.Pattern[str] | None = None  # compiled on first use (~0.5 s for Gemma)
        self._cache: dict[str, list[int]] = {}
        self._memo: dict[bytes, int] = {}

    @classmethod
    def from_tokens(
        cls,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        *,
        add_space_prefix: bool,
        unk_id: int | None = None,
    ) -> SentencePiece:
        n = len(tokens)
        if len(scores) < n or len(types) < n:
            raise InvalidModelFile(f"SentencePiece vocabulary: {n} tokens but {len(scores)} scores")
        data = [t.encode("utf-8", errors="surrogatepass") for t in tokens]
        return cls(
            b"".join(data),
            np.fromiter((len(d) for d in data), dtype=np.int64, count=n),
            np.asarray(scores[:n], dtype=np.float32),
            np.asarray(types[:n], dtype=np.int64) & 0xFF,
            add_space_prefix=add_space_prefix,
            unk_id=unk_id,
        )

    def _index(self) -> None:
        """Fill the hash table: slot -> token id (-1: empty) and 31 more bits of the hash, probed linearly."""
        n = len(self._offsets) - 1
        size = 1 << max(4, (2 * n - 1).bit_length())  # at most half full
        slot_id, slot_tag = array("i", [-1]) * size, array("i", [0]) * size
        mask, blob, off = size - 1, self._blob, self._offsets
        for i in range(n):
            key = blob[off[i] : off[i + 1]]
            h = hash(key)
            j, tag = h & mask, (h >> 32) & 0x7FFFFFFF
            while (other := slot_id[j]) >= 0:
                if slot_tag[j] == tag and blob[off[other] : off[other + 1]] == key:
                    raise InvalidModelFile("tokenizer vocabulary has duplicate tokens")
                j = (j + 1) & mask
            slot_id[j], slot_tag[j] = i, tag
        self._slot_id, self._slot_tag, self._mask = slot_id, slot_tag, mask

    def _find(self, key: bytes) -> int | None:
        """The id of the token whose UTF-8 text is `key`."""
        h = hash(key)
        j, tag = h & self._mask, (h >> 32) & 0x7FFFFFFF
        slot_id, slot_tag, off = self._slot_id, self._slot_tag, self._offsets
        while (i := slot_id[j]) >= 0:
            if slot_tag[j] == tag and self._blob[off[i] : off[i + 1]] == key:
                return i
            j = (j + 1) & self._mask
        return None

    @staticmethod
    def _inner_pairs(blob: bytes, ends: np.ndarray) -> np.ndarray:
        """Every pair of adjacent characters inside some token (sorted keys): between any other pair of
        characters no merge can ever happen."""
        raw = np.frombuffer(blob, dtype=np.uint8)
        # characters before each byte offset: UTF-8 continuation bytes are 10xxxxxx
        chars_before = np.concatenate(([0], np.cumsum((raw & 0xC0) != 0x80)))
        char_ends = chars_before[ends]
        keys = _pair_keys(_code_points(blob.decode("utf-8", errors="surrogatepass")))
        inside = np.ones(len(keys), dtype=bool)
        across = char_ends[:-1] - 1  # the pair of one token's last and the next token's first character
        inside[across[(across >= 0) & (across < len(keys))]] = False
        return np.unique(keys[inside])

    @property
    def vocab_size(self) -> int:
        return len(self._offsets) - 1

    def id_to_token(self, token_id: int) -> str:
        return self._blob[self._offsets[token_id] : self._offsets[token_id + 1]].decode(
            "utf-8", errors="surrogatepass"
        )

    def token_to_id(self, text: str) -> int | None:
        return self._find(text.encode("utf-8", errors="surrogatepass"))

    # -- files ---------------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> None:
        np.savez(
            Path(folder) / VOCAB_FILE,
            text=np.frombuffer(self._blob, dtype=np.uint8),
            lengths=np.diff(np.frombuffer(self._offsets, dtype=np.int64)).astype(np.int32),
            scores=np.frombuffer(self.scores, dtype=np.float32),
            types=np.frombuffer(self.types, dtype=np.uint8),
            pairs=self._pairs,
        )

    @classmethod
    def load(cls, folder: str | Path, *, add_space_prefix: bool, unk_token: str | None) -> SentencePiece:
        try:
            with np.load(Path(folder) / VOCAB_FILE) as f:
                blob = f["text"].tobytes()
                lengths, scores, types, pairs = f["lengths"], f["scores"], f["types"], f["pairs"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise InvalidModelFile(f"cannot read {VOCAB_FILE} in {folder}: {e}") from e
        try:
            spm = cls(blob, lengths, scores, types, add_space_prefix=add_space_prefix, pairs=pairs)
        except InvalidModelFile as e:
            raise InvalidModelFile(f"{VOCAB_FILE} in {folder}: {e}") from e
        spm.unk_id = None if unk_token is None else spm.token_to_id(unk_token)
        return spm

    # -- encoding ------------------------------------------------------------------------------------

    def encode(
        self, text: str, *, parse_special: bool = True, literal_spans: Sequence[Span] = ()
    ) -> list[int]:
        """Ids for `text` without BOS/EOS (the caller adds them); specials inside `literal_spans` are text."""
        if not text:
            return []
        escaped = text.replace(" ", SPACE)  # one character for one: offsets stay
        cuts = self._cuts(escaped)
        out: list[int] = []
        prev_special = True  # a space prefix also starts the text
        for frag in self._partition(text, parse_special, literal_spans):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            start, end = frag
            if self.add_space_prefix and prev_special:
                if self._cuts(SPACE + escaped[start]):
                    out += self._piece(SPACE)
                    self._pieces(escaped, start, end, cuts, out)
                else:  # the prefix joins the first piece
                    k = bisect.bisect_right(cuts, start)
                    stop = min(cuts[k], end) if k < len(cuts) else end
                    out += self._piece(SPACE + escaped[start:stop])
                    self._pieces(escaped, stop, end, cuts, out)
            else:
                self._pieces(escaped, start, end, cuts, out)
            prev_special = False
        return out

    def _cuts(self, text: str) -> list[int]:
        """Offsets between two characters that no token holds side by side."""
        if len(text) < 2:
            return []
        if not len(self._pairs):  # no token longer than one character
            return list(range(1, len(text)))
        keys = _pair_keys(_code_points(text))
        at = np.searchsorted(self._pairs, keys)
        at[at == len(self._pairs)] = 0
        return (np.flatnonzero(self._pairs[at] != keys) + 1).tolist()

    def _pieces(self, text: str, start: int, end: int, cuts: list[int], out: list[int]) -> None:
        if start >= end:
            return
        i = bisect.bisect_right(cuts, start)
        j = bisect.bisect_left(cuts, end, lo=i)
        cache, piece = self._cache, self._piece
        for stop in (*cuts[i:j], end):
            word = text[start:stop]
            ids = cache.get(word)
            out += ids if ids is not None else piece(word)
            start = stop

    def _partition(self, text: str, parse_special: bool, literal_spans: Sequence[Span]) -> list[Span | int]:
        """tokenizer_st_partition: (start, end) spans of raw text and special token ids, in order.

        llama.cpp takes each special (longest first) at its leftmost occurrences inside what is still raw
        text. Same here from every occurrence of every special: in that order, an occurrence is taken
        unless it overlaps one taken before (by this special or an earlier one)."""
        if not self._specials:
            return [(0, len(text))]
        if self._find_specials is None:
            texts = sorted(self._special_rank)
            self._find_specials = re.compile(f"(?=({trie_pattern(texts)}))")
        found: dict[int, list[int]] = {}
        rank_of, prefixes = self._special_rank, self._prefixes
        for m in self._find_specials.finditer(text):
            longest, at = m.group(1), m.start()
            if (where := found.get(rank_of[longest])) is not None:
                where.append(at)
            else:
                found[rank_of[longest]] = [at]
            for special in prefixes.get(longest, ()):
                found.setdefault(rank_of[special], []).append(at)
        if not found:
            return [(0, len(text))]
        taken = bytearray(len(text))
        overlaps = taken.find
        hits: list[tuple[int, int, int]] = []
        for rank in sorted(found):
            special, token_id = self._specials[rank]
            if not parse_special and self.types[token_id] != TOKEN_USER_DEFINED:
                continue
            size = len(special)
            mark = b"\x01" * size
            for at in found[rank]:
                stop = at + size
                if overlaps(1, at, stop) >= 0:
                    continue
                if literal_spans and any(at < b and a < stop for a, b in literal_spans):
                    continue  # untrusted text: this occurrence is not the token
                taken[at:stop] = mark
                hits.append((at, stop, token_id))
        hits.sort()
        frags: list[Span | int] = []
        pos = 0
        for at, stop, token_id in hits:
            if at > pos:
                frags.append((pos, at))
            frags.append(token_id)
            pos = stop
        if pos < len(text):
            frags.append((pos, len(text)))
        return frags

    def _piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        ids = self._merge(piece)
        if len(piece) <= CACHE_PIECE_CHARS:
            if len(self._cache) >= CACHE_PIECES:
                self._cache.clear()  # cheaper than LRU bookkeeping; a new text refills it quickly
            self._cache[piece] = ids
        return ids

    def _merge(self, piece: str) -> list[int]:
        """llm_tokenizer_spm_session::tokenize on one piece: symbols start as characters; the adjacent pair
        that joins into the highest-scoring token (then the leftmost) merges until none does."""
        find, scores = self._lookup, self.scores
        data = piece.encode("utf-8", errors="surrogatepass")
        n = len(piece)
        if n == 1:
            token = find(data)
            return [token] if token >= 0 else self._bytes(data)
        if len(data) == n:
            start = list(range(n + 1))
        else:
            start = [0, *itertools.accumulate(len(c.encode("utf-8", errors="surrogatepass")) for c in piece)]
        # Symbol i starts at byte start[i] and keeps it; `size` is its length in bytes (0: merged away).
        size = [start[i + 1] - start[i] for i in range(n)]
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]
        heap = []
        for i in range(n - 1):
            token = find(data[start[i] : start[i + 2]])
            if token >= 0:
                heap.append((-scores[token], i, i + 1, start[i + 2] - start[i]))
        heapq.heapify(heap)  # score high first, then leftmost: llm_bigram_spm's comparator
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, joined = pop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != joined:
                continue  # one side changed since the pair was queued
            size[left] = joined
            size[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                total = size[before] + joined
                token = find(data[start[before] : start[before] + total])
                if token >= 0:
                    push(heap, (-scores[token], before, left, total))
            if after >= 0:
                total = joined + size[after]
                token = find(data[start[left] : start[left] + total])
                if token >= 0:
                    push(heap, (-scores[token], left, after, total))
        out: list[int] = []
        i = 0
        while i >= 0:
            symbol = data[start[i] : start[i] + size[i]]
            token = find(symbol)
            if token >= 0:
                out.append(token)
            else:  # only a single character can be no token: a merge always makes one
                out += self._bytes(symbol)
            i = nxt[i]
        return out

    def _lookup(self, key: bytes) -> int:
        """_find (-1: no such token) behind a memo: merges look up the same few thousand texts again and
        again, and a dict is ~20x faster than probing the table in Python."""
        token = self._memo.get(key)
        if token is None:
            found = self._find(key)
            token = -1 if found is None else found
            if len(self._memo) >= MEMO_KEYS:
                self._memo.clear()
            self._memo[key] = token
        return token

    def _bytes(self, data: bytes) -> list[int]:
        """A character missing from the vocabulary as its UTF-8 bytes (byte fallback). A byte without a
        token becomes the unknown token (llama.cpp would fail on it)."""
        out = []
        for b in data:
            token = self._byte_ids[b]
            if token is None:
                token = self.unk_id
            if token is not None:
                out.append(token)
        return out
