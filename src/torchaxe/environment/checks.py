"""Settings that silently slow training, read from the run (its environment and the
process-wide switches it left on, runtime/run_context.py) and located in its code.

Where switching a setting off is a knob (an environment variable), it becomes a
candidate and its cost is measured; otherwise the check says where it is set and,
for garbage collection, what it was measured to cost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torchaxe import cpulist
from torchaxe.memory.candidates import allocator_setting
from torchaxe.runtime.candidate import Candidate, knob_candidate
from torchaxe.units import duration, plural


@dataclass
class EnvironmentCheck:
    """A setting that silently slows training, found in the run's environment or code."""

    name: str
    message: str
    location: str | None = None
    #: The key of the recommendation that measures switching it off, if any.
    recommendation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "message": self.message, "location": self.location,
                "recommendation": self.recommendation}


#: Code that turns on a slow process-wide switch, and the setting it shows up as.
_CODE_PATTERNS = {
    "anomaly_detection": re.compile(r"(set_detect_anomaly\s*\(\s*(True|mode\s*=\s*True)|detect_anomaly\s*\()"),
    "deterministic_algorithms": re.compile(r"use_deterministic_algorithms\s*\(\s*(True|mode\s*=\s*True)"),
    "cudnn_deterministic": re.compile(r"cudnn\.deterministic\s*=\s*True"),
    "profiler_enabled": re.compile(r"(torch\.profiler\.profile\s*\(|autograd\.profiler\.profile\s*\(|"
                                   r"emit_nvtx\s*\()"),
}

_MESSAGES = {
    "anomaly_detection": "autograd anomaly detection is on: every backward op records and checks its forward "
                         "trace, often several times slower; switch it off outside debugging",
    "deterministic_algorithms": "deterministic algorithms are forced: slower kernels are chosen (and some ops "
                                "fall back); keep it for reproducibility runs only",
    "cudnn_deterministic": "cudnn.deterministic = True restricts cuDNN to deterministic (often slower) algorithms",
    "profiler_enabled": "a profiler was left running during training: every op is recorded",
}


def locate(folder: Path, name: str, limit: int = 200) -> str | None:
    """``file:line`` of the first line under ``folder`` that turns ``name`` on."""
    pattern = _CODE_PATTERNS[name]
    for n, path in enumerate(sorted(folder.rglob("*.py"))):
        if n >= limit or any(part.startswith(".") or part in ("site-packages", "node_modules") for part in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                return f"{path}:{number}"
    return None


def _env_candidate(key: str, title: str, env: dict[str, str | None], detail: str) -> Candidate:
    return knob_candidate(key, "environment", title, {"env": env}, detail=detail, priority=3.0)


def environment_checks(settings: dict[str, Any], profile: dict[str, Any], findings: Sequence[Any], target: str,
                       folder: Path | None = None) -> tuple[list[EnvironmentCheck], list[Candidate]]:
    """The environment checks of a run, and a candidate for each setting that an
    environment variable can switch off (its check names the candidate)."""
    env: dict[str, str] = settings.get("env") or {}
    checks: list[EnvironmentCheck] = []
    candidates: list[Candidate] = []

    for var in ("CUDA_LAUNCH_BLOCKING", "ASCEND_LAUNCH_BLOCKING"):
        if env.get(var, "0") not in ("0", ""):
            c = _env_candidate(f"env:{var}", f"unset {var}: every kernel launch waits for the device",
                               {var: None}, f"{var}={env[var]} makes each launch synchronous, so the host "
                               "cannot queue work ahead of the device")
            candidates.append(c)
            checks.append(EnvironmentCheck(var, c.rec.detail, recommendation=c.key))

    allocator = allocator_setting(settings, target)
    if allocator is not None:
        # The candidate that measures it belongs to the memory axis (memory/candidates.py).
        var, current, _ = allocator
        checks.append(EnvironmentCheck(var, f"{var} is {current or 'unset'}: expandable segments are off",
                                       recommendation="knob:expandable-segments"))

    for var in ("PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONTRACEMALLOC"):
        if env.get(var) and not (var == "PYTHONMALLOC" and env[var] in ("pymalloc", "malloc")):
            c = _env_candidate(f"env:{var}", f"unset {var}: a Python debug mode slows every allocation",
                               {var: None}, f"{var}={env[var]} turns on Python's debug hooks")
            candidates.append(c)
            checks.append(EnvironmentCheck(var, c.rec.detail, recommendation=c.key))

    allowed = settings.get("allowed_cpus") or settings.get("cpu_count") or 0
    # The local ranks of a torchrun job share the node's cores: each gets its part.
    local_ranks = cpulist.local_ranks(env)
    if allowed:
        allowed = cpulist.cores_per_rank(allowed, env)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if var not in env:
            continue
        try:
            value = int(env[var])
        except ValueError:
            checks.append(EnvironmentCheck(var, f"{var}={env[var]!r} is not a number"))
            continue
        if allowed and value > allowed:
            cores = plural(allowed, "core") + (f" per rank ({local_ranks} ranks on this node)" if local_ranks > 1 else "")
            c = _env_candidate(f"env:{var}", f"{var}={allowed}: {value} threads oversubscribe {cores}",
                               {var: str(allowed)}, "more compute threads than cores: they preempt each other")
            candidates.append(c)
            checks.append(EnvironmentCheck(var, c.rec.detail, recommendation=c.key))
        elif allowed and value < allowed and target == "cpu":
            share = f"all {allowed} cores this process may use" if local_ranks == 1 else \
                f"its {allowed} cores (the node's, shared by {local_ranks} ranks)"
            c = _env_candidate(f"env:{var}", f"{var}={allowed}: use {share} (now {value})", {var: str(allowed)},
                               "on the CPU the compute threads are the device")
            candidates.append(c)
            checks.append(EnvironmentCheck(var, f"{var}={value} leaves {allowed - value} of {allowed} cores idle",
                                           recommendation=c.key))

    for name, message in _MESSAGES.items():
        if not settings.get(name):
            continue
        if name == "cudnn_deterministic" and target != "cuda":
            continue
        where = locate(folder, name) if folder is not None else None
        checks.append(EnvironmentCheck(name, message, location=where))

    summary = profile.get("summary") or {}
    gc_fraction = summary.get("gc_fraction") or 0.0
    if gc_fraction >= 0.02:
        per_step = duration(summary.get("gc_seconds_per_step") or 0.0, 2)
        checks.append(EnvironmentCheck(
            "gc_pauses", f"Python garbage collection took {gc_fraction:.1%} of the step ({per_step} per step, "
            "measured): call gc.freeze() after building the model and data, or raise gc.set_threshold()"))
    return checks, candidates
