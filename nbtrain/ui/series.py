"""What keeps a live view cheap: a rate limit for redraws and series of bounded length.

``Series`` keeps at most ``2 * max_points`` points whatever the run's length: when full
it drops every other point and from then on keeps one point in ``stride``, so appending
is O(1) amortised and a redraw never sends more than ``max_points``-ish points per trace.
The newest point is always shown. The full history stays in ``run.history``.
"""

from __future__ import annotations

import time


class Throttle:
    """``ready()`` is true at most once per ``interval`` seconds."""

    def __init__(self, interval: float, clock=time.monotonic):
        if not isinstance(interval, (int, float)) or interval < 0:
            raise ValueError(f"interval={interval!r} must be a number of seconds >= 0.")
        self.interval = float(interval)
        self._clock = clock
        self._last: float | None = None

    def wait_time(self) -> float:
        """Seconds until the next redraw is allowed (0: now)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.interval - self._clock())

    def ready(self) -> bool:
        if self.wait_time() > 0:
            return False
        self._last = self._clock()
        return True


class Series:
    """An (x, y) series that keeps a bounded, evenly thinned sample of what it was given."""

    def __init__(self, max_points: int = 400):
        if not isinstance(max_points, int) or max_points < 2:
            raise ValueError(f"max_points={max_points!r} must be an int >= 2.")
        self.max_points = max_points
        self.x: list[float] = []
        self.y: list[float] = []
        self.stride = 1
        self.count = 0  # points given, kept or not
        self._pending = 0  # points seen since the last one kept
        self._last: tuple[float, float] | None = None
        self.version = 0  # changes whenever the visible data changes

    def append(self, x: float, y: float) -> None:
        self.count += 1
        self._last = (x, y)
        self.version += 1
        self._pending += 1
        if self._pending < self.stride:
            return
        self._pending = 0
        self.x.append(x)
        self.y.append(y)
        if len(self.x) >= 2 * self.max_points:  # an even count: the newest kept point goes
            self.x = self.x[::2]
            self.y = self.y[::2]
            self._pending = self.stride  # points since the newest point still kept
            self.stride *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points plus the newest one, at most ``2 * max_points + 1``."""
        xs, ys = list(self.x), list(self.y)
        if self._last is not None and (not xs or xs[-1] != self._last[0] or self._pending):
            xs.append(self._last[0])
            ys.append(self._last[1])
        return xs, ys

    @property
    def last(self) -> float | None:
        return None if self._last is None else self._last[1]

    def __len__(self) -> int:
        return len(self.points()[0])


def downsample(xs: list[float], ys: list[float], max_points: int) -> tuple[list, list]:
    """At most ``max_points`` evenly spaced points of (xs, ys), first and last kept."""
    if max_points < 2:
        raise ValueError(f"max_points={max_points} must be >= 2.")
    n = len(xs)
    if n <= max_points:
        return list(xs), list(ys)
    step = (n - 1) / (max_points - 1)
    idx = sorted({round(i * step) for i in range(max_points)})
    return [xs[i] for i in idx], [ys[i] for i in idx]
