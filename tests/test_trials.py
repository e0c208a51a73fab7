"""Trials without subprocesses: knob validation, interleaving, failures, ratios,
rendering, the bootstrap's patches applied in-process, and CLI usage errors."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

from torchaxe.cli import main
from torchaxe.runtime import bootstrap, knob_specs
from torchaxe.data.knob import DataLoaderOverride
from torchaxe.runtime.knobs import KnobError, KnobSet, knob_set_from_dict, load_knob_set
from torchaxe.runtime.trials import TrialOptions, TrialRun, run_trials, unique_names, child_environment, bootstrap_argv
from torchaxe.report.trial_text import render_trial_report
from torchaxe.runtime.stats import Samples

FULL = {
    "name": "fused",
    "env": {"OMP_NUM_THREADS": "2", "GONE": None},
    "torch": {"cudnn_benchmark": True, "matmul_precision": "high", "num_threads": 2, "interop_threads": 1},
    "compile": {"mode": "default", "dynamic": None, "backend": "inductor"},
    "dataloader": {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 4},
    "cpu_affinity": [1, 0],
    "npu": {"jit_compile": False},
}


def test_full_knob_set_round_trips(tmp_path):
    path = tmp_path / "fused.json"
    path.write_text(json.dumps(FULL))
    knobs = load_knob_set(path)
    assert knobs.name == "fused"
    assert knobs.env == {"OMP_NUM_THREADS": "2", "GONE": None}
    assert knobs.torch.num_threads == 2 and knobs.torch.matmul_precision == "high"
    assert knobs.compile.kwargs() == {"backend": "inductor", "fullgraph": False, "dynamic": None}
    assert knobs.dataloader.overrides() == {"num_workers": 2, "pin_memory": True, "persistent_workers": True,
                                            "prefetch_factor": 4}
    assert knobs.cpu_affinity == (0, 1)
    assert knobs.npu.jit_compile is False
    again = knob_set_from_dict(knobs.to_dict(), "again")
    assert again.to_dict() == knobs.to_dict()


def test_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text("{}")
    knobs = load_knob_set(path)
    assert knobs.name == "baseline" and knobs.summary == "(no knobs)"


@pytest.mark.parametrize("data, message", [
    ({"envv": {}}, "a.json: envv: unknown key"),
    ([], "a.json: expected a JSON object of knobs"),
    ({"env": {"X": 1}}, "a.json: env.X: expected a string (or null to unset it), got number 1"),
    ({"env": []}, "a.json: env: expected an object"),
    ({"torch": {"num_threads": 0}}, "a.json: torch.num_threads: 0 is below the minimum 1"),
    ({"torch": {"num_threads": "2"}}, "a.json: torch.num_threads: expected an integer, got string \"2\""),
    ({"torch": {"matmul_precision": "low"}}, "a.json: torch.matmul_precision: \"low\" is not one of highest, high, medium"),
    ({"torch": {"cudnn_benchmark": 1}}, "a.json: torch.cudnn_benchmark: expected true or false"),
    ({"torch": {"threads": 1}}, "a.json: torch.threads: unknown key"),
    ({"compile": {"mode": "fast"}}, "a.json: compile.mode: \"fast\" is not one of"),
    ({"compile": {"backend": 3}}, "a.json: compile.backend: expected a backend name"),
    ({"dataloader": {"num_workers": -1}}, "a.json: dataloader.num_workers: -1 is below the minimum 0"),
    ({"dataloader": {"batch_size": 4}}, "a.json: dataloader.batch_size: unknown key"),
    ({"cpu_affinity": []}, "a.json: cpu_affinity: expected a non-empty list"),
    ({"cpu_affinity": [0, "1"]}, "a.json: cpu_affinity[1]: expected an integer"),
    ({"npu": {"jit_compile": "no"}}, "a.json: npu.jit_compile: expected true or false"),
    ({"name": ""}, "a.json: name: expected a non-empty string"),
])
def test_bad_knobs_are_refused_in_one_line(data, message):
    with pytest.raises(KnobError) as info:
        knob_set_from_dict(data, "a.json")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(KnobError, match="missing.json: knob file not found"):
        load_knob_set(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(KnobError, match=r"bad.json: not valid JSON: .* line 1 column 2"):
        load_knob_set(bad)


# ------------------------------------------------------------ run_trials, fake runner


def fake_runner(medians: dict[str, list[float]], fail: dict[str, int] | None = None, calls: list | None = None):
    fail = fail or {}

    def run(knobs: KnobSet, command, options, repeat):
        if calls is not None:
            calls.append((knobs.name, repeat))
        if fail.get(knobs.name) == repeat:
            return TrialRun(knobs.name, repeat, ok=False, returncode=3, error="error: boom", stderr_tail="Trace\nboom")
        m = medians[knobs.name][repeat - 1]
        return TrialRun(knobs.name, repeat, ok=True, step_seconds=[m * 0.9, m, m * 1.1], returncode=0, status="stopped")

    return run


def sets(*names):
    return [KnobSet(name=n) for n in names]


def test_runs_are_interleaved_and_ratios_are_per_repeat():
    calls = []
    runner = fake_runner({"a": [0.010, 0.020, 0.010], "b": [0.005, 0.010, 0.006]}, calls=calls)
    report = run_trials(sets("a", "b"), ["python", "t.py"], TrialOptions(repeats=3), runner=runner)
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
    a, b = report.results
    assert a.ratio.per_repeat == [1.0, 1.0, 1.0]
    assert b.ratio.per_repeat == pytest.approx([0.5, 0.5, 0.6])
    assert b.ratio.samples.median == pytest.approx(0.5)
    assert len(b.samples) == 9  # raw samples kept, by run
    data = json.loads(report.to_json())
    assert data["schema"] == "torchaxe.trial/1" and data["baseline"] == "a"
    kb = data["knob_sets"][1]
    assert kb["status"] == "ok" and kb["ratio"]["min"] == pytest.approx(0.5) and kb["ratio"]["max"] == pytest.approx(0.6)
    assert kb["runs"][0]["step_seconds"] == pytest.approx([0.0045, 0.005, 0.0055])


def test_runs_are_compared_by_their_steps_mean_without_the_extremes_not_by_the_median():
    # A loader's two workers deliver batches in bursts: fast steps between steps that
    # wait. Its median lands on the fast ones (0.02 s) though the run takes as long
    # as the original's even steps; one spike in the original's is set aside.
    bursty = [0.02, 0.18] * 5 + [0.02] * 2
    even = [0.085] * 11 + [0.9]

    def run(knobs: KnobSet, command, options, repeat):
        steps = bursty if knobs.name == "workers" else even
        return TrialRun(knobs.name, repeat, ok=True, step_seconds=list(steps), returncode=0, status="stopped")

    report = run_trials(sets("original", "workers"), ["python", "t.py"], TrialOptions(repeats=2), runner=run)
    workers = report.results[1]
    assert Samples.of(bursty).median / Samples.of(even).median < 0.3  # what a median would have said
    # Each: the mean of the ten steps left (six fast, four slow) over 0.085 s.
    assert workers.ratio.per_repeat == pytest.approx([(6 * 0.02 + 4 * 0.18) / 10 / 0.085] * 2)
    assert Samples.of([1.0, 2.0, 3.0]).trimmed_mean(0.1) == pytest.approx(2.0)  # a handful: nothing set aside
    assert Samples.of(list(range(10))).trimmed_mean(0.1) == pytest.approx(4.5)
    with pytest.raises(ValueError):
        Samples.of([1.0]).trimmed_mean(0.5)


def test_runs_of_one_set_far_apart_are_said_so():
    # llama2.c on a busy machine: one run's median 2.18 s, the next 94 ms.
    runner = fake_runner({"a": [2.18, 0.094], "b": [0.09, 0.09]})
    report = run_trials(sets("a", "b"), ["t.py"], TrialOptions(repeats=2), runner=runner)
    out = io.StringIO()
    render_trial_report(report, out)
    text = out.getvalue()
    assert "a: its runs' median steps lay" in text and "(23.2x)" in text and "b: its runs'" not in text


def test_a_failing_set_is_reported_and_the_others_still_run():
    calls = []
    runner = fake_runner({"a": [0.01] * 3, "b": [0.02] * 3, "c": [0.005] * 3}, fail={"b": 2}, calls=calls)
    progress = []
    report = run_trials(sets("a", "b", "c"), ["t.py"], TrialOptions(repeats=3), runner=runner, progress=progress.append)
    assert ("b", 3) not in calls and ("c", 3) in calls
    assert [r.name for r in report.failed] == ["b"]
    b = report.results[1]
    assert b.ratio is None and b.failed_run.error == "error: boom"
    assert report.results[2].ratio.samples.median == pytest.approx(0.5)
    assert any("b: FAILED: error: boom" in line for line in progress)
    out = io.StringIO()
    render_trial_report(report, out)
    text = out.getvalue()
    assert "FAILED" in text and "b failed (repeat 2): error: boom" in text and "| boom" in text
    assert "0.500 (0.500..0.500)" in text


def test_failed_baseline_gives_no_ratios():
    runner = fake_runner({"a": [0.01], "b": [0.02]}, fail={"a": 1})
    report = run_trials(sets("a", "b"), ["t.py"], TrialOptions(repeats=1), runner=runner)
    assert report.results[1].ok and report.results[1].ratio is None
    out = io.StringIO()
    render_trial_report(report, out)
    assert "the baseline a failed: no ratios" in out.getvalue()


def test_same_name_twice_is_told_apart():
    assert [k.name for k in unique_names(sets("a", "a", "b", "a"))] == ["a", "a-2", "b", "a-3"]


def test_options_are_checked():
    with pytest.raises(Exception, match="--repeats 0"):
        TrialOptions(repeats=0)


def test_child_environment_sets_and_unsets():
    knobs = KnobSet(name="x", env={"NEW": "1", "OLD": None})
    env = child_environment(knobs, {"OLD": "x", "KEEP": "y"})
    assert env == {"NEW": "1", "KEEP": "y"}


def test_bootstrap_command_line():
    argv = bootstrap_argv("k.json", "p.json", ["python", "t.py", "--lr", "1"], TrialOptions(steps=4, warmup=1, timeout=9))
    assert argv[1:4] == ["-m", "torchaxe.runtime.bootstrap", "k.json"]
    assert argv[argv.index("--"):] == ["--", "python", "t.py", "--lr", "1"]
    assert argv[argv.index("--timeout") + 1] == "9"


# ------------------------------------------------------------ bootstrap, in-process


def test_dataloader_override_handles_positional_and_keyword_arguments():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.zeros(4, 1))
    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    override = DataLoaderOverride({"num_workers": 2, "pin_memory": True, "prefetch_factor": 3}, applied)
    original = DataLoader.__init__
    override.install()
    try:
        positional = DataLoader(data, 2, False, None, None, 0)  # num_workers by position
        keyword = DataLoader(data, batch_size=2, num_workers=1)
    finally:
        override.uninstall()
    assert DataLoader.__init__ is original
    for loader in (positional, keyword):
        assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (2, True, 3)
    assert len(applied.record["dataloader"]["loaders"]) == 2
    assert DataLoader(data, num_workers=0).num_workers == 0  # uninstalled


def test_worker_only_options_are_dropped_when_no_workers():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    override = DataLoaderOverride({"persistent_workers": True, "prefetch_factor": 4}, applied)
    override.install()
    try:
        loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)  # torch would refuse both here
    finally:
        override.uninstall()
    assert loader.num_workers == 0 and loader.persistent_workers is False


def test_torch_settings_are_applied_and_recorded():
    import torch

    before = (torch.get_num_threads(), torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    knobs = knob_set_from_dict({"torch": {"num_threads": 1, "matmul_precision": "medium", "cudnn_benchmark": True}}, "t")
    applied = bootstrap.AppliedKnobs(knobs)
    try:
        knob_specs.apply_torch(knobs.torch, applied)
        assert torch.get_num_threads() == 1
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.set_num_threads(before[0])
        torch.set_float32_matmul_precision(before[1])
        torch.backends.cudnn.benchmark = before[2]
    assert applied.record["torch"] == {"cudnn_benchmark": True, "matmul_precision": "medium", "num_threads": 1}


def test_npu_compile_mode_goes_through_the_npu_backend(monkeypatch):
    calls = []
    fake = types.ModuleType("torch_npu")
    fake.npu = types.SimpleNamespace(set_compile_mode=lambda **kw: calls.append(kw))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    knobs = knob_set_from_dict({"npu": {"jit_compile": False}}, "n")
    applied = bootstrap.AppliedKnobs(knobs)
    knob_specs.apply_npu(knobs.npu, applied)
    assert calls == [{"jit_compile": False}]
    assert applied.record["npu"] == {"jit_compile": False}


def test_npu_knob_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    knobs = knob_set_from_dict({"npu": {"jit_compile": True}}, "n")
    with pytest.raises(Exception, match="npu.jit_compile: torch_npu is not installed"):
        knob_specs.apply_npu(knobs.npu, bootstrap.AppliedKnobs(knobs))


class _Net:
    """A model class of the user's own (defined here, not in torch)."""

    @staticmethod
    def make():
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(2, 2)

            def forward(self, x):
                return self.a(x).relu()

        return Net()


