"""AX118: scaled dot-product attention computed by hand (scores, softmax, @ v)."""

from __future__ import annotations

import ast
from dataclasses import replace
from typing import Callable

from torchaxe.findings import Applicability
from torchaxe.scan.context import fast_walk
from torchaxe.scan.formulas.inline import attribute_writes
from torchaxe.scan.rules._formula import UNVERIFIED, FormulaRule, Proposal, atom, exact, functional, innermost
from torchaxe.scan.rules.base import Invalid, Valid


def _scale_argument(match) -> str | None:
    """SDPA's ``scale=`` argument ("" for the default), None when it cannot be written."""
    params, scale = match.params, match.inputs.get("scale")
    if scale is not None:
        if params.get("scale_from_shape") and params.get("default_scale"):
            return ""
        if params.get("scale_op") == "mul":
            return f", scale={scale}"
        return f", scale=1 / {atom(scale)}"
    if abs(params.get("scale", 0.0) - 1.0) < 1e-6:
        return ", scale=1.0"
    return None


def _scaled_query(match, q: str, ctx=None) -> tuple[str, str] | None:
    """For a scale that may be a tensor (``self.temperature``, a parameter): SDPA's
    ``scale=`` takes a Python float only, so the scale goes on the query instead
    (``(q * s) @ k^T`` is ``s * (q @ k^T)``, and its gradient still reaches ``s``).
    None when the scale is a number (or the default): written as one, or an attribute
    the class sets to one (``self.scale = dim_head ** -0.5``)."""
    scale = match.inputs.get("scale")
    params = match.params
    if scale is None or (params.get("scale_from_shape") and params.get("default_scale")) or _a_number(scale):
        return None
    if ctx is not None and _number_attribute(ctx, match.node.lineno, scale):
        return None
    op = "*" if params.get("scale_op") == "mul" else "/"
    return f"{atom(q)} {op} {atom(scale)}", ", scale=1.0"


_NUMBER_CALLS = ("float", "int", "len", "abs", "round", "min", "max", "pow")


