"""The distributed settings worth measuring on a data-parallel run, from what the
profile saw of it (its ``distributed`` section, one rank's view):

* DistributedDataParallel's own settings (the ``ddp`` knob): no search for unused
  parameters when none was unused, a static graph, gradients as views into the
  buckets, no buffer broadcast when no buffer changes, other bucket sizes, and
  gradient compression (bf16/fp16 hooks) when the all-reduce is a noticeable part of
  the step;
* on npu, the host-side and HCCL settings the Ascend documentation gives for speed
  (environment variables, each with its source; not yet verified on Ascend hardware).

A run that is not distributed (no ``distributed`` section) gets none of them.
"""

from __future__ import annotations

import math
from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate
from torchaxe.units import bytes_text, duration

AXIS = "distributed"
#: DDP's bucket size when the script gives none (MiB).
DEFAULT_BUCKET_CAP_MB = 25.0
MIB = 1024 * 1024
#: Below this share of the step, DDP's all-reduce is not worth bucket sizes or compression.
MIN_COMM_SHARE = 0.05
#: A bucket holding every gradient is tried only for models up to this size (MiB).
ONE_BUCKET_MAX_MB = 256
#: HCCL's communication buffer when HCCL_BUFFSIZE is not set (MB).
HCCL_DEFAULT_BUFFSIZE_MB = 200
#: One group each: advise keeps at most one bucket size and one compression hook.
BUCKET_GROUP, HOOK_GROUP = "ddp-bucket", "ddp-comm-hook"
#: Shared with the bind axis's core binding: torch_npu's own binding replaces it.
BINDING_GROUP = "binding"
UNVERIFIED = "not yet verified on Ascend hardware"

#: The Ascend documents each npu setting comes from (named in the candidate's detail).
TASK_QUEUE_SOURCE = ("Ascend Extension for PyTorch environment variable reference, TASK_QUEUE_ENABLE "
                     "(hiascend.com/document/detail/zh/Pytorch/600/apiref/Envvariables/Envir_019.html)")
CPU_AFFINITY_SOURCE = ("Ascend Extension for PyTorch feature guide, core binding with CPU_AFFINITY_CONF "
                       "(hiascend.com/doc_center/source/zh/Pytorch/700/ptmoddevg/Frameworkfeatures/"
                       "featuresguide_00010.html)")
COMBINED_SOURCE = ("Ascend Extension for PyTorch environment variable reference, COMBINED_ENABLE "
                   "(hiascend.com/document/detail/zh/Pytorch/600/apiref/Envvariables/Envir_005.html)")
HCCL_BUFFSIZE_SOURCE = ("CANN environment variable reference, HCCL_BUFFSIZE "
                        "(hiascend.com/document/detail/zh/canncommercial/800/apiref/envvar/envref_07_0080.html)")


def _exact(detail: str) -> Accuracy:
    return Accuracy(kind="exact", detail=detail)


def _ms(seconds: float) -> str:
    return duration(seconds, 1)


def comm_share(profile: dict[str, Any], dist: dict[str, Any]) -> tuple[float, str] | None:
    """The share of the step DDP's backward all-reduce takes (every backward pass of
    the step that exchanged gradients), and how it reads; None when the profile has
    no timing of it."""
    ddp = dist.get("ddp") or {}
    comm = ddp.get("backward_comm_seconds")
    if comm is None:
        return None
    passes = _exchanges(dist)
    per_step = comm * passes
    step = (profile.get("summary") or {}).get("step_seconds_median")
    times = f" x {passes:g} backward passes" if passes != 1 else ""
    if step:
        return per_step / step, f"DDP's all-reduce took {_ms(comm)}{times} of the {_ms(step)} step"
    compute = (ddp.get("forward_compute_seconds") or 0.0) + (ddp.get("backward_compute_seconds") or 0.0)
    if compute + comm <= 0:
        return None
    return comm / (compute + comm), f"DDP's all-reduce took {_ms(comm)} against {_ms(compute)} of forward and backward"


