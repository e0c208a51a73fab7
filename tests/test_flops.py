"""FLOPs per step and MFU: the count against a hand count, the peak table, the
matrix-product probe, and the figures in the profile and its summary."""

from __future__ import annotations

import json

import pytest

from profile_support import run_script
from torchaxe.backends.peaks import TERA, dtype_key, table_peak
from torchaxe.runtime.flops import FlopWindow, measure_peak
from torchaxe.runtime.profile import FlopCount, Profile, Summary
from torchaxe.units import flop_rate, mfu_sentence


def _linear_flops(batch: int, fan_in: int, fan_out: int, backward: bool = True, input_grad: bool = True) -> int:
    """2 FLOPs a multiply-add: forward x @ W.T, backward dW = g.T @ x and dx = g @ W."""
    one = 2 * batch * fan_in * fan_out
    return one * (1 + (1 if backward else 0) + (1 if backward and input_grad else 0))


def test_a_step_of_an_mlp_counts_forward_and_backward_as_by_hand():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    x = torch.randn(32, 64)
    window = FlopWindow(step=1)
    window.start()
    model(x).pow(2).mean().backward()
    window.stop()
    # The first layer's input needs no gradient, so its backward is one product, not two.
    expected = _linear_flops(32, 64, 128, input_grad=False) + _linear_flops(32, 128, 10)
    assert window.flops == expected
    assert window.dtype == "float32" and window.error is None and not window.active


def test_a_step_that_differentiates_with_autograd_grad_is_counted_not_broken():
    """A physics-informed loss takes the gradient of the output with respect to the
    input inside the step; counting that step must not stop the script."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.rand(8, 2, requires_grad=True)
    window = FlopWindow(step=1)
    window.start()
    u = model(x)
    (du,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    (du ** 2).mean().backward()
    window.stop()
    assert window.error is None and not window.active
    # At least the forward's two products and the input gradient's two are counted.
    assert window.flops >= 2 * (_linear_flops(8, 2, 16, backward=False) + _linear_flops(8, 16, 1, backward=False))


def test_an_evaluation_pass_inside_the_counted_step_is_not_the_steps_work():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    x = torch.randn(32, 64)
    window = FlopWindow(step=1)
    window.start()
    model(x).pow(2).mean().backward()
    with torch.no_grad():  # a callback evaluating between two optimizer steps
        for _ in range(5):
            model(torch.randn(100, 64))
    window.stop()
    assert window.flops == _linear_flops(32, 64, 128, input_grad=False) + _linear_flops(32, 128, 10)
    assert window.evaluation_flops == 5 * (_linear_flops(100, 64, 128, backward=False)
                                           + _linear_flops(100, 128, 10, backward=False))
    assert window.by_dtype == {"float32": window.flops}


def test_a_sparse_matrix_product_counts_its_stored_elements_not_the_dense_shape():
    # A review's GCN: torch.spmm over an 8000 x 8000 adjacency was counted as a dense
    # matmul (31.7 GFLOP a step), and MFU read 182% of the measured peak.
    import warnings

    import torch

    n, features, hidden = 2000, 16, 8
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adjacency = torch.sparse_coo_tensor(torch.randint(0, n, (2, 10000), generator=g), torch.ones(10000),
                                            (n, n)).coalesce()
    weight = torch.nn.Parameter(torch.randn(features, hidden, generator=g))
    x = torch.randn(n, features, generator=g)
    window = FlopWindow(step=1)
    window.start()
    torch.spmm(adjacency, x @ weight).sum().backward()
    window.stop()
    dense_part = 2 * (2 * n * features * hidden)  # x @ weight and its weight gradient
    sparse_part = 2 * (2 * adjacency._nnz() * hidden)  # the product and its gradient through the adjacency
    assert window.flops == dense_part + sparse_part
    assert window.by_dtype == {"float32": window.flops}


def test_fused_attention_on_cpu_is_counted_as_the_fused_kernel_computes_it():
    import torch
    import torch.nn.functional as F

    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, h, s, d, requires_grad=True)
    v = torch.randn(b, h, s, d, requires_grad=True)
    forward_only = FlopWindow(step=1)
    forward_only.start()
    F.scaled_dot_product_attention(q, k, v)
    forward_only.stop()
    # Scores q @ k.T and the weighted sum with v: two products of 2*s*s*d per head.
    assert forward_only.flops == 2 * (2 * b * h * s * s * d)
    both = FlopWindow(step=1)
    both.start()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    both.stop()
    # Backward: the scores again, then four products for the gradients of scores, v, q and k.
    assert both.flops == 2 * (2 * b * h * s * s * d) + 5 * (2 * b * h * s * s * d)


def test_a_recurrent_layer_on_cpu_is_counted_by_its_weight_products():
    """nn.LSTM runs oneDNN's fused layer on a CPU, which the counter has no formula for:
    pytorch/examples' mnist_rnn counted 909 kFLOP a step and an MFU of 0.0%."""
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: nn.LSTM runs its products as matmuls, counted as such")
    t, b, i, h = 5, 4, 8, 16
    lstm = torch.nn.LSTM(i, h, batch_first=True)
    x = torch.randn(b, t, i)
    window = FlopWindow(step=1)
    window.start()
    out, _ = lstm(x)
    out.sum().backward()
    window.stop()
    # Four gates: (4h x i) input and (4h x h) hidden weights at every step of every sequence.
    forward = 2 * t * b * (4 * h * i + 4 * h * h)
    assert window.flops == forward + 2 * forward


