"""GGUF -> ONNX: every variant, the tokenizer, the chat template, genai_config.json, and a measured
manifest fragment (sizes, quality against the fp32 numpy reference, decode speed, memory).

numpy + onnx only (no torch). The governor orders its ladder of variants by the measured numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models.convert.disk_plan import estimate_output
from models.convert.graph import VARIANTS, BuiltVariant, WeightFile, build_variant
from models.convert.linear import FLOAT_TYPES
from models.convert.measure import measure_variant, plan_segments, write_segments
from models.convert.memory_need import estimate_memory
from models.convert.model import GGUFModel
from models.convert.reference import ReferenceForward
from models.convert.tokenizer_gguf import metadata_from_reader, tokenizer_from_metadata
from models.errors import VerificationFailed
from models.gguf.reader import SUPPORTED_TYPES
from models.runtime.session import DecoderSession, KVCache, ModelShape
from models.types import NOMINAL_VARIANT

# 9: every large head on MatMulNBits sliced by rows (untied ones too); SentencePiece vocabularies also
# written as tokenizer.spm.npz (the compact tokenizer simmer loads)
# 10: a tied head without correction writes the logits output itself (no Reshape copy)
# 11: streamed (tables in bands, the reference a layer at a time, variants measured a segment at a time:
# load_rss_bytes is now what the weights take, not what a heap reused after the reference let show); the
# nominal variant alone by default;
# and batch > 1: the rows of input_ids are separate sequences (GroupQueryAttention's batch, each row its own
# past length), logits [batch, positions kept, vocab]
CONVERTER_VERSION = 11
WEIGHTS_FILE = "weights.data"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
QUALITY_PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew to the Moon",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)
QUALITY_MAX_TOKENS = 24
# a variant whose greedy choices disagree with the reference this often is broken, not just approximate
MIN_TOP1_AGREEMENT = {"f32": 0.99, "q8": 0.85, "q4": 0.99, "q4-a8": 0.75}

Progress = Callable[[str, float], None]


def plan_variants(model: GGUFModel) -> list[str]:
    """Best first.

    A quantized source (any matrix in a block format: every GGUF people download) gets `q4`, the exact
    variant (its own blocks, fp32 activations), and `q4-a8` (the same blocks, int8 activations: llama.cpp's
    arithmetic, fastest). No `f32`: q4 is exact already and fp32 copies cost 4-8x the bytes (Gemma 3's
    262,144 x 640 table alone is 671 MB in fp32). No `q8`: every 8-bit format is 8-bit in q4-a8 already, and
    widening the 4-bit ones buys nothing once activations are int8.
    A float source (F32/F16/BF16 matrices) gets `f32` (exact) and two re-quantized ones, `q8` and `q4-a8`,
    whose cost the quality measurement records."""
    matrices = [t for t in model.reader.tensors if len(t.shape) == 2]
    if any(SUPPORTED_TYPES.get(t.tensor_type) not in FLOAT_TYPES for t in matrices):
        return ["q4", "q4-a8"]
    return ["f32", "q8", "q4-a8"]


def default_variants(model: GGUFModel) -> list[str]:
    """What a pull installs unless asked for more: the nominal variant alone (q4-a8: the one the device
    serves), or the best one the source has. Others (the exact q4, whose 8-bit formats become fp32 and
    cost twice the disk) come on request (`simmer pull --variants`) or when the ladder names them."""
    plan = plan_variants(model)
    return [NOMINAL_VARIANT] if NOMINAL_VARIANT in plan else plan[:1]


def convert(
    gguf_path: Path,
    out_dir: Path,
    *,
    variants: list[str] | None = None,
    progress: Progress | None = None,
    measure: bool = True,
    threads: int = 2,
    disk_plan: Callable[[dict[str, int]], None] | None = None,
    memory_plan: Callable[[dict[str, int]], None] | None = None,
) -> dict[str, Any]:
    """Write the variants into `out_dir` (existing, empty) and return the manifest fragment.

    `disk_plan`, when given, gets the bytes each output file will take (models/convert/disk_plan.py) once
    the GGUF is read and before anything is written: the store checks free space there (and may raise).
    `memory_plan` likewise gets the memory each step may add to the process's RSS at its peak
    (models/convert/memory_need.py): the store checks it against the device's memory budget."""
    report = progress or (lambda stage, frac: None)
    out_dir = Path(out_dir)
    report("reading GGUF", 0.0)
    model = GGUFModel(Path(gguf_path))
    cfg = model.config
    names = variants or default_variants(model)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    if disk_plan is not None:
        disk_plan(estimate_output(model, names))
    if memory_plan is not None:
        memory_plan(estimate_memory(model, measure))

    report("tokenizer", 0.05)
    tokenizer = tokenizer_from_metadata(metadata_from_reader(model.reader))  # no second parse of the file
    tokenizer.save(out_dir)
    if tokenizer.chat_template:  # no template: the model serves completions only
        (out_dir / CHAT_TEMPLATE_FILE).write_text(tokenizer.chat_template)

    model.drop_vocabulary()  # the tokenizer is written: its arrays are not read again
    weights = WeightFile(out_dir / WEIGHTS_FILE)
    built: dict[str, BuiltVariant] = {}
    segments = plan_segments(model) if measure else []
    segment_files: dict[str, list[Path]] = {}
    try:
        for i, name in enumerate(names):
            report(f"building {name}", 0.1 + 0.4 * i / len(names))
            built[name] = build_variant(model, VARIANTS[name], weights, out_dir / f"{name}.onnx")
            if measure:
                segment_files[name] = write_segments(model, VARIANTS[name], weights, out_dir, segments)
    finally:
        weights.close()
    default = NOMINAL_VARIANT if NOMINAL_VARIANT in names else names[-1]
    write_genai_config(out_dir, model, default, tokenizer)

    architecture = architecture_entry(model)
    shape = ModelShape.from_architecture(architecture)
    entries: dict[str, dict[str, Any]] = {}
    for name in names:
        onnx_file = out_dir / f"{name}.onnx"
        entries[name] = {
            "file": onnx_file.name,
            "files": [onnx_file.name, WEIGHTS_FILE],
            "weights_bytes": referenced_bytes(onnx_file),
            "onnx_bytes": onnx_file.stat().st_size,
            "quant_map": built[name].quant_map,
            "copied_at_load": built[name].copied_at_load,
        }
    if measure:
        report("measuring quality", 0.5)
        prompts = [
            tokenizer.encode(p, add_special_tokens=False)[:QUALITY_MAX_TOKENS] for p in QUALITY_PROMPTS
        ]
        ref_logits = ReferenceForward(model).logits_many(prompts)
        try:
            for i, name in enumerate(names):
                report(f"measuring {name}", 0.55 + 0.45 * i / len(names))
                files = segment_files[name]
                copied = built[name].copied_at_load
                entries[name] |= measure_variant(files, segments, shape, prompts, ref_logits, threads, copied)
        finally:
            for files in segment_files.values():
                for path in files:
                    if path.name.startswith("."):
                        path.unlink(missing_ok=True)
    report("done", 1.0)
    return {
        "converter_version": CONVERTER_VERSION,
        "architecture": architecture,
        "context_length": cfg.context_length,
        "source_tensor_types": model.tensor_types(),
        "variants": entries,
        "default_variant": default,
        "tokenizer": "tokenizer.json",
        "chat_template": CHAT_TEMPLATE_FILE if tokenizer.chat_template else None,
        "kv_bytes_per_token": shape.kv_bytes_per_token(),
    }


