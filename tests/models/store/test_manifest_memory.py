"""The store manifest's memory estimate per variant: weights plus the KV cache of the whole context in the
variant's own KV type."""

from __future__ import annotations

from models.runtime.session import kv_bytes_per_token
from models.store.manifest import memory_estimate

MiB = 1 << 20


def test_memory_estimate_when_a_variant_has_a_half_cache_then_its_kv_is_half():
    fragment = {
        "architecture": {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64},
        "context_length": 8192,
        "variants": {
            "q4": {"weights_bytes": 100 * MiB, "kv_dtype": "float32"},
            "q4-a8": {"weights_bytes": 100 * MiB, "kv_dtype": "float16"},
            "old": {"weights_bytes": 100 * MiB},  # from before the choice: fp32
        },
    }
    out = memory_estimate(fragment, {})
    fp32 = kv_bytes_per_token(30, 3, 64) * 8192
    assert out["variants"]["q4"]["estimate_bytes"] == 100 * MiB + fp32
    assert out["variants"]["old"]["estimate_bytes"] == 100 * MiB + fp32
    assert out["variants"]["q4-a8"]["estimate_bytes"] == 100 * MiB + fp32 // 2
