"""peak's opt-in Apex alias: `python -m peak.compat install` / `uninstall`, Apex-style scripts
run unmodified under it, amp_C's entry points with Apex's argument order, and the refusal next
to a real-looking apex package."""
import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import peak.compat
from peak.compat import RealApexError, pth_paths

# ---------------------------------------------------------------------------- Apex-style scripts
# Written as Apex's README and examples write them (imports, calls, argument order), on the CPU.
SCRIPTS = {
    "readme_amp": """
        import torch
        from apex import amp

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        x, y = torch.randn(64, 16), torch.randn(64, 4)
        losses = []
        for _ in range(30):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses.append(loss.item())
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "amp": amp.state_dict()}
        amp.load_state_dict(checkpoint["amp"])
        assert losses[-1] < losses[0], losses
        print("OK")
    """,
    "o2_fused_adam_and_larc": """
        import torch
        from apex import amp
        from apex.optimizers import FusedAdam, FusedSGD
        from apex.parallel.LARC import LARC

        torch.manual_seed(0)
        for make in (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
                     lambda p: LARC(FusedSGD(p, lr=0.1, momentum=0.9), trust_coefficient=0.02)):
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                        torch.nn.Linear(32, 4))
            optimizer = make(model.parameters())
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                              keep_batchnorm_fp32=True, loss_scale="dynamic",
                                              verbosity=0)
            x, y = torch.randn(64, 16), torch.randn(64, 4)
            first = None
            for _ in range(30):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
                optimizer.step()
                first = first if first is not None else loss.item()
            assert model[0].weight.dtype == torch.float16
            assert model[1].weight.dtype == torch.float32
            assert loss.item() < first, (first, loss.item())
        print("OK")
    """,
    "fp16_utils_manual": """
        import torch
        from apex.fp16_utils import (FP16Model, prep_param_lists, model_grads_to_master_grads,
                                     master_params_to_model_params, clip_grad_norm)

        torch.manual_seed(0)
        model = FP16Model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                              torch.nn.Linear(32, 4)))
        model_params, master_params = prep_param_lists(model, flat_master=True)
        optimizer = torch.optim.SGD(master_params, lr=1e-2)
        x, y = torch.randn(64, 16), torch.randn(64, 4)
        loss_scale = 128.0
        losses = []
        for _ in range(30):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (loss * loss_scale).backward()
            model_grads_to_master_grads(model_params, master_params, flat_master=True)
            for p in master_params:
                p.grad.data.mul_(1.0 / loss_scale)
            clip_grad_norm(master_params, 10.0)
            optimizer.step()
            master_params_to_model_params(model_params, master_params, flat_master=True)
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        print("OK")
    """,
    "megatron_amp_C": """
        import torch
        import amp_C
        from apex.multi_tensor_apply import multi_tensor_applier

        torch.manual_seed(0)
        grads = [torch.randn(1000) * 1024, torch.randn(70000) * 1024]
        overflow_buf = torch.IntTensor([0])
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        expected = torch.norm(torch.cat([g.flatten() for g in grads]))
        assert torch.allclose(norm, expected, rtol=1e-5), (norm, expected)
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], 1.0 / 1024)
        assert overflow_buf.item() == 0
        assert torch.allclose(torch.norm(torch.cat(grads)), expected / 1024, rtol=1e-5)
        grads[1][7] = float("inf")
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], 1.0)
        assert overflow_buf.item() == 1
        print("OK")
    """,
    "apex_optimizers_family": """
        import torch
        from apex.optimizers import (FusedAdagrad, FusedNovoGrad, FusedMixedPrecisionLamb,
                                     FusedLAMB)

        torch.manual_seed(0)
        for make in (lambda p: FusedAdagrad(p, lr=1e-1),
                     lambda p: FusedNovoGrad(p, lr=1e-2, betas=(0.95, 0.98), weight_decay=0.001),
                     lambda p: FusedLAMB(p, lr=1e-2),
                     lambda p: FusedMixedPrecisionLamb(p, lr=1e-2,
                                                       reduced_precision_dtype=torch.bfloat16)):
            model = torch.nn.Linear(16, 4).to(torch.bfloat16)
            optimizer = make(model.parameters())
            scaler = torch.amp.GradScaler("cpu")
            x, y = torch.randn(64, 16), torch.randn(64, 4)
            losses = []
            for _ in range(30):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                losses.append(loss.item())
            assert losses[-1] < losses[0], (type(optimizer).__name__, losses)
        print("OK")
    """,
}


