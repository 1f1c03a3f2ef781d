"""The master-weight protocol of peak.optimizers, tested directly (docs/core.md, "Who owns the
master weights"): the MasterWeights store, the one maker and the one copy of masters, and a fused
optimizer's public methods that amp and GradScaler use."""
import copy

import pytest
import torch

from peak.optimizers import FusedAdam, FusedSGD, MasterWeights
from peak.optimizers.masters import (MASTER_KEY, REMAINDER_KEY, copy_to_model, join_remainder,
                                     master_in_state, masters_by_param, new_master, store_of)
from peak.scaling import LossScale
from peak_testing import DEVICES, assert_bitwise_equal

LOWS = [torch.float16, torch.bfloat16]


def fp32_weights(seed=0, shapes=((5, 3), (7,), (300,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("low", LOWS)
def test_new_master_is_the_original_or_the_exact_widening(low):
    w = fp32_weights()[0]
    p = w.to(low)
    assert new_master(p, w) is w
    assert new_master(p).dtype == torch.float32 and torch.equal(new_master(p), p.float())


@pytest.mark.parametrize("low", LOWS)
def test_copy_to_model_rounds_to_nearest_even_like_torch(low):
    masters = fp32_weights(1) + [torch.tensor([float("inf"), -0.0, 65504.0 * 1.01])]
    params = [torch.empty_like(m, dtype=low) for m in masters]
    copy_to_model(masters, params)
    for m, p in zip(masters, params):
        assert_bitwise_equal(p, m.to(low))


def test_store_register_take_grads_and_copy_back():
    """register swaps low params for fp32 masters (frozen ones left out), take_grads unscales a
    backward's gradients into them (flagging inf), accumulates a second pass, copy_to_model
    rounds the masters back."""
    w = fp32_weights(2)
    low = [torch.nn.Parameter(x.to(torch.float16)) for x in w[:2]]
    own = torch.nn.Parameter(w[2].clone())
    frozen = torch.nn.Parameter(w[0].to(torch.float16), requires_grad=False)
    store = MasterWeights()
    group = store.register(low + [own, frozen], True, {id(low[0]): w[0]})
    assert group[0] is store.masters[0] and torch.equal(group[0], w[0])  # the exact original
    assert torch.equal(group[1], low[1].float()) and group[2] is own and group[3] is frozen
    assert store.own_params == [own] and store.holds(low[1]) and not store.holds(own)
    assert store.mark() == (2, 1, 1) and store.frozen == [frozen]

    scale = LossScale(1024.0, device="cpu")

    class Scaler:  # what take_grads asks of a scaler (amp's LossScaler has these two)
        def unscale(self, grads, outs):
            scale.unscale_(grads, outputs=outs)

        def unscale_with_stashed(self, grads, earlier, outs):
            for g, e, o in zip(grads, earlier, outs):
                o.copy_(g.float() / 1024.0 + e)

    grads = [torch.randn_like(p, dtype=torch.float32) for p in low + [own]]
    for backward in range(2):
        store.set_grads_aside()
        for p, g in zip(low + [own], grads):
            p.grad = (g * 1024.0).to(p.dtype)
        store.take_grads(Scaler())
    for m, p, g in zip(store.masters + [own], low + [own], grads):
        expected = 2 * ((g * 1024.0).to(p.dtype).float() / 1024.0)
        torch.testing.assert_close(m.grad, expected, rtol=0, atol=1e-6)
    assert not scale.found_inf.any_()
    with torch.no_grad():
        store.masters[1].add_(0.5)
    store.copy_to_model()
    assert_bitwise_equal(low[1].detach(), store.masters[1].detach().to(torch.float16))
    store.rollback((1, 0, 0))
    assert len(store.masters) == 1 and store.own_params == [] and not store.holds(low[1])


def test_store_checkpoint_entry_and_earlier_layout():
    """attach: state_dict() carries each master as state[i]["master_param"] (the layout peak's
    fused optimizers write); load_state_dict takes it, or the earlier "amp_master_params"."""
    w = fp32_weights(3)
    low = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in w]
    store = MasterWeights()
    opt = torch.optim.SGD(store.register(low, True, {id(p): x for p, x in zip(low, w)}), lr=0.1)
    store.attach(opt)
    assert store_of(opt) is store
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2]
    assert all(sd["state"][i][MASTER_KEY] is store.masters[i] for i in range(3))
    assert opt.state == {}  # the entries are the state dict's, not the optimizer's state
    saved = [m.detach().clone() for m in store.masters]

    for layout in ("one", "earlier"):
        other = MasterWeights()
        low2 = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in fp32_weights(4)]
        opt2 = torch.optim.SGD(other.register(low2, True), lr=0.1)
        other.attach(opt2)
        loaded = {"param_groups": sd["param_groups"], "state": sd["state"]}
        if layout == "earlier":
            loaded = {"param_groups": sd["param_groups"], "state": {},
                      "amp_master_params": {i: st[MASTER_KEY] for i, st in sd["state"].items()}}
        opt2.load_state_dict(loaded)
        assert_bitwise_equal([m.detach() for m in other.masters], saved)
        assert_bitwise_equal([p.detach() for p in low2], [m.to(torch.bfloat16) for m in saved])
        assert opt2.state == {}


