"""Behaviour of the optimizer (AX202-AX204) and data-loading (AX401-AX404) rules that
the inline examples do not pin down: layouts of multi-line calls, rules working
together on a realistic file, and fixes that must settle after one run."""

from __future__ import annotations

import ast

import pytest

from torchaxe.findings import Applicability
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source
from torchaxe.scan.rules import all_rules
from torchaxe.scan.rules.base import DOC_SECTIONS

OURS = ("AX202", "AX203", "AX204", "AX401", "AX402", "AX403", "AX404")


def _options(target: str, select: tuple[str, ...] = OURS, cpus: int = 16,
             decoders: tuple[str, ...] = ("torchvision", "cv2")) -> ScanOptions:
    return ScanOptions(target=target, select=select,
                       capabilities={**torch_capabilities(target), "cpus": cpus, "decoders": list(decoders)})


def _scan(source: str, target: str = "cpu", select: tuple[str, ...] = OURS, cpus: int = 16,
          decoders: tuple[str, ...] = ("torchvision", "cv2")):
    report = scan_source(source, "t.py", _options(target, select, cpus, decoders))
    assert not report.diagnostics, report.diagnostics
    return report.findings


def _fix(source: str, target: str = "cpu", select: tuple[str, ...] = OURS, unsafe: bool = True) -> str:
    result = fix_source(source, "t.py", _options(target, select), unsafe=unsafe)
    assert result.error is None, result.error
    ast.parse(result.fixed)
    again = fix_source(result.fixed, "t.py", _options(target, select), unsafe=unsafe)
    assert again.fixed == result.fixed, "fixing a second time changed the file"
    return result.fixed


# A training script written the way many are: every data-loading default left alone,
# a hand-rolled zero_grad, an apex optimizer.
TRAIN = '''\
"""Train a classifier."""
import argparse

import torch
from apex.optimizers import FusedAdam
from torch.utils.data import DataLoader
from PIL import Image


class Folder(torch.utils.data.Dataset):
    def __init__(self, paths, labels):
        self.paths, self.labels = paths, labels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            img = Image.open(f).convert("RGB")
        return img, self.labels[i]


def main(args):
    train = DataLoader(
        Folder(args.train, args.labels),
        batch_size=args.batch_size,
        shuffle=True,
    )
    val = DataLoader(Folder(args.val, args.val_labels), batch_size=256, num_workers=args.workers)
    opt = FusedAdam(
        model.parameters(),
        lr=args.lr,
        set_grad_none=True,
    )
    for epoch in range(args.epochs):
        for x, y in train:
            opt.zero_grad(set_to_none=False)
            loss = model(x.cuda()).cross_entropy(y.cuda())
            loss.backward()
            opt.step()
'''

TRAIN_FIXED_CUDA = '''\
"""Train a classifier."""
import argparse

import torch
from apex.optimizers import FusedAdam
from torch.utils.data import DataLoader
from PIL import Image


class Folder(torch.utils.data.Dataset):
    def __init__(self, paths, labels):
        self.paths, self.labels = paths, labels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            img = Image.open(f).convert("RGB")
        return img, self.labels[i]


def main(args):
    train = DataLoader(
        Folder(args.train, args.labels),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=4,
        pin_memory=True,
        persistent_workers=True,
    )
    val = DataLoader(Folder(args.val, args.val_labels), batch_size=256, num_workers=args.workers, pin_memory=True, persistent_workers=args.workers > 0)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=0, fused=True,
    )
    for epoch in range(args.epochs):
        for x, y in train:
            opt.zero_grad()
            loss = model(x.cuda()).cross_entropy(y.cuda())
            loss.backward()
            opt.step()
'''


def test_realistic_script_flags_each_problem_once():
    codes = sorted(f.code for f in _scan(TRAIN, "cuda"))
    assert codes == ["AX202", "AX204", "AX401", "AX402", "AX402", "AX403", "AX404"]


def test_realistic_script_fixes_settle_in_one_run():
    # AX401 adds workers on the first pass; AX403 then sees them and adds
    # persistent_workers on a later pass; a second run changes nothing.
    assert _fix(TRAIN, "cuda") == TRAIN_FIXED_CUDA


