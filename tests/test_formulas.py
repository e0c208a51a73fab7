"""The formula machinery: lowering and local inlining, the safe interpreter, roles,
fingerprints in many spellings, the fingerprint store, lazy torch import, and the
interplay with the name-level rule AX103."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchaxe.findings import Applicability
from torchaxe.scan.context import FileContext
from torchaxe.scan.formulas.analysis import formula_matches
from torchaxe.scan.formulas.inline import FileUnit, read_scope
from torchaxe.scan.formulas.ir import Builder, normalised
from torchaxe.scan.formulas.probes import infer_roles, scalar_value
from torchaxe.scan.formulas.store import FingerprintStore


def matches(source: str, target: str = "npu"):
    source = textwrap.dedent(source)
    ctx = FileContext("t.py", source, ast.parse(source), target)
    return formula_matches(ctx)


def roots(source: str):
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    ctx = FileContext("t.py", source, tree, "npu")
    unit = FileUnit(ctx.imports, ctx.qualified_name, ctx.text, tree, ctx.lines,
                    relevant_lines=list(range(1, len(ctx.lines) + 1)),
                    hot_definitions={id(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)})
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    return read_scope(unit, fn, None)


# ----------------------------------------------------------------------- lowering
def test_locals_are_inlined_into_one_expression():
    found = roots("""
        import torch
        def f(x):
            cdf = 0.5 * (1.0 + torch.tanh(x))
            return x * cdf
    """)
    text, names = normalised(found[-1].node)
    assert "tanh" in text and text.startswith("mul(")
    assert names == ("x",)


def test_unknown_calls_are_opaque_variables_and_their_arguments_are_roots():
    found = roots("""
        import torch
        def f(self, x):
            return self.proj(x * torch.sigmoid(x))
    """)
    texts = [normalised(r.node)[0] for r in found]
    assert texts[0] == "v0"  # self.proj(...) is a free variable
    assert any("sigmoid" in t for t in texts[1:])  # the argument is looked into


def test_constants_fold_to_the_same_leaf():
    b = Builder()
    import math

    a = b.op("sqrt", (b.op("div", (b.const(2), b.const(math.pi))),))
    assert a.is_const and abs(a.value - 0.7978845608028654) < 1e-15


def test_names_bound_in_loops_are_not_inlined():
    found = roots("""
        import torch
        def f(x):
            for _ in range(3):
                x = torch.tanh(x)
            return x * torch.sigmoid(x)
    """)
    text, names = normalised(found[-1].node)
    assert names == ("x@3",) or names[0].startswith("x@")


def test_roles_read_from_use():
    found = roots("""
        import torch
        def f(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
    """)
    roles = infer_roles(found[-1].node)
    assert roles == {"x": "full", "self.eps": "scalar", "self.weight": "vector"}


# ----------------------------------------------------------------------- interpreter
def test_interpreter_never_calls_what_it_does_not_know():
    # os.system is not on the whitelist: it is a free variable, never called.
    found = matches("""
        import os, torch
        def f(x):
            return x * torch.sigmoid(x) + os.system("touch /tmp/torchaxe-should-not-exist")
    """)
    import os.path

    assert not os.path.exists("/tmp/torchaxe-should-not-exist")
    assert [m.category for m in found] == ["silu"]


def test_interpreter_caps_what_a_formula_may_allocate():
    import torch

    from torchaxe.scan.formulas.interpreter import FAIL, Evaluator

    b = Builder()
    x = b.var("x")
    big = b.op("repeat", (x, b.const(100000), b.const(100000)))
    outer = b.op("mul", (b.op("unsqueeze", (b.op("reshape", (x, b.const(-1))), b.const(1))),
                         b.op("reshape", (x, b.const(-1)))))
    env = {"x": torch.randn(16, 16, 16, 16)}
    # The repeat is refused (the layout op passes its input through), the outer
    # product of 65536 x 65536 elements is refused outright.
    assert Evaluator(env).value(big).shape == (16, 16, 16, 16)
    assert Evaluator(env).value(outer) is FAIL


# ----------------------------------------------------------------------- fingerprints
@pytest.mark.parametrize("body,category", [
    ("0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))", "gelu_tanh"),
    ("0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x * x * x)))", "gelu_tanh"),
    ("x * (1 + torch.tanh(0.7978845608 * x * (1 + 0.044715 * x ** 2))) / 2", "gelu_tanh"),
    ("x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x ** 3))", "gelu_tanh"),
    ("0.5 * x * (1 + torch.erf(x / math.sqrt(2)))", "gelu_erf"),
    ("x * torch.special.ndtr(x)", "gelu_erf"),
    ("x * torch.sigmoid(1.702 * x)", "quick_gelu"),
    ("x / (1 + torch.exp(-x))", "silu"),
    ("torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)",
     "softmax"),
])
def test_one_line_forms(body, category):
    found = matches(f"import math, torch\ndef f(x):\n    return {body}\n")
    assert [m.category for m in found] == [category]
    assert found[0].max_abs < 1e-4


@pytest.mark.parametrize("body", [
    "0.5 * x * (1 + torch.tanh(x))",
    "0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.44715 * x ** 3)))",
    "0.5 * (1 + torch.erf(x / math.sqrt(2)))",
    "x * torch.sigmoid(1.5 * x)",
    "x * torch.sigmoid(-x)",
    "x / x.sum(-1, keepdim=True)",
    "x - torch.logsumexp(x, -1, keepdim=True)",
    "x / x.norm(dim=-1, keepdim=True)",
])
def test_look_alikes_are_not_matched(body):
    assert matches(f"import math, torch\ndef f(x):\n    return {body}\n") == []


def test_largest_match_wins():
    found = matches("""
        import torch
        def swiglu(x):
            a, b = x.chunk(2, -1)
            return a * torch.sigmoid(a) * b
    """)
    assert [m.category for m in found] == ["swiglu"]  # not the SiLU inside it
    found_cpu = matches("""
        import torch
        def swiglu(x):
            a, b = x.chunk(2, -1)
            return a * torch.sigmoid(a) * b
    """, target="cpu")
    assert [m.category for m in found_cpu] == ["silu"]  # no fused SwiGLU on cpu


def test_a_helper_and_its_caller_report_once():
    found = matches("""
        import torch
        def gelu(x):
            return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
        def mlp(self, h):
            return self.fc2(gelu(self.fc1(h)))
    """)
    assert [(m.category, m.scope_name) for m in found] == [("gelu_tanh", "gelu")]


def test_attention_parameters_are_read():
    found = matches("""
        import math, torch
        def attn(q, k, v, mask):
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            s = s.masked_fill(mask == 0, float("-inf"))
            return torch.softmax(s, dim=-1) @ v
    """)
    [m] = found
    assert m.category == "attention" and m.params["masked"] and m.params["default_scale"]
    assert (m.inputs["q"], m.inputs["k"], m.inputs["v"]) == ("q", "k", "v")
    assert m.spread and not m.fixable


@pytest.mark.parametrize("mask", ["bias[:, :, :T, :T] == 0", "bias[:T, :T] == 0"])
def test_a_mask_cut_to_a_length_given_as_an_argument_is_read(mask):
    # The length is a parameter: the probes must give it the scores' size (a
    # narrower mask would not broadcast), not half a width as other slice bounds.
    found = matches(f"""
        import math, torch
        def attn(q, k, v, bias, T):
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            s = s.masked_fill({mask}, float("-inf"))
            return torch.softmax(s, dim=-1) @ v
    """)
    [m] = found
    assert m.category == "attention" and m.params["masked"]


def test_norm_eps_and_weight_are_identified():
    [m] = matches("""
        import torch
        def rms(h, g, eps=1e-6):
            return h / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps) * (1 + g)
    """)
    assert m.category == "rms_norm"
    assert m.inputs == {"x": "h", "weight": "(1 + g)", "eps": "eps"} or m.inputs["weight"] == "1 + g"


@pytest.mark.parametrize("body,category,eps", [
    # A small eps fits as none within the probes' tolerance: the closest fit keeps it.
    ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)", "rms_norm", "1e-6"),
    ("x * (x.square().mean(-1, keepdim=True) + 1e-5) ** -0.5", "rms_norm", "1e-5"),
    ("(x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False) + 1e-6).sqrt()", "layer_norm",
     "1e-6"),
])
def test_a_literal_eps_is_kept(body, category, eps):
    [m] = matches(f"import torch\ndef norm(x):\n    return {body}\n", target="cuda")
    assert m.category == category and m.inputs.get("eps") == eps and m.max_rel < 1e-12


def test_two_stored_numbers_are_told_apart():
    # self.eps inside the square root, self.scale outside: one number each, not a weight vector.
    [m] = matches("""
        import torch
        class Norm(torch.nn.Module):
            def forward(self, x):
                return x / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps) * self.scale
    """, target="cuda")
    assert (m.inputs["eps"], m.inputs["weight"]) == ("self.eps", "self.scale")
    assert m.params["scalar_weight"]


def test_a_scalar_norm_weight_multiplies_the_fused_output(scan):
    source = ("import torch\nimport torch.nn.functional as F\nclass Norm(torch.nn.Module):\n"
              "    def forward(self, x):\n"
              "        return x / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps) * self.scale\n")
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX115"]
    assert finding.replacement == "F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.scale"


def test_match_errors_are_reported_on_float64_probes():
    [m] = matches("import math, torch\ndef f(x):\n    return 0.5 * x * (1 + torch.tanh(0.7978 * (x + 0.044715 * x**3)))\n")
    assert m.category == "gelu_tanh" and 1e-6 < m.max_abs < 1e-3  # truncated constant: close, not exact


# ----------------------------------------------------------------------- store
def test_store_round_trip_and_version_reset(tmp_path):
    store = FingerprintStore(tmp_path, use_disk=True)
    store.put_many({"k1": [["silu", 3, {"x": 0}, {}, "x*sigmoid(x)", 0.0, 0.0]]})
    again = FingerprintStore(tmp_path, use_disk=True)
    assert again.get_many(["k1", "k2"]) == {"k1": [["silu", 3, {"x": 0}, {}, "x*sigmoid(x)", 0.0, 0.0]]}
    import sqlite3

    db = sqlite3.connect(tmp_path / "fingerprints.sqlite3")
    db.execute("UPDATE meta SET value = 'older' WHERE name = 'version'")
    db.commit()
    db.close()
    assert FingerprintStore(tmp_path, use_disk=True).get_many(["k1"]) == {}


def test_store_turns_itself_off_when_the_disk_fails(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    store = FingerprintStore(blocker / "sub", use_disk=True)
    store.put_many({"k": []})  # no exception
    assert store.get_many(["k"]) == {"k": []}  # memory still works


# ----------------------------------------------------------------------- laziness, AX103
def test_torch_is_imported_only_for_a_candidate(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nx = torch.zeros(3)\ny = x.mean()\nopt = torch.optim.SGD(p, lr=1)\n")
    code = textwrap.dedent(f"""
        import sys, json
        import torchaxe
        from torchaxe.scan.engine import scan_paths, ScanOptions
        first = 'torch' in sys.modules
        scan_paths([{str(plain)!r}], ScanOptions(target='cpu', capabilities={{'fused_optimizers': ['SGD']}}))
        print(json.dumps([first, 'torch' in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [False, False]


def test_ax103_leaves_a_recognised_formula_to_the_formula_rules(scan):
    source = "import math, torch\ndef gelu(x):\n    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))\n"
    codes = [f.code for f in scan(source, target="cpu").findings]
    assert codes == ["AX110"]


def test_npu_messages_say_unverified(scan):
    source = "import torch\ndef act(x):\n    return x * torch.sigmoid(1.702 * x)\n"
    [finding] = scan(source, target="npu").findings
    assert finding.code == "AX112" and "unverified on Ascend hardware" in finding.message
    assert finding.fix.imports == ("import torch_npu",)


def test_an_unchanged_file_is_not_analysed_again(monkeypatch):
    from torchaxe.scan.formulas import analysis

    source = "import torch\ndef swish(v):\n    return v * torch.sigmoid(v)\n"
    first = matches(source, target="cuda")

    def fail(ctx):
        raise AssertionError("analysed again")

    monkeypatch.setattr(analysis, "_analyse", fail)
    again = matches(source, target="cuda")
    assert [(m.category, m.line, m.inputs, m.fixable) for m in again] == [
        (m.category, m.line, m.inputs, m.fixable) for m in first]


# ----------------------------------------------------------------------- cold-scan work
def test_broadcast_shape_agrees_with_torch():
    import torch

    from torchaxe.scan.formulas.interpreter import broadcast_shape

    for a, b in [((4, 1, 3), (2, 1)), ((), (3,)), ((5,), (1, 5)), ((2, 3), (2, 3)), ((1,), (7, 1, 1))]:
        assert broadcast_shape(torch.Size(a), torch.Size(b)) == torch.broadcast_shapes(a, b)
    with pytest.raises(RuntimeError):
        broadcast_shape((2, 3), (4, 3))


@pytest.mark.parametrize("body,worth", [
    ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)", True),
    ("(x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + 1e-5) ** 0.5", True),
    ("0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))", True),
    # A division by a sum (no square root): not a norm.
    ("torch.exp(x) / torch.exp(x).sum(-1, keepdim=True) + torch.sqrt(y).mean()", True),
    ("x / x.sum(-1, keepdim=True) + y.mean()", False),
    # x only inside the statistics (a BatchNorm backward): not a norm of x.
    ("(g * (x - m)).sum(0) * torch.rsqrt(v + 1e-5)", False),
    ("(x - m).pow(2).mean(-1) * y", False),
    # tanh of x, but no input every path goes through with the tanh outside it.
    ("x * torch.tanh(y)", False),
])
def test_structural_prefilter(body, worth):
    from torchaxe.scan.formulas.analysis import categories_for
    from torchaxe.scan.formulas.prefilter import worth_evaluating

    found = roots(f"import torch\ndef f(x, y, g, m, v):\n    return {body}\n")
    assert worth_evaluating(found[-1].node, categories_for("npu")) is worth


def test_torch_is_not_imported_when_the_structure_rules_every_formula_out(tmp_path):
    source = tmp_path / "stats.py"
    source.write_text(textwrap.dedent("""
        import torch
        def normalise_counts(x):
            return x / x.sum(-1, keepdim=True)
        def batch_norm_backward(g, x, m, v):
            return (g * (x - m)).sum(0) * torch.rsqrt(v + 1e-5)
        def gated(x, y):
            return x * torch.tanh(y)
    """))
    code = textwrap.dedent(f"""
        import json, os, sys
        os.environ['TORCHAXE_NO_CACHE'] = '1'
        from torchaxe.scan.engine import scan_paths, ScanOptions
        from torchaxe.scan.formulas import analysis
        seen = []
        original = analysis._analyse
        analysis._analyse = lambda ctx: seen.append(ctx.path) or original(ctx)
        result = scan_paths([{str(source)!r}], ScanOptions(target='npu', capabilities={{'fused_optimizers': []}}))
        print(json.dumps([len(seen), [f.code for f in result.findings], 'torch' in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    analysed, codes, imported = json.loads(out)
    assert analysed == 1  # the file was analysed: it holds formula words
    assert not [c for c in codes if c.startswith("AX11")]
    assert imported is False


def test_trees_travel_to_the_evaluator_unchanged():
    from torchaxe.scan.formulas import remote
    from torchaxe.scan.formulas.ir import walk

    found = roots("""
        import math, torch
        def f(self, x, mask):
            q, k, v = x.split(4, dim=-1)
            s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            s = s.masked_fill(mask[..., :4] == 0, float("-inf"))
            z = torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v) * (1 + 2j).real
            return z + self.eps * (None is None)
    """)
    for root in found:
        again = remote.tree_in(json.loads(json.dumps(remote.tree_out(root.node))))
        assert [n.key for n in walk(again)] == [n.key for n in walk(root.node)]
        assert [type(n.value) for n in walk(again)] == [type(n.value) for n in walk(root.node)]
    b = Builder()
    with pytest.raises(remote.Unencodable):
        remote.tree_out(b.op("mul", (b.var("x"), b.const(b"bytes"))))


def test_a_parallel_scan_evaluates_in_one_process(tmp_path):
    """Workers hand their trees to the evaluator: torch is imported in one process, and
    the findings are those of a serial scan."""
    gelu = "import torch\ndef act(x):\n    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))\n"
    silu = "import torch\ndef act(v):\n    return v * torch.sigmoid(v)\n"
    for i in range(60):  # more than one chunk of files, so that both workers get some
        (tmp_path / f"m{i:03}.py").write_text((gelu, silu, "import torch\nopt = torch.optim.AdamW(p)\n")[i % 3]
                                              + f"# file {i}\n")
    log = tmp_path / "pids.log"
    code = textwrap.dedent(f"""
        import json, os, sys
        os.environ['TORCHAXE_NO_CACHE'] = '1'
        from torchaxe.scan.engine import scan_paths, ScanOptions
        from torchaxe.scan.formulas import analysis
        original = analysis.load_compute
        def logged():
            with open({str(log)!r}, 'a') as f:
                f.write(f'{{os.getpid()}}\\n')
            return original()
        analysis.load_compute = logged
        opts = ScanOptions(target='npu', capabilities={{'fused_optimizers': ['AdamW']}})
        parallel = scan_paths([{str(tmp_path)!r}], ScanOptions(**{{**opts.__dict__, 'jobs': 2}}))
        in_parent = 'torch' in sys.modules
        with open({str(log)!r}, 'a') as f:
            f.write('serial\\n')
        serial = scan_paths([{str(tmp_path)!r}], ScanOptions(**{{**opts.__dict__, 'jobs': 1}}))
        print(json.dumps([[f.to_dict() for f in parallel.findings], [f.to_dict() for f in serial.findings],
                          [d.code for d in parallel.diagnostics], in_parent, os.getpid()]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    parallel, serial, diagnostics, in_parent, parent = json.loads(out)
    assert parallel == serial and not diagnostics
    assert sum(f["code"] == "AX110" for f in parallel) == 20 and sum(f["code"] == "AX113" for f in parallel) == 20
    assert not in_parent  # the parallel scan left the parent without torch
    during, after = log.read_text().split("serial")
    # One process, not the parent, evaluated for both workers; the serial scan evaluates in the parent.
    assert len(set(during.split())) == 1 and int(during.split()[0]) != parent
    assert set(after.split()) == {str(parent)}


def test_a_worker_evaluates_itself_when_the_evaluator_is_gone():
    import multiprocessing

    from torchaxe.scan.formulas import remote

    context = multiprocessing.get_context()
    gone = context.Process(target=int)
    gone.start()
    gone.join()
    link = remote.Link(context.Queue(), [context.Queue()], 0, gone.pid)
    tree = roots("import torch\ndef f(x):\n    return x * torch.sigmoid(x)\n")[-1].node
    assert link.evaluate([(tree, {"x": "full"})], frozenset({"silu"})) is None
    assert link.broken  # and it does not ask again


# ----------------------------------------------------------------------- activation attributes, equations, baddbmm
_MLP = """
    import torch
    import torch.nn as nn
    from transformers.activations import ACT2FN
    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            {init}
        def forward(self, x):
            return self.down(self.act_fn(self.gate(x)) * self.up(x))
"""


@pytest.mark.parametrize("init,found", [
    ('self.act_fn = ACT2FN["silu"]', True),
    ("self.act_fn = nn.SiLU()", True),
    ("self.act_fn = torch.nn.functional.silu", True),
    ("self.act_fn = ACT2FN[config.hidden_act]", False),  # decided at run time
    ("self.act_fn = nn.GELU()", False),  # a GeGLU
    ("if config.silu:\n                self.act_fn = nn.SiLU()", False),  # maybe never set here
    ("self.act_fn = nn.SiLU()\n            self.act_fn = nn.ReLU()", False),  # set twice
    ("self.act_fn = nn.SiLU()\n            setattr(self, 'act_fn', nn.ReLU())", False),
])
def test_activation_attributes_resolve_only_when_certain(init, found):
    source = _MLP.replace("{init}", init)
    assert [m.category for m in matches(source)] == (["swiglu"] if found else [])


def test_an_activation_attribute_becomes_its_operation():
    source = textwrap.dedent("""
        import torch.nn as nn
        class Block(nn.Module):
            def __init__(self):
                self.act = nn.GELU(approximate="tanh")
                self.other = nn.GELU(approximate=self.mode)
            def forward(self, x):
                return self.act(x) + self.other(x)
    """)
    tree = ast.parse(source)
    ctx = FileContext("t.py", source, tree, "npu")
    unit = FileUnit(ctx.imports, ctx.qualified_name, ctx.text, tree, ctx.lines,
                    relevant_lines=list(range(1, len(ctx.lines) + 1)), hot_definitions=set())
    cls = tree.body[1]
    [root] = read_scope(unit, cls.body[1], cls)
    text, _ = normalised(root.node)
    assert text.startswith("add(gelu(v0,approximate=#'tanh'),v1)")  # self.other stays opaque


@pytest.mark.parametrize("equation,static", [
    ('f"b h i d, {kv} -> b h i j"', True),
    ('"b h i d, " + kv + " -> b h i j"', True),
    ("EQUATION", True),
    ('f"b h i d, {self.kv} -> b h i j"', False),
    ('f"b h i d, {kv!r} -> b h i j"', False),
])
def test_einsum_equations_are_read_when_they_are_constants(equation, static):
    found = roots(f"""
        import torch
        EQUATION = "b h i d, b h j d -> b h i j"
        def f(self, q, k):
            kv = "b h j d"
            return torch.einsum({equation}, q, k)
    """)
    node = found[-1].node
    assert node.op == "einsum"
    assert (node.args[0].is_const and node.args[0].value == "b h i d, b h j d -> b h i j") is static


def test_baddbmm_is_read_as_scaled_scores_plus_input():
    def tree(call: str) -> str:
        return normalised(roots(f"import torch\ndef f(m, q, k):\n    return {call}\n")[-1].node)[0]

    assert tree("torch.baddbmm(m, q, k, beta=0, alpha=0.5)") == "mul(bmm(v0,v1),#0.5)"
    assert tree("torch.baddbmm(m, q, k)") == "add(v0,bmm(v1,v2))"
    assert tree("m.baddbmm(batch1=q, batch2=k, beta=2.0)") == "add(mul(#2.0,v0),bmm(v1,v2))"
    assert tree("torch.baddbmm(m, q, k, out=m, value=3)").startswith("v")  # not a form it knows: opaque


def test_a_tensor_viewed_before_bmm_keeps_its_own_rank():
    found = roots("""
        import torch
        def f(q, k):
            b, h, s, d = q.shape
            return torch.bmm(q.view(b * h, s, d), k)
    """)
    roles = infer_roles(found[-1].node)
    assert roles["q"] == "full" and roles["k"] == "cube"


def test_a_swiglu_through_act2fn_is_reported_by_the_scan(scan):
    source = textwrap.dedent(_MLP.replace("{init}", 'self.act_fn = ACT2FN["silu"]'))
    assert "silu(" not in source and "sigmoid(" not in source
    assert [f.code for f in scan(source, target="npu").findings] == ["AX114"]


# ----------------------------------------------------------------------- held-out audit: R2-R9
def test_a_per_channel_weight_indexed_with_none_is_the_norms_weight():
    [m] = matches("""
        import torch
        def ln_cf(x, weight, bias, eps: float = 1e-6):
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            x = (x - u) / torch.sqrt(s + eps)
            return weight[:, None, None] * x + bias[:, None, None]
    """)
    assert m.category == "layer_norm" and m.params["dim"] == -3
    assert (m.inputs["weight"], m.inputs["bias"]) == ("weight", "bias")


def test_channels_first_layer_norm_advice_keeps_the_affine(scan):
    source = textwrap.dedent("""
        import torch
        def ln_cf(x, weight, bias, eps: float = 1e-6):
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            return weight[:, None, None] * ((x - u) / torch.sqrt(s + eps)) + bias[:, None, None]
    """)
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX116"]
    assert "weight, bias, eps)" in finding.replacement and not finding.fix.edits


_SOFTMAX_ATTRIBUTE = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    class Attention(nn.Module):
        def __init__(self, head_dim):
            super().__init__()
            self.scale = head_dim ** -0.5
            {init}
        def forward(self, q, k, v):
            dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            return torch.matmul({call}, v)
"""


@pytest.mark.parametrize("init,call,found", [
    ("self.attend = nn.Softmax(dim=-1)", "self.attend(dots)", True),
    ("self.attend = nn.Softmax(-1)", "self.attend(dots)", True),
    ("self.attend = nn.Softmax(dim=-2)", "self.attend(dots)", False),  # over the queries
    ("self.attend = nn.Softmax()", "self.attend(dots)", False),  # torch picks the dim at run time
    ("self.attn_fn = F.softmax", "self.attn_fn(dots, dim=-1)", True),
    ("self.attn_fn = torch.softmax", "self.attn_fn(dots, -1)", True),
    ("self.attn_fn = F.softmax", "self.attn_fn(dots, dim=1)", False),
    ("self.attn_fn = F.softmax\n            self.attn_fn = F.log_softmax", "self.attn_fn(dots, dim=-1)", False),
])
def test_softmax_kept_in_an_attribute(init, call, found):
    source = _SOFTMAX_ATTRIBUTE.replace("{init}", init).replace("{call}", call)
    assert [m.category for m in matches(source)] == (["attention"] if found else [])


def test_a_softmax_function_attribute_passes_the_rule_prefilter(scan):
    source = textwrap.dedent(_SOFTMAX_ATTRIBUTE.replace("{init}", "self.attn_fn = F.softmax")
                             .replace("{call}", "self.attn_fn(dots, dim=-1)"))
    assert "softmax(" not in source
    assert "AX118" in [f.code for f in scan(source, target="cuda").findings]


def test_names_unpacked_from_an_opaque_value_get_their_own_probes():
    found = matches("""
        import torch
        from einops import rearrange
        def attn(qkv, h, scale):
            q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=h), qkv)
            dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
            return torch.einsum("b h i j, b h j d -> b h i d", dots.softmax(dim=-1), v)
    """)
    assert [m.category for m in found] == ["attention"]


@pytest.mark.parametrize("body,found", [
    ("return F.normalize(x, dim=-1) * self.scale * self.g", True),
    ("return self.scale * F.normalize(x, p=2, dim=-1)", True),
    ("return F.normalize(x, dim=-1) * self.temperature * self.g", False),  # not a stored sqrt(d)
    ("return F.normalize(x, dim=-1) * self.g", False),  # an L2 normalisation
    ("return F.normalize(x, p=1, dim=-1) * self.scale", False),
    ("return F.normalize(x, dim=-1) * (self.scale * self.temperature)", False),  # not only a stored factor
])
def test_rms_norm_as_an_l2_normalisation_times_a_stored_factor(body, found):
    source = f"""
        import torch.nn as nn
        import torch.nn.functional as F
        class Norm(nn.Module):
            def forward(self, x):
                {body}
    """
    found_categories = [m.category for m in matches(source)]
    assert found_categories == (["rms_norm"] if found else [])
    if found:
        [m] = matches(source)
        assert m.params["factor"] and m.inputs["factor"] == "self.scale"


def test_normalize_keeps_its_default_dimension():
    [m] = matches("""
        import torch.nn.functional as F
        def norm(x, scale):
            return F.normalize(x) * scale
    """)
    assert m.category == "rms_norm" and m.params["dim"] == -3  # dim=1 of a four-dimensional probe


def test_a_factor_rms_norm_is_advice_that_names_the_assumption(scan):
    source = textwrap.dedent("""
        import torch.nn as nn
        import torch.nn.functional as F
        class RMSNorm(nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.scale = dim ** 0.5
                self.g = nn.Parameter(torch.ones(dim))
            def forward(self, x):
                return F.normalize(x, dim=-1) * self.scale * self.g
    """)
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX115"]
    assert ("this assumes the dim given to __init__ (which sets self.scale) is the size of the dimension the "
            "formula works over" in finding.message) and not finding.fix.edits
    assert "self.g" in finding.replacement


def test_an_rms_norm_scaled_by_a_dimension_argument_fits_exactly():
    [m] = matches("""
        import torch
        def rms(x, g, dim: int):
            n = torch.norm(x, dim=-1, keepdim=True) * dim ** -0.5
            return x / n.clamp(min=1e-8) * g
    """)
    assert m.category == "rms_norm" and not m.params.get("factor") and m.inputs["weight"] == "g"


def test_channels_first_rms_norm_is_reported_with_the_permute_advice(scan):
    source = textwrap.dedent("""
        import torch
        def rms2d(x, weight, eps: float = 1e-5):
            v = torch.mean(x.pow(2), dim=1, keepdim=True)
            return x * torch.rsqrt(v + eps) * weight.reshape(1, -1, 1, 1)
    """)
    [m] = matches(source)
    assert m.category == "rms_norm" and m.params["dim"] == -3 and m.inputs["weight"] == "weight"
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX115"]
    # The dimension as written, not as counted on the probes' 4-D inputs.
    assert "normalises dimension 1, not the last one" in finding.message and not finding.fix.edits
    # The replacement shown moves that dimension last and back, so that it computes
    # what the code does (seen in a review: shown as a norm over the last dimension).
    assert finding.replacement == ("torch.nn.functional.rms_norm(x.movedim(1, -1), (x.shape[1],), weight, "
                                   "eps).movedim(-1, 1)")
    x, weight = torch.randn(2, 5, 3, 4), torch.randn(5)
    written = x * torch.rsqrt(torch.mean(x.pow(2), dim=1, keepdim=True) + 1e-5) * weight.reshape(1, -1, 1, 1)
    shown = torch.nn.functional.rms_norm(x.movedim(1, -1), (x.shape[1],), weight, 1e-5).movedim(-1, 1)
    assert torch.allclose(written, shown, atol=1e-5)


def test_channels_first_layer_norm_is_shown_with_its_dimension_moved_last_and_back(scan):
    source = textwrap.dedent("""
        import torch
        class LayerNorm2d(torch.nn.Module):
            def forward(self, x):
                u = x.mean(1, keepdim=True)
                s = (x - u).pow(2).mean(1, keepdim=True)
                x = (x - u) / torch.sqrt(s + self.eps)
                return self.weight[:, None, None] * x + self.bias[:, None, None]
    """)
    [finding] = [f for f in scan(source, target="cpu").findings if f.code == "AX116"]
    assert finding.replacement == ("torch.nn.functional.layer_norm(x.movedim(1, -1), (x.shape[1],), self.weight, "
                                   "self.bias, self.eps).movedim(-1, 1)")
    assert "the replacement moves it last (movedim) and back" in finding.message
    x, weight, bias = torch.randn(2, 5, 3, 4), torch.randn(5), torch.randn(5)
    u = x.mean(1, keepdim=True)
    written = (weight[:, None, None] * (x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + 1e-6)
               + bias[:, None, None])
    shown = torch.nn.functional.layer_norm(x.movedim(1, -1), (x.shape[1],), weight, bias, 1e-6).movedim(-1, 1)
    assert torch.allclose(written, shown, atol=1e-5)


@pytest.mark.parametrize("stats", ["x.pow(2).mean(self.dim, keepdim=True)",
                                   "x.pow(2).mean(dim=self.dim, keepdim=True)"])
def test_a_norm_over_a_dimension_held_in_a_variable_is_advice_only(scan, stats):
    # self.dim may be 1 (channels first): F.rms_norm over the last one would be wrong.
    source = textwrap.dedent(f"""
        import torch
        class Norm(torch.nn.Module):
            def __init__(self, d, dim=1, eps=1e-5):
                super().__init__()
                self.dim, self.eps = dim, eps
                self.weight = torch.nn.Parameter(torch.ones(d))
            def forward(self, x):
                return x * torch.rsqrt({stats} + self.eps) * self.weight
    """)
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX115"]
    assert "normalises the dimension held in self.dim" in finding.message
    assert finding.fix.applicability.value == "display-only" and not finding.fix.edits


def test_a_layer_norm_over_a_dimension_held_in_a_variable_is_advice_only(scan):
    source = textwrap.dedent("""
        import torch
        def norm(x, weight, bias, dim, eps=1e-5):
            mu = x.mean(dim, keepdim=True)
            var = ((x - mu) ** 2).mean(dim, keepdim=True)
            return (x - mu) / torch.sqrt(var + eps) * weight + bias
    """)
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX116"]
    assert "normalises the dimension held in dim" in finding.message
    assert finding.fix.applicability.value == "display-only" and not finding.fix.edits


@pytest.mark.parametrize("signature,product,found", [
    ("q, k, v, scale", "q.matmul(k)", True),
    ("q, key_t, v, scale", "torch.matmul(q, key_t)", True),
    ("query, keys, v, scale", "query @ keys", True),
    ("x, w, v, scale", "x @ w", False),  # a weight: softmax(x @ w) @ v is not attention
    ("x, prototypes, v, scale", "x.matmul(prototypes)", False),
])
def test_a_key_that_arrives_transposed(signature, product, found):
    source = f"""
        import torch
        def attend({signature}):
            w = torch.softmax({product} * scale, dim=-1)
            return w.matmul(v)
    """
    found_matches = matches(source)
    assert [m.category for m in found_matches] == (["attention"] if found else [])
    if found:
        assert found_matches[0].params["k_transposed"]


def test_a_transposed_key_is_rewritten_with_its_transpose(scan):
    source = "import torch\ndef attend(q, k, v):\n    return torch.softmax(q @ k * 0.125, dim=-1) @ v\n"
    [finding] = [f for f in scan(source, target="cuda").findings if f.code == "AX118"]
    assert "k.transpose(-2, -1)" in finding.replacement and not finding.fix.edits


@pytest.mark.parametrize("body,says", [
    # An additive float mask (0 / -inf), as encoders pass it: SDPA adds attn_mask the same way.
    ("torch.softmax(q @ k.transpose(-2, -1) * 0.125 + mask, dim=-1) @ v", "attn_mask=mask)"),
    # masked_fill's mask is True where a score is dropped, SDPA's where it is kept.
    ("torch.softmax((q @ k.transpose(-2, -1) * 0.125).masked_fill(mask == 0, float('-inf')), dim=-1) @ v",
     "attn_mask=mask != 0)"),
    ("torch.softmax((q @ k.transpose(-2, -1) * 0.125).masked_fill(~mask, float('-inf')), dim=-1) @ v",
     "attn_mask=mask)"),
    ("torch.softmax((q @ k.transpose(-2, -1) * 0.125).masked_fill(mask.logical_not(), -1e9), dim=-1) @ v",
     "attn_mask=mask)"),
    ("torch.softmax((q @ k.transpose(-2, -1) * 0.125).masked_fill(mask, float('-inf')), dim=-1) @ v",
     "attn_mask=~mask)"),
    # torch.where keeps the scores where its condition holds: that is SDPA's attn_mask.
    ("torch.softmax(torch.where(mask, q @ k.transpose(-2, -1) * 0.125, float('-inf')), dim=-1) @ v",
     "attn_mask=mask)"),
    ("torch.softmax(torch.where(mask, float('-inf'), q @ k.transpose(-2, -1) * 0.125), dim=-1) @ v",
     "attn_mask=~mask)"),
])
def test_the_mask_is_passed_the_way_sdpa_reads_it(scan, body, says):
    finding = attention_finding(scan, f"import torch\ndef attend(q, k, v, mask):\n    return {body}\n", "cuda")
    assert finding.replacement.endswith(says)
    assert finding.fix.applicability is Applicability.UNSAFE and finding.fix.edits
    # A boolean mask may be a causal one, which is_causal=True passes faster.
    assert ("is_causal=True" in finding.message) == ("+ mask" not in body)


def _run_attention(source: str, name: str, *args):
    namespace: dict = {}
    exec(compile(source, "<test>", "exec"), namespace)  # the test's own code
    return namespace[name](*args)


def test_a_float_bias_and_a_boolean_mask_both_reach_attn_mask(scan):
    # MPT: a position bias added, then the padded positions filled. One attn_mask takes
    # both; dropping either would change the result.
    import torch

    source = textwrap.dedent("""\
        import torch
        def attend(q, k, v, position_bias, attention_mask):
            scores = torch.matmul(q, k.transpose(-1, -2)) * 0.125
            scores = scores + position_bias
            scores = scores.masked_fill(attention_mask, float("-inf"))
            return torch.matmul(torch.softmax(scores, dim=-1), v)
    """)
    finding = attention_finding(scan, source, "cuda")
    assert finding.replacement.endswith('attn_mask=torch.where(~attention_mask, position_bias, float("-inf")))')
    assert not finding.fix.edits and "a boolean one" in finding.message
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 5) < 0.3
    mask[..., 0] = False  # no row with every score dropped
    fused = "import torch\nimport torch.nn.functional as F\ndef fused(q, k, v, position_bias, attention_mask):\n" \
        f"    return {finding.replacement}\n"
    expected = _run_attention(source, "attend", q, k, v, bias, mask)
    assert torch.allclose(_run_attention(fused, "fused", q, k, v, bias, mask), expected)


def test_scores_started_from_zeros_have_no_mask_of_them_and_the_where_mask_is_kept(scan):
    # GPT-NeoX: baddbmm into a tensor of zeros, q and k flattened to (batch * heads, ...),
    # then the causal mask applied with torch.where.
    source = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        def attend(query, key, value, causal_mask, norm_factor):
            b, h, lq, d = query.shape
            lk = key.shape[-2]
            query = query.reshape(b * h, lq, d)
            key = key.reshape(b * h, lk, d)
            scores = torch.zeros(b * h, lq, lk, dtype=query.dtype, device=key.device)
            scores = torch.baddbmm(scores, query, key.transpose(1, 2), beta=1.0, alpha=norm_factor)
            scores = scores.view(b, h, lq, lk)
            mask_value = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype).to(scores.device)
            scores = torch.where(causal_mask, scores, mask_value)
            return torch.matmul(F.softmax(scores, dim=-1), value)
    """)
    finding = attention_finding(scan, source, "cuda")
    assert finding.replacement.endswith("attn_mask=causal_mask)")
    assert "q and k are 3-D here and v is 4-D" in finding.message and not finding.fix.edits


def test_a_value_unpacked_with_q_and_k_is_not_said_to_have_another_rank(scan):
    # q, k, v unpacked from one permuted projection, q and k rotated: the probes cannot
    # give v its shape from the unpacking; no "v is 3-D" for a 4-D v.
    source = textwrap.dedent("""\
        import math
        import torch
        import torch.nn as nn
        class Attention(nn.Module):
            def forward(self, x, cos, sin, causal):
                B, T, C = x.shape
                q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
                scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
                scores = scores.masked_fill(causal, float("-inf"))
                scores = scores - scores.max(dim=-1, keepdim=True).values
                w = scores.exp()
                w = w / w.sum(dim=-1, keepdim=True)
                return torch.matmul(w, v).transpose(1, 2).reshape(B, T, C)
    """)
    finding = attention_finding(scan, source, "cpu")
    assert "-D here and v is" not in finding.message


@pytest.mark.parametrize("imports,call,suppressed", [
    ("from torch.nn.functional import scaled_dot_product_attention", "scaled_dot_product_attention", True),
    ("from torch.nn.functional import scaled_dot_product_attention as sdpa", "sdpa", True),
    ("import torch.nn.functional as F", "F.scaled_dot_product_attention", True),
    ("from mylib import scaled_dot_product_attention", "scaled_dot_product_attention", False),  # not torch's
    ("from torch.nn.functional import scaled_dot_product_attention", "my_scaled_dot_product_attention", False),
])
def test_a_fused_call_imported_by_name_suppresses_its_fallback(imports, call, suppressed):
    source = f"""
        import torch
        {imports}
        def attend(q, k, v, fused):
            if fused:
                return {call}(q, k, v)
            w = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1)
            return w @ v
    """
    assert [m.category for m in matches(source)] == ([] if suppressed else ["attention"])


def test_a_boolean_mask_takes_the_rank_of_bmm_scores():
    source = """
        import torch
        def attn(q, k, v, mask):
            scores = torch.bmm(q, k.transpose(-1, -2)) / 8.0
            scores = scores.masked_fill(mask, torch.finfo(q.dtype).min)
            return torch.bmm(torch.softmax(scores, dim=-1), v)
    """
    assert infer_roles(roots(source)[-1].node)["mask"] == "bool3"
    [m] = matches(source)
    assert m.category == "attention" and m.params["masked"] and m.inputs["mask"] == "mask"


def test_a_fix_does_not_name_functional_by_an_alias_the_function_rebinds(tmp_path):
    # Audio code: F is the frequency dimension inside forward, F.silu there would be int.silu.
    source = textwrap.dedent("""\
        import math
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class SpecBlock(nn.Module):
            def __init__(self, n=16):
                super().__init__()
                self.lin = nn.Linear(n, n)

            def forward(self, spec):
                B, T, F = spec.shape
                h = self.lin(spec.reshape(B * T, F))
                h = h * torch.sigmoid(h)
                h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
                return h.reshape(B, T, F)


        def elsewhere(x):
            return x * torch.sigmoid(x)
    """)
    from torchaxe.scan.engine import ScanOptions
    from torchaxe.scan.fix import fix_source

    fixed = fix_source(source, "m.py", ScanOptions(target="cpu")).fixed
    assert "h = torch.nn.functional.silu(h)" in fixed
    assert "h = torch.nn.functional.gelu(h)" in fixed
    assert "return F.silu(x)" in fixed  # outside that function the alias is fine
    import importlib.util

    import torch

    path = tmp_path / "fixed_spec.py"
    path.write_text(fixed)
    spec = importlib.util.spec_from_file_location("fixed_spec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SpecBlock()(torch.randn(2, 3, 16)).shape == (2, 3, 16)  # runs: F is not an int's attribute


def test_a_group_norm_written_out_is_not_reported_as_a_layer_norm(scan):
    # The view regroups the channels: the statistics are per group, not over the last dimension.
    source = textwrap.dedent("""
        import torch
        class GroupNormManual(torch.nn.Module):
            def forward(self, x):
                N, C, H, W = x.shape
                x = x.view(N, self.g, -1)
                mean = x.mean(-1, keepdim=True)
                var = x.var(-1, keepdim=True, unbiased=False)
                x = (x - mean) / (var + self.eps).sqrt()
                x = x.view(N, C, H, W)
                return x * self.w + self.b
    """)
    assert not [f for f in scan(source, target="cuda").findings if f.code in ("AX115", "AX116")]


def test_formulas_in_the_cases_of_a_match_statement_are_found(scan):
    source = textwrap.dedent("""
        import math
        import torch
        def act(x, kind):
            match kind:
                case "silu":
                    y = x * torch.sigmoid(x)
                case "gelu":
                    y = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
                case {"scale": s, **rest}:
                    y = x * s
                case _:
                    y = x
            return y * torch.sigmoid(y)  # a SiLU of y itself: y is not read as any one case's value
    """)
    codes = sorted((f.code, f.line) for f in scan(source, target="cuda").findings if f.code.startswith("AX11"))
    assert codes == [("AX111", 9), ("AX113", 7), ("AX113", 14)]


def test_a_partial_rotation_is_reported_where_the_slice_is_rotated():
    """rot_dim read from cos's width: on the probes the slice is all of q, so the
    concatenation with the untouched rest would read as a rotation of q; the finding
    (and its replacement) must be on the rotation of the slice."""
    found = matches("""
        import torch
        def rotate_half(x):
            x1 = x[..., : x.shape[-1] // 2]
            x2 = x[..., x.shape[-1] // 2 :]
            return torch.cat((-x2, x1), dim=-1)
        def apply_rotary(q, cos, sin):
            rot_dim = cos.shape[-1]
            q_rot, q_pass = q[..., :rot_dim], q[..., rot_dim:]
            q_rot = q_rot * cos + rotate_half(q_rot) * sin
            return torch.cat([q_rot, q_pass], dim=-1)
    """)
    assert [(m.category, m.node.lineno) for m in found] == [("rotary", 10)]


def test_a_complex_rotary_is_a_rotation_of_the_input_not_of_its_pairs():
    """freqs_cis[None, :, None, :] indexes a matrix of unit complex numbers: probed as
    one, the whole expression matches, and the replacement rotates t itself
    (interleaved), not the reshaped pairs (where a half rotation of width 2 would fit)."""
    found = matches("""
        import torch
        def apply_rotary_emb(xq, xk, freqs_cis):
            return map(
                lambda t: torch.view_as_real(
                    torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * freqs_cis[None, :, None, :]
                ).flatten(3).type_as(t),
                (xq, xk),
            )
    """)
    assert [(m.category, m.inputs["x"], m.params["mode"]) for m in found] == [("rotary", "t", "interleave")]
    assert found[0].node.end_lineno == 7  # through .flatten(3).type_as(t)


def test_a_three_dimensional_complex_rotary_rotates_the_input(scan):
    """view_as_real(...).flatten(2) merges the pairs back into a 3-D (T, H, D) input:
    probed as 3-D, the replacement rotates xq itself, interleaved."""
    source = textwrap.dedent("""\
        import torch
        def apply_rotary_emb(xq, freqs_cis):
            xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
            return torch.view_as_real(xq_ * freqs_cis[:, None, :]).flatten(2).type_as(xq)
    """)
    [finding] = [f for f in scan(source, target="npu").findings if f.code == "AX119"]
    assert finding.replacement == 'torch_npu.npu_rotary_mul(xq, cos, sin, rotary_mode="interleave")'


@pytest.mark.parametrize("second, sin", [("x1 * (-sin) + x2 * cos", "-sin"), ("x2 * cos - x1 * sin", "-sin"),
                                         ("x2 * cos + x1 * sin", "sin")])
def test_half_width_tables_are_widened_with_the_sign_the_code_rotates_by(scan, second, sin):
    """cos and sin as wide as one half (x1 * cos + x2 * sin): the replacement widens
    them, and a rotation by -theta passes the sine negated."""
    first = "x1 * cos + x2 * sin" if sin == "-sin" else "x1 * cos - x2 * sin"
    source = textwrap.dedent(f"""\
        import torch
        def apply_rotary_emb(x, cos, sin):
            d = x.shape[3] // 2
            x1, x2 = x[..., :d], x[..., d:]
            return torch.cat([{first}, {second}], 3)
    """)
    [finding] = [f for f in scan(source, target="npu").findings if f.code == "AX119"]
    assert finding.replacement == (f"torch_npu.npu_rotary_mul(x, torch.cat((cos, cos), dim=-1), "
                                   f"torch.cat(({sin}, {sin}), dim=-1))")


def test_a_complex_gain_is_not_a_rotation_but_complex_cos_sin_is():
    """torch.complex(re, im) times a complex view: a rotation when its parts are a
    cosine and a sine, a learned gain (any magnitude) otherwise."""
    found = matches("""
        import torch
        def gain(x, self_re, self_im):
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * torch.complex(self_re, self_im)).flatten(-2)
        def rope(x, cos, sin):
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
    """)
    assert [(m.category, m.scope_name) for m in found] == [("rotary", "rope")]


def test_fitting_a_mask_on_degenerate_scores_prints_nothing(capfd):
    """torch.onnx's reference attention once led the mask fit into a least-squares
    call with nothing to fit, and LAPACK wrote an error line into the scan's output."""
    import torch

    path = __import__("pathlib").Path(torch.__file__).parent / "onnx" / "ops" / "_impl.py"
    if not path.is_file():
        pytest.skip("this torch has no torch/onnx/ops/_impl.py")
    source = path.read_text()
    ctx = FileContext(str(path), source, ast.parse(source), "npu")
    formula_matches(ctx)
    out, err = capfd.readouterr()
    assert "DGELSY" not in out + err and "MKL" not in out + err


def test_a_norm_over_another_dimension_keeps_its_eps():
    """PixelNorm (RMS over dim 1): a small eps also fits as none within the probes'
    tolerance; the closest one is kept, as over the last dimension."""
    found = matches("""
        import torch
        def pixel_norm(x):
            return x * torch.rsqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-6)
    """)
    assert [m.category for m in found] == ["rms_norm"]
    assert found[0].params["dim"] != -1 and found[0].params["eps"] == pytest.approx(1e-6)


def test_an_added_float_bias_is_offered_as_pse_on_npu():
    """ALiBi's bias is added to the scores: npu_fusion_attention takes it as pse (a float
    bias, before its scale), not as atten_mask (a boolean of dropped positions)."""
    from torchaxe.scan.engine import ScanOptions, scan_source

    source = textwrap.dedent("""
        import math
        import torch
        import torch.nn.functional as F
        def alibi_attention(q, k, v, bias):
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
            scores = scores + bias
            return torch.matmul(F.softmax(scores, dim=-1), v)
    """)
    report = scan_source(source, "t.py", ScanOptions(target="npu", select=("AX118",)))
    [finding] = report.findings
    text = finding.message + " " + (finding.fix.title if finding.fix else "")
    assert "pse=bias / (q.shape[-1] ** -0.5), scale=q.shape[-1] ** -0.5" in finding.message and "atten_mask=<" not in finding.message, text


@pytest.mark.parametrize("body, replacement", [
    # The default scale, whatever the code calls head_dim: read from q.
    ("attn = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))\n    return torch.softmax(attn, dim=-1) @ v",
     'torch_npu.npu_fusion_attention(q, k, v, head_num, "BNSD", scale=q.shape[-1] ** -0.5)[0]'),
    # A tensor temperature cannot be its float scale: it goes on q.
    ("attn = (q @ k.transpose(-2, -1)) * temperature\n    return attn.softmax(dim=-1) @ v",
     'torch_npu.npu_fusion_attention(q * temperature, k, v, head_num, "BNSD", scale=1.0)[0]'),
    # (batch * heads, sequence, head_dim), as bmm takes them: BSH with one head.
    ("attn = torch.bmm(q * scale, k.transpose(1, 2)).softmax(dim=-1)\n    return torch.bmm(attn, v)",
     'torch_npu.npu_fusion_attention(q * scale, k, v, 1, "BSH", scale=1.0)[0]'),
    # Channels before positions: transposed in and out.
    ("w = torch.einsum('bct,bcs->bts', q * scale, k).softmax(dim=-1)\n    return torch.einsum('bts,bcs->bct', w, v)",
     'torch_npu.npu_fusion_attention((q * scale).transpose(-2, -1), k.transpose(-2, -1), v.transpose(-2, -1), 1, '
     '"BSH", scale=1.0)[0].transpose(-2, -1)'),
    # One key/value head for all query heads.
    ("sim = torch.einsum('bhid,bjd->bhij', q * scale, k)\n    return torch.einsum('bhij,bjd->bhid', sim.softmax(-1), v)",
     'torch_npu.npu_fusion_attention(q * scale, k.unsqueeze(1), v.unsqueeze(1), head_num, "BNSD", scale=1.0)[0]'),
])
def test_npu_attention_arguments_follow_the_codes_layout_and_names(scan, body, replacement):
    source = f"import math\nimport torch\n\n\ndef attend(q, k, v, scale, temperature):\n    {body}\n"
    assert attention_finding(scan, source, "npu").replacement == replacement


def attention_finding(scan, source: str, target: str):
    """The one AX118 finding of ``source`` for ``target``."""
    [finding] = [f for f in scan(source, target=target).findings if f.code == "AX118"]
    return finding


def test_npu_attention_keeps_the_codes_dropout_as_keep_prob(scan):
    source = textwrap.dedent("""\
        import math
        import torch
        import torch.nn.functional as F
        from torch import nn
        class Attn(nn.Module):
            def __init__(self, p):
                super().__init__()
                self.attn_dropout = nn.Dropout(p)
            def forward(self, q, k, v):
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                att = F.softmax(att, dim=-1)
                att = self.attn_dropout(att)
                return att @ v
    """)
    finding = attention_finding(scan, source, "npu")
    assert finding.replacement.endswith(
        "keep_prob=1 - (self.attn_dropout.p if self.training else 0.0))[0]"), finding.replacement
    assert "keep_prob is the share kept" in finding.message


def test_window_attention_with_a_gathered_position_bias_is_found(scan):
    """A relative-position bias gathered from a table by an index buffer does not fit
    the probes: it is read as a term of the scores' shape, so the attention is found;
    with q scaled beforehand the bias goes to pse as it is."""
    source = textwrap.dedent("""\
        import torch
        from torch import nn
        class WindowAttention(nn.Module):
            def forward(self, x, mask=None):
                B_, N, C = x.shape
                qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
                q, k, v = qkv[0], qkv[1], qkv[2]
                q = q * self.scale
                attn = q @ k.transpose(-2, -1)
                bias = self.bias_table[self.position_index.view(-1)].view(self.area, self.area, -1)
                attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
                if mask is not None:
                    nW = mask.shape[0]
                    attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
                    attn = attn.view(-1, self.num_heads, N, N)
                attn = attn.softmax(dim=-1)
                return (attn @ v).transpose(1, 2).reshape(B_, N, C)
    """)
    finding = attention_finding(scan, source, "npu")
    assert finding.line == 17
    assert finding.replacement.startswith(
        'torch_npu.npu_fusion_attention(q, k, v, head_num, "BNSD", pse=bias.permute(2, 0, 1).contiguous().unsqueeze(0), '
        'scale=1.0'), finding.replacement


@pytest.mark.parametrize("target, replacement", [
    ("npu", 'torch_npu.npu_fusion_attention(q, k.transpose(-2, -1), v.transpose(-2, -1), 1, "BSH", '
            'scale=q.shape[-1] ** -0.5)[0].transpose(-2, -1)'),
    ("cuda", "torch.nn.functional.scaled_dot_product_attention(q, k.transpose(-2, -1), v.transpose(-2, -1))"
             ".transpose(-2, -1)"),
])
def test_values_first_attention_keeps_the_query_positions_first(scan, target, replacement):
    """bmm(v, softmax(q k).permute(0, 2, 1)) with q positions-first and k, v
    channel-first: only k and v go in transposed, and the result comes back so."""
    source = textwrap.dedent("""\
        import torch
        def attend(q, k, v):
            b, c, n = k.shape
            w_ = torch.bmm(q, k) * (int(c) ** (-0.5))
            w_ = torch.nn.functional.softmax(w_, dim=2)
            return torch.bmm(v, w_.permute(0, 2, 1))
    """)
    assert attention_finding(scan, source, target).replacement == replacement


@pytest.mark.parametrize("dim, found", [(2, ["attention"]), (-1, ["attention"]), (1, [])])
def test_a_fused_projection_split_along_a_dimension_counted_from_the_front(dim, found):
    # MPT: q, k, v = self.Wqkv(x).chunk(3, dim=2) of a (batch, sequence, 3 * width)
    # projection; dimension 2 is taken for the last of a three-dimensional tensor.
    # Split along dimension 1 (the sequence), the pieces are not heads of one token.
    source = f"""
import torch
class Attention(torch.nn.Module):
    def forward(self, x):
        b, s = x.shape[:2]
        q, k, v = self.Wqkv(x).chunk(3, dim={dim})
        q = q.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale, dim=-1)
        return torch.matmul(w, v)
"""
    assert [m.category for m in matches(source) if m.category == "attention"] == found


def test_heads_folded_into_the_batch_by_a_count_from_inputs_that_hold_them():
    # Bloom: q (batch, heads, sequence, width) reshaped to (batch * self.num_heads, -1,
    # width), scores from alibi.baddbmm(batch1=, batch2=), viewed back to four dimensions.
    source = """
import torch
import torch.nn.functional as F
class Attention(torch.nn.Module):
    def forward(self, hidden_states, alibi):
        batch_size, q_length, _ = hidden_states.shape
        q, k, v = self._split_heads(self.query_key_value(hidden_states))
        q = q.reshape(batch_size * self.num_heads, -1, self.head_dim)
        k = k.reshape(batch_size * self.num_heads, -1, self.head_dim).transpose(-1, -2)
        v = v.reshape(batch_size * self.num_heads, -1, self.head_dim)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=self.inv_norm_factor)
        weights = F.softmax(scores.view(batch_size, self.num_heads, q_length, -1), dim=-1)
        return torch.bmm(weights.view(batch_size * self.num_heads, q_length, -1), v)
"""
    [found] = [m for m in matches(source) if m.category == "attention"]
    assert found.params["masked"] and found.params["scale"] == pytest.approx(scalar_value("self.inv_norm_factor"))


def test_a_small_scan_whose_formula_results_are_stored_stays_in_this_process(tmp_path, monkeypatch):
    # Starting workers costs more than a warm scan of a small project: --jobs 2 then
    # scans here. Files no formula rule looks at need no stored result.
    import torchaxe.scan.engine as engine
    from torchaxe.scan.formulas import analysis

    monkeypatch.setattr(analysis, "STORE", FingerprintStore(use_disk=False))
    gelu = "import torch\ndef act(x):\n    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))\n"
    for i in range(60):  # more than one chunk of files
        (tmp_path / f"m{i:03}.py").write_text((gelu, "import torch\nopt = torch.optim.AdamW(p)\n")[i % 2]
                                              + f"# file {i}\n")

    class NoPool:
        def __init__(self, *args, **kwargs):
            raise AssertionError("workers started")

    monkeypatch.setattr(engine, "ProcessPoolExecutor", NoPool)
    options = engine.ScanOptions(target="cpu", capabilities={"fused_optimizers": ["AdamW"]})
    with pytest.raises(AssertionError, match="workers started"):  # cold: the work is worth sharing
        engine.scan_paths([tmp_path], engine.ScanOptions(**{**options.__dict__, "jobs": 2}))
    serial = engine.scan_paths([tmp_path], engine.ScanOptions(**{**options.__dict__, "jobs": 1}))
    reads: list[str] = []
    real_read = Path.read_bytes

    def counted(self):
        reads.append(self.name)
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", counted)
    warm = engine.scan_paths([tmp_path], engine.ScanOptions(**{**options.__dict__, "jobs": 2}))
    monkeypatch.setattr(Path, "read_bytes", real_read)
    assert [f.to_dict() for f in warm.findings] == [f.to_dict() for f in serial.findings]
    assert sum(f.code == "AX110" for f in warm.findings) == 30
    assert sorted(reads) == sorted(p.name for p in tmp_path.glob("*.py"))  # each file read once
    monkeypatch.setattr(engine, "WARM_IN_PROCESS_BYTES", 0)  # a large project: workers again
    with pytest.raises(AssertionError, match="workers started"):
        engine.scan_paths([tmp_path], engine.ScanOptions(**{**options.__dict__, "jobs": 2}))


def test_an_rms_norm_by_f_normalize_is_fixed_with_an_eps_that_keeps_zero_rows_zero(scan):
    # x-transformers' RMSNorm: F.normalize clamps the norm at 1e-12; with eps 0 the
    # fused kernel would turn a row of zeros into NaN.
    source = ("import torch\nimport torch.nn.functional as F\n\n\nclass RMSNorm(torch.nn.Module):\n"
              "    def __init__(self, dim):\n        super().__init__()\n        self.scale = dim ** 0.5\n"
              "        self.g = torch.nn.Parameter(torch.ones(dim))\n\n"
              "    def forward(self, x):\n        return F.normalize(x, dim=-1) * self.scale * self.g\n")
    finding, = [f for f in scan(source, target="cuda").findings if f.code == "AX115"]
    assert finding.replacement == "F.rms_norm(x, (x.shape[-1],), self.g, 1e-24)"
    assert "a row of zeros stays zeros, not NaN" in finding.message


@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_attention_whose_query_comes_from_a_complex_rotary_helper(target):
    # pytorch-llama: on npu the rotary helper is read (and inlined) for the NPU's rotary
    # rule; the attention on its output is still found, and the rotary beside it.
    source = """
import math
import torch
import torch.nn.functional as F


def apply_rotary_embeddings(x, freqs_complex, device):
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_complex = freqs_complex.unsqueeze(0).unsqueeze(2)
    x_out = torch.view_as_real(x_complex * freqs_complex).reshape(*x.shape)
    return x_out.type_as(x).to(device)


def attend(xq, keys, values, head_dim, freqs_complex):
    xq = apply_rotary_embeddings(xq, freqs_complex, device=xq.device)
    xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(head_dim)
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    return torch.matmul(scores, values)
"""
    found = sorted((m.category, m.line) for m in matches(source, target))
    expected = [("attention", 19)] + ([("rotary", 10)] if target == "npu" else [])
    assert found == sorted(expected)


def test_a_silu_inside_a_swiglu_stays_the_swiglus_on_npu():
    source = """
import torch
import torch.nn.functional as F


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gate(h):
    a, b = torch.split(h, h.shape[-1] // 2, dim=-1)
    return a * torch.sigmoid(a) * b
"""
    assert sorted(m.category for m in matches(source, "npu")) == ["rotary", "swiglu"]


def test_gpt2s_zero_one_mask_written_as_arithmetic():
    # The first GPT-2 code: w * b + -1e9 * (1 - b) with b a triangle of ones.
    source = """
import math
import torch
import torch.nn as nn


class Attention(nn.Module):
    def _attn(self, q, k, v):
        w = torch.matmul(q, k) / math.sqrt(v.size(-1))
        b = self.b[:, :, :w.size(-2), :w.size(-1)]
        w = w * b + -1e9 * (1 - b)
        w = nn.Softmax(dim=-1)(w)
        return torch.matmul(w, v)

    def _attn_subtracted(self, q, k, v):
        w = torch.matmul(q, k) / math.sqrt(v.size(-1))
        b = self.bias[:, :, :w.size(-2), :w.size(-1)]
        w = w * b - 1e10 * (1 - b)
        return torch.matmul(torch.softmax(w, dim=-1), v)
"""
    found = [m for m in matches(source, "cpu") if m.category == "attention"]
    assert [m.line for m in found] == [13, 19]
    assert all(m.params["masked"] for m in found)


def test_attention_over_the_channels_of_an_image_projection_split_in_three():
    # Restormer's transposed attention: qkv.chunk(3, dim=1) of a convolution, each
    # piece rearranged from (b, (head c), h, w), a learned temperature as the scale.
    source = """
import torch
from einops import rearrange


class Attention(torch.nn.Module):
    def forward(self, x):
        qkv = self.qkv_dwconv(self.qkv(x))
        q, k, v = qkv.chunk(3, dim=1)
        q = rearrange(q, 'b (head c) h w -> b head c (h w)', head=self.num_heads)
        k = rearrange(k, 'b (head c) h w -> b head c (h w)', head=self.num_heads)
        v = rearrange(v, 'b (head c) h w -> b head c (h w)', head=self.num_heads)
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        attn = attn.softmax(dim=-1)
        return attn @ v
"""
    assert [m.category for m in matches(source, "cpu") if m.category == "attention"] == ["attention"]


def test_a_mask_written_into_the_scores_in_place_is_part_of_the_attention(scan):
    # score.masked_fill_(mask, -1e9) changed the scores, yet the replacement left the
    # mask out: the scores were read as they were before the in-place write.
    source = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        def attend(q, k, v, mask):
            score = torch.matmul(q, k.transpose(2, 3)) / 8.0
            score.masked_fill_(mask, -1e9)
            return torch.matmul(F.softmax(score, -1), v)
    """)
    assert attention_finding(scan, source, "cpu").replacement == \
        "F.scaled_dot_product_attention(q, k, v, scale=1 / 8.0, attn_mask=~mask)"


def test_conformers_relative_attention_with_its_sqrt_dim_divisor():
    # sooftware/conformer: (content + position scores) / self.sqrt_dim, the position
    # scores a bias of their own.
    source = """
import torch
import torch.nn.functional as F


class RelativeAttention(torch.nn.Module):
    def forward(self, query, key, value, pos_embedding):
        content_score = torch.matmul((query + self.u_bias).transpose(1, 2), key.transpose(2, 3))
        pos_score = torch.matmul((query + self.v_bias).transpose(1, 2), pos_embedding.permute(0, 2, 3, 1))
        score = (content_score + pos_score) / self.sqrt_dim
        return torch.matmul(F.softmax(score, -1), value)
"""
    found = [m for m in matches(source, "cpu") if m.category == "attention"]
    assert len(found) == 1 and found[0].params["mask_added"]


def test_a_head_count_divides_a_size_read_from_the_input():
    # XLM: dim_per_head = dim // n_heads, dim from input.size(): a count, not a tensor.
    source = """
import math
import torch
import torch.nn.functional as F


class MultiHeadAttention(torch.nn.Module):
    def forward(self, input, k, v, mask):
        bs, qlen, dim = input.size()
        dim_per_head = dim // self.n_heads
        q = self.q_lin(input) / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores.masked_fill_(mask, -float('inf'))
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        return torch.matmul(weights, v)
"""
    assert [m.category for m in matches(source, "cpu")] == ["attention"]


def test_a_complex_rotary_whose_table_is_viewed_to_the_inputs_sizes():
    # DeepSeek-V3: freqs_cis.view(1, x.size(1), 1, x.size(-1)) of a complex x.
    source = """
import torch


def apply_rotary_emb(x, freqs_cis):
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)
"""
    assert [m.category for m in matches(source, "npu")] == ["rotary"]


def test_a_fallback_bound_only_for_old_torch_is_not_reported():
    source = """
import torch
import torch.nn.functional as F


def _silu_python(x):
    return x * torch.sigmoid(x)


def swish(x):
    return x * torch.sigmoid(x)


if torch.__version__ < "1.7":
    silu = _silu_python
else:
    silu = F.silu
ACT = {"swish": swish}
"""
    assert [(m.category, m.scope_name) for m in matches(source, "cpu")] == [("silu", "swish")]


def test_a_module_bound_only_where_torch_lacks_the_operator_is_not_reported():
    # Reformer: ``GELU = nn.GELU if hasattr(nn, 'GELU') else GELU_``; the same class
    # used anywhere else is reported.
    source = """
import math
import torch
from torch import nn


class GELU_(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


GELU = nn.GELU if hasattr(nn, 'GELU') else GELU_
"""
    assert matches(source, "cpu") == []
    assert [m.category for m in matches(source + "ACT = GELU_\n", "cpu")] == ["gelu_tanh"]


def test_attention_with_the_heads_last_in_its_weights(scan):
    # Transformer-XL writes its operands as one tuple, keeps the sequence first and
    # normalises over dim 1; labml's NeoX keeps the batch first and normalises over
    # dim -2, its mask filled with a number set in __init__.
    seq_first = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        def attend(q, k, v, scale):
            score = torch.einsum('ibnd,jbnd->ijbn', (q, k))
            score.mul_(scale)
            prob = F.softmax(score, dim=1)
            return torch.einsum('ijbn,jbnd->ibnd', (prob, v))
    """)
    finding = attention_finding(scan, seq_first, "cuda")
    assert finding.replacement == ("F.scaled_dot_product_attention(q.permute(1, 2, 0, 3) * scale, "
                                   "k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), scale=1.0).permute(2, 0, 1, 3)")
    assert finding.fix is None or finding.fix.applicability == Applicability.DISPLAY_ONLY
    batch_first = textwrap.dedent("""\
        import torch
        class Attention(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.softmax = torch.nn.Softmax(dim=-2)
                self.mask_fill = float('-inf')
            def forward(self, q, k, v, mask):
                attn = torch.einsum('bihk,bjhk->bijh', q, k) * self.scale
                attn.masked_fill_(mask, self.mask_fill)
                attn = self.softmax(attn)
                return torch.einsum('bijh,bjhk->bihk', attn, v)
    """)
    finding = attention_finding(scan, batch_first, "cuda")
    assert finding.replacement == ("torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2) * self.scale, "
                                   "k.transpose(1, 2), v.transpose(1, 2), scale=1.0, attn_mask=~mask).transpose(1, 2)")
    assert "permuted to (batch, heads, query, key)" in finding.message
    # Both replacements compute what the code does.
    q, k, v = (torch.randn(5, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    code = torch.einsum('ijbn,jbnd->ibnd', torch.einsum('ibnd,jbnd->ijbn', q, k).mul(0.3).softmax(1), v)
    fused = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3) * 0.3, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), scale=1.0).permute(2, 0, 1, 3)
    assert torch.allclose(code, fused)


def test_a_partial_rotary_with_sliced_caches_keeps_the_slices(scan):
    # labml's RoPE: only the first self.d features rotate; the caches are cut to the
    # sequence's length, which the replacement must keep.
    source = textwrap.dedent("""\
        import torch
        class RotaryPositionalEmbeddings(torch.nn.Module):
            def _neg_half(self, x):
                d_2 = self.d // 2
                return torch.cat([-x[:, :, :, d_2:], x[:, :, :, :d_2]], dim=-1)
            def forward(self, x):
                seq_len = x.shape[0]
                x_rope, x_pass = x[..., :self.d], x[..., self.d:]
                neg_half_x = self._neg_half(x_rope)
                x_rope = (x_rope * self.cos_cached[:seq_len]) + (neg_half_x * self.sin_cached[:seq_len])
                return torch.cat((x_rope, x_pass), dim=-1)
    """)
    [finding] = [f for f in scan(source, target="npu").findings if f.code == "AX119"]
    assert finding.replacement == "torch_npu.npu_rotary_mul(x_rope, self.cos_cached[:seq_len], self.sin_cached[:seq_len])"


def test_a_softmax_chosen_by_a_conditional_expression_is_read_with_its_first_choice():
    # DALLE-pytorch: ``softmax = torch.softmax if not self.stable else stable_softmax``.
    source = """
import torch


def stable_softmax(t, dim=-1, alpha=32 ** 2):
    t = t / alpha
    t = t - torch.amax(t, dim=dim, keepdim=True).detach()
    return (t * alpha).softmax(dim=dim)


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        softmax = torch.softmax if not self.stable else stable_softmax
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        attn = softmax(dots, dim=-1)
        return torch.einsum('b h i j, b h j d -> b h i d', attn, v)
"""
    assert [(m.category, m.scope_name) for m in matches(source, "cuda")] == [("attention", "Attention.forward")]
    # A conditional between something else than callables is not read so.
    other = source.replace("torch.softmax if not self.stable else stable_softmax", "self.pick(1) if a else None")
    assert matches(other, "cuda") == []


def test_a_helper_defined_inside_the_function_is_inlined():
    # minimind: ``def rotate_half(x): ...`` written inside apply_rotary_pos_emb.
    source = """
import torch


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    def rotate_half(x): return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
    q_embed = (q * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(q) * sin.unsqueeze(unsqueeze_dim))
    k_embed = (k * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(k) * sin.unsqueeze(unsqueeze_dim))
    return q_embed, k_embed
"""
    found = [(m.category, m.node.lineno) for m in matches(source, "npu")]
    assert found == [("rotary", 7), ("rotary", 8)]
    # A helper that is not a rotation is no rotary.
    scaled = source.replace("return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)",
                            "return x * 2")
    assert matches(scaled, "npu") == []


def test_projections_written_with_f_linear_are_read_as_layer_outputs():
    # VideoMAE builds its qkv bias by hand and projects with F.linear(input=...,
    # weight=self.qkv.weight, bias=...); a LLaMA-style feed-forward with F.linear.
    attention = """
import torch
import torch.nn.functional as F


class Attention(torch.nn.Module):
    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = None
        if self.q_bias is not None:
            qkv_bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(B, N, -1)
"""
    assert [m.category for m in matches(attention, "cuda")] == ["attention"]
    feed_forward = """
import torch
import torch.nn.functional as F


class FeedForward(torch.nn.Module):
    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w1.weight)) * F.linear(x, self.w3.weight), self.w2.weight)
"""
    assert [m.category for m in matches(feed_forward, "npu")] == ["swiglu"]


def test_channel_first_attention_of_feature_maps_is_kept_whatever_the_key_is_called():
    """SAGAN's non-local block: softmax(theta^T phi) then g @ beta^T, channels before
    positions throughout and no scale. A key used as written is kept only when named
    like a key, unless the values are channel-first too and the query was made
    positions-first on the spot (layout "BDS-q"); a product with a weight matrix is
    still left alone."""
    sagan = """
    import torch
    import torch.nn.functional as F
    def attn(theta, phi, g):
        beta = F.softmax(torch.bmm(theta.transpose(1, 2), phi), -1)
        return torch.bmm(g, beta.transpose(1, 2))
    """
    [found] = [m for m in matches(sagan, "cuda") if m.category == "attention"]
    assert found.params["layout"] == "BDS-q" and found.params["scale"] == pytest.approx(1.0)
    gate = """
    import torch
    import torch.nn.functional as F
    def gated(x, w, v):
        return torch.bmm(F.softmax(torch.bmm(x, w), -1), v)
    """
    assert not [m for m in matches(gate, "cuda") if m.category == "attention"]


_FULL_ATTENTION = """
import torch
from math import sqrt

class FullAttention(torch.nn.Module):
    def forward(self, queries, keys, values):
        N, L, H, E = queries.shape
        softmax_temp = self.softmax_temp or 1. / sqrt(E)
        queries = queries * softmax_temp
        QK = torch.einsum("nlhe,nshe->nhls", queries, keys)
        {top}
        A = self.dropout(torch.softmax(QK, dim=-1))
        return torch.einsum("nhls,nshd->nlhd", A, values).contiguous()
"""


def test_a_scale_chosen_with_or_is_a_number():
    """fast-transformers: ``self.softmax_temp or 1./sqrt(E)`` scales the queries; an
    ``or`` whose last value is a number is read as a number (``math_or``), not as a
    tensor the queries are multiplied by."""
    [found] = [m for m in matches(_FULL_ATTENTION.replace("{top}", "pass"), "cuda") if m.category == "attention"]
    assert found.params["layout"] == "BSND"


def test_top_k_sparsified_attention_is_left_alone():
    """Exact top-k attention masks all but each row's top scores: it needs the score
    matrix a fused attention never makes."""
    top = ("QK = QK + torch.zeros_like(QK).scatter(-1, torch.topk(QK, 4, dim=-1)[1], 1.0)"
           ".log()")
    assert not [m for m in matches(_FULL_ATTENTION.replace("{top}", top), "cuda") if m.category == "attention"]


def test_a_method_that_only_returns_the_scores_product_is_read_into_the_attention():
    """labml's MultiHeadAttention keeps its scores in ``get_scores`` (to be overridden
    by relative attention): a method that only returns an einsum, matmul or ``@`` holds
    no formula word, and is inlined all the same."""
    source = """
    import math
    import torch
    import torch.nn as nn
    class MultiHeadAttention(nn.Module):
        def __init__(self, d_k):
            super().__init__()
            self.softmax = nn.Softmax(dim=1)
            self.scale = 1 / math.sqrt(d_k)
        def get_scores(self, query, key):
            \"\"\"Overridden by relative attention.\"\"\"
            return torch.einsum('ibhd,jbhd->ijbh', query, key)
        def forward(self, query, key, value):
            scores = self.get_scores(query, key)
            scores *= self.scale
            attn = self.softmax(scores)
            return torch.einsum("ijbh,jbhd->ibhd", attn, value)
    """
    [found] = [m for m in matches(source, "cuda") if m.category == "attention"]
    assert found.params["layout"] == "SBND"