@pytest.mark.parametrize("low", LOWS)
def test_fused_optimizer_protocol(low):
    w = fp32_weights(5)
    params = [torch.nn.Parameter(x.to(low)) for x in w[:2]] + [torch.nn.Parameter(w[2].clone())]
    opt = FusedAdam(params, lr=1e-2, max_grad_norm=1.0)
    assert [opt.wants_master(p) for p in params] == [True, True, False]
    assert not any(opt.keeps_remainder(p) for p in params)
    assert opt.clips_by_norm and not FusedAdam(params, lr=1e-2).clips_by_norm
    opt.set_master(params[0], w[0])
    # (the master set, as the first step will compare it with a weight written since: a copy)
    assert_bitwise_equal(opt.master_of(params[0]), w[0])
    assert opt.master_of(params[2]) is None
    grads = [torch.randn_like(x) for x in w]
    for p, g in zip(params, grads):
        p.grad = (g * 256).to(p.dtype)
    norm = opt.grad_norm()  # of the gradients as they are (scaled)
    reference = torch.cat([p.grad.double().flatten() for p in params]).norm()
    torch.testing.assert_close(norm.double().reshape(()), reference, rtol=1e-6, atol=0)
    stepped = list(opt.give_master_grads(torch.tensor([256.0])))
    assert stepped[0] is w[0] and stepped[2] is params[2]
    for m, p, g in zip(stepped, params, grads):
        expected = (g * 256).to(p.dtype).float() / 256  # exact for a power-of-two scale
        assert_bitwise_equal(m.grad.float(), expected)
    opt.zero_grad()
    assert all(m.grad is None for m in stepped)


def test_remainder_masters_through_the_protocol():
    w = fp32_weights(6)[0]
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    opt = FusedAdam([p], lr=1e-2, store_param_remainders=True)
    assert opt.wants_master(p) and opt.keeps_remainder(p)
    opt.set_master(p, w)  # kept as p's rounding and the 16 bits it drops
    st = opt.state[p]
    assert MASTER_KEY not in st and REMAINDER_KEY in st
    assert_bitwise_equal(opt.master_of(p), w)
    assert_bitwise_equal(join_remainder(p.detach(), st[REMAINDER_KEY]), w)
    assert master_in_state(opt, p, st) is None  # already there: nothing changes
    assert_bitwise_equal(masters_by_param(opt)[id(p)], w)


