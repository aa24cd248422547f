"""A real simmer serving the tiny model, as the upstream of the routing tests (a second process).

    python -m tests.server.routing.upstream_child MODEL_DIR TOKENS_PER_SECOND   (settings from SIMMER_*)
    python -m tests.server.routing.upstream_child store                        (the store at SIMMER_HOME)

It is `simmer serve` with one difference: its replies are paced to TOKENS_PER_SECOND by a gate that holds a
pace as the governor's does (tests/server/fakes.py PaceGate), so that a reply lasts long enough for a test
to kill the process or hang up in the middle of it. 0 = unpaced. With `store` it serves the installed
models of SIMMER_HOME (an embedding model among them) without a governor: nothing of this machine's own
heat or battery may refuse a test's request.
"""

from __future__ import annotations

import sys
from pathlib import Path

from server.launch import build_server
from server.logs import setup_logging
from server.serving.contracts import NoGate
from server.settings import Settings
from tests.server.fakes import PaceGate


def main() -> None:
    settings = Settings()
    setup_logging(settings.log_level, json_lines=False)
    if sys.argv[1] == "store":
        build_server(settings, governor=NoGate()).run()
        return
    model_dir, pace = Path(sys.argv[1]), float(sys.argv[2])

    def load():
        from models.runtime.engine import load_engine

        return load_engine(model_dir, variant="q4", threads=1, context_length=256)

    gate = PaceGate(pace) if pace > 0 else NoGate()
    build_server(settings, engine_factory=load, governor=gate).run()


if __name__ == "__main__":
    main()
