"""Fused optimizers built at run time where a framework or library builds them
unfused: the patch, the knob, what the run records, and the candidate advise measures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchaxe.kernels import candidates as kernels
from torchaxe.kernels.optimizer import FusedOptimizers
from torchaxe.runtime import bootstrap
from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.errors import TorchaxeError


def test_optimizers_built_without_a_choice_are_fused_and_the_rest_as_asked() -> None:
    model = nn.Linear(4, 4)
    original = torch.optim.AdamW.__init__
    patch = FusedOptimizers().install()
    try:
        fused = torch.optim.AdamW(p for p in model.parameters())  # a generator: read once
        groups = torch.optim.SGD([{"params": [model.weight]}, {"params": model.bias, "lr": 0.5}], lr=0.1)
        asked = torch.optim.AdamW(model.parameters(), foreach=False)
        unfused = torch.optim.Adam(model.parameters(), fused=False)

        class Mine(torch.optim.AdamW):
            pass

        mine = Mine(model.parameters())
        fused.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        fused.step()
    finally:
        patch.uninstall()
    assert fused.defaults["fused"] is True and len(fused.param_groups[0]["params"]) == 2
    assert groups.defaults["fused"] is True and len(groups.param_groups) == 2
    assert not asked.defaults["fused"] and unfused.defaults["fused"] is False and not mine.defaults["fused"]
    assert patch.fused == {"AdamW": 1, "SGD": 1}
    assert torch.optim.AdamW.__init__ is original
    assert not torch.optim.AdamW(model.parameters()).defaults["fused"]  # removed: as torch builds it


def test_the_kernels_knob_takes_the_optimizer_setting_and_records_what_it_fused() -> None:
    knobs = knob_set_from_dict({"name": "k", "kernels": {"optimizer": "fused"}}, "test")
    applied = bootstrap.AppliedKnobs(knobs)
    from torchaxe.kernels.knob import SPEC

    with SPEC.patch(knobs.kernels, applied):
        torch.optim.Adam(nn.Linear(2, 2).parameters())
    assert applied.record["kernels"]["optimizer"] == "fused"
    assert applied.record["kernels"]["fused_optimizers"] == {"Adam": 1}
    with pytest.raises(TorchaxeError, match="kernels.optimizer"):
        knob_set_from_dict({"name": "k", "kernels": {"optimizer": "apex"}}, "test")


def test_the_run_records_each_optimizer_it_built() -> None:
    from torchaxe.runtime.run_context import OBSERVED, OptimizerProbe

    probe = OptimizerProbe().install()
    try:
        torch.optim.AdamW(nn.Linear(2, 2).parameters())
        torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, foreach=False)
    finally:
        probe.uninstall()
    first, second = OBSERVED["optimizers"]
    assert first["class"] == "AdamW" and first["module"].startswith("torch.optim")
    assert first["fused"] is False and first["chosen"] is False and first["site"].endswith(
        f"test_kernels_optimizer.py:{test_the_run_records_each_optimizer_it_built.__code__.co_firstlineno + 5}")
    assert second["chosen"] is True


def _built(site: str, **extra) -> dict:
    return {"optimizers": [{"class": "AdamW", "module": "torch.optim.adamw", "site": site, "fused": False,
                            "chosen": False, **extra}]}


def test_a_fused_optimizer_is_proposed_where_an_installed_package_built_it_unfused() -> None:
    timm = "/venv/lib/python3.11/site-packages/timm/optim/_optim_factory.py:1107"
    (found,) = kernels.fused_optimizer_candidates("cpu", _built(timm))
    assert found.key == "knob:fused-optimizer" and found.knobs == {"kernels": {"optimizer": "fused"}}
    assert "timm/optim/_optim_factory.py:1107" in found.rec.title and "site-packages" not in found.rec.title
    assert kernels.fused_optimizer_candidates("cuda", _built(timm))
    # The user's own call is the scan's when it has a fix there; a choice made, or the npu: nothing.
    assert not kernels.fused_optimizer_candidates("cpu", _built("/home/u/train.py:40"), [("/home/u/train.py", 39, 41)])
    assert not kernels.fused_optimizer_candidates("cpu", _built(timm, chosen=True))
    assert not kernels.fused_optimizer_candidates("cpu", _built(timm, fused=True))
    assert not kernels.fused_optimizer_candidates("npu", _built(timm))
    assert not kernels.fused_optimizer_candidates("cpu", _built(timm, **{"class": "RMSprop"}))


def test_a_fused_optimizer_is_proposed_where_the_users_call_has_no_code_fix() -> None:
    # nanoGPT's and llama2.c's AdamW(..., **extra_args), whose dict asks for fused=True
    # on cuda only: the scan reads no keywords to fix, the run built it unfused on cpu.
    (found,) = kernels.fused_optimizer_candidates("cpu", _built("/home/u/model.py:292"), [("/home/u/train.py", 39, 41)])
    assert found.knobs == {"kernels": {"optimizer": "fused"}}
    assert "/home/u/model.py:292" in found.rec.title and "no fix to make" in found.rec.detail


def test_advise_measures_the_fused_optimizer_knob() -> None:
    from torchaxe.advise.candidates import knob_candidates

    timm = "/venv/lib/python3.11/site-packages/timm/optim/_optim_factory.py:1107"
    settings = {"num_threads": 2, "allowed_cpus": 2, **_built(timm)}
    (fused,) = [c for c in knob_candidates("cpu", {"shapes": {"static": True}}, settings)
                if c.key == "knob:fused-optimizer"]
    # The fragment is a valid knob set that `torchaxe apply` writes and `run` applies.
    assert knob_set_from_dict({"name": "x", **fused.knobs}, "test").kernels.optimizer == "fused"


def test_advise_offers_the_fused_optimizer_knob_only_where_the_scan_has_no_fix(tmp_path) -> None:
    # The script's SGD call is AX201's (a code fix); an AdamW built in a file of the
    # user's that the scan has no fix for (keywords spread from a dict) is the knob's.
    import shutil

    from test_advise import SCRIPTS, FakeRuns, run_advice

    script = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "advise_train.py", script)
    line = next(n for n, text in enumerate(script.read_text().splitlines(), 1) if "torch.optim.SGD" in text)
    keys = {}
    for site in (f"{script}:{line}", f"{tmp_path / 'model.py'}:292"):
        settings = {"num_threads": 2, "allowed_cpus": 2,
                    "optimizers": [{"class": "SGD", "module": "torch.optim.sgd", "site": site, "fused": False,
                                    "chosen": False}]}
        advice = run_advice(script, FakeRuns(), settings=settings)
        keys[site.rpartition("/")[2]] = {r.key for r in advice.recommendations}
    assert "code:AX201" in keys[f"train.py:{line}"] and "knob:fused-optimizer" not in keys[f"train.py:{line}"]
    assert "knob:fused-optimizer" in keys["model.py:292"]
