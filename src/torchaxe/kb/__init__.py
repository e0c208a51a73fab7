"""The knowledge base: one SQLite file of measured results (tuned subgraphs, the best
settings of each axis per workload) that later runs reuse; ``torchaxe kb`` looks after
it. It sits beside the runtime layer, so that tune, data and advise can all use it;
nothing here imports torch or an axis package. The names below are loaded from
:mod:`torchaxe.kb.store` on first use, so that listing the CLI's commands stays cheap.
"""

from __future__ import annotations

from torchaxe.lazy import lazy_attributes

__all__ = ["DEFAULT_FILE_NAME", "EXPORT_FORMAT", "SCHEMA_VERSION", "STATUSES", "DoctorReport", "KnowledgeBase",
           "KnowledgeBaseError", "SettingRecord", "TunedRecord", "choose", "default_path", "doctor", "parse_export",
           "record_from_dict", "workload_key"]


__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "torchaxe.kb.store"))
