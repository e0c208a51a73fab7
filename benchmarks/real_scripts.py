"""What torchaxe delivers on training scripts it was not written for: advise -> apply ->
run on each script, against the original, judged by the script's own logged step time.

The scripts:

* the framework scripts of tests/scripts/frameworks/ (a Hugging Face ``Trainer``, a
  loop over a ``transformers`` BERT, a Lightning ``Trainer``, accelerate with gradient
  accumulation, a loop with SGD written by hand, a minGPT-style model with dropout),
  each skipped when the package it needs is not installed (``pip install -e
  .[frameworks]``);
* public scripts a reader places in a folder given with ``--scripts DIR`` (nothing is
  downloaded; this machine may be offline):

  - ``DIR/nanoGPT/``: a checkout of github.com/karpathy/nanoGPT, run with its README's
    CPU recipe for shakespeare_char. When ``data/shakespeare_char/`` lacks them,
    synthetic ``train.bin``/``val.bin`` (random character ids, numpy) and the recipe's
    ``meta.pkl`` (its 65-character vocabulary) are written into the benchmark's copy.
  - ``DIR/word_language_model/``: pytorch/examples' word-level LSTM language model (its
    default SGD written by hand). When ``data/wikitext-2/`` is missing, a synthetic
    corpus (random words, numpy) is written into the copy.
  - any other ``DIR/NAME/train.py``: run as ``python train.py`` with no argument; it
    must end by itself in a few minutes and should log its step time (below).

For each script, in a temporary copy (the reader's files are never changed):

1. ``torchaxe advise --budget B --turns`` (JSON advice kept);
2. ``torchaxe apply --unsafe-fixes``: code fixes written into the copy, run knobs into
   its torchaxe.toml;
3. ``--repeats`` rounds of the original (``python script``, a second untouched copy)
   and the tuned copy under ``torchaxe run``, each run to its end. The two runs of a
   round take turns (``alternate.py``): both are started, each warms up alone for its
   first logged steps, then one computes at a time, in turns of a second or more, so
   that the machine's swings in speed fall on both alike; ``--one-by-one`` runs them
   one after the other instead.

The judge is the script's own log: the lines it prints with its step time
(``step N: loss X, time Y ms``, nanoGPT's ``iter N: loss X, time Yms``,
word_language_model's ``ms/batch Y | loss X``). The first quarter of each run's logged
steps is left out (compilation, caches), and so is a line whose time a pause may hold
(taking turns, the first line of each turn); the speedup is the median over rounds of
(original median step / tuned median step), and the loss difference compares the
mean of the last quarter of the logged losses. A script that logs no step time is
judged by torchaxe's own step time instead (trial runs of the original files against
the applied changes, as ``advise`` measures), and the output says so. When advise
chooses nothing, nothing is applied and the speedup is 1 (not measured).

The runs are shortened jobs (``--steps``, 120 by default), and advise reads a job's
length from its command: a compile that 120 steps do not repay is held back, while the
judge above leaves the first quarter of the steps out. ``--job-steps N`` tells advise the
length of the job the shortened runs stand for instead (nanoGPT's README runs its CPU
recipe for 2,000 iterations); each script's line then says what the chosen changes cost
once and after how many steps they repaid it, as advise measured.

Printed: per script, what advise chose, the speedup with its per-round ratios, the
loss difference; then the median speedup. Targets: every script gets advice (at least
one measured change); median delivered speedup >= 1.3x.

    .venv/bin/python benchmarks/real_scripts.py --budget 4m --repeats 3
    .venv/bin/python benchmarks/real_scripts.py --scripts ~/src/public --only nanoGPT --save
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate import run_in_turns, run_to_end  # noqa: E402
from saved_run import add_save_options, save_result  # noqa: E402

FRAMEWORK_SCRIPTS = ROOT / "tests" / "scripts" / "frameworks"

#: Log lines that carry a step time (milliseconds) and a loss, as scripts print them.
LOG_PATTERNS = (
    re.compile(r"^step (?P<step>\d+): loss (?P<loss>[-0-9.eE+naif]+), time (?P<ms>[0-9.]+) ?ms", re.MULTILINE),
    re.compile(r"^iter (?P<step>\d+): loss (?P<loss>[-0-9.eE+naif]+), time (?P<ms>[0-9.]+)ms", re.MULTILINE),
    re.compile(r"ms/batch +(?P<ms>[0-9.]+) \| loss +(?P<loss>[-0-9.eE+naif]+)", re.MULTILINE),
)


@dataclass
class Script:
    """One script to measure: the folder copied, the script in it, its arguments."""

    name: str
    folder: Path
    script: str  # relative to the folder
    args: list[str] = field(default_factory=list)
    needs: tuple[str, ...] = ()
    prepare: Callable[[Path], None] | None = None  # makes missing data in the copy

    def command(self, folder: Path) -> list[str]:
        return ["python", str(folder / self.script), *self.args]


def log(line: str) -> None:
    print(f"real_scripts: {line}", file=sys.stderr, flush=True)


def torchaxe(*args: str, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "torchaxe", *args], cwd=cwd, timeout=timeout)


# --------------------------------------------------------------------------- the scripts


def framework_scripts(steps: int) -> list[Script]:
    each = ["--steps", str(steps)]
    return [
        Script("hf_trainer", FRAMEWORK_SCRIPTS, "hf_trainer.py", each, ("transformers", "accelerate")),
        Script("hf_custom_loop", FRAMEWORK_SCRIPTS, "hf_custom_loop.py", each, ("transformers",)),
        Script("lightning_trainer", FRAMEWORK_SCRIPTS, "lightning_trainer.py", each, ("lightning",)),
        # Its --steps counts optimizer steps of four batches each: at half the others'
        # count advise's runs ended before the 10 + 64 steps they ask for ("give it
        # more steps"), and its rounds strayed 28% from each other.
        Script("accelerate_accumulation", FRAMEWORK_SCRIPTS, "accelerate_accumulation.py", each, ("accelerate",)),
        Script("manual_sgd", FRAMEWORK_SCRIPTS, "manual_sgd.py", each),
        Script("dropout_gpt", FRAMEWORK_SCRIPTS, "dropout_gpt.py", each),
    ]


#: shakespeare_char's vocabulary size (its prepare.py: the distinct characters of the text).
NANOGPT_CHARS = 65


def nanogpt_data(folder: Path) -> None:
    """Synthetic shakespeare_char files, when the reader has not prepared them: the token
    files and ``meta.pkl``, as the recipe's ``prepare.py`` writes them. Without
    ``meta.pkl`` nanoGPT falls back to GPT-2's 50,304-token vocabulary, and the output
    layer alone would outweigh the recipe's whole model."""
    import pickle  # nanoGPT's own format for meta.pkl

    import numpy as np

    data = folder / "data" / "shakespeare_char"
    if not ((data / "train.bin").exists() and (data / "val.bin").exists()):
        data.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        rng.integers(0, NANOGPT_CHARS, 1_000_000, dtype=np.uint16).tofile(data / "train.bin")
        rng.integers(0, NANOGPT_CHARS, 100_000, dtype=np.uint16).tofile(data / "val.bin")
    if not (data / "meta.pkl").exists():
        chars = [chr(c) for c in range(32, 32 + NANOGPT_CHARS)]
        meta = {"vocab_size": NANOGPT_CHARS, "itos": dict(enumerate(chars)),
                "stoi": {ch: i for i, ch in enumerate(chars)}}
        (data / "meta.pkl").write_bytes(pickle.dumps(meta))


