"""`hlotool.cost.measure`: each side timed in a child process, short calls repeated up to a
minimum timed duration, the bytes a call faulted in, and the memory guard."""

from __future__ import annotations

import resource

import pytest

from hlotool.cost.measure import measure, predicted_bytes
from hlotool.errors import HlotoolError
from hlotool.site import AttentionSite

SITE = AttentionSite(batch=1, q_len=64, kv_len=64, num_q_heads=2, num_kv_heads=2, head_dim=16,
                     v_head_dim=16, dtype="float32", scale=0.25)


@pytest.mark.parametrize("side", ["native", "kernel"])
def test_short_calls_are_repeated_until_min_seconds(side):
    m = measure(SITE, side, repeats=2, min_seconds=0.05)
    # A [1, 64, 2, 16] call takes well under 25 ms, so 2 calls cannot fill 0.05 s...
    assert 2 < m.repeats <= 40  # ...and the loop stops at 20 x repeats
    assert 0 < m.seconds < 0.05
    assert m.peak_rss_bytes > 10**7  # a Python process with jax loaded
    assert m.faulted_bytes >= 0 and m.faulted_bytes % resource.getpagesize() == 0
    assert m.peak_device_bytes is None  # the CPU reports no device memory


def test_without_min_seconds_exactly_repeats_calls():
    assert measure(SITE, "native", repeats=2).repeats == 2


def test_a_side_over_the_memory_limit_is_not_run():
    need = predicted_bytes(SITE, "native")
    with pytest.raises(HlotoolError, match=r"native would need ~.* GB \(limit .*\): not measured"):
        measure(SITE, "native", limit_bytes=need - 1)
