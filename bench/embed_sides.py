"""The encoders `simmer bench embed` compares, each behind the same two calls: the token ids it reads a
text as, and unit vectors for a list of texts (tokenized inside the call, as a server does).

- simmer: the server's `Embedder` over a converted folder, a call's texts batched as the server batches
  one request's (SimmerSide).
- llama.cpp: llama-cpp-python's `embed` over a GGUF, in this process, one `llama_decode` per call (rows
  packed into one ubatch, the attention masked per row). Flash attention decides its cost:
  llama.cpp's own default (`auto`, which resolves to on for the CPU) and llama-cpp-python's (off) are
  both measured, since neither is faster at every batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.llama_peer import open_llama
from models.runtime.embedder import MAX_BATCH, Embedder
from server.serving.embedding import by_length

# llama.cpp pads its context to a multiple of this (llama-context.cpp); see LlamaSide.
_CTX_PAD = 256


class SimmerSide:
    """The server's batching of one request (server/serving/embedding.py): all its texts tokenized, the
    batches of at most MAX_BATCH rows cut from them ordered by length (each batch is padded to its longest
    row), each vector put back at its text's index."""

    def __init__(self, folder: Path, threads: int) -> None:
        self.name = "simmer"
        self._emb = Embedder(folder, threads=threads)

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        return self._emb.tokenize(texts)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """`texts` as one request."""
        rows = self._emb.tokenize(texts)
        order = by_length(rows)
        out = np.empty((len(rows), self._emb.dimensions), np.float32)
        for start in range(0, len(order), MAX_BATCH):
            batch = order[start : start + MAX_BATCH]
            out[batch] = self._emb.embed([rows[i] for i in batch])
        return out

    def run(self, texts: Sequence[str], batch: int) -> np.ndarray:
        """A run of `texts` as clients would send them: one request per text at batch 1; else the list as
        requests of up to MAX_BATCH rows a pass, the whole list at once (the server orders its batches by
        length over a request, so a client sends what it has)."""
        if batch == 1:
            return np.concatenate([self.embed([t]) for t in texts])
        return self.embed(texts)


class LlamaSide:
    def __init__(self, gguf: Path, threads: int, batch_tokens: int, *, flash_attn: bool) -> None:
        """`batch_tokens`: the most tokens one call will carry (all in one decode)."""
        import llama_cpp

        self.name = "llama_cpp" if flash_attn else "llama_cpp_no_flash_attn"
        # A ubatch shorter than the padded context aborts on an assertion while llama.cpp reserves the
        # mean-pooling graph (700 tokens did, 768 ran), so the batch takes the padded size.
        self.batch_tokens = -(-batch_tokens // _CTX_PAD) * _CTX_PAD
        # llama.cpp's extra buffers (AMX, repacking: bench/llama_peer.py) take quantized weights only;
        # these are float, so they are neither used nor able to fault.
        self._llm = open_llama(
            str(gguf),
            extra_bufts=True,
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            flash_attn=flash_attn,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=self.batch_tokens,
            n_batch=self.batch_tokens,
            n_ubatch=self.batch_tokens,  # a non-causal model needs each row whole in one ubatch
            verbose=False,
        )

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._llm.tokenize(t.encode("utf-8")) for t in texts]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(self._llm.embed(list(texts), normalize=True), dtype=np.float32)

    def run(self, texts: Sequence[str], batch: int) -> np.ndarray:
        """A run of `texts`, `batch` a call (one decode each, rows packed: no padding to sort away)."""
        return np.concatenate([self.embed(texts[i : i + batch]) for i in range(0, len(texts), batch)])
