"""Settings -> the Governor and its Gate. The ladder and the start rung are inputs (serving/ladder.py builds
them from the catalog before anything loads): the governor decides on them, nothing writes them later."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from governor.cgroup import usable_cpus
from governor.governor import Governor
from governor.limits import Rung
from governor.load_heat import LoadHeat
from governor.policy import PolicyConfig
from governor.power import battery_reader
from governor.sensors import ThermalSource, make_thermal_source, read_memory
from models.errors import InvalidParameter
from models.store.durable import replace_text
from server.serving.governor_gate import GovernorGate
from server.settings import Settings

log = logging.getLogger("simmer.governor")
LOAD_HEAT_FILE = "load_heat.json"
MAX_LOAD_HEAT_BYTES = 1 << 20  # a few hundred bytes per device; more is a damaged or foreign file


def build_governor(
    settings: Settings,
    *,
    thermal: ThermalSource | None = None,
    ladder: Sequence[Rung] = (),
    start_rung: int = 0,
) -> Governor:
    """The Governor for these settings. `thermal` replaces settings.thermal_source (tests script one)."""
    cpus = usable_cpus(settings.cgroup_root, settings.proc_root)
    threads = max(1, min(settings.threads or cpus, cpus))
    if thermal is None:
        thermal = make_thermal_source(
            settings.thermal_source,
            sysfs_root=settings.sysfs_root,
            sensor_name=settings.thermal_sensor,
            sim_time_scale=settings.sim_time_scale,
            max_cores=cpus,
        )
    config = PolicyConfig(
        memory_budget_bytes=_mb(settings.memory_budget_mb),
        background_action=settings.background_action,  # type: ignore[arg-type]
        pace_control=settings.pace_control,
        lifecycle_ttl_s=settings.lifecycle_ttl_s,
        background_work=settings.background_work,
        background_min_battery_percent=settings.background_min_battery_percent,
    )
    return Governor(
        thermal=thermal,
        read_memory=lambda: read_memory(settings.cgroup_root, settings.proc_root),
        read_battery=battery_reader(settings.sysfs_root),
        config=config,
        usable_cpus=threads,
        ladder=ladder,
        start_rung=start_rung,
        poll_s=settings.governor_poll_s,
        enforce=settings.governor,
        load_heat=kept_load_heat(settings.home / LOAD_HEAT_FILE),
    )


def kept_load_heat(path: Path) -> LoadHeat:
    """What model loads heated this device by, kept in SIMMER_HOME across restarts (and read again before
    each save: two servers may share a home)."""

    def read() -> str | None:
        try:
            if path.stat().st_size > MAX_LOAD_HEAT_BYTES:
                log.warning(
                    "%s is over %d bytes: not ours; load heat is measured again", path, MAX_LOAD_HEAT_BYTES
                )
                return None
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            log.warning("%s unreadable (%s): load heat is measured again", path, err)
            return None

    def save(new: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, new)

    return LoadHeat(read(), save, read)


def _mb(value: int | None) -> int | None:
    return None if value is None else value << 20


def build_gate(
    settings: Settings,
    *,
    thermal: ThermalSource | None = None,
    ladder: Sequence[Rung] = (),
    start_rung: int = 0,
) -> GovernorGate:
    """The gate for `simmer serve`: the governor from settings, observe-only when settings.governor is False
    (the device still throttles and kills: that is what an ungoverned app suffers)."""
    try:
        governor = build_governor(settings, thermal=thermal, ladder=ladder, start_rung=start_rung)
    except ValueError as err:  # an unknown thermal source or profile, background_action: configuration
        raise InvalidParameter(str(err), param="thermal_source") from err
    return GovernorGate(governor, pause_timeout_s=settings.pause_timeout_s, spin=settings.spin)
