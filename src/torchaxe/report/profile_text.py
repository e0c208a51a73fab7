"""Short text summaries of a Profile and of a merge of rank profiles.

The profile itself is the JSON file; this is what a person reads on stderr after
``torchaxe profile``: how the run ended, step time, and the biggest costs found.
"""

from __future__ import annotations

from typing import TextIO

from torchaxe.runtime.merge import MergeReport
from torchaxe.runtime.profile import Profile
from torchaxe.units import bytes_text, duration, flop_count, flop_rate, mfu_sentence

#: Lines of host-sync sites and of ops shown in the summary.
TOP_SYNCS = 3
TOP_OPS = 5

#: How each kind of host read is written in the summary.
CALLS = {
    "item": ".item()",
    "tolist": ".tolist()",
    "numpy": ".numpy()",
    "cpu": ".cpu()",
    "__bool__": "bool(tensor)",
    "__float__": "float(tensor)",
    "__int__": "int(tensor)",
    "__index__": "tensor as index",
    "__repr__": "print/repr(tensor)",
    "device-sync": "device sync",
}


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def render_profile_summary(profile: Profile, path: str | None, out: TextIO) -> None:
    """A dozen lines: status, step time, data wait, syncs, gc, memory, ops, shapes."""
    s = profile.summary
    run = profile.run
    who = f" [rank {run.rank}/{run.world_size}]" if run.rank is not None and (run.world_size or 0) > 1 else ""
    out.write(f"torchaxe profile{who}: {profile.status}: {profile.detail}\n")
    _write_mfu(profile, out)
    counts = {}
    for step in profile.steps:
        counts[step.phase] = counts.get(step.phase, 0) + 1
    parts = [f"{counts[p]} {p}" for p in ("warmup", "ops", "measured") if counts.get(p)]
    out.write(f"  steps       {' + '.join(parts) or 'none'} on {run.target}\n")
    if s.steps_measured:
        spread = f"; IQR {percent(s.step_seconds_spread)} of median" if s.step_seconds_spread is not None else ""
        out.write(f"  step time   median {duration(s.step_seconds_median)}, p90 {duration(s.step_seconds_p90)} "
                  f"(min {duration(s.step_seconds_min)}, max {duration(s.step_seconds_max)}{spread})\n")
        if s.no_grad_passes_per_step and s.no_grad_fraction is not None:
            out.write(f"  no-grad     {s.no_grad_passes_per_step:.1f} passes per step without gradients (evaluation or "
                      f"generation under no_grad/inference_mode): {percent(s.no_grad_fraction)} of step time\n")
        if s.optimizer_seconds_median is not None and s.optimizer_fraction is not None:
            # The share is of all the time; when a few steps' updates took far longer than
            # the usual one, the median alone would not add up to it: say so.
            mean = s.optimizer_fraction * s.step_seconds_mean if s.step_seconds_mean else None
            uneven = (f", mean {duration(mean)}: a few steps' updates took far longer"
                      if mean is not None and mean > 2 * s.optimizer_seconds_median + 1e-4 else "")
            out.write(f"  optimizer   {percent(s.optimizer_fraction)} of step time in optimizer.step() "
                      f"(median {duration(s.optimizer_seconds_median)} per step{uneven})\n")
        if s.data_wait_fraction is not None or run.source == "harness":
            out.write(f"  data wait   {percent(s.data_wait_fraction)} of step time "
                      f"(median {duration(s.data_wait_seconds_median)} per step)\n")
        syncs = f"{s.host_syncs_per_step:.1f}" if s.host_syncs_per_step is not None else "n/a"
        note = " (on cpu: reads that would synchronise a device; host-only tensors left out)" \
            if run.target == "cpu" else ""
        out.write(f"  host syncs  {syncs} per step{note}\n")
    if profile.host_syncs:
        # A warm-up step's reads (an evaluation pass at step 0) are in the counts, not in the per-step figure.
        if s.steps_measured:
            out.write("                by line, over the whole run (warm-up steps included):\n")
        else:
            out.write("  host syncs  by line, over the whole run (no measured step to count them by):\n")
    for site in profile.host_syncs[:TOP_SYNCS]:
        code = f"  {site.code}" if site.code else ""
        via = f"  (read in {site.via})" if site.via else ""
        out.write(f"                {site.location} {CALLS.get(site.call, site.call)} x{site.count}{code}{via}\n")
    if s.steps_measured and run.source == "harness":
        out.write(f"  gc          {duration(s.gc_seconds_per_step)} per step ({percent(s.gc_fraction)})\n")
    traced = run.source != "harness"
    device = bytes_text(s.peak_device_memory_bytes) if s.peak_device_memory_bytes is not None else f"n/a on {run.target}"
    if not traced:
        activations = ""
        if s.activation_bytes_estimate is not None:
            activations = f"; activations saved for backward {bytes_text(s.activation_bytes_estimate)} a step"
        out.write(f"  memory      host RSS peak {bytes_text(s.host_rss_peak_bytes)}; device peak {device}{activations}\n")
    dist = profile.distributed
    if dist is not None:
        out.write(f"  rank        {dist.rank} of {dist.world_size} ({dist.backend or '?'}, {dist.host or '?'})\n")
        if dist.comm_seconds_per_step is not None:
            exposed = dist.comm_exposed_seconds_per_step
            syncs = ""
            if dist.backwards_per_step:
                syncs = (f"; {dist.synced_backwards_per_step:g} of {dist.backwards_per_step:g} backward passes a step "
                         "exchange gradients")
            out.write(f"  comm        {duration(dist.comm_seconds_per_step)} per step, "
                      f"{duration(exposed) if exposed is not None else 'n/a'} of it not hidden behind compute{syncs}\n")
        if dist.ddp:
            d = dist.ddp
            out.write(f"  DDP         bucket {d.get('bucket_cap_mb')} MB, find_unused_parameters "
                      f"{d.get('find_unused_parameters')}, static_graph {d.get('static_graph')}, "
                      f"gradient_as_bucket_view {d.get('gradient_as_bucket_view')}, broadcast_buffers "
                      f"{d.get('broadcast_buffers')}\n")
    ops = [o for o in profile.ops if o.kind == "op"]
    if ops:
        window = profile.ops_steps
        steps = f"steps {window[0]}-{window[-1]}" if len(window) > 1 else (f"step {window[0]}" if window else ("the trace" if run.source != "harness" else "the window"))
        use_device = any(o.device_self_seconds for o in ops)
        total = sum((o.device_self_seconds or 0.0) if use_device else o.self_seconds for o in ops) or 1.0
        out.write(f"  ops         top by {'device' if use_device else 'host'} self time over {steps}:\n")
        for op in ops[:TOP_OPS]:
            t = (op.device_self_seconds or 0.0) if use_device else op.self_seconds
            source = ""
            if op.sources:
                first = op.sources[0]
                source = f"  from {first.function} ({first.location})" if first.function else f"  from {first.location}"
            out.write(f"                {op.name:<28} {duration(t):>9} {100 * t / total:5.1f}%  "
                      f"{op.calls} calls{source}\n")
    kernels = [o for o in profile.ops if o.kind == "kernel"]
    if kernels:
        total = sum(k.device_self_seconds or 0.0 for k in kernels) or 1.0
        out.write("  kernels     top by device time:\n")
        for kernel in kernels[:TOP_OPS]:
            t = kernel.device_self_seconds or 0.0
            out.write(f"                {_short(kernel.name, 44):<44} {duration(t):>9} {100 * t / total:5.1f}%  "
                      f"{kernel.calls} calls\n")
    for finding in profile.findings:
        out.write(f"  {finding.kind}: {finding.message}\n")
        if finding.suggestion:
            out.write(f"      -> {finding.suggestion}\n")
    if profile.shapes is not None:
        shapes = profile.shapes
        batches = shapes.batches
        batch_text = ""
        if batches is not None:
            n = len(batches.signatures)
            batch_text = f"; {n}{'+' if batches.truncated else ''} batch shape{'s' if n != 1 else ''}"
        dynamic = shapes.dynamic_modules
        if dynamic:
            listed = ", ".join(dynamic[:4]) + (f" and {len(dynamic) - 4} more" if len(dynamic) > 4 else "")
            out.write(f"  shapes      dynamic in {len(dynamic)} of {len(shapes.modules)} modules ({listed}){batch_text}\n")
        else:
            out.write(f"  shapes      static: every one of {len(shapes.modules)} modules saw one input shape{batch_text}\n")
    for warning in profile.warnings:
        out.write(f"  warning: {warning}\n")
    if path:
        out.write(f"  profile written to {path}\n")


