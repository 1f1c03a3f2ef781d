"""amp O0-O3 and GradScaler (with torch SGD and peak's FusedAdam) under DistributedDataParallel:
2 gloo ranks on CPU, rank 1 alone poisoned (inf loss at step 3, NaN input at step 7).  Every rank
skips the same steps, the scales agree, and every parameter, master weight, moment and step counter
is bit-identical across ranks; a single-process run on both ranks' data is the reference."""

from __future__ import annotations

import pytest
import torch

import ddp_worker
from dist_helpers import WORLD_SIZE, run_ranks

CONFIGS = list(ddp_worker.CONFIGS)
assert "control" not in CONFIGS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One spawn of both ranks runs every configuration (spawning costs seconds, a config does not)."""
    return run_ranks(ddp_worker.worker, tmp_path_factory.mktemp("ddp"))


def _reference(name):
    kind, a, low, opt_name, dynamic = ddp_worker.CONFIGS[name]
    fn = ddp_worker.run_amp if kind == "amp" else ddp_worker.run_scaler
    return fn(None, a, low, opt_name, dynamic)


def test_world_size(ranks):
    assert len(ranks) == WORLD_SIZE == 2


@pytest.mark.parametrize("name", CONFIGS)
def test_ranks_bit_identical(ranks, name):
    r0, r1 = ranks[0][name], ranks[1][name]
    assert len(r0["state"]) == len(r1["state"]) > 0
    for i, (a, b) in enumerate(zip(r0["state"], r1["state"])):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: state tensor {i} differs between ranks"
        assert torch.isfinite(a.float()).all(), f"{name}: state tensor {i} is not finite"
    assert r0["scales"] == r1["scales"]
    assert r0["skipped"] == r1["skipped"]


@pytest.mark.parametrize("name", CONFIGS)
def test_poisoned_steps_skipped_on_every_rank(ranks, name):
    dynamic = ddp_worker.CONFIGS[name][4]
    poisoned = [s in ddp_worker.POISON for s in range(ddp_worker.STEPS)] if dynamic else [False] * ddp_worker.STEPS
    for r in range(WORLD_SIZE):
        res = ranks[r][name]
        assert res["skipped"] == poisoned, f"rank {r}"
        if "skipped_steps" in res:
            assert res["skipped_steps"] == sum(poisoned)
        if dynamic:  # the scale backs off exactly at the poisoned steps, on every rank
            expect, s = [], res["scales"][0]
            for step in range(ddp_worker.STEPS):
                expect.append(s / 2 if poisoned[step] else s)
                s = expect[-1]
            assert res["scales"] == expect
            assert res["scales"][0] == 2.0 ** 16


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_single_process_reference(ranks, name):
    """The single-process run on the concatenated batch (poisoned alike) skips the same steps with
    the same scales; its weights agree to rounding (DDP averages per-rank gradients)."""
    ref = _reference(name)
    got = ranks[0][name]
    assert got["skipped"] == ref["skipped"]
    assert got["scales"] == ref["scales"]
    low = ddp_worker.CONFIGS[name][2] is not None or ddp_worker.CONFIGS[name][1] in (torch.float16, torch.bfloat16)
    tol = 3e-2 if low else 1e-5
    n_params = sum(1 for _ in ddp_worker.make_model().parameters())
    for i, (a, b) in enumerate(zip(got["state"][:n_params], ref["state"][:n_params])):
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol), f"{name}: parameter {i}"
    # and training moved the weights (the comparison is not between two untouched models)
    init = [p.detach() for p in ddp_worker.make_model().parameters()]
    assert any(not torch.allclose(a.double(), b.double(), atol=tol) for a, b in zip(got["state"], init))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_ddp_before_initialize_is_an_explained_error(ranks, level):
    for r in range(WORLD_SIZE):
        msg, dtype = ranks[r]["wrong_order"][level]
        assert "DistributedDataParallel" in msg and "AFTER" in msg
        assert "model = DistributedDataParallel(model" in msg and "docs/distributed.md" in msg
        assert dtype == torch.float32  # rejected before anything was cast


def test_control_a_local_fault_after_the_all_reduce_splits_the_ranks(ranks):
    """What the checks above would catch: rank 1 alone skips, the scales and weights diverge."""
    c0, c1 = ranks[0]["control"], ranks[1]["control"]
    assert c0["skipped"] == [False] * 4 and c1["skipped"] == [False, False, True, False]
    assert c0["scale"] != c1["scale"]
    assert not all(torch.equal(a, b) for a, b in zip(c0["state"], c1["state"]))


@pytest.mark.parametrize("config", [("O1", "sgd"), ("O1", "fused_adam"), ("O2", "sgd"),
                                    ("O2", "fused_adam")], ids="-".join)
def test_accumulation_with_gradients_as_bucket_views(ranks, config):
    """scale_loss sets an earlier micro-batch's unscaled gradients aside during the next backward
    pass; with gradient_as_bucket_view=True they were views into DDP's bucket, which that pass
    overwrote (gradients 1e5x off under O1, 3x under O2 with FusedAdam, silently)."""
    for r in range(WORLD_SIZE):
        default, views = ranks[r]["bucket_view"][config]
        for a, b in zip(default, views):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(views, ranks[0]["bucket_view"][config][1]))


def test_accumulation_under_no_sync_warns_unless_delayed(ranks):
    """Without delay_unscale the first micro-batch's gradients are set aside during the second
    backward, so DDP's all-reduce never sees them and the ranks step with different gradients:
    scale_loss warns (Apex's accumulation, kept); delay_unscale=True (Apex's recipe) keeps them in
    p.grad for the all-reduce: no warning, the ranks agree bit for bit."""
    (warned, set_aside), (warned_delayed, delayed) = ranks[0]["no_sync"]
    assert warned and not warned_delayed
    other_set_aside, other_delayed = ranks[1]["no_sync"][0][1], ranks[1]["no_sync"][1][1]
    assert all(torch.equal(a, b) for a, b in zip(delayed, other_delayed))
    assert not all(torch.equal(a, b) for a, b in zip(set_aside, other_set_aside))  # (the warning's case)


@pytest.mark.parametrize("kind", ["FP16_Optimizer", "amp O2"])
def test_fp32_gradients_set_aside_as_bucket_views(ranks, kind):
    """An fp32 batch norm's gradients are set aside during the next micro-batch's backward (by
    FP16_Optimizer, and by amp O2's store): as views into DDP's bucket they were overwritten."""
    for r in range(WORLD_SIZE):
        default, views = ranks[r]["batch_norm_views"][kind]
        assert all(torch.equal(a, b) for a, b in zip(default, views))


@pytest.mark.parametrize("config", ddp_worker.UNSEEDED_CONFIGS, ids=str)
def test_ranks_initialized_differently_agree_after_ddp_broadcast(ranks, config):
    """DDP's constructor gives every rank rank 0's (cast) weights; the masters amp O2 built before
    it must agree too: built from each rank's own fp32 weights, rank 1's followed the broadcast
    only where they no longer rounded to it, and the ranks stepped apart (silently)."""
    a, b = ranks[0]["unseeded"][config], ranks[1]["unseeded"][config]
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{config}: state tensor {i} differs"


@pytest.mark.parametrize("config", list(ddp_worker.STOCHASTIC_CONFIGS))
def test_stochastic_rounding_agrees_on_ranks_seeded_differently(ranks, config):
    """The fused optimizers' rounding key was torch's seed, which each launched rank draws for
    itself: replicas rounded the same all-reduced gradients apart (silently). On several ranks
    the key is 0 unless a param group sets its own (docs/distributed.md)."""
    a, b = ranks[0]["stochastic"][config], ranks[1]["stochastic"][config]
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{config}: state tensor {i} differs"
