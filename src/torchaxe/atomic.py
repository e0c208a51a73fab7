"""Write a file so that readers see either the old content or the new, never half.

The text goes to a temporary file in the destination folder, is flushed to disk and
renamed over the destination. An existing file keeps its permission bits; a new one
gets the usual ``0o666`` less the umask. Every write to a user's file goes through here.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Replace (or create) ``path`` with ``text`` atomically; on any failure the
    destination is untouched and no temporary file is left behind."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".torchaxe-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
