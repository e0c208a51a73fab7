"""Measured runs of torchrun jobs: the command form, every rank measured and merged,
knobs applied in every rank, a rank that dies or hangs failing the run cleanly (no
process left behind), and the per-rank view of where a distributed step goes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil
import pytest

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.merge import merge_profiles
from torchaxe.runtime.profile import DistributedInfo, Profile, RunInfo, StepRecord
from torchaxe.runtime.ranks import distributed_view, job_steps, median_rows, rank_files, slowest_reason, with_measured_rows
from torchaxe.runtime.torchrun import failure_line, parse_job, verb_in_ranks

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "scripts" / "dist_faults.py"
DDP_EXAMPLE = ROOT / "examples" / "ddp" / "train.py"


# ------------------------------------------------------------------ the command form


def test_torchrun_command_is_taken_apart():
    job = parse_job(["torchrun", "--nproc-per-node", "2", "--standalone", "train.py", "--lr", "1"])
    assert job.distributed and job.torchrun == ("--nproc-per-node", "2", "--standalone")
    assert job.script_argv == ("python", "train.py", "--lr", "1")
    launched = job.launch(["torchaxe.runtime.bootstrap", "k.json", "--out", "p.json"])
    assert launched[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert launched[3:] == ["--nproc-per-node", "2", "--standalone", "--module", "torchaxe.runtime.bootstrap",
                            "k.json", "--out", "p.json", "--", "python", "train.py", "--lr", "1"]


def test_python_m_torch_distributed_run_and_modules():
    job = parse_job(["python", "-m", "torch.distributed.run", "--nnodes=2", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "host:29400", "-m", "pkg.train", "-v"])
    assert job.script_argv == ("python", "-m", "pkg.train", "-v")
    assert job.nnodes == 2 and job.option("--rdzv-endpoint") == "host:29400"
    assert parse_job(["torchrun", "--no-python", "python3", "t.py"]).script_argv == ("python3", "t.py")
    plain = parse_job(["python", "train.py"])
    assert not plain.distributed and plain.launch(["m", "a"])[-3:] == ["--", "python", "train.py"]


@pytest.mark.parametrize("argv, message", [
    (["torchrun", "--nproc-per-node", "2"], "no training script"),
    (["torchrun", "--frobnicate", "t.py"], "unknown option --frobnicate"),
    (["torchrun", "--no-python", "./run.sh"], "measures Python training scripts"),
    (["python", "-m", "torch.distributed.launch", "t.py"], "deprecated"),
])
def test_bad_torchrun_commands_are_one_line_errors(argv, message):
    with pytest.raises(TorchaxeError, match=message):
        parse_job(argv)


def test_a_verb_runs_itself_in_every_rank():
    command = ["torchrun", "--nproc-per-node", "2", "t.py", "--x"]
    argv = verb_in_ranks(["profile", "--steps", "3", "--", *command], command)
    assert argv[3:] == ["--nproc-per-node", "2", "--module", "torchaxe", "profile", "--steps", "3", "--",
                        "python", "t.py", "--x"]
    assert verb_in_ranks(["profile", "--", "python", "t.py"], ["python", "t.py"]) is None


TORCHRUN_FAILURE = """Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 10737)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_23:00:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 4 (pid: 10738)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_job_ends_with_one_line_naming_the_rank():
    line = failure_line("profile", 1, TORCHRUN_FAILURE)
    assert line == ("torchaxe profile: error: rank 1 (local rank 1) ended with exit code 4 "
                    "(the script exited with a non-zero code)")
    assert failure_line("shapes", 1, "no summary here") == "torchaxe shapes: error: torchrun exited with code 1"


