"""The data probes under the real harness (in-process), the verdict and the join of
static findings with runtime evidence, and the new dataloader knob keys."""

from __future__ import annotations

import sys

from types import SimpleNamespace

import pytest
import torch

from torchaxe.data.analysis import DataReport, StepSplit, join_findings, judge
from torchaxe.data.probes import CopyProbe, LoaderProbe, LoaderRecord, process_cpu_seconds
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.command import parse_command
from torchaxe.runtime.harness import Harness, HarnessOptions
from torchaxe.runtime.knobs import KnobError, knob_set_from_dict

SCRIPT = """\
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((4,), float(i * i))

loader = DataLoader(Squares(), batch_size=4, num_workers={workers}, persistent_workers={persistent})  # LOADER
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(10):
    for x in loader:
        x.to("meta")  # a "device" copy the cpu can make
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def _run(tmp_path, workers=0, persistent=False, steps=8):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(workers=workers, persistent=persistent))
    loaders, copies = LoaderProbe(), CopyProbe()
    profile = Harness(HarnessOptions(steps=steps, warmup=1, target="cpu"),
                      probes=[loaders.attach, copies.attach]).run(parse_command(["python", str(path)]))
    return profile, loaders, copies, path


def test_loader_probe_records_settings_site_batches_and_waits(tmp_path):
    profile, loaders, copies, path = _run(tmp_path, workers=0)
    assert profile.status == "stopped"
    [record] = loaders.records
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "# LOADER" in text)
    assert record.file.endswith("train.py") and record.line == line
    assert record.num_workers == 0 and record.batch_size == 4 and record.dataset_type == "Squares"
    assert record.map_style and record.dataset_length == 24 and record.dataset is not None
    assert record.dataset_source is not None and record.dataset_source[1] == 4
    assert record.batches == 9 and record.batches_measured == 8
    measured_wait = sum(s.data_wait_seconds for s in profile.measured_steps)
    # the harness's data wait and the loader's own agree (the loader's wraps it)
    assert record.wait_measured_seconds >= measured_wait * 0.9
    assert len(record.iterator_seconds) == 2  # 6 batches an epoch: a second epoch started
    assert record.worker_utilisation is None
    # the .to("meta") copies, one per step, counted per step
    counted = {i: c for i, c in copies.steps.items() if i in {s.index for s in profile.measured_steps}}
    assert len(counted) == 8 and all(c.copies == 1 and c.bytes == 16 * 4 and c.blocking == 1 for c in counted.values())
    assert torch.utils.data.DataLoader.__init__.__name__ == "__init__"
    assert not hasattr(torch.utils.data.DataLoader.__init__, "__wrapped__")  # uninstalled
    assert "to" not in torch.Tensor.__dict__


def test_a_loader_an_installed_package_rebuilds_is_the_users_loader(tmp_path):
    # accelerate's prepare(train_loader) builds a new loader over the same dataset with
    # a batch sampler of its own: "built, never iterated" was said of the user's line,
    # and the rebuilt loader was sampled at batch size 1.
    from torchaxe.runtime.probes import CodeMap

    lib = tmp_path / "wrapping"  # beside the script, and taken for an installed package
    lib.mkdir()
    (lib / "__init__.py").write_text(
        "from torch.utils.data import BatchSampler, DataLoader, SequentialSampler\n\n\n"
        "def prepare(loader):\n"
        "    sampler = BatchSampler(SequentialSampler(loader.dataset), loader.batch_size, False)\n"
        "    return DataLoader(loader.dataset, batch_sampler=sampler)\n")
    script = SCRIPT.format(workers=0, persistent=False).replace(
        "for epoch in range(10):", "import wrapping\nloader = wrapping.prepare(loader)\nfor epoch in range(10):")
    path = tmp_path / "train.py"
    path.write_text(script)
    try:
        loaders = LoaderProbe(codes=CodeMap(library=(str(lib),)))
        profile = Harness(HarnessOptions(steps=4, warmup=1, target="cpu"),
                          probes=[loaders.attach]).run(parse_command(["python", str(path)]))
    finally:
        sys.modules.pop("wrapping", None)
    assert profile.status == "stopped", profile.detail
    [record] = loaders.records
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "# LOADER" in text)
    assert record.line == line and record.batch_size == 4 and record.batches_measured == 4


def test_worker_processes_are_timed(tmp_path):
    profile, loaders, _, _ = _run(tmp_path, workers=1, persistent=True)
    [record] = loaders.records
    assert record.num_workers == 1 and record.persistent_workers and record.start_method
    assert record.workers_started == 1 and len(record.iterator_seconds) == 1
    assert record.worker_alive_seconds > 0
    assert record.worker_utilisation is not None and 0.0 <= record.worker_utilisation <= 1.0
    data = record.to_dict()
    assert data["settings"]["multiprocessing_context"] == record.start_method and "dataset" not in data


def test_process_cpu_seconds():
    import os

    assert process_cpu_seconds(os.getpid()) >= 0.0
    assert process_cpu_seconds(2**22 + 12345) is None


# ------------------------------------------------------------------ verdict and join


def _record(**kwargs) -> LoaderRecord:
    base = dict(index=0, file="train.py", line=20, dataset_type="Images", map_style=True, dataset_length=100,
                batch_size=8, num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None,
                start_method=None, timeout=0.0, batches=10, batches_measured=10, wait_measured_seconds=0.5)
    base.update(kwargs)
    return LoaderRecord(**base)


def _stages(per_sample=0.01, read=0.001, decode=0.006, batch=8):
    return SimpleNamespace(per_sample_seconds=per_sample, per_batch_seconds=per_sample * batch,
                           stage_seconds=lambda: {"read": read, "decode": decode,
                                                  "transform": per_sample - read - decode, "collate": 0.0001},
                           dataset_type="Images")


def _report(record, wait=0.05, compute=0.05, steps=10, stages=None, cores=4, decoders=None, copies=None):
    report = DataReport(command=["python", "train.py"], target="cpu", status="stopped", detail="", cores=cores,
                        steps=[StepSplit(i, wait + compute, wait, 0.0) for i in range(steps)], loaders=[record],
                        stages={0: stages} if stages else {}, copies=copies or {}, decoders=decoders)
    from torchaxe.data.analysis import estimate

    report.estimate = estimate(report)
    return report


def test_verdict_data_bound_without_workers():
    report = _report(_record(), wait=0.05, compute=0.05, stages=_stages())
    verdict = judge(report)
    assert verdict.level == "data-bound" and verdict.data_bound
    assert verdict.headline.startswith("data-bound: the step waits for data 50.0% of the time")
    assert any("num_workers=0" in r and "80.0 ms to load" in r for r in verdict.reasons)
    assert any(s.startswith("num_workers=2") for s in verdict.suggestions)  # 80 ms / 50 ms
    assert any(r.startswith("per sample: read 1.00 ms, decode 6.00 ms") for r in verdict.reasons)


def test_a_getitem_that_computes_its_item_is_not_told_to_index_a_batch():
    # A review's speech dataset synthesised each waveform in __getitem__ (0.12 ms an
    # item, variable lengths): "index a whole batch at once" fits tensors in memory.
    def verdict(per_item, cores=4):
        stages = SimpleNamespace(per_sample_seconds=per_item, per_batch_seconds=per_item * 8,
                                 stage_seconds=lambda: {"read": 0.0, "decode": 0.0, "transform": per_item,
                                                        "collate": 1e-6}, dataset_type="SynthSpeech")
        return judge(_report(_record(dataset_type="SynthSpeech"), wait=0.05, compute=0.05, cores=cores,
                             stages=stages))

    computed = verdict(120e-6).suggestions
    assert any("its items computed in memory (0.12 ms each)" in s for s in computed)
    assert not any("index a whole batch at once" in s for s in computed)
    assert any("index a whole batch at once" in s for s in verdict(10e-6).suggestions)
    # On two cores a worker shares them with the step's own threads: said beside the guess.
    two = [s for s in verdict(120e-6, cores=2).suggestions if s.startswith("num_workers=")]
    assert two and "may not pay" in two[0] and "--tune" in two[0]


def test_without_a_dataloader_the_verdict_says_the_wait_was_not_measured():
    # llama2.c and nanoGPT make their batches themselves: no "not data-bound, 0.0%".
    report = _report(_record(), wait=0.0, compute=0.05, stages=_stages())
    report.loaders = []
    verdict = judge(report)
    assert verdict.level == "unknown" and not verdict.data_bound
    assert verdict.headline.startswith("data wait not measured: no torch DataLoader was iterated")


def test_verdict_for_a_tensor_dataset_says_what_is_true():
    report = _report(_record(dataset_type="TensorDataset"), wait=0.05, compute=0.05, cores=2,
                     stages=_stages(read=0.0, decode=0.0))
    verdict = judge(report)
    assert any(r.startswith("the dataset is a TensorDataset: its batches are tensors already in memory")
               for r in verdict.reasons)
    assert not any("decod" in s for s in verdict.suggestions)
    assert all(int(s.split()[0].split("=")[1]) <= 2 for s in verdict.suggestions if s.startswith("num_workers="))
    assert not any("TensorDataset" in r for r in judge(_report(_record(), stages=_stages())).reasons)


def test_verdict_busy_workers_restarts_and_decoders():
    record = _record(num_workers=2, worker_cpu_seconds=9.0, worker_alive_seconds=10.0,
                     iterator_seconds=[0.2, 0.2, 0.2])
    decoders = SimpleNamespace(fastest=SimpleNamespace(name="opencv", agreement=lambda: "pixel-identical on all 8 files"),
                               speedup=lambda name: 2.5)
    verdict = judge(_report(record, wait=0.02, compute=0.08, stages=_stages(), decoders=decoders))
    assert verdict.level == "data-bound"
    assert any("busy 90.0%" in r and "cannot keep up" in r for r in verdict.reasons)
    assert any("started again every epoch" in r and "3 starts" in r for r in verdict.reasons)
    assert any(s.startswith("decode with opencv") and "2.50x faster" in s for s in verdict.suggestions)


def test_verdict_not_data_bound_and_copies():
    verdict = judge(_report(_record(num_workers=4), wait=0.0005, compute=0.1, stages=_stages(),
                            copies={"applicable": True, "host_to_device_fraction": 0.2, "blocking_copies": 10}))
    assert verdict.level == "not data-bound" and not verdict.data_bound
    assert verdict.reasons[0].startswith("the loader has batches ready")
    assert any("host-to-device copies take 20.0%" in r for r in verdict.reasons)
    assert any("DevicePrefetcher" in s for s in verdict.suggestions)


def test_one_slow_step_does_not_decide_the_verdict():
    # Nine steps that hardly wait and one that waited 400 ms (a first batch): 29% of all
    # the step time, but not what the run's steps do.
    report = _report(_record(num_workers=2), wait=0.0005, compute=0.1, stages=_stages())
    report.steps[3] = StepSplit(3, 0.5005, 0.4, 0.0)
    verdict = judge(report)
    assert verdict.level == "not data-bound"
    assert verdict.headline.startswith("not data-bound: the step waits for data 0.5% of the time")
    assert any(r.startswith("one step (step 3) waited 400.0 ms for data") and "--steps" in r for r in verdict.reasons)
    # The same wait spread over two steps (epoch starts) recurs: it decides.
    report.steps[7] = StepSplit(7, 0.5005, 0.4, 0.0)
    assert judge(report).level == "data-bound"
    assert not any(r.startswith("one step") for r in judge(report).reasons)


def test_verdict_without_steps_or_loaders():
    empty = DataReport(command=[], target="cpu", status="error", detail="the script raised", steps=[], loaders=[],
                       stages={}, copies={})
    assert judge(empty).level == "unknown"
    no_loader = DataReport(command=[], target="cpu", status="stopped", detail="", steps=[StepSplit(1, 0.1, 0.0, 0.0)],
                           loaders=[], stages={}, copies={})
    assert "no torch DataLoader" in judge(no_loader).headline and judge(no_loader).level == "unknown"


def _finding(code, line, end_line=None, path="train.py", message="x: y"):
    from torchaxe.findings import Finding

    return Finding(code=code, category="dataloader_config", message=message, path=path, line=line, col=1,
                   end_line=end_line or line, end_col=2, snippet="", target="cpu")


def test_join_puts_measurement_next_to_the_finding():
    record = _record(line=21, iterator_seconds=[0.1, 0.1], dataset_source=("train.py", 5, 15))
    steps = [StepSplit(i, 0.1, 0.061, 0.0) for i in range(10)]  # 1 s of steps
    record.wait_measured_seconds = 0.61
    tuned_best = SimpleNamespace(point=SimpleNamespace(overrides=lambda: {"num_workers": 2}, label="num_workers=2"),
                                 wait_fraction=0.04)
    tuning = SimpleNamespace(best=tuned_best, speedup=lambda: 1.6)
    findings = [_finding("AX401", 20, 22), _finding("AX404", 9, message="PIL decode: slow"),
                _finding("AX403", 40)]
    joined, lines = join_findings(findings, [record], steps, {0: _stages()}, None, tuning)
    assert joined[0].message == ("DataLoader at train.py:21 has num_workers=0; measured data wait 61.0% of the step; "
                                 "with num_workers=2 measured 4.0% (1.60x the throughput) [AX401]")
    assert joined[0].loader == 0
    assert joined[1].message.startswith("Dataset Images (DataLoader at train.py:21) has PIL decoding in __getitem__ "
                                        "(decode 6.00 ms of 10.0 ms per sample) at train.py:9")
    assert joined[2].loader is None and "no loader built on this line ran" in joined[2].message
    assert lines == ["DataLoader at train.py:21 (num_workers=0, pin_memory=False): measured data wait 61.0% of the "
                     "step; with num_workers=2 measured 4.0% (1.60x the throughput)"]
    assert joined[0].to_dict()["code"] == "AX401"


# ------------------------------------------------------------------ the knob keys


def test_dataloader_knob_takes_start_method_and_timeout():
    knobs = knob_set_from_dict({"dataloader": {"num_workers": 2, "multiprocessing_context": "spawn", "timeout": 30}},
                               "k.json")
    assert knobs.dataloader.overrides() == {"num_workers": 2, "multiprocessing_context": "spawn", "timeout": 30.0}
    assert knob_set_from_dict(knobs.to_dict(), "again").dataloader == knobs.dataloader
    with pytest.raises(KnobError, match="dataloader.multiprocessing_context: \"thread\" is not one of fork"):
        knob_set_from_dict({"dataloader": {"multiprocessing_context": "thread"}}, "k.json")
    with pytest.raises(KnobError, match="dataloader.timeout: expected a positive number of seconds"):
        knob_set_from_dict({"dataloader": {"timeout": 0}}, "k.json")
    with pytest.raises(KnobError, match="dataloader.timeout"):
        knob_set_from_dict({"dataloader": {"timeout": True}}, "k.json")


def test_bootstrap_override_applies_start_method_and_drops_it_without_workers():
    from torch.utils.data import DataLoader

    from torchaxe.data.knob import DataLoaderOverride
    from torchaxe.runtime.knobs import AppliedKnobs

    knobs = knob_set_from_dict({"dataloader": {"num_workers": 1, "multiprocessing_context": "spawn", "timeout": 5}}, "k")
    applied = AppliedKnobs(knobs)
    override = DataLoaderOverride(knobs.dataloader.overrides(), applied)
    override.install()
    try:
        loader = DataLoader(list(range(4)), batch_size=2)
        assert loader.num_workers == 1 and loader.timeout == 5
        assert loader.multiprocessing_context.get_start_method() == "spawn"
    finally:
        override.uninstall()
    assert applied.record["dataloader"]["loaders"][0]["multiprocessing_context"] == "spawn"

    zero = knob_set_from_dict({"dataloader": {"num_workers": 0, "multiprocessing_context": "spawn"}}, "k")
    override = DataLoaderOverride(zero.dataloader.overrides(), AppliedKnobs(zero))
    override.install()
    try:
        loader = DataLoader(list(range(4)), batch_size=2, num_workers=2)
        assert loader.num_workers == 0 and loader.multiprocessing_context is None
    finally:
        override.uninstall()


def test_bootstrap_override_never_changes_the_workers_of_an_iterable_dataset():
    from torch.utils.data import DataLoader, IterableDataset

    from torchaxe.data.knob import DataLoaderOverride
    from torchaxe.runtime.knobs import AppliedKnobs

    class Stream(IterableDataset):  # does not split itself by worker: 2 workers would yield it twice
        def __iter__(self):
            return iter(range(6))

    knobs = knob_set_from_dict({"dataloader": {"num_workers": 2, "persistent_workers": True}}, "k")
    override = DataLoaderOverride(knobs.dataloader.overrides(), AppliedKnobs(knobs))
    override.install()
    try:
        loader = DataLoader(Stream(), batch_size=2)
        assert loader.num_workers == 0 and not loader.persistent_workers
        assert sorted(int(x) for b in loader for x in b) == list(range(6))
        assert DataLoader(list(range(4)), batch_size=2).num_workers == 2  # map-style: changed
    finally:
        override.uninstall()


def _epochs(make_loader, seed: int, knob: bool):
    """Every batch of one epoch of ``make_loader()``, with or without batched fetch."""
    from torchaxe.data.knob import SPEC
    from torchaxe.runtime.knobs import AppliedKnobs

    knobs = knob_set_from_dict({"dataloader": {"batched_fetch": knob}}, "k")
    applied = AppliedKnobs(knobs)
    with SPEC.patch(knobs.dataloader, applied):
        torch.manual_seed(seed)
        loader = make_loader()
        batches = [[t.clone() for t in batch] for batch in loader]
    return batches, applied.record.get("batched_fetch")


@pytest.mark.parametrize("case", ["shuffled", "subset", "workers", "last_partial"])
def test_batched_fetch_gives_the_same_batches_in_the_same_order(case):
    from torch.utils.data import DataLoader, TensorDataset, random_split

    x, y = torch.randn(300, 4), torch.randint(0, 5, (300,))
    data = TensorDataset(x, y)
    make = {
        "shuffled": lambda: DataLoader(data, batch_size=32, shuffle=True),
        "subset": lambda: DataLoader(random_split(data, [200, 100], generator=torch.Generator().manual_seed(1))[0],
                                     batch_size=16, shuffle=True, drop_last=True),
        "workers": lambda: DataLoader(data, batch_size=25, shuffle=True, num_workers=2,
                                      multiprocessing_context="fork"),
        "last_partial": lambda: DataLoader(data, batch_size=64),
    }[case]
    plain, _ = _epochs(make, 0, False)
    fetched, noted = _epochs(make, 0, True)
    assert noted is True or case == "workers"  # fork workers note in their own process
    assert len(plain) == len(fetched) > 0
    for a, b in zip(plain, fetched):
        assert type(a) is type(b) and len(a) == len(b)
        assert all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b))


def test_batched_fetch_leaves_other_loaders_alone():
    from torch.utils.data import DataLoader, TensorDataset

    from torchaxe.runtime.tensor_batches import batchable

    class Noisy(TensorDataset):  # a __getitem__ of its own: sample by sample, as written
        def __getitem__(self, i):
            return tuple(t[i] + 1 for t in self.tensors)

    data = TensorDataset(torch.arange(8.0))
    assert batchable(DataLoader(data, batch_size=4))
    assert not batchable(DataLoader(data, batch_size=4, collate_fn=lambda b: b))
    assert not batchable(DataLoader(data, batch_size=None))
    assert not batchable(DataLoader(Noisy(torch.arange(8.0)), batch_size=4))
    assert not batchable(DataLoader(list(range(8)), batch_size=4))
    batches, noted = _epochs(lambda: DataLoader(Noisy(torch.arange(8.0)), batch_size=4), 0, True)
    assert noted is None and torch.equal(batches[0][0], torch.arange(1.0, 5.0))
    # The knob is parsed and written back; a wrong type is refused.
    knobs = knob_set_from_dict({"dataloader": {"batched_fetch": True}}, "k")
    assert knob_set_from_dict(knobs.to_dict(), "again").dataloader.batched_fetch is True
    with pytest.raises(KnobError, match="dataloader.batched_fetch"):
        knob_set_from_dict({"dataloader": {"batched_fetch": "yes"}}, "k.json")


def test_a_loader_of_in_memory_tensors_is_offered_batched_fetch():
    from torchaxe.data.candidates import candidates

    profile = {"summary": {"data_wait_fraction": 0.3, "data_wait_seconds_median": 0.003,
                           "step_seconds_median": 0.01}}
    epoch = {"site": "train.py:12", "batch_size": 64, "samples": 6400, "batched_fetch": True}
    offered = {c.key: c for c in candidates(profile, "cpu", {"loader_epochs": [epoch], "allowed_cpus": 2})}
    fetch = offered["knob:dataloader-batched-fetch"]
    assert fetch.knobs == {"dataloader": {"batched_fetch": True}} and fetch.rec.accuracy.kind == "exact"
    assert "train.py:12" in fetch.rec.detail and "knob:dataloader" in offered
    assert "knob:dataloader-batched-fetch" not in {
        c.key for c in candidates(profile, "cpu", {"loader_epochs": [{**epoch, "batched_fetch": False}]})}


def test_no_worker_count_is_offered_when_every_loader_iterates_an_iterable_dataset():
    # Seen in a review: a recommender over an IterableDataset was offered (and chose, and
    # wrote) num_workers=1, which the knob never applies to such a loader.
    from torch.utils.data import DataLoader, IterableDataset

    from torchaxe.data.candidates import candidates
    from torchaxe.runtime import run_context

    class Batches(IterableDataset):
        def __iter__(self):
            yield from (torch.randn(4, 2) for _ in range(3))

    saved = dict(run_context.OBSERVED)
    run_context.OBSERVED.clear()
    try:
        run_context.note_loader(DataLoader(Batches(), batch_size=None), "train.py:30")
        settings = run_context.settings()
    finally:
        run_context.OBSERVED.clear()
        run_context.OBSERVED.update(saved)
    assert settings["loader_kinds"] == {"map": 0, "iterable": 1}
    profile = {"summary": {"data_wait_fraction": 0.3, "data_wait_seconds_median": 0.003,
                           "step_seconds_median": 0.01}}
    assert "knob:dataloader" not in {c.key for c in candidates(profile, "cpu", {**settings, "allowed_cpus": 2})}
    # With a map-style loader beside it, workers are offered (the knob changes that one).
    mixed = {"loader_kinds": {"map": 1, "iterable": 1}, "allowed_cpus": 2}
    assert "knob:dataloader" in {c.key for c in candidates(profile, "cpu", mixed)}


def test_torchaxe_data_import_is_light():
    import subprocess
    import sys

    code = "import sys, torchaxe.data; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_errors_are_torchaxe_errors():
    from torchaxe.data.decoders import ImageDecodeError

    assert issubclass(ImageDecodeError, TorchaxeError)


def test_a_dataset_in_memory_is_not_told_its_transforms_dominate():
    # A dataset of its own that reads no file and decodes nothing: __getitem__'s time is
    # its indexing, and two workers beside training on two cores are one too many.
    stages = _stages(per_sample=0.01, read=0.0, decode=0.0)
    verdict = judge(_report(_record(dataset_type="Synthetic", num_workers=2), wait=0.05, compute=0.05, cores=2,
                            stages=stages))
    assert verdict.data_bound
    assert not any("transforms dominate" in s for s in verdict.suggestions)
    assert any(s.startswith("__getitem__ dominates, its items computed in memory (10.0 ms each)")
               for s in verdict.suggestions)
    assert any(r.startswith("per sample: read 0.00 ms, decode 0.00 ms, __getitem__ 10.0 ms") for r in verdict.reasons)
    assert any(s.startswith("num_workers=1 (one core left") for s in verdict.suggestions), verdict.suggestions
    # A TensorDataset with the default collate: the knob that takes its batches at once.
    tensors = judge(_report(_record(dataset_type="TensorDataset", batched_fetch=True), wait=0.05, compute=0.05,
                            cores=2, stages=stages))
    assert any(s.startswith("__getitem__ dominates, on tensors in memory (a TensorDataset): `[run] dataloader = "
                            "{batched_fetch = true}`") for s in tensors.suggestions), tensors.suggestions
    # An IterableDataset has no __getitem__ (seen in a review: told to index a batch at once).
    iterable = judge(_report(_record(dataset_type="Batches", map_style=False, dataset_length=None), wait=0.05,
                             compute=0.05, cores=2, stages=stages))
    assert not any("__getitem__" in s for s in iterable.suggestions), iterable.suggestions
    assert any(s.startswith("the dataset's iterator dominates (an IterableDataset") for s in iterable.suggestions)
    # Files read and decoded: the rest is the transforms'.
    files = judge(_report(_record(), stages=_stages(per_sample=0.02, read=0.001, decode=0.001)))
    assert any("transforms dominate" in s for s in files.suggestions)
