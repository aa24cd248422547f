"""What the route handlers read, as typed values (handlers never read Settings, and nothing probes for
attributes): the worker, what is served (which model a request means: `served.resolve`), the governor
when there is one, and the streaming settings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from models.store.store import ModelStore
from server.http.metrics import Metrics
from server.http.stream_slots import StreamSlots, stream_limits
from server.routing.router import Router
from server.serving.deferred import Deferred
from server.serving.governor_gate import GovernorGate
from server.serving.grammars import LLGUIDANCE, Grammars
from server.serving.model_choice import ModelChoice
from server.serving.request import SamplingDefaults
from server.serving.summary import Summarizer
from server.serving.worker import Worker

STORE_THREADS = 2  # pulls and removals at once; more wait in line without holding a thread


@dataclass
class Runtime:
    model: str  # the default model (a request that names none)
    worker: Worker
    served: ModelChoice
    metrics: Metrics
    governor: GovernorGate | None  # None: no governor (the worker's gate never pauses or limits)
    stream_interval_s: float
    keepalive_ping_s: float
    stream_start_wait_s: float
    started: int
    sampling_defaults: SamplingDefaults
    router: Router | None = None  # set by create_app; where each request is served (server/routing/)
    store_home: Path | None = None  # the model store, for /health's model_problem (None: not from a store)
    model_store: ModelStore | None = None  # installed models: Ollama's /api/tags, /api/show, pull, delete
    summarizer: Summarizer | None = None  # the sliding window's summary (None: SIMMER_SUMMARY=false)
    pull_dirs: tuple[Path, ...] = ()  # the only folders /api/pull may install a local path from
    # Store work that may wait on a model's lock for minutes (a pull, a removal): its own few threads, so
    # that asyncio's default pool, which every other route's thread work uses, is never held by it.
    store_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="simmer-store")
    )
    # The tokenizer routes' work, one request at a time (server/serving/tokenizers.py says why).
    tokenizer_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="simmer-tokenizer")
    )
    deferred: Deferred = field(default_factory=Deferred)  # heavy work waiting for the governor's leave
    api_key_set: bool = False  # SIMMER_API_KEY: the key a request presents is part of its cache scope
    batch_fast: bool = False  # SIMMER_BATCH=fast: a local reply says so (X-Simmer-Batch)
    grammars: Grammars = LLGUIDANCE  # every grammar a request asks for is converted and checked here
    # endless event streams open at once (GET /v1/thermal/events): well under the connection cap
    event_streams: StreamSlots = field(default_factory=lambda: StreamSlots(*stream_limits(128)))
