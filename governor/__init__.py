"""The thermal and memory governor: sensors -> policy (pure) -> Limits, polled in its own thread.

It imports no onnxruntime and nothing from server/ or models/: it publishes limits, the worker
applies them.
"""

from governor.governor import Governor, Snapshot
from governor.limits import Limits, NoRungFits, Rung, build_ladder, pick_rung, rungs_from_manifest
from governor.policy import GovernorState, PolicyConfig, Readings, decide
from governor.sensors import make_thermal_source, read_battery, read_memory, usable_cpus

__all__ = [
    "Governor",
    "GovernorState",
    "Limits",
    "NoRungFits",
    "PolicyConfig",
    "Readings",
    "Rung",
    "Snapshot",
    "build_ladder",
    "decide",
    "make_thermal_source",
    "pick_rung",
    "read_battery",
    "read_memory",
    "rungs_from_manifest",
    "usable_cpus",
]
