"""The cuda paths on a real GPU: skipped on machines without one (CI has none).

What the cpu tests can only check against stand-ins: that the harness waits for the
device before it reads the clock, that device memory is read per step, that the
prefetcher's side-stream copies hand out the right batches, that the runtime knobs
(cudnn.benchmark, TF32, autocast) are applied in a trial run on the device, and that
tune's timer measures device time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from profile_support import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: A step of about 20 ms of device time that returns at once on the host.
SLEEPY = """\
import sys
import torch
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64, device="cuda")
torch.cuda._sleep(1000)
torch.cuda.synchronize()
start = torch.cuda.Event(enable_timing=True); end = torch.cuda.Event(enable_timing=True)
start.record(); torch.cuda._sleep(10_000_000); end.record(); end.synchronize()
cycles = int(10_000_000 * 20.0 / start.elapsed_time(end))   # cycles for 20 ms
for _ in range(6):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    torch.cuda._sleep(cycles)
    opt.step()
"""


def test_backend_synchronizes_and_reads_device_memory() -> None:
    from torchaxe.backends import get_backend

    backend = get_backend("cuda")
    assert backend.is_available()
    backend.reset_peak_memory()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert backend.is_initialized()
    assert backend.peak_memory_bytes() >= block.numel()
    torch.cuda._sleep(50_000_000)
    start = time.perf_counter()
    backend.synchronize()
    assert time.perf_counter() - start > 0.001
    undo = backend.enable_sync_warnings()
    assert torch.cuda.get_sync_debug_mode() == 1
    undo()
    assert torch.cuda.get_sync_debug_mode() == 0


def test_harness_step_times_include_the_device_work(tmp_path) -> None:
    profile = run_script(tmp_path, SLEEPY, target="cuda", steps=4, warmup=1)
    measured = [s for s in profile.steps if s.phase == "measured"]
    assert len(measured) == 4
    # Without a synchronize at the step boundary the host would see ~0.1 ms steps.
    assert all(s.seconds >= 0.015 for s in measured), [s.seconds for s in measured]
    assert all(s.peak_device_memory_bytes and s.peak_device_memory_bytes > 0 for s in measured)


def test_prefetcher_hands_out_every_batch_on_the_device_in_order() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from torchaxe.data.prefetch import DevicePrefetcher

    data = torch.randn(40, 1024, 256)
    labels = torch.arange(40)
    loader = DataLoader(TensorDataset(data, labels), batch_size=4)
    seen = []
    for x, y in DevicePrefetcher(loader, "cuda"):
        assert x.device.type == "cuda" and y.device.type == "cuda"
        # Work on the default stream that reads the batch while the next copy is in flight.
        seen.append(((x @ x.transpose(1, 2)).sum().item(), y.cpu()))
    assert torch.equal(torch.cat([y for _, y in seen]), labels)
    expected = [(b @ b.transpose(1, 2)).sum().item() for b in data.cuda().split(4)]
    assert [s for s, _ in seen] == pytest.approx(expected, rel=1e-4)


def test_a_trial_run_applies_the_cuda_knobs(tmp_path) -> None:
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(1)).cuda()\n"
        "model(torch.randn(2, 3, 16, 16, device='cuda'))\n"
        "inside = []\n"
        "model[0].register_forward_hook(lambda module, args, out: inside.append(out.dtype))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "x = torch.randn(8, 3, 16, 16, device='cuda')\n"
        "for step in range(12):\n"
        "    out = model(x)\n"
        "    if step == 3:\n"
        # The model runs in bf16; what it hands back to the loss code is float32.
        "        assert inside[-1] == torch.bfloat16, inside[-1]\n"
        "        assert out.dtype == torch.float32, out.dtype\n"
        "        assert torch.backends.cudnn.benchmark\n"
        "        assert torch.get_float32_matmul_precision() == 'high'\n"
        "    loss = out.float().pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    knobs = knob_set_from_dict({"name": "gpu", "torch": {"cudnn_benchmark": True, "matmul_precision": "high"},
                                "autocast": {"dtype": "bfloat16"}}, "k")
    run = run_in_subprocess(knobs, ["python", str(script)],
                            TrialOptions(steps=4, warmup=2, timeout=180, target="cuda"), 1)
    assert run.ok, run.error
    assert len(run.step_seconds) == 4
    assert run.applied["torch"] == {"cudnn_benchmark": True, "matmul_precision": "high"}


def test_tune_timer_waits_for_the_device() -> None:
    from torchaxe.backends import get_backend
    from torchaxe.tune.measure import Example, Timer

    class Sleepy(torch.nn.Module):
        def forward(self, x):
            torch.cuda._sleep(20_000_000)
            return x * 2

    timer = Timer(synchronize=get_backend("cuda").synchronize)
    x = torch.randn(8, device="cuda", requires_grad=True)
    seconds = timer.time(Sleepy(), Example(args=(x,)), iterations=2)
    assert seconds > 0.002


@pytest.mark.slow
def test_advise_on_cuda_measures_the_gpu_candidates(tmp_path) -> None:
    """advise on the GPT example on the GPU: the cuda candidates (TF32, cudnn.benchmark,
    autocast, compile) are measured, not refused."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCHAXE_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "torchaxe", "advise", "--budget", "90s", "--target", "cuda", "--format", "json",
         "--skip", "knob:compile", "-q", "--", "python", os.path.join(root, "examples", "gpt", "train.py"),
         "--device", "cuda", "--steps", "60"],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    advice = json.loads(proc.stdout)
    status = {r["key"]: r["status"] for r in advice["recommendations"]}
    assert status.get("knob:tf32") == "measured", status
    assert status.get("knob:autocast-bf16") == "measured", status
