"""`simmer`: the command line. Model management lives here; other commands plug in through EXTERNAL.

Adding a subcommand from your own module: add `"name": ("package.module", "function", "one-line help")`
to EXTERNAL. The function is imported only when that subcommand runs and is called as
`function(argv: list[str], settings: Settings) -> int`, where argv holds the arguments after the
subcommand name (parse them with your own argparse parser). A subcommand whose module does not exist
yet is left out of the help and gives a clear message when called.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

from models.errors import SimmerError
from models.store import registry
from models.store.registry import license_notice
from models.store.store import Converter, ModelInfo, ModelStore
from models.types import NOMINAL_VARIANT
from models.variant_facts import describe, refused_variants
from server.serving.ladder import parse_ladder
from server.settings import Settings, hub_config

EXTERNAL: dict[str, tuple[str, str, str]] = {
    "serve": ("server.cli.serve", "cli_serve", "run the OpenAI-compatible HTTP server"),
    "run": ("server.cli.run", "cli_run", "generate from a prompt in the terminal"),
    "chat": ("server.cli.run", "cli_chat", "chat with a model in the terminal"),
    "bench": ("bench.cli", "cli_bench", "benchmarks (JSON output)"),
}


class TqdmProgress:
    """Maps (stage, fraction) progress reports onto one tqdm bar per stage. When stderr is not a
    terminal (CI logs, pipes) it prints one line per stage instead of redrawing bars."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._stage: str | None = None
        self._tty = sys.stderr.isatty()

    def __call__(self, stage: str, fraction: float) -> None:
        if stage != self._stage:
            self.close()
            self._stage = stage
            if self._tty:
                from tqdm import tqdm

                fmt = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}"
                self._bar = tqdm(total=100, desc=stage, file=sys.stderr, bar_format=fmt)
            else:
                print(f"{stage} ...", file=sys.stderr, flush=True)
        if self._bar is not None:
            self._bar.n = round(fraction * 100, 1)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stage = None


def _print(msg: str) -> None:
    print(msg, flush=True)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _store(settings: Settings, converter: Converter | None) -> ModelStore:
    return ModelStore(
        settings.home,
        converter=converter,
        log=_print,
        warn=_warn,
        hub=hub_config(settings),
        memory_free=lambda: conversion_memory_free(settings),
        memory_budget=conversion_memory_budget(settings),
    )


def conversion_memory_free(settings: Settings) -> int | None:
    """What a conversion in this process may add: an explicit SIMMER_MEMORY_BUDGET_MB less what the
    process holds already, else what the device (cgroup or host) has available less the reserve."""
    import psutil

    from server.serving.model_setup import memory_budget

    budget = memory_budget(settings)
    held = psutil.Process().memory_info().rss if budget.explicit_bytes is not None else 0
    return budget.free(held)


def conversion_memory_budget(settings: Settings) -> str:
    if settings.memory_budget_mb is not None:
        mb = settings.memory_budget_mb
        return f"the budget of {mb} MiB (SIMMER_MEMORY_BUDGET_MB), less what simmer holds,"
    return f"the memory available now, less a reserve of {settings.memory_reserve_mb} MiB,"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def configured_variants(settings: Settings, model_id: str) -> list[str] | None:
    """The variants of `model_id` the configuration will serve beyond the nominal one: SIMMER_VARIANT for
    the served model, and `id:variant` rungs of SIMMER_LADDER. None when it names none (a pull then
    installs the nominal variant alone)."""
    ladder = parse_ladder(settings.ladder)
    wanted = {variant for rung, variant in ladder if rung == model_id and variant}
    # the served model: SIMMER_MODEL, or the ladder's first when only SIMMER_LADDER is set (served.py)
    served = ladder[0][0] if ladder and "model" not in settings.model_fields_set else settings.model
    if settings.variant and registry.model_id(served) == model_id:
        wanted.add(settings.variant)
    return sorted(wanted | {NOMINAL_VARIANT}) if wanted else None


def cmd_pull(args: argparse.Namespace, settings: Settings, converter: Converter | None) -> int:
    name = args.model or settings.model
    progress = TqdmProgress()
    store = _store(settings, converter)
    spec = registry.resolve(name, sha256=args.sha256, hub=store.hub)
    with store.disk_full_as_error(f"simmer pull {name}", f"reading the license notice of {spec.id}"):
        notice = license_notice(spec.source, store.downloads_dir)
    if notice:
        _print(notice)
    try:
        if args.variants:
            variants: list[str] | None = [v for v in args.variants.split(",") if v]
        else:
            variants = configured_variants(settings, spec.id)
        model = store.pull(name, progress, sha256=args.sha256, variants=variants, force=args.force)
    finally:
        progress.close()
    _print(
        f"{model.id} {model.version}: variants {', '.join(sorted(model.variants))} ({_mb(model.size_bytes)})"
    )
    for name, why in refused_variants(model.manifest).items():
        _warn(f"variant {name} {why}")
    _print(f"  {model.path}")
    return 0


