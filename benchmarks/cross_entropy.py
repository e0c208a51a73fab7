"""Cross-entropies written by hand (what AX122 flags) against F.cross_entropy on the
same logits: forward and backward, interleaved rounds in one process, medians and
ratios, and the largest difference of the losses and of the logits' gradients.

    .venv/bin/python benchmarks/cross_entropy.py [--rounds 9] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F


def label_smoothing(rows: int, classes: int, eps: float = 0.1):
    x = torch.randn(rows, classes, requires_grad=True)
    y = torch.randint(classes, (rows,))

    def hand() -> torch.Tensor:
        log_probs = F.log_softmax(x, dim=-1)
        true_dist = torch.zeros_like(log_probs).scatter_(1, y.unsqueeze(1), 1)
        true_dist = true_dist * (1 - eps) + eps / classes
        return (-true_dist * log_probs).sum(dim=-1).mean()

    def fused() -> torch.Tensor:
        return F.cross_entropy(x, y, label_smoothing=eps)

    return x, hand, fused


def soft_targets(rows: int, classes: int, temperature: float = 4.0):
    x = torch.randn(rows, classes, requires_grad=True)
    teacher = torch.randn(rows, classes)

    def hand() -> torch.Tensor:
        return -(F.softmax(teacher / temperature, dim=1) * F.log_softmax(x / temperature, dim=1)).sum(1).mean()

    def fused() -> torch.Tensor:
        return F.cross_entropy(x / temperature, F.softmax(teacher / temperature, dim=1))

    return x, hand, fused


def nt_xent(batch: int, dim: int, temperature: float = 0.5):
    """SimCLR's loss: each of 2B embeddings' positive is its other view."""
    x = torch.nn.functional.normalize(torch.randn(2 * batch, dim), dim=1).requires_grad_()
    n = 2 * batch
    eye = torch.eye(n, dtype=torch.bool)
    positive = torch.cat([torch.arange(batch, n), torch.arange(batch)])

    def hand() -> torch.Tensor:
        sim = torch.exp(x @ x.t() / temperature)
        sim = sim.masked_select(~eye).view(n, -1)
        pos = torch.exp((x * x[positive]).sum(-1) / temperature)
        return (-torch.log(pos / sim.sum(dim=-1))).mean()

    def fused() -> torch.Tensor:
        logits = (x @ x.t() / temperature).masked_fill(eye, float("-inf"))
        return F.cross_entropy(logits, positive)

    return x, hand, fused


def log_of_softmax(rows: int, classes: int):
    """``-(targets * torch.log(F.softmax(x))).sum(1).mean()`` with one-hot targets."""
    x = torch.randn(rows, classes, requires_grad=True)
    y = torch.randint(classes, (rows,))
    target = F.one_hot(y, classes).float()

    def hand() -> torch.Tensor:
        return -(target * torch.log(F.softmax(x, dim=1))).sum(1).mean()

    def fused() -> torch.Tensor:
        return F.cross_entropy(x, y)

    return x, hand, fused


def picked(rows: int, classes: int):
    x = torch.randn(rows, classes, requires_grad=True)
    y = torch.randint(classes, (rows,))

    def hand() -> torch.Tensor:
        return -F.log_softmax(x, dim=-1).gather(1, y.unsqueeze(1)).mean()

    def fused() -> torch.Tensor:
        return F.cross_entropy(x, y)

    return x, hand, fused


#: (name, builder, its arguments)
CASES = (
    ("label smoothing, 256 x 1000", label_smoothing, (256, 1000)),
    ("label smoothing, 2048 tokens x 8000", label_smoothing, (2048, 8000)),
    ("soft targets (distillation), 256 x 1000", soft_targets, (256, 1000)),
    ("NT-Xent, batch 256, dim 128", nt_xent, (256, 128)),
    ("one-hot x log(softmax), 2048 x 8000", log_of_softmax, (2048, 8000)),
    ("-log_softmax.gather, 2048 x 8000", picked, (2048, 8000)),
)


def _time(fn: Callable[[], torch.Tensor], x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        x.grad = None
        fn().backward()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="forward+backward passes per round and arm")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} "
          "forward+backward passes, interleaved")
    print(f"{'case':42} {'by hand':>10} {'fused':>10} {'ratio':>7} {'loss diff':>10} {'grad diff':>10}")
    for name, build, build_args in CASES:
        x, hand, fused = build(*build_args)
        x.grad = None
        hand().backward()
        with torch.no_grad():
            loss_hand, loss_fused = float(hand()), float(fused())
        g_hand = x.grad.clone()
        x.grad = None
        fused().backward()
        g_fused = x.grad.clone()
        times: dict[str, list[float]] = {"hand": [], "fused": []}
        for r in range(args.rounds):
            arms = (("hand", hand), ("fused", fused)) if r % 2 == 0 else (("fused", fused), ("hand", hand))
            for arm, fn in arms:
                times[arm].append(_time(fn, x, args.steps))
        h, f = statistics.median(times["hand"]), statistics.median(times["fused"])
        print(f"{name:42} {1000 * h:8.2f}ms {1000 * f:8.2f}ms {h / f:6.2f}x {abs(loss_hand - loss_fused):10.1e} "
              f"{float((g_hand - g_fused).abs().max()):10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
