"""The machine-readable overflow/skip log line of peak.amp (logger "peak.amp", INFO; docs/logging.md).

Apex's printed message stays byte for byte; the structured line is extra and goes through `logging`."""
import logging
import re

import torch
from torch import nn

from peak import amp

LINE = re.compile(r"^event=skip_step step=(\d+) loss_id=(\d+) loss_scale=(\S+) optimizer=(\w+)$")


def _setup(num_losses=1):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", num_losses=num_losses,
                                verbosity=1, max_loss_scale=1024.0)  # no natural fp16 overflow
    return model, opt


def _step(model, opt, poison=False, loss_id=0):
    opt.zero_grad()
    loss = model(torch.randn(3, 4)).float().sum()
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def test_skip_line_format_and_step_numbers(caplog, capsys):
    model, opt = _setup(num_losses=2)
    with caplog.at_level(logging.INFO, logger="peak.amp"):
        _step(model, opt)                           # step 0
        _step(model, opt, poison=True)              # step 1: skipped, scaler 0 -> 32768
        _step(model, opt)                           # step 2
        _step(model, opt, poison=True, loss_id=1)   # step 3: skipped, scaler 1 -> 32768
        _step(model, opt, poison=True)              # step 4: skipped, scaler 0 -> 16384
    records = [r for r in caplog.records if r.name == "peak.amp"]
    assert all(r.levelno == logging.INFO for r in records)
    parsed = [LINE.match(r.getMessage()).groups() for r in records]
    assert parsed == [("1", "0", "512.0", "SGD"), ("3", "1", "512.0", "SGD"), ("4", "0", "256.0", "SGD")]
    # Apex's human-readable message is unchanged and still printed.
    out = capsys.readouterr().out
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0\n" in out
    assert "Gradient overflow.  Skipping step, loss scaler 1 reducing loss scale to 512.0\n" in out


def test_silent_without_logging_configuration(capfd):
    model, opt = _setup()
    _amp_verbosity_off()
    _step(model, opt, poison=True)
    captured = capfd.readouterr()
    assert "event=skip_step" not in captured.out + captured.err  # INFO: not shown by Python's last resort


def test_no_line_without_overflow(caplog):
    model, opt = _setup()
    with caplog.at_level(logging.INFO, logger="peak.amp"):
        for _ in range(3):
            _step(model, opt)
    assert not [r for r in caplog.records if r.name == "peak.amp"]


def _amp_verbosity_off():
    from peak.amp._amp_state import _amp_state
    _amp_state.verbosity = 0