def _write(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def _run(args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          **kw)


def _env_without_peak_pth():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_install_run_unmodified_apex_scripts_uninstall(tmp_path):
    """The real thing: `python -m peak.compat install` writes the .pth into this environment's
    site-packages, new interpreters run Apex-style scripts unmodified, `uninstall` removes it
    and `import apex` fails again."""
    pth, loader = pth_paths()
    assert not os.path.exists(pth), "the alias is already installed in this environment"
    scripts = {name: _write(tmp_path, name, src) for name, src in SCRIPTS.items()}
    before = _run(["-c", "import apex"], cwd=tmp_path)
    assert before.returncode != 0 and "No module named 'apex'" in before.stderr
    try:
        out = _run(["-m", "peak.compat", "install"], cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert os.path.exists(pth) and os.path.exists(loader)
        # start-up stays light: the hook imports neither torch nor peak
        light = _run(["-c", "import sys; print('torch' in sys.modules, 'peak' in sys.modules)"],
                     cwd=tmp_path)
        assert light.stdout.split() == ["False", "False"], light
        for name, path in scripts.items():
            result = _run([str(path)], cwd=tmp_path)
            assert result.returncode == 0 and result.stdout.strip().endswith("OK"), (
                name, result.stdout, result.stderr)
        status = _run(["-m", "peak.compat", "status"], cwd=tmp_path)
        assert "installed at" in status.stdout
    finally:
        out = _run(["-m", "peak.compat", "uninstall"], cwd=tmp_path)
    assert out.returncode == 0 and "removed" in out.stdout
    assert not os.path.exists(pth) and not os.path.exists(loader)
    after = _run(["-c", "import apex"], cwd=tmp_path)
    assert after.returncode != 0 and "No module named 'apex'" in after.stderr


def _fake_apex(root):
    """A real-looking Apex package (apex/ with amp/ and an amp_C module) in its own dir."""
    pkg = root / "apex"
    (pkg / "amp").mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    (pkg / "amp" / "__init__.py").write_text("def initialize(*a, **k):\n    return 'real'\n")
    (root / "amp_C.py").write_text("REAL = True\n")
    return root


def test_refuses_next_to_a_real_apex(tmp_path, monkeypatch):
    fake = _fake_apex(tmp_path / "fake_site")
    env = dict(os.environ, PYTHONPATH=str(fake))
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    out = _run(["-m", "peak.compat", "install", "--site-dir", str(site_dir)], env=env)
    assert out.returncode == 1
    assert "refuses to switch on: a real 'apex' is importable" in out.stderr
    assert not os.listdir(site_dir)  # nothing written
    # ... and in-process
    monkeypatch.syspath_prepend(str(fake))
    with pytest.raises(RealApexError, match="real 'apex' is importable"):
        peak.compat.install_apex_alias()
    assert not peak.compat.apex_alias_active()


def test_an_installed_pth_stands_aside_for_a_real_apex_installed_later(tmp_path):
    """The .pth was written first; a real Apex appears afterwards: the real one is imported,
    with a warning that the alias is off."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    peak.compat.install_pth(str(site_dir))
    fake = _fake_apex(tmp_path / "fake_site")
    launcher = ("import site, sys; site.addsitedir(sys.argv[1]);"
                "import apex; from apex import amp; print(apex.REAL, amp.initialize())")
    out = _run(["-W", "always", "-c", launcher, str(site_dir)],
               env=dict(os.environ, PYTHONPATH=str(fake)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "real"]
    assert "peak's Apex alias stays off: a real 'apex' is importable" in out.stderr
    # without the real one the same .pth switches the alias on (site.addsitedir processes it
    # exactly as the interpreter does for site-packages at start-up)
    out = _run(["-c", "import site, sys; site.addsitedir(sys.argv[1]); from apex import amp; "
                      "import peak.amp; print(amp is peak.amp)", str(site_dir)],
               env=_env_without_peak_pth())
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr
    assert peak.compat.uninstall_pth(str(site_dir))


def test_a_real_apex_C_alone_keeps_the_alias_off_everywhere(tmp_path, monkeypatch):
    """Apex's C extension left installed (apex_C.so beside no apex package) is a real Apex:
    install refuses, status names it, and a .pth written before it appeared stands aside for
    every aliased name (the alias would otherwise mix a real apex_C with peak's apex)."""
    fake = tmp_path / "fake_site"
    fake.mkdir()
    (fake / "apex_C.py").write_text("REAL = True\n")
    env = dict(_env_without_peak_pth(), PYTHONPATH=str(fake))
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    out = _run(["-m", "peak.compat", "install", "--site-dir", str(site_dir)], env=env)
    assert out.returncode == 1 and "a real 'apex_C' is importable" in out.stderr
    out = _run(["-m", "peak.compat", "status", "--site-dir", str(site_dir)], env=env)
    assert f"real apex_C: {fake / 'apex_C.py'}" in out.stdout and "real apex: not" in out.stdout
    peak.compat.install_pth(str(site_dir))
    launcher = ("import site, sys; site.addsitedir(sys.argv[1]);"
                "import apex_C; print(apex_C.REAL)\n"
                "try:\n    import apex\nexcept ImportError:\n    print('no apex')")
    out = _run(["-W", "always", "-c", launcher, str(site_dir)], env=env)
    assert out.returncode == 0 and out.stdout.split() == ["True", "no", "apex"], out.stderr
    assert "a real 'apex_C' is importable" in out.stderr
    assert peak.compat.uninstall_pth(str(site_dir))
    monkeypatch.syspath_prepend(str(fake))
    with pytest.raises(RealApexError, match="real 'apex_C' is importable"):
        peak.compat.install_apex_alias()


# ---------------------------------------------------------------------------- in process
@pytest.fixture
def alias():
    peak.compat.install_apex_alias()
    try:
        yield
    finally:
        peak.compat.uninstall_apex_alias()


def test_names_resolve_to_peak_objects(alias):
    import amp_C  # noqa: F401
    import apex
    import apex.amp._amp_state
    from apex import amp
    from apex.fp16_utils import FP16_Optimizer, FP16Model, network_to_half  # noqa: F401
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
    from apex.optimizers import FusedAdam, FusedSGD
    from apex.parallel.LARC import LARC

    import peak.amp
    import peak.optimizers
    assert amp is peak.amp and apex.amp is peak.amp
    assert apex.amp._amp_state is peak.amp._amp_state
    # ...the AmpState object, as in Apex (importing the submodule must not replace it)
    assert isinstance(peak.amp._amp_state, peak.amp._amp_state.__class__)
    assert hasattr(peak.amp._amp_state, "loss_scalers") and hasattr(peak.amp._amp_state, "reset")
    assert peak.amp.__spec__.name == "peak.amp"  # peak's module keeps its own identity
    assert LARC is peak.optimizers.LARC
    assert multi_tensor_applier.available and multi_tensor_applier.chunk_size == 65536
    assert MultiTensorApply(333).chunk_size == 333
    p = torch.nn.Parameter(torch.ones(2))
    # Apex's defaults: FusedAdam is AdamW with Apex's argument order, FusedSGD keeps grads
    adam = FusedAdam([p], 1e-3, False, (0.8, 0.9))
    assert adam.param_groups[0]["adam_w_mode"] is True
    assert adam.param_groups[0]["bias_correction"] is False
    assert adam.param_groups[0]["betas"] == (0.8, 0.9)
    assert FusedSGD([p], lr=0.1).set_grad_none is False
    assert FusedAdam([p], capturable=True).param_groups[0]["capturable"] is True  # (issue 14)
    with pytest.raises(ModuleNotFoundError, match="apex.contrib has no peak counterpart"):
        import apex.contrib  # noqa: F401
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
    assert issubclass(DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    assert issubclass(SyncBatchNorm, torch.nn.SyncBatchNorm) and callable(convert_syncbn_model)
    assert not hasattr(apex.parallel, "Reducer")
    # An import statement names the torch class too (Python would otherwise replace the message
    # with one naming peak's internal module).
    with pytest.raises(ImportError, match=r"torch\.nn\.parallel\.DistributedDataParallel") as info:
        from apex.parallel import Reducer  # noqa: F401
    assert "peak.compat" not in str(info.value)


def test_amp_C_kernels_with_apex_argument_order(alias):
    """Apex's L0 fuzz values: scale 4.0 by 1/4 gives 1.0; axpby 2*4 + 8*16 = 136; l2norm
    against torch.norm; the flag only ever set."""
    import amp_C
    from apex.multi_tensor_apply import MultiTensorApply

    applier = MultiTensorApply(333)
    noop = torch.zeros(1, dtype=torch.int32)
    # one dtype per list, as Apex's kernels take them (peak refuses a mixed list where Apex
    # silently reinterpreted memory)
    ins = [torch.full((777,), 4.0), torch.full((555,), 4.0)]
    outs = [torch.empty(777, dtype=torch.float16), torch.empty(555, dtype=torch.float16)]
    applier(amp_C.multi_tensor_scale, noop, [ins, outs], 1.0 / 4.0)
    assert all(torch.equal(o.float(), torch.ones_like(o.float())) for o in outs)
    assert noop.item() == 0
    xs = [torch.full((65537,), 4.0), torch.full((3,), 4.0)]
    ys = [torch.full((65537,), 16.0, dtype=torch.float16), torch.full((3,), 16.0).half()]
    out = [torch.empty(65537), torch.empty(3)]
    applier(amp_C.multi_tensor_axpby, noop, [xs, ys, out], 2.0, 8.0, -1)
    assert all(torch.equal(o.float(), torch.full_like(o.float(), 136.0)) for o in out)
    tensors = [torch.randn(n) for n in (7777, 555, 65536)]
    norm, per = applier(amp_C.multi_tensor_l2norm, noop, [tensors], True)
    torch.testing.assert_close(norm[0], torch.norm(torch.cat(tensors)), rtol=1e-5, atol=0)
    torch.testing.assert_close(per, torch.stack([t.norm() for t in tensors]), rtol=1e-5, atol=0)
    norm2, _ = applier(amp_C.multi_tensor_unscale_l2norm, noop, [tensors], torch.tensor([0.5]),
                       False)
    torch.testing.assert_close(norm2, norm * 0.5)
    assert noop.item() == 0
    tensors[2][100] = float("nan")
    applier(amp_C.multi_tensor_l2norm, noop, [tensors], False)
    assert noop.item() == 1
    applier(amp_C.multi_tensor_scale, noop, [ins, outs], 1.0)  # a clean pass never clears it
    assert noop.item() == 1


def test_amp_C_update_scale_hysteresis():
    peak.compat.install_apex_alias()
    try:
        import amp_C
        scale = torch.tensor([1024.0])
        growth, hyst = torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
        inf, clean = torch.ones(1), torch.zeros(1)
        amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 3, 2)
        assert scale.item() == 1024.0  # hysteresis - 1 overflows tolerated
        amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 3, 2)
        assert scale.item() == 512.0
        for _ in range(3):
            amp_C.update_scale_hysteresis(scale, growth, hyst, clean, 2.0, 0.5, 3, 2)
        assert scale.item() == 1024.0 and hyst.item() == 2
        # 200 overflows in a row: Apex's kernel backs off to 0 (its own test expects it; the
        # next clean step's gradients would be 0 * 1/0 = NaN) and its tracker goes negative;
        # peak's scale stops at the smallest normal float and the tracker at 0.
        for _ in range(200):
            amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 3, 2)
        assert scale.item() == torch.finfo(torch.float32).tiny and hyst.item() == 0
        amp_C.update_scale_hysteresis(scale, growth, hyst, clean, 2.0, 0.5, 3, 2)
        assert hyst.item() == 2 and growth.item() == 1
    finally:
        peak.compat.uninstall_apex_alias()


def test_amp_C_optimizer_kernels_match_torch(alias):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    torch.manual_seed(0)
    params = [torch.randn(70000), torch.randn(5, 7)]
    ref = [p.clone().requires_grad_() for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    torch_adam = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    noop = torch.zeros(1, dtype=torch.int32)
    for step in range(1, 6):
        grads = [torch.randn_like(p) for p in params]
        multi_tensor_applier(amp_C.multi_tensor_adam, noop, [grads, params, m, v], 1e-2, 0.9,
                             0.999, 1e-8, step, 1, 1, 0.1)
        for r, g in zip(ref, grads):
            r.grad = g
        torch_adam.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
    # SGD, Apex's 4-list form (fp16 grads, fp32 weights, momenta, fp16 copies), scale 1/8
    w = [torch.randn(300), torch.randn(3)]
    ref = [x.clone().requires_grad_() for x in w]
    mom = [torch.zeros_like(x) for x in w]
    copies = [x.half() for x in w]
    torch_sgd = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(4):
        grads = [torch.randn_like(x) for x in w]
        multi_tensor_applier(amp_C.multi_tensor_sgd, noop.zero_(),
                             [[(g * 8).half() for g in grads], w, mom, copies], 0.01, 0.9, 0.0,
                             0.1, False, step == 0, False, 1.0 / 8)
        for r, g in zip(ref, grads):
            r.grad = g.half().float()
        torch_sgd.step()
    for x, r, c in zip(w, ref, copies):
        torch.testing.assert_close(x, r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(c, x.half())
    # a set noop flag skips multi_tensor_sgd (Apex's early exit)
    before = [x.clone() for x in w]
    multi_tensor_applier(amp_C.multi_tensor_sgd, noop.fill_(1),
                         [[torch.ones(300).half(), torch.ones(3).half()], w, mom, copies], 0.0,
                         0.9, 0.0, 0.1, False, False, False, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(w, before))
    # Adagrad against torch's; fp16 state refused with a message
    p = [torch.randn(50)]
    r = [p[0].clone().requires_grad_()]
    h = [torch.zeros(50)]
    torch_ada = torch.optim.Adagrad(r, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(50)
        multi_tensor_applier(amp_C.multi_tensor_adagrad, noop, [[g], p, h], 0.1, 1e-10, 0, 0.01)
        r[0].grad = g
        torch_ada.step()
    torch.testing.assert_close(p[0], r[0].detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="must be float32 .*peak keeps optimizer state"):
        multi_tensor_applier(amp_C.multi_tensor_adam, noop,
                             [[torch.ones(3).half()], [torch.ones(3).half()],
                              [torch.zeros(3).half()], [torch.zeros(3).half()]],
                             1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)


def test_amp_C_novograd_and_lamb_match_the_optimizers(alias):
    """The kernel entry points step exactly as the optimizers built on the same ops."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    from peak.optimizers import FusedLAMB, FusedNovoGrad

    torch.manual_seed(0)
    base = [torch.randn(300), torch.randn(4, 5)]
    grads_seq = [[torch.randn_like(b) for b in base] for _ in range(4)]
    # NovoGrad: Apex's Python side starts the norms at the first step's norms
    params = [b.clone() for b in base]
    m = [torch.zeros_like(b) for b in base]
    norms = torch.stack([g.norm() for g in grads_seq[0]])
    noop = torch.zeros(1, dtype=torch.int32)
    for step, grads in enumerate(grads_seq, 1):
        multi_tensor_applier(amp_C.multi_tensor_novograd, noop, [grads, params, m], norms, 1e-2,
                             0.95, 0.98, 1e-8, step, 1, 0.001, 1, 1, 2)
    ref = [b.clone().requires_grad_() for b in base]
    opt = FusedNovoGrad(ref, lr=1e-2, betas=(0.95, 0.98), weight_decay=0.001)
    for grads in grads_seq:
        for r, g in zip(ref, grads):
            r.grad = g
        opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(norms, torch.stack([opt.state[r]["exp_avg_sq"] for r in ref]))
    # LAMB, with Apex's global norm argument
    params = [b.clone() for b in base]
    m, v = [torch.zeros_like(b) for b in base], [torch.zeros_like(b) for b in base]
    for step, grads in enumerate(grads_seq, 1):
        gnorm = torch.norm(torch.cat([g.flatten() for g in grads])).reshape(1)
        multi_tensor_applier(amp_C.multi_tensor_lamb, noop, [grads, params, m, v], 1e-2, 0.9,
                             0.999, 1e-6, step, 1, 0.01, 1, 1, gnorm, 1.0, False)
    ref = [b.clone().requires_grad_() for b in base]
    opt = FusedLAMB(ref, lr=1e-2)
    for grads in grads_seq:
        for r, g in zip(ref, grads):
            r.grad = g
        opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


def test_apex_module_paths_and_missing_submodules(alias):
    """Apex scripts import optimizers by their module path too; a submodule Apex has and peak
    does not is an ImportError (what `try: import ... except ImportError` expects)."""
    from apex.multi_tensor_apply import MultiTensorApply as M1
    from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply as M2
    from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
    from apex.optimizers.fused_adam import FusedAdam as A2
    from apex.optimizers.fused_lamb import FusedLAMB as L2
    from apex.optimizers.fused_sgd import FusedSGD as S2
    assert (A2, L2, S2, M2) == (FusedAdam, FusedLAMB, FusedSGD, M1)
    for name in ("apex.fp16_utils.loss_scaler", "apex.amp.no_such_module"):
        with pytest.raises(ImportError, match="does not exist"):
            importlib.import_module(name)
    import amp_C  # an amp_C function Apex has and peak does not: what peak has instead
    assert not hasattr(amp_C, "multi_tensor_lamb_mp")  # (hasattr: an AttributeError)
    with pytest.raises(AttributeError, match=r"amp_C.multi_tensor_lamb_mp is not in peak's Apex "
                       r"alias, which provides multi_tensor_scale, .*docs/migrating.md"):
        amp_C.multi_tensor_lamb_mp


def test_apex_C_flattens_and_unflattens_as_apexs_extension(alias):
    """apex_C.flatten is the tensors' elements in order in one tensor; unflatten gives views
    shaped as the tensors again (Apex's bucketing writes through them)."""
    import apex_C
    from apex.parallel.distributed import flatten, unflatten

    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.arange(4.0).view(2, 2)]
    flat = apex_C.flatten(tensors)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    parts = apex_C.unflatten(flat * 2, tensors)
    assert [p.shape for p in parts] == [t.shape for t in tensors]
    assert all(torch.equal(p, t * 2) for p, t in zip(parts, tensors))
    assert torch.equal(flatten(tensors), flat) and len(unflatten(flat, tensors)) == 3


def test_apex_parallel_distributed_is_reached_from_import_apex_alone(alias):
    """Apex's __init__ imported apex.parallel.distributed: scripts write
    apex.parallel.distributed.flat_dist_call(...) after a bare `import apex`."""
    import peak.compat._apex.parallel as parallel
    vars(parallel).pop("distributed", None)  # (an earlier import statement of it set it)
    sys.modules.pop("apex.parallel.distributed", None)
    import apex
    assert apex.parallel.distributed.flat_dist_call is parallel.flat_dist_call
    from apex.parallel import distributed
    assert distributed is parallel
    with pytest.raises(ModuleNotFoundError, match="amp_C and apex_C"):
        import apex.no_such_module  # noqa: F401


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_amp_c_sgd_with_fp32_master_grads_and_low_copies(alias, low):
    """Apex's FusedSGD under O2 (materialize_master_grads=True) passes [fp32 master grads,
    fp32 masters, momenta, fp16 model copies]: the masters step with the fp32 grads (as SGD with
    momentum would, in float64 here) and the copies are the rounded masters."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in (30, 70000)]
    grads = [torch.randn(m.shape, generator=g) for m in masters]
    copies = [m.to(low) for m in masters]
    momenta = [torch.zeros_like(m) for m in masters]
    ref = [m.double() - 0.1 * gr.double() / 4 for m, gr in zip(masters, grads)]
    multi_tensor_applier(amp_C.multi_tensor_sgd, torch.IntTensor([0]),
                         [grads, masters, momenta, copies], 0.0, 0.9, 0.0, 0.1, False, True,
                         False, 0.25)
    for m, c, r in zip(masters, copies, ref):
        torch.testing.assert_close(m.double(), r, rtol=1e-6, atol=1e-7)
        assert torch.equal(c, m.to(low))


# An Apex install's apex.amp.scaler as far as a pickle sees it: the class and Apex's attributes.
_APEX_SCALER_MODULE = """
class LossScaler:
    def __init__(self, scale, unskipped, window):
        self.dynamic, self._loss_scale, self._unskipped = True, scale, unskipped
        self._scale_seq_len, self._min_loss_scale, self._max_loss_scale = window, None, 2.0 ** 24
        self._has_overflow = False
"""

_FP16_OPTIMIZER_RUN = """
import sys, warnings
import torch
from peak.fp16_utils import FP16_Optimizer
warnings.simplefilter("ignore", DeprecationWarning)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0 ** 10, "scale_window": 3})
    return model, opt


def train(model, opt, steps):
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).half()
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
"""


def test_an_apex_fp16_optimizer_checkpoint_loads_under_the_alias(tmp_path, alias):
    """Apex's FP16_Optimizer.state_dict() pickles its apex.amp.scaler.LossScaler object: under the
    alias torch.load finds that name (it raised ModuleNotFoundError) and the resumed run is the
    uninterrupted one, bit for bit, the scale's window included (it restarted: the scale grew a
    step late)."""
    fake = tmp_path / "apex_site"
    (fake / "apex" / "amp").mkdir(parents=True)
    (fake / "apex" / "__init__.py").write_text("")
    (fake / "apex" / "amp" / "__init__.py").write_text("")
    (fake / "apex" / "amp" / "scaler.py").write_text(_APEX_SCALER_MODULE)
    writer = _write(tmp_path, "writer", _FP16_OPTIMIZER_RUN + textwrap.dedent("""
        from apex.amp.scaler import LossScaler
        model, opt = build()
        train(model, opt, range(4))
        sd = opt.state_dict()  # as Apex's: its LossScaler object, no peak-only entries
        assert sd["loss_scaler"]["growth_tracker"] == 1, sd["loss_scaler"]
        sd = dict(sd, loss_scaler=LossScaler(opt.loss_scale, 1, 3))
        del sd["groups_in_place"]
        torch.save({"model": model.state_dict(), "optimizer": sd}, sys.argv[1])
        train(model, opt, range(4, 9))
        torch.save({"model": model.state_dict(), "scale": opt.loss_scale}, sys.argv[2])
        """))
    ckpt, final = tmp_path / "apex_ckpt.pt", tmp_path / "final.pt"
    out = _run([str(writer), str(ckpt), str(final)], env=dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))))
    assert out.returncode == 0, out.stderr
    namespace = {}
    exec(_FP16_OPTIMIZER_RUN, namespace)
    checkpoint = torch.load(ckpt, weights_only=False)
    from apex.amp.scaler import LossScaler
    assert isinstance(checkpoint["optimizer"]["loss_scaler"], LossScaler)
    model, opt = namespace["build"]()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    namespace["train"](model, opt, range(4, 9))
    expected = torch.load(final)
    assert opt.loss_scale == expected["scale"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected["model"][key]), key


def test_apex_fused_adam_step_refuses_its_old_arguments_and_works_with_grad_scaler(alias):
    """Apex's FusedAdam.step(closure, grads, output_params, scale, grad_norms, grad_scaler):
    the old arguments are refused as Apex refuses them, grad_scaler with what works instead;
    scaler.step(optimizer) still hands the scale over (no FutureWarning) and steps as torch's
    AdamW on the unscaled gradient."""
    from apex.optimizers import FusedAdam

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = FusedAdam([w], lr=0.1)
    for kwargs in ({"scale": 2.0}, {"grads": [torch.ones(3)]}, {"grad_norms": [1.0]}):
        with pytest.raises(RuntimeError, match="Apex's pre-2019 interface"):
            opt.step(**kwargs)
    with pytest.raises(TypeError, match=r"call scaler.step\(optimizer\)"):
        opt.step(grad_scaler=torch.amp.GradScaler("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale((w * w).sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(opt)
    (ref * ref).sum().backward()
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
