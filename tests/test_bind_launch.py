"""`torchaxe launch` (torchrun + per-rank binding) and `torchaxe bind --rank-from-env`.

The launch test is the issue's measure: 2 local ranks on this 2-core machine, each
rank's Cpus_allowed_list and thread count read from /proc while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchaxe.bind import launcher
from torchaxe.cpulist import format_cpulist, parse_cpulist
from torchaxe.errors import TorchaxeError

REPO = Path(__file__).resolve().parents[1]
TREES = REPO / "tests" / "data" / "sysfs"
TORCHAXE = [sys.executable, "-m", "torchaxe"]
TWO_CPUS = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


def env(**extra):
    e = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        e.pop(var, None)
    e.update(extra)
    return e


def expected_rank(nproc: int, local_rank: int, loader_cores=None):
    """What the plan gives a rank on this machine (the launcher makes the same one)."""
    from torchaxe.bind.plan import plan_binding
    from torchaxe.bind.topology import read_topology

    return plan_binding(read_topology("/"), nproc, loader_cores=loader_cores, environ=env()).ranks[local_rank]


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


# ------------------------------------------------------------- argument split


def test_split_args_separates_torchaxe_torchrun_and_script():
    a = launcher.split_args(["--nproc-per-node", "2", "--bind", "node", "--standalone", "--cpus=0-1",
                             "--cpus", "2-3", "train.py", "--bind", "x", "--lr", "1"])
    assert a.own == {"cpus": ["0-1", "2-3"], "bind": "node"}
    assert a.torchrun == ["--nproc-per-node", "2", "--standalone"]
    assert a.script == "train.py" and a.script_args == ["--bind", "x", "--lr", "1"]
    m = launcher.split_args(["-m", "--nnodes=1", "pkg.train", "-v"])
    assert m.how == "module" and m.torchrun == ["--nnodes=1"] and m.script == "pkg.train"
    x = launcher.split_args(["--no-python", "--", "./run.sh", "a"])
    assert x.how == "exec" and x.script == "./run.sh" and x.script_args == ["a"]


@pytest.mark.parametrize("tokens, message", [
    (["--nproc-per-node", "2"], "no training script"),
    (["--numa-binding", "node", "t.py"], "use torchaxe's --bind"),
    (["--frobnicate", "t.py"], "unknown option --frobnicate"),
    (["--bind"], "--bind needs a value"),
    (["--bind", "node", "--bind", "socket", "t.py"], "given twice"),
])
def test_split_args_errors(tokens, message):
    with pytest.raises(TorchaxeError, match=message):
        launcher.split_args(tokens)


def test_command_puts_the_rank_bootstrap_in_front():
    a = launcher.split_args(["--nproc-per-node", "2", "-m", "pkg.train", "--x"])
    cmd = launcher.torchrun_command(a, "/tmp/p.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nproc-per-node", "2", "--module", "torchaxe.bind.rank", "--plan", "/tmp/p.json",
                       "--module", "--", "pkg.train", "--x"]
    assert launcher.torchrun_command(a, None)[3:] == ["--nproc-per-node", "2", "--module", "pkg.train", "--x"]


def test_dry_run_json_plan_and_command(capsys):
    from torchaxe.cli import main

    code = main(["launch", "--dry-run", "--json", "--sysfs-root", str(TREES / "xeon-2s-smt"), "--target", "cuda",
                 "--nproc-per-node", "4", "train.py", "--epochs", "1"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "exclusive" and data["nproc"] == 4 and data["device_kind"] == "cuda"
    assert [r["nodes"] for r in data["ranks"]] == [[0], [0], [1], [1]]
    assert data["command"][-3:] == ["train.py", "--epochs", "1"]


def test_dry_run_table(capsys):
    from torchaxe.cli import main

    assert main(["launch", "--dry-run", "--bind", "core-complex", "--sysfs-root", str(TREES / "epyc-2s-nps2"),
                 "--nproc-per-node", "2", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "binding plan: mode core-complex" in out and "would run:" in out and "torchaxe.bind.rank" in out


@pytest.mark.parametrize("argv, message", [
    (["launch", "--bind", "numa", "t.py"], "--bind 'numa'"),
    (["launch", "--nproc-per-node", "two", "t.py"], "--nproc-per-node two"),
    (["launch", "--json", "--nproc-per-node", "1", "t.py"], "use it with --dry-run"),
    (["launch", "--dry-run", "--cpus", "0-1", "--cpus", "2", "--nproc-per-node", "1", "t.py"], "gives 2 CPU list"),
    (["bind", "--", "python", "t.py"], "--rank-from-env"),
    (["bind", "check"], "give a process id"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    from torchaxe.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_launch_help(capsys):
    from torchaxe.cli import main

    assert main(["launch", "--help"]) == 0
    assert "--bind MODE" in capsys.readouterr().out
    assert main(["bind", "--help"]) == 0
    assert "bind check" in capsys.readouterr().out
    assert main(["bind", "check", "--help"]) == 0
    assert "--duration" in capsys.readouterr().out


# ------------------------------------------------------------- real runs

PROBE = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.randn(128, 128)
    for _ in range(3):
        x = (x @ x).tanh()
    out = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    with open(os.path.join(out, f"rank{rank}.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "torch_threads": torch.get_num_threads()}, f)
    os.replace(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
    deadline = time.time() + 90
    while not os.path.exists(os.path.join(out, "go")) and time.time() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CPUS, reason="needs 2 CPUs")
def test_launch_two_ranks_and_read_their_binding_from_proc(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    from torchaxe.bind.plan import plan_binding
    from torchaxe.bind.topology import read_topology

    # the plan `torchaxe launch` makes for this machine (its --dry-run --json is tested above)
    plan = plan_binding(read_topology("/"), 2, environ=env()).to_dict()
    run = subprocess.Popen([*TORCHAXE, "launch", "--nproc-per-node", "2", "--standalone", str(script), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=tmp_path)
    try:
        deadline = time.time() + 150
        while time.time() < deadline and not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
            assert run.poll() is None, run.communicate()[1]
            time.sleep(0.1)
        seen = {}
        for r in (0, 1):
            info = json.loads((tmp_path / f"rank{r}.json").read_text())
            status = proc_status(info["pid"])
            planned = plan["ranks"][r]
            assert parse_cpulist(status["Cpus_allowed_list"]) == tuple(planned["compute_cpus"])
            # every thread of the rank (OpenMP, gloo, ...) inherited the mask
            for task in Path(f"/proc/{info['pid']}/task").iterdir():
                mask = proc_status_task(task)
                if mask is not None:
                    assert set(mask) <= set(planned["compute_cpus"])
            environ = Path(f"/proc/{info['pid']}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={planned['threads']}".encode() in environ
            assert info["torch_threads"] == planned["threads"]
            assert int(status["Threads"]) >= planned["threads"]
            seen[r] = parse_cpulist(status["Cpus_allowed_list"])
        assert not set(seen[0]) & set(seen[1])  # no core shared
        if len(os.sched_getaffinity(0)) == 2:
            assert seen[0] == (0,) and seen[1] == (1,)  # this 2-core machine: one core each
    finally:
        (tmp_path / "go").write_text("")
        out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "torchaxe launch: running:" in err and "torchaxe.bind.rank" in err
    for r in (0, 1):
        assert f"local rank {r} (" in err
        assert f"CPUs {format_cpulist(plan['ranks'][r]['compute_cpus'])} (node" in err
    assert "Setting OMP_NUM_THREADS" not in err  # torchrun's banner: the plan sets it per rank


def proc_status_task(task: Path):
    try:
        text = (task / "status").read_text()
    except OSError:
        return None  # the thread ended
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1])
    return None


LOADER = textwrap.dedent("""
    import json, os
    import torch
    from torch.utils.data import DataLoader, Dataset

    class D(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, i):
            return torch.tensor(sorted(os.sched_getaffinity(0)) + [int(os.environ.get("MINE", "0"))])

    def mine(worker_id):
        os.environ["MINE"] = "7"

    rows = [b[0].tolist() for b in DataLoader(D(), batch_size=1, num_workers=1, worker_init_fn=mine)]
    print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "workers": rows, "threads": torch.get_num_threads()}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CPUS, reason="needs 2 CPUs")
