"""The knowledge base: one SQLite file of measured results that later runs reuse.

Two kinds of record live in it:

* **tuned records** (:class:`TunedRecord`): one measurement of one tuning strategy on
  one subgraph, keyed by the subgraph's structural signature and the strategy name,
  with the raw samples, their statistics, the error against eager and the
  environment. ``torchaxe tune`` writes them; ``torchaxe.tune.apply`` reads the
  winners.
* **settings** (:meth:`KnowledgeBase.put_setting`): the measured best setting of
  another axis for a workload (``kind="dataloader"``, ``kind="compile"``, ...), keyed
  by ``kind`` and a workload key (:func:`workload_key`).

The file is ``kb.sqlite`` in torchaxe's home folder by default (:func:`torchaxe.config.home`:
``$TORCHAXE_HOME``, else ``$XDG_CACHE_HOME/torchaxe``). It runs in WAL
mode with a busy timeout, writes in ``BEGIN IMMEDIATE`` transactions and only ever
appends, so several processes tuning at once lose nothing. Every record has a random
``uid``; import skips the uids it already has. Records are JSON; nothing is pickled.
A file that is not a knowledge base, or is damaged, raises :class:`KnowledgeBaseError`
with one line that points to ``torchaxe kb doctor``.

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from torchaxe.config import home
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.command import split_module, split_python

#: The schema this code writes. Older files are migrated on open; newer ones refused.
SCHEMA_VERSION = 2
#: ``kb export`` files carry this in ``"format"``.
EXPORT_FORMAT = "torchaxe.kb/1"
#: How long a writer waits for another process's transaction (milliseconds).
BUSY_TIMEOUT_MS = 30_000
#: The statuses a tuned record can have. Only ``ok`` records can win.
STATUSES = ("ok", "wrong", "failed")
DEFAULT_FILE_NAME = "kb.sqlite"


class KnowledgeBaseError(TorchaxeError):
    """A knowledge-base file that cannot be used, in one line."""


# ------------------------------------------------------------------ records


@dataclass
class TunedRecord:
    """One strategy measured on one subgraph.

    ``samples`` are seconds of one forward + backward each; ``status`` is ``ok`` (it
    matched eager within its dtype's tolerance), ``wrong`` (it ran but did not match)
    or ``failed`` (it raised, or timed out); ``message`` says why for the last two.
    ``errors`` holds the largest differences from eager (outputs and gradients) and the
    tolerance used; ``describe`` the parts of the signature, readable.
    """

    signature: str
    strategy: str
    status: str
    samples: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    describe: dict[str, Any] = field(default_factory=dict)
    message: str | None = None
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)

    @property
    def median(self) -> float | None:
        value = self.stats.get("median")
        return float(value) if isinstance(value, (int, float)) else None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "tuned", "uid": self.uid, "signature": self.signature, "strategy": self.strategy,
                "status": self.status, "samples": list(self.samples), "stats": dict(self.stats),
                "errors": dict(self.errors), "env": dict(self.env), "describe": dict(self.describe),
                "message": self.message, "created": self.created}

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> "TunedRecord":
        """Validate and build; a bad record raises :class:`KnowledgeBaseError`."""
        d = _check_object(data, where, ("type", "uid", "signature", "strategy", "status", "samples", "stats",
                                        "errors", "env", "describe", "message", "created"))
        if d.get("type", "tuned") != "tuned":
            raise KnowledgeBaseError(f"{where}: type {d.get('type')!r} is not \"tuned\"")
        status = _check_str(d, "status", where)
        if status not in STATUSES:
            raise KnowledgeBaseError(f"{where}: status {status!r} is not one of {', '.join(STATUSES)}")
        samples = d.get("samples", [])
        if not isinstance(samples, list) or not all(_finite_number(v) and v >= 0 for v in samples):
            raise KnowledgeBaseError(f"{where}: samples must be a list of non-negative seconds")
        if status == "ok" and not samples:
            raise KnowledgeBaseError(f"{where}: an ok record needs its samples")
        stats = _check_dict(d, "stats", where)
        if status == "ok" and not _finite_number(stats.get("median")):
            raise KnowledgeBaseError(f"{where}: an ok record needs stats.median")
        message = d.get("message")
        if message is not None and not isinstance(message, str):
            raise KnowledgeBaseError(f"{where}: message must be a string or null")
        return cls(signature=_check_hex(d, "signature", where), strategy=_check_str(d, "strategy", where),
                   status=status, samples=[float(v) for v in samples], stats=stats,
                   errors=_check_dict(d, "errors", where), env=_check_dict(d, "env", where),
                   describe=_check_dict(d, "describe", where), message=message, uid=_check_uid(d, where),
                   created=_check_created(d, where))


@dataclass
class SettingRecord:
    """The measured setting of one axis (``kind``) for one workload."""

    kind: str
    workload: str
    setting: dict[str, Any]
    stats: dict[str, Any]
    env: dict[str, Any] = field(default_factory=dict)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "setting", "uid": self.uid, "kind": self.kind, "workload": self.workload,
                "setting": dict(self.setting), "stats": dict(self.stats), "env": dict(self.env),
                "created": self.created}

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> "SettingRecord":
        d = _check_object(data, where, ("type", "uid", "kind", "workload", "setting", "stats", "env", "created"))
        if d.get("type") != "setting":
            raise KnowledgeBaseError(f"{where}: type {d.get('type')!r} is not \"setting\"")
        return cls(kind=_check_str(d, "kind", where), workload=_check_str(d, "workload", where),
                   setting=_check_dict(d, "setting", where), stats=_check_dict(d, "stats", where),
                   env=_check_dict(d, "env", where), uid=_check_uid(d, where), created=_check_created(d, where))


def record_from_dict(data: Any, where: str = "record") -> TunedRecord | SettingRecord:
    """A record of either type from its JSON form, validated."""
    if isinstance(data, dict) and data.get("type") == "setting":
        return SettingRecord.from_dict(data, where)
    return TunedRecord.from_dict(data, where)


def _check_object(data: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise KnowledgeBaseError(f"{where}: expected an object")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise KnowledgeBaseError(f"{where}: unknown key {unknown[0]!r}")
    return data


def _check_str(d: dict[str, Any], key: str, where: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value or len(value) > 500:
        raise KnowledgeBaseError(f"{where}: {key} must be a non-empty string")
    return value


def _check_hex(d: dict[str, Any], key: str, where: str) -> str:
    value = _check_str(d, key, where)
    if len(value) < 8 or any(c not in "0123456789abcdef" for c in value):
        raise KnowledgeBaseError(f"{where}: {key} must be a lower-case hex digest")
    return value


def _check_uid(d: dict[str, Any], where: str) -> str:
    value = d.get("uid")
    if not isinstance(value, str) or len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise KnowledgeBaseError(f"{where}: uid must be 32 lower-case hex digits")
    return value


def _check_dict(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise KnowledgeBaseError(f"{where}: {key} must be an object")
    return value


def _check_created(d: dict[str, Any], where: str) -> float:
    value = d.get("created")
    if not _finite_number(value) or value < 0:
        raise KnowledgeBaseError(f"{where}: created must be a time in seconds since the epoch")
    return float(value)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


# ------------------------------------------------------------------ keys and paths


def default_path() -> Path:
    """``kb.sqlite`` in torchaxe's home folder, beside the scanner's cache and the
    originals ``apply`` keeps."""
    return home() / DEFAULT_FILE_NAME


def workload_key(command: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> str:
    """A stable key for a training command: a hash of the resolved script path (or
    ``-m module``) and its arguments, so that ``python train.py --bs 8`` run as
    ``./train.py`` or by its absolute path gives the same key while another script
    or other arguments give another. ``python`` and its options (``-u``, ``-O``, ``-W
    ignore``), read by the one command parser the runs use, are left out; relative
    paths are resolved against ``cwd`` (default: the working folder)."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    _, tokens = split_python(command)
    module = split_module(tokens)
    if module is not None and module[0]:
        parts = ["module", module[0], *module[1]]
    elif tokens:
        target = tokens[0] if os.path.isabs(tokens[0]) else str(base / tokens[0])
        parts = ["path", os.path.realpath(target), *tokens[1:]]
    else:
        parts = ["empty"]
    return hashlib.sha256(_dumps(parts).encode()).hexdigest()[:32]


# ------------------------------------------------------------------ schema


def _migrate_to_1(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE IF NOT EXISTS tuned (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        uid TEXT NOT NULL UNIQUE,
        signature TEXT NOT NULL,
        strategy TEXT NOT NULL,
        status TEXT NOT NULL,
        created REAL NOT NULL,
        record TEXT NOT NULL)""")
    db.execute("CREATE INDEX IF NOT EXISTS tuned_key ON tuned (signature, strategy, created)")


def _migrate_to_2(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE IF NOT EXISTS settings (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        uid TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL,
        workload TEXT NOT NULL,
        created REAL NOT NULL,
        record TEXT NOT NULL)""")
    db.execute("CREATE INDEX IF NOT EXISTS settings_key ON settings (kind, workload, created)")


#: ``MIGRATIONS[v]`` brings a file from schema ``v`` to ``v + 1``.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _migrate_to_1, 1: _migrate_to_2}


def _corrupt(path: Path, detail: str) -> KnowledgeBaseError:
    return KnowledgeBaseError(f"knowledge base {path} is damaged or not a torchaxe knowledge base ({detail}); "
                              f"run `torchaxe kb doctor --kb {path}` to recover what is readable")


# ------------------------------------------------------------------ the store


class KnowledgeBase:
    """An open knowledge-base file. Use as a context manager::

        with KnowledgeBase.open() as kb:
            kb.put_setting("dataloader", workload_key(argv), {"num_workers": 4}, {"median": 0.12})
            best = kb.best_setting("dataloader", workload_key(argv))
    """

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self.path = path

    # -------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, create: bool = True,
             max_version: int = SCHEMA_VERSION) -> "KnowledgeBase":
        """Open (and create, and migrate) the file; ``None`` means :func:`default_path`.
        ``max_version`` is for tests of migration: stop migrating at that version."""
        p = Path(path) if path is not None else default_path()
        if p.is_dir():
            raise KnowledgeBaseError(f"knowledge base {p}: is a folder")
        if not p.exists():
            if not create:
                raise KnowledgeBaseError(f"knowledge base {p}: no such file")
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise KnowledgeBaseError(f"knowledge base {p}: cannot create its folder: {exc.strerror}") from None
        try:
            db = sqlite3.connect(str(p), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise KnowledgeBaseError(f"knowledge base {p}: cannot open: {exc}") from None
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                _set_up(db, p, max_version)
                return cls(db, p)
            except sqlite3.OperationalError as exc:
                # Several processes opening one file at once have met "database is locked"
                # here before the busy timeout ran out: try again until it has.
                if _busy(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                db.close()
                if _busy(exc):
                    raise KnowledgeBaseError(f"knowledge base {p}: another process kept it locked for "
                                             f"{BUSY_TIMEOUT_MS // 1000} s") from None
                raise _corrupt(p, str(exc)) from None
            except sqlite3.DatabaseError as exc:
                db.close()
                raise _corrupt(p, str(exc)) from None
            except BaseException:
                db.close()
                raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "KnowledgeBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    # -------------------------------------------------------------- writing
    def _write(self, statements: Callable[[sqlite3.Connection], Any]) -> Any:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = statements(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result
        except sqlite3.OperationalError as exc:
            raise KnowledgeBaseError(f"knowledge base {self.path}: cannot write: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None

    def add(self, records: Iterable[TunedRecord | SettingRecord]) -> int:
        """Append records (validated); a uid already present is skipped. Returns how
        many were new."""
        rows = []
        for r in records:
            data = r.to_dict()
            record_from_dict(json.loads(_dumps(data)), f"record {r.uid}")  # the same check import makes
            rows.append((r, _dumps(data)))

        def insert(db: sqlite3.Connection) -> int:
            added = 0
            for r, text in rows:
                if isinstance(r, TunedRecord):
                    cur = db.execute("INSERT OR IGNORE INTO tuned (uid, signature, strategy, status, created, record) "
                                     "VALUES (?, ?, ?, ?, ?, ?)",
                                     (r.uid, r.signature, r.strategy, r.status, r.created, text))
                else:
                    cur = db.execute("INSERT OR IGNORE INTO settings (uid, kind, workload, created, record) "
                                     "VALUES (?, ?, ?, ?, ?)", (r.uid, r.kind, r.workload, r.created, text))
                added += cur.rowcount
            return added

        return self._write(insert) if rows else 0

    def put_setting(self, kind: str, workload: str, setting: dict, stats: dict, env: dict | None = None) -> None:
        """Record the measured ``setting`` of axis ``kind`` for ``workload``; the latest
        record of a (kind, workload) is what :meth:`best_setting` returns."""
        record = SettingRecord(kind=kind, workload=workload, setting=dict(setting), stats=dict(stats),
                               env=dict(env or {}))
        try:
            self.add([record])
        except (TypeError, ValueError) as exc:
            raise KnowledgeBaseError(f"setting {kind}/{workload}: not JSON data: {exc}") from None

    # -------------------------------------------------------------- reading
    def best_setting(self, kind: str, workload: str) -> dict | None:
        """``{"setting", "stats", "env", "created"}`` of the latest record of this kind
        and workload, or ``None``."""
        rows = self._read("SELECT record FROM settings WHERE kind = ? AND workload = ? ORDER BY created DESC, id DESC "
                          "LIMIT 1", (kind, workload))
        if not rows:
            return None
        r = self._decode(rows[0][0], SettingRecord)
        return {"setting": r.setting, "stats": r.stats, "env": r.env, "created": r.created}

    def _decode(self, text: str, kind: type) -> Any:
        try:
            return kind.from_dict(json.loads(text), "stored record")
        except (ValueError, KnowledgeBaseError) as exc:
            raise _corrupt(self.path, f"a stored record is not valid: {exc}") from None

    def tuned(self, signature: str | None = None) -> list[TunedRecord]:
        """Every tuned record (of one signature), oldest first."""
        if signature is None:
            rows = self._read("SELECT record FROM tuned ORDER BY created, id")
        else:
            rows = self._read("SELECT record FROM tuned WHERE signature = ? ORDER BY created, id", (signature,))
        return [self._decode(r[0], TunedRecord) for r in rows]

    def settings(self) -> list[SettingRecord]:
        return [self._decode(r[0], SettingRecord) for r in self._read("SELECT record FROM settings ORDER BY created, id")]

    def latest(self, signature: str) -> dict[str, TunedRecord]:
        """The latest record of each strategy measured on ``signature``."""
        out: dict[str, TunedRecord] = {}
        for r in self.tuned(signature):
            out[r.strategy] = r
        return out

    def measured_strategies(self, signature: str) -> set[str]:
        return {row[0] for row in self._read("SELECT DISTINCT strategy FROM tuned WHERE signature = ?", (signature,))}

    def winner(self, signature: str, min_gain: float = 0.0) -> TunedRecord | None:
        """The fastest correct strategy of ``signature`` (see :func:`choose`)."""
        return choose(self.latest(signature).values(), min_gain)

    def signatures(self) -> list[str]:
        return [r[0] for r in self._read("SELECT DISTINCT signature FROM tuned ORDER BY signature")]

    def counts(self) -> dict[str, int]:
        tuned = self._read("SELECT COUNT(*) FROM tuned")[0][0]
        settings = self._read("SELECT COUNT(*) FROM settings")[0][0]
        return {"tuned": int(tuned), "settings": int(settings), "signatures": len(self.signatures())}

    # -------------------------------------------------------------- upkeep
    def prune(self, *, older_than: float | None = None, superseded: bool = False,
              keep_torch: str | None = None, now: Callable[[], float] = time.time) -> int:
        """Delete records created more than ``older_than`` seconds ago, records that a
        newer one of the same key replaces (``superseded``), and tuned records measured
        under another torch version than ``keep_torch``. Returns how many went."""

        def delete(db: sqlite3.Connection) -> int:
            gone = 0
            if older_than is not None:
                cutoff = now() - older_than
                gone += db.execute("DELETE FROM tuned WHERE created < ?", (cutoff,)).rowcount
                gone += db.execute("DELETE FROM settings WHERE created < ?", (cutoff,)).rowcount
            if superseded:
                gone += db.execute("DELETE FROM tuned WHERE id NOT IN (SELECT id FROM tuned AS t WHERE t.id = "
                                   "(SELECT id FROM tuned AS u WHERE u.signature = t.signature AND "
                                   "u.strategy = t.strategy ORDER BY created DESC, id DESC LIMIT 1))").rowcount
                gone += db.execute("DELETE FROM settings WHERE id NOT IN (SELECT id FROM settings AS t WHERE t.id = "
                                   "(SELECT id FROM settings AS u WHERE u.kind = t.kind AND "
                                   "u.workload = t.workload ORDER BY created DESC, id DESC LIMIT 1))").rowcount
            if keep_torch is not None:
                for rid, text in db.execute("SELECT id, record FROM tuned").fetchall():
                    try:
                        torch_version = json.loads(text).get("env", {}).get("torch")
                    except ValueError:
                        continue
                    if torch_version != keep_torch:
                        gone += db.execute("DELETE FROM tuned WHERE id = ?", (rid,)).rowcount
            return gone

        return self._write(delete)

    def export_data(self) -> dict[str, Any]:
        """Everything, as the JSON object ``kb export`` writes."""
        return {"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION,
                "records": [r.to_dict() for r in self.tuned()] + [s.to_dict() for s in self.settings()]}

    def import_data(self, data: Any, where: str = "import") -> tuple[int, int]:
        """Validate every record of an export, then add them all (or none).
        Returns (new, already present)."""
        records = parse_export(data, where)
        added = self.add(records)
        return added, len(records) - added


def parse_export(data: Any, where: str) -> list[TunedRecord | SettingRecord]:
    """The records of an export object; the first bad record refuses the whole file."""
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise KnowledgeBaseError(f"{where}: not a torchaxe knowledge-base export (expected \"format\": "
                                 f"\"{EXPORT_FORMAT}\")")
    records = data.get("records")
    if not isinstance(records, list):
        raise KnowledgeBaseError(f"{where}: \"records\" must be a list")
    return [record_from_dict(r, f"{where}: record {i}") for i, r in enumerate(records)]


#: Strategies from the simplest to apply to the costliest (compile time, tuning):
#: of two whose medians lie within :data:`TIE` of each other, the simpler wins.
SIMPLEST_FIRST = ("eager", "replace", "channels-last", "compile", "replace+compile", "max-autotune", "aoe")
TIE = 0.01


def choose(records: Iterable[TunedRecord], min_gain: float = 0.0) -> TunedRecord | None:
    """The winner among one signature's latest records: the correct (``ok``) strategy
    with the lowest median -- or a simpler one within :data:`TIE` of it (compile over
    max-autotune at 27.334 against 27.326 ms) -- provided it beats ``eager`` by more
    than ``min_gain`` (a fraction); otherwise eager itself. Wrong and failed records
    never win."""
    ok = [r for r in records if r.status == "ok" and r.median is not None]
    if not ok:
        return None
    fastest = min(ok, key=lambda r: (r.median, r.strategy))
    rank = {name: i for i, name in enumerate(SIMPLEST_FIRST)}
    best = min((r for r in ok if r.median <= fastest.median * (1.0 + TIE)),
               key=lambda r: (rank.get(r.strategy, len(rank)), r.median, r.strategy))
    eager = next((r for r in ok if r.strategy == "eager"), None)
    if eager is not None and best is not eager and best.median > eager.median * (1.0 - min_gain):
        return eager
    return best


def _set_up(db: sqlite3.Connection, path: Path, max_version: int) -> None:
    """WAL journal (switched to once, by whichever process gets there first), then the
    schema brought up to date."""
    mode = db.execute("PRAGMA journal_mode").fetchone()
    if mode is None or str(mode[0]).lower() != "wal":
        if db.execute("PRAGMA journal_mode = WAL").fetchone() is None:
            raise sqlite3.DatabaseError("journal mode not set")
    db.execute("PRAGMA synchronous = NORMAL")
    _upgrade(db, path, max_version)


def _busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _upgrade(db: sqlite3.Connection, path: Path, max_version: int) -> None:
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise KnowledgeBaseError(f"knowledge base {path}: schema {version} is newer than this torchaxe "
                                 f"understands ({SCHEMA_VERSION}); upgrade torchaxe")
    if version == 0:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = tables - {"tuned", "settings", "sqlite_sequence"}
        if foreign:
            raise KnowledgeBaseError(f"knowledge base {path}: is a SQLite file of something else "
                                     f"(tables {', '.join(sorted(foreign))})")
    target = min(max_version, SCHEMA_VERSION)
    while version < target:
        db.execute("BEGIN IMMEDIATE")
        try:
            current = int(db.execute("PRAGMA user_version").fetchone()[0])  # another process may have migrated
            if current == version:
                MIGRATIONS[version](db)
                db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        version = int(db.execute("PRAGMA user_version").fetchone()[0])


# ------------------------------------------------------------------ doctor


@dataclass
class DoctorReport:
    path: Path
    healthy: bool
    recovered: int = 0
    lost: int = 0
    backup: Path | None = None
    problems: list[str] = field(default_factory=list)


def doctor(path: str | os.PathLike[str] | None = None, *, repair: bool = True) -> DoctorReport:
    """Check a knowledge base; when it is damaged (and ``repair``), copy every record
    that can still be read and is valid into a fresh file, keep the damaged one beside
    it as ``NAME.damaged-TIME`` and put the fresh one in its place."""
    p = Path(path) if path is not None else default_path()
    if not p.exists():
        raise KnowledgeBaseError(f"knowledge base {p}: no such file")
    problems: list[str] = []
    rows: list[tuple[str, str]] = []  # (table, record text)
    lost = 0
    try:
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as exc:
        raise KnowledgeBaseError(f"knowledge base {p}: cannot open: {exc}") from None
    try:
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as exc:
            tables = set()
            problems.append(f"not readable as SQLite: {exc}")
        try:
            check = [r[0] for r in db.execute("PRAGMA integrity_check").fetchall()]
            if check != ["ok"]:
                problems.extend(check[:5])
        except sqlite3.DatabaseError as exc:
            if tables:
                problems.append(str(exc))
        for table in ("tuned", "settings"):
            if table not in tables:
                continue
            got, missed = _salvage(db, table)
            rows.extend((table, text) for text in got)
            lost += missed
            if missed:
                problems.append(f"{missed} unreadable row(s) in {table}")
    finally:
        db.close()
    valid: list[TunedRecord | SettingRecord] = []
    for table, text in rows:
        try:
            record = record_from_dict(json.loads(text), f"{table} record")
        except (ValueError, KnowledgeBaseError) as exc:
            lost += 1
            problems.append(str(exc))
            continue
        valid.append(record)
    healthy = not problems
    report = DoctorReport(p, healthy, recovered=len(valid), lost=lost, problems=problems)
    if healthy or not repair:
        return report
    fresh = p.with_name(f".{p.name}.doctor-{os.getpid()}")
    for leftover in (fresh, Path(f"{fresh}-wal"), Path(f"{fresh}-shm")):
        leftover.unlink(missing_ok=True)
    with KnowledgeBase.open(fresh) as kb:
        kb.add(valid)
        kb._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    backup = p.with_name(f"{p.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(p, backup)
    for suffix in ("-wal", "-shm"):
        side = Path(f"{p}{suffix}")
        if side.exists():
            os.replace(side, Path(f"{backup}{suffix}"))
    os.replace(fresh, p)
    for suffix in ("-wal", "-shm"):
        Path(f"{fresh}{suffix}").unlink(missing_ok=True)
    report.backup = backup
    return report


def _salvage(db: sqlite3.Connection, table: str) -> tuple[list[str], int]:
    """Every readable ``record`` of ``table``, row by row, so that one damaged page
    loses only the rows on it. Returns (texts, rows that could not be read)."""
    try:
        found = db.execute(f"SELECT record FROM {table}").fetchall()  # noqa: S608 - table is ours
        return [r[0] for r in found], 0
    except sqlite3.DatabaseError:
        pass
    texts: list[str] = []
    missed = 0
    try:
        top = db.execute(f"SELECT MAX(id) FROM {table}").fetchone()[0] or 0
    except sqlite3.DatabaseError:
        top = 0
    # Without a readable maximum, walk ids until a long run of nothing.
    limit = top if top else 1_000_000
    gap = 0
    rid = 0
    while rid < limit and gap < 1_000:
        rid += 1
        try:
            row = db.execute(f"SELECT record FROM {table} WHERE id = ?", (rid,)).fetchone()
        except sqlite3.DatabaseError:
            missed += 1
            gap += 1
            continue
        if row is None:
            gap += 1
            continue
        gap = 0
        texts.append(row[0])
    return texts, missed

