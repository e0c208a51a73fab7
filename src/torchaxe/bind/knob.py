"""The ``bind`` knob of trial knob sets: run the training run bound as a plan says, so
that ``torchaxe trial`` can measure binding against no binding on the user's own run
(under torchrun, each local rank takes its part of the node's plan)::

    {"name": "bound", "bind": {"mode": "exclusive", "loader_cores": 1}}
    {"name": "pinned", "bind": {"cpus": "0-3", "loader_cores": 1}}
    {"name": "defaults", "bind": true}

Parsing imports nothing heavy (knob files are read before torch is imported).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from torchaxe.bind.plan import MODES
from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed


@dataclass(frozen=True)
class BindSettings:
    mode: str = "exclusive"
    cpus: str | None = None
    #: None: automatic (see torchaxe.bind.plan).
    loader_cores: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.cpus is not None:
            out["cpus"] = self.cpus
        if self.loader_cores is not None:
            out["loader_cores"] = self.loader_cores
        return out


def bind_from_dict(raw: Any, fail: Callable[[str, str], Any]) -> BindSettings:
    """Validate the ``bind`` value; ``fail(key, message)`` raises the knob error."""
    if raw is True:
        return BindSettings()
    if not isinstance(raw, dict):
        fail("bind", "expected true or an object with mode, cpus, loader_cores")
    for key in raw:
        if key not in ("mode", "cpus", "loader_cores"):
            fail(f"bind.{key}", "unknown key (expected one of mode, cpus, loader_cores)")
    mode = raw.get("mode", "exclusive")
    if mode not in MODES:
        fail("bind.mode", f"{mode!r} is not one of {', '.join(MODES)}")
    cpus = raw.get("cpus")
    if cpus is not None:
        from torchaxe.cpulist import parse_cpulist
        from torchaxe.errors import TorchaxeError

        if not isinstance(cpus, str):
            fail("bind.cpus", "expected a CPU list string such as \"0-3,8\"")
        try:
            if not parse_cpulist(cpus):
                fail("bind.cpus", "is empty")
        except TorchaxeError as exc:
            fail("bind.cpus", str(exc))
    loader = raw.get("loader_cores")
    if loader is not None and (isinstance(loader, bool) or not isinstance(loader, int) or loader < 0):
        fail("bind.loader_cores", "expected a number of cores, 0 or more")
    return BindSettings(mode=mode, cpus=cpus, loader_cores=loader)


def _local(name: str, default: int) -> int:
    import os

    try:
        return max(0, int(os.environ[name]))
    except (KeyError, ValueError):
        return default


class BoundRun:
    """What the bootstrap does with the knob: plan one rank on this machine, bind the
    process now (before torch is imported), and pin DataLoader workers while the
    script runs."""

    def __init__(self, knob: BindSettings, note: Callable[[str, Any], None]) -> None:
        from torchaxe.bind.apply import apply_binding
        from torchaxe.bind.plan import plan_binding
        from torchaxe.bind.topology import read_topology

        # Under torchrun every local rank plans the node's ranks alike and takes its own.
        local_ranks, local_rank = _local("LOCAL_WORLD_SIZE", 1), _local("LOCAL_RANK", 0)
        if local_rank >= local_ranks:
            local_ranks, local_rank = 1, 0
        plan = plan_binding(read_topology("/"), local_ranks, knob.mode, [knob.cpus] if knob.cpus else None,
                            knob.loader_cores)
        self.rank = plan.ranks[local_rank]
        warnings: list[str] = list(plan.warnings)
        done = apply_binding(plan, self.rank, warn=warnings.append)
        note("bind", {"mode": plan.mode, "cpus": list(self.rank.cpus), "compute_cpus": list(self.rank.compute_cpus),
                      "loader_cpus": list(self.rank.loader_cpus), "threads": self.rank.threads,
                      "env": done["env"], "affinity": done["affinity"], "warnings": warnings})
        self.pin_loaders = bool(self.rank.loader_cpus) and done["affinity"] is not None
        self._undo = None

    def install(self) -> None:
        if self.pin_loaders:
            from torchaxe.bind.apply import install_loader_affinity

            self._undo = install_loader_affinity(self.rank.loader_cpus)

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


class BindKnob(Knob):
    """``bind``: bind the run as a one-rank plan says. Acts before torch is imported
    (the process's CPUs and thread counts size torch's pools at import)."""

    key = "bind"
    example = {"mode": "exclusive", "loader_cores": 1}
    before_torch = True
    conflicts = {"cpu_affinity": "cpu_affinity pins the process too: give one of them"}

    def parse(self, raw: Any, check: KnobCheck) -> BindSettings | None:
        return None if raw is None else bind_from_dict(raw, check.fail)

    def patch(self, value: BindSettings | None, applied: AppliedKnobs):
        return installed(BoundRun(value, applied.note)) if value is not None else nullcontext()


SPEC = BindKnob()
