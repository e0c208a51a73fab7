"""Code the user does not edit from the script's folder: the project's own files
beside it (``repo/scripts/train.py`` importing ``repo/src/pkg/model.py``) are fixed by
``apply`` like local ones, and the hand-written formulas of installed packages are
swapped at run time by the ``replace`` knob, which ``advise`` measures, ``apply``
writes to torchaxe.toml and ``run`` applies -- never by editing the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchaxe.advise.apply import apply_advice, read_run_knobs
from torchaxe.advise.pipeline import AdviseOptions, Advisor, BaselineProfile
from torchaxe.runtime.knobs import AppliedKnobs, KnobError, knob_set_from_dict
from torchaxe.scan.discover import in_project, project_root
from torchaxe.tune.replace import SPEC

from test_advise import Clock, FakeRuns

GELU = "0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))"

#: An installed package's module, as transformers writes NewGELUActivation.
PACKAGE_MODULE = f"""import math

import torch
from torch import nn


class TanhGELU(nn.Module):
    def forward(self, x):
        return {GELU}
"""

#: A training script that counts the fused GELU's calls and compares the module's
#: output with it.
TRAIN = """import torch
import torch.nn.functional as F
from torch import nn

from fakeact.act import TanhGELU

calls = []
fused = F.gelu


def counting(*args, **kwargs):
    calls.append(kwargs.get("approximate"))
    return fused(*args, **kwargs)


F.gelu = counting
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), TanhGELU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16)
for _ in range(3):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
F.gelu = fused
probe = torch.randn(64, 64)
difference = (TanhGELU()(probe) - fused(probe, approximate="tanh")).abs().max().item()
print("fused calls", calls.count("tanh"), "difference", difference)
"""


def fake_package(root: Path) -> Path:
    """``root/fakeact/act.py``: a package outside any project, as site-packages holds one."""
    (root / "fakeact").mkdir(parents=True)
    (root / "fakeact" / "__init__.py").write_text("")
    path = root / "fakeact" / "act.py"
    path.write_text(PACKAGE_MODULE)
    return path


def src_layout(tmp_path: Path, marked: bool) -> tuple[Path, Path, Path]:
    """``repo/scripts/train.py`` importing ``repo/src/pkg/model.py`` (a hand-written
    GELU) through ``sys.path``; ``repo`` holds ``.git`` when ``marked``."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "src" / "pkg").mkdir(parents=True)
    if marked:
        (repo / ".git").mkdir()
    (repo / "src" / "pkg" / "__init__.py").write_text("")
    model = repo / "src" / "pkg" / "model.py"
    model.write_text("import math\n\nimport torch\n\n\ndef gelu(x):\n    return " + GELU + "\n")
    script = repo / "scripts" / "train.py"
    script.write_text("import sys\nfrom pathlib import Path\n\n"
                      "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'src'))\n"
                      "from pkg.model import gelu\n")
    return repo, model, script


def profile_of(step: float = 0.1, modules: list | None = None) -> dict:
    return {
        "status": "stopped", "detail": "stopped after 4 measured steps",
        "summary": {"steps_measured": 4, "step_seconds_median": step, "data_wait_fraction": 0.0,
                    "data_wait_seconds_median": 0.0, "backward_seconds_median": step / 3,
                    "gc_seconds_per_step": 0.0, "gc_fraction": 0.0, "host_syncs_per_step": 0.0},
        "steps": [{"phase": "measured", "seconds": step, "data_wait_seconds": 0.0} for _ in range(4)],
        "ops_steps": [3, 4], "ops": [], "shapes": {"static": True, "modules": modules or []},
    }


def runs_where(**times: float) -> FakeRuns:
    """Trial runs where only the named changes are faster than the original."""
    return FakeRuns({"knob:compile": 0.1, "knob:autocast-bf16": 0.1, **times})


def advise_with(script: Path, modules: list[Path], runs: FakeRuns, profile: dict | None = None):
    context = {"modules": [str(p) for p in modules], "settings": {"num_threads": 2, "allowed_cpus": 2}}
    options = AdviseOptions(target="cpu", budget=600.0, skip=("env:",))
    profile = profile or profile_of()
    return Advisor(["python", str(script)], options, runner=runs, clock=Clock(),
                   profiler=lambda command, o, target: BaselineProfile(profile, context, 2.0)).run()


