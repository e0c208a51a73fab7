"""A small training script with a hand-written tanh GELU, for the advise tests.

ADVISE_WIDTH sets the hidden width (default 64): at a few thousand the GELU, eight
elementwise passes forward and more backward, dominates the step, so that its fused
replacement is measurably faster however noisy the machine. ADVISE_NO_STEP=1 trains
without an optimizer (no step can be detected)."""

import math
import os

import torch
from torch import nn
import torch.nn.functional as F

WIDTH = int(os.environ.get("ADVISE_WIDTH", "64"))


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, WIDTH)
        self.down = nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.down(gelu(self.up(x)))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(256, 16)
y = torch.randint(0, 4, (256,))
for step in range(200):
    loss = F.cross_entropy(model(x), y)
    if os.environ.get("ADVISE_NO_STEP"):
        loss.backward()
        continue
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"done: loss {loss.item():.4f}")