def test_masters_by_param_sees_every_placement():
    w = fp32_weights(7)
    fused_p = torch.nn.Parameter(w[0].to(torch.float16))
    fused = FusedSGD([fused_p], lr=0.1)
    fused.set_master(fused_p, w[0])
    assert_bitwise_equal(masters_by_param(fused)[id(fused_p)], w[0])
    low = torch.nn.Parameter(w[1].to(torch.float16))
    store = MasterWeights()
    opt = torch.optim.SGD(store.register([low], True, {id(low): w[1]}), lr=0.1)
    store.attach(opt, hooks=False)
    assert masters_by_param(opt)[id(low)] is store.masters[0]


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32 masters", "remainders"])
def test_reads_between_a_weight_write_and_the_step_give_what_the_step_will(remainders):
    """A model reloaded (no amp: no hook sees it) between steps: ``master_of``, the exports and
    ``state_dict`` give the masters the next step follows the weights to (they gave the masters
    of the weights trained before the reload), and reading changes nothing that run does."""
    from peak.optimizers import export_fp32_optimizer_state_dict, export_fp32_state_dict

    def run(read, check=False):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64).to(torch.bfloat16)
        early = copy.deepcopy(model.state_dict())
        opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=remainders)
        for step in range(5):
            if step == 3:
                model.load_state_dict(early)
                reads = (opt.master_of(model.weight), export_fp32_state_dict(model, opt)["weight"],
                         export_fp32_optimizer_state_dict(opt)["state"][0]["master_param"],
                         opt.state_dict()) if read else None
            if step == 3 and check:  # the next step's following, with nothing to move weights
                opt.param_groups[0]["lr"] = 0.0
                model.weight.grad = torch.zeros_like(model.weight)
                opt.step()
                followed = opt.master_of(model.weight)
                assert torch.equal(followed.to(torch.bfloat16), model.weight.detach())
                for value in reads[:3]:
                    assert_bitwise_equal(value, followed)
                return None
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            model(x.bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    run(True, check=True)
    assert_bitwise_equal(run(True), run(False))  # reading changed nothing


# -- a model reloaded without its optimizer state (NOTE: [Masters after a model reload]) ---------
RELOAD_CASES = {
    "bf16 remainders": (torch.bfloat16, dict(store_param_remainders=True)),
    "bf16 fp32 masters": (torch.bfloat16, dict(master_weights=True)),
    "fp16 fp32 masters": (torch.float16, dict(master_weights=True)),
}


def _reload_model(dtype, seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).to(dtype)


def _grad_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("case", list(RELOAD_CASES))
def test_masters_follow_weights_loaded_without_the_optimizer_state(case):
    """model.load_state_dict alone (no amp hooks): the next step starts from the loaded weights
    (the masters follow them; the moments stay), like an optimizer resumed from a state without
    masters. Before, an fp32 master overwrote the loaded weights and a remainder was joined
    onto them."""
    dtype, options = RELOAD_CASES[case]
    model = _reload_model(dtype)
    opt = FusedAdam(model.parameters(), lr=1e-2, **options)
    for s in range(3):
        _grad_step(model, opt, s)
    loaded = _reload_model(dtype, seed=11).state_dict()
    state = copy.deepcopy(opt.state_dict())  # (torch's state_dict shares the live entries)
    for entry in state["state"].values():  # the reference: the same moments, no masters
        entry.pop(MASTER_KEY, None)
        entry.pop(REMAINDER_KEY, None)
    model.load_state_dict(loaded)
    reference = _reload_model(dtype, seed=11)
    ref_opt = FusedAdam(reference.parameters(), lr=1e-2, **options)
    ref_opt.load_state_dict(state)
    for s in range(3, 5):
        _grad_step(model, opt, s)
        _grad_step(reference, ref_opt, s)
        assert_bitwise_equal(list(model.state_dict().values()),
                             list(reference.state_dict().values()), f"{case} step {s}")
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_bitwise_equal(opt.master_of(p), ref_opt.master_of(q), f"{case} master")


@pytest.mark.parametrize("case", list(RELOAD_CASES))
@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer first", "model first"])
def test_model_and_optimizer_checkpoints_still_resume_bit_for_bit(case, optimizer_first):
    """Loading both, in either order, keeps the saved masters (the weights that arrive are the
    ones saved with them): the resumed run is the uninterrupted one."""
    dtype, options = RELOAD_CASES[case]
    model = _reload_model(dtype)
    opt = FusedAdam(model.parameters(), lr=1e-2, **options)
    for s in range(3):
        _grad_step(model, opt, s)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    saved_model = {k: v.clone() for k, v in saved_model.items()}
    resumed = _reload_model(dtype, seed=5)
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2, **options)
    _grad_step(resumed, resumed_opt, 99)  # (state of its own, to be replaced)
    loads = [lambda: resumed_opt.load_state_dict(saved_opt),
             lambda: resumed.load_state_dict(saved_model)]
    for load in loads if optimizer_first else loads[::-1]:
        load()
    for s in range(3, 5):
        _grad_step(model, opt, s)
        _grad_step(resumed, resumed_opt, s)
    assert_bitwise_equal(list(resumed.state_dict().values()), list(model.state_dict().values()))
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert_bitwise_equal(resumed_opt.master_of(p), opt.master_of(q))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["step", "GradScaler + clip_grad_norm_", "amp O2"])
def test_the_step_itself_is_not_taken_for_a_reload(path, device):
    """peak's kernels write the weights without bumping their version counter, and neither do
    GradScaler, clipping or amp's paths: ten steps keep every remainder they made (a remainder
    cleared by mistake would leave the masters equal to the bf16 weights)."""
    from peak import amp

    model = _reload_model(torch.float32 if path == "amp O2" else torch.bfloat16).to(device)
    opt = FusedAdam(model.parameters(), lr=1e-3, store_param_remainders=True)
    if path == "amp O2":  # (amp casts the fp32 model; the masters are its exact weights)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                    cast_model_type=torch.bfloat16, loss_scale=128.0)
    scaler = amp.GradScaler(device)
    for s in range(10):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(s)).to(device, torch.bfloat16)
        loss = model(x).float().square().mean()
        if path == "step":
            loss.backward()
            opt.step()
        elif path == "amp O2":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    remainders = [opt.state[p][REMAINDER_KEY] for p in model.parameters()]
    assert all(r.count_nonzero() > r.numel() // 2 for r in remainders)


def _embedding_steps(model, opt, steps, start=0, before_step=None):
    for s in range(start, start + steps):
        ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(s))
        model(ids).float().square().mean().backward()
        if before_step is not None:
            before_step(s)
        opt.step()
        opt.zero_grad()


