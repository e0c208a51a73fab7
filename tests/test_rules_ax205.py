"""AX205 (a moving average of weights kept one tensor at a time) beyond its inline
examples: the rewrite computes the same average as the loop it replaces, the layouts
of public EMA helpers are read, and advise measures the rewrite as a code change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchaxe.advise.candidates import code_candidates
from torchaxe.findings import Applicability
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source


def _options(target: str = "cpu") -> ScanOptions:
    return ScanOptions(target=target, select=("AX205",), capabilities=torch_capabilities(target))


def _findings(source: str, target: str = "cpu"):
    report = scan_source(source, "t.py", _options(target))
    assert not report.diagnostics, report.diagnostics
    return report.findings


SCRIPT = '''\
import copy
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
ema = copy.deepcopy(model).requires_grad_(False)
decay = 0.9


def update(ema, model):
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            {update}


for step in range(5):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    update(ema, model)
print(repr(torch.cat([e.flatten() for e in ema.parameters()]).tolist()))
'''

UPDATES = (
    "e.mul_(decay).add_(p, alpha=1 - decay)",
    "e.data = e.data * decay + p.data * (1. - decay)",
    "e.copy_(p.detach().lerp(e, decay))",
    "e.sub_((1 - decay) * (e - p))",
)


@pytest.mark.parametrize("update", UPDATES)
def test_rewrite_computes_the_same_average(tmp_path, update):
    source = SCRIPT.format(update=update)
    (finding,) = _findings(source)
    assert finding.fix is not None and finding.fix.applicability == Applicability.UNSAFE
    result = fix_source(source, "t.py", _options(), unsafe=True)
    assert result.error is None, result.error
    fixed = result.fixed
    assert "torch._foreach_lerp_(" in fixed and "for e, p in zip" not in fixed
    assert not _findings(fixed)
    outputs = []
    for name, text in (("before.py", source), ("after.py", fixed)):
        path = tmp_path / name
        path.write_text(text)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        outputs.append([float(v) for v in run.stdout.strip().strip("[]").split(",")])
    before, after = outputs
    assert len(before) == len(after) > 100
    assert max(abs(a - b) for a, b in zip(before, after)) < 1e-5


def test_public_helper_layouts_are_found():
    # An EMA of named parameters looked up in a dict; a function over lists it is
    # handed (both shown, not rewritten: nothing says what the lists hold).
    dict_lookup = (
        "import torch\nfrom collections import OrderedDict\n\n@torch.no_grad()\n"
        "def update_ema(ema_model, model, decay=0.9999):\n"
        "    ema_params = OrderedDict(ema_model.named_parameters())\n"
        "    model_params = OrderedDict(model.named_parameters())\n"
        "    for name, param in model_params.items():\n"
        "        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)\n"
    )
    handed = (
        "import torch\n\ndef update_ema(target_params, source_params, rate=0.99):\n"
        "    for targ, src in zip(target_params, source_params):\n"
        "        targ.detach().mul_(rate).add_(src, alpha=1 - rate)\n"
    )
    for source, line in ((dict_lookup, 9), (handed, 5)):
        (finding,) = _findings(source, target="cuda")
        assert finding.line == line
        assert finding.fix is not None and finding.fix.applicability == Applicability.DISPLAY_ONLY
        assert "Display-only" in finding.message and "foreach_lerp_" in finding.message


def test_a_target_detached_in_the_loop_is_found_and_shown_only():
    # DeepRL's soft_update detaches each target parameter in place (it stops requiring
    # grad) before the average: the average is found, and a rewrite that dropped the
    # detach_() would change the module, so it is shown, not rewritten.
    source = (
        "import torch\nclass Agent:\n    def soft_update(self, target, src):\n"
        "        for target_param, param in zip(target.parameters(), src.parameters()):\n"
        "            target_param.detach_()\n"
        "            target_param.copy_(target_param * (1.0 - self.mix) + param * self.mix)\n"
    )
    (finding,) = _findings(source, target="cuda")
    assert finding.line == 6 and finding.fix.applicability == Applicability.DISPLAY_ONLY
    assert "updated among other statements of the loop" in finding.message


def test_npu_message_says_unverified():
    (finding,) = _findings(SCRIPT.format(update=UPDATES[0]), target="npu")
    assert "unverified on Ascend hardware" in finding.message


def test_loops_that_are_not_averages_are_left_alone():
    for body in ("e.copy_(p)", "e.add_(p.grad, alpha=-0.1)", "e.mul_(decay)", "e.add_(p)",
                 "e.mul_(decay).add_(p * p, alpha=1 - decay)", "e.mul_(decay).add_(other, alpha=1 - decay)"):
        assert not _findings(SCRIPT.format(update=body)), body


def test_advise_measures_the_rewrite_as_a_code_change():
    findings = _findings(SCRIPT.format(update=UPDATES[0]))
    candidates, advice_only = code_candidates(findings, {}, None)
    assert [c.rec.key for c in candidates] == ["code:AX205"] and not advice_only
    rec = candidates[0].rec
    assert rec.unsafe and rec.accuracy.kind == "unknown"


LAYOUTS = {
    # Buffers looked up through a map of names, cast first, then moved by a difference.
    "name_map": (
        "import torch\nclass Ema(torch.nn.Module):\n    def forward(self, model, decay):\n"
        "        params = dict(model.named_parameters())\n        shadow = dict(self.named_buffers())\n"
        "        for key in params:\n            if params[key].requires_grad:\n"
        "                sname = self.names[key]\n"
        "                shadow[sname] = shadow[sname].type_as(params[key])\n"
        "                shadow[sname].sub_((1.0 - decay) * (shadow[sname] - params[key]))\n"
        "            else:\n                assert key not in self.names\n",
        10,
    ),
    # A state_dict walked by a key that may get a prefix, values bound to names first.
    "prefixed_key": (
        "import torch\ndef update(ema, model, decay, wrapped):\n    msd, esd = model.state_dict(), ema.state_dict()\n"
        "    for k in keys:\n        if wrapped:\n            j = 'module.' + k\n        else:\n            j = k\n"
        "        model_v = msd[j].detach()\n        ema_v = esd[k]\n"
        "        esd[k].copy_(ema_v * decay + (1. - decay) * model_v)\n",
        11,
    ),
    # An `out=` call through an alias of torch, after a scaling in place.
    "out_argument": (
        "import torch as th\ndef polyak(params, targets, tau):\n    with th.no_grad():\n"
        "        for p, t in zip(params, targets):\n            t.data.mul_(1 - tau)\n"
        "            th.add(t.data, p.data, alpha=tau, out=t.data)\n",
        6,
    ),
    # The average computed by a method of the file, which returns early for a first call.
    "helper_returns": (
        "import torch\nclass Updater:\n    def average(self, old, new):\n        if old is None:\n            return new\n"
        "        return old * self.beta + (1 - self.beta) * new\n\n"
        "def step(updater, online, target):\n"
        "    for cur, avg in zip(online.parameters(), target.parameters()):\n"
        "        old, new = avg.data, cur.data\n        avg.data = updater.average(old, new)\n",
        11,
    ),
    # An in-place helper of the file, with optional device and dtype moves.
    "helper_in_place": (
        "import torch\ndef lerp_into(tgt, src, weight, move=False):\n    if move:\n        src = src.to(tgt.device)\n"
        "    tgt.lerp_(src, weight)\n\ndef update(pairs, decay):\n    for tgt, src in pairs:\n"
        "        lerp_into(tgt, src, 1. - decay)\n",
        9,
    ),
    # Skips, a lookup that may fail, and the average in the else of a branch.
    "branches": (
        "import torch\ndef step(self, new_model, decay):\n    averages = self.model.state_dict()\n"
        "    for key, param in new_model.state_dict().items():\n        if isinstance(param, dict):\n            continue\n"
        "        try:\n            avg = averages[key]\n        except KeyError:\n            avg = param.clone()\n"
        "        if key in self.skip:\n            avg = param.clone()\n        else:\n            avg.mul_(decay)\n"
        "            avg.add_(param, alpha=1 - decay)\n        self.out[key] = avg\n",
        15,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_of_public_averaging_code_are_read(name):
    source, line = LAYOUTS[name]
    (finding,) = _findings(source, target="cuda")
    assert finding.line == line


def test_fallback_beside_a_multi_tensor_path_names_the_setting():
    source = (
        "import torch\ndef step(self, shadow, params, d):\n    if self.use_foreach:\n"
        "        torch._foreach_lerp_(shadow, params, 1 - d)\n    else:\n"
        "        for s, p in zip(shadow, params):\n            s.sub_((1 - d) * (s - p))\n"
    )
    (finding,) = _findings(source)
    assert "`self.use_foreach`" in finding.message and finding.fix.applicability == Applicability.DISPLAY_ONLY
    # The same loop beside a dtype test is the path for tensors lerp cannot take.
    assert not _findings(source.replace("self.use_foreach", "shadow[0].is_floating_point()"))


def test_an_ema_helper_module_that_never_names_torch_is_read():
    # Seen in a held-out corpus (fast-autoaugment's common.py): an EMA class handed the
    # model averages module.state_dict() without importing torch; the scan skipped the
    # file for every rule. AX205 reads such files; the other rules still skip them.
    from pathlib import Path
    import tempfile

    from torchaxe.scan.engine import ScanOptions, scan_paths

    source = (
        "class EMA:\n    def __init__(self, mu):\n        self.mu = mu\n        self.shadow = {}\n\n"
        "    def __call__(self, module):\n        mu = self.mu\n"
        "        for name, x in module.state_dict().items():\n"
        "            if name in self.shadow:\n"
        "                self.shadow[name] = ((1.0 - mu) * x + mu * self.shadow[name]).clone()\n"
        "            else:\n                self.shadow[name] = x.clone()\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "common.py"
        path.write_text(source)
        (Path(tmp) / "plain.py").write_text("def add(a, b):\n    return a + b\n")
        result = scan_paths([tmp], ScanOptions(target="cpu"))
    assert [(f.code, f.line) for f in result.findings] == [("AX205", 10)]
    assert result.stats.files_skipped == 1


def test_an_update_through_a_name_bound_to_the_averaged_tensor_is_read():
    # openfold's EMA (a held-out corpus miss): a difference scaled in place, then taken
    # off the stored tensor through a name bound to it.
    source = (
        "import torch\n\nclass EMA:\n    def _update(self, update, state_dict):\n"
        "        with torch.no_grad():\n            for k, v in update.items():\n"
        "                stored = state_dict[k]\n                diff = stored - v\n"
        "                diff *= 1 - self.decay\n                stored -= diff\n"
    )
    found = _findings(source)
    assert [(f.code, f.line) for f in found] == [("AX205", 10)]
    assert found[0].fix is None or found[0].fix.applicability == Applicability.DISPLAY_ONLY
    # Numbers: ``total -= diff`` rebinds the name and leaves the dict as it was.
    numbers = source.replace("stored -= diff", "stored -= diff\n                print(stored)").replace(
        "stored = state_dict[k]", "stored = float(state_dict[k])")
    assert _findings(numbers) == []


def test_the_fix_reaches_a_helper_module_that_never_names_torch(tmp_path):
    # The fix reads files as the scan does: the average is rewritten, `import torch` added.
    from torchaxe.scan.fix import fix_paths

    path = tmp_path / "ema.py"
    path.write_text("def update(ema, model, decay):\n"
                    "    for e, p in zip(ema.parameters(), model.parameters()):\n"
                    "        e.mul_(decay).add_(p, alpha=1 - decay)\n")
    fix_paths([path], _options(), unsafe=True, write=True)
    fixed = path.read_text()
    assert fixed.startswith("import torch\n") and "torch._foreach_lerp_(" in fixed
