"""Fixes: atomic writes that keep the mode, imports added once in the right place,
files left alone when the result would not parse, and a second run changing nothing."""

from __future__ import annotations

import os
import stat

import pytest

from torchaxe.findings import Applicability, Edit, Fix, Position
from torchaxe.scan.engine import ScanOptions
from torchaxe.atomic import write_text_atomic
from torchaxe.scan.fix import add_imports, apply_edits, fix_paths

TRAIN = '''"""Train a small model."""
from __future__ import annotations

import torch
import torch.nn.functional as F

model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def act(x):
    return F.gelu(x)
'''


def test_safe_only_by_default_unsafe_on_request(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    result = fix_paths([f], ScanOptions(target="cpu"))
    assert result.applied == 0 and f.read_text() == TRAIN
    assert result.remaining >= 1
    result = fix_paths([f], ScanOptions(target="cpu"), unsafe=True)
    assert result.applied == 1
    assert "torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)" in f.read_text()


def test_npu_fix_adds_the_import_once_after_the_import_block(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    fix_paths([f], ScanOptions(target="npu"), unsafe=True)
    text = f.read_text()
    assert text.count("import torch_npu\n") == 1
    lines = text.splitlines()
    assert lines.index("import torch_npu") == lines.index("import torch.nn.functional as F") + 1
    assert "torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)" in text
    assert "return torch_npu.fast_gelu(x)" in text
    # A second run changes nothing.
    again = fix_paths([f], ScanOptions(target="npu"), unsafe=True)
    assert again.applied == 0 and f.read_text() == text


def test_diff_writes_nothing(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    result = fix_paths([f], ScanOptions(target="cpu"), unsafe=True, write=False)
    assert f.read_text() == TRAIN
    (changed,) = [x for x in result.files if x.changed]
    diff = changed.diff()
    assert "+opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)" in diff
    assert diff.startswith("---")


def test_write_keeps_mode_and_leaves_no_temp_files(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    f.chmod(0o751)
    fix_paths([f], ScanOptions(target="cpu"), unsafe=True)
    assert stat.S_IMODE(f.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_a_read_only_file_is_left_unchanged_and_said_so(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    f.chmod(0o444)  # even for root, who could rename over it
    result = fix_paths([f], ScanOptions(target="cpu"), unsafe=True)
    assert f.read_text() == TRAIN and result.applied == 0
    assert [(d.code, d.message) for d in result.diagnostics] == [
        ("AX909", "read-only file: left unchanged (make it writable to fix it)")]


def test_failed_write_leaves_original_untouched(tmp_path, monkeypatch):
    f = tmp_path / "train.py"
    f.write_text(TRAIN)

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_text_atomic(f, "broken")
    assert f.read_text() == TRAIN
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_fix_that_would_not_parse_is_refused(tmp_path, monkeypatch):
    import torchaxe.scan.fix as fixmod

    f = tmp_path / "train.py"
    f.write_text(TRAIN)
    monkeypatch.setattr(fixmod, "apply_edits", lambda source, fixes: (source + "def (:\n", list(range(len(fixes)))))
    result = fix_paths([f], ScanOptions(target="cpu"), unsafe=True)
    assert f.read_text() == TRAIN
    assert [d.code for d in result.diagnostics] == ["AX908"]
    assert "would not parse" in result.diagnostics[0].message


def test_overlapping_fixes_apply_one_and_keep_the_other():
    a = Fix(Applicability.SAFE, "a", (Edit(Position(1, 1), Position(1, 4), "AAA"),))
    b = Fix(Applicability.SAFE, "b", (Edit(Position(1, 2), Position(1, 5), "BBB"),))
    text, applied = apply_edits("abcdef\n", [a, b])
    assert text == "AAAdef\n" and applied == [0]


@pytest.mark.parametrize(
    "source,expected",
    [
        ("x = 1\n", "import torch_npu\nx = 1\n"),
        ('"""Doc."""\nx = 1\n', '"""Doc."""\nimport torch_npu\nx = 1\n'),
        ("import os\nimport torch\n\nx = 1\n", "import os\nimport torch\nimport torch_npu\n\nx = 1\n"),
        ("import torch_npu.optim\nx = 1\n", "import torch_npu.optim\nx = 1\n"),
        ("import torch_npu as tn\nx = 1\n", "import torch_npu as tn\nimport torch_npu\nx = 1\n"),
        # An import inside a function binds a local name only: the module still needs one.
        ("import os\ndef f():\n    import torch_npu\n", "import os\nimport torch_npu\ndef f():\n    import torch_npu\n"),
        ("try:\n    import torch_npu\nexcept ImportError:\n    pass\n", "try:\n    import torch_npu\nexcept ImportError:\n    pass\n"),
    ],
)
def test_add_imports(source, expected):
    assert add_imports(source, ["import torch_npu", "import torch_npu"]) == expected