def test_a_weight_rewritten_unchanged_keeps_its_remainder():
    """nn.Embedding(max_norm=...) renormalises its weight in place at every forward (the version
    counter moves) without changing it when no row is over the limit. The first such write
    clears the remainder (nothing tells it from a reload); from then on the weight is watched by
    a checksum of its bits, and its remainder stays: the run equals one without max_norm whose
    remainder was cleared at that same step."""
    runs = []
    for max_norm in (1e6, None):
        torch.manual_seed(0)
        model = torch.nn.Embedding(50, 16, max_norm=max_norm).to(torch.bfloat16)
        opt = FusedAdam(model.parameters(), lr=1e-3, store_param_remainders=True)
        clear = (lambda s: opt.state[model.weight][REMAINDER_KEY].zero_() if s == 1 else None)
        _embedding_steps(model, opt, 8, before_step=None if max_norm else clear)
        runs.append((model.weight.detach().clone(), opt.state[model.weight][REMAINDER_KEY]))
    assert_bitwise_equal(runs[0], runs[1])
    assert runs[0][1].count_nonzero() > runs[0][1].numel() // 2


def test_a_watched_weight_that_is_reloaded_still_has_its_remainder_cleared():
    torch.manual_seed(0)
    model = torch.nn.Embedding(50, 16, max_norm=1e6).to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-3, store_param_remainders=True)
    _embedding_steps(model, opt, 4)  # (watched from the second step)
    state = copy.deepcopy(opt.state_dict())
    for entry in state["state"].values():
        entry.pop(REMAINDER_KEY)
    loaded = {"weight": torch.randn(50, 16).to(torch.bfloat16)}
    model.load_state_dict(loaded)
    reference = torch.nn.Embedding(50, 16, max_norm=1e6).to(torch.bfloat16)
    reference.load_state_dict(loaded)
    ref_opt = FusedAdam(reference.parameters(), lr=1e-3, store_param_remainders=True)
    ref_opt.load_state_dict(state)
    _embedding_steps(model, opt, 1, start=4)
    _embedding_steps(reference, ref_opt, 1, start=4)
    assert_bitwise_equal(model.weight.detach(), reference.weight.detach())
    assert_bitwise_equal(opt.master_of(model.weight), ref_opt.master_of(reference.weight))


def _resumed(checkpoint_model, checkpoint_opt, optimizer_first, under_amp, **options):
    """A fresh fp32 model made bf16 (by amp O2 or a cast) and a FusedAdam(**options), given the
    checkpoint's optimizer state before or after the model's."""
    from peak import amp

    resumed = _reload_model(torch.float32, seed=5)
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2, **options)
    if under_amp:
        amp.initialize(resumed, resumed_opt, opt_level="O2", cast_model_type=torch.bfloat16,
                       verbosity=0)
    else:
        resumed.to(torch.bfloat16)
    loads = [lambda: resumed_opt.load_state_dict(checkpoint_opt),
             lambda: resumed.load_state_dict(checkpoint_model)]
    for load in loads if optimizer_first else loads[::-1]:
        load()
    return resumed, resumed_opt


