"""Logging setup (plain or JSON lines) and the one line logged per completion request (numbers only: never
any prompt or completion text)."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass

log = logging.getLogger("simmer.request")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not when the handler was made: a
    worker thread that logs after stderr was swapped (tests, daemonizers) must not hit a closed file."""

    @property  # type: ignore[override]
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # type: ignore[no-untyped-def]
        pass


def setup_logging(level: str = "info", *, json_lines: bool = False) -> None:
    """Configure the root logger once, at the edge (serve)."""
    handler = StderrHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Libraries whose debug lines carry request or reply text (sse-starlette logs every chunk): logs hold
    # numbers, never what people wrote or read, even at debug level.
    for name in TEXT_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))


TEXT_LOGGERS = ("sse_starlette",)


@dataclass
class RequestRecord:
    id: str
    endpoint: str
    model: str
    variant: str | None
    stream: bool
    prompt_tokens: int
    completion_tokens: int  # produced by the engine (what /metrics counts)
    sent_tokens: int  # of those, sent to the client (fewer when it left or the request was cut)
    ttft_ms: float
    tokens_per_s: float
    outcome: str  # finish_reason, an error code (server_shutting_down ...), or "client_gone"
    duration_ms: float
    route: str | None = None  # "upstream/thermal", "local/offline_first" (server/routing/)


def log_request(record: RequestRecord) -> None:
    text = (
        f"{record.id} {record.endpoint} model={record.model} variant={record.variant} "
        f"stream={record.stream} prompt={record.prompt_tokens} completion={record.completion_tokens} "
        f"sent={record.sent_tokens} "
        f"ttft_ms={record.ttft_ms:.1f} tok_s={record.tokens_per_s:.1f} outcome={record.outcome} "
        f"duration_ms={record.duration_ms:.0f}"
    )
    if record.route:
        text += f" route={record.route}"
    log.info(text, extra={"fields": asdict(record)})


@dataclass
class EmbeddingRecord:
    id: str
    endpoint: str  # the route's path: /v1/embeddings, /api/embed, /api/embeddings, /embedding(s)
    model: str
    inputs: int
    tokens: int  # the inputs' tokens the encoder ran (0 when it never ran)
    outcome: str  # "ok", an error code (server_busy ...), or "client_gone"
    duration_ms: float
    route: str | None = None  # where it was served, as a completion's: "upstream/model", "local/policy"


def log_embedding(record: EmbeddingRecord) -> None:
    """One line per embedding request, as per completion: numbers only, never the texts. `tokens` is the
    upstream's count for an answer it gave (0 when it reports none)."""
    text = (
        f"{record.id} embeddings {record.endpoint} model={record.model} inputs={record.inputs} "
        f"tokens={record.tokens} outcome={record.outcome} duration_ms={record.duration_ms:.0f}"
    )
    if record.route:
        text += f" route={record.route}"
    log.info(text, extra={"fields": asdict(record)})
