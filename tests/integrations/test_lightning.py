"""peak.integrations.lightning with the real Lightning Trainer.

References are independent of the plugins: the Apex-dialect plugin against the same training
written by hand with peak's API (amp.initialize, amp.scale_loss, step), the torch-dialect plugin
against Lightning's own MixedPrecision with torch.amp.GradScaler; both bit for bit. Checkpoints:
an interrupted run resumed from ``trainer.save_checkpoint`` ends bit for bit where an
uninterrupted run ends.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")  # installed by the Makefile; a plain `pip install peak` lacks it

from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision  # noqa: E402

from peak import amp  # noqa: E402
from peak.amp._amp_state import _amp_state  # noqa: E402
from peak.integrations.lightning import AmpPrecision, MixedPrecision  # noqa: E402

BATCHES_PER_EPOCH = 4


class Net(L.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.losses = []
        self.hidden_dtypes = []
        self.net[0].register_forward_hook(lambda mod, inp, out: self.hidden_dtypes.append(out.dtype))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * BATCHES_PER_EPOCH, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def fit(plugin, epochs, model=None, ckpt_path=None):
    model = model or Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[plugin])
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_loss_falls(losses):
    first, last = losses[:BATCHES_PER_EPOCH], losses[-BATCHES_PER_EPOCH:]
    assert sum(last) < 0.8 * sum(first), (first, last)


def by_hand(opt_level, dtype, epochs):
    """The same training with peak's Apex API: the reference for AmpPrecision."""
    model = Net()
    optimizer = model.configure_optimizers()
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      low_precision_dtype=dtype, verbosity=0)
    for _ in range(epochs):
        for i, batch in enumerate(data()):
            optimizer.zero_grad()
            loss = model.training_step(batch, i)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    return model, optimizer


LEVELS = ["O0", "O1", "O2", "O3"]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_level", LEVELS)
def test_apex_plugin_trains_as_by_hand_and_resumes_bitwise(opt_level, dtype, tmp_path):
    low = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    # uninterrupted: 3 epochs through Lightning
    trainer, model = fit(AmpPrecision(opt_level, low_precision_dtype=low), epochs=3)
    full_weights, full_amp = weights(model), amp.state_dict()
    full_masters = [p.detach().clone() for p in amp.master_params(trainer.optimizers[0])]
    assert_loss_falls(model.losses)
    expected_dtype = torch.float32 if opt_level == "O0" else dtype
    assert model.net[0].weight.dtype == (dtype if opt_level in ("O2", "O3") else torch.float32)
    assert set(model.hidden_dtypes) == {expected_dtype}
    prefix = "bf16" if low == "bf16" else "16"
    assert trainer.precision == {"O0": "32-true", "O1": f"{prefix}-mixed", "O2": f"{prefix}-mixed",
                                 "O3": f"{prefix}-true"}[opt_level]

    # the same by hand with peak's API: bit for bit
    _amp_state.reset()
    ref_model, ref_optimizer = by_hand(opt_level, dtype, epochs=3)
    assert_bitwise(full_weights, weights(ref_model))
    assert full_amp == amp.state_dict()
    for a, b in zip(full_masters, amp.master_params(ref_optimizer)):
        assert torch.equal(a, b)

    # interrupted after 2 epochs, checkpointed, resumed into a differently initialised module
    trainer, model = fit(AmpPrecision(opt_level, low_precision_dtype=low), epochs=2)
    path = tmp_path / "amp.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["AmpPrecision"]["amp"] == amp.state_dict()
    assert saved["AmpPrecision"]["opt_level"] == opt_level
    if opt_level == "O2":  # fp32 masters travel in the optimizer's state, exactly
        masters = {i: st["master_param"] for i, st in saved["optimizer_states"][0]["state"].items()
                   if "master_param" in st}  # {index: master} of cast params
        live = list(amp.master_params(trainer.optimizers[0]))
        assert len(masters) == 4  # the two Linear layers' weight and bias; BatchNorm stays fp32
        assert all(torch.equal(m, live[i]) and m.dtype == torch.float32 for i, m in masters.items())
    trainer, model = fit(AmpPrecision(opt_level, low_precision_dtype=low), epochs=3,
                         model=Net(seed=123), ckpt_path=path)
    assert_bitwise(full_weights, weights(model))
    assert amp.state_dict() == full_amp
    for a, b in zip(full_masters, amp.master_params(trainer.optimizers[0])):
        assert torch.equal(a, b)


def test_apex_plugin_dynamic_loss_scale_state_resumes(tmp_path):
    """fp16 O1 with a dynamic scale that moves during the run (a tiny growth interval is not an
    option of amp, so the run starts from a low scale and grows): the checkpoint carries the
    scale and the clean-step count, and a resume continues from them."""
    trainer, model = fit(AmpPrecision("O2", "fp16", loss_scale="dynamic", max_loss_scale=2.0**8), epochs=2)
    state = amp.state_dict()
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert torch.load(tmp_path / "a.ckpt", weights_only=False)["AmpPrecision"]["amp"] == state
    # a fresh plugin starts from amp's defaults; loading puts the saved scaler back
    fit(AmpPrecision("O2", "fp16", loss_scale="dynamic", max_loss_scale=2.0**8), epochs=2,
        model=Net(seed=5), ckpt_path=tmp_path / "a.ckpt")
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == state["loss_scaler0"]["loss_scale"]


