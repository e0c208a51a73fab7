"""The harness, in-process: step counting, data wait, host syncs, shapes, ops, the
ways a script is started, and step markers. The examples are the workloads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

from profile_support import EXAMPLES, PRELUDE, TINY_GPT, TINY_SEQ, line_of, run_command, run_script, write_script
from torchaxe.runtime.harness import EXIT_NO_STEPS, EXIT_OK, exit_code_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def _def_line(path, cls, method):
    import ast

    tree = ast.parse(path.read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return next(f.lineno for f in node.body if isinstance(f, ast.FunctionDef) and f.name == method)


def _line_containing(path, text):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if text in line:
            return number
    raise AssertionError(text)


# ------------------------------------------------------------------- examples


def test_gpt_example_is_stopped_after_warmup_and_steps(capsys):
    script = EXAMPLES / "gpt" / "train.py"
    profile = run_command(["python", str(script), *TINY_GPT], steps=3, warmup=2)
    assert profile.status == "stopped" and exit_code_for(profile) == EXIT_OK
    assert [s.phase for s in profile.steps] == ["warmup", "warmup", "measured", "measured", "measured"]
    assert [s.index for s in profile.steps] == [1, 2, 3, 4, 5]
    assert all(s.seconds > 0 and s.batches == 1 for s in profile.steps)
    assert "done:" not in capsys.readouterr().out  # stopped before the script's own end
    item_line = _line_containing(script, "running_loss += loss.item()")
    [site] = [s for s in profile.host_syncs if s.line == item_line]
    assert site.call == "item" and site.count == 4 and site.file.endswith("examples/gpt/train.py")
    assert site.code == "running_loss += loss.item()" and site.function == "main"
    summary = profile.summary
    assert summary.steps_measured == 3 and summary.host_syncs_per_step == 1.0
    assert 0 < summary.data_wait_fraction < 0.5
    assert summary.step_seconds_median > 0 and summary.host_rss_peak_bytes > 10 << 20
    assert profile.run.target == "cpu" and profile.run.options["steps"] == 3
    assert profile.run.command[:2] == ["python", str(script)]


def test_image_classifier_waits_for_data(tmp_path):
    script = EXAMPLES / "image_classifier" / "train.py"
    args = ["--data-dir", str(tmp_path / "jpegs"), "--images-per-class", "4", "--num-workers", "2", "--log-every", "100"]
    profile = run_command(["python", str(script), *args], steps=2, warmup=1)
    assert profile.status == "stopped"
    # 16 images at batch 16: every step is an epoch, with two new worker processes.
    assert profile.summary.data_wait_fraction > 0.2
    calls = {(s.line, s.call) for s in profile.host_syncs}
    predictions = _line_containing(script, "logits.argmax(dim=1).cpu().numpy()")
    assert {(predictions, "cpu"), (predictions, "numpy"), (_line_containing(script, "labels.tolist()"), "tolist")} <= calls


def test_seq_varlen_has_dynamic_shapes_and_gpt_static_ones():
    seq = run_command(["python", str(EXAMPLES / "seq_varlen" / "train.py"), *TINY_SEQ], steps=4, warmup=1, shapes=True)
    shapes = seq.shapes
    assert shapes.batches is not None and shapes.batches.dynamic and len(shapes.batches.signatures) > 1
    assert {"GRUClassifier", "GRUClassifier.embedding", "GRUClassifier.gru"} <= set(shapes.dynamic_modules)
    names = {m.name: m for m in shapes.modules}
    assert names["GRUClassifier.head.0"].type == "Linear" and not names["GRUClassifier.head.0"].dynamic
    assert seq.to_dict()["shapes"]["static"] is False

    gpt = run_command(["python", str(EXAMPLES / "gpt" / "train.py"), *TINY_GPT], steps=2, warmup=1, shapes=True)
    data = gpt.to_dict()["shapes"]
    assert data["static"] is True and data["dynamic_modules"] == []
    qkv = {m.name: m for m in gpt.shapes.modules}["GPT.blocks.1.attn.qkv"]
    assert qkv.calls == 3 and qkv.signatures[0].shapes == [[4, 16, 32]] and qkv.signatures[0].dtypes == ["float32"]
    assert gpt.shapes.batches.signatures[0].shapes == [[4, 17]]


def test_ops_window_on_gpt_with_shapes_and_sources():
    script = EXAMPLES / "gpt" / "train.py"
    profile = run_command(["python", str(script), *TINY_GPT], steps=2, warmup=1, ops=True, ops_steps=2, shapes=True)
    assert [s.phase for s in profile.steps] == ["warmup", "ops", "ops", "measured", "measured"]
    assert profile.ops_steps == [2, 3]
    assert profile.summary.steps_measured == 2
    ops = {o.name: o for o in profile.ops}
    assert "aten::mm" in ops or "aten::addmm" in ops
    mm = ops.get("aten::mm") or ops["aten::addmm"]
    assert mm.kind == "op" and mm.calls > 0 and mm.self_seconds > 0
    assert mm.input_shapes and all(g.calls > 0 for g in mm.input_shapes)
    # Sources name the user's function that led to the op (by the line it starts on).
    located = {(src.location, src.function) for op in profile.ops for src in op.sources}
    attention = _def_line(script, "CausalSelfAttention", "forward")
    assert (f"examples/gpt/train.py:{attention}", "forward") in {(loc[loc.index("examples/"):], f)
                                                                 for loc, f in located if "examples/" in loc}
    assert any(o.kind == "range" and o.name.startswith("Optimizer.step") for o in profile.ops)
    # self times are sorted, largest first
    assert [o.self_seconds for o in profile.ops] == sorted((o.self_seconds for o in profile.ops), reverse=True)


def test_an_op_table_torch_cannot_hand_over_leaves_the_rest_of_the_profile(monkeypatch):
    # Now and then torch.profiler records an event whose name is not valid UTF-8, and
    # turning its events into Python objects fails for all of them.
    import torch.profiler

    def events(self):
        raise UnicodeDecodeError("utf-8", b"forward\xf6", 7, 8, "invalid start byte")

    monkeypatch.setattr(torch.profiler.profile, "events", events)
    script = EXAMPLES / "gpt" / "train.py"
    profile = run_command(["python", str(script), *TINY_GPT], steps=2, warmup=1, ops=True, ops_steps=1)
    assert profile.status == "stopped"
    assert profile.summary.steps_measured == 2
    assert [s.phase for s in profile.steps] == ["warmup", "ops", "measured", "measured"]
    assert profile.ops == [] and profile.ops_steps == []
    assert any(w.startswith("no op table: torch.profiler could not return its events (UnicodeDecodeError")
               for w in profile.warnings)


PYTHON_HEAVY = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def bump(x):
    return x + 1

def train_step(calls):
    s = 0
    for _ in range(calls):  # Python work in every step: plotting, a per-item loop
        s = bump(s)
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

for step in range(12):
    train_step(CALLS)
"""


