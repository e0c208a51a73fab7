"""Axis 4: bind every training process to the cores near its device.

- :mod:`torchaxe.bind.topology` reads sockets, NUMA nodes, cores, SMT siblings, L3
  groups, the allowed CPUs and the devices' nodes from sysfs (an injectable root);
- :mod:`torchaxe.bind.plan` makes a :class:`BindingPlan` for N local ranks;
- :mod:`torchaxe.bind.apply` and :mod:`torchaxe.bind.rank` apply one rank's part
  inside its process; :mod:`torchaxe.bind.launcher` wraps torchrun;
- :mod:`torchaxe.bind.check` measures whether a running process would gain;
- :mod:`torchaxe.bind.knob` is the trials' ``bind`` knob (one rank, bound in the
  bootstrap).

Nothing here imports torch at import time.
"""

from torchaxe.bind.plan import BindingPlan, RankBinding, plan_binding
from torchaxe.bind.topology import Topology, read_topology

__all__ = ["BindingPlan", "RankBinding", "Topology", "plan_binding", "read_topology"]
