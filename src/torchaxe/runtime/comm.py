"""Where a distributed step goes on communication, from what PyTorch measures itself.

Two sources, both on every rank:

* **DistributedDataParallel's own timing.** DDP's reducer times, on its sampled
  iterations (the first ten and every hundredth), the forward and backward compute,
  the backward's gradient exchange, and the part of that exchange that overlapped
  with backward compute (``_get_ddp_logging_data()``: ``forward_compute_time``,
  ``backward_compute_time``, ``backward_comm_time``,
  ``backward_compute_comm_overlap_time``, in nanoseconds, for the last sampled
  iteration; ``avg_*`` over all of them). The first iterations are warm-up, so DDP's
  own averages describe the warm-up: :class:`CommProbe` reads each sample taken in
  the measured steps (a sample is logged at the next iteration's forward) and
  takes their median; a module on the CPU is sampled every iteration (timing it costs
  nothing there), one on a device keeps DDP's sampling, and when none of its samples
  fell in the measured steps DDP's averages are used with a note saying so. The
  exchange not overlapped is what the step waits for: its *exposed* communication.
  These are per iteration (one forward and backward); :class:`CommProbe` counts how many
  iterations a step has (gradient accumulation) and how many of them exchanged
  gradients (the others ran under ``no_sync()``), so per-step figures follow. DDP's
  settings (bucket size, ``find_unused_parameters``, ...) come from the same data.
* **The script's own collectives** (``dist.all_reduce`` of a loss to print it,
  ``barrier()``...): each call is timed on the host. On the CPU (gloo) a collective
  blocks until every rank has reached it, so its time is exposed, waiting for the
  slowest rank included; on a device the host time is the launch, and the device
  time shows in the step.

Whether a DDP module's buffers change during the run (BatchNorm's running
statistics) is checked by comparing them at its first forward and at the end: a
module whose buffers never change gains nothing from ``broadcast_buffers``.

Nothing here is used unless ``torch.distributed`` is initialised by the script.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Callable, Collection

from torchaxe.cpulist import usable_cpus
from torchaxe.runtime.probes import StepSink, patch_attribute, restore_patches
from torchaxe.runtime.profile import DistributedInfo
from torchaxe.runtime.stats import Samples

#: The torch.distributed calls timed as the script's collectives.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "gather_object", "monitored_barrier")
#: Buffers larger than this (bytes, all of a module's together) are not copied to
#: find out whether they change.
BUFFER_CHECK_LIMIT = 64 << 20


class CommProbe:
    """Times the script's collectives, counts DDP's iterations per step, and at the
    end reads DDP's own timing into a :class:`DistributedInfo`."""

    def __init__(self, sink: StepSink, clock: Callable[[], float], step: Callable[[], int | None]) -> None:
        """``step()``: the index of the measured step under way, None outside them."""
        self.sink = sink
        self.clock = clock
        self.step = step
        self._saved: list = []
        self._local = threading.local()
        #: name -> step index -> [calls, seconds], over the measured steps. Kept by step
        #: so that a step the run never finished (the script's end: a last evaluation's
        #: all-reduces, a barrier) is left out of the figures a step.
        self.tally: dict[str, dict[int, list[float]]] = {}
        #: step index -> [training forwards, synced ones] of the DDP model.
        self.forwards: dict[int, list[int]] = {}
        self._ddp: Any = None
        self._buffers_before: list[Any] | None = None
        #: (rank, world size, backend) as first seen while the process group was up.
        self._group: tuple[int, int, str] | None = None
        #: DDP's last sampled iteration before the measured steps (None: not read yet).
        self._sampled_before: int | None = None
        #: DDP's per-iteration timing samples (nanoseconds) of the measured steps, by iteration.
        self.samples: dict[int, dict[str, float]] = {}

    def _note_group(self) -> None:
        if self._group is None:
            import torch.distributed as dist

            try:
                if dist.is_initialized():
                    self._group = (dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
            except Exception:
                pass

    # -------------------------------------------------------------- install

    def install(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if callable(original):
                patch_attribute(self._saved, dist, name, self._timed(name, original))
        from torch.nn.parallel import DistributedDataParallel

        patch_attribute(self._saved, DistributedDataParallel, "forward",
                        self._counted(DistributedDataParallel.forward))

    def uninstall(self) -> None:
        restore_patches(self._saved)

    def _timed(self, name: str, original: Callable) -> Callable:
        import functools

        local, clock, sink, step, tally = self._local, self.clock, self.sink, self.step, self.tally
        probe = self

        @functools.wraps(original)
        def collective(*args, **kwargs):
            if getattr(local, "inside", False):
                return original(*args, **kwargs)
            local.inside = True
            probe._note_group()
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False
                seconds = clock() - start
                sink.add_comm(seconds)
                index = step()
                if index is not None:
                    entry = tally.setdefault(name, {}).setdefault(index, [0, 0.0])
                    entry[0] += 1
                    entry[1] += seconds

        return collective

    def _counted(self, original: Callable) -> Callable:
        import functools

        import torch

        probe = self

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            if probe._ddp is None:
                probe._note_group()
                probe._ddp = module  # kept: the script's own reference is gone when the profile is made
                probe._buffers_before = _buffer_copy(module)
                _sample_every_iteration_on_cpu(module)
            synced = False
            index = probe.step() if torch.is_grad_enabled() and module.training else None
            if index is not None:
                counts = probe.forwards.setdefault(index, [0, 0])
                counts[0] += 1
                if getattr(module, "require_backward_grad_sync", True):
                    counts[1] += 1
                    synced = module is probe._ddp
            output = original(module, *args, **kwargs)
            if synced:  # DDP logs the previous iteration's timing in a synced forward
                probe._read_sample(module)
            return output

        return forward

    def _read_sample(self, ddp: Any) -> None:
        try:
            data = ddp._get_ddp_logging_data()
        except Exception:
            return
        iteration = data.get("iteration")
        iteration = iteration if isinstance(iteration, int) else 0
        if self._sampled_before is None:  # the first measured forward logs the last warm-up iteration
            self._sampled_before = iteration
            return
        if iteration > self._sampled_before and iteration not in self.samples:
            self.samples[iteration] = {key: data[key] for key in _SAMPLE_KEYS
                                       if isinstance(data.get(key), (int, float)) and data[key] > 0}

    # -------------------------------------------------------------- results

    def info(self, measured: Collection[int], step_comm: list[float | None] | None = None) -> DistributedInfo | None:
        """This rank's part, or None when the script set up no process group.
        ``measured``: the indexes of the measured steps that ended (what happened in
        one the script left unfinished is not counted). ``step_comm``: each measured
        step's time in the script's collectives; their median is the exposed time per
        step (as step times are medians, so that one slow step does not make the
        communication look longer than a step)."""
        self._note_group()
        if self._group is None:
            return None
        rank, world, backend = self._group
        local_world = _env_int("LOCAL_WORLD_SIZE")
        info = DistributedInfo(
            rank=rank, local_rank=_env_int("LOCAL_RANK"), world_size=world, local_world_size=local_world,
            nnodes=world // local_world if world and local_world and world % local_world == 0 else None,
            host=socket.gethostname(), backend=backend, cpus=usable_cpus())
        ended = set(measured)
        steps = len(ended)
        per_step = (lambda v: v / steps) if steps else (lambda v: None)
        totals = {name: [sum(by_step[i][k] for i in by_step if i in ended) for k in (0, 1)]
                  for name, by_step in sorted(self.tally.items())}
        info.collectives = {name: {"calls_per_step": per_step(calls), "seconds_per_step": per_step(seconds)}
                            for name, (calls, seconds) in totals.items() if calls}
        explicit = per_step(sum(seconds for _, seconds in totals.values())) if steps else None
        if explicit is not None and step_comm:
            explicit = Samples.of(c or 0.0 for c in step_comm).median
        forwards = sum(counts[0] for i, counts in self.forwards.items() if i in ended)
        synced = sum(counts[1] for i, counts in self.forwards.items() if i in ended)
        info.backwards_per_step = per_step(forwards) if forwards else None
        info.synced_backwards_per_step = per_step(synced) if forwards else None
        ddp = self._ddp
        comm = exposed = None
        if ddp is not None:
            info.ddp = ddp_facts(ddp, self._buffers_before, self.samples)
            comm, exposed, compute = _ddp_per_step(info.ddp, info.backwards_per_step, info.synced_backwards_per_step)
            info.compute_seconds_per_step = compute
        if comm is not None or explicit is not None:
            info.comm_seconds_per_step = (comm or 0.0) + (explicit or 0.0)
            info.comm_exposed_seconds_per_step = (exposed or 0.0) + (explicit or 0.0)
        if ddp is not None and comm is None:
            info.note = "DDP recorded no timing for the measured iterations"
        elif ddp is not None and not self.samples:
            info.note = ("DDP sampled none of the measured iterations: its timing is its average over its "
                         "sampled iterations, the first ten of which are warm-up")
        return info


#: DDP's timing of its last sampled iteration, in nanoseconds.
_SAMPLE_KEYS = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
                "backward_compute_comm_overlap_time")


def _sample_every_iteration_on_cpu(ddp: Any) -> None:
    """Have DDP time every iteration of a module on the CPU, where its timer only
    reads the clock (on a device it waits for the previous iteration's events)."""
    try:
        if all(p.device.type == "cpu" for p in ddp.parameters()):
            ddp._set_ddp_runtime_logging_sample_rate(1)
    except Exception:
        pass


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _buffer_copy(module: Any) -> list[Any] | None:
    buffers = list(module.buffers())
    if sum(b.numel() * b.element_size() for b in buffers) > BUFFER_CHECK_LIMIT:
        return None
    return [b.detach().clone() for b in buffers]


def _buffers_changed(module: Any, before: list[Any] | None) -> bool | None:
    if before is None:
        return None
    import torch

    now = list(module.buffers())
    if len(now) != len(before):
        return True
    return any(a.shape != b.shape or not torch.equal(a.to(b.device), b) for a, b in zip(now, before))


_NS = 1e-9


def ddp_facts(ddp: Any, buffers_before: list[Any] | None,
              samples: dict[int, dict[str, float]] | None = None) -> dict[str, Any]:
    """A DDP module's settings and its own timing, per iteration, in seconds: the mean
    median of ``samples`` (iteration -> DDP's timing of it) when given, else DDP's averages."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # an older DDP without logging data: the settings from the module
        data = {}

    def seconds(key: str) -> float | None:
        if samples:
            name = key[len("avg_"):]
            values = Samples.of(sample[name] for sample in samples.values() if name in sample)
            return values.median * _NS if values else None
        value = data.get(key)
        return value * _NS if isinstance(value, (int, float)) and value > 0 else None

    buffers = list(ddp.module.buffers()) if hasattr(ddp, "module") else []
    cap = data.get("bucket_cap_bytes")
    return {
        "bucket_cap_mb": cap / (1 << 20) if isinstance(cap, (int, float)) else None,
        "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", data.get("gradient_as_bucket_view"))),
        "static_graph": bool(getattr(ddp, "static_graph", False)),
        "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", data.get("find_unused_parameters"))),
        "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", data.get("broadcast_buffers"))),
        "unused_parameter_bytes": data.get("unused_parameter_size"),
        "parameter_bytes": data.get("total_parameter_size_bytes"),
        "buckets": len(str(data.get("bucket_sizes") or "").split(",")) if data.get("bucket_sizes") else None,
        "buffers": len(buffers),
        "buffers_changed": _buffers_changed(ddp.module, buffers_before) if hasattr(ddp, "module") else None,
        "comm_hook": data.get("comm_hook") or None,
        "forward_compute_seconds": seconds("avg_forward_compute_time"),
        "backward_compute_seconds": seconds("avg_backward_compute_time"),
        "backward_comm_seconds": seconds("avg_backward_comm_time"),
        "backward_overlap_seconds": seconds("avg_backward_compute_comm_overlap_time"),
        #: How many measured iterations the timing is the median of (0: DDP's own averages).
        "timed_iterations": len(samples or ()),
    }


def _ddp_per_step(ddp: dict[str, Any], backwards: float | None,
                  synced: float | None) -> tuple[float | None, float | None, float | None]:
    """(communication, its exposed part, compute) per optimizer step, from DDP's
    per-iteration averages and the iterations a step had."""
    comm = ddp.get("backward_comm_seconds")
    overlap = ddp.get("backward_overlap_seconds") or 0.0
    if synced is None:
        synced = backwards = 1.0
    compute = None
    forward, backward = ddp.get("forward_compute_seconds"), ddp.get("backward_compute_seconds")
    if forward is not None and backward is not None and backwards is not None:
        compute = (forward + backward) * backwards
    if comm is None:
        return None, None, compute
    return comm * synced, max(comm - overlap, 0.0) * synced, compute