def wikitext_data(folder: Path) -> None:
    """A synthetic wikitext-2 (random words with a Zipf-like frequency) when it is missing."""
    import numpy as np

    data = folder / "data" / "wikitext-2"
    if all((data / f"{part}.txt").exists() for part in ("train", "valid", "test")):
        return
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(2000)])
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    # About 230 batches of the script's defaults (20 x 35 tokens): 23 log lines at --log-interval 10.
    for part, lines in (("train", 8000), ("valid", 200), ("test", 200)):
        text = "\n".join(" ".join(rng.choice(words, size=20, p=weights)) for _ in range(lines))
        (data / f"{part}.txt").write_text(text + "\n", encoding="utf-8")


def placed_scripts(folder: Path, iters: int) -> list[Script]:
    """The public scripts a reader placed under ``folder`` (see the module docstring)."""
    found = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        if sub.name == "nanoGPT" and (sub / "train.py").exists():
            found.append(Script("nanoGPT", sub, "train.py", [
                "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", f"--max_iters={iters}", "--lr_decay_iters=2000", "--dropout=0.0",
                f"--eval_interval={iters + 1000}"], prepare=nanogpt_data))
        elif sub.name == "word_language_model" and (sub / "main.py").exists():
            found.append(Script("word_language_model", sub, "main.py", [
                "--epochs", "1", "--log-interval", "10", "--save", "model.pt"], prepare=wikitext_data))
        elif (sub / "train.py").exists():
            found.append(Script(sub.name, sub, "train.py"))
    return found


