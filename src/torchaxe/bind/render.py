"""Text tables (rich) for topologies, binding plans and binding checks."""

from __future__ import annotations

from typing import TextIO

from torchaxe.bind.plan import BindingPlan
from torchaxe.bind.topology import Topology
from torchaxe.cpulist import format_cpulist


def text_console(out: TextIO):
    """A rich console for the bind reports on ``out``: colour only on a terminal."""
    from rich.console import Console

    color = hasattr(out, "isatty") and out.isatty()
    return Console(file=out, width=140, no_color=not color, highlight=False, soft_wrap=False,
                   force_terminal=False if not color else None)


def text_table(*columns: str):
    """A plain rich table with these columns, as every bind report draws them."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in columns:
        table.add_column(c, overflow="fold")
    return table


def render_topology(topo: Topology, out: TextIO) -> None:
    console = text_console(out)
    cores = len(topo.cores)
    cpus = len(topo.cpus)
    console.print(f"topology: {len(topo.sockets)} socket(s), {len(topo.nodes)} NUMA node(s), {cores} physical cores, "
                  f"{cpus} CPUs ({'SMT on' if topo.smt else 'no SMT'}), {len(topo.l3_groups)} L3 group(s)"
                  f"{'' if topo.root == '/' else f'  [read from {topo.root}]'}")
    allowed = set(topo.allowed)
    console.print(f"allowed CPUs: {format_cpulist(topo.allowed)} ({len(topo.allowed)} of {cpus}; affinity "
                  f"{format_cpulist(topo.affinity)}, cgroup cpuset "
                  f"{format_cpulist(topo.cgroup_cpus) if topo.cgroup_cpus is not None else 'none'})")
    table = text_table("node", "socket", "CPUs", "cores", "allowed", "L3 groups", "distances", "devices")
    for node in topo.nodes:
        node_cores = [c for c in topo.cores if c.node == node.id]
        groups = sorted({c.l3 for c in node_cores if c.l3 is not None})
        devices = [f"{d.kind}:{d.index}" for d in topo.devices if d.numa_node == node.id]
        table.add_row(str(node.id), str(node.socket), format_cpulist(node.cpus), str(len(node_cores)),
                      format_cpulist(c for c in node.cpus if c in allowed) or "-",
                      " ".join(format_cpulist(topo.l3_groups[g]) for g in groups) or "?",
                      " ".join(map(str, node.distances)) if node.distances else "?",
                      " ".join(devices) or "-")
    console.print(table)
    if topo.devices:
        dtable = text_table("device", "PCI", "node", "source", "note")
        for d in topo.devices:
            dtable.add_row(f"{d.kind}:{d.index}", d.pci or "?", "unknown" if d.numa_node is None else str(d.numa_node),
                           d.source, d.note or "")
        console.print(dtable)
    else:
        console.print("devices: none found (CPU only)")
    for w in topo.warnings:
        console.print(f"warning: {w}")


def render_plan(plan: BindingPlan, out: TextIO) -> None:
    console = text_console(out)
    console.print(f"binding plan: mode {plan.mode}, {plan.nproc} local rank(s), {plan.device_kind}"
                  f", allowed CPUs {format_cpulist(plan.allowed)}")
    table = text_table("rank", "device", "dev node", "CPUs", "nodes", "compute CPUs", "loader CPUs", "threads")
    for r in plan.ranks:
        device = f"{plan.device_kind}:{r.device}" if r.device is not None else "-"
        table.add_row(str(r.local_rank), device, "-" if r.device_node is None else str(r.device_node),
                      format_cpulist(r.cpus), ",".join(map(str, plan.rank_nodes(r))),
                      format_cpulist(r.compute_cpus), format_cpulist(r.loader_cpus) or "(shared)",
                      "-" if r.threads is None else str(r.threads))
    console.print(table)
    for var, value in plan.user_env.items():
        console.print(f"kept: {var}={value} (set by you)")
    for n in plan.notes:
        console.print(f"note: {n}")
    for w in plan.warnings:
        console.print(f"warning: {w}")