@pytest.mark.parametrize("calls, flops, recorded, with_lines", [
    (20, True, 3, True), (1200, True, 1, True),
    # Without the tracer only the operators count: three steps of a small model fit.
    (3000, True, 3, False),
    # Without the FLOP counter the operators are not known: one step, to be safe.
    (3000, False, 1, False),
])
def test_the_op_window_shrinks_to_the_python_calls_its_tracer_can_record(tmp_path, monkeypatch, calls, flops,
                                                                          recorded, with_lines):
    import torchaxe.runtime.opstats as opstats

    monkeypatch.setattr(opstats, "PYTHON_CALLS_BUDGET", 2000)
    # The Python calls and the FLOPs are both counted on the last warm-up step (the
    # FLOP counter's own calls are left out).
    profile = run_script(tmp_path, PYTHON_HEAVY.replace("CALLS", str(calls)), steps=2, warmup=2, ops=True,
                         ops_steps=3, flops=flops)
    assert len(profile.ops_steps) == recorded
    assert [s.phase for s in profile.steps].count("ops") == recorded and profile.summary.steps_measured == 2
    assert profile.ops and any(o.name == "aten::addmm" for o in profile.ops)
    located = {src.function for op in profile.ops for src in op.sources}
    assert ("train_step" in located) == with_lines
    notes = [w for w in profile.warnings if "Python calls" in w]
    assert bool(notes) == (recorded < 3 or not with_lines)
    assert sys.getprofile() is None


@pytest.mark.parametrize("budget, limit, recorded", [(10_000, 100_000, 3), (1, 100_000, 1), (1, 2, 0)])
def test_the_op_window_shrinks_to_the_operators_a_step_runs(tmp_path, monkeypatch, budget, limit, recorded):
    import torchaxe.runtime.opstats as opstats

    # A step of PYTHON_HEAVY's model runs a few dozen operators (forward, backward, SGD).
    monkeypatch.setattr(opstats, "OPERATORS_BUDGET", budget)
    monkeypatch.setattr(opstats, "OPERATORS_LIMIT", limit)
    profile = run_script(tmp_path, PYTHON_HEAVY.replace("CALLS", "5"), steps=2, warmup=2, ops=True,
                         ops_steps=3, flops=True)
    assert len(profile.ops_steps) == recorded
    assert profile.summary.steps_measured == 2 and profile.flops.flops_per_step
    assert bool(profile.ops) == (recorded > 0)
    notes = [w for w in profile.warnings if "operators" in w]
    if recorded == 3:
        assert not notes
    elif recorded == 1:
        assert len(notes) == 1 and "operators recorded over 1 step, not 3: a step makes" in notes[0]
    else:
        assert len(notes) == 1 and notes[0].startswith("no operators recorded: a step runs ")


# ------------------------------------------------------------------ counting


def test_steps_and_warmup_counting_with_a_fake_clock(tmp_path, monkeypatch):
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setitem(sys.modules, "torchaxe_test_clock", clock)
    source = PRELUDE + """
import torchaxe_test_clock as clock
for k in range(1, 20):
    out = model(x)                  # the first call starts step 1
    clock.now += k                  # step k lasts k seconds
    out.sum().backward()
    opt.step()
"""
    profile = run_script(tmp_path, source, steps=3, warmup=2, clock=lambda: clock.now)
    assert profile.status == "stopped"
    assert [(s.index, s.phase, s.seconds) for s in profile.steps] == [
        (1, "warmup", 1.0), (2, "warmup", 2.0), (3, "measured", 3.0), (4, "measured", 4.0), (5, "measured", 5.0)]
    assert [s.start_seconds for s in profile.steps] == [0.0, 1.0, 3.0, 6.0, 10.0]
    assert profile.summary.step_seconds_median == 4.0
    assert profile.summary.step_seconds_min == 3.0 and profile.summary.step_seconds_max == 5.0


def test_steps_all_lets_the_script_finish(tmp_path):
    source = PRELUDE + "for _ in range(7):\n    step()\nprint('finished')\n"
    profile = run_script(tmp_path, source, steps=None, warmup=1)
    assert profile.status == "completed" and exit_code_for(profile) == EXIT_OK
    assert len(profile.steps) == 7 and profile.summary.steps_measured == 6
    assert not any("ended after" in w for w in profile.warnings)