def _exchanges(dist: dict[str, Any]) -> float:
    """Backward passes per step that exchanged gradients (the others ran under ``no_sync()``)."""
    synced = dist.get("synced_backwards_per_step")
    return synced if synced is not None else (dist.get("backwards_per_step") or 1.0)


def _bucket_accuracy(world: int | None) -> Accuracy:
    if world is not None and world <= 2:
        return _exact("the same per-element sums: with two ranks each gradient is one addition, whatever the buckets")
    return Accuracy(kind="unknown", detail="the same sums, but with more than two ranks the collective may add the "
                    "ranks' gradients in another order for another message size (last-bit differences); its "
                    "training loss is compared with the original's")


def _hccl_env(cap_mb: float, target: str, settings: dict[str, Any]) -> dict[str, str]:
    """On npu, HCCL_BUFFSIZE large enough for a bucket above HCCL's buffer (the
    documentation advises a buffer larger than the data of one collective)."""
    if target != "npu":
        return {}
    current = (settings.get("env") or {}).get("HCCL_BUFFSIZE")
    try:
        have = float(current) if current else HCCL_DEFAULT_BUFFSIZE_MB
    except ValueError:
        have = HCCL_DEFAULT_BUFFSIZE_MB
    return {"HCCL_BUFFSIZE": str(math.ceil(cap_mb))} if cap_mb > have else {}


def _bucket_candidates(ddp: dict[str, Any], dist: dict[str, Any], target: str, settings: dict[str, Any],
                       share: tuple[float, str] | None) -> list[Candidate]:
    """Half and four times the current bucket size, and one bucket for every gradient
    when the model is small, each only where it changes the bucketing."""
    current = float(ddp.get("bucket_cap_mb") or DEFAULT_BUCKET_CAP_MB)
    params = ddp.get("parameter_bytes")
    if not params:
        return []
    params_mb = params / MIB
    comm = ddp.get("backward_comm_seconds")
    overlap = ddp.get("backward_overlap_seconds")
    seen = f"{share[1]}; " if share else ""
    overlapped = (f"{_ms(overlap)} of its {_ms(comm)} overlapped backward compute; " if comm and overlap is not None
                  else "")
    buckets = ddp.get("buckets")
    now = f"{bytes_text(params)} of parameters in {buckets} bucket(s) of {current:g} MB"
    sizes: list[tuple[float, str]] = []
    if params_mb > current / 2:
        sizes.append((current / 2, "smaller buckets start all-reducing earlier in backward, so more of the "
                                   "communication overlaps the backward compute still to run"))
    if params_mb > current:
        sizes.append((current * 4, "fewer, larger all-reduces: less fixed cost per call"))
    if params_mb > current * 4 and params_mb < ONE_BUCKET_MAX_MB:
        sizes.append((float(math.ceil(params_mb)), "one bucket for every gradient: a single all-reduce after "
                                                    "backward, no per-call cost, no overlap"))
    base = 0.3 + min(share[0], 1.0) if share else 0.3
    out = []
    for cap, why in sizes:
        knobs: dict[str, Any] = {"ddp": {"bucket_cap_mb": cap}}
        env = _hccl_env(cap, target, settings)
        if env:
            knobs["env"] = env
        extra = (f"; HCCL_BUFFSIZE={env['HCCL_BUFFSIZE']} so that a bucket fits HCCL's buffer "
                 f"({HCCL_BUFFSIZE_SOURCE}; {UNVERIFIED})") if env else ""
        out.append(knob_candidate(
            f"knob:ddp-bucket-cap-{cap:g}", AXIS, f"DDP bucket_cap_mb={cap:g} (now {current:g})", knobs,
            group=BUCKET_GROUP, priority=base, accuracy=_bucket_accuracy(dist.get("world_size")),
            detail=f"{now}; {seen}{overlapped}{why}{extra}"))
    return out


