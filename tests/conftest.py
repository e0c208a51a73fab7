"""Shared fixtures: scanning text in memory with chosen options."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Keep the tests' on-disk state (the formula fingerprint store) out of the user's
# cache folder; every test process gets its own.
if "TORCHAXE_HOME" not in os.environ:
    os.environ["TORCHAXE_HOME"] = tempfile.mkdtemp(prefix="torchaxe-test-home-")
    atexit.register(shutil.rmtree, os.environ["TORCHAXE_HOME"], True)

from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.capabilities import torch_capabilities


#: The benchmark scripts, which the tests load by path (benchmarks/ is not a package).
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str):
    """``benchmarks/<name>.py`` loaded as a module for the ``with`` block. It is listed in
    ``sys.modules`` meanwhile, because dataclasses look their module up by name."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def scan_text(source: str, target: str = "cpu", select: tuple[str, ...] = (), path: str = "t.py"):
    options = ScanOptions(target=target, select=select, capabilities=torch_capabilities(target))
    return scan_source(source, path, options)


@pytest.fixture
def scan():
    return scan_text


class CountingBackend:
    """A torch.compile backend that runs each captured graph as it is and counts the
    runs: a test sees whether a module really ran compiled."""

    def __init__(self) -> None:
        self.runs: list[int] = []

    def __call__(self, gm, inputs):
        def run(*args):
            self.runs.append(1)
            return gm.forward(*args)
        return run


@pytest.fixture
def counting_backend() -> CountingBackend:
    return CountingBackend()
