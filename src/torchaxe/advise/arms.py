"""The knob set of each arm advise measures: a change's knobs on top of the run table
of torchaxe.toml (what ``torchaxe run`` applies), its code fixes applied to copies of
the files, and the loss observed when accuracy is checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torchaxe.advise.candidates import Candidate, fixed_sources
from torchaxe.runtime.knobs import KnobSet, knob_set_from_dict


def merge_knobs(fragments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Knob fragments merged in order: tables merged key by key, anything else replaced."""
    out: dict[str, Any] = {}
    for frag in fragments:
        for key, value in frag.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


class ArmKnobs:
    """Makes the knob sets of the arms; code fixes are written under ``workdir``."""

    def __init__(self, workdir: Path, target: str, check_accuracy: bool = False) -> None:
        self.workdir = workdir
        self.target = target
        self.check_accuracy = check_accuracy
        #: The run table of torchaxe.toml, under which every arm runs (empty: none).
        self.run_knobs: dict[str, Any] = {}

    def of(self, name: str, fragment: dict[str, Any], run_knobs: bool = True) -> KnobSet:
        """The knob set of one arm: ``fragment`` on top of the run table, if any
        (``run_knobs=False``: the fragment alone)."""
        data = merge_knobs([self.run_knobs, fragment]) if run_knobs and self.run_knobs else dict(fragment)
        if self.check_accuracy:
            data["observe"] = {"loss": True}
        return knob_set_from_dict({"name": name, **data}, f"advise:{name}")

    def of_change(self, c: Candidate) -> KnobSet | None:
        """The knob set that makes one change alone; None when its fix changes nothing."""
        fragment = dict(c.knobs)
        if c.rec.applies == "code":
            folder = self.workdir / c.key.replace(":", "-")
            folder.mkdir(parents=True, exist_ok=True)
            sources = fixed_sources(c.findings, c.rec.rules, folder, target=self.target)
            if not sources:
                return None
            fragment["sources"] = sources
        return self.of(c.key, fragment)

    def of_changes(self, name: str, members: Sequence[Candidate], findings) -> KnobSet:
        """The knob set that makes all of ``members``' changes at once (their knobs
        merged, their code fixes applied to copies of the files)."""
        fragment = merge_knobs([c.knobs for c in members if c.rec.applies == "knob"])
        codes = [code for c in members if c.rec.applies == "code" for code in c.rec.rules]
        if codes:
            folder = self.workdir / name
            folder.mkdir(parents=True, exist_ok=True)
            fragment["sources"] = fixed_sources(findings, codes, folder, target=self.target)
        return self.of(name, fragment)
