"""The tuned subgraphs worth measuring: the winners ``torchaxe tune`` kept in the
knowledge base, swapped into the model where its subgraphs match."""

from __future__ import annotations

from typing import Sequence

from torchaxe.runtime.candidate import Accuracy, Candidate, Recommendation
from torchaxe.kb import KnowledgeBase


def stored_candidates(command: Sequence[str], static_shapes: bool | None, notes: list[str]) -> list[Candidate]:
    """The ``tune`` knob when the knowledge base holds tuned signatures; otherwise, for
    a model with static shapes, a note in ``notes`` that tuning it could pay. Raises
    :class:`~torchaxe.errors.TorchaxeError` when the knowledge base cannot be read."""
    with KnowledgeBase.open() as kb:
        tuned = len(kb.signatures())
    if not tuned:
        if static_shapes:
            notes.append("shapes are static: `torchaxe tune -- " + " ".join(command)
                         + "` can tune the model's subgraphs and keep the winners for `torchaxe run`")
        return []
    rec = Recommendation(
        key="knob:tune", axis="tune", title=f"tuned subgraphs from the knowledge base ({tuned} tuned "
        "signatures; those matching this model are swapped in)", applies="knob", knobs={"tune": {}},
        detail="the winners `torchaxe tune` measured and checked against eager (docs/tune.md)",
        accuracy=Accuracy(kind="unknown", detail="each winner matched eager within its dtype's tolerance "
                          "when tuned; the training loss is compared with the original's"))
    return [Candidate(rec=rec, knobs={"tune": {}}, group="compile", priority=1.8)]
