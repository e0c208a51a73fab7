"""The tune knob as an advise candidate: offered only when the knowledge base (the
machine's, shared by every project) holds winners of modules the profiled run called."""

from __future__ import annotations

from torchaxe.kb import KnowledgeBase
from torchaxe.kb.store import TunedRecord
from torchaxe.tune.candidates import stored_candidates


def _kb_with(tmp_path, monkeypatch, *modules: str) -> None:
    monkeypatch.setenv("TORCHAXE_HOME", str(tmp_path))
    with KnowledgeBase.open() as kb:
        kb.add([TunedRecord("%032x" % i, "compile", "ok", samples=[0.1], stats={"median": 0.1},
                            describe={"module": module}) for i, module in enumerate(modules)])


def test_winners_of_modules_the_run_called_are_offered(tmp_path, monkeypatch):
    _kb_with(tmp_path, monkeypatch, "Block", "SmallResNet")
    notes: list[str] = []
    found = stored_candidates(["python", "train.py"], True, notes, {"GPT", "Block", "Linear"})
    assert [c.key for c in found] == ["knob:tune"]
    assert "(1 tuned signatures;" in found[0].rec.title and not notes


def test_winners_of_another_project_s_model_are_not_offered(tmp_path, monkeypatch):
    # Seen in a review: after `tune` of a CNN, every later advise of any project measured
    # the tune knob (once "1.18x" on one round, on an MLP it swapped nothing into).
    _kb_with(tmp_path, monkeypatch, "SmallResNet", "ResBlock")
    notes: list[str] = []
    assert stored_candidates(["python", "train.py"], True, notes, {"MLP", "Linear"}) == []
    assert any(n.startswith("the knowledge base's 2 tuned signature(s) are of other modules (ResBlock, SmallResNet), "
                            "none of which this run called") for n in notes), notes
    # The classes unknown (no shapes in the profile): offered as before.
    assert [c.key for c in stored_candidates(["python", "train.py"], True, [], None)] == ["knob:tune"]
