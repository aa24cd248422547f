"""What the route handlers read, as typed values (handlers never read Settings, and nothing probes for
attributes): the worker, what is served, the governor when there is one, and the streaming settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.store.store import ModelStore
from server.governor_gate import GovernorGate
from server.metrics import Metrics
from server.routing.router import Router
from server.schemas import SamplingDefaults
from server.served import Served
from server.summary import Summarizer
from server.worker import Worker


@dataclass
class Runtime:
    model: str  # the default model (a request that names none)
    worker: Worker
    served: Served
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
    api_key_set: bool = False  # SIMMER_API_KEY: the key a request presents is part of its cache scope

    def model_id(self) -> str:
        """The model in use: the one that ran last (or loaded at start), else the default."""
        engine = self.worker.engine
        return engine.model_id if engine is not None else self.model

    def served_ids(self) -> set[str]:
        return {self.model, self.model_id(), *self.served.served_ids()}