def _a_number(text: str, known: Callable[[ast.AST], bool] = lambda node: False) -> bool:
    """Whether an expression is a Python number whatever its names hold: literals,
    ``math`` functions, sizes (``k.size(-1)``, ``q.shape[-1]``) and arithmetic on them;
    ``known`` says so of further names and attributes."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return False
    return _number_node(tree, known)


def _number_node(tree: ast.AST, known: Callable[[ast.AST], bool]) -> bool:
    def number(node: ast.AST) -> bool:
        if isinstance(node, (ast.Name, ast.Attribute)) and known(node):
            return True
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
        if isinstance(node, ast.BinOp):
            return number(node.left) and number(node.right)
        if isinstance(node, ast.UnaryOp):
            return number(node.operand)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
                return True
            if isinstance(func, ast.Attribute) and func.attr == "size" and node.args:
                return True
            return isinstance(func, ast.Name) and func.id in _NUMBER_CALLS and all(number(a) for a in node.args)
        if isinstance(node, ast.Subscript):
            return isinstance(node.value, ast.Attribute) and node.value.attr == "shape"
        return isinstance(node, ast.Attribute) and node.attr == "ndim"

    return number(tree)


def _number_attribute(ctx, line: int, text: str) -> bool:
    """Whether ``self.NAME`` is a number: the class around ``line`` sets it once, in
    ``__init__``, to arithmetic on numbers, on ``__init__``'s parameters with a number
    default or an ``int``/``float`` annotation, and on locals or attributes set so
    (``self.scale = dim_head ** -0.5``, ``head_dim = dim // heads`` with ``dim: int``)."""
    text = text.strip()
    if not text.startswith("self.") or not text[5:].isidentifier():
        return False
    if ("attribute_writes",) not in ctx.cache:
        ctx.cache[("attribute_writes",)] = attribute_writes(ctx.tree)
    if ctx.cache[("attribute_writes",)].get(text[5:], 0) != 1:
        return False  # set again by a subclass or elsewhere: perhaps to a tensor
    owner = innermost(ctx, line, (ast.ClassDef,))
    if not isinstance(owner, ast.ClassDef):
        return False
    init = next((f for f in owner.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return False
    numeric_params = set()
    args = init.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in [*zip(positional, defaults), *zip(args.kwonlyargs, args.kw_defaults)]:
        annotated = isinstance(arg.annotation, ast.Name) and arg.annotation.id in ("int", "float")
        literal = isinstance(default, ast.Constant) and isinstance(default.value, (int, float)) \
            and not isinstance(default.value, bool)
        if annotated or literal:
            numeric_params.add(arg.arg)
    # Every binding of a name or self attribute in the class, by its text.
    bindings: dict[str, list[tuple[ast.AST, bool]]] = {}
    in_init = {id(n) for n in fast_walk(init)}
    for node in fast_walk(owner):
        targets: list[ast.AST] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Tuple):
                for elt in target.elts:  # unpacked: not followed
                    bindings.setdefault(ast.unparse(elt), []).append((elt, False))
            else:
                plain = value is not None and not isinstance(node, ast.AugAssign) and id(node) in in_init
                bindings.setdefault(ast.unparse(target), []).append((value if plain else target, plain))
    seen: set[str] = set()

    def known(node: ast.AST) -> bool:
        name = ast.unparse(node)
        if isinstance(node, ast.Name) and name in numeric_params and name not in bindings:
            return True
        found = bindings.get(name)
        if name in seen or not found or len(found) != 1 or not found[0][1]:
            return False
        seen.add(name)
        return _number_node(found[0][0], known)

    return known(ast.parse(text, mode="eval").body)


class HandWrittenAttention(FormulaRule):
    """
    ## What it does
    Flags attention computed by hand: `softmax(q @ k^T * scale [+ mask]) [dropout] @ v`,
    with `matmul`, `@`, `bmm` or `einsum` (BNSD or BSND layouts; in einsum also one
    key/value head shared by every query head, `'b h i d, b j d -> b h i j'`, and
    channels before positions, `'bct,bcs->bts'`, as diffusion U-Nets write it, and
    heads between positions and features throughout, `'...qhd,...khd->...qhk'` with the
    values written first or second, and weights that keep the heads last and normalise
    over a middle dimension, sequence first as Transformer-XL writes it,
    `'ibnd,jbnd->ijbn'` with `softmax(dim=1)`, or batch first, `'bihd,bjhd->bijh'` with
    `softmax(dim=2)`; these are advice only), and one chunk of a memory-efficient attention
    (`exp(scores - max) @ v` with its sum kept apart for the merge, advice only), a scale written as a
    division by `sqrt(d)` or a multiplication, an additive or `masked_fill` mask and
    dropout on the weights. Scores made with `torch.baddbmm(bias, q, k^T, beta=,
    alpha=)` count (`alpha` is the scale, `beta * bias` the mask), and so do einsum
    equations built from constants (an f-string or a `+` of string constants); an
    equation chosen at run time is not read. The softmax may be kept in an attribute
    set once in `__init__` (`self.attend = nn.Softmax(dim=-1)`, `self.attn_fn =
    F.softmax`). A key that arrives already transposed, (batch, heads, head_dim,
    sequence), counts when the operand is named like a key (`q.matmul(k)`,
    `torch.bmm(q, key_t)`); `softmax(x @ w) @ v` with a weight does not. Recognised by
    its values on random inputs: the weights must be a softmax over the key dimension
    of a scaled `q @ k^T`.

    ## Why is this bad?
    The hand-written form materialises the full (L x L) score matrix per head, reads
    and writes it four or five times (scale, mask, softmax, dropout, product) and keeps
    it for the backward pass. `F.scaled_dot_product_attention` dispatches to flash or
    memory-efficient kernels that never build it (and to a fused kernel on CPU);
    `torch_npu.npu_fusion_attention` is the NPU's fused attention.

    ## Example
    ```python
    def attention(q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return torch.softmax(scores, dim=-1) @ v
    ```

    ## Use instead
    ```python
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)
    ```

    ## Fix safety
    Safe on cpu and cuda when the whole computation is one expression in the (batch,
    heads, sequence, head_dim) layout with no mask and no dropout: SDPA computes the
    same function. The scale is kept: omitted when it is `1/sqrt(q.size(-1))`, passed
    as `scale=` when it is a Python number (a literal, a `math` function, a size, or an
    attribute `__init__` sets once to one, like `self.scale = dim_head ** -0.5` with
    `dim_head=64`), and multiplied into q otherwise (`scale=` takes a float only, and a learned temperature
    keeps its gradient that way). Unsafe with a mask, dropout or dtype casts on the way:
    - `masked_fill(cond, -inf)` becomes `attn_mask=` the opposite condition (SDPA's
      boolean mask is True where attention is allowed), and an added float mask is
      passed as it is; a query row masked everywhere (a padded query) comes out of
      SDPA as zeros, where the code gave NaN (`-inf`) or the mean of v (a finite fill
      such as `-1e4`): the same wherever the loss ignores padded positions; and a
      float32 mask with half-precision scores (no autocast) is refused by SDPA;
    - dropout on the weights, from an `nn.Dropout` set in `__init__` or `F.dropout`,
      becomes `dropout_p=(p if self.training else 0.0)`: the same rate, other random
      draws.

    The usual form, over several statements (scores, mask, softmax, dropout, `@ v`),
    is fixed by deleting those statements too, when nothing else reads what they
    compute (attention weights returned or stored stay advice) and q, k, v are not
    reassigned in between. A mask applied under `if mask is not None:` is passed as
    `attn_mask=None if mask is None else ...`; any other condition stays advice. With a causal mask of a self-attention, `is_causal=True`
    instead of the mask lets cuda pick its flash kernel; that is left to the user.
    Advice only: other layouts, a mask added before the scale (it is scaled with the
    scores), dropout on the scores before the softmax, and a `.detach()` on the way. On npu `npu_fusion_attention` needs `head_num`, an
    `input_layout`, an explicit `scale` (its default is 1) and a mask in which True
    means "drop" (a float bias added to the scores, such as ALiBi's, goes to `pse`,
    which is added before the scale); it supports float16 and bfloat16 only. Always advice on npu,
    unverified on Ascend hardware.
    """

    code = "AX118"
    name = "hand-written-attention"
    category = "attention"
    label = "scaled dot-product attention"
    message = "attention computed by hand instead of a fused attention kernel"
    fix_title = "use F.scaled_dot_product_attention"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.DISPLAY_ONLY}
    # A softmax function kept in an attribute (``self.attn_fn = F.softmax``) is named, not called.
    requires_text = ("softmax(", "Softmax(", "torch.exp(", ".exp()", ".softmax\n", ".softmax\r", ".softmax ",
                     ".softmax,", ".softmax)")
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html",
        "https://www.hiascend.com/document (torch_npu.npu_fusion_attention)",
    )
    examples = (
        Invalid(
            "import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef attention(q, k, v):\n"
            "    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v\n",
            fixed="import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef attention(q, k, v):\n"
            "    return F.scaled_dot_product_attention(q, k, v)\n", lines=(7,),
        ),
        Invalid(
            "import torch\n\n\ndef attention(q, k, v, scale):\n"
            "    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * scale, -1), v)\n",
            target="cuda",
            fixed="import torch\n\n\ndef attention(q, k, v, scale):\n"
            "    return torch.nn.functional.scaled_dot_product_attention(q * scale, k, v, scale=1.0)\n", lines=(5,),
        ),
        Invalid(
            "import math\nimport torch\n\n\nclass Attention(torch.nn.Module):\n"
            "    def forward(self, q, k, v, mask=None):\n"
            "        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)\n"
            "        if mask is not None:\n            scores = scores.masked_fill(mask == 0, float('-inf'))\n"
            "        attn = self.dropout(torch.softmax(scores, dim=-1))\n        return torch.matmul(attn, v)\n",
            target="npu", lines=(11,),
        ),
        Invalid(
            "import math\nimport torch\nimport torch.nn.functional as F\n\n\nclass Attention(torch.nn.Module):\n"
            "    def forward(self, q, k, v, mask):\n"
            "        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))\n"
            "        scores = scores.masked_fill(mask == 0, float('-inf'))\n"
            "        weights = torch.softmax(scores, dim=-1)\n        return weights @ v\n",
            fixed="import math\nimport torch\nimport torch.nn.functional as F\n\n\nclass Attention(torch.nn.Module):\n"
            "    def forward(self, q, k, v, mask):\n"
            "        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask != 0)\n", lines=(11,),
        ),
        Invalid(
            "import torch\n\n\ndef attn(q, k, v):\n    w = torch.einsum('bhqd,bhkd->bhqk', q, k) * q.shape[-1] ** -0.5\n"
            "    return torch.einsum('bhqk,bhkd->bhqd', w.softmax(dim=-1), v)\n",
            fixed="import torch\n\n\ndef attn(q, k, v):\n"
            "    return torch.nn.functional.scaled_dot_product_attention(q, k, v)\n", lines=(6,),
        ),
        Valid("import torch.nn.functional as F\ndef attention(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)\n"),
        Valid("import torch\ndef not_attention(q, k, v):\n    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v\n"),
        Valid("import torch\ndef gate(x, w, v):\n    return torch.softmax(x @ w, dim=-1) @ v\n"),
        # Ring and tree attention merge shards by the normaliser: a fused call does not return it.
        Valid("import torch\ndef attend(q, k, v):\n    sim = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5\n"
              "    lse = sim.logsumexp(dim=-1, keepdim=True)\n    attn = sim.softmax(dim=-1)\n"
              "    out = attn @ v\n    return out, lse\n"),
        # The weights flow into the result again (VITS's relative values): not SDPA's product.
        Valid("import torch\ndef attend(q, k, v, e_v):\n"
              "    p = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1)\n    out = p @ v\n"
              "    rel = to_relative(p)\n    out = out + rel @ e_v\n    return out\n"),
    )

    def reports(self, ctx, match):
        return not _weights_feed_output(ctx, match) and not _normaliser_read_after(ctx, match)

    def propose(self, ctx, match):
        proposal = self._propose(ctx, match)
        kept = _weights_read_after(ctx, match)
        if not kept:
            return proposal
        names, line = kept
        return replace(
            proposal, edit=False, applicability=Applicability.DISPLAY_ONLY,
            note=proposal.note + (f"; the code also reads the attention weights ({', '.join(names)}) after the "
                                  f"attention (line {line}), and a fused attention does not return them: keep the "
                                  "hand-written form where the weights are needed (when asked to return them, "
                                  "for instance) and use the fused call elsewhere"))

    def _propose(self, ctx, match):
        q, k, v = match.inputs["q"], match.inputs["k"], match.inputs["v"]
        params = match.params
        if params.get("chunked"):
            fused = ("torch_npu.npu_fusion_attention" if ctx.target == "npu"
                     else "F.scaled_dot_product_attention")
            return Proposal(
                f"{fused}(q, k, v) over the whole sequence",
                f"these are the pieces of a chunked (memory-efficient) attention: exp(scores - max) @ v and its sum, "
                f"merged over the chunks elsewhere; {fused} computes the whole attention in one fused call without "
                "materialising the scores, so the chunking and the merge can go",
                f"use {fused}", Applicability.DISPLAY_ONLY, edit=False,
            )
        if params.get("k_transposed"):
            k = f"{atom(k)}.transpose(-2, -1)"  # the source keeps the key already transposed
        scale = _scale_argument(match)
        if ctx.target == "npu":
            q, k, v, layout, heads, tail, layout_note = _npu_layout(params, q, k, v)
            folded = _scaled_query(match, q, ctx)
            if folded is not None:
                # Its scale is a float too: a tensor scale (a learned temperature) goes on q.
                q, scale = folded
            # The default scale is 1 / sqrt(head_dim), read from q itself (the code may
            # have no name for head_dim).
            scale_value = "scale=<the score scale>" if scale is None else (
                f"scale={atom(q)}.shape[-1] ** -0.5" if scale == "" else scale.lstrip(", "))
            mask, bias_note = "", ""
            bias = match.inputs.get("mask") if params.get("mask_added") else None
            if bias is not None:
                # pse is added before the scale (scale * (pse + q @ k^T)): a bias added after
                # it is divided by the scale first.
                after = abs(params.get("mask_weight", 1.0) - 1.0) <= 1e-6
                scale_text = scale_value.split("=", 1)[1]
                if not after or scale_text == "1.0":
                    mask = f", pse={bias}"  # (already on the scaled scores' footing: scale 1)
                elif scale_text.startswith("<"):
                    mask = f", pse={atom(bias)} / <the score scale>"
                else:
                    mask = f", pse={atom(bias)} / ({scale_text})"
                bias_note = ("; its pse is a float bias added to the scores before the scale, as ALiBi or a relative "
                             "position bias is (4-D, BNSS or 1NSS)")
                fill = match.inputs.get("fill_mask")
                if fill:  # the boolean mask beside the bias: atten_mask is True where masked
                    mask += f", atten_mask={'~(' + fill + ')' if params.get('mask_keeps') else fill}"
            elif params.get("masked"):
                mask = ", atten_mask=<True where masked>"
            keep, dropout_note = "", ""
            if params.get("dropout"):
                # Its dropout is keep_prob, the share of weights kept, in training only.
                dropout_p = match.plan.dropout_p if match.plan is not None else None
                keep = (f", keep_prob=1 - {atom(_unwrapped(dropout_p))}" if dropout_p
                        else ", keep_prob=<1 - the dropout rate in training, 1.0 in evaluation>")
                dropout_note = "; the code drops out attention weights: keep_prob is the share kept"
            replacement = (f'torch_npu.npu_fusion_attention({q}, {k}, {v}, {heads}, "{layout}"{mask}, {scale_value}'
                           f'{keep})[0]{tail}')
            return Proposal(
                replacement,
                f"{replacement} is the NPU's fused attention (pass head_num and the scale explicitly: its default scale "
                "is 1; its atten_mask is True where a position is dropped; float16/bfloat16 only; the first output is "
                f"the attention result){layout_note}{bias_note}{dropout_note}; {UNVERIFIED}",
                "use torch_npu.npu_fusion_attention", Applicability.DISPLAY_ONLY, edit=False,
            )
        fn, imports = functional(ctx, match.node.lineno)
        layout, after = params.get("layout"), ""
        if layout in ("BDS", "BDS-q"):
            if layout == "BDS":
                q, k = (f"{atom(t)}.transpose(-2, -1)" for t in (q, k))
            v = f"{atom(v)}.transpose(-2, -1)"
            after = ".transpose(-2, -1)"
        elif layout == "BNSD-shared":
            k, v = (f"{atom(t)}.unsqueeze(1)" for t in (k, v))
        elif layout in ("SBND", "BSND-kh"):
            after = ".permute(2, 0, 1, 3)" if layout == "SBND" else ".transpose(1, 2)"
            q, k, v = (f"{atom(t)}.permute(1, 2, 0, 3)" if layout == "SBND" else f"{atom(t)}.transpose(1, 2)"
                       for t in (q, k, v))
        folded = _scaled_query(match, q, ctx)
        if folded is not None:
            q, scale = folded
        extra, advice = [], []
        guard = match.plan.guard if match.plan is not None else None
        guarded = False
        folded_masks = False
        if params.get("masked"):
            mask, fill = match.inputs.get("mask"), match.inputs.get("fill_mask")
            if not mask:
                advice.append("attn_mask=<the mask: a float mask is added to the scores as it is>" if params.get(
                    "mask_added") else "attn_mask=<the mask: True where attention is allowed>")
            elif params.get("mask_added") and abs(params.get("mask_weight", 1.0) - 1.0) > 1e-6:
                # (q @ k^T + mask) / sqrt(d): the mask is scaled with the scores.
                advice.append(f"attn_mask=<{mask}, scaled as the scores are>")
            elif params.get("mask_added") and fill:
                # A float bias and a boolean mask: SDPA takes one float attn_mask, the
                # bias with -inf where the boolean mask drops a score.
                keep = fill if params.get("mask_keeps") else _allowed(fill)
                extra.append(f'attn_mask=torch.where({keep}, {mask}, float("-inf"))')
                folded_masks = True
            else:
                allowed = mask if params.get("mask_added") or params.get("mask_keeps") else _allowed(mask)
                if guard is not None and guard in _names(mask):
                    # Applied only when the mask is not None: SDPA's attn_mask=None is no mask.
                    allowed = allowed if allowed == guard else f"None if {guard} is None else {allowed}"
                    guarded = True
                extra.append(f"attn_mask={allowed}")
        if params.get("dropout"):
            dropout_p = match.plan.dropout_p if match.plan is not None else None
            if dropout_p:
                extra.append(f"dropout_p={dropout_p}")
            else:
                advice.append("dropout_p=(<the dropout rate> if self.training else 0.0)")
        scale_arg = scale if scale is not None else ", scale=<the score scale>"
        if layout == "BNSD-shared":
            extra.append("enable_gqa=True")
        replacement = f"{fn}.scaled_dot_product_attention({q}, {k}, {v}{scale_arg}" + "".join(
            f", {e}" for e in extra + advice) + ")" + after
        note = (f"{fn}.scaled_dot_product_attention computes it without materialising the score matrix (flash and "
                "memory-efficient kernels on cuda, a fused kernel on cpu)")
        layout_ok = layout == "BNSD"
        if layout in ("BDS", "BDS-q"):
            note += "; the code puts channels before positions: q, k and v go in transposed, the result comes back so"
        elif layout == "BNSD-shared":
            note += ("; the code shares one key/value head among the query heads (multi-query): k and v get a head "
                     "dimension of 1 and enable_gqa=True (torch 2.5 or later) spreads it")
        elif layout in ("SBND", "BSND-kh"):
            note += (SEQUENCE_FIRST_NOTE if layout == "SBND" else "; q, k and v go in transposed to (batch, heads, "
                     "sequence, head_dim), the result comes back so") + HEADS_LAST_NOTE
        elif not layout_ok:
            note += "; q, k and v must be transposed to (batch, heads, sequence, head_dim) first"
        if params.get("v_rank"):
            layout_ok = False
            note += (f"; q and k are {params['rank']}-D here and v is {params['v_rank']}-D: pass all three in one "
                     "shape, (batch, heads, sequence, head_dim), as before the code flattened them")
        certain = not advice and layout_ok and scale is not None and not params.get("k_transposed") \
            and not folded_masks
        if folded_masks:
            note += ("; the code adds a float mask and also drops scores with a boolean one: attn_mask takes both, "
                     "as -inf where a score is dropped (a row with every score dropped gives NaN where the code "
                     "gave a uniform row)")
        elif params.get("masked") and not params.get("mask_added"):
            note += ("; attn_mask is True where attention is allowed" + (
                "" if params.get("mask_keeps") else ", the opposite of masked_fill's mask") + " (when it is the causal "
                "mask of a self-attention, is_causal=True instead lets cuda use its flash kernel); a query row with "
                "every score masked (a padded query) comes out as zeros, where the code gave the mean of v (a "
                "finite fill) or NaN (-inf)")
        if params.get("dropout"):
            note += "; dropout_p must follow self.training"
        if advice:
            note += " (see the rule's documentation)"
        if params.get("casts"):
            note += "; the hand-written form changes dtype on the way, the fused call computes in the input's"
        safe = exact(match) and not extra and not params.get("casts")
        return Proposal(replacement, note, "use F.scaled_dot_product_attention",
                        Applicability.SAFE if safe else Applicability.UNSAFE, edit=certain, imports=imports,
                        guarded=guarded)


