"""One onnxruntime session per loaded variant, with a preallocated KV buffer shared by past and present.

Decode binds the same KV buffers as GroupQueryAttention's past inputs and present outputs (its shared
buffer mode), a preallocated attention mask and a preallocated logits buffer: a decode step allocates and
copies nothing but the one-token input.

Longer than most modules (~700 lines) because the binding, the buffers it binds and the session options
that make them valid are one contract with onnxruntime: split, each half would have to know the other's
layout.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from models.errors import InvalidModelFile
from models.runtime.measured import remembered

KV_DTYPE = np.dtype(np.float32)  # the graph's KV type unless it declares another (graph_kv_dtype)
WEIGHTS_FILE = "weights.data"  # the converter's (models/convert/pipeline.py)
KEEP_INPUT = "num_logits_to_keep"  # the graph input saying how many of the last positions get logits
ROWS_ATOL = 1e-3  # logits of one position fed alone and in a batch: summation order only


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str = KV_DTYPE.name) -> int:
    """The one KV-size formula (memory planning, manifests, the engine's slots): a key and a value of
    head_dim elements of `kv_dtype` (fp32, or fp16 where the graph's cache is) per KV head per layer,
    exactly what KVCache allocates. Sliding-window layers keep the full context too (as llama.cpp's
    "full-size SWA cache"): GroupQueryAttention masks by position."""
    return 2 * n_layers * n_kv_heads * head_dim * np.dtype(kv_dtype).itemsize


def kv_slot_count(context_length: int, per_token: int, prefix_slots: int, prefix_budget_bytes: int) -> int:
    """How many full-context KV buffers an engine keeps for prefix reuse: `prefix_slots`, as many as the
    prefix budget holds, and always one (the reply needs it whatever the budget)."""
    slot = max(1, per_token * context_length)
    return max(1, min(prefix_slots, prefix_budget_bytes // slot))


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    kv_dtype: str = KV_DTYPE.name  # numpy's name of the cache's element type: the graph's (graph_kv_dtype)

    @classmethod
    def from_architecture(cls, arch: Mapping[str, Any]) -> ModelShape:
        """From a manifest's `architecture` (or ModelConfig.to_dict())."""
        return cls(int(arch["n_layers"]), int(arch["n_kv_heads"]), int(arch["head_dim"]), int(arch["vocab"]))

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, self.kv_dtype)


def kv_zeros(dims: tuple[int, ...], dtype: Any, prefault: bool) -> np.ndarray:
    """A zeroed KV buffer in its own anonymous mapping (where the OS has them), so its memory behaves the
    same in any process: the kernel maps a page only when it is first written, and dropping the buffer
    (an unload, a bigger slot) unmaps it at once. A np.zeros of the same size may come from heap a longer
    process freed earlier, which calloc writes over (resident at once) and a free keeps in the heap.
    Lazily mapped, RSS grows with the longest context seen, a few MB at a time, for as long as the process
    runs (the ladder benchmark's memory growth once warm measured 10 MB over ten requests, all KV). With
    `prefault` every page is mapped now, as llama.cpp clears its KV buffer at init: RSS is the memory
    planner's figure from the start (a model that fits is refused at load, never killed mid-reply) and any
    growth afterwards is a real leak."""
    count = int(np.prod(dims))
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # no anonymous mmap (Windows): the heap
        a = np.zeros(dims, dtype)
        if prefault:
            a.fill(0)  # the write is the point: a read would map the shared zero page
        return a
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if prefault:
        flags |= getattr(mmap, "MAP_POPULATE", 0)  # Linux: the kernel maps every page in the one call
    buf = mmap.mmap(-1, nbytes, flags=flags)
    a = np.frombuffer(buf, dtype, count).reshape(dims)  # the array keeps the mapping alive, and frees it
    if prefault and not getattr(mmap, "MAP_POPULATE", 0):
        a.fill(0)
    return a


class KVCache:
    """Per-layer key/value buffers [1, kv_heads, capacity, head_dim] of the shape's KV type (a session's
    shape carries its graph's), wrapped once as OrtValues."""

    def __init__(self, shape: ModelShape, capacity: int, prefault: bool = False) -> None:
        self.shape = shape
        self.capacity = capacity
        dims = (1, shape.n_kv_heads, capacity, shape.head_dim)
        dtype = np.dtype(shape.kv_dtype)
        self.arrays = [
            (kv_zeros(dims, dtype, prefault), kv_zeros(dims, dtype, prefault)) for _ in range(shape.n_layers)
        ]
        self.ortvalues = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays
        ]
        self.tokens: list[int] = []  # the token ids whose keys/values fill positions 0..len-1
        self.exact = 0  # positions 0..exact-1 hold what a cold prefill writes (note_write)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.arrays)

    def copy_prefix_from(self, other: KVCache, n: int) -> None:
        for (dk, dv), (sk, sv) in zip(self.arrays, other.arrays, strict=True):
            dk[:, :, :n] = sk[:, :, :n]
            dv[:, :, :n] = sv[:, :, :n]
        self.tokens = list(other.tokens[:n])
        self.exact = min(other.exact, n)


