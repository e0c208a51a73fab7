"""`torchaxe shapes` on real (tiny) training scripts run in this process, and on traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profile_support import write_script
from torchaxe.cli import main
from torchaxe.shapes.analysis import analyse
from torchaxe.shapes.observe import NoStepsError, observe
from torchaxe.shapes.verdict import decide

DATA = Path(__file__).parent / "data" / "ascend"

VARLEN = """\
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
torch.manual_seed(0)
data = [torch.randint(1, 9, (int(n),)) for n in torch.randint(4, 40, (60,))]
def pad_collate(batch):
    return pad_sequence(batch, batch_first=True)
loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=pad_collate, drop_last=True)
model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for tokens in loader:
    print("batch", tuple(tokens.shape))
    loss = model(tokens).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

FIXED = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, drop_last=True)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

MASKED = """\
import torch
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        keep = x[:, 0] > 0
        picked = x[keep]  # mask
        n = int((x[:, 1] > 0).sum().item())  # item
        padding = torch.zeros(n)
        return self.linear(picked).mean() + padding.sum()


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    loss = model(torch.randn(16, 4))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

NO_OPTIMIZER = """\
import torch
x = torch.ones(3)
for _ in range(3):
    x = x * 2
"""


def run(tmp_path, source, steps=8):
    script = write_script(tmp_path, source)
    observation = observe(["python", str(script)], steps=steps, target="cpu")
    return observation, analyse(observation)


def test_variable_length_batches_are_dynamic_traced_to_the_collate_function(tmp_path):
    observation, analysis = run(tmp_path, VARLEN)
    assert observation.steps == 8 and observation.loaders[0].collate == "pad_collate"
    collate = next(c for c in analysis.causes if c.kind == "collate")
    assert collate.location.endswith("train.py:6")
    verdict = decide(analysis, max_shapes=2)
    assert verdict.verdict == "dynamic"
    embedding = next(s for s in analysis.subjects if s.kind == "module" and s.name.endswith(".0"))
    assert embedding.dynamic and collate.id in embedding.causes
    plan = verdict.buckets[0]
    assert plan.chosen.k == 2 and plan.chosen.shapes <= 2 and plan.dims == (1,)
    assert plan.table[0].boundaries[0] == (max(v for (v,) in plan.table[0].boundaries and
                                               analysis.batch_sources[0].points),)
    # the data set was built before training: its ops are not in the records
    assert all(s.name != "aten.randint.low" for s in analysis.subjects)


DICT_BATCHES = VARLEN.replace(
    "    return pad_sequence(batch, batch_first=True)",
    "    ids = pad_sequence(batch, batch_first=True)\n"
    "    return {'input_ids': ids, 'attention_mask': (ids > 0).long(), 'labels': torch.zeros(len(batch))}",
).replace("for tokens in loader:", "for batch in loader:\n    tokens = batch['input_ids']")


COLLATOR_OBJECT = VARLEN.replace(
    "def pad_collate(batch):\n    return pad_sequence(batch, batch_first=True)",
    "class PadCollator:\n    def __call__(self, batch):\n        return pad_sequence(batch, batch_first=True)",
).replace("collate_fn=pad_collate", "collate_fn=PadCollator()")


def test_a_collator_object_is_wrapped_as_an_object_of_its_class(tmp_path):
    observation, analysis = run(tmp_path, COLLATOR_OBJECT)
    (plan,) = decide(analysis, max_shapes=2).buckets
    assert "collate_fn=PadCollator(...), dim=1)" in plan.snippet() and plan.snippet().startswith("DataLoader(")


TRAINER = Path(__file__).parent / "scripts" / "frameworks" / "hf_trainer_collator.py"


def test_a_trainer_s_loader_is_bucketed_through_its_data_collator(tmp_path):
    """The Trainer builds the DataLoader from ``data_collator=`` (and wraps it to drop
    unused columns): the advice wraps the user's collator there."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[frameworks])")
    observation = observe(["python", str(TRAINER)], steps=8, target="cpu")
    plan = decide(analyse(observation), max_shapes=2).buckets[0]
    assert observation.loaders[0].collate == "PadCollator" and observation.loaders[0].built_by == "Trainer"
    assert plan.snippet().startswith("Trainer(..., data_collator=torchaxe.shapes.BucketingCollate(")
    assert "collate_fn=PadCollator(...), dim=1" in plan.snippet()


