"""A reply moved across a ladder of model sizes by the governor, checked for lost or repeated text. Prints
JSON.

Starts `simmer serve` (bench.sustained's child: the store, the governor on a simulated device) with
SIMMER_LADDER, sends greedy streamed chat requests that ask for governor events until one reply moved
mid-way (or `--requests` ran out), and records each reply's text, its moves (`event: governor` switches:
old, new, tokens before) and its tokens per model. Then rebuilds every moved reply offline, engines alone,
piece by piece at the same points: the first model's greedy reply for its tokens; a model of the same
tokenizer continues from the same ids (the KV cache rebuilt once); a model of another tokenizer from its
own prompt for the text so far (continuation_prompt). The reply the client read must be that text,
character for character: nothing lost, nothing repeated. (Greedy q4-a8 is the same on 1 and 2 threads:
only the positions a pass covers change its rounding, and the rebuild prefills as the server does.)

`--budget-mb` sets SIMMER_MEMORY_BUDGET_MB, so the memory tier picks the start rung as a device of that
size would. Each request waits (up to `--wait-s`) for the governor to be below serious, where the start
rung serves: loading a model heats the simulated device too. On `phone-heatwave` an idle device settles at
fair (40.4 C) and never cools back out of serious; a `--time-scale` below 1 keeps a slow load from heating
it past serious before the first request.

    SIMMER_HOME=... python -m studies.experiments.ladder_handover --ladder A,B,C [--profile phone-heatwave]
        [--time-scale 1] [--budget-mb N] [--max-tokens 400] [--requests 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sustained.process import server_process
from models.protocol import Prompt
from models.types import GenerationParams, SamplingParams, TokenEvent
from server.serving.engine_config import EngineConfig
from server.serving.ladder import parse_ladder
from server.settings import Settings

PROMPT = (
    "Write a long, detailed tutorial on Python list comprehensions, with many examples and an explanation "
    "of each one."
)


def wait_below_serious(url: str, timeout_s: float) -> dict[str, Any]:
    """Until the governor's level is nominal or fair (the start rung serves), or the timeout: the state
    then. A load heats the simulated device too; a reply that starts on a lower rung moves nowhere."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(url + "/v1/thermal", timeout=10).json()
        if state.get("level") in ("nominal", "fair") or time.monotonic() > deadline:
            t = state.get("temperature") or {}
            return {"level": state.get("level"), "celsius": t.get("celsius")}
        time.sleep(0.5)


def stream_reply(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
    }
    text, models, switches, usage, finish, event = "", [], [], {}, None, None
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line.removeprefix("data: "))
                if event == "governor":
                    if "switch" in data:
                        switches.append(data["switch"])
                elif data.get("usage"):
                    usage = data["usage"]
                elif data.get("choices"):
                    choice = data["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
                    if not models or models[-1] != data["model"]:
                        models.append(data["model"])
                event = None
    return {
        "text": text,
        "models_in_order": models,
        "switches": switches,
        "usage_models": usage.get("models"),
        "completion_tokens": usage.get("completion_tokens"),
        "finish_reason": finish,
        "seconds": round(time.monotonic() - t0, 1),
    }


def rebuild(reply: dict[str, Any], first: str) -> str:
    """The same greedy reply, model by model, at the points the server moved it. Within one tokenizer the
    ids go on (the text is theirs, decoded once); a model of another tokenizer starts from its own prompt
    for the complete characters so far (a character's bytes not yet shown are dropped, as the server does)."""
    config = EngineConfig.from_settings(Settings())
    messages = [{"role": "user", "content": PROMPT}]
    names = [first, *(s["new"].split("/")[0] for s in reply["switches"])]
    variants = [None, *(s["new"].split("/")[1] for s in reply["switches"])]
    ends = [*(s["tokens_before"] for s in reply["switches"]), reply["completion_tokens"]]
    before = ""  # the text of the tokenizers before the current one
    ids: list[int] = []  # the reply's ids in the current tokenizer
    prompt_ids: list[int] = []
    key = None
    done = 0
    text = ""
    for i, (name, variant) in enumerate(zip(names, variants, strict=True)):
        engine = config.open_installed(name, variant=variant)
        if i == 0:
            prompt_ids = list(engine.chat_prompt(messages).ids)
        elif engine.tokenizer_key != key:
            before = text.rstrip("\ufffd")
            continued = engine.continuation_prompt(messages, before)
            prompt_ids, ids = list(continued.ids), []
        key = engine.tokenizer_key
        params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=ends[i] - done)
        tokens = [e for e in engine.generate(Prompt(prompt_ids + ids), params) if isinstance(e, TokenEvent)]
        ids += [e.token_id for e in tokens]
        eos = engine.tokenizer.eos_ids
        text = before + engine.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
        done = ends[i]
        engine.unload()
    return text


def run(a: argparse.Namespace) -> dict[str, Any]:
    models = [m for m, _ in parse_ladder(a.ladder)]
    update: dict[str, Any] = {
        "ladder": a.ladder,
        "model": models[0],
        "thermal_source": f"sim:{a.profile}",
        "sim_time_scale": a.time_scale,
        "keep_alive_s": -1,
    }
    if a.budget_mb:
        update["memory_budget_mb"] = a.budget_mb
    settings = Settings().model_copy(update=update)
    replies = []
    with server_process(settings, ready_timeout_s=900) as srv:
        start = next(
            (line for line in srv.log_lines() if "memory tier: " in line),
            "(the server logged no memory tier)",
        )
        for _ in range(a.requests):
            at_start = wait_below_serious(srv.url, a.wait_s)
            reply = {"device_at_start": at_start, **stream_reply(srv.url, models[0], a.max_tokens)}
            replies.append(reply)
            if reply["switches"]:
                break
        rung_log = [line.split("simmer.governor: ", 1)[-1] for line in srv.log_lines() if " rung " in line]
    for reply in replies:
        if reply["switches"]:
            rebuilt = rebuild(reply, reply["models_in_order"][0])
            same = rebuilt == reply["text"]
            at = next(
                (i for i, (x, y) in enumerate(zip(rebuilt, reply["text"], strict=False)) if x != y), None
            )
            reply["rebuilt_equal"] = same
            reply["first_difference_at"] = (
                None if same else (at if at is not None else min(len(rebuilt), len(reply["text"])))
            )
            reply["rebuilt_text"] = None if same else rebuilt
    return {
        "benchmark": "ladder_handover",
        "how": __doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else "",
        "ladder": a.ladder,
        "profile": a.profile,
        "time_scale": a.time_scale,
        "budget_mb": a.budget_mb,
        "memory_tier": re.sub(r"^.*memory tier: ", "", start),
        "rung_log": rung_log[:40],
        "replies": replies,
        "moved_replies": sum(bool(r["switches"]) for r in replies),
        "no_text_lost": all(r.get("rebuilt_equal", True) for r in replies)
        and any(r["switches"] for r in replies),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.experiments.ladder_handover")
    p.add_argument("--ladder", required=True)
    p.add_argument("--profile", default="phone-heatwave")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--budget-mb", type=int)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--wait-s", type=float, default=300.0, help="for the device to leave serious first")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    out = run(a)
    text = json.dumps(out, indent=1, ensure_ascii=False)
    if a.json:
        a.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
