"""`torchaxe profile` and `torchaxe profile merge` on the command line: argument forms,
exit codes, what reaches stderr. Most tests call the CLI in-process; the ones marked
slow start real processes (the console entry, Ctrl-C, torchrun with two ranks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from profile_support import EXAMPLES, PRELUDE, ROOT, TINY_GPT, write_script
from torchaxe.cli import main
from torchaxe.runtime.command import parse_command
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.profile import load_profile

LOOP = PRELUDE + "for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):\n    step()\n"


@pytest.fixture
def script(tmp_path):
    return write_script(tmp_path, LOOP)


def test_profile_writes_the_profile_and_a_summary(tmp_path, script, capsys):
    out = tmp_path / "p.json"
    code = main(["profile", "--steps", "2", "--warmup", "1", "--target", "cpu", "-o", str(out), "--", "python",
                 str(script)])
    err = capsys.readouterr().err
    assert code == 0, err
    profile = load_profile(out)
    assert profile.status == "stopped" and len(profile.steps) == 3
    assert "torchaxe profile: stopped: stopped after 2 measured steps" in err
    assert "step time   median" in err and f"profile written to {out}" in err


def test_arguments_after_the_script_belong_to_it_even_without_double_dash(tmp_path, script, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--steps", "all", "-o", str(out), "python", str(script), "4"]) == 0, capsys.readouterr().err
    profile = load_profile(out)
    assert profile.status == "completed" and len(profile.steps) == 4
    assert profile.run.command == ["python", str(script), "4"]


def test_script_options_that_look_like_ours_go_to_the_script(tmp_path, capsys):
    path = write_script(tmp_path, PRELUDE + "assert sys.argv[1:] == ['--steps', '3', '--out', 'x'], sys.argv\nstep()\n")
    out = tmp_path / "p.json"
    assert main(["profile", "--steps", "all", "-o", str(out), "--", str(path), "--steps", "3", "--out", "x"]) == 0, \
        capsys.readouterr().err
    assert load_profile(out).status == "completed"


def test_a_script_called_merge_is_still_a_script(tmp_path, capsys):
    path = write_script(tmp_path, LOOP, name="merge.py")
    out = tmp_path / "p.json"
    monkey_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["profile", "--steps", "1", "--warmup", "0", "-o", str(out), "merge.py"]) == 0
        assert main(["profile", "--steps", "1", "--warmup", "0", "-o", str(out), "--", "python", "merge.py"]) == 0
    finally:
        os.chdir(monkey_cwd)
    assert load_profile(out).status == "stopped"
    assert path.exists()


def test_help_lists_merge_and_the_exit_codes(capsys):
    assert main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    assert "merge" in text and "Exit codes" in text and "--step-marker" in text and "--timeout" in text
    assert main(["profile", "merge", "--help"]) == 0
    assert "slowest rank" in capsys.readouterr().out


def test_profile_is_listed_by_torchaxe_help(capsys):
    assert main(["--help"]) == 0
    assert "profile" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["profile"], "nothing to run"),
    (["profile", "--steps", "zero", "--", "python", "x.py"], "is not a number of steps"),
    (["profile", "--steps", "0", "--", "python", "x.py"], "is not a positive number"),
    (["profile", "--timeout", "-1", "--", "python", "x.py"], "--timeout"),
    (["profile", "--", "python", "definitely_missing_script.py"], "script not found: definitely_missing_script.py"),
    (["profile", "--", "python", "-m", "definitely_missing_module_xyz"], "no module of that name"),
    (["profile", "--", "python", "-c", "print(1)"], "python -c is not supported"),
    (["profile", "--", "torchrun", "--nproc-per-node", "2", "no_such_train.py"], "script not found"),
    (["profile", "--step-marker", "nocolon", "--", "python", "x.py"], "expected MODULE:FUNCTION"),
    (["profile", "-o", "/no/such/folder/p.json", "--", "python", "x.py"], "does not exist"),
    (["profile", "merge"], "Missing argument"),
    (["profile", "--", "sh", "x.py"], "sh is not a Python script: torchaxe runs Python training commands"),
    (["profile", "--", "/bin/sh"], "/bin/sh is not a Python script"),  # a binary given as the script
    # A misspelt interpreter is not a missing script.
    (["profile", "--", "pyhton", "x.py"], "pyhton: no such script or program (did you mean `python`?)"),
    (["profile", "--", "train", "x.py"], "train: no such script or program: torchaxe runs `python train.py`"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("pass\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_script_error_shows_the_users_traceback_and_exits_3(tmp_path, capsys):
    message = "diverged\\n\\tat step 3\\n\\tloss nan"
    path = write_script(tmp_path, PRELUDE + f"step()\nstep()\nraise RuntimeError('{message}')\n")
    out = tmp_path / "p.json"
    assert main(["profile", "-o", str(out), "--", "python", str(path)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert str(path) in err and "RuntimeError: diverged" in err
    assert "torchaxe/" not in err.split("torchaxe profile:")[0]  # no torchaxe frames in the user's traceback
    # The summary is one line: the message's first line (all of it is in the traceback).
    summary = next(line for line in err.splitlines() if line.startswith("torchaxe profile: error:"))
    assert summary.startswith("torchaxe profile: error: the script raised RuntimeError at")
    assert ": diverged ...; " in summary and "loss nan" not in err.split("torchaxe profile:")[1]
    profile = load_profile(out)
    assert profile.status == "error" and len(profile.steps) == 2 and profile.error.message.startswith("diverged\n")


def test_script_exit_code_is_reported(tmp_path, capsys):
    path = write_script(tmp_path, PRELUDE + "step()\nsys.exit(7)\n")
    out = tmp_path / "p.json"
    assert main(["profile", "-o", str(out), "--", "python", str(path)]) == 4
    assert load_profile(out).exit_code == 7
    assert "sys.exit(7)" in capsys.readouterr().err


def test_no_steps_exits_6(tmp_path, capsys):
    path = write_script(tmp_path, "print('no training here')\n")
    assert main(["profile", "-o", str(tmp_path / "p.json"), "--", "python", str(path)]) == 6
    assert "--step-marker" in capsys.readouterr().err


def test_merge_prints_the_ranks_and_writes_json(tmp_path, capsys):
    from test_profile_model import make_profile
    from torchaxe.runtime.profile import save_profile

    a = save_profile(make_profile(seconds=(1, 0.1, 0.1, 0.1), rank=0, world=2), tmp_path / "p.rank0.json")
    b = save_profile(make_profile(seconds=(1, 0.2, 0.2, 0.2), rank=1, world=2), tmp_path / "p.rank1.json")
    out = tmp_path / "merged.json"
    assert main(["profile", "merge", str(a), str(b), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 of 2 ranks" in text and "slowest rank 1: median step time 200.0 ms" in text
    assert json.loads(out.read_text())["slowest_rank"] == 1
    assert main(["profile", "merge", "--format", "json", str(a), str(b)]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "torchaxe.profile-merge/1"


def test_merge_of_a_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "torchaxe.profile/9"}')
    assert main(["profile", "merge", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "from a newer torchaxe" in err and str(bad) in err


@pytest.mark.parametrize("argv, kind, target, args", [
    (["python", "t.py", "a"], "path", "t.py", ("a",)),
    (["python3", "-u", "t.py"], "path", "t.py", ()),
    (["/usr/bin/python3.11", "t.py", "-m", "x"], "path", "t.py", ("-m", "x")),
    (["t.py", "--lr", "1"], "path", "t.py", ("--lr", "1")),
    (["python", "-m", "pkg.train", "--x"], "module", "pkg.train", ("--x",)),
    (["python", "-mpkg.train"], "module", "pkg.train", ()),
    (["-m", "pkg.train", "1"], "module", "pkg.train", ("1",)),
])
def test_command_forms(tmp_path, monkeypatch, argv, kind, target, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("pass\n")
    command = parse_command(argv)
    assert (command.kind, command.target, command.args) == (kind, target, args)
    assert command.typed == tuple(argv)


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to run"),
    (["python"], "no script after `python`"),
    (["python", "-X", "dev", "t.py"], "python option -X is not supported"),
    (["python", "-"], "stdin"),
    (["python", "-m"], "-m needs a module name"),
    (["--weird"], "expected a script"),
    (["folder"], "is a folder without __main__.py"),
])
def test_bad_command_forms(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(TorchaxeError, match=message):
        parse_command(argv)


# ------------------------------------------------------------ real processes


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCHAXE_DEBUG", None)
    return env


@pytest.mark.slow
def test_console_entry_on_the_gpt_example(tmp_path):
    out = tmp_path / "gpt.json"
    done = subprocess.run(
        [sys.executable, "-m", "torchaxe", "profile", "--steps", "3", "--warmup", "1", "--ops", "--ops-steps", "1",
         "--shapes", "-o", str(out), "--", "python", str(EXAMPLES / "gpt" / "train.py"), *TINY_GPT],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpt: ")
    assert "ops         top by host self time over step 2:" in done.stderr
    assert "shapes      static" in done.stderr
    profile = load_profile(out)
    assert profile.status == "stopped" and profile.summary.steps_measured == 3 and profile.ops


@pytest.mark.slow
def test_timeout_of_a_script_that_ignores_interrupts_still_writes_a_profile(tmp_path):
    path = write_script(tmp_path, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + PRELUDE + """
