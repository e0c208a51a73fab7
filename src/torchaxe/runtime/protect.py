"""Measured runs leave the user's files as they were.

``advise``, ``trial`` and the tuners run the user's script many times, and a script
writes files: a log, a metrics CSV, checkpoints every N steps. A trial run that stops
after a few steps would leave them truncated or replaced. So each run started through
the bootstrap with ``--protect-writes DIR`` watches (with an audit hook, PEP 578) every
file it opens for writing under the working folder or the script's folder; before the
first such open of a file, the file is copied into ``DIR`` (or, if it did not exist,
noted as created). When the run is over, the parent calls :func:`restore`: copies are
put back (atomically) and files the run created are removed, and so are the folders
it created (``os.mkdir``, ``os.makedirs``) once empty. Compiler caches, the
caches and anything outside the two folders are not touched, and neither is
a file written by a worker started with ``spawn`` (it has no hook).

The manifest is one JSON object per line, written as each file is first met, so a run
that is killed still leaves what is needed to restore. Processes that run at the same
time (a torchrun job's ranks, runs taking turns) share one folder: the first record of
a path holds the state before any of them wrote it, and the folder is restored once
all of them have ended.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

MANIFEST = "manifest.jsonl"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_SKIP_PARTS = ("__pycache__", ".git", ".cache")
#: Compiler caches: keeping them between runs is what makes the runs comparable.
_SKIP_PREFIXES = ("torchinductor", "triton", ".triton")


class WriteGuard:
    """The child's half: installed once per process (audit hooks cannot be removed)."""

    def __init__(self, folder: str | os.PathLike[str], roots: list[str]) -> None:
        self.folder = os.path.realpath(folder)
        self.files = os.path.join(self.folder, "files")
        self.manifest = os.path.join(self.folder, MANIFEST)
        self.roots = tuple(os.path.realpath(r).rstrip(os.sep) + os.sep for r in roots)
        self.seen: set[str] = set()
        self._local = threading.local()
        self._count = 0

    def install(self) -> "WriteGuard":
        os.makedirs(self.files, exist_ok=True)
        sys.addaudithook(self._hook)
        return self

    def watch_torch_save(self) -> None:
        """``torch.save`` to a path opens the file in C++, where no audit event is
        raised: the path is noted before the call."""
        import torch

        original = torch.save
        guard = self

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, bytes, os.PathLike)):
                guard._guarded_note(f)
            return original(obj, f, *args, **kwargs)

        save.__wrapped__ = original  # type: ignore[attr-defined]
        save.__doc__ = original.__doc__
        torch.save = save

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "os.mkdir":
            if args and not isinstance(args[0], int) and (len(args) < 3 or args[2] in (None, -1)):  # no dir_fd
                self._guarded_note(args[0], folder=True)
            return
        if event != "open":
            return
        try:
            path, mode, flags = args
        except ValueError:
            return
        if isinstance(mode, str):
            if not any(c in mode for c in "wax+"):
                return
        elif not (isinstance(flags, int) and flags & _WRITE_FLAGS):
            return
        if not isinstance(path, int):
            self._guarded_note(path)

    def _guarded_note(self, path: Any, folder: bool = False) -> None:
        """``_note``, never re-entered by its own file operations, never raising."""
        if getattr(self._local, "busy", False):
            return
        self._local.busy = True
        try:
            self._note(path, folder)
        except Exception:  # noqa: BLE001 - never disturb the user's run
            pass
        finally:
            self._local.busy = False

    def _note(self, path: Any, folder: bool = False) -> None:
        text = os.fsdecode(os.fspath(path))
        real = os.path.realpath(text)
        if real in self.seen:
            return
        if real.startswith(self.folder + os.sep) or not real.startswith(self.roots):
            return
        if any(part in _SKIP_PARTS or part.startswith(_SKIP_PREFIXES) for part in Path(real).parts):
            return
        record: dict[str, Any] = {"path": real}
        if folder:
            if os.path.exists(real):
                return  # not created by this call (exist_ok); a later mkdir of it is still watched
            self.seen.add(real)
            record["created_folder"] = True
            with open(self.manifest, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
            return
        self.seen.add(real)
        if os.path.isfile(real):
            self._count += 1
            # The ranks of a torchrun job share one folder: the first record of a path wins.
            backup = os.path.join(self.files, f"{os.getpid()}-{self._count}")
            shutil.copy2(real, backup)
            record["backup"] = backup
        elif not os.path.exists(real):
            record["created"] = True
        else:
            return
        with open(self.manifest, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def guard_roots(script_folder: str | os.PathLike[str] | None) -> list[str]:
    """The folders whose files a run's writes are undone in: the working folder and the
    script's own, unless one is the temporary folder itself (compiler caches live there)."""
    roots = {os.getcwd()}
    if script_folder is not None:
        roots.add(os.fspath(script_folder))
    temp = os.path.realpath(tempfile.gettempdir())
    return sorted(r for r in roots if os.path.realpath(r) != temp)


def restore(folder: str | os.PathLike[str]) -> int:
    """Undo what the run recorded in ``folder``; returns how many files were put back
    or removed. Later records of the same path are ignored (the first holds the state
    before the run)."""
    manifest = Path(folder) / MANIFEST
    if not manifest.exists():
        return 0
    done: set[str] = set()
    folders: list[str] = []
    count = 0
    for line in manifest.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            path = record["path"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a killed run
        if path in done:
            continue
        done.add(path)
        if record.get("created_folder"):
            folders.append(path)
            continue
        try:
            if record.get("backup"):
                staging = f"{path}.torchaxe-restore"
                shutil.copy2(record["backup"], staging)
                os.replace(staging, path)
                count += 1
            elif record.get("created") and os.path.isfile(path):
                os.remove(path)
                count += 1
        except OSError:
            continue
    # Folders the run made, deepest first, once the files in them are gone; one that
    # still holds something (written by a process the guard did not watch) stays.
    for path in sorted(folders, key=len, reverse=True):
        try:
            os.rmdir(path)
            count += 1
        except OSError:
            continue
    return count
