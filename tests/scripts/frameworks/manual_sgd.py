"""Train a small two-layer LSTM language model with SGD written by hand (no
``torch.optim``): ``p -= lr * p.grad`` after each backward pass, as many research
loops do.

Each step prints ``step N: loss X, time Y ms``.

    python manual_sgd.py --steps 200
"""

import argparse
import time

import torch
from torch import nn


class LanguageModel(nn.Module):
    def __init__(self, vocab_size, width):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        hidden, _ = self.rnn(self.embed(tokens))
        return self.out(hidden)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    vocab_size = 256
    model = LanguageModel(vocab_size, 128)
    stream = torch.randint(0, vocab_size, (args.batch_size, args.steps * args.seq_len + 1))
    criterion = nn.CrossEntropyLoss()
    model.train()
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        start = (step - 1) * args.seq_len
        tokens = stream[:, start:start + args.seq_len]
        targets = stream[:, start + 1:start + args.seq_len + 1]
        model.zero_grad()
        loss = criterion(model(tokens).reshape(-1, vocab_size), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for p in model.parameters():
                p -= args.lr * p.grad
        print(f"step {step}: loss {loss.item():.4f}, time {(time.perf_counter() - started) * 1e3:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
