"""GGUF -> ONNX: every variant, the tokenizer, the chat template, genai_config.json, and a measured
manifest fragment (sizes, quality against the fp32 numpy reference, decode speed, memory).

numpy + onnx only (no torch). The governor orders its ladder of variants by the measured numbers.
A GGUF of a sentence encoder (llama.cpp's `bert`) goes to the encoder converter instead
(models/convert/encoder_convert.py): one exact fp32 graph, manifest kind "embedding".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from models.convert import nominal
from models.convert.consolidate import consolidate
from models.convert.disk_plan import estimate_output
from models.convert.encoder_convert import convert_gguf_install, encoder_smoke_test
from models.convert.encoder_gguf import is_encoder_gguf
from models.convert.fast_plan import PLANS
from models.convert.graph import (
    KV_TYPES,
    VARIANTS,
    BuiltVariant,
    Segment,
    SplitWeights,
    VariantSpec,
    WeightFile,
    build_variant,
)
from models.convert.kv_dtype import kv_dtype_here, variant_kv_dtype
from models.convert.linear import FLOAT_TYPES
from models.convert.measure import measure_variant, plan_segments, write_segments
from models.convert.memory_need import estimate_memory
from models.convert.model import GGUFModel
from models.convert.quality import (
    METHOD,
    QUALITY_POSITIONS,
    Comparison,
    compare,
    peer_logits,
    quality_ids,
)
from models.convert.reference import ReferenceForward
from models.convert.tokenizer_gguf import metadata_from_reader, tokenizer_from_metadata
from models.errors import InvalidParameter, VerificationFailed
from models.gguf.reader import SUPPORTED_TYPES
from models.runtime.session import DecoderSession, KVCache, ModelShape
from models.types import KIND_EMBEDDING

# 9: every large head on MatMulNBits sliced by rows (untied ones too); SentencePiece vocabularies also
# written as tokenizer.spm.npz (the compact tokenizer simmer loads)
# 10: a tied head without correction writes the logits output itself (no Reshape copy)
# 11: streamed (tables in bands, the reference a layer at a time, variants measured a segment at a time:
# load_rss_bytes is now what the weights take, not what a heap reused after the reference let show); the
# `fast` variant (re-encoded, installed only within the measured quality floor); quality measured as KL
# over a fixed text; the nominal variant chosen by one rule from it (convert/nominal.py: the fastest of q4-a8
# and fast within the floor, else the exact q4), and a pull keeps it alone by default; and batch > 1: the
# rows of input_ids are separate sequences (GroupQueryAttention's batch, each row its own past length),
# logits [batch, positions kept, vocab]
# 12: the floor without llama.cpp is llama.cpp's arithmetic as it is (each matmul input rounded as llama.cpp
# rounds it for the weight's type), and `fast` has a third plan (fp32 inputs into attention and ffn_down):
# SmolLM2's default is `fast`, not `q4`
# 13: the block sums of a format with a min over a wide input (k > 2,896) by Reshape + ReduceSum, not
# a MatMul with a 0/1 indicator (Qwen2.5 1.5B: +5 % decode; the indicator read 10 MB a call in ffn_down)
# 14: byte-level BPE vocabularies also written as tokenizer.bpe.npz (the compact tokenizer simmer loads
# without holding the GIL for the quarter second `tokenizers` takes to parse Qwen 2.5's tokenizer.json)
CONVERTER_VERSION = 14
WEIGHTS_FILE = "weights.data"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPEED_ROUNDS = 3  # the nominal variant's candidates timed in alternation
# a variant whose greedy choices disagree with the reference this often is broken, not just approximate
MIN_TOP1_AGREEMENT = {"f32": 0.99, "q8": 0.85, "q4": 0.99, "q4-a8": 0.75, "fast": 0.75}

log = logging.getLogger("simmer.convert")

Progress = Callable[[str, float], None]


def plan_variants(model: GGUFModel) -> list[str]:
    """Best first.

    A quantized source (any matrix in a block format: every GGUF people download) gets `q4`, the exact
    variant (its own blocks, fp32 activations), and `q4-a8` (the same blocks, int8 activations: llama.cpp's
    arithmetic, fastest). No `f32`: q4 is exact already and fp32 copies cost 4-8x the bytes (Gemma 3's
    262,144 x 640 table alone is 671 MB in fp32). No `q8`: every 8-bit format is 8-bit in q4-a8 already, and
    widening the 4-bit ones buys nothing once activations are int8. And `fast`, re-encoded for the fewest
    bytes per token (convert/requant.py), which is installed only if its measured KL is within the floor
    (convert/nominal.py).
    A float source (F32/F16/BF16 matrices) gets `f32` (exact) and two re-quantized ones, `q8` and `q4-a8`,
    whose cost the quality measurement records."""
    matrices = [t for t in model.reader.tensors if len(t.shape) == 2]
    if any(SUPPORTED_TYPES.get(t.tensor_type) not in FLOAT_TYPES for t in matrices):
        return ["q4", "q4-a8", "fast"]
    return ["f32", "q8", "q4-a8"]


def default_variants(model: GGUFModel, measure: bool = True) -> list[str]:
    """What a pull builds unless asked for more: the nominal variant's candidates (convert/nominal.py), of
    which it keeps the one the device will serve, or the best variant the source has. Others (the exact
    q4, whose 8-bit formats become fp32 and cost twice the disk) come on request (`simmer pull --variants`)
    or when the ladder names them."""
    plan = plan_variants(model)
    return nominal.candidates(plan, measure) or plan[:1]


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
    floor: dict[str, Any] | None = None,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Write the variants into `out_dir` (existing, empty) and return the manifest fragment.

    `disk_plan`, when given, gets the bytes each output file will take (models/convert/disk_plan.py) once
    the GGUF is read and before anything is written: the store checks free space there (and may raise).
    `memory_plan` likewise gets the memory each step may add to the process's RSS at its peak
    (models/convert/memory_need.py): the store checks it against the device's memory budget.
    `floor`: the quality floor the nominal variant's candidates are held to (convert/nominal.py); by
    default it is measured: llama.cpp's KL on the same GGUF when llama-cpp-python is installed, else the
    int8 reference's (llama.cpp's arithmetic computed in numpy).
    `variants`: build and keep these; by default the nominal variant's candidates are built and the
    nominal one alone is kept (convert/nominal.py).
    `kv_dtype`: the KV cache type of the variants with int8 activations, "float32" or "float16"; by
    default this CPU's (convert/kv_dtype.py: fp16 on an aarch64 core with fp16 arithmetic, else fp32). The
    exact ones keep fp32 (variant_kv_dtype)."""
    if is_encoder_gguf(Path(gguf_path)):  # a sentence encoder: its own graph, its one exact variant
        return convert_gguf_install(
            gguf_path,
            out_dir,
            variants=variants,
            progress=progress,
            disk_plan=disk_plan,
            memory_plan=memory_plan,
        )
    report = progress or (lambda stage, frac: None)
    kv = kv_dtype or kv_dtype_here()
    if kv not in KV_TYPES:
        raise InvalidParameter(f"unknown KV type {kv!r}; known: {', '.join(KV_TYPES)}", param="kv_dtype")

    def spec(name: str) -> VariantSpec:
        return replace(VARIANTS[name], kv_dtype=variant_kv_dtype(kv, VARIANTS[name].accuracy_level))

    out_dir = Path(out_dir)
    report("reading GGUF", 0.0)
    model = GGUFModel(Path(gguf_path))
    cfg = model.config
    names = variants or default_variants(model, measure)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise InvalidParameter(f"unknown variants {unknown}; known: {', '.join(sorted(VARIANTS))}")
    refused: dict[str, str] = {}
    if not measure:  # a re-encoded variant is installed only once its quality is measured
        for n in names:
            if VARIANTS[n].requant is not None:
                refused[n] = "not installed: no quality floor was measured (a conversion without measuring)"
    if disk_plan is not None:
        disk_plan(estimate_output(model, [n for n in names if n not in refused], kv))
    if memory_plan is not None:
        memory_plan(estimate_memory(model, measure))

    report("tokenizer", 0.05)
    tokenizer = tokenizer_from_metadata(metadata_from_reader(model.reader))  # no second parse of the file
    tokenizer.save(out_dir)
    if tokenizer.chat_template:  # no template: the model serves completions only
        (out_dir / CHAT_TEMPLATE_FILE).write_text(tokenizer.chat_template)

    model.drop_vocabulary()  # the tokenizer is written: its arrays are not read again
    exact = [n for n in names if VARIANTS[n].requant is None]
    weights = WeightFile(out_dir / WEIGHTS_FILE)
    architecture = architecture_entry(model)
    shape = ModelShape.from_architecture(architecture)
    segments = plan_segments(model) if measure else []
    built: dict[str, Built] = {}
    entries: dict[str, dict[str, Any]] = {}
    try:
        for i, name in enumerate(exact):
            report(f"building {name}", 0.1 + 0.3 * i / len(names))
            variant = build_variant(model, spec(name), weights, out_dir / f"{name}.onnx")
            segment_files = write_segments(model, spec(name), weights, out_dir, segments) if measure else []
            built[name] = Built(variant, segment_files)
            entries[name] = variant_entry(out_dir, name, variant)
        weights.flush()  # measured below while the re-encoded variants still write to it
        ids: list[int] = []
        ref_logits: list[np.ndarray] = []
        if measure:
            report("measuring quality", 0.4)
            ids = quality_ids(tokenizer.encode)[: min(QUALITY_POSITIONS, cfg.context_length - 8) + 1]
            ref_logits = ReferenceForward(model).logits_many([ids[:-1]])
            for i, name in enumerate(exact):
                report(f"measuring {name}", 0.5 + 0.2 * i / len(exact))
                entries[name] |= built[name].measure(segments, shape, ids, ref_logits, threads)
            # The floor judges the candidates only: a pull of exact variants alone (`--variants q4`) has
            # nothing to hold to it, and on a slow device the int8 reference is minutes of numpy.
            if floor is None and any(n in nominal.CANDIDATES for n in names):
                report("measuring the quality floor", 0.7)
                floor = measure_floor(model, Path(gguf_path), ids, ref_logits[0])
        for name in (n for n in names if n not in exact and n not in refused):
            assert floor is not None  # measured: refused above otherwise
            got, why = build_reencoded(
                model, spec(name), out_dir, weights, shape, segments, ids, ref_logits, floor, threads, report
            )
            if got is None:
                refused[name] = f"not installed: {why}"
            else:
                built[name], entries[name] = got
        installed = [n for n in names if n in built]
        if not installed:
            raise VerificationFailed(
                "no variant left to install: " + "; ".join(f"{k} {v}" for k, v in refused.items())
            )
        racing = [n for n in nominal.CANDIDATES if n in installed]
        if measure and len(racing) > 1:
            report("timing the nominal variant's candidates", 0.9)
            race(racing, built, entries, segments, shape, ids, threads)
        exact_possible = nominal.EXACT in plan_variants(model)
        if measure and exact_possible and nominal.needs_exact(installed, entries, floor):
            name = nominal.EXACT
            report(f"building {name}: no candidate within the floor", 0.92)
            variant = build_variant(model, spec(name), weights, out_dir / f"{name}.onnx")
            built[name] = Built(variant, write_segments(model, spec(name), weights, out_dir, segments))
            weights.flush()
            entries[name] = variant_entry(out_dir, name, variant)
            entries[name] |= built[name].measure(segments, shape, ids, ref_logits, threads)
            installed.insert(0, name)
        del ref_logits
    finally:
        weights.close()
        for b in built.values():
            b.remove_segments()
    for name, why in refused.items():
        log.warning("variant %s %s", name, why)
    default, reason = nominal.choose(installed, entries, floor)
    report(f"nominal variant {default}: {reason}", 0.93)
    names = nominal.kept(installed, default, variants, entries)
    dropped = [n for n in installed if n not in names]
    for name in dropped:
        report(f"{name} measured but not kept: {default} is the nominal variant", 0.94)
        remove_variant_files(out_dir, name)
    if dropped or any(own_data_file(n) in entries[n]["files"] for n in names):
        report("writing the weights of the variants kept", 0.95)
        copied = consolidate(out_dir, WEIGHTS_FILE, {n: built[n].variant.copied_by_file for n in names})
        for name in names:
            entries[name] |= {"files": [f"{name}.onnx", WEIGHTS_FILE], "copied_at_load": copied[name]}
    write_genai_config(out_dir, model, default, tokenizer)
    report("done", 1.0)
    return {
        "converter_version": CONVERTER_VERSION,
        "architecture": architecture,
        "context_length": cfg.context_length,
        "source_tensor_types": model.tensor_types(),
        "variants": {n: entries[n] for n in names},
        "default_variant": default,
        "default_variant_reason": reason,
        "quality_floor": floor,
        "refused_variants": refused,
        "tokenizer": "tokenizer.json",
        "chat_template": CHAT_TEMPLATE_FILE if tokenizer.chat_template else None,
        "kv_bytes_per_token": shape.kv_bytes_per_token(),  # fp32's: a variant's `kv_dtype` may halve it
    }