def _hook_candidates(dist: dict[str, Any], target: str, share: tuple[float, str]) -> list[Candidate]:
    """Gradient compression: bf16 where DDP takes it (CUDA with NCCL), fp16 elsewhere too."""
    backend = dist.get("backend")
    unverified = f" ({UNVERIFIED})" if target == "npu" else ""
    priority = 0.5 + min(share[0], 1.0) * 2
    why = f"{share[1]} ({share[0]:.0%}) on {backend or 'its backend'}: half the bytes cross between the ranks"
    out = []
    hooks = (("bf16", "bfloat16", "8-bit mantissa, float32's range"), ("fp16", "float16", "10-bit mantissa, "
             "a narrow range: the hook divides by the world size before the all-reduce"))
    for name, dtype, form in hooks:
        # DDP refuses the bf16 hook unless torch runs on CUDA with NCCL (or XPU).
        if name == "bf16" and not (target == "cuda" and backend == "nccl"):
            continue
        out.append(knob_candidate(
            f"knob:ddp-comm-{name}", AXIS, f"DDP gradient compression: all-reduce in {dtype} "
            f"({name}_compress_hook){unverified}", {"ddp": {"comm_hook": name}}, group=HOOK_GROUP,
            priority=priority - (0.1 if name == "fp16" else 0.0),
            accuracy=Accuracy(kind="unknown", detail=f"the averaged gradients are rounded to {dtype} ({form}) "
                              "and cast back; its training loss is compared with the original's"),
            detail=why + unverified))
    return out


def _npu_candidates(ddp: dict[str, Any] | None, settings: dict[str, Any]) -> list[Candidate]:
    """The host-side and HCCL settings the Ascend documentation gives for speed, each
    unless the run's environment already sets it."""
    env = settings.get("env") or {}
    out: list[Candidate] = []
    if env.get("TASK_QUEUE_ENABLE") != "2" and env.get("ASCEND_LAUNCH_BLOCKING") != "1":
        out.append(knob_candidate(
            "knob:npu-task-queue-2", AXIS, f"TASK_QUEUE_ENABLE=2: level 2 of torch_npu's operator dispatch queue "
            f"({UNVERIFIED})", {"env": {"TASK_QUEUE_ENABLE": "2"}}, priority=0.9,
            detail=f"TASK_QUEUE_ENABLE is {env.get('TASK_QUEUE_ENABLE') or 'unset (level 1)'}: level 2 also moves "
                   "workspace work to the second dispatch stage, hiding more of the host's operator dispatch; the "
                   f"documentation recommends it and warns that the peak device memory may rise "
                   f"({TASK_QUEUE_SOURCE}; {UNVERIFIED})"))
    if not env.get("CPU_AFFINITY_CONF"):
        for mode, grain, priority in (("2", "fine-grained", 0.5), ("1", "coarse-grained", 0.4)):
            out.append(knob_candidate(
                f"knob:npu-cpu-affinity-{mode}", AXIS, f"CPU_AFFINITY_CONF={mode}: torch_npu's {grain} core "
                f"binding ({UNVERIFIED})", {"env": {"CPU_AFFINITY_CONF": mode}}, group=BINDING_GROUP,
                priority=priority,
                detail=("binds torch_npu's dispatch threads to the first cores of the device's NUMA node and the "
                        "rest (DataLoader workers) to the others; the documentation recommends it for runs whose "
                        "host dispatch is slow" if mode == "2" else
                        "binds each process's threads to the cores of its device's NUMA node")
                       + "; torch_npu binds after start-up, over any other binding, so it is one choice with the "
                         f"bind axis's core binding ({CPU_AFFINITY_SOURCE}; {UNVERIFIED})"))
    if env.get("COMBINED_ENABLE") != "1":
        out.append(knob_candidate(
            "knob:npu-combined", AXIS, f"COMBINED_ENABLE=1: torch_npu's combined contiguous copies ({UNVERIFIED})",
            {"env": {"COMBINED_ENABLE": "1"}}, priority=0.3,
            detail="optimises making contiguous the non-contiguous tensors that two or more view operations "
                   f"produce (off by default) ({COMBINED_SOURCE}; {UNVERIFIED})"))
    cap = (ddp or {}).get("bucket_cap_mb")
    hccl = _hccl_env(float(cap), "npu", settings) if cap else {}
    if hccl:
        out.append(knob_candidate(
            "knob:npu-hccl-buffsize", AXIS, f"HCCL_BUFFSIZE={hccl['HCCL_BUFFSIZE']}: an HCCL buffer that holds a "
            f"DDP bucket ({UNVERIFIED})", {"env": hccl}, priority=0.6,
            detail=f"the run's DDP buckets are {cap:g} MB, above HCCL's {HCCL_DEFAULT_BUFFSIZE_MB} MB buffer: the "
                   "documentation says a collective larger than the buffer may slow down and advises a buffer "
                   "larger than the data; each communicator then holds twice that much device memory "
                   f"({HCCL_BUFFSIZE_SOURCE}; {UNVERIFIED})"))
    return out


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any], *,
               notes: list[str] | None = None) -> list[Candidate]:
    """The ``ddp`` knob's settings the profile's DDP module shows worth trying, and on
    npu the documented host-side and HCCL settings; [] for a run that is not
    distributed. Why a setting is not tried, where the evidence says, goes to ``notes``."""
    dist = profile.get("distributed")
    if not dist:
        return []
    out: list[Candidate] = []
    ddp = dist.get("ddp")
    if ddp:
        out += _ddp_candidates(profile, dist, ddp, target, settings, notes)
    elif notes is not None:
        notes.append("the distributed run built no DistributedDataParallel module: DDP's settings were not tried")
    if target == "npu":
        out += _npu_candidates(ddp, settings)
    if notes is not None:
        notes.extend(_accumulation_notes(dist, ddp))
        notes.extend(_collective_notes(profile, dist))
    return out


