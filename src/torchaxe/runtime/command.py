"""The training command: what the user typed after ``--``, and running it in-process.

``python train.py ARGS``, ``python -m package.module ARGS`` and plain ``train.py
ARGS`` are accepted. The script runs in this interpreter (so the harness can hook
into it) with what it would have seen under ``python``: ``sys.argv``, ``sys.path[0]``
(the script's folder, or the working folder for ``-m``) and ``__name__ ==
"__main__"``. Everything changed is put back afterwards.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from torchaxe.errors import TorchaxeError

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$", re.IGNORECASE)
#: Interpreter options that change nothing the harness could honour differently.
HARMLESS_FLAGS = frozenset({"-u", "-B", "-E", "-s", "-I", "-q"})
#: Interpreter options whose value is the next token (``-W ignore``, ``-X dev``).
_VALUED_FLAGS = frozenset({"-W", "-X", "--check-hash-based-pycs"})


@dataclass(frozen=True)
class ScriptCommand:
    """A script (``kind == "path"``) or a module (``kind == "module"``) with its arguments."""

    kind: str
    target: str
    args: tuple[str, ...] = ()
    #: The command as typed, for the profile.
    typed: tuple[str, ...] = ()
    #: The working folder the command is meant for, when not this process's (a saved advice).
    workdir: str | None = None

    @property
    def display(self) -> str:
        return self.target if self.kind == "path" else f"-m {self.target}"

    @property
    def folder(self) -> Path:
        """The folder put first on ``sys.path``: the script's own, or the working folder."""
        if self.kind == "path":
            real = Path(os.path.realpath(self.target))
            # A folder with __main__.py, or a zip archive, is itself put on the path.
            if real.is_dir() or real.suffix in (".zip", ".pyz"):
                return real
            return real.parent
        return Path(self.workdir) if self.workdir else Path.cwd()


def is_python(token: str) -> bool:
    """Whether a command's first word is a Python interpreter (``python3.11``, this one)."""
    name = os.path.basename(token)
    return bool(_PYTHON.match(name)) or os.path.abspath(token) == os.path.abspath(sys.executable)


def _starts_module(token: str) -> bool:
    return token == "-m" or (token.startswith("-m") and not token.startswith("--"))


