"""The AX3xx rules (host-device syncs and transfers) beyond their inline examples:
where findings point, what their messages say per target, which loops count as
training steps, which branches count as rare, and the exact text of their fixes."""

from __future__ import annotations

import ast

import pytest

from torchaxe.findings import Applicability
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions
from torchaxe.scan.fix import fix_source
from torchaxe.scan.rules import all_rules
from torchaxe.scan.rules._tensors import modulo_guard
from torchaxe.scan.rules.base import DOC_SECTIONS

SYNC_CODES = ("AX301", "AX302", "AX303", "AX304", "AX307")

LOOP_HEAD = (
    "import torch\n"
    "for step, (x, y) in enumerate(loader):\n"
    "    loss = criterion(model(x), y)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
)


def codes(report, prefix="AX3"):
    return sorted(f.code for f in report.findings if f.code.startswith(prefix))


def fix(source, target="cuda", unsafe=False, select=("AX3",)):
    options = ScanOptions(target=target, select=select, capabilities=torch_capabilities(target))
    result = fix_source(source, "t.py", options, unsafe=unsafe)
    assert result.error is None
    return result.fixed


# ------------------------------------------------------------------ metadata
def test_ax3_rules_document_themselves():
    rules = [r for r in all_rules() if r.code.startswith("AX3")]
    assert [r.code for r in rules] == ["AX301", "AX302", "AX303", "AX304", "AX305", "AX306", "AX307"]
    for rule in rules:
        assert tuple(rule.docs()) == DOC_SECTIONS, rule.code
        assert set(rule.targets) == {"cuda", "npu"}, rule.code
        assert rule.category in ("host_sync_in_loop", "host_tensor_to_device")
        assert rule.name == rule.name.lower() and " " not in rule.name
    assert {r.code for r in rules if r.category == "host_sync_in_loop"} == set(SYNC_CODES)


# ------------------------------------------------------------------ positions
def test_positions_point_at_the_sync(scan):
    source = LOOP_HEAD + (
        "    total += loss.item()\n"
        "    print(f'loss {loss:.3f}')\n"
        "    if torch.isnan(loss) or done:\n"
        "        break\n"
        "    torch.cuda.synchronize()\n"
    )
    found = {f.code: f for f in scan(source, target="cuda", select=("AX3",)).findings}
    assert (found["AX301"].line, found["AX301"].col, found["AX301"].end_col) == (6, 14, 25)
    # Inside the f-string: the tensor itself, not the whole string.
    assert (found["AX302"].line, found["AX302"].col, found["AX302"].end_col) == (7, 19, 23)
    # The part of the condition that is a tensor.
    assert (found["AX303"].line, found["AX303"].col, found["AX303"].end_col) == (8, 8, 25)
    assert (found["AX304"].line, found["AX304"].col) == (10, 5)
    assert found["AX301"].snippet == "    total += loss.item()"


def test_one_finding_per_read_chain(scan):
    source = LOOP_HEAD + (
        "    preds.append(loss.detach().cpu().numpy())\n    print(f'{loss.item():.3f}')\n    print(float(loss))\n"
    )
    findings = scan(source, target="cuda", select=("AX3",)).findings
    assert codes_of(findings) == ["AX301", "AX301", "AX302"]
    chain = findings[0]
    assert chain.line == 6 and source.splitlines()[5][chain.col - 1 : chain.end_col - 1] == "loss.detach().cpu()"


def codes_of(findings):
    return sorted(f.code for f in findings)


# ------------------------------------------------------------------ messages
@pytest.mark.parametrize("target,word,module", [("cuda", "GPU", "torch.cuda"), ("npu", "NPU", "torch.npu")])
def test_messages_name_the_target(scan, target, word, module):
    source = LOOP_HEAD + "    total += loss.item()\n    torch.cuda.synchronize()\n    b = torch.zeros(3).cuda()\n"
    found = {f.code: f for f in scan(source, target=target, select=("AX3",)).findings}
    assert word in found["AX301"].message and "every step" in found["AX301"].message
    assert f"{module}.Event" in found["AX304"].message
    assert word in found["AX305"].message
    for f in found.values():
        assert f.target == target


