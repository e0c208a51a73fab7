"""benchmarks/scan_speed.py must keep running and keep its documented JSON shape."""

from __future__ import annotations

import io
import itertools
import json
import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS, benchmark_module

SCRIPT = BENCHMARKS / "scan_speed.py"


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("scan_speed") as module:
        yield module


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(
        "import torch\nopt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
    )
    (tmp_path / "loader.py").write_text(
        "from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=8)\n"
    )
    (tmp_path / "plain.py").write_text("print('no framework here')\n")
    return tmp_path


def _fake_timer():
    """Each call advances one second: every timed span is exactly 1 s."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def test_json_has_documented_keys(bench, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["--tree", str(_tree(tmp_path)), "--repeats", "1", "--jobs", "1,2", "--sample", "2",
            "--no-torchfix", "--json"]
    clocks = bench.Clocks(wall=_fake_timer(), cpu=_fake_timer())
    code = bench.main(argv, stdout=out, stderr=err, clocks=clocks,
                      capabilities={"torch_version": None, "fused_optimizers": ["Adam", "AdamW", "SGD"]})
    assert code in (0, 1), err.getvalue()
    data = json.loads(out.getvalue())
    assert tuple(data) == bench.JSON_KEYS
    assert data["files_total"] == 3
    assert set(data["full_tree"]) == {"jobs=1", "jobs=2"}
    for m in [*data["full_tree"].values(), data["sample"]["torchaxe_inprocess_jobs1"]]:
        assert tuple(m) == bench.MEASUREMENT_KEYS
        assert m["seconds"] == [1.0] and m["cpu_seconds"] == [1.0]
    assert data["full_tree"]["jobs=1"]["files_per_s_median"] == 3.0
    assert tuple(data["scan"]) == bench.SCAN_KEYS
    assert data["scan"]["files_scanned"] + data["scan"]["files_skipped"] == 3
    assert data["scan"]["crashes"] == 0
    assert data["sample"]["files"] == 2 and data["sample"]["torchfix"] is None
    assert all(v is None for v in data["ratios"].values())
    statuses = {t["name"]: t["status"] for t in data["targets"]}
    assert statuses == {
        "full tree --jobs 2 >= 300 files/s": "FAIL",
        "sample in-process --jobs 1 >= 100x torchfix": "SKIP",
        "zero crashes (AX906)": "PASS",
        "torchaxe --help <= 0.3 s": "FAIL",  # every span of the fake clock is 1 s
        "warm 81-file project CLI --jobs 2 >= 40x torchfix": "SKIP",
    }
    assert tuple(data["startup"]) == bench.STARTUP_KEYS
    assert data["startup"]["project_files"] == 3 and data["startup"]["torchfix_help"] is None
    assert data["startup"]["torchaxe_help"]["seconds"] == [1.0] * 5
    assert "scan_speed:" in err.getvalue()


def test_bad_flag_is_one_line(bench):
    err = io.StringIO()
    assert bench.main(["--jobs", "two"], stdout=io.StringIO(), stderr=err) == 2
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("scan_speed: error:")


def test_cpu_model_from_canned_text(bench):
    text = "processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\nflags\t: fpu\n"
    assert bench.cpu_model(text) == "Example CPU @ 2.0GHz"


def test_work_counts_of_a_cold_scan(tmp_path: Path) -> None:
    """--work counts what the formula machinery did, noise-free, in its own process."""
    import subprocess

    (tmp_path / "act.py").write_text(
        "import math\nimport torch\n\n\ndef gelu(x):\n"
        "    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))\n\n\n"
        "def count(x):\n    return x.sum() / x.numel()\n")
    (tmp_path / "plain.py").write_text("print('no framework here')\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "--work", "--json", "--tree", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert set(data) >= {"files_analysed", "trees_evaluated", "findings", "jobs2_findings"}
    assert data["findings"] == data["jobs2_findings"] >= 1  # the GELU, found alike in and out of process
    assert 1 <= data["files_analysed"] <= 2
