"""``torchaxe compare A B``."""

from __future__ import annotations

import io

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]), default="text", show_default=True,
              help="text and json go to stdout (or --out); html to --out (default torchaxe-compare.html).")
@click.option("--out", metavar="FILE", help="Write the comparison here (atomically) instead of stdout.")
def compare(a, b, fmt, out):
    """Compare two runs: where each spent its step time, and what changed.

    A and B are each a profile written by `torchaxe profile` (JSON), a torch.profiler
    Chrome trace (.json, .json.gz), or torch_npu profiler output (a *_ascend_pt
    folder, its ASCEND_PROFILER_OUTPUT, trace_view.json, kernel_details.csv), in any
    mix: a GPU run against an NPU run is the main case.

    The report gives each run's median step time and model FLOPs utilisation (MFU,
    when the profile counted FLOPs), the phases per step side by side (data wait,
    backward, the rest of the step, optimizer and communication where an operator
    table shows them, garbage collection, host syncs), the aten operators whose time
    per step changed most (with calls per step, input shapes and the user's line where
    recorded), what appears in one run only, dynamic-shape and compile findings, and
    each run's top device kernels. Where a torch_npu trace links a kernel to the aten
    operator that launched it, the kernel is listed under that operator and the NPU
    side's operator time is its kernels' device time; kernels linked to no operator
    are listed apart. Profile with --ops (and --shapes) for the operator table. NPU
    paths are unverified on Ascend hardware.

    \b
    Examples:
      torchaxe profile --ops --out before.json -- python train.py
      torchaxe profile --ops --out after.json -- python train.py --bf16
      torchaxe compare before.json after.json
      torchaxe compare gpu_trace.json npu_run_ascend_pt/ --format html --out gpu-vs-npu.html
    """
    from torchaxe.compare.model import compare_paths
    from torchaxe.console import write_output

    comparison = compare_paths(a, b)
    if fmt == "json":
        write_output(comparison.to_json(), out, "--out")
    elif fmt == "html":
        from torchaxe.report.compare_html import render_comparison_html

        target = out or "torchaxe-compare.html"
        write_output(render_comparison_html(comparison), target, "--out")
        click.echo(f"torchaxe compare: written to {target}", err=True)
    else:
        from torchaxe.report.compare_text import render_comparison

        buffer = io.StringIO()
        render_comparison(comparison, buffer)
        write_output(buffer.getvalue(), out, "--out")
