"""The GPT example's model, forward and backward, with its hand-written attention and
with AX118's fix (``F.scaled_dot_product_attention``), in float32 and under bfloat16
autocast: interleaved rounds in one process, medians and ratios.

Why advise must measure code fixes together with the chosen knobs: on some CPUs the
fused attention is faster in float32 and slower under bf16 autocast.

    .venv/bin/python benchmarks/attention_precision.py [--rounds 15] [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions
from torchaxe.scan.fix import fix_source

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt" / "train.py"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="forward+backward passes per round and arm")
    args = parser.parse_args(argv)

    source = EXAMPLE.read_text()
    options = ScanOptions(target="cpu", select=("AX118",), capabilities=torch_capabilities("cpu"))
    fixed = fix_source(source, str(EXAMPLE), options, unsafe=True).fixed
    if fixed == source:
        print("AX118 found nothing to fix in the example", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "hand.py").write_text(source)
        (Path(folder) / "sdpa.py").write_text(fixed)
        modules = {"hand-written": _load(Path(folder) / "hand.py", "gpt_hand"),
                   "sdpa (AX118)": _load(Path(folder) / "sdpa.py", "gpt_sdpa")}
    torch.manual_seed(0)
    models = {name: m.GPT(256, 128, 4, 4, 64, "tanh") for name, m in modules.items()}
    state = next(iter(models.values())).state_dict()
    for model in models.values():
        model.load_state_dict(state)
    tokens = torch.randint(256, (16, 64))

    print(f"GPT example model (d_model 128, 4 layers, batch 16 x 64), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} forward+backward passes")
    for precision in ("float32", "bfloat16 autocast"):
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "float32"):
                        out = model(tokens)
                    out.float().sum().backward()
                times[name].append((time.perf_counter() - start) / args.steps)
        hand, sdpa = times["hand-written"], times["sdpa (AX118)"]
        ratios = [s / h for s, h in zip(sdpa, hand)]
        print(f"  {precision:18s} hand-written {1e3 * statistics.median(hand):6.1f} ms, "
              f"sdpa {1e3 * statistics.median(sdpa):6.1f} ms; sdpa / hand per round: median "
              f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
