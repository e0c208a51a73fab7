"""Axis 4: bind every training process to the cores near its device.

- :mod:`torchaxe.bind.topology` reads sockets, NUMA nodes, cores, SMT siblings, L3
  groups, the allowed CPUs and the devices' nodes from sysfs (an injectable root);
- :mod:`torchaxe.bind.plan` makes a :class:`BindingPlan` for N local ranks;
- :mod:`torchaxe.bind.apply` and :mod:`torchaxe.bind.rank` apply one rank's part
  inside its process; :mod:`torchaxe.bind.launcher` wraps torchrun;
- :mod:`torchaxe.bind.check` measures whether a running process would gain;
- :mod:`torchaxe.bind.knob` is the trials' ``bind`` knob (one rank, bound in the
  bootstrap).

Nothing here imports torch at import time, and importing the package imports none of
its modules: the names below load on first use (``torchaxe --help`` looks the
package up).
"""

from __future__ import annotations

from torchaxe.lazy import lazy_attributes

__all__ = ["BindingPlan", "RankBinding", "Topology", "plan_binding", "read_topology"]

__getattr__ = lazy_attributes(__name__, {
    "BindingPlan": "torchaxe.bind.plan",
    "RankBinding": "torchaxe.bind.plan",
    "plan_binding": "torchaxe.bind.plan",
    "Topology": "torchaxe.bind.topology",
    "read_topology": "torchaxe.bind.topology",
})