_SOFTMAX_CALLS = frozenset({"softmax", "_softmax", "_softmax_last_dim"})


def _weights_read_after(ctx, match) -> tuple[list[str], int] | None:
    """The names holding the softmax weights of a matched attention, when a statement
    after the attention reads them (``return x, attn``), with that statement's line.
    The weights are the names the attention reads that were last assigned a softmax (or
    something made from a name holding one: ``attn = self.attn_drop(attn)``)."""
    found = _weights(ctx, match)
    if found is None:
        return None
    function, weights, end = found
    later = [n for n in fast_walk(function) if isinstance(n, ast.Name) and n.id in weights
             and isinstance(n.ctx, ast.Load) and (n.lineno, n.col_offset) > end]
    rebound = [n.lineno for n in fast_walk(function) if isinstance(n, ast.Name) and n.id in weights
               and isinstance(n.ctx, ast.Store) and (n.lineno, n.col_offset) > end]
    first_rebound = min(rebound, default=None)
    later = [n for n in later if first_rebound is None or n.lineno <= first_rebound]
    if not later:
        return None
    return sorted({n.id for n in later}), min(n.lineno for n in later)


def _weights_feed_output(ctx, match) -> bool:
    """Whether the attention weights also flow, after the attention, into the name its
    result is assigned to (VITS's relative attention: ``output = p_attn @ value`` then
    ``output = output + rel(p_attn) @ e_v``): the weights are needed anyway, and the
    whole is not softmax(q @ k^T) @ v."""
    found = _weights(ctx, match)
    if found is None:
        return False
    function, weights, end = found
    holder = next((n for n in fast_walk(function) if isinstance(n, ast.Assign) and len(n.targets) == 1
                   and isinstance(n.targets[0], ast.Name) and n.value.lineno <= match.node.lineno
                   and (n.value.end_lineno or n.value.lineno) >= (match.node.end_lineno or match.node.lineno)
                   and n.lineno <= match.node.lineno), None)
    if holder is None:
        return False
    output = holder.targets[0].id  # type: ignore[attr-defined]
    tainted = set(weights)
    later = sorted((n for n in fast_walk(function) if isinstance(n, (ast.Assign, ast.AugAssign))
                    and (n.lineno, n.col_offset) > end), key=lambda n: (n.lineno, n.col_offset))
    for stmt in later:
        if not {n.id for n in fast_walk(stmt.value) if isinstance(n, ast.Name)} & tainted:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = {n.id for t in targets for n in fast_walk(t) if isinstance(n, ast.Name)}
        if output in names:
            return True
        tainted |= names
    return False