@dataclass
class Built:
    """A variant built: its graph's facts, and the segment graphs it is measured through (removed after)."""

    variant: BuiltVariant
    segment_files: list[Path]

    def measure(
        self,
        segments: list[Segment],
        shape: ModelShape,
        ids: list[int],
        ref_logits: list[np.ndarray],
        threads: int,
    ) -> dict[str, Any]:
        copied = self.variant.copied_at_load
        return measure_variant(self.segment_files, segments, shape, [ids], ref_logits, threads, copied)

    def remove_segments(self) -> None:
        for path in self.segment_files:
            if path.name.startswith("."):
                path.unlink(missing_ok=True)


def variant_entry(out_dir: Path, name: str, variant: BuiltVariant) -> dict[str, Any]:
    onnx_file = out_dir / f"{name}.onnx"
    own = out_dir / own_data_file(name)
    return {
        "file": onnx_file.name,
        "files": [onnx_file.name, WEIGHTS_FILE, *([own.name] if own.exists() else [])],
        "weights_bytes": referenced_bytes(onnx_file),
        "onnx_bytes": onnx_file.stat().st_size,
        "quant_map": variant.quant_map,
        "copied_at_load": variant.copied_at_load,
        "kv_dtype": variant.kv_dtype,
    }


def build_reencoded(
    model: GGUFModel,
    variant_spec: VariantSpec,
    out_dir: Path,
    weights: WeightFile,
    shape: ModelShape,
    segments: list[Segment],
    ids: list[int],
    ref_logits: list[np.ndarray],
    floor: dict[str, Any],
    threads: int,
    report: Progress,
) -> tuple[tuple[Built, dict[str, Any]] | None, str]:
    """Build and measure the re-encoded variant plan by plan (convert/fast_plan.py, cheapest first) until
    one is within the floor: ((what was built, its manifest entry), "") or (None, why none was). A refused
    attempt leaves nothing behind: its graph, its segments and its own weights file are removed, and what
    it shares in the shared file are exact initializers q4-a8 writes under the same names."""
    attempts: list[dict[str, Any]] = []
    name = variant_spec.name
    for plan in PLANS:
        report(f"building {name} ({plan.name} plan)", 0.75)
        own = WeightFile(out_dir / own_data_file(name))
        spec = replace(variant_spec, requant=plan)
        split = SplitWeights(weights, own)
        try:
            variant = build_variant(model, spec, split, out_dir / f"{name}.onnx")
            built = Built(variant, write_segments(model, spec, split, out_dir, segments))
        finally:
            own.close()
        weights.flush()
        if own.size == 0 and variant.fp32_inputs == 0:
            attempts.append(
                {"plan": plan.name, "verdict": "changes no tensor of this GGUF (the same as q4-a8)"}
            )
            built.remove_segments()
            remove_variant_files(out_dir, name)
            continue
        if own.size == 0:  # a plan that re-encodes nothing: every weight is q4-a8's, in the shared file
            (out_dir / own_data_file(name)).unlink(missing_ok=True)
        report(f"measuring {name} ({plan.name} plan)", 0.85)
        entry: dict[str, Any] = variant_entry(out_dir, name, variant) | {"plan": plan.name}
        entry |= built.measure(segments, shape, ids, ref_logits, threads)
        why = nominal.check(entry.get("quality"), floor)
        q = entry.get("quality") or {}
        attempts.append(
            {
                "plan": plan.name,
                "kl_mean": q.get("kl_mean"),
                "kl_p99": q.get("kl_p99"),
                "verdict": why or "within the floor",
            }
        )
        if why is None:
            return (built, entry | {"attempts": attempts}), ""
        report(f"{name} ({plan.name} plan) not kept: {why}", 0.85)  # the user sees why, not only the log
        built.remove_segments()
        remove_variant_files(out_dir, name)
    return None, "; ".join(f"{a['plan']} plan: {a['verdict']}" for a in attempts)