def test_model_compiler_picks_the_top_level_model_and_unpatches(monkeypatch):
    import torch
    from torch import nn

    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    original = nn.Module.__call__
    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    compiler = knob_specs.ModelCompiler({"backend": "eager"}, applied)
    compiler.install()
    try:
        nn.ReLU()(torch.zeros(1))  # no parameters: not the model
        model = _Net.make()
        model(torch.zeros(1, 2))
        assert nn.Module.__call__ is not original  # one iteration's models are still to come
        model(torch.zeros(1, 2))  # the model again: its iteration is over
        assert nn.Module.__call__ is original
        nn.Linear(2, 2)(torch.zeros(1, 2))  # a module first called later: left alone
    finally:
        compiler.uninstall()
    assert compiled == [("Net", {"backend": "eager"})]
    assert nn.Module.__call__ is original
    assert applied.record["compile"]["module"].endswith("Net") and applied.record["compile"]["compiled"] == "module"


def _gan_classes():
    """A generator and a discriminator: two model classes, each with a container inside."""
    import torch
    from torch import nn

    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.main = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, z):
            return torch.tanh(self.main(z))

    class Discriminator(Generator):
        def forward(self, x):
            return self.main(x)

    return Generator, Discriminator


def _gan_iterations(netD, netG, iterations: int) -> None:
    """dcgan's loop: the discriminator on real data, the generator, the discriminator on
    the fakes, and a loss without parameters."""
    import torch
    from torch import nn

    for _ in range(iterations):
        netD(torch.zeros(1, 2))
        fake = netG(torch.ones(1, 2))
        netD(fake.detach())
        nn.MSELoss()(fake, fake)


