"""The O1 caster in the threads torch runs a thread's work on (NOTE: [Caster state in torch's
worker threads] in csrc/caster/state.cpp).

torch hands such threads the caller's ``at::ThreadLocalState``: autograd's device threads (CUDA
backward, hence checkpoint recomputation) and at::launch's inter-op pool (TorchScript forks). The
CPU tests go through the latter, which is torch's own machinery for carrying thread-local state
(the same ``ThreadLocalStateGuard`` the autograd engine uses); the CUDA test runs checkpoint's
recomputation on autograd's device thread.
"""
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

from peak import amp
from peak.amp import _caster, lists

_seen: dict = {}


@torch.jit.ignore
def _probe(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Runs on an inter-op pool thread: records what the caster does there."""
    _seen["thread"] = threading.get_ident()
    _seen["handed"] = _caster._c.handed_state()
    _seen["mm"] = mm = torch.mm(a, b)
    _seen["softmax"] = F.softmax(mm, 1)  # fp32 list
    _seen["gelu"] = F.gelu(mm)  # fp32 list too, unless an edit says otherwise
    with amp.disable_casts():
        _seen["mm_disabled"] = torch.mm(a, b)
    _seen["mm_after"] = torch.mm(a, b)
    _seen["cache"] = _caster.cache_stats()
    return a


def _forked_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.jit.wait(torch.jit.fork(_probe, a, b))


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript: its fork is what we need
    _forked = torch.jit.script(_forked_impl)


def _run_forked(a, b):
    _seen.clear()
    _forked(a, b)
    assert _seen["thread"] != threading.get_ident(), "the fork ran on the calling thread"
    return _seen


def test_forked_work_is_cast_like_the_caller(o1):
    a = torch.randn(3, 4)
    w = torch.randn(4, 5, requires_grad=True)  # a leaf weight: the main thread would cache it
    _caster._c.reset_cache_stats()
    seen = _run_forked(a, w)
    assert seen["handed"] == (True, 0, 0)
    assert seen["mm"].dtype == o1
    with amp.disable_casts():
        mm = torch.mm(a.to(o1), w.detach().to(o1))
        assert torch.equal(seen["mm"], mm)
        assert torch.equal(seen["softmax"], F.softmax(mm.float(), 1))
    assert seen["mm"].requires_grad  # the cast stays visible to autograd
    assert seen["softmax"].dtype == torch.float32 and seen["gelu"].dtype == torch.float32
    assert seen["mm_disabled"].dtype == torch.float32  # the worker's own disable_casts
    assert seen["mm_after"].dtype == o1
    # The weight-cast cache belongs to the caller: the worker neither fills nor hits one.
    assert seen["cache"]["stores"] == 0 and seen["cache"]["hits"] == 0
    assert _caster.cache_stats()["stores"] == 0
    # And the caller itself is unchanged.
    assert torch.mm(a, w).dtype == o1 and _caster.cache_stats()["stores"] == 1


def test_forked_inside_disable_casts_is_not_cast(o1):
    a = torch.randn(3, 4)
    with amp.disable_casts():
        seen = _run_forked(a, a.t())
    assert seen["handed"] == (True, 1, 0)
    assert seen["mm"].dtype == torch.float32 and seen["softmax"].dtype == torch.float32
    assert _run_forked(a, a.t())["mm"].dtype == o1  # resumed: published again


def test_forked_sees_the_callers_list_edits(o1):
    a = torch.randn(3, 4)
    with lists.local({F.gelu: "lower", torch.mm: None}):
        seen = _run_forked(a, a.t())
    assert seen["handed"] == (True, 0, 1)
    assert seen["mm"].dtype == torch.float32  # unlisted in the caller's block
    assert seen["gelu"].dtype == o1
    with amp.disable_casts():
        assert torch.equal(seen["gelu"], F.gelu(torch.mm(a, a.t()).to(o1)))
    seen = _run_forked(a, a.t())  # the block has ended: default lists again
    assert seen["handed"] == (True, 0, 0)
    assert seen["gelu"].dtype == torch.float32 and seen["mm"].dtype == o1


def test_forked_after_disable_is_not_cast(low):
    a = torch.randn(3, 4)
    _caster.enable(low)
    assert _run_forked(a, a.t())["mm"].dtype == low
    _caster.disable()
    seen = _run_forked(a, a.t())
    assert seen["handed"] is None
    assert seen["mm"].dtype == torch.float32 and seen["softmax"].dtype == torch.float32


def test_plain_python_thread_is_handed_nothing(o1):
    res = {}

    def other():
        res["handed"] = _caster._c.handed_state()
        res["casting"] = _caster._c.is_casting()
        res["dtype"] = torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert res == {"handed": None, "casting": False, "dtype": torch.float32}


def test_amp_initialize_o1_reaches_forked_work(low):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"loss_scale": 1.0} if low == torch.bfloat16 else {}
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0,
                                low_precision_dtype=low, **kw)
    a = torch.randn(2, 4)
    assert _run_forked(a, model.weight.t())["mm"].dtype == low


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_cuda_checkpoint_recomputation_on_the_device_thread(o1, reentrant):
    """On CUDA, backward (and so the recomputation of a checkpointed block) runs on autograd's
    device thread: it must be cast as the forward was, or the recomputed tensors would not match
    the saved ones (checkpoint raises) and the gradients would differ."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8)).cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    threads = set()

    def record(module, inputs, output):
        threads.add(threading.get_ident())

    model[0].register_forward_hook(record)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
    assert out.dtype == o1
    out.float().sum().backward()
    assert len(threads) == 2, "the recomputation did not run on autograd's device thread"
    ref(x.detach()).float().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


# ---- per-thread state: one thread's initialize does not switch another thread's casting ----------

def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_another_threads_initialize_leaves_this_thread_casting(low):
    a = torch.randn(3, 3)
    _caster.enable(low)

    def other():
        m = torch.nn.Linear(3, 3)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        amp.initialize(m, o, opt_level="O0", verbosity=0)  # this thread: no casting
        return torch.mm(a, a).dtype, _caster.is_enabled()

    assert _in_thread(other) == (torch.float32, False)
    assert torch.mm(a, a).dtype == low and _caster.is_enabled() and _caster.low_dtype() == low


def test_threads_cast_to_their_own_low_dtype():
    a = torch.randn(3, 3)
    _caster.enable(torch.float16)

    def other():
        _caster.enable(torch.bfloat16)
        try:
            return torch.mm(a, a).dtype, _caster._c.threads_on()
        finally:
            _caster.disable()

    assert _in_thread(other) == (torch.bfloat16, 2)
    assert torch.mm(a, a).dtype == torch.float16
    assert _caster._c.threads_on() == 1
    _caster.disable()
    assert _caster._c.threads_on() == 0 and not _caster.patched()
    assert torch.mm(a, a).dtype == torch.float32


def test_wrappers_stay_while_any_thread_casts(low):
    """The patch wrappers are process-wide: the last thread to turn O1 off removes them."""
    orig_mm = torch.mm
    _caster.enable(low)
    started, release = threading.Event(), threading.Event()
    seen = {}

    def other():
        _caster.enable(low)
        started.set()
        release.wait(10)
        seen["dtype"] = torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype
        _caster.disable()

    t = threading.Thread(target=other)
    t.start()
    started.wait(10)
    _caster.disable()  # this thread off; the other still casts
    assert torch.mm is not orig_mm and torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    release.set()
    t.join()
    assert seen["dtype"] == low
    assert torch.mm is orig_mm and not _caster.patched()


@torch.jit.ignore
def _probe_recompute_state(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A checkpoint recomputation on a worker thread: push a snapshot (here one taken inside
    disable_casts), run, pop; the state torch handed the thread must come back."""
    _seen["thread"] = threading.get_ident()
    _seen["before"] = _caster._c.handed_state()
    with amp.disable_casts():
        snapshot = _caster._c.snapshot()
    _caster._c.push_state(snapshot)
    try:
        _seen["inside"] = torch.mm(a, b)
    finally:
        _caster._c.pop_state()
    _seen["after_handed"] = _caster._c.handed_state()
    _seen["after"] = torch.mm(a, b)
    # an "off" snapshot (from a thread without O1) hides the handed state too
    _caster._c.push_state(_off_snapshot[0])
    try:
        _seen["inside_off"] = torch.mm(a, b)
    finally:
        _caster._c.pop_state()
    _seen["after_off"] = torch.mm(a, b)
    return a


_off_snapshot: list = []


def _forked_recompute_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.jit.wait(torch.jit.fork(_probe_recompute_state, a, b))


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    _forked_recompute = torch.jit.script(_forked_recompute_impl)


def test_recompute_state_on_a_worker_thread_gives_the_handed_state_back(o1):
    a = torch.randn(3, 4)
    _seen.clear()
    taker = threading.Thread(target=lambda: _off_snapshot.__setitem__(
        slice(None), [_caster._c.snapshot()]))  # a plain thread: O1 off there
    taker.start()
    taker.join()
    _forked_recompute(a, a.t())
    assert _seen["thread"] != threading.get_ident()
    assert _seen["before"] == (True, 0, 0)
    assert _seen["inside"].dtype == torch.float32  # the snapshot's disable_casts
    assert _seen["after_handed"] == (True, 0, 0)
    assert _seen["after"].dtype == o1
    assert _seen["inside_off"].dtype == torch.float32
    assert _seen["after_off"].dtype == o1