def _normaliser_read_after(ctx, match) -> bool:
    """Whether the function keeps the softmax's normaliser, a ``logsumexp`` of the
    scores bound to a name before the attention ends and read after it (Reformer's LSH
    attention returns it to merge hash rounds; ring and tree attention merge the
    shards' outputs by it): a fused attention does not return it."""
    function = innermost(ctx, match.node.lineno, (ast.FunctionDef, ast.AsyncFunctionDef))
    if function is None:
        return False
    end = (match.node.end_lineno, match.node.end_col_offset)
    kept = set()
    for node in fast_walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and (node.lineno, node.col_offset) < end and any(
                    isinstance(c, ast.Call) and isinstance(c.func, (ast.Attribute, ast.Name))
                    and (c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id) == "logsumexp"
                    for c in fast_walk(node.value)):
            kept.add(node.targets[0].id)
    return bool(kept) and any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in kept
                              and (n.lineno, n.col_offset) > end for n in fast_walk(function))


def _weights(ctx, match) -> tuple[ast.AST, set[str], tuple[int, int]] | None:
    """The function of a matched attention, the names holding its softmax weights
    (see :func:`_weights_read_after`), and where the attention ends."""
    function = innermost(ctx, match.node.lineno, (ast.FunctionDef, ast.AsyncFunctionDef))
    if function is None:
        return None
    start, end = (match.node.lineno, match.node.col_offset), (match.node.end_lineno, match.node.end_col_offset)
    read = set()
    for node in fast_walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and start <= (
                node.lineno, node.col_offset) and (node.end_lineno, node.end_col_offset) <= end:
            read.add(node.id)
    weights: set[str] = set()
    assignments = sorted((n for n in fast_walk(function) if isinstance(n, ast.Assign) and len(n.targets) == 1
                          and isinstance(n.targets[0], ast.Name)), key=lambda n: (n.lineno, n.col_offset))
    for stmt in assignments:
        if (stmt.lineno, stmt.col_offset) >= start:
            break
        name = stmt.targets[0].id  # type: ignore[attr-defined]
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in fast_walk(stmt.value) if isinstance(n, ast.Call)}
        loads = {n.id for n in fast_walk(stmt.value) if isinstance(n, ast.Name)}
        if calls & _SOFTMAX_CALLS or (loads & weights and isinstance(stmt.value, ast.Call)):
            weights.add(name)
        else:
            weights.discard(name)
    weights &= read
    if not weights:
        return None
    return function, weights, end


