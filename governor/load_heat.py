"""How much one model's load heats the device, measured at every load and kept per device.

A load is seconds of full CPU that no pace governs: the governor counts its heat before it moves to a rung
that must load (limits.choose_rung). On a simulated phone in a heatwave the load of the biggest model alone
took the device from ambient past the temperature at which it kills the app; with the heat of that load
known, the next start begins on a model whose load the device can take.

As JSON, {device: {model: degrees C}} (the server keeps it in SIMMER_HOME/load_heat.json). The device key
names the sensor, and for a simulated device its profile and time scale: the same load heats a device with
a tenth of the heat capacity ten times as much. Knowledge only: what cannot be read is measured again.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("simmer.governor")

# A load's time varies with what else the machine does (the same 1.5B load took 2.4 to 5.9 s here, and
# heated the simulated heatwave phone by 6.3 to 11.6 C). The kept value decides whether a load is safe, so
# it follows a hotter measurement at once and a cooler one slowly.
FALL = 0.25  # weight of a cooler measurement against the kept one


class LoadHeat:
    def __init__(
        self,
        text: str | None = None,
        save: Callable[[str], None] | None = None,
        reread: Callable[[], str | None] | None = None,
    ) -> None:
        """`text`: what was kept (JSON; None or unreadable: nothing); `save(text)`: keeps the new state after
        each measurement (None: this process only). A save that fails is logged, never raised. `reread()`:
        what is kept now, read again before each measurement is combined and saved, so that another server
        keeping the same file (one SIMMER_HOME) loses none of its measurements to this one's save: the
        file's values replace this process's, and the new measurement combines with them."""
        self._lock = threading.Lock()
        self._data = parse(text)
        self._save = save
        self._reread = reread

    def rises(self, device: str) -> dict[str, float]:
        """model -> degrees C its load heated `device` by, as measured so far."""
        with self._lock:
            return dict(self._data.get(device, {}))

    def record(self, device: str, model: str, rise_c: float) -> None:
        if not math.isfinite(rise_c):
            return
        rise_c = max(0.0, rise_c)
        with self._lock:
            if self._reread is not None:
                for other_device, models in parse(self._reread()).items():
                    self._data.setdefault(other_device, {}).update(models)
            kept = self._data.setdefault(device, {})
            old = kept.get(model)
            kept[model] = now = round(
                rise_c if old is None or rise_c > old else old + FALL * (rise_c - old), 3
            )
            text = json.dumps(self._data, indent=1, sort_keys=True)
        log.info("the load of %s heated %s by %.1f C (kept: %.1f C)", model, device, rise_c, now)
        if self._save is None:
            return
        try:
            self._save(text)
        except OSError as err:
            log.warning("the load heat could not be kept (%s); it is measured again after a restart", err)


# A model whose load was never measured on a device is not blind if another's was: a load's CPU time goes
# with the bytes it reads and packs, and so, for loads short against the device's time constant, its heat.
#
#   measured on this device                    -> that
#   not measured, some model with bytes was    -> its bytes x the most any measured model heated it per byte
#                                                 (the dearest per byte: erring hot only delays a load)
#   nothing measured here, or no bytes known   -> absent (choose_rung counts it as no heat: blind)
# Measured on one machine (heatwave phone at time scale 10, Qwen2.5-Coder's fast variants): the 1.5B's load
# 11.5 C for 1.53 GB; the 0.5B's 6.4 C for 0.70 GB, which the 1.5B's would have put at 5.3 C; SmolLM2's
# 0.6 C for 0.15 GB (prior 1.1 C). Another run: 18.3 C and 8.0 C (prior 8.4 C).
def with_priors(measured: Mapping[str, float], sizes: Mapping[str, int]) -> dict[str, float]:
    per_byte = max((c / sizes[m] for m, c in measured.items() if sizes.get(m, 0) > 0), default=None)
    out = dict(measured)
    if per_byte is not None:
        out.update({m: per_byte * b for m, b in sizes.items() if m not in out and b > 0})
    return out


def parse(text: str | None) -> dict[str, dict[str, float]]:
    """The kept JSON, checked: a device maps models to finite degrees >= 0 (the rest is dropped)."""
    try:
        raw = json.loads(text) if text else {}
    except (ValueError, RecursionError):  # RecursionError: nested too deep to be what this module wrote
        log.warning("the kept load heat is not JSON; measuring again")
        return {}
    out: dict[str, dict[str, float]] = {}
    for device, models in raw.items() if isinstance(raw, dict) else ():
        if not isinstance(models, dict):
            continue
        kept = {
            str(m): float(c)
            for m, c in models.items()
            if isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) and c >= 0
        }
        if kept:
            out[str(device)] = kept
    return out
