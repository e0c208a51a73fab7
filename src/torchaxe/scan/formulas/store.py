"""Fingerprint results kept between roots, files and runs.

A root's result (which of its subtrees match which reference) depends only on its
normalised text, the roles of its variables and the categories looked for, so it is
stored under that key; a file's matches depend only on its text and the target, so
they are stored under those. Both live in memory for the process and on disk (SQLite,
no pickle), so that a later scan of the same code needs neither the analysis nor the
torch import.
The disk store is tied to the source of the modules that compute results: any change
to them empties it. Set ``TORCHAXE_NO_CACHE=1`` to skip the disk store;
``TORCHAXE_HOME`` chooses its folder (default ``$XDG_CACHE_HOME/torchaxe``).

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from torchaxe.scan.formulas.ir import Node, normalised, walk
from torchaxe.config import home
from torchaxe.scan.formulas.probes import infer_roles

#: A change to any module of this package empties the disk store.
MEMORY_LIMIT = 50_000
DISK_ROW_LIMIT = 500_000


@dataclass
class Match:
    """A subtree that computes a reference function."""

    category: str
    node: Node
    #: The subtrees that play the reference's inputs and parameters (x, weight, q, ...).
    inputs: dict[str, Node]
    params: dict[str, Any]
    #: The reference, in words.
    reference: str
    max_abs: float = 0.0
    max_rel: float = 0.0


@dataclass(frozen=True)
class RootKey:
    """What a root's result depends on."""

    key: str
    roles: dict[str, str]


def root_key(root: Node, categories: frozenset[str]) -> RootKey:
    roles = infer_roles(root)
    text, names = normalised(root)
    raw = json.dumps([text, [roles[n] for n in names], sorted(categories)], separators=(",", ":"))
    return RootKey(hashlib.sha1(raw.encode()).hexdigest(), roles)


def encode(matches: list[Match], root: Node) -> list[list[Any]]:
    """Matches as plain data: subtrees by their position in ``walk(root)``."""
    index = {id(n): i for i, n in enumerate(walk(root))}
    return [
        [m.category, index[id(m.node)], {k: index[id(v)] for k, v in m.inputs.items()}, m.params, m.reference,
         m.max_abs, m.max_rel]
        for m in matches
    ]


def decode(entry: list[list[Any]], root: Node) -> list[Match]:
    order = list(walk(root))
    return [
        Match(cat, order[i], {k: order[j] for k, j in inputs.items()}, dict(params), ref, err, rel)
        for cat, i, inputs, params, ref, err, rel in entry
    ]


def _code_version() -> str:
    digest = hashlib.sha1()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(path.name.encode())
    return digest.hexdigest()


def file_key(source: str, target: str) -> str:
    """A file's result depends on its text and the target only."""
    return "file:" + hashlib.sha1(f"{target}\0{source}".encode("utf-8", "surrogatepass")).hexdigest()


def unneeded_key(source: str, target: str, codes: Iterable[str]) -> str:
    """The key of a mark that a scan of this text, with these formula rules reading it,
    never asked for its formula matches (AX103 asks only for a definition whose name
    and body look like an operator's): a parallel scan of the text again needs no
    evaluator for it."""
    text = f"{target}\0{','.join(sorted(codes))}\0{source}"
    return "unneeded:" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


class FingerprintStore:
    """Memory, then disk. Every disk problem (read-only folder, a locked or broken
    file) turns the disk part off for the process: the store is an accelerator only."""

    def __init__(self, folder: Path | None = None, use_disk: bool | None = None):
        self.memory: dict[str, list] = {}
        self._folder = folder
        self._use_disk = use_disk
        self._db: sqlite3.Connection | None = None
        self._pid: int | None = None
        self._disabled = False

    # ------------------------------------------------------------- disk
    def _connection(self) -> sqlite3.Connection | None:
        if self._disabled:
            return None
        use = self._use_disk if self._use_disk is not None else not os.environ.get("TORCHAXE_NO_CACHE")
        if not use:
            return None
        if self._db is not None and self._pid == os.getpid():
            return self._db
        try:
            folder = self._folder or home()
            folder.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(folder / "fingerprints.sqlite3", timeout=5, isolation_level=None)
            db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT)")
            db.execute("CREATE TABLE IF NOT EXISTS fingerprints (key TEXT PRIMARY KEY, value TEXT)")
            version = _code_version()
            row = db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
            if row is None or row[0] != version:
                db.execute("BEGIN IMMEDIATE")
                db.execute("DELETE FROM fingerprints")
                db.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))
                db.execute("COMMIT")
            elif db.execute("SELECT COUNT(*) FROM fingerprints").fetchone()[0] > DISK_ROW_LIMIT:
                db.execute("DELETE FROM fingerprints")
        except (sqlite3.Error, OSError):
            self._disabled = True
            return None
        self._db, self._pid = db, os.getpid()
        return db

    # ------------------------------------------------------------- access
    def get_many(self, keys: list[str]) -> dict[str, list]:
        found = {k: self.memory[k] for k in keys if k in self.memory}
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        db = self._connection() if missing else None
        if db is not None:
            try:
                for start in range(0, len(missing), 500):
                    part = missing[start : start + 500]
                    marks = ",".join("?" * len(part))
                    for key, value in db.execute(f"SELECT key, value FROM fingerprints WHERE key IN ({marks})", part):
                        found[key] = self.memory[key] = json.loads(value)
            except (sqlite3.Error, ValueError):
                self._disabled = True
        return found

    def get_file(self, key: str) -> list | None:
        return self.get_many([key]).get(key)

    def put_file(self, key: str, matches: list) -> None:
        self.put_many({key: matches})

    def put_many(self, entries: dict[str, list]) -> None:
        if len(self.memory) + len(entries) > MEMORY_LIMIT:
            self.memory.clear()
        self.memory.update(entries)
        db = self._connection() if entries else None
        if db is None:
            return
        try:
            rows = [(k, json.dumps(v, separators=(",", ":"))) for k, v in entries.items()]
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO fingerprints VALUES (?, ?)", rows)
            db.execute("COMMIT")
        except (sqlite3.Error, TypeError, ValueError):
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self._disabled = True


#: The process's store.
STORE = FingerprintStore()
