"""Several replies at once over HTTP (SIMMER_MAX_BATCH): real openai SDK streams against a live server on the
tiny real model. Equality is between two paths of the same engine: streams run together, the same requests
one after another, and (where one row sums as a batch's rows do) the one-reply engine of SIMMER_MAX_BATCH=1;
text and logprobs token for token.

What the server does depends on what this CPU's kernels do with a batch (models/runtime/batch.py
batch_traits, measured at load). The tests of the batch path let a lone reply decode padded to two rows
(`padded`: DecoderEngine.pad_batches) so that it runs on every CPU where a batch's rows are alike; where they
are not, the server's replies take turns (test_turns_serving.py) and those tests skip, saying so. What
the server does by default on this CPU: the test_batch_when_served_by_default_... test."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from governor.governor import Governor
from governor.limits import make_table
from models.protocol import EngineLimits
from models.runtime.batch import BatchDecoder, batch_traits
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.turns import TurnDecoder
from models.types import CancelToken
from server.serving.contracts import Gate
from server.serving.governor_gate import GovernorGate
from tests.helpers import sdk
from tests.server.fakes import HoldGate, PaceGate
from tests.server.serving.helpers import reference
from tests.server.serving.helpers import stream as multi_stream

PROMPTS = ["the cat sat on the mat", "once upon a time", "what is the capital", "def fib(n):"]
# two greedy replies, two seeded ones
SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0, "frequency_penalty": 0.5},
    {"temperature": 1.2, "top_p": 0.9, "seed": 9},
]


@pytest.fixture
def passes(monkeypatch) -> list[int]:
    """How many replies each decode pass of any batch decoder fed."""
    seen: list[int] = []
    step = BatchDecoder.step

    def counted(self: BatchDecoder):
        events = step(self)
        if self.last_pass is not None and events:
            seen.append(self.last_pass.replies)
        return events

    monkeypatch.setattr(BatchDecoder, "step", counted)
    return seen


def engine(folder, variant: str) -> DecoderEngine:
    return load_engine(folder, variant=variant, threads=1, context_length=128, speculation="off")


@pytest.fixture
def padded(monkeypatch) -> None:
    """Every engine batches where its rows are alike: a reply alone decodes padded to two rows where this
    CPU's kernels sum one row otherwise (q4; q4-a8 on AVX2), as it does beside others."""
    monkeypatch.setattr(DecoderEngine, "pad_batches", True)


def alike_or_skip(e: DecoderEngine) -> DecoderEngine:
    """`e`, where a batch's rows get the logits they get alone; elsewhere the server's replies take turns
    (asserted; tests/server/serving/test_turns_serving.py), and the test skips, saying why."""
    why = batch_traits(e.session()).why_alone(pad=True)
    if why is not None:
        assert isinstance(e.batch_decoder(4), TurnDecoder)
        pytest.skip(f"{e.model_id} {e.variant}: {why}; its replies take turns")
    return e


def serve(live, folder, variant: str, max_batch: int, gate: Gate | None = None):
    e = alike_or_skip(engine(folder, variant))
    return live(engine=e, model=e.model_id, max_batch=max_batch, governor=gate), e


SALTS = iter(range(1 << 30))


def stream(srv, i: int, max_tokens: int = 24, after: Callable[[int], bool] | None = None) -> list:
    """Request i streamed: [(text, logprob, top logprobs)] per token; `after(n)` False closes the stream
    after n chunks (the client leaves). Each request its own cache scope: a prompt is prefilled whole
    every time (the same text either way: tests/models/runtime/test_prefix_exact.py; here the usage is
    too)."""
    chunks = sdk(srv).chat.completions.create(
        model=srv.settings.model,
        messages=[{"role": "user", "content": PROMPTS[i]}],
        max_tokens=max_tokens,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "cache_salt": f"request-{next(SALTS)}"},
        **SAMPLING[i],
    )
    out = []
    for n, chunk in enumerate(chunks):
        if after is not None and not after(n):
            chunks.close()
            break
        for choice in chunk.choices:
            for lp in (choice.logprobs and choice.logprobs.content) or []:
                out.append((lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]))
    return out


