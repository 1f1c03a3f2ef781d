"""peak's fused optimizers step DTensor shards (FSDP2's fully_shard parameters): 2 and 4 gloo
ranks against one process given the same full gradients (NOTE: [Sharded steps]).

- every layout (fp32 weights; fp16/bf16 with fp32 masters; remainders + bf16 moments; SGD with
  momentum; Adagrad) gives the one-process bits on every shard, steps included;
- clipping by the global norm reduces the norm over the mesh (summed rank by rank: close to one
  process's, not bitwise);
- an inf in ONE rank's gradient shard skips the step on every rank (the flag agreed in the step);
- shards of a tensor with fewer rows than ranks are empty on some ranks, which still count steps;
- stochastic rounding (weights, moments) draws from the shard's positions: close, not bitwise;
- the state is DTensor placed like its parameter (step counts plain tensors); a state dict saved
  and loaded on the same mesh continues bit for bit;
- LAMB and NovoGrad take per-tensor norms of whole tensors, reduced over the mesh (NovoGrad's
  infinity norm: bit for bit; L2 norms: within a tolerance);
- 8-bit moments where rows are whole 256-element blocks (the one-process blocks on any number
  of ranks), bf16 moments elsewhere, bit for bit, resharded through DCP too;
- replicated placements are refused at construction."""

from __future__ import annotations

import pytest
import torch

import sharded_worker as W
from dist_helpers import run_ranks
from peak_testing import assert_bitwise_equal


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request, tmp_path_factory):
    return run_ranks(W.worker, tmp_path_factory.mktemp(f"sharded{request.param}"),
                     world_size=request.param)


@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_shards_step_like_one_process_bit_for_bit(ranks, name):
    reference = W.run(None, name)
    for r in ranks:
        got = r[name]
        assert got["skipped"] == [1.0 if s == W.POISON_STEP else 0.0 for s in range(W.STEPS)]
        for step, (a, b) in enumerate(zip(got["history"], reference["history"], strict=True)):
            assert_bitwise_equal(a, b, f"{name} step {step}")
    # the poisoned step changed nothing, on every rank
    assert_bitwise_equal(ranks[0][name]["history"][W.POISON_STEP],
                         ranks[0][name]["history"][W.POISON_STEP - 1])


@pytest.mark.parametrize("name", list(W.CLIPPED))
def test_clipping_takes_the_norm_over_the_mesh(ranks, name):
    """The norm is summed rank by rank, so the bits may differ from one process's in the last
    place; an unclipped run would differ by the clipping factor (here far below 1)."""
    reference = W.run(None, name)
    for r in ranks:
        assert r[name]["skipped"] == reference["skipped"]
        for a, b in zip(r[name]["history"][-1], reference["history"][-1], strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("name", list(W.STOCHASTIC))
def test_stochastic_rounding_on_shards_is_close_not_bitwise(ranks, name):
    reference = W.run(None, name)["history"][-1]
    got = ranks[0][name]["history"][-1]
    for a, b in zip(got, reference, strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=2e-3)
    for r in ranks[1:]:  # every rank gathers the same tensors
        assert_bitwise_equal(r[name]["history"][-1], got)


@pytest.mark.parametrize("name", W.ACCUMULATE)
def test_fp32_accumulation_on_shards_is_one_process_bit_for_bit(ranks, name):
    """accumulate_grads() on bf16 shards (fp32 sums placed like the parameter) steps what one
    process steps."""
    expected = W.run_accumulated(None, name)
    for r in ranks:
        assert_bitwise_equal(r["accumulated"][name], expected, name)


def test_state_is_placed_like_its_parameter(ranks):
    for key, placed_alike, is_dtensor in ranks[0]["placements"]:
        if key == "step":
            assert not is_dtensor
        else:
            assert placed_alike, key


def test_state_dict_round_trip_on_the_same_mesh(ranks):
    for r in ranks:
        uninterrupted, resumed = r["state_dict_round_trip"]
        assert_bitwise_equal(resumed, uninterrupted)


@pytest.mark.parametrize("name", W.MOVED)
def test_a_sharded_model_moved_between_steps_trains_on_unchanged(ranks, name):
    """FSDP2's ``model.to()`` swaps its DTensor parameters in place: the optimizer's bookkeeping
    must hold no weak reference to them (swap_tensors refuses one), and the steps after the move
    give the bits of steps without it."""
    expected = W.moved_after_steps(None, name, move=False)
    for r in ranks:
        assert_bitwise_equal(r["moved"][name], expected, name)


@pytest.mark.parametrize("name", W.RELOAD)
def test_masters_follow_a_model_reloaded_without_its_optimizer_state(ranks, name):
    """Two Adam steps of lr 1e-2 from the loaded weights move each by about 2e-2; stale masters
    would put the old weights back (O(1) away)."""
    expected = W.reload_without_optimizer_state(None, name)
    loaded = W.full_tensors(7, W.CONFIGS[name][0])
    for w, l in zip(expected, loaded):
        assert (w.float() - l.float()).abs().max() < 0.05
    for r in ranks:
        assert_bitwise_equal(r["reloaded"][name], expected, name)


def test_unsupported_sharded_configurations_are_refused_at_construction(ranks):
    messages = ranks[0]["refusals"]
    assert "fully_shard" in messages["replicated"] and "Replicate" in messages["replicated"]


def test_a_plain_parameter_beside_shards_is_not_summed_over_the_ranks(ranks):
    for r in ranks:
        norm, expected, layer_norms, expected_layer_norms = r["plain_beside_shards"]
        torch.testing.assert_close(norm.reshape(()), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer_norms, expected_layer_norms, rtol=1e-6, atol=0)


def test_a_weight_rewritten_unchanged_keeps_its_remainder_on_shards(ranks):
    expected = W.rewritten_unchanged(None)
    assert any(t.dtype == torch.int16 and t.count_nonzero() for t in expected)  # (kept)
    for r in ranks:
        assert_bitwise_equal(r["rewritten_unchanged"], expected)


def test_8bit_moments_need_row_shards(ranks):
    for r in ranks:
        assert r["column_shards"] == (torch.bfloat16, True)


def test_the_global_norm_reduces_once_per_mesh_not_per_mesh_object(ranks):
    for r in ranks:
        got, expected = r["norm_over_equal_meshes"]
        torch.testing.assert_close(got.reshape(()), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (2, 4), (1, 2), (4, 2)],
                         ids=lambda n: str(n))
