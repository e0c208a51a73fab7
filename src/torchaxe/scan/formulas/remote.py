"""One evaluating process for a parallel scan.

Evaluating a candidate tree needs torch, and importing torch costs a worker about as
much CPU as scanning a hundred files. A parallel scan therefore starts one extra
process, the *evaluator*, next to its workers: a worker that meets trees it must
evaluate (and has not imported torch) sends them there and waits for the answer, so
torch is imported once per scan instead of once per worker, and only when some file
needs it. The evaluator starts importing torch at once, at low priority, so that the first
request does not wait for the import; a scan that never asks stops it unfinished.

Trees travel as JSON (no pickle): their nodes in ``walk`` order, each with its
operation, the positions of its arguments and its constant value; keys are rebuilt
as ``ir.Builder`` builds them and the root's key is checked on arrival. Answers are
the store's plain-data form (``store.encode``). Anything that goes wrong (a value
JSON cannot carry, a dead evaluator, a timeout) makes the worker evaluate locally.

Nothing here imports torch; the evaluator imports it on its first request.
"""

from __future__ import annotations

import json
import os
import queue
import sys
from typing import Any

from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk

#: Seconds a worker waits for an answer before it evaluates locally instead (the
#: evaluator's first answer includes the torch import).
TIMEOUT_S = 120.0


class Unencodable(ValueError):
    """A constant JSON cannot carry exactly."""