def together(
    srv,
    gate: HoldGate,
    indices: list[int],
    others: list[Callable[[], object]] = (),
    **kw,  # type: ignore[assignment]
) -> dict[int, list]:
    """Requests `indices` (and the callables `others`) at once: the first is held until every other one
    is queued behind it."""
    gate.release.clear()
    gate.holding.clear()
    out: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(srv, i, **kw))) for i in indices]
    threads += [threading.Thread(target=other) for other in others]
    for t in threads:
        t.start()
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 30
    while not (gate.holding.is_set() and worker.queue_depth == len(threads) - 1):
        assert time.monotonic() < deadline, (gate.holding.is_set(), worker.queue_depth)
        time.sleep(0.01)
    gate.release.set()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("variant", ["q4-a8", "q4"])
def test_batch_when_four_sdk_streams_at_once_then_the_same_as_one_after_another(
    live, tiny_model_dir, passes, padded, variant
):
    gate = HoldGate()
    srv, e = serve(live, tiny_model_dir, variant, 4, gate)
    alone = {i: stream(srv, i) for i in range(4)}
    assert max(passes) == 1
    passes.clear()
    at_once = together(srv, gate, list(range(4)))
    assert max(passes) == 4  # they did decode together
    for i in range(4):
        assert len(at_once[i]) == 24
        assert at_once[i] == alone[i], i
    if batch_traits(e.session()).one_row_exact:  # one row sums as a batch's rows do (q4-a8 on AVX-512):
        one, _ = serve(live, tiny_model_dir, variant, 1)  # the one-reply engine gives the same
        passes.clear()
        assert {i: stream(one, i) for i in range(4)} == alone
        assert passes == []  # SIMMER_MAX_BATCH=1: no batch decoder ran


@pytest.mark.parametrize("variant", ["q4-a8", "q4"])
def test_batch_when_served_by_default_then_batched_only_where_a_lone_row_is_exact(
    live, tiny_model_dir, passes, variant
):
    """By default replies decode together only where batching costs a lone reply nothing: where this CPU's
    kernels give a batch's rows the logits they get alone and one row the same sums as a batch's rows
    (measured at load: q4-a8 on AVX-512 VNNI). Elsewhere (q4's fp32 kernels; any variant on AVX2) a lone
    reply would decode padded at about twice the cost, or rows would change each other's text: the replies
    take turns, each in one-row passes of its own (models/runtime/turns.py). The same text either way."""
    gate = HoldGate()
    e = engine(tiny_model_dir, variant)
    traits = batch_traits(e.session())
    srv = live(engine=e, model=e.model_id, max_batch=4, governor=gate)
    alone = {i: stream(srv, i) for i in range(4)}
    passes.clear()
    at_once = together(srv, gate, list(range(4)))
    assert at_once == alone
    if traits.rows_alike and traits.one_row_exact:
        assert max(passes) == 4
    else:
        assert passes == []  # no batch pass ran: the replies took turns
        assert isinstance(e._batch, TurnDecoder)


def test_batch_when_a_client_leaves_mid_batch_then_its_row_ends_and_the_others_are_unchanged(
    live, tiny_model_dir, passes, padded
):
    gate = HoldGate()
    # the tiny model is too fast to leave mid-reply: paced as the governor's gate paces a batch
    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4, PaceGate(200, gate))
    alone = {i: stream(srv, i, max_tokens=40) for i in (0, 2)}
    passes.clear()
    left: dict[int, list] = {}
    leave = lambda: left.__setitem__(1, stream(srv, 1, 40, after=lambda n: n < 4))  # noqa: E731
    out = together(srv, gate, [0, 2], [leave], max_tokens=40)
    assert out == alone
    assert 0 < len(left[1]) < 40
    assert_row_left(passes)