import time
step(); step()
time.sleep(120)
""")
    out = tmp_path / "p.json"
    started = time.monotonic()
    # 8 s: on a loaded machine the script's imports alone can take several seconds, and
    # the two steps must come before the timeout.
    done = subprocess.run([sys.executable, "-m", "torchaxe", "profile", "--timeout", "8", "-o", str(out), "--",
                           "python", str(path)], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 5, done.stderr
    assert time.monotonic() - started < 60
    profile = load_profile(out)
    assert profile.status == "timeout" and len(profile.steps) == 2
    assert "did not stop within" in profile.detail


@pytest.mark.slow
def test_ctrl_c_from_outside(tmp_path):
    ready = tmp_path / "ready"
    path = write_script(tmp_path, PRELUDE + f"""
import time
for i in range(100000):
    step()
    if i == 3:
        open({str(ready)!r}, "w").close()
    time.sleep(0.01)
""")
    out = tmp_path / "p.json"
    proc = subprocess.Popen([sys.executable, "-m", "torchaxe", "profile", "--steps", "all", "-o", str(out), "--",
                             "python", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "not ready"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    profile = load_profile(out)
    assert profile.status == "interrupted" and len(profile.steps) >= 4
    assert "interrupted" in err


@pytest.mark.slow
def test_two_ranks_under_torchrun_and_merge(tmp_path):
    out = tmp_path / "ddp.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "torchaxe", "profile", "--steps", "4", "--warmup", "1", "-o", str(out), "--",
         "python", str(ROOT / "tests" / "scripts" / "ddp_train.py"), "--slow-rank-sleep", "0.05"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(tmp_path.glob("ddp.rank*.json"))
    assert [f.name for f in files] == ["ddp.rank0.json", "ddp.rank1.json"]
    profiles = [load_profile(f) for f in files]
    assert [(p.run.rank, p.run.world_size, p.status) for p in profiles] == [(0, 2, "stopped"), (1, 2, "stopped")]
    assert all(p.summary.steps_measured == 4 for p in profiles)
    assert "[rank 1/2]" in done.stderr

    merged = subprocess.run([sys.executable, "-m", "torchaxe", "profile", "merge", *map(str, files)],
                            capture_output=True, text=True, env=_env(), timeout=60)
    assert merged.returncode == 0, merged.stderr
    assert "2 of 2 ranks" in merged.stdout
    assert "slowest rank 1: median time outside backward" in merged.stdout


def test_the_lines_that_read_tensors_back_say_they_count_the_whole_run(tmp_path, capsys):
    # A warm-up step that reads many values (an evaluation at step 0) is in the lines'
    # counts but not in the per-step figure: the summary says so.
    script = write_script(tmp_path, PRELUDE + "for i in range(6):\n    loss = step()\n    if i == 0:\n"
                                            "        [loss.item() for _ in range(50)]\n")
    code = main(["profile", "--steps", "3", "--warmup", "1", "--target", "cpu", "-o", str(tmp_path / "p.json"),
                 "--", "python", str(script)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "by line, over the whole run (warm-up steps included):" in err