@pytest.mark.slow
def test_profile_under_torchrun_ends_a_failed_job_with_one_line(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torchaxe", "profile", "--steps", "2", "--out",
                           str(tmp_path / "p.json"), "--", "torchrun", "--nproc-per-node", "2", "--standalone",
                           str(FAULTS), "--fault", "raise", "--fault-rank", "1", "--fault-step", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchaxe profile: error: rank 1 (local rank 1) ended with exit code 3"), last
    assert "(the script raised)" in last
    assert "broke at step 1" in proc.stderr  # the rank's own error is passed on as it came


# ------------------------------------------------------------------ ranks side by side


def _profile(rank: int, seconds: list[float], wait: float = 0.0, backward: float = 0.05, cpus: int = 4,
             exposed: float = 0.01) -> Profile:
    steps = [StepRecord(index=i + 1, seconds=s, data_wait_seconds=wait, backward_seconds=backward)
             for i, s in enumerate(seconds)]
    info = DistributedInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2, nnodes=1, host="h",
                           backend="gloo", cpus=cpus, comm_seconds_per_step=2 * exposed,
                           comm_exposed_seconds_per_step=exposed)
    return Profile(status="stopped", run=RunInfo(command=["t.py"], target="cpu", rank=rank, local_rank=rank,
                                                 world_size=2), steps=steps, distributed=info)


def test_a_job_step_is_the_slowest_ranks():
    job = job_steps({0: _profile(0, [0.10, 0.30, 0.10]), 1: _profile(1, [0.20, 0.10, 0.10], wait=0.05)})
    assert job.seconds == [0.20, 0.30, 0.10]
    assert job.slowest == [1, 0, 0]
    assert job.data_wait_seconds == [0.05, 0.0, 0.0]


def test_the_slowest_rank_is_named_with_its_reason():
    fast = _profile(0, [0.10] * 5)
    slow = _profile(1, [0.10] * 5, wait=0.04, backward=0.01, cpus=2)
    view = distributed_view({0: fast, 1: slow})
    assert view["world_size"] == 2 and view["backend"] == "gloo" and view["slowest_rank"] == 1
    assert "waits for data" in view["slowest_reason"] and "fewer CPUs" in view["slowest_reason"]
    rows = {r["rank"]: r for r in view["ranks"]}
    assert rows[0]["wait_for_slowest_seconds_per_step"] == pytest.approx(0.04)
    assert rows[1]["comm_exposed_seconds_per_step"] == pytest.approx(0.01)
    merged = median_rows([[{"rank": 0, "comm_exposed_seconds_per_step": 1.0}],
                          [{"rank": 0, "comm_exposed_seconds_per_step": 3.0}]])
    assert merged[0]["comm_exposed_seconds_per_step"] == 2.0 and merged[0]["runs"] == 2


def test_waiting_in_the_scripts_collectives_does_not_make_a_rank_the_slowest():
    # A per-step barrier (Lightning's logging, a loss all_reduce): rank 0 has less work
    # and waits 30 ms in it for rank 1; outside backward rank 0 looks the longer.
    waiter = _profile(0, [0.10] * 5, backward=0.05)
    worker = _profile(1, [0.10] * 5, backward=0.07)
    for step in waiter.steps:
        step.comm_seconds = 0.03
    for step in worker.steps:
        step.comm_seconds = 0.001
    view = distributed_view({0: waiter, 1: worker})
    assert view["slowest_rank"] == 1
    rows = {r["rank"]: r for r in view["ranks"]}
    assert rows[1]["own_work_seconds_median"] == pytest.approx(0.029)
    assert rows[0]["wait_for_slowest_seconds_per_step"] == pytest.approx(0.009)
    assert "outside backward and collectives (29.0 ms against 20.0 ms)" in view["slowest_reason"]
    close = _profile(1, [0.10] * 5, backward=0.0795)
    assert distributed_view({0: waiter, 1: close})["slowest_reason"].startswith(
        "only just: 0.50 ms a step longer outside backward and collectives than the others")
    report = merge_profiles([("p.rank0.json", waiter), ("p.rank1.json", worker)])
    assert report.slowest.rank == 1 and report.slowest_by == "outside_backward_seconds"
    assert report.to_dict()["steps"][0]["outside_backward_seconds"] == {"0": pytest.approx(0.02),
                                                                        "1": pytest.approx(0.029)}


