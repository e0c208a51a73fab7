"""Train a small GPT-style language model on synthetic tokens.

This script is DELIBERATELY UNTUNED. It is the kind of training code people write
by hand, and it exists so that torchaxe (``make demo``, the tests) has something real
to find on every axis. Do not "fix" it: the slow patterns are the point.

What is slow on purpose:

* a hand-written tanh GELU (``gelu_tanh``), a hand-written ``RMSNorm`` module and
  hand-written causal attention (``q @ k^T / sqrt(d)``, ``masked_fill``, softmax,
  ``@ v``) where fused operators exist; ``F.gelu`` is used by ``--mlp erf``;
* ``torch.optim.AdamW`` without ``fused=True``;
* ``optimizer.zero_grad(set_to_none=False)``, which writes zeros into every
  gradient each step instead of dropping them;
* a ``DataLoader`` with ``num_workers=0`` and no ``pin_memory``;
* ``batch.to(device)`` without ``non_blocking=True``;
* a ``torch.tensor(...)`` built on the host and copied ``.to(device)`` every step;
* ``loss.item()`` every step, which waits for the device to finish the step.

The data is a fixed random Markov chain over the vocabulary, so the loss goes down
and no network or download is needed. Everything is seeded.

Run it::

    python examples/gpt/train.py                      # tiny, CPU friendly
    python examples/gpt/train.py --steps 200 --d-model 512 --n-layers 8 --seq-len 512
    python examples/gpt/train.py --device cuda        # or npu (needs torch_npu)
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to run (default: 20)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--mlp", choices=("tanh", "erf"), default="tanh",
                        help="MLP activation: hand-written tanh GELU or F.gelu (erf)")
    parser.add_argument("--num-samples", type=int, default=2048, help="sequences in the synthetic dataset")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=5, help="print the running loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    args = parser.parse_args(argv)
    if args.d_model % args.n_heads:
        parser.error("--d-model must be divisible by --n-heads")
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


class MarkovTokens(Dataset):
    """Sequences drawn from a fixed random Markov chain: each token has a handful of
    likely successors, so next-token prediction is learnable but not trivial."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int, successors: int = 4):
        generator = torch.Generator().manual_seed(seed)
        table = torch.randint(vocab_size, (vocab_size, successors), generator=generator)
        tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (num_samples,), generator=generator)
        for t in range(1, seq_len + 1):
            choice = torch.randint(successors, (num_samples,), generator=generator)
            tokens[:, t] = table[tokens[:, t - 1], choice]
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        # seq_len + 1 tokens: the inputs and, shifted by one, the targets.
        return self.tokens[index]


# -------------------------------------------------------------------------- model


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, as in the original GPT-2 code."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_len: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # [batch, length, width] -> [batch, heads, length, head_dim]
        q = q.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = self.causal_mask[:length, :length]
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = weights @ v

        out = out.transpose(1, 2).contiguous().view(batch, length, width)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, d_model: int, activation: str):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        if self.activation == "tanh":
            hidden = gelu_tanh(hidden)
        else:
            hidden = F.gelu(hidden)
        return self.down(hidden)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_len: int, activation: str):
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len)
        self.norm2 = RMSNorm(d_model)
        self.mlp = MLP(d_model, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_len: int, activation: str):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, max_len, activation) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------- training


def infinite(loader: DataLoader):
    """Cycle over the loader for as many steps as asked, one epoch after another."""
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)

    dataset = MarkovTokens(args.num_samples, args.seq_len, args.vocab_size, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers, drop_last=True)

    model = GPT(args.vocab_size, args.d_model, args.n_layers, args.n_heads, args.seq_len, args.mlp).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"gpt: {n_params / 1e6:.2f}M parameters, batch {args.batch_size} x {args.seq_len} tokens, device {device}")

    model.train()
    running_loss = 0.0
    start = time.perf_counter()
    batches = infinite(loader)
    for step in range(1, args.steps + 1):
        batch = next(batches)
        batch = batch.to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]

        logits = model(inputs)
        # Mean over the tokens of the batch, normalised by a count built on the host.
        n_tokens = torch.tensor(targets.numel(), dtype=torch.float32).to(device)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), targets.reshape(-1), reduction="sum") / n_tokens

        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()

        running_loss += loss.item()
        if step % args.log_every == 0 or step == args.steps:
            count = (step - 1) % args.log_every + 1  # steps since the last log line
            print(f"step {step}/{args.steps} loss {running_loss / count:.4f}")
            running_loss = 0.0

    elapsed = time.perf_counter() - start
    final = loss.item()
    print(f"done: {args.steps} steps, final loss {final:.4f}, {1000 * elapsed / args.steps:.1f} ms/step")


if __name__ == "__main__":
    main()