def test_apex_plugin_refuses_a_checkpoint_of_another_opt_level(tmp_path):
    trainer, _ = fit(AmpPrecision("O2", "bf16"), epochs=1)
    trainer.save_checkpoint(tmp_path / "o2.ckpt")
    with pytest.raises(ValueError, match="written under opt_level='O2'.*AmpPrecision\\('O2'"):
        fit(AmpPrecision("O1", "bf16"), epochs=2, model=Net(), ckpt_path=tmp_path / "o2.ckpt")


def test_apex_plugin_clips_unscaled_master_gradients():
    """Lightning's gradient_clip_val clips what the optimizer steps: the fp32 masters' unscaled
    gradients (checked against clipping by hand inside on_before_optimizer_step)."""
    norms = []

    class Clipped(Net):
        def on_before_optimizer_step(self, optimizer):
            params = list(amp.master_params(optimizer))
            assert all(p.dtype == torch.float32 for p in params)
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            params = list(amp.master_params(optimizer))
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

    model = Clipped()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05,
                        plugins=[AmpPrecision("O2", "fp16")])
    trainer.fit(model, data())
    unclipped, clipped = norms[0::2], norms[1::2]
    # the first step's gradient norm, in fp32 without amp: the masters' gradients are unscaled
    reference = Net()
    x, y = next(iter(data()))
    F.cross_entropy(reference(x), y).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert abs(float(unclipped[0]) / float(ref_norm) - 1) < 0.02, (unclipped[0], ref_norm)
    assert all(float(n) > 0.05 for n in unclipped)
    assert all(abs(float(n) - 0.05) < 1e-4 for n in clipped)


def test_apex_plugin_manual_optimization_with_two_losses():
    """Manual optimization: manual_backward(loss, loss_id=...) picks amp's loss scaler."""
    class TwoLosses(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            out = self(x)
            self.manual_backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
            self.manual_backward(out.float().pow(2).mean() * 1e-3, loss_id=1)
            opt.step()

    model = TwoLosses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AmpPrecision("O2", "fp16", num_losses=2)])
    trainer.fit(model, data())
    state = amp.state_dict()
    assert set(state) == {"loss_scaler0", "loss_scaler1"}
    assert state["loss_scaler0"]["unskipped"] == state["loss_scaler1"]["unskipped"] == BATCHES_PER_EPOCH


def test_apex_plugin_validates_its_arguments():
    with pytest.raises(ValueError, match="opt_level must be one of 'O0', 'O1', 'O2', 'O3'.*got opt_level='02'"):
        AmpPrecision("02")
    with pytest.raises(ValueError, match="low_precision_dtype must be one of .*'bf16'.*got low_precision_dtype='fp8'"):
        AmpPrecision("O2", "fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        AmpPrecision("O2", loss_scale="huge")


def test_apex_plugin_predicts_after_fit_and_refuses_a_second_fit():
    plugin = AmpPrecision("O2", "bf16")
    trainer, model = fit(plugin, epochs=1)
    # predict after fit reconnects the same module: amp's O2 forward (bf16 inside, fp32 out)
    x = next(iter(data()))[0]
    (out,) = trainer.predict(model, torch.utils.data.DataLoader(x, batch_size=16))[:1]
    model.eval()
    with torch.no_grad():
        assert out.dtype == torch.float32 and torch.equal(out, model(x))
    trainer2 = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])
    with pytest.raises(RuntimeError, match="give each Trainer.fit a new AmpPrecision"):
        trainer2.fit(model, data())


# ---------------------------------------------------------------------------------------------- torch dialect
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_torch_plugin_matches_lightnings_own_and_resumes_bitwise(precision, tmp_path):
    fp16 = precision == "16-mixed"
    peak_trainer, peak_model = fit(MixedPrecision("fp16" if fp16 else "bf16"), epochs=3)
    assert isinstance(peak_trainer.precision_plugin.scaler, amp.GradScaler) == fp16
    assert set(peak_model.hidden_dtypes) == {torch.float16 if fp16 else torch.bfloat16}
    assert_loss_falls(peak_model.losses)
    torch_scaler = torch.amp.GradScaler("cpu") if fp16 else None
    _, torch_model = fit(LightningMixedPrecision(precision, "cpu", scaler=torch_scaler), epochs=3)
    assert_bitwise(weights(peak_model), weights(torch_model))
    full = weights(peak_model)
    full_scaler = peak_trainer.precision_plugin.state_dict()
    if fp16:
        assert full_scaler == torch_scaler.state_dict() | {k: full_scaler[k] for k in full_scaler
                                                             if k not in torch_scaler.state_dict()}

    trainer, _ = fit(MixedPrecision(precision), epochs=2)
    trainer.save_checkpoint(tmp_path / "t.ckpt")
    saved = torch.load(tmp_path / "t.ckpt", weights_only=False)
    assert saved.get("MixedPrecision", {}) == trainer.precision_plugin.state_dict()
    trainer, model = fit(MixedPrecision(precision), epochs=3, model=Net(seed=7), ckpt_path=tmp_path / "t.ckpt")
    assert_bitwise(full, weights(model))
    assert trainer.precision_plugin.state_dict() == full_scaler


