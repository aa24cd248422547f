"""Build the ONNX decoder graph for a GGUF of any supported family with onnxruntime's fused contrib ops.

I/O follows onnxruntime-genai's decoder convention:
  inputs  input_ids int64 [batch, seq], attention_mask int64 [batch, total],
          past_key_values.N.key / .value float32 (or float16: VariantSpec.kv_dtype) [batch, kv_heads, past,
          head_dim]
          num_logits_to_keep int64 scalar, optional: how many of the last positions get logits; 0 (the
          default, as in Hugging Face's logits_to_keep) means all of them
  outputs logits float32 [batch, positions kept, vocab] (simmer's prefill asks for the last one; a
          speculative verification pass for one per drafted token and one more),
          present.N.key / .value as the pasts [batch, kv_heads, total (or the shared buffer length), head_dim]
Per layer (convert/block.py, the family's flags decide the optional parts): fused QKV projection (+ bias)
(-> per-head Q/K norm) -> GroupQueryAttention (rotary inside, the family's pairing and the layer's RoPE
cache and window; past and present may share one buffer) -> output projection (-> post norm) ->
SkipSimplifiedLayerNormalization -> fused gate+up -> act(gate) * up -> down (-> post norm) ->
SkipSimplifiedLayerNormalization into the next layer's attention norm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from models.convert.block import attention, mlp, rms_norm, skip_norm
from models.convert.embedding import TABLE, embed_tokens, lm_head
from models.convert.fast_plan import PLANS, Plan
from models.convert.linear import FLOAT_TYPES, MS, REQUANT_TAG
from models.convert.model import GGUFModel
from models.gguf.quant import Packing, packing
from models.gguf.reader import Tensor, dequantize_rows

OPSET = 17
KV_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}  # VariantSpec.kv_dtype

ALIGN = 64


@dataclass(frozen=True)
class VariantSpec:
    """How a variant maps tensors (the rule table is in convert/linear.py)."""

    name: str
    accuracy_level: int  # MatMulNBits: 1 = fp32 activations, 4 = int8 activations
    exact_blocks: bool  # block formats at their own width (exact); False: everything dequantized to fp32
    min_bits: int = 4  # block formats narrower than this are widened (exactly)
    float_bits: int | None = None  # float matrices quantized symmetrically to this width; None: kept fp32
    requant: Plan | None = None  # matrices re-encoded for the cheapest kernels (convert/fast_plan.py)
    # The KV cache's element type (numpy's name): "float16" halves it, and GroupQueryAttention then runs in
    # fp16 between casts (convert/block.py, convert/kv_dtype.py).
    kv_dtype: str = "float32"


VARIANTS = {
    "f32": VariantSpec("f32", 1, exact_blocks=False),
    "q8": VariantSpec("q8", 4, exact_blocks=True, min_bits=8, float_bits=8),
    # the exact variant: GGUF blocks as they are, fp32 activations
    "q4": VariantSpec("q4", 1, exact_blocks=True),
    "q4-a8": VariantSpec("q4-a8", 4, exact_blocks=True, float_bits=4),
    # re-encoded for the fewest bytes per token; installed only within the measured quality floor
    "fast": VariantSpec("fast", 4, exact_blocks=True, float_bits=4, requant=PLANS[0]),
}


# An array larger than this whose rows can be computed a band at a time is written that way (a
# vocabulary-sized table's codes, scales and offsets), so it is never whole in memory.
BAND_BYTES = 16 << 20


@dataclass(frozen=True)
class Planned:
    """An initializer known by shape and type before its values exist. The builder declares every weight
    this way, so the same build with a dry WeightFile sizes a conversion from the GGUF header alone
    (models/convert/disk_plan.py), and a real one checks each computed array against its declaration.
    `rows`, when given, computes rows lo..hi-1 (along the first axis) alone."""

    shape: tuple[int, ...]
    dtype: type
    make: Callable[[], np.ndarray]
    rows: Callable[[int, int], np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(1, self.shape[0])


class WeightFile:
    """Writes initializers into one external-data file that several graphs may reference. `dry`: nothing is
    computed or written, every offset is the same as in a real build (`size` is the file's length)."""

    def __init__(self, path: Path, *, dry: bool = False) -> None:
        self.path = path
        self.dry = dry
        self._f = None if dry else open(path, "wb")  # noqa: SIM115 - closed in close()
        self._cache: dict[str, TensorProto] = {}
        self.size = 0

    def add(self, name: str, value: np.ndarray | Planned) -> TensorProto:
        return self.add_many([(name, value)])[0]

    def add_many(self, items: list[tuple[str, np.ndarray | Planned]]) -> list[TensorProto]:
        """Several initializers, placed one after another (the offsets `add` would give them one by one).
        Those whose rows come from one source (a table's codes, scales and offsets) are written a band of
        rows at a time across all of them, so each band of the source is computed once and none of them is
        ever whole in memory."""
        out: list[TensorProto] = []
        todo: list[tuple[str, np.ndarray | Planned, int]] = []
        for name, value in items:
            if name not in self._cache:
                pos = self.size + (-self.size) % ALIGN
                shape, dtype = tuple(value.shape), np.dtype(value.dtype)
                self.size = pos + value.nbytes
                self._cache[name] = _external(name, shape, dtype, self.path.name, pos, value.nbytes)
                todo.append((name, value, pos))
            out.append(self._cache[name])
        if self._f is not None:
            banded = [x for x in todo if _bandable(x[1], todo[0][1])]
            if sum(x[1].nbytes for x in banded) <= BAND_BYTES:
                banded = []
            for name, value, pos in todo:
                if not any(b[0] == name for b in banded):
                    self._write_whole(name, value, pos)
            if banded:
                self._write_bands(banded)
        return out

    def _write_whole(self, name: str, value: np.ndarray | Planned, pos: int) -> None:
        assert self._f is not None
        array = np.ascontiguousarray(value.make() if isinstance(value, Planned) else value)
        _check(name, array, tuple(value.shape), np.dtype(value.dtype))
        self._f.seek(pos)
        self._f.write(array.data.cast("B"))  # no bytes copy: a head table is hundreds of MB

    def _write_bands(self, items: list[tuple[str, np.ndarray | Planned, int]]) -> None:
        assert self._f is not None
        n = items[0][1].shape[0]
        per_row = sum(_row_bytes(v) for _, v, _ in items)
        step = max(1, BAND_BYTES // max(1, per_row))
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            for name, value, pos in items:
                assert isinstance(value, Planned) and value.rows is not None
                array = np.ascontiguousarray(value.rows(lo, hi))
                _check(f"{name} rows {lo}..{hi}", array, (hi - lo, *value.shape[1:]), np.dtype(value.dtype))
                self._f.seek(pos + lo * value.row_bytes)
                self._f.write(array.data.cast("B"))

    def alias(
        self,
        name: str,
        existing: str,
        dims: tuple[int, ...] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> TensorProto:
        """A second initializer over the same bytes of the file (nothing is written twice), optionally seen
        with other `dims` of the same element count, or over `rows` lo..hi-1 (along the first axis) only.

        onnxruntime maps each initializer on its own. Once a kernel has prepacked its weights (the LM
        head), it unmaps that initializer; an alias read by a gather op keeps only its own mapping, of
        which just the pages of the rows actually looked up become resident."""
        if name in self._cache:
            return self._cache[name]
        t = TensorProto()
        t.CopyFrom(self._cache[existing])
        t.name = name
        if rows is not None:
            lo, hi = rows
            ext = {e.key: e for e in t.external_data}
            n = int(t.dims[0])
            if not 0 <= lo < hi <= n or int(ext["length"].value) % n:
                raise ValueError(f"{name}: rows {rows} of {tuple(t.dims)}")
            row_bytes = int(ext["length"].value) // n
            ext["offset"].value = str(int(ext["offset"].value) + lo * row_bytes)
            ext["length"].value = str((hi - lo) * row_bytes)
            t.dims[0] = hi - lo
        if dims is not None:
            if int(np.prod(dims)) != int(np.prod(t.dims)):
                raise ValueError(f"{name}: dims {dims} do not match {tuple(t.dims)}")
            del t.dims[:]
            t.dims.extend(dims)
        self._cache[name] = t
        return t

    def flush(self) -> None:
        """What is written so far, readable by another reader of the file (a session measuring a variant)."""
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.truncate(self.size)  # written by seeking: the file ends where the plan does
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


class SplitWeights:
    """A variant's initializers over two files: its own (named with linear.REQUANT_TAG: the re-encoded
    weights no other variant shares) in `own`, the rest in the shared file, deduplicated there against the
    other variants as usual. A variant refused after it was built then goes with its own file, leaving
    the shared one as the other variants need it."""

    def __init__(self, shared: WeightFile, own: WeightFile) -> None:
        self.shared, self.own = shared, own

    def _file(self, name: str) -> WeightFile:
        return self.own if REQUANT_TAG in name else self.shared

    @property
    def dry(self) -> bool:
        return self.shared.dry

    @property
    def size(self) -> int:
        return self.shared.size + self.own.size

    def add(self, name: str, value: np.ndarray | Planned) -> TensorProto:
        return self._file(name).add(name, value)

    def add_many(self, items: list[tuple[str, np.ndarray | Planned]]) -> list[TensorProto]:
        """As WeightFile.add_many; a group whose names go to both files is written file by file (its
        row bands are then computed once per file)."""
        files = {id(self._file(name)) for name, _ in items}
        if len(files) == 1:
            return self._file(items[0][0]).add_many(items)
        return [self._file(name).add(name, value) for name, value in items]

    def alias(
        self,
        name: str,
        existing: str,
        dims: tuple[int, ...] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> TensorProto:
        return self._file(existing).alias(name, existing, dims, rows)


Weights = WeightFile | SplitWeights


def _bandable(value: np.ndarray | Planned, first: np.ndarray | Planned) -> bool:
    """Planned with a row source, of as many rows as the first of the group."""
    return isinstance(value, Planned) and value.rows is not None and value.shape[:1] == first.shape[:1]


def _row_bytes(value: np.ndarray | Planned) -> int:
    return value.nbytes // max(1, value.shape[0])


def _check(name: str, array: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if array.shape != shape or array.dtype != dtype:
        raise RuntimeError(
            f"converter bug: {name} planned as {shape} {dtype}, computed {array.shape} {array.dtype}"
        )


def _external(
    name: str, shape: tuple[int, ...], dtype: np.dtype, location: str, pos: int, n: int
) -> TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = helper.np_dtype_to_tensor_dtype(dtype)
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(pos)), ("length", str(n))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    return t


# What flows between segments: the normed input of the next layer and the residual stream ([tokens, hidden])
SEGMENT_STATE = ("x_norm", "residual")
SEGMENT_STATE_OUT = ("x_norm_out", "residual_out")


@dataclass(frozen=True)
class Segment:
    """Layers lo..hi-1 of the decoder; with the embedding lookup when lo is 0 (input_ids in), with the final
    norm's output and the LM head when `head` (logits out), else SEGMENT_STATE in and out."""

    lo: int
    hi: int
    head: bool = False


class GraphBuilder:
    def __init__(self, model: GGUFModel, spec: VariantSpec, weights: Weights) -> None:
        self.m = model
        self.cfg = model.config
        self.family = model.family
        self.spec = spec
        self.w = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self._n = 0
        self._packed: dict[str, Packing] = {}
        self.quant_map: dict[str, list[str]] = {}  # source tensor type -> how it was mapped (manifest)
        self.copied_at_load: set[str] = set()  # initializers a kernel copies when it packs (linear.py)
        self.fp32_inputs = 0  # matrices the variant's plan gives fp32 activations (fast_plan.fp32_inputs)
        self._seq_shapes: dict[int, str] = {}  # width -> the shape [batch, -1, width] (to_seq)
        # where to_seq reads the batch from: a segment after the first takes one sequence, [seq, hidden]
        self._batch_of: str | None = "input_ids"

    # -- helpers --------------------------------------------------------------------------------------
    def _name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def node(
        self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str = "", **attrs
    ) -> list[str]:
        base = name or op
        outs = [self._name(f"{base}_out{i}") for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self._name(base), domain=domain, **attrs))
        return outs

    def init(self, name: str, value: np.ndarray | Planned) -> str:
        self.inits[name] = self.w.add(name, value)
        return name

    def planned(
        self,
        shape: tuple[int, ...],
        make: Callable[[], np.ndarray],
        dtype: type = np.float32,
        rows: Callable[[int, int], np.ndarray] | None = None,
    ) -> Planned:
        return Planned(tuple(int(d) for d in shape), dtype, make, rows)

    def alias(
        self,
        name: str,
        existing: str,
        dims: tuple[int, ...] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> str:
        self.inits[name] = self.w.alias(name, existing, dims, rows)
        return name

    def packed(self, name: str) -> Packing:
        """pack_tensor at the format's own width, planned (the embedding table feeds the lookup and the
        head: one Packing, computed a band at a time)."""
        if name not in self._packed:
            self._packed[name] = packing(self.tensor(name))
        return self._packed[name]

    def dequantized(self, name: str) -> Planned:
        """The tensor in fp32, (rows, cols) ((1, n) for 1-D); a band of rows at a time where it is large."""
        t = self.tensor(name)
        if t.rows == 1 or len(np.shape(t.data)) < 2:
            return self.planned((t.rows, t.cols), lambda: t.dequantize().reshape(t.rows, t.cols))
        return self.planned(
            (t.rows, t.cols), t.dequantize, rows=lambda lo, hi: dequantize_rows(t, slice(lo, hi))
        )

    def const(self, name: str, array: np.ndarray) -> str:
        """Small constants live inside the .onnx file."""
        if name not in self.inits:
            self.inits[name] = onnx.numpy_helper.from_array(np.asarray(array), name)
        return name

    def to_seq(self, x: str, width: int) -> str:
        """x [tokens, width] (the graph's 2-D form, a batch's rows one after another) as [batch, seq,
        width], the form GroupQueryAttention and the logits take; batch from input_ids, once per width."""
        if width not in self._seq_shapes:
            if self._batch_of is None:
                self._seq_shapes[width] = self.const(f"one_seq_{width}", np.array([1, -1, width], np.int64))
            else:
                batch = self.node("Shape", [self._batch_of], start=0, end=1)[0]  # [batch] as a 1-D int64
                tail = self.const(f"seq_{width}", np.array([-1, width], np.int64))
                self._seq_shapes[width] = self.node("Concat", [batch, tail], axis=0)[0]
        return self.node("Reshape", [x, self._seq_shapes[width]])[0]

    def settle(self) -> None:
        """Between layers: what the last one read and freed goes back (GGUFModel.release)."""
        if not self.w.dry:
            self.m.release()

    # -- weights --------------------------------------------------------------------------------------
    def tensor(self, name: str) -> Tensor:
        return self.m.tensor(name)

    def norm_weight(self, name: str) -> str:
        t = self.tensor(name)
        return self.init(name, self.planned((t.cols,), lambda: t.dequantize().reshape(-1)))

    # -- graph ----------------------------------------------------------------------------------------
    def _last_positions(self, x: str, inputs: list) -> str:
        """The last `num_logits_to_keep` positions of every row of the batch, [rows x kept, hidden]: only
        they reach the LM head (at a prefill of 256 positions a vocabulary-sized head is most of the
        cost). The input is optional, its initializer is its default: 0, every position (Slice from -0 =
        0), which is onnxruntime-genai's convention. It does not feed the input, sizes the logits output
        by the positions it feeds, and takes the last."""
        inputs.append(helper.make_tensor_value_info("num_logits_to_keep", TensorProto.INT64, []))
        self.const("num_logits_to_keep", np.array(0, np.int64))
        start = self.node(
            "Reshape",
            [self.node("Neg", ["num_logits_to_keep"])[0], self.const("to_1d", np.array([1], np.int64))],
        )[0]
        end = self.const("last_end", np.array([np.iinfo(np.int64).max], np.int64))
        rows = self.to_seq(x, self.cfg.hidden)
        kept = self.node("Slice", [rows, start, end, self.const("axis1", np.array([1], np.int64))])[0]
        return self.node("Reshape", [kept, self.const("to_2d", np.array([-1, self.cfg.hidden], np.int64))])[0]

    def build(self, segment: Segment | None = None) -> onnx.ModelProto:
        """The whole decoder, or one `segment` of it over the same initializers (models/convert/measure.py
        runs a large model's graph that way, one segment in memory at a time)."""
        cfg, spec = self.cfg, self.spec
        seg = segment or Segment(0, cfg.n_layers, head=True)
        self._batch_of = "input_ids" if seg.lo == 0 else None
        inputs, outputs = [], []
        if seg.lo == 0:
            inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]))
        else:
            for n in SEGMENT_STATE if seg.lo < cfg.n_layers else SEGMENT_STATE[:1]:
                inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["seq", cfg.hidden]))
        if seg.hi > seg.lo:
            inputs.append(
                helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
            )
        if seg.head:
            outputs.append(
                helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "logits_seq", cfg.vocab])
            )

        embd_packed = None
        if seg.lo == 0:
            rows, embd_packed = embed_tokens(self)
            self.settle()
            x = self.node("Reshape", [rows, self.const("to_2d", np.array([-1, cfg.hidden], np.int64))])[0]
            if cfg.embed_scale != 1.0:
                x = self.node("Mul", [x, self.const("embed_scale", np.array(cfg.embed_scale, np.float32))])[0]
            first_norm = "blk.0.attn_norm.weight" if cfg.n_layers else "output_norm.weight"
            x_norm, residual = rms_norm(self, x, first_norm), x
        else:
            x_norm, residual = SEGMENT_STATE
            if cfg.tied_embeddings and self.tensor(TABLE).type_name not in FLOAT_TYPES:
                embd_packed = self.packed(TABLE)  # a tied head's codes, written by the whole graph
        if seg.hi > seg.lo:
            seqlens_k, total_len = self._sequence_lengths()
        kv_type = KV_TYPES[spec.kv_dtype]
        for i in range(seg.lo, seg.hi):
            kv_dims = ["batch", cfg.n_kv_heads, "past", cfg.head_dim]
            for n in (f"past_key_values.{i}.key", f"past_key_values.{i}.value"):
                inputs.append(helper.make_tensor_value_info(n, kv_type, kv_dims))
            for n in (f"present.{i}.key", f"present.{i}.value"):
                outputs.append(
                    helper.make_tensor_value_info(
                        n, kv_type, ["batch", cfg.n_kv_heads, "present", cfg.head_dim]
                    )
                )
            a = attention(self, i, x_norm, seqlens_k, total_len)
            x_norm, residual = skip_norm(self, a, residual, f"blk.{i}.ffn_norm.weight")
            f = mlp(self, i, x_norm)
            next_norm = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layers else "output_norm.weight"
            x_norm, residual = skip_norm(self, f, residual, next_norm)
            self.settle()

        if seg.head:
            last = self._last_positions(x_norm, inputs)
            lm_head(self, last, embd_packed)
            self.settle()
        else:
            for value, name in zip((x_norm, residual), SEGMENT_STATE_OUT, strict=True):
                self.node("Identity", [value])
                self.nodes[-1].output[0] = name
                outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["seq", cfg.hidden]))
        model = helper.make_model(
            helper.make_graph(self.nodes, f"simmer-{spec.name}", inputs, outputs, list(self.inits.values())),
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
            producer_name="simmer",
        )
        model.ir_version = 8
        return model

    def _sequence_lengths(self) -> tuple[str, str]:
        """GQA's sequence bookkeeping from the attention mask, computed once for all layers."""
        mask_sum = self.node(
            "ReduceSum", ["attention_mask", self.const("axis1", np.array([1], np.int64))], keepdims=0
        )[0]
        seqlens = self.node("Sub", [mask_sum, self.const("one_i64", np.array(1, np.int64))])[0]
        seqlens_k = self.node("Cast", [seqlens], to=TensorProto.INT32)[0]
        mask_shape = self.node("Shape", ["attention_mask"])[0]
        total = self.node("Gather", [mask_shape, self.const("idx1", np.array(1, np.int64))], axis=0)[0]
        return seqlens_k, self.node("Cast", [total], to=TensorProto.INT32)[0]


