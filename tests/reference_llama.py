"""An independent fp32 numpy forward pass for Llama GGUFs, written the Hugging Face way: Q/K rows are
un-permuted back to HF order and RoPE is the half-split rotate_half form. The converter uses the other
formulation (interleaved pairs on the stored rows), so agreement checks the permutation handling."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceLlama:
    def __init__(self, path) -> None:
        r = GGUFReader(str(path))
        f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
        self.n_layers = int(f["llama.block_count"])
        self.hidden = int(f["llama.embedding_length"])
        self.n_heads = int(f["llama.attention.head_count"])
        self.n_kv = int(f["llama.attention.head_count_kv"])
        self.hd = self.hidden // self.n_heads
        self.base = float(f["llama.rope.freq_base"])
        self.eps = float(f["llama.attention.layer_norm_rms_epsilon"])
        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim > 1 else a.reshape(-1)
        for i in range(self.n_layers):
            for key, heads in (("attn_q", self.n_heads), ("attn_k", self.n_kv)):
                name = f"blk.{i}.{key}.weight"
                w = self.w[name]
                self.w[name] = w.reshape(heads, self.hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])

    def _rms(self, x, g):
        return (
            x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + self.eps).astype(np.float32) * g
        )

    def _rope(self, x, pos):  # x: (heads, S, hd), HF rotate_half
        inv = 1.0 / (self.base ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd))
        ang = np.outer(pos, inv)
        cos = np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32)
        sin = np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)
        half = self.hd // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def logits(self, ids) -> np.ndarray:
        """All positions' logits for a full sequence (no cache): (S, vocab)."""
        ids = np.asarray(ids)
        s = len(ids)
        x = self.w["token_embd.weight"][ids]
        pos = np.arange(s)
        mask = np.triu(np.full((s, s), -np.inf, np.float32), 1)
        g = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(s, self.n_heads, self.hd).transpose(1, 0, 2)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(s, self.n_kv, self.hd).transpose(1, 0, 2)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(s, self.n_kv, self.hd).transpose(1, 0, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k, v = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
            att = q @ k.transpose(0, 2, 1) / np.sqrt(self.hd) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ v).transpose(1, 0, 2).reshape(s, -1)
            x = x + o @ self.w[p + "attn_output.weight"].T
            h = self._rms(x, self.w[p + "ffn_norm.weight"])
            gt = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gt / (1 + np.exp(-gt)) * up) @ self.w[p + "ffn_down.weight"].T
        return self._rms(x, self.w["output_norm.weight"]) @ self.head.T
