"""Candidates from what earlier commands kept in the knowledge base for this one: the
loader setting ``torchaxe data --tune`` found, the subgraphs ``torchaxe tune`` tuned."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from torchaxe.advise.candidates import LOADER_ACCURACY, Candidate
from torchaxe.advise.recommendation import Accuracy, Recommendation
from torchaxe.errors import TorchaxeError


def stored_candidates(command: Sequence[str], static_shapes: bool, notes: list[str]) -> list[Candidate]:
    """Settings measured for this very command before and kept in the knowledge
    base (``torchaxe data --tune``): measured again here, against this run."""
    from torchaxe.data.tuning import stored_loader_knobs
    from torchaxe.tune.kb import KnowledgeBase

    out: list[Candidate] = []
    try:
        stored = stored_loader_knobs(command)
        with KnowledgeBase.open() as kb:
            tuned = len(kb.signatures())
    except TorchaxeError as exc:
        notes.append(f"knowledge base not read: {exc}")
        return []
    if tuned:
        rec = Recommendation(
            key="knob:tune", axis="tune", title=f"tuned subgraphs from the knowledge base ({tuned} tuned "
            "signatures; those matching this model are swapped in)", applies="knob", knobs={"tune": {}},
            detail="the winners `torchaxe tune` measured and checked against eager (docs/tune.md)",
            accuracy=Accuracy(kind="unknown", detail="each winner matched eager within its dtype's tolerance "
                              "when tuned; use --check-accuracy for the loss"))
        out.append(Candidate(rec=rec, knobs={"tune": {}}, group="compile", priority=1.8))
    elif static_shapes:
        notes.append("shapes are static: `torchaxe tune -- " + " ".join(command)
                     + "` can tune the model's subgraphs and keep the winners for `torchaxe run`")
    if not stored:
        return out
    loader = stored["dataloader"]
    settings = ", ".join(f"{k}={v}" for k, v in sorted(loader.items()))
    rec = Recommendation(key="knob:dataloader-tuned", axis="data", title=f"DataLoader({settings}) "
                         "(found by `torchaxe data --tune`)", applies="knob", knobs={"dataloader": loader},
                         detail="the loader setting the knowledge base holds for this command",
                         accuracy=replace(LOADER_ACCURACY))
    out.append(Candidate(rec=rec, knobs={"dataloader": loader}, group="dataloader", priority=2.5))
    return out