def own_data_file(variant: str) -> str:
    return f"{variant}.data"


def measure_floor(model: GGUFModel, gguf: Path, ids: list[int], ref_logits: np.ndarray) -> dict[str, Any]:
    """The quality floor (convert/nominal.py): llama.cpp's KL on the same GGUF and token ids when
    llama-cpp-python is installed and can read the file, else from the int8 reference's."""
    return llama_floor(gguf, ids, ref_logits) or int8_reference_floor(model, ids, ref_logits)


def llama_floor(gguf: Path, ids: list[int], ref_logits: np.ndarray) -> dict[str, Any] | None:
    """llama.cpp's KL on the same GGUF and token ids as a floor, or None without a llama.cpp that reads it."""
    try:
        # one thread: the logits are the same (ggml splits a matmul by rows; checked: equal at 1 and 2), and
        # ggml's threads spin at every barrier, which on a loaded machine made each token take seconds
        peer = peer_logits(gguf, ids, len(ref_logits), 1)
    except Exception as e:  # a build of llama.cpp that cannot read this file: say so, use the int8 reference
        log.warning("llama.cpp could not measure %s (%s): the int8 reference sets the floor", gguf.name, e)
        return None
    if peer is None:
        return None
    step, method, close = peer
    try:
        if step(ids[0], 0).shape[-1] == ref_logits.shape[-1]:
            return nominal.peer_floor(compare(ref_logits, step, ids).summary(method))
        log.warning("llama.cpp's vocabulary differs in size: the int8 reference sets the floor")
        return None
    finally:
        close()