def note_write(cache: Any, pos: int, n: int, exact_pass: bool) -> None:
    """Before a pass writes positions pos..pos+n-1 of `cache`: how far its keys stay what a cold prefill
    of the same tokens writes (`cache.exact`, what prefix reuse may take). `exact_pass`: the pass's rows
    are bitwise a multi-position prefill's (PositionsExact). Positions past pos are overwritten, so the
    exact prefix never reaches beyond pos unless this pass extends it."""
    cache.exact = pos + n if exact_pass and cache.exact >= pos else min(cache.exact, pos)


def cold_pass(pos: int, n: int, chunk: int, one_position: bool, passes: bool) -> bool:
    """Whether a pass writing positions pos..pos+n-1 writes what a cold prefill of the same tokens writes
    (note_write's `exact_pass`), from the session's Exactness and the prefill chunk. Where passes of
    several positions are exact (x86), any pass of several does, and one of one position where those are
    exact too. Where passes depend on their number of positions (ARM's kernels), only the pass a cold
    prefill itself runs there: a whole chunk starting at a multiple of it, as prefill_end plans a prompt
    from position 0 (its last, shorter pass is no longer prompt's), so a prefix is reused a chunk at a
    time (reusable_prefix) and the keys before it are the ones that prompt's cold prefill would write."""
    if not passes:
        return n == chunk and pos % chunk == 0
    return n > 1 or one_position


def exact_prefix(cache: Any) -> int:
    """The leading positions of `cache` a prompt may reuse and still get the logits a cold prefill gives."""
    return min(getattr(cache, "exact", 0), len(cache.tokens))


@dataclass(frozen=True)
class Exactness:
    """What a session's passes keep bitwise (measure_exactness).

    `one_position`: a pass feeding one position after a past gives bitwise the logits that position gets
    as the last of a pass of several. On onnxruntime 1.32 x86 it does not, with int8 activations (q4-a8:
    GroupQueryAttention's token path against its prompt path, 0.5 apart in SmolLM2's logits) nor with
    fp32 ones (q4: MatMulNBits' one-row kernel, ~2e-5). Where it does not, a prefill never runs a pass of
    one position (prefill_end) and prefix reuse takes only keys written by passes of several
    (exact_prefix).

    `passes`: the positions of a pass of several get bitwise the same keys, values and logits whatever
    the pass's number of positions. On onnxruntime 1.32 x86 they do; on ARM's kernels (an emulated
    Cortex-A76) they do not, and not for every split: a prompt prefilled as 74 + 2 positions gave
    logprobs a few ulps from one pass of 76, where 13 + 11 against 24 agreed. There the last position's
    logits of 74 + 2 were still bitwise those of 76 while two positions' keys and values were not (the
    tiny test model: an ulp in one key does not reach its logits, but it reaches the next tokens'), so
    the probe compares what the passes wrote too. Where they do not, a prefix is reused only in the
    whole prefill chunks a cold prefill runs (cold_pass, reusable_prefix).

    Either way a reply's text never depends on how much of its prompt was cached."""

    one_position: bool
    passes: bool

    @staticmethod
    def valid(facts: Any) -> bool:
        """Whether `facts` (read back from measured.json) are an Exactness's fields."""
        fields = {f.name for f in dataclasses.fields(Exactness)}
        return (
            isinstance(facts, dict)
            and set(facts) == fields
            and all(isinstance(v, bool) for v in facts.values())
        )