def test_realistic_script_safe_fixes_only_pin_memory():
    fixed = _fix(TRAIN, "cuda", unsafe=False)
    assert fixed.count("pin_memory=True") == 2
    assert "num_workers=4" not in fixed and "FusedAdam(" in fixed and "set_to_none=False" in fixed


def test_pil_decode_suggestion_reads_the_opened_path():
    (finding,) = _scan(TRAIN, "cuda", ("AX404",))
    assert finding.replacement == (
        "torchvision.io.decode_image(torchvision.io.read_file(self.paths[i]), mode=torchvision.io.ImageReadMode.RGB)"
    )
    assert "cv2.COLOR_BGR2RGB" in finding.message and "BGR" in finding.message
    assert "Folder.__getitem__" in finding.message
    assert finding.fix is not None and finding.fix.applicability is Applicability.DISPLAY_ONLY


def test_pil_decode_suggests_the_decoder_installed_here():
    # torchvision missing (no build for this torch), OpenCV there: OpenCV first.
    (finding,) = _scan(TRAIN, "cpu", ("AX404",), decoders=("cv2",))
    assert finding.replacement == "cv2.cvtColor(cv2.imread(self.paths[i], cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)"
    assert "torchvision is not installed here" in finding.message
    # Neither: torchvision first, and how to get either.
    (finding,) = _scan(TRAIN, "cpu", ("AX404",), decoders=())
    assert finding.replacement.startswith("torchvision.io.decode_image(")
    assert "neither is installed here: pip install torchvision, or opencv-python-headless" in finding.message
    # The installed decoders are found without importing them.
    assert set(torch_capabilities("cpu")["decoders"]) <= {"torchvision", "cv2"}


# ----------------------------------------------------------------- AX4xx layouts
@pytest.mark.parametrize(
    "source, fixed",
    [
        # Closing parenthesis on the last argument's line, trailing comma.
        (
            "from torch.utils.data import DataLoader\nl = DataLoader(ds,\n               batch_size=2,)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(ds,\n               batch_size=2, pin_memory=True,)\n",
        ),
        # No arguments but the dataset, a comment inside the call.
        (
            "from torch.utils.data import DataLoader\nl = DataLoader(\n    ds,  # the data\n)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(\n    ds,  # the data\n    pin_memory=True,\n)\n",
        ),
        # A comment after the last argument and no trailing comma.
        (
            "from torch.utils.data import DataLoader\nl = DataLoader(\n    ds  # the data\n)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(\n    ds,  # the data\n    pin_memory=True,\n)\n",
        ),
        # pin_memory passed by position: replaced where it stands.
        (
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, 8, False, None, None, 2, None,\n    False)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, 8, False, None, None, 2, None,\n    True)\n",
        ),
    ],
)
def test_pin_memory_fix_keeps_layout(source, fixed):
    assert _fix(source, "cuda", ("AX402",)) == fixed


def test_loader_rules_skip_unpacked_arguments_and_other_loaders():
    source = (
        "import torch\nfrom monai.data import DataLoader as MonaiLoader\n"
        "a = torch.utils.data.DataLoader(ds, *rest)\n"
        "b = torch.utils.data.DataLoader(ds, **cfg, num_workers=0)\n"
        "c = MonaiLoader(ds)\n"  # its second position is num_workers: not read by torch's
    )
    assert _scan(source, "cuda") == []


def test_one_dataloader_detector_serves_the_loop_rules_and_the_loader_rules():
    from torchaxe.scan.context import FileContext
    from torchaxe.scan.rules._dataloader import dataloader_kind, loader_call
    from torchaxe.scan.rules._tensors import is_loader

    source = (
        "import torch\nfrom monai.data import DataLoader as MonaiLoader\n"
        "a = torch.utils.data.DataLoader(ds, 8)\n"
        "b = MonaiLoader(ds, 2)\n"
        "c = DataLoader(ds, 8)\n"
        "d = make(ds)\n"
    )
    tree = ast.parse(source)
    ctx = FileContext("t.py", source, tree, "cuda")
    calls = [node.value for node in tree.body if isinstance(node, ast.Assign)]
    assert [dataloader_kind(ctx, call) for call in calls] == ["torch", "other", "other", None]
    # The loop rules saw MONAI's and an unbound DataLoader as loaders, the loader rules
    # did not: both now read the one answer, and keep their own use of it.
    assert [is_loader(ctx, call) for call in calls] == [True, True, True, False]
    assert [loader_call(call, ctx) is not None for call in calls] == [True, False, False, False]


