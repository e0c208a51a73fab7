"""Distributed tuning with two CPU ranks (gloo): shares split, results all-gathered,
the same choices applied everywhere."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "tune_dist.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_split_the_subgraphs_and_apply_the_same_choices(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert r0["world"] == r1["world"] == 2
    # Each rank measured its own share, the shares are disjoint and cover all four layers.
    assert r0["measured"] and r1["measured"]
    assert not set(r0["measured"]) & set(r1["measured"])
    everything = set(r0["measured"]) | set(r1["measured"])
    assert len(everything) == 4
    assert sorted(r0["statuses"].values()).count("remote") == 2
    # Every rank's own file holds every record after the exchange.
    assert set(r0["stored"]) == set(r1["stored"]) == everything
    # The same choices, applied the same way, on both ranks.
    assert r0["choices"] == r1["choices"]
    assert r0["applied"] == r1["applied"]
    assert r0["compiled"] == r1["compiled"]
