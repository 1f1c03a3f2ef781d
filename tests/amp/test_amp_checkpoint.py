"""Checkpointing: N steps, save, restore in a NEW process, M steps == N+M uninterrupted steps, bit for bit
(seed 001's workflow), for O0-O3 x fp16/bf16."""
import os
import subprocess
import sys
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
    assert ("amp_master_params" in opt_sd) == (level == "O2")
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


def test_load_state_dict_apex_semantics(capsys):
    amp.initialize(H.make_mlp(), opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict(OrderedDict([("loss_scaler7", {"loss_scale": 8.0, "unskipped": 3})]))
    assert "Warning: state_dict contains 1 entries, while 2 loss_scalers are used" in capsys.readouterr().out
    assert _amp_state.loss_scalers[0].loss_scale() == 8.0  # matched by position, as Apex
    assert _amp_state.loss_scalers[0]._unskipped == 3
    sd = OrderedDict((f"loss_scaler{i}", {"loss_scale": 2.0**i, "unskipped": i}) for i in range(3))
    amp.load_state_dict(sd)
    assert "Skipping loss_scaler[2], since num_losses was set to 2" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "bogus"'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "bogus": 1})
    assert _amp_state.loss_scalers[0].loss_scale() == 4.0  # valid keys applied first, as Apex
