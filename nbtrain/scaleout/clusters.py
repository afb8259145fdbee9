"""Cluster environments that start the ranks themselves, seen as torchrun's.

Lightning detects these by their environment variables alone; so does ``launch()``. Each
is translated into torchrun's names (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), which ``torchrun.py`` already
runs under: ``fn`` runs in this process as that rank, nothing is started.

- **SLURM**, a step started by ``srun`` with more than one task (``srun -n 2 python
  train.py``, or ``srun`` inside an sbatch script): rank ``SLURM_PROCID``, world
  ``SLURM_STEP_NUM_TASKS``, local rank ``SLURM_LOCALID``, the node's task count from
  ``SLURM_STEP_TASKS_PER_NODE``, the master the first host of ``SLURM_STEP_NODELIST``,
  the port derived from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (two jobs on one node do
  not collide). An sbatch script's own process (no ``SLURM_STEP_ID``) and one-task steps
  (a notebook started on a SLURM node) are not ranks: there ``launch()`` starts workers
  as anywhere else.
- **LSF** (``jsrun``): ``JSM_NAMESPACE_RANK``, ``JSM_NAMESPACE_SIZE``,
  ``JSM_NAMESPACE_LOCAL_RANK`` and ``JSM_NAMESPACE_LOCAL_SIZE``; the master the first
  compute host of ``LSB_DJOB_RANKFILE`` (else of ``LSB_HOSTS``), the port from
  ``LSB_JOBID``.
- **Kubeflow**'s PyTorchJob (one process per pod): its ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` and ``RANK``, in a pod (``KUBERNETES_PORT``); local rank 0 of 1.

A ``MASTER_PORT`` or ``MASTER_ADDR`` already set wins.
"""

from __future__ import annotations

import itertools
import os
import re

from ..spec import WORKER_ENV

TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``,
    ``"rack[1-2]-node[01-04]"`` -> ``"rack1-node01"``."""
    for host in expand_hostlist(nodelist):
        return host
    raise ValueError(f"SLURM's node list {nodelist!r} names no host")


def expand_hostlist(nodelist: str):
    """Every host of a SLURM hostlist, in ``scontrol show hostnames``'s order: entries
    split at the commas outside brackets; in an entry each bracket group is a comma list
    of numbers and ranges (``01-04`` keeps the width of its first number), and several
    groups multiply, the first varying slowest."""
    for entry in _split_top_level(nodelist):
        parts = re.split(r"(\[[^\]]*\])", entry)
        choices = []
        for part in parts:
            if part.startswith("[") and part.endswith("]"):
                choices.append(list(_numbers(part[1:-1], nodelist)))
            elif "[" in part or "]" in part:
                raise ValueError(f"SLURM's node list {nodelist!r}: unbalanced brackets")
            else:
                choices.append([part])
        yield from ("".join(combo) for combo in itertools.product(*choices))


def _split_top_level(nodelist: str) -> list[str]:
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    entries.append(nodelist[start:])
    return [e.strip() for e in entries if e.strip()]


def _numbers(group: str, nodelist: str):
    for item in group.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"SLURM's node list {nodelist!r}: cannot read [{group}]")
        for n in range(int(low), int(high or low) + 1):
            yield str(n).zfill(len(low))  # "01-10": 01 ... 10; "1-10": 1 ... 10


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM's ``"4(x2),3"`` form (4, 4, 3)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot read SLURM's tasks per node {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else counts[-1]


def _port(job_id: str, step: str = "0") -> int:
    """A port in 15000-50999 from a job id (and step): fixed for every rank of the step,
    different for two jobs sharing a node (unless their ids differ by a multiple of 9000)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + (int(digits) % 9000) * 4 + int(re.sub(r"\D", "", step) or 0) % 4


def slurm(env) -> dict[str, str] | None:
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world < 2:
        return None
    node = int(env.get("SLURM_NODEID") or 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world),
            "LOCAL_RANK": env.get("SLURM_LOCALID") or "0",
            "LOCAL_WORLD_SIZE": str(tasks_on_node(per_node, node)),
            "MASTER_ADDR": first_host(nodelist),
            "MASTER_PORT": str(_port(env.get("SLURM_JOB_ID", "0"), env["SLURM_STEP_ID"]))}


def lsf(env) -> dict[str, str] | None:
    needed = ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")
    if not all(k in env for k in needed) or "LSB_JOBID" not in env:
        return None
    hosts: list[str] = []
    rankfile = env.get("LSB_DJOB_RANKFILE")
    if rankfile and os.path.exists(rankfile):
        with open(rankfile) as f:
            hosts = [line.strip() for line in f if line.strip()]
    else:
        hosts = env.get("LSB_HOSTS", "").split()
    # The first line is the launch node (batch host); the ranks run on the others.
    master = hosts[1] if len(hosts) > 1 else (hosts[0] if hosts else "127.0.0.1")
    return {"RANK": env["JSM_NAMESPACE_RANK"], "WORLD_SIZE": env["JSM_NAMESPACE_SIZE"],
            "LOCAL_RANK": env["JSM_NAMESPACE_LOCAL_RANK"],
            "LOCAL_WORLD_SIZE": env.get("JSM_NAMESPACE_LOCAL_SIZE", "1"),
            "MASTER_ADDR": master, "MASTER_PORT": str(_port(env["LSB_JOBID"]))}


def kubeflow(env) -> dict[str, str] | None:
    needed = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if not all(env.get(k) for k in needed) or env.get("LOCAL_RANK"):
        return None  # torchrun's own variables (LOCAL_RANK) mean torchrun, not the operator
    return {"RANK": env["RANK"], "WORLD_SIZE": env["WORLD_SIZE"], "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": env["MASTER_ADDR"],
            "MASTER_PORT": env["MASTER_PORT"]}


ENVIRONMENTS = {"slurm": slurm, "lsf": lsf, "kubeflow": kubeflow}


def detect(env=os.environ) -> tuple[str, dict[str, str]] | None:
    """The cluster environment this process is a rank of, with torchrun's variables for
    it; None outside one (and in nbtrain's own workers, which inherit a node's)."""
    if env.get(WORKER_ENV):
        return None
    for name, read in ENVIRONMENTS.items():
        found = read(env)
        if found is not None:
            return name, found
    return None


def adopt(env=os.environ) -> str | None:
    """Under a cluster environment: set torchrun's variables it implies (those already
    set win) and return its name; else None and nothing changes."""
    found = detect(env)
    if found is None:
        return None
    name, values = found
    for key, value in values.items():
        env.setdefault(key, value)
    return name
