"""The README's path end to end on whatever CPU runs the suite: `simmer pull` the default model, `simmer
serve` it on the exact variant (`q4`: the GGUF's own blocks, fp32 activations), and a greedy chat gives the
answer recorded on x86 (tests/fixtures/exact_answer_x86.json), token for token, up to the first position
where the recorded top two tokens were closer than MIN_MARGIN. An exact variant differs between CPUs by float
rounding only (about 1e-4 in the logits), so a wide margin cannot flip and a mismatch there is a real
difference in the arithmetic. `make test-arm64` runs this under qemu-user on arm64.

The answer is recorded with `python -m tests.test_exact_answer_e2e` on x86 (it pulls and serves the same way).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_once, converted_cache_dir
from tests.server.processes import free_port

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "exact_answer_x86.json"
MODEL = "smollm2-135m-instruct"
VARIANT = "q4"
PROMPT = "Name the four seasons of the year, then say which one comes after winter."
MAX_TOKENS = 48
# logits (= logprob) gap between the top two tokens below which a position is a near-tie: 1000x the
# cross-CPU error of the exact variant
MIN_MARGIN = 0.1
# how far the exact variant's margins may move between CPUs (the float rounding, with room)
MARGIN_TOLERANCE = 0.02
# emulated, loading the model takes minutes
HEALTH_TIMEOUT_S = float(os.environ.get("SIMMER_E2E_HEALTH_TIMEOUT_S", "900"))


def simmer_bin() -> str:
    return str(Path(sys.executable).with_name("simmer"))


def pulled_home() -> Path:
    """A SIMMER_HOME with the default model pulled (`simmer pull`, the exact variant only), once per machine
    and converter: the pull converts, smoke-tests and verifies, which takes minutes under emulation."""
    home = converted_cache_dir() / "e2e-home"

    def pull() -> None:
        env = {**os.environ, "SIMMER_HOME": str(home)}
        subprocess.run([simmer_bin(), "pull", MODEL, "--variants", VARIANT], env=env, check=True)

    return build_once(home, lambda: (home / "models" / MODEL / "current").exists(), pull)


@contextlib.contextmanager
def serve(home: Path) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "SIMMER_HOME": str(home),
        "SIMMER_MODEL": MODEL,
        "SIMMER_VARIANT": VARIANT,
        "SIMMER_THERMAL_SOURCE": "none",  # nothing here may step the variant down
        "SIMMER_SPECULATION": "off",
    }
    proc = subprocess.Popen(
        [simmer_bin(), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
            )
            try:
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200 and r.json()["status"] == "ok":  # the model loaded
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"simmer serve not healthy after {HEALTH_TIMEOUT_S:.0f} s"
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def greedy_answer(url: str) -> list[dict]:
    """(token, margin to the runner-up) per generated token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    out = []
    for item in choice["logprobs"]["content"]:
        top = item["top_logprobs"]
        out.append({"token": item["token"], "margin": round(top[0]["logprob"] - top[1]["logprob"], 4)})
    assert "".join(t["token"] for t in out) == choice["message"]["content"]
    return out


@pytest.mark.slow
def test_exact_variant_when_pulled_and_served_then_the_x86_answer_where_margins_are_wide():
    recorded = json.loads(FIXTURE.read_text())
    assert (recorded["model"], recorded["variant"], recorded["prompt"]) == (MODEL, VARIANT, PROMPT)
    with serve(pulled_home()) as url:
        answer = greedy_answer(url)
    wide = 0
    for i, (want, got) in enumerate(zip(recorded["tokens"], answer, strict=False)):
        if want["margin"] < MIN_MARGIN:
            break  # a near-tie on x86: what follows may legitimately differ
        assert got["token"] == want["token"], (i, answer[: i + 1], recorded["tokens"][: i + 1])
        assert abs(got["margin"] - want["margin"]) <= MARGIN_TOLERANCE, (i, got, want)
        wide += 1
    # the fixture's prefix before any near-tie is what makes this test mean something
    assert wide >= 12, f"only {wide} wide-margin tokens compared"
    if wide == len(recorded["tokens"]):  # no near-tie anywhere: the whole answer, and where it stops
        assert len(answer) == wide, answer


def record() -> None:
    """Write the fixture from this machine (run it on x86)."""
    with serve(pulled_home()) as url:
        answer = greedy_answer(url)
    import platform

    FIXTURE.write_text(
        json.dumps(
            {
                "model": MODEL,
                "variant": VARIANT,
                "prompt": PROMPT,
                "machine": platform.machine(),
                "text": "".join(t["token"] for t in answer),
                "tokens": answer,
            },
            indent=1,
        )
        + "\n"
    )
    print(FIXTURE.read_text())


if __name__ == "__main__":
    record()