def test_the_advices_rank_figures_come_from_the_originals_measured_runs():
    view = distributed_view({0: _profile(0, [0.10] * 5, backward=0.05), 1: _profile(1, [0.10] * 5, backward=0.06)})
    assert view["slowest_rank"] == 0
    # in the measured runs rank 1 did more of its own work: it is the one the others wait for
    runs = [[{"rank": 0, "step_seconds_median": 0.2, "own_work_seconds_median": 0.02},
             {"rank": 1, "step_seconds_median": 0.2, "own_work_seconds_median": 0.08}],
            [{"rank": 0, "step_seconds_median": 0.4, "own_work_seconds_median": 0.04},
             {"rank": 1, "step_seconds_median": 0.4, "own_work_seconds_median": 0.10}]]
    measured = with_measured_rows(view, runs)
    rows = {r["rank"]: r for r in measured["ranks"]}
    assert rows[0]["step_seconds_median"] == pytest.approx(0.3) and rows[0]["runs"] == 2
    assert rows[0]["host"] == "h" and rows[0]["cpus"] == 4  # what the runs do not measure is kept
    assert measured["slowest_rank"] == 1 and measured["ranks_source"] == "measured runs of the original"
    assert rows[0]["wait_for_slowest_seconds_per_step"] == pytest.approx(0.06)
    assert with_measured_rows(view, []) is view


def test_a_reason_tells_sub_millisecond_figures_apart():
    rows = [{"rank": 0, "compute_seconds_per_step": 0.00074}, {"rank": 1, "compute_seconds_per_step": 0.00066}]
    assert "(0.74 ms against 0.66 ms)" in slowest_reason(rows[0], rows)


def test_one_process_has_no_distributed_view(tmp_path):
    p = _profile(0, [0.1])
    p.distributed = None
    p.run.world_size = None
    assert distributed_view({0: p}) is None
    (tmp_path / "p.rank1.json").write_text("{}")
    (tmp_path / "p.rank0.json").write_text("{}")
    assert list(rank_files(tmp_path / "p.json")) == [0, 1]


def test_the_distributed_section_round_trips():
    p = _profile(1, [0.1, 0.2])
    p.distributed.ddp = {"bucket_cap_mb": 25.0, "find_unused_parameters": True}
    again = Profile.from_dict(json.loads(p.to_json()))
    assert again.distributed == p.distributed


# ------------------------------------------------------------------ real torchrun jobs (gloo, 2 ranks)


def _leftovers(marker: str) -> list[str]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if marker in line:
            out.append(line)
    return out


def _trial(tmp_path, args, knobs=None, timeout=60.0, steps=3):
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

    knob_set = knob_set_from_dict(knobs or {"name": "original"}, "test")
    command = ["torchrun", "--nproc-per-node", "2", "--standalone", str(FAULTS), *args]
    options = TrialOptions(repeats=1, steps=steps, warmup=1, timeout=timeout, target="cpu")
    return run_in_subprocess(knob_set, command, options, 1)


@pytest.mark.slow
def test_every_rank_is_measured_with_the_knobs_applied(tmp_path):
    note = tmp_path / "seen"
    note.mkdir()
    run = _trial(tmp_path, ["--note", str(note)], {"name": "k", "env": {"TORCHAXE_TEST_KNOB": "on"}})
    assert run.ok, run.error
    assert len(run.step_seconds) == 3
    assert sorted(p.name for p in note.iterdir()) == ["rank0.txt", "rank1.txt"]
    assert {p.read_text() for p in note.iterdir()} == {"on"}
    assert [r["rank"] for r in run.ranks] == [0, 1]
    assert all(r["comm_seconds_per_step"] is not None for r in run.ranks)


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_and_leaves_nothing(tmp_path):
    started = time.monotonic()
    run = _trial(tmp_path, ["--fault", "kill", "--fault-step", "3"])
    assert not run.ok
    assert "rank 1" in run.error or "exit" in run.error
    assert time.monotonic() - started < 90
    assert not _leftovers(str(FAULTS))