def test_a_mapping_batch_s_tensors_are_named_by_their_keys(tmp_path):
    # A tokenizer's collator gives a dict: "tensor 0/1/2" would leave the user to
    # guess which of input_ids, attention_mask and labels varies.
    observation, analysis = run(tmp_path, DICT_BATCHES)
    assert observation.loaders[0].fields == ("input_ids", "attention_mask", "labels")
    messages = [c.message for c in analysis.causes if c.kind == "collate"]
    assert any("tensor 0 (input_ids) varies in dimension 1" in m for m in messages), messages
    assert any("tensor 1 (attention_mask) varies" in m for m in messages), messages
    batch = next(s for s in analysis.subjects if s.kind == "batch")
    assert {d.position for d in batch.dims} >= {"tensor 0 (input_ids)", "tensor 1 (attention_mask)"}
    assert all(d.cause for d in batch.dims)  # still traced to their causes
    verdict = decide(analysis, max_shapes=2)
    assert verdict.buckets[0].field == "input_ids" and verdict.buckets[0].to_dict()["field"] == "input_ids"


SEQ2SEQ = """\
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
torch.manual_seed(0)
data = [(torch.randint(1, 9, (int(n),)), torch.randint(1, 9, (int(m),)))
        for n, m in zip(torch.randint(4, 40, (60,)), torch.randint(2, 12, (60,)))]
def collate_fn(batch):
    ids = pad_sequence([s for s, _ in batch], batch_first=True)
    labels = pad_sequence([t for _, t in batch], batch_first=True, padding_value=-100)
    return {'input_ids': ids, 'attention_mask': (ids > 0).long(), 'labels': labels}
loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate_fn, drop_last=True)
model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for batch in loader:
    loss = model(batch['input_ids']).mean() + model(batch['labels'].clamp(min=0)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_batch_whose_inputs_and_labels_vary_apart_gets_one_wrapper_each(tmp_path):
    # A wrapped BucketingCollate pads the tensors as long as the batch's longest: the
    # labels of a seq2seq batch, of lengths of their own, need a wrapper of their own.
    observation, analysis = run(tmp_path, SEQ2SEQ, steps=12)
    verdict = decide(analysis, max_shapes=2)
    plans = {b.field: b for b in verdict.buckets}
    assert set(plans) == {"input_ids", "attention_mask", "labels"}
    snippet = plans["labels"].snippet()
    assert snippet == plans["input_ids"].snippet()  # one for the loader
    assert snippet.count("BucketingCollate(") == 2 and "collate_fn=collate_fn" in snippet
    assert "fields=['input_ids', 'attention_mask']" in snippet and "fields=['labels']" in snippet
    bucketing = next(r for r in verdict.recommendations if r.kind == "bucketing")
    assert bucketing.setting == snippet
    # The nested wrappers it describes give each group only its own bucket sizes.
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from torchaxe.shapes import BucketingCollate

    def collate_fn(batch):  # the script's own
        ids = pad_sequence([s for s, _ in batch], batch_first=True)
        labels = pad_sequence([t for _, t in batch], batch_first=True, padding_value=-100)
        return {"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": labels}

    sources, targets = plans["input_ids"].knob()["boundaries"], plans["labels"].knob()["boundaries"]
    inner = BucketingCollate(sources, collate_fn=collate_fn, dim=1, fields=["input_ids", "attention_mask"])
    outer = BucketingCollate(targets, collate_fn=inner, dim=1, fields=["labels"])
    torch.manual_seed(1)
    data = [(torch.randint(1, 9, (int(n),)), torch.randint(1, 9, (int(m),)))
            for n, m in zip(torch.randint(4, 40, (80,)), torch.randint(2, 12, (80,)))]
    batches = [outer(data[start:start + 4]) for start in range(0, 80, 4)]
    padded = [b for b in batches if b["input_ids"].shape[1] in sources and b["labels"].shape[1] in targets]
    assert len(padded) >= len(batches) - 2  # the first batches pass unpadded until the padding is learned
    assert all(b["attention_mask"].shape == b["input_ids"].shape for b in batches)


GAN = """\
import torch
from torch import nn
class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    def forward(self, z):
        return self.net(z)
