"""Build the ONNX decoder graph for a Llama GGUF with onnxruntime's fused contrib ops.

I/O follows onnxruntime-genai's decoder convention:
  inputs  input_ids int64 [batch, seq], attention_mask int64 [batch, total],
          past_key_values.N.key / .value float32 [batch, kv_heads, past, head_dim]
  outputs logits float32 [batch, 1, vocab] (the last position only: prefill never needs the others),
          present.N.key / .value float32 [batch, kv_heads, total (or the shared buffer length), head_dim]
Per layer: SkipSimplifiedLayerNormalization -> fused QKV projection -> GroupQueryAttention (rotary inside,
interleaved pairs because llama.cpp's converter permuted the Q/K rows; past and present may share one
buffer) -> output projection -> SkipSimplifiedLayerNormalization -> fused gate+up -> SiLU * up -> down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from models.gguf.quant import BLOCK, PackedNBits, concat_packed, pack_tensor, q8_as_nibble_pair
from models.gguf.reader import GGUFModel, LlamaConfig, Tensor

OPSET = 17
MS = "com.microsoft"
ALIGN = 64


@dataclass(frozen=True)
class VariantSpec:
    name: str
    matmul_bits: int | None  # None = fp32 MatMul
    accuracy_level: int  # MatMulNBits: 0/1 = fp32 activations, 4 = int8 activations
    embed_bits: int | None  # None = fp32 table


VARIANTS = {
    "f32": VariantSpec("f32", None, 0, None),
    "q8": VariantSpec("q8", 8, 4, 8),
    # no 8-bit head: MatMulNBits' 8-bit kernel is slow with fp32 activations (a Q8_0 head becomes two exact
    # 4-bit halves, any other a fp32 table)
    "q4": VariantSpec("q4", 4, 1, None),
    "q4-a8": VariantSpec("q4-a8", 4, 4, 8),
}


class WeightFile:
    """Writes initializers into one external-data file that several graphs may reference."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._cache: dict[str, TensorProto] = {}

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        if name in self._cache:
            return self._cache[name]
        array = np.ascontiguousarray(array)
        pos = self._f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            pos += pad
        data = array.tobytes()
        self._f.write(data)
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(pos)), ("length", str(len(data)))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self._cache[name] = t
        return t

    def alias(self, name: str, existing: str) -> TensorProto:
        """A second initializer over the same bytes of the file (nothing is written twice).

        onnxruntime maps each initializer on its own. Once a kernel has prepacked its weights (the LM
        head), it unmaps that initializer; an alias read by a gather op keeps only its own mapping, of
        which just the pages of the rows actually looked up become resident."""
        if name in self._cache:
            return self._cache[name]
        t = TensorProto()
        t.CopyFrom(self._cache[existing])
        t.name = name
        self._cache[name] = t
        return t

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def rope_cache(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_base ** (np.arange(0, half, dtype=np.float64) * 2.0 / cfg.head_dim))
    ang = np.outer(np.arange(cfg.context_length, dtype=np.float64), inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class GraphBuilder:
    def __init__(self, model: GGUFModel, spec: VariantSpec, weights: WeightFile) -> None:
        self.m = model
        self.cfg = model.config
        self.spec = spec
        self.w = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self._n = 0
        self._packed: dict[tuple[str, int], PackedNBits] = {}
        self._dequantized: dict[str, np.ndarray] = {}

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

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits[name] = self.w.add(name, array)
        return name

    def alias(self, name: str, existing: str) -> str:
        self.inits[name] = self.w.alias(name, existing)
        return name

    def packed(self, name: str, bits: int) -> PackedNBits:
        """pack_tensor, once per tensor and width (the embedding table feeds the lookup and the head)."""
        if (name, bits) not in self._packed:
            self._packed[name, bits] = pack_tensor(self.tensor(name), bits)
        return self._packed[name, bits]

    def dequantized(self, name: str) -> np.ndarray:
        if name not in self._dequantized:
            self._dequantized[name] = self.tensor(name).dequantize()
        return self._dequantized[name]

    def const(self, name: str, array: np.ndarray) -> str:
        """Small constants live inside the .onnx file."""
        if name not in self.inits:
            self.inits[name] = onnx.numpy_helper.from_array(np.asarray(array), name)
        return name

    # -- weights --------------------------------------------------------------------------------------
    def tensor(self, name: str) -> Tensor:
        return self.m.tensor(name)

    def linear(
        self, x: str, key: str, names: list[str], blocksum: str | None = None, bits: int | None = None
    ) -> tuple[str, str | None]:
        """y = x @ concat(W_names)^T. Returns (y, blocksum of x) so a caller can reuse the block sums."""
        bits = bits or self.spec.matmul_bits
        if bits is None:
            w = np.concatenate([self.tensor(n).dequantize() for n in names], axis=0)
            wt = self.init(f"{key}.weight_t", np.ascontiguousarray(w.T))
            return self.node("MatMul", [x, wt])[0], None
        p = concat_packed([pack_tensor(self.tensor(n), bits) for n in names])
        y = self.node(
            "MatMulNBits",
            [x, self.init(f"{key}.qweight", p.packed), self.init(f"{key}.scales", p.scales)],
            domain=MS,
            K=p.k,
            N=p.n,
            bits=p.bits,
            block_size=BLOCK,
            accuracy_level=self.spec.accuracy_level,
        )[0]
        if p.correction is None:
            return y, blocksum
        if blocksum is None:
            # block sums as one small MatMul with a 0/1 block-indicator matrix (no Reshape + ReduceSum)
            ind = np.kron(np.eye(p.k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
            blocksum = self.node("MatMul", [x, self.init(f"block_indicator_{p.k}", ind)])[0]
        corr = self.init(f"{key}.q41_correction", p.correction)
        # Gemm adds the correction to y in the same node (the graph is 2-D: [tokens, features])
        return self.node("Gemm", [blocksum, corr, y])[0], blocksum

    def norm_weight(self, name: str) -> str:
        return self.init(name, self.tensor(name).dequantize().reshape(-1))

    # -- graph ----------------------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        cfg, spec = self.cfg, self.spec
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, cfg.vocab])]

        # GQA's sequence bookkeeping, computed once for all layers
        mask_sum = self.node(
            "ReduceSum", ["attention_mask", self.const("axis1", np.array([1], np.int64))], keepdims=0
        )[0]
        seqlens = self.node("Sub", [mask_sum, self.const("one_i64", np.array(1, np.int64))])[0]
        seqlens_k = self.node("Cast", [seqlens], to=TensorProto.INT32)[0]
        mask_shape = self.node("Shape", ["attention_mask"])[0]
        total = self.node("Gather", [mask_shape, self.const("idx1", np.array(1, np.int64))], axis=0)[0]
        total_len = self.node("Cast", [total], to=TensorProto.INT32)[0]
        cos, sin = rope_cache(cfg)
        cos_name, sin_name = self.init("rope.cos", cos), self.init("rope.sin", sin)

        # embeddings (tied to the LM head when the GGUF has no output.weight). The lookup reads its own
        # alias of the table: the head's copy is unmapped after prepacking, and the lookup's stays resident
        # only where rows were read. Sharing one initializer kept the whole table resident twice.
        embd = self.tensor("token_embd.weight")
        embd_packed = None
        if cfg.tied_embeddings and spec.embed_bits is not None and embd.type_name not in ("Q4_0", "Q4_1"):
            embd_packed = self.packed("token_embd.weight", spec.embed_bits)
            self.init(f"token_embd.q{embd_packed.bits}weight", embd_packed.packed)
            self.init(f"token_embd.q{embd_packed.bits}scales", embd_packed.scales)
        # The table's bytes are written under the head's name (whichever variant is built first: once);
        # the graph only holds the lookup's alias unless the head uses the table too.
        if embd.type_name == "Q8_0":
            # Q8_0 rows are exact as (q - 128) * scale in fp32, so every variant gathers from 8-bit rows:
            # a quarter of the bytes an fp32 row takes
            q8 = self.packed("token_embd.weight", 8)
            self.w.add("token_embd.q8weight", q8.packed)
            data = self.alias("token_embd.gather_q8weight", "token_embd.q8weight")
            scales = self.init("token_embd.scales_3d", q8.scales[..., None])
            rows = self.node(
                "GatherBlockQuantized",
                [data, "input_ids", scales],  # no zero points: uint8 data defaults to 128, like ours
                domain=MS,
                bits=8,
                block_size=BLOCK,
                gather_axis=0,
                quantize_axis=2,
            )[0]
        else:
            # other tables gather exact fp32 rows (a 4-bit table has no exact 8-bit form)
            self.w.add("token_embd.weight", self.dequantized("token_embd.weight"))
            table = self.alias("token_embd.gather_weight", "token_embd.weight")
            rows = self.node("Gather", [table, "input_ids"], axis=0)[0]
        x = self.node("Reshape", [rows, self.const("to_2d", np.array([-1, cfg.hidden], np.int64))])[0]

        x_norm = self.node(
            "SimplifiedLayerNormalization",
            [x, self.norm_weight("blk.0.attn_norm.weight")],
            n_out=1,
            axis=-1,
            epsilon=cfg.rms_eps,
        )[0]
        residual = x
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
            pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
            for n in (past_k, past_v):
                inputs.append(
                    helper.make_tensor_value_info(
                        n, TensorProto.FLOAT, ["batch", cfg.n_kv_heads, "past", cfg.head_dim]
                    )
                )
            for n in (pres_k, pres_v):
                outputs.append(
                    helper.make_tensor_value_info(
                        n, TensorProto.FLOAT, ["batch", cfg.n_kv_heads, "present", cfg.head_dim]
                    )
                )

            qkv, _ = self.linear(
                x_norm, p + "attn_qkv", [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
            )
            # GQA wants [batch, seq, features]; everything else runs on 2-D [tokens, features] (batch 1)
            qkv_dim = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
            qkv3 = self.node("Reshape", [qkv, self.const("to_3d", np.array([1, -1, qkv_dim], np.int64))])[0]
            attn = self.node(
                "GroupQueryAttention",
                [qkv3, "", "", past_k, past_v, seqlens_k, total_len, cos_name, sin_name],
                n_out=1,
                domain=MS,
                num_heads=cfg.n_heads,
                kv_num_heads=cfg.n_kv_heads,
                do_rotary=1,
                rotary_interleaved=1,
                scale=float(1.0 / np.sqrt(cfg.head_dim)),
            )
            # GQA's outputs 1 and 2 are the presents: name them as graph outputs
            self.nodes[-1].output.extend([pres_k, pres_v])
            attn2 = self.node(
                "Reshape", [attn[0], self.const("to_2d", np.array([-1, cfg.hidden], np.int64))]
            )[0]
            o, _ = self.linear(attn2, p + "attn_output", [p + "attn_output.weight"])
            x_norm, _, _, residual = self.node(
                "SkipSimplifiedLayerNormalization",
                [o, residual, self.norm_weight(p + "ffn_norm.weight")],
                n_out=4,
                domain=MS,
                epsilon=cfg.rms_eps,
            )
            gate_up, _ = self.linear(x_norm, p + "ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"])
            gate, up = self.node(
                "Split",
                [gate_up, self.const("split_ffn", np.array([cfg.ffn, cfg.ffn], np.int64))],
                n_out=2,
                axis=-1,
            )
            act = self.node("Mul", [gate, self.node("Sigmoid", [gate])[0]])[0]
            down, _ = self.linear(self.node("Mul", [act, up])[0], p + "ffn_down", [p + "ffn_down.weight"])
            next_norm = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layers else "output_norm.weight"
            x_norm, _, _, residual = self.node(
                "SkipSimplifiedLayerNormalization",
                [down, residual, self.norm_weight(next_norm)],
                n_out=4,
                domain=MS,
                epsilon=cfg.rms_eps,
            )

        # only the last position reaches the LM head
        last = self.node(
            "Slice",
            [
                x_norm,
                self.const("last_start", np.array([-1], np.int64)),
                self.const("last_end", np.array([np.iinfo(np.int64).max], np.int64)),
                self.const("axis0", np.array([0], np.int64)),
            ],
        )[0]
        self._lm_head(last, embd_packed)
        model = helper.make_model(
            helper.make_graph(self.nodes, f"simmer-{spec.name}", inputs, outputs, list(self.inits.values())),
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
            producer_name="simmer",
        )
        model.ir_version = 8
        return model

    def _lm_head(self, last: str, embd_packed: PackedNBits | None) -> None:
        """Tied heads reuse the embedding's initializers. A Q4 head stays exact at 4 bits; an fp32-activation
        variant keeps any other head in fp32 (MatMulNBits' 8-bit kernel has no fast fp32-activation path)."""
        cfg, spec = self.cfg, self.spec
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        head = self.tensor(head_name)
        if cfg.tied_embeddings and embd_packed is not None:
            logits = self.node(
                "MatMulNBits",
                [last, f"token_embd.q{embd_packed.bits}weight", f"token_embd.q{embd_packed.bits}scales"],
                domain=MS,
                K=embd_packed.k,
                N=embd_packed.n,
                bits=embd_packed.bits,
                block_size=BLOCK,
                accuracy_level=spec.accuracy_level,
            )[0]
        elif spec.matmul_bits == 4 and head.type_name in ("Q4_0", "Q4_1"):
            logits, _ = self.linear(last, "lm_head", [head_name], bits=4)
        elif spec.matmul_bits == 4 and spec.accuracy_level < 4 and head.type_name == "Q8_0":
            # exact, and a quarter of the memory of a fp32 head at the same speed
            p = q8_as_nibble_pair(self.packed(head_name, 8))
            assert p.zero_points is not None
            twice = self.node("Concat", [last, last], axis=1)[0]
            logits = self.node(
                "MatMulNBits",
                [
                    twice,
                    self.init(f"{head_name}.nibbles", p.packed),
                    self.init(f"{head_name}.nibble_scales", p.scales),
                    self.init(f"{head_name}.nibble_zero_points", p.zero_points),
                ],
                domain=MS,
                K=p.k,
                N=p.n,
                bits=4,
                block_size=BLOCK,
                accuracy_level=spec.accuracy_level,
            )[0]
        elif spec.embed_bits is None:
            if cfg.tied_embeddings:
                table = self.init("token_embd.weight", self.dequantized("token_embd.weight"))
            else:
                table = self.init("output.weight", head.dequantize())
            logits = self.node("Gemm", [last, table], transB=1)[0]
        else:
            logits, _ = self.linear(last, "lm_head", [head_name], bits=spec.embed_bits)
        self.node("Reshape", [logits, self.const("logits_shape", np.array([1, 1, cfg.vocab], np.int64))])
        self.nodes[-1].output[0] = "logits"


def build_variant(model: GGUFModel, spec: VariantSpec, weights: WeightFile, out: Path) -> None:
    """Write `out` (an .onnx file) whose initializers live in `weights`."""
    graph = GraphBuilder(model, spec, weights).build()
    out.write_bytes(graph.SerializeToString())
    with open(out, "rb+") as f:
        os.fsync(f.fileno())
