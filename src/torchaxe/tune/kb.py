"""The knowledge base's former place: it is now :mod:`torchaxe.kb`, and this name
stays only for code that still imports it from here."""

from __future__ import annotations

from torchaxe.kb import KnowledgeBase

__all__ = ["KnowledgeBase"]
