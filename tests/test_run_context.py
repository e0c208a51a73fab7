"""The run context: what the profiled run shows the script doing itself (its own
torch.compile, its own autocast), read in the process that ran it, and the knob
candidates advise then leaves out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchaxe.advise.candidates import knob_candidates, script_speedups

SCRIPT = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
if {compile}:
    model = torch.compile(model, backend="eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled={autocast}):
        loss = model(x).float().pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def bootstrap_context(tmp_path: Path, script: str, *options: str, warmup: int = 1) -> dict:
    """The run context of ``python SCRIPT`` run from ``tmp_path`` under the bootstrap."""
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"name": "plain"}))
    context = tmp_path / "context.json"
    done = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out",
                           str(tmp_path / "p.json"), "--steps", "2", "--warmup", str(warmup), "--target", "cpu",
                           *options, "--context-out", str(context), "--", "python", script],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert context.exists(), done.stderr[-2000:]
    return json.loads(context.read_text())


def run_context_of(tmp_path: Path, compile: bool, autocast: bool) -> dict:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(compile=compile, autocast=autocast))
    return bootstrap_context(tmp_path, str(script))["settings"]


def test_a_plain_script_neither_compiles_nor_autocasts(tmp_path: Path) -> None:
    settings = run_context_of(tmp_path, compile=False, autocast=False)
    assert settings["compiled_graphs"] == 0
    assert settings["autocast"] is None
    # Whether this CPU has bfloat16 instructions, for the precision candidates.
    from torchaxe.backends.cpu import native_bfloat16

    assert settings["cpu_bfloat16"] is native_bfloat16()


def test_a_float64_model_is_seen_and_mixed_precision_is_not_offered(tmp_path: Path) -> None:
    # autocast leaves float64 operations alone: a float64 model's bf16 "change" measured
    # nothing (a review's LSTMCell model: "loss +0.00%"), where float32 was 1.44x.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(compile=False, autocast=False).replace(
        "nn.Linear(8, 2))", "nn.Linear(8, 2)).double()").replace("torch.randn(4, 8)", "torch.randn(4, 8).double()"))
    settings = bootstrap_context(tmp_path, str(script))["settings"]
    assert settings["model_dtypes"] == ["float64"]
    keys = {c.key for c in knob_candidates("cpu", {}, settings)}
    assert not any(k.startswith("knob:autocast") for k in keys)
    assert any(k.startswith("knob:autocast") for k in {c.key for c in knob_candidates("cpu", {}, {
        **settings, "model_dtypes": ["float32"], "cpu_bfloat16": True})})
    assert any("parameters are float64" in n and "model.float()" in n for n in script_speedups(settings, "cpu"))
    plain = run_context_of(tmp_path, compile=False, autocast=False)
    assert plain["model_dtypes"] == ["float32"]
    assert not any("float64" in n for n in script_speedups(plain, "cpu"))


def test_the_scripts_own_compile_and_autocast_are_seen(tmp_path: Path) -> None:
    settings = run_context_of(tmp_path, compile=True, autocast=True)
    assert settings["compiled_graphs"] >= 1
    assert settings["autocast"] == "bfloat16"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_what_the_script_does_itself_is_not_tried_again(target: str) -> None:
    plain = {c.key for c in knob_candidates(target, {}, {})}
    assert "knob:compile" in plain and "knob:autocast-bf16" in plain
    own = {c.key for c in knob_candidates(target, {}, {"compiled_graphs": 3, "autocast": "bfloat16"})}
    assert not any(k.startswith(("knob:compile", "knob:autocast")) for k in own)
    notes = script_speedups({"compiled_graphs": 3, "autocast": "bfloat16"}, "cpu")
    assert "compiles its model itself (3 graph(s)" in notes[0] and "autocast (bfloat16)" in notes[1]
    assert script_speedups({"compiled_graphs": 0}, "cpu") == []


@pytest.mark.parametrize("steps", ["2", "all"])
def test_the_scripts_own_modules_count_as_imported_however_the_run_ends(tmp_path: Path, steps: str) -> None:
    # "all": the script runs to its end, after which its own modules are dropped from
    # sys.modules; "2": it is stopped in the middle of its loop.
    (tmp_path / "model.py").write_text("from torch import nn\n\ndef build():\n    return nn.Linear(8, 2)\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(compile=False, autocast=False).replace(
        "model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))",
        "from model import build\nmodel = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), build())"))
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"name": "plain"}))
    context = tmp_path / "context.json"
    subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out", str(tmp_path / "p.json"),
                    "--steps", steps, "--warmup", "1", "--target", "cpu", "--context-out", str(context), "--",
                    "python", str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    modules = json.loads(context.read_text())["modules"]
    assert str((tmp_path / "model.py").resolve()) in modules
    assert not any("torchaxe" in m for m in modules)  # the bootstrap (run as __main__) is ours, not the user's


def test_a_script_that_compiles_its_own_model_runs_under_every_probe(tmp_path: Path) -> None:
    # dynamo traces global module hooks and nn.Module.__call__ patches into the
    # script's graph: torchaxe's probes must stay out of it (runtime/dynamo.py).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(compile=True, autocast=False))
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"name": "plain", "autocast": {"dtype": "bfloat16"}}))
    done = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out",
                           str(tmp_path / "p.json"), "--steps", "2", "--warmup", "1", "--target", "cpu", "--shapes",
                           "--ops", "--context-out", str(tmp_path / "c.json"), "--", "python", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["status"] == "stopped", done.stderr[-2000:]
    assert "global hooks" not in done.stderr  # torch's warning about our hooks is not the user's business
    assert json.loads((tmp_path / "c.json").read_text())["settings"]["compiled_graphs"] >= 1


HELPER = """
import torch


