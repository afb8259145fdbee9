"""``run.history``: every event the kernel received, kept per rank in arrival order.

Rows are tidy: one row per event, with ``kind``, ``rank``, ``step``, ``t`` (seconds since
the run started) and the event's values as columns. A ``comm`` row stands for ``steps``
consecutive steps from ``step`` with the same collectives, each step's calls and bytes
per op (``all_reduce_calls``, ``all_reduce_bytes``).
"""

from __future__ import annotations

import csv
import json
import threading
from dataclasses import asdict
from typing import Any

from .events import Event, Metric

_SUFFIXES = {"counts": "_calls", "bytes": "_bytes"}  # columns of a mapping whose keys repeat


class History:
    def __init__(self, t0: float = 0.0):
        self._t0 = t0
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def append(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def events(self, kind: str | None = None, rank: int | None = None) -> list[Event]:
        with self._lock:
            events = list(self._events)
        return [e for e in events
                if (kind is None or e.kind == kind) and (rank is None or e.rank == rank)]

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events()})

    def metric(self, name: str, rank: int = 0) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` of one logged metric on one rank."""
        return [(e.step, e.values[name]) for e in self.events("metric", rank)
                if isinstance(e, Metric) and name in e.values]

    @property
    def metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for e in self.events("metric"):
            names.update(dict.fromkeys(e.values))
        return list(names)

    def records(self, kind: str | None = "metric") -> list[dict[str, Any]]:
        rows = []
        for e in self.events(kind):
            row: dict[str, Any] = {"kind": e.kind, "rank": e.rank, "step": e.step,
                                   "t": round(e.t - self._t0, 6)}
            for key, value in asdict(e).items():
                if key in ("rank", "step", "t"):
                    continue
                if isinstance(value, dict):  # a Comm's ops are in counts and in bytes
                    suffix = _SUFFIXES.get(key, "")
                    row.update((f"{name}{suffix}", v) for name, v in value.items())
                else:
                    row[key] = value
            rows.append(row)
        return rows

    def to_pandas(self, kind: str | None = "metric"):
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("run.history.to_pandas() needs pandas: pip install pandas "
                              "(or use run.history.records()).") from None
        return pd.DataFrame(self.records(kind))

    def to_csv(self, path: str, kind: str | None = "metric") -> None:
        rows = self.records(kind)
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(rows)

    def to_json(self, path: str, kind: str | None = None) -> None:
        with open(path, "w") as f:
            json.dump(self.records(kind), f)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __repr__(self) -> str:
        return (f"History({len(self)} events, ranks={self.ranks}, "
                f"metrics={self.metric_names})")