#: What the code's heads-last layouts ask of a fused call (see :func:`_npu_layout`).
SEQUENCE_FIRST_NOTE = ("; the code puts the sequence first, (sequence, batch, heads, head_dim): q, k and v go in "
                       "permuted to (batch, heads, sequence, head_dim), the result comes back so")
HEADS_LAST_NOTE = ("; its weights keep the heads last and the softmax runs over a middle dimension: a mask "
                   "written in their layout must be permuted to (batch, heads, query, key) for the fused call")


def _npu_layout(params, q: str, k: str, v: str) -> tuple[str, str, str, str, str, str, str]:
    """npu_fusion_attention's arguments for the code's layout: (q, k, v, input_layout,
    head_num, what follows the call, a note)."""
    layout, rank = params.get("layout"), params.get("rank", 4)  # 0: not known
    if layout in ("BSND", "BSND-qhk"):
        return q, k, v, "BSND", "head_num", "", ""
    if layout == "BSND-kh":
        return q, k, v, "BSND", "head_num", "", HEADS_LAST_NOTE
    if layout == "SBND":
        q, k, v = (f"{atom(t)}.permute(1, 2, 0, 3)" for t in (q, k, v))
        return q, k, v, "BNSD", "head_num", ".permute(2, 0, 1, 3)", SEQUENCE_FIRST_NOTE + HEADS_LAST_NOTE
    if layout == "BNSD" and rank == 3:
        return q, k, v, "BSH", "1", "", "; (batch * heads, sequence, head_dim) tensors go in as BSH with one head"
    if layout == "BNSD":
        return q, k, v, "BNSD", "head_num", "", ""
    if layout in ("BDS", "BDS-q"):
        # BDS-q: q already positions-first, k channel-first (transposed as the key is).
        if layout == "BDS":
            q, k = (f"{atom(t)}.transpose(-2, -1)" for t in (q, k))
        v = f"{atom(v)}.transpose(-2, -1)"
        return (q, k, v, "BSH" if rank == 3 else "BNSD", "1" if rank == 3 else "head_num", ".transpose(-2, -1)",
                "; the code puts channels before positions: q, k and v go in transposed, the result comes back so")
    if layout == "BNSD-shared":
        k, v = (f"{atom(t)}.unsqueeze(1)" for t in (k, v))
        return (q, k, v, "BNSD", "head_num", "",
                "; the code shares one key/value head among the query heads (multi-query): k and v get a head "
                "dimension of 1 (its key and value may have fewer heads than its query)")
    return (q, k, v, "BNSD", "head_num", "",
            "; q, k and v are not in one layout as written: rearrange them to (batch, heads, sequence, head_dim) first")


