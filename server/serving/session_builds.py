"""Sessions for a loaded model's new limits, built beside the worker (a loader thread of their own).

The governor's limits change threads, spinning or the variant; each is another onnxruntime session, and
building one packs every weight again (2.4 s for a 1.5B model). Applied at once, the reply they come to
waited that long for its next token. Here the worker asks first: limits whose session exists (or that build
none) apply now; otherwise the session is built on this module's thread while the reply goes on with the
limits it has, and the limits apply at the first token boundary after it is done. One build at a time; a
build the memory budget has no room for beside the running session is not started: those limits apply at
once and build inside the reply, as before (`inside` counts them for /v1/thermal).

Worker thread only, except the build itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from models.protocol import Engine, EngineLimits
from server.serving.loader import Loader

log = logging.getLogger("simmer.server")


class SessionBuilds:
    def __init__(self, wake: Callable[[], None], room: Callable[[Engine, EngineLimits], bool]) -> None:
        self._loader: Loader[None] = Loader(wake)
        self._room = room  # whether memory holds the new session beside the running one
        self._building: str | None = None  # the key of the build under way
        self._failed: set[str] = set()  # builds that raised: those limits apply inside the reply
        self.beside = 0  # sessions built here
        self.inside = 0  # limits applied with a session built inside a reply (no room beside it)

    def ready(self, engine: Engine, limits: EngineLimits) -> bool:
        """Whether `limits` may apply to `engine` now without a running reply waiting for a session build:
        True when they build none, their session was built here, or it cannot be (no room, or it failed:
        built inside the reply, as before). False while it is being built here (started now if none is)."""
        self._take_done()
        build = engine.session_build(limits)
        if build is None:
            return True
        key = f"{id(engine)}:{limits.variant}:{limits.threads}:{limits.spin}"
        if key in self._failed:
            self._failed.discard(key)
            return True
        if self._building is not None:
            return False  # this one's turn comes after the build under way
        if not self._room(engine, limits):
            self.inside += 1
            log.info(
                "%s: no room to build a session beside the running one: built inside the reply",
                engine.model_id,
            )
            return True
        self._building = key
        self.beside += 1
        self._loader.start(key, build)
        return False

    def waiting(self) -> bool:
        """A build is under way or done and not yet seen: limits wait for it."""
        return self._building is not None

    def _take_done(self) -> None:
        for key, result in self._loader.take_done():
            if isinstance(result, BaseException):
                self._failed.add(key)
            if key == self._building:
                self._building = None

    def counts(self) -> dict[str, int | bool]:
        """For /v1/thermal: sessions built beside the worker, inside replies, and whether one builds now."""
        return {"beside": self.beside, "inside": self.inside, "building": self._building is not None}

    def close(self) -> None:
        self._loader.close()
