"""AX404: images decoded with PIL in a dataset's ``__getitem__``."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, fast_walk
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Calls that decode one image with PIL.
PIL_DECODERS = frozenset(
    {"PIL.Image.open", "torchvision.datasets.folder.pil_loader", "torchvision.datasets.folder.default_loader"}
)
#: The methods a DataLoader calls once per sample (``__getitems__``: once per batch).
SAMPLE_METHODS = ("__getitem__", "__getitems__")
#: PIL ``convert`` modes with a torchvision.io.ImageReadMode twin.
READ_MODES = {"RGB": "RGB", "L": "GRAY", "RGBA": "RGB_ALPHA", "LA": "GRAY_ALPHA"}

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


class PilDecodeInDataset(Rule):
    """
    ## What it does
    Flags `PIL.Image.open(...)` (and torchvision's `pil_loader` / `default_loader`)
    called in a dataset's `__getitem__`, in a method that `__getitem__` calls through
    `self`, or in a module-level function that a class with a `__getitem__` uses.

    ## Why is this bad?
    `__getitem__` runs once per sample, so decoding is usually the largest part of
    the loading cost, and the device waits whenever loading falls behind a step.
    PIL decodes into its own image object that must then be converted to a tensor
    (`ToTensor`/`PILToTensor` copies it again); `torchvision.io.decode_image` decodes
    with libjpeg-turbo/libpng straight into a uint8 tensor, and OpenCV's `cv2.imread`
    is another fast decoder.

    ## Example
    ```python
    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.labels[i]
    ```

    ## Use instead
    ```python
    from torchvision.io import ImageReadMode, decode_image, read_file

    def __getitem__(self, i):
        img = decode_image(read_file(self.paths[i]), mode=ImageReadMode.RGB)  # uint8 CHW tensor
        return self.transform(img), self.labels[i]
    ```
    or `cv2.cvtColor(cv2.imread(path, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)`:
    OpenCV returns BGR channel order in an HWC numpy array.

    ## Fix safety
    Display-only. The new decoder returns a tensor (torchvision) or a BGR numpy array
    (OpenCV) instead of a PIL image, so the transforms after it must change too
    (`torchvision.transforms.v2` accept tensors; `ToTensor` must become a dtype
    conversion), and decoders differ in the last bits of some pixels (JPEG IDCT,
    chroma upsampling), which can shift accuracy slightly: measure before and after.
    """

    code = "AX404"
    name = "pil-decode-in-dataset"
    category = "image_decode"
    message = "images decoded with PIL in a dataset's __getitem__"
    fix_title = "decode with torchvision.io.decode_image (or cv2.imread, BGR order)"
    fix_safety = Applicability.DISPLAY_ONLY
    requires_text = ("PIL", "torchvision")
    also_requires_text = ("__getitem",)  # only decoding reached from __getitem__/__getitems__ counts
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/vision/stable/io.html#image-decoding",
        "https://docs.opencv.org/4.x/d4/da8/group__imgcodecs.html",
    )
    examples = (
        Invalid(
            "import torch\nfrom PIL import Image\n\n\nclass Images(torch.utils.data.Dataset):\n"
            "    def __getitem__(self, i):\n"
            "        return Image.open(self.paths[i]).convert('RGB'), self.labels[i]\n", lines=(7,)
        ),
        Invalid(
            "import PIL.Image\n\n\nclass Images:\n"
            "    def __getitem__(self, i):\n"
            "        with open(self.paths[i], 'rb') as f:\n"
            "            img = PIL.Image.open(f)\n"
            "            img = img.convert('L')\n"
            "        return img\n",
            target="cuda", lines=(7,),
        ),
        Invalid(
            "from PIL import Image as I\nfrom torch.utils.data import Dataset\n\n\nclass Images(Dataset):\n"
            "    def _load(self, path):\n"
            "        return I.open(path)\n\n"
            "    def __getitem__(self, i):\n"
            "        return self._load(self.paths[i])\n",
            target="npu", lines=(7,),
        ),
        Invalid(
            "from PIL import Image\nfrom torch.utils.data import Dataset\n\n\n"
            "def pil_loader(path):\n    return Image.open(path).convert('RGB')\n\n\n"
            "class Folder(Dataset):\n"
            "    def __init__(self, paths, loader=pil_loader):\n        self.loader = loader\n\n"
            "    def __getitem__(self, i):\n        return self.loader(self.paths[i])\n", lines=(6,), message="which Fold"
        ),
        Invalid(
            "from torchvision.datasets.folder import pil_loader\n\n\nclass Folder:\n"
            "    def __getitem__(self, i):\n        return pil_loader(self.paths[i])\n", lines=(6,)
        ),
        Valid(
            "from PIL import Image\n\n\ndef show(path):\n    Image.open(path).show()\n"
        ),
        Valid(
            "from PIL import Image\n\n\nclass Images:\n"
            "    def __init__(self, paths):\n        self.images = [Image.open(p).convert('RGB') for p in paths]\n\n"
            "    def __getitem__(self, i):\n        return self.images[i]\n"
        ),
        Valid(
            "import torchvision.io as tio\n\n\nclass Images:\n"
            "    def __getitem__(self, i):\n        return tio.decode_image(tio.read_file(self.paths[i]))\n"
        ),
        Valid(
            "from mylib import Image\n\n\nclass Images:\n"
            "    def __getitem__(self, i):\n        return Image.open(self.paths[i])  # not PIL\n"
        ),
        Valid(
            "from PIL import Image\n\n\nclass Images:\n"
            "    def __getitem__(self, i):\n        return Image.open(self.paths[i])  # noqa: AX404\n"
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node)
        if name not in PIL_DECODERS:
            return
        where = _sample_path(ctx)
        if where is None:
            return
        mode = "RGB" if name != "PIL.Image.open" else _convert_mode(ctx)
        torchvision_call, cv2_call = _decoders(ctx, node, mode)
        waiting = "training steps wait" if ctx.target == "cpu" else f"the {ctx.target} device waits"
        target_note = {
            "cuda": "; on cuda, torchvision.io.decode_jpeg(data, device='cuda') can also decode JPEG batches on the GPU",
            "npu": "; on npu both decoders run on the host CPU, so pair them with enough DataLoader workers",
        }.get(ctx.target, "")
        shown = name.rsplit(".", 1)[1] if name != "PIL.Image.open" else "PIL.Image.open"
        torchvision_text = f"{torchvision_call} decodes straight into a uint8 CHW tensor"
        cv2_text = f"{cv2_call}: OpenCV returns BGR channel order in an HWC numpy array"
        # The decoder installed here first (a scan without the facts: torchvision's).
        installed = ctx.capabilities.get("decoders")
        replacement = torchvision_call
        if installed is not None and "torchvision" not in installed and "cv2" in installed:
            instead, replacement = f"{cv2_text} (or {torchvision_text}; torchvision is not installed here)", cv2_call
        elif installed is not None and not installed:
            instead = (f"{torchvision_text} (or {cv2_text}; neither is installed here: "
                       "pip install torchvision, or opencv-python-headless)")
        else:
            instead = f"{torchvision_text} (or {cv2_text})"
        message = (
            f"{shown} decodes every sample with PIL in {where}: decoding is the bulk of per-sample loading "
            f"and PIL builds an image object that ToTensor/PILToTensor copy again, so {waiting} whenever "
            f"loading falls behind; {instead}{target_note}. "
            "Display-only: the transforms after it must accept the new type, and decoders can differ "
            "in the last bits of some pixels"
        )
        yield ctx.finding(
            self,
            node,
            message,
            replacement=replacement,
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )


def _sample_path(ctx: FileContext) -> str | None:
    """Where the current call runs once per sample, in words, or None."""
    parents = ctx.parents
    functions = [i for i, p in enumerate(parents) if isinstance(p, _FUNCTIONS)]
    if not functions:
        return None
    index = _sample_index(ctx)
    for i in functions:  # outermost first: a helper nested in __getitem__ counts too
        func, owner = parents[i], parents[i - 1] if i > 0 else None
        assert isinstance(func, _FUNCTIONS)
        if isinstance(owner, ast.ClassDef):
            if func.name in SAMPLE_METHODS:
                return f"{owner.name}.{func.name}"
            caller = index.methods.get((id(owner), func.name))
            if caller:
                return f"{owner.name}.{func.name}, which {owner.name}.{caller} calls"
        elif isinstance(owner, ast.Module):
            user = index.functions.get(func.name)
            if user:
                return f"{func.name}, which {user} uses"
    return None


class _SampleIndex:
    """Per file: methods that a ``__getitem__`` calls through ``self`` and names used
    inside classes that define ``__getitem__``."""

    def __init__(self, tree: ast.Module) -> None:
        self.methods: dict[tuple[int, str], str] = {}
        self.functions: dict[str, str] = {}
        for cls in fast_walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            getters = [f for f in cls.body if isinstance(f, _FUNCTIONS) and f.name in SAMPLE_METHODS]
            if not getters:
                continue
            for getter in getters:
                for sub in fast_walk(getter):
                    if (
                        isinstance(sub, ast.Call)
                        and isinstance(sub.func, ast.Attribute)
                        and isinstance(sub.func.value, ast.Name)
                        and sub.func.value.id == "self"
                    ):
                        self.methods.setdefault((id(cls), sub.func.attr), getter.name)
            for sub in fast_walk(cls):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                    self.functions.setdefault(sub.id, f"{cls.name}.{getters[0].name}")


def _sample_index(ctx: FileContext) -> _SampleIndex:
    key = "ax404.sample_index"
    if key not in ctx.cache:
        ctx.cache[key] = _SampleIndex(ctx.tree)
    return ctx.cache[key]


def _convert_mode(ctx: FileContext) -> str | None:
    """The mode of a ``.convert("RGB")`` chained on the decoding call."""
    parents = ctx.parents
    if len(parents) >= 2:
        attr, call = parents[-1], parents[-2]
        if (
            isinstance(attr, ast.Attribute)
            and attr.attr == "convert"
            and isinstance(call, ast.Call)
            and call.func is attr
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            return call.args[0].value
    return None


def _decoders(ctx: FileContext, call: ast.Call, mode: str | None) -> tuple[str, str]:
    """The torchvision.io and OpenCV calls that decode what ``call`` decodes."""
    read_mode = READ_MODES.get(mode or "", "UNCHANGED")
    flag = {"RGB": "cv2.IMREAD_COLOR", "L": "cv2.IMREAD_GRAYSCALE"}.get(mode or "", "cv2.IMREAD_UNCHANGED")
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.Name):
        arg = _opened_path(ctx, arg.id) or arg
    if isinstance(arg, ast.Call) and ctx.call_name(arg) == "io.BytesIO" and arg.args:
        data = _short(ctx, arg.args[0], "data")
        tensor = f"torch.frombuffer({data}, dtype=torch.uint8)"
        cv2_call = f"cv2.imdecode(np.frombuffer({data}, np.uint8), {flag})"
    else:
        path = _short(ctx, arg, "path") if arg is not None else "path"
        tensor = f"torchvision.io.read_file({path})"
        cv2_call = f"cv2.imread({path}, {flag})"
    if mode == "RGB":
        cv2_call = f"cv2.cvtColor({cv2_call}, cv2.COLOR_BGR2RGB)"
    return f"torchvision.io.decode_image({tensor}, mode=torchvision.io.ImageReadMode.{read_mode})", cv2_call


def _opened_path(ctx: FileContext, name: str) -> ast.expr | None:
    """The path of an enclosing ``with open(path, "rb") as <name>:``."""
    for node in reversed(ctx.parents):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                expr, var = item.context_expr, item.optional_vars
                if (
                    isinstance(var, ast.Name)
                    and var.id == name
                    and isinstance(expr, ast.Call)
                    and isinstance(expr.func, ast.Name)
                    and expr.func.id == "open"
                    and "open" not in ctx.imports
                    and expr.args
                ):
                    return expr.args[0]
    return None


def _short(ctx: FileContext, node: ast.AST, fallback: str) -> str:
    text = ctx.text(node)
    return text if isinstance(node, ast.expr) and "\n" not in text and len(text) <= 60 else fallback
