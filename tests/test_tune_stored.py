"""The tune knob as an advise candidate: offered only when the knowledge base (the
machine's, shared by every project) holds winners of modules the profiled run called,
on the inputs it called them with."""

from __future__ import annotations

from torchaxe.kb import KnowledgeBase
from torchaxe.kb.store import TunedRecord
from torchaxe.tune.candidates import stored_candidates


def _tensor(shape, dtype="float32"):
    return {"tensor": [list(shape), dtype, False, "cpu", True, False]}


def _kb_with(tmp_path, monkeypatch, *modules, eager_wins=()) -> None:
    """One signature per ``(module class, first input shape)``; compile wins unless the
    class is in ``eager_wins``."""
    monkeypatch.setenv("TORCHAXE_HOME", str(tmp_path))
    rows = []
    for i, (module, shape) in enumerate(modules):
        describe = {"module": module, "inputs": [_tensor(shape)]}
        compiled = 0.1 if module not in eager_wins else 0.2
        rows += [TunedRecord("%032x" % i, "eager", "ok", samples=[0.15], stats={"median": 0.15}, describe=describe),
                 TunedRecord("%032x" % i, "compile", "ok", samples=[compiled], stats={"median": compiled},
                             describe=describe)]
    with KnowledgeBase.open() as kb:
        kb.add(rows)


def _run(*modules):
    """The profile's ``shapes.modules``: class and first input of each module called."""
    return [{"name": f"m.{i}", "type": cls, "calls": 1,
             "signatures": [{"shapes": [list(shape), None], "dtypes": ["float32", None], "count": 1}]}
            for i, (cls, shape) in enumerate(modules)]


def test_winners_of_modules_the_run_called_are_offered(tmp_path, monkeypatch):
    _kb_with(tmp_path, monkeypatch, ("Block", (8, 16, 64)), ("SmallResNet", (32, 3, 32, 32)))
    notes: list[str] = []
    found = stored_candidates(["python", "train.py"], True, notes,
                              _run(("GPT", (8, 16)), ("Block", (8, 16, 64)), ("Linear", (8, 16, 64))))
    assert [c.key for c in found] == ["knob:tune"]
    assert "(1 tuned signature matching this model" in found[0].rec.title and not notes


def test_winners_of_another_project_s_model_are_not_offered(tmp_path, monkeypatch):
    # Seen in a review: after `tune` of a CNN, every later advise of any project measured
    # the tune knob (once "1.18x" on one round, on an MLP it swapped nothing into).
    _kb_with(tmp_path, monkeypatch, ("SmallResNet", (32, 3, 32, 32)), ("ResBlock", (32, 16, 32, 32)))
    notes: list[str] = []
    assert stored_candidates(["python", "train.py"], True, notes, _run(("MLP", (8, 32)), ("Linear", (8, 32)))) == []
    # The knowledge base is the machine's: the other project's module names are not
    # listed in this one's advice (seen in a review: a GCN's in every later project's).
    assert not any("ResBlock" in n or "knowledge base" in n for n in notes), notes
    # The modules unknown (no shapes in the profile): offered as before.
    assert [c.key for c in stored_candidates(["python", "train.py"], True, [], None)] == ["knob:tune"]


def test_a_class_every_model_has_matches_only_on_its_inputs(tmp_path, monkeypatch):
    # Seen in a review: a ConvNeXt's tuned head (a Linear on [32, 320]) made the tune
    # knob a candidate of a LLaMA script, whose Linears take [8, 128, 192].
    _kb_with(tmp_path, monkeypatch, ("Linear", (32, 320)))
    notes: list[str] = []
    assert stored_candidates(["python", "train.py"], True, notes, _run(("Linear", (8, 128, 192)))) == []
    assert notes and notes[0].startswith("the knowledge base holds 1 tuned signature of this run's Linear, none "
                                         "with a winner for the inputs this run called them with")
    assert [c.key for c in stored_candidates(["python", "train.py"], True, [], _run(("Linear", (32, 320))))] \
        == ["knob:tune"]


def test_a_signature_whose_winner_is_eager_swaps_nothing_in(tmp_path, monkeypatch):
    _kb_with(tmp_path, monkeypatch, ("Block", (8, 16, 64)), eager_wins=("Block",))
    notes: list[str] = []
    assert stored_candidates(["python", "train.py"], True, notes, _run(("Block", (8, 16, 64)))) == []
    assert notes
