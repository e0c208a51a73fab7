"""DevicePrefetcher: the cpu pass-through, and the side-stream logic of the cuda/npu
path driven by a recording stand-in for the stream API (no GPU here)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchaxe.data import DevicePrefetcher
from torchaxe.data.prefetch import StreamOps, map_tensors
from torchaxe.errors import TorchaxeError


class Numbers(Dataset):
    def __init__(self, n: int, bad: int | None = None) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return torch.full((3,), float(i)), i


def _values(batches):
    return [b[0][:, 0].tolist() for b in batches]


# ------------------------------------------------------------------ cpu pass-through


def test_cpu_is_a_passthrough_keeping_order_contents_and_exhaustion():
    loader = DataLoader(Numbers(10), batch_size=4)
    prefetcher = DevicePrefetcher(loader, "cpu")
    assert prefetcher.passthrough and len(prefetcher) == 3
    batches = list(prefetcher)
    assert _values(batches) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[1][1].tolist() == [4, 5, 6, 7]
    it = iter(prefetcher)
    assert len(list(it)) == 3
    with pytest.raises(StopIteration):
        next(it)


def test_cpu_reiteration_gives_every_batch_again():
    prefetcher = DevicePrefetcher(DataLoader(Numbers(6), batch_size=2), torch.device("cpu"))
    assert _values(prefetcher) == _values(prefetcher) == [[0, 1], [2, 3], [4, 5]]


def test_cpu_loader_exception_surfaces_at_its_batch():
    prefetcher = DevicePrefetcher(DataLoader(Numbers(8, bad=5), batch_size=2), "cpu")
    it = iter(prefetcher)
    assert _values([next(it), next(it)]) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="sample 5 is corrupt"):
        next(it)


def test_unsupported_device_is_a_one_line_error():
    with pytest.raises(TorchaxeError, match="only cpu, cuda and npu"):
        DevicePrefetcher([], "meta")
    with pytest.raises(TorchaxeError, match="device 'not-a-device'"):
        DevicePrefetcher([], "not-a-device")


# ------------------------------------------------------------------ the stream logic


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class RecordingOps(StreamOps):
    """Stands in for torch.cuda's stream API: "copies" are clones, every call is logged."""

    def __init__(self) -> None:
        super().__init__(module=None, device="fake")
        self.log: list[tuple] = []
        self.active = FakeStream("main")
        self.main = self.active

    def new_stream(self):
        stream = FakeStream("side")
        self.log.append(("new_stream", stream))
        return stream

    def current_stream(self):
        return self.active

    def use(self, stream):
        ops = self

        class Use:
            def __enter__(self):
                ops.previous = ops.active
                ops.active = stream

            def __exit__(self, *exc):
                ops.active = ops.previous

        return Use()

    def wait(self, waiter, stream):
        self.log.append(("wait", waiter, stream))

    def needs_copy(self, tensor):
        return not getattr(tensor, "on_fake_device", False)

    def pin(self, tensor):
        self.log.append(("pin", float(tensor.flatten()[0]) if tensor.numel() else None))
        return tensor

    def copy(self, tensor):
        moved = tensor.clone()
        moved.on_fake_device = True
        self.log.append(("copy", float(tensor.flatten()[0]) if tensor.numel() else None, self.active))
        return moved

    def record(self, tensor, stream):
        self.log.append(("record", float(tensor.flatten()[0]) if tensor.numel() else None, stream))


def _device_prefetcher(loader, ops=None, pin=True):
    ops = ops or RecordingOps()
    return DevicePrefetcher(loader, "cuda", ops=ops, pin_memory=pin), ops


def test_copies_run_on_the_side_stream_and_the_consumer_waits_and_records():
    loader = DataLoader(Numbers(6), batch_size=2)
    prefetcher, ops = _device_prefetcher(loader)
    assert not prefetcher.passthrough
    it = iter(prefetcher)
    first = next(it)
    assert first[0][:, 0].tolist() == [0, 1] and getattr(first[0], "on_fake_device", False)
    copies = [e for e in ops.log if e[0] == "copy"]
    # both batch 1 and (ahead of time) batch 2 were copied, on the side stream
    assert [c[1] for c in copies] == [0.0, 0.0, 2.0, 2.0]
    assert all(repr(c[2]) == "side" for c in copies)
    # the consumer's stream waited for the side stream before batch 1 was handed out,
    # and every tensor of batch 1 was recorded on it; batch 2's copies came after
    kinds = [e[0] for e in ops.log]
    wait_at = kinds.index("wait")
    assert ops.log[wait_at][1] is ops.main and repr(ops.log[wait_at][2]) == "side"
    records = [e for e in ops.log if e[0] == "record"]
    assert [r[1] for r in records] == [0.0, 0.0] and all(r[2] is ops.main for r in records)
    second_batch_copy = [i for i, e in enumerate(ops.log) if e[0] == "copy" and e[1] == 2.0][0]
    assert wait_at < second_batch_copy
    # pinned before every copy
    assert [e[1] for e in ops.log if e[0] == "pin"] == [0.0, 0.0, 2.0, 2.0]
    rest = list(it)
    assert [b[0][:, 0].tolist() for b in rest] == [[2, 3], [4, 5]]
    with pytest.raises(StopIteration):
        next(it)
    assert sum(1 for e in ops.log if e[0] == "wait") == 3


def test_without_pinning_nothing_is_pinned():
    prefetcher, ops = _device_prefetcher(DataLoader(Numbers(4), batch_size=2), pin=False)
    assert len(list(prefetcher)) == 2
    assert not [e for e in ops.log if e[0] == "pin"]