def test_loader_workers_get_their_own_core(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    done = subprocess.run([*TORCHAXE, "launch", "--nproc-per-node", "1", "--loader-cores", "1", "--standalone",
                           str(script)], capture_output=True, text=True, env=env(), timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rank = expected_rank(1, 0, loader_cores=1)
    assert result["main"] == list(rank.compute_cpus) and result["threads"] == rank.threads
    # pinned to the loader core(s), and the script's own worker_init_fn still ran
    assert result["workers"] == [[*rank.loader_cpus, 7]] * 2
    if len(os.sched_getaffinity(0)) == 2:
        assert result["main"] == [0] and result["workers"] == [[1, 7], [1, 7]]


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CPUS, reason="needs 2 CPUs")
def test_bind_rank_from_env_python_and_exec(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, json; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), "
                      "'omp': os.environ.get('OMP_NUM_THREADS')}))\n")
    done = subprocess.run([*TORCHAXE, "bind", "--rank-from-env", "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=env(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"), timeout=60)
    assert done.returncode == 0, done.stderr
    rank = expected_rank(2, 1)
    assert json.loads(done.stdout) == {"cpus": list(rank.compute_cpus), "omp": str(rank.threads)}
    assert "local rank 1 (" in done.stderr
    # Open MPI's variables, a non-Python command (exec'd), and a user's OMP_NUM_THREADS kept
    done = subprocess.run([*TORCHAXE, "bind", "--rank-from-env", "--", "grep", "-E", "Cpus_allowed_list|^Name",
                           "/proc/self/status"], capture_output=True, text=True, timeout=60,
                          env=env(OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2", OMP_NUM_THREADS="2"))
    assert done.returncode == 0, done.stderr
    assert "Name:\tgrep" in done.stdout
    assert f"Cpus_allowed_list:\t{format_cpulist(expected_rank(2, 0).compute_cpus)}\n" in done.stdout
    assert "OMP_NUM_THREADS=2 is set in your environment and kept" in done.stderr


def test_bind_rank_from_env_errors(capsys, monkeypatch):
    from torchaxe.cli import main

    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["bind", "--rank-from-env", "--", "true"]) == 2
    assert "no local rank in the environment" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert main(["bind", "--rank-from-env", "--", "true"]) == 2
    assert "give --nproc" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3)")
    assert main(["bind", "--rank-from-env", "--", "true"]) == 2
    assert "local rank 3 but only 2 local ranks" in capsys.readouterr().err


