"""The bundled example training scripts run end to end, and stay untuned.

Each example is run as a subprocess for two steps on the CPU; the run must exit 0 and
print only finite losses. A second, fast set of checks makes sure nobody "fixes" the
slow patterns that the demo and the scanner tests rely on.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+)", re.MULTILINE)
DONE_LINE = re.compile(r"^done: (\d+) steps, final loss ([^,\s]+)", re.MULTILINE)


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ)
    # One intra-op thread: under `pytest -n auto` several runs share a few cores, and
    # OpenMP threads competing for them make a step take many times longer.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, str(EXAMPLES / name / "train.py"), "--device", "cpu", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, f"{name} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def assert_finite_losses(stdout: str, steps: int) -> None:
    logged = STEP_LINE.findall(stdout)
    assert [int(step) for step, _, _ in logged] == list(range(1, steps + 1)), stdout
    for _, _, loss in logged:
        assert math.isfinite(float(loss)), stdout
    done = DONE_LINE.search(stdout)
    assert done is not None, f"no final line in:\n{stdout}"
    assert int(done.group(1)) == steps
    assert math.isfinite(float(done.group(2))), stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,args",
    [
        pytest.param("gpt", (), id="gpt"),
        pytest.param("gpt", ("--mlp", "erf", "--n-layers", "1", "--d-model", "32", "--seq-len", "16"), id="gpt-erf-tiny"),
        pytest.param("seq_varlen", (), id="seq_varlen"),
    ],
)
def test_example_runs(name: str, args: tuple[str, ...]) -> None:
    stdout = run_example(name, "--steps", "2", "--log-every", "1", *args)
    assert_finite_losses(stdout, steps=2)


@pytest.mark.slow
def test_image_classifier_runs_on_generated_jpegs(tmp_path: Path) -> None:
    data_dir = tmp_path / "images"
    stdout = run_example("image_classifier", "--steps", "2", "--log-every", "1", "--data-dir", str(data_dir))
    assert_finite_losses(stdout, steps=2)
    assert len(list(data_dir.glob("*/*.jpg"))) == 64
    assert (data_dir / "COMPLETE").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["images"], "staging folder left behind"


# ------------------------------------------------------------- fast checks, no subprocess


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / name / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_images_are_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    example = load_example("image_classifier")
    example.ensure_dataset(tmp_path / "a", images_per_class=2, size=32, seed=0)
    example.ensure_dataset(tmp_path / "b", images_per_class=2, size=32, seed=0)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.jpg"))
    assert len(files_a) == 8 and files_a == files_b
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_image_data_dir_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    example = load_example("image_classifier")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a complete generated data set"):
        example.ensure_dataset(tmp_path, images_per_class=1, size=32, seed=0)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_varlen_batches_change_shape() -> None:
    example = load_example("seq_varlen")
    defaults = example.parse_args([])
    assert defaults.num_samples % defaults.batch_size != 0, "the last batch must be a different size"
    dataset = example.MarkerSequences(100, 4, 40, vocab_size=32, num_classes=4, seed=0)
    lengths = {len(dataset[i][0]) for i in range(len(dataset))}
    assert len(lengths) > 10
    for tokens, label in (dataset[i] for i in range(len(dataset))):
        counts = [int((tokens == marker).sum()) for marker in range(1, 5)]
        assert counts[label] > max(c for i, c in enumerate(counts) if i != label)
    tokens, seq_lengths, labels = example.pad_collate([dataset[0], dataset[1], dataset[2]])
    assert tokens.shape == (3, int(seq_lengths.max()))
    assert labels.tolist() == [dataset[i][1] for i in range(3)]


#: What each example must keep doing, slowly, for the demo and the scanner to find.
SLOW_PATTERNS = {
    "gpt": (
        "0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))",
        "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight",
        "q @ k.transpose(-2, -1) / math.sqrt(",
        "masked_fill(",
        "F.gelu(",
        "torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)",
        "optimizer.zero_grad(set_to_none=False)",
        "loss.item()",
        "batch = batch.to(device)\n",
        ").to(device)",
    ),
    "image_classifier": (
        'Image.open(path).convert("RGB")',
        "num_workers=args.num_workers)",
        "torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)",
        ".cpu().numpy()",
        ".tolist()",
        "print(loss)",
    ),
    "seq_varlen": (
        "pad_sequence(",
        "drop_last=False",
        "torch.optim.Adam(model.parameters(), lr=args.lr)",
        "float(loss)",
    ),
}


TUNED_KEYWORDS = {"fused", "foreach", "pin_memory", "persistent_workers", "non_blocking"}


@pytest.mark.parametrize("name", sorted(SLOW_PATTERNS))
def test_examples_stay_untuned(name: str) -> None:
    source = (EXAMPLES / name / "train.py").read_text()
    for pattern in SLOW_PATTERNS[name]:
        assert pattern in source, f"examples/{name}/train.py no longer contains {pattern!r}"
    # The docstrings name the tuned options; the code must not use them.
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword):
            assert node.arg not in TUNED_KEYWORDS, f"examples/{name}/train.py was tuned: line {node.value.lineno} passes {node.arg}="
        if isinstance(node, ast.Attribute):
            assert node.attr != "scaled_dot_product_attention", f"examples/{name}/train.py uses the fused attention"