def test_persistent_workers_parenthesises_low_precedence_expressions():
    source = "from torch.utils.data import DataLoader\nl = DataLoader(ds, num_workers=a if b else c)\n"
    fixed = _fix(source, "cpu", ("AX403",))
    assert "persistent_workers=(a if b else c) > 0" in fixed


@pytest.mark.parametrize(
    ("sampler", "flagged"),
    [
        ("RandomSampler(ds, replacement=True, num_samples=int(1e10))", False),  # minGPT's trainer
        ("RandomSampler(ds, True, 10**9)", False),
        ("RandomSampler(ds, replacement=True, num_samples=1000)", True),  # epochs of 1,000 samples
        ("RandomSampler(ds, num_samples=int(1e10))", True),  # without replacement it cannot draw that many
        ("RandomSampler(ds, replacement=True, num_samples=n)", True),  # unknown length
    ],
)
def test_persistent_workers_not_asked_of_a_loader_with_an_endless_sampler(sampler, flagged):
    source = (
        "from torch.utils.data import DataLoader, RandomSampler\n"
        f"sampler = {sampler}\n"
        "loader = DataLoader(ds, sampler=sampler, batch_size=8, num_workers=4)\n"
    )
    assert [f.code for f in _scan(source, select=("AX403",))] == (["AX403"] if flagged else [])


def test_loader_positions_match_the_installed_torch():
    import inspect

    from torch.utils.data import DataLoader

    from torchaxe.scan.rules._dataloader import POSITIONS

    params = inspect.signature(DataLoader.__init__).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    assert tuple(positional) == POSITIONS


def test_workers_fix_applies_to_explicit_zero_in_place():
    source = "from torch.utils.data import DataLoader\nl = DataLoader(ds, num_workers=0, shuffle=True)\n"
    assert _fix(source, "cpu", ("AX401",)) == (
        "from torch.utils.data import DataLoader\nl = DataLoader(ds, num_workers=4, shuffle=True)\n"
    )


@pytest.mark.parametrize("cpus,target,workers", [(2, "cpu", 1), (2, "cuda", 2), (1, "cpu", 1), (1, "npu", 1),
                                                 (3, "cpu", 2), (64, "cuda", 4)])
def test_the_worker_count_stays_within_the_cpus_the_process_may_use(cpus, target, workers):
    source = "from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True)\n"
    [finding] = _scan(source, target, ("AX401",), cpus=cpus)
    assert f"num_workers={workers} is a start" in finding.message
    assert f"within the {cpus} CPUs this process may use" in finding.message
    assert finding.replacement == f"DataLoader(..., num_workers={workers})"
    fixed = fix_source(source, "t.py", _options(target, ("AX401",), cpus), unsafe=True).fixed
    assert f"num_workers={workers})" in fixed


def test_the_cpus_are_the_processs_affinity(monkeypatch):
    import os

    from torchaxe.cpulist import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == 2 and torch_capabilities("cpu")["cpus"] == 2


def test_workers_advice_does_not_claim_decoding_and_knows_in_memory_tensors():
    # The loader's dataset comes from outside: nothing says what __getitem__ does.
    source = ("from torch.utils.data import DataLoader\n\n\ndef loader(ds):\n    return DataLoader(ds, batch_size=8)\n")
    [finding] = _scan(source, "cuda", ("AX401",))
    assert "decoded" not in finding.message and "__getitem__ and the collate function" in finding.message
    assert "TensorDataset" in finding.message and "This file builds" not in finding.message
    # A TensorDataset is built here but does not reach the loader in a way the rule follows.
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef loader(ds):\n"
              "    return DataLoader(ds, batch_size=8)\n\n\nl = loader(TensorDataset(torch.zeros(8, 2)))\n")
    [finding] = _scan(source, "cuda", ("AX401",))
    assert "This file builds a TensorDataset: if this loader reads it, its batches are tensors in memory " \
           "already and workers usually do not help" in finding.message
    # Followed through every binding of the name, or a function of the file that returns it: not flagged.
    for source in ("from torch.utils.data import DataLoader, TensorDataset\nds = TensorDataset(a)\n"
                   "ds = TensorDataset(b)\nl = DataLoader(ds)\n",
                   "import torch.utils.data as tud\n\n\ndef build():\n    return tud.TensorDataset(a)\n\n\n"
                   "l = tud.DataLoader(build())\n"):
        assert _scan(source, "cpu", ("AX401",)) == []
    # A name also bound to something else is not known to be in memory.
    source = ("from torch.utils.data import DataLoader, TensorDataset\nds = TensorDataset(a)\nds = Images(root)\n"
              "l = DataLoader(ds)\n")
    assert [f.code for f in _scan(source, "cpu", ("AX401",))] == ["AX401"]


