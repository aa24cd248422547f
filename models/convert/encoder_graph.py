"""Build the ONNX graph of a BERT sentence encoder: embeddings, post-norm layers with bidirectional
attention, mean pooling over the attention mask and (when the model has the module) L2 normalisation.

I/O: inputs  input_ids int64 [batch, seq], attention_mask int64 [batch, seq] (1 = a token, 0 = padding)
     output  sentence_embedding float32 [batch, hidden] (sentence-transformers' name for it)
Every input is a single sentence, so its token types are all 0: that row of the token-type table is added
to the position table once here instead of gathered per token. The weights stay fp32 (the exact variant);
plain ONNX ops, which onnxruntime's optimizer fuses (attention, LayerNorm with skip, GELU) at load. With
`outliers` (the int8 variant) the linear layers run on MatMulNBits instead, each outlier input channel
beside it in fp32 (models/convert/encoder_int8.py); the rest is the same.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.convert.encoder_config import GRAPH, OUTPUT, EncoderConfig
from models.convert.encoder_int8 import BLOCK, INT8_ACTIVATIONS, Outliers, pack_int8
from models.errors import InvalidModelFile

OPSET = 17
# Added to the scores of padded keys: exp() of it underflows to exactly 0 next to any real score.
_MASKED = -1e9
MS = "com.microsoft"


class _Builder:
    def __init__(
        self,
        weights: dict[str, np.ndarray],
        cfg: EncoderConfig,
        outliers: Outliers | None,
        accuracy_level: int = INT8_ACTIVATIONS,
    ) -> None:
        self.w = weights
        self.cfg = cfg
        self.outliers = outliers
        self.accuracy_level = accuracy_level
        self.linear_inputs: dict[str, str] = {}  # each linear layer's input (the calibration reads them)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._n = 0

    def weight(self, name: str) -> np.ndarray:
        for key in (name, f"bert.{name}"):
            if key in self.w:
                return self.w[key]
        raise InvalidModelFile(f"the checkpoint has no tensor {name}")

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def const(self, value: np.ndarray) -> str:
        self._n += 1
        return self.init(f"const_{self._n}", value)

    def op(self, kind: str, inputs: list[str], **attrs: Any) -> str:
        self._n += 1
        out = f"{kind.lower()}_{self._n}"
        self.nodes.append(helper.make_node(kind, inputs, [out], name=f"n{self._n}_{kind}", **attrs))
        return out

    def linear(self, x: str, prefix: str) -> str:
        self.linear_inputs[prefix] = x
        b = self.init(f"{prefix}.bias", self.weight(f"{prefix}.bias").astype(np.float32))
        weight = self.weight(f"{prefix}.weight").astype(np.float32)
        if self.outliers is not None:
            return self.op("Add", [self.linear_int8(x, prefix, weight, self.outliers.get(prefix, [])), b])
        # torch's Linear stores (out, in): the graph multiplies by its transpose.
        w = self.init(f"{prefix}.weight", weight.T)
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def linear_int8(self, x: str, prefix: str, weight: np.ndarray, outliers: list[int]) -> str:
        """x @ weight.T on MatMulNBits (it reads torch's (out, in) layout as it is), the `outliers` input
        channels zeroed there and multiplied in fp32 beside it (their int8 scale would flatten the block)."""
        n, k = weight.shape
        if outliers:
            keep = np.ones(k, dtype=np.float32)
            keep[outliers] = 0.0
            side = self.op("Gather", [x, self.const(np.array(outliers, dtype=np.int64))], axis=2)
            exact = self.init(f"{prefix}.outliers", np.ascontiguousarray(weight[:, outliers].T))
            x = self.op("Mul", [x, self.const(keep)])
        codes, scales = pack_int8(weight)
        inputs = [x, self.init(f"{prefix}.codes", codes), self.init(f"{prefix}.scales", scales)]
        attrs = {"K": k, "N": n, "bits": 8, "block_size": BLOCK, "accuracy_level": self.accuracy_level}
        y = self.op("MatMulNBits", inputs, domain=MS, **attrs)
        return self.op("Add", [y, self.op("MatMul", [side, exact])]) if outliers else y

    def layer_norm(self, x: str, prefix: str) -> str:
        g = self.init(f"{prefix}.weight", self.weight(f"{prefix}.weight").astype(np.float32))
        b = self.init(f"{prefix}.bias", self.weight(f"{prefix}.bias").astype(np.float32))
        return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=self.cfg.eps)

    def heads(self, x: str, perm: list[int]) -> str:
        shape = self.const(np.array([0, 0, self.cfg.heads, self.cfg.head_dim], dtype=np.int64))
        return self.op("Transpose", [self.op("Reshape", [x, shape])], perm=perm)

    def attention(self, x: str, bias: str, prefix: str) -> str:
        q = self.heads(self.linear(x, f"{prefix}.self.query"), [0, 2, 1, 3])
        k = self.heads(self.linear(x, f"{prefix}.self.key"), [0, 2, 3, 1])
        v = self.heads(self.linear(x, f"{prefix}.self.value"), [0, 2, 1, 3])
        scale = self.const(np.array(1.0 / math.sqrt(self.cfg.head_dim), dtype=np.float32))
        scores = self.op("Add", [self.op("Mul", [self.op("MatMul", [q, k]), scale]), bias])
        ctx = self.op("MatMul", [self.op("Softmax", [scores], axis=-1), v])
        merged = self.op(
            "Reshape",
            [
                self.op("Transpose", [ctx], perm=[0, 2, 1, 3]),
                self.const(np.array([0, 0, self.cfg.hidden], dtype=np.int64)),
            ],
        )
        out = self.linear(merged, f"{prefix}.output.dense")
        return self.layer_norm(self.op("Add", [out, x]), f"{prefix}.output.LayerNorm")

    def feed_forward(self, x: str, prefix: str) -> str:
        h = self.linear(x, f"{prefix}.intermediate.dense")
        # exact GELU, as BERT's "gelu": x * (1 + erf(x / sqrt 2)) / 2
        erf = self.op("Erf", [self.op("Mul", [h, self.const(np.array(1 / math.sqrt(2), dtype=np.float32))])])
        one = self.const(np.array(1.0, dtype=np.float32))
        half = self.const(np.array(0.5, dtype=np.float32))
        act = self.op("Mul", [self.op("Mul", [h, half]), self.op("Add", [erf, one])])
        out = self.linear(act, f"{prefix}.output.dense")
        return self.layer_norm(self.op("Add", [out, x]), f"{prefix}.output.LayerNorm")

    def build(self) -> onnx.ModelProto:
        cfg = self.cfg
        word = self.init("word_embeddings", self.weight("embeddings.word_embeddings.weight"))
        positions = self.weight("embeddings.position_embeddings.weight")
        token_type = self.weight("embeddings.token_type_embeddings.weight")
        table = self.init("position_embeddings", (positions + token_type[0]).astype(np.float32))
        if positions.shape[0] < cfg.context:
            raise InvalidModelFile(f"{positions.shape[0]} positions for a context of {cfg.context}")

        x = self.op("Gather", [word, "input_ids"], axis=0)
        # the first `seq` rows of the position table (a slice, not a gather of a range: onnxruntime's
        # optimizer (1.32) rewrote that gather into a Slice with scalar bounds, which failed at run time)
        seq = self.op("Shape", ["input_ids"], start=1, end=2)
        zero = self.const(np.array([0], dtype=np.int64))
        pos = self.op("Slice", [table, zero, seq, zero])
        x = self.layer_norm(self.op("Add", [x, pos]), "embeddings.LayerNorm")

        mask = self.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
        one = self.const(np.array(1.0, dtype=np.float32))
        bias = self.op("Mul", [self.op("Sub", [one, mask]), self.const(np.array(_MASKED, dtype=np.float32))])
        bias = self.op("Unsqueeze", [bias, self.const(np.array([1, 2], dtype=np.int64))])  # [B, 1, 1, S]

        for i in range(cfg.layers):
            x = self.attention(x, bias, f"encoder.layer.{i}.attention")
            x = self.feed_forward(x, f"encoder.layer.{i}")

        weights = self.op("Unsqueeze", [mask, self.const(np.array([2], dtype=np.int64))])  # [B, S, 1]
        axis = self.const(np.array([1], dtype=np.int64))
        total = self.op("ReduceSum", [self.op("Mul", [x, weights]), axis], keepdims=0)
        count = self.op(
            "Max", [self.op("ReduceSum", [weights, axis], keepdims=0), self.const(np.array(1e-9, np.float32))]
        )
        pooled = self.op("Div", [total, count])
        if cfg.normalize:  # torch's F.normalize: x / max(||x||, 1e-12)
            norm = self.op("ReduceL2", [pooled], axes=[1], keepdims=1)
            pooled = self.op("Div", [pooled, self.op("Max", [norm, self.const(np.array(1e-12, np.float32))])])
        self.nodes.append(helper.make_node("Identity", [pooled], [OUTPUT], name="output"))

        graph = helper.make_graph(
            self.nodes,
            "sentence_encoder",
            [
                helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
            ],
            [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", cfg.hidden])],
            self.inits,
        )
        opsets = [helper.make_opsetid("", OPSET)]
        if self.outliers is not None:
            opsets.append(helper.make_opsetid(MS, 1))
        return helper.make_model(graph, opset_imports=opsets, producer_name="simmer")


def build_encoder(
    weights: dict[str, np.ndarray],
    cfg: EncoderConfig,
    outliers: Outliers | None = None,
    accuracy_level: int = INT8_ACTIVATIONS,
) -> onnx.ModelProto:
    """The f32 graph; the int8 one with `outliers` ({} when none are kept in fp32), its MatMulNBits at
    `accuracy_level` (models/convert/encoder_int8.py's PLANS)."""
    return _Builder(weights, cfg, outliers, accuracy_level).build()


def build_traced(
    weights: dict[str, np.ndarray], cfg: EncoderConfig
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The f32 graph and each linear layer's input tensor ({prefix: name}), for calibration."""
    builder = _Builder(weights, cfg, None)
    return builder.build(), builder.linear_inputs


def save_encoder(model: onnx.ModelProto, folder: Path, graph: str = GRAPH) -> list[str]:
    """The graph and its weights (one external-data file beside it); returns the files written."""
    data = f"{graph}.data"
    onnx.save_model(
        model, str(Path(folder) / graph), save_as_external_data=True, location=data, size_threshold=1024
    )
    return [graph, data]