def test_model_compiler_compiles_each_model_of_a_gan_iteration(monkeypatch):
    # dcgan's loop: the discriminator on real data, the generator, the discriminator
    # on the fakes. Both networks train; compiling only the first left the generator eager.
    from torch import nn

    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compiled.append(type(self).__name__))
    original = nn.Module.__call__
    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    compiler = knob_specs.ModelCompiler({"backend": "eager"}, applied)

    Generator, Discriminator = _gan_classes()
    netG, netD = Generator(), Discriminator()
    compiler.install()
    try:
        _gan_iterations(netD, netG, 2)
    finally:
        compiler.uninstall()
    assert compiled == ["Discriminator", "Generator"]  # not their Sequential or Linear layers
    assert nn.Module.__call__ is original
    assert [n.rsplit(".", 1)[-1] for n in applied.record["compile"]["modules"]] == ["Discriminator", "Generator"]
    assert applied.record["compile"]["how"] == ["module", "module"]


def test_each_model_of_a_gan_iteration_compiles_once():
    # While the first model's first call is traced, nn.Module.__call__ must be torch's
    # own: a graph traced through the finder's patch is guarded on it and compiles
    # again once the patch is gone (dcgan compiled each network twice).
    import torch

    compiles = []

    def backend(gm, inputs):
        compiles.append(1)
        return gm.forward

    Generator, Discriminator = _gan_classes()
    torch._dynamo.reset()
    netD, netG = Discriminator(), Generator()
    compiler = knob_specs.ModelCompiler({"backend": backend}, bootstrap.AppliedKnobs(KnobSet(name="x")))
    compiler.install()
    try:
        _gan_iterations(netD, netG, 3)
    finally:
        compiler.uninstall()
        torch._dynamo.reset()
    assert compiler.models == [netD, netG] and len(compiles) == 2


