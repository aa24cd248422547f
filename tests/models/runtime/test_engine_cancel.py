"""A generation's cancel token may fire long after the generation ended (a client that leaves late). It
must not stop whichever generation runs on the shared session at that moment."""

from __future__ import annotations

import threading

from models.runtime.engine import load_engine
from models.types import CancelToken, FinishEvent, GenerationParams, SamplingParams


def test_generate_when_finished_requests_token_cancelled_during_next_then_next_unaffected(tiny_model_dir):
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256, prefill_chunk=4)
    params = GenerationParams(SamplingParams(temperature=0), max_tokens=100, ignore_eos=True)
    first = CancelToken()
    events = list(engine.generate(engine.text_prompt("the cat sat on the mat"), params, cancel=first))
    assert isinstance(events[-1], FinishEvent) and events[-1].finish_reason == "length"

    stop = threading.Event()

    def leave_late() -> None:  # the first request's client hangs up, again and again, while the next runs
        while not stop.is_set():
            first.cancel()

    t = threading.Thread(target=leave_late)
    t.start()
    try:
        prompt = engine.text_prompt("a different and somewhat longer prompt " * 2)
        finish = list(engine.generate(prompt, params, cancel=CancelToken()))[-1]
    finally:
        stop.set()
        t.join()
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
    assert finish.usage.completion_tokens == 100
