"""What `make demo` shows: a scan of the bundled examples finds something in every
category of the scanner, and the fixed examples still parse and fix idempotently."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from torchaxe.scan.engine import ScanOptions, scan_paths
from torchaxe.scan.fix import fix_paths

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CATEGORIES = {
    "optimizer_unfused",
    "zero_grad_no_set_to_none",
    "host_sync_in_loop",
    "host_tensor_to_device",
    "dataloader_config",
    "image_decode",
    "affinity_api",
    # The hand-written formulas of examples/gpt (AX110, AX115, AX118).
    "gelu_tanh",
    "rms_norm",
    "attention",
    # examples/ddp: accumulation that all-reduces every micro-batch (AX601), the loss
    # all-reduced every step only to print it (AX603), find_unused_parameters=True (AX604).
    "ddp_accumulation_sync",
    "collective_for_logging",
    "ddp_find_unused",
}


def test_demo_scan_finds_every_category():
    result = scan_paths([EXAMPLES], ScanOptions(target="npu"))
    assert not result.diagnostics
    assert {f.category for f in result.findings} == CATEGORIES


@pytest.mark.parametrize("target", ["cpu", "cuda", "npu"])
def test_fix_round_trip_on_the_examples(tmp_path, target):
    copy = tmp_path / "examples"
    shutil.copytree(EXAMPLES, copy, ignore=shutil.ignore_patterns("data", "__pycache__"))
    before = scan_paths([copy], ScanOptions(target=target))
    result = fix_paths([copy], ScanOptions(target=target), unsafe=True)
    assert not result.diagnostics
    assert result.applied > 0
    for path in copy.rglob("*.py"):
        ast.parse(path.read_text())
    after = scan_paths([copy], ScanOptions(target=target))
    # Everything fixable was fixed (a fix may enable another: pinned memory makes
    # non_blocking copies worth it); what is left is advice without an automatic edit.
    assert len(after.findings) < len(before.findings)
    assert all(not (f.fix and f.fix.edits) for f in after.findings)
    snapshot = {p: p.read_text() for p in copy.rglob("*.py")}
    again = fix_paths([copy], ScanOptions(target=target), unsafe=True)
    assert again.applied == 0
    assert snapshot == {p: p.read_text() for p in copy.rglob("*.py")}
