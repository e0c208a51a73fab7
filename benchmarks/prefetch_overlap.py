"""How much of the host-to-device copy DevicePrefetcher hides behind compute (cuda/npu).

A synthetic step — a stack of matmuls on the device — is fed batches of ``--mb``
megabytes from a DataLoader over tensors in host memory, three ways, interleaved A B C
for ``--rounds`` rounds:

* ``blocking``: ``batch.to(device)`` from pageable memory (what most loops do);
* ``pinned``: ``pin_memory=True`` on the loader, ``.to(device, non_blocking=True)``;
* ``prefetch``: ``DevicePrefetcher(loader, device)`` (side-stream copy of the next batch).

Each way's median step time (the device synchronised at every step end) is printed
with its ratio to ``blocking``, and the copy time alone (a step with no compute) so
the hidden share can be read: ``(blocking - prefetch) / copy``. Needs a cuda (or npu)
device; on a machine without one it says so and exits 2. Run once on an H200 (RESULTS.md).

    python benchmarks/prefetch_overlap.py --device cuda --mb 64 --rounds 5 --workers 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mb", type=float, default=64.0, help="megabytes per batch")
    parser.add_argument("--matmuls", type=int, default=8, help="compute per step: matmuls of 4096x4096")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader workers (0: batching and pinning on the training thread, in series with "
                             "the step; with workers they run beside it, as in most real loops)")
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from torchaxe.backends import get_backend
    from torchaxe.data import DevicePrefetcher

    device = torch.device(args.device)
    backend = get_backend(device.type)
    if device.type == "cpu" or not backend.is_available():
        sys.stderr.write(f"prefetch_overlap: no {device.type} device here: nothing to measure\n")
        return 2
    module = backend.device_module()
    floats = int(args.mb * (1 << 20) / 4)
    per_sample = 1 << 16
    samples = max(2, floats // per_sample)
    data = TensorDataset(torch.randn(samples * args.steps, per_sample))
    weight = torch.randn(4096, 4096, device=device)

    def compute(batch, matmuls):
        x = weight
        for _ in range(matmuls):
            x = torch.tanh(x @ weight)
        return x.sum() + batch.sum()

    def run(way: str, matmuls: int) -> list[float]:
        loader = DataLoader(data, batch_size=samples, pin_memory=way != "blocking", num_workers=args.workers,
                            persistent_workers=False)
        source = DevicePrefetcher(loader, device) if way == "prefetch" else loader
        times = []
        module.synchronize()
        last = time.perf_counter()
        for (batch,) in source:
            if way == "host":
                times.append(time.perf_counter() - last)  # the loader alone: batching, nothing on the device
                last = time.perf_counter()
                continue
            if way == "blocking":
                batch = batch.to(device)
            elif way == "pinned":
                batch = batch.to(device, non_blocking=True)
            compute(batch, matmuls)
            module.synchronize()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times[2:]

    results = {w: [] for w in ("blocking", "pinned", "prefetch")}
    copy_only = []
    host_only = []
    for _ in range(args.rounds):
        for way in results:
            results[way].extend(run(way, args.matmuls))
        copy_only.extend(run("blocking", 0))
        host_only.extend(run("host", 0))
    base = statistics.median(results["blocking"])
    copy = statistics.median(copy_only)
    print(f"device {device}, {args.mb:g} MB batches, {args.matmuls} matmuls per step, {args.rounds} rounds, "
          f"{args.workers} loader workers")
    print(f"  loader alone (batching, pinning)   {1e3 * statistics.median(host_only):8.2f} ms per step")
    print(f"  copy alone (blocking, no compute)  {1e3 * copy:8.2f} ms per step (the loader's batching included)")
    for way, times in results.items():
        median = statistics.median(times)
        print(f"  {way:<10} median {1e3 * median:8.2f} ms   ratio {median / base:.3f}")
    hidden = (base - statistics.median(results["prefetch"])) / copy if copy else float("nan")
    print(f"  copy time hidden by the prefetcher: {100 * hidden:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
