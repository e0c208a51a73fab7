"""torchaxe: find and measure what makes PyTorch training slow, on NPU, GPU and CPU.

The top-level import is deliberately light: it pulls in neither torch nor torch_npu.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]


def __getattr__(name: str):
    # ``torchaxe.tune(model, example_inputs)`` without importing torch at ``import torchaxe``.
    if name == "tune":
        import importlib

        return importlib.import_module("torchaxe.tune")
    raise AttributeError(f"module 'torchaxe' has no attribute {name!r}")