def _unwrapped(text: str) -> str:
    """``text`` without the parentheses around all of it, if it has them."""
    if text.startswith("(") and text.endswith(")"):
        try:
            if ast.dump(ast.parse(text, mode="eval")) == ast.dump(ast.parse(text[1:-1], mode="eval")):
                return text[1:-1]
        except SyntaxError:
            pass
    return text


def _names(text: str) -> set[str]:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in fast_walk(tree) if isinstance(n, ast.Name)}


def _allowed(condition: str) -> str:
    """SDPA's boolean ``attn_mask`` (True where attention is allowed) from
    ``masked_fill``'s condition (True where a score is masked)."""
    text = condition.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return f"~({condition})"

    def source(part: ast.AST) -> str:
        return ast.get_source_segment(text, part) or ast.unparse(part)

    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return source(node.operand)
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value in (0, 1)
            and not isinstance(node.comparators[0].value, bool)):
        flipped = "!=" if isinstance(node.ops[0], ast.Eq) else "=="
        return f"{source(node.left)} {flipped} {source(node.comparators[0])}"
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1 and (
            ast.unparse(node.func) in ("torch.logical_not", "logical_not")):
        return source(node.args[0])
    if (isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute)
            and node.func.attr == "logical_not"):
        return source(node.func.value)
    return f"~{atom(text)}"
