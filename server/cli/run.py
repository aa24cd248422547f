"""`simmer run PROMPT` and `simmer chat`: the engine in a terminal, no server needed."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Iterator

from models.runtime.engine import DecoderEngine
from models.types import CancelToken, FinishEvent, GenerationParams, SamplingParams
from server.serving.engine_config import EngineConfig
from server.serving.summary import Summarizer
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


def _stream(
    engine: DecoderEngine,
    messages: list[dict],
    args: argparse.Namespace,
    summarizer: Summarizer | None = None,
) -> str:
    reserve = min(args.max_tokens, 256)
    summarized = False
    if engine.can_chat and summarizer is not None:  # the server's window: dropped turns come as a summary
        windowed = summarizer.window(engine, messages, truncate=True, reserve=reserve, tools=None)
        prompt, summarized = windowed.prompt, windowed.summarized
    elif engine.can_chat:
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
                    f"TTFT {t.ttft_ms:.0f} ms, {ev.finish_reason}"
                    + (", truncated" if prompt.truncated else "")
                    + (", summarized" if summarized else "")
                    + "]",
                    file=sys.stderr,
                )
    return "".join(reply)


def _messages(args: argparse.Namespace) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _open(settings: Settings, args: argparse.Namespace) -> DecoderEngine:
    """The engine as `simmer serve` opens it (EngineConfig), with the command line's overrides."""
    config = EngineConfig.from_settings(settings, threads=args.threads)
    return config.open_installed(args.model or settings.model, variant=args.variant)


def cli_run(argv: list[str], settings: Settings) -> int:
    args = _parser("simmer run", True).parse_args(argv)
    engine = _open(settings, args)
    _stream(engine, [*_messages(args), {"role": "user", "content": " ".join(args.prompt)}], args)
    return 0


class _OneEngine:
    """The chat's engine as the summarizer's model source (the server's is its ModelPool)."""

    def __init__(self, engine: DecoderEngine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def borrow(self, model_id: str) -> Iterator[DecoderEngine | None]:
        yield self.engine if model_id == self.engine.model_id else None


class _IdleSummary:
    """The summary work of `simmer chat`, in a thread while the user types (the engine is otherwise idle);
    the next line stops it at the engine's next step, before the reply uses the engine."""

    def __init__(self, summarizer: Summarizer, engine: DecoderEngine) -> None:
        self.summarizer = summarizer
        self.models = _OneEngine(engine)
        self.cancel = CancelToken()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.summarizer.pending():
            self.cancel = CancelToken()
            self.thread = threading.Thread(
                target=self.summarizer.run,
                args=(self.models, self.cancel),
                name="simmer-summary",
                daemon=True,
            )
            self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.cancel.cancel()
            self.thread.join()
            self.thread = None


def cli_chat(argv: list[str], settings: Settings) -> int:
    """An interactive loop; the KV cache is reused between turns, so a follow-up prefills only itself. A
    conversation longer than the context keeps a summary of the turns it drops, as the server does
    (SIMMER_SUMMARY), written by the chat's own model while the user types."""
    args = _parser("simmer chat", False).parse_args(argv)
    engine = _open(settings, args)
    summarizer = Summarizer(lambda: [engine.model_id]) if settings.summary and engine.can_chat else None
    idle = _IdleSummary(summarizer, engine) if summarizer is not None else None
    messages = _messages(args)
    print(
        f"simmer chat: {engine.model_id} ({engine.variant}). Empty line or Ctrl-D to quit.", file=sys.stderr
    )
    try:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if idle is not None:
                idle.stop()
            if not line.strip():
                return 0
            messages.append({"role": "user", "content": line})
            reply = _stream(engine, messages, args, summarizer)
            messages.append({"role": "assistant", "content": reply})
            if idle is not None:
                idle.start()
    finally:
        if idle is not None:
            idle.stop()
