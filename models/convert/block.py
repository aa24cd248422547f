"""The transformer block every family shares, built once: RMS norms, the attention block on
GroupQueryAttention, the gated MLP, and the RoPE caches. A family changes it only through its flags
(families/base.py): QKV bias, QK-norm, sandwich norms, activation, RoPE pairing, window and RoPE per layer.

The graph is 2-D ([tokens, features], a batch's rows one after another) except where GroupQueryAttention
wants [batch, seq, features] (GraphBuilder.to_seq).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto

from models.convert.families import RopeKind
from models.convert.linear import MS, linear

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder


def rms_norm(g: GraphBuilder, x: str, weight: str) -> str:
    return g.node("SimplifiedLayerNormalization", [x, g.norm_weight(weight)], axis=-1, epsilon=g.cfg.rms_eps)[
        0
    ]


def skip_norm(g: GraphBuilder, x: str, residual: str, weight: str) -> tuple[str, str]:
    """(norm(x + residual), x + residual) in one fused node."""
    out = g.node(
        "SkipSimplifiedLayerNormalization",
        [x, residual, g.norm_weight(weight)],
        n_out=4,
        domain=MS,
        epsilon=g.cfg.rms_eps,
    )
    return out[0], out[3]


def rope_cache(g: GraphBuilder, kind: RopeKind, half: bool = False) -> tuple[str, str]:
    """cos/sin [context, head_dim / 2] for one RoPE kind, once per graph (and once in the weights file);
    in fp16 for an attention that runs in fp16 (`half`)."""
    cfg = g.cfg
    name = "rope" if kind.name == "global" else f"rope_{kind.name}"
    name += "_fp16" if half else ""
    if f"{name}.cos" in g.inits:
        return f"{name}.cos", f"{name}.sin"
    factors = g.dequantized("rope_freqs.weight") if kind.uses_freq_factors else None

    def angles() -> np.ndarray:
        inv = kind.inv_freq(cfg.head_dim, None if factors is None else factors.make())
        return np.outer(np.arange(cfg.context_length, dtype=np.float64), inv)

    shape = (cfg.context_length, cfg.head_dim // 2)
    dtype = np.float16 if half else np.float32
    return (
        g.init(f"{name}.cos", g.planned(shape, lambda: np.cos(angles()).astype(dtype), dtype)),
        g.init(f"{name}.sin", g.planned(shape, lambda: np.sin(angles()).astype(dtype), dtype)),
    )


def _per_head_norm(g: GraphBuilder, x: str, heads: int, weight: str) -> str:
    """RMS-norm over each head's head_dim features ([tokens, heads*hd] in, [batch, seq, heads*hd] out).
    onnxruntime's CPU GroupQueryAttention has no fused q_norm/k_norm, and its rotary runs after this norm,
    which is the order Qwen 3 and Gemma 3 use."""
    hd = g.cfg.head_dim
    per_head = g.node("Reshape", [x, g.const(f"heads_{heads}", np.array([-1, heads, hd], np.int64))])[0]
    normed = rms_norm(g, per_head, weight)
    return g.to_seq(normed, heads * hd)


def attention(g: GraphBuilder, i: int, x: str, seqlens_k: str, total_len: str) -> str:
    """The attention branch of layer i, from its normed input to what is added to the residual stream."""
    cfg, fam = g.cfg, g.family
    p = f"blk.{i}."
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bias = [p + f"attn_{n}.bias" for n in "qkv"] if fam.qkv_bias else None
    qkv, _ = linear(
        g, x, p + "attn_qkv", [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], bias=bias
    )
    if fam.qk_norm:
        q, k, v = g.node(
            "Split",
            [qkv, g.const(f"split_qkv_{q_dim}_{kv_dim}", np.array([q_dim, kv_dim, kv_dim], np.int64))],
            n_out=3,
            axis=-1,
        )
        q = _per_head_norm(g, q, cfg.n_heads, p + "attn_q_norm.weight")
        k = _per_head_norm(g, k, cfg.n_kv_heads, p + "attn_k_norm.weight")
        v = g.to_seq(v, kv_dim)
        qkv_inputs = [q, k, v]
    else:
        qkv_inputs = [g.to_seq(qkv, q_dim + 2 * kv_dim), "", ""]
    # An fp16 KV cache: GroupQueryAttention all in fp16 between casts (onnxruntime's fp16 kernel). On a
    # Cortex-A76 it counted 0.82x the fp32 attention's decode instructions, where fp32 inputs over an fp16
    # cache (onnxruntime's other form) counted 1.32x (docs/arm64.md).
    half = g.spec.kv_dtype == "float16"
    if half:
        qkv_inputs = [g.node("Cast", [x], to=TensorProto.FLOAT16)[0] if x else "" for x in qkv_inputs]
    cos, sin = rope_cache(g, cfg.layer_rope(i), half)
    window: dict[str, Any] = {"local_window_size": cfg.sliding_window} if cfg.is_sliding(i) else {}
    attn = g.node(
        "GroupQueryAttention",
        [
            *qkv_inputs,
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            seqlens_k,
            total_len,
            cos,
            sin,
        ],
        domain=MS,
        num_heads=cfg.n_heads,
        kv_num_heads=cfg.n_kv_heads,
        do_rotary=1,
        rotary_interleaved=int(fam.rope_interleaved),
        scale=float(cfg.attention_scale),
        **window,
    )[0]
    # GQA's outputs 1 and 2 are the presents: name them as graph outputs
    g.nodes[-1].output.extend([f"present.{i}.key", f"present.{i}.value"])
    if half:
        attn = g.node("Cast", [attn], to=TensorProto.FLOAT)[0]
    attn2 = g.node("Reshape", [attn, g.const(f"to_2d_{q_dim}", np.array([-1, q_dim], np.int64))])[0]
    out, _ = linear(g, attn2, p + "attn_output", [p + "attn_output.weight"])
    if fam.sandwich_norms:
        out = rms_norm(g, out, p + "post_attention_norm.weight")
    return out


def mlp(g: GraphBuilder, i: int, x: str) -> str:
    """The gated feed-forward branch of layer i: down(act(gate(x)) * up(x))."""
    cfg, fam = g.cfg, g.family
    p = f"blk.{i}."
    gate_up, _ = linear(g, x, p + "ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"])
    gate, up = g.node(
        "Split", [gate_up, g.const("split_ffn", np.array([cfg.ffn, cfg.ffn], np.int64))], n_out=2, axis=-1
    )
    if fam.activation == "gelu_tanh":
        act = g.node("FastGelu", [gate], domain=MS)[0]  # the tanh approximation, as ggml_gelu and HF's
    else:
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])[0]
    out, _ = linear(g, g.node("Mul", [act, up])[0], p + "ffn_down", [p + "ffn_down.weight"])
    if fam.sandwich_norms:
        out = rms_norm(g, out, p + "post_ffw_norm.weight")
    return out
