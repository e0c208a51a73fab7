"""torchaxe: find and measure what makes PyTorch training slow, on NPU, GPU and CPU.

The top-level import is deliberately light: it pulls in neither torch nor torch_npu.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