def test_a_busy_neighbour_of_the_measured_steps_is_named(tmp_path, monkeypatch):
    # Other processes slow steps unevenly: what they used of the cores while the steps
    # were measured is read at the first measured step and at the end.
    from torchaxe import cpulist
    from torchaxe.runtime import load, other_load

    monkeypatch.setattr(cpulist, "usable_cpus", lambda: 2)
    monkeypatch.setattr(other_load, "machine_cores", lambda: 2)
    monkeypatch.setattr(load, "load_average", lambda: 1.0)  # a quiet machine, whatever this one is doing
    source = PRELUDE + "import time\nfor _ in range(6):\n    step()\n    time.sleep(0.05)\n"
    started = time.time()
    # A neighbour (pid 4242) that uses 1.5 cores for every second that passes.
    monkeypatch.setattr(other_load, "all_processes",
                        lambda: {4242: ("trainer", 1.5 * (time.time() - started), started - 10.0)})
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    busy = [w for w in profile.warnings if w.startswith("other processes kept")]
    assert len(busy) == 1 and "(busiest: trainer (pid 4242))" in busy[0], profile.warnings
    assert not any("1-minute load" in w for w in profile.warnings)
    monkeypatch.setattr(other_load, "all_processes", lambda: {4242: ("trainer", 1.0, started - 10.0)})
    assert not any("busy" in w for w in run_script(tmp_path, source, steps=3, warmup=1).warnings)
    # Processes that came and went between the watch's two samples (a test run's
    # workers) are not seen by it: the load average the run ended under says so.
    monkeypatch.setattr(load, "load_average", lambda: 4.0)
    warnings = run_script(tmp_path, source, steps=3, warmup=1).warnings
    assert any(w.startswith("the machine was busy (1-minute load 4.0 on 2 cores at the end)") for w in warnings)


def test_a_busy_machine_is_said_beside_the_figures(tmp_path, monkeypatch):
    # Where other processes cannot be read, the load the run ended under stands in.
    from torchaxe import cpulist
    from torchaxe.runtime import load, other_load

    def unreadable():
        raise PermissionError("no /proc")

    monkeypatch.setattr(other_load, "all_processes", unreadable)
    source = PRELUDE + "for _ in range(6):\n    step()\n"
    monkeypatch.setattr(cpulist, "usable_cpus", lambda: 2)
    monkeypatch.setattr(load, "load_average", lambda: 3.6)
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    assert any(w.startswith("the machine was busy (1-minute load 3.6 on 2 cores at the end)")
               for w in profile.warnings), profile.warnings
    monkeypatch.setattr(load, "load_average", lambda: 2.5)  # the run's own two threads, and a little
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    assert not any("busy" in w for w in profile.warnings)


def test_a_script_shorter_than_asked_completes_with_a_warning(tmp_path):
    profile = run_script(tmp_path, PRELUDE + "for _ in range(4):\n    step()\n", steps=10, warmup=2)
    assert profile.status == "completed"
    assert [s.phase for s in profile.steps] == ["warmup", "warmup", "measured", "measured"]
    assert any("ended after 4 steps: 2 measured of the 10 asked for" in w for w in profile.warnings)
    assert any("only 2 measured steps" in w for w in profile.warnings)


def test_no_optimizer_means_no_steps(tmp_path):
    profile = run_script(tmp_path, "import torch\nfor _ in range(3):\n    torch.ones(2).sum()\n", steps=2, warmup=0)
    assert profile.status == "completed" and profile.steps == []
    assert exit_code_for(profile) == EXIT_NO_STEPS
    assert any("--step-marker" in w for w in profile.warnings)


def test_only_the_first_optimizer_marks_steps(tmp_path):
    source = PRELUDE + """
other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
for _ in range(5):
    step()
    other.step()
    other.step()
"""
    profile = run_script(tmp_path, source, steps=None, warmup=0)
    assert len(profile.steps) == 5


def test_data_wait_is_measured_on_a_sleeping_dataset(tmp_path):
    source = PRELUDE + """
import time
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 100
    def __getitem__(self, i):
        time.sleep(0.03)
        return torch.ones(4)
for batch in DataLoader(Slow(), batch_size=1):
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    measured = profile.measured_steps
    assert len(measured) == 3
    assert all(0.025 < s.data_wait_seconds <= s.seconds for s in measured)
    assert all(s.batches == 1 for s in measured)
    assert profile.summary.data_wait_fraction > 0.6


def test_host_syncs_are_counted_once_each_with_their_line(tmp_path):
    source = PRELUDE + """
opt = torch.optim.Adam(model.parameters())  # reads its step counter with .item() inside torch
for _ in range(6):
    loss = step()
    a = loss.item()                      # ITEM
    b = float(loss)                      # FLOAT
    if loss > 100:                       # BOOL
        pass
    c = f"{loss:.3f}"                    # FORMAT
    print(loss)                          # PRINT
    d = loss.detach().cpu().numpy()      # CPU
    e = loss.detach().view(1).tolist()   # TOLIST
"""
    path = write_script(tmp_path, source)
    profile = run_command(["python", str(path)], steps=3, warmup=1)
    sites = {(s.line, s.call): s for s in profile.host_syncs}
    expected = {
        (line_of(path, "ITEM"), "item"), (line_of(path, "FLOAT"), "__float__"), (line_of(path, "BOOL"), "__bool__"),
        (line_of(path, "FORMAT"), "item"), (line_of(path, "PRINT"), "__repr__"), (line_of(path, "CPU"), "cpu"),
        (line_of(path, "CPU"), "numpy"), (line_of(path, "TOLIST"), "tolist"),
    }
    assert set(sites) == expected
    # 4 steps ran; the reads after the 4th never happened (the script was stopped).
    assert all(s.count == 3 for s in sites.values())
    assert all(s.file.endswith("train.py") and s.via is None for s in sites.values())
    assert [s.host_syncs for s in profile.steps] == [0, 8, 8, 8]
    assert profile.summary.host_syncs_per_step == 8


def test_reads_in_setup_code_are_not_training_syncs(tmp_path):
    source = PRELUDE + "n = int(torch.tensor(3))\nfor _ in range(n):\n    step()\n"
    profile = run_script(tmp_path, source, steps=None, warmup=0)
    assert profile.host_syncs == []


def test_a_read_inside_a_library_is_the_users_line_via_the_library(tmp_path):
    source = PRELUDE + """