def test_the_dtype_is_the_one_that_carried_most_flops():
    import torch

    model = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64)
    window = FlopWindow(step=1)
    window.start()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    model(x[:2])
    window.stop()
    assert window.by_dtype["bfloat16"] > window.by_dtype["float32"]
    assert window.dtype == "bfloat16"


def test_peak_table_lookups():
    assert table_peak("NVIDIA H200", "bfloat16").flops_per_second == pytest.approx(989.5 * TERA)
    assert table_peak("NVIDIA H100 PCIe", "float16").flops_per_second == pytest.approx(756 * TERA)
    assert table_peak("NVIDIA A100-SXM4-80GB", "float32").flops_per_second == pytest.approx(19.5 * TERA)
    assert table_peak("NVIDIA A100-SXM4-80GB", "float32", tf32=True).flops_per_second == pytest.approx(156 * TERA)
    assert table_peak("NVIDIA L4", "bfloat16").flops_per_second == pytest.approx(121 * TERA)
    assert table_peak("Ascend910B2C", "bfloat16").flops_per_second == pytest.approx(376 * TERA)
    assert table_peak("Ascend910A", "float16").flops_per_second == pytest.approx(256 * TERA)
    peak = table_peak("NVIDIA H200", "torch.bfloat16")
    assert "H200" in peak.source and peak.dtype == "bf16"
    # What the table does not know is unknown, never guessed.
    assert table_peak("Ascend910B3", "bfloat16") is None
    assert table_peak("AMD EPYC 7B13", "float32") is None
    assert table_peak("NVIDIA V100-SXM2-16GB", "bfloat16") is None
    assert table_peak(None, "float32") is None and table_peak("NVIDIA H200", "int8") is None
    assert dtype_key("float32") == "fp32" and dtype_key("float32", tf32=True) == "tf32"


def test_the_probe_measures_a_real_peak_on_this_cpu():
    rate = measure_peak("cpu", "float32", seconds=0.1, max_size=512)
    assert rate is not None and 1e8 < rate < 1e14
    assert measure_peak("cpu", "not_a_dtype", seconds=0.05) is None


def test_summary_mfu_is_achieved_over_each_peak():
    from torchaxe.runtime.profile import StepRecord

    steps = [StepRecord(index=i, phase="measured", seconds=0.5, data_wait_seconds=0.0, batches=1)
             for i in range(1, 4)]
    flops = FlopCount(flops_per_step=10 ** 12, counted_step=1, dtype="bfloat16", device_name="NVIDIA H200",
                      peak_flops_per_second_table=4e12, peak_flops_per_second_measured=2.5e12)
    summary = Summary.of(steps, None, flops)
    assert summary.achieved_flops_per_second == pytest.approx(2e12)
    assert summary.mfu_table == pytest.approx(0.5) and summary.mfu_measured == pytest.approx(0.8)
    unknown = Summary.of(steps, None, FlopCount(flops_per_step=10 ** 12, peak_flops_per_second_measured=4e12))
    assert unknown.peak_flops_per_second_table is None and unknown.mfu_table is None
    assert unknown.mfu_measured == pytest.approx(0.5)
    assert mfu_sentence(unknown.mfu_table, unknown.mfu_measured) == "MFU table peak unknown, 50.0% of measured peak"
    assert flop_rate(2e12) == "2 TFLOP/s" and flop_rate(85.31e9) == "85.3 GFLOP/s"


SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 32)
for _ in range(8):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_profile_counts_the_last_warmup_step_and_writes_the_figures(tmp_path):
    profile = run_script(tmp_path, SCRIPT, steps=3, warmup=2, flops=True)
    flops = profile.flops
    assert flops.counted_step == 2 and flops.dtype == "float32"
    assert flops.flops_per_step == _linear_flops(16, 32, 64, input_grad=False) + _linear_flops(16, 64, 8)
    assert flops.peak_flops_per_second_table is None and "no published peak" in flops.note
    assert flops.peak_flops_per_second_measured > 0
    summary = profile.summary
    assert summary.achieved_flops_per_second == pytest.approx(flops.flops_per_step / summary.step_seconds_median)
    assert 0 < summary.mfu_measured < 2 and summary.mfu_table is None
    # x, the ReLU's output and the model's output (saved by pow for its gradient).
    assert summary.activation_bytes_estimate == 4 * (16 * 32 + 16 * 64 + 16 * 8)
    data = json.loads(profile.to_json())
    assert data["summary"]["flops_per_step"] == flops.flops_per_step
    assert set(data["summary"]) >= {"achieved_flops_per_second", "peak_flops_per_second_table",
                                    "peak_flops_per_second_measured", "mfu_table", "mfu_measured"}
    again = Profile.from_dict(data)
    assert again.flops == flops and again.summary.mfu_measured == summary.mfu_measured


def test_an_mfu_above_the_measured_peak_says_the_counted_step_was_not_typical(tmp_path):
    # The counted step (2) trains on extra large products that no other step has.
    source = SCRIPT.replace("for _ in range(8):\n", "for step in range(8):\n    if step == 1:\n"
                            "        w = torch.randn(512, 512, requires_grad=True)\n"
                            "        for _ in range(20):\n            (w @ w).sum().backward()\n")
    profile = run_script(tmp_path, source, steps=3, warmup=2, flops=True)
    assert profile.summary.mfu_measured > 1
    assert any("the FLOPs counted on step 2 make" in w and "not reliable" in w for w in profile.warnings)


COMPILED_SCRIPT = """\
import os
import torch
torch.manual_seed(0)
calls = []
compiles = []

def counting(gm, inputs):  # a compiler backend that runs the graph as it is, counting compiles and runs
    compiles.append(1)

    def run(*args):
        calls.append(1)
        return gm.forward(*args)
    return run

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

model = MLP()
model.compile(backend=counting)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 32)
for step in range(8):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write(f"{step + 1} {len(calls)} {len(compiles)}\\n")
"""


def test_a_compiled_model_runs_compiled_after_the_counted_step(tmp_path, monkeypatch):
    # torch.compile does not trace under a dispatch mode such as the FLOP counter, and
    # marks the frames it met there to be skipped for good: without care, every step
    # after the counted one ran eagerly, and the profile measured the eager model.
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS_FILE", str(calls))
    profile = run_script(tmp_path, COMPILED_SCRIPT, steps=4, warmup=2, flops=True, shapes=True)
    assert profile.flops.counted_step == 2 and profile.flops.flops_per_step > 0
    lines = [line.split() for line in calls.read_text().splitlines()]
    compiled_runs = {step: runs for step, runs, _ in lines}
    # Step 1 ran the compiled graph; step 2 was counted, eagerly; steps 3-5 ran it again.
    assert compiled_runs["1"] == "1" and compiled_runs["2"] == "1"
    assert [compiled_runs[str(s)] for s in (3, 4, 5)] == ["2", "3", "4"]
    # ... without recompiling: the eager step fired torchaxe's one-shot module hooks,
    # which stay registered (and idle) because the graph guards on their number.
    assert {compiles for _, _, compiles in lines} == {"1"}


def test_without_a_warmup_step_nothing_is_counted_and_the_profile_says_why(tmp_path):
    profile = run_script(tmp_path, SCRIPT, steps=3, warmup=0, flops=True)
    assert profile.flops.flops_per_step is None and "--warmup 0" in profile.flops.note
    assert profile.summary.mfu_measured is None
    plain = run_script(tmp_path, SCRIPT, steps=3, warmup=1)
    assert plain.flops is None and plain.to_dict()["flops"] is None


def test_profile_cli_leads_with_mfu(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "p.json"
    done = subprocess.run([sys.executable, "-m", "torchaxe", "profile", "--steps", "2", "--warmup", "1",
                           "--target", "cpu", "--out", str(out), "--", "python", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("torchaxe profile:"))
    assert lines[first + 1].strip().startswith("MFU table peak unknown, ") and "% of measured peak" in lines[first + 1]
    assert json.loads(out.read_text())["summary"]["mfu_measured"] > 0


def test_activations_saved_for_backward_are_estimated_without_the_parameters():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    x = torch.randn(32, 64)
    window = FlopWindow(step=1)
    window.start()
    model(x).sum().backward()
    window.stop()
    # Saved: the input x (32x64), the first layer's output through the ReLU (32x128),
    # float32. The weights the products also save are parameters, not activations.
    assert window.activation_bytes == 4 * (32 * 64 + 32 * 128)
    with torch.no_grad():
        idle = FlopWindow(step=1)
        idle.start()
        model(x)
        idle.stop()
    assert idle.activation_bytes == 0
