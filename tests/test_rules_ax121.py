"""AX121 (a recurrent cell stepped over a sequence known before the loop) beyond its
inline examples: cells found through the class that holds them, constructor arguments
and the assignment that reaches the loop; state unpacked after the call."""

from __future__ import annotations

from torchaxe.scan.engine import ScanOptions, scan_source

OPTIONS = ScanOptions(target="cuda", select=("AX121",))


def lines(source: str) -> list[int]:
    return sorted(f.line for f in scan_source(source, "m.py", OPTIONS).findings)


def test_cells_are_read_from_their_own_class_and_from_constructor_arguments():
    source = '''\
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 8)

    def forward(self, x, h, c):
        for t in range(x.size(1)):
            state = self.cell(x[:, t], (h, c))
            h = state[0]
            c = state[1]
        return h


class Wrapper(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x, h):
        outs = []
        for xt in reversed(x.unbind(1)):
            h = self.cell(xt, h)
            outs.append(h)
        return outs


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(8, 8)

    def forward(self, x, h):
        for t in range(4):
            h = self.cell(x[t])
        return h


w = Wrapper(nn.GRUCell(4, 8))
'''
    assert lines(source) == [11, 25]


def test_a_name_is_the_cell_its_last_assignment_before_the_loop_makes():
    source = '''\
import torch
import torch.nn as nn

rnn = nn.RNNCell(10, 20)
for i in range(6):
    hx = rnn(x[i], hx)
rnn = nn.LSTMCell(10, 20)
for i in range(6):
    hx, cx = rnn(x[i], (hx, cx))
rnn = torch.nn.Linear(3, 3)
for i in range(6):
    hx = rnn(x[i])
'''
    findings = scan_source(source, "m.py", OPTIONS).findings
    assert [(f.line, "nn.RNN" in f.message, "nn.LSTM" in f.message) for f in findings] == [
        (6, True, False), (9, False, True)]
    assert "cuDNN" in findings[0].message


def test_state_changed_between_steps_or_a_wrapper_of_unknown_cells_is_left_alone():
    source = '''\
import torch.nn as nn


class Zoneout(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x, h, c):
        for t in range(x.size(0)):
            state = self.cell(x[t], (h, c))
            h = state[0] * keep + h * (1 - keep)
            c = state[1]
        return h


z1 = Zoneout(nn.LSTMCell(4, 8))
z2 = Zoneout(make_cell())
'''
    assert lines(source) == []
