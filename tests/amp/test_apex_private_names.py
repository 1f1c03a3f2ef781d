"""Apex's private names that Apex-era scripts use, as NVIDIA's BERT pretraining script
(DeepLearningExamples, ``run_pretraining.py``) does: ``optimizer._lazy_init_maybe_master_weights()``
before loading a checkpoint, and with ``--allreduce_post_accumulation`` its own overflow buffer
swapped into ``_amp_state.loss_scalers[0]._overflow_buf`` around ``update_scale()``, then, on a
skipped step, the masters' gradients cleared through ``optimizer._amp_stash
.all_fp32_from_fp16_params`` (Apex's stash lists)."""
import pytest
import torch
from torch._utils import _unflatten_dense_tensors

from peak import amp
from peak.amp._amp_state import _amp_state
from peak.compat._apex import amp_C
from peak.optimizers import LARC, FusedAdam, FusedLAMB
from peak_testing import assert_bitwise_equal

OPTIMIZERS = {"FusedLAMB": FusedLAMB, "torch Adam": torch.optim.Adam, "FusedAdam": FusedAdam}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _batch(step, micro):
    g = torch.Generator().manual_seed(step * 10 + micro)
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def _bert_run(opt_class, poisoned_step, steps=5, accum=2, clear_model_grads=True):
    """The script's loop: micro-batches under ``scale_loss(..., delay_overflow_check=True)``, then
    its take_optimizer_step on one rank (the all-reduce of one rank is the identity)."""
    model = _model()
    optimizer = opt_class(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                      verbosity=0)
    optimizer._lazy_init_maybe_master_weights()  # (the script's resume path)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 2.0 ** 12
    overflow_buf = torch.zeros(1, dtype=torch.int32)
    history = []
    for step in range(steps):
        for micro in range(accum):
            x, y = _batch(step, micro)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if step == poisoned_step and micro == 0:
                loss = loss * float("inf")
            with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
                scaled_loss.backward()
        before = [t.detach().clone() for t in list(model.parameters())
                  + list(amp.master_params(optimizer))]
        loss_scale = scaler.loss_scale()
        master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        flat_raw = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float16)
        views = _unflatten_dense_tensors(flat_raw, master_grads)
        overflow_buf.zero_()
        amp_C.multi_tensor_scale(65536, overflow_buf, [master_grads, views], loss_scale / accum)
        overflow_buf.zero_()
        amp_C.multi_tensor_scale(65536, overflow_buf, [views, master_grads], 1.0 / loss_scale)
        old_overflow_buf = scaler._overflow_buf
        scaler._overflow_buf = overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overflow_buf = old_overflow_buf
        if not had_overflow:
            optimizer.step()
        else:
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
        after = [t.detach().clone() for t in list(model.parameters())
                 + list(amp.master_params(optimizer))]
        for param in model.parameters() if clear_model_grads else ():
            param.grad = None
        history.append((had_overflow, loss_scale, scaler.loss_scale(), before, after))
    return history


@pytest.mark.parametrize("clear_model_grads", [True, False], ids=["BERT", "masters only"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_nvidia_berts_post_accumulation_step_skips_on_its_own_overflow_buffer(name,
                                                                               clear_model_grads):
    """"masters only": the skip clears the masters' gradients alone (Apex's own skip_step does):
    the scaled model gradients they were taken from, inf included, go with them, as Apex's next
    backward drops them, so the steps after the skip are not skipped too."""
    history = _bert_run(OPTIMIZERS[name], poisoned_step=2, clear_model_grads=clear_model_grads)
    assert [h[0] for h in history] == [False, False, True, False, False]
    for step, (skipped, scale, new_scale, before, after) in enumerate(history):
        if skipped:  # the scale backs off and nothing moves, bit for bit
            assert new_scale == scale / 2
            assert_bitwise_equal(after, before, f"step {step}")
        else:
            assert new_scale == scale
            assert all(torch.isfinite(t).all() for t in after)
            assert not all(torch.equal(a, b) for a, b in zip(after, before)), step
    _reset()  # the steps before the poisoned one are those of a run without it
    clean = _bert_run(OPTIMIZERS[name], poisoned_step=-1, clear_model_grads=clear_model_grads)
    assert [h[0] for h in clean] == [False] * 5
    assert_bitwise_equal([h[4] for h in history[:2]], [h[4] for h in clean[:2]])


def _reset():
    from peak.amp import _caster
    _caster.disable()
    _amp_state.reset()


def test_an_overflow_buffer_swapped_in_reaches_update_scale_and_the_flag_given_back_is_kept():
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scale = scaler.loss_scale()
    own = scaler._overflow_buf
    scaler._overflow_buf = torch.ones(1, dtype=torch.int32)  # the script's, flagged
    assert scaler._has_overflow
    assert scaler.update_scale() is True and scaler.loss_scale() == scale / 2
    scaler._overflow_buf = own  # given back: no change (the flag stays set until the next
    assert scaler._overflow_buf is own and scaler._has_overflow  # pass clears it, as in Apex)
    scaler.clear_overflow_state()
    scaler._overflow_buf = torch.zeros(1, dtype=torch.int32)
    assert scaler.update_scale() is False and scaler.loss_scale() == scale / 2
    scaler._has_overflow = True  # (Apex's is an attribute scripts set: Horovod's Adasum)
    assert scaler.update_scale() is True and scaler.loss_scale() == scale / 4
    scaler._has_overflow = False
    assert not scaler._has_overflow and scaler.update_scale() is False
    before = scaler.loss_scale()
    for bad in (0.0, 1e-40, float("nan")):  # (the next clean step would unscale by 1/0: NaN)
        with pytest.raises(ValueError, match=r"_loss_scale must be finite and >= 2\*\*-127"):
            scaler._loss_scale = bad
        assert scaler.loss_scale() == before


def _frozen_tail_model_and_groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2), torch.nn.Linear(2, 2))
    model[3].requires_grad_(False)  # frozen, in the optimizer
    groups = [{"params": list(model[0].parameters()) + list(model[1].parameters())},
              {"params": list(model[2].parameters()) + list(model[3].parameters()), "lr": 0.5}]
    return model, groups


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