def test_local_size_from_slurm_forms():
    from torchaxe.bind.apply import local_rank_from_env, local_size_from_env

    assert local_size_from_env({"SLURM_TASKS_PER_NODE": "4(x2)"}) == (4, "SLURM_TASKS_PER_NODE")
    assert local_size_from_env({"SLURM_TASKS_PER_NODE": "4(x2),3"}) is None
    assert local_rank_from_env({"MPI_LOCALRANKID": "5"}) == (5, "MPI_LOCALRANKID")
    assert local_rank_from_env({}) is None


def test_rank_bootstrap_refuses_a_missing_plan(capsys):
    from torchaxe.bind.rank import main

    assert main(["--plan", "/nonexistent/plan.json", "--", "t.py"]) == 2
    assert "binding plan /nonexistent/plan.json not found" in capsys.readouterr().err
    assert main(["t.py"]) == 2


def test_apply_binding_falls_back_when_the_kernel_refuses(monkeypatch):
    from torchaxe.bind.apply import apply_binding
    from torchaxe.bind.plan import plan_binding
    from torchaxe.bind.topology import read_topology

    plan = plan_binding(read_topology(TREES / "xeon-2s-smt", environ={}), 4, environ={})
    warnings = []
    environ = {}
    calls = []

    def refuse(pid, cpus):
        calls.append(cpus)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    done = apply_binding(plan, plan.ranks[3], environ=environ, warn=warnings.append)
    assert calls and done["affinity"] is None
    assert environ == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert "cannot bind to CPUs" in warnings[0] and "running unbound" in warnings[0]


# ------------------------------------------------------------- the trial knob


def test_bind_knob_is_validated():
    from torchaxe.runtime.knobs import KnobError, knob_set_from_dict

    k = knob_set_from_dict({"bind": {"mode": "node", "loader_cores": 1}}, "k.json")
    assert k.bind.mode == "node" and k.to_dict()["bind"] == {"mode": "node", "loader_cores": 1}
    assert knob_set_from_dict({"bind": True}, "k.json").bind.mode == "exclusive"
    for bad, message in [({"bind": {"mode": "numa"}}, "bind.mode"), ({"bind": {"cpus": "x"}}, "bind.cpus"),
                         ({"bind": {"loader_cores": -1}}, "bind.loader_cores"), ({"bind": {"nproc": 2}}, "bind.nproc"),
                         ({"bind": True, "cpu_affinity": [0]}, "give one of them"), ({"bind": 3}, "bind")]:
        with pytest.raises(KnobError, match=message):
            knob_set_from_dict(bad, "k.json")


