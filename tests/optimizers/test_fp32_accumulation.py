"""fp32 gradient accumulation beside fp16/bf16 parameters (NOTE: [fp32 gradient accumulation]):
accumulate_grads() after each micro-batch, then step() steps the exact fp32 sum -- an fp32
master with no rounding at all, a remainder-kept weight with the sum rounded once -- where
autograd's own accumulation in bf16 rounds every partial sum."""
import pytest
import torch

from peak.optimizers import FusedAdam, FusedSGD
from peak_testing import assert_bitwise_equal

MICRO = 8


def setup(seed=0, n=4096):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    # micro-batch gradients of mixed magnitudes: their bf16 partial sums lose bits
    grads = [(torch.randn(n, generator=g) * (10.0 ** (i % 3 - 1))).to(torch.bfloat16)
             for i in range(MICRO)]
    return w, grads


def fp32_sum(grads):
    total = grads[0].float()
    for g in grads[1:]:
        total = total + g.float()  # the order accumulate_grads adds in
    return total


def test_fp32_master_steps_the_exact_sum():
    w, grads = setup()
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    opt = FusedAdam([p], lr=1e-2)
    opt.set_master(p, w.clone())
    for g in grads:
        p.grad = g.clone()
        opt.accumulate_grads()
        assert p.grad is None
    opt.step()
    # reference: the fp32 master stepped as an fp32 weight with the fp32 sum
    ref = torch.nn.Parameter(w.clone())
    ref_opt = FusedAdam([ref], lr=1e-2)
    ref.grad = fp32_sum(grads)
    ref_opt.step()
    assert_bitwise_equal(opt.master_of(p), ref.detach())
    assert_bitwise_equal(p.detach(), ref.detach().to(torch.bfloat16))
    assert opt.state[p]["master_param"].grad is None  # the step used and dropped it


def test_bf16_accumulation_is_what_it_improves_on():
    """The same micro-batches accumulated by autograd in bf16: the stepped gradient is farther
    from the float64 sum than the fp32 accumulation's (so the test above can fail)."""
    w, grads = setup()
    exact = torch.stack([g.double() for g in grads]).sum(0)
    in_bf16 = grads[0].clone()
    for g in grads[1:]:
        in_bf16 += g
    assert (fp32_sum(grads).double() - exact).abs().max() < (in_bf16.double() - exact).abs().max()


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD])
def test_remainder_weights_step_the_sum_rounded_once(cls):
    w, grads = setup(1)
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    q = torch.nn.Parameter(w.to(torch.bfloat16))
    kw = dict(lr=1e-2, store_param_remainders=True)
    opt, ref_opt = cls([p], **kw), cls([q], **kw)
    for g in grads[:-1]:
        p.grad = g.clone()
        opt.accumulate_grads()
    p.grad = grads[-1].clone()  # the last micro-batch's gradient, not accumulated: added too
    opt.step()
    q.grad = fp32_sum(grads).to(torch.bfloat16)
    ref_opt.step()
    assert_bitwise_equal(p.detach(), q.detach())
    assert_bitwise_equal(opt.state[p]["master_param_remainder"],
                         ref_opt.state[q]["master_param_remainder"])
    assert_bitwise_equal(p.grad, q.grad)  # the model's view: the sum, rounded once


def test_fp32_accumulation_refuses_loss_scaling():
    w, grads = setup(2, n=16)
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    opt = FusedAdam([p], lr=1e-2)
    p.grad = grads[0]
    opt.accumulate_grads()
    with pytest.raises(ValueError, match="accumulate_grads.*without loss scaling"):
        opt.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.zeros(1))
    assert p.grad is None and not opt.state  # nothing changed: the sum is still pending
    opt.step()
    assert_bitwise_equal(p.grad, grads[0])  # ...and steps


def test_amp_o2_bf16_scale_loss_blocks_then_accumulate_grads_step_the_fp32_sum():
    """docs/advanced.md's recipe: amp O2 in bf16 over a fused optimizer, accumulate_grads() after
    each micro-batch's scale_loss block: the masters step the fp32 sum of the micro-batches' bf16
    gradients, not autograd's bf16 running sum."""
    from peak import amp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = FusedSGD(model.parameters(), lr=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    params = list(model.parameters())
    before = [opt.master_of(p).clone() for p in params]
    sums = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for _ in range(MICRO):
        x, y = torch.randn(4, 32) + 0.5, torch.randn(4, 8)
        with amp.scale_loss((model(x).float() - y).pow(2).mean() / MICRO, opt) as scaled:
            scaled.backward()
        for total, p in zip(sums, params):
            total += p.grad.float()  # (what the block left: this micro-batch's bf16 gradient)
        opt.accumulate_grads()
    opt.step()
    for p, b, total in zip(params, before, sums):
        assert_bitwise_equal(opt.master_of(p), b - 0.5 * total)
        assert_bitwise_equal(p.detach(), opt.master_of(p).to(torch.bfloat16))


def test_zero_grad_drops_the_sums():
    """A discarded micro-batch does not leak into the next step: zero_grad() drops the sums."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = FusedSGD([p], lr=1.0)
    p.grad = torch.full_like(p, 100.0)
    opt.accumulate_grads()
    opt.zero_grad()
    p.grad = torch.ones_like(p)
    opt.accumulate_grads()
    opt.step()
    assert torch.equal(p.detach(), torch.full_like(p, -1.0))


def test_grad_norm_reads_the_fp32_sums():
    """After accumulate_grads() the gradients live in fp32 sums, not in .grad (where
    clip_grad_norm_ finds nothing): grad_norm() is the norm of what the step will step, the sum
    plus a gradient since. It returned None, and clipping by it was a silent no-op."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(torch.bfloat16)
    opt = FusedSGD(model.parameters(), lr=0.1)
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for i in range(4):
        model(torch.randn(8, 16, dtype=torch.bfloat16) * 10).float().pow(2).mean().backward()
        for t, p in zip(total, model.parameters()):
            t += p.grad.double()
        if i < 3:
            opt.accumulate_grads()
    expected = torch.cat([t.flatten() for t in total]).norm()
    got = opt.grad_norm()
    assert got is not None
    torch.testing.assert_close(got.double().item(), expected.item(), rtol=1e-6, atol=0)


def test_replicated_parameters_on_several_ranks_warn_once_about_no_sync(monkeypatch, recwarn):
    """DDP all-reduces .grad: sums of micro-batches run under no_sync() never reach it, so on
    several ranks (a launcher's WORLD_SIZE) the first accumulate_grads() says so, once; one
    process does not warn."""
    def micro_batches(opt, w):
        for _ in range(2):
            w.grad = torch.ones_like(w)
            opt.accumulate_grads()

    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    micro_batches(FusedAdam([w], lr=1e-3), w)
    assert not [r for r in recwarn if "no_sync" in str(r.message)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    opt = FusedAdam([w], lr=1e-3)
    with pytest.warns(UserWarning, match=r"accumulate_grads\(\) on several ranks.*no_sync\(\), it "
                      r"never reaches the all-reduce") as caught:
        micro_batches(opt, w)
    assert len([r for r in caught if "no_sync" in str(r.message)]) == 1
