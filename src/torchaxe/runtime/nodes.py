"""Measured runs across nodes: one node leads, the others follow.

A multi-node torchrun job is one torchrun agent per node, meeting in torchrun's own
rendezvous (``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``). When
``torchaxe advise`` measures such a job, every run it makes (the profile, each arm of
each round) must be started on every node at the same time, under the same knobs.
So ``advise`` runs on one node (the leader) and ``torchaxe follow`` with the same
command on each of the others:

    node 0:  torchaxe advise -- torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint node0:29400 train.py
    node 1:  torchaxe follow -- torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint node0:29400 train.py

They talk through a key-value store (``torch.distributed.TCPStore``) that the leader
opens on the rendezvous host at the rendezvous port + 1 (``--control HOST:PORT``
chooses another). For each run the leader posts ``run/N``: the knob set and the
bootstrap's options; each follower starts its torchrun agent with them, and when it
ends posts ``result/N/F``: its ranks' profiles, its exit code and the tail of its
stderr. The leader waits for every follower's result and reads their ranks with its
own, as if all ranks had run on one node. ``run/N`` of kind ``done`` ends the
followers. Nothing is pickled: every value is JSON.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from torchaxe.errors import TorchaxeError

#: How long the leader waits for its followers to join, and a follower for the next run.
JOIN_SECONDS = 600.0
#: How often a waiting side looks at the store.
POLL_SECONDS = 0.2
#: Beyond a run's own limit, how long the leader waits for a follower's result.
RESULT_GRACE_SECONDS = 60.0


def control_endpoint(job: Any, given: str | None = None) -> tuple[str, int]:
    """Where the leader's store listens: ``given`` (HOST:PORT), else the rendezvous
    endpoint's host at its port + 1."""
    text = given
    if text is None:
        endpoint = job.option("--rdzv-endpoint", "--rdzv_endpoint")
        if not endpoint:
            raise TorchaxeError("a multi-node job needs torchrun's --rdzv-endpoint HOST:PORT (or give --control "
                                "HOST:PORT for torchaxe's own coordination)")
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            host, port = endpoint, "29400"  # torchrun's default port
        return host, int(port) + 1
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise TorchaxeError(f"--control {text}: expected HOST:PORT")
    return host, int(port)


def _store(host: str, port: int, leader: bool, timeout: float):
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, None, leader, timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as exc:  # RuntimeError / DistNetworkError: the address is taken or unreachable
        role = "open" if leader else "reach"
        raise TorchaxeError(f"cannot {role} torchaxe's coordination store at {host}:{port}: "
                            f"{str(exc).splitlines()[0]}") from None


def _wait(store: Any, key: str, seconds: float, what: str) -> bytes:
    deadline = time.monotonic() + seconds
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TorchaxeError(f"{what}: nothing after {seconds:.0f} s")
            time.sleep(POLL_SECONDS)
        return store.get(key)
    except TorchaxeError:
        raise
    except Exception as exc:  # DistNetworkError: the other side closed the store
        raise TorchaxeError(f"{what}: the connection to the leading node was lost "
                            f"({str(exc).splitlines()[0]})") from None


class Leader:
    """The node that decides: announces each run and gathers the followers' ranks."""

    def __init__(self, job: Any, control: str | None = None, join_seconds: float = JOIN_SECONDS) -> None:
        self.job = job
        self.followers = job.nnodes - 1
        self.host, self.port = control_endpoint(job, control)
        self.join_seconds = join_seconds
        self.store: Any = None
        self.runs = 0

    def start(self, progress: Callable[[str], None]) -> None:
        self.store = _store("0.0.0.0", self.port, True, self.join_seconds)
        progress(f"waiting for {self.followers} follower node(s) at {self.host}:{self.port}: run `torchaxe follow -- "
                 f"{' '.join(self.job.typed)}` on each of the other nodes")
        deadline = time.monotonic() + self.join_seconds
        while int(self.store.add("joined", 0)) < self.followers:
            if time.monotonic() > deadline:
                raise TorchaxeError(f"{int(self.store.add('joined', 0))} of {self.followers} follower node(s) joined "
                                    f"within {self.join_seconds:.0f} s: start `torchaxe follow` on the other nodes")
            time.sleep(POLL_SECONDS)

    def announce(self, message: dict[str, Any]) -> int:
        """Post one run to every follower; returns its number."""
        self.runs += 1
        self.store.set(f"run/{self.runs}", json.dumps({"kind": "run", **message}))
        return self.runs

    def collect(self, run: int, out: Path, seconds: float) -> list[str]:
        """The followers' profiles of run ``run``, written beside the leader's own as
        ``OUT.rankN.json``; returns the failures the followers reported (one line each)."""
        from torchaxe.runtime.profile import rank_path

        problems = []
        for follower in range(1, self.followers + 1):
            try:
                raw = _wait(self.store, f"result/{run}/{follower}", seconds, f"follower {follower}")
            except TorchaxeError as exc:
                problems.append(str(exc))
                continue
            result = json.loads(raw)
            for rank, text in (result.get("profiles") or {}).items():
                rank_path(out, int(rank), 2).write_text(text, encoding="utf-8")
            if result.get("returncode") and not result.get("profiles"):
                problems.append(f"follower {follower} ({result.get('host')}): torchrun exited with code "
                                f"{result['returncode']}: {result.get('error') or ''}".rstrip(": "))
        return problems

    def finish(self, seconds: float = 15.0) -> None:
        """Tell the followers that the runs are over, and give them a moment to read it
        before the store closes with this process."""
        if self.store is None:
            return
        self.store.set(f"run/{self.runs + 1}", json.dumps({"kind": "done"}))
        deadline = time.monotonic() + seconds
        while int(self.store.add("left", 0)) < self.followers and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)


_ACTIVE: list[Leader] = []


def active() -> Leader | None:
    """The leader of the measured runs in progress, if they span nodes."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def leading(job: Any, progress: Callable[[str], None], control: str | None = None) -> Iterator[Leader | None]:
    """Lead the followers for the runs made inside (nothing for a one-node job)."""
    if job.torchrun is None or job.nnodes <= 1:
        yield None
        return
    leader = Leader(job, control)
    leader.start(progress)
    _ACTIVE.append(leader)
    try:
        yield leader
    finally:
        _ACTIVE.remove(leader)
        leader.finish()


def follow(job: Any, run: Callable[[dict[str, Any]], dict[str, Any]], progress: Callable[[str], None],
           control: str | None = None, wait_seconds: float = JOIN_SECONDS) -> int:
    """A follower's loop: join, then make each run the leader posts with ``run`` (which
    returns the result to post) until the leader is done. Returns the runs made."""
    import socket

    host, port = control_endpoint(job, control)
    deadline = time.monotonic() + wait_seconds
    while True:  # the leader may not be up yet
        try:
            store = _store(host, port, False, 30.0)
            break
        except TorchaxeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    me = int(store.add("joined", 1))
    progress(f"joined {host}:{port} as follower {me}")
    made = 0
    while True:
        message = json.loads(_wait(store, f"run/{made + 1}", wait_seconds, "the leader posted no run"))
        if message.get("kind") == "done":
            store.add("left", 1)
            progress(f"the leader is done after {made} run(s)")
            return made
        made += 1
        progress(f"run {made}: {message.get('label') or message.get('knobs', {}).get('name')}")
        result = run(message)
        result["host"] = socket.gethostname()
        store.set(f"result/{made}/{me}", json.dumps(result))
