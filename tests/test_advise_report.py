"""The advise report: the terminal summary, the JSON, and the HTML page -- checked as
text (escaping, self-contained) and rendered in a real headless browser (Debian's
chromium, which .ci/run installs; skipped with a message where it is missing)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from torchaxe.report.advice_html import render_advice_html
from torchaxe.report.advice_text import render_advice_text
from torchaxe.units import duration

from test_advise import FakeRuns, run_advice, script  # noqa: F401  (fixture)

PAYLOAD = "<script>alert('x')</script>"


def browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
def advice(script: Path):  # noqa: F811
    result = run_advice(script, FakeRuns())
    result.recommendations[0].title += PAYLOAD
    result.command.append(PAYLOAD)
    return result


def test_text_summary_names_the_winners_and_what_to_run_next(advice) -> None:
    out = io.StringIO()
    render_advice_text(advice, out, width=140)
    text = out.getvalue()
    assert "torch.compile(model)" in text and "2.00x" in text
    assert "All chosen changes together: 2.22x faster" in text
    assert "torchaxe apply --diff" in text and "torchaxe run -- python" in text
    assert "torchaxe apply -- " not in text  # apply takes no command


def test_next_step_says_unsafe_fixes_checked_on_the_run_need_no_flag(advice) -> None:
    from torchaxe.runtime.candidate import Accuracy

    code = next(r for r in advice.recommendations if r.key == "code:AX110")
    assert code.selected
    code.unsafe = True
    code.accuracy = Accuracy(kind="unknown")
    out = io.StringIO()
    render_advice_text(advice, out, width=300)
    assert "torchaxe apply --diff --unsafe-fixes" in out.getvalue()
    code.accuracy = Accuracy(kind="loss", loss_delta=0.001, loss_noise=0.01, loss_tolerance=0.02)
    out = io.StringIO()
    render_advice_text(advice, out, width=300)
    text = out.getvalue()
    assert "--unsafe-fixes" not in text and "the unsafe fixes chosen are applied: their loss was checked" in text


def test_the_report_says_where_the_budget_went(script: Path) -> None:  # noqa: F811
    from test_advise import Clock, TimedRuns

    clock = Clock()
    advice = run_advice(script, TimedRuns(clock, 4.0), clock=clock, budget=300.0)
    phases = advice.phases
    assert set(phases) <= {"profile", "scan", "micro-benchmarks", "measuring"} and phases["measuring"] >= 4.0
    assert abs(sum(phases.values()) - advice.elapsed_seconds) < 1e-6
    assert json.loads(advice.to_json())["phases"]["measuring"] == round(phases["measuring"], 2)
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    assert f"s of a 300 s budget: measuring {phases['measuring']:.0f} s;" in out.getvalue()


def test_a_failed_change_s_error_is_shown_in_full_below_the_table(advice) -> None:
    rec = advice.ranked()[-1]
    rec.status, rec.selected = "failed", False
    rec.error = ("error: the script raised RuntimeError at train.py:41, through torchaxe's attention "
                 "(torchaxe/runtime/knob_specs.py:421) (a change under trial): The size of tensor a (4) must match "
                 "the size of tensor b (3) at non-singleton dimension 3 [END]; 2 steps")
    out = io.StringIO()
    render_advice_text(advice, out)
    text = " ".join(line.strip() for line in out.getvalue().splitlines())
    assert "failed (why: below)" in text
    assert f"{rec.key}: error: the script raised RuntimeError" in text
    assert "[END]; 2 steps" in text  # nothing cut


def test_an_installed_packages_file_is_shown_from_the_package_down(advice, monkeypatch) -> None:
    from torchaxe.report import advice_text

    rec = advice.ranked()[0]
    rec.location = "/home/u/venv/lib/python3.11/site-packages/torchvision/datasets/coco.py:43"
    out = io.StringIO()
    render_advice_text(advice, out)
    text = out.getvalue()
    assert "torchvision/datasets/coco.py:43" in text and "site-packages" not in text
    command = " ".join(advice.command)  # a command is never wrapped, to be copied whole
    assert max(len(line) for line in text.splitlines() if command not in line) <= advice_text.REPORT_WIDTH

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size((180, 50)))
    assert advice_text.report_width(Terminal()) == 180  # a wide terminal's own width
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size((60, 50)))
    assert advice_text.report_width(Terminal()) == advice_text.REPORT_WIDTH
    assert advice_text.report_width(Terminal(), 90) == 90


def test_findings_in_installed_packages_are_named_not_only_counted(advice) -> None:
    site = "/home/u/venv/lib/python3.11/site-packages/transformers/"
    advice.scanned["installed_findings"] = [
        {"path": site + f"models/m{i}.py", "line": 10 + i, "code": "AX101", "category": "gelu_tanh"}
        for i in range(5)]
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    text = out.getvalue()
    assert "5 findings in installed packages the run imported (all of them in the JSON advice" in text
    assert "transformers/models/m0.py:10 AX101 gelu tanh" in text and "... 2 more" in text
    assert "see the report" not in text
    advice.scanned["installed_findings"] = advice.scanned["installed_findings"][:1]
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    assert "  1 finding in installed packages" in out.getvalue()
    # Listed and also left out as not executed (a review's HF ViT): the listing says so.
    findings = [{"path": site + f"models/m{i}.py", "line": 10 + i, "code": "AX101", "category": "gelu_tanh",
                 "executed": i == 4} for i in range(5)]
    advice.scanned["installed_findings"] = findings
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    text = out.getvalue()
    assert "5 findings in installed packages the run imported, 1 in code its steps ran (listed first" in text
    assert text.index("m4.py:14") < text.index("m0.py:10")
    for item in findings:
        item["executed"] = False
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    assert "none in code its steps ran (left out, see the note)" in out.getvalue()


def test_a_set_cut_to_its_best_change_is_not_called_all_of_them_together(script: Path) -> None:  # noqa: F811
    slower_together = run_advice(script, FakeRuns(times={"combined": 0.07}))  # compile alone: 0.05
    out = io.StringIO()
    render_advice_text(slower_together, out, width=200)
    text = out.getvalue()
    assert "All chosen changes together" not in text
    assert "Chosen alone: knob:compile, 2.00x faster in its own" in text
    assert "the 2 changes first chosen (knob:compile, " in text and "measured 1.43x together" in text
    html = render_advice_html(slower_together)
    assert "knob:compile alone (the changes first chosen, together: 1.43x)" in html


def test_a_change_that_compiles_says_what_it_costs_once_and_when_it_pays_off(script: Path) -> None:  # noqa: F811
    # Compile's warm-up steps took 10 s where the original's took 0.2 s; it saves 50 ms a
    # step: a job shorter than about 196 steps is slower with it.
    advice = run_advice(script, FakeRuns(warmup={"knob:compile": 10.0}))
    compiled = next(r for r in advice.recommendations if r.key == "knob:compile")
    assert compiled.one_time_seconds == pytest.approx(9.8)
    assert compiled.break_even_steps == 196
    assert compiled.to_dict()["break_even_steps"] == 196
    fix = next(r for r in advice.recommendations if r.key == "code:AX110")
    assert fix.one_time_seconds is None and fix.break_even_steps is None  # warmed up as the original did
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    assert "costs 9.8 s once, in its first steps (compiling); pays off after 196 steps" in out.getvalue()
    together = run_advice(script, FakeRuns(warmup={"knob:compile": 10.0, "combined": 12.0}))
    assert together.combined["one_time_seconds"] == pytest.approx(11.8)
    assert together.combined["break_even_steps"] == 215  # 11.8 s over the 55 ms it saves a step
    # The set's runs warmed as fast as the original's (the compiler's caches were warm
    # from compile's own runs; a fresh job compiles again): its members' cost stands
    # (seen in a review: "one-time costs counted" with nothing counted).
    warm = run_advice(script, FakeRuns(warmup={"knob:compile": 10.0}), job_steps=300)
    assert warm.combined["one_time_seconds"] == pytest.approx(9.8)
    saved = warm.combined["measured_seconds_saved_per_step"]
    out = io.StringIO()
    render_advice_text(warm, out, width=300)
    assert f"about {duration(300 * saved - 9.8)} saved" in out.getvalue()


@pytest.mark.parametrize("job_steps", [100, 500])
def test_a_change_not_paid_back_within_the_jobs_steps_is_held_back(script: Path, job_steps: int) -> None:  # noqa: F811
    # Compile pays off after 196 steps (above): a 100-step job is slower with it.
    advice = run_advice(script, FakeRuns(warmup={"knob:compile": 10.0}), job_steps=job_steps)
    compiled = next(r for r in advice.recommendations if r.key == "knob:compile")
    fix = next(r for r in advice.recommendations if r.key == "code:AX110")
    assert fix.selected and not fix.held_back  # no one-time cost: chosen whatever the job's length
    if job_steps == 100:
        assert not compiled.selected
        assert "pays off only after 196 steps, more than the job's 100 (--job-steps)" in compiled.held_back
        assert any(n.startswith("knob:compile (2.00x) is held back") for n in advice.notes)
    else:
        assert compiled.selected and not compiled.held_back


def test_a_set_not_paid_back_within_the_jobs_steps_is_not_chosen(script: Path) -> None:  # noqa: F811
    # Each pays off within 300 steps alone (compile after 196, the fix at once), but
    # together they compile for 29.8 s more than the original: 542 steps to pay back.
    runs = FakeRuns(warmup={"knob:compile": 10.0, "combined": 30.0})
    advice = run_advice(script, runs, job_steps=300)
    assert "combined" in runs.order
    assert advice.combined["keys"] == ["knob:compile"]
    assert any("together cost 29.8 s once, before their first fast step, which pays off only after 542 steps, "
               "more than the job's 300 (--job-steps): only knob:compile is kept" in n for n in advice.notes)
    # A longer job keeps both.
    longer = run_advice(script, FakeRuns(warmup={"knob:compile": 10.0, "combined": 30.0}), job_steps=600)
    assert sorted(longer.combined["keys"]) == ["code:AX110", "knob:compile"]


@pytest.mark.parametrize("command, expected", [
    (["--max-steps", "300"], (300, "--max-steps 300")),
    (["--max_iters=5000", "--lr", "3e-4"], (5000, "--max_iters 5000")),
    (["--num-train-steps", "10"], (10, "--num-train-steps 10")),
    (["--max_train_steps", "40"], (40, "--max_train_steps 40")),  # transformers' no-trainer examples
    (["--num_training_steps=7"], (7, "--num_training_steps 7")),
    (["--steps", "200"], (200, "--steps 200")),
    (["--iters=50"], (50, "--iters 50")),
    (["--num_batches", "64"], (64, "--num_batches 64")),
    (["--eval-steps", "10"], None),  # not the job's length
    (["--save_steps", "10"], None),
    (["--batches", "10"], None),
    (["--max-steps-per-epoch", "10"], None),
    (["--max-steps", "300", "--max_steps=400"], None),  # two lengths: neither
    (["--epochs", "3"], None),
    # A section of a configuration (minGPT's --trainer.max_iters, Hydra's key=value).
    (["--trainer.max_iters=300"], (300, "--trainer.max_iters 300")),
    (["trainer.max_steps=100"], (100, "trainer.max_steps 100")),
    (["trainer.max_steps", "100"], None),  # a bare word without "=" is no option
    (["--maxIters", "80"], (80, "--maxIters 80")),  # camelCase
    (["--numSteps=12"], (12, "--numSteps 12")),
])
def test_the_jobs_length_is_read_from_the_command(command, expected) -> None:
    from torchaxe.runtime.job_command import job_steps_in

    assert job_steps_in(["python", "train.py", *command]) == expected


def test_a_length_stated_in_the_command_holds_back_a_compile_it_does_not_pay_back(script: Path) -> None:  # noqa: F811
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.advise.pipeline import Advisor

    from test_advise import Clock, fake_profile
    from torchaxe.advise.baseline import BaselineProfile

    profile = fake_profile(script, step=0.1)
    advice = Advisor(["python", str(script), "--max-steps", "100"], AdviseOptions(target="cpu", budget=600.0),
                     runner=FakeRuns(warmup={"knob:compile": 10.0}),
                     profiler=lambda command, o, target, knobs=None: BaselineProfile(
                         profile, {"modules": [], "settings": {"num_threads": 2, "allowed_cpus": 2}}, 2.0),
                     clock=Clock()).run()
    compiled = next(r for r in advice.recommendations if r.key == "knob:compile")
    assert not compiled.selected
    assert "more than the job's 100 (read from the command: --max-steps 100)" in compiled.held_back
    assert any(n.startswith("the job's length is read from the command (--max-steps 100)") for n in advice.notes)


def test_a_length_in_steps_of_a_job_that_accumulates_says_the_command_may_count_batches(script: Path) -> None:  # noqa: F811
    # Seen in a review: an accelerate loop accumulating 2 batches a step, whose --steps
    # 300 counts batches, was put in 300 optimizer steps, twice its length.
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.advise.pipeline import Advisor

    from test_advise import Clock, fake_profile
    from torchaxe.advise.baseline import BaselineProfile

    def advise(batches: int):
        profile = fake_profile(script, step=0.1)
        for step in profile["steps"]:
            step["batches"] = batches
        return Advisor(["python", str(script), "--steps", "300"], AdviseOptions(target="cpu", budget=600.0),
                       runner=FakeRuns(), profiler=lambda command, o, target, knobs=None: BaselineProfile(
                           profile, {"modules": [], "settings": {"num_threads": 2, "allowed_cpus": 2}}, 2.0),
                       clock=Clock()).run()

    assert ("a step here is one optimizer step, which took 2 batches (gradient accumulation): if --steps 300 counts "
            "batches, the job is 150 steps and its figures here are too large (--job-steps 150 says so)") \
        in advise(2).notes
    assert not any(n.startswith("a step here is one optimizer step") for n in advise(1).notes)


def test_a_trainers_max_steps_counts_optimizer_steps_without_a_hedge(script: Path) -> None:  # noqa: F811
    # Seen in a review: "if --max_steps 80 counts batches, the job is 40 steps" under
    # Hugging Face's Trainer, whose max_steps counts optimizer steps.
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.advise.pipeline import Advisor

    from test_advise import Clock, fake_profile
    from torchaxe.advise.baseline import BaselineProfile

    def advise(modules: list[str]):
        profile = fake_profile(script, step=0.1)
        for step in profile["steps"]:
            step["batches"] = 2
        context = {"modules": modules, "settings": {"num_threads": 2, "allowed_cpus": 2}}
        return Advisor(["python", str(script), "--max_steps", "80"], AdviseOptions(target="cpu", budget=600.0),
                       runner=FakeRuns(), profiler=lambda command, o, target, knobs=None: BaselineProfile(
                           profile, context, 2.0), clock=Clock()).run()

    hedge = "a step here is one optimizer step"
    assert not any(n.startswith(hedge) for n in advise(["/venv/lib/site-packages/transformers/trainer.py"]).notes)
    assert not any(n.startswith(hedge) for n in advise(
        ["/venv/lib/site-packages/lightning/pytorch/trainer/trainer.py"]).notes)
    assert any(n.startswith(hedge + ", which took 2 batches") for n in advise([]).notes)


@pytest.mark.parametrize("command, expected", [
    (["--epochs", "2"], (2.0, "--epochs 2")),
    (["--num_train_epochs=3.0"], (3.0, "--num_train_epochs 3.0")),
    (["--max-epochs", "5", "--warmup-epochs", "1"], (5.0, "--max-epochs 5")),  # warm-up epochs are not the length
    (["--epoch", "3"], None),  # often the epoch to start from
    (["--epochs", "2", "--epochs=3"], None),
    (["--epochs", "many"], None),
    (["trainer.max_epochs=3"], (3.0, "trainer.max_epochs 3")),
    (["--nEpochs", "8"], (8.0, "--nEpochs 8")),  # pytorch/examples' super_resolution
    (["--numTrainEpochs=2"], (2.0, "--numTrainEpochs 2")),
])
def test_the_jobs_length_in_epochs_is_read_from_the_command(command, expected) -> None:
    from torchaxe.runtime.job_command import job_epochs_in

    assert job_epochs_in(["python", "train.py", *command]) == expected


def test_epochs_in_the_command_count_the_training_loaders_batches(script: Path) -> None:  # noqa: F811
    # timm's train.py --epochs 2: 64 steps, yet a compile paying off after 1,158 was chosen.
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.runtime.job_command import job_steps_of_epochs
    from torchaxe.advise.pipeline import Advisor

    from test_advise import Clock, fake_profile
    from torchaxe.advise.baseline import BaselineProfile

    assert job_steps_of_epochs(2, {"samples": 1000, "batch_size": 16, "drop_last": False}, 1) == 126
    assert job_steps_of_epochs(2, {"samples": 1000, "batch_size": 16, "drop_last": True}, 1) == 124
    assert job_steps_of_epochs(1, {"samples": 1000, "batch_size": 16, "drop_last": False}, 4) == 16  # accumulation
    profile = fake_profile(script, step=0.1)
    profile["shapes"]["batches"] = {"signatures": [{"shapes": [[16, 3]], "dtypes": ["float32"], "count": 4}]}
    epochs = [{"site": "train.py:40", "batch_size": 16, "samples": 512, "drop_last": True, "last_batch_samples": None},
              {"site": "train.py:41", "batch_size": 64, "samples": 100, "drop_last": False, "last_batch_samples": 36}]
    def advise_two_epochs():
        return Advisor(["python", str(script), "--epochs", "2"], AdviseOptions(target="cpu", budget=600.0),
                       runner=FakeRuns(warmup={"knob:compile": 10.0}),
                       profiler=lambda command, o, target, knobs=None: BaselineProfile(
                           profile, {"modules": [], "settings": {"num_threads": 2, "allowed_cpus": 2,
                                                                 "loader_epochs": epochs}}, 2.0),
                       clock=Clock()).run()

    advice = advise_two_epochs()
    compiled = next(r for r in advice.recommendations if r.key == "knob:compile")
    assert not compiled.selected and "more than the job's 64 (read from the command: --epochs 2)" in compiled.held_back
    assert any(n.startswith("the job's length is read from the command (--epochs 2): 64 steps of the loader built "
                            "at train.py:40 (512 samples in batches of 16)") for n in advice.notes)
    # mnist_forward_forward's --epochs: passes over one batch taken before the loop
    # (its steps draw no batch), not the loader's epochs.
    for step in profile["steps"]:
        step["batches"] = 0
    advice = advise_two_epochs()
    assert next(r for r in advice.recommendations if r.key == "knob:compile").selected
    assert not any(n.startswith("the job's length is read") for n in advice.notes)


def test_job_steps_must_be_positive() -> None:
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.errors import TorchaxeError

    with pytest.raises(TorchaxeError, match="--job-steps 0"):
        AdviseOptions(job_steps=0)


def test_a_set_not_measured_together_says_so_in_words() -> None:
    from torchaxe.report.advice_text import together_text

    text = together_text({"keys": ["knob:autocast-bf16", "knob:compile"], "status": "not_measured"})
    assert text == ("the 2 changes first chosen (knob:autocast-bf16, knob:compile) were not measured together: the "
                    "--budget ended before a round of them (out of --budget)")
    assert together_text({"keys": ["a", "b"], "status": "failed", "error": "exit 1"}).endswith("failed together: exit 1")


def test_text_summary_claims_no_rounds_or_choices_that_did_not_happen(script: Path) -> None:  # noqa: F811
    from test_advise import Clock

    nothing = run_advice(script, FakeRuns(), budget=100.0, clock=Clock(step=30.0))
    out = io.StringIO()
    render_advice_text(nothing, out, width=140)
    text = out.getvalue()
    assert "* chosen" not in text and "nothing measured clearly faster" in text
    measured = sum(r.status == "measured" for r in nothing.recommendations)
    assert f"{measured} of " in text and "changes measured" in text
    assert "% at most" not in text  # no run-to-run noise is quoted when the original never ran against itself


def test_html_escapes_every_user_string_and_loads_nothing(advice) -> None:
    page = render_advice_html(advice)
    assert PAYLOAD not in page
    assert "&lt;script&gt;" in page
    assert "<script" not in page.lower()
    assert "Content-Security-Policy" in page
    for scheme in ("http://", "https://", "//cdn"):
        assert scheme not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for plot in ("plot-gains", "plot-breakdown", "plot-data-wait", "plot-ops"):
        assert f'id="{plot}"' in page


def test_the_chosen_changes_are_put_in_the_job_s_seconds_when_its_length_is_known(script: Path) -> None:  # noqa: F811
    # 0.100 s steps, 0.045 s together: 55 ms saved in each of 1000 steps.
    advice = run_advice(script, FakeRuns(), args=("--steps", "1000"))
    assert advice.job == {"steps": 1000, "source": "read from the command: --steps 1000"}
    assert json.loads(advice.to_json())["job"]["steps"] == 1000
    out = io.StringIO()
    render_advice_text(advice, out, width=300)
    assert "over the job's 1,000 steps (read from the command: --steps 1000): about 55.0 s saved of 100.0 s in " \
           "steps, one-time costs counted" in out.getvalue()
    # Without the job's length: nothing said.
    out = io.StringIO()
    render_advice_text(run_advice(script, FakeRuns()), out, width=300)
    assert "over the job's" not in out.getvalue()


def test_partial_advice_says_what_is_missing(script: Path) -> None:  # noqa: F811
    from test_advise import Clock, TimedRuns

    def partial_line(advice) -> str:
        out = io.StringIO()
        render_advice_text(advice, out, width=200)
        return next(line for line in out.getvalue().splitlines() if "partial advice" in line)

    # 12 s fit one change of four, once: three not measured, each saying why in the JSON too.
    clock = Clock()
    short = run_advice(script, TimedRuns(clock, 2.0), budget=12.0, clock=clock)
    assert "partial advice: 3 changes not measured for the --budget" in partial_line(short)
    reasons = [r["not_measured_reason"] for r in json.loads(short.to_json())["recommendations"]
               if r["status"] == "not_measured"]
    assert reasons.count("budget") == 3
    # Every change measured, round 2 left out for the combined run (runs of 10 s, 125 s).
    clock = Clock()
    advice = run_advice(script, TimedRuns(clock, 10.0), repeats=2, budget=125.0, clock=clock)
    assert all(r.status != "not_measured" for r in advice.recommendations)
    assert "partial advice: not every planned run was made: some figures rest on fewer rounds" in partial_line(advice)


def test_json_keeps_the_partial_flag_and_notes(advice) -> None:
    advice.partial = True
    advice.notes.append("interrupted (Ctrl-C)")
    data = json.loads(advice.to_json())
    assert data["partial"] is True and "interrupted (Ctrl-C)" in data["notes"]
    assert "partial" in render_advice_html(advice).lower()


def test_html_renders_in_a_headless_browser(advice, tmp_path: Path) -> None:
    exe = browser()
    if exe is None:
        pytest.skip("no chromium here: install Debian's `chromium` package (.ci/run does) to run this test")
    page = tmp_path / "report.html"
    page.write_text(render_advice_html(advice), encoding="utf-8")
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1280,1800"]
    dom = subprocess.run([exe, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="recommendations"' in dom.stdout and "torch.compile(model)" in dom.stdout
    assert "&lt;script&gt;" in dom.stdout  # shown as text, never run
    run = subprocess.run([exe, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size[0] >= 1000
    counts = {color: n for n, color in image.getcolors(maxcolors=1 << 24)}
    assert len(counts) > 50  # text, table lines and plots, not a blank page
    green = (0x1A, 0x7F, 0x37)  # the chosen changes' bars in the gain plot
    assert counts.get(green, 0) > 100
    if os.environ.get("TORCHAXE_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["TORCHAXE_KEEP_SCREENSHOT"])


def test_the_gain_achieved_says_which_figure_is_which(advice) -> None:
    advice.achieved = {"status": "measured", "speedup": 1 / 1.015, "ratios": [0.84, 1.19],
                       "step_seconds_median": 0.06176, "original_step_seconds_median": 0.05772}
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    assert ("Gain achieved since `torchaxe apply`: 0.99x, the median of the interleaved rounds (1.19x, 0.84x); "
            "step medians over all rounds: now 61.76 ms, original 57.72 ms") in out.getvalue()


def test_a_one_time_cost_is_called_compiling_only_for_a_change_that_compiles() -> None:
    from torchaxe.advise.recommendation import Recommendation
    from torchaxe.report.advice_text import compiles, one_time_text

    loader = Recommendation(key="code:AX403", axis="data", title="persistent_workers", applies="code")
    compiled = Recommendation(key="knob:compile", axis="compile", title="torch.compile", applies="knob",
                              knobs={"compile": {"mode": "default"}})
    packed = Recommendation(key="knob:compile-dropout-packed", axis="compile", title="t", applies="knob",
                            knobs={"compile": {}, "kernels": {"dropout": "packed"}})
    assert not compiles(loader) and compiles(compiled) and compiles(packed)
    assert one_time_text(9.9, None, compiles(loader)) == "costs 9.9 s once, in its first steps"
    assert one_time_text(9.9, 40, compiles(compiled)).endswith("(compiling); pays off after 40 steps")


def test_a_slower_change_is_not_held_back_for_its_one_time_cost(script: Path) -> None:  # noqa: F811
    # A compile measured slower per step (a review's LSTM: 0.86x) is not chosen for being
    # slower; "held back ... never paid back ... apply --only" read as yours to decide.
    advice = run_advice(script, FakeRuns(times={"knob:compile": 0.116}, warmup={"knob:compile": 10.0}),
                        job_steps=300)
    compiled = next(r for r in advice.recommendations if r.key == "knob:compile")
    assert not compiled.selected and compiled.speedup < 1.0
    assert not compiled.held_back


def test_a_report_written_to_a_file_wraps_between_words_under_its_own_indent(advice) -> None:
    from torchaxe.report import advice_text

    advice.baseline["run_to_run_noise"] = 0.181
    advice.command += ["--outf", "out"] + [f"--option-{n} value-{n}" for n in range(12)]
    out = io.StringIO()
    render_advice_text(advice, out)  # not a terminal: the fixed width
    lines = out.getvalue().splitlines()
    command = " ".join(advice.command)
    # The commands stay on one line each, to be copied whole.
    assert any(line.startswith("torchaxe advise ") and command in line for line in lines)
    assert any(line == f"  torchaxe run -- {command}" for line in lines)
    rest = [line for line in lines if command not in line]
    assert max(len(line) for line in rest) <= advice_text.REPORT_WIDTH
    # A sentence longer than the width goes on under its own indent, never from column 0.
    first = next(n for n, line in enumerate(lines) if line.startswith("  run-to-run noise   18.1%"))
    assert lines[first + 1].startswith(" " * 21) and not lines[first + 1][21].isspace()
    sentence = " ".join(line.strip() for line in lines[first:first + 3])
    assert "beyond chance)" in sentence and "a change is chosen when it is faster" in sentence