def test_finders_installed_together_each_find_their_models_and_leave_torch_as_it_was():
    import torch
    from torch import nn

    from torchaxe.runtime.first_model import FirstModel

    original = nn.Module.__call__
    seen: dict[str, list] = {"first": [], "every": []}
    first = FirstModel(lambda m: seen["first"].append(m)).install()
    every = FirstModel(lambda m: seen["every"].append(m), every_model=True).install()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    try:
        a(torch.zeros(1, 2))
        assert nn.Module.__call__ is not original  # the every-model finder still watches
        b(torch.zeros(1, 2))
        a(torch.zeros(1, 2))
        assert nn.Module.__call__ is original
    finally:
        first.uninstall()
        every.uninstall()
    assert seen == {"first": [a], "every": [a, b]}
    assert nn.Module.__call__ is original


def test_blocks_recomputed_by_activation_checkpointing_are_not_models_of_the_loop():
    # Seen in a review: reentrant checkpointing calls each block again in the backward
    # pass, outside the model's forward; the blocks were taken as models of their own
    # ("autocast applied to Encoder and Block and Block and Block").
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from torchaxe.runtime.first_model import FirstModel

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return x

    model, seen = Encoder(), []
    finder = FirstModel(seen.append, every_model=True).install()
    try:
        x = torch.randn(2, 4, requires_grad=True)
        model(x).sum().backward()
        model(x).sum().backward()
    finally:
        finder.uninstall()
    assert seen == [model]