def _accumulation_notes(dist: dict[str, Any], ddp: dict[str, Any] | None) -> list[str]:
    """Gradient accumulation that exchanges gradients on every micro-batch: a code
    change (``no_sync()``) saves all but one exchange; no setting does."""
    passes, synced = dist.get("backwards_per_step"), dist.get("synced_backwards_per_step")
    if not ddp or not passes or passes <= 1 or synced is None or synced <= 1:
        return []
    comm = ddp.get("backward_comm_seconds")
    cost = f" (DDP's all-reduce took {_ms(comm)} each: {_ms(comm * (synced - 1))} a step to save)" if comm else ""
    return [f"the script accumulates gradients over {passes:g} backward passes a step and DDP exchanged them on "
            f"{synced:g} of them{cost}: running the micro-batches before the last under model.no_sync() exchanges "
            "them once a step, with the same gradients up to the order of additions (a code change; no setting "
            "does it)"]


def _collective_notes(profile: dict[str, Any], dist: dict[str, Any]) -> list[str]:
    """The script's own collectives (``dist.all_reduce`` of a loss to print it, say)
    when they take a noticeable part of the step: no setting changes them."""
    step = (profile.get("summary") or {}).get("step_seconds_median")
    calls = {name: c for name, c in (dist.get("collectives") or {}).items() if c and c.get("seconds_per_step")}
    seconds = sum(c["seconds_per_step"] for c in calls.values())
    if not step or seconds / step < MIN_COMM_SHARE:
        return []
    which = ", ".join(f"{name} {c.get('calls_per_step') or 0:.3g} a step" for name, c in sorted(calls.items()))
    return [f"the script's own collectives ({which}) took {_ms(seconds)} of the {_ms(step)} step "
            f"({seconds / step:.0%}): no setting changes them; calling them less often does (a loss all-reduced "
            "only when it is printed)"]