def is_bool(fact: Any) -> bool:
    return isinstance(fact, bool)


# The probe: 76 positions (the ARM case above; 24 showed nothing there), split for a last pass of one
# position (Exactness.one_position), and for first passes leaving 1 and 2 positions past a multiple of 4
# with last ones of 63 and 2 (Exactness.passes).
PROBE_POSITIONS = 76
ONE_POSITION_SPLIT = PROBE_POSITIONS - 1
PASS_SPLITS = (13, PROBE_POSITIONS - 2)


def same_kv(a: Any, b: Any) -> bool:
    """Whether two caches hold bitwise the same keys and values (True where the cache's arrays are not
    ours to read: GrowingKV's live in onnxruntime's values)."""
    ours, theirs = getattr(a, "arrays", None), getattr(b, "arrays", None)
    if ours is None or theirs is None:
        return True
    return all(
        np.array_equal(x, y) for pair in zip(ours, theirs, strict=True) for x, y in zip(*pair, strict=True)
    )


def measure_exactness(run: Any, new_cache: Any, vocab: int) -> Exactness:
    """Exactness, measured, not assumed: PROBE_POSITIONS in one pass against two passes split at
    ONE_POSITION_SPLIT and at each of PASS_SPLITS, on throwaway caches: the last position's logits and all
    the keys and values written. Seven passes, once per file and machine (measured.py)."""
    n = PROBE_POSITIONS
    probe = np.array([(j * 7919 + 11) % vocab for j in range(n)])
    whole_cache = new_cache(n)
    whole = run(probe, whole_cache, 0).copy()

    def split_agrees(cut: int) -> bool:
        cache = new_cache(n)
        run(probe[:cut], cache, 0)
        return bool(np.array_equal(run(probe[cut:], cache, cut), whole)) and same_kv(cache, whole_cache)

    return Exactness(split_agrees(ONE_POSITION_SPLIT), all(split_agrees(cut) for cut in PASS_SPLITS))


def prefill_end(pos: int, total: int, chunk: int, exact: bool) -> int:
    """Where the prefill pass starting at `pos` of a context of `total` positions ends: `chunk` positions
    at most, and (unless one-position passes are `exact`) never leaving one position for a last pass of
    its own (that pass then takes one more, or this one one less)."""
    end = min(total, pos + max(1, chunk))
    if not exact and total - end == 1:
        end = end - 1 if end - pos >= 3 else end + 1
    return end


PREFAULT_ALL_MAX = 96 << 20  # when all that stays mapped is at most this, all of it is read in at load
PREFAULT_MAX_BYTES = 4 << 20  # otherwise mappings up to this size are; larger ones are only advised