def test_names_of_models_are_counted_not_repeated():
    from torchaxe.units import counted

    assert counted(["Encoder", "Block", "Block", "Block"], " and ") == "Encoder and Block x3"
    assert counted(["Generator", "Discriminator"], " and ") == "Generator and Discriminator"


def test_model_compiler_stops_at_a_few_models_called_one_by_one(monkeypatch):
    # A loop that calls its layers from the script (no model class) is not compiled
    # layer by layer without end, and the patch does not stay on every call.
    import torch
    from torch import nn

    from torchaxe.runtime.first_model import MOST_MODELS

    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compiled.append(self))
    original = nn.Module.__call__
    compiler = knob_specs.ModelCompiler({"backend": "eager"}, bootstrap.AppliedKnobs(KnobSet(name="x")))
    layers = [_Net.make() for _ in range(MOST_MODELS + 3)]
    compiler.install()
    try:
        x = torch.zeros(1, 2)
        for layer in layers:
            x = layer(x)
        assert nn.Module.__call__ is original
    finally:
        compiler.uninstall()
    assert compiled == layers[:MOST_MODELS]


def test_a_sequential_model_runs_compiled(counting_backend):
    # torch.compile does not trace torch's own containers from nn.Module's call:
    # module.compile() leaves an nn.Sequential eager without a word.
    import torch
    from torch import nn

    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    compiler = knob_specs.ModelCompiler({"backend": counting_backend}, applied)
    compiler.install()
    try:
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        first = model(torch.ones(1, 2))
        model(torch.ones(1, 2))
    finally:
        compiler.uninstall()
    assert len(counting_backend.runs) == 2 and first.shape == (1, 2)
    assert applied.record["compile"]["compiled"] == "forward"
    assert set(model.state_dict()) == {"0.weight", "0.bias"}  # the same module, the same keys