def test_noqa_on_the_closing_line_of_a_multiline_loader():
    source = "from torch.utils.data import DataLoader\nl = DataLoader(\n    ds,\n)  # noqa: AX401\n"
    assert [f.code for f in _scan(source, "cpu", ("AX401",))] == []


def test_loader_messages_state_target_and_safety():
    source = "from torch.utils.data import DataLoader\nl = DataLoader(ds)\n"
    by_code = {f.code: f for f in _scan(source, "npu")}
    assert "unsafe" in by_code["AX401"].message and "pickle" in by_code["AX401"].message
    assert "safe" in by_code["AX402"].message and "unverified on Ascend" in by_code["AX402"].message
    cpu_codes = {f.code for f in _scan(source, "cpu")}
    assert "AX402" not in cpu_codes


def test_pil_helpers_count_only_when_a_dataset_uses_them():
    source = (
        "from PIL import Image\n\n\ndef load(path):\n    return Image.open(path)\n\n\n"
        "def preview(path):\n    return Image.open(path)\n\n\n"
        "class Data:\n    def __getitem__(self, i):\n        return load(self.paths[i])\n"
    )
    findings = _scan(source, "cpu", ("AX404",))
    assert [f.line for f in findings] == [5]
    assert "load, which Data.__getitem__ uses" in findings[0].message


# ----------------------------------------------------------------- AX2xx
def test_zero_grad_keeps_a_comment_inside_the_call():
    source = "import torch\nopt.zero_grad(\n    set_to_none=False,  # keep zeros\n)\n"
    fixed = _fix(source, "cpu", ("AX202",))
    assert "set_to_none" not in fixed and "# keep zeros" in fixed


def test_zero_grad_on_npu_defers_to_npu_fused_optimizers():
    # AX201 would turn this AdamW into NpuFusedAdamW, which needs set_to_none=False:
    # AX202 still explains, but applies nothing, so the two fixes cannot collide.
    source = (
        "import torch\nopt = torch.optim.AdamW(model.parameters())\n"
        "model.zero_grad(set_to_none=False)\n"
    )
    (finding,) = _scan(source, "npu", ("AX202",))
    assert finding.fix is not None and finding.fix.applicability is Applicability.DISPLAY_ONLY
    assert "NpuFused" in finding.message
    both = _fix(source, "npu", ("AX201", "AX202"))
    assert "NpuFusedAdamW" in both and "set_to_none=False" in both
    # On cuda the same file is fixed.
    assert "set_to_none" not in _fix(source, "cuda", ("AX202",))


def test_zero_grad_other_arguments_are_left_alone():
    assert _scan("import torch\nopt.zero_grad(True)\nopt.zero_grad(set_to_none=None)\n", "cpu", ("AX202",)) == []


def test_apex_adam_multiline_drops_apex_only_keywords_in_the_middle():
    source = (
        "import torch\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(\n"
        "    params,\n    lr=1e-3,\n    bias_correction=True,\n    adam_w_mode=True,\n"
        "    weight_decay=0.05,  # decoupled\n)\n"
    )
    fixed = _fix(source, "cuda", ("AX204",))
    assert fixed == (
        "import torch\nfrom apex.optimizers import FusedAdam\nopt = torch.optim.AdamW(\n"
        "    params,\n    lr=1e-3,\n    weight_decay=0.05,  # decoupled\n    fused=True,\n)\n"
    )


def test_apex_adam_keeps_comments_next_to_dropped_keywords():
    source = (
        "import torch\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(\n"
        "    params,  # all of them\n    set_grad_none=True,\n    lr=1e-3,  # tuned\n"
        "    adam_w_mode=True,  # AdamW\n    eps=1e-6)\n"
    )
    assert _fix(source, "cuda", ("AX204",)) == (
        "import torch\nfrom apex.optimizers import FusedAdam\nopt = torch.optim.AdamW(\n"
        "    params,  # all of them\n    lr=1e-3,  # tuned\n"
        "    # AdamW\n    eps=1e-6, weight_decay=0, fused=True)\n"
    )


