"""``wording.plural``: counted nouns in messages."""

from __future__ import annotations

from zero_kernels.wording import plural


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert [plural(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert plural(1, "other rank") == "1 other rank" and plural(3, "other rank") == "3 other ranks"
    assert plural(1, "entry", "entries") == "1 entry" and plural(2, "entry", "entries") == "2 entries"
