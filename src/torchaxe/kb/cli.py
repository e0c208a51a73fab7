"""``torchaxe kb``: look after the knowledge base (show, export, import, prune, doctor)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from torchaxe.console import CONTEXT, write_output
from torchaxe.errors import TorchaxeError
from torchaxe.units import duration

_KB_OPTION = click.option("--kb", "kb_path", default=None, metavar="PATH",
                          help="Knowledge base file (default $TORCHAXE_HOME/kb.sqlite).")


@click.group("kb", context_settings=CONTEXT)
def kb() -> None:
    """Look after the knowledge base of tuned subgraphs and measured settings.

    \b
    Examples:
      torchaxe kb show
      torchaxe kb export -o team.json && torchaxe kb import team.json --kb other.sqlite
      torchaxe kb prune --older-than 30d
      torchaxe kb doctor
    """


def _open(kb_path: str | None, create: bool = False):
    from torchaxe.kb.store import KnowledgeBase, default_path

    path = Path(kb_path) if kb_path else default_path()
    if not create and not path.exists():
        raise TorchaxeError(f"knowledge base {path}: no such file (nothing tuned yet: `torchaxe tune -- python "
                            "train.py` creates it)")
    return KnowledgeBase.open(path, create=create)


@kb.command("show", context_settings=CONTEXT)
@_KB_OPTION
@click.option("--min-gain", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="A strategy must beat eager by this fraction to be the winner (as in `torchaxe tune`).")
@click.option("--json", "as_json", is_flag=True, help="Print the winners and records as JSON.")
def show(kb_path, min_gain, as_json):
    """Show each tuned subgraph with its strategies and winner, and the settings."""
    from torchaxe.kb.store import choose

    with _open(kb_path) as base:
        rows = []
        for sig in base.signatures():
            latest = base.latest(sig)
            winner = choose(latest.values(), min_gain)
            any_record = next(iter(latest.values()))
            rows.append({"signature": sig, "describe": any_record.describe,
                         "winner": winner.strategy if winner else None,
                         "strategies": {name: {"status": r.status, "median": r.median, "samples": len(r.samples),
                                               "message": r.message, "created": r.created}
                                        for name, r in sorted(latest.items())}})
        settings: dict[tuple[str, str], Any] = {}
        for s in base.settings():
            settings[(s.kind, s.workload)] = s
        if as_json:
            click.echo(json.dumps({"kb": str(base.path), "schema": base.schema_version, "subgraphs": rows,
                                   "settings": [s.to_dict() for s in settings.values()]}, indent=2))
            return
        counts = base.counts()
        click.echo(f"{base.path}: {counts['tuned']} tuned record(s) on {counts['signatures']} subgraph(s), "
                   f"{counts['settings']} setting record(s); schema {base.schema_version}")
        for row in rows:
            d = row["describe"]
            click.echo(f"\n{d.get('module', '?')}  {row['signature']}  winner: {row['winner'] or '-'}")
            click.echo(f"  inputs {json.dumps(d.get('inputs'), separators=(',', ':'))[:120]}  "
                       f"device {d.get('device')}  torch {d.get('torch')}")
            for name, info in row["strategies"].items():
                tail = duration(info["median"], 3, missing="-") if info["status"] == "ok" else (info["message"] or "")
                click.echo(f"  {name:<16} {info['status']:<7} {tail}")
        for (kind, workload), s in sorted(settings.items()):
            click.echo(f"\nsetting {kind} for workload {workload}: {json.dumps(s.setting, sort_keys=True)}  "
                       f"stats {json.dumps(s.stats, sort_keys=True)[:100]}")


@kb.command("export", context_settings=CONTEXT)
@_KB_OPTION
@click.option("--output", "-o", metavar="FILE", help="Write to FILE (atomically) instead of stdout.")
def export(kb_path, output):
    """Write every record as JSON, to share with a team (`torchaxe kb import`)."""
    with _open(kb_path) as base:
        text = json.dumps(base.export_data(), indent=1, sort_keys=True) + "\n"
        count = len(base.export_data()["records"])
    write_output(text, output)
    click.echo(f"exported {count} record(s)", err=True)


@kb.command("import", context_settings=CONTEXT)
@_KB_OPTION
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
def import_(kb_path, file):
    """Add the records of an export file; every record is validated first, and
    nothing is added unless all are valid. Records already present are skipped."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TorchaxeError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TorchaxeError(f"{file}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TorchaxeError(f"{file}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    with _open(kb_path, create=True) as base:
        added, present = base.import_data(data, file)
    click.echo(f"imported {added} record(s); {present} already present", err=True)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _age(text: str) -> float:
    value = text.strip().lower()
    unit = value[-1:] if value[-1:] in _UNITS else "d"
    number = value[:-1] if value[-1:] in _UNITS else value
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise TorchaxeError(f"--older-than {text!r}: expected an age such as 30d, 12h or 2w") from None
    if seconds < 0:
        raise TorchaxeError(f"--older-than {text!r}: must not be negative")
    return seconds


@kb.command("prune", context_settings=CONTEXT)
@_KB_OPTION
@click.option("--older-than", default=None, metavar="AGE", help="Delete records older than this (30d, 12h, 2w).")
@click.option("--superseded", is_flag=True, help="Keep only the latest record of each subgraph and strategy.")
@click.option("--other-torch", is_flag=True, help="Delete tuned records measured under another torch version.")
def prune(kb_path, older_than, superseded, other_torch):
    """Delete old, superseded or out-of-date records."""
    if older_than is None and not superseded and not other_torch:
        raise TorchaxeError("kb prune: say what to delete: --older-than AGE, --superseded and/or --other-torch")
    keep = None
    if other_torch:
        import torch

        keep = torch.__version__
    with _open(kb_path) as base:
        gone = base.prune(older_than=_age(older_than) if older_than else None, superseded=superseded,
                          keep_torch=keep, now=time.time)
    click.echo(f"deleted {gone} record(s)", err=True)


@kb.command("doctor", context_settings=CONTEXT)
@_KB_OPTION
@click.option("--check", is_flag=True, help="Only check; repair nothing. Exit code 1 when damaged.")
def doctor(kb_path, check):
    """Check the knowledge base; when it is damaged, recover every readable, valid
    record into a fresh file (the damaged one is kept beside it)."""
    from torchaxe.kb.store import doctor as run_doctor

    report = run_doctor(kb_path, repair=not check)
    if report.healthy:
        click.echo(f"{report.path}: healthy ({report.recovered} record(s))")
        return
    for problem in report.problems[:10]:
        click.echo(f"  problem: {problem}", err=True)
    if check:
        click.echo(f"{report.path}: damaged; {report.recovered} record(s) readable, {report.lost} lost "
                   f"(run `torchaxe kb doctor` to repair)")
        sys.exit(1)
    click.echo(f"{report.path}: repaired; recovered {report.recovered} record(s), lost {report.lost}; "
               f"the damaged file is kept as {report.backup}")