def test_apex_last_keyword_after_a_comment_is_display_only():
    source = "import apex\nopt = apex.optimizers.FusedAdam(\n    params,  # p\n    bias_correction=True\n)\n"
    (finding,) = _scan(source, "cuda", ("AX204",))
    assert finding.fix is not None and finding.fix.applicability is Applicability.DISPLAY_ONLY
    assert "comments" in finding.message


def test_apex_on_cpu_offers_torch_fused_and_npu_mentions_unverified():
    source = "import apex\nopt = apex.optimizers.FusedSGD(params, lr=0.1)\n"
    (cpu,) = _scan(source, "cpu", ("AX204",))
    assert "cannot run on cpu" in cpu.message and cpu.replacement == "torch.optim.SGD(..., fused=True)"
    (npu,) = _scan(source, "npu", ("AX204",))
    assert "unverified on Ascend hardware" in npu.message
    assert npu.replacement == "torch_npu.optim.NpuFusedSGD(...)"


def test_apex_runtime_adam_mode_is_display_only():
    source = "import apex\nopt = apex.optimizers.FusedAdam(params, adam_w_mode=args.adamw)\n"
    (finding,) = _scan(source, "cuda", ("AX204",))
    assert finding.fix is not None and finding.fix.applicability is Applicability.DISPLAY_ONLY
    assert "only known at run time" in finding.message


def test_manual_update_inside_nested_function_is_not_the_loop_s():
    source = (
        "import torch\nfor p in model.parameters():\n"
        "    def hook(g, p=p):\n        p.data.add_(p.grad, alpha=-lr)\n"
        "    p.register_hook(hook)\n"
    )
    assert _scan(source, "cpu", ("AX203",)) == []


def test_manual_update_lr_expression_is_parenthesised_when_negated():
    source = "import torch\nfor p in model.parameters():\n    p.data -= (base_lr * scale) * p.grad\n"
    (finding,) = _scan(source, "cuda", ("AX203",))
    assert "lr=base_lr * scale," in finding.message and "alpha=-(base_lr * scale)" in finding.message
    source = "import torch\nfor p in model.parameters():\n    p.data.sub_(p.grad, alpha=a + b)\n"
    (finding,) = _scan(source, "cuda", ("AX203",))
    assert "alpha=-(a + b)" in finding.message


# ----------------------------------------------------------------- docs
@pytest.mark.parametrize("code", OURS)
def test_rule_documents_every_section(code):
    (rule,) = [r for r in all_rules() if r.code == code]
    assert tuple(rule.docs()) == DOC_SECTIONS
    assert all(rule.docs()[s].strip() for s in DOC_SECTIONS)
    assert rule.fix_title and rule.fix_safety is not None and rule.references


def test_a_momentum_buffer_loop_is_an_update_and_its_momentum_is_kept():
    # The held-out custom loop's form: weight decay and momentum kept per parameter.
    source = (
        "import torch\n\n\n@torch.no_grad()\ndef sgd_update(params, lr, bufs, momentum=0.9, weight_decay=1e-4):\n"
        "    for p in params:\n        if p.grad is None:\n            continue\n        d_p = p.grad\n"
        "        if weight_decay:\n            d_p = d_p.add(p.data, alpha=weight_decay)\n"
        "        buf = bufs.get(p)\n        if buf is None:\n            buf = bufs[p] = d_p.clone()\n"
        "        else:\n            buf.mul_(momentum).add_(d_p)\n        p.data.add_(buf, alpha=-lr)\n"
        "\n\nsgd_update(model.parameters(), 0.1, {})\n"
    )
    (finding,) = _scan(source, "cuda", ("AX203",))
    assert finding.line == 17
    assert finding.replacement == ("torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, "
                                   "fused=True)")
    # Weight decay written into the gradient, the review's GRU loop: kept as well.
    source = ("import torch\nparams = [p for p in model.parameters() if p.requires_grad]\nwith torch.no_grad():\n"
              "    for p, v in zip(params, velocity):\n"
              "        g = p.grad + args.weight_decay * p\n        v.mul_(args.momentum).add_(g)\n"
              "        p.sub_(lr * v)\n")
    (finding,) = _scan(source, "cpu", ("AX203",))
    assert finding.replacement == ("torch.optim.SGD(params, lr=lr, momentum=args.momentum, "
                                   "weight_decay=args.weight_decay, fused=True)")
    # A decay after the step (decoupled, as AdamW) is not SGD's weight_decay.
    source = ("import torch\nfor p in model.parameters():\n    p.data = p.data - lr * p.grad\n"
              "    p.data.mul_(1 - wd)\n")
    (finding,) = _scan(source, "cpu", ("AX203",))
    assert "weight_decay" not in finding.replacement
    # A buffer that only accumulates gradients, with the parameters left alone, is not an update.
    accumulate = "import torch\nfor p, acc in zip(model.parameters(), accs):\n    acc.add_(p.grad)\n"
    assert _scan(accumulate, "cuda", ("AX203",)) == []