def test_the_project_root_is_the_nearest_marker_and_environments_are_not_project_code(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / ".venv" / "lib" / "site-packages" / "dep").mkdir(parents=True)
    (repo / "env" / "lib" / "python3.11" / "x").mkdir(parents=True)
    (repo / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert project_root(repo / "scripts") == repo / "scripts"  # no marker anywhere: the folder itself
    (repo / ".git").mkdir()
    assert project_root(repo / "scripts") == repo
    (repo / "scripts" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert project_root(repo / "scripts") == repo / "scripts"  # the nearest marker wins
    (repo / "scripts" / "pyproject.toml").unlink()
    assert in_project(repo / "src" / "pkg" / "model.py", repo)
    assert not in_project(repo / ".venv" / "lib" / "site-packages" / "dep" / "m.py", repo)
    assert not in_project(repo / "env" / "lib" / "python3.11" / "x" / "m.py", repo)  # a venv of another name
    assert not in_project(tmp_path / "elsewhere.py", repo)


def test_the_replace_knob_swaps_an_installed_forward_while_the_run_lasts(tmp_path: Path, monkeypatch) -> None:
    import torch
    import torch.nn.functional as F

    package = fake_package(tmp_path / "site")
    original_text = package.read_text()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    calls: list[str] = []
    fused = F.gelu

    def counting(*args, **kwargs):
        calls.append(kwargs.get("approximate"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "gelu", counting)
    knobs = knob_set_from_dict({"replace": {"fakeact.act:TanhGELU.forward": "gelu_tanh",
                                            "fakeact.act:TanhGELU.extra": "silu"}}, "test")
    applied = AppliedKnobs(knobs)
    x = torch.randn(64, 64)
    try:
        with SPEC.patch(knobs.replace, applied):
            import fakeact.act as act  # imported after the knob is in place, as a script does

            hand_free = act.TanhGELU()(x)
            assert calls == ["tanh"]
            assert torch.equal(hand_free, fused(x, approximate="tanh"))
        record = applied.record["replace"]
        assert record["replaced"] == ["fakeact.act:TanhGELU.forward (gelu_tanh)"]
        assert record["not_replaced"][0].startswith("fakeact.act:TanhGELU.extra: TanhGELU.extra")
        # Undone when the run ends: the hand-written form again, within float tolerance.
        again = act.TanhGELU()(x)
        assert calls == ["tanh"]
        assert (again - hand_free).abs().max().item() < 1e-5
        assert package.read_text() == original_text
        assert type(act.__loader__).__name__ == "SourceFileLoader"
    finally:
        sys.modules.pop("fakeact.act", None)
        sys.modules.pop("fakeact", None)


@pytest.mark.parametrize("value, message", [
    (["fakeact.act:TanhGELU.forward"], "expected an object"),
    ({"fakeact.act.TanhGELU.forward": "gelu_tanh"}, "module:function or module:Class.method"),
    ({"fakeact.act:TanhGELU.forward": "fast_gelu"}, "is not one of gelu_tanh"),
])
def test_a_bad_replace_value_is_one_line(value, message) -> None:
    with pytest.raises(KnobError) as err:
        knob_set_from_dict({"replace": value}, "torchaxe.toml")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("torchaxe.toml: replace")


def test_an_installed_formula_is_measured_applied_as_a_knob_and_run_replaces_it(tmp_path: Path) -> None:
    package = fake_package(tmp_path / "site")
    original_text = package.read_text()
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'proj'\n")
    script = project / "train.py"
    script.write_text(TRAIN)

    runs = runs_where(**{"knob:replace-gelu_tanh": 0.07})
    seen = [{"name": "1", "type": "TanhGELU", "calls": 4, "signatures": [
        {"shapes": [[8, 32]], "dtypes": ["float32"], "count": 4}]}]
    advice = advise_with(script, [package], runs, profile_of(modules=seen))
    rec = next(r for r in advice.recommendations if r.key == "knob:replace-gelu_tanh")
    assert rec.status == "measured" and rec.speedup == pytest.approx(0.1 / 0.07)
    assert rec.selected and rec.applies == "knob"
    assert rec.knobs == {"replace": {"fakeact.act:TanhGELU.forward": "gelu_tanh"}}
    assert rec.accuracy.kind == "max_error" and rec.accuracy.max_error < 1e-5
    assert f"{package}:9 TanhGELU.forward: its module ran on [8, 32] in the profiled steps" in rec.evidence
    assert any(e.startswith("micro-benchmark on [8, 32] float32") for e in rec.evidence), rec.evidence
    # The arm ran under the knob; the package is listed, not offered as an edit.
    assert runs.knobs["knob:replace-gelu_tanh"].to_dict()["replace"] == rec.knobs["replace"]
    assert not any(r.key.startswith("installed:") for r in advice.recommendations)

    saved = tmp_path / "advice.json"
    saved.write_text(advice.to_json())
    result = apply_advice(json.loads(saved.read_text()))
    assert result.changed_files == [] and result.config == project / "torchaxe.toml"
    assert package.read_text() == original_text
    knobs, source = read_run_knobs(project)
    assert knobs == {"replace": {"fakeact.act:TanhGELU.forward": "gelu_tanh"}} and source == project / "torchaxe.toml"

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "torchaxe", "run", "--", "python", str(script)], cwd=project,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    words = run.stdout.split()
    assert words[words.index("calls") + 1] == "3"  # the three training forwards
    assert float(words[words.index("difference") + 1]) <= 1e-6
    assert package.read_text() == original_text


def test_apply_fixes_a_formula_in_the_projects_src_folder_beside_the_script(tmp_path: Path) -> None:
    repo, model, script = src_layout(tmp_path, marked=True)

    advice = advise_with(script, [model], runs_where(**{"code:AX110": 0.08}))
    assert advice.scanned["project"] == str(repo) and advice.scanned["project_files"] == 1
    rec = next(r for r in advice.recommendations if r.key == "code:AX110")
    assert rec.status == "measured" and rec.selected and rec.files == [str(model)]

    result = apply_advice(json.loads(advice.to_json()))
    assert result.changed_files == [str(model)] and not result.skipped_outside
    fixed = model.read_text()
    assert "gelu(x, approximate=\"tanh\")" in fixed and "torch.tanh" not in fixed


def test_without_a_marker_the_project_reaches_the_imported_src_folder_beside_the_script(tmp_path: Path) -> None:
    from torchaxe.scan.discover import project_of

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "src" / "pkg").mkdir(parents=True)
    own = repo / "src" / "pkg" / "model.py"
    own.write_text("x = 1\n")
    other = tmp_path / "cloned" / "lib"
    other.mkdir(parents=True)
    (tmp_path / "cloned" / ".git").mkdir()
    (other / "m.py").write_text("x = 1\n")
    venv = repo / "env" / "lib" / "python3.11" / "site-packages"
    venv.mkdir(parents=True)
    (repo / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "dep.py").write_text("x = 1\n")
    import json as stdlib_module

    assert project_of(repo / "scripts", []) == repo / "scripts"
    assert project_of(repo / "scripts", [str(own)]) == repo
    # Another marked project, an environment, Python's own files: none of them widen it.
    assert project_of(repo / "scripts", [str(other / "m.py"), str(venv / "dep.py"), stdlib_module.__file__]) \
        == repo / "scripts"
    (repo / ".git").mkdir()
    assert project_of(repo / "scripts", [str(own)]) == repo
    (repo / "scripts" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert project_of(repo / "scripts", [str(own)]) == repo / "scripts"  # a marker decides


def test_apply_fixes_the_src_folder_of_an_unmarked_project_and_refuses_a_copy(tmp_path: Path) -> None:
    from torchaxe.advise.apply import check_made_here
    from torchaxe.errors import TorchaxeError

    repo, model, script = src_layout(tmp_path, marked=False)

    advice = advise_with(script, [model], runs_where(**{"code:AX110": 0.08}))
    assert advice.scanned["project"] == str(repo) and advice.scanned["project_files"] == 1
    rec = next(r for r in advice.recommendations if r.key == "code:AX110")
    assert rec.status == "measured" and rec.selected and rec.files == [str(model)]
    assert not any(r.applies == "knob" and "replace" in (r.knobs or {}) for r in advice.recommendations)

    saved = json.loads(advice.to_json())
    import shutil

    shutil.copytree(repo, tmp_path / "repo-copy")
    with pytest.raises(TorchaxeError, match="this advice was made for"):
        check_made_here(saved, tmp_path / "repo-copy" / "scripts")
    check_made_here(saved, repo / "scripts")
    result = apply_advice(saved)
    assert result.changed_files == [str(model)] and not result.skipped_outside
    assert "torch.tanh" not in model.read_text()


def test_a_class_the_profile_never_saw_run_is_not_measured(tmp_path: Path) -> None:
    from torchaxe.scan.engine import ScanOptions, scan_paths
    from torchaxe.tune.candidates import replace_candidates

    package = fake_package(tmp_path / "site")
    findings = scan_paths([package], ScanOptions(target="cpu")).findings
    seen, _ = replace_candidates(findings, {"TanhGELU", "Linear"})
    assert [c.knobs for c in seen] == [{"replace": {"fakeact.act:TanhGELU.forward": "gelu_tanh"}}]
    unseen, why = replace_candidates(findings, {"Linear"})
    assert unseen == [] and list(why.values()) == ["no TanhGELU module ran in the profiled steps"]


def _pip_target(folder: Path) -> Path:
    """What ``pip install --target folder`` leaves: a package, a single module, and
    the distributions' .dist-info folders listing them (a script placed in ../bin)."""
    (folder / "vision" / "datasets").mkdir(parents=True)
    (folder / "vision" / "__init__.py").write_text("")
    (folder / "vision" / "datasets" / "coco.py").write_text("x = 1\n")
    (folder / "six.py").write_text("x = 1\n")
    info = folder / "vision-0.1.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("vision/__init__.py,sha256=abc,0\nvision/datasets/coco.py,sha256=def,6\n"
                                 "vision-0.1.dist-info/RECORD,,\n../../bin/vision-tool,sha256=x,9\n")
    six = folder / "six-1.0.dist-info"
    six.mkdir()
    (six / "top_level.txt").write_text("six\n")  # no RECORD: its top-level names
    return folder


def test_a_pip_target_folder_is_installed_code_whatever_its_name(tmp_path: Path) -> None:
    from torchaxe.installs import install_folder
    from torchaxe.runtime.probes import CodeMap
    from torchaxe.scan.discover import discover, in_environment, project_of
    from torchaxe.units import package_path

    review = tmp_path / "review"
    pylib = _pip_target(review / "pylib")
    (pylib / "notes.py").write_text("x = 1\n")  # not pip's: the user's own file beside the packages
    script = review / "dcgan" / "main.py"
    script.parent.mkdir()
    script.write_text("import vision\n")
    coco = pylib / "vision" / "datasets" / "coco.py"
    assert install_folder(coco) == str(pylib.resolve())
    assert install_folder(script) is None and install_folder(pylib / "notes.py") is None
    assert in_environment(coco) and not in_environment(script)
    # The run imported it from beside the script's folder: not the script's project.
    assert project_of(script.parent, [str(coco)]) == script.parent.resolve()
    # A folder walked for a scan leaves pip's packages out, the user's files in.
    found = {p.name for p in discover([review]).files}
    assert found == {"main.py", "notes.py"}
    # Classified and shown as an installed package's file in the run.
    code = CodeMap(internal=(), library=(), installed=(), cwd=str(review))
    assert code.kind(str(coco)) == "library" and code.is_installed(str(coco))
    assert code.kind(str(script)) == "user" and not code.is_installed(str(script))
    assert code.kind(str(pylib / "six.py")) == "library"
    assert code.show_library(str(coco), 3) == "vision/datasets/coco.py:3"
    assert package_path(f"{coco}:43") == "vision/datasets/coco.py:43"
    assert package_path(f"{script}:1") == f"{script}:1"
