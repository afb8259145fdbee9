"""The ranks' telemetry relayed through Ray, for a notebook the cluster cannot dial back:
a laptop on Ray Client (``Ray("ray://head:10001")``), a notebook behind NAT or on a
network the workers do not route to.

The ranks attach to a small actor on the cluster (``Relay``) exactly as they would to
``nbtrain.listen()`` (``NBTRAIN_ATTACH`` with its address and token: the same handshake,
the same frames); it keeps what arrives, and the kernel takes it through Ray every poll
(``RelayFeed.pull``), so nothing connects from the cluster to the notebook. Ray's
documentation steers remote drivers away from long Ray Client sessions towards Jobs; a
notebook that wants a live view is the case Client exists for, and the relay adds no
connection of its own, only a method call a poll.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..telemetry.channel import TelemetryServer, format_address
from ..telemetry.events import Event
from .listen import Job


class Relay:
    """On the cluster (a Ray actor of no CPU): a telemetry listener for one run's ranks
    whose events wait for the kernel's ``take``."""

    def __init__(self, run_id: str):
        import ray

        self.run_id = run_id
        self._items: list[tuple] = []  # ("hello", rank, offset), ("event", rank, event),
        self._lock = threading.Lock()  # ("closed", rank), in arrival order
        self._server = TelemetryServer(host="0.0.0.0", port=0, on_hello=self._hello)
        self._address = format_address(ray.util.get_node_ip_address(),
                                        self._server.address[1], self._server.token)

    def address(self) -> str:
        """What the ranks attach to (``NBTRAIN_ATTACH``)."""
        return self._address

    def take(self) -> tuple[float, list[tuple]]:
        """(this node's clock, what arrived since the last take)."""
        with self._lock:
            items, self._items = self._items, []
        return time.monotonic(), items

    def close(self) -> None:
        self._server.close()

    def _hello(self, hello: dict[str, Any]) -> _Relayed | None:
        if hello.get("run") != self.run_id or not isinstance(hello.get("rank"), int):
            return None
        t = hello.get("t")
        offset = time.monotonic() - t if isinstance(t, (int, float)) else 0.0
        self._put(("hello", hello["rank"], offset))
        return _Relayed(self, hello["rank"])

    def _put(self, item: tuple) -> None:
        with self._lock:
            self._items.append(item)


class _Relayed:
    """One rank's connection to the relay."""

    def __init__(self, relay: Relay, rank: int):
        self.relay, self.rank = relay, rank

    def __call__(self, event: Event) -> None:
        self.relay._put(("event", self.rank, event))

    def closed(self) -> None:
        self.relay._put(("closed", self.rank))


class RelayFeed:
    """The kernel's side: what the relay kept goes to the job's links (the links a
    listener would make), its times moved onto this kernel's clock (the relay's clock
    read between two of this one's; each rank's own offset to the relay's, taken by the
    relay at its hello)."""

    def __init__(self, job: Job, actor):
        import ray

        self.job, self.actor = job, actor
        before = time.monotonic()
        there = ray.get(actor.take.remote())[0]  # (nothing has arrived: no rank started)
        self.offset = (before + time.monotonic()) / 2 - there
        self._links: dict[int, Any] = {}

    def drain(self, within: float = 3.0) -> None:
        """After the ranks returned: take until each rank's connection closed (its last
        frames read by the relay), or ``within`` seconds."""
        deadline = time.monotonic() + within
        self.pull()
        while self._links and time.monotonic() < deadline:
            time.sleep(0.05)
            self.pull()

    def pull(self, timeout: float = 10.0) -> None:
        import ray

        _, items = ray.get(self.actor.take.remote(), timeout=timeout)
        for kind, rank, *rest in items:
            if kind == "hello":
                self._links[rank] = self.job.link(rank, rest[0] + self.offset)
            elif (link := self._links.get(rank)) is not None:
                if kind == "event":
                    link(rest[0])
                else:
                    self._links.pop(rank).closed()