@pytest.mark.slow
def test_a_raising_rank_names_itself(tmp_path):
    run = _trial(tmp_path, ["--fault", "raise", "--fault-step", "2"])
    assert not run.ok
    assert run.error.startswith("rank 1: error:") and "broke at step 2" in run.error


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_at_the_timeout(tmp_path):
    started = time.monotonic()
    run = _trial(tmp_path, ["--fault", "hang", "--fault-step", "2"], timeout=8.0)
    elapsed = time.monotonic() - started
    assert not run.ok
    assert "timeout" in run.error
    assert elapsed < 8.0 + 20.0 + 30.0
    assert not _leftovers(str(FAULTS))


@pytest.mark.slow
def test_advise_under_torchrun_measures_no_sync_on_every_rank(tmp_path):
    """The DDP example end to end: the baseline profiled on both ranks, the per-rank
    breakdown in the advice, and AX601's fix (no all-reduce on the micro-batches
    before the last) measured as a torchrun job, cutting the exposed communication."""
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.advise.pipeline import advise

    command = ["torchrun", "--nproc-per-node", "2", "--standalone", str(DDP_EXAMPLE), "--steps", "200",
               "--width", "256"]
    options = AdviseOptions(budget=120, repeats=1, steps=3, warmup=1,
                            skip=("knob:", "env:", "code:AX2", "code:AX3", "code:AX4"))
    advice = advise(command, options)
    view = advice.distributed
    assert view is not None and view["world_size"] == 2 and view["backend"] == "gloo"
    assert [r["rank"] for r in view["ranks"]] == [0, 1]
    assert all(r["comm_exposed_seconds_per_step"] > 0 for r in view["ranks"])
    assert view["ddp"]["find_unused_parameters"] is True
    assert view["slowest_rank"] in (0, 1) and view["slowest_reason"]
    assert json.loads(advice.to_json())["distributed"]["ranks"][0]["host"]
    fix = next(r for r in advice.recommendations if r.key == "code:AX601")
    assert fix.status == "measured", (fix.status, fix.error)
    assert fix.axis == "distributed" and len(fix.ranks) == 2

    # Gradients cross once a step instead of once per micro-batch, on every rank. (How
    # much exposed communication that saves is benchmarks/distributed.py's to measure:
    # with other jobs on the cores, each rank's wait for the other swamps it.)
    assert [r["synced_backwards_per_step"] for r in view["ranks"]] == [4.0, 4.0]
    assert [r["synced_backwards_per_step"] for r in fix.ranks] == [1.0, 1.0]
    assert all(r["comm_exposed_seconds_per_step"] is not None for r in fix.ranks)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_rendezvous_through_torchruns_own_c10d(tmp_path):
    """Two torchrun agents on one machine (``--nnodes 2``, one process each, c10d on
    localhost), each started by its own `torchaxe trial` as it would be on its node:
    the same knob sets in the same order meet in the same rendezvous."""
    import subprocess

    port = _free_port()
    knobs = tmp_path / "original.json"
    knobs.write_text('{"name": "original"}')
    command = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "torchaxe-test", str(FAULTS), "--steps", "30"]
    argv = [sys.executable, "-m", "torchaxe", "trial", "--knobs", str(knobs), "--repeats", "1", "--steps", "3",
            "--warmup", "1", "--timeout", "90", "--json", "--", *command]
    nodes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for _ in range(2)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-2000:]
        report = json.loads(out)
        run = report["knob_sets"][0]["runs"][0]
        assert run["ok"], run["error"]
        assert len(run["ranks"]) == 1  # each node measured its own rank
    assert sorted(json.loads(out)["knob_sets"][0]["runs"][0]["ranks"][0]["rank"] for out, _ in outputs) == [0, 1]


