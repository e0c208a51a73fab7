"""What every command line shares: click's context settings, the writer of a
command's output (stdout or a file, atomically) and the printer of progress lines on
stderr. It sits low (beside ``errors``) so that every CLI, the runtime's included,
can use it; it imports neither click nor torch, and rich only when a line is printed
to a terminal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from torchaxe.errors import TorchaxeError

#: click ``context_settings`` of every command: ``-h`` as well as ``--help``, and help
#: text up to 100 columns.
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def writable_path(output: str | os.PathLike[str], option: str = "--output", shown: str | None = None) -> Path:
    """``output`` as a Path, once it is clear a file can be written there (not a
    folder, in a folder that exists); otherwise a one-line error naming ``option``
    and ``shown`` (default: ``output`` as given)."""
    path = Path(output)
    name = shown if shown is not None else str(output)
    if path.is_dir():
        raise TorchaxeError(f"{option} {name}: is a folder")
    if not path.parent.exists():
        raise TorchaxeError(f"{option} {name}: folder {path.parent} does not exist")
    return path


def write_output(text: str, output: str | None, option: str = "--output") -> None:
    """A command's output: to stdout when ``output`` is None or ``-``, else to that
    file, atomically, so that the user never finds it half-written."""
    if output is None or output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from torchaxe.atomic import write_text_atomic

    write_text_atomic(writable_path(output, option), text)


def progress_printer(verb: str, quiet: bool = False) -> Callable[[str], None]:
    """A function that prints one progress line as ``torchaxe VERB: LINE`` on stderr,
    with a dim prefix through rich when stderr is a terminal; with ``quiet``, one that
    prints nothing. Progress goes to stderr so that stdout stays the command's output."""
    if quiet:
        return lambda line: None
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.markup import escape

        console = Console(stderr=True, highlight=False, soft_wrap=True)
        return lambda line: console.print(f"[dim]torchaxe {verb}:[/dim] {escape(line)}")

    def plain(line: str) -> None:
        sys.stderr.write(f"torchaxe {verb}: {line}\n")
        sys.stderr.flush()

    return plain


#: Where the command group keeps the arguments as typed (``click.Context.meta``).
RAW_ARGS = "torchaxe.raw_args"


def raw_args() -> list[str] | None:
    """The verb and its arguments as typed on the command line (None outside it)."""
    import click

    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(RAW_ARGS) if ctx is not None else None

