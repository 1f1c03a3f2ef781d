"""apex.parallel.DistributedDataParallel through peak's Apex alias (2 gloo ranks, CPU): the
gradients every rank holds after backward are Apex's all-reduce of the ranks' own gradients, bit
for bit (averaged after the sum, divided by the predivide factor before it, summed in fp32 when
asked), under amp O2 and in fp32; disable_allreduce leaves each rank its own."""

from __future__ import annotations

import pytest
import torch

import apex_parallel_worker as W
from dist_helpers import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(W.worker, tmp_path_factory.mktemp("apex_parallel"))


def _apex_reduced(local, options):
    """Apex's allreduce_bucket written out for two ranks' gradients."""
    factor = options.get("gradient_predivide_factor", 1.0)
    fp32 = options.get("allreduce_always_fp32", False)
    parts = [g.float() if fp32 else g.clone() for g in local]
    if factor != 1.0:
        parts = [p.mul_(1.0 / factor) for p in parts]
    out = parts[0] + parts[1]
    if options.get("gradient_average", True):
        out.mul_(factor / 2)
    return out.to(local[0].dtype)


@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_gradients_are_apexs_all_reduce(ranks, name):
    options = W.CONFIGS[name][2]
    for i in range(len(ranks[0][name]["local"])):
        expected = _apex_reduced([r[name]["local"][i] for r in ranks], options)
        for r in ranks:
            assert torch.equal(r[name]["wrapped"][i], expected), (name, i)
            assert torch.equal(r[name]["copied"][i], expected), (name, i, "deepcopy")
    assert not torch.equal(ranks[0][name]["local"][0], ranks[1][name]["local"][0])


def test_disable_allreduce_keeps_each_ranks_gradients(ranks):
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["disabled"], r["fp32"]["local"]))


def test_flat_dist_call_broadcasts_and_averages_per_dtype_as_apex(ranks):
    """Apex's flat_dist_call: every rank gets rank 0's tensors from a broadcast, and the mean of
    the ranks' from an all_reduce (summed, then divided by the world size), each dtype flat."""
    own = [r["flat"]["own"] for r in ranks]
    for r in ranks:
        for i, t in enumerate(r["flat"]["broadcast"]):
            assert torch.equal(t, own[0][i]) and t.dtype == own[0][i].dtype
        for i, t in enumerate(r["flat"]["averaged"]):
            assert torch.equal(t, (own[0][i] + own[1][i]) / 2) and t.dtype == own[0][i].dtype
    assert not torch.equal(own[0][0], own[1][0])


def test_a_parameter_without_gradient_names_delay_allreduce(ranks):
    for r in ranks:
        assert "pass delay_allreduce=True" in r["unused"], r["unused"]


def test_apex_only_options_are_refused_with_the_way_out():
    import peak.compat

    peak.compat.install_apex_alias()
    try:
        from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
        with pytest.raises(ValueError, match="channels_last tensors in NCHW shape"):
            SyncBatchNorm(4, channel_last=True)
        with pytest.raises(ValueError, match="apply the ReLU after"):
            convert_syncbn_model(torch.nn.BatchNorm2d(4), channel_last=True)
        with pytest.raises(ValueError, match="shared_param is no longer supported"):
            DistributedDataParallel(torch.nn.Linear(2, 2), shared_param=True)
        with pytest.raises(ValueError, match="in each parameter's .grad"):
            DistributedDataParallel(torch.nn.Linear(2, 2), retain_allreduce_buffers=True)
        converted = convert_syncbn_model(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
        assert isinstance(converted[0], torch.nn.SyncBatchNorm)
    finally:
        peak.compat.uninstall_apex_alias()