class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    def forward(self, x):
        return self.net(x)
netG, netD = Generator(), Discriminator()
optG = torch.optim.SGD(netG.parameters(), lr=0.1)
optD = torch.optim.SGD(netD.parameters(), lr=0.1)
criterion = nn.BCEWithLogitsLoss()
for _ in range(12):
    real = torch.randn(8, 6)
    fake = netG(torch.randn(8, 4))
    lossD = criterion(netD(real), torch.ones(8, 1)) + criterion(netD(fake.detach()), torch.zeros(8, 1))
    optD.zero_grad(); lossD.backward(); optD.step()
    lossG = criterion(netD(fake), torch.ones(8, 1))
    optG.zero_grad(); lossG.backward(); optG.step()
"""


def test_a_loop_that_trains_two_models_is_told_to_compile_each(tmp_path):
    # "model = torch.compile(model)" for a GAN, whose script has no `model`.
    _, analysis = run(tmp_path, GAN, steps=6)
    verdict = decide(analysis)
    assert verdict.verdict == "static", verdict.reasons
    compiles = [r.setting for r in verdict.recommendations if r.kind == "compile"]
    assert compiles and all(s.endswith("(each of the 2 models the loop trains: Discriminator, Generator)")
                            for s in compiles)
    # Two instances of one class, and a loss module built anew each step (as Hugging Face
    # models build CrossEntropyLoss() in their forward): the loss is no model.
    sequential = (GAN.replace("netG, netD = Generator(), Discriminator()",
                              "netG = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))\n"
                              "netD = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))")
                  .replace("    real = torch.randn(8, 6)\n", "    real = torch.randn(8, 6)\n    criterion = nn.BCEWithLogitsLoss()\n"))
    _, two = run(tmp_path, sequential, steps=6)
    compiles = [r.setting for r in decide(two).recommendations if r.kind == "compile"]
    assert compiles and all(s.endswith("(each of the 2 models the loop trains: Sequential x2)") for s in compiles)
    _, one = run(tmp_path, FIXED, steps=6)
    assert all(r.setting == "model = torch.compile(model)" for r in decide(one).recommendations
               if r.kind == "compile")
    # A contrastive loss written as a module with no parameters (SimCLR's NT_Xent) is no
    # model either, whatever its name.
    contrastive = GAN.replace("criterion = nn.BCEWithLogitsLoss()",
                              "class NTXent(nn.Module):\n"
                              "    def forward(self, a, b):\n"
                              "        return nn.functional.binary_cross_entropy_with_logits(a, b)\n"
                              "criterion = NTXent()")
    _, with_loss = run(tmp_path, contrastive, steps=6)
    assert any(s.name == "NTXent" and s.parameters == 0 for s in with_loss.subjects)
    compiles = [r.setting for r in decide(with_loss).recommendations if r.kind == "compile"]
    assert compiles and all(s.endswith("(each of the 2 models the loop trains: Discriminator, Generator)")
                            for s in compiles)


def test_fixed_shapes_are_static(tmp_path):
    _, analysis = run(tmp_path, FIXED, steps=6)
    verdict = decide(analysis)
    assert verdict.verdict == "static", verdict.reasons
    assert analysis.counts("op")["dynamic"] == 0 and analysis.counts("module")["static"] == 4
    assert verdict.picks == {"npu": "jit-compile-on", "cuda": "compile-static", "cpu": "compile-static"}


FIXED_WITH_EVAL = FIXED + """\
    if step_count := globals().get("step_count", 0) + 1:
        globals()["step_count"] = step_count
    if step_count % 2 == 0:
        model.eval()
        with torch.no_grad():
            for n in (3, 5, 7):  # validation batches of other sizes
                model(torch.randn(n, 6))
        model.train()
