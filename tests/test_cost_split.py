"""All-gather against ring for a sequence split over devices (`hlotool.cost.split`): figures
computed from the shapes, and the choice flipping where the model says it does."""

from __future__ import annotations

import dataclasses

import pytest

from hlotool.cost import split
from hlotool.hardware import get_hardware
from hlotool.site import AttentionSite


def _site(length: int, **kw) -> AttentionSite:
    return AttentionSite(**{**dict(batch=1, q_len=length, kv_len=length, num_q_heads=4,
                                   num_kv_heads=4, head_dim=64, v_head_dim=64,
                                   dtype="float32", scale=0.125, mask="causal", causal=True),
                            **kw})


@pytest.mark.parametrize("backward", [False, True])
def test_the_all_gather_moves_all_but_its_own_block_of_k_and_v(backward):
    site = _site(2048, num_kv_heads=2)
    priced = split.price(site, 8, "tpu-v5p", backward=backward)
    kv = 2048 * 2 * (64 + 64) * 4  # K and V, whole, f32
    assert priced.gather.link_bytes == (2 if backward else 1) * kv * 7 // 8
    # 7 hops of one K/V block each; the backward's 7 carry its f32 dK/dV beside it, and one
    # more brings them home
    assert priced.ring.link_bytes == kv * 7 // 8 + (backward and (7 * 2 * kv + kv) // 8)
    hw = get_hardware("tpu-v5p")  # both neighbours at once, 4 steps of 1 µs
    assert priced.gather.link_seconds == pytest.approx(
        (2 if backward else 1) * (kv * 7 / 8 / (2 * hw.link_bandwidth) + 4e-6))


@pytest.mark.parametrize("chip", ["cpu", "tpu-v5e", "tpu-v5p", "h100"])
@pytest.mark.parametrize("length", [64, 512, 8192])
def test_the_ring_holds_less_per_device_than_the_all_gather(chip, length):
    for backward in (False, True):
        priced = split.price(_site(length), 8, chip, backward=backward)
        assert priced.ring.memory_bytes < priced.gather.memory_bytes


@pytest.mark.parametrize("chip, short, long", [
    ("cpu", 64, 2048),        # 7 rendezvous of ~200 µs each against one
    ("tpu-v5p", 2048, 8192),  # link-bound: the all-gather sends both ways round the torus
])
def test_the_choice_flips_where_the_ring_stops_being_link_bound(chip, short, long):
    small, large = split.price(_site(short), 8, chip), split.price(_site(long), 8, chip)
    assert not small.ring_pays and small.ring.seconds > small.gather.seconds
    assert small.why.startswith("all-gather ×") and "7 hops" in small.why, small.why
    assert large.ring_pays and large.ring.seconds < large.gather.seconds
    assert large.line().endswith("→ ring"), large.line()


def test_a_gather_that_does_not_fit_takes_the_ring_however_slow():
    site = _site(2048)
    assert not split.price(site, 8, "tpu-v5p").ring_pays  # the all-gather is faster and fits
    tiny = dataclasses.replace(get_hardware("tpu-v5p"), hbm_bytes=2**20)
    priced = split.price(site, 8, tiny)
    assert priced.ring.seconds > priced.gather.seconds and priced.ring_pays
    assert priced.why.startswith("all-gather needs 20.5 MiB per device, more than"), priced.why


def test_a_refused_ring_prices_the_all_gather_alone():
    priced = split.price(_site(2048, sinks=True), 8, "cpu")
    assert priced.ring is None and not priced.ring_pays
    assert "sinks" in priced.refusal and "no ring" in priced.line()


@pytest.mark.parametrize("backward", [False, True])
def test_a_window_ring_stops_once_the_window_reaches_no_further_block(backward):
    """A causal window of 128 over blocks of 256: each device's block and the one before
    it, one hop (and dK/dV home in one more), against 7 for the causal ring."""
    windowed, causal = (split.price(_site(2048, **kw), 8, "cpu", backward=backward).ring
                        for kw in (dict(window=(128, 0), mask="local"), {}))
    kv = 2048 // 8 * 4 * (64 + 64) * 4
    assert windowed.link_bytes == kv + (backward and 2 * kv + kv)
    assert windowed.seconds < causal.seconds and windowed.link_seconds < causal.link_seconds


class _Mesh:
    shape = {"data": 2, "seq": 8}


class _Sequence:
    shape = {"seq": 8}


def test_on_a_mesh_the_batch_is_split_before_the_sequence():
    site = _site(1024, batch=2)
    priced = split.on_mesh(_Mesh, site, chip="cpu")
    alone = split.price(dataclasses.replace(site, batch=1), 8, "cpu")
    assert priced.devices == 8 and priced.to_json() == alone.to_json()
    assert split.on_mesh(_Mesh, _site(1024, batch=16), chip="cpu") is None  # both on batch
    doc = priced.to_json()
    assert doc["choice"] == "ring" and doc["all_gather"]["link_bytes"] == 7 * 128 * 4 * 128 * 4


def test_auto_keeps_the_all_gather_per_platform_where_the_ring_does_not_pay():
    """flash_jit's auto policy on a mesh, per platform on the chip it prices that platform on
    (a mesh without devices: `decision.chip_for`): the kernel's choice stands where the ring
    pays, and becomes native, with the price's reason, where it does not. 8 devices, f32,
    D = 64: the host's ring pays from L = 1024 (seven ~200 µs rendezvous against one), a
    v5e's from L = 2048 (below, a block crosses its link slower than it computes)."""
    from hlotool.cost.decision import Choice, chip_for, verdict
    from hlotool.cost.split import gathered_where_cheaper

    assert chip_for("tpu") == "tpu-v5e"
    priced = verdict(_site(2048), "cpu")  # chosen by price (a named kernel stands: below)
    kernel = {p: Choice(p, k, "kernel pays", (), priced)
              for p, k in (("cpu", "chunked"), ("tpu", "splash_tpu"))}
    for length, ring in ((64, set()), (1024, {"cpu"}), (2048, {"cpu", "tpu"})):
        chosen = gathered_where_cheaper(kernel, _site(length), _Sequence, False)
        assert {p for p, c in chosen.items() if c.kernel} == ring, length
        for p in set(kernel) - ring:
            assert chosen[p].reason.startswith(
                "keep native (XLA all-gathers K and V: all-gather ×"), chosen[p]
    named = {"cpu": Choice("cpu", "chunked", "chunked requested")}
    assert gathered_where_cheaper(named, _site(64), _Sequence, False) == named