import io, logging
log = logging.getLogger("torchaxe-test")
log.propagate = False
log.setLevel(logging.INFO)
log.addHandler(logging.StreamHandler(io.StringIO()))
for _ in range(4):
    loss = step()
    log.info("loss %s", loss)            # LOG
"""
    path = write_script(tmp_path, source)
    profile = run_command(["python", str(path)], steps=2, warmup=1)
    [site] = profile.host_syncs
    assert site.line == line_of(path, "LOG") and site.call == "__repr__"
    assert site.via is not None and "logging" in site.via


def test_index_tensors_that_stay_on_the_host_are_not_syncs_on_the_cpu(tmp_path):
    """nanoGPT's ``get_batch``: an index tensor made without a device slices a numpy
    array; a device run keeps it on the host, so its reads are not syncs."""
    source = PRELUDE + """
import numpy as np
data = np.arange(1000, dtype=np.uint16)
block_size = 8
def get_batch():
    ix = torch.randint(len(data) - block_size, (4,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])   # SLICE
    first = int(ix[0])                                                                          # ELEMENT
    moved = torch.randint(10, (2,)).to("cpu")
    return x, moved.tolist()                                                                    # MOVED
for _ in range(5):
    get_batch()
    loss = step()
    loss.item()                                                                                 # ITEM
"""
    path = write_script(tmp_path, source)
    profile = run_command(["python", str(path)], steps=3, warmup=1)
    sites = {(s.line, s.call): s.count for s in profile.host_syncs}
    assert sites == {(line_of(path, "ITEM"), "item"): 3, (line_of(path, "MOVED"), "tolist"): 3}
    assert profile.summary.host_syncs_per_step == 2


def _sink():
    return types.SimpleNamespace(started=True, syncs=0, add_sync=lambda: None)


def test_the_sync_decision_with_a_pretend_accelerator_and_on_the_cpu():
    import numpy as np
    import torch

    from torchaxe.runtime.probes import CodeMap, HostSyncProbe

    # A run on an accelerator: tensors on the host are never device syncs, whatever made them.
    device_run = HostSyncProbe(_sink(), CodeMap(), count_host_tensors=False)
    assert not device_run.counts(torch.randint(10, (4,)))
    assert not device_run.counts(torch.ones(2, requires_grad=True).sum())
    assert device_run.counts(torch.empty(3, device="meta"))  # the pretend device's tensor
    # A cpu run: every tensor is on the host; those a device run would keep there are left out.
    cpu_run = HostSyncProbe(_sink(), CodeMap(), count_host_tensors=True)
    cpu_run.install()
    try:
        ix = torch.randint(100, (4,))
        stays = [ix, ix[0], *ix, ix[1] + 8, 1 + ix[2] * 2 - 1, -ix, torch.arange(3) // 2,
                 torch.from_numpy(np.zeros(2)), torch.tensor([1, 2])]
        assert not any(cpu_run.counts(t) for t in stays)
        model = torch.nn.Linear(2, 1)
        device = torch.device("cpu")
        moved = torch.zeros(3, 2).to(device)
        placed = torch.zeros(3, 2, device=device)
        loss = model(moved).sum()
        goes = [moved, placed, loss, loss.detach(), ix.float().mean(), ix[:3] + placed[:, 0].long(),
                torch.zeros(2).to(device="cpu", dtype=torch.float64)]
        assert all(cpu_run.counts(t) for t in goes)
        assert not cpu_run.counts(torch.zeros(2).to(torch.float64))  # a dtype, not a device
        assert cpu_run.counts(torch.zeros(2).to(torch.float64).to(device))
        # Inside a DataLoader fetch a dataset reads its own host tensors (MNIST's
        # int(self.targets[i]), targets torch.load'ed): data preparation, not a sync.
        from torchaxe.runtime import probes

        probes._FETCHING.active = True
        try:
            assert not cpu_run.counts(moved)
        finally:
            probes._FETCHING.active = False
    finally:
        cpu_run.uninstall()
    assert torch.randint.__module__ != __name__ and not hasattr(torch.randint, "__wrapped__")
    assert "__add__" not in vars(torch.Tensor)


def test_the_model_s_arithmetic_pays_no_tracking_work(monkeypatch):
    """The arithmetic and ``Tensor.to`` wrappers run on every tensor of the model. On
    tensors that are not tracked, with nothing tracked or with a data set kept on the
    host for the whole run, they never ask whether torch.compile is tracing nor make
    the exact (weak reference) lookup: only a tracked operand or a result to track
    does."""
    import torch

    from torchaxe.runtime import probes

    checks, lookups = [], []
    monkeypatch.setattr(probes, "compiling_check", lambda: lambda: checks.append(1) or False)
    held = probes._held
    monkeypatch.setattr(probes, "_held", lambda ids, t: lookups.append(1) or held(ids, t))
    probe = probes.HostSyncProbe(_sink(), probes.CodeMap(), count_host_tensors=True)
    probe.install()
    try:
        device = torch.device("cpu")
        x = torch.ones(4, device=device)
        w = torch.ones(4, device=device)

        def model_step():
            y = (x + w) * 2.0 - x
            return (-y[1:] + 1).to(device).to(torch.float64) / 3

        checks.clear()  # the factories (called rarely) ask first
        model_step()
        assert lookups == [] and checks == []  # nothing tracked
        data = torch.arange(16)  # kept for the whole run, as a data set on the host is
        checks.clear()
        model_step()
        assert lookups == [] and checks == []  # something tracked, not these tensors
        i = data[3] + 2
        assert checks and lookups and not probe.counts(i)  # the index arithmetic is still followed
    finally:
        probe.uninstall()


def test_host_tensor_tracking_stays_out_of_compiled_graphs():
    """The wrapped factories and arithmetic trace as torch's own: one graph, no break."""
    import torch

    from torchaxe.runtime.probes import CodeMap, HostSyncProbe

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            pos = torch.arange(x.shape[1])
            return (self.fc(x) + pos * 2 + torch.zeros(4)).to(torch.float32) - 1

    probe = HostSyncProbe(_sink(), CodeMap(), count_host_tensors=True)
    probe.install()
    try:
        model = Model()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        x = torch.randn(2, 4, device="cpu")
        assert torch.allclose(compiled(x), model(x))
        assert len(graphs) == 1 and probe.counts(compiled(x))
        # The wrappers look at what is tracked without being traced: tracking more
        # (or less) never makes the compiled graph recompile.
        kept = [torch.arange(3), torch.zeros(2)]
        assert probe.counts(compiled(x)) and len(graphs) == 1
        kept.clear()
        assert probe.counts(compiled(x)) and len(graphs) == 1
    finally:
        probe.uninstall()
    # After the run (the tuner compiles in the same process), torch's own functions again.
    after = torch.compile(lambda x: x + torch.arange(4), backend=backend, fullgraph=True)
    assert after(torch.zeros(4)).tolist() == [0.0, 1.0, 2.0, 3.0] and len(graphs) == 2