TRAIN_WITH_LOADER = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class D(Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.tensor([float(min(os.sched_getaffinity(0))), float(len(os.sched_getaffinity(0)))])

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for batch in DataLoader(D(), batch_size=2, num_workers=1):
        seen.append(batch[0].tolist())
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()
        with open(sys.argv[1], "w") as f:
            json.dump({"main": sorted(os.sched_getaffinity(0)), "workers": seen,
                       "threads": torch.get_num_threads()}, f)
""")


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CPUS, reason="needs 2 CPUs")
def test_trial_bootstrap_applies_the_bind_knob(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_LOADER)
    knobs = tmp_path / "bound.json"
    knobs.write_text(json.dumps({"name": "bound", "bind": {"mode": "exclusive", "loader_cores": 1}}))
    seen, profile = tmp_path / "seen.json", tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out", str(profile),
                           "--steps", "2", "--warmup", "0", "--target", "cpu", "--", "python", str(script), str(seen)],
                          capture_output=True, text=True, env=env(), timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(seen.read_text())
    rank = expected_rank(1, 0, loader_cores=1)
    assert result["main"] == list(rank.compute_cpus) and result["threads"] == rank.threads
    loader = [float(min(rank.loader_cpus)), float(len(rank.loader_cpus))]
    assert result["workers"] and all(w == loader for w in result["workers"])
    applied = json.loads(profile.read_text())["run"]["options"]["knobs"]["bind"]
    assert applied["compute_cpus"] == list(rank.compute_cpus) and applied["loader_cpus"] == list(rank.loader_cpus)
    assert applied["affinity"] == list(rank.compute_cpus)
    assert applied["env"] == {"OMP_NUM_THREADS": str(rank.threads), "MKL_NUM_THREADS": str(rank.threads)}
    if len(os.sched_getaffinity(0)) == 2:
        assert result["main"] == [0] and loader == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.skipif(not TWO_CPUS, reason="needs 2 CPUs")
def test_bind_knob_under_torchrun_takes_its_local_ranks_part(tmp_path):
    """Each rank of a torchrun job (LOCAL_RANK of LOCAL_WORLD_SIZE) is bound as the
    node's plan gives that rank, not to the whole node."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_LOADER)
    knobs = tmp_path / "bound.json"
    knobs.write_text(json.dumps({"name": "bound", "bind": {"mode": "exclusive"}}))
    seen, profile = tmp_path / "seen.json", tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out", str(profile),
                           "--steps", "2", "--warmup", "0", "--target", "cpu", "--", "python", str(script), str(seen)],
                          capture_output=True, text=True, env=env(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"),
                          timeout=180)
    assert done.returncode == 0, done.stderr
    rank = expected_rank(2, 1)
    assert json.loads(seen.read_text())["main"] == list(rank.compute_cpus)
    assert json.loads(profile.read_text())["run"]["options"]["knobs"]["bind"]["cpus"] == list(rank.cpus)


def test_bind_candidates_share_the_node_between_local_ranks():
    from torchaxe.bind.candidates import candidates

    one = candidates({}, "cpu", {"allowed_cpus": 8, "num_threads": 4})
    assert [c.key for c in one] == ["knob:threads", "knob:bind"] and one[0].knobs["torch"]["num_threads"] == 8
    ranks = candidates({}, "cpu", {"allowed_cpus": 8, "num_threads": 2, "env": {"LOCAL_WORLD_SIZE": "4"}})
    assert [c.key for c in ranks] == ["knob:bind"] and "4 local ranks" in ranks[0].rec.title
    crowded = candidates({}, "cpu", {"allowed_cpus": 4, "num_threads": 1, "env": {"LOCAL_WORLD_SIZE": "8"}})
    assert "knob:bind" not in [c.key for c in crowded]


def test_rank_from_env_plans_over_the_cgroup_not_the_launchers_mask(tmp_path):
    import shutil

    from torchaxe.bind.cli import widen_to_cgroup
    from torchaxe.bind.topology import read_topology

    root = tmp_path / "x"
    shutil.copytree(TREES / "xeon-2s-smt", root)
    (root / "proc/self/status").write_text("Cpus_allowed_list:\t20-39\n")  # mpirun bound this rank to a socket
    t = read_topology(root, environ={})
    assert t.allowed == tuple(range(20, 40))
    widen_to_cgroup(t)
    assert t.allowed == tuple(range(80))
    assert any("bound to 20-39 by its launcher" in w for w in t.warnings)
