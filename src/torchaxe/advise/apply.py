"""``torchaxe apply``: carry out what ``advise`` chose, and ``torchaxe run``'s knobs.

Code changes are the scanner's fixes of the chosen rules, written atomically (safe
fixes by default, unsafe ones with ``unsafe=True``), in the files of the script's
project (``scan.discover.project_root``) only; installed packages are never edited
(their formulas are swapped at run time by the ``replace`` knob, written like any knob). Before the first change to a
workload its original files are kept under ``originals/`` of torchaxe's home folder (:func:`torchaxe.config.home`) so that a
later ``advise`` can measure the gain achieved against them. Runtime knobs go to the
``run`` table of the project's ``torchaxe.toml`` (or ``[tool.torchaxe.run]`` of a
pyproject.toml that already holds the configuration), edited in place so the user's
comments stay.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torchaxe.advise.recommendation import SCHEMA
from torchaxe.runtime.candidate import loss_checked
from torchaxe.atomic import write_text_atomic
from torchaxe.config import home
from torchaxe.errors import TorchaxeError

ORIGINALS_SCHEMA = "torchaxe.originals/1"


def workload_id(script: str | Path) -> str:
    """A stable name for the workload: the script's real path."""
    return hashlib.sha256(os.path.realpath(script).encode()).hexdigest()[:16]


def load_advice(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TorchaxeError(f"{path}: no advice file: run `torchaxe advise -- python train.py` first") from None
    except (OSError, ValueError) as exc:
        raise TorchaxeError(f"{path}: not a readable advice file: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise TorchaxeError(f"{path}: not a torchaxe advice file (schema {SCHEMA} expected)")
    if not isinstance(data.get("recommendations"), list) or not isinstance(data.get("command"), list):
        raise TorchaxeError(f"{path}: advice file without recommendations or command")
    return data


# ------------------------------------------------------------------ originals


def originals_dir(script: str | Path) -> Path:
    return home() / "originals" / workload_id(script)


def keep_originals(script: str | Path, files: Sequence[str | Path]) -> Path:
    """Copy ``files`` as they are now, unless an earlier apply already kept them."""
    folder = originals_dir(script)
    manifest_path = folder / "manifest.json"
    manifest: dict[str, Any] = {"schema": ORIGINALS_SCHEMA, "script": os.path.realpath(script), "files": {}}
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    folder.mkdir(parents=True, exist_ok=True)
    for path in files:
        real = os.path.realpath(path)
        if real in manifest["files"]:
            continue
        copy = folder / f"{len(manifest['files'])}-{Path(real).name}"
        write_text_atomic(copy, Path(real).read_text(encoding="utf-8"))
        manifest["files"][real] = str(copy)
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_text_atomic(manifest_path, json.dumps(manifest, indent=1) + "\n")
    return folder


def kept_originals(script: str | Path) -> dict[str, str]:
    """original path -> kept copy, for files that changed since they were kept."""
    manifest_path = originals_dir(script) / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for real, copy in (manifest.get("files") or {}).items():
        try:
            if Path(real).read_bytes() != Path(copy).read_bytes():
                out[real] = copy
        except OSError:
            continue
    return out


# ------------------------------------------------------------------ knobs in the config


def config_path_for(script_folder: Path) -> Path:
    """Where the run knobs live: the nearest torchaxe.toml (or pyproject.toml with a
    [tool.torchaxe] table) above the script, else a new torchaxe.toml beside it."""
    from torchaxe.config import find_config

    found = find_config(script_folder).source
    return found if found is not None else script_folder / "torchaxe.toml"


def write_run_knobs(path: Path, knobs: dict[str, Any]) -> None:
    write_text_atomic(path, run_knobs_text(path, knobs)[1])


def run_knobs_diff(path: Path, knobs: dict[str, Any]) -> str:
    """What :func:`write_run_knobs` would change in ``path``, as a unified diff."""
    import difflib

    before, after = run_knobs_text(path, knobs)
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=str(path) if before else "/dev/null", tofile=str(path)))


def run_knobs_text(path: Path, knobs: dict[str, Any]) -> tuple[str, str]:
    """The text of ``path`` now, and with its ``run`` table (``[tool.torchaxe.run]`` in
    a pyproject.toml) holding ``knobs``; the rest of the file is kept as it is."""
    import tomlkit

    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        doc = tomlkit.parse(text)
    except Exception as exc:  # tomlkit raises its own ParseError subclasses
        raise TorchaxeError(f"{path}: invalid TOML: {exc}") from None
    if path.name == "pyproject.toml":
        tool = doc.setdefault("tool", tomlkit.table())
        table = tool.setdefault("torchaxe", tomlkit.table())
    else:
        table = doc
    run = tomlkit.table()
    run.comment("written by `torchaxe apply`; applied by `torchaxe run` (docs/advise.md)")
    for key, value in knobs.items():
        if isinstance(value, dict):
            inline = tomlkit.inline_table()
            inline.update(value)
            run[key] = inline
        else:
            run[key] = value
    table["run"] = run
    return text, tomlkit.dumps(doc)