def test_a_copy_of_a_compiled_torch_layer_runs_its_own_parameters():
    # An EMA copy or a checkpointed best model is a deepcopy made after the compile:
    # its forward must be bound to the copy, not to the model it was copied from.
    import copy

    import torch
    from torch import nn

    from torchaxe.runtime.compile_module import FORWARD, compile_in_place

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert compile_in_place(model, backend="eager") == FORWARD
    x = torch.ones(1, 2)
    before = model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].bias.add_(10.0)
    assert torch.equal(model(x), before)
    assert torch.equal(twin(x), torch.relu(twin[0](x)))
    assert not torch.equal(twin(x), before)


def test_a_torch_container_of_a_stopped_scripts_modules_compiles(tmp_path, counting_backend):
    # The tuner compiles after the script has stopped: its classes name `__main__`,
    # which is then not the script, and torch.compile looked their globals up there.
    import runpy

    import torch

    from torchaxe.runtime.compile_module import compile_in_place

    script = tmp_path / "script.py"
    script.write_text(
        "import math\nfrom torch import nn\n\n"
        "class Scaled(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.linear = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.linear(x) / math.sqrt(x.size(-1))\n")
    namespace = runpy.run_path(str(script), run_name="__main__")
    blocks = torch.nn.Sequential(namespace["Scaled"](), namespace["Scaled"]())
    x = torch.randn(2, 4)
    expected = blocks(x)
    compile_in_place(blocks, backend=counting_backend)
    assert torch.allclose(blocks(x), expected) and len(counting_backend.runs) == 1


DDP_COMPILE_CHECK = """
import datetime, json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchaxe.runtime import bootstrap, knob_specs
from torchaxe.runtime.compile_module import is_compiled_in_place
from torchaxe.runtime.knobs import KnobSet

runs = []


def counting_backend(gm, inputs):
    def run(*args):
        runs.append(1)
        return gm.forward(*args)
    return run


dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
try:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapper = DistributedDataParallel(inner)
    x = torch.randn(3, 4)
    expected = wrapper(x)
    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    knob_specs.ModelCompiler({"backend": counting_backend}, applied).compile(wrapper)
    out = wrapper(x)
    out.sum().backward()
finally:
    dist.destroy_process_group()
json.dump({"inner": is_compiled_in_place(inner), "wrapper": is_compiled_in_place(wrapper),
           "module": applied.record["compile"]["module"], "same": bool(torch.allclose(out, expected)),
           "runs": len(runs), "grad": inner[0].weight.grad is not None}, sys.stdout)
sys.stdout.flush()
# Past this point only the interpreter's teardown is left, where gloo's threads can abort
# the process ("terminate called without an active exception") on a busy machine.
os._exit(0)
"""


def test_a_ddp_wrapper_has_the_module_inside_it_compiled():
    # torch's guide: compile the module DDP wraps, not the wrapper (rule AX606 says
    # the same of the script's own code). One-rank gloo group: a real DDP. In its own
    # process, as under torchrun: a gloo group in a test worker that earlier tests
    # have used can wait forever in native code.
    import os
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src"
    proc = subprocess.run([sys.executable, "-c", DDP_COMPILE_CHECK], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(src)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["inner"] and not result["wrapper"]
    # and the run's note names what was compiled: the module inside the wrapper
    assert result["module"] == "Sequential (inside DistributedDataParallel)"
    assert result["same"] and result["runs"] >= 1 and result["grad"]


# ------------------------------------------------------------ CLI usage errors


def test_cli_bad_knob_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"torch": {"num_threads": "two"}}')
    script = tmp_path / "t.py"
    script.write_text("")
    code = main(["trial", "--knobs", str(bad), "--", "python", str(script)])
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.json: torch.num_threads: expected an integer" in err and "Traceback" not in err