"""


def test_evaluation_under_no_grad_does_not_make_training_dynamic(tmp_path):
    # Training always sees (8, 6); only the no_grad validation passes see other sizes.
    _, analysis = run(tmp_path, FIXED_WITH_EVAL, steps=6)
    verdict = decide(analysis)
    assert verdict.verdict == "static", verdict.reasons
    assert analysis.counts("module")["dynamic"] == 0 and analysis.counts("op")["dynamic"] == 0


FIXED_WITH_EVAL_LOADER = FIXED.replace("for x, y in loader:", """\
evaluation = DataLoader(TensorDataset(torch.randn(30, 6), torch.randn(30, 1)), batch_size=10)
for x, y in loader:
    for vx, vy in evaluation:  # fetched with gradients on, no backward after it
        with torch.no_grad():
            model(vx)
    with torch.no_grad():
        for (vx,) in DataLoader(TensorDataset(torch.randn(9, 6)), batch_size=3):
            model(vx)""")


def test_an_evaluation_loaders_batches_are_not_training_shapes(tmp_path):
    observation, analysis = run(tmp_path, FIXED_WITH_EVAL_LOADER, steps=6)
    verdict = decide(analysis)
    assert verdict.verdict == "static", verdict.reasons
    batches = observation.profile.shapes.batches
    assert [s.shapes for s in batches.signatures] == [[[8, 6], [8, 1]]]


def test_a_module_only_ever_called_without_gradients_keeps_its_shapes(tmp_path):
    # A frozen teacher, called under no_grad in every training step: its calls are all it has.
    source = FIXED.replace("opt = torch.optim", "teacher = torch.nn.Linear(6, 1)\nopt = torch.optim").replace(
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n",
        "    with torch.no_grad():\n        target = teacher(x[: int(torch.randint(2, 8, ()))])\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n")
    _, analysis = run(tmp_path, source, steps=6)
    teacher = next(s for s in analysis.subjects if s.kind == "module" and s.type == "Linear" and s.name == "Linear")
    assert teacher.dynamic and analysis.counts("module")["static"] == 4


SHARED_ACTIVATION = """\
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 12), torch.nn.Linear(12, 4), torch.nn.Linear(4, 1)
        self.act = torch.nn.ReLU()  # one module, called after layers of three widths
    def forward(self, x):
        return self.c(self.act(self.b(self.act(self.a(x)))))
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_module_called_at_several_places_with_fixed_shapes_is_static(tmp_path):
    # The shared ReLU sees (8, 12) and (8, 4) in every step: two signatures, one set per step.
    observation, analysis = run(tmp_path, SHARED_ACTIVATION, steps=6)
    act = next(m for m in observation.profile.shapes.modules if m.type == "ReLU")
    assert len(act.signatures) == 2 and act.step_sets == 1 and not act.dynamic
    assert decide(analysis).verdict == "static"
    assert observation.profile.shapes.to_dict()["static"]
    # Its sizes changing from one step to the next is what makes a module dynamic.
    varying = SHARED_ACTIVATION.replace("torch.randn(8, 6), torch.randn(8, 1)",
                                        "torch.randn(4 + step % 3, 6), torch.randn(4 + step % 3, 1)")
    observation, analysis = run(tmp_path, varying, steps=6)
    act = next(m for m in observation.profile.shapes.modules if m.type == "ReLU")
    assert act.step_sets == 3 and act.dynamic and decide(analysis).verdict in ("dynamic", "mixed")
    # Its width (12 at one place, 4 at the other, every step) is no varying dimension:
    # only the batch is (seen in a review: "Net.relu input 0 dim 1 2 sizes 32..64").
    assert act.steady == [[0, 1]]
    relu = next(s for s in analysis.subjects if s.kind == "module" and s.type == "ReLU")
    assert [(d.position, d.dim) for d in relu.dims] == [("input 0", 0)]


def test_boolean_mask_and_item_sizes_are_found_with_their_lines(tmp_path):
    observation, analysis = run(tmp_path, MASKED)
    kinds = {c.kind: c for c in analysis.causes}
    line = {text.split("#")[-1].strip(): n for n, text in enumerate(MASKED.splitlines(), 1) if "  # " in text}
    assert kinds["boolean-mask"].location.endswith(f"train.py:{line['mask']}")
    assert kinds["boolean-mask"].code == "picked = x[keep]  # mask"
    assert "item" in kinds and kinds["item"].location.endswith(f"train.py:{line['item']}")
    verdict = decide(analysis)
    assert verdict.verdict == "dynamic"
    assert any(r.kind == "data-dependent" and "torch.where" in r.setting for r in verdict.recommendations)


