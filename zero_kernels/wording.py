"""Counted nouns in messages: ``plural(1, "rank")`` is ``"1 rank"``, ``plural(4, "rank")`` is ``"4 ranks"``."""

from __future__ import annotations

from typing import Optional

__all__ = ["plural"]


def plural(n: int, noun: str, nouns: Optional[str] = None) -> str:
    """``n`` and ``noun``, in the plural (``nouns``, else ``noun + "s"``) unless ``n`` is 1.

    Args:
        n: the count.
        noun: the singular.
        nouns: an irregular plural (``"entries"``).
    """
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"