def test_device_path_reiterates_with_a_fresh_side_stream_each_pass():
    prefetcher, ops = _device_prefetcher(DataLoader(Numbers(4), batch_size=2))
    assert [b[0][:, 0].tolist() for b in prefetcher] == [[0, 1], [2, 3]]
    assert [b[0][:, 0].tolist() for b in prefetcher] == [[0, 1], [2, 3]]
    assert sum(1 for e in ops.log if e[0] == "new_stream") == 2


def test_device_path_loader_exception_is_raised_at_its_own_batch_and_iteration_goes_on():
    class Flaky:
        """An iterator whose third item fails, then goes on (as a DataLoader does)."""

        def __iter__(self):
            self.i = 0
            return self

        def __next__(self):
            self.i += 1
            if self.i == 3:
                raise RuntimeError("DataLoader worker raised: bad sample")
            if self.i > 4:
                raise StopIteration
            return torch.full((2,), float(self.i))

    prefetcher, _ = _device_prefetcher(Flaky())
    it = iter(prefetcher)
    assert next(it)[0].item() == 1.0
    assert next(it)[0].item() == 2.0  # not raised early, though batch 3 was already asked for
    with pytest.raises(RuntimeError, match="bad sample"):
        next(it)
    assert next(it)[0].item() == 4.0
    with pytest.raises(StopIteration):
        next(it)


def test_a_failing_copy_is_raised_at_that_batch():
    class FailingOps(RecordingOps):
        def copy(self, tensor):
            if float(tensor.flatten()[0]) == 2.0:
                raise RuntimeError("out of device memory")
            return super().copy(tensor)

    prefetcher, _ = _device_prefetcher(DataLoader(Numbers(6), batch_size=2), ops=FailingOps())
    it = iter(prefetcher)
    assert next(it)[0][:, 0].tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="out of device memory"):
        next(it)


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    names: list
    meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    step: int


Pair = namedtuple("Pair", "inputs targets")


def test_nested_batches_keep_their_structure_and_every_tensor_is_moved():
    ops = RecordingOps()
    counts = defaultdict(list, {"a": [torch.ones(1)]})
    nested = {
        "pair": Pair(torch.zeros(2), torch.ones(2)),
        "list": [torch.full((1,), 3.0), "text", 7],
        "tuple": (torch.full((1,), 4.0), None),
        "ordered": OrderedDict(z=torch.full((1,), 5.0)),
        "dc": Batch(torch.full((2,), 6.0), torch.zeros(2), ["a.jpg"], {"m": torch.full((1,), 8.0)}),
        "frozen": FrozenBatch(torch.full((1,), 9.0), 3),
        "counts": counts,
    }
    prefetcher = DevicePrefetcher([nested], "cuda", ops=ops)
    [out] = list(prefetcher)
    assert isinstance(out["pair"], Pair) and out["pair"].targets.on_fake_device
    assert out["list"][1:] == ["text", 7] and out["list"][0].on_fake_device
    assert out["tuple"][1] is None and isinstance(out["tuple"], tuple)
    assert isinstance(out["ordered"], OrderedDict) and out["ordered"]["z"].on_fake_device
    assert isinstance(out["dc"], Batch) and out["dc"].images.on_fake_device and out["dc"].names == ["a.jpg"]
    assert out["dc"].meta["m"].on_fake_device
    assert isinstance(out["frozen"], FrozenBatch) and out["frozen"].x.on_fake_device and out["frozen"].step == 3
    assert isinstance(out["counts"], defaultdict) and out["counts"].default_factory is list
    assert out["counts"]["a"][0].on_fake_device
    # the originals are untouched
    assert not getattr(nested["pair"].inputs, "on_fake_device", False)
    moved = [e for e in ops.log if e[0] == "copy"]
    records = [e for e in ops.log if e[0] == "record"]
    assert len(moved) == len(records) == 10


def test_map_tensors_leaves_non_tensors_alone():
    seen = []
    out = map_tensors({"x": torch.ones(1), "s": "a", "n": None}, lambda t: seen.append(t) or t * 2)
    assert out["s"] == "a" and out["n"] is None and out["x"].item() == 2.0 and len(seen) == 1


def test_stream_ops_use_the_device_module_api():
    calls = []

    class Module:
        class Stream:
            def __init__(self, device):
                calls.append(("Stream", device))

        @staticmethod
        def current_stream(device):
            calls.append(("current_stream", device))
            return "current"

        @staticmethod
        def stream(s):
            calls.append(("stream", s))
            return "context"

    ops = StreamOps(Module, "cuda:1")
    side = ops.new_stream()
    assert ops.current_stream() == "current" and ops.use(side) == "context"
    assert calls[0] == ("Stream", "cuda:1") and calls[1] == ("current_stream", "cuda:1")


def test_backends_route_the_device_module():
    from torchaxe.backends.cpu import CpuBackend
    from torchaxe.backends.cuda import CudaBackend

    assert CpuBackend().device_module() is None
    assert CudaBackend().device_module() is torch.cuda

    class NoStreams:
        name = "odd"

        def is_available(self):
            return True

        def device_module(self):
            return None

    with pytest.raises(TorchaxeError, match="has no streams"):
        DevicePrefetcher([], "cuda", backend=NoStreams())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without cuda")
def test_cuda_without_a_device_is_a_one_line_error():
    with pytest.raises(TorchaxeError, match="no cuda device is available here"):
        DevicePrefetcher([], "cuda")
