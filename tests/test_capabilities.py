"""The optimizer facts rules rely on are read from the installed torch's sources
and agree with its real signatures, without importing torch."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import torch
import torch.optim as optim

from torchaxe.scan.capabilities import torch_capabilities


def test_capabilities_match_real_signatures_without_importing_torch():
    code = (
        "import sys, json; from torchaxe.scan.capabilities import torch_capabilities as c;"
        "print(json.dumps([c('cpu'), 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    caps, imported = json.loads(out)
    assert not imported
    real = sorted(
        name
        for name, cls in vars(optim).items()
        if isinstance(cls, type) and issubclass(cls, optim.Optimizer) and "fused" in inspect.signature(cls).parameters
    )
    assert caps["fused_optimizers"] == real
    assert caps["torch_version"] == torch.__version__


def test_target_without_fused_kernels_gets_none(monkeypatch):
    import torchaxe.scan.capabilities as capabilities

    monkeypatch.setattr(capabilities, "_introspect", lambda: (("Adam",), ("cuda",), "2.13.0"))
    assert torch_capabilities("cuda")["fused_optimizers"] == ["Adam"]
    assert torch_capabilities("cpu")["fused_optimizers"] == []