_WITH_MASTERS = ("fp16_groups", "fp32_from_fp16_groups", "fp32_from_fp32_groups",
                 "all_fp32_from_fp16_params", "all_fp32_from_fp32_params")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("opt_level", ["O1", "O3"])
def test_apexs_stash_without_master_weights_has_its_two_lists(name, opt_level):
    """Apex's lazy_init_no_master_weights: all_fp16_params and all_fp32_params, every param of
    each kind (frozen ones too); the master-weight lists are absent (hasattr is False)."""
    model, groups = _frozen_tail_model_and_groups()
    model, optimizer = amp.initialize(model, OPTIMIZERS[name](groups, lr=1e-2),
                                      opt_level=opt_level, keep_batchnorm_fp32=(
                                          True if opt_level == "O3" else None), verbosity=0)
    stash = optimizer._amp_stash
    params = list(model.parameters())  # (group order is model order here)
    assert _same(stash.all_fp16_params, [p for p in params if p.dtype == torch.float16])
    assert _same(stash.all_fp32_params, [p for p in params if p.dtype == torch.float32])
    assert any(not p.requires_grad for p in (stash.all_fp16_params if opt_level == "O3"
                                             else stash.all_fp32_params))
    for missing in _WITH_MASTERS:
        assert not hasattr(stash, missing)
    with pytest.raises(AttributeError, match="no fp32_from_fp16_groups without master weights"):
        stash.fp32_from_fp16_groups


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apexs_stash_lists_name_the_weights_each_group_steps(name):
    model, groups = _frozen_tail_model_and_groups()  # the frozen Linear: not listed (as Apex)
    model, optimizer = amp.initialize(model, OPTIMIZERS[name](groups, lr=1e-2),
                                      opt_level="O2", verbosity=0)
    stash = optimizer._amp_stash
    low = [[p for p in m.parameters()] for m in (model[0], model[2])]
    fp32 = [list(model[1].parameters()), []]  # keep_batchnorm_fp32 under O2
    same = _same
    assert not hasattr(stash, "all_fp32_params")  # (Apex's O1/O3 list: a script's hasattr)
    assert all(same(a, b) for a, b in zip(stash.fp16_groups, low))
    masters = {id(p): m for p, m in zip(low[0] + low[1], stash.all_fp32_from_fp16_params)}
    assert len(masters) == len(low[0] + low[1])
    for p in low[0] + low[1]:
        m = masters[id(p)]
        assert m.dtype == torch.float32 and m is not p and torch.equal(m.to(p.dtype), p)
    stepped = list(amp.master_params(optimizer))
    assert all(any(m is s for s in stepped) for m in stash.all_fp32_from_fp16_params)
    assert all(same(a, b) for a, b in zip(stash.fp32_from_fp32_groups, fp32))
    assert same(stash.all_fp16_params, low[0] + low[1])
    assert same(stash.all_fp32_from_fp32_params, fp32[0] + fp32[1])
    assert [len(g) for g in stash.fp32_from_fp16_groups] == [len(g) for g in low]


def test_a_wrapper_given_to_initialize_has_the_lazy_init_too():
    model = _model()
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    model, larc = amp.initialize(model, larc, opt_level="O2", verbosity=0)
    before = [m.detach().clone() for m in amp.master_params(larc)]
    larc._lazy_init_maybe_master_weights()
    larc._amp_lazy_init()  # (Varuna's resume calls this one)
    larc.optim._amp_lazy_init()
    assert_bitwise_equal([m.detach() for m in amp.master_params(larc)], before)