def architecture_entry(model: GGUFModel) -> dict[str, Any]:
    """The manifest's `architecture`: the family and every resolved hyper-parameter (the engine needs
    n_layers, n_kv_heads, head_dim, vocab; the rest says what was built)."""
    fam = model.family
    return {
        "name": fam.name,
        **model.config.to_dict(),
        "family": {
            "rope_interleaved": fam.rope_interleaved,
            "qkv_bias": fam.qkv_bias,
            "qk_norm": fam.qk_norm,
            "sandwich_norms": fam.sandwich_norms,
            "activation": fam.activation,
        },
    }


def referenced_bytes(onnx_file: Path) -> int:
    """Bytes of external data a variant really uses (several variants share one weights file)."""
    import onnx

    m = onnx.load(str(onnx_file), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext.get("length", 0)) if ext else len(t.raw_data)
    return total


def write_genai_config(out_dir: Path, model: GGUFModel, variant: str, tokenizer: Any) -> None:
    """onnxruntime-genai's decoder description, so the same files run under onnxruntime-genai too."""
    c = model.config
    cfg = {
        "model": {
            "bos_token_id": tokenizer.bos_id,
            "context_length": c.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": f"{variant}.onnx",
                "head_size": c.head_dim,
                "hidden_size": c.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": c.n_heads,
                "num_hidden_layers": c.n_layers,
                "num_key_value_heads": c.n_kv_heads,
            },
            "eos_token_id": sorted(tokenizer.eos_ids),
            "pad_token_id": tokenizer.eos_id,
            "type": model.family.genai_type,
            "vocab_size": c.vocab,
        },
        "search": {
            "do_sample": False,
            "max_length": c.context_length,
            "num_beams": 1,
            "past_present_share_buffer": True,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }
    (out_dir / "genai_config.json").write_text(json.dumps(cfg, indent=2))


def smoke_test(model_dir: Path, manifest: dict[str, Any]) -> None:
    """A new install must load and generate, and each variant must agree with the reference well enough."""
    variants = manifest.get("variants", {})
    if not variants:
        raise VerificationFailed("the model has no variants")
    for name, entry in variants.items():
        agreement = entry.get("quality", {}).get("top1_agreement")
        floor = MIN_TOP1_AGREEMENT.get(name, 0.5)
        if agreement is not None and agreement < floor:
            raise VerificationFailed(
                f"variant {name} agrees with the fp32 reference on only {agreement:.0%} of greedy choices "
                f"(at least {floor:.0%} expected): the conversion is wrong"
            )
    shape = ModelShape.from_architecture(manifest["architecture"])
    name = manifest.get("default_variant") or next(iter(variants))
    if (variants[name].get("speed") or {}).get("segments", 1) > 1:
        # Measured a segment at a time (models/convert/measure.py): generating with the whole graph would
        # take the memory the conversion kept under. The measurement ran every weight through the same
        # kernels; the whole graph is only loaded here, unpacked, so its weights stay mapped, unread.
        _load_only(Path(model_dir) / variants[name]["file"], name)
        return
    try:
        sess = DecoderSession(Path(model_dir) / variants[name]["file"], shape, 1)
        kv = KVCache(shape, 16)
        logits = sess.run(np.array([1, 2, 3, 4]), kv, 0)
        for pos in range(4, 8):
            if not np.isfinite(logits).all():
                raise VerificationFailed(f"variant {name} produced non-finite logits")
            logits = sess.run(np.array([int(logits.argmax())]), kv, pos)
    except VerificationFailed:
        raise
    except Exception as e:  # onnxruntime raises its own types for a broken file
        raise VerificationFailed(f"variant {name} failed to run: {e}") from e


def _load_only(path: Path, name: str) -> None:
    import onnxruntime as ort

    from models.runtime.session import session_options

    options = session_options(1)
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own types for a broken file
        raise VerificationFailed(f"variant {name} failed to load: {e}") from e