@pytest.mark.parametrize("under_amp", [False, True], ids=["plain", "amp O2"])
def test_a_remainder_checkpoint_resumes_into_fp32_masters_in_either_order(under_amp):
    """A checkpoint saved with remainders, loaded into an optimizer that keeps fp32 masters: each
    master is the remainder joined with the bf16 weight saved with it, whether the model's
    state_dict is loaded before the optimizer's or after (then the master is joined again with
    the weight that arrives). Optimizer first used to leave masters joined with the fresh model's
    weights, and the step overwrote the loaded weights with them."""
    model = _reload_model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
    for s in range(3):
        _grad_step(model, opt, s)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    runs = {}
    for optimizer_first in (False, True):
        resumed, resumed_opt = _resumed(saved_model, saved_opt, optimizer_first, under_amp)
        for p, q in zip(resumed.parameters(), model.parameters()):
            assert_bitwise_equal(resumed_opt.master_of(p), opt.master_of(q))
        for s in range(3, 5):
            _grad_step(resumed, resumed_opt, s)
        runs[optimizer_first] = ([v.clone() for v in resumed.state_dict().values()],
                                 [resumed_opt.master_of(p).clone() for p in resumed.parameters()])
    assert_bitwise_equal(runs[True], runs[False])


@pytest.mark.parametrize("under_amp", [False, True], ids=["plain", "amp O2"])
def test_fp32_masters_load_into_remainders_in_either_order(under_amp):
    """A checkpoint with fp32 masters, loaded into an optimizer that keeps remainders: the
    masters are exact in either order. Some masters lie on a rounding tie, where the model's
    weight (rounded to nearest even) and the remainder's weight (ties away from zero) differ by an
    ulp: loaded after the optimizer, such a weight used to clear the tensor's remainders under
    amp, and to join the remainder with the wrong weight without it. Both orders give the same
    weights and masters, and train on alike."""
    from peak import amp

    model = _reload_model(torch.float32)
    with torch.no_grad():  # ties: exactly between two bf16 values
        model[0].weight[0, :3] = torch.tensor([1 + 2**-8, -(1 + 3 * 2**-8), 2 + 2**-7])
    opt = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    saved_masters = [opt.master_of(q).clone() for q in model.parameters()]
    assert any((m.to(torch.bfloat16) != _ties_away(m)).any() for m in saved_masters)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    runs = {}
    for optimizer_first in (False, True):
        resumed, resumed_opt = _resumed(saved_model, saved_opt, optimizer_first, under_amp,
                                        store_param_remainders=True)
        assert_bitwise_equal([resumed_opt.master_of(p) for p in resumed.parameters()],
                             saved_masters)
        for s in range(2):
            _grad_step(resumed, resumed_opt, s)
        runs[optimizer_first] = ([v.clone() for v in resumed.state_dict().values()],
                                 [resumed_opt.master_of(p).clone() for p in resumed.parameters()])
    assert_bitwise_equal(runs[True], runs[False])


def _ties_away(m):
    bits = m.view(torch.int32)
    return ((bits + 0x8000) & -65536).view(torch.float32).to(torch.bfloat16)


def test_a_remainder_load_is_joined_before_the_state_is_read_again():
    """Optimizer first, then the model, then ``state_dict()`` or an export before any step: the
    masters joined with the weights that arrived (they were the fresh model's weights joined with
    the loaded remainders until the next step, and a checkpoint saved then overwrote the weights
    with them when loaded)."""
    from peak.optimizers import export_fp32_state_dict

    model = _reload_model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
    for s in range(3):
        _grad_step(model, opt, s)
    saved = export_fp32_state_dict(model, opt)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = _reload_model(torch.bfloat16, seed=5)
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed.load_state_dict(checkpoint["model"])
    assert_bitwise_equal(export_fp32_state_dict(resumed, resumed_opt), saved)
    again = copy.deepcopy({"model": resumed.state_dict(), "optimizer": resumed_opt.state_dict()})
    third = _reload_model(torch.bfloat16, seed=6)
    third_opt = FusedAdam(third.parameters(), lr=1e-2)
    third.load_state_dict(again["model"])
    third_opt.load_state_dict(again["optimizer"])
    assert_bitwise_equal(dict(third.state_dict()), dict(model.state_dict()))
    assert_bitwise_equal(export_fp32_state_dict(third, third_opt), saved)


