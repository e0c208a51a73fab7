"""The binding settings worth measuring: on a cpu, compute threads on every core the
process may use; with enough cores, the process pinned near its device."""

from __future__ import annotations

import os
from typing import Any

from torchaxe import cpulist
from torchaxe.runtime.candidate import Candidate, knob_candidate

#: Fewer cores than this leave nothing to bind apart.
MIN_CORES_TO_BIND = 4


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """The thread-count and core-binding candidates, given the cores the run was allowed."""
    out: list[Candidate] = []
    node_cores = settings.get("allowed_cpus") or os.cpu_count() or 1
    # The local ranks of a torchrun job share the node's cores: each has its part.
    env = settings.get("env") or {}
    local_ranks = cpulist.local_ranks(env)
    allowed = cpulist.cores_per_rank(node_cores, env)
    if target == "cpu":
        threads = settings.get("num_threads")
        if threads and threads != allowed and "OMP_NUM_THREADS" not in (settings.get("env") or {}):
            out.append(knob_candidate(
                "knob:threads", "binding", f"torch.set_num_threads({allowed}): use every core this process may use",
                {"torch": {"num_threads": allowed}}, priority=0.6))
    if node_cores >= max(MIN_CORES_TO_BIND, local_ranks):
        # One group with torch_npu's own core binding (CPU_AFFINITY_CONF, proposed on
        # distributed npu runs): it binds after start-up, over this one.
        out.append(knob_candidate(
            "knob:bind", "binding", "bind the process to the cores near its device (torchaxe bind, exclusive mode)"
            if local_ranks == 1 else f"bind each of the {local_ranks} local ranks to the cores near its device "
            "(torchaxe launch's plan, exclusive mode)",
            {"bind": {"mode": "exclusive"}}, group="binding", priority=0.4,
            detail="pins the main and compute threads, and the DataLoader workers apart from them, to the "
                   "device's NUMA node, so the scheduler does not migrate them (docs/bind.md)"))
    return out
