"""Stop sequences matched on the streamed text, across token boundaries.

Text that could still grow into a stop is held back until it is known not to be one; the stop text
itself (and anything after it) is never emitted. Generation stops at the first complete match.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        # An empty stop string would match before any text: ignored, as it cannot mean anything.
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns (text safe to emit now, whether a stop was hit)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        # The earliest complete match wins: the model would have stopped right there.
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self._held = ""
            self.stopped = True
            self.matched = best[1]
            return buf[: best[0]], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that is the beginning of some stop (shorter than it)."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back text, at the end of generation (it turned out not to be a stop)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
