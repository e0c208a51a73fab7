"""AX102: code that Huawei's affinity table (pytorch_analyse.sh -m affinity_apis)
maps to a torch_npu affinity function or module."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

# The entries of pytorch_analyse's affinity table for torch 1.11 (names and parameter
# lists, as facts). A function or method matches by name and exact parameter list, a
# class by name and its forward's parameter list, as the name-based tool does.
FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "single_level_responsible_flags": (
        ("self", "featmap_size", "gt_bboxes", "stride", "num_base_anchors", "device"),
        "torch_npu.contrib.function.npu_single_level_responsible_flags",
    ),
    "encode": (("self", "bboxes", "gt_bboxes", "stride"), "torch_npu.contrib.function.npu_bbox_coder_encode_xyxy2xywh"),
    "decode": (("self", "bboxes", "pred_bboxes", "stride"), "torch_npu.contrib.function.npu_bbox_coder_decode_xyxy2xywh"),
    "multiclass_nms": (
        ("multi_bboxes", "multi_scores", "score_thr", "nms_cfg", "max_num", "score_factors", "return_inds"),
        "torch_npu.contrib.function.npu_multiclass_nms",
    ),
    "fast_nms": (
        ("multi_bboxes", "multi_scores", "multi_coeffs", "score_thr", "iou_thr", "top_k", "max_num"),
        "torch_npu.contrib.function.npu_batched_multiclass_nms",
    ),
    "channel_shuffle": (("x", "groups"), "torch_npu.contrib.module.ChannelShuffle"),
}

CLASSES: dict[str, tuple[tuple[str, ...], str]] = {
    "MultiheadAttention": (
        ("self", "query", "key", "value", "key_padding_mask", "incremental_state", "need_weights",
         "static_kv", "attn_mask", "before_softmax", "need_head_weights"),
        "torch_npu.contrib.module.MultiheadAttention",
    ),
    "FairseqDropout": (("self", "x", "inplace"), "torch_npu.contrib.module.NpuCachedDropout"),
    "Mish": (("self", "input"), "torch_npu.contrib.module.Mish"),
    "ModulatedDeformConv2dFunction": (
        ("ctx", "input", "offset", "mask", "weight", "bias", "stride", "padding", "dilation", "groups", "deform_groups"),
        "torch_npu.contrib.module.ModulatedDeformConv",
    ),
    "DropPath": (("self", "x"), "torch_npu.contrib.module.NpuDropPath"),
    "Focus": (("self", "x"), "torch_npu.contrib.module.Focus"),
    "PSROIPool": (("self", "features", "rois"), "torch_npu.contrib.module.PSROIPool"),
    "ROIAlign": (("self", "input", "rois"), "torch_npu.contrib.module.ROIAlign"),
}

CALLS: dict[str, str] = {
    "torch.matmul": "torch_npu.contrib.function.matmul_transpose",
    "torch.roll": "torch_npu.contrib.function.roll",
    "torch.nn.SiLU": "torch_npu.contrib.module.SiLU",
}


def _last_two_swapped(node: ast.AST) -> ast.AST | None:
    """``b`` of ``b.transpose(-1, -2)``, ``torch.transpose(b, -2, -1)``, ``b.mT`` or
    ``b.t()`` (a 2-D ``b``); None for anything else."""
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        return node.value
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute):
        return None
    func, args = node.func, node.args
    if func.attr == "t" and not args:
        return func.value
    if func.attr != "transpose":
        return None
    if len(args) == 3 and isinstance(func.value, ast.Name) and func.value.id == "torch":
        tensor, args = args[0], args[1:]
    elif len(args) == 2:
        tensor = func.value
    else:
        return None
    dims = {ast.literal_eval(a) if isinstance(a, (ast.Constant, ast.UnaryOp)) else None for a in args}
    return tensor if dims == {-1, -2} else None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs))


class NpuAffinityTable(Rule):
    """
    ## What it does
    On the `npu` target, reports every place that Huawei's affinity-API table (the one
    `pytorch_analyse.sh -m affinity_apis` matches against) maps to a `torch_npu`
    affinity function or module: user functions and classes with the listed names and
    parameter lists (bounding-box coders, NMS, channel shuffle, Fairseq multi-head
    attention and dropout, Mish, DropPath, Focus, PSROIPool, ROIAlign, modulated
    deformable convolution) and the calls `torch.matmul` by a transposed second operand
    (`matmul_transpose` takes it untransposed), `torch.roll` and `torch.nn.SiLU`.

    ## Why is this bad?
    These are written with many small generic operators; the listed `torch_npu`
    replacements are fused operators tuned for Ascend. Unlike pytorch_analyse,
    torchaxe also scans installed third-party packages (`--package`), where most of
    these implementations live.

    ## Example
    ```python
    def channel_shuffle(x, groups):
        ...
    ```

    ## Use instead
    ```python
    torch_npu.contrib.module.ChannelShuffle(...)
    ```

    ## Fix safety
    Display-only: the replacements have their own signatures and semantics (for
    example `matmul_transpose` multiplies by the transpose of its second operand), so
    each needs a human. Unverified on Ascend hardware.
    """

    code = "AX102"
    name = "npu-affinity-table-match"
    category = "affinity_api"
    message = "listed in the NPU affinity table with a torch_npu replacement"
    targets = ("npu",)
    requires_text = (
        *(f"def {name}(" for name in FUNCTIONS),
        *(f"class {name}" for name in CLASSES),
        "matmul",
        "roll(",
        "SiLU",
    )
    node_types = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Call)
    references = (
        "https://www.hiascend.com/document (pytorch_analyse affinity API list; torch_npu.contrib)",
    )
    examples = (
        Invalid("import torch\ndef channel_shuffle(x, groups):\n    return x\n", target="npu", lines=(2,)),
        Invalid(
            "import torch\nclass DropPath(torch.nn.Module):\n    def __init__(self, drop_prob):\n        super().__init__()\n"
            "    def forward(self, x):\n        return x\n",
            target="npu", lines=(2,),
        ),
        Invalid("import torch\ny = torch.roll(x, 1, 0)\nact = torch.nn.SiLU()\n", target="npu", lines=(2, 3)),
        Invalid("import torch\ns = torch.matmul(q, k.transpose(-1, -2))\nt = torch.matmul(a, b.mT)\n", target="npu", lines=(2, 3)),
        # matmul_transpose multiplies by the transpose of its second operand: a plain product is no fit.
        Valid("import torch\ny = torch.matmul(w, v)\nz = torch.matmul(x, y.transpose(1, 2))\n", target="npu"),
        Valid("import torch\ndef channel_shuffle(x, groups, extra):\n    return x\n", target="npu"),
        Valid("import torch\ndef channel_shuffle(x, groups):\n    return x\n", target="cuda"),
        Valid("import torch\nclass DropPath(torch.nn.Module):\n    def forward(self, x, scale):\n        return x\n", target="npu"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        display = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            entry = FUNCTIONS.get(node.name)
            if entry and _params(node) == entry[0]:
                yield self._finding(ctx, node, f"function {node.name}()", entry[1], display)
        elif isinstance(node, ast.ClassDef):
            entry = CLASSES.get(node.name)
            if entry:
                forward = next(
                    (s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "forward"),
                    None,
                )
                if forward is not None and _params(forward) == entry[0]:
                    yield self._finding(ctx, node, f"class {node.name}", entry[1], display)
        elif isinstance(node, ast.Call):
            name = ctx.call_name(node)
            if name == "torch.matmul":
                # matmul_transpose(a, b) is a @ b^T: it fits a product by a transposed
                # second operand only, which it takes untransposed.
                untransposed = _last_two_swapped(node.args[1]) if len(node.args) == 2 and not node.keywords else None
                if untransposed is not None:
                    a, b = (ctx.text(n) for n in (node.args[0], untransposed))
                    yield self._finding(ctx, node, name, f"{CALLS[name]}({a}, {b})", display)
            elif name in CALLS:
                yield self._finding(ctx, node, name, CALLS[name], display)

    def _finding(self, ctx: FileContext, node: ast.AST, what: str, replacement: str, fix) -> Finding:
        return ctx.finding(
            self,
            node,
            f"{what} has an NPU affinity replacement in torch_npu: {replacement} "
            "(check its signature and semantics; unverified on Ascend hardware)",
            replacement=replacement,
            fix=fix,
        )
