"""A recurrent cell stepped in a Python loop (what AX121 flags) against the sequence
layer with the same weights: forward and backward, interleaved rounds in one process,
medians and ratios, and the largest difference of their outputs.

    .venv/bin/python benchmarks/cell_loop.py [--rounds 9] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

#: (cell, layer, batch, steps of the sequence, input size, hidden size)
CASES = (
    ("LSTMCell", "LSTM", 32, 100, 64, 128),
    ("LSTMCell", "LSTM", 8, 50, 32, 64),
    ("GRUCell", "GRU", 32, 100, 64, 128),
)


def _pair(cell_name: str, layer_name: str, inputs: int, hidden: int):
    cell = getattr(torch.nn, cell_name)(inputs, hidden)
    layer = getattr(torch.nn, layer_name)(inputs, hidden, batch_first=True)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(layer, f"{name}_l0").copy_(getattr(cell, name))
    return cell, layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="forward+backward passes per round and arm")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} "
          "forward+backward passes")
    for cell_name, layer_name, batch, length, inputs, hidden in CASES:
        cell, layer = _pair(cell_name, layer_name, inputs, hidden)
        x = torch.randn(batch, length, inputs)
        lstm = cell_name == "LSTMCell"

        def loop() -> torch.Tensor:
            h = torch.zeros(batch, hidden)
            c = torch.zeros(batch, hidden)
            outs = []
            for t in range(length):
                if lstm:
                    h, c = cell(x[:, t], (h, c))
                else:
                    h = cell(x[:, t], h)
                outs.append(h)
            return torch.stack(outs, 1)

        def fused() -> torch.Tensor:
            return layer(x)[0]

        difference = (loop() - fused()).abs().max().item()
        times: dict[str, list[float]] = {"loop": [], "layer": []}
        for _ in range(args.rounds):
            for name, run in (("loop", loop), ("layer", fused)):
                start = time.perf_counter()
                for _ in range(args.steps):
                    run().sum().backward()
                times[name].append((time.perf_counter() - start) / args.steps)
        ratios = [a / b for a, b in zip(times["loop"], times["layer"])]
        print(f"  {cell_name} loop vs {layer_name} (batch {batch}, {length} steps, {inputs} -> {hidden}): loop "
              f"{1e3 * statistics.median(times['loop']):7.1f} ms, {layer_name} "
              f"{1e3 * statistics.median(times['layer']):6.1f} ms; loop / layer per round: median "
              f"{statistics.median(ratios):.1f}x (min {min(ratios):.1f}, max {max(ratios):.1f}); "
              f"largest output difference {difference:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
