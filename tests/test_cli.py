"""The command line as a user meets it: exit codes, one-line errors, --help,
configuration from pyproject.toml, --package, --output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchaxe.cli import main

OPT = "import torch\nopt = torch.optim.AdamW(params)\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(OPT)
    return tmp_path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_scan_json_contract(project, capsys):
    code, out, err = run(capsys, "scan", "--target", "cpu", "--format", "json", "train.py")
    assert code == 1
    data = json.loads(out)
    assert set(data) >= {"version", "target", "findings", "diagnostics", "stats"}
    assert data["target"] == "cpu"
    (f,) = data["findings"]
    assert set(f) >= {"code", "category", "message", "path", "line", "end_line", "col", "end_col", "replacement", "fix"}
    assert f["path"] == "train.py" and f["fix"]["applicability"] == "unsafe"
    assert set(data["stats"]) == {"files_scanned", "files_skipped", "seconds"}


def test_clean_scan_exits_zero(project, capsys):
    (project / "train.py").write_text("import torch\nx = torch.ones(3)\n")
    code, out, _ = run(capsys, "scan", "--target", "cpu", "train.py")
    assert code == 0 and "No findings" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (("scan", "missing.py"), "no such file or folder: missing.py"),
        (("scan", "--select", "ZZ1", "train.py"), "matches no rule"),
        (("scan", "--target", "tpu", "train.py"), "'tpu' is not one of"),
        (("scan", "--package", "surely-not-installed-xyz"), "no installed distribution"),
        (("scan",), "nothing to scan"),
        (("rules", "AX999"), "unknown rule"),
        (("scan", "--bogus"), "No such option"),
    ],
)
def test_errors_are_one_line_with_exit_2(project, capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert err.startswith("torchaxe: error: ")


def test_config_from_pyproject_and_flag_override(project, capsys):
    (project / "pyproject.toml").write_text('[tool.torchaxe]\ntarget = "npu"\nignore = ["AX1"]\nformat = "json"\n')
    code, out, _ = run(capsys, "scan", "train.py")
    data = json.loads(out)
    assert data["target"] == "npu"
    assert data["findings"][0]["replacement"].startswith("torch_npu.optim.NpuFusedAdamW")
    code, out, _ = run(capsys, "scan", "--target", "cpu", "train.py")
    assert json.loads(out)["target"] == "cpu"


def test_bad_config_is_a_clear_error(project, capsys):
    (project / "pyproject.toml").write_text("[tool.torchaxe]\ncolour = 'red'\n")
    code, _, err = run(capsys, "scan", "train.py")
    assert code == 2 and "unknown torchaxe setting 'colour'" in err


def test_output_file_is_written(project, capsys):
    code, out, _ = run(capsys, "scan", "--target", "cpu", "--format", "csv", "-o", "report.csv", "train.py")
    assert code == 1 and out == ""
    assert (project / "report.csv").read_text().startswith("File,Start Line,End Line,Category,Call,Replacement")


def test_package_scans_installed_sources(project, capsys, tmp_path_factory, monkeypatch):
    site = tmp_path_factory.mktemp("site")
    pkg = site / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(OPT)
    monkeypatch.syspath_prepend(str(site))
    code, out, _ = run(capsys, "scan", "--target", "cpu", "--format", "json", "--package", "fakepkg")
    data = json.loads(out)
    assert code == 1 and data["findings"][0]["path"].endswith("fakepkg/__init__.py")


def test_fix_diff_and_unsafe(project, capsys):
    code, out, err = run(capsys, "fix", "--target", "cpu", "--diff", "--unsafe-fixes", "train.py")
    assert code == 1 and "+opt = torch.optim.AdamW(params, fused=True)" in out
    assert (project / "train.py").read_text() == OPT
    code, out, err = run(capsys, "fix", "--target", "cpu", "train.py")
    assert "1 more can be fixed with --unsafe-fixes" in err
    code, out, err = run(capsys, "fix", "--target", "cpu", "--unsafe-fixes", "train.py")
    assert code == 0 and "Fixed 1 finding(s) in 1 file(s)" in err
    assert "fused=True" in (project / "train.py").read_text()


def test_rules_list_and_explain(capsys):
    code, out, _ = run(capsys, "rules")
    assert code == 0 and "AX201" in out and "unfused-optimizer" in out
    code, out, _ = run(capsys, "rules", "AX201")
    assert code == 0 and "Why is this bad?" in out and "Fix safety" in out
    code, out, _ = run(capsys, "rules", "--format", "json")
    assert any(r["code"] == "AX201" and r["has_fix"] for r in json.loads(out))


def test_help_explains_each_verb(capsys):
    for verb in ("scan", "fix", "rules"):
        code, out, _ = run(capsys, verb, "--help")
        assert code == 0 and "Usage: torchaxe " + verb in out


@pytest.mark.slow
def test_console_script_exit_code_and_no_traceback(project):
    exe = Path(sys.executable).with_name("torchaxe")
    proc = subprocess.run([str(exe), "scan", "--target", "cpu", "train.py"], capture_output=True, text=True)
    assert proc.returncode == 1 and "AX201" in proc.stdout
    proc = subprocess.run([str(exe), "scan", "nope.py"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0


def test_import_torchaxe_is_light():
    code = "import sys, torchaxe, torchaxe.findings, torchaxe.cli; print(sorted(m for m in ('torch', 'torch_npu', 'matplotlib', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_terminated_measuring_command_ends_the_runs_it_started(tmp_path):
    # Measured runs are started in sessions of their own (so that each ends whole): a
    # SIGTERM to torchaxe (a scheduler, a closed terminal) would leave them running.
    import signal
    import subprocess
    import time

    import psutil

    script = tmp_path / "train.py"
    script.write_text(
        "import time, torch\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(10000):\n"
        "    (w * 2).sum().backward()\n"
        "    opt.step()\n"
        "    time.sleep(0.2)\n")
    knobs = tmp_path / "a.json"
    knobs.write_text('{"name": "a"}')
    proc = subprocess.Popen([sys.executable, "-m", "torchaxe", "trial", "--knobs", str(knobs), "--steps", "5000",
                             "--", "python", str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    children: list = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not children:
        time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the run never started"
    time.sleep(2.0)  # well inside the run
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
