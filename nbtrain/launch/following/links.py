"""The TCP connections between a pool's ranks, read from ``/proc`` (Linux): gloo's pairs
of every process group, and the rendezvous store's. A pool frees a rank stuck in a
collective by having its idle peers shut theirs down (``wire.DropGroup``): the stuck
rank's wait fails at once ("Connection closed by peer"), whatever still holds the
group (a DDP model in a cell's names, a run's last frames), which destroying the group
alone does not do. Where ``/proc`` cannot be read the answer is empty, and the peers only
destroy their group."""

from __future__ import annotations

import os


def links(pids: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """``{rank: its file descriptors of TCP connections to another of the ranks}``, for
    ranks given as ``{rank: pid}`` (processes on this machine)."""
    if not pids:
        return {}
    table = _tcp(next(iter(pids.values())))  # one network namespace: the pool's
    sockets = {rank: _sockets(pid) for rank, pid in pids.items()}
    # each rank's own ends: (table, address) pairs
    ends = {rank: {table[i][:2] for i in s if i in table} for rank, s in sockets.items()}
    out = {}
    for rank, s in sockets.items():
        others = set().union(*(e for r, e in ends.items() if r != rank))
        out[rank] = tuple(sorted(fd for inode, fd in s.items()
                                 if inode in table and (table[inode][0], table[inode][2]) in others))
    return out


def _sockets(pid: int) -> dict[int, int]:
    """``{socket inode: fd}`` of process ``pid`` (empty if it cannot be read)."""
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _tcp(pid: int) -> dict[int, tuple[str, str, str]]:
    """``{inode: (table, local address, remote address)}`` of the TCP sockets in the
    network namespace of ``pid`` (addresses as ``/proc/net/tcp`` writes them)."""
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) > 9:
                        out[int(fields[9])] = (table, fields[1], fields[2])
        except (OSError, ValueError):
            continue
    return out


__all__ = ["links"]