def folder_mappings(folder: Path, maps: Path = Path("/proc/self/maps")) -> dict[str, tuple[int, int]]:
    """This process's readable mappings of files in `folder`: {maps line up to the path (address range,
    permissions, offset, device, inode): (start, length)}. Empty where there is no procfs."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return {}
    root = str(Path(folder).resolve()) + "/"
    found = {}
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith(root) or "r" not in parts[1]:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        found[" ".join(parts[:5])] = (start, end - start)
    return found


def prefault_mappings(
    folder: Path,
    maps: Path = Path("/proc/self/maps"),
    touch_max: int = PREFAULT_MAX_BYTES,
    all_max: int = PREFAULT_ALL_MAX,
    skip: Collection[str] = (),
) -> int:
    """Bring the weights that this process maps from files in `folder` into memory at load; returns the
    bytes made resident. `skip`: mappings (folder_mappings keys) that were there before the session being
    loaded, left out of the decision: a session rebuilt for another thread count or spinning maps the
    same tables while the one it replaces is still alive, and counting both (SmolLM2: 2 x 54 MB) left its
    27 MB lookup table only advised, read in a few rows per new token for as long as the process runs
    (7.7 MB over the ten replies after the governor's thread change, SmolLM2 q4-a8 on a worker thread).

    onnxruntime maps the weights file and unmaps what its kernels prepack, so what stays mapped is read in
    place: small tensors read whole by every token (norms), and tables of which a token reads a few rows
    (the embedding lookup, the RoPE caches).
    - Read in now, one byte a page: everything when it all fits in `all_max` (SmolLM2: 54 MB), else every
      mapping up to `touch_max`. Those pages come in at load rather than a few per token for hours, which
      looked like a slow leak (the soak benchmark).
    - Only advised (MADV_WILLNEED) otherwise: the larger mappings of a model whose mapped tables are large
      (Gemma 3: the lookup's 168 + 21 MB and four 17 MB RoPE caches for a 32k context). The kernel reads
      them into the page cache, so a row seen for the first time mid-reply costs a minor fault, never a
      disk read, and RSS counts the rows used: reading Gemma's in at load cost 245 MB of RSS, mostly rows
      never looked up, against 42 MB touched by a 500-token prompt (the kernel maps up to 16 neighbouring
      cached pages per fault). RSS grows as new rows are looked up, up to what reading it all costs.
    The pages are the file's own (clean, shared with the page cache), so neither copies anything. Linux
    only; elsewhere a no-op."""
    spans = [span for key, span in folder_mappings(folder, maps).items() if key not in skip]
    limit = max(all_max, touch_max) if sum(n for _, n in spans) <= all_max else touch_max
    total = 0
    for start, n in spans:
        if n > limit:
            _advise_willneed(start, n)
            continue
        view = np.frombuffer(memoryview((ctypes.c_ubyte * n).from_address(start)), np.uint8)
        int(view[:: mmap.PAGESIZE].sum())  # the read is the point
        total += n
    return total


def _advise_willneed(start: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_WILLNEED)


def release_copied(
    weights: Path, spans: Collection[Sequence[int]], maps: Path = Path("/proc/self/maps")
) -> set[str]:
    """Give back the pages of initializers the kernels copied when they packed their weights and never read
    again (the converter lists them per variant: `copied_at_load`, [offset, length] in the weights file).

    onnxruntime maps each initializer of the weights file on its own; MatMulNBits with int8 activations
    copies its scales into its packed weights and keeps the scales' mapping, whose pages stay resident
    because packing read them: 247 MB of Qwen2.5-Coder 1.5B's 1,990 MB, 69 MB of the 0.5B's 795 MB. They
    are the file's own clean pages: dropping them copies nothing, and were one read again it would come
    back from the page cache. Returns the mappings released (folder_mappings keys), for prefault_mappings to
    leave alone. Linux only; elsewhere a no-op."""
    if not spans or not hasattr(mmap, "MADV_DONTNEED"):
        return set()
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return set()
    path = str(Path(weights).resolve())
    wanted = sorted((int(o), int(n)) for o, n in spans)
    released = set()
    libc = ctypes.CDLL(None, use_errno=True)
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[5] != path:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        file_off = int(parts[2], 16)
        # one mapping per initializer, from the page its bytes start in
        hit = next(
            (
                o
                for o, n in wanted
                if file_off <= o < file_off + mmap.PAGESIZE and o + n <= file_off + end - start
            ),
            None,
        )
        if hit is None:
            continue
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)
        released.add(" ".join(parts[:5]))
    return released


# The converter writes fp32 or fp16 caches; an int8 one (a quantized cache, with its scales in the graph)
# is bound the same way, its bytes counted by its element size.
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


def graph_kv_dtype(sess: ort.InferenceSession, past_input: str) -> str:
    """The KV cache's element type as the graph declares its past input (numpy's name): the buffers are
    allocated in it, never assumed. fp32, or fp16 where the converter chose a half cache
    (models/convert/kv_dtype.py)."""
    kv_type = next((i.type for i in sess.get_inputs() if i.name == past_input), None)
    if kv_type not in _ORT_DTYPES:
        raise InvalidModelFile(
            f"the graph's {past_input} is of type {kv_type}: a KV cache of fp32, fp16 or int8 is supported"
        )
    return np.dtype(_ORT_DTYPES[kv_type]).name


def new_run_options() -> ort.RunOptions:
    return ort.RunOptions()


def session_options(threads: int, spinning: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # onnxruntime's memory patterns cache one plan per distinct set of input shapes, never dropped: every
    # attention length a decode step sees adds ~25 KB (SmolLM2 and Gemma 3 alike), 24 MB by position 1000,
    # up to ~100 MB over a 2048-token context. Without them the arena serves each run's tensors: the same
    # speed measured (decode and a 200-token prefill within 6 %, either way), and heap flat once warm.
    so.enable_mem_pattern = False
    # a spinning pool burns a core while idle: on a phone that is heat for nothing
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


class DecoderSession:
    def __init__(
        self,
        path: Path,
        shape: ModelShape,
        threads: int,
        *,
        spinning: bool = False,
        copied_at_load: Collection[Sequence[int]] = (),
    ) -> None:
        """`copied_at_load`: the manifest's spans of the weights file that packing copied (release_copied)."""
        self.path = Path(path)
        self.shape = shape
        self.threads = threads
        before = folder_mappings(self.path.parent)
        self.sess = ort.InferenceSession(
            str(path), session_options(threads, spinning), providers=["CPUExecutionProvider"]
        )
        released = release_copied(self.path.parent / WEIGHTS_FILE, copied_at_load)
        prefault_mappings(self.path.parent, skip=set(before) | released)
        if shape.n_layers:  # the caches this session binds are of its graph's KV type
            self.shape = dataclasses.replace(
                shape, kv_dtype=graph_kv_dtype(self.sess, "past_key_values.0.key")
            )
        # Graphs from converter 7 on take num_logits_to_keep (an input with a default, which onnxruntime
        # lists as an overridable initializer); older folders give the last position only.
        self.multi_logits = any(
            i.name == KEEP_INPUT for i in [*self.sess.get_inputs(), *self.sess.get_overridable_initializers()]
        )
        self.logits = np.zeros((1, 1, shape.vocab), np.float32)
        self._logits_ovs: dict[int, ort.OrtValue] = {}  # k -> a [1, k, vocab] view of self.logits
        self._keep: dict[int, ort.OrtValue] = {}
        self._bound_k = 0
        self._mask = np.ones((1, 0), np.int64)
        self.run_options = ort.RunOptions()
        self._binding: ort.IOBinding | None = None
        self._bound_kv: KVCache | None = None

    def _mask_view(self, total: int) -> np.ndarray:
        if self._mask.shape[1] < total:
            self._mask = np.ones((1, max(total, 2 * self._mask.shape[1], 64)), np.int64)
        return self._mask[:, :total]

    def run(
        self, ids: np.ndarray, kv: KVCache, past_len: int, run_options: ort.RunOptions | None = None
    ) -> np.ndarray:
        """Feed `ids` at positions past_len.. (KV beyond past_len is overwritten). Returns the last
        position's logits (a view into a buffer reused by the next call). `run_options`: the caller's own
        (one per generation, so a late cancel of one generation cannot stop the next)."""
        return self.run_last(ids, kv, past_len, 1, run_options)[0]

    def run_last(
        self,
        ids: np.ndarray,
        kv: KVCache,
        past_len: int,
        k: int,
        run_options: ort.RunOptions | None = None,
    ) -> np.ndarray:
        """As run, but the logits of the last k positions, [k, vocab] (a speculative verification pass).
        k > 1 needs a graph with num_logits_to_keep (multi_logits)."""
        n = int(ids.shape[-1])
        if past_len + n > kv.capacity:
            raise ValueError(f"KV buffer holds {kv.capacity} tokens, asked for {past_len + n}")
        if not 1 <= k <= n or (k > 1 and not self.multi_logits):
            raise ValueError(f"cannot give logits for the last {k} of {n} positions")
        b = self._binding_for(kv)
        if k != self._bound_k:
            self._bind_k(b, k)
        b.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64).reshape(1, n))
        b.bind_cpu_input("attention_mask", self._mask_view(past_len + n))
        self.sess.run_with_iobinding(b, run_options or self.run_options)
        return self.logits[0, :k]

    @cached_property
    def rows_exact(self) -> bool:
        """Whether a pass of several positions gives each the logits feeding it alone gives (up to
        summation order), so a speculative verification pass decides exactly what plain decoding would.
        Measured, not assumed. On onnxruntime 1.32's x86 kernels the one-row and the multi-row paths of
        MatMulNBits (and of the fp32 MatMul) sum in a different order, ~1e-7 apart per linear, with the
        same activation quantization; with fp32 activations that stays ~6e-5 in SmolLM2's logits, but
        int8 activations round it up to a whole quantum now and then and 30 layers amplify it to 0.3-0.8
        (argmax flips), also on an all-8-bit graph. Rows of passes with two or more positions are
        bitwise equal whatever their number (measured on the real graph). Six probe passes on a
        throwaway cache, once per file and machine (measured.py)."""
        if not self.multi_logits:
            return False
        return bool(remembered(self.path, self.threads, "rows_exact", self._measure_rows_exact, is_bool))

    def _measure_rows_exact(self) -> bool:
        probe = [(j * 7919 + 11) % self.shape.vocab for j in range(6)]
        kv = KVCache(self.shape, len(probe))
        self.run(np.array(probe[:2]), kv, 0)
        alone = np.stack([self.run(np.array([t]), kv, 2 + i).copy() for i, t in enumerate(probe[2:])])
        together = self.run_last(np.array(probe[2:]), kv, 2, len(probe) - 2)
        exact = bool(np.abs(together - alone).max() <= ROWS_ATOL) and bool(
            (together.argmax(-1) == alone.argmax(-1)).all()
        )
        self.unbind()  # the probe cache goes
        return exact

    @cached_property
    def exactness(self) -> Exactness:
        """measure_exactness on this session (at load; once per file and machine: measured.py)."""

        def measure() -> dict[str, bool]:
            exact = measure_exactness(self.run, lambda n: KVCache(self.shape, n), self.shape.vocab)
            self.unbind()  # the probe caches go
            return dataclasses.asdict(exact)

        return Exactness(**remembered(self.path, self.threads, "exactness", measure, Exactness.valid))

    @property
    def positions_exact(self) -> bool:
        return self.exactness.one_position

    @property
    def passes_exact(self) -> bool:
        return self.exactness.passes

    def _bind_k(self, b: ort.IOBinding, k: int) -> None:
        """Bind a [1, k, vocab] view of the logits buffer (grown when k is larger than ever before: one
        buffer, so the views of smaller k stay valid) and the matching num_logits_to_keep."""
        if k > self.logits.shape[1]:
            self.logits = np.zeros((1, max(k, 2 * self.logits.shape[1]), self.shape.vocab), np.float32)
            self._logits_ovs.clear()
        if k not in self._logits_ovs:
            self._logits_ovs[k] = ort.OrtValue.ortvalue_from_numpy(self.logits[:, :k])
        b.bind_ortvalue_output("logits", self._logits_ovs[k])
        if self.multi_logits:
            # an OrtValue: bind_cpu_input refuses an input that has a default ("Failed to find NodeArg")
            if k not in self._keep:
                self._keep[k] = ort.OrtValue.ortvalue_from_numpy(np.array(k, np.int64))
            b.bind_ortvalue_input(KEEP_INPUT, self._keep[k])
        self._bound_k = k

    def unbind(self) -> None:
        """Forget the KV bound between calls, so a throwaway cache (a probe's) is freed; the next run binds
        its own."""
        self._binding, self._bound_kv = None, None

    def _binding_for(self, kv: KVCache) -> ort.IOBinding:
        """The KV buffers and logits stay bound between calls: rebinding 60 OrtValues per token costs
        about 0.1 ms, a percent of a decode step."""
        if self._bound_kv is not kv:
            b = self.sess.io_binding()
            for i, (k, v) in enumerate(kv.ortvalues):
                b.bind_ortvalue_input(f"past_key_values.{i}.key", k)
                b.bind_ortvalue_input(f"past_key_values.{i}.value", v)
                b.bind_ortvalue_output(f"present.{i}.key", k)
                b.bind_ortvalue_output(f"present.{i}.value", v)
            self._bind_k(b, 1)
            self._binding, self._bound_kv = b, kv
        assert self._binding is not None
        return self._binding

    def terminate(self) -> None:
        """Stop a running Run between nodes (called from another thread on cancel)."""
        self.run_options.terminate = True

    def reset_terminate(self) -> None:
        self.run_options.terminate = False


