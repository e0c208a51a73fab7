"""Activations called through a module attribute (``self.act_fn(gate) * up``): found
when ``__init__`` sets the attribute once, unconditionally, to an activation named by a
constant; left alone when the choice is made at run time. Written the way Hugging Face
models (relative ``ACT2FN`` import), timm and hand-rolled MLPs write it."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...activations import ACT2FN
from transformers.activations import get_activation


class LlamaStyleMLP(nn.Module):  # formula: swiglu
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ModuleActivationGLU(nn.Module):  # formula: swiglu
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.fc1(x)
        x_gate, x_up = x.chunk(2, dim=-1)
        x = self.act(x_gate) * x_up
        return self.fc2(x)


class FunctionAttributeGLU(nn.Module):  # formula: swiglu
    def __init__(self):
        super().__init__()
        self.activation = F.silu

    def forward(self, gate, value):
        hidden = self.activation(gate)
        return hidden * value


class SwishByName(nn.Module):  # formula: swiglu
    def __init__(self, config):
        super().__init__()
        self.act = get_activation("swish")

    def forward(self, hidden_states):
        gate, up = self.wi(hidden_states).split(self.d_ff, dim=-1)
        return self.wo(self.act(gate) * up)


class ConfiguredMLP(nn.Module):  # formula: swiglu
    """The activation comes from the config (Llama's says "silu"): reported as advice,
    SwiGLU when the configuration chooses silu."""

    def __init__(self, config):
        super().__init__()
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SigmoidModuleSiLU(nn.Module):  # formula: silu
    def __init__(self):
        super().__init__()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        return x * self.sigmoid(x)


# ----------------------------------------------------------------------- look-alikes
class ConfiguredMLPWithoutGate(nn.Module):  # lookalike: swiglu
    """The activation comes from the config, but nothing gates it: no SwiGLU whatever it is."""

    def __init__(self, config):
        super().__init__()
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * 0.5)


class LayerArgumentGLU(nn.Module):  # lookalike: swiglu
    """timm's ``act_layer=nn.SiLU``: the caller may pass anything."""

    def __init__(self, act_layer=nn.SiLU):
        super().__init__()
        self.act = act_layer()

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return self.act(a) * b


class GeGLUModule(nn.Module):  # lookalike: swiglu
    def __init__(self):
        super().__init__()
        self.act = nn.GELU()

    def forward(self, gate, up):
        return self.act(gate) * up


class SwitchedActivation(nn.Module):  # lookalike: swiglu
    """Set in two places: which one runs depends on the config."""

    def __init__(self, use_silu):
        super().__init__()
        if use_silu:
            self.act = nn.SiLU()
        else:
            self.act = nn.ReLU()

    def forward(self, gate, up):
        return self.act(gate) * up


class ReassignedActivation(nn.Module):  # lookalike: swiglu
    def __init__(self):
        super().__init__()
        self.act = nn.SiLU()

    def use_relu(self):
        self.act = nn.ReLU()

    def forward(self, gate, up):
        return self.act(gate) * up


class TanhApproximationGLU(nn.Module):  # lookalike: swiglu
    def __init__(self):
        super().__init__()
        self.act = ACT2FN["gelu_new"]

    def forward(self, gate, up):
        return self.act(gate) * up


class SigmoidOfOtherInput(nn.Module):  # lookalike: silu
    def __init__(self):
        super().__init__()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x, y):
        return x * self.sigmoid(y)
