"""Serving tests' helpers: text-only sampling and a long conversation to truncate (summaries), and a
reference reply and a stream for the several-models tests."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx

from models.protocol import Prompt
from models.runtime.engine import load_engine
from models.types import GenerationParams, SamplingParams, TokenEvent

# The tiny random model prints only newlines greedily (a blank summary), or bytes that are no text: the
# summarizer's sampling bans them (the tiny vocabulary's byte b is token 3 + b), so it writes ASCII.
TEXT_ONLY = SamplingParams(
    temperature=0.0, logit_bias=tuple((3 + b, -100.0) for b in [*range(0, 32), *range(127, 256)])
)


def conversation(turns: int = 10, size: int = 40) -> list[dict]:
    """A system message, `turns` alternating user/assistant turns of about `size` characters (the tiny
    vocabulary is about a token per character: far more than a 256-token context) and a last question."""
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {i}: " + "the cat sat on a mat " * (size // 20)})
    messages.append({"role": "user", "content": "and now?"})
    return messages


PROMPT = "The quick brown fox"


def stream(srv, model: str, max_tokens: int) -> tuple[str, list[str], list[dict], dict]:
    """A greedy streamed completion: (its text, each chunk's model, the switches, the usage)."""
    return timed_stream(srv, model, max_tokens)[1:]


def timed_stream(srv, model: str, max_tokens: int, **extra) -> tuple[float, str, list[str], list[dict], dict]:
    """stream(), with when its first text arrived (time.monotonic) in front; `extra`: more body fields."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
        **extra,
    }
    first, text, names, switches, usage, event = None, "", [], [], {}, None
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line.removeprefix("data: "))
                if event == "governor":
                    switches.append(data["switch"])
                elif data.get("usage"):
                    usage = data["usage"]
                else:
                    chunk = "".join(ch["text"] for ch in data["choices"])
                    if chunk and first is None:
                        first = time.monotonic()
                    text += chunk
                    names.append(data["model"])
                event = None
    assert first is not None
    return first, text, names, switches, usage


def reference(first_dir, second_dir, n_first: int, total: int, same_tokenizer: bool) -> str:
    """The same greedy reply, model by model, engines alone."""
    a = load_engine(first_dir, variant="f32", threads=1, context_length=128)
    b = load_engine(second_dir, variant="f32", threads=1, context_length=128)
    prompt = a.text_prompt(PROMPT)
    params = GenerationParams(SamplingParams(temperature=0), max_tokens=n_first, ignore_eos=True)
    first = [e for e in a.generate(prompt, params) if isinstance(e, TokenEvent)]
    shown = "".join(e.text for e in first)
    rest_params = replace(params, max_tokens=total - n_first)
    if same_tokenizer:
        then = Prompt(prompt.ids + [e.token_id for e in first])
    else:
        then = b.continuation_prompt(PROMPT, shown)
    events = list(b.generate(then, rest_params))
    return shown + "".join(e.text for e in events)
