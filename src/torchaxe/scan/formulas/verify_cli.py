"""``torchaxe verify``: the command-line face of ``formulas.verify`` (loaded lazily by
the CLI, so that ``torchaxe --help`` and ``torchaxe scan`` never import torch)."""

from __future__ import annotations

import json
import sys

import click

from torchaxe.console import CONTEXT, progress_printer


@click.command(context_settings=CONTEXT)
@click.argument("codes", nargs=-1)
@click.option("--device", type=click.Choice(("auto", "cpu", "cuda", "npu"), case_sensitive=False), default="auto",
              help="Where to run: auto (cuda if available, else cpu), cpu or cuda. npu is refused: torchaxe never "
                   "imports torch_npu.")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16", "float64")), default="float32",
              help="Data type of the inputs (default float32); tolerances follow torch.testing.")
@click.option("--shape", metavar="N,N,...",
              help="Shape of the main input (default per formula, e.g. 8,256,1024; attention takes B,H,L,E).")
@click.option("--repeats", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="Interleaved timing samples per side.")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", help="Output format.")
def verify(codes, device, dtype, shape, repeats, fmt):
    """Measure each formula rule's fix: hand-written form against replacement.

    For the formula rules (AX110-AX120, or the CODES given, prefixes allowed) runs the
    hand-written reference form and the fused replacement on the same random inputs
    and prints the max absolute and relative difference, whether it is within the
    dtype's tolerance, and the speedup (median of interleaved runs) on this device.
    Exit code: 0 every fix the rules call safe is within tolerance, 1 one is not,
    2 errors.

    \b
    Examples:
      torchaxe verify
      torchaxe verify AX110 AX118 --shape 4,8,512,64 --dtype bfloat16
    """
    import torch

    from torchaxe.scan.formulas.verify import parse_shape, render_text
    from torchaxe.scan.formulas.verify import verify as run_verify

    results = run_verify(tuple(c.upper() for c in codes), device.lower(), dtype, parse_shape(shape), repeats,
                         progress=progress_printer("verify", quiet=not sys.stderr.isatty()))
    if fmt == "json":
        click.echo(json.dumps({"torch": torch.__version__, "results": [r.to_dict() for r in results]}, indent=2))
    else:
        device_name = results[0].device if results else device
        render_text(results, sys.stdout,
                    f"torchaxe verify: device {device_name} (torch {torch.__version__}), dtype {dtype}, "
                    f"{repeats} interleaved samples per side")
    failed = any(not r.agrees for r in results)
    errors = any(r.error for r in results)
    sys.exit((1 if failed else 0) | (2 if errors else 0))
