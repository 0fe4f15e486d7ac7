"""ZeRO++ on two emulated nodes of two ranks (``benchmarks.netns``, no rate limit): the bytes that cross the
link per step, counted on the link (``tx_bytes``), against plain stage 3's. Needs root; skipped elsewhere.

Expected, per step and node, of plain stage 3's three parameter-sized collectives (forward all-gather,
backward all-gather, gradient reduce-scatter): hpZ keeps the backward gather inside the node (2/3 of
plain); qwZ sends the forward gather as int8 blocks (a quarter of fp32, plus a scale per block):
(1/4 + 0 + 1) / 3 = 0.42 of plain; qgZ sends the reduce-scatter as int4 blocks (an eighth of fp32, plus
scales): (1/4 + 0 + 1/8) / 3 = 0.125 of plain, the issue's goal 0.3. Tested with headroom for headers and
the small persistent unit, each against plain stage 3's volume (three fp32 parameter-sized collectives, half
of each crossing the link; measured here on nine runs: plain 0.89-1.01x of it, qwZ + hpZ 0.40-0.43x, all three
0.11-0.14x, hpZ 0.55-0.68x).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.distributed
@pytest.mark.netns
def test_zeropp_link_bytes_on_two_nodes(two_nodes: Path) -> None:
    """The runs of ``_zeropp_nodes_worker.py``, in the two-node job."""
    results = [json.loads((two_nodes / "zeropp" / f"{rank}.json").read_text()) for rank in range(4)]
    for result in results:
        assert "error" not in result, result["error"]
    node0 = results[0]  # local rank 0 of node 0 counted its node's end of the link
    measured, hpz, both, every = (node0[k]["tx_bytes"] for k in ("plain", "hpz", "qwz+hpz", "zero++"))
    # Plain stage 3's volume: three fp32 parameter-sized collectives, half of each crossing the link. The ratios
    # are taken against it: the measured plain bytes move by up to 14 % between runs (706-807 kB for 796 kB),
    # while the ZeRO++ runs' bytes stay within 2 %.
    plain = 3 * 4 * node0["plain"]["params"] / 2
    assert measured >= plain * 0.85, f"plain stage 3 sent only {measured} bytes"
    assert hpz <= 0.8 * plain, f"hpZ sent {hpz / plain:.2f}x plain stage 3's bytes over the link"
    assert both <= 0.48 * plain, f"qwZ + hpZ sent {both / plain:.2f}x plain stage 3's bytes over the link"
    assert every <= 0.3 * plain, f"qwZ + hpZ + qgZ sent {every / plain:.2f}x plain stage 3's bytes over the link"
    for result in results:
        assert result["hpz"]["losses"] == result["plain"]["losses"], "hpZ changed training"
