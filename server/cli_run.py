"""`simmer run PROMPT` and `simmer chat`: the engine in a terminal, no server needed."""

from __future__ import annotations

import argparse
import sys

from models.runtime.engine import LlamaEngine
from models.types import FinishEvent, GenerationParams, SamplingParams
from server.engine_config import EngineConfig
from server.settings import Settings


def _parser(prog: str, with_prompt: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", "-m", help="model id (default: SIMMER_MODEL)")
    p.add_argument("--variant", help="variant, e.g. q4-a8, q4, f32")
    p.add_argument("--threads", type=int, help="inference threads")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--system", help="system message")
    p.add_argument("--stats", action="store_true", help="print timings after each reply")
    if with_prompt:
        p.add_argument("prompt", nargs="+", help="the user message")
    return p


def _params(args: argparse.Namespace) -> GenerationParams:
    return GenerationParams(
        SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
        max_tokens=args.max_tokens,
    )


def _stream(engine: LlamaEngine, messages: list[dict], args: argparse.Namespace) -> str:
    reserve = min(args.max_tokens, 256)
    if engine.can_chat:
        prompt = engine.chat_prompt(messages, truncate=True, reserve=reserve)
    else:  # a base model (no chat template) continues the text, as `ollama run` does with one
        prompt = engine.text_prompt("\n".join(m["content"] for m in messages), truncate=True, reserve=reserve)
    reply = []
    for ev in engine.generate(prompt, _params(args)):
        text = ev.text
        reply.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()
        if isinstance(ev, FinishEvent):
            sys.stdout.write("\n")
            if args.stats:
                t = ev.timings
                print(
                    f"[{engine.variant}, {ev.usage.prompt_tokens} prompt tokens "
                    f"({ev.usage.cached_tokens} cached), "
                    f"{t.prompt_per_second:.0f} tok/s prompt, {t.predicted_per_second:.1f} tok/s decode, "
                    f"TTFT {t.ttft_ms:.0f} ms, {ev.finish_reason}]",
                    file=sys.stderr,
                )
    return "".join(reply)


def _messages(args: argparse.Namespace) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _open(settings: Settings, args: argparse.Namespace) -> LlamaEngine:
    """The engine as `simmer serve` opens it (EngineConfig), with the command line's overrides."""
    config = EngineConfig.from_settings(settings, threads=args.threads)
    return config.open_installed(args.model or settings.model, variant=args.variant)


def cli_run(argv: list[str], settings: Settings) -> int:
    args = _parser("simmer run", True).parse_args(argv)
    engine = _open(settings, args)
    _stream(engine, [*_messages(args), {"role": "user", "content": " ".join(args.prompt)}], args)
    return 0


def cli_chat(argv: list[str], settings: Settings) -> int:
    """An interactive loop; the KV cache is reused between turns, so a follow-up prefills only itself."""
    args = _parser("simmer chat", False).parse_args(argv)
    engine = _open(settings, args)
    messages = _messages(args)
    print(
        f"simmer chat: {engine.model_id} ({engine.variant}). Empty line or Ctrl-D to quit.", file=sys.stderr
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = _stream(engine, messages, args)
        messages.append({"role": "assistant", "content": reply})
