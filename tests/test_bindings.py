"""The value a name holds at a line, as every rule that follows a name reads it
(``scan.rules._bindings.reaching``): the last assignment when it always runs before the
line, every candidate when a branch may skip it, nothing when a loop, ``with`` or
``+=`` binds the name; and the rules that rely on it."""

from __future__ import annotations

import ast

from torchaxe.scan.context import FileContext
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.rules._bindings import reaching


def values(source: str, name: str, line: int) -> list[str] | None:
    tree = ast.parse(source)
    ctx = FileContext(path="m.py", source=source, tree=tree, target="cuda")
    scope = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    found = reaching(name, scope, line, ctx)
    return None if found is None else [ast.unparse(b.value) for b in found]


BODY = '''\
def f(a, c, xs):
    p = a
    if c:
        p = a + 1
    q = p
    for x in xs:
        p = x * 2
        r = p
    with open(a) as p2:
        s = a - 1
    t = s
    s += 1
    u = s
    v, w = a, c
    z = v
'''


def test_the_last_assignment_alone_when_it_always_runs_before_the_line():
    assert values(BODY, "p", 8) == ["x * 2"]  # same loop body, after the assignment
    assert values(BODY, "s", 11) == ["a - 1"]  # assigned inside a ``with``, read after it
    assert values(BODY, "v", 15) == ["(a, c)"]


def test_every_assignment_when_a_branch_may_skip_the_last():
    assert values(BODY, "p", 5) == ["a", "a + 1"]


def test_nothing_is_read_through_loops_or_with_and_augmented_assignments_read_as_operations():
    assert values(BODY, "x", 8) is None
    assert values(BODY, "p2", 10) is None
    assert values(BODY, "s", 13) == ["s + 1"]  # ``s += 1``: the name before it, plus one
    assert values(BODY, "a", 3) == []  # a parameter: nothing in the function binds it


def test_rules_read_names_the_same_way():
    # AX703: the sigmoid assigned in the loop body is what the loss reads, though
    # another value was assigned before the loop.
    bce = '''\
import torch
import torch.nn.functional as F


def train(model, loader, opt):
    p = None
    for x, y in loader:
        p = torch.sigmoid(model(x))
        loss = F.binary_cross_entropy(p, y)
        loss.backward()
        opt.step()
'''
    found = scan_source(bce, "m.py", ScanOptions(target="cuda", select=("AX703",))).findings
    assert [f.line for f in found] == [9]
    # AX122: a log-softmax rebound by unpacking a tuple is no longer the log-softmax.
    xent = '''\
import torch
import torch.nn.functional as F


def loss(x, y, head):
    p = F.softmax(x, dim=-1)
    p, extra = head(p)
    return -torch.log(p.gather(1, y.unsqueeze(1))).mean()


def plain(x, y):
    p = F.softmax(x, dim=-1)
    return -torch.log(p.gather(1, y.unsqueeze(1))).mean()
'''
    found = scan_source(xent, "m.py", ScanOptions(target="npu", select=("AX122",))).findings
    assert [f.line for f in found] == [13]
