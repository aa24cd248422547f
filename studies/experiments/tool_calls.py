"""Tool calls from real models under `tool_choice: "auto"`: 20 prompts that ask for a declared function and
20 that do not, per model, greedy. Prints JSON.

For every reply: what the client got (calls or text), how the model wrote it (the grammar's own envelope,
a call in its own way that the recogniser took, or text; models/runtime/loose_calls.py), and the raw reply
(the token ids decoded). "before" counts what reached clients before the recogniser: the envelope's calls
alone. A plain prompt answered with a call is the model's choice (its whole reply was a call); a reply with
any prose that became a call would be the recogniser's error, counted as `text_turned_into_call` (the raw
reply is checked to be only the call's frame).

    python -m studies.experiments.tool_calls --model-dir DIR [--model-dir DIR2 ...] [--json OUT]
        [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from models.runtime.engine import load_engine
from models.runtime.loose_calls import LooseScan, parse
from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent, Tool, ToolUse


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


STRING = {"type": "string"}
TOOLS = (
    Tool(
        "get_weather",
        "Get the current weather in a city",
        _obj(["city"], city=STRING, unit={"enum": ["celsius", "fahrenheit"]}),
    ),
    Tool("get_time", "Get the current local time in a time zone", _obj(["timezone"], timezone=STRING)),
    Tool("search_web", "Search the web and return the top results", _obj(["query"], query=STRING)),
    Tool(
        "send_email",
        "Send an email",
        _obj(["to", "subject", "body"], to=STRING, subject=STRING, body=STRING),
    ),
    Tool(
        "convert_currency",
        "Convert an amount of money from one currency to another at today's rate",
        _obj(
            ["amount", "from_currency", "to_currency"],
            amount={"type": "number"},
            from_currency=STRING,
            to_currency=STRING,
        ),
    ),
    Tool("set_alarm", "Set an alarm on this device", _obj(["time"], time=STRING, label=STRING)),
)

# (prompt, the function it asks for)
TOOL_PROMPTS = [
    ("What's the weather in Paris?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How hot is it in Tokyo today, in fahrenheit?", "get_weather"),
    ("Tell me the current temperature in Berlin.", "get_weather"),
    ("What time is it in New York?", "get_time"),
    ("What's the local time in Sydney, Australia?", "get_time"),
    ("Current time in the Europe/Madrid time zone, please.", "get_time"),
    ("Search the web for the latest news about the Mars rover.", "search_web"),
    ("Look up who won the 2022 World Cup.", "search_web"),
    ("Find recent articles about quantum computing.", "search_web"),
    ("Email alice@example.com with the subject 'Lunch' and say I'll be 10 minutes late.", "send_email"),
    ("Send an email to bob@example.com titled 'Report' saying the report is attached.", "send_email"),
    ("Write to carol@example.com, subject Meeting, body: see you at 3pm.", "send_email"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("Exchange 250 EUR into CHF for me.", "convert_currency"),
    ("Set an alarm for 7:00 tomorrow morning.", "set_alarm"),
    ("Wake me up at 6:30 with the label 'gym'.", "set_alarm"),
    ("Please set an alarm at 22:15 called 'take medicine'.", "set_alarm"),
    ("What's the weather like in Cairo?", "get_weather"),
]

PLAIN_PROMPTS = [
    "What is 2 + 2?",
    "Write a Python function that reverses a string.",
    "Explain recursion in one sentence.",
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "How do I sort a list in Python?",
    "What does HTTP stand for?",
    "Give me three tips for writing clean code.",
    "Translate 'good morning' into Spanish.",
    "What is the difference between a list and a tuple in Python?",
    "Reply with a JSON object describing a cat with a name and an age.",
    'Give me a JSON object {"name": ..., "year": ...} for the first Moon landing mission.',
    "Write a SQL query that counts the rows of a table named users.",
    "Who wrote Romeo and Juliet?",
    "What is a prime number?",
    "Summarize the plot of Cinderella in two sentences.",
    "Write a bash one-liner that counts the lines of every .py file.",
    "Is 17 a prime number?",
    "What is the boiling point of water at sea level?",
    "Name three primary colours.",
]

FRAME = re.compile(r"\s*(```(json)?\s*|<tool_call>\s*)?\{.*\}\s*(```|</tool_call>)?\s*", re.S | re.I)


def one(engine: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    use = ToolUse(TOOLS, choice="auto")
    p = engine.chat_prompt([{"role": "user", "content": prompt}], tools=use)
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens, tools=use)
    t0 = time.perf_counter()
    events = list(engine.generate(p, params))
    fin = events[-1]
    assert isinstance(fin, FinishEvent)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    raw = engine.tokenizer.decode([t.token_id for t in tokens], skip_special_tokens=True)
    content = "".join(t.text for t in tokens) + fin.text
    deltas = [d for t in tokens for d in t.tool_calls] + list(fin.tool_calls)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"name": "", "arguments": ""})
        c["name"] = c["name"] or d.name or ""
        c["arguments"] += d.arguments
    canonical = raw.lstrip().startswith(engine.tool_format.opener.strip()) and bool(calls)
    scan = LooseScan(TOOLS, markup=engine.tool_format.name != "llama3", parallel=True)
    scan.feed(raw)
    loose = not canonical and parse(scan, TOOLS) is not None and bool(calls)
    return {
        "prompt": prompt,
        "finish_reason": fin.finish_reason,
        "calls": [calls[i] for i in sorted(calls)],
        "how": "envelope" if canonical else ("own_way" if loose else "text"),
        "content": content,
        "raw": raw,
        "tokens": len(tokens),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def run_model(model_dir: Path, max_tokens: int, threads: int) -> dict[str, Any]:
    engine = load_engine(model_dir, threads=threads, context_length=2048)
    tools = [dict(one(engine, q, max_tokens), wanted=f) for q, f in TOOL_PROMPTS]
    plain = [one(engine, q, max_tokens) for q in PLAIN_PROMPTS]

    def count(rows: list[dict], how: str) -> int:
        return sum(r["how"] == how for r in rows)

    def prose_call(r: dict) -> bool:  # a call from a reply that was not only a call's frame
        return bool(r["calls"]) and r["how"] != "envelope" and FRAME.fullmatch(r["raw"]) is None

    return {
        "model": f"{model_dir.parent.name}/{model_dir.name}",
        "variant": engine.variant,
        "tool_format": engine.tool_format.name,
        "tool_prompts": {
            "n": len(tools),
            "calls": sum(bool(r["calls"]) for r in tools),
            "calls_before": count(tools, "envelope"),
            "in_the_envelope": count(tools, "envelope"),
            "written_own_way_recognised": count(tools, "own_way"),
            "text": count(tools, "text"),
            "right_function": sum(bool(r["calls"]) and r["calls"][0]["name"] == r["wanted"] for r in tools),
        },
        "plain_prompts": {
            "n": len(plain),
            "text": count(plain, "text"),
            "answered_with_a_call_by_the_model": sum(bool(r["calls"]) for r in plain),
            "text_turned_into_call": sum(prose_call(r) for r in [*plain, *tools]),
        },
        "replies": {"tool": tools, "plain": plain},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.experiments.tool_calls")
    p.add_argument("--model-dir", type=Path, action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    out = {
        "benchmark": "tool_calls",
        "how": __doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else "",
        "models": [run_model(d, a.max_tokens, a.threads) for d in a.model_dir],
    }
    text = json.dumps(out, indent=1, ensure_ascii=False)
    if a.json:
        a.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
