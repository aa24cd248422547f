"""fp32 numpy forward pass over the dequantized GGUF weights, for every family: the yardstick every variant's
quality is measured against (manifest `quality`). Written as llama.cpp computes (RoPE on the stored rows,
interleaved pairs for `llama`, NEOX halves otherwise; sliding windows by position), from the same family
flags as the graph builder but with none of its code.

Memory: layer weights are dequantized once per layer and kept; the embedding table, the largest tensor
(Gemma 3: 262,144 rows), is never dequantized whole: the lookup reads only the rows it needs, and the head
runs over row chunks.
"""

from __future__ import annotations

import numpy as np

from models.convert.model import GGUFModel
from models.gguf.reader import dequantize_rows

HEAD_CHUNK = 16384  # rows of the LM head dequantized at a time


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def q8_blocks(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x with each run of `block` values along the last axis rounded to int8 on its own scale (max |v| / 127):
    the activations llama.cpp's quantized matmuls see (Q8_0/Q8_1), and onnxruntime's int8 kernels on x86."""
    shape = x.shape
    b = x.reshape(-1, shape[-1] // block, block)
    scale = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    q = np.round(np.divide(b, scale, out=np.zeros_like(b), where=scale > 0))
    return (q * scale).reshape(shape).astype(np.float32)


class ReferenceForward:
    def __init__(self, model: GGUFModel, *, int8_activations: bool = False) -> None:
        """`int8_activations`: every matmul's input rounded to int8 per 32-block first (q8_blocks), the
        arithmetic of an int8 variant done exactly: its distance from the fp32 forward is the error that
        quantizing activations this way costs, on any machine."""
        self.m = model
        self.int8_activations = int8_activations
        self.cfg = c = model.config
        self.family = model.family
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        factors = model.tensor("rope_freqs.weight").dequantize() if c.rope_freqs else None
        self.inv_freq = [c.layer_rope(i).inv_freq(c.head_dim, factors) for i in range(c.n_layers)]
        self.output_norm = model.tensor("output_norm.weight").dequantize().reshape(-1)

    def _layer(self, i: int) -> dict[str, np.ndarray]:
        if i not in self._layers:
            p = f"blk.{i}."
            w = {}
            for name in self.m.tensors:
                if name.startswith(p):
                    a = self.m.tensor(name).dequantize()
                    w[name[len(p) :]] = a.reshape(-1) if a.shape[0] == 1 else a
            self._layers[i] = w
        return self._layers[i]

    def _mm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T, w as a torch Linear's (out, in)."""
        if self.int8_activations and x.shape[-1] % 32 == 0:
            x = q8_blocks(x)
        return x @ w.T

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

    def hidden(self, ids: list[int]) -> np.ndarray:
        """(len(ids), hidden): the final-normed hidden states of one sequence."""
        c, fam = self.cfg, self.family
        s = len(ids)
        x = dequantize_rows(self.m.tensor("token_embd.weight"), np.asarray(ids)) * np.float32(c.embed_scale)
        pos = np.arange(s)
        group = c.n_heads // c.n_kv_heads
        act = gelu_tanh if fam.activation == "gelu_tanh" else silu
        for i in range(c.n_layers):
            w = self._layer(i)
            h = self._rms(x, w["attn_norm.weight"])
            q, k, v = (self._mm(h, w[f"attn_{n}.weight"]) for n in "qkv")
            if fam.qkv_bias:
                q, k, v = q + w["attn_q.bias"], k + w["attn_k.bias"], v + w["attn_v.bias"]
            q = q.reshape(s, c.n_heads, c.head_dim).transpose(1, 0, 2)
            k = k.reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = v.reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            if fam.qk_norm:
                q, k = self._rms(q, w["attn_q_norm.weight"]), self._rms(k, w["attn_k_norm.weight"])
            q, k = self._rope(q, pos, self.inv_freq[i]), self._rope(k, pos, self.inv_freq[i])
            k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
            scores = q @ k.transpose(0, 2, 1) * np.float32(c.attention_scale) + self._mask(s, i)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            a = self._mm((scores @ v).transpose(1, 0, 2).reshape(s, -1), w["attn_output.weight"])
            if fam.sandwich_norms:
                a = self._rms(a, w["post_attention_norm.weight"])
            x = x + a
            h = self._rms(x, w["ffn_norm.weight"])
            f = self._mm(
                act(self._mm(h, w["ffn_gate.weight"])) * self._mm(h, w["ffn_up.weight"]), w["ffn_down.weight"]
            )
            if fam.sandwich_norms:
                f = self._rms(f, w["post_ffw_norm.weight"])
            x = x + f
        return self._rms(x, self.output_norm)

    def logits(self, ids: list[int], positions: list[int] | None = None) -> np.ndarray:
        """(len(positions), vocab) float32 logits of one sequence, every position by default."""
        h = self.hidden(ids)
        if positions is not None:
            h = h[np.asarray(positions)]
        head = self.m.tensor("token_embd.weight" if self.cfg.tied_embeddings else "output.weight")
        out = np.empty((len(h), self.cfg.vocab), np.float32)
        for start in range(0, self.cfg.vocab, HEAD_CHUNK):
            chunk = slice(start, min(start + HEAD_CHUNK, self.cfg.vocab))
            out[:, chunk] = self._mm(h, dequantize_rows(head, chunk))
        return out