@dataclass(frozen=True)
class BuiltVariant:
    quant_map: dict[str, str]  # source tensor type -> how it was mapped
    # [offset, length] in the weights file of initializers the kernels copy at load and never read again
    copied_at_load: list[list[int]]
    # the same per file ({location: spans}): a re-encoded variant's own file holds some too
    copied_by_file: dict[str, list[list[int]]]
    fp32_inputs: int = 0  # matrices whose MatMulNBits take fp32 activations where the variant's take int8
    kv_dtype: str = "float32"  # the KV cache's element type (VariantSpec.kv_dtype)


def build_variant(model: GGUFModel, spec: VariantSpec, weights: Weights, out: Path) -> BuiltVariant:
    """Write `out` (an .onnx file) whose initializers live in `weights`."""
    builder = GraphBuilder(model, spec, weights)
    graph = builder.build()
    out.write_bytes(graph.SerializeToString())
    with open(out, "rb+") as f:
        os.fsync(f.fileno())
    spans: dict[str, list[list[int]]] = {}
    for name in sorted(builder.copied_at_load):
        ext = {e.key: e.value for e in builder.inits[name].external_data}
        spans.setdefault(ext["location"], []).append([int(ext["offset"]), int(ext["length"])])
    by_file = {location: sorted(s) for location, s in spans.items()}
    shared = weights.shared if isinstance(weights, SplitWeights) else weights
    return BuiltVariant(
        {t: "; ".join(ways) for t, ways in sorted(builder.quant_map.items())},
        by_file.get(shared.path.name, []),
        by_file,
        builder.fp32_inputs,
        spec.kv_dtype,
    )
