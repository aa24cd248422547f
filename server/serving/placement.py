"""Where a reply runs and with what: the worker acting on the governor's decisions (worker thread only).

Which model a job runs on is placed per job and again at every changed limit (`place`, serving/ladder.py):
the governor's rung, never above the model the client asked for, skipping rungs that cannot serve it. The
engine runs with the governor's limits on the job's own rung. When the rung moves to another model
mid-reply, the engine ends its part with a Handover and the reply is handed to the new model (`Switched`
goes to the stream), which continues it without losing or repeating text.

Memory is relieved here too: under pressure batches get fewer rows, then only the serving model stays
loaded; once the governor's rung moved below a loaded bigger model, that model is unloaded when idle
(`shed_above`, serving/ladder.py), not at the end of its keep_alive.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace

from governor.limits import Rung
from models.errors import Cancelled, SimmerError
from models.protocol import BatchDecoding, Engine, EngineLimits, Prompt
from models.types import BatchEvent, CancelToken, Handover
from server.serving.contracts import Gate, Job, Placer, StandIn, reply_tokens
from server.serving.events import Failed, Started, Switched
from server.serving.ladder import Target, shed_above
from server.serving.model_pool import ModelPool
from server.serving.reply import Desk, Gone, Reply
from server.serving.session_builds import SessionBuilds
from server.serving.summary import Windowed

log = logging.getLogger("simmer.server")


class Placement:
    """The worker's placement of replies on models, the limits their engines run with, handovers and memory
    relief. It holds the governor's latest limits and what each engine was given."""

    def __init__(
        self,
        pool: ModelPool,
        gate: Gate,
        desk: Desk,
        *,
        place: Placer,
        queued: Callable[[], list[Job]],
        ladder: Sequence[Rung] = (),
        max_batch: int = 1,
    ) -> None:
        self.pool = pool
        self.gate = gate
        self.desk = desk
        self.place = place
        self._queued = queued  # the queue's jobs whose client is still there (what shedding must keep)
        self.ladder = list(ladder)  # the governor's rungs across models (what shed_above reads)
        self.max_batch = max(1, max_batch)
        self.governed: EngineLimits | None = None  # the governor's latest limits (its rung included)
        self._applied: dict[int, EngineLimits] = {}  # per engine (id()): the limits it runs with
        self.batch: BatchDecoding | None = None  # the decoder running a batch now
        self.batch_events: list[BatchEvent] = []  # what applying limits to it ended (sync_limits)
        self._rung_seen: str | None = None  # the governor's rung the worker last shed models for
        # takes a job whose model must load to wait for it beside the worker (True: the job is no longer
        # held), instead of loading it here, on the worker thread (the worker's, serving/load_waits.py)
        self.waits_for_load: Callable[[Job, Target], bool] = lambda job, target: False
        # a loaded smaller rung for a job while the model it is placed on loads (None: jobs wait for their
        # model, SIMMER_COLD_START=wait), and what asks for that load beside the worker (the worker's)
        self.stand_in: StandIn | None = None
        self.warm: Callable[[Target], None] = lambda target: None
        # whether a model will be loaded before the target's (a stand-in loading at start: the job waits
        # for it, the shorter wait)
        self.sooner: Callable[[str, Target], bool] = lambda model, target: False
        # the model each reply on a stand-in waits for, by its job's cancel token (gone with the job)
        self._stood_in: weakref.WeakKeyDictionary[CancelToken, str] = weakref.WeakKeyDictionary()
        # new limits whose session is built beside the worker first (None: applied at once, built inside)
        self.builds: SessionBuilds | None = None
        # the memory headroom above which idle models above the rung stay loaded (None: never kept)
        self.keep_warm: int | None = None
        self._held_back: set[int] = set()  # engines (id()) whose new limits wait for that build

    def take_batch_events(self) -> list[BatchEvent]:
        events, self.batch_events = self.batch_events, []
        return events

    # -- a job starts --------------------------------------------------------------------------------
    def start(self, job: Job) -> Reply | None:
        """The job's model acquired and limited, its prompt built and Started sent: its Reply, or None
        when it ended here (its client left, or it failed: Failed sent; the worker is done with it), or
        waits for its model's load (waits_for_load)."""
        self.desk.held.hold(job)
        key = id(job)  # what the worker holds it by (a summarized job is replaced by a copy below)
        started = time.monotonic()
        engine: Engine | None = None
        blocked: set[str] = set()  # models this job could not move to (a failed load)
        try:
            if job.cancel.cancelled:
                raise Gone  # the client left while queued
            limits = self.gate.before_job(job.cancel, job.enqueued_at)
            if limits is not None:
                self.governed = limits
            if job.cancel.cancelled:
                raise Gone
            target = self.placed(job, self.governed, blocked)
            if self.waits_for_load(job, target):  # no longer held: it starts again once its model is loaded
                return None
            engine = self.pool.acquire(target.model_id, target.variant, self.load_limits(target))
            self.sync_limits(engine, target)
            self.relieve_memory(engine)
            self.shed_above_rung()
            windowed = self.prompt(engine, job)
            prompt: Prompt | None = windowed.prompt
            assert prompt is not None
            requested = job.request.payload
            if windowed.summarized:  # a reply continued on another tokenizer renders the same messages
                job = replace(job, request=job.request.with_messages(windowed.messages))
            if job.account is not None:
                job.account.started(len(prompt.ids), engine.variant)
            job.sink(
                Started(
                    len(prompt.ids), prompt.truncated, engine.variant, engine.model_id, windowed.summarized
                )
            )
            return Reply(
                job, engine, windowed, requested, blocked, started, prompt, key, self.desk, limits is not None
            )
        except Gone:
            pass
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        Reply(job, engine, None, job.request.payload, blocked, started, None, key, self.desk).close()
        return None

    def placed(self, job: Job, governed: EngineLimits | None, blocked: set[str]) -> Target:
        """Where `job` runs now: place(), or a loaded smaller rung standing in while the model it is placed
        on loads beside the worker (that load asked for here, once)."""
        target = self.place(job, governed, blocked)
        if self.stand_in is None or self.pool.is_ready(target.model_id):
            return target
        other = self.stand_in(job, target, blocked, lambda m: self.pool.is_ready(m) or self.sooner(m, target))
        if other is None:
            return target
        self.warm(target)
        self._stood_in[job.cancel] = target.model_id
        return other

    def stand_in_over(self, job: Job, engine: Engine, blocked: set[str]) -> bool:
        """`job` runs on a stand-in (`engine`) and the model it was placed on is loaded now: it hands over
        at its next step, without waiting for the governor to change anything."""
        awaited = self._stood_in.get(job.cancel)
        return awaited is not None and awaited != engine.model_id and self.pool.is_ready(awaited)

    def expected(self, job: Job) -> Target:
        """Where `job` would run now, without waiting for the gate (whose before_job may hold it): the
        governor's latest limits, on its rung as it stands now (the rung may have moved since they came)."""
        governed, rung = self.governed, self.gate.rung
        if rung is not None and (governed is None or governed.model_id != rung):
            governed = replace(governed or EngineLimits(), model_id=rung, variant=None)
        return self.placed(job, governed, set())

    def fail(self, job: Job, err: BaseException) -> None:
        """End a job that never started with `err` (its model's load failed beside the worker), as start()
        ends one whose load failed on the worker: Failed to its client unless it left, its account closed."""
        self.desk.held.hold(job)
        reply = Reply(job, None, None, job.request.payload, set(), time.monotonic(), None, id(job), self.desk)
        if job.cancel.cancelled:
            reply.close()
        else:
            reply.fail(err)

    def start_model(self, preload: str | None) -> str | None:
        """The model loaded at start: the memory tier's pick, or the governor's rung where that is a model
        further down the ladder (its first reading already says the device is hot, or will be). A load is
        seconds of full CPU: one the governor would leave at once only heats the device."""
        first, rung = preload, self.gate.rung
        order = [r.model_id for r in self.ladder]  # best first
        if first in order and rung in order and order.index(rung) > order.index(first):
            return rung
        return first

    def prompt(self, engine: Engine, job: Job) -> Windowed:
        truncate = job.request.params.truncate
        # Without truncation, only insist that one token fits (generation stops at the context cap with
        # finish_reason "length"); with it, make room for the answer, up to half the context.
        reserve = min(reply_tokens(job), engine.context_length // 2) if truncate else 1
        if not isinstance(job.request.payload, list):
            return Windowed(
                engine.text_prompt(job.request.payload, truncate=truncate, reserve=reserve), False, []
            )
        tools = job.request.params.tools
        window = self.desk.window
        if window is not None:
            return window.window(
                engine,
                job.request.payload,
                truncate=truncate,
                reserve=reserve,
                tools=tools,
                scope=job.request.params.cache_scope,
            )
        if tools is None:  # engines without tool support keep their two-keyword signature
            prompt = engine.chat_prompt(job.request.payload, truncate=truncate, reserve=reserve)
        else:
            prompt = engine.chat_prompt(job.request.payload, truncate=truncate, reserve=reserve, tools=tools)
        return Windowed(prompt, False, job.request.payload)

    # -- the limits its engine gets --------------------------------------------------------------------
    def limits_for(self, target: Target) -> EngineLimits:
        """The governor's limits on the job's own rung."""
        return replace(self.governed or EngineLimits(), model_id=target.model_id, variant=target.variant)

    def load_limits(self, target: Target) -> EngineLimits | None:
        """What a model loaded for `target` opens with: the limits sync_limits would apply right after, so
        its first session is built for the governor's threads and spinning (a load builds one, not two)."""
        return None if self.governed is None else self.limits_for(target)

    def sync_limits(self, engine: Engine, target: Target) -> None:
        """Before a job (and after a handover): the engine runs with the governor's limits on the job's
        rung. Without a governor nothing is applied but a variant the rung names."""
        if self.governed is None:
            if target.variant is None or target.variant == engine.variant:
                return
            limits = EngineLimits(variant=target.variant)
        else:
            limits = self.limits_for(target)
        if self._applied.get(id(engine)) != limits:
            if not self._session_ready(engine, limits):
                return  # the engine keeps its limits until their session is built beside the worker
            if self.batch is not None and self.batch.engine is engine:  # every row of the batch gets them
                self.batch_events += self.batch.apply_limits(limits)
            else:
                engine.apply_limits(limits)
            self._applied[id(engine)] = limits

    def _session_ready(self, engine: Engine, limits: EngineLimits) -> bool:
        """Whether `limits` apply to `engine` now; else their session is being built beside the worker and
        the engine is held back (held_back) until it is."""
        if self.builds is None or self.builds.ready(engine, limits):
            self._held_back.discard(id(engine))
            return True
        self._held_back.add(id(engine))
        return False

    def held_back(self, engine: Engine) -> bool:
        """`engine`'s new limits wait for a session built beside the worker: look again at the next step."""
        return id(engine) in self._held_back

    def step_hook(self, job: Job, engine: Engine, blocked: set[str]) -> Callable[[], EngineLimits | None]:
        """The gate's step for a reply that runs alone, as the engine's step hook: new limits on the job's
        rung, or a rung on another model (the engine then hands over)."""

        def hook() -> EngineLimits | None:
            governed = self.gate.before_step(job.cancel)
            if job.cancel.cancelled:
                raise Cancelled("request cancelled")
            if governed is None:
                if not self.stand_in_over(job, engine, blocked) and not self.held_back(engine):
                    return None
            else:
                self.governed = governed
            target = self.placed(job, self.governed, blocked)
            limits = self.limits_for(target)
            if target.model_id != engine.model_id:
                log.info(
                    "%s: the governor moves the reply to %s (%s)", job.id, target.model_id, target.reason
                )
                return limits  # the engine hands over (a Handover event)
            if self._applied.get(id(engine)) == limits:
                self._held_back.discard(id(engine))
                return None
            if not self._session_ready(engine, limits):
                return None  # the reply goes on as it is; the limits apply once their session is built
            self._applied[id(engine)] = limits
            log.info("%s: applying governor limits mid-reply: %s", job.id, describe(limits))
            return limits

        return hook

    # -- the reply moves to another model --------------------------------------------------------------
    def hand_over(
        self, job: Job, old: Engine, handover: Handover, blocked: set[str]
    ) -> tuple[Engine, Prompt | None]:
        """Move the reply to handover.model_id: release the old model first (the planner may need its
        room), load the new one, and give it the reply. A model that cannot load leaves the reply where it
        was (and is not tried again for this job)."""
        old_name = f"{old.model_id}/{old.variant}"
        self.pool.release(old.model_id, job.request.keep_alive_s)
        try:
            engine = self.pool.acquire(
                handover.model_id,
                handover.variant,
                self.load_limits(Target(handover.model_id, handover.variant, "handover")),
            )
        except SimmerError as err:
            log.warning(
                "%s: cannot move to %s (%s); the reply stays on %s", job.id, handover.model_id, err, old_name
            )
            blocked.add(handover.model_id)
            engine = self.pool.acquire(old.model_id)
            return engine, None if engine.tokenizer_key == handover.tokenizer_key else continuation(
                engine, job, handover, old
            )
        self.relieve_memory(engine)
        self.shed_above_rung()  # the model the reply left, idle now, is above the rung: its memory goes
        target = self.placed(job, self.governed, blocked)
        if target.model_id != engine.model_id:  # moved on again meanwhile: the next step hands over again
            target = Target(engine.model_id, handover.variant, "handover")
        self.sync_limits(engine, target)
        same = engine.tokenizer_key == handover.tokenizer_key
        prompt = None if same else continuation(engine, job, handover, old)
        how = (
            "same tokenizer: the KV cache rebuilt once"
            if same
            else "another tokenizer: the text so far re-tokenized"
        )
        if self._stood_in.get(job.cancel) == engine.model_id:
            del self._stood_in[job.cancel]
            why = f"{engine.model_id} is loaded ({old.model_id} stood in while it loaded)"
        else:
            why = f"the governor's rung ({describe(self.governed) if self.governed else 'no limits'})"
        reason = f"{why}; {how}"
        log.info("%s: %s -> %s/%s: %s", job.id, old_name, engine.model_id, engine.variant, reason)
        job.sink(Switched(old_name, engine.model_id, engine.variant, reason, handover.generated))
        return engine, prompt

    # -- memory ------------------------------------------------------------------------------------------
    def rows(self) -> int:
        """Replies a batch may hold now: SIMMER_MAX_BATCH, or fewer while memory is short (pool.rows_cap)."""
        cap = self.pool.rows_cap
        return self.max_batch if cap is None else max(1, min(self.max_batch, cap))

    def relieve_memory(self, engine: Engine) -> None:
        """Under memory pressure, first batches of fewer replies (halved when a job starts a batch, down to
        one at a time: new requests wait in the queue, running rows finish; a job joining a running batch
        changes nothing, the last halving is not in effect yet), then only the model that serves stays
        loaded: the governor's smaller rung frees the room of the bigger ones. Without pressure the rows
        come back, doubling, as far as the memory plan says they fit."""
        rows = self.rows()
        if not self.gate.memory_pressure:
            if rows < self.max_batch and self.pool.rows_fit(more := min(self.max_batch, 2 * rows)):
                self.pool.cap_rows(None if more >= self.max_batch else more, "memory pressure over")
            return
        if rows > 1:
            if self.batch is None:
                self.pool.cap_rows(rows // 2, "memory pressure")
            return
        for model_id, view in self.pool.loaded().items():
            if model_id != engine.model_id and not view.busy:  # a batch's model still serves its rows
                self.pool.unload(model_id, f"memory pressure: {engine.model_id} serves")

    def rung_moved(self) -> bool:
        return self.gate.rung != self._rung_seen

    def shed_above_rung(self) -> None:
        """Unload the idle models above the governor's rung (the rule table over shed_above): the worker
        acts on the governor's decision, as it owns the models."""
        rung = self.gate.rung
        self._rung_seen = rung
        if rung is None:
            return
        governed = replace(self.governed or EngineLimits(), model_id=rung, variant=None)
        wanted = {self.place(job, governed, set()).model_id for job in self._queued()}
        busy = {model_id: view.busy for model_id, view in self.pool.loaded().items()}
        spare = (
            self.keep_warm is not None and not self.gate.memory_pressure and self.pool.spare(self.keep_warm)
        )
        for model_id in shed_above(self.ladder, rung, busy, wanted, spare=spare):
            try:
                self.pool.unload(model_id, f"idle above the governor's rung ({rung})")
            except Exception:  # the worker must go on serving; keep_alive tries again later
                log.exception("unloading %s failed", model_id)


def continuation(engine: Engine, job: Job, handover: Handover, old: Engine) -> Prompt:
    """`engine`'s prompt for the reply `old` started (another tokenizer: the request rendered again). A
    prompt of token ids is the old model's: the new one reads it as the text those ids spell."""
    left = reply_tokens(job) - handover.generated
    reserve = min(max(left, 1), engine.context_length // 2) if job.request.params.truncate else 1
    request = job.request.payload
    if isinstance(request, tuple):
        request = b"".join(old.token_bytes(t) for t in request).decode("utf-8", "replace")
    return engine.continuation_prompt(
        request, handover.text, truncate=job.request.params.truncate, reserve=reserve
    )


def requested_model(default: str | None) -> Placer:
    """Without a ladder: the model the job asked for, on the governor's variant when that is its rung."""

    def place(job: Job, governed: EngineLimits | None, blocked: set[str]) -> Target:
        model = job.request.model or default or ""
        same = governed is not None and governed.model_id in (None, model)
        return Target(model, governed.variant if same and governed else None, "requested")

    return place


def describe(limits: EngineLimits) -> str:
    """`threads=1 variant=q4-a8 ...`: the limits that are set, for one log line."""
    fields = {k: v for k, v in vars(limits).items() if v is not None}
    return " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in fields.items()) or "none"