def _ddp_candidates(profile: dict[str, Any], dist: dict[str, Any], ddp: dict[str, Any], target: str,
                    settings: dict[str, Any], notes: list[str] | None) -> list[Candidate]:
    out: list[Candidate] = []
    if ddp.get("find_unused_parameters") is True and ddp.get("unused_parameter_bytes") == 0:
        out.append(knob_candidate(
            "knob:ddp-find-unused-false", AXIS, "DDP find_unused_parameters=False",
            {"ddp": {"find_unused_parameters": False}}, priority=1.2,
            accuracy=_exact("every parameter got its gradient in the profiled steps: the same gradients, without "
                            "the search"),
            detail="find_unused_parameters=True walks the autograd graph from the outputs after every forward to "
                   "find parameters that will get no gradient; the profile saw none unused. A model that leaves "
                   "some parameters unused only in some steps fails loudly without it (DDP raises that it expected "
                   "every parameter to receive a gradient)"))
    backwards, synced = dist.get("backwards_per_step"), dist.get("synced_backwards_per_step")
    skips_sync = backwards is not None and synced is not None and synced < backwards
    if ddp.get("static_graph") is False and skips_sync:
        if notes is not None:
            notes.append(f"DDP static_graph=True was not tried: the run exchanged gradients in {synced:g} of its "
                         f"{backwards:g} backward passes a step (no_sync() on the others), and DDP's static graph "
                         "fails with no_sync() on the first step's micro-batches (an internal assert in its reducer)")
    elif ddp.get("static_graph") is False:
        out.append(knob_candidate(
            "knob:ddp-static-graph", AXIS, "DDP static_graph=True", {"ddp": {"static_graph": True}}, priority=0.9,
            accuracy=_exact("the same gradients: DDP only records once which parameters are used and in which "
                            "order their gradients are ready"),
            detail="DDP learns the graph in the first step, then skips the unused-parameter search and orders its "
                   "buckets as the gradients become ready; the run must use the same parameters every step "
                   "(DDP raises otherwise, and the trial fails)"))
    if ddp.get("gradient_as_bucket_view") is False:
        out.append(knob_candidate(
            "knob:ddp-bucket-view", AXIS, "DDP gradient_as_bucket_view=True",
            {"ddp": {"gradient_as_bucket_view": True}}, priority=0.7,
            accuracy=_exact("the same gradients, held in the all-reduce buckets"),
            detail="each gradient becomes a view into DDP's all-reduce bucket instead of a tensor copied into the "
                   "bucket and back every step: one copy fewer and less memory; a script that calls detach_() on "
                   "a gradient or keeps one across steps sees the bucket's values"))
    buffers, changed = ddp.get("buffers"), ddp.get("buffers_changed")
    if ddp.get("broadcast_buffers") is True:
        if buffers and changed is False:
            out.append(knob_candidate(
                "knob:ddp-broadcast-buffers-false", AXIS, "DDP broadcast_buffers=False",
                {"ddp": {"broadcast_buffers": False}}, priority=0.6,
                accuracy=_exact(f"none of the module's {buffers} buffer(s) changed in the profiled steps: every "
                                "rank keeps rank 0's values without the broadcast"),
                detail=f"DDP broadcasts the module's {buffers} buffer(s) from rank 0 before every forward; none "
                       "changed in the profiled steps (buffers that do change, such as BatchNorm's running "
                       "statistics, would then differ between ranks)"))
        elif buffers and changed and notes is not None:
            notes.append(f"DDP broadcasts the module's {buffers} buffer(s) before every forward and they changed "
                         "during the run (BatchNorm statistics?): broadcast_buffers=False was not tried, as the "
                         "ranks' buffers would drift apart")
    share = comm_share(profile, dist)
    if share is not None and share[0] < MIN_COMM_SHARE:
        if notes is not None:
            notes.append(f"{share[1]} ({share[0]:.1%}): DDP's bucket sizes and gradient compression were not tried")
        return out
    out += _bucket_candidates(ddp, dist, target, settings, share)
    if share is not None and not ddp.get("comm_hook"):
        out += _hook_candidates(dist, target, share)
    elif ddp.get("comm_hook") and notes is not None:
        notes.append(f"the script registers its own DDP comm hook ({ddp['comm_hook']}): gradient compression "
                     "was not tried over it")
    return out
