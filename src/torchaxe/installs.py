"""Installed packages told by what pip leaves beside them, not by a folder's name: a
folder that holds ``NAME-VERSION.dist-info`` folders holds installed packages, the
ones their ``RECORD`` files list (``pip install --target pylib``, a vendored
``deps/`` folder on ``PYTHONPATH``), whatever the folder is called. Light: the
standard library only, and each folder is looked at once."""

from __future__ import annotations

import functools
import os

#: A RECORD this large is read no further (torch's holds some 20,000 lines; a file's
#: top folder comes first in each line, so the names are known well before).
_MOST_RECORD_BYTES = 8 << 20


@functools.lru_cache(maxsize=8192)
def installed_names(folder: str) -> frozenset[str]:
    """The top-level names (package folders, single-module files) installed into
    ``folder`` by the distributions whose ``.dist-info`` folders it holds; empty for
    a folder with none (or one that cannot be listed)."""
    try:
        entries = [e.name for e in os.scandir(folder) if e.name.endswith(".dist-info")]
    except OSError:
        return frozenset()
    names: set[str] = set()
    for info in entries:
        names.update(_record_tops(os.path.join(folder, info)))
    return frozenset(names)


def _record_tops(info: str) -> set[str]:
    """The first path part of each file a distribution's RECORD lists (its own
    ``.dist-info`` folder, scripts placed elsewhere (``../bin``) and caches left out);
    ``top_level.txt``'s names where there is no RECORD."""
    tops: set[str] = set()
    try:
        with open(os.path.join(info, "RECORD"), encoding="utf-8", errors="replace") as handle:
            text = handle.read(_MOST_RECORD_BYTES)
    except OSError:
        try:
            with open(os.path.join(info, "top_level.txt"), encoding="utf-8", errors="replace") as handle:
                names = [line.strip() for line in handle if line.strip() and "/" not in line]
            return {n for name in names for n in (name, f"{name}.py")}  # a package or a module
        except OSError:
            return tops
    for line in text.splitlines():
        path = line.split(",", 1)[0].strip().strip('"')
        top = path.replace("\\", "/").split("/", 1)[0]
        if top and top not in (".", "..", "__pycache__") and not top.endswith((".dist-info", ".data")) \
                and not os.path.isabs(path):
            tops.add(top)
    return tops


def install_folder(path: str | os.PathLike[str]) -> str | None:
    """The folder pip installed the file at ``path`` into: the nearest folder above it
    holding the ``.dist-info`` of a distribution that lists the file's top folder (or
    the file itself) among the names it installed; None for any other file."""
    real = os.path.realpath(path)
    parent, name = os.path.split(real)
    while parent and name:
        if name in installed_names(parent):
            return parent
        parent, name = os.path.dirname(parent), os.path.basename(parent)
    return None


def is_installed_file(path: str | os.PathLike[str]) -> bool:
    """Whether pip installed the file at ``path`` (see :func:`install_folder`)."""
    return install_folder(path) is not None