def used(x):
    return x * 0.5 * (1.0 + torch.tanh(x))


def unused(x):
    return x * torch.sigmoid(1.702 * x)


class Pictures(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return (torch.full((8,), float(i)),)  # decoded here


class Unused(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return (torch.zeros(8),)  # never read


def make_loader():
    return torch.utils.data.DataLoader(torch.utils.data.Subset(Pictures(), range(64)), batch_size=4)


def make_other_loader():
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    return torch.utils.data.DataLoader(data, batch_size=8, num_workers=0)
"""

LOOP = """
import torch
from torch import nn
import helper

model = nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if model.in_features == 0:
    optimizer = torch.optim.Adam(model.parameters())  # never built
for (x,) in helper.make_loader():
    loss = helper.used(model(x)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_the_run_records_which_functions_a_step_ran_and_where_loaders_were_built(tmp_path: Path) -> None:
    from torchaxe.advise.candidates import run_by_the_job
    from torchaxe.findings import Finding
    from torchaxe.runtime.run_context import built_loader, built_optimizer, executed, loader_workers

    # The helper stands for an installed package: code the user's loop calls into.
    (tmp_path / "helper.py").write_text(HELPER)
    (tmp_path / "train.py").write_text(LOOP)
    context = bootstrap_context(tmp_path, str(tmp_path / "train.py"), "--ops", warmup=2)
    helper = str((tmp_path / "helper.py").resolve())
    used, unused = _line_of(HELPER, "0.5 * (1.0"), _line_of(HELPER, "sigmoid(1.702")
    built, not_built = _line_of(HELPER, "batch_size=4"), _line_of(HELPER, "batch_size=8")
    decoded, never_read = _line_of(HELPER, "decoded here"), _line_of(HELPER, "never read")
    assert executed(context, helper, used) is True
    assert executed(context, helper, unused) is False
    # The loop itself was running when the step began: its lines count as executed.
    assert executed(context, str(tmp_path / "train.py"), _line_of(LOOP, "loss.backward")) is True
    assert built_loader(context, helper, built) is True
    assert loader_workers(context, helper, built) == 0 and loader_workers(context, helper, not_built) is None
    assert built_loader(context, helper, not_built) is False
    train = str((tmp_path / "train.py").resolve())
    assert built_optimizer(context, train, _line_of(LOOP, "torch.optim.SGD")) is True
    assert built_optimizer(context, train, _line_of(LOOP, "torch.optim.Adam")) is False
    # Each loader's epoch, for the compile candidates (a smaller last batch recompiles).
    assert context["settings"]["loader_epochs"] == [
        {"site": f"{helper}:{built}", "batch_size": 4, "samples": 64, "drop_last": False, "last_batch_samples": None,
         "batched_fetch": False}]

    def finding(code: str, line: int) -> Finding:
        return Finding(code, "affinity", "", helper, line, 0, line, 1, "", "all")

    kept, idle = run_by_the_job([finding("AX101", used), finding("AX102", unused), finding("AX401", built),
                                 finding("AX401", not_built), finding("AX501", unused), finding("AX404", decoded),
                                 finding("AX404", never_read), finding("AX205", unused)], context)
    # A decode in the class of a dataset a loader was built on (through a Subset)
    # counts, wherever its __getitem__ ran; one in a class no loader used does not.
    # A weight average (AX205) in code no step ran (timm's EMA, switched off) is idle.
    assert [(f.code, f.line) for f in kept] == [("AX101", used), ("AX401", built), ("AX501", unused),
                                                ("AX404", decoded)]
    assert [(f.code, f.line) for f in idle] == [("AX102", unused), ("AX401", not_built), ("AX404", never_read),
                                                ("AX205", unused)]
    # An optimizer call in a package that built no optimizer in the run (a framework's
    # demo module the job imported) is left out; the one the run built is kept.
    sgd, adam = _line_of(LOOP, "torch.optim.SGD"), _line_of(LOOP, "torch.optim.Adam")
    kept, idle = run_by_the_job([Finding("AX201", "optimizer", "", train, line, 0, line, 1, "", "all")
                                 for line in (sgd, adam)], context)
    assert [f.line for f in kept] == [sgd] and [f.line for f in idle] == [adam]


RELATIVE = """
import torch
from torch import nn


def act(x):
    return x * torch.sigmoid(x)


def unused(x):
    return x * torch.sigmoid(1.702 * x)


model = nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
spare = torch.utils.data.DataLoader(list(range(8)), num_workers=2)  # built, never read
train_loader = torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4)
val_loader = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
for step, x in enumerate(train_loader):
    loss = act(model(x)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for v in val_loader:
            model(v)
"""


def test_a_script_named_by_a_relative_path_is_known_to_have_run_its_functions(tmp_path: Path) -> None:
    """`python train.py` from the script's folder: its functions' code carries the
    absolute path (as under Python itself), so a finding in them is measured. The
    loop's own code runs at module level: the lines of a function it never called are
    not among the lines it ran."""
    from torchaxe.runtime.run_context import executed, fed_training, loader_workers

    (tmp_path / "train.py").write_text(RELATIVE)
    context = bootstrap_context(tmp_path, "train.py", "--ops", "--shapes")
    script = str(tmp_path / "train.py")
    assert executed(context, script, _line_of(RELATIVE, "x * torch.sigmoid(x)")) is True
    assert executed(context, script, _line_of(RELATIVE, "torch.sigmoid(1.702")) is False
    assert executed(context, script, _line_of(RELATIVE, "loss.backward")) is True
    # How many workers the loaders built there had (AX403 on a loader without any
    # workers in the run is listed only).
    assert loader_workers(context, script, _line_of(RELATIVE, "num_workers=2")) == 2
    assert loader_workers(context, script, _line_of(RELATIVE, "loss.backward")) is None
    # Which loaders fed training steps (a backward pass after their batch): not the
    # evaluation loader read under no_grad inside each step.
    assert fed_training(context, script, _line_of(RELATIVE, "train_loader =")) is True
    assert fed_training(context, script, _line_of(RELATIVE, "val_loader =")) is False


def test_nothing_is_left_out_when_the_run_did_not_record_what_it_executed() -> None:
    from torchaxe.advise.candidates import run_by_the_job
    from torchaxe.findings import Finding

    findings = [Finding("AX101", "affinity", "", "/x/y.py", 3, 0, 3, 1, "", "all"),
                Finding("AX401", "data", "", "/x/y.py", 9, 0, 9, 1, "", "all")]
    assert run_by_the_job(findings, {}) == (findings, [])


def test_a_loaders_epoch_says_how_many_samples_its_last_batch_holds() -> None:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from torchaxe.runtime.run_context import loader_epoch

    data = TensorDataset(torch.zeros(10, 2))
    assert loader_epoch(DataLoader(data, batch_size=4, shuffle=True)) == {
        "batch_size": 4, "samples": 10, "drop_last": False, "last_batch_samples": 2}
    assert loader_epoch(DataLoader(data, batch_size=4, drop_last=True))["last_batch_samples"] is None
    assert loader_epoch(DataLoader(data, batch_size=5))["last_batch_samples"] is None
    # This process's share under a DistributedSampler: 5 of the 10 samples on each of 2 ranks.
    shared = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert loader_epoch(shared)["samples"] == 5 and loader_epoch(shared)["last_batch_samples"] == 1

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert loader_epoch(DataLoader(Stream(), batch_size=2)) is None  # no length: unknown
    assert loader_epoch(DataLoader(data, batch_size=None)) is None  # not batched by a size


DIRECT_FORWARD = """
import torch
from torch import nn

class Layer(nn.Linear):
    # pytorch/examples' forward-forward: each layer trains itself, calling its own
    # forward directly; only the parameterless ReLU goes through nn.Module.__call__.
    def __init__(self, a, b):
        super().__init__(a, b)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

    def forward(self, x):
        return self.relu(torch.mm(x / (x.norm(2, 1, keepdim=True) + 1e-4), self.weight.T) + self.bias)

    def train_on(self, x, steps):
        for _ in range(steps):
            loss = torch.log1p(torch.exp(2.0 - self.forward(x).pow(2).mean(1))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

torch.manual_seed(0)
Layer(64, 32).train_on(torch.randn(128, 64), 12)
"""


def test_a_script_that_calls_its_layers_forward_directly_is_profiled_with_operators(tmp_path: Path) -> None:
    # The model finder found nothing to take (no module with parameters called through
    # nn.Module.__call__) and kept its patch in place, where torch.profiler's Python
    # tracer met it: a segmentation fault. The finders give up when the first step ends.
    (tmp_path / "train.py").write_text(DIRECT_FORWARD)
    context = bootstrap_context(tmp_path, str(tmp_path / "train.py"), "--ops", warmup=2)
    profile = json.loads((tmp_path / "p.json").read_text())
    assert len([s for s in profile["steps"] if s["phase"] == "measured"]) == 2
    assert context["settings"]["compiled_graphs"] == 0
    mm = next(op for op in profile["ops"] if op["name"] == "aten::mm")
    # with the user's code that called it: the Python tracer ran
    assert any(source["function"] == "forward" and source["location"].startswith("train.py:")
               for source in mm["sources"])


REBUILT = """
import sys
sys.path.insert(0, {packages!r})
import torch
from torch.utils.data import DataLoader, TensorDataset
from wrapper import prepare

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
train_loader = DataLoader(data, batch_size=8)  # the user's line
eval_loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)  # evaluation
train = prepare(train_loader)
for x, y in train:
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    for (x,) in eval_loader:
        model(x)
"""


def test_a_loader_a_package_rebuilds_counts_for_the_users_line(tmp_path: Path) -> None:
    # accelerate's prepare(train_loader) builds a new DataLoader over the same dataset
    # inside the package: its batches fed training, and so did the user's loader line.
    from torchaxe.runtime.run_context import fed_training

    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "wrapper.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "def prepare(loader):\n"
        "    return DataLoader(loader.dataset, batch_size=loader.batch_size)\n")
    script = REBUILT.format(packages=str(packages))
    (tmp_path / "train.py").write_text(script)
    context = bootstrap_context(tmp_path, str(tmp_path / "train.py"), "--shapes", warmup=1)
    train = str((tmp_path / "train.py").resolve())
    assert fed_training(context, train, _line_of(script, "the user's line")) is True
    assert fed_training(context, train, _line_of(script, "# evaluation")) is False