def cmd_list(args: argparse.Namespace, settings: Settings, converter: Converter | None) -> int:
    models = _store(settings, converter).list()
    if not models:
        _print("no models installed (run `simmer pull`)")
        return 0
    store = _store(settings, converter)
    rows = [("ID", "VERSION", "VARIANTS", "SIZE", "CURRENT", "STATUS")]
    fixes: list[str] = []
    for m in models:
        rows.append(
            (
                m.id,
                m.version,
                ",".join(m.variants),
                _mb(m.size_bytes),
                "yes" if m.current else "no",
                _status(m),
            )
        )
        if m.current and m.problem:
            problem = store.problem(m.id)
            fix = problem["fix"] if problem else f"simmer pull --force {m.id}"
            fixes.append(
                f"{m.id}: the current version {m.version} is not served ({m.problem}); to fix: {fix}"
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        _print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for m in models:
        if m.current:
            for line in _variant_lines(m):
                _print(line)
    for line in fixes:
        _print(line)
    return 0


def _variant_lines(m: ModelInfo) -> list[str]:
    """Each variant's measured quality and speed (models/variant_facts.py), the floor, what it refused."""
    head = f"{m.id} {m.version}: default {m.default_variant or '-'}"
    f = m.floor or {}
    if isinstance(f.get("kl_mean"), float | int) and isinstance(f.get("kl_p99"), float | int):
        head += f"; quality floor ({f.get('source')}): KL {f['kl_mean']:.2g} (p99 {f['kl_p99']:.2g})"
    if isinstance(f.get("min_cosine"), float | int):
        head += f"; quality floor ({f.get('source')}): min cosine {f['min_cosine']}"
    width = max(len(n) for n in [*m.variants, *m.refused]) if m.variants or m.refused else 0
    lines = [head]
    lines += ["  " + describe(name.ljust(width), m.facts.get(name, {})) for name in m.variants]
    lines += [f"  {name.ljust(width)}  {why}" for name, why in m.refused.items()]
    return lines


def _status(m: ModelInfo) -> str:
    """What a load would do with this version (no hashing here: `simmer verify` hashes)."""
    if m.bad:
        return f"BAD: {m.problem}"
    if m.problem:
        return f"damaged: {m.problem}"
    if m.serving:
        return "serving" if m.current else "serving (the current version is bad)"
    return "kept (previous)"


def cmd_verify(args: argparse.Namespace, settings: Settings, converter: Converter | None) -> int:
    progress = TqdmProgress()
    try:
        model = _store(settings, converter).verify(args.model or settings.model, progress)
    finally:
        progress.close()
    count = len(model.manifest["files"])
    _print(f"ok: {model.id} {model.version}: {count} files, {_mb(model.size_bytes)}, sha256 verified")
    return 0


def cmd_rm(args: argparse.Namespace, settings: Settings, converter: Converter | None) -> int:
    _store(settings, converter).remove(args.model)
    _print(f"removed {args.model}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simmer", description="Local inference server for small models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("pull", help="download, convert and verify a model (default: settings' model)")
    p.add_argument("model", nargs="?", help="model id, ./file.gguf or hf:owner/repo/file.gguf[@revision]")
    p.add_argument("--sha256", help="expected sha256 of the GGUF (for file and hf: models)")
    p.add_argument("--variants", help="comma-separated variants to build (default: all the converter offers)")
    p.add_argument("--force", action="store_true", help="convert again even if installed")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="installed models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("verify", help="check the sha256 of every file of a model")
    p.add_argument("model", nargs="?")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("rm", help="remove a model (all its versions)")
    p.add_argument("model")
    p.set_defaults(func=cmd_rm)

    for name, (module, _func, help_text) in EXTERNAL.items():
        if _module_exists(module):
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _run_external(name: str, argv: list[str], settings: Settings) -> int:
    module, func_name, _help = EXTERNAL[name]
    if not _module_exists(module):
        print(
            f"error: `simmer {name}` is not available in this build (module {module} is missing)",
            file=sys.stderr,
        )
        return 2
    func: Callable[[list[str], Settings], int] = getattr(importlib.import_module(module), func_name)
    try:
        return int(func(argv, settings))
    except SystemExit as exit_:  # their argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)


def main(
    argv: Sequence[str] | None = None, *, settings: Settings | None = None, converter: Converter | None = None
) -> int:
    """Entry point of the `simmer` console script. `settings` and `converter` are seams for tests."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if settings is None:
            settings = Settings()
    except ValueError as err:  # pydantic's ValidationError: a bad SIMMER_* variable
        print(f"error: invalid settings: {err}", file=sys.stderr)
        return 2
    try:
        if argv and argv[0] in EXTERNAL:
            return _run_external(argv[0], argv[1:], settings)
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # argparse: usage error (2) or --help (0)
            return int(exit_.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return int(args.func(args, settings, converter))
    except SimmerError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
