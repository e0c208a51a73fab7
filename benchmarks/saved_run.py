"""Keep a benchmark's JSON output on disk, so that `benchmarks/summary.py` can build the
table of current figures from it.

A saved run is one JSON object: what was run and where (``benchmark``, ``date``,
``commit``, ``machine``, ``command``) and, under ``result``, the object the script
prints with ``--json``, unchanged. It is written atomically (a temporary file, then a
rename), so a reader never sees half a file and a failed write leaves the last run.

    --save        write benchmarks/results/<benchmark>.json
    --out FILE    write FILE instead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
#: Top-level keys of a saved run.
SAVED_KEYS = ("benchmark", "date", "commit", "machine", "command", "result")


def add_save_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save", action="store_true",
                        help="also write the JSON result to benchmarks/results/<benchmark>.json")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="also write the JSON result to FILE (implies --save)")


def git_commit(root: Path = ROOT) -> str | None:
    """The short commit of ``root``, with ``+dirty`` when tracked files differ from it
    (other than the saved results themselves: saving one run leaves the next clean)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results", ":(exclude)benchmarks/RESULTS.md"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_vectors(flags: set[str] | None = None) -> str:
    """The CPU's widest vector instructions and whether it has bfloat16 ones: figures
    measured on an AVX2-only CPU (bfloat16 emulated) and on one with AVX-512 BF16 or AMX
    are not comparable, though both may call themselves the same model."""
    if flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    if "amx_bf16" in flags:
        return "AMX, bf16"
    if "avx512_bf16" in flags:
        return "AVX-512, bf16"
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f"{widest}, no bf16" if widest else ""


def machine_line(device: str | None = None) -> str:
    """One line naming the machine: cores, CPU, Python, torch, the device when not the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "not installed"
    vectors = _cpu_vectors()
    cpu = f"{_cpu_model()} ({vectors})" if vectors else _cpu_model()
    parts = [f"{cores} cores", cpu, f"Python {platform.python_version()}", f"torch {torch_version}"]
    if device:
        parts.insert(0, device)
    if hasattr(os, "getloadavg"):
        parts.append(f"1-minute load {os.getloadavg()[0]:.2f} at the end")
    return ", ".join(parts)


def saved_run(benchmark: str, result: Any, argv: list[str], device: str | None = None,
              script: str | None = None) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine_line(device),
        "command": shlex.join(["python", f"benchmarks/{script or benchmark}.py", *argv]),
        "result": result,
    }


def save_result(args: argparse.Namespace, benchmark: str, result: Any, argv: list[str] | None = None,
                device: str | None = None, script: str | None = None) -> Path | None:
    """Write the saved run when ``--save`` or ``--out`` was given; return its path.
    ``script``: the script that made it, when its name is not ``benchmark`` (one script
    saving runs of several corpora under their own names)."""
    if not (args.save or args.out):
        return None
    path = Path(args.out) if args.out else RESULTS_DIR / f"{benchmark}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    text = json.dumps(saved_run(benchmark, result, argv, device, script), indent=2) + "\n"
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from torchaxe.atomic import write_text_atomic

    write_text_atomic(path, text)
    print(f"{benchmark}: saved to {path}", file=sys.stderr)
    return path
