"""Large /tokenize calls at once against a real `simmer serve` process (the tiny real model): /health keeps
answering within 2 s while they run (the tokenizer lets the GIL go, its JSON is written off the event loop),
and the memory they used goes back to the OS afterwards (one tokenizer thread, the heap trimmed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.server.processes import free_port, wait_ready

SERVE_FOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from server.launch import build_server
    from server.serving.model_setup import serve_folders
    from server.settings import Settings
    settings = Settings(port=int(sys.argv[1]), home=sys.argv[2], thermal_source="none", keep_alive_s=-1,
                        threads=1, context_length=128)
    build_server(settings, served=serve_folders(settings, [Path(sys.argv[3])])).run()
    """
)
CALLS = 4
# ~500 KB of CJK as UTF-8: 500,000 ids from the tiny byte-level vocabulary, about 2 s of tokenizing each
TEXT = "漢字かな交じり文" * 20_800


def test_tokenize_when_large_calls_at_once_then_health_answers_and_memory_goes_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_FOLDER, str(port), str(tmp_path), str(tiny_model_dir)],
        cwd=os.getcwd(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"content": TEXT}, ensure_ascii=False).encode()
    statuses: list[int] = []
    try:
        wait_ready(url, proc, timeout=60)
        process = psutil.Process(proc.pid)
        before = process.memory_info().rss

        def call() -> None:
            r = httpx.post(
                url + "/tokenize", content=body, headers={"Content-Type": "application/json"}, timeout=300
            )
            statuses.append(r.status_code)

        calls = [threading.Thread(target=call) for _ in range(CALLS)]
        for t in calls:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in calls):
            started = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.1)
        time.sleep(1.0)
        grown = process.memory_info().rss - before
    finally:
        proc.terminate()
        proc.wait(10)
        stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    assert statuses == [200] * CALLS, stderr[-2000:]
    assert worst < 2.0, f"/health took {worst:.2f} s while the calls ran"
    assert grown < 64 << 20, f"RSS stayed {grown >> 20} MB higher"
