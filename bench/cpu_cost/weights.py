"""Bytes of weights one decode step reads: a figure from the model files, not a measurement.

A decode step multiplies one token's activations by every weight matrix once, so it reads every weight
once; a lookup table (a Gather's data: the token embedding) gives one row. Read from the files as they
are stored: what onnxruntime copies or repacks at load (its prepacked MatMulNBits layouts) may differ, and
whether a byte comes from cache or DRAM is what a count cannot tell (docs/cpu-classes.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LOOKUPS = ("Gather", "GatherBlockQuantized")


def onnx_decode_bytes(onnx_path: Path) -> dict[str, int]:
    """(weights read per decoded token, all weights) of a simmer variant's graph."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    users: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    read = total = 0
    for t in graph.initializer:
        external = {e.key: e.value for e in t.external_data}
        if "length" in external:
            size = int(external["length"])
        elif t.raw_data:
            size = len(t.raw_data)
        else:
            size = int(np.prod(t.dims)) * np.dtype(tensor_dtype_to_np_dtype(t.data_type)).itemsize
        total += size
        lookup_only = users.get(t.name, set()) and users[t.name] <= set(LOOKUPS)
        read += size // max(1, int(t.dims[0])) if lookup_only and t.dims else size
    return {"weight_bytes_per_decoded_token": read, "weight_bytes_total": total}


def gguf_decode_bytes(gguf_path: Path) -> dict[str, int]:
    """The same for llama.cpp on the GGUF: every tensor once; token_embd one row unless the head reads it
    too (tied embeddings: no output.weight), then whole."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    read = total
    embd = tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in tensors:
        rows = int(embd.shape[-1])  # GGUF lists dims fastest first: (hidden, vocab)
        read -= int(embd.n_bytes) - int(embd.n_bytes) // rows
    return {"weight_bytes_per_decoded_token": read, "weight_bytes_total": total}
