"""Train a GRU sequence classifier on variable-length synthetic token sequences.

This script is DELIBERATELY UNTUNED. It is a common way to batch sequences of
different lengths, and it exists so that torchaxe (``make demo``, the tests) has a
dynamic-shape workload to find. Do not "fix" it: the slow patterns are the point.

What is slow on purpose:

* the collate function pads every batch to the length of its own longest sequence,
  so the input shape changes from step to step (dynamic shapes: every new shape
  recompiles under ``torch.compile`` or NPU online compilation and defeats
  ``cudnn.benchmark`` and CUDA graphs; bucketing or padding to a few fixed lengths
  would make the shapes static);
* ``drop_last=False`` with a data set size that the batch size does not divide, so
  the last batch of every epoch has yet another shape;
* ``torch.optim.Adam`` without ``fused=True``;
* ``tokens.to(device)`` without ``non_blocking=True`` and no ``pin_memory``;
* ``float(loss)`` every step, which waits for the device to finish the step.

The task: each sequence holds filler tokens and a few "marker" tokens; the label is
the marker that occurs most often. Lengths are drawn between ``--min-len`` and
``--max-len``. The data is generated in memory and everything is seeded.

Run it::

    python examples/seq_varlen/train.py
    python examples/seq_varlen/train.py --steps 300 --max-len 512 --hidden 512 --batch-size 64
    python examples/seq_varlen/train.py --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

PAD = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to run (default: 20)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=1000,
                        help="sequences in the data set (default 1000: not a multiple of the batch size)")
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--num-classes", type=int, default=4, help="number of marker tokens, one per class")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="GRU hidden size")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5, help="print the mean loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.vocab_size <= args.num_classes + 1:
        parser.error("--vocab-size must leave room for padding, markers and filler tokens")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU. ``npu`` imports torch_npu, which
    registers the Ascend device with torch; it is imported only when asked for."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but CUDA is not available")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device)
        except ImportError as exc:
            raise SystemExit(f"error: --device npu needs torch_npu ({exc})") from exc
    return torch.device(name)


# --------------------------------------------------------------------------- data


class MarkerSequences(Dataset):
    """Token ids: 0 is padding, 1..num_classes are the markers, the rest is filler.

    A sequence of class ``c`` holds more copies of marker ``c + 1`` than of any other
    marker, scattered among filler tokens."""

    def __init__(self, num_samples: int, min_len: int, max_len: int, vocab_size: int, num_classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.sequences: list[torch.Tensor] = []
        self.labels: list[int] = []
        first_filler = num_classes + 1
        for _ in range(num_samples):
            length = int(torch.randint(min_len, max_len + 1, (), generator=generator))
            tokens = torch.randint(first_filler, vocab_size, (length,), generator=generator)
            label = int(torch.randint(num_classes, (), generator=generator))
            winner = int(torch.randint(1, max(2, length // 4) + 1, (), generator=generator))
            counts = torch.randint(0, winner, (num_classes,), generator=generator)
            counts[label] = 0
            others = torch.repeat_interleave(torch.arange(1, num_classes + 1), counts)
            # The label's markers first, so that cutting to a short length keeps them.
            markers = torch.cat([torch.full((winner,), label + 1), others])[:length]
            positions = torch.randperm(length, generator=generator)[: markers.numel()]
            tokens[positions] = markers
            self.sequences.append(tokens)
            self.labels.append(label)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], self.labels[index]


def pad_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence of this batch: the batch shape changes every step."""
    sequences, labels = zip(*batch)
    tokens = pad_sequence(list(sequences), batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(s) for s in sequences])
    return tokens, lengths, torch.tensor(labels)


# -------------------------------------------------------------------------- model


class GRUClassifier(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        self.gru = nn.GRU(embed_dim, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.gru(self.embedding(tokens))
        # Mean over the real (non-padding) positions of each sequence.
        mask = (tokens != PAD).unsqueeze(-1).to(outputs.dtype)
        pooled = (outputs * mask).sum(dim=1) / lengths.unsqueeze(1).to(outputs.dtype)
        return self.head(pooled)


# ----------------------------------------------------------------------- training


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)

    dataset = MarkerSequences(args.num_samples, args.min_len, args.max_len, args.vocab_size, args.num_classes, args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        collate_fn=pad_collate,
        drop_last=False,
    )

    model = GRUClassifier(args.vocab_size, args.embed_dim, args.hidden, args.num_classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(
        f"seq_varlen: {len(dataset)} sequences of {args.min_len}-{args.max_len} tokens, "
        f"batch {args.batch_size} ({len(dataset) % args.batch_size or args.batch_size} in the last), device {device}"
    )

    model.train()
    step = 0
    total_loss = 0.0
    shapes: set[tuple[int, ...]] = set()
    start = time.perf_counter()
    while step < args.steps:
        for tokens, lengths, labels in loader:
            tokens = tokens.to(device)
            lengths = lengths.to(device)
            labels = labels.to(device)
            shapes.add(tuple(tokens.shape))

            logits = model(tokens, lengths)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            total_loss += float(loss)
            if step % args.log_every == 0 or step == args.steps:
                count = (step - 1) % args.log_every + 1  # steps since the last log line
                print(f"step {step}/{args.steps} loss {total_loss / count:.4f} batch shape {tuple(tokens.shape)}")
                total_loss = 0.0
            if step == args.steps:
                break

    elapsed = time.perf_counter() - start
    print(
        f"done: {args.steps} steps, final loss {loss.item():.4f}, {1000 * elapsed / args.steps:.1f} ms/step, "
        f"{len(shapes)} distinct batch shapes"
    )


if __name__ == "__main__":
    main()