def assert_row_left(passes: list[int]) -> None:
    """Three rows decoded together, then two (the one whose client left ended mid-reply), then the last."""
    last_three = len(passes) - 1 - passes[::-1].index(3)
    assert passes[last_three + 1 :].count(2) >= 2 and max(passes[last_three + 1 :]) == 2


def hostile_stream(srv, body: bytes) -> None:
    """A raw client that reads the start of a stream and resets the connection (no FIN, no close)."""
    import struct

    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + srv.host_header.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    got = b""
    while got.count(b"data:") < 3:
        got += s.recv(4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_batch_when_a_hostile_client_resets_mid_batch_then_the_others_stream_on_and_health_answers(
    live, tiny_model_dir, passes, padded
):
    gate = HoldGate()
    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4, PaceGate(150, gate))
    alone = {i: stream(srv, i, max_tokens=48) for i in (0, 3)}
    body = (
        b'{"model": "%s", "stream": true, "max_tokens": 100, "ignore_eos": true, '
        b'"messages": [{"role": "user", "content": "go on"}]}' % srv.settings.model.encode()
    )
    health: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for _ in range(5):
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    out = together(srv, gate, [0, 3], [lambda: hostile_stream(srv, body)], max_tokens=48)
    prober.join(30)
    assert out == alone
    assert len(health) == 5 and max(health) < 2.0
    assert_row_left(passes)
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 10
    while worker.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.busy  # the reset client's row is gone too (its 100 tokens were not all made)


class HoldThenSwitchGate(HoldGate):
    """Holds the first job (HoldGate), then after `after` steps moves the governor's rung to `target`."""

    def __init__(self, target: str, after: int) -> None:
        super().__init__()
        self.target, self.after, self.steps = target, after, 0
        self.rung: str | None = None  # type: ignore[assignment]

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        self.steps += 1
        if self.steps == self.after:
            self.rung = self.target
            return EngineLimits(model_id=self.target, variant="f32")
        return None


def test_batch_when_the_rung_moves_mid_batch_then_every_row_goes_on_on_the_other_model(
    several,
    tiny_pair_dirs,
    passes,
    padded,
):
    for folder in tiny_pair_dirs:
        alike_or_skip(engine(folder, "f32"))
    gate = HoldThenSwitchGate("tiny-small", after=12)
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    out: dict[int, tuple] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, multi_stream(srv, "tiny-big", 24)))
        for i in range(3)
    ]
    gate.release.clear()
    for t in threads:
        t.start()
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 30
    while not (gate.holding.is_set() and worker.queue_depth == 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.release.set()
    for t in threads:
        t.join(60)
    assert 3 in passes  # they decoded together on tiny-big, and after the move on tiny-small
    for text, names, switches, usage in out.values():
        n_first = usage["models"]["tiny-big"]
        assert usage["models"] == {"tiny-big": n_first, "tiny-small": 24 - n_first} and 0 < n_first < 24
        assert len(switches) == 1 and names[-1] == "tiny-small"
        assert text == reference(tiny_pair_dirs[0], tiny_pair_dirs[1], n_first, 24, same_tokenizer=True)


def test_bench_concurrency_round_when_clients_stream_at_once_then_every_token_counted(live, tiny_model_dir):
    from bench.concurrency import run_round

    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4)
    round_ = run_round(srv.url, srv.settings.model, clients=3, requests=2, max_tokens=12)
    assert round_["errors"] == [] and round_["requests"] == 6 and round_["tokens"] == 6 * 12
    assert len(round_["itl_p50_ms_per_client"]) == 3 and round_["aggregate_tok_s"] > 0
    assert 0 < round_["ttft_p50_s"] <= round_["ttft_p95_s"]


