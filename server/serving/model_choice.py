"""Which model: the one a request means (`resolve`: the one it names, or the default) and the one a job
runs on (`place`: on the governor's ladder, among the models that can take it), with what a request on a
model gets (its context, chat).

It decides over what it holds and does not own: the catalog (serving/catalog.py: what can be served, by
name), the pool (serving/model_pool.py: what is loaded now) and the governor's ladder (serving/ladder.py),
with what serving/model_setup.py found when it built it from Settings (the start rung, the model loaded
at start, the planner's cost, the tokenizers of models not loaded). The routes reach all of these through
it (`Runtime.served`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from governor.limits import Rung
from models.protocol import EngineLimits
from server.serving.catalog import Catalog, CatalogEntry
from server.serving.contracts import Job
from server.serving.ladder import StartPlan, Target, place, stand_in, start_stand_in
from server.serving.memory_plan import Estimate
from server.serving.model_pool import ModelPool
from server.serving.tokenizers import Tokenizers


@dataclass
class ModelChoice:
    catalog: Catalog
    pool: ModelPool
    default_model: str
    ladder: list[Rung] = field(default_factory=list)
    start: StartPlan | None = None
    preload: str | None = None  # loaded at start (/health says "loading" until it is)
    cost: Callable[[CatalogEntry, str | None], Estimate] | None = None  # the planner's estimate
    context_cap: int | None = None  # SIMMER_CONTEXT_LENGTH
    tokenizers: Tokenizers = field(default_factory=Tokenizers)  # tokenizers of models not loaded

    # -- what routing and the routes read: which model a request means ------------------------------------
    def ids(self) -> set[str]:
        """Every model id served here."""
        return {self.default_model, *(e.id for e in self.catalog.entries())}

    def resolve(self, model: str | None) -> CatalogEntry | None:
        """The model a request means: the one it names (None or "": the default model); None: not served
        here. Every route asks this, never which engine ran last."""
        return self.catalog.get(model or self.default_model)

    def entries(self) -> list[CatalogEntry]:
        """The served models, the default first (also one engine that has not said what it is yet)."""
        entries = self.catalog.entries()
        default = self.catalog.get(self.default_model)
        if default is None:
            return entries
        if all(e.id != default.id for e in entries):
            entries = [default, *entries]
        return sorted(entries, key=lambda e: e.id != default.id)

    def context_length(self, entry: CatalogEntry) -> int | None:
        """The context a request on `entry` gets: its loaded engine's, else SIMMER_CONTEXT_LENGTH capped
        by the model's own."""
        engine = self.pool.engine(entry.id)
        if engine is not None:
            return engine.context_length
        caps = [x for x in (self.context_cap, entry.context_length) if x]
        return min(caps) if caps else None

    def can_chat(self, model_id: str) -> bool:
        entry = self.catalog.get(model_id)
        return entry is not None and entry.can_chat

    def serves_chat(self, requested: str) -> bool:
        """A chat request for `requested` lands somewhere: the model itself or a chat rung below it."""
        target = place(self.ladder, None, requested, self.can_chat)
        return self.can_chat(target.model_id)

    def ladder_models(self) -> list[str]:
        return list(dict.fromkeys(r.model_id for r in self.ladder))

    # -- the worker's placement ---------------------------------------------------------------------------
    def place(self, job: Job, governed: EngineLimits | None, blocked: set[str]) -> Target:
        requested = self.catalog.get(job.request.model or self.default_model)
        requested_id = requested.id if requested else (job.request.model or self.default_model)
        rung = (governed.model_id, governed.variant) if governed is not None else None
        return place(self.ladder, rung, requested_id, self._usable(job, blocked))

    def stand_in(
        self, job: Job, placed: Target, blocked: set[str], ready: Callable[[str], bool]
    ) -> Target | None:
        """A smaller rung for `job` while `placed`'s model loads (serving/ladder.py stand_in; `ready`: loaded,
        or loading ahead of it), or None when the job waits for it (the request said so, or none is)."""
        if job.request.wait_for_model:
            return None
        return stand_in(self.ladder, placed, ready, self._usable(job, blocked))

    def start_stand_in(self, start: str | None) -> str | None:
        """The model loaded before `start` at the server's start, to stand in for it (chat requests)."""
        return start_stand_in(self.ladder, start, self.can_chat)

    def _usable(self, job: Job, blocked: set[str]) -> Callable[[str], bool]:
        """The models that can serve `job`: a chat needs a chat template; logit_bias needs the requested
        model's vocabulary (its token ids mean nothing in another)."""
        requested = self.catalog.get(job.request.model or self.default_model)
        key = requested.tokenizer_key if requested else None
        chat = job.request.kind == "chat"
        biased = bool(job.request.params.sampling.logit_bias)

        def usable(model_id: str) -> bool:
            if model_id in blocked:
                return False
            entry = self.catalog.get(model_id)
            if entry is None:
                return False
            return (not chat or entry.can_chat) and (not biased or entry.tokenizer_key == key)

        return usable