def read_run_knobs(script_folder: Path, cwd: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The ``run`` table nearest the script (then the working folder)."""
    from torchaxe.config import find_config

    for start in (script_folder, cwd or Path.cwd()):
        config = find_config(start)
        if config.get("run") is not None:
            return dict(config.get("run")), config.source
    return {}, None


# ------------------------------------------------------------------ apply


@dataclass
class ApplyResult:
    changed_files: list[str] = field(default_factory=list)
    applied_fixes: int = 0
    skipped_unsafe: list[str] = field(default_factory=list)
    #: Unsafe code changes applied without --unsafe-fixes: advise chose them with
    #: their training loss measured within the noise and the tolerance.
    checked_unsafe: list[str] = field(default_factory=list)
    skipped_outside: list[str] = field(default_factory=list)
    knobs: dict[str, Any] = field(default_factory=dict)
    config: Path | None = None
    originals: Path | None = None
    diffs: list[str] = field(default_factory=list)
    #: Named with --only although advise measured them slower than the original.
    slower: list[str] = field(default_factory=list)
    #: Named with --only although advise held them back (training loss, memory limit).
    held_back: list[str] = field(default_factory=list)
    #: Applied changes that change the optimisation (a larger micro-batch).
    changes_optimisation: list[str] = field(default_factory=list)
    #: The recommendations asked for (chosen by advise, or named with --only).
    asked: list[str] = field(default_factory=list)


def advised_project(advice: dict[str, Any], folder: str | Path) -> Path:
    """The project advise found the script in (``scanned.project``: it may reach above
    an unmarked folder, see ``scan.discover.project_of``), else the folder's own."""
    from torchaxe.scan.discover import project_root

    recorded = (advice.get("scanned") or {}).get("project")
    if isinstance(recorded, str) and os.path.isdir(recorded):
        real = Path(os.path.realpath(recorded))
        if Path(os.path.realpath(folder)).is_relative_to(real):
            return real
    return project_root(folder)


def chosen_recommendations(advice: dict[str, Any], keys: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The recommendations ``apply`` applies: those named in ``keys``, else the chosen."""
    recs = [r for r in advice["recommendations"] if isinstance(r, dict)]
    return [r for r in recs if (r.get("key") in keys if keys else r.get("selected"))]


def _code_edits(advice: dict[str, Any], keys: Sequence[str]) -> list[dict[str, Any]]:
    """The changes to apply (of ``keys``, or the chosen) that edit files."""
    return [r for r in chosen_recommendations(advice, keys) if r.get("applies") == "code" and r.get("status") != "advice"]


def check_made_here(advice: dict[str, Any], here: str | Path, keys: Sequence[str] = ()) -> Path | None:
    """Refuse advice made in another copy of this project. Its fixes are for the files
    of the project of the script advise ran (``apply`` run from anywhere changes
    those), but run from a copy of that project (the same script at the same place in
    it) the user means the copy, and would see the other tree edited. Run knobs alone
    (the changes to apply, of ``keys`` or the chosen, edit no file) belong to no tree:
    for them the copy's script folder is returned, where its run knobs go."""
    from torchaxe.runtime.torchrun import parse_script
    from torchaxe.scan.discover import project_root

    made_in = advice.get("cwd")
    if not isinstance(made_in, str) or not os.path.isdir(made_in):
        return None
    try:
        _, script = parse_script(advice["command"], cwd=made_in)
    except (TorchaxeError, KeyError):
        return None
    advised = Path(os.path.realpath(script.target if script.kind == "path" else script.folder))
    project = advised_project(advice, script.folder)
    here_project = project_root(here)
    here_real = Path(os.path.realpath(here))
    if here_real.is_relative_to(project) or project.is_relative_to(here_project):
        # Inside the advised project, a folder holding a copy of the script (a
        # sub-folder the user copied it into) means that copy: refused as below.
        copy = here_real / advised.name
        if (script.kind == "path" and here_real != advised.parent and copy.is_file()
                and _code_edits(advice, keys)):
            raise TorchaxeError(f"this advice was made for {advised}: its fixes are for the files there, not for "
                                f"the copy here ({copy}); run `torchaxe advise` here, or `torchaxe apply` in "
                                f"{made_in}")
        return None
    # The copy's project may be unmarked, as advise's may have been: look for the same
    # script at the same place from here and the folders above it (not top-level ones).
    inside = advised.relative_to(project)
    for base in dict.fromkeys((here_project, *here_project.parents)):
        if len(base.parts) < 3:
            break
        copy = base / inside
        if copy.exists():
            if not _code_edits(advice, keys):
                return copy if copy.is_dir() else copy.parent
            raise TorchaxeError(f"this advice was made for {advised}: its fixes are for the files there, not for "
                                f"the copy here ({copy}); run `torchaxe advise` here, or `torchaxe apply` in "
                                f"{made_in}")
    return None


def apply_advice(advice: dict[str, Any], *, unsafe: bool = False, keys: Sequence[str] = (),
                 write: bool = True, knobs_folder: Path | None = None) -> ApplyResult:
    """Apply the chosen recommendations (or the ones named in ``keys``); the run knobs
    go to the torchaxe.toml of the script's folder, or of ``knobs_folder`` (a copy of
    the project, see :func:`check_made_here`)."""
    from torchaxe.advise.arms import merge_knobs
    from torchaxe.runtime.torchrun import parse_script
    from torchaxe.scan.discover import in_project
    from torchaxe.scan.engine import ScanOptions
    from torchaxe.scan.fix import fix_paths

    cwd = advice.get("cwd") if isinstance(advice.get("cwd"), str) else None
    if cwd is not None and not os.path.isdir(cwd):
        raise TorchaxeError(f"the folder advise ran in is gone: {cwd}")
    _, script = parse_script(advice["command"], cwd=cwd)
    folder = script.folder
    known = {r.get("key") for r in advice["recommendations"] if isinstance(r, dict)}
    for key in keys:
        if key not in known:
            raise TorchaxeError(f"--only {key}: no such recommendation in the advice (see its `key` fields)")
    chosen = chosen_recommendations(advice, keys)
    result = ApplyResult(asked=[r["key"] for r in chosen])
    result.slower = [f"{r['key']} ({r['speedup']:.2f}x)" for r in chosen
                     if r.get("status") == "measured" and isinstance(r.get("speedup"), (int, float)) and r["speedup"] < 1]
    result.held_back = [f"{r['key']} ({r['held_back']})" for r in chosen if r.get("held_back")]
    result.changes_optimisation = [r["key"] for r in chosen if r.get("changes_optimisation")]
    codes: list[str] = []
    checked: set[str] = set()
    for r in chosen:
        if r.get("applies") != "code" or r.get("status") == "advice":
            continue
        if r.get("unsafe") and not unsafe:
            if not loss_checked(r):
                result.skipped_unsafe.append(r["key"])
                continue
            checked.update(r.get("rules") or [])
            result.checked_unsafe.append(r["key"])
        codes.extend(r.get("rules") or [])
    allowed: bool | frozenset[str] = True if unsafe else frozenset(checked)
    files: list[str] = []
    project = advised_project(advice, folder)
    for r in chosen:
        if r.get("applies") == "code" and r.get("status") != "advice":
            for f in r.get("files") or []:
                real = os.path.realpath(os.path.join(cwd, f) if cwd else f)
                if not in_project(real, project):
                    result.skipped_outside.append(f)
                elif real not in files:
                    files.append(real)
    if codes and files:
        options = ScanOptions(target=advice.get("target", "cpu"), select=tuple(sorted(set(codes))))
        preview = fix_paths(files, options, unsafe=allowed, write=False)
        changed = [ff for ff in preview.files if ff.changed]
        result.diffs = [ff.diff() for ff in changed]
        if write and changed:
            result.originals = keep_originals(script.target if script.kind == "path" else folder,
                                              [ff.path for ff in changed])
            done = fix_paths(files, options, unsafe=allowed, write=True)
            result.applied_fixes = sum(len(ff.applied) for ff in done.files)
        result.changed_files = [ff.path for ff in changed]
    fragments = [r.get("knobs") or {} for r in chosen if r.get("applies") == "knob"]
    if fragments:
        result.knobs = merge_knobs(fragments)
        result.config = config_path_for(Path(knobs_folder) if knobs_folder is not None else Path(folder))
        from torchaxe.runtime.knobs import knob_set_from_dict

        knob_set_from_dict({"name": "run", **result.knobs}, str(result.config))  # refuse what run would refuse
        if write:
            write_run_knobs(result.config, result.knobs)
        else:
            result.diffs.append(run_knobs_diff(result.config, result.knobs))
    return result
