"""Shared fixtures: scanning text in memory with chosen options."""

from __future__ import annotations

import pytest

from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.capabilities import torch_capabilities


def scan_text(source: str, target: str = "cpu", select: tuple[str, ...] = (), path: str = "t.py"):
    options = ScanOptions(target=target, select=select, capabilities=torch_capabilities(target))
    return scan_source(source, path, options)


@pytest.fixture
def scan():
    return scan_text
