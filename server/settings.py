"""The one Settings object (environment prefix SIMMER_). Built once at the edge and passed down.

Everything below `server/` receives plain values or small config objects, never reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.store.hub import HubConfig


def default_home() -> Path:
    return Path.home() / ".cache" / "simmer"


class Settings(BaseSettings):
    # hide_input_in_errors: a settings error must not print a secret (a key, a token, a URL with credentials).
    model_config = SettingsConfigDict(
        env_prefix="SIMMER_", extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    # model store
    home: Path = Field(default_factory=default_home, description="Cache folder for models")
    model: str = Field("smollm2-135m-instruct", description="Model id to serve")
    variant: str | None = Field(
        None,
        description="Variant each model opens on when it has it (default: the manifest's, chosen at pull "
        "time from what was measured there)",
    )
    ladder: str | None = Field(
        None,
        description="Models the governor steps down through, best first: id or id:variant, comma-separated "
        "(default: the served model's variants)",
    )
    # The Hugging Face Hub (hf: models). Hugging Face's own variable names work too.
    hf_endpoint: str = Field(
        "https://huggingface.co",
        validation_alias=AliasChoices("SIMMER_HF_ENDPOINT", "HF_ENDPOINT", "hf_endpoint"),
        description="Hugging Face Hub URL for hf: models (or HF_ENDPOINT)",
    )
    hf_token: str | None = Field(
        None,
        validation_alias=AliasChoices("SIMMER_HF_TOKEN", "HF_TOKEN", "hf_token"),
        description="Hub token for gated/private repos (or HF_TOKEN; default: huggingface-cli login's)",
    )
    pull_dirs: list[Path] = Field(
        default_factory=list,
        description="Folders whose GGUF files and model folders a client may install with /api/pull "
        "(JSON list; a local path anywhere else: only `simmer pull` on the machine)",
    )
    hf_offline: bool = Field(
        False,
        validation_alias=AliasChoices("SIMMER_HF_OFFLINE", "HF_HUB_OFFLINE", "hf_offline"),
        description="Never contact the Hub; use downloaded files only (or HF_HUB_OFFLINE)",
    )

    # engine
    threads: int | None = Field(None, description="Inference threads (default and cap: the CPUs we may use)")
    context_length: int = Field(2048, description="Context cap in tokens (KV buffer size)")
    prefill_chunk: int = Field(256, ge=1, description="Prompt tokens per prefill chunk")
    spin: str = Field("auto", description="Thread-pool spinning: auto (while unpaced) | on | off")
    speculation: Literal["auto", "off"] = Field(
        "auto",
        description="Prompt-lookup speculative decoding (greedy and seeded replies unchanged): auto "
        "(where the variant's verification pass is exact) | off",
    )
    max_batch: int = Field(
        4,
        ge=1,
        le=64,
        description="Replies of one model decoded together, one token each per forward pass (each holds a "
        "KV buffer of the whole context); 1: one reply at a time",
    )
    batch: Literal["exact", "fast"] = Field(
        "exact",
        description="exact: replies decode together only where this CPU gives a row of a batch the logits "
        "it gets alone, and take turns elsewhere (a reply's text never depends on its neighbours); fast: "
        "batch on every CPU (faster where rows differ, but a reply's text may then depend on the replies "
        "beside it; each reply says so in its X-Simmer-Batch header)",
    )
    prefix_cache_slots: int = Field(1, description="KV slots kept for prefix reuse (conversations cached)")
    prefix_cache_mb: int = Field(256, description="Memory budget for prefix-reuse KV slots")
    kv_prefault: bool = Field(
        True,
        description="Write a KV buffer's pages when it is allocated, as llama.cpp does: RSS is the memory "
        "plan from the first request on (false: pages come in as the context first grows)",
    )
    keep_alive_s: float = Field(
        300.0,
        description="Seconds an idle model stays loaded (0 = unload after each reply, negative = keep); "
        "a request's keep_alive overrides it",
    )
    cold_start: Literal["stand_in", "wait"] = Field(
        "stand_in",
        description="A request whose model is still loading: stand_in starts the reply on a loaded smaller "
        "model of the ladder and hands it over once the model is loaded (at start that smaller model loads "
        "first); wait: it waits for the load (a request's wait_for_model: true waits too)",
    )
    window_reply_contexts: int = Field(
        1,
        ge=1,
        description="A reply under the sliding window (truncate) stops (finish_reason length) after this "
        "many contexts' worth of tokens, whatever max_tokens asks (Ollama's bound is 10)",
    )
    summary: bool = Field(
        True,
        description="When the chat window drops turns, the smallest loaded chat model of the ladder "
        "summarizes them while idle and later requests carry the summary (false: the plain window)",
    )
    chat_template: Path | None = Field(
        None, description="Jinja chat template file used instead of the model's (gives a base model chat)"
    )

    # sampling, for requests that leave a field out (llama.cpp's server defaults, not OpenAI's)
    temperature: float = Field(0.8, ge=0.0, le=2.0, description="Default sampling temperature")
    top_k: int = Field(40, ge=0, description="Default top_k (0 = off)")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Default top_p (1 = off)")
    min_p: float = Field(0.05, ge=0.0, le=1.0, description="Default min_p (0 = off)")

    # HTTP server
    host: str = Field("127.0.0.1", description="Bind address")
    port: int = Field(8000, description="Bind port")
    api_key: str | None = Field(None, description="Bearer key; required when binding a non-loopback address")
    allowed_hosts: list[str] = Field(default_factory=list, description="Extra Host header names accepted")
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS")
    max_queue: int = Field(16, description="Requests waiting for the worker before 503")
    max_body_bytes: int = Field(1_000_000, description="Largest request body")
    max_connections: int | None = Field(
        None,
        ge=1,
        description="Open connections at most; beyond, the one waiting longest for its request goes "
        "(default: the open-file limit less a reserve)",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a connection has to send a complete request head"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a request has to send its whole body once its head is in"
    )
    stream_interval_ms: int = Field(50, description="SSE coalescing interval")
    keepalive_ping_s: float = Field(5.0, description="SSE ping interval while queued")
    log_json: bool = Field(False, description="One JSON object per log line")
    log_level: str = Field("info", description="Log level")

    # governor
    thermal_source: str = Field("auto", description="auto | psutil | sysfs | file:PATH | sim:PROFILE | none")
    thermal_sensor: str | None = Field(None, description="psutil sensor name or label to govern on")
    sysfs_root: Path = Field(Path("/sys"), description="Root of sysfs (tests point it at a fixture tree)")
    cgroup_root: Path = Field(Path("/sys/fs/cgroup"), description="Root of the cgroup filesystem")
    proc_root: Path = Field(Path("/proc"), description="Root of procfs")
    sim_time_scale: float = Field(1.0, description="Simulated seconds per wall second (sim: sources)")
    governor: bool = Field(True, description="Apply governor limits (False: observe only)")
    governor_poll_s: float = Field(1.0, description="Governor polling interval (wall seconds)")
    background_action: str = Field("pause", description="pause | low_priority: what 'background' does")
    background_work: Literal["auto", "always"] = Field(
        "auto",
        description="auto: a pull's conversion (over /api/pull) and chat summaries wait while the device is "
        "on battery below background_min_battery_percent, not nominal, or the app is in the background; "
        "always: they run at once",
    )
    background_min_battery_percent: float = Field(
        50.0, ge=0.0, le=100.0, description="On battery below this, heavy background work waits for a charger"
    )
    pace_control: bool = Field(
        True, description="Hold the thermal envelope by pace (false: the level table, pausing at throttle)"
    )
    # 30 s: a page renews every 10 s (three tries before it lapses, and hidden tabs still run a timer about
    # once a second), while a client that reported background and vanished pauses the server for 30 s at most.
    lifecycle_ttl_s: float = Field(
        30.0, gt=0, le=86400, description="A background report lapses after this many seconds unless renewed"
    )
    memory_budget_mb: int | None = Field(None, description="Memory budget (default: the cgroup/system limit)")
    memory_reserve_mb: int = Field(
        128, ge=0, description="Memory left to the rest of the device when no budget is set"
    )
    pause_timeout_s: float = Field(60.0, description="How long queued requests wait out a pause before 503")

    # routing (docs/routing.md). Nothing leaves the device unless route is auto or upstream.
    route: Literal["local", "auto", "upstream"] = Field(
        "local",
        description="local (nothing leaves the device) | auto (offload when the device can't) | upstream",
    )
    upstream_url: str | None = Field(
        None,
        validate_default=True,
        description="OpenAI-compatible base URL to offload to, e.g. http://gpu:8000/v1",
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="Bearer key for the upstream (never logged or echoed)"
    )
    upstream_models: dict[str, str] = Field(
        default_factory=dict,
        description='JSON {"model id": "upstream name"}; ids not served locally are listed as remote',
    )
    upstream_ca_bundle: Path | None = Field(
        None, description="PEM CA bundle for the upstream's TLS (default: certifi)"
    )
    upstream_connect_timeout_s: float = Field(3.0, gt=0, description="Upstream connect timeout")
    upstream_read_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Upstream time without a token (silence, pings, a byte at a time) before failing",
    )
    upstream_reply_timeout_s: float = Field(
        600.0, gt=0, description="Longest an upstream reply may take, first byte to last, before failing"
    )
    upstream_max_connections: int = Field(16, ge=1, description="Pooled connections to the upstream")
    # auto under the pace controller (docs/routing.md): offload new work while heat slows the device
    route_min_local_tok_s: float = Field(
        5.0,
        ge=0,
        description="auto: send new work upstream while heat holds the local pace under this many tokens/s "
        "(about reading speed; home at 1.5x; 0: off)",
    )
    route_max_local_wait_s: float = Field(
        10.0,
        ge=0,
        description="auto: send new work upstream while heat paces the device and the work ahead of it "
        "would take longer than this at that pace (0: off)",
    )
    upstream_breaker_failures: int = Field(
        3, ge=1, description="Consecutive upstream failures that open the breaker"
    )
    upstream_breaker_cooldown_s: float = Field(
        30.0, gt=0, description="How long an open breaker keeps work local"
    )

    # A field validator (not a model validator): the check belongs to the URL, and errors name that field.
    @field_validator("upstream_url")
    @classmethod
    def _upstream_url(cls, url: str | None, info: ValidationInfo) -> str | None:
        if url is None:
            route = info.data.get("route", "local")
            if route != "local":
                raise ValueError(f"route={route} needs SIMMER_UPSTREAM_URL")
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username or parts.password:
            # HTTP clients log URLs and /v1/thermal shows it: a key must not travel inside one.
            raise ValueError("must not contain credentials: use SIMMER_UPSTREAM_API_KEY")
        return url

    @field_validator("upstream_models")
    @classmethod
    def _upstream_models(cls, models: dict[str, str]) -> dict[str, str]:
        if any(not k.strip() or not v.strip() for k, v in models.items()):
            raise ValueError("model ids and upstream names must not be empty")
        return models


def settings_table() -> str:
    """The README's settings table, generated so it cannot drift from this class."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory else field.default
        shown = "unset" if default is None else f"`{default}`"
        if name == "home":
            shown = "`~/.cache/simmer`"
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `SIMMER_{name.upper()}` | {shown} | {meaning} |")
    return "\n".join(rows)


def hub_config(settings: Settings) -> HubConfig:
    """Where the model store downloads from (SIMMER_HF_*)."""
    return HubConfig(endpoint=settings.hf_endpoint, token=settings.hf_token, offline=settings.hf_offline)


if __name__ == "__main__":
    print(settings_table())
