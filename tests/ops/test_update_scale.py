"""update_scale_: the dynamic loss-scale update, against torch's kernel and a Python model."""
import math
import random

import pytest
import torch

from peak import ops

from peak_testing import DEVICES


def new_state(device, scale=2.0 ** 16, hysteresis=None):
    s = torch.tensor([scale], device=device)
    g = torch.zeros(1, dtype=torch.int32, device=device)
    h = None if hysteresis is None else torch.full((1,), hysteresis, dtype=torch.int32, device=device)
    return s, g, h


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(5))
def test_matches_torch_amp_update_scale(device, seed):
    rng = random.Random(seed)
    growth, backoff, interval = rng.choice([(2.0, 0.5, 3), (1.5, 0.25, 1), (4.0, 0.125, 5)])
    ours = new_state(device)
    theirs = new_state(device)
    for _ in range(200):
        found = torch.tensor([1.0 if rng.random() < 0.3 else 0.0], device=device)
        ops.update_scale_(ours[0], ours[1], found, growth, backoff, interval)
        before = theirs[0].clone()
        torch._amp_update_scale_(theirs[0], theirs[1], found, growth, backoff, interval)
        if theirs[0].item() < SMALLEST_NORMAL:  # torch goes on towards 0; peak stops there
            theirs[0].copy_(torch.minimum(before, torch.full_like(before, SMALLEST_NORMAL)))
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert ours[0].item() > 0


SMALLEST_NORMAL = torch.finfo(torch.float32).tiny  # 2^-126: NOTE: [The scale never reaches zero]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_scale", [0.0, None])
def test_the_scale_never_backs_off_to_zero(device, min_scale):
    """Without a floor, ~150 overflows in a row would take an fp32 scale of 2^16 to 0 (torch's
    does), and a zero scale turns the next clean step's gradients into NaN: peak stops at 2^-126."""
    s, g, h = new_state(device, hysteresis=1)
    kwargs = {} if min_scale is None else {"min_scale": min_scale}
    seen = []
    for _ in range(300):
        ops.update_scale_(s, g, torch.ones(1, device=device), 2.0, 0.5, 2000,
                          hysteresis_tracker=h, hysteresis=1, **kwargs)
        seen.append(s.item())
    assert seen[-1] == SMALLEST_NORMAL and min(seen) == SMALLEST_NORMAL
    assert seen.index(SMALLEST_NORMAL) == 16 + 126 - 1  # 2^16 halved 142 times
    t, tg, _ = new_state(device)
    for _ in range(300):
        torch._amp_update_scale_(t, tg, torch.ones(1, device=device), 2.0, 0.5, 2000)
    assert t.item() == 0.0  # (what the floor is for)
    # A scale already below the floor (a subnormal init_scale) backs off no further, never up.
    s.fill_(SMALLEST_NORMAL / 8)
    ops.update_scale_(s, g, torch.ones(1, device=device), 2.0, 0.5, 2000)
    assert s.item() == SMALLEST_NORMAL / 8


def test_growth_never_reaches_inf_like_torch():
    s, g, _ = new_state("cpu", scale=3e38)
    ops.update_scale_(s, g, torch.zeros(1), 2.0, 0.5, 1)
    assert s.item() == pytest.approx(3e38) and g.item() == 0


