"""peak.integrations.accelerate's Apex dialect with ``accelerator.accumulate`` on 2 gloo ranks:
``backward``'s default keeps the gradients of the micro-batches Accelerate runs under DDP's
``no_sync()`` scaled in ``.grad`` (``delay_unscale``), so they reach the last micro-batch's
all-reduce. The ranks then hold the same weights, masters and loss scale, bit for bit the run
written by hand as docs/distributed.md says, an overflow in one rank's first micro-batch
included; with ``delay_unscale=False`` forced they drift apart. With ``sync_each_batch=True``
every micro-batch all-reduces and nothing is delayed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")  # installed by the Makefile

import accelerate_worker as W  # noqa: E402
from dist_helpers import run_ranks  # noqa: E402


def _equal(a, b) -> bool:
    return (a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and len(a["masters"]) == len(b["masters"])
            and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
            and a["amp"] == b["amp"])


@pytest.mark.parametrize("opt_level, dtype", [("O2", "fp16"), ("O1", "fp16"), ("O2", "bf16")])
def test_accumulate_on_two_ranks_keeps_the_replicas_equal(opt_level, dtype, tmp_path):
    ranks = run_ranks(W.worker, tmp_path, opt_level, dtype)
    for r in ranks:
        assert _equal(r["default"], r["by_hand"])
        # sync_each_batch: every micro-batch all-reduces, so nothing is delayed (each pass is
        # unscaled at its exit, as without DDP)
        assert _equal(r["sync_each_batch"], r["by_hand_synced"])
    assert _equal(ranks[0]["default"], ranks[1]["default"])
    assert _equal(ranks[0]["sync_each_batch"], ranks[1]["sync_each_batch"])
    assert not _equal(ranks[0]["by_hand"], ranks[0]["by_hand_synced"])  # (the two paths differ)
    # the reference can fail: without the delay the first micro-batches miss the all-reduce
    assert not _equal(ranks[0]["no_delay"], ranks[1]["no_delay"])
    if dtype == "fp16":  # rank 1's overflow skipped the step on both ranks: the scale agrees
        scales = [r["default"]["amp"]["loss_scaler0"]["loss_scale"] for r in ranks]
        assert scales[0] == scales[1] < 2.0 ** 16