# --------------------------------------------------------------------------- judging


def logged(stdout: str) -> tuple[list[float], list[float]]:
    """(step seconds, losses) from the script's own log lines: the first pattern that matches."""
    for pattern in LOG_PATTERNS:
        hits = list(pattern.finditer(stdout))
        if hits:
            losses = []
            for h in hits:
                try:
                    losses.append(float(h.group("loss")))
                except ValueError:
                    pass
            return [float(h.group("ms")) / 1e3 for h in hits], losses
    return [], []


def steady(values: list[float]) -> list[float]:
    """The logged steps after the first quarter (compilation, caches, allocator)."""
    return values[len(values) // 4:] if len(values) >= 4 else values


def tail_mean(values: list[float]) -> float | None:
    tail = values[-max(1, len(values) // 4):] if values else []
    return statistics.fmean(tail) if tail else None


@dataclass
class Outcome:
    name: str
    chosen: list[str] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)
    judge: str = "the script's log"
    speedup: float | None = None
    ratios: list[float] = field(default_factory=list)
    original_step: float | None = None
    tuned_step: float | None = None
    loss_original: float | None = None
    loss_tuned: float | None = None
    wall_original: float | None = None
    wall_tuned: float | None = None
    error: str | None = None
    #: advise's notes about its budget (why changes went unmeasured)
    budget_notes: list[str] = field(default_factory=list)
    #: advise's other notes (why measured changes were not chosen: the noise, the loss)
    notes: list[str] = field(default_factory=list)
    #: per measured change, its per-round ratios and why it was held back (if it was)
    rounds: dict[str, dict] = field(default_factory=dict)
    #: what the chosen changes cost once together (compiling), as advise measured it on
    #: a run after the first, and the steps their saving takes to pay it back
    one_time_seconds: float | None = None
    break_even_steps: int | None = None

    @property
    def advised(self) -> bool:
        return bool(self.measured)

    @property
    def loss_difference(self) -> float | None:
        if self.loss_original is None or self.loss_tuned is None or not self.loss_original:
            return None
        return (self.loss_tuned - self.loss_original) / abs(self.loss_original)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "chosen": self.chosen, "measured": self.measured, "judge": self.judge,
                "speedup": self.speedup, "per_round_ratios": self.ratios, "original_step_s": self.original_step,
                "tuned_step_s": self.tuned_step, "loss_original": self.loss_original, "loss_tuned": self.loss_tuned,
                "loss_difference": self.loss_difference, "wall_original_s": self.wall_original,
                "wall_tuned_s": self.wall_tuned, "advised": self.advised, "error": self.error,
                "budget_notes": self.budget_notes, "notes": self.notes, "rounds": self.rounds,
                "one_time_seconds": self.one_time_seconds, "break_even_steps": self.break_even_steps}

    def line(self) -> str:
        head = f"  {self.name}: "
        if self.error:
            return head + f"error: {self.error}"
        chosen = ", ".join(self.chosen) or "nothing"
        measured = ", ".join(f"{k} {v:.2f}x" for k, v in self.measured.items()) or \
            "nothing measured" + (f": {self.budget_notes[0]}" if self.budget_notes else "")
        if self.speedup is None:
            return head + f"chosen {chosen} (measured: {measured}); delivered: not measured"
        if self.original_step is None:
            return head + f"{self.speedup:.2f}x ({self.judge}; advise measured: {measured})"
        loss = self.loss_difference
        loss_text = f"loss {100 * loss:+.2f}%" if loss is not None else "loss n/a"
        rounds = ", ".join(f"{r:.2f}" for r in self.ratios)
        once = (f"; costs {self.one_time_seconds:.1f} s once"
                + (f", repaid after {self.break_even_steps:,} steps" if self.break_even_steps else "")
                if self.one_time_seconds else "")
        return (head + f"{self.speedup:.2f}x by {self.judge} ({1e3 * self.original_step:.1f} -> "
                f"{1e3 * self.tuned_step:.1f} ms/step; rounds {rounds}); {loss_text}; chosen {chosen}{once} "
                f"(advise measured: {measured})")


def run_logged(command: list[str], cwd: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = run_to_end(command, cwd=cwd, timeout=timeout)
    return done, time.perf_counter() - started


def is_step_line(line: str) -> bool:
    return any(pattern.search(line) for pattern in LOG_PATTERNS)


def compare_logged(spec: Script, original: Path, tuned: Path, outcome: Outcome, repeats: int,
                   timeout: float, one_by_one: bool = False) -> bool:
    """Interleaved full runs, judged by the scripts' logs; False when they log no step time.

    By default each round's two runs take turns (``alternate.py``): both run at once and
    one computes at a time, so that the machine's swings in speed fall on both; their
    logged steps are judged where a turn holds them whole, the first quarter left out.
    ``one_by_one`` runs the original, then the tuned copy, each to its end."""
    plain = [sys.executable, *spec.command(original)[1:]]
    under_run = [sys.executable, "-m", "torchaxe", "run", "--", *spec.command(tuned)]
    sides = (("original", plain, original), ("tuned", under_run, tuned))
    steps = {"original": [], "tuned": []}
    losses = {"original": [], "tuned": []}
    walls = {"original": [], "tuned": []}
    for n in range(repeats):
        if one_by_one:
            outputs = {}
            for side, command, cwd in sides:
                log(f"{spec.name}: round {n + 1}/{repeats}, {side}")
                done, wall = run_logged(command, cwd, timeout)
                if done.returncode != 0:
                    raise RuntimeError(f"the {side} run exited {done.returncode}: "
                                       f"{(done.stderr.strip().splitlines() or [''])[-1]}")
                text = done.stdout + "\n" + done.stderr
                outputs[side] = (text, text, wall)
        else:
            order = sides if n % 2 == 0 else sides[::-1]  # who warms up and goes first alternates
            runs = run_in_turns([(command, cwd, None) for _, command, cwd in order], is_step_line,
                                timeout=timeout, progress=lambda m: log(f"{spec.name}: round {n + 1}/{repeats}, {m}"))
            outputs = {}
            for (side, _, _), run in zip(order, runs):
                if run.killed:
                    raise subprocess.TimeoutExpired(run.argv, timeout)
                if run.returncode != 0:
                    last = [line.text for line in run.lines if line.text.strip()][-1:] or [""]
                    raise RuntimeError(f"the {side} run exited {run.returncode}: {last[0].strip()}")
                outputs[side] = ("\n".join(run.judged()), run.output, run.seconds)
        for side, (judged, text, wall) in outputs.items():
            seconds, _ = logged(judged)
            loss = logged(text)[1]
            if not seconds:
                return False
            steps[side].append(statistics.median(steady(seconds)))
            losses[side].append(tail_mean(loss))
            walls[side].append(wall)
    outcome.judge = "the script's log" + ("" if one_by_one else ", runs taking turns")
    outcome.ratios = [o / t for o, t in zip(steps["original"], steps["tuned"])]
    outcome.speedup = statistics.median(outcome.ratios)
    outcome.original_step = statistics.median(steps["original"])
    outcome.tuned_step = statistics.median(steps["tuned"])
    known = [x for x in losses["original"] if x is not None]
    outcome.loss_original = statistics.median(known) if known else None
    known = [x for x in losses["tuned"] if x is not None]
    outcome.loss_tuned = statistics.median(known) if known else None
    outcome.wall_original = statistics.median(walls["original"])
    outcome.wall_tuned = statistics.median(walls["tuned"])
    return True


def compare_profiled(spec: Script, tuned: Path, outcome: Outcome, repeats: int, timeout: float) -> None:
    """The script logs no step time: torchaxe's trial runs, the files as they were
    before apply against the applied changes (as ``advise`` measures the gain achieved)."""
    from torchaxe.advise.apply import kept_originals, read_run_knobs
    from torchaxe.advise.measure import Measurer
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions

    command = spec.command(tuned)
    knobs, _ = read_run_knobs(tuned, cwd=tuned)
    before = knob_set_from_dict({"name": "original", "sources": kept_originals(tuned / spec.script)}, "bench")
    after = knob_set_from_dict({"name": "tuned", **knobs}, "bench")
    measurer = Measurer(command, TrialOptions(repeats=1, steps=10, warmup=10, timeout=timeout, target="cpu"),
                        progress=log)
    cwd = os.getcwd()
    os.chdir(tuned)
    try:
        base, (arm,), _ = measurer.compare(before, [after], repeats, f"{spec.name}: tuned vs original", warm=True)
    finally:
        os.chdir(cwd)
    outcome.judge = "torchaxe's step time (the script logs none)"
    if arm.error or base.error:
        raise RuntimeError(arm.error or base.error)
    outcome.ratios = [1 / r for r in arm.ratios if r]
    outcome.speedup = 1 / arm.ratio if arm.ratio else None
    outcome.original_step, outcome.tuned_step = base.median, arm.median


def measure(spec: Script, work: Path, budget: str, repeats: int, timeout: float,
            skip: tuple[str, ...] = (), one_by_one: bool = False, keep: Path | None = None,
            job_steps: int | None = None) -> Outcome:
    outcome = Outcome(spec.name)
    original, tuned = work / spec.name / "original", work / spec.name / "tuned"
    for copy in (original, tuned):
        shutil.copytree(spec.folder, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "out*"))
        if spec.prepare:
            spec.prepare(copy)
    advice_file = tuned / "torchaxe-advice.json"
    log(f"{spec.name}: advise --budget {budget} --turns")
    extra = [arg for key in skip for arg in ("--skip", key)]
    if job_steps is not None:
        extra += ["--job-steps", str(job_steps)]
    # --turns: advise's rounds run side by side taking turns, as steady as this machine allows.
    advised = torchaxe("advise", "--budget", budget, "--turns", "--target", "cpu", "--format", "json", "--save",
                       str(advice_file), *extra, "--", *spec.command(tuned), cwd=tuned)
    if advised.returncode != 0:
        outcome.error = "advise: " + (advised.stderr.strip().splitlines() or ["failed"])[-1]
        return outcome
    advice = json.loads(advised.stdout)
    if keep is not None:
        # The work folder goes at the end: what advise saw (its profile's top operators,
        # every candidate and note) stays readable after a surprising choice.
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{spec.name}-advice.json").write_text(advised.stdout, encoding="utf-8")
    outcome.chosen = [r["key"] for r in advice["recommendations"] if r["selected"]]
    combined = advice.get("combined") or {}
    outcome.one_time_seconds, outcome.break_even_steps = (combined.get("one_time_seconds"),
                                                          combined.get("break_even_steps"))
    outcome.measured = {r["key"]: round(r["speedup"], 3) for r in advice["recommendations"]
                        if r["status"] == "measured" and r.get("speedup")}
    outcome.budget_notes = [n for n in advice.get("notes", []) if "--budget" in n]
    outcome.notes = [n for n in advice.get("notes", []) if "--budget" not in n]
    outcome.rounds = {r["key"]: {"ratios": r.get("ratios"), "held_back": r.get("held_back")}
                      for r in advice["recommendations"] if r["status"] == "measured"}
    log(f"{spec.name}: chosen {', '.join(outcome.chosen) or 'nothing'}")
    if not outcome.chosen:
        # Nothing to apply: the tuned run would be the original; its speedup is 1 by definition.
        outcome.judge, outcome.speedup = "nothing applied", 1.0
        return outcome
    applied = torchaxe("apply", "--unsafe-fixes", "--advice", str(advice_file), cwd=tuned)
    if applied.returncode != 0:
        outcome.error = "apply: " + (applied.stderr.strip().splitlines() or ["failed"])[-1]
        return outcome
    try:
        if not compare_logged(spec, original, tuned, outcome, repeats, timeout, one_by_one):
            log(f"{spec.name}: the script logs no step time; judged by torchaxe's own step time")
            compare_profiled(spec, tuned, outcome, repeats, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        outcome.error = f"comparison: {exc}"
    return outcome


def missing_packages(spec: Script) -> list[str]:
    import importlib.util

    return [p for p in spec.needs if importlib.util.find_spec(p) is None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="4m", help="advise's --budget per script (default 4m)")
    parser.add_argument("--job-steps", type=int, metavar="N",
                        help="tell advise each job runs N steps (its --job-steps), the job the benchmark's "
                             "shortened runs stand for; by default advise reads the length from the command "
                             "(--steps), and holds back a compile that 120 steps do not repay")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of original and tuned runs")
    parser.add_argument("--steps", type=int, default=120, help="steps of each framework script's runs")
    parser.add_argument("--scripts", metavar="DIR", help="a folder of public scripts placed by the reader "
                        "(nanoGPT/, word_language_model/, NAME/train.py)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="measure this script only "
                        "(repeatable)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="set OMP_NUM_THREADS=N for every run (advise's included); on a machine shared with "
                             "other work, N=1 keeps OpenMP threads from waiting on each other")
    parser.add_argument("--one-by-one", action="store_true",
                        help="run the original and the tuned copy one after the other, each to its end, instead "
                             "of side by side taking turns (alternate.py)")
    parser.add_argument("--keep", metavar="DIR", help="write each script's advice (JSON: the profile's top "
                        "operators, every candidate with its rounds, the notes) to DIR/NAME-advice.json")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_save_options(parser)
    args = parser.parse_args()
    if args.repeats < 1:
        print("real_scripts: error: --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.scripts and not Path(args.scripts).is_dir():
        print(f"real_scripts: error: --scripts {args.scripts}: not a folder", file=sys.stderr)
        return 2

    started = time.perf_counter()
    specs = framework_scripts(args.steps)
    if args.scripts:
        specs += placed_scripts(Path(args.scripts).resolve(), max(args.steps, 100))
    if args.only:
        unknown = set(args.only) - {s.name for s in specs}
        if unknown:
            print(f"real_scripts: error: --only {', '.join(sorted(unknown))}: no such script "
                  f"(known: {', '.join(s.name for s in specs)})", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.name in args.only]
    if args.threads is not None:
        if args.threads < 1:
            print("real_scripts: error: --threads must be at least 1", file=sys.stderr)
            return 2
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(tempfile.mkdtemp(prefix="torchaxe-real-scripts-"))
    os.environ["TORCHAXE_HOME"] = str(work / "home")
    outcomes, skipped = [], []
    # SIGTERM (a scheduler, `timeout`) is taken as Ctrl-C: the runs taking turns, stopped
    # between turns in sessions of their own, are then ended, not left stopped.
    from torchaxe.runtime.process import ended_with_this_process

    with ended_with_this_process():
        try:
            for spec in specs:
                missing = missing_packages(spec)
                if missing:
                    skipped.append(f"{spec.name} (needs {', '.join(missing)})")
                    log(f"{spec.name}: skipped, {', '.join(missing)} not installed")
                    continue
                # The thread count set by --threads is the benchmark's condition, not a change to try.
                skip = ("env:OMP_NUM_THREADS",) if args.threads is not None else ()
                outcomes.append(measure(spec, work, args.budget, args.repeats, args.timeout, skip,
                                        args.one_by_one, Path(args.keep) if args.keep else None,
                                        args.job_steps))
                log(outcomes[-1].line().strip())
        finally:
            shutil.rmtree(work, ignore_errors=True)

    speedups = [o.speedup for o in outcomes if o.speedup is not None]
    median = statistics.median(speedups) if speedups else None
    every_advised = bool(outcomes) and all(o.advised for o in outcomes)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    lines = [
        f"real scripts: advise -> apply -> run ({platform.machine()}, {os.cpu_count()} cores, "
        f"budget {args.budget}, {args.repeats} rounds"
        + (", one by one" if args.one_by_one else ", runs taking turns")
        + (f", OMP_NUM_THREADS={args.threads}" if args.threads is not None else "")
        + (f", advise told jobs of {args.job_steps:,} steps" if args.job_steps is not None else "")
        + f", {time.strftime('%Y-%m-%d')}"
        + (f", 1-minute load {load:.1f} at the end" if load is not None else "") + ")",
        *(o.line() for o in outcomes),
        *(f"  {s}: skipped" for s in skipped),
        f"  median delivered speedup: {median:.2f}x over {len(speedups)} scripts" if median else
        "  median delivered speedup: nothing measured",
        f"  targets: every script advised: {'PASS' if every_advised else 'FAIL'} "
        f"({sum(o.advised for o in outcomes)} of {len(outcomes)}); median >= 1.3x: "
        f"{'PASS' if median and median >= 1.3 else 'FAIL'}",
        f"  total {time.perf_counter() - started:.0f} s",
    ]
    text = "\n".join(lines)
    result = {"budget": args.budget, "repeats": args.repeats, "threads": args.threads, "job_steps": args.job_steps,
              "one_by_one": args.one_by_one, "scripts": [o.to_dict() for o in outcomes],
              "skipped": skipped, "median_speedup": median, "every_script_advised": every_advised,
              "targets": {"every_script_advised": every_advised,
                          "median_at_least_1_3x": bool(median and median >= 1.3)},
              "seconds": time.perf_counter() - started, "text": text}
    print(json.dumps(result, indent=2) if args.json else text)
    save_result(args, "real_scripts", result)
    return 0 if every_advised and median and median >= 1.3 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("real_scripts: interrupted; the runs it started were ended", file=sys.stderr)
        sys.exit(130)
