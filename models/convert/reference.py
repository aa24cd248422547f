"""fp32 numpy forward pass over the dequantized GGUF weights, for every family: the yardstick every variant's
quality is measured against (manifest `quality`). Written as llama.cpp computes (RoPE on the stored rows,
interleaved pairs for `llama`, NEOX halves otherwise; sliding windows by position), from the same family
flags as the graph builder but with none of its code.

Memory: a layer at a time, a tensor at a time. Every sequence asked for goes through the layers together
(their tokens stacked for the matrix products, attention per sequence), so each weight is dequantized once,
used once and dropped, and the file's pages are given back after each layer (GGUFModel.release). What is
resident is one tensor in fp32 (Qwen2.5 1.5B: 55 MB) and the activations, not the model (5 GB in fp32).
The embedding table is never dequantized whole: the lookup reads only the rows it needs, and the head runs
over row chunks.
"""

from __future__ import annotations

import itertools

import numpy as np

from models.convert.model import GGUFModel
from models.gguf.reader import dequantize_rows

HEAD_CHUNK = 8192  # rows of the LM head dequantized at a time


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def q8_blocks(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x with each run of `block` values along the last axis rounded to int8 on its own scale (max |v| / 127):
    the activations llama.cpp's quantized matmuls see (Q8_0/Q8_1 per 32, Q8_K per 256), and onnxruntime's
    int8 kernels on x86 (per the weight's block)."""
    shape = x.shape
    b = x.reshape(-1, shape[-1] // block, block)
    scale = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    q = np.round(np.divide(b, scale, out=np.zeros_like(b), where=scale > 0))
    return (q * scale).reshape(shape).astype(np.float32)


# What llama.cpp's CPU matmul rounds its input to for each weight type (ggml-cpu's `vec_dot_type`): int8 per
# 32-block beside the 32-blocks (Q8_0, Q8_1), int8 per 256-block beside the K-quants' super-blocks (Q8_K),
# half precision beside F16, nothing beside F32. The K-quants' coarser blocks are why llama.cpp's error on a
# Q4_K_M file is several times that of int8 per 32-block (measured: Gemma 3 270M, Qwen2.5-Coder 1.5B).
ACTIVATIONS: dict[str, int | str | None] = {
    "F32": None,
    "F16": "f16",
    "BF16": "bf16",
    **{t: 32 for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")},
    **{t: 256 for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
}


def llama_activations(x: np.ndarray, weight_type: str) -> np.ndarray:
    """x as llama.cpp's CPU matmul sees it beside a weight of `weight_type` (ACTIVATIONS)."""
    how = ACTIVATIONS.get(weight_type)
    if how == "f16":
        return x.astype(np.float16).astype(np.float32)
    if how == "bf16":  # round to nearest even on the top 16 bits
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
        return bits.view(np.float32)
    if isinstance(how, int) and x.shape[-1] % how == 0:
        return q8_blocks(x, how)
    return x


class ReferenceForward:
    def __init__(self, model: GGUFModel, *, int8_activations: bool = False) -> None:
        """`int8_activations`: every matmul's input rounded first as llama.cpp's CPU matmul rounds it for the
        weight's type (llama_activations: int8 per 32-block or per 256-block, or half precision), the
        arithmetic of llama.cpp's int8 path done exactly: its distance from the fp32 forward is the error that
        quantizing activations this way costs, on any machine."""
        self.m = model
        self.int8_activations = int8_activations
        self.cfg = c = model.config
        self.family = model.family
        factors = model.tensor("rope_freqs.weight").dequantize() if c.rope_freqs else None
        self.inv_freq = [c.layer_rope(i).inv_freq(c.head_dim, factors) for i in range(c.n_layers)]
        self.output_norm = model.tensor("output_norm.weight").dequantize().reshape(-1)

    def _w(self, i: int, name: str) -> np.ndarray:
        """Layer i's tensor in fp32, dequantized now (1-D tensors flat)."""
        a = self.m.tensor(f"blk.{i}.{name}").dequantize()
        return a.reshape(-1) if a.shape[0] == 1 else a

    def _rms(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True)
        return (x / np.sqrt(ms + self.cfg.rms_eps)).astype(np.float32) * g

    def _rope(self, x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """x: (heads, S, head_dim)."""
        ang = np.outer(pos, inv_freq)
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        if self.family.rope_interleaved:  # pairs (2i, 2i+1)
            a, b = x[..., 0::2], x[..., 1::2]
        else:  # NEOX: pairs (i, i + head_dim/2)
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
        ra, rb = a * cos - b * sin, a * sin + b * cos
        out = np.empty_like(x)
        if self.family.rope_interleaved:
            out[..., 0::2], out[..., 1::2] = ra, rb
        else:
            out[..., :half], out[..., half:] = ra, rb
        return out

    def _mask(self, s: int, layer: int) -> np.ndarray:
        q, k = np.arange(s)[:, None], np.arange(s)[None, :]
        masked = k > q
        if self.cfg.is_sliding(layer):
            masked |= q - k >= self.cfg.sliding_window
        return np.where(masked, -np.inf, 0.0).astype(np.float32)

    def _mm(self, x: np.ndarray, w: np.ndarray, weight_type: str) -> np.ndarray:
        """x @ w.T, w as a torch Linear's (out, in), stored in the GGUF as `weight_type`."""
        if self.int8_activations:
            x = llama_activations(x, weight_type)
        return x @ w.T

    def _linear(self, i: int, x: np.ndarray, name: str) -> np.ndarray:
        t = self.m.tensor(f"blk.{i}.{name}.weight")
        return self._mm(x, t.dequantize(), t.type_name)

    def _attention(self, i: int, h: np.ndarray, spans: list[slice]) -> np.ndarray:
        """Layer i's attention over the stacked sequences `h` (each span one sequence)."""
        c, fam = self.cfg, self.family
        q, k, v = (self._linear(i, h, f"attn_{n}") for n in "qkv")
        if fam.qkv_bias:
            q, k, v = (
                q + self._w(i, "attn_q.bias"),
                k + self._w(i, "attn_k.bias"),
                v + self._w(i, "attn_v.bias"),
            )
        q_norm = self._w(i, "attn_q_norm.weight") if fam.qk_norm else None
        k_norm = self._w(i, "attn_k_norm.weight") if fam.qk_norm else None
        group = c.n_heads // c.n_kv_heads
        out = np.empty((h.shape[0], c.n_heads * c.head_dim), np.float32)
        for span in spans:
            s = span.stop - span.start
            qs = q[span].reshape(s, c.n_heads, c.head_dim).transpose(1, 0, 2)
            ks = k[span].reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            vs = v[span].reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            if q_norm is not None and k_norm is not None:
                qs, ks = self._rms(qs, q_norm), self._rms(ks, k_norm)
            pos = np.arange(s)
            qs, ks = self._rope(qs, pos, self.inv_freq[i]), self._rope(ks, pos, self.inv_freq[i])
            ks, vs = np.repeat(ks, group, axis=0), np.repeat(vs, group, axis=0)
            scores = qs @ ks.transpose(0, 2, 1) * np.float32(c.attention_scale) + self._mask(s, i)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            out[span] = (scores @ vs).transpose(1, 0, 2).reshape(s, -1)
        a = self._linear(i, out, "attn_output")
        return self._rms(a, self._w(i, "post_attention_norm.weight")) if fam.sandwich_norms else a

    def _mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        act = gelu_tanh if self.family.activation == "gelu_tanh" else silu
        f = act(self._linear(i, h, "ffn_gate")) * self._linear(i, h, "ffn_up")
        f = self._linear(i, f, "ffn_down")
        return self._rms(f, self._w(i, "post_ffw_norm.weight")) if self.family.sandwich_norms else f

    def hidden_many(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """(len(ids), hidden) final-normed hidden states of each sequence, all computed in one pass over
        the layers."""
        c = self.cfg
        bounds = np.cumsum([0, *(len(ids) for ids in seqs)])
        spans = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        ids = np.concatenate([np.asarray(s, np.int64) for s in seqs]) if seqs else np.zeros(0, np.int64)
        x = dequantize_rows(self.m.tensor("token_embd.weight"), ids) * np.float32(c.embed_scale)
        for i in range(c.n_layers):
            x = x + self._attention(i, self._rms(x, self._w(i, "attn_norm.weight")), spans)
            x = x + self._mlp(i, self._rms(x, self._w(i, "ffn_norm.weight")))
            self.m.release()
        x = self._rms(x, self.output_norm)
        return [x[span] for span in spans]

    def hidden(self, ids: list[int]) -> np.ndarray:
        """(len(ids), hidden): the final-normed hidden states of one sequence."""
        return self.hidden_many([ids])[0]

    def logits_many(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """(len(ids), vocab) float32 logits of every position of each sequence."""
        hs = self.hidden_many(seqs)
        head = self.m.tensor("token_embd.weight" if self.cfg.tied_embeddings else "output.weight")
        outs = [np.empty((len(h), self.cfg.vocab), np.float32) for h in hs]
        for start in range(0, self.cfg.vocab, HEAD_CHUNK):
            chunk = slice(start, min(start + HEAD_CHUNK, self.cfg.vocab))
            w = dequantize_rows(head, chunk)
            for h, out in zip(hs, outs, strict=True):
                out[:, chunk] = self._mm(h, w, head.type_name)
        self.m.release()
        return outs

    def logits(self, ids: list[int], positions: list[int] | None = None) -> np.ndarray:
        """(len(positions), vocab) float32 logits of one sequence, every position by default."""
        out = self.logits_many([ids])[0]
        return out if positions is None else out[np.asarray(positions)]
