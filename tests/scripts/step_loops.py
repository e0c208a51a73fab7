"""Training loops whose steps torchaxe must find, one per mode:

    python step_loops.py MODE [ITERATIONS [SLEEP]]

- ``sgd``: hand-written SGD, as pytorch/examples' word_language_model does it
  (``model.zero_grad()``, ``clip_grad_norm_``, ``p.data.add_(p.grad, alpha=-lr)``),
  sleeping SLEEP seconds (default 0) an iteration;
- ``nograd``: ``p -= lr * p.grad`` under ``torch.no_grad()``, then ``p.grad.zero_()``;
- ``accumulate``: no optimizer, 4 micro-batches from a DataLoader per update;
- ``gan``: a generator and a discriminator, each with its own ``torch.optim.Adam``;
- ``gan-by-hand``: the same two models updated by hand;
- ``subclass``: an optimizer class whose ``step()`` calls its parent's (``SGD``,
  whose ``step()`` an earlier plain ``SGD`` had torch hook too);
- ``lbfgs``: ``torch.optim.LBFGS`` whose closure runs several backward passes a step;
- ``recursive``: no training, a function that calls itself once an iteration (the
  test marks it with ``--step-marker``);
- ``never``: backward passes whose gradients are never cleared, nor the parameters
  updated (no training step), for much longer than a test waits; it catches
  ``KeyboardInterrupt`` and goes on, as word_language_model does.

Each prints ``updates N`` at the end: the parameter updates it made.
"""

import sys
import time

import torch
from torch import nn

MODE = sys.argv[1]
ITERATIONS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
SLEEP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
LR = 0.05

torch.manual_seed(0)
x = torch.randn(16, 8)
y = torch.randn(16, 1)


def mlp(inputs: int = 8, outputs: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, outputs))


updates = 0
if MODE == "sgd":
    model = mlp()
    for _ in range(ITERATIONS):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
        updates += 1
        time.sleep(SLEEP)
elif MODE == "nograd":
    w = torch.zeros(8, 1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    for _ in range(ITERATIONS):
        loss = ((x @ w + b - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in (w, b):
                p -= LR * p.grad
                p.grad.zero_()
        updates += 1
elif MODE == "accumulate":
    from torch.utils.data import DataLoader, TensorDataset

    model = mlp()
    loader = DataLoader(TensorDataset(torch.randn(4 * ITERATIONS * 4, 8), torch.randn(4 * ITERATIONS * 4, 1)),
                        batch_size=4)
    for i, (xb, yb) in enumerate(loader, 1):
        (nn.functional.mse_loss(model(xb), yb) / 4).backward()
        if i % 4 == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
            model.zero_grad(set_to_none=True)
            updates += 1
elif MODE == "subclass":
    class ClippedSGD(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                nn.utils.clip_grad_norm_(group["params"], 0.25)
            return super().step(closure)

    model = mlp()
    torch.optim.SGD(mlp().parameters(), lr=LR)
    optimizer = ClippedSGD(model.parameters(), lr=LR)
    for _ in range(ITERATIONS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        updates += 1
elif MODE in ("gan", "gan-by-hand"):
    generator, discriminator = mlp(4, 8), mlp(8, 1)
    by_hand = MODE == "gan-by-hand"
    if not by_hand:
        opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)

    def update(model: nn.Module, optimizer) -> None:
        if optimizer is not None:
            optimizer.step()
            return
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad

    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(ITERATIONS):
        fake = generator(torch.randn(16, 4))
        discriminator.zero_grad()
        d_loss = bce(discriminator(x), torch.ones(16, 1)) + bce(discriminator(fake.detach()), torch.zeros(16, 1))
        d_loss.backward()
        update(discriminator, None if by_hand else opt_d)
        generator.zero_grad()
        g_loss = bce(discriminator(fake), torch.ones(16, 1))  # also accumulates into the discriminator
        g_loss.backward()
        update(generator, None if by_hand else opt_g)
        updates += 1
elif MODE == "lbfgs":
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=5)
    evaluations = 0

    def closure():
        global evaluations
        evaluations += 1
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(ITERATIONS):
        optimizer.step(closure)
        updates += 1
    print(f"closure evaluations {evaluations}")
elif MODE == "recursive":
    # A function that calls itself, as word_language_model's repackage_hidden does.
    def repackage(h):
        if isinstance(h, torch.Tensor):
            return h.detach()
        return tuple(repackage(v) for v in h)

    model = mlp()
    hidden = ((torch.zeros(2), torch.zeros(2)), (torch.zeros(2), torch.zeros(2)))
    for _ in range(ITERATIONS):
        hidden = repackage(hidden)
        model(x)
        updates += 1
elif MODE == "never":
    model = mlp()
    try:
        for _ in range(100_000):
            nn.functional.mse_loss(model(x), y).backward()
            time.sleep(0.01)
    except KeyboardInterrupt:
        print("exiting from training early")
    for _ in range(100_000):
        model(x)
        time.sleep(0.01)
else:
    sys.exit(f"unknown mode {MODE}")
print(f"updates {updates}")
