"""Checkpointing: N steps, save, restore in a NEW process, M steps == N+M uninterrupted steps, bit for bit
(seed 001's workflow), for O0-O3 x fp16/bf16."""
import os
import subprocess
import sys
import warnings
from collections import OrderedDict

import pytest
import torch

from peak import amp
from peak.amp._amp_state import _amp_state

import amp_ckpt_worker as W
import amp_helpers as H


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("amp_ckpt")
    # CPU kernels' reduction order depends on the thread count: use the worker's (1) for bitwise equality
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    uninterrupted = {}
    for name, (level, low) in W.CONFIGS.items():
        model, opt = W.build(level, low)
        W.train(model, opt, range(W.N_STEPS))
        ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
        torch.save(ckpt, directory / f"{name}.ckpt.pt")
        W.train(model, opt, range(W.N_STEPS, W.N_STEPS + W.M_STEPS))
        uninterrupted[name] = W.state(model, opt)
    torch.set_num_threads(threads)
    worker = os.path.join(os.path.dirname(__file__), "amp_ckpt_worker.py")
    proc = subprocess.run([sys.executable, worker, str(directory)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory, uninterrupted


@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_resume_in_new_process_is_bit_for_bit(runs, name):
    directory, uninterrupted = runs
    resumed = torch.load(directory / f"{name}.resumed.pt", weights_only=False)
    H.assert_bitwise_equal(resumed, uninterrupted[name])
    level, low = W.CONFIGS[name]
    opt_sd = resumed["optimizer"]
    # the masters: one entry per cast parameter, in its state (peak's one layout)
    assert any("master_param" in st for st in opt_sd["state"].values()) == (level == "O2")
    scalers = resumed["amp"]
    assert list(scalers) == ["loss_scaler0"] and set(scalers["loss_scaler0"]) == {"loss_scale", "unskipped"}
    if level in ("O1", "O2") and low == torch.float16:
        # dynamic: overflows at steps 1 and 5, growth at step 4: the final scale is 2**13, unskipped 2
        assert scalers["loss_scaler0"] == {"loss_scale": 2.0**13, "unskipped": 2}


def test_amp_state_dict_format():
    model, opt = W.build("O2", torch.float16)
    amp.initialize(H.make_mlp(5), opt_level="O1", num_losses=2, verbosity=0)
    sd = amp.state_dict()
    assert isinstance(sd, OrderedDict)
    assert sd == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
                  "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 0}}
    assert type(sd["loss_scaler0"]["loss_scale"]) is float and type(sd["loss_scaler0"]["unskipped"]) is int


def test_load_state_dict_apex_semantics():
    """Entries load by position, as Apex's; a different number of losses is a Python warning
    (not a print) at verbosity > 0 and nothing at 0; a damaged dict loads nothing."""
    amp.initialize(H.make_mlp(), opt_level="O1", num_losses=2, verbosity=1)
    with pytest.warns(UserWarning, match="1 saved loss scalers, 2 in use"):
        amp.load_state_dict(OrderedDict([("loss_scaler7", {"loss_scale": 8.0, "unskipped": 3})]))
    assert _amp_state.loss_scalers[0].loss_scale() == 8.0  # matched by position, as Apex
    assert _amp_state.loss_scalers[0]._unskipped == 3
    sd = OrderedDict((f"loss_scaler{i}", {"loss_scale": 2.0**i, "unskipped": i}) for i in range(3))
    with pytest.warns(UserWarning, match="3 saved loss scalers, 2 in use"):
        amp.load_state_dict(sd)
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [1.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning obeys filters: here it would raise
        with pytest.raises(UserWarning):
            amp.load_state_dict(OrderedDict(list(sd.items())[:1]))
    for bad, match in (({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "bogus": 1},
                        'Unexpected key\\(s\\) in state_dict: "bogus"'),
                       ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 4.0}}, "not loss scaler states"),
                       # a NaN or inf scale would skip every step, 0 or a subnormal (1/scale
                       # is inf) would make NaN weights
                       *(({"loss_scaler0": {"loss_scale": v, "unskipped": 0}},
                          r"loss_scaler0=.*'loss_scale': a finite float >= 2\*\*-127")
                         for v in (float("nan"), float("inf"), 0.0, -2.0, 1e-40)),
                       ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": -1}}, "an int >= 0")):
        with pytest.raises(RuntimeError, match=match):
            amp.load_state_dict(bad)
        assert _amp_state.loss_scalers[0].loss_scale() == 1.0  # nothing was applied
    amp.initialize(H.make_mlp(), opt_level="O1", num_losses=2, verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verbosity 0: no warning
        amp.load_state_dict(OrderedDict([("loss_scaler0", {"loss_scale": 8.0, "unskipped": 3})]))


def test_a_static_loss_scale_is_not_replaced_by_the_checkpoints():
    """A user's explicit static loss_scale=128 stays when a checkpoint of a dynamic run (65536)
    is loaded: a warning says so; the same scale loads silently; a dynamic scaler resumes."""
    amp.initialize(H.make_mlp(), opt_level="O1", loss_scale=128.0, verbosity=0)
    saved = {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 7}}
    with pytest.warns(UserWarning, match="static loss scale 128.0 stays, the saved 65536.0"):
        amp.load_state_dict(saved)
    # amp.LossScaler is public: loaded directly, the warning names this line too
    with pytest.warns(UserWarning, match="static loss scale 128.0 stays") as w:
        amp.LossScaler(128.0).load_state_dict(saved["loss_scaler0"])
    assert w[0].filename == __file__
    assert _amp_state.loss_scalers[0].loss_scale() == 128.0
    assert _amp_state.loss_scalers[0]._unskipped == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 1}})
    amp.initialize(H.make_mlp(), opt_level="O1", verbosity=0)  # dynamic
    amp.load_state_dict(saved)
    assert _amp_state.loss_scalers[0].loss_scale() == 65536.0