class _Tied(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # (GPT-2's wte and lm_head)
        with torch.no_grad():  # ties: exactly between two bf16 values
            self.embed.weight[0, :2] = torch.tensor([1 + 2**-8, -(2 + 3 * 2**-7)])

    def forward(self, idx):
        return self.head(self.embed(idx))


@pytest.mark.parametrize("remainders_saved", [False, True], ids=["fp32 saved", "remainders saved"])
def test_tied_weights_load_in_either_order_under_amp(remainders_saved):
    """A weight two modules share is given twice by the model's load (once per module): under
    amp, optimizer first, the second arrival used to take the first one's tie-away rounding for a
    change and replace every master of the tensor with the loaded bf16 weights."""
    from peak import amp

    model = _Tied(0)
    opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=remainders_saved)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    saved = opt.master_of(model.embed.weight).clone()  # (with its ties: no step since)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for optimizer_first in (False, True):
        resumed = _Tied(5)
        resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2,
                                store_param_remainders=not remainders_saved)
        amp.initialize(resumed, resumed_opt, opt_level="O2", cast_model_type=torch.bfloat16,
                       verbosity=0)
        loads = [lambda: resumed_opt.load_state_dict(checkpoint["optimizer"]),
                 lambda: resumed.load_state_dict(checkpoint["model"])]
        for load in loads if optimizer_first else loads[::-1]:
            load()
        assert_bitwise_equal(resumed_opt.master_of(resumed.embed.weight), saved,
                             f"optimizer first: {optimizer_first}")


def test_reading_or_loading_again_keeps_a_pending_split():
    """A split waiting for its weight belongs to the optimizer that loaded it: another optimizer's
    ``master_of`` does not take it (it made the other's state hold a foreign parameter), and a
    second load of the same optimizer completes it first (it was dropped: the masters became the
    bf16 weights)."""
    model = _reload_model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    weight = model[0].weight
    master = weight.detach().float()
    master[0, :2] = torch.tensor([1 + 2**-8, -(1 + 3 * 2**-8)])  # ties
    opt.set_master(weight, master)
    with torch.no_grad():
        weight.copy_(master.to(torch.bfloat16))
    weight.grad, opt.param_groups[0]["lr"] = torch.zeros_like(weight), 0.0
    opt.step()  # (its moments: a whole state, the master as it was)
    assert_bitwise_equal(opt.master_of(weight), master)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = _reload_model(torch.bfloat16, seed=5)
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2, store_param_remainders=True)
    other = FusedAdam([torch.nn.Parameter(torch.zeros(3))], lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed.load_state_dict(checkpoint["model"])
    assert other.master_of(resumed[0].weight) is None and len(other.state) == 0
    resumed_opt.load_state_dict(copy.deepcopy(resumed_opt.state_dict()))
    assert_bitwise_equal(resumed_opt.master_of(resumed[0].weight), master)


def test_a_later_optimizer_load_drops_an_earlier_remainder_join():
    """A remainder checkpoint, then an fp32-master checkpoint, then the second one's model: the
    masters are the second checkpoint's (the first load's pending join is dropped), bit for bit
    as if only the second had been loaded."""
    def trained(**options):
        model = _reload_model(torch.bfloat16, seed=1 if options else 2)
        opt = FusedAdam(model.parameters(), lr=1e-2, **options)
        for s in range(3):
            _grad_step(model, opt, s)
        return ({k: v.clone() for k, v in model.state_dict().items()},
                copy.deepcopy(opt.state_dict()))

    lean_model, lean_opt = trained(store_param_remainders=True)
    fp32_model, fp32_opt = trained()
    runs = []
    for first in (lean_opt, None):
        model = _reload_model(torch.bfloat16, seed=5)
        opt = FusedAdam(model.parameters(), lr=1e-2)
        if first is not None:
            opt.load_state_dict(first)
        opt.load_state_dict(fp32_opt)
        model.load_state_dict(fp32_model)
        _grad_step(model, opt, 3)
        runs.append([opt.master_of(p).clone() for p in model.parameters()])
    assert_bitwise_equal(runs[0], runs[1])


def _trained_through_torch(low=torch.bfloat16, **fused_kwargs):
    """A fused optimizer's checkpoint, carried through torch.optim.AdamW (which keeps the unknown
    master entry as it was while it trains the weights on in fp32): (that checkpoint, the fp32
    weights it reached)."""
    p = torch.nn.Parameter(fp32_weights(3, ((64,),))[0].to(low))
    opt = FusedAdam([p], lr=0.1, adam_w_mode=True, **fused_kwargs)
    for i in range(3):
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(100 + i)).to(low)
        opt.step()
    q = torch.nn.Parameter(p.detach().float().clone())
    plain = torch.optim.AdamW([q], lr=0.1)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    for i in range(3, 8):
        q.grad = torch.randn(64, generator=torch.Generator().manual_seed(100 + i))
        plain.step()
    return copy.deepcopy(plain.state_dict()), q.detach()