def test_dcp_checkpoint_reshards(tmp_path, saved_on, loaded_on):
    """torch.distributed.checkpoint: model and optimizer (fp32, fp32 masters, remainders + bf16
    moments, SGD momentum) saved on one number of ranks and loaded on another continue like the
    uninterrupted run, bit for bit (elementwise steps: the bits do not depend on the sharding)."""
    (tmp_path / "save").mkdir()
    (tmp_path / "load").mkdir()
    run_ranks(W.dcp_save, tmp_path / "save", str(tmp_path / "ckpt"), world_size=saved_on)
    resumed = run_ranks(W.dcp_resume, tmp_path / "load", str(tmp_path / "ckpt"),
                        world_size=loaded_on)
    for name in W.RESHARD_CONFIGS:
        expected = W.uninterrupted(name)
        for r in resumed:
            assert_bitwise_equal(r[name], expected, name)
    assert all(r["scaler_scale"] == 128.0 for r in resumed)  # GradScaler's state in DCP too


def _flat_scales(state):
    """8-bit scales flat (shards keep them [rows, blocks per row]: the same blocks)."""
    return {fqn: {k: v.reshape(-1) if k.endswith("_scale") else v for k, v in st.items()}
            for fqn, st in state.items()}


@pytest.mark.parametrize("name", ["adamw-fp32", "adam-bf16-masters", "sgd-fp32-8bit"])
def test_full_state_dict_for_export(tmp_path, name):
    """A full (unsharded) state dict gathered from 2 ranks is one process's, bit for bit. (Not
    with remainder masters: their int16 shards have no all-gather in gloo or NCCL; sharded DCP
    checkpoints carry them, above.)"""
    got = run_ranks(W.full_state_dict, tmp_path, name)[0]
    expected = W.one_process_state_dict(name)
    assert_bitwise_equal(got["model"], expected["model"])
    assert_bitwise_equal(_flat_scales(got["optim"]), _flat_scales(expected["optim"]))
    # ...and one process loads it as it is (8-bit scales [rows, blocks per row] included) and
    # steps on like the uninterrupted run
    module, opt = W._module(None, name)
    names = [n for n, _ in module.named_parameters()]
    module.load_state_dict(got["model"])
    opt.load_state_dict({"state": {i: got["optim"][n] for i, n in enumerate(names)},
                         "param_groups": opt.state_dict()["param_groups"]})
    W._steps(module, opt, W.STEPS, W.STEPS + 2)
    reference, ref_opt = W._module(None, name)
    W._steps(reference, ref_opt, 0, W.STEPS + 2)
    assert_bitwise_equal(W._full_state(list(module.parameters()), opt),
                         W._full_state(list(reference.parameters()), ref_opt))


def test_lean_checkpoints_load_on_shards_in_either_order(tmp_path):
    """fp32 masters into remainders and back, on 2 ranks, model before or after the optimizer: the
    weights are the saved ones and the masters exact (a remainder made from an fp32 master, or
    joined with its weight, went through DTensor bit operations that left the shards as they were:
    weights of 4e29)."""
    from peak.optimizers.masters import split_master

    results = run_ranks(W.lean_loads_in_either_order, tmp_path, world_size=2)
    for r in results:
        for (remainders_saved, optimizer_first), (saved, weight, master) in r.items():
            where = f"remainders saved: {remainders_saved}, optimizer first: {optimizer_first}"
            assert_bitwise_equal(master, saved[1], where)
            if remainders_saved:  # (into fp32 masters the weight stays the one loaded)
                assert_bitwise_equal(weight, saved[0], where)
            else:  # (into remainders: the master's rounding ties away, NOTE: [Remainder masters])
                assert_bitwise_equal(weight, split_master(saved[1])[0], where)
