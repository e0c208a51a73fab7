"""benchmarks/real_scripts.py judges each script by its own log: the step-time lines of
the framework scripts, nanoGPT and pytorch/examples' word_language_model are read as
those scripts print them, and the reader's folder of public scripts is recognised."""

from __future__ import annotations

import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("real_scripts") as module:
        yield module


def test_the_framework_scripts_step_lines(bench):
    out = "loading\nstep 1: loss 6.1814, time 217.63 ms\nstep 2: loss 6.0000, time 147.94 ms\n{'loss': '6.16'}\n"
    assert bench.logged(out) == ([0.21763, 0.14794], [6.1814, 6.0])


def test_nanogpt_iter_lines(bench):
    out = ("step 0: train loss 4.2874, val loss 4.2823\n"
           "iter 0: loss 4.2654, time 3120.05ms, mfu -100.00%\n"
           "iter 1: loss 3.9123, time 61.50ms, mfu 0.01%\n")
    seconds, losses = bench.logged(out)
    assert seconds == pytest.approx([3.12005, 0.0615]) and losses == [4.2654, 3.9123]


def test_word_language_model_interval_lines(bench):
    out = ("| epoch   1 |    10/   57 batches | lr 20.00 | ms/batch 45.67 | loss  7.63 | ppl  2050.38\n"
           "| epoch   1 |    20/   57 batches | lr 20.00 | ms/batch 40.10 | loss  7.01 | ppl  1107.77\n"
           "| end of epoch   1 | time:  3.05s | valid loss  6.90 | valid ppl   992.27\n")
    seconds, losses = bench.logged(out)
    assert seconds == pytest.approx([0.04567, 0.0401]) and losses == [7.63, 7.01]


def test_no_step_time_logged_is_empty(bench):
    assert bench.logged("done: loss 0.1234\n") == ([], [])


def test_steady_leaves_out_the_first_quarter(bench):
    assert bench.steady([9.0, 1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 1.1]) == [1.1, 0.9, 1.0, 1.2, 1.0, 1.1]
    assert bench.steady([5.0, 1.0]) == [5.0, 1.0]


def test_placed_scripts_are_recognised_by_their_layout(bench, tmp_path):
    (tmp_path / "nanoGPT" / "config").mkdir(parents=True)
    (tmp_path / "nanoGPT" / "train.py").write_text("")
    (tmp_path / "word_language_model").mkdir()
    (tmp_path / "word_language_model" / "main.py").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text("")
    (tmp_path / "notes").mkdir()
    found = {s.name: s for s in bench.placed_scripts(tmp_path, 150)}
    assert sorted(found) == ["mine", "nanoGPT", "word_language_model"]
    assert "--max_iters=150" in found["nanoGPT"].args and "--device=cpu" in found["nanoGPT"].args
    assert found["mine"].command(tmp_path / "mine") == ["python", str(tmp_path / "mine" / "train.py")]


def test_synthetic_data_is_written_only_when_missing(bench, tmp_path):
    bench.nanogpt_data(tmp_path)
    train = tmp_path / "data" / "shakespeare_char" / "train.bin"
    assert train.stat().st_size == 2_000_000
    # nanoGPT reads the vocabulary of the recipe from meta.pkl, as its prepare.py writes it.
    import pickle

    meta = pickle.loads((tmp_path / "data" / "shakespeare_char" / "meta.pkl").read_bytes())
    assert meta["vocab_size"] == 65 == len(meta["itos"]) == len(meta["stoi"])
    train.write_bytes(b"\x01\x00" * 10)
    bench.nanogpt_data(tmp_path)
    assert train.stat().st_size == 20
    bench.wikitext_data(tmp_path)
    words = (tmp_path / "data" / "wikitext-2" / "train.txt").read_text().split()
    assert len(words) == 8000 * 20 and all(w.startswith("w") for w in words)


def test_a_script_advised_to_change_nothing_keeps_why(bench, tmp_path, monkeypatch):
    import json
    import subprocess

    advice = {"recommendations": [
        {"key": "knob:compile", "status": "measured", "speedup": 1.33, "selected": False,
         "ratios": [0.7, 0.72, 1.02], "held_back": None},
        {"key": "code:AX201", "status": "skipped", "selected": False}],
        "notes": ["no change saved at least 3% of the step on the median beyond the run-to-run noise"]}

    def fake(*args, cwd, timeout=None):
        return subprocess.CompletedProcess(args, 0, json.dumps(advice), "")

    monkeypatch.setattr(bench, "torchaxe", fake)
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "train.py").write_text("print('step 1: loss 1.0, time 1.00 ms')\n")
    spec = bench.Script("s", folder, "train.py", [])
    outcome = bench.measure(spec, tmp_path / "work", "1m", 1, 60.0, keep=tmp_path / "kept")
    assert outcome.chosen == [] and outcome.speedup == 1.0 and outcome.judge == "nothing applied"
    assert json.loads((tmp_path / "kept" / "s-advice.json").read_text()) == advice  # kept to be read afterwards
    saved = outcome.to_dict()
    assert saved["rounds"] == {"knob:compile": {"ratios": [0.7, 0.72, 1.02], "held_back": None}}
    assert saved["notes"] == advice["notes"]