def test_bench_concurrency_long_short_when_run_then_the_short_reply_is_timed(live, tiny_model_dir):
    from bench.concurrency import run_long_short

    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4)
    got = run_long_short(
        srv.url, srv.settings.model, long_clients=2, long_tokens=24, short_tokens=4, lead_s=0.05
    )
    assert got["errors"] == [] and got["long_tokens"] == 2 * 24
    assert 0 < got["short_ttft_s"] <= got["short_total_s"] <= got["wall_s"]


class HoldThenLimitGate(HoldGate):
    """Holds the first job (HoldGate), then after `after` steps hands out `limits` once."""

    def __init__(self, limits: EngineLimits, after: int) -> None:
        super().__init__()
        self.limits, self.after, self.steps = limits, after, 0

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        self.steps += 1
        return self.limits if self.steps == self.after else None


def test_batch_when_the_governor_switches_variant_mid_batch_then_every_row_goes_on_on_it(
    live, tiny_model_dir, passes, padded, monkeypatch
):
    prefills: list[int] = []  # the rows waiting for a prefill chunk at each chunk
    prefill = BatchDecoder.prefill

    def counted(self: BatchDecoder, slot: int | None = None):
        if self.prefilling:
            prefills.append(len(self.prefilling))
        return prefill(self, slot)

    monkeypatch.setattr(BatchDecoder, "prefill", counted)
    gate = HoldThenLimitGate(EngineLimits(variant="f32"), after=16)
    srv, e = serve(live, tiny_model_dir, "q4-a8", 4, gate)
    gate.limits = EngineLimits(variant="f32", model_id=e.model_id)  # the governor names its rung's model
    # the switch at its step, its session built there: a build beside the worker would land at a step that
    # depends on the machine's load (tests/server/serving/test_session_builds.py tests that path)
    srv.app.state.runtime.worker.placement.builds = None
    out = together(srv, gate, list(range(4)), max_tokens=32)
    assert e.variant == "f32" and gate.steps > 16
    assert all(len(out[i]) == 32 for i in range(4))
    # each prompt a chunk, then every row's context again on the new weights (a chunk each: < 256 tokens)
    assert len(prefills) == 8 and prefills[4] == 4
    switched = passes.index(4)  # the rows decoded together before the switch and again after it
    assert 4 in passes[switched + 8 :]


def test_batch_when_another_model_is_asked_for_then_it_waits_for_the_batch_and_is_served(
    several,
    tiny_pair_dirs,
    passes,
    padded,
):
    for folder in tiny_pair_dirs:
        alike_or_skip(engine(folder, "q4-a8"))
    gate = HoldGate()
    srv, _ = several(governor=gate, variant="q4-a8")
    # both loaded first: a job for a model that must load waits beside the queue instead (its load runs
    # beside the worker; tests/server/serving/test_background_load.py)
    assert multi_stream(srv, "tiny-big", 1)[3]["completion_tokens"] == 1
    out: dict[str, tuple] = {}
    asks = [("big-0", "tiny-big"), ("big-1", "tiny-big"), ("small", "tiny-small"), ("big-2", "tiny-big")]
    threads = []
    gate.release.clear()
    worker = srv.app.state.runtime.worker
    for key, model in asks:  # queued in this order
        threads.append(
            threading.Thread(target=lambda k=key, m=model: out.__setitem__(k, multi_stream(srv, m, 16)))
        )
        threads[-1].start()
        deadline = time.monotonic() + 10
        while worker.queue_depth < len(threads) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    gate.release.set()
    for t in threads:
        t.join(60)
    for key, model in asks:
        _, names, _, usage = out[key]
        assert usage["completion_tokens"] == 16 and set(names) == {model}, key
    # tiny-big's first two decode together; tiny-small's reply waits for them (FIFO), then big-2 follows it
    assert 2 in passes and max(passes) == 2


