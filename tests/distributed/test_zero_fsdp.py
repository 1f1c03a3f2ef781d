"""ZeroRedundancyOptimizer (optimizer state sharded over 2 gloo ranks, around a DDP model) with
peak.amp.GradScaler and with amp O1/O3; amp O2 with ZeRO is an explained error.  FSDP2
``fully_shard`` (DTensor gradient shards) with GradScaler: an inf/NaN written into ONE rank's local
gradient shard skips the step on both ranks (GradScaler all-reduces the overflow flag for sharded
gradients), with torch's Adam and with peak's FusedAdam, FusedLAMB and FusedNovoGrad stepping
the shards; without that all-reduce the ranks disagree (the control)."""

from __future__ import annotations

import pytest
import torch

import ddp_worker
import zero_worker
from dist_helpers import WORLD_SIZE, run_ranks

RUNS = [*zero_worker.CONFIGS, "zero-amp-O1-bf16", "zero-amp-O3-f16", "fsdp2-scaler-autocast-bf16",
        "fsdp2-scaler-autocast-bf16-FusedAdam", "fsdp2-scaler-autocast-bf16-FusedLAMB",
        "fsdp2-scaler-autocast-bf16-FusedNovoGrad", "fsdp2-amp-O1-f16-FusedAdam",
        "fsdp2-amp-O1-f16-AdamW"]
POISONED = [s in ddp_worker.POISON for s in range(ddp_worker.STEPS)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(zero_worker.worker, tmp_path_factory.mktemp("zero"))


def _reference(name):
    if name in zero_worker.CONFIGS:
        mdt, low, cls = zero_worker.CONFIGS[name]
        return zero_worker.run_zero_scaler(None, mdt, low, zero_worker.resolve(cls))
    if name.startswith("zero-amp-"):
        level, low = name.split("-")[2], {"bf16": torch.bfloat16, "f16": torch.float16}[name.split("-")[3]]
        return zero_worker.run_amp(None, level, low)
    if name.startswith("fsdp2-amp-"):
        return zero_worker.run_fsdp2_amp(None, name.split("-")[-1])
    last = name.split("-")[-1]
    return zero_worker.run_fsdp2(None, torch.bfloat16, last if last.startswith("Fused") else "Adam")


@pytest.mark.parametrize("name", RUNS)
def test_same_steps_skipped_same_scales_same_weights(ranks, name):
    r0, r1 = ranks[0][name], ranks[1][name]
    for r in (r0, r1):
        assert r["skipped"] == POISONED
        expect, s = [], 2.0 ** 16
        for p in POISONED:
            s = s / 2 if p else s
            expect.append(s)
        assert r["scales"] == expect
    for i, (a, b) in enumerate(zip(r0["params"], r1["params"], strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: parameter {i} differs between ranks"
        assert torch.isfinite(a.float()).all()


@pytest.mark.parametrize("name", RUNS)
def test_matches_single_process_reference(ranks, name):
    ref = _reference(name)
    got = ranks[0][name]
    assert got["skipped"] == ref["skipped"] == POISONED
    assert got["scales"] == ref["scales"]
    for i, (a, b) in enumerate(zip(got["params"], ref["params"], strict=True)):
        assert torch.allclose(a.double(), b.double(), rtol=3e-2, atol=3e-2), f"{name}: parameter {i}"
    init = [p.detach() for p in ddp_worker.make_model().parameters()]
    assert any(not torch.allclose(a.double(), b.double(), atol=1e-3) for a, b in zip(got["params"], init))


@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("zero-scaler") or n.startswith("fsdp2")])
def test_optimizer_state_is_sharded_and_finite(ranks, name):
    """ZeRO / FSDP2 really shard: each rank holds state for part of the parameters only."""
    n0, n1 = len(ranks[0][name]["local_state"]), len(ranks[1][name]["local_state"])
    for r in range(WORLD_SIZE):
        assert all(torch.isfinite(t.float()).all() for t in ranks[r][name]["local_state"])
    if name.startswith("zero-scaler-autocast-f16-SGD"):
        assert n0 == n1 == 0  # momentum-free SGD keeps no state
    elif name.startswith("zero"):
        assert 0 < n0 and 0 < n1 and n0 != n1  # parameters split unevenly between the 2 ranks
    else:
        assert n0 == n1 > 0


def test_fsdp2_control_ranks_disagree_without_the_all_reduce(ranks):
    r0, r1 = ranks[0]["fsdp2-without-agreement"], ranks[1]["fsdp2-without-agreement"]
    assert r1["skipped"] == POISONED  # the poisoned rank skips...
    assert r0["skipped"] != r1["skipped"]  # ...the other one does not know
    assert r0["scales"] != r1["scales"]


def test_amp_o2_with_zero_is_an_explained_error(ranks):
    for r in range(WORLD_SIZE):
        msg, dtype, stashed = ranks[r]["zero-amp-O2-error"]
        assert "ZeroRedundancyOptimizer" in msg and "master weights" in msg and "GradScaler" in msg
        assert dtype == torch.float32 and not stashed  # nothing changed


def test_amp_o2_over_fsdp2_is_an_explained_error(ranks):
    for r in range(WORLD_SIZE):
        msg, dtype = ranks[r]["fsdp2-amp-O2-error"]
        assert msg is not None and "fully_shard" in msg and "opt_level='O1'" in msg
        assert "GradScaler" in msg and dtype == torch.float32  # nothing was cast


def test_fully_shard_after_amp_o2_is_not_silent(ranks):
    for r in range(WORLD_SIZE):
        for name, messages in ranks[r]["fsdp2-after-amp-o2"].items():
            assert len(messages) == 1 and "fully_shard" in messages[0], name