def test_torchscript_compiles_the_wrapped_factories_as_torchs_own():
    """``import torch.distributed.optim`` scripts functions that call ``torch.tensor``
    (llm.c's train_gpt2.py imports it): with the factories wrapped, TorchScript must
    still find their operators, and it forgets the wrappers once they are removed."""
    import torch
    from torch.jit import _builtins

    from torchaxe.runtime.probes import CodeMap, HostSyncProbe

    probe = HostSyncProbe(_sink(), CodeMap(), count_host_tensors=True)
    probe.install()
    try:
        wrapper = torch.randint

        @torch.jit.script
        def draw(n: int) -> torch.Tensor:
            return torch.randint(10, (n,)) + torch.tensor([1])

        assert draw(3).shape == (3,)
    finally:
        probe.uninstall()
    assert torch.randint is not wrapper and _builtins._find_builtin(wrapper) is None


def test_a_read_in_a_framework_names_the_users_line_and_the_frameworks(tmp_path):
    """Inside a framework every read is under the user's ``trainer.train()`` line;
    each names the framework line that read it, the innermost installed package's
    frame before the standard library's, and they are separate sites."""
    import importlib.util

    import torch

    from torchaxe.runtime.probes import CodeMap, HostSyncProbe

    site, stdlib = tmp_path / "site", tmp_path / "lib"
    write_script(stdlib, "def fmt(t):\n    return '%.3f' % t.item()\n", name="fmtlib.py")
    write_script(site, """
        import fmtlib
        def train(t):
            for _ in range(2):
                t.item()                  # TRAINER-ITEM
                fmtlib.fmt(t)             # TRAINER-LOG
        """, name="framework/trainer.py")
    sys.path.insert(0, str(stdlib))
    try:
        spec = importlib.util.spec_from_file_location("framework_trainer_for_test", site / "framework" / "trainer.py")
        trainer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(trainer)
        torch_dir = os.path.dirname(torch.__file__)
        codes = CodeMap(internal=(torch_dir,), library=(str(stdlib), str(site)), installed=(str(site),),
                        cwd=str(tmp_path))
        probe = HostSyncProbe(_sink(), codes, count_host_tensors=True)
        probe.install()
        try:
            trainer.train(torch.ones(1, device="cpu", requires_grad=True) * 2)
            train_line = sys._getframe().f_lineno - 1
        finally:
            probe.uninstall()
    finally:
        sys.path.remove(str(stdlib))
    path = site / "framework" / "trainer.py"
    sites = {s.via: (s.line, s.call, s.count) for s in probe.sites()}
    assert sites == {f"framework/trainer.py:{line_of(path, 'TRAINER-ITEM')}": (train_line, "item", 2),
                     f"framework/trainer.py:{line_of(path, 'TRAINER-LOG')}": (train_line, "item", 2)}
    assert codes.show_library(str(stdlib / "fmtlib.py"), 2) == "fmtlib.py:2"


