"""CommProbe reads DDP's own timing of the measured iterations, not of the warm-up."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from torchaxe.runtime.comm import CommProbe


class _Sink:
    started = True

    def add_comm(self, seconds: float) -> None:
        pass


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _SlowFirst(torch.nn.Module):
    """A model whose first iterations (the warm-up) are much slower than the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 3:
            time.sleep(0.05)
        return self.linear(x)


def test_ddp_timing_is_the_mean_of_the_measured_iterations(one_rank_group):
    measuring = {"on": None}
    probe = CommProbe(_Sink(), time.perf_counter, lambda: measuring["on"])
    probe.install()
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_SlowFirst())
        x = torch.randn(4, 8)
        for iteration in range(1, 13):
            # three warm-up iterations, then nine measured
            measuring["on"] = iteration if iteration > 3 else None
            ddp(x).sum().backward()
        info = probe.info(measured=range(4, 13))
    finally:
        probe.uninstall()
    facts = info.ddp
    # the last measured iteration's timing is only logged at a following forward
    assert facts["timed_iterations"] == 8
    assert sorted(probe.samples) == list(range(4, 12))
    # DDP's own average covers the 50 ms warm-up forwards; the measured ones take far less
    assert facts["forward_compute_seconds"] < 0.005
    assert ddp._get_ddp_logging_data()["avg_forward_compute_time"] * 1e-9 > facts["forward_compute_seconds"]
    assert info.note is None


def test_without_measured_samples_a_note_says_the_timing_is_the_warm_up(one_rank_group):
    probe = CommProbe(_Sink(), time.perf_counter, lambda: None)
    probe.install()
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        for _ in range(4):
            ddp(torch.randn(4, 8)).sum().backward()
        info = probe.info(measured=())
    finally:
        probe.uninstall()
    assert info.ddp["timed_iterations"] == 0
    assert "warm-up" in info.note


def test_the_scripts_collectives_count_by_their_median_step(one_rank_group):
    probe = CommProbe(_Sink(), time.perf_counter, lambda: 1)
    probe.install()
    try:
        dist.all_reduce(torch.ones(4))
        info = probe.info(measured=[1, 2, 3], step_comm=[0.001, 0.002, 0.5])
    finally:
        probe.uninstall()
    # one step that waited half a second for a peer does not make every step's wait long
    assert info.comm_exposed_seconds_per_step == pytest.approx(0.002)
    assert info.collectives["all_reduce"]["calls_per_step"] == pytest.approx(1 / 3)


def test_collectives_of_a_step_the_script_never_finished_are_not_counted(one_rank_group):
    # Three measured steps of one all-reduce each, then the script's end (a last
    # evaluation all-reducing its metrics 55 times) inside a fourth step that never ends.
    step = {"index": None}
    probe = CommProbe(_Sink(), time.perf_counter, lambda: step["index"])
    probe.install()
    try:
        for index in (1, 2, 3):
            step["index"] = index
            dist.all_reduce(torch.ones(4))
        step["index"] = 4
        for _ in range(55):
            dist.all_reduce(torch.ones(4))
        info = probe.info(measured=[1, 2, 3])
    finally:
        probe.uninstall()
    assert info.collectives["all_reduce"]["calls_per_step"] == pytest.approx(1.0)