OUTSIDE_THE_MODEL = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for episode in range(12):
    # One fixed-size call of the model per time step; the episode's length varies, and
    # so do the loss's terms (REINFORCE's returns) and the checkpoint's copies.
    terms = [model(torch.randn(1, 4)).log_softmax(-1)[0, 0] for _ in range(3 + episode % 4)]
    returns = torch.randn(len(terms))
    loss = -(torch.stack(terms) * (returns - returns.mean()) / (returns.std() + 1e-6)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if episode % 5 == 4:
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
"""


def test_shapes_that_change_only_outside_the_model_leave_it_static(tmp_path):
    # torch.compile(model) compiles the model's forward and backward: the loss over a
    # varying number of terms and the checkpoint's copies are not in them.
    _, analysis = run(tmp_path, OUTSIDE_THE_MODEL, steps=10)
    verdict = decide(analysis)
    assert verdict.verdict == "static", verdict.reasons


def test_no_step_says_step_marker(tmp_path):
    script = write_script(tmp_path, NO_OPTIMIZER)
    with pytest.raises(NoStepsError, match="--step-marker"):
        observe(["python", str(script)], steps=4, target="cpu")


def test_cli_json_verdict_and_recommendations(tmp_path, capsys):
    script = write_script(tmp_path, VARLEN)
    code = main(["shapes", "--steps", "6", "--max-shapes", "3", "--target", "cpu", "--format", "json", "--",
                 "python", str(script)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)  # the script's prints went to stderr
    assert "batch (4," in captured.err
    assert report["schema"] == "torchaxe.shapes/1" and report["verdict"] == "dynamic"
    assert report["pick"] == "compile-static+bucketing"
    assert report["recommendations"][0]["target"] == "cpu"
    assert {r["target"] for r in report["recommendations"]} == {"cpu", "cuda", "npu"}
    assert [p["k"] for p in report["bucketing"][0]["table"]] == list(range(1, 9))
    assert report["bucketing"][0]["chosen"]["k"] == 3
    assert report["counts"]["ops"]["dynamic"] > 0 and report["trial"] is None


def test_a_script_that_compiles_its_model_is_told_it_ran_eagerly_here(tmp_path, capsys):
    # Seen in a review: a script calling torch.compile itself was recorded eagerly and
    # told to add `model = torch.compile(model)`, with no word of either.
    script = write_script(tmp_path, FIXED.replace("opt = torch.optim", "model = torch.compile(model, "
                                                  "backend='eager')\nopt = torch.optim"))
    code = main(["shapes", "--steps", "4", "--target", "cpu", "--format", "json", "--", "python", str(script)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["verdict"] == "static"
    assert any(w.startswith("the script compiles Sequential itself (torch.compile); it ran eagerly")
               for w in report["warnings"]), report["warnings"]
    compile_rec = next(r for r in report["recommendations"] if r["target"] == "cpu" and r["kind"] == "compile")
    assert "the script compiles Sequential already: keep its call" in compile_rec["reason"]


def test_cli_text_and_no_step_error(tmp_path, capsys):
    script = write_script(tmp_path, FIXED)
    out = tmp_path / "report.txt"
    assert main(["shapes", "--steps", "4", "--target", "cpu", "-o", str(out), "--", "python", str(script)]) == 0
    text = out.read_text()
    assert "verdict: STATIC" in text and "model = torch.compile(model)" in text and "unverified on Ascend" in text
    none = write_script(tmp_path, NO_OPTIMIZER, name="loop.py")
    capsys.readouterr()
    assert main(["shapes", "--steps", "4", "--target", "cpu", "--", "python", str(none)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("torchaxe: error: no step was seen") and "--step-marker" in err[-1]


def test_cli_from_ascend_trace_uses_op_state(capsys):
    assert main(["shapes", "--from-trace", str(DATA / "ut_compute_v2"), "--format", "json", "--target", "npu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "dynamic" and report["trace"]["op_state"] == {"dynamic": 29}
    assert report["pick"] == "jit-compile-off"
    assert any("OP State" in r for r in report["reasons"])


def test_cli_traces_without_shapes_say_so(capsys):
    for trace in ("ut_timeline", "ut_compute/kernel_details.csv"):
        assert main(["shapes", "--from-trace", str(DATA / trace)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("torchaxe: error:") and "cannot tell static shapes from dynamic" in err
        assert "record_shapes=True" in err and len(err.splitlines()) == 1


def kernel_csv(path, rows):
    header = "Step Id,Name,Type,OP State,Duration(us),Input Shapes\n"
    path.write_text(header + "".join(f'{s},{n},{n},{st},10.0,"""{shape}"""\n' for s, n, st, shape in rows))
    return path


def test_ascend_kernels_over_steps(tmp_path, capsys):
    static = kernel_csv(tmp_path / "kernel_details.csv",
                        [(s, "MatMul", "dynamic", "8,16;16,4") for s in (1, 2, 3)])
    assert main(["shapes", "--from-trace", str(static), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "static"
    assert any("jit_compile=True) may make them faster" in r for r in report["reasons"])
    varying = kernel_csv(tmp_path / "v_kernel_details.csv",
                         [(s, "MatMul", "static", f"{8 * s},16;16,4") for s in (1, 2, 3, 4)])
    assert main(["shapes", "--from-trace", str(varying), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "dynamic" and report["picks"]["npu"] == "jit-compile-off"


MARKED = """\
import torch
torch.manual_seed(0)
w = torch.ones(4, requires_grad=True)
def train_step(n):
    x = torch.randn(n, 4)
    (x @ w).sum().backward()
for step in range(10):
    train_step(8 + step)
"""


def test_steps_from_a_step_marker(tmp_path):
    script = write_script(tmp_path, MARKED)
    observation = observe(["python", str(script)], steps=8, target="cpu", step_marker="__main__:train_step")
    assert observation.complete_steps == 8
    analysis = analyse(observation)
    mv = next(s for s in analysis.subjects if s.name == "aten.mv.default")
    assert mv.dynamic and mv.dims[0].distinct >= 6
    assert decide(analysis).verdict == "dynamic"


def chrome_trace(path, batch_sizes, record_shapes=True):
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 record_shapes=record_shapes) as prof:
        for batch in batch_sizes:
            model(torch.randn(batch, 8)).sum().backward()
            opt.step()
            prof.step()
    prof.export_chrome_trace(str(path))
    return str(path)


def test_torch_traces_with_and_without_shapes(tmp_path, capsys):
    varying = chrome_trace(tmp_path / "varying.json", [4, 4, 4, 6, 8])
    assert main(["shapes", "--from-trace", varying, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "dynamic" and report["picks"]["cpu"] == "compile-dynamic"
    fixed = chrome_trace(tmp_path / "fixed.json", [4] * 5)
    assert main(["shapes", "--from-trace", fixed, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "static"
    bare = chrome_trace(tmp_path / "bare.json", [4, 4, 4, 6, 8], record_shapes=False)
    assert main(["shapes", "--from-trace", bare]) == 2
    assert "the trace has no input shapes" in capsys.readouterr().err


TWO_LOADERS = """\
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

data = TensorDataset(torch.randn(100, 6))
# Training draws 6,400 samples with replacement in batches of 64; evaluation reads the
# same dataset in batches of 100.
train = DataLoader(data, batch_size=64, sampler=RandomSampler(data, replacement=True, num_samples=6400))
evaluation = DataLoader(data, batch_size=100)
model = torch.nn.Linear(6, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x,) in enumerate(train):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 3 == 0:
        for (v,) in evaluation:
            model(v)
"""


def test_two_loaders_over_one_dataset_are_two_and_an_epoch_is_the_samplers(tmp_path):
    observation, _ = run(tmp_path, TWO_LOADERS, steps=6)
    by_size = {info.batch_size: info for info in observation.loaders}
    assert set(by_size) == {64, 100}
    # 6,400 samples drawn in batches of 64: no smaller last batch (the dataset's 100
    # samples would say 36).
    assert by_size[64].dataset_length == 6400 and by_size[64].remainder is None
    assert by_size[100].dataset_length == 100 and by_size[100].remainder is None


def test_under_torchrun_only_rank_0_writes_the_report(tmp_path, capsys, monkeypatch):
    # every rank records its shapes; two ranks printing the same report (or writing one
    # --out file at once) is one too many
    script = write_script(tmp_path, FIXED)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "report.txt"
    assert main(["shapes", "--steps", "4", "--target", "cpu", "-o", str(out), "--", "python", str(script)]) == 0
    assert not out.exists() and capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["shapes", "--steps", "4", "--target", "cpu", "-o", str(out), "--", "python", str(script)]) == 0
    assert "verdict: STATIC" in out.read_text()


@pytest.mark.parametrize("args, found", [
    (["--compile=False"], "--compile=False"),
    (["--batch", "8", "--compile", "False"], "--compile False"),
    (["--compile"], "--compile"),
    (["--use-compile", "--lr", "1"], "--use-compile"),
    (["--compiled-model", "x"], None),
    (["compile=False"], None),
])
def test_the_scripts_own_compile_switch_is_found(args, found):
    from torchaxe.runtime.job_command import compile_switch_in

    assert compile_switch_in(["python", "train.py", *args]) == found


def test_the_jobs_batches_come_from_its_stated_length_and_the_batches_a_step_draws():
    from torchaxe.runtime.profile import StepRecord
    from torchaxe.shapes.cli import job_batches

    class Profile:
        steps = [StepRecord(index=1, seconds=0.1, phase="warmup", batches=9)] + [
            StepRecord(index=i, seconds=0.1, batches=2) for i in range(2, 6)]

    assert job_batches(["python", "train.py", "--max_iters=40"], Profile) == 80  # two micro-batches a step
    assert job_batches(["python", "train.py", "--epochs", "2"], Profile) is None
    Profile.steps = [StepRecord(index=i, seconds=0.1, batches=0) for i in range(1, 5)]  # batches made by hand
    assert job_batches(["python", "train.py", "--max_iters=40"], Profile) is None


def test_the_compile_advice_points_at_the_scripts_own_switch(tmp_path, capsys):
    # nanoGPT runs with --compile=False: the advice is to turn that on, not to edit the code
    script = write_script(tmp_path, FIXED)
    out = tmp_path / "report.txt"
    assert main(["shapes", "--steps", "4", "--target", "cpu", "-o", str(out), "--", "python", str(script),
                 "--compile=False"]) == 0
    assert "its own switch for it (--compile=False in this command)" in out.read_text()


def test_the_bucketing_advice_points_at_the_scripts_own_padding_switch(tmp_path):
    # Hugging Face's examples pad each batch to its longest unless --pad_to_max_length:
    # the script's own switch gives one shape without editing it.
    script = write_script(tmp_path, VARLEN.replace(
        "import torch\n", "import argparse\nimport torch\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--pad_to_max_length', action='store_true')\nparser.parse_args()\n", 1))
    out = tmp_path / "report.txt"
    assert main(["shapes", "--steps", "8", "--target", "cpu", "-o", str(out), "--", "python", str(script)]) == 0
    assert "its own switch for one shape: --pad_to_max_length pads every batch" in out.read_text()


def test_the_padding_switch_is_read_from_argparse_or_an_argument_dataclass(tmp_path):
    from torchaxe.shapes.cli import own_padding_switch

    script = tmp_path / "run_glue.py"
    script.write_text("from dataclasses import dataclass, field\n\n\n@dataclass\nclass DataArguments:\n"
                      "    pad_to_max_length: bool = field(default=True)\n")
    assert own_padding_switch(["python", str(script)]) == "--pad_to_max_length"
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--pad-to-max-length')\n")
    assert own_padding_switch(["python", str(script)]) == "--pad-to-max-length"
    # Passed already, not defined, or not a script file: nothing to point at.
    assert own_padding_switch(["python", str(script), "--pad-to-max-length"]) is None
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--max_length')\n")
    assert own_padding_switch(["python", str(script)]) is None
    assert own_padding_switch(["python", "-m", "torchaxe_missing_module"]) is None


def test_a_script_that_raises_after_its_first_steps_is_said_to_have_raised(tmp_path, capsys):
    # Seen in a review: exit 0 and a verdict, the exception nowhere.
    crashing = FIXED.replace("    opt.step()\n", "    opt.step()\n    if globals().setdefault('n', [0]).append(1) or "
                             "len(globals()['n']) == 3:\n        raise RuntimeError('boom at step 3')\n")
    script = write_script(tmp_path, crashing)
    code = main(["shapes", "--steps", "6", "--target", "cpu", "--format", "json", "--", "python", str(script)])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    report = json.loads(captured.out)
    assert report["warnings"][0].startswith("the script raised RuntimeError at ")
    assert "boom at step 3; the shapes are those of the steps before it" in report["warnings"][0]
