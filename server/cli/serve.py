"""`simmer serve` and `python -m server`: the arguments, then the process (server/launch.py)."""

from __future__ import annotations

import argparse
import sys

from models.errors import SimmerError
from server.launch import serve
from server.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="Bind address (default 127.0.0.1, SIMMER_HOST)")
    parser.add_argument("--port", type=int, default=None, help="Bind port (default 8000, SIMMER_PORT)")
    parser.add_argument("--model", default=None, help="Model id to serve (SIMMER_MODEL)")
    parser.add_argument("--variant", default=None, help="Variant to start with (SIMMER_VARIANT)")


def apply_arguments(args: argparse.Namespace, settings: Settings) -> Settings:
    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "model", "variant")
        if getattr(args, name, None) is not None
    }
    return settings.model_copy(update=overrides)


def parser(prog: str = "simmer serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the OpenAI-compatible HTTP server")
    add_arguments(p)
    return p


def cli_serve(args: argparse.Namespace | list[str], settings: Settings) -> int:
    """`simmer serve`: takes parsed arguments or the raw argv after "serve"; returns the exit code."""
    if not isinstance(args, argparse.Namespace):
        args = parser().parse_args(list(args))
    settings = apply_arguments(args, settings)
    try:
        serve(settings)
    except SimmerError as err:
        print(f"simmer serve: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_serve(parser("python -m server").parse_args(argv), Settings())