class ReferenceScaler:
    """An independent model of the algorithm (Apex update_scale_hysteresis + floor/ceiling)."""

    def __init__(self, scale, growth, backoff, interval, hysteresis, min_scale, max_scale):
        self.scale, self.growth_tracker, self.hyst_tracker = scale, 0, hysteresis
        self.p = (growth, backoff, interval, hysteresis, min_scale, max_scale)

    def update(self, found_inf):
        growth, backoff, interval, hysteresis, lo, hi = self.p
        if found_inf:
            self.hyst_tracker = max(self.hyst_tracker - 1, 0)
            if self.hyst_tracker <= 0:
                backed_off = max(self.scale * backoff, lo)
                if backed_off < SMALLEST_NORMAL:  # NOTE: [The scale never reaches zero]
                    backed_off = min(self.scale, SMALLEST_NORMAL)
                self.scale = float(torch.tensor(backed_off, dtype=torch.float32))
            self.growth_tracker = 0
            return
        self.hyst_tracker = hysteresis
        self.growth_tracker += 1
        if self.growth_tracker == interval:
            grown = float(torch.tensor(min(self.scale * growth, hi), dtype=torch.float32))
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("bounds", [(0.0, math.inf), (8.0, 2.0 ** 18), (2.0 ** 15, 2.0 ** 17)],
                         ids=["unbounded", "8..2^18", "2^15..2^17"])
def test_hysteresis_and_bounds_against_reference(device, hysteresis, bounds):
    lo, hi = bounds
    rng = random.Random(hysteresis)
    ref = ReferenceScaler(2.0 ** 16, 2.0, 0.5, 4, hysteresis, lo, hi)
    s, g, h = new_state(device, hysteresis=hysteresis)
    # Runs of overflows and of clean steps, so both trackers hit their limits.
    pattern = []
    for _ in range(40):
        pattern += [rng.random() < 0.5] * rng.randint(1, 6)
    for found in pattern:
        ops.update_scale_(s, g, torch.tensor([float(found)], device=device), 2.0, 0.5, 4,
                          hysteresis=hysteresis, hysteresis_tracker=h, min_scale=lo, max_scale=hi)
        ref.update(found)
        assert s.item() == ref.scale
        assert g.item() == ref.growth_tracker
        assert h.item() == ref.hyst_tracker


def test_hysteresis_backs_off_only_after_consecutive_overflows():
    s, g, h = new_state("cpu", scale=1024.0, hysteresis=3)
    inf, ok = torch.ones(1), torch.zeros(1)
    seq = [(inf, 1024.0), (inf, 1024.0), (ok, 1024.0), (inf, 1024.0), (inf, 1024.0), (inf, 512.0),
           (inf, 256.0)]
    for found, expected in seq:
        ops.update_scale_(s, g, found, 2.0, 0.5, 100, hysteresis=3, hysteresis_tracker=h)
        assert s.item() == expected


def test_static_scale_counts_clean_updates():
    # growth 1 / backoff 1: the scale never moves, the tracker still counts (Apex's static scaler).
    s, g, _ = new_state("cpu", scale=128.0)
    for i, found in enumerate([0.0, 0.0, 1.0, 0.0]):
        ops.update_scale_(s, g, torch.tensor([found]), 1.0, 1.0, 1000)
    assert s.item() == 128.0 and g.item() == 1


def test_floor_and_ceiling():
    s, g, _ = new_state("cpu", scale=4.0)
    for _ in range(5):
        ops.update_scale_(s, g, torch.ones(1), 2.0, 0.5, 1, min_scale=1.0)
    assert s.item() == 1.0
    for _ in range(10):
        ops.update_scale_(s, g, torch.zeros(1), 2.0, 0.5, 1, max_scale=32.0)
    assert s.item() == 32.0


def test_takes_the_flags_of_every_device_and_optimizer():
    # Issue 15: the op merges the per-device flags itself (any flag set: an overflow).
    s, g, _ = new_state("cpu", scale=1024.0)
    ops.update_scale_(s, g, [torch.zeros(1), torch.zeros(()), torch.zeros(1)], 2.0, 0.5, 1)
    assert s.item() == 2048.0
    ops.update_scale_(s, g, [torch.zeros(1), torch.ones(()), torch.zeros(1)], 2.0, 0.5, 1)
    assert s.item() == 1024.0 and g.item() == 0
    with pytest.raises(RuntimeError, match="found_infs is empty"):
        ops.update_scale_(s, g, [], 2.0, 0.5, 1)
