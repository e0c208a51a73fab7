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


def test_a_method_that_steps_the_cell_once_is_followed_to_the_loop_that_calls_it():
    source = '''\
import torch.nn as nn


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTMCell(4, 8)
        self.prenet = nn.Linear(4, 4)

    def step(self, t, frames, h, c):
        inp = frames[:, t]
        inp = self.prenet(inp)
        h, c = self.rnn(inp, (h, c))
        return h, c

    def forward(self, frames, h, c):
        for t in range(frames.size(1)):
            h, c = self.step(t, frames, h, c)
        return h

    def feedback(self, y, h, c):
        h, c = self.rnn(y, (h, c))
        return h, c

    def generate(self, y, h, c):
        for _ in range(10):
            h, c = self.feedback(y, h, c)
            y = h[:, :4]
        return y
'''
    # ``feedback`` is called with the previous step's output: left alone.
    assert lines(source) == [13]


def test_a_helper_whose_input_is_the_state_or_that_no_loop_calls_is_left_alone():
    source = '''\
import torch.nn as nn

cell = nn.GRUCell(8, 8)


def mix(h, x):
    h = cell(h, x)
    return h


def once(x, h):
    h = cell(x, h)
    return h


def run(x, h):
    for t in range(x.size(0)):
        h = mix(h, x[t])
    return once(x[0], h)
'''
    assert lines(source) == []


def test_a_cell_passed_through_parameters_and_closures_is_followed():
    source = '''\
import torch.nn as nn


def test_rnn():
    def simple_rnn(x, h0, cell):
        h = h0
        for xt in x.unbind(1):
            h = cell(xt, h)
        return h

    def make(cell):
        def inner(x, h0):
            return simple_rnn(x, h0, cell)
        return inner

    make(nn.RNNCell(2, 2))


def not_a_cell(x, h, layer):
    for xt in x.unbind(1):
        h = layer(xt, h)
    return h


not_a_cell(x, h, nn.Bilinear(2, 2, 2))
'''
    assert lines(source) == [8]


def test_a_package_that_wraps_torch_layers_under_the_name_nn_counts():
    source = '''\
import nni.nas.nn.pytorch.layers as nn
from mypackage.recurrent import LSTMCell


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTMCell(1, 8)
        self.own = LSTMCell(1, 8)

    def forward(self, x, h, c, g, d):
        for x_t in x.chunk(x.size(1), dim=1):
            h, c = self.lstm(x_t, (h, c))
            g, d = self.own(x_t, (g, d))
        return h, g
'''
    assert lines(source) == [13]


def test_cells_of_a_module_list_stepped_layer_by_layer_inside_a_time_loop():
    """fairseq's LASER decoder: stacked cells in a ModuleList (built by a factory
    function of the file), each layer's state in a list; an input fed back from the
    last step (the LSTM decoder's input feeding) is left alone."""
    source = '''\
import torch
import torch.nn as nn


def LSTMCell(input_size, hidden_size):
    m = nn.LSTMCell(input_size, hidden_size)
    for name, param in m.named_parameters():
        param.data.uniform_(-0.1, 0.1)
    return m


class Decoder(nn.Module):
    def __init__(self, n, size):
        super().__init__()
        self.layers = nn.ModuleList([LSTMCell(size, size) for _ in range(n)])

    def forward(self, x, sentemb, hs, cs):
        for j in range(x.size(0)):
            input = torch.cat((x[j], sentemb), dim=1)
            for i, rnn in enumerate(self.layers):
                hidden, cell = rnn(input, (hs[i], cs[i]))
                input = hidden
                hs[i] = hidden
                cs[i] = cell
        return hidden

    def feeding(self, x, hs, cs, feed):
        for j in range(x.size(0)):
            input = torch.cat((x[j], feed), dim=1)
            for i, rnn in enumerate(self.layers):
                hidden, cell = rnn(input, (hs[i], cs[i]))
                input = hidden
                hs[i] = hidden
                cs[i] = cell
            feed = attend(hidden)
        return hidden
'''
    assert lines(source) == [21]


def test_a_model_chosen_between_a_recurrent_and_a_plain_class_is_read_as_the_recurrent_one():
    # Lizhi-sjtu's QMIX: ``Q_network_RNN`` or ``Q_network_MLP`` by a flag; the loop over
    # the episode's steps only runs with the recurrent one.
    source = (
        "import torch.nn as nn\n"
        "class RNN(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.rnn = nn.GRUCell(8, 8)\n        self.rnn_hidden = None\n"
        "    def forward(self, x):\n        self.rnn_hidden = self.rnn(x, self.rnn_hidden)\n"
        "        return self.rnn_hidden\n"
        "class MLP(nn.Module):\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
        "class Agent:\n"
        "    def __init__(self, use_rnn):\n"
        "        if use_rnn:\n            self.q = RNN()\n        else:\n            self.q = MLP()\n"
        "    def train(self, inputs, steps, opt):\n"
        "        outs = []\n"
        "        for t in range(steps):\n"
        "            outs.append(self.q(inputs[:, t]))\n"
        "        loss = sum(o.sum() for o in outs)\n"
        "        loss.backward()\n"
        "        opt.step()\n"
    )
    findings = scan_source(source, "q.py", ScanOptions(target="cuda", select=("AX121",))).findings
    assert [(f.code, f.line) for f in findings] == [("AX121", 22)]
    assert "RNN's nn.GRUCell once per call" in findings[0].message