def test_torch_plugin_list_edits_apply_inside_the_steps():
    _, model = fit(MixedPrecision("bf16", fp32_ops=[torch.nn.functional.linear]), epochs=1)
    assert set(model.hidden_dtypes) == {torch.float32}
    _, model = fit(MixedPrecision("bf16"), epochs=1)
    assert set(model.hidden_dtypes) == {torch.bfloat16}


def test_torch_plugin_takes_a_configured_peak_scaler():
    scaler = amp.GradScaler("cpu", init_scale=2.0**10, hysteresis=2, max_scale=2.0**12)
    trainer, model = fit(MixedPrecision("16-mixed", scaler=scaler), epochs=1)
    assert trainer.precision_plugin.scaler is scaler
    assert scaler.state_dict()["hysteresis"] == 2 and scaler.get_scale() <= 2.0**12


def test_torch_plugin_validates_its_arguments():
    with pytest.raises(ValueError, match="precision must be '16-mixed' or 'bf16-mixed'.*'bf16'.*got precision='32-true'"):
        MixedPrecision("32-true")
    with pytest.raises(ValueError, match="precision must be '16-mixed' or 'bf16-mixed'.*got precision='fp32'"):
        MixedPrecision("fp32")
    assert MixedPrecision(torch.float16).precision == MixedPrecision("half").precision == "16-mixed"
    with pytest.raises(Exception, match="bf16 needs no loss scaling"):
        MixedPrecision("bf16", scaler=amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="not a torch function"):
        MixedPrecision("bf16", fp32_ops=["no_such_op"])


@pytest.mark.parametrize("opt_level, dtype", [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")])
def test_apex_plugin_gradient_accumulation_as_by_hand(opt_level, dtype):
    """accumulate_grad_batches=2: Lightning divides each loss by 2, backs both micro-batches
    through the plugin (scale_loss each) and steps once; the same by hand with peak's API."""
    model = Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        plugins=[AmpPrecision(opt_level, dtype)])
    trainer.fit(model, data())
    got, got_amp = weights(model), amp.state_dict()
    assert trainer.global_step == BATCHES_PER_EPOCH  # two epochs, one step per two batches

    _amp_state.reset()
    ref = Net()
    optimizer = ref.configure_optimizers()
    ref, optimizer = amp.initialize(ref, optimizer, opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
    for _ in range(2):
        for i, batch in enumerate(data()):
            if i % 2 == 0:
                optimizer.zero_grad()
            loss = ref.training_step(batch, i) / 2
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            if i % 2 == 1:
                optimizer.step()
    assert_bitwise(got, weights(ref))
    assert got_amp == amp.state_dict()


def test_apex_plugin_manual_optimization_passes_the_chosen_optimizers():
    """Two models, two optimizers, two loss scalers in manual optimization; the first loss
    overflows once. manual_backward(..., optimizers=opt) passes scale_loss that optimizer alone,
    so the overflow skips its step only and halves its scaler only (every optimizer was passed:
    the other model's clean step was skipped too)."""
    class TwoModels(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)
            self.moved = []

        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            x = batch[0]
            before = [m.weight.detach().clone() for m in (self.a, self.b)]
            for m, opt, loss_id in ((self.a, opt_a, 0), (self.b, opt_b, 1)):
                opt.zero_grad()
                loss = m(x.half()).float().pow(2).mean()  # (O2: the submodules take fp16)
                if loss_id == 0 and batch_idx == 1:
                    loss = loss * float("inf")
                self.manual_backward(loss, loss_id=loss_id, optimizers=opt)
                opt.step()
            self.moved.append([not torch.equal(w, m.weight) for w, m in zip(before,
                                                                             (self.a, self.b))])

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1),
                    torch.optim.SGD(self.b.parameters(), lr=0.1)]

    model = TwoModels()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 4)),
                                         batch_size=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        plugins=[AmpPrecision("O2", "fp16", num_losses=2)])
    trainer.fit(model, loader)
    assert model.moved == [[True, True], [False, True], [True, True]]
    state = amp.state_dict()
    assert (state["loss_scaler0"]["loss_scale"], state["loss_scaler1"]["loss_scale"]) == (
        2.0**15, 2.0**16)