HAND_ADAM = """\
import torch


class HandAdam:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = m / (1 - b1 ** self.t)
            v_hat = v / (1 - b2 ** self.t)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))


opt = HandAdam(model.parameters(), lr=args.lr)
"""


def test_a_hand_written_adam_class_is_an_adam_step_with_its_own_arguments():
    # Seen in a review: a PINN's Adam written as a plain class was not flagged (the
    # rule left every class alone), and would have been called SGD with momentum=b1.
    (finding,) = _scan(HAND_ADAM, "cpu", ("AX203",))
    assert finding.line == 22 and finding.message.startswith("hand-written Adam step")
    assert finding.replacement == "torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)"
    (npu,) = _scan(HAND_ADAM, "npu", ("AX203",))
    assert npu.replacement == "torch_npu.optim.NpuFusedAdam(model.parameters(), lr=args.lr)"
    # Built with arguments Adam does not take: the generic form.
    odd = HAND_ADAM.replace("opt = HandAdam(model.parameters(), lr=args.lr)",
                            "opt = HandAdam(model.parameters(), lr=args.lr, warmup=10)")
    odd = odd.replace("eps=1e-8):", "eps=1e-8, warmup=0):")
    (finding,) = _scan(odd, "cpu", ("AX203",))
    assert finding.replacement == "torch.optim.Adam(params, lr=lr, fused=True)"
    # A subclass of torch.optim.Optimizer is an optimizer's implementation: left alone.
    subclass = HAND_ADAM.replace("class HandAdam:", "class HandAdam(torch.optim.Optimizer):")
    assert _scan(subclass, "cpu", ("AX203",)) == []
    # A class that keeps an average of the weights (no gradient) is not an optimizer.
    ema = ("import torch\nclass EMA:\n    def __init__(self, params, decay):\n"
           "        self.params = list(params)\n        self.shadow = [p.clone() for p in self.params]\n"
           "    def update(self):\n        for s, p in zip(self.shadow, self.params):\n"
           "            s.mul_(0.99).add_(p, alpha=0.01)\n")
    assert _scan(ema, "cpu", ("AX203",)) == []


# An optimizer factory in the style many training repositories use: the keywords are
# collected in a dict, adjusted per optimizer, and spread into the constructor.
OPTIMIZER_FACTORY = '''\
import torch.optim as optim


def build(name, params, lr=None, weight_decay=0.0, momentum=0.9, **kwargs):
    opt_args = dict(weight_decay=weight_decay, **kwargs)
    if lr is not None:
        opt_args.setdefault("lr", lr)
    if name == "sgd":
        opt_args.pop("eps", None)
        return optim.SGD(params, momentum=momentum, **opt_args)
    if name == "adamw":
        return optim.AdamW(params, **opt_args)
    if name == "nadam":
        return optim.NAdam(params, **opt_args)
    raise ValueError(name)


def from_config(cfg, params):
    return optim.AdamW(params, **cfg.optimizer_params)


def maybe_fused(params, lr, use_fused):
    extra = {"fused": True} if use_fused else {}
    return optim.AdamW(params, lr=lr, **extra)


def explicit(params, lr, on_gpu):
    settings = {"lr": lr, "betas": (0.9, 0.95)}
    if on_gpu:
        settings["fused"] = True
    return optim.AdamW(params, **settings)


def plain(params, lr):
    settings = {"lr": lr, "betas": (0.9, 0.95)}
    return optim.Adam(params, **settings)
'''