def test_cli_missing_script_and_missing_knobs(tmp_path, capsys):
    good = tmp_path / "a.json"
    good.write_text("{}")
    assert main(["trial", "--knobs", str(good), "--", "python", str(tmp_path / "nope.py")]) == 2
    assert "script not found" in capsys.readouterr().err
    assert main(["trial", "--", "python", "x.py"]) == 2
    assert "--knobs" in capsys.readouterr().err


# ------------------------------------------------------------ the one measuring loop


def test_interleave_skips_a_failed_arm_and_ends_at_a_required_one():
    from torchaxe.runtime.trials import interleave

    calls, broken, failed = [], {("b", 1), ("a", 3)}, set()

    def run(arm, repeat):
        calls.append((arm, repeat))
        if (arm, repeat) in broken:
            failed.add(arm)

    assert interleave(["a", "b", "c"], run, lambda arm: arm in failed, rounds=4, required=["a"]) is True
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("c", 2), ("a", 3)]


def test_interleave_asks_the_stop_hook_with_the_runs_of_a_round_and_the_reserve():
    from torchaxe.runtime.trials import interleave

    asked, calls = [], []

    def stop(repeat, runs):
        asked.append((repeat, runs))
        return repeat == 3

    done = interleave(["a", "b"], lambda arm, repeat: calls.append((arm, repeat)), lambda arm: False,
                      rounds=5, first=1, reserve=4, stop=stop)
    assert done is False and asked == [(1, 6), (2, 6), (3, 6)] and len(calls) == 4
    # Arms chosen round by round, numbered on from ``first``, until none is named.
    plans = iter([["a"], ["a", "b"], []])
    calls.clear()
    assert interleave(lambda repeat: next(plans), lambda arm, repeat: calls.append((arm, repeat)),
                      lambda arm: False, first=3) is True
    assert calls == [("a", 3), ("a", 4), ("b", 4)]


def test_the_seed_knob_shifts_every_torch_seed_and_puts_manual_seed_back():
    import torch

    from torchaxe.runtime.knobs import AppliedKnobs

    originals = (torch.manual_seed, torch.random.manual_seed)  # not always one object (another library's wrapper)
    torch.manual_seed(6)
    expected = torch.rand(3)
    torch.manual_seed(0)
    unseeded = torch.rand(3)  # what a script that never seeds would draw after this point
    applied = AppliedKnobs(knob_set_from_dict({"seed": {"offset": 1}}, "test"))
    torch.manual_seed(0)
    with knob_specs.SEED.patch(1, applied):
        assert not torch.equal(torch.rand(3), unseeded)  # the initial seed is shifted too
        torch.manual_seed(5)
        assert torch.equal(torch.rand(3), expected)
        torch.random.manual_seed(5)
        assert torch.equal(torch.rand(3), expected)
    assert (torch.manual_seed, torch.random.manual_seed) == originals
    assert applied.record["seed"] == {"offset": 1}
    with pytest.raises(KnobError, match="seed.offset"):
        knob_set_from_dict({"seed": {"offset": -1}}, "knobs.json")


def test_knobs_that_pay_once_before_their_first_fast_step() -> None:
    from torchaxe.runtime.knobs import pays_once

    # A knob file's mapping (advice's) and a knob set's parsed values read alike.
    for raw in ({"compile": {}}, {"compile": {"mode": "max-autotune"}}, {"npu": {"jit_compile": True}},
                {"torch": {"cudnn_benchmark": True}}):
        assert pays_once(raw), raw
        assert pays_once(knob_set_from_dict({"name": "x", **raw}, "test").values), raw
    for raw in ({}, {"npu": {"jit_compile": False}}, {"torch": {"num_threads": 2}}, {"env": {"X": "1"}},
                {"dataloader": {"num_workers": 2}}):
        assert not pays_once(raw), raw
        assert not pays_once(knob_set_from_dict({"name": "x", **raw}, "test").values), raw
