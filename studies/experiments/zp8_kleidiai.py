"""Does a constant zero point of 8 on the symmetric 4-bit MatMulNBits move onnxruntime's ARM int8 path onto
the kernel that quantizes activations per 32-block (as llama.cpp does), and what KL does that give?

onnxruntime 1.32 (onnxruntime/core/mlas/lib/kleidiai/qnbitgemm_kleidiai.cpp, SelectKleidiAIQ4Backend): with
the dot product, a 4-bit MatMulNBits at accuracy_level 4 runs KleidiAI's `qai8dxp_qsi4c32p` kernels without a
zero-point input (activations int8 per row over the whole K, weight scales truncated to bf16) and
`qsi8d32p_qai4c32p` with one (activations int8 per block, fp32 scales). A zero point of 8 everywhere gives
the same dequantized weights as none ((q - 8) * scale): only the kernel changes.

    python -m studies.experiments.zp8_kleidiai rewrite --src DIR --variant q4-a8 --out DIR
        a folder with the variant and the variant + "-zp8" (every 4-bit MatMulNBits without zero points
        given a constant uint8 zero-point input of 0x88: two 4-bit 8s a byte, [N, ceil(blocks / 2)])
    python -m studies.experiments.zp8_kleidiai same --model-dir DIR --variant q4-a8 [--positions N]
        teacher-forced logits of both on this CPU: how far apart they are
    python -m studies.experiments.zp8_kleidiai probe [--json OUT]
        one small MatMulNBits on this CPU, with and without the zero points, KleidiAI on and off: an
        activation row whose first block holds an outlier (per-row int8 loses the other blocks) and integer
        activations with fp32 scales that bf16 cannot hold (the scales' rounding alone)
    python -m studies.experiments.zp8_kleidiai measure --gguf GGUF --model-dir DIR \
        --runs q4-a8,q4-a8-zp8,q4-a8:mlas.disable_kleidiai=1 [--positions N] [--ref-npz F] --json OUT
        KL from the fp32 reference as studies/experiments/quality.py measures it (same text, same summary),
        each run a variant with its own session config entries; the logits are saved beside the JSON
    python -m studies.experiments.zp8_kleidiai count --cpu cortex-a76 --model-dir DIR \
        --variants q4-a8,q4-a8-zp8 [--session-config mlas.disable_kleidiai=1] --json OUT
        `simmer bench cpu-cost`'s count (bench/cpu_cost, no peer), its guest opening every session with these
        config entries (the guest is `... zp8_kleidiai guest --session-config K=V -- GUEST ARGS`)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ZP_SUFFIX = "-zp8"


# ---------------------------------------------------------------------------------------------- rewrite


def add_zero_points(src: Path, dst: Path) -> dict[str, int]:
    """Write `src`'s graph to `dst` with a constant zero-point input (all 8) on every 4-bit MatMulNBits that
    has none. External data stays where it points (the same weights file); the zero points are inline."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(src), load_external_data=False)
    counts = {"rewritten": 0, "kept": 0, "zero_point_bytes": 0}
    for node in m.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        has_zp = len(node.input) > 3 and node.input[3] != ""
        if attrs["bits"] != 4 or has_zp:
            counts["kept"] += 1
            continue
        n, k, block = attrs["N"], attrs["K"], attrs["block_size"]
        blocks = -(-k // block)
        # MatMulNBits' zero_points for 4 bits: uint8 [N, ceil(blocks / 2)], block 2j in the low nibble and
        # 2j + 1 in the high one (the padding nibble of an odd count is 8 too: never read)
        zp = np.full((n, (blocks + 1) // 2), 0x88, np.uint8)
        name = f"{node.input[1]}.zp8"
        m.graph.initializer.append(numpy_helper.from_array(zp, name))
        del node.input[3:]
        node.input.append(name)
        counts["rewritten"] += 1
        counts["zero_point_bytes"] += zp.nbytes
    onnx.save(m, str(dst))
    return counts


def link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def rewrite(src_dir: Path, variant: str, out: Path) -> dict[str, Any]:
    manifest = json.loads((src_dir / "manifest.json").read_text())
    entry = manifest["variants"][variant]
    out.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():  # hard links: the folder works inside a chroot too
        if f.is_file() and f.name != "manifest.json":
            link_or_copy(f, out / f.name)
    new_file = Path(entry["file"]).stem + ZP_SUFFIX + ".onnx"
    counts = add_zero_points(src_dir / entry["file"], out / new_file)
    new = dict(
        entry, file=new_file, files=[new_file, *[f for f in entry.get("files", []) if f != entry["file"]]]
    )
    manifest["variants"] = {variant: entry, variant + ZP_SUFFIX: new}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return {"variant": variant, "new_variant": variant + ZP_SUFFIX, "file": new_file, **counts}


# ---------------------------------------------------------------------------------------------- sessions


def use_session_config(entries: dict[str, str]) -> None:
    """Every session opened from now on gets these config entries (and no earlier call's)."""
    from models.runtime import session

    plain = getattr(session, "_zp8_plain_options", None) or session.session_options
    session._zp8_plain_options = plain  # type: ignore[attr-defined]

    def options(threads: int, spinning: bool = False) -> Any:
        so = plain(threads, spinning)
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        return so

    session.session_options = options


def parse_run(spec: str) -> tuple[str, str, dict[str, str]]:
    """'q4-a8-zp8:mlas.disable_kleidiai=1' -> (label, variant, config)."""
    variant, _, rest = spec.partition(":")
    config = dict(kv.split("=", 1) for kv in rest.split(";") if kv)
    return spec, variant, config


def variant_logits(
    model_dir: Path, variant: str, config: dict[str, str], ids: list[int], threads: int
) -> np.ndarray:
    from studies.experiments.quality import teacher_forced, variant_step

    use_session_config(config)
    return teacher_forced(variant_step(model_dir, variant, threads), ids)


def text_ids(model_dir: Path, positions: int) -> list[int]:
    from models.runtime.tokenizer import Tokenizer
    from studies.experiments.quality import QUALITY_POSITIONS, TEXT

    ids = Tokenizer.load(model_dir).encode(TEXT, add_special_tokens=False)[:QUALITY_POSITIONS]
    return ids[:positions]


# ---------------------------------------------------------------------------------------------- same


def same(model_dir: Path, variant: str, positions: int, threads: int) -> dict[str, Any]:
    ids = text_ids(model_dir, positions)
    a = variant_logits(model_dir, variant, {}, ids, threads)
    b = variant_logits(model_dir, variant + ZP_SUFFIX, {}, ids, threads)
    from models.convert.quality import kl_rows

    kl = kl_rows(a, b)
    return {
        "positions": len(ids),
        "max_abs_logit_diff": float(np.abs(a - b).max()),
        "max_logit_magnitude": float(np.abs(a).max()),
        "bitwise_equal_rows": int((a == b).all(axis=-1).sum()),
        "argmax_equal": float((a.argmax(-1) == b.argmax(-1)).mean()),
        "kl_between_mean": float(kl.mean()),
        "kl_between_max": float(kl.max()),
    }


# ---------------------------------------------------------------------------------------------- probe


def probe_graph(k: int, n: int, block: int, zero_points: bool, q: np.ndarray, scales: np.ndarray) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // block, block // 2)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
    inputs = ["A", "B", "S"]
    if zero_points:
        inits.append(numpy_helper.from_array(np.full((n, (k // block + 1) // 2), 0x88, np.uint8), "Z"))
        inputs.append("Z")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        accuracy_level=4,
    )
    g = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    m.ir_version = 8
    return m.SerializeToString()


def probe() -> dict[str, Any]:
    """Which rounding the kernel applies, told apart by what it loses: per-row int8 activations zero a small
    block beside an outlier; bf16 weight scales lose ~2^-9 relative where fp32 ones lose nothing."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    k, n, block = 256, 64, 32
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    # scales whose low 16 bits are far from zero: bf16 (truncated or rounded) changes them by up to 2^-8
    scales = (0.01 * (1 + rng.random((n, k // block)))).astype(np.float32)
    scales = (scales.view(np.uint32) | np.uint32(0x7FFF)).view(np.float32)
    w = ((q.astype(np.float32) - 8) * np.repeat(scales, block, axis=1)).astype(np.float32)  # [n, k]

    # outlier: 100 at A[0], the rest of block 0 zero, the other blocks in [-0.3, 0.3]
    outlier = np.zeros((1, k), np.float32)
    outlier[0, block:] = rng.uniform(-0.3, 0.3, k - block)
    outlier[0, 0] = 100.0
    # integers in [-127, 127], 127 in every block: exact in int8 per row and per block alike
    integer = rng.integers(-127, 128, (1, k)).astype(np.float32)
    integer[0, ::block] = 127.0
    inputs = {"outlier": outlier, "integer": integer, "outlier_4rows": np.repeat(outlier, 4, axis=0)}

    report: dict[str, Any] = {"K": k, "N": n, "block": block}
    for zero_points in (False, True):
        model = probe_graph(k, n, block, zero_points, q, scales)
        for kleidiai in ("on", "off"):
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            so.log_severity_level = 3
            if kleidiai == "off":
                so.add_session_config_entry("mlas.disable_kleidiai", "1")
            sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            row: dict[str, Any] = {}
            for name, a in inputs.items():
                exact = a.astype(np.float64) @ w.astype(np.float64).T
                y = sess.run(None, {"A": a})[0]
                err = np.abs(y - exact)
                # the part of the exact result that blocks 1.. contribute (what per-row int8 loses)
                rest = np.abs(a[:, block:].astype(np.float64) @ w[:, block:].astype(np.float64).T)
                row[name] = {
                    "max_abs_error": float(err.max()),
                    "rel_error": float(err.max() / np.abs(exact).max()),
                    "error_over_rest_of_row": float(err.mean() / rest.mean()) if name != "integer" else None,
                }
            report[f"{'zp8' if zero_points else 'no_zp'}_kleidiai_{kleidiai}"] = row
    return report


# ---------------------------------------------------------------------------------------------- measure


def reference(gguf: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
    from models.convert.model import GGUFModel
    from models.convert.reference import ReferenceForward

    t0 = time.perf_counter()
    forward = ReferenceForward(GGUFModel(gguf))
    ref = forward.logits(ids)
    forward.int8_activations = True
    int8 = forward.logits(ids)
    return ref, int8, time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from studies.experiments.quality import machine, summarize

    ids = text_ids(args.model_dir, args.positions)
    out_npz = args.json.with_suffix(".logits.npz")
    logits: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {
        "method": "studies/experiments/quality.py's: KL(P_fp32_reference || P_run) per position, "
        "teacher-forced over its TEXT, one token per forward pass; each run a variant with its own "
        "session config entries",
        "gguf": args.gguf.name,
        "positions": len(ids),
        "threads": args.threads,
        **machine(),
        "runs": {},
    }
    for spec in args.runs.split(","):
        label, variant, config = parse_run(spec)
        t0 = time.perf_counter()
        logits[label] = variant_logits(args.model_dir, variant, config, ids, args.threads)
        report["runs"][label] = {
            "variant": variant,
            "session_config": config,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        np.savez(out_npz, ids=np.array(ids), **logits)  # kept as it goes: the reference may be slow here
        print(f"{label}: {report['runs'][label]['seconds']} s", file=sys.stderr, flush=True)
    if args.ref_npz and args.ref_npz.exists():
        z = np.load(args.ref_npz)
        assert list(z["ids"][: len(ids)]) == ids, "the reference was made from other ids"
        ref, int8 = z["ref"][: len(ids)], z["int8"][: len(ids)]
        report["reference"] = {"from": args.ref_npz.name, "machine": str(z["machine"])}
    else:
        ref, int8, seconds = reference(args.gguf, ids)
        report["reference"] = {"computed_here_s": round(seconds, 1)}
        if args.ref_npz:
            np.savez(args.ref_npz, ids=np.array(ids), ref=ref, int8=int8, machine=os.uname().machine)
    report["int8_reference"] = summarize(ref, int8)
    for label, lg in logits.items():
        report["runs"][label] |= summarize(ref, lg)
    return report


# ---------------------------------------------------------------------------------------------- count


def guest(argv: list[str]) -> None:
    """bench.cpu_cost.guest with session config entries: `--session-config K=V ... -- GUEST ARGS`."""
    split = argv.index("--")
    entries = dict(
        v.split("=", 1)
        for flag, v in zip(argv[:split:2], argv[1:split:2], strict=True)
        if flag == "--session-config"
    )
    use_session_config(entries)
    from bench.cpu_cost.guest import main as guest_main

    guest_main(argv[split + 1 :])


def count(args: argparse.Namespace) -> dict[str, Any]:
    from bench.cpu_cost import run

    plain = run.simmer_command
    extra = [a for kv in args.session_config for a in ("--session-config", kv)]

    def command(*a: Any, **kw: Any) -> tuple[list[str], dict[str, str]]:
        cmd, env = plain(*a, **kw)
        i = cmd.index("bench.cpu_cost.guest")
        return [*cmd[:i], "studies.experiments.zp8_kleidiai", "guest", *extra, "--", *cmd[i + 1 :]], env

    run.simmer_command = command
    report = run.bench_cpu_cost(
        args.cpu,
        [args.model_dir],
        args.variants.split(","),
        None,
        prompt_tokens=args.prompt_tokens,
        decode=args.decode,
        arm64_root=None,
        reps=3,
    )
    report["session_config"] = dict(kv.split("=", 1) for kv in args.session_config)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "guest":
        guest(argv[1:])
        return 0
    p = argparse.ArgumentParser(
        prog="python -m studies.experiments.zp8_kleidiai", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rewrite")
    r.add_argument("--src", required=True, type=Path)
    r.add_argument("--variant", default="q4-a8")
    r.add_argument("--out", required=True, type=Path)
    s = sub.add_parser("same")
    s.add_argument("--model-dir", required=True, type=Path)
    s.add_argument("--variant", default="q4-a8")
    s.add_argument("--positions", type=int, default=256)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--json", type=Path)
    pr = sub.add_parser("probe")
    pr.add_argument("--json", type=Path)
    m = sub.add_parser("measure")
    m.add_argument("--gguf", required=True, type=Path)
    m.add_argument("--model-dir", required=True, type=Path)
    m.add_argument(
        "--runs",
        required=True,
        help="VARIANT[:KEY=VALUE;...],... e.g. q4-a8,q4-a8-zp8:mlas.disable_kleidiai=1",
    )
    m.add_argument("--positions", type=int, default=256)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument(
        "--ref-npz", type=Path, help="the reference logits: read when present, else computed and written"
    )
    m.add_argument("--json", required=True, type=Path)
    c = sub.add_parser("count")
    c.add_argument("--cpu", required=True)
    c.add_argument("--model-dir", required=True, type=Path)
    c.add_argument("--variants", default="q4-a8,q4-a8-zp8")
    c.add_argument("--session-config", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--prompt-tokens", type=int, default=256)
    c.add_argument("--decode", type=int, default=16)
    c.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "count":
        result: dict[str, Any] = count(args)
    elif args.cmd == "rewrite":
        result = rewrite(args.src, args.variant, args.out)
    elif args.cmd == "same":
        result = same(args.model_dir, args.variant, args.positions, args.threads)
    elif args.cmd == "probe":
        result = probe()
    else:
        result = measure(args)
    text = json.dumps(result, indent=2)
    if getattr(args, "json", None):
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
