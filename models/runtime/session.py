"""One onnxruntime session per loaded variant, with a preallocated KV buffer shared by past and present.

Decode binds the same KV buffers as GroupQueryAttention's past inputs and present outputs (its shared
buffer mode), a preallocated attention mask and a preallocated logits buffer: a decode step allocates and
copies nothing but the one-token input.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab: int

    def kv_bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4


class KVCache:
    """Per-layer key/value buffers [1, kv_heads, capacity, head_dim], wrapped once as OrtValues."""

    def __init__(self, shape: ModelShape, capacity: int) -> None:
        self.shape = shape
        self.capacity = capacity
        dims = (1, shape.n_kv_heads, capacity, shape.head_dim)
        self.arrays = [
            (np.zeros(dims, np.float32), np.zeros(dims, np.float32)) for _ in range(shape.n_layers)
        ]
        self.ortvalues = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays
        ]
        self.tokens: list[int] = []  # the token ids whose keys/values fill positions 0..len-1

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.arrays)

    def copy_prefix_from(self, other: KVCache, n: int) -> None:
        for (dk, dv), (sk, sv) in zip(self.arrays, other.arrays, strict=True):
            dk[:, :, :n] = sk[:, :, :n]
            dv[:, :, :n] = sv[:, :, :n]
        self.tokens = list(other.tokens[:n])


def prefault_mappings(folder: Path, maps: Path = Path("/proc/self/maps")) -> int:
    """Read one byte of every page that this process maps from files in `folder`; returns the bytes.

    onnxruntime maps the weights file and reads some tensors in place, the embedding table among them.
    Each page comes in the first time a token whose row lies on it is looked up, so RSS creeps up for
    hours (about 30 MiB for SmolLM2's table) and a rare token can cost a disk read mid-reply. Reading them
    once at load makes RSS what the model really holds, from the start. The pages are the file's own
    (clean, shared with the page cache), so this copies nothing. Linux only; elsewhere a no-op."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return 0
    root = str(Path(folder).resolve()) + "/"
    total = 0
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith(root) or "r" not in parts[1]:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        view = np.frombuffer((ctypes.c_ubyte * (end - start)).from_address(start), np.uint8)
        int(view[:: mmap.PAGESIZE].sum())  # the read is the point
        total += end - start
    return total


def new_run_options() -> ort.RunOptions:
    return ort.RunOptions()


def session_options(threads: int, spinning: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # a spinning pool burns a core while idle: on a phone that is heat for nothing
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


class DecoderSession:
    def __init__(self, path: Path, shape: ModelShape, threads: int, *, spinning: bool = False) -> None:
        self.path = Path(path)
        self.shape = shape
        self.threads = threads
        self.sess = ort.InferenceSession(
            str(path), session_options(threads, spinning), providers=["CPUExecutionProvider"]
        )
        prefault_mappings(self.path.parent)
        self.logits = np.zeros((1, 1, shape.vocab), np.float32)
        self._logits_ov = ort.OrtValue.ortvalue_from_numpy(self.logits)
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
        n = int(ids.shape[-1])
        if past_len + n > kv.capacity:
            raise ValueError(f"KV buffer holds {kv.capacity} tokens, asked for {past_len + n}")
        b = self._binding_for(kv)
        b.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64).reshape(1, n))
        b.bind_cpu_input("attention_mask", self._mask_view(past_len + n))
        self.sess.run_with_iobinding(b, run_options or self.run_options)
        return self.logits[0, 0]

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
            b.bind_ortvalue_output("logits", self._logits_ov)
            self._binding, self._bound_kv = b, kv
        assert self._binding is not None
        return self._binding

    def terminate(self) -> None:
        """Stop a running Run between nodes (called from another thread on cancel)."""
        self.run_options.terminate = True

    def reset_terminate(self) -> None:
        self.run_options.terminate = False
