"""An encoder's linear weight as MatMulNBits reads it at 8 bits: symmetric codes per block of 32 inputs.

Measured on all-MiniLM-L6-v2 (2 threads, AVX-512 VNNI, onnxruntime 1.32): onnxruntime's quantize_dynamic
(int8 weights, each activation quantized per tensor) ran 1.8x fp32 but its embeddings fell to a min cosine of
0.94 (0.987 per channel, 0.998 with the feed-forward layers left fp32), far under the 0.999 floor: one scale
per activation tensor cannot hold GELU's outliers. MatMulNBits at accuracy level 4 quantizes activations per
block of 32, as the weights are: mean cosine 0.9996 but a min of 0.9983 over the built-in sentences
(models/convert/encoder_quality.py), on "ok"; no one kind of layer left in fp32 lifted it past 0.9988, nor
blocks of 16 (0.9988). The cause is a few outlier channels of the residual stream (MiniLM's channel 99
reaches 28 where the median channel's peak is 0.55): their block's one int8 scale flattens the 31 channels
beside them. Those channels are taken out of the int8 product and multiplied in fp32 beside it (LLM.int8()'s
decomposition): min cosine 0.9994, mean 0.9998. They are found by running the f32 graph on random token ids
(`outlier_channels`), not on any text the pull measures quality on. The price is speed: plain MatMulNBits
ran 1.17x f32's sentences per CPU-second, with the fp32 side products (28 of MiniLM's 36 layers have
outliers) 0.95-1.04x, within the rounds' own spread (the variant's use is its size: 60 MB of weights to
f32's 90 MB, the word embeddings staying fp32).

The int8 activations are the CPU's: onnxruntime quantizes them per block of 32 on x86 but a whole row on
one scale on ARM cores with the dot product (docs/arm64.md, on the decoders' 4-bit matrices: 6x the KL),
and a core without an int8 kernel computes the product in fp32. So the pull measures the graph on the
machine it will run on and, where int8 activations miss the floor, writes it again with fp32 activations
(`PLANS`, accuracy level 1: MatMulNBits dequantizes the 8-bit weights and multiplies in fp32, the same
arithmetic on every CPU; on MiniLM min cosine 0.99976, at 0.80x f32's speed: models/store/encoder_install.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 32
ZERO = 128  # MatMulNBits' default zero point at 8 bits: codes are unsigned, value = (code - 128) * scale
# MatMulNBits' accuracy levels: 4, the activations go int8 too (per block on x86), so the matmul runs on int8
# dot products (VNNI); 1, fp32 activations. The pull tries them in this order, keeping the first within the
# floor.
INT8_ACTIVATIONS = 4
FP32_ACTIVATIONS = 1
PLANS = {INT8_ACTIVATIONS: "int8 activations", FP32_ACTIVATIONS: "fp32 activations"}
# An input channel whose peak is this many times the median channel's is kept in fp32, at most MAX_OUTLIERS
# per layer (MiniLM at 6x and 4 a layer: min cosine 0.9988; at 4x and 8: 0.9994; at 3x and 16: 0.9995)
OUTLIER_RATIO = 4.0
MAX_OUTLIERS = 8
CALIBRATION_ROWS, CALIBRATION_TOKENS = 8, 64

Outliers = dict[str, list[int]]  # linear layer -> its input channels kept in fp32


def pack_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [n, k_blocks, BLOCK], scales float32 [n * k_blocks]) of a torch Linear weight [n, k];
    k is zero-padded to whole blocks (MatMulNBits reads K and ignores the padding)."""
    n, k = weight.shape
    blocks = -(-k // BLOCK)
    padded = np.zeros((n, blocks * BLOCK), dtype=np.float64)
    padded[:, :k] = weight
    padded = padded.reshape(n, blocks, BLOCK)
    scales = np.abs(padded).max(axis=-1) / 127.0
    scales = np.where(scales > 0, scales, 1.0)  # an all-zero block: any scale gives codes of 128
    codes = np.clip(np.rint(padded / scales[..., None]), -127, 127) + ZERO
    return codes.astype(np.uint8), scales.astype(np.float32).reshape(-1)


def outlier_channels(model: Any, inputs: dict[str, str], vocab: int, context: int) -> Outliers:
    """{linear layer: its outlier input channels}, from the f32 graph (`model`, with each layer's input
    tensor named in `inputs`: encoder_graph.build_traced) run on seeded random token ids."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = sorted(set(inputs.values()))
    traced = type(model)()
    traced.CopyFrom(model)
    traced.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(traced.SerializeToString(), providers=["CPUExecutionProvider"])
    width = min(CALIBRATION_TOKENS, context)
    ids = np.random.default_rng(0).integers(0, vocab, (CALIBRATION_ROWS, width), dtype=np.int64)
    outputs = session.run(names, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    values = {n: np.asarray(v, dtype=np.float32) for n, v in zip(names, outputs, strict=True)}
    out: Outliers = {}
    for prefix, name in inputs.items():
        peak = np.abs(values[name]).reshape(-1, values[name].shape[-1]).max(axis=0)
        top = np.argsort(-peak)[:MAX_OUTLIERS]
        out[prefix] = sorted(int(i) for i in top if peak[i] > OUTLIER_RATIO * np.median(peak))
    return out