def test_torchs_own_warnings_keep_the_users_line(tmp_path, monkeypatch):
    """A warning torch raises inside ``item()`` (from C++, so located at the Python
    frame that called it: the harness's wrapper) still points at the user's line."""
    import warnings

    import torch

    original = torch.Tensor.item

    def warning_item(self):
        warnings.warn("read inside item", UserWarning, stacklevel=2)  # where C++ warnings point
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", warning_item)
    source = PRELUDE + """
for _ in range(3):
    loss = step()
    value = loss.item()                  # ITEM
"""
    path = write_script(tmp_path, source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_command(["python", str(path)], steps=None, warmup=0)
    ours = [w for w in caught if "read inside item" in str(w.message)]
    assert len(ours) == 3
    assert all(w.filename == str(path) and w.lineno == line_of(path, "ITEM") for w in ours)


def test_passes_without_gradients_are_counted_and_timed_apart_from_training(tmp_path):
    # An evaluation after every step (a decorated function and an inference_mode block);
    # gradient clipping's and a hand-written update's no_grad call no module and do not count.
    source = PRELUDE + """
@torch.no_grad()
def evaluate():
    model.eval()
    out = model(x)
    model.train()
    return out
for _ in range(6):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.0 * p.grad
    opt.step()
    evaluate()
    with torch.inference_mode():
        with torch.no_grad():  # nested: one pass
            model(x)
            model(x)
    with torch.inference_mode(False):
        model(x)
"""
    profile = run_script(tmp_path, source, steps=4, warmup=1)
    measured = [s for s in profile.steps if s.phase == "measured"]
    assert [s.no_grad_passes for s in measured] == [2, 2, 2, 2]
    assert all(0 < s.no_grad_seconds < s.seconds for s in measured)
    summary = profile.summary
    assert summary.no_grad_passes_per_step == 2 and 0 < summary.no_grad_fraction < 1
    again = type(profile).from_dict(profile.to_dict())
    assert again.steps[-1].no_grad_passes == 2 and again.summary.no_grad_fraction == summary.no_grad_fraction

    import io

    from torchaxe.report.profile_text import render_profile_summary

    text = io.StringIO()
    render_profile_summary(profile, None, text)
    assert "no-grad     2.0 passes per step without gradients" in text.getvalue()
    plain = run_script(tmp_path, PRELUDE + "for _ in range(4):\n    step()\n", steps=2, warmup=1)
    assert plain.summary.no_grad_passes_per_step == 0
    text = io.StringIO()
    render_profile_summary(plain, None, text)
    assert "no-grad" not in text.getvalue()


def test_an_lbfgs_closure_is_training_not_a_pass_without_gradients(tmp_path):
    # Seen in a review: LBFGS's step runs under no_grad and evaluates the closure with
    # gradients back on; its forward passes were "50.6% of step time" without gradients.
    source = PRELUDE + """
lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3)
def closure():
    lbfgs.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss
for _ in range(5):
    lbfgs.step(closure)
"""
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    measured = [s for s in profile.steps if s.phase == "measured"]
    assert len(measured) == 3 and all(s.no_grad_passes == 0 for s in measured)
    # Its optimizer time is the update alone, not the closure's forward and backward.
    assert all(s.optimizer_seconds is not None for s in measured)


def test_the_optimizers_step_is_timed_in_each_step(tmp_path):
    # What a fused optimizer could save at most: every optimizer's step() (a GAN's two).
    source = PRELUDE + """
import time
class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)
opt = SlowSGD(model.parameters(), lr=0.01)
other = SlowSGD([torch.nn.Parameter(torch.ones(1))], lr=0.01)
for _ in range(6):
    step()
    other.step()
"""
    profile = run_script(tmp_path, source, steps=3, warmup=1)
    measured = [s for s in profile.steps if s.phase == "measured"]
    assert all(0.04 <= s.optimizer_seconds < s.seconds for s in measured), [s.optimizer_seconds for s in measured]
    assert 0.04 <= profile.summary.optimizer_seconds_median and 0 < profile.summary.optimizer_fraction < 1
    again = type(profile).from_dict(profile.to_dict())
    assert again.steps[-1].optimizer_seconds == measured[-1].optimizer_seconds

    import io

    from torchaxe.report.profile_text import render_profile_summary

    text = io.StringIO()
    render_profile_summary(profile, None, text)
    assert "of step time in optimizer.step()" in text.getvalue()
    # A loop that updates its parameters by hand has no optimizer time to show.
    manual = PRELUDE + """
for _ in range(6):
    loss = model(x).pow(2).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
"""
    profile = run_script(tmp_path, manual, steps=3, warmup=1)
    assert profile.summary.steps_measured == 3 and profile.summary.optimizer_seconds_median is None
    text = io.StringIO()
    render_profile_summary(profile, None, text)
    assert "optimizer.step()" not in text.getvalue()


def test_torchs_device_context_still_puts_factories_on_its_device(tmp_path):
    # transformers builds models under torch.device("meta"); torch fills the set of
    # factories that context moves at its first use, by identity. Filled while the
    # host-tensor probe's wrappers were in place, BERT's position_ids buffer came out
    # as uninitialised memory.
    import torch.utils._device as device_context

    device_context._device_constructors.cache_clear()
    source = PRELUDE + """
with torch.device("meta"):
    made = [torch.tensor([1, 2]), torch.arange(3), torch.zeros(2), torch.randint(5, (2,))]
assert all(t.device.type == "meta" for t in made), [t.device for t in made]
for _ in range(3):
    step()
"""
    profile = run_script(tmp_path, source, steps=1, warmup=1)
    assert profile.status in ("completed", "stopped"), profile.detail


def test_probes_are_removed_afterwards(tmp_path):
    import gc

    import torch
    from torch.utils.data import dataloader
    from torch.nn.modules import module
    from torch.optim import optimizer

    def probed():
        return (torch.Tensor.__dict__.get("item"), dataloader._BaseDataLoaderIter.__next__,
                dataloader.DataLoader.__iter__, len(gc.callbacks), len(module._global_forward_pre_hooks),
                len(optimizer._global_optimizer_post_hooks), len(optimizer._global_optimizer_pre_hooks),
                sys.gettrace(), torch.no_grad.__enter__,
                torch.inference_mode.__exit__)

    before = probed()
    run_script(tmp_path, PRELUDE + "for _ in range(3):\n    step().item()\n    with torch.no_grad():\n        model(x)\n",
               steps=1, warmup=0, shapes=True)
    after = probed()
    assert before == after
    assert "item" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__


# ------------------------------------------------------------ how it is started


def test_script_sees_what_python_would_give_it(tmp_path):
    source = """
import os, sys
assert __name__ == "__main__", __name__
assert sys.argv == [__file__, "--lr", "3", "pos"], sys.argv
assert sys.path[0] == os.path.dirname(os.path.realpath(__file__)), sys.path[0]
import helper_module_for_argv_test              # a module beside the script
assert helper_module_for_argv_test.VALUE == 7
"""
    (tmp_path / "helper_module_for_argv_test.py").write_text("VALUE = 7\n")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    profile = run_script(tmp_path, source, "--lr", "3", "pos", steps=None)
    assert profile.status == "completed", profile.detail
    assert sys.argv == saved_argv and sys.path == saved_path
    assert "helper_module_for_argv_test" not in sys.modules


def test_module_form_runs_as_main_with_the_working_folder_on_the_path(tmp_path, monkeypatch):
    package = tmp_path / "mytrainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(PRELUDE + """
import os
import subprocess
assert __name__ == "__main__"
assert sys.argv[1:] == ["--epochs", "2"], sys.argv
assert sys.argv[0].endswith(os.path.join("mytrainpkg", "train.py")), sys.argv[0]
assert sys.path[0] == os.getcwd()
for _ in range(5):
    step()
""")
    monkeypatch.chdir(tmp_path)
    profile = run_command(["python", "-m", "mytrainpkg.train", "--epochs", "2"], steps=2, warmup=1)
    assert profile.status == "stopped", profile.detail
    assert len(profile.steps) == 3
    assert profile.run.command == ["python", "-m", "mytrainpkg.train", "--epochs", "2"]
    assert "mytrainpkg.train" not in sys.modules


def test_script_without_python_in_front(tmp_path):
    path = write_script(tmp_path, PRELUDE + "for _ in range(3):\n    step()\n")
    profile = run_command([str(path)], steps=None, warmup=0)
    assert profile.status == "completed" and len(profile.steps) == 3


# -------------------------------------------------------------- step markers


LOOP_WITHOUT_OPTIMIZER = """
import torch
w = torch.zeros(3, requires_grad=True)
def train_step(i):
    loss = (w - i).pow(2).sum()
    loss.backward()
    with torch.no_grad():
        w.sub_(0.1 * w.grad)
        w.grad = None
    return loss
"""


def test_step_marker_in_an_imported_module(tmp_path):
    (tmp_path / "marker_loop_mod.py").write_text(LOOP_WITHOUT_OPTIMIZER)
    source = "import marker_loop_mod\nfor i in range(8):\n    marker_loop_mod.train_step(i)\n"
    profile = run_script(tmp_path, source, steps=3, warmup=1, step_marker="marker_loop_mod:train_step")
    assert profile.status == "stopped"
    assert [s.phase for s in profile.steps] == ["warmup", "measured", "measured", "measured"]
    assert "marker_loop_mod" not in sys.modules


def test_step_marker_on_a_function_of_the_script_itself(tmp_path):
    source = LOOP_WITHOUT_OPTIMIZER + "for i in range(8):\n    train_step(i)\n"
    for marker in ("__main__:train_step", "train:train_step"):
        profile = run_script(tmp_path, source, steps=2, warmup=1, step_marker=marker)
        assert profile.status == "stopped", (marker, profile.detail)
        assert len(profile.steps) == 3, marker
    assert sys.gettrace() is None


def test_step_marker_on_a_method_of_the_script(tmp_path):
    source = LOOP_WITHOUT_OPTIMIZER + """
class Trainer:
    def step(self, i):
        return train_step(i)
t = Trainer()
for i in range(8):
    t.step(i)
"""
    profile = run_script(tmp_path, source, steps=2, warmup=0, step_marker="__main__:Trainer.step")
    assert profile.status == "stopped" and len(profile.steps) == 2


def test_step_marker_that_is_never_called(tmp_path):
    (tmp_path / "marker_unused_mod.py").write_text("def train_step():\n    pass\n")
    profile = run_script(tmp_path, "import marker_unused_mod\n", steps=2, step_marker="marker_unused_mod:train_step")
    assert profile.status == "completed" and not profile.steps
    assert any("was never called" in w for w in profile.warnings)


@pytest.mark.parametrize("marker, message", [
    ("no_colon", "expected MODULE:FUNCTION"),
    ("mod:", "expected MODULE:FUNCTION"),
    ("mod:not-a-name", "expected MODULE:FUNCTION"),
    ("marker_missing_module_xyz:f", "cannot import marker_missing_module_xyz"),
    ("os:no_such_function_here", "no function no_such_function_here in os"),
])
def test_bad_step_markers_are_usage_errors(tmp_path, marker, message):
    from torchaxe.errors import TorchaxeError

    with pytest.raises(TorchaxeError, match=message):
        run_script(tmp_path, PRELUDE, step_marker=marker)



def test_a_folder_with_main_runs_with_itself_on_the_path(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper_for_folder_test.py").write_text("N = 3\n")
    write_script(app, PRELUDE + "import helper_for_folder_test\nfor _ in range(helper_for_folder_test.N):\n    step()\n",
                 name="__main__.py")
    profile = run_command(["python", str(app)], steps=None, warmup=0)
    assert profile.status == "completed", profile.detail
    assert len(profile.steps) == 3


def test_code_map_classifies_files(tmp_path):
    from torchaxe.runtime.probes import CodeMap

    torch_dir, lib, work = tmp_path / "site" / "torch", tmp_path / "lib", tmp_path / "work"
    codes = CodeMap(internal=(str(torch_dir),), library=(str(lib), str(tmp_path / "site")), cwd=str(work),
                    installed=(str(tmp_path / "site"),))
    assert codes.kind(str(torch_dir / "optim" / "adam.py")) == "internal"
    assert codes.kind(str(torch_dir / "_tensor.py")) == "tensor"
    assert codes.kind(str(tmp_path / "site" / "transformers" / "x.py")) == "library"
    assert codes.kind(str(lib / "logging" / "__init__.py")) == "library"
    assert codes.kind("<frozen runpy>") == "library"
    assert codes.kind(str(work / "train.py")) == "user"
    assert codes.show(str(work / "sub" / "train.py")) == "sub/train.py"
    assert codes.show("/elsewhere/train.py") == "/elsewhere/train.py"
    assert codes.is_installed(str(tmp_path / "site" / "transformers" / "x.py"))
    assert not codes.is_installed(str(lib / "logging" / "__init__.py"))
    assert codes.show_library(str(tmp_path / "site" / "transformers" / "trainer.py"), 7) == "transformers/trainer.py:7"
    assert codes.show_library(str(lib / "logging" / "__init__.py"), 3) == "logging/__init__.py:3"


def test_input_signature():
    import torch

    from torchaxe.runtime.probes import ShapeTallier, input_signature

    batch = {"ids": torch.zeros(2, 5, dtype=torch.long), "mask": torch.ones(2, 5, dtype=torch.bool), "n": 3}
    assert input_signature(batch, torch.Tensor) == (((2, 5), "int64"), ((2, 5), "bool"), (None, None))
    args = (torch.zeros(3), (torch.zeros(1, 2), None), 1.5)
    assert input_signature(args, torch.Tensor) == (((3,), "float32"), ((1, 2), "float32"), (None, None),
                                                   (None, None))
    tally = ShapeTallier(torch.Tensor)
    for n in range(40):
        tally.add((torch.zeros(n % 35 + 1),))
    result = tally.tally("m", "Linear")
    assert result.calls == 40 and len(result.signatures) == 32 and result.truncated and result.dynamic
    assert result.signatures[0].count == 2


class FakeDevice:
    """A backend with a device: counts synchronisations, reports memory, and has a
    runtime that warns at synchronisations (like cuda's sync debug mode)."""

    name = "cuda"

    def __init__(self):
        self.syncs = 0
        self.peak = 0
        self.warnings_on = False

    def is_initialized(self):
        return True

    def synchronize(self):
        self.syncs += 1

    def reset_peak_memory(self):
        self.peak = 0

    def peak_memory_bytes(self):
        self.peak += 1000
        return self.peak

    def profiler_activities(self):
        return ("cpu",)

    def enable_sync_warnings(self):
        self.warnings_on = True

        def undo():
            self.warnings_on = False
        return undo


def test_backend_synchronises_at_boundaries_and_reports_memory_and_sync_warnings(tmp_path):
    from torchaxe.runtime.command import parse_command
    from torchaxe.runtime.harness import Harness, HarnessOptions

    source = PRELUDE + """
import warnings
for _ in range(4):
    step()
    warnings.warn("called a synchronizing CUDA operation")   # DEVICE
    loss = step().item()                                       # HOST
"""
    path = write_script(tmp_path, source)
    device = FakeDevice()
    profile = Harness(HarnessOptions(steps=None, warmup=0), backend=device).run(parse_command(["python", str(path)]))
    assert profile.run.target == "cuda"
    assert device.syncs == 1 + len(profile.steps) and len(profile.steps) == 8
    assert all(s.peak_device_memory_bytes == 1000 for s in profile.steps)
    assert profile.summary.peak_device_memory_bytes == 1000
    sites = {(s.line, s.call): s.count for s in profile.host_syncs}
    # On a device only device tensors count: the cpu tensor's .item() is not a sync.
    assert sites == {(line_of(path, "DEVICE"), "device-sync"): 4}
    assert device.warnings_on is False


def test_a_one_shot_module_hook_in_an_eager_run_acts_once_and_leaves_no_hook() -> None:
    # An eager script keeps torch's fast module call (no global hooks) after the start.
    import torch
    from torch.nn.modules import module as torch_module

    from torchaxe.runtime.dynamo import OneShotModuleHook

    seen: list[int] = []
    before = len(torch_module._global_forward_pre_hooks)
    hook = OneShotModuleHook(lambda: seen.append(1))
    hook.install()
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2))
    layer(torch.ones(1, 2))
    assert seen == [1]
    assert len(torch_module._global_forward_pre_hooks) == before


