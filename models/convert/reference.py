"""fp32 numpy forward pass over the dequantized GGUF weights: the yardstick every variant's quality is
measured against (manifest `quality`). Interleaved-pair RoPE on the stored (llama.cpp-permuted) Q/K rows,
the same formulation llama.cpp uses."""

from __future__ import annotations

import numpy as np

from models.gguf.reader import GGUFModel


class ReferenceForward:
    def __init__(self, model: GGUFModel) -> None:
        self.cfg = c = model.config
        self.w = {name: model.tensor(name).dequantize() for name in model.tensors}
        for name in [n for n in self.w if n.endswith("norm.weight")]:
            self.w[name] = self.w[name].reshape(-1)
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])
        half = c.head_dim // 2
        self.inv_freq = 1.0 / (c.rope_base ** (np.arange(half, dtype=np.float64) * 2.0 / c.head_dim))

    def _rms(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True)
        return (x / np.sqrt(ms + self.cfg.rms_eps)).astype(np.float32) * g

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: (heads, S, head_dim); rotates pairs (2i, 2i+1)."""
        ang = np.outer(pos, self.inv_freq)
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), vocab) float32 logits for every position of one sequence."""
        c = self.cfg
        s = len(ids)
        x = self.w["token_embd.weight"][np.asarray(ids)]
        pos = np.arange(s)
        causal = np.triu(np.full((s, s), -np.inf, np.float32), 1)
        group = c.n_heads // c.n_kv_heads
        for i in range(c.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(s, c.n_heads, c.head_dim).transpose(1, 0, 2)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(s, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
            scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(c.head_dim)) + causal
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            x = x + (scores @ v).transpose(1, 0, 2).reshape(s, -1) @ self.w[p + "attn_output.weight"].T
            h = self._rms(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        return self._rms(x, self.w["output_norm.weight"]) @ self.head.T
