"""Start-up: `torchaxe --help`, `torchaxe rules` and a scan whose formula results are
all stored run without importing torch (a lint tool that editors and pre-commit call
must start in a blink), and `--help` lists the lazy commands as they describe
themselves."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import click

from torchaxe.backends import detect_target_without_torch
from torchaxe.cli import LAZY_COMMANDS

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
from torchaxe.cli import main
from torchaxe.scan.formulas import remote
started = []
original = remote.Evaluator.__init__
def counting(self, *args, **kwargs):
    started.append(1)
    original(self, *args, **kwargs)
remote.Evaluator.__init__ = counting
code = main(json.loads(sys.argv[1]))
sys.stdout.flush()
sys.stderr.write(json.dumps({"code": code, "torch": "torch" in sys.modules, "evaluators": len(started)}) + "\\n")
"""


def _run(args: list[str], home: Path) -> dict:
    env = {**os.environ, "TORCHAXE_HOME": str(home)}
    env.pop("TORCHAXE_NO_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["rules"], ["rules", "AX101"], ["scan", "--help"]])
def test_quick_commands_do_not_import_torch(args, tmp_path):
    result = _run(args, tmp_path)
    assert result["code"] == 0 and result["torch"] is False


@pytest.mark.slow
def test_a_scan_with_every_result_stored_imports_no_torch_and_starts_no_evaluator(tmp_path):
    tree = tmp_path / "project"
    tree.mkdir()
    source = (ROOT / "tests" / "formula_corpus" / "gelu.py").read_text(encoding="utf-8")
    for i in range(100):  # more than two chunks, so the scan runs in parallel
        (tree / f"m{i}.py").write_text(source + f"\n\nVALUE_{i} = {i}\n", encoding="utf-8")
    home = tmp_path / "home"
    cold = _run(["scan", "--jobs", "2", "--target", "cpu", str(tree)], home)
    assert cold["code"] == 1 and cold["evaluators"] == 1
    warm = _run(["scan", "--jobs", "2", "--target", "cpu", str(tree)], home)
    assert warm == {"code": 1, "torch": False, "evaluators": 0}


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_help_describes_each_lazy_command_as_the_command_does(name):
    module, attribute = LAZY_COMMANDS[name][0].split(":")
    command = getattr(importlib.import_module(module), attribute)
    assert command.short_help is None
    first = " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split())
    assert LAZY_COMMANDS[name][1] == first
    for limit in (40, 80):
        stand_in = click.Command(name, help=LAZY_COMMANDS[name][1])
        assert stand_in.get_short_help_str(limit) == command.get_short_help_str(limit)


def _machine(root: Path, devices: list[str]) -> Path:
    (root / "dev").mkdir(parents=True)
    for d in devices:
        (root / "dev" / d).write_text("")
    return root


def test_target_is_read_from_device_nodes_without_torch(tmp_path, monkeypatch):
    import torchaxe.backends as backends

    monkeypatch.setattr(backends, "_torch_gpu_build", lambda spec: True)
    gpu = _machine(tmp_path / "gpu", ["nvidia0", "nvidiactl"])
    assert detect_target_without_torch(gpu, {}) == "cuda"
    assert detect_target_without_torch(gpu, {"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    assert detect_target_without_torch(_machine(tmp_path / "none", ["null"]), {}) == "cpu"
    monkeypatch.setattr(backends, "_torch_gpu_build", lambda spec: False)  # a CPU build of torch
    assert detect_target_without_torch(gpu, {}) == "cpu"


def test_torch_build_is_read_from_its_version_file(tmp_path):
    import importlib.machinery

    from torchaxe.backends import _torch_gpu_build

    for text, expected in (("cuda: Optional[str] = '12.4'\nhip = None\n", True),
                           ("cuda = None\nhip: Optional[str] = '6.1'\n", True),
                           ("cuda: Optional[str] = None\nhip = None\n", False)):
        folder = tmp_path / str(len(text))
        folder.mkdir()
        (folder / "version.py").write_text(text)
        spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        assert _torch_gpu_build(spec) is expected