def _write_mfu(profile: Profile, out: TextIO) -> None:
    """The MFU line first, then how it was reached: FLOPs per step, achieved, peaks."""
    flops, s = profile.flops, profile.summary
    if flops is None:
        return
    sentence = mfu_sentence(s.mfu_table, s.mfu_measured)
    if sentence is not None:
        out.write(f"  {sentence}\n")
    if flops.flops_per_step:
        device = f" on {flops.device_name}" if flops.device_name else ""
        out.write(f"  flops       {flop_count(flops.flops_per_step)} per step ({flops.dtype}, counted on step "
                  f"{flops.counted_step}); achieved {flop_rate(s.achieved_flops_per_second)}; peak{device}: "
                  f"table {flop_rate(flops.peak_flops_per_second_table, missing='unknown')}, "
                  f"measured {flop_rate(flops.peak_flops_per_second_measured)}\n")
    if flops.note:
        out.write(f"  flops note  {flops.note}\n")


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def render_merge(report: MergeReport, out: TextIO) -> None:
    """A table of the ranks, then the slowest rank and its distance from the median."""
    from torchaxe.runtime.merge import OUTSIDE_BACKWARD

    out.write(f"{len(report.ranks)} of {report.world_size} ranks\n")
    out.write(f"{'rank':>4}  {'status':<11} {'steps':>5}  {'median':>10}  {'p90':>10}  {'outside bwd':>11}  "
              f"{'data wait':>9}  {'syncs/step':>10}\n")
    for r in report.ranks:
        syncs = f"{r.host_syncs_per_step:.1f}" if r.host_syncs_per_step is not None else "n/a"
        out.write(f"{r.rank:>4}  {r.status:<11} {r.steps_measured:>5}  {duration(r.step_seconds_median):>10}  "
                  f"{duration(r.step_seconds_p90):>10}  {duration(r.outside_backward_seconds_median):>11}  "
                  f"{percent(r.data_wait_fraction):>9}  {syncs:>10}\n")
    slowest = report.slowest
    if slowest is not None:
        by = report.slowest_by
        what = "time outside backward" if by == OUTSIDE_BACKWARD else "step time"
        counts = report.slowest_counts()
        steps = f"; slowest on {counts.get(slowest.rank, 0)} of {len(report.steps)} steps" if report.steps else ""
        out.write(f"slowest rank {slowest.rank}: median {what} {duration(slowest.measure(by))}, "
                  f"{percent(report.slowest_vs_median)} above the median rank "
                  f"({duration(report.median_rank_measure)}){steps}\n")
        if by == OUTSIDE_BACKWARD:
            out.write("  (in data-parallel training every rank's step lasts as long as the slowest one's: the others "
                      "wait inside backward for its gradients, so ranks are compared by their time outside backward)\n")
    for warning in report.warnings:
        out.write(f"warning: {warning}\n")
