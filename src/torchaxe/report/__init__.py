"""Renderers: findings are data, rendering is separate, and output streams are
passed in. Each renderer is ``render(result, stream, **options)``."""

from __future__ import annotations

import importlib
from typing import Any, TextIO

from torchaxe.errors import TorchaxeError
from torchaxe.findings import ScanResult

FORMATS = ("text", "json", "sarif", "csv", "html")


def render(result: ScanResult, fmt: str, stream: TextIO, **options: Any) -> None:
    """Write ``result`` to ``stream`` in the given format."""
    if fmt not in FORMATS:
        raise TorchaxeError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    module = importlib.import_module(f"torchaxe.report.{fmt}_report")
    module.render(result, stream, **options)