def test_sync_rules_are_silent_on_cpu(scan):
    source = LOOP_HEAD + (
        "    total += loss.item()\n"
        "    print(loss)\n"
        "    if loss > 10:\n"
        "        break\n"
        "    torch.cuda.synchronize()\n"
        "    w = torch.zeros(3).cuda()\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == ["AX301", "AX302", "AX303", "AX304", "AX305"]
    assert codes(scan(source, target="cpu", select=("AX3",))) == []


def test_display_only_findings_carry_no_edits(scan):
    source = LOOP_HEAD + "    total += loss.item()\n"
    (finding,) = scan(source, target="cuda", select=("AX301",)).findings
    data = finding.to_dict()
    assert data["fix"]["applicability"] == "display-only" and data["fix"]["edits"] == []
    assert data["category"] == "host_sync_in_loop"
    assert fix(source) == source


# ----------------------------------------------------------- training loops
EPOCH = (
    "import torch\n"
    "for epoch in range(10):\n"
    "    for x, y in train_loader:\n"
    "        loss = criterion(model(x), y)\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "    for x, y in val_loader:\n"
    "        out = model(x)\n"
    "        correct += (out.argmax(1) == y).sum().item()\n"
    "        print(float(criterion(out, y)))\n"
    "        if torch.isnan(out).any():\n"
    "            break\n"
    "        torch.cuda.synchronize()\n"
    "    print(f'epoch {epoch} loss {loss.item()} {loss}')\n"
    "    scheduler.step()\n"
)


def test_eval_loop_inside_epoch_loop_is_not_a_training_loop(scan):
    assert codes(scan(EPOCH, target="cuda", select=("AX3",))) == []


def test_lr_scheduler_step_does_not_make_a_training_loop(scan):
    source = (
        "import torch\n"
        "from torch.optim.lr_scheduler import StepLR\n"
        "sched = StepLR(optimizer, 1)\n"
        "lr_policy = StepLR(optimizer, 1)\n"
        "for epoch in range(10):\n"
        "    acc = train_one_epoch(model, loader)\n"
        "    sched.step()\n"
        "    lr_policy.step()\n"
        "    history.append(acc.item())\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == []


def test_gradient_accumulation_loops_are_training_loops(scan):
    source = (
        "import torch\n"
        "for batch in loader:\n"
        "    for micro in batch.split(4):\n"
        "        loss = model(micro)\n"
        "        loss.backward()\n"
        "        seen += loss.item()\n"
        "    opt.step()\n"
        "    print(loss)\n"
    )
    found = scan(source, target="cuda", select=("AX3",)).findings
    assert [(f.code, f.line) for f in found] == [("AX301", 6), ("AX302", 8)]


def test_code_run_once_per_loop_is_not_in_it(scan):
    source = (
        "import torch\n"
        "for x in torch.randn(3).cuda().tolist():\n"
        "    model(x).backward()\n"
        "    opt.step()\n"
        "else:\n"
        "    print(x.item())\n"
        "while True:\n"
        "    model(x).backward()\n"
        "    opt.step()\n"
        "    class Logger:\n"
        "        last = loss.item()\n"
        "    cb = lambda: loss.item()\n"
    )
    assert codes(scan(source, target="cuda", select=("AX301", "AX302"))) == []


# -------------------------------------------------------------- rare branches
@pytest.mark.parametrize(
    "test,side",
    [
        ("step % 100 == 0", "body"),
        ("(step + 1) % args.log_every == 0", "body"),
        ("i % log_interval == 0 and rank == 0", "body"),
        ("step % 100 == 0 or step == last", "body"),
        ("not step % 50", "body"),
        ("step % 100", "orelse"),
        ("step % 100 != 0", "orelse"),
        ("not (step % 100 == 0)", "orelse"),
        ("step % 2 == 0", None),
        ("step % 100 == 0 or mode == 'train'", None),
        ("'%d' % step", None),
        ("rank == 0", None),
    ],
)
def test_modulo_guard(test, side):
    assert modulo_guard(ast.parse(test, mode="eval").body) == side


def test_syncs_in_rare_branches_are_not_reported(scan):
    source = LOOP_HEAD + (
        "    if step % args.log_every == 0:\n"
        "        print(loss.item(), float(loss))\n"
        "        torch.cuda.synchronize()\n"
        "    if step % 100:\n"
        "        pass\n"
        "    else:\n"
        "        print(loss)\n"
        "    try:\n"
        "        pass\n"
        "    except RuntimeError:\n"
        "        print(loss.item())\n"
        "    assert ok, f'bad loss {loss}'\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == []


def test_a_flag_set_before_an_accumulation_loop_guards_a_rare_branch(scan):
    # StyleGAN2: the path-length penalty runs every 32 steps, its flag set before the
    # loop over accumulated micro-batches; the same read under a flag the loop
    # reassigns every iteration is not rare.
    source = (
        "import numpy as np\nimport torch\n"
        "def train(self, loader, opt):\n"
        "    apply_path_penalty = self.steps > 5000 and self.steps % 32 == 0\n"
        "    for i in range(self.accumulate):\n"
        "        loss = self.G(next(loader)).mean()\n"
        "        if apply_path_penalty:\n"
        "            pl = self.pl(loss)\n"
        "            avg = np.mean(pl.detach().cpu().numpy())\n"
        "        loss.backward()\n"
        "    opt.step()\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == []
    every = source.replace("        if apply_path_penalty:", "        apply_path_penalty = i >= 0\n        if apply_path_penalty:")
    assert codes(scan(every, target="cuda", select=("AX3",))) == ["AX301"]


def test_an_item_of_a_batch_dict_moved_to_the_device_is_a_device_tensor(scan):
    # GaLore counts tokens with ``.item()`` on the batch it moved with a dict
    # comprehension: a sync every micro-batch. The batch as the loader gave it lives on
    # the host: no sync.
    source = (
        "import torch\n"
        "def main(dataloader, model, device, pad_idx, optimizer):\n"
        "    tokens_seen = 0\n"
        "    for batch in dataloader:\n"
        "        batch = {k: v.to(device) for k, v in batch.items()}\n"
        "        tokens_seen += (batch['input_ids'] != pad_idx).sum().item()\n"
        "        loss = model(**batch).loss\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == ["AX301"]
    on_host = source.replace("        batch = {k: v.to(device) for k, v in batch.items()}\n", "")
    assert codes(scan(on_host, target="cuda", select=("AX3",))) == []
    listed = source.replace("{k: v.to(device) for k, v in batch.items()}", "{'input_ids': ids, 'n': len(ids)}")
    assert codes(scan(listed.replace("for batch in dataloader:", "for ids in dataloader:"),
                      target="cuda", select=("AX3",))) == []


def test_a_modulus_the_file_sets_to_a_small_constant_is_no_rare_branch(scan):
    # llama2.c: `log_interval = 1` at the top, `if iter_num % log_interval == 0:` reads
    # the loss every step.
    body = ("    if step % log_interval == 0:\n"
            "        lossf = loss.item()\n")
    every_step = "log_interval = 1\n" + LOOP_HEAD + body
    assert codes(scan(every_step, target="cuda", select=("AX301",))) == ["AX301"]
    for rare in ("log_interval = 100\n", "log_interval = 1\nlog_interval = args.n\n", ""):
        assert codes(scan(rare + LOOP_HEAD + body, target="cuda", select=("AX301",))) == [], rare


def test_a_rare_flag_set_earlier_in_the_loop_makes_its_branch_rare(scan):
    source = LOOP_HEAD + (
        "    last_batch = step == len(loader) - 1\n"
        "    is_console_step = (step % args.log_every == 0) or last_batch\n"
        "    is_metric_step = (step % metric_every == 0) or is_console_step\n"
        "    if is_metric_step:\n"
        "        print(loss.item())\n"
        "    g_regularize = step % args.g_reg_every == 0\n"
        "    if g_regularize:\n"
        "        print(float(loss))\n"
        # A flag set two ways, one of them every step, is no guard.
        "    show = step % 100 == 0\n"
        "    if args.verbose:\n"
        "        show = True\n"
        "    if show:\n"
        "        print(loss.item())\n"
    )
    assert [f.line for f in scan(source, target="cuda", select=("AX301",)).findings] == [18]


def test_a_function_of_the_file_that_returns_numbers_is_not_a_tensor(scan):
    # Named like a loss, but its returns are numbers; the other returns a tensor.
    source = (
        "import math\n"
        "import torch\n"
        "def get_loss_scale(args, batch):\n"
        "    if args.mode == 'none':\n"
        "        return 1.0\n"
        "    return math.sqrt(batch.size / args.batch_size)\n"
        "def compute_loss(out, y):\n"
        "    return ((out - y) ** 2).mean()\n"
        "for step, (x, y) in enumerate(loader):\n"
        "    loss = compute_loss(model(x), y)\n"
        "    loss_scale = get_loss_scale(args, x)\n"
        "    if loss_scale != 1.0:\n"
        "        loss = loss * loss_scale\n"
        "    if compute_loss(model(x), y) > 3:\n"
        "        print('large')\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    assert [(f.code, f.line) for f in scan(source, target="cuda", select=("AX303",)).findings] == [("AX303", 14)]


def test_functions_of_the_file_that_call_each_other_are_judged_without_end(scan):
    source = (
        "import torch\n"
        "def f(x):\n"
        "    if x is None:\n"
        "        return 1.0\n"
        "    return g(x)\n"
        "def g(x):\n"
        "    return f(x) * 2\n"
        "for x, y in loader:\n"
        "    loss = criterion(model(x), y)\n"
        "    if f(x) > 1:\n"
        "        print(loss.item())\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    report = scan(source, target="cuda", select=("AX3",))
    assert not report.diagnostics, report.diagnostics  # not "nested too deeply"
    assert [(f.code, f.line) for f in report.findings] == [("AX301", 11)]


def test_frequent_branches_are_reported(scan):
    source = LOOP_HEAD + (
        "    if step % 2 == 0:\n"
        "        print(loss.item())\n"
        "    if step % 100:\n"
        "        print(loss.item())\n"
        "    if rank == 0:\n"
        "        print(loss.item())\n"
    )
    assert [f.line for f in scan(source, target="cuda", select=("AX301",)).findings] == [7, 9, 11]


# ------------------------------------------------------------ tensor guesses
def test_non_tensors_are_not_converted(scan):
    source = LOOP_HEAD + (
        "    lr = float(args.lr)\n"
        "    print(f'epoch {epoch} step {step}', lr, x.shape, x.dtype, len(loader))\n"
        "    n = int(x.size(0))\n"
        "    print(model, criterion, opt)\n"
        "    if loss is None or model.training:\n"
        "        pass\n"
        "    accelerator.backward(loss)\n"
        "    print(accelerator.num_processes)\n"
        "    print('%d steps' % step, '{}'.format(epoch))\n"
    )
    assert codes(scan(source, target="cuda", select=("AX302", "AX303"))) == []


def test_names_follow_their_latest_binding(scan):
    source = LOOP_HEAD + (
        "    norm = clip(model)\n"
        "    norm = norm.item() if isinstance(norm, torch.Tensor) else norm\n"
        "    print(norm)\n"
        "    value = loss.detach()\n"
        "    print(value)\n"
        "    value = value.item()\n"
        "    print(value)\n"
    )
    found = scan(source, target="cuda", select=("AX302",)).findings
    assert [f.line for f in found] == [10]


def test_a_binding_later_in_the_loop_reaches_the_next_iteration(scan):
    source = (
        "import torch\n"
        "total = 0.0\n"
        "for x, y in loader:\n"
        "    print(total)\n"
        "    loss = criterion(model(x), y)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    total = total + loss\n"
    )
    assert [f.line for f in scan(source, target="cuda", select=("AX302",)).findings] == [4]


def test_a_conditional_binding_does_not_hide_an_earlier_one(scan):
    source = LOOP_HEAD + ("    out = model(x)\n    if world > 1:\n        out = gather(out)\n    print(out)\n")
    assert [f.line for f in scan(source, target="cuda", select=("AX302",)).findings] == [9]


# ------------------------------------------------------------------ AX305
def test_ax305_fix_keeps_a_multiline_chain_layout():
    source = "import torch\nmask = (\n    torch.ones(n, n)\n    .triu()\n    .to(device)\n)\n"
    assert fix(source) == "import torch\nmask = (\n    torch.ones(n, n, device=device)\n    .triu()\n)\n"


def test_ax305_random_factories_need_unsafe_fixes():
    source = "import torch\nz = torch.randn(4, 8).cuda()\nw = torch.zeros(4).npu()\n"
    assert fix(source, target="npu") == 'import torch\nz = torch.randn(4, 8).cuda()\nw = torch.zeros(4, device="npu")\n'
    assert fix(source, target="npu", unsafe=True) == (
        'import torch\nz = torch.randn(4, 8, device="cuda")\nw = torch.zeros(4, device="npu")\n'
    )


def test_ax305_moves_with_more_than_a_device_are_advice_only(scan):
    source = (
        "import torch\n"
        "a = torch.tensor(x).to(device, non_blocking=True)\n"
        "b = torch.tensor(x).to(device, torch.float16)\n"
        "c = torch.arange(4).cuda(1)\n"
    )
    found = scan(source, target="cuda", select=("AX305",)).findings
    assert len(found) == 3
    assert all(f.fix.applicability is Applicability.DISPLAY_ONLY and not f.fix.edits for f in found)
    assert fix(source) == source


def test_ax305_from_numpy_only_in_loops(scan):
    once = "import torch\nx = torch.from_numpy(a).cuda()\n"
    looped = "import torch\nfor a in arrays:\n    x = torch.from_numpy(a).cuda()\n"
    assert codes(scan(once, target="cuda", select=("AX305",))) == []
    (finding,) = scan(looped, target="cuda", select=("AX305",)).findings
    assert "pin_memory()" in finding.message and "non_blocking=True" in finding.message
    assert "on every iteration of `for a in arrays`" in finding.message
    assert finding.fix.applicability is Applicability.DISPLAY_ONLY


def test_ax305_names_the_loop_that_repeats_the_copy(scan):
    # an epoch loop's iteration is not a training step: the message names the loop
    source = (
        "import torch\n"
        "for epoch in range(args.epochs):\n"
        "    train(epoch)\n"
        "    sample = torch.randn(64, 20).to(device)\n"
        "while running:\n"
        "    x = torch.zeros(8).cuda()\n"
    )
    first, second = scan(source, target="cuda", select=("AX305",)).findings
    assert "on every iteration of `for epoch in range(args.epochs)`" in first.message
    assert "on every iteration of `while running`" in second.message


# ------------------------------------------------------------------ AX306
PINNED = (
    "import torch\n"
    "from torch.utils.data import DataLoader\n"
    "loader = DataLoader(ds, **{'batch_size': 8, 'pin_memory': True})\n"
    "for batch in loader:\n"
    "    batch = batch.to(device)\n"
    "    x, y = batch\n"
    "    x = x.cuda()\n"
    "    y = y.to(\n"
    "        device\n"
    "    )\n"
    "    loss = model(x, y)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
)


def test_ax306_item_copies_are_safe_whole_batches_unsafe(scan):
    found = scan(PINNED, target="cuda", select=("AX306",)).findings
    assert [(f.line, f.fix.applicability) for f in found] == [
        (5, Applicability.UNSAFE),
        (7, Applicability.SAFE),
        (8, Applicability.SAFE),
    ]
    safe = fix(PINNED)
    assert "batch = batch.to(device)\n" in safe
    assert "x = x.cuda(non_blocking=True)\n" in safe
    assert "    y = y.to(\n        device, non_blocking=True\n    )\n" in safe
    assert "batch = batch.to(device, non_blocking=True)\n" in fix(PINNED, unsafe=True)


def test_ax306_needs_a_pinned_loader_and_a_training_loop(scan):
    unpinned = PINNED.replace("'pin_memory': True", "'pin_memory': False")
    assert codes(scan(unpinned, target="cuda", select=("AX306",))) == []
    no_training = PINNED.replace("    loss.backward()\n    opt.step()\n", "")
    assert codes(scan(no_training, target="cuda", select=("AX306",))) == []


def test_noqa_on_the_last_line_of_a_multiline_call(scan):
    source = PINNED.replace("        device\n    )\n", "        device\n    )  # noqa: AX306\n")
    assert [f.line for f in scan(source, target="cuda", select=("AX306",)).findings] == [5, 7]


def test_fixes_compose_across_ax3_rules():
    source = PINNED + "    mask = torch.ones(4).to(device)\n    print(loss.item())\n"
    fixed = fix(source, unsafe=True)
    assert "mask = torch.ones(4, device=device)\n" in fixed
    assert "x = x.cuda(non_blocking=True)\n" in fixed
    assert "print(loss.item())\n" in fixed  # advice only
    assert fix(fixed, unsafe=True) == fixed


def test_ax306_batches_from_next_over_a_loader_wrapper(scan):
    source = (
        "import torch\n"
        "loader = torch.utils.data.DataLoader(ds, pin_memory=True)\n"
        "batches = infinite(loader)\n"
        "train_iter = iter(loader)\n"
        "for step in range(steps):\n"
        "    batch = next(batches)\n"
        "    x, y = next(train_iter)\n"
        "    batch = batch.to(device)\n"
        "    x = x.to(device)\n"
        "    model(batch, x).backward()\n"
        "    opt.step()\n"
    )
    found = scan(source, target="cuda", select=("AX306",)).findings
    assert [(f.line, f.fix.applicability) for f in found] == [(8, Applicability.UNSAFE), (9, Applicability.SAFE)]
    assert "accepts non_blocking" in found[0].message


def test_ax302_names_the_tensor_inside_an_f_string(scan):
    source = LOOP_HEAD + "    log(f'step {step} loss {loss:.4f}')\n"
    (finding,) = scan(source, target="npu", select=("AX302",)).findings
    assert finding.message.startswith("`{loss}` in an f-string converts a tensor")
    assert "NPU" in finding.message and "loss.detach()" in finding.message


@pytest.mark.parametrize(
    "factory,safety",
    [
        ("torch.arange(n)", Applicability.SAFE),
        ("torch.arange(0, n, 2, dtype=torch.long)", Applicability.SAFE),
        ("torch.arange(0, 1, 0.1)", Applicability.UNSAFE),
        ("torch.arange(n, dtype=torch.float32)", Applicability.UNSAFE),
        ("torch.arange(n) / n", None),
        ("torch.linspace(0, 1, 5)", Applicability.UNSAFE),
        ("torch.full((2,), 0.5)", Applicability.SAFE),
        ("torch.eye(3)", Applicability.SAFE),
        ("torch.randint(0, 9, (3,))", Applicability.UNSAFE),
    ],
)
def test_ax305_fix_safety_follows_exactness(scan, factory, safety):
    found = scan(f"import torch\nx = {factory}.to(device)\n", target="cuda", select=("AX305",)).findings
    if safety is None:
        assert found == []  # the move applies to an expression, not to the factory
    else:
        assert [f.fix.applicability for f in found] == [safety]


def test_ax305_comprehensions_count_as_loops(scan):
    source = "import torch\nxs = [torch.from_numpy(a).cuda() for a in arrays]\nys = [torch.tensor(a).cuda() for a in arrays]\n"
    found = scan(source, target="cuda", select=("AX305",)).findings
    assert len(found) == 2 and all("for every element of the comprehension" in f.message for f in found)


# ------------------------------------------------------------------ steps taken by helpers
# Training loops whose optimizer step is not written in the loop: a loss-scaler object
# called with the loss and the optimizer, a GradScaler stepping the optimizer, a step
# method the loop calls, Lightning's manual optimisation. Their syncs run every step.
SCALER_LOOP = """\
import math
import torch


def train_one_epoch(model, loader, optimizer, loss_scaler, device):
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda"):
            loss = model(images, labels)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise SystemExit(1)
        loss_scaler(loss, optimizer, parameters=model.parameters())
        optimizer.zero_grad()
        torch.cuda.synchronize()


def evaluate(model, loader):
    for images, labels in loader:
        loss = model(images, labels)
        print(loss.item())


def fit(model, loader, optimizer, scaler, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda"):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            print(f"loss {loss.item():.3f}")
        save(model, optimizer, epoch, loss)
        print(f"last loss {loss.item():.3f}")
"""


def test_a_loss_scaler_or_grad_scaler_steps_the_loop(scan):
    found = sorted((f.line, f.code) for f in scan(SCALER_LOOP, target="cuda", select=("AX3",)).findings)
    # loss.item() and synchronize() of the scaler loop, loss.item() of the GradScaler
    # loop; not the evaluation loop, not the epoch loop that saves a checkpoint.
    assert found == [(10, "AX301"), (15, "AX304"), (32, "AX301")]


STEP_METHOD_LOOP = """\
import torch


class Trainer:
    def run_loop(self):
        while self.step < self.steps:
            batch = next(self.data).to("cuda")
            self.run_step(batch)
            if self.log_loss:
                print(self.last_loss.item())
            self.step += 1

    def run_step(self, batch):
        self.forward_backward(batch)
        if self.use_fp16:
            self.optimize_fp16()
        else:
            self.opt.step()

    def forward_backward(self, batch):
        loss = self.model(batch)
        self.last_loss = loss.detach()
        loss.backward()

    def optimize_fp16(self):
        if any(not torch.isfinite(p.grad).all() for p in self.params):
            self.scale /= 2
            return
        self.log_grad_norm()
        self.opt.step()

    def log_grad_norm(self):
        total = 0.0
        for p in self.params:
            total += (p.grad ** 2).sum().item()
        self.logger.log(total)
        if self.verbose:
            self.report_memory()

    def report_memory(self):
        print(torch.cuda.memory_allocated())
        print(self.buffer.cpu())

    def evaluate(self):
        for batch in self.val:
            print(self.model(batch).item())
"""


def test_a_step_method_called_from_the_loop_makes_it_a_training_loop(scan):
    found = sorted((f.line, f.code) for f in scan(STEP_METHOD_LOOP, target="cuda", select=("AX3",)).findings)
    # The loop's own read (line 10), the check inside the fp16 step (line 26, a step
    # method called from a step method) and the read in the helper every fp16 step
    # calls (line 35); not the helper it calls only when verbose, nothing in evaluate().
    assert found == [(10, "AX301"), (26, "AX303"), (35, "AX301")]


LIGHTNING_MANUAL = """\
import torch
import lightning as L


class GAN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch):
        opt_g, opt_d = self.optimizers()
        imgs = batch.to(self.device)
        g_loss = self.generator_loss(imgs)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        d_loss = self.discriminator_loss(imgs)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.history.append(d_loss.item())

    def validation_step(self, batch):
        self.history.append(self.generator_loss(batch).item())
"""


def test_lightning_manual_optimisation_training_step_is_a_step(scan):
    found = [(f.line, f.code) for f in scan(LIGHTNING_MANUAL, target="cuda", select=("AX3",)).findings]
    assert found == [(21, "AX301")]


def test_a_function_calling_itself_is_no_training_step(scan):
    source = (
        "import torch\n"
        "def repackage(h):\n"
        "    if isinstance(h, torch.Tensor):\n"
        "        return h.detach()\n"
        "    return tuple(repackage(v) for v in h)\n"
        "for x in loader:\n"
        "    h = repackage(h)\n"
        "    print(h[0].sum().item())\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == []


def test_the_device_accumulation_names_the_tensor_read(scan):
    # DCGAN's `D_x = output.mean().item()`: the advice accumulates what was read.
    source = LOOP_HEAD + "    D_x = model(x).mean().item()\n    total += loss.item()\n"
    found = [f for f in scan(source, target="cuda", select=("AX301",)).findings]
    assert [f.replacement.split("  #")[0] for f in found] == ["total += model(x).mean().detach()",
                                                             "total += loss.detach()"]


def test_an_rl_loops_action_is_needed_now_and_its_training_step_under_a_modulo_is_every_step(scan):
    """A DQN loop: the greedy action reaches env.step in the same iteration (the read
    cannot be deferred: the advice says how to make it rarer), and the optimizer step
    runs under `if global_step % train_frequency == 0`, so the loss read there is on
    every training step, not a rare one."""
    source = (
        "import torch\n"
        "for global_step in range(total_timesteps):\n"
        "    q_values = q_network(torch.Tensor(obs).to(device))\n"
        "    action = torch.argmax(q_values, dim=1).cpu().numpy()[0]\n"
        "    next_obs, reward, done, info = env.step(action)\n"
        "    if global_step % args.train_frequency == 0:\n"
        "        loss = criterion(q_network(b_obs), target)\n"
        "        losses.append(loss.item())\n"
        "        optimizer.zero_grad()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "    if global_step % args.log_every == 0:\n"
        "        print(loss.item())\n"
    )
    found = sorted((f.line, f) for f in scan(source, target="cuda", select=("AX301",)).findings)
    assert [line for line, _ in found] == [4, 8]
    action, loss = found[0][1], found[1][1]
    assert "for `env.step(action)`, which needs it before the next step" in action.message
    assert "total +=" not in action.message and action.replacement is None
    assert "accumulate on the device" in loss.message


def test_a_guarded_extra_backward_beside_the_main_step_stays_rare(scan):
    # StyleGAN2's lazy regularisation: its own backward every 16 iterations, beside the
    # main step's; what it reads runs on one iteration in 16.
    source = (
        "import torch\n"
        "for i in range(iters):\n"
        "    loss = criterion(model(x), y)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    if i % args.reg_every == 0:\n"
        "        reg = penalty(model)\n"
        "        reg.backward()\n"
        "        opt.step()\n"
        "        mean_len = reg.item()\n"
    )
    assert scan(source, target="cuda", select=("AX301",)).findings == []


def test_a_helper_every_training_iteration_calls_syncs_every_step(scan):
    # StarGAN v2: the loss helper reads its parts with .item() and the loop calls it
    # outside any branch, before backward(); a helper called only when logging does not.
    source = (
        "import torch\n"
        "def compute_d_loss(nets, x, y):\n"
        "    loss_real = nets.D(x).mean()\n"
        "    loss_fake = nets.D(nets.G(y)).mean()\n"
        "    loss = loss_real + loss_fake\n"
        "    return loss, {'real': loss_real.item(), 'fake': loss_fake.item()}\n"
        "def report(loss):\n"
        "    return loss.item()\n"
        "def train(nets, opt, loader):\n"
        "    for i, (x, y) in enumerate(loader):\n"
        "        d_loss, parts = compute_d_loss(nets, x.cuda(), y.cuda())\n"
        "        opt.zero_grad()\n"
        "        d_loss.backward()\n"
        "        opt.step()\n"
        "        if i % 100 == 0:\n"
        "            print(report(d_loss))\n"
    )
    found = scan(source, target="cuda", select=("AX301",)).findings
    assert [f.line for f in found] == [6, 6]


def test_a_helper_of_another_file_that_reads_the_host_is_reported_at_the_call(tmp_path):
    # VITS: ``commons.clip_grad_value_(net_g.parameters(), None)`` every step, its
    # ``param_norm.item()`` in commons.py; GNN benchmarks: a metric imported under
    # another name.
    from pathlib import Path

    from torchaxe.scan.engine import scan_paths

    (tmp_path / "commons.py").write_text(
        "import torch\n\n"
        "def clip_grad_value_(parameters, clip_value):\n"
        "    total = 0\n"
        "    for p in parameters:\n"
        "        norm = p.grad.data.norm(2)\n"
        "        total += norm.item() ** 2\n"
        "    return total\n\n"
        "def maybe_log(loss, every):\n"
        "    if every:\n"
        "        print(loss.item())\n"
    )
    (tmp_path / "metrics.py").write_text(
        "import torch\n\ndef accuracy_SBM(scores, targets):\n    S = targets.cpu().numpy()\n    return S.mean()\n")
    (tmp_path / "train.py").write_text(
        "import torch\nimport commons\nfrom metrics import accuracy_SBM as accuracy\n\n"
        "def train(model, loader, opt):\n"
        "    for x, y in loader:\n"
        "        loss = model(x).sum()\n"
        "        loss.backward()\n"
        "        commons.clip_grad_value_(model.parameters(), None)\n"
        "        acc = accuracy(model(x), y)\n"
        "        commons.maybe_log(loss, 0)\n"
        "        opt.step()\n"
    )
    options = ScanOptions(target="cuda", select=("AX301",), capabilities=torch_capabilities("cuda"))
    found = sorted((Path(f.path).name, f.line) for f in scan_paths([tmp_path], options).findings)
    # maybe_log reads only under a branch: not every call.
    assert found == [("train.py", 9), ("train.py", 10)]
    # The helpers' files not scanned: nothing is known of them.
    assert scan_paths([tmp_path / "train.py"], options).findings == []


def test_an_optimizer_wrapper_stepped_with_the_loss_is_a_whole_update(scan):
    # tianshou: ``self.critic_optim.step(critic_loss)`` runs the backward pass and the
    # step; the algorithm's update, called from a trainer in another file, returns
    # its losses read with .item() every update.
    source = (
        "import torch\nimport torch.nn.functional as F\n"
        "class BCQ:\n"
        "    def _update_with_batch(self, batch):\n"
        "        critic_loss = F.mse_loss(self.critic(batch.obs), batch.target)\n"
        "        self.critic_optim.step(critic_loss)\n"
        "        return {'critic_loss': critic_loss.item()}\n"
    )
    assert codes(scan(source, target="cuda", select=("AX3",))) == ["AX301"]
    # A scheduler's step is no update.
    plain = source.replace("self.critic_optim.step(critic_loss)", "self.lr_scheduler.step(critic_loss)")
    assert codes(scan(plain, target="cuda", select=("AX3",))) == []


def test_a_gradient_scalers_scale_read_every_step_is_a_sync(scan):
    # FastPoseGait compares the scale before and after update() to tell a skipped step.
    source = (
        "import torch\n"
        "def train(model, loader, opt, scaler):\n"
        "    for x in loader:\n"
        "        scaler.scale(model(x).sum()).backward()\n"
        "        scaler.step(opt)\n"
        "        scale = scaler.get_scale()\n"
        "        scaler.update()\n"
        "        if scale != scaler.get_scale():\n"
        "            print('skipped')\n"
    )
    found = scan(source, target="cuda", select=("AX301",)).findings
    assert [f.line for f in found] == [6, 8] and "get_scale()" in found[0].message
    assert scan(source, target="cpu", select=("AX301",)).findings == []


def test_a_tensor_read_before_the_step_moves_it_to_the_device_is_on_the_host(scan):
    # XLM checks its batch with ``.item()`` and only then moves it with to_cuda().
    source = (
        "import torch\n"
        "def clm_step(self, model, opt):\n"
        "    x, lengths = self.generate_batch()\n"
        "    pred_mask = torch.arange(lengths.max())[:, None] < lengths[None] - 1\n"
        "    assert pred_mask.sum().item() > 0\n"
        "    x, pred_mask = to_cuda(x, pred_mask)\n"
        "    loss = model(x, pred_mask)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    print(pred_mask.sum().item())\n"
    )
    found = scan(source, target="cuda", select=("AX301",)).findings
    assert [f.line for f in found] == [10]


def test_a_method_that_ends_in_the_files_update_helper_is_a_step(scan):
    # XLM: ``clm_step`` computes the loss, reads it, and calls ``self.optimize(loss)``,
    # which runs the backward pass and the steps; the loop is in another file.
    source = (
        "import torch\n"
        "class Trainer:\n"
        "    def optimize(self, loss):\n"
        "        self.optimizer.zero_grad()\n"
        "        loss.backward()\n"
        "        self.optimizer.step()\n"
        "    def clm_step(self, x):\n"
        "        loss = self.model(x)\n"
        "        self.stats.append(loss.item())\n"
        "        self.optimize(loss)\n"
    )
    assert [f.line for f in scan(source, target="cuda", select=("AX301",)).findings] == [9]
    # A method the file calls itself is judged where it is called.
    called = source + "    def run(self, x):\n        self.clm_step(x)\n"
    assert scan(called, target="cuda", select=("AX301",)).findings == []


_STEP_FACTORY = """import torch

def make_step(G, D, config):
    def train(x, y):
        for step_index in range(config["num_D_steps"]):
            D.optim.zero_grad()
            for accumulation_index in range(config["num_D_accumulations"]):
                d_loss = D(x) - D(G(y))
                d_loss.backward()
            D.optim.step()
        G.optim.zero_grad()
        g_loss = -D(G(y))
        for accumulation_index in range(config["num_G_accumulations"]):
            g_loss.backward()
        G.optim.step()
        return {"G_loss": float(g_loss.item()), "D_loss": float(d_loss.item())}
    return train
"""


def test_ax301_reads_a_step_function_whose_backward_passes_run_in_its_own_loops():
    """BigGAN's step function, returned by a factory and called by another file's
    loop: its backward passes run in its D-steps and accumulation loops, its own body
    steps G's optimizer once. The reads it returns run every step; ``float()`` around
    them needs the number no sooner than a log does."""
    from torchaxe.scan.engine import scan_source

    report = scan_source(_STEP_FACTORY, "train_fns.py",
                         ScanOptions(target="cuda", select=("AX301",), capabilities=torch_capabilities("cuda")))
    assert [(f.line, f.snippet.strip()) for f in report.findings] == [
        (16, 'return {"G_loss": float(g_loss.item()), "D_loss": float(d_loss.item())}')] * 2
    assert all("accumulate on the device" in f.message for f in report.findings)


def test_ax301_leaves_a_function_that_runs_a_whole_training_loop():
    """A function whose optimizer steps all run in its loops trains for many steps:
    what its own body reads after them runs once."""
    from torchaxe.scan.engine import scan_source

    source = ("import torch\n\ndef fit(model, opt, loader):\n    for x, y in loader:\n"
              "        loss = model(x, y)\n        loss.backward()\n        opt.step()\n"
              "    return loss.item()\n")
    report = scan_source(source, "fit.py",
                         ScanOptions(target="cuda", select=("AX301",), capabilities=torch_capabilities("cuda")))
    assert report.findings == []


def test_ax301_a_converted_read_handed_to_a_call_is_still_needed_now():
    from torchaxe.scan.engine import scan_source

    source = LOOP_HEAD + "    state, reward, done, _ = env.step(int(policy(state).argmax().item()))\n"
    report = scan_source(source, "rl.py",
                         ScanOptions(target="cuda", select=("AX301",), capabilities=torch_capabilities("cuda")))
    assert len(report.findings) == 1 and "which needs it before the next step" in report.findings[0].message


# ------------------------------------------------------------------ AX307 / AX305 (built before the move)
def _findings(source, code, target="cuda"):
    from torchaxe.scan.engine import scan_source

    return scan_source(source, "t.py", ScanOptions(target=target, select=(code,),
                                                   capabilities=torch_capabilities(target))).findings


def test_ax307_a_loader_batch_is_a_device_tensor_only_after_its_move():
    """A batch straight from a DataLoader is in host memory: masking it costs no device
    sync; once moved, the same mask is counted on the device."""
    head = ("import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=8)\n"
            "for x, y in loader:\n")
    tail = "    loss = model(x)[keep].sum()\n    loss.backward()\n    opt.step()\n"
    assert _findings(head + "    keep = y != 0\n" + tail, "AX307") == []
    moved = _findings(head + "    y = y.to(device)\n    keep = y != 0\n" + tail, "AX307")
    assert [f.line for f in moved] == [7]
    assert "`keep`" in moved[0].message and "GPU" in moved[0].message
    # The moved batch now counts as a device tensor for the other sync rules too.
    branch = head + "    y = y.cuda()\n    if y.sum() > 0:\n        pass\n" + tail.replace("[keep]", "")
    assert [f.line for f in _findings(branch, "AX303")] == [6]


def test_ax307_reaches_helpers_of_helpers_the_step_always_calls():
    source = ("import torch\n\ndef cal_loss(pred, gold):\n    keep = gold.ne(0)\n"
              "    return torch.log_softmax(pred, -1).masked_select(keep).sum()\n\n"
              "def cal_performance(pred, gold):\n    return cal_loss(pred, gold)\n\n"
              "def cal_rare(pred, gold):\n    return torch.log_softmax(pred, -1).masked_select(gold.ne(0)).sum()\n\n"
              "for x, y in loader:\n    x, y = x.to(device), y.to(device)\n    pred = model(x)\n"
              "    loss = cal_performance(pred, y)\n    if verbose:\n        cal_rare(pred, y)\n"
              "    loss.backward()\n    opt.step()\n")
    assert [f.line for f in _findings(source, "AX307")] == [5]


def test_ax307_noqa_and_npu_wording():
    source = ("import torch\nfor x, y in loader:\n    x = x.npu()\n    out = model(x)\n"
              "    a = out[out > 0].sum()  # noqa: AX307\n    b = torch.nonzero(out)\n"
              "    loss = a + b.sum()\n    loss.backward()\n    opt.step()\n")
    found = _findings(source, "AX307", target="npu")
    assert [f.line for f in found] == [6]
    assert "NPU" in found[0].message and found[0].fix.applicability is Applicability.DISPLAY_ONLY


def test_ax305_names_the_factory_a_moved_tensor_was_computed_from():
    source = ("import torch\n\ndef loss_fn(features, device):\n"
              "    labels = torch.cat([torch.arange(8) for _ in range(2)], dim=0)\n"
              "    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()\n"
              "    step = 0\n    while step < 3:\n        step = step + 1\n"
              "    return labels.to(device), torch.tensor(step).to(device)\n")
    found = _findings(source, "AX305")
    assert [f.line for f in found] == [9, 9]
    built = next(f for f in found if "computed in host memory" in f.message)
    assert "`torch.arange(8)` (line 4)" in built.message
    assert built.fix.applicability is Applicability.DISPLAY_ONLY and not built.fix.edits


def test_ax305_a_name_computed_from_itself_is_left_alone():
    source = ("import torch\n\ndef f(device):\n    t = torch.zeros(3)\n    for _ in range(4):\n"
              "        t = t + 1\n    return t.to(device)\n")
    assert _findings(source, "AX305") == []


def test_ax307_reads_a_loss_forward_but_not_its_nested_functions_or_other_forwards():
    """A module's forward that computes a loss runs on every training step; a forward
    returning no loss, a function defined inside one, and a reassigned argument moved
    to the host are not read as one."""
    source = ("import torch\nfrom torch import nn\n\n\nclass Contrastive(nn.Module):\n"
              "    def forward(self, q, labels):\n"
              "        if not self.training:\n            return self.knn(q)\n"
              "        sim = q @ q.t()\n"
              "        pos = sim[labels.unsqueeze(0) == labels.unsqueeze(1)]\n"
              "        def later(t):\n            return t[t > 0]\n"
              "        labels = labels.cpu()\n        kept = labels[labels > 0]\n"
              "        total_loss = -pos.mean() + kept.float().mean()\n"
              "        return total_loss\n\n\n"
              "class Backbone(nn.Module):\n"
              "    def forward(self, x, valid):\n        return self.proj(x[valid > 0])\n")
    assert [f.line for f in _findings(source, "AX307")] == [10]
    assert _findings(source, "AX307", target="cpu") == []


def test_ax307_leaves_a_loss_forward_s_evaluation_branch_alone():
    source = ("import torch\nfrom torch import nn\n\n\nclass Loss(nn.Module):\n"
              "    def forward(self, logits, target):\n"
              "        keep = target != -100\n"
              "        if not self.training:\n            self.acc = (logits.argmax(-1)[keep] == target[keep]).float()\n"
              "        if self.training:\n            pass\n        else:\n            self.n = target[keep].numel()\n"
              "        return self.ce(logits[keep], target[keep])\n")
    assert [f.line for f in _findings(source, "AX307")] == [14, 14]