# ------------------------------------------------------------------ wire format
def _value_out(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["v", value]
    if isinstance(value, tuple):
        return ["t", [_value_out(v) for v in value]]
    if isinstance(value, complex):
        return ["c", value.real, value.imag]
    if value is Ellipsis:
        return ["e"]
    raise Unencodable(type(value).__name__)


def _value_in(data: list[Any]) -> Any:
    tag = data[0]
    if tag == "v":
        return data[1]
    if tag == "t":
        return tuple(_value_in(v) for v in data[1])
    if tag == "c":
        return complex(data[1], data[2])
    if tag == "e":
        return Ellipsis
    raise ValueError(f"unknown tag {tag!r}")


def tree_out(root: Node) -> list[Any]:
    """``root`` as plain data; raises Unencodable."""
    order = list(walk(root))
    index = {id(n): i for i, n in enumerate(order)}
    rows = []
    for n in order:
        value = _value_out(n.value) if n.op in (VAR, CONST) else None
        rows.append([n.op, [index[id(a)] for a in n.args], [[k, index[id(v)]] for k, v in n.kwargs], value])
    return [root.key, rows]


def tree_in(data: list[Any]) -> Node:
    """The tree ``tree_out`` wrote, with the same keys; ValueError when it differs."""
    root_key, rows = data
    nodes: list[Node] = []
    for op, args, kwargs, value in rows:
        arg_nodes = tuple(nodes[i] for i in args)
        kw_nodes = tuple((k, nodes[i]) for k, i in kwargs)
        if op == VAR:
            name = _value_in(value)
            nodes.append(Node(VAR, (), (), name, "$" + name))
        elif op == CONST:
            constant = _value_in(value)
            nodes.append(Node(CONST, (), (), constant, "#" + repr(constant)))
        else:
            parts = [a.key for a in arg_nodes] + [f"{k}={v.key}" for k, v in kw_nodes]
            nodes.append(Node(op, arg_nodes, kw_nodes, None, f"{op}({','.join(parts)})"))
    if not nodes or nodes[-1].key != root_key:
        raise ValueError("the tree changed on the way")
    return nodes[-1]


def request_out(trees: list[tuple[Node, dict[str, str]]], categories: frozenset[str]) -> str:
    """Raises Unencodable."""
    return json.dumps([sorted(categories), [[tree_out(node), roles] for node, roles in trees]],
                      separators=(",", ":"))


def request_in(text: str) -> tuple[list[tuple[Node, dict[str, str]]], frozenset[str]]:
    categories, trees = json.loads(text)
    return [(tree_in(t), roles) for t, roles in trees], frozenset(categories)


# ------------------------------------------------------------------ evaluator
def serve(requests: Any, answers: list[Any], parent: int, eager: bool = False) -> None:
    """The evaluator's loop: answer each request on its worker's queue until None,
    or until the scanning process is gone (killed before it could say stop).

    ``eager``: import torch now, at low priority, so that the first request does not
    wait for the import (the workers parse their first files meanwhile)."""
    if eager:
        try:
            os.nice(10)
            from torchaxe.scan.formulas.analysis import load_compute

            load_compute()
        except Exception:  # the first request will import it, or fail and say so
            pass
    while True:
        try:
            item = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if item is None:
            return
        slot, text = item
        try:
            from torchaxe.scan.formulas.analysis import load_compute
            from torchaxe.scan.formulas.store import encode

            compute = load_compute()
            trees, categories = request_in(text)
            entries = [encode(compute(node, roles, categories), node) for node, roles in trees]
            reply = json.dumps(["ok", entries], separators=(",", ":"))
        except Exception as exc:  # the worker evaluates locally instead
            reply = json.dumps(["error", f"{type(exc).__name__}: {exc}"])
        answers[slot].put(reply)


class Evaluator:
    """The parent's handle: starts the evaluator process, gives each worker its
    link, and stops the process at the end of the scan."""

    def __init__(self, context: Any, workers: int, eager: bool = False):
        self.requests = context.Queue()
        self.answers = [context.Queue() for _ in range(workers)]
        self.slots = context.Value("i", 0)
        self.process = context.Process(target=serve, args=(self.requests, self.answers, os.getpid(), eager), daemon=True,
                                       name="torchaxe-evaluator")
        self.process.start()

    def worker_args(self) -> tuple[Any, ...]:
        return (self.requests, self.answers, self.slots, self.process.pid)

    def close(self) -> None:
        try:
            self.requests.put(None)
            # An idle evaluator stops at once; one still importing torch for a scan
            # that never needed it is stopped rather than waited for.
            self.process.join(timeout=0.5)
        finally:
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
            for q in (self.requests, *self.answers):
                # Nothing left in them matters; never wait on a reader that is gone.
                q.cancel_join_thread()
                q.close()


# ------------------------------------------------------------------ worker side
class Link:
    """A worker's way to the evaluator."""

    def __init__(self, requests: Any, answers: list[Any], slot: int, evaluator: int):
        self.requests = requests
        self.answer = answers[slot]
        self.slot = slot
        self.evaluator = evaluator
        self.broken = False

    def _wait(self) -> str:
        """The next answer; queue.Empty when the evaluator died or took too long."""
        waited = 0.0
        while True:
            try:
                return self.answer.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if waited >= TIMEOUT_S or not _alive(self.evaluator):
                    raise

    def evaluate(self, trees: list[tuple[Node, dict[str, str]]], categories: frozenset[str]) -> list[list] | None:
        """The store entries of ``trees``, or None when the worker must evaluate them."""
        if self.broken:
            return None
        try:
            text = request_out(trees, categories)
        except (Unencodable, ValueError):
            return None
        self.requests.put((self.slot, text))
        try:
            status, entries = json.loads(self._wait())
        except (queue.Empty, ValueError, OSError, EOFError):
            # No answer, or a late one would come out of step: stop asking.
            self.broken = True
            return None
        if status != "ok" or len(entries) != len(trees):
            return None
        return entries


#: This process's link, set in scan workers only.
LINK: Link | None = None


def connect(requests: Any, answers: list[Any], slots: Any, evaluator: int) -> None:
    """Pool initializer: take the next free answer queue."""
    global LINK
    with slots.get_lock():
        slot = slots.value
        slots.value += 1
    LINK = Link(requests, answers, slot, evaluator) if slot < len(answers) else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by the
    scanning process, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def link() -> Link | None:
    """The link to use now: only in a worker that has not imported torch itself
    (one forked from a process that had torch evaluates at no import cost)."""
    if LINK is None or "torch" in sys.modules:
        return None
    return LINK