def test_a_compile_after_the_probes_are_removed_traces_torchs_own_tensor_methods():
    # Dynamo snapshots the tensor class's attributes when it is first imported: imported
    # while the probes' wrappers of Tensor.to and Tensor.item were installed, a later
    # compile in the process (the tuner's, under a torch function mode) traced the
    # removed wrappers and failed to build its guards ("'method_descriptor' object has no attribute '__closure__'").
    code = (
        "import torch\n"
        "from torchaxe.runtime.probes import CodeMap, HostSyncProbe\n"
        "class Sink:\n    started = False\n"
        "sync = HostSyncProbe(Sink(), CodeMap(), count_host_tensors=True); sync.install()\n"
        "import torch._dynamo\n"
        "sync.uninstall()\n"
        "def f(x, y):\n    return x.to(torch.float64).sum() + y.to(torch.float64).mean()\n"
        "from torch.overrides import TorchFunctionMode\n"
        "class Mode(TorchFunctionMode):\n"
        "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        return func(*args, **(kwargs or {}))\n"
        "with Mode():  # as the tuner's checks run (stochastic layers off)\n"
        "    out = torch.compile(f, backend='eager', fullgraph=True)(torch.randn(3), torch.randn(2))\n"
        "print('ok', out.dtype)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok torch.float64" in run.stdout, run.stderr[-2000:]
