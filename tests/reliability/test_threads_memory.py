"""Threads and memory.

* Two threads training different models at the same time — one with amp O2 (fused optimizer and
  the Apex dialect's global loss scaler), one with GradScaler + autocast — end bit-for-bit where
  each ends when run alone; likewise three threads with O1 (initialized in its thread), plain fp32
  (which must never see the O1 casts) and GradScaler + autocast.  (The Apex dialect's state is process-global, as in Apex: one
  ``amp.initialize`` at a time; autocast and the O1 caster are per thread.)
* Resident memory stays flat over thousands of O1 and O2 iterations: RSS (from /proc/self/statm)
  grows by at most ``RSS_BOUND_MB`` (8 MB) from iteration 300 to 10,000 (O1) / 5,000 (O2); a deliberate leak
  of one weight-sized tensor per iteration exceeds that bound many times over (the control)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import threading

import pytest
import torch

import peak.optimizers
from peak import amp

STEPS = 150


_RNG = threading.Lock()  # torch's default generator is process-wide: seed + init atomically


def _model(seed, width=64):
    with _RNG:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))


def _batch(i, seed):
    g = torch.Generator().manual_seed(seed * 100000 + i)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _setup_o2():
    model = _model(1)
    opt = peak.optimizers.FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0)
    return model, opt


def _train_o2(model, opt, out):
    for i in range(STEPS):
        x, y = _batch(i, 1)
        loss = torch.nn.functional.mse_loss(model(x).float(), y * (1e6 if i % 37 == 5 else 1))
        if i % 41 == 7:
            loss = loss * float("inf")  # an overflow: the step is skipped and the scale backs off
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    out["o2"] = [p.detach().clone() for p in model.parameters()] + [
        amp._amp_state.loss_scalers[0].loss_scale()]


def _train_scaler(out):
    model = _model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = amp.GradScaler("cpu", growth_interval=10)
    for i in range(STEPS):
        x, y = _batch(i, 2)
        with amp.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if i % 29 == 3:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out["scaler"] = [p.detach().clone() for p in model.parameters()] + [scaler.get_scale(), scaler.skipped_steps]


def _setup_o1():
    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=torch.bfloat16, verbosity=0)
    return model, opt


def _train_o1(out):
    """amp.initialize(O1) in this thread: the caster then casts this thread's ops (and only
    this thread's: its state is thread-local)."""
    model, opt = _setup_o1()
    seen = []
    hook = model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    for i in range(STEPS):
        if i == 1:
            hook.remove()
            assert seen == [torch.bfloat16]  # the caster is on in this thread
        x, y = _batch(i, 3)
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    out["o1"] = [p.detach().clone() for p in model.parameters()]


def _train_fp32(out):
    """No amp at all: must not see another thread's O1 casts."""
    model = _model(4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(STEPS):
        x, y = _batch(i, 4)
        seen = model(x).dtype
        assert seen == torch.float32, f"an fp32 thread computed in {seen}"
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["fp32"] = [p.detach().clone() for p in model.parameters()]


def _concurrently(*jobs):
    start = threading.Barrier(len(jobs))
    errors = []

    def run(fn, *args):
        try:
            start.wait()
            fn(*args)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a training thread did not finish in 300 s"
    assert not errors, errors


def test_o1_casts_stay_in_their_thread():
    """The O1 caster's state is per thread: an O1 model trained in one thread, an fp32 model and a
    GradScaler + autocast model in two others, all at once, end as each does alone."""
    from peak.amp import _caster

    alone = {}
    _train_fp32(alone)
    _train_scaler(alone)
    _train_o1(alone)
    _caster.disable()  # O1 casts every op of the thread that called initialize, until disabled
    together = {}
    _concurrently((_train_o1, together), (_train_fp32, together), (_train_scaler, together))
    for key in ("o1", "fp32", "scaler"):
        assert _same(together[key], alone[key]), key


def _same(a, b):
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_two_threads_train_as_they_do_alone():
    alone = {}
    model, opt = _setup_o2()
    _train_o2(model, opt, alone)
    _train_scaler(alone)
    assert alone["scaler"][-1] == len(range(3, STEPS, 29))  # the NaN steps were skipped

    together = {}
    model, opt = _setup_o2()
    start = threading.Barrier(2)
    errors = []

    def run(fn, *args):
        try:
            start.wait()
            fn(*args)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(_train_o2, model, opt, together)),
               threading.Thread(target=run, args=(_train_scaler, together))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a training thread did not finish in 300 s"
    assert not errors, errors
    assert _same(together["o2"], alone["o2"])
    assert _same(together["scaler"], alone["scaler"])


# ---------------------------------------------------------------------------------------- memory
WARMUP, RSS_BOUND_MB = 300, 8.0
ITERS = {"O1": 10_000, "O2": 5_000}
PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def rss_mb() -> float:
    """Resident memory after glibc hands its free pages back.

    Without the trim, memory freed by the tests that ran before (the whole suite shares one
    process) stays resident in the heap, and a leak that refills those holes does not show."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2 ** 20


def _rss_growth(level, leak=None, iters=None):
    model = _model(3, width=256)  # a 256x... fp16 weight copy is 16 KB: a per-iteration leak shows
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = _batch(0, 3)
    seen = []
    hook = model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(x)
    hook.remove()
    assert seen == [torch.bfloat16]  # the casts are on (O1: the caster, O2: the model's weights)
    base = None
    for i in range(iters or ITERS[level]):
        if i == WARMUP:
            base = rss_mb()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if leak is not None:
            leak.append(torch.empty(256 * 32).fill_(i))  # 32 KB per iteration (the control)
    return rss_mb() - base


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resident_memory_flat(level):
    growth = _rss_growth(level)
    print(f"{level}: RSS grew {growth:.2f} MB over {ITERS[level] - WARMUP} iterations")
    assert growth <= RSS_BOUND_MB, f"RSS grew {growth:.1f} MB over {ITERS[level] - WARMUP} {level} iterations"


def test_the_rss_measure_sees_a_leak():
    leak = []
    growth = _rss_growth("O2", leak, iters=3000)
    assert growth > 5 * RSS_BOUND_MB, f"a 32 KB/iteration leak only showed as {growth:.1f} MB"