# ---- the general path: decoders in onnxruntime-genai's layout that we did not build ------------------------
#
# Our own folders keep the fast path above (one shared fp32 buffer, last-position logits, a binding kept
# between calls). A foreign decoder says in its genai_config.json whether past and present share a buffer; its
# KV and logits dtype come from the session's own inputs and outputs (fp32 or fp16), and its logits may cover
# every position ([batch, seq, vocab]) or the last one ([batch, 1, vocab]): the last row is what we use.

_ORT_INT_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


class SharedKV(KVCache):
    """KVCache in the decoder's own dtype: past and present are one buffer per layer."""

    def __init__(
        self, shape: ModelShape, capacity: int, dtype: type = np.float32, prefault: bool = False
    ) -> None:
        self.shape = shape
        self.capacity = capacity
        dims = (1, shape.n_kv_heads, capacity, shape.head_dim)
        self.arrays = [
            (kv_zeros(dims, dtype, prefault), kv_zeros(dims, dtype, prefault)) for _ in range(shape.n_layers)
        ]
        self.ortvalues = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays
        ]
        self.tokens = []
        self.exact = 0


class GrowingKV:
    """Separate past and present: the presents of one run ([1, kv_heads, length, head_dim], allocated by
    onnxruntime) are the pasts of the next, passed back without a copy."""

    def __init__(
        self, shape: ModelShape, capacity: int, dtype: type = np.float32, prefault: bool = False
    ) -> None:
        # `prefault` has nothing to touch: onnxruntime allocates each run's presents
        self.shape = shape
        self.capacity = capacity
        self.dtype = dtype
        empty = np.zeros((1, shape.n_kv_heads, 0, shape.head_dim), dtype)
        self.values = [
            (ort.OrtValue.ortvalue_from_numpy(empty), ort.OrtValue.ortvalue_from_numpy(empty))
            for _ in range(shape.n_layers)
        ]
        self.length = 0
        self.tokens: list[int] = []
        self.exact = 0  # as KVCache's

    @property
    def nbytes(self) -> int:
        per_token = self.shape.n_kv_heads * self.shape.head_dim * np.dtype(self.dtype).itemsize
        return 2 * self.shape.n_layers * self.length * per_token

    def past(self, n: int) -> list[tuple[ort.OrtValue, ort.OrtValue]]:
        """The first n positions. Reusing a shorter prefix than we hold (another prompt) copies them."""
        if n == self.length:
            return self.values
        if n > self.length:
            raise ValueError(f"the KV cache holds {self.length} positions, asked to continue at {n}")

        def cut(v: ort.OrtValue) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :n]))

        return [(cut(k), cut(v)) for k, v in self.values]

    def copy_prefix_from(self, other: GrowingKV, n: int) -> None:
        self.values, self.length = other.past(n), n
        self.tokens = list(other.tokens[:n])
        self.exact = min(other.exact, n)


