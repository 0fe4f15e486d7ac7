"""The ZeRO++ convergence subject: its corpus, its verdict against the plain runs' spread, and the subject itself
at a tiny size (4 gloo ranks as 2 emulated nodes, 3 steps)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from benchmarks import zeropp_loss


def test_corpus_is_fixed_and_follows_its_chain() -> None:
    stream = zeropp_loss.corpus(4000, 16)
    assert stream.equal(zeropp_loss.corpus(4000, 16))
    pairs = stream[:-1] * 16 + stream[1:]
    successors = {}
    for pair in pairs.unique().tolist():
        successors.setdefault(pair // 16, set()).add(pair % 16)
    assert max(len(s) for s in successors.values()) <= zeropp_loss.BRANCHES


def test_verdict_against_the_spread() -> None:
    rows = [{"run": f"stage3 seed {s}", "final_loss": v} for s, v in enumerate((2.0, 2.2, 2.1))]
    rows += [{"run": "stage3 + qwZ + hpZ + qgZ seed 0", "final_loss": 2.15},
             {"run": "stage3 + qwZ + hpZ + qgZ seed 1", "final_loss": 2.5},
             {"run": "stage3 + qwZ + hpZ + qgZ seed 2", "final_loss": 1.9}]  # fmt: skip
    spread = zeropp_loss.summary_row(rows)
    assert (spread["spread_low"], spread["spread_high"]) == (2.0, 2.2)
    assert spread["zeropp"] == "inside; outside by 0.3000; outside by 0.1000"
    assert [r.get("outside") for r in rows[3:]] == [0.0, pytest.approx(0.3), pytest.approx(0.1)]
    assert [r["vs_same_seed"] for r in rows[3:]] == [pytest.approx(0.15), pytest.approx(0.3), pytest.approx(-0.2)]


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_subject_at_a_tiny_size() -> None:
    shape = {"model": {"vocab": 16, "width": 16, "layers": 1, "heads": 2, "context": 8}, "rows": 2, "corpus": 2000}
    rows = zeropp_loss.measure(3, (0, 1), (0,), shape)
    assert [r["run"] for r in rows] == [
        "stage3 seed 0",
        "stage3 seed 1",
        "stage3 + qwZ + hpZ + qgZ seed 0",
        "plain spread",
    ]
    for r in rows[:3]:
        assert math.isfinite(r["final_loss"]) and abs(r["first_loss"] - math.log(16)) < 1.0, r
    # the same seed: the first forward differs only by the int8 weights of the other ranks' shards
    assert rows[2]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-2)
    assert rows[2]["first_loss"] != rows[0]["first_loss"], "nothing was quantized"
    assert rows[3]["spread_low"] <= rows[3]["spread_high"] and rows[3]["zeropp"]
