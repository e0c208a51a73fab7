"""The stable JSON form of a scan: one object, documented in the README."""

from __future__ import annotations

import json
from typing import Any, TextIO

from torchaxe.findings import ScanResult


def render(result: ScanResult, stream: TextIO, **_: Any) -> None:
    json.dump(result.to_dict(), stream, indent=2, ensure_ascii=False)
    stream.write("\n")
