"""AX702 (a gradient scaler beside bfloat16 autocast) beyond its inline examples: the
fixed script still trains, with the scaler passing its calls through."""

from __future__ import annotations

import subprocess
import sys

from torchaxe.findings import Applicability
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source

SCRIPT = '''\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(20):
    with torch.autocast("cpu"):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(scaler.is_enabled(), loss.item())
'''


def _options() -> ScanOptions:
    return ScanOptions(target="cpu", select=("AX702",), capabilities=torch_capabilities("cpu"))


def test_fixed_script_trains_with_the_scaler_passing_through(tmp_path):
    report = scan_source(SCRIPT, "t.py", _options())
    (finding,) = report.findings
    assert finding.line == 6 and finding.fix.applicability == Applicability.UNSAFE
    assert "step() waits for the host" in finding.message
    result = fix_source(SCRIPT, "t.py", _options(), unsafe=True)
    assert 'torch.amp.GradScaler("cpu", enabled=False)' in result.fixed
    runs = {}
    for name, text in (("before", SCRIPT), ("after", result.fixed)):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        enabled, loss = run.stdout.split()
        runs[name] = (enabled, float(loss))
    assert runs["before"][0] == "True" and runs["after"][0] == "False"
    # The same training: only the scaling (a power of two, undone before the step) is gone.
    assert abs(runs["before"][1] - runs["after"][1]) <= 0.05 * abs(runs["before"][1]) + 1e-3
    assert not scan_source(result.fixed, "t.py", _options()).findings
