"""benchmarks/real_recall.py: reads its manifest, finds the files, scores recall and
false positives per class, and says in one line why it cannot run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from conftest import benchmark_module


TRAIN = """\
import torch


def fit(model, loader, optimizer, scaler):
    for x, y in loader:
        x = x.to("cuda", non_blocking=True)
        with torch.autocast("cuda"):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(loss.item())


def evaluate(model, loader):
    for x, y in loader:
        print(model(x, y).item())


def make(params, lr):
    settings = {"lr": lr}
    return torch.optim.AdamW(params, **settings)
"""

MANIFEST = """\
[[file]]
repo = "someone/trainer"
commit = "0123456789abcdef0123456789abcdef01234567"
path = "src/train.py"
cases = [
  { lines = [12, 12], class = "loop_sync_helper", kind = "positive" },
  { lines = [17, 17], class = "loop_sync_helper", kind = "lookalike" },
  { lines = [%s, %s], class = "optimizer_kwargs", kind = "positive" },
]

[[file]]
repo = "someone/trainer"
commit = "fedcba9876543210fedcba9876543210fedcba98"
path = "src/train.py"
cases = [
  { lines = [17, 17], class = "loop_sync_helper", kind = "positive", note = "an evaluation loop, labelled wrong" },
]
"""


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("real_recall") as module:
        yield module


def _corpus(tmp_path: Path, optimizer_line: int = 22) -> tuple[Path, Path]:
    manifest = tmp_path / "corpus.toml"
    manifest.write_text(MANIFEST % (optimizer_line, optimizer_line))
    sources = tmp_path / "sources"
    for folder in ("someone+trainer", "someone+trainer@fedcba987654"):
        target = sources / folder / "src" / "train.py"
        target.parent.mkdir(parents=True)
        target.write_text(TRAIN)
    return manifest, sources


def _run(bench, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = bench.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_scores_each_class_and_fails_on_a_miss(bench, tmp_path):
    manifest, sources = _corpus(tmp_path)
    code, out, _ = _run(bench, "--manifest", str(manifest), "--sources", str(sources), "--json")
    data = json.loads(out)
    loops, optimizers = data["classes"]["loop_sync_helper"], data["classes"]["optimizer_kwargs"]
    # The training loop's read is found; the evaluation loop's is not, so the case
    # labelled positive there is a miss and the look-alike is no false positive.
    assert (loops["positives"], loops["found"], loops["lookalikes"], loops["false_positives"]) == (2, 1, 1, 0)
    assert (optimizers["positives"], optimizers["found"]) == (1, 1)
    assert data["overall"]["recall"] == pytest.approx(2 / 3)
    assert data["corpus"] == {"files": 2, "context_files": 0, "repositories": 1, "positives": 3, "lookalikes": 1}
    assert data["status"] == "FAIL" and code == 1
    assert loops["misses"] == ["someone/trainer/src/train.py:17-17 (an evaluation loop, labelled wrong)"]


def test_a_false_positive_fails_even_at_full_recall(bench, tmp_path):
    manifest, sources = _corpus(tmp_path)
    text = manifest.read_text().replace('kind = "lookalike"', 'kind = "positive"')
    text = text.replace('{ lines = [17, 17], class = "loop_sync_helper", kind = "positive", note',
                        '{ lines = [12, 12], class = "loop_sync_helper", kind = "lookalike", note')
    manifest.write_text(text)
    code, out, _ = _run(bench, "--manifest", str(manifest), "--sources", str(sources))
    assert code == 1
    assert "false positive (loop_sync_helper): someone/trainer/src/train.py:12-12 AX301:12" in out


def test_print_fetch_names_every_file_at_its_commit(bench, tmp_path):
    manifest, _ = _corpus(tmp_path)
    code, out, _ = _run(bench, "--manifest", str(manifest), "--sources", "/data/real", "--print-fetch")
    assert code == 0
    assert out.count("git clone") == 1
    assert "show 0123456789abcdef0123456789abcdef01234567:src/train.py > /data/real/someone+trainer/src/train.py" in out
    assert "> /data/real/someone+trainer@fedcba987654/src/train.py" in out


def test_context_files_are_fetched_and_scanned_but_not_counted(bench, tmp_path):
    # A training script whose criterion reads the output of a model another file of
    # the repository defines: labelled positive, found only with that file scanned.
    manifest = tmp_path / "corpus.toml"
    commit = "0123456789abcdef0123456789abcdef01234567"
    manifest.write_text(f"""\
[[file]]
repo = "someone/gan"
commit = "{commit}"
path = "train.py"
cases = [{{ lines = [7, 7], class = "bce_on_sigmoid", kind = "positive" }}]

[[file]]
repo = "someone/gan"
commit = "{commit}"
path = "nets.py"
cases = []
""")
    folder = tmp_path / "sources" / "someone+gan"
    folder.mkdir(parents=True)
    (folder / "train.py").write_text("import torch\nfrom nets import D\nnet = D()\ncriterion = torch.nn.BCELoss()\n"
                                     "for x, y in data:\n    p = net(x)\n    loss = criterion(p, y)\n")
    (folder / "nets.py").write_text("import torch\nclass D(torch.nn.Module):\n    def forward(self, x):\n"
                                    "        return torch.sigmoid(self.fc(x))\n")
    code, out, _ = _run(bench, "--manifest", str(manifest), "--sources", str(tmp_path / "sources"), "--json")
    data = json.loads(out)
    assert data["corpus"]["files"] == 1 and data["corpus"]["context_files"] == 1
    assert data["overall"]["found"] == 1 and code == 0
    code, out, _ = _run(bench, "--manifest", str(manifest), "--sources", "/data/real", "--print-fetch")
    assert f"show {commit}:nets.py > /data/real/someone+gan/nets.py" in out
    (folder / "nets.py").unlink()
    code, _, err = _run(bench, "--manifest", str(manifest), "--sources", str(tmp_path / "sources"))
    assert code == 2 and "1 listed files are missing" in err


@pytest.mark.parametrize("problem", ["no sources", "missing file", "bad manifest", "unknown class"])
def test_cannot_run_is_one_line_and_exit_2(bench, tmp_path, problem):
    manifest, sources = _corpus(tmp_path)
    if problem == "no sources":
        sources = tmp_path / "nowhere"
    elif problem == "missing file":
        (sources / "someone+trainer" / "src" / "train.py").unlink()
    elif problem == "bad manifest":
        manifest.write_text("[[file]\n")
    else:
        manifest.write_text(manifest.read_text().replace("optimizer_kwargs", "optimiser"))
    code, out, err = _run(bench, "--manifest", str(manifest), "--sources", str(sources))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("real_recall: error: ") and len(lines) <= 2


def test_each_corpus_is_saved_under_its_own_name(bench):
    root = Path(bench.__file__).resolve().parent
    assert bench.benchmark_name(root / "real_corpus.toml") == "real_recall"
    assert bench.benchmark_name(root / "real_corpus_distributed.toml") == "real_recall_distributed"
    assert bench.benchmark_name(Path("/elsewhere/mine.toml")) == "real_recall"


def test_the_distributed_manifest_reads_and_labels_only_its_classes(bench):
    cases = bench.load_manifest(Path(bench.__file__).resolve().parent / "real_corpus_distributed.toml")
    classes = {c.cls for c in cases}
    assert classes <= {cls for cls, rules in bench.CLASSES.items() if rules[0].startswith("AX6")}
    assert {c.kind for c in cases} == {"positive", "lookalike"}
    assert all(len(c.commit) == 40 for c in cases)