@pytest.mark.slow
def test_advise_leads_a_follower_node(tmp_path):
    """Two nodes on one machine: `torchaxe advise` leads, `torchaxe follow` makes every
    run on the second node, and the advice sees both nodes' ranks."""
    import subprocess

    port = _free_port()
    command = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", str(FAULTS), "--steps", "200"]
    control = f"127.0.0.1:{_free_port()}"
    # Nothing to measure but the profile (every change skipped): the runs across nodes
    # are what is tested, and each costs a rendezvous of two torchrun agents.
    leader = subprocess.Popen([sys.executable, "-m", "torchaxe", "advise", "--budget", "70", "--repeats", "1",
                               "--steps", "3", "--warmup", "1", "--skip", "knob:", "--skip", "env:",
                               "--skip", "code:",
                               "--control", control, "--format", "json", "--", *command],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    follower = subprocess.Popen([sys.executable, "-m", "torchaxe", "follow", "--control", control, "--wait", "120",
                                 "--", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path)
    out, err = leader.communicate(timeout=400)
    f_out, f_err = follower.communicate(timeout=120)
    assert leader.returncode == 0, err[-3000:]
    assert follower.returncode == 0, f_err[-3000:]
    advice = json.loads(out)
    view = advice["distributed"]
    assert view["world_size"] == 2 and view["ranks_measured"] == 2 and view["nnodes"] == 2
    assert "the leader is done" in f_err


@pytest.mark.slow
def test_run_applies_the_knobs_in_every_rank_and_keeps_the_exit_code(tmp_path):
    """`torchaxe run -- torchrun ...`: the run table of torchaxe.toml in every rank, to
    the script's end, with the job's exit code."""
    import shutil
    import subprocess

    script = tmp_path / "train.py"
    shutil.copy(FAULTS, script)
    (tmp_path / "torchaxe.toml").write_text('[run.env]\nTORCHAXE_TEST_KNOB = "from-toml"\n')
    seen = tmp_path / "seen"
    seen.mkdir()
    base = [sys.executable, "-m", "torchaxe", "run", "--", "torchrun", "--nproc-per-node", "2", "--standalone",
            str(script), "--steps", "3", "--note", str(seen)]
    ok = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert {p.read_text() for p in seen.iterdir()} == {"from-toml"} and len(list(seen.iterdir())) == 2
    assert not _leftovers(str(script))


def test_thread_advice_counts_the_cores_each_local_rank_has():
    """Under torchrun the ranks of a node share its cores: OMP_NUM_THREADS=1 for each
    of 2 ranks on 2 cores is right, not "1 of 2 cores idle"."""
    from torchaxe.environment.checks import environment_checks
    from torchaxe.runtime.run_context import SPEED_VARIABLES

    assert "LOCAL_WORLD_SIZE" in SPEED_VARIABLES
    shared = {"allowed_cpus": 2, "env": {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}}
    assert environment_checks(shared, {}, [], "cpu")[1] == []
    alone = {"allowed_cpus": 2, "env": {"OMP_NUM_THREADS": "1"}}
    assert [c.key for c in environment_checks(alone, {}, [], "cpu")[1]] == ["env:OMP_NUM_THREADS"]
    crowded = {"allowed_cpus": 8, "env": {"OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "4"}}
    (c,) = environment_checks(crowded, {}, [], "cpu")[1]
    assert c.knobs == {"env": {"OMP_NUM_THREADS": "2"}} and "per rank" in c.rec.title


def test_run_exits_with_the_code_of_the_rank_that_failed(tmp_path):
    from torchaxe.advise.cli import _script_exit_code

    out = tmp_path / "p.json"
    (tmp_path / "p.rank0.json").write_text(json.dumps({"status": "stopped", "exit_code": None}))
    (tmp_path / "p.rank1.json").write_text(json.dumps({"status": "error", "exit_code": None}))
    assert _script_exit_code(out, 3) == 1
    (tmp_path / "p.rank1.json").write_text(json.dumps({"status": "exited", "exit_code": 7}))
    assert _script_exit_code(out, 4) == 7
    (tmp_path / "p.rank1.json").write_text(json.dumps({"status": "completed", "exit_code": None}))
    (tmp_path / "p.rank0.json").write_text(json.dumps({"status": "completed", "exit_code": None}))
    assert _script_exit_code(out, 0) == 0


def test_a_verdict_exits_0_in_the_ranks_only(monkeypatch):
    from torchaxe.runtime.torchrun import IN_RANKS, rank_exit_code

    monkeypatch.delenv(IN_RANKS, raising=False)
    assert rank_exit_code(1) == 1
    monkeypatch.setenv(IN_RANKS, "1")
    assert rank_exit_code(1) == 0 and rank_exit_code(3) == 3


@pytest.mark.slow
def test_data_under_torchrun_reports_every_rank_and_exits_0_on_a_verdict(tmp_path):
    """`torchaxe data -- torchrun ...`: each rank measures its loader; rank 0 prints
    the report, the other ranks their verdict in one labelled line (reports printed by
    every rank at once interleave), --out keeps each rank's; a data-bound verdict is
    no failed rank for torchrun."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-m", "torchaxe", "data", "--steps", "3", "--warmup", "1", "--out",
                           "data.json", "--", "torchrun", "--nproc-per-node", "2", "--standalone", str(DDP_EXAMPLE),
                           "--steps", "50", "--width", "128"], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("verdict:") == 1 and "rank        0 of 2" in done.stdout
    assert "torchaxe data [rank 1 of 2]: " in done.stderr
    assert "torchaxe data [rank 0]: running" in done.stderr
    for rank in (0, 1):
        assert json.loads((tmp_path / f"data.rank{rank}.json").read_text())["verdict"]["level"]
    assert "error" not in done.stderr.lower().replace("errors.html", "")


def test_a_nodes_cores_are_shared_by_its_local_ranks():
    from torchaxe.cpulist import cores_per_rank, local_ranks

    assert local_ranks({}) == 1 and local_ranks({"LOCAL_WORLD_SIZE": "x"}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert cores_per_rank(8, {"LOCAL_WORLD_SIZE": "4"}) == 2 and cores_per_rank(2, {"LOCAL_WORLD_SIZE": "8"}) == 1


def test_ranks_without_a_process_group_are_said_to_train_alone():
    """A script under torchrun that never sets up a process group: each rank trains
    its own copy, so no rank waits for another and there is no backend to name."""
    import io

    from torchaxe.advise.recommendation import Advice
    from torchaxe.report.advice_text import render_advice_text

    alone = [_profile(0, [0.10] * 5), _profile(1, [0.12] * 5)]
    for p in alone:
        p.distributed = None
    view = distributed_view({0: alone[0], 1: alone[1]})
    assert view["process_group"] is False and view["slowest_rank"] is None
    assert all(r["wait_for_slowest_seconds_per_step"] is None for r in view["ranks"])
    advice = Advice(command=["torchrun", "t.py"], target="cpu", budget_seconds=60.0, repeats=2, distributed=view)
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    text = out.getvalue()
    assert "backend ?" not in text and "waits for slowest" not in text and "slowest rank" not in text
    assert "the script sets up no process group: each rank trains its own copy of the model alone" in text
    grouped = distributed_view({0: _profile(0, [0.10] * 5), 1: _profile(1, [0.12] * 5)})
    assert grouped["process_group"] is True and grouped["slowest_rank"] is not None