def int8_reference_floor(model: GGUFModel, ids: list[int], ref_logits: np.ndarray) -> dict[str, Any]:
    """The int8 reference's KL (llama.cpp's arithmetic in numpy) on the same token ids as a floor."""
    int8 = ReferenceForward(model, int8_activations=True).logits_many([ids[: len(ref_logits)]])[0]
    comparison = Comparison()
    for pos in range(len(ref_logits)):
        comparison.add(ref_logits[pos], int8[pos])
    return nominal.int8_floor(comparison.summary(METHOD.format(n=len(ref_logits)) + ", int8 reference"))


def remove_variant_files(out_dir: Path, name: str) -> None:
    for rel in (f"{name}.onnx", own_data_file(name)):
        (out_dir / rel).unlink(missing_ok=True)


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


def race(
    names: list[str],
    built: dict[str, Built],
    entries: dict[str, dict[str, Any]],
    segments: list[Segment],
    shape: ModelShape,
    ids: list[int],
    threads: int,
) -> None:
    """The nominal variant's candidates timed again in alternation (SPEED_ROUNDS rounds, one variant loaded
    at a time, a segment at a time as measured, the order rotating), so that a machine whose speed drifts
    while a pull runs does not choose for them: each entry's speed becomes the medians."""
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(SPEED_ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            b = built[name]
            copied = b.variant.copied_at_load
            speed = measure_variant(b.segment_files, segments, shape, [], [], threads, copied, ids)["speed"]
            samples[name].append((speed["decode_tok_s"], speed["cpu_s_per_token"]))
    for name, got in samples.items():
        entries[name]["speed"] |= {
            "decode_tok_s": round(float(np.median([t for t, _ in got])), 2),
            "cpu_s_per_token": round(float(np.median([c for _, c in got])), 5),
            "rounds": SPEED_ROUNDS,
            "raced_with": [n for n in names if n != name],
        }


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
    """A new install must load and generate, and each variant must agree with the reference well enough
    (a sentence encoder's: load and embed)."""
    if manifest.get("kind") == KIND_EMBEDDING:
        encoder_smoke_test(model_dir, manifest)
        return
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
        kv = KVCache(sess.shape, 16)  # the session's: its KV type is the graph's
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