class MeteredGate(HoldGate):
    """HoldGate that hears, as GovernorGate's meter and pace do, what each step's pass made."""

    def __init__(self) -> None:
        super().__init__()
        self.noted: list[int] = []

    def note_pass(self, tokens: int) -> None:
        self.noted.append(tokens)


def test_batch_when_replies_decode_together_then_the_gate_hears_each_pass_s_tokens(
    live, tiny_model_dir, passes, padded
):
    """The meter keys a pass's cost on the tokens it made (server/serving/cost_meter.py): the worker tells
    the gate the replies of every decode pass, and 0 for a prefill chunk (no token)."""
    gate = MeteredGate()
    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4, gate)
    passes.clear()
    out = together(srv, gate, [0, 1, 2], max_tokens=8)
    assert [len(out[i]) for i in range(3)] == [8, 8, 8]
    assert [n for n in gate.noted if n] == passes and max(passes) == 3
    assert sum(passes) == 3 * 7  # each reply's first token comes from its prefill
    assert gate.noted.count(0) >= 3  # one prefill chunk each, at least


class PressedGate(HoldGate):
    """HoldGate whose governing level comes from memory while `memory_pressure` is set."""

    memory_pressure = True


def test_batch_when_memory_pressure_then_batches_of_fewer_rows_and_the_same_replies(
    live, tiny_model_dir, passes, padded
):
    """Memory pressure halves the rows when a job starts a batch (4 -> 2: the other requests wait in the
    queue for a row; at the next batch 2 -> 1: one at a time, its decoder's rows gone); no reply changes.
    Without pressure the rows come back, doubling at each batch's start."""
    gate = PressedGate()
    gate.memory_pressure = False
    srv, e = serve(live, tiny_model_dir, "q4-a8", 4, gate)
    alone = {i: stream(srv, i) for i in range(4)}
    pool = srv.app.state.runtime.served.pool
    gate.memory_pressure = True
    passes.clear()
    at_once = together(srv, gate, list(range(4)))
    assert max(passes) == 2 and pool.rows_cap == 2  # a batch of two rows, the others joining as rows free
    assert at_once == alone
    batch = e._batch
    assert batch is not None and not isinstance(batch, bool) and batch.slots == 2
    passes.clear()
    single = stream(srv, 1)  # the next batch: one reply at a time, on the one-reply engine
    assert pool.rows_cap == 1 and passes == [] and e._batch is None  # the batch decoder's KV rows went
    if batch_traits(e.session()).one_row_exact:  # a lone row sums as a batch's rows: the same reply
        assert single == alone[1]
    else:  # (AVX2) its one-row passes round otherwise than the padded ones: the one-reply engine's reply
        one, _ = serve(live, tiny_model_dir, "q4-a8", 1)
        assert single == stream(one, 1)
    gate.memory_pressure = False
    stream(srv, 0, max_tokens=2)
    assert pool.rows_cap == 2
    stream(srv, 0, max_tokens=2)
    assert pool.rows_cap is None


