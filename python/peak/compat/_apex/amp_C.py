"""``amp_C`` under peak's Apex alias: Apex's kernel entry points, with Apex's argument order
``(chunk_size, noop_flag, tensor_lists, *scalars)``, on peak's ops (CPU and CUDA).

``noop_flag`` is Apex's int32 one-element overflow buffer: ops that check for inf/NaN set it to
1 (never clear it), on the device. As Apex's kernels, the unscale ops (scale, axpby) always write
their outputs, multi_tensor_sgd skips the step when the flag is set and the other optimizer ops
step regardless. Optimizer state lists must be float32 (peak keeps optimizer state in fp32).
"""
from __future__ import annotations

import torch

from peak import ops as _ops
from peak.ops import device_scalar as _scalar
from peak.optimizers.masters import copy_to_model

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm",
           "multi_tensor_unscale_l2norm", "update_scale_hysteresis", "multi_tensor_sgd",
           "multi_tensor_adam", "multi_tensor_adagrad", "multi_tensor_novograd",
           "multi_tensor_lamb"]

# Apex's arg_to_check -> peak's check (any other value: "none")
_AXPBY_CHECK = {-1: "both", 0: "x", 1: "y"}


def _lists(name, tensor_lists, depths):
    is_list = isinstance(tensor_lists, (list, tuple))
    if not is_list or len(tensor_lists) not in depths:
        got = len(tensor_lists) if is_list else type(tensor_lists).__name__
        raise RuntimeError(f"{name}: tensor_lists must be a list of {' or '.join(map(str, depths))}"
                           f" lists of tensors (Apex's layout), got {got}")
    return [list(t) for t in tensor_lists]


def _raise_noop(noop_flag, found_inf):
    """noop_flag |= found_inf, on the device (Apex's kernels only ever set the buffer)."""
    torch.maximum(noop_flag, (found_inf != 0).to(noop_flag.dtype).reshape(noop_flag.shape),
                  out=noop_flag)


def _steps(params, step):
    # peak's ops count steps per tensor and bump them before the update: start one below.
    return [torch.full((), float(step) - 1.0, dtype=torch.float32, device=p.device)
            for p in params]


def _check_fp32_state(name, label, tensors):
    for t in tensors:
        if t.dtype != torch.float32:
            raise RuntimeError(
                f"{name}: {label} must be float32 (peak keeps optimizer state in fp32), got "
                f"{t.dtype}. Keep the state in fp32, or use peak.optimizers / apex.optimizers "
                "under the alias, which do")


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = in * scale``; sets noop_flag if an input holds inf/NaN."""
    ins, outs = _lists("multi_tensor_scale", tensor_lists, (2,))
    if not ins:
        return
    found = _ops.new_found_inf(noop_flag.device)
    _ops.multi_tensor_scale_(ins, outs, _scalar(scale, found.device), found, chunk_size=chunk_size)
    _raise_noop(noop_flag, found)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a * x + b * y``; ``arg_to_check`` -1: x and y, 0: x, 1: y, else none."""
    xs, ys, outs = _lists("multi_tensor_axpby", tensor_lists, (3,))
    if not xs:
        return
    found = _ops.new_found_inf(noop_flag.device)
    _ops.multi_tensor_axpby_(xs, ys, outs, _scalar(a, found.device), _scalar(b, found.device),
                            found, check=_AXPBY_CHECK.get(int(arg_to_check), "none"),
                            chunk_size=chunk_size)
    _raise_noop(noop_flag, found)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``(norm [1], per-tensor norms [n] or empty)``, fp32; sets noop_flag if not finite."""
    (tensors,) = _lists("multi_tensor_l2norm", tensor_lists, (1,))
    if not tensors:  # the op's own error (peak.ops.multi_tensor_l2norm returns 0 instead)
        raise RuntimeError("multi_tensor_l2norm: tensors is empty; the norm of no tensors is 0, "
                           "call it only with at least one tensor")
    norm, per = _ops.multi_tensor_l2norm(tensors, per_tensor=bool(per_tensor),
                                        chunk_size=chunk_size)
    _raise_noop(noop_flag, ~torch.isfinite(norm))
    return norm, per


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """The norms of ``x * inv_scale`` (x unchanged): a norm scales with its tensor."""
    norm, per = multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)
    inv = _scalar(inv_scale, norm.device)
    return norm * inv, (per * inv if per.numel() else per)


def update_scale_hysteresis(scale, growth_tracker, hysteresis_tracker, found_inf,
                            growth_factor, backoff_factor, growth_interval, hysteresis):
    """Apex's Megatron-style scale update with hysteresis, on the device."""
    _ops.update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                      growth_interval, hysteresis=hysteresis, hysteresis_tracker=hysteresis_tracker)


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening,
                     lr, nesterov, first_run, wd_after_momentum, scale):
    """Lists ``[grads, weights, momenta]`` or ``[grads, fp32 weights, momenta, fp16 copies]``;
    the gradients are multiplied by ``scale``; skipped when noop_flag is set."""
    lists = _lists("multi_tensor_sgd", tensor_lists, (3, 4))
    if wd_after_momentum:
        raise NotImplementedError("multi_tensor_sgd(wd_after_momentum=True) is not provided by "
                                  "peak (torch.optim.SGD's order: weight decay before momentum)")
    grads, weights, momenta = lists[:3]
    if not grads:
        return
    params, masters = (lists[3], weights) if len(lists) == 4 else (weights, [])
    # Apex's FusedSGD under O2 with materialize_master_grads=True passes fp32 master gradients
    # next to the fp16 copies: step the fp32 weights with them, then round into the copies.
    copies = None
    if masters and grads[0].dtype != params[0].dtype:
        copies, params, masters = params, weights, []
    if momentum != 0:
        _check_fp32_state("multi_tensor_sgd", "momentum buffers", momenta)
    device = weights[0].device
    flag = noop_flag.to(torch.float32).reshape(1)
    _ops.fused_sgd_(
        params, grads, masters, momenta if momentum != 0 else [],
        _steps(params, 1 if first_run else 2), lr=_scalar(lr, device), momentum=float(momentum),
        dampening=float(dampening), weight_decay=float(weight_decay), nesterov=bool(nesterov),
        maximize=False, grad_scale=_scalar(1.0 / float(scale), device), found_inf=flag,
        chunk_size=chunk_size)
    if copies is not None:  # (a skipped step left the weights, so this rewrites the same bits)
        copy_to_model(weights, copies)


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                      mode, bias_correction, weight_decay):
    """Lists ``[grads, params, exp_avgs, exp_avg_sqs]``; mode 0: L2 decay, 1: AdamW."""
    grads, params, m, v = _lists("multi_tensor_adam", tensor_lists, (4,))
    if not grads:
        return
    _check_fp32_state("multi_tensor_adam", "exp_avg and exp_avg_sq", m + v)
    _ops.fused_adam_(params, grads, [], m, v, [], _steps(params, step),
                     lr=_scalar(lr, params[0].device), beta1=float(beta1), beta2=float(beta2),
                     eps=float(epsilon), weight_decay=float(weight_decay), amsgrad=False,
                     adam_w_mode=bool(mode), maximize=False,
                     bias_correction=bool(bias_correction), chunk_size=chunk_size)


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay):
    """Lists ``[grads, params, sums]``; mode 0: L2 decay, 1: decoupled."""
    grads, params, sums = _lists("multi_tensor_adagrad", tensor_lists, (3,))
    if not grads:
        return
    _check_fp32_state("multi_tensor_adagrad", "state sums", sums)
    _ops.fused_adagrad_(params, grads, [], sums, _steps(params, 1),
                        lr=_scalar(lr, params[0].device), eps=float(epsilon),
                        weight_decay=float(weight_decay), adagrad_w_mode=bool(mode),
                        chunk_size=chunk_size)


