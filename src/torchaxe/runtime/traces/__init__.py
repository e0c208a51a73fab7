"""Trace import: read profiler output made elsewhere into a Profile.

``load_trace(path)`` accepts

- a torch.profiler Chrome trace (``prof.export_chrome_trace``, or the
  ``*.pt.trace.json[.gz]`` that ``tensorboard_trace_handler`` writes), or a folder
  holding exactly one such file;
- torch_npu.profiler output: a ``*_ascend_pt`` folder, its ``ASCEND_PROFILER_OUTPUT``
  folder, or one of its files (``trace_view.json``, ``kernel_details.csv``,
  ``op_statistic.csv``).

Every problem with the input is one :class:`TraceFormatError` line naming the path.
"""

from __future__ import annotations

from pathlib import Path

from torchaxe.runtime.profile import Profile
from torchaxe.runtime.traces.analysis import TraceData, build_profile
from torchaxe.runtime.traces.ascend import read_kernel_details, read_op_statistic
from torchaxe.runtime.traces.events import TraceFormatError, read_timeline

__all__ = ["TraceFormatError", "load_trace"]

ASCEND_FILES = ("trace_view.json", "kernel_details.csv", "op_statistic.csv")
CHROME_SUFFIXES = (".json", ".json.gz")


def load_trace(path: str | Path) -> Profile:
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file or folder")
    if path.is_dir():
        return build_profile(_read_folder(path))
    if path.name in ("kernel_details.csv", "op_statistic.csv") or path.name.endswith(".csv"):
        return build_profile(_read_ascend(path, {path.name: path}))
    if not path.name.endswith(CHROME_SUFFIXES):
        raise TraceFormatError(f"{path}: not a trace this torchaxe reads (expected a .json or .json.gz Chrome trace, "
                               f"or torch_npu's trace_view.json, kernel_details.csv, op_statistic.csv)")
    timeline = read_timeline(path)
    source = "ascend-trace" if timeline.is_ascend else "torch-trace"
    return build_profile(TraceData(source=source, path=path, files=[path], timeline=timeline))


def _read_folder(folder: Path) -> TraceData:
    candidates = [folder / "ASCEND_PROFILER_OUTPUT", folder]
    for where in candidates:
        found = {name: where / name for name in ASCEND_FILES if (where / name).is_file()}
        if found:
            return _read_ascend(folder, found)
    traces = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith((".pt.trace.json",
                                                                                    ".pt.trace.json.gz")))
    if not traces:
        traces = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(CHROME_SUFFIXES))
    if len(traces) > 1:
        raise TraceFormatError(f"{folder}: {len(traces)} trace files in this folder ({traces[0].name}, "
                               f"{traces[1].name}, ...); name one")
    if not traces:
        raise TraceFormatError(f"{folder}: no profiler trace in this folder (looked for *.pt.trace.json[.gz], "
                               f"*.json[.gz] and ASCEND_PROFILER_OUTPUT/{{{','.join(ASCEND_FILES)}}})")
    timeline = read_timeline(traces[0])
    return TraceData(source="ascend-trace" if timeline.is_ascend else "torch-trace", path=folder,
                     files=[traces[0]], timeline=timeline)


def _read_ascend(path: Path, found: dict[str, Path]) -> TraceData:
    data = TraceData(source="ascend-trace", path=path, files=sorted(found.values()))
    if "trace_view.json" in found:
        data.timeline = read_timeline(found["trace_view.json"])
    for name, file in found.items():
        if name == "kernel_details.csv" or (name.endswith(".csv") and "kernel" in name):
            data.kernels = read_kernel_details(file)
        elif name.endswith(".csv"):
            data.op_types = read_op_statistic(file)
    if data.timeline is None and not data.kernels and not data.op_types:
        raise TraceFormatError(f"{path}: no rows in {', '.join(f.name for f in found.values())}")
    return data