def test_optimizer_keywords_from_a_dict_built_in_the_function_are_read():
    lines = sorted(f.line for f in _scan(OPTIMIZER_FACTORY, "cpu", ("AX201",)))
    # SGD and AdamW of build(), Adam of plain(); NAdam has no fused kernel; the config,
    # the conditional dict and the dict given fused=True may choose an implementation.
    assert lines == [10, 12, 36]


def test_optimizer_keywords_from_a_dict_fix_adds_fused_on_cpu():
    fixed = _fix(OPTIMIZER_FACTORY, "cpu", ("AX201",))
    assert "optim.SGD(params, momentum=momentum, **opt_args, fused=True)" in fixed
    assert "optim.Adam(params, **settings, fused=True)" in fixed
    assert "optim.AdamW(params, **cfg.optimizer_params)" in fixed


def test_optimizer_keywords_from_a_dict_on_npu():
    findings = {f.line: f for f in _scan(OPTIMIZER_FACTORY, "npu", ("AX201",))}
    assert sorted(findings) == [10, 12, 36]
    # build() merges its own **kwargs: the NPU optimizer may not take them.
    assert findings[12].fix.applicability == Applicability.DISPLAY_ONLY
    assert findings[36].fix.applicability == Applicability.UNSAFE
    assert "NpuFusedAdam(params, **settings)" in _fix(OPTIMIZER_FACTORY, "npu", ("AX201",))


def test_the_unfused_optimizer_message_names_the_torch_release_not_its_build():
    # Scanning for cuda with a CPU build installed: "torch 2.13.0", not "2.13.0+cpu".
    source = "import torch\nopt = torch.optim.AdamW(params)\n"
    report = scan_source(source, "t.py", ScanOptions(target="cuda", select=("AX201",), capabilities={
        "torch_version": "2.13.0+cpu", "fused_optimizers": ["AdamW"], "cpus": 4}))
    (finding,) = report.findings
    assert "(torch 2.13.0 supports it)" in finding.message and "+cpu" not in finding.message


def test_ax401_gives_advice_only_for_a_dataset_that_moves_its_samples_to_the_device() -> None:
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, Dataset\n\n\n"
        "class Base(Dataset):\n    def __getitem__(self, i):\n        x = torch.randn(8)\n"
        "        return x.cuda(non_blocking=True)\n\n\n"
        "class Cached(Base):\n    def __len__(self):\n        return 64\n\n\n"
        "train = Cached()\nloader = DataLoader(train, batch_size=8)\n")
    finding, = _scan(source, target="cuda", select=("AX401",))
    assert "Cached moves tensors to the device in the samples it makes (line 8)" in finding.message
    assert "CUDA cannot be initialised in a forked process" in finding.message
    assert finding.fix is None or finding.fix.applicability == Applicability.DISPLAY_ONLY
    assert _fix(source, target="cuda", select=("AX401",)) == source
    # A dtype cast, or a device that is the cpu, moves nothing: the fix stands.
    for stay in ("x.to(torch.float16)", "x.to(dtype=torch.float16)", "x.to('cpu')",
                 "torch.zeros(8, device='cpu') + x"):
        kept = source.replace("x.cuda(non_blocking=True)", stay)
        assert "num_workers=4" in _fix(kept, target="cuda", select=("AX401",)), stay


PYG_LOOP = '''import torch
from torch_geometric.loader import DataLoader

loader = DataLoader(dataset, 32, True, None, None, persistent_workers=False)
model = torch.nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for data in loader:
        opt.zero_grad()
        model(data.x).sum().backward()
        opt.step()
'''


def test_pytorch_geometric_loaders_are_read_by_their_own_positions():
    # Seen in a review: PyG's DataLoader (a subclass that passes num_workers on to
    # torch's) waited 26-30% of each step for its collate, and AX401 said nothing.
    findings = _scan(PYG_LOOP, select=("AX401", "AX402"), target="cuda")
    assert sorted(f.code for f in findings) == ["AX401", "AX402"]
    # Its fourth and fifth positions are follow_batch and exclude_keys, not sampler and
    # num_workers: the fix adds keywords and leaves them be.
    fixed = _fix(PYG_LOOP, select=("AX401",))
    assert "DataLoader(dataset, 32, True, None, None, persistent_workers=False, num_workers=" in fixed