@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
def test_a_master_that_does_not_round_to_the_weight_gives_way_to_it(model_first):
    """A checkpoint's fp32 master saved with other weights (kept as it was by torch.optim while
    the weights trained on) must not overwrite the weights loaded with it: at the next step it
    follows them where it does not round to them, in either load order."""
    sd, reached = _trained_through_torch()
    r = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = FusedAdam([r], lr=0.1, adam_w_mode=True)
    if model_first:
        with torch.no_grad():
            r.copy_(reached)
    opt.load_state_dict(sd)
    if not model_first:
        with torch.no_grad():
            r.copy_(reached)
    assert not torch.equal(opt.state[r][MASTER_KEY].to(torch.bfloat16), r)  # (stale, as loaded)
    opt.param_groups[0].update(lr=1e-30, weight_decay=0.0)  # (a step that moves nothing)
    r.grad = torch.zeros_like(r)
    opt.step()
    assert_bitwise_equal(r.detach(), reached.to(torch.bfloat16))
    assert torch.equal(opt.state[r][MASTER_KEY].to(torch.bfloat16), r.detach())


def test_a_consistent_master_still_restores_bit_for_bit_after_the_check():
    """The check at the first step after a load keeps a master that rounds to its weight (the
    exact fp32 value, not the weight widened), so resumes stay bit for bit."""
    p = torch.nn.Parameter(fp32_weights(4, ((64,),))[0].to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.1)
    for i in range(3):
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        opt.step()
    sd, weight = copy.deepcopy(opt.state_dict()), p.detach().clone()
    r = torch.nn.Parameter(weight.clone())
    resumed = FusedAdam([r], lr=0.1)
    resumed.load_state_dict(sd)
    for o, q in ((opt, p), (resumed, r)):
        q.grad = torch.randn(64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        o.step()
    assert_bitwise_equal(resumed.state[r][MASTER_KEY], opt.state[p][MASTER_KEY])
    assert_bitwise_equal(r, p)


@pytest.mark.parametrize("kwargs", [{}, {"store_param_remainders": True},
                                    {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}],
                         ids=["fp32_master", "remainder", "8bit"])
def test_state_follows_a_change_of_the_model_layout(kwargs):
    """model.to(memory_format=torch.channels_last) after the state exists: the step re-lays the
    state out (8-bit moments re-coded) instead of refusing half-way; it steps as a fused optimizer
    built on the channels_last model from that state would."""
    w = fp32_weights(5, ((8, 3, 4, 4),))[0]
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.01, **kwargs)
    grads = [torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    p.grad = grads[0].to(torch.bfloat16)
    opt.step()
    twin = torch.nn.Parameter(p.detach().contiguous(memory_format=torch.channels_last))
    twin_opt = FusedAdam([twin], lr=0.01, **kwargs)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (loads into the new layout)
    p.data = p.data.contiguous(memory_format=torch.channels_last)
    for g in grads[1:]:
        for q, o in ((p, opt), (twin, twin_opt)):
            q.grad = g.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
            o.step()
    assert_bitwise_equal(p.detach(), twin.detach())
    assert all(t.stride() == p.stride() for t in opt.state[p].values() if t.shape == p.shape)


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda o: __import__("pickle").loads(
    __import__("pickle").dumps(o))], ids=["deepcopy", "pickle"])