def split_python(argv: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """``python [options] REST`` taken apart into the interpreter's options and the
    rest (the script, ``-m MODULE`` or ``-``, onwards); a command that does not start
    with an interpreter has no options. Nothing is judged here: callers decide which
    options they accept."""
    tokens = list(argv)
    if not tokens or not is_python(tokens[0]):
        return (), tokens
    tokens.pop(0)
    options: list[str] = []
    while tokens and tokens[0].startswith("-") and tokens[0] != "-" and not _starts_module(tokens[0]):
        flag = tokens.pop(0)
        options.append(flag)
        if flag == "-c":
            break
        if flag in _VALUED_FLAGS and tokens:
            options.append(tokens.pop(0))
    return tuple(options), tokens


def split_module(tokens: Sequence[str]) -> tuple[str, list[str]] | None:
    """``-m NAME ARGS`` (or ``-mNAME ARGS``) as (NAME, ARGS), the name empty when it is
    missing; ``None`` when ``tokens`` do not start with ``-m``."""
    if not tokens or not _starts_module(tokens[0]):
        return None
    first = tokens[0]
    if first != "-m":
        return first[2:], list(tokens[1:])
    return (tokens[1] if len(tokens) > 1 else ""), list(tokens[2:])


def _other_program(first: str, path: Path) -> bool:
    """Whether the command's first word names a program that is not a Python script:
    one on PATH that is not a file here (``bash``, ``deepspeed``), or a binary."""
    if path.suffix == ".py":
        return False
    if not path.exists():
        import shutil

        return os.sep not in first and shutil.which(first) is not None
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"\x7fELF"
    except OSError:
        return False


def parse_command(argv: Sequence[str], cwd: str | None = None) -> ScriptCommand:
    """Understand ``python [-u] train.py ARGS``, ``python -m mod ARGS`` or ``train.py ARGS``.
    ``cwd``: the working folder the command was typed in, when not this process's (a
    relative script path is resolved there, and becomes absolute).

    Raises TorchaxeError, in one line, for anything else (other interpreter options,
    ``-c``, a launcher such as torchrun, a script that is not there)."""
    tokens = list(argv)
    typed = tuple(argv)
    if not tokens:
        raise TorchaxeError("nothing to run: give the training command, e.g. `torchaxe profile -- python train.py`")
    head = os.path.basename(tokens[0])
    if head in ("torchrun", "torch.distributed.run") or head.startswith("torchrun"):
        raise TorchaxeError(
            "a torchrun command runs torchaxe in every rank: give it to `torchaxe profile`, `trial`, `advise`, "
            "`shapes`, `data` or `tune`, or run `torchrun [options] --module torchaxe VERB -- python train.py`"
        )
    if is_python(tokens[0]):
        options, tokens = split_python(tokens)
        for flag in options:
            if flag in HARMLESS_FLAGS:
                continue
            if flag == "-c":
                raise TorchaxeError("python -c is not supported: torchaxe profiles a script file or a module (-m)")
            raise TorchaxeError(
                f"python option {flag} is not supported: the script runs inside torchaxe's interpreter; "
                "set it with an environment variable (PYTHONWARNINGS, PYTHONOPTIMIZE, ...) instead"
            )
        if not tokens:
            raise TorchaxeError("no script after `python`: give the training script, e.g. `python train.py`")
    first = tokens[0]
    module = split_module(tokens)
    if module is not None:
        name, rest = module
        if not name:
            raise TorchaxeError("-m needs a module name, e.g. `python -m package.train`")
        return ScriptCommand("module", name, tuple(rest), typed, workdir=cwd)
    if first == "-":
        raise TorchaxeError("reading the script from stdin is not supported: give a file")
    if first.startswith("-"):
        raise TorchaxeError(f"{first}: expected a script, `python SCRIPT` or `python -m MODULE`")
    path = Path(cwd, first) if cwd else Path(first)
    if _other_program(first, path):
        raise TorchaxeError(f"{first} is not a Python script: torchaxe runs Python training commands "
                            "(`python train.py`, `python -m package.train`, `train.py`, `torchrun ... train.py`)")
    if not path.exists() and path.suffix != ".py" and len(tokens) > 1:
        # ``pyhton train.py``: a misspelt program, not a missing script.
        import difflib

        close = difflib.get_close_matches(first, ("python", "python3", "torchrun"), n=1)
        raise TorchaxeError(f"{first}: no such script or program"
                            + (f" (did you mean `{close[0]}`?)" if close else "")
                            + ": torchaxe runs `python train.py`, `python -m package.train`, `train.py` or "
                              "`torchrun ... train.py`")
    if not path.exists():
        raise TorchaxeError(f"script not found: {path}")
    if path.is_dir() and not (path / "__main__.py").exists():
        raise TorchaxeError(f"{first}: is a folder without __main__.py")
    return ScriptCommand("path", str(path) if cwd else first, tuple(tokens[1:]), typed, workdir=cwd)


def check_module(command: ScriptCommand) -> None:
    """Fail early, in one line, when a ``-m`` module cannot be found (with the
    working folder on ``sys.path``, as ``python -m`` would have it)."""
    if command.kind != "module":
        return
    import importlib.util

    folder = str(command.folder)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec = importlib.util.find_spec(command.target)
    except (ImportError, ValueError) as exc:
        raise TorchaxeError(f"-m {command.target}: {exc}") from None
    finally:
        if added:
            sys.path.remove(folder)
    if spec is None:
        raise TorchaxeError(f"-m {command.target}: no module of that name (looked in {folder} and sys.path)")


def run_command(command: ScriptCommand) -> None:
    """Run the script or module as ``__main__`` in this interpreter; exceptions
    (including SystemExit) propagate to the caller. ``sys.argv``, ``sys.path`` and
    the modules imported from the script's folder are restored or dropped after."""
    saved_argv = sys.argv[:]
    saved_path = sys.path[:]
    before = set(sys.modules)
    folder = str(command.folder)
    try:
        if sys.path:
            sys.path[0] = folder
        else:
            sys.path.append(folder)
        if command.kind == "path":
            sys.argv = [command.target, *command.args]
            from torchaxe.runtime.overlay import run_main

            run_main(command.target)
        else:
            # run_module replaces argv[0] with the module's file, as python -m does.
            sys.argv = [command.target, *command.args]
            runpy.run_module(command.target, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        _forget_local_modules(before, folder)


#: Real paths of the files of the script's own modules that :func:`_forget_local_modules`
#: dropped: the run imported them (runtime/run_context.py lists them with the rest).
FORGOTTEN_FILES: set[str] = set()


def _forget_local_modules(before: set[str], folder: str) -> None:
    """Drop modules the script imported from its own folder, so that a second run
    in the same interpreter (tests, trials) imports the user's current code. Modules
    from anywhere else (torch's lazily imported parts) stay: dropping those would
    leave two copies of one module. The dropped files are kept in ``FORGOTTEN_FILES``."""
    prefix = os.path.realpath(folder).rstrip(os.sep) + os.sep
    for name in set(sys.modules) - before:
        if name.split(".", 1)[0] in ("torchaxe", "torch"):
            continue  # a checkout of torchaxe or torch can sit below the working folder
        module = sys.modules.get(name)
        filename = getattr(module, "__file__", None) or ""
        real = os.path.realpath(filename) if filename else ""
        if real and real.startswith(prefix):
            sys.modules.pop(name, None)
            if real.endswith(".py"):
                FORGOTTEN_FILES.add(real)