class GeneralDecoderSession:
    """Runs a decoder described by a DecoderIO (models/runtime/genai_config.py); same interface as
    DecoderSession, plus `new_cache` for the KV layout it needs."""

    def __init__(self, path: Path, io: Any, threads: int, *, spinning: bool = False) -> None:
        self.path = Path(path)
        self.io = io
        self.shape = ModelShape(io.n_layers, io.n_kv_heads, io.head_dim, io.vocab)
        self.threads = threads
        before = folder_mappings(self.path.parent)
        self.sess = ort.InferenceSession(
            str(path), session_options(threads, spinning), providers=["CPUExecutionProvider"]
        )
        ins = {i.name: i.type for i in self.sess.get_inputs()}
        outs = {o.name: o.type for o in self.sess.get_outputs()}
        self.past_names = [(io.past_key % i, io.past_value % i) for i in range(io.n_layers)]
        self.present_names = [(io.present_key % i, io.present_value % i) for i in range(io.n_layers)]
        missing = [n for n in [io.input_ids, *(x for p in self.past_names for x in p)] if n not in ins]
        missing += [n for n in [io.logits, *(x for p in self.present_names for x in p)] if n not in outs]
        if missing:
            raise InvalidModelFile(
                f"{self.path.name} has no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, "
                "which genai_config.json names"
            )
        kv_type = ins[self.past_names[0][0]]
        if kv_type not in _ORT_DTYPES:
            raise InvalidModelFile(
                f"{self.path.name}: KV cache of type {kv_type} is not supported (fp32, fp16)"
            )
        self.kv_dtype = _ORT_DTYPES[kv_type]
        self.shape = dataclasses.replace(self.shape, kv_dtype=np.dtype(self.kv_dtype).name)
        self.ids_dtype = _ORT_INT_DTYPES.get(ins[io.input_ids], np.int64)
        self.mask_name = io.attention_mask if io.attention_mask in ins else None
        positions = io.position_ids or "position_ids"
        self.positions_name = positions if positions in ins else None
        self.mask_dtype = _ORT_INT_DTYPES.get(ins.get(self.mask_name or "", ""), np.int64)
        self.positions_dtype = _ORT_INT_DTYPES.get(ins.get(self.positions_name or "", ""), np.int64)
        self.run_options = ort.RunOptions()
        prefault_mappings(self.path.parent, skip=before)

    @cached_property
    def exactness(self) -> Exactness:
        """measure_exactness on this session (at its first use; once per file and machine: measured.py)."""

        def measure() -> dict[str, bool]:
            return dataclasses.asdict(measure_exactness(self.run, self.new_cache, self.shape.vocab))

        return Exactness(**remembered(self.path, self.threads, "exactness", measure, Exactness.valid))

    @property
    def positions_exact(self) -> bool:
        return self.exactness.one_position

    @property
    def passes_exact(self) -> bool:
        return self.exactness.passes

    def new_cache(self, capacity: int, prefault: bool = False) -> SharedKV | GrowingKV:
        kind = SharedKV if self.io.share_buffer else GrowingKV
        return kind(self.shape, capacity, self.kv_dtype, prefault)

    def run(
        self, ids: np.ndarray, kv: Any, past_len: int, run_options: ort.RunOptions | None = None
    ) -> np.ndarray:
        """Feed `ids` at positions past_len.. and return the last position's logits as fp32.
        `run_options`: the caller's own, as in DecoderSession.run."""
        n = int(ids.shape[-1])
        if past_len + n > kv.capacity:
            raise ValueError(f"KV buffer holds {kv.capacity} tokens, asked for {past_len + n}")
        b = self.sess.io_binding()
        b.bind_cpu_input(self.io.input_ids, np.ascontiguousarray(ids, dtype=self.ids_dtype).reshape(1, n))
        if self.mask_name is not None:
            b.bind_cpu_input(self.mask_name, np.ones((1, past_len + n), self.mask_dtype))
        if self.positions_name is not None:
            positions = np.arange(past_len, past_len + n, dtype=self.positions_dtype).reshape(1, n)
            b.bind_cpu_input(self.positions_name, positions)
        shared = isinstance(kv, SharedKV)
        pasts = kv.ortvalues if shared else kv.past(past_len)
        for (pk, pv), (k, v) in zip(self.past_names, pasts, strict=True):
            b.bind_ortvalue_input(pk, k)
            b.bind_ortvalue_input(pv, v)
        for (ok, ov), (k, v) in zip(self.present_names, pasts, strict=True):
            if shared:
                b.bind_ortvalue_output(ok, k)
                b.bind_ortvalue_output(ov, v)
            else:
                b.bind_output(ok, "cpu")
                b.bind_output(ov, "cpu")
        b.bind_output(self.io.logits, "cpu")
        self.sess.run_with_iobinding(b, run_options or self.run_options)
        outputs = b.get_outputs()
        if not shared:
            kv.values = [(outputs[2 * i], outputs[2 * i + 1]) for i in range(self.io.n_layers)]
            kv.length = past_len + n
        logits = outputs[-1].numpy()  # [1, 1, vocab] or [1, n, vocab]
        return np.asarray(logits[0, -1], dtype=np.float32)

    def terminate(self) -> None:
        self.run_options.terminate = True

    def reset_terminate(self) -> None:
        self.run_options.terminate = False