def test_a_copied_fused_optimizer_keeps_its_options_and_steps_as_the_original(copier):
    p = torch.nn.Parameter(fp32_weights(6, ((32,),))[0].to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.1, master_weights=True, set_grad_none=False,
                    store_unscaled_grads=False)
    p.grad = torch.ones_like(p)
    opt.step()
    twin = copier(opt)
    (q,) = twin.param_groups[0]["params"]
    assert (twin.master_weights, twin.set_grad_none, twin.store_unscaled_grads) == (True, False, False)
    for o, x in ((opt, p), (twin, q)):
        x.grad = torch.full_like(x, 0.5)
        o.step()
    assert_bitwise_equal(q.detach(), p.detach())


def test_state_follows_the_layout_back_while_a_parameter_sits_out_a_step():
    """channels_last, then back to contiguous with one parameter without a gradient in that
    step: its state is re-laid out when it is next stepped (the check stays on until then)."""
    ws = fp32_weights(7, ((4, 3, 2, 2), (4, 3, 2, 2)))
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    refs = [torch.nn.Parameter(w.clone()) for w in ws]
    opt, ref = FusedAdam(ps, lr=0.01), torch.optim.Adam(refs, lr=0.01)
    grads = [torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    layouts = [torch.channels_last, torch.channels_last, torch.contiguous_format,
               torch.contiguous_format]
    for step, (g, layout) in enumerate(zip(grads, layouts)):
        for group in (ps, refs):
            for i, p in enumerate(group):
                p.data = p.data.contiguous(memory_format=layout)
                p.grad = None if (step == 2 and i == 1) else g.contiguous(memory_format=layout)
        opt.step()
        ref.step()
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def test_a_fused_load_refreshes_the_model_from_its_masters():
    """Outside amp too: after load_state_dict alone the weights are the loaded masters' rounding
    (an optimizer-only load, or a model load that left a weight out, restores it)."""
    p = torch.nn.Parameter(fp32_weights(8, ((32,),))[0].to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.1)
    for i in range(2):
        p.grad = torch.randn(32, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    loaded = FusedAdam([fresh], lr=0.1)
    loaded.load_state_dict(sd)
    assert_bitwise_equal(fresh.detach(), p.detach())


@pytest.mark.parametrize("case", ["optimizer_only", "zeroed_after_loads"])
def test_a_remainder_joined_with_another_weight_stays_finite(case):
    """A remainder checkpoint into fp32 masters, joined with a weight it was not saved with (zeros:
    a model whose optimizer alone is loaded, its biases zero; or a layer the user re-initialises
    after the loads): a rounded-up remainder joined with a zero weight gave NaN bits, and the step
    NaN weights. The master is the weight there now, and the step finite."""
    model = _reload_model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
    for s in range(3):
        _grad_step(model, opt, s)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert any((opt.state[p][REMAINDER_KEY] < 0).any() for p in model.parameters())
    resumed = _reload_model(torch.bfloat16, seed=5)
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    if case == "zeroed_after_loads":
        resumed.load_state_dict(checkpoint["model"])
        with torch.no_grad():
            for p in resumed.parameters():
                p.zero_()
    for p in resumed.parameters():
        assert torch.isfinite(resumed_opt.master_of(p)).all()
    _grad_step(resumed, resumed_opt, 3)
    assert all(torch.isfinite(p).all() for p in resumed.parameters())


def test_the_first_step_keeps_a_master_whose_tie_its_weight_rounds_away():
    """The first step compares every fp32 master with its weight (a write through ``.data``
    before it is followed); a bf16 weight that is its master's tie rounded away from zero (a
    remainder checkpoint's, joined) is the master's rounding too, and keeps it."""
    tie = torch.tensor([1 + 2 ** -8, -(1 + 2 ** -8), 3.0])  # two ties of bf16, one exact value
    low = torch.nn.Parameter(torch.tensor([1 + 2 ** -7, -(1 + 2 ** -7), 3.0]).to(torch.bfloat16))
    store = MasterWeights()
    opt = torch.optim.SGD(store.register([low], True, {id(low): tie.clone()}), lr=0.1)
    store.attach(opt, hooks=False)
    low.data[2] = 5.0  # (no version bump) no rounding of the master: followed
    store.follow_weights()
    assert_bitwise_equal(store.masters[0].detach(), torch.tensor([tie[0], tie[1], 5.0]))