def multi_tensor_novograd(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2,
                          epsilon, step, bias_correction, weight_decay, grad_averaging,
                          moment_mode, norm_type):
    """Lists ``[grads, params, exp_avgs]``; ``grad_norms`` (fp32, one per tensor) is blended with
    this step's norms in place, as in Apex (moment_mode 0: regularisation inside the moment)."""
    grads, params, m = _lists("multi_tensor_novograd", tensor_lists, (3,))
    if not grads:
        return
    _check_fp32_state("multi_tensor_novograd", "exp_avgs and grad_norms", m + [grad_norms])
    if grad_norms.numel() != len(params) or not grad_norms.is_contiguous():
        raise RuntimeError(f"multi_tensor_novograd: grad_norms must be a contiguous float32 tensor"
                           f" with one norm per tensor ({len(params)}), got {grad_norms.numel()} "
                           "elements")
    _ops.fused_novograd_(
        params, grads, [], m, list(grad_norms.reshape(-1).unbind(0)), _steps(params, step),
        lr=_scalar(lr, params[0].device), beta1=float(beta1), beta2=float(beta2),
        eps=float(epsilon), weight_decay=float(weight_decay), grad_averaging=bool(grad_averaging),
        reg_inside_moment=int(moment_mode) == 0, bias_correction=bool(bias_correction),
        norm_type=int(norm_type), init_zero=True, chunk_size=chunk_size)


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                      bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                      max_grad_norm, use_nvlamb=False):
    """Lists ``[grads, params, exp_avgs, exp_avg_sqs]``; ``global_grad_norm`` is the norm of
    all gradients (for clipping to ``max_grad_norm``); mode 1: decoupled weight decay."""
    grads, params, m, v = _lists("multi_tensor_lamb", tensor_lists, (4,))
    if not grads:
        return
    _check_fp32_state("multi_tensor_lamb", "exp_avg and exp_avg_sq", m + v)
    device = params[0].device
    _ops.fused_lamb_(
        params, grads, [], m, v, _steps(params, step), lr=_scalar(lr, device), beta1=float(beta1),
        beta2=float(beta2), eps=float(epsilon), weight_decay=float(weight_decay),
        adam_w_mode=bool(mode), grad_averaging=bool(grad_averaging),
        bias_correction=bool(bias_correction), max_grad_norm=float(max_grad_norm),
        use_nvlamb=bool(use_nvlamb), grad_norm=_scalar(global_grad_norm, device),
        chunk_size=chunk_size)


def __getattr__(name: str):
    raise AttributeError(f"amp_C.{name} is not in peak's Apex alias, which provides "
                         f"{', '.join(__all__)}; for the rest use peak.optimizers' fused "
                         "optimizers or peak.ops (docs/migrating.md)", name=name)