class HeldGovernorGate(GovernorGate):
    """The real governor's gate, holding the first job as HoldGate does (`together` queues every request
    behind it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.release.set()
        self.holding = threading.Event()

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        self.holding.set()
        self.release.wait(30)
        return super().before_job(cancel, enqueued_at)


def test_batch_when_the_governor_paces_then_the_gate_alone_holds_the_pace_for_the_whole_batch(
    live, tiny_model_dir, passes, padded
):
    """A pass of n replies makes n tokens, and the governor's gate is the only one that waits for the pace:
    its sleep here only records, and it records the rest of n / pace after every pass but the last, while
    the replies take no more wall time than their work (had the batch loop slept for the pace on its own,
    they would take the pace in wall time)."""
    pace = 5.0
    e = alike_or_skip(engine(tiny_model_dir, "q4-a8"))
    slept: list[float] = []
    governor = Governor(usable_cpus=1, table=make_table({"nominal": {"tokens_per_second": pace}}))
    gate = HeldGovernorGate(governor, sleep=slept.append)
    srv = live(engine=e, model=e.model_id, max_batch=4, governor=gate)
    passes.clear()
    t0 = time.monotonic()
    out = together(srv, gate, [0, 1, 2], max_tokens=12)  # type: ignore[arg-type]
    wall = time.monotonic() - t0
    assert [len(out[i]) for i in range(3)] == [12, 12, 12] and max(passes) == 3
    paced = sum(passes) / pace  # 33 tokens decoded in passes (each reply's first came from its prefill)
    assert paced - passes[-1] / pace - wall <= sum(slept) <= paced
    assert wall < 0.5 * paced  # no other wait: the pace is ~6.6 s of wall time


def test_bench_concurrency_meter_when_replies_decode_together_then_cost_per_token_of_each_batch_size(
    live, tiny_model_dir, passes, padded
):
    """A real governor gate's meter, fed by the worker, shows each batch size's cost on /metrics, and the
    bench reads it (bench/concurrency.py meter_costs): what `simmer bench concurrency` reports."""
    from bench.concurrency import meter_costs
    from governor.limits import build_ladder
    from server.serving.cost_meter import CostMeter

    e = alike_or_skip(engine(tiny_model_dir, "q4-a8"))
    governor = Governor(usable_cpus=1, ladder=build_ladder([(e.model_id, "q4-a8", 0.03, 1.0, 1, 1, 60.0)]))
    gate = HeldGovernorGate(governor, meter=CostMeter(window=32, publish_every=2))
    srv = live(engine=e, model=e.model_id, max_batch=4, governor=gate)
    passes.clear()
    together(srv, gate, [0, 1, 2], max_tokens=12)  # type: ignore[arg-type]
    metrics = httpx.get(srv.url + "/metrics").text
    costs = meter_costs(metrics)
    batched = sorted({c["rows"] for c in costs})
    assert batched and set(batched) <= set(passes) and max(batched) >= 2
    for c in costs:
        assert (c["model"], c["variant"], c["threads"]) == (e.model_id, "q4-a8", "1")
        assert c["cpu_s_per_token"] > 0 and c["tok_s"] > 0 and c["tokens_per_cpu_s"] > 0


@pytest.fixture
def schedule(monkeypatch) -> list[str]:
    """The batch decoder's calls in order: "p" a prefill chunk, "s" a decode pass."""
    seen: list[str] = []
    prefill, step = BatchDecoder.prefill, BatchDecoder.step

    def prefilled(self: BatchDecoder, slot: int | None = None):
        seen.append("p")
        return prefill(self, slot)

    def stepped(self: BatchDecoder):
        seen.append("s")
        return step(self)

    monkeypatch.setattr(BatchDecoder, "prefill", prefilled)
    monkeypatch.setattr(BatchDecoder, "step", stepped)
    return seen


@pytest.mark.parametrize(("stall_s", "first"), [(None, "ppppsss"), (0.0, "pspspsp")])
def test_batch_when_prompts_arrive_together_then_prefilled_first_unless_a_reply_waited_too_long(
    live, tiny_model_dir, schedule, padded, monkeypatch, stall_s, first
):
    """Short prompts that arrive together all get their first token before the running replies' next one
    (the tiny model's prefill takes a millisecond, far below the stall allowed); with no stall allowed a
    prefill chunk alternates with a decode pass, as for a long prompt."""
    import server.serving.batch_loop as batch_loop

    if stall_s is not None:
        monkeypatch.setattr(batch_loop, "PREFILL_STALL_S", stall_s)
    gate = HoldGate()
    srv, _ = serve(live, tiny_model_dir, "q4-a8", 4, gate)
    out = together(srv, gate, list(range(4)), max_tokens=4)
    assert all(len(out[i]) == 4 for i in range(4))
    assert "".join(schedule).startswith(first), schedule
