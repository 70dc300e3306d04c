"""PyTorch binding: input checks, the forward and backward around their plans, autograd.

The compiled kernels take torch tensors directly (tvm-ffi reads them through DLPack): no host
copies, no ``.numpy()``. CUDA kernels run on PyTorch's current stream (see
:mod:`tvm_flash.plan`).

Two doors to the same forward and backward (:func:`forward`): in eager mode a
``torch.autograd.Function`` (:class:`_Attention`; with no gradient to record, the forward
itself), which skips the custom-op wrappers that issue #20's profile found most of a small
call's host time in; under ``torch.compile`` (and for fake or subclass tensors, or with a
dispatch mode active) the custom ops ``tvm_flash::fwd`` / ``tvm_flash::bwd``, which the
compiler sees as opaque nodes with fake implementations and an autograd formula.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import plan
from .key import HEAD_DIMS
from .layout import kernel_view, output_like

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
CAUSAL_ALIGNMENTS = ("top-left", "bottom-right")
HEAD_DIM_MAX = HEAD_DIMS[-1]


def native_head_dim(d: int) -> int:
    """The head dim the kernels run for ``d`` (1 to ``HEAD_DIM_MAX``): ``d`` where it is one
    of ``HEAD_DIMS``, else the next one, q, k and v zero-padded to it (:func:`pad_head_dim`).
    Zeros add nothing to Q K^T, give zero columns of the output, and the gradients of the
    padding are dropped; the softmax scale stays the caller's (default ``1 / sqrt(d)``).
    Padding costs a copy of q, k, v (and of the output back): one more kernel per head dim
    would cost a compiled artifact per key instead."""
    return next(n for n in HEAD_DIMS if n >= d)


def pad_head_dim(fn, q, k, v, *args):
    """``fn(q, k, v, *args)`` -> ``(out, *rest)`` at a head dim without kernels: q, k and v
    zero-padded to :func:`native_head_dim` (differentiably: autograd drops the padding's
    gradients), ``out`` cut back to q's head dim in the layout ``out`` would have had
    (:func:`tvm_flash.layout.output_like`)."""
    d = q.shape[-1]
    pad = (0, native_head_dim(d) - d)
    out, *rest = fn(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), *args)
    return (output_like(q).copy_(out[..., :d]), *rest)


def flash_forward(q, k, v, sinks, causal: str, scale: float):
    """Run the forward kernels: returns ``(out, lse)``. Inputs must already be validated and
    in the kernels' layout (:func:`tvm_flash.layout.kernel_view`); ``sinks`` is None or a
    float32 ``(Hq,)`` tensor."""
    b, hq, lq, d = q.shape
    out = output_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[2] == 0:  # no keys at all: every row is empty (but for its sink)
        lse.fill_(-math.inf) if sinks is None else lse.copy_(sinks[None, :, None].expand_as(lse))
        return out.zero_(), lse
    run = plan.get(q.device, q.dtype, d, causal, hq // k.shape[1], sinks is not None, lq, False)
    run.forward(q, k, v, sinks if sinks is not None else _no_sinks(q.device, hq), out, lse,
                scale)
    return out, lse


@functools.cache
def _no_sinks(device, hq: int):
    """The sinks argument of a forward built without sinks: the kernel never reads this
    ``(Hq,)`` buffer (it only fixes the calling convention), so one per device and head
    count serves every call."""
    return torch.empty(hq, dtype=torch.float32, device=device)


def sink_gradient(sinks, lse, delta):
    """d loss / d sink_h = -sum over batch and rows of P_sink * Delta, P_sink = exp(s_h - LSE).

    The sink is a key with no value: its dP is 0, so its dS is P_sink * (0 - Delta).
    Rows with LSE = -inf (no key, sink -inf) have P_sink = 0.
    """
    p_sink = torch.exp(sinks[None, :, None] - lse)
    p_sink = torch.where(torch.isfinite(lse), p_sink, 0.0)
    return -(p_sink * delta).sum(dim=(0, 2))


def flash_backward(do, q, k, v, out, lse, sinks, causal: str, scale: float):
    """Run preprocess, dQ and dK/dV: returns ``(dq, dk, dv, dsinks)``; dsinks is zeros of
    shape (Hq,) without sinks. Tensors in the kernels' layout, ``lse`` contiguous."""
    b, hq, lq, d = q.shape
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), lse.new_zeros(hq)
    run = plan.get(q.device, q.dtype, d, causal, hq // k.shape[1], False, lq, True)
    delta = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    run.backward(do, q, k, v, out, lse, delta, dq, dk, dv, scale)
    dsinks = sink_gradient(sinks, lse, delta) if sinks is not None else lse.new_zeros(hq)
    return dq, dk, dv, dsinks


def _eager(q, k, v) -> bool:
    """Whether a call may skip the custom ops: not traced by torch.compile / export, plain
    tensors (not fake or subclass ones), no dispatch mode that expects to see the op."""
    return (not torch.compiler.is_compiling() and type(q) is torch.Tensor
            and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch._C._len_torch_dispatch_stack())


# ----------------------------------------------------------------------- torch custom ops
# Opaque to torch.compile (no graph break), with fake impls for tracing and an autograd
# formula that calls the backward op.


@torch.library.custom_op("tvm_flash::fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
            causal: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(kernel_view(q), kernel_view(k), kernel_view(v), sinks, causal, scale)


# Fakes allocate like the real ops (layout.output_like), so their strides agree.
@_fwd_op.register_fake
def _(q, k, v, sinks, causal, scale):
    return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tvm_flash::bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, causal: str,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(kernel_view(do), kernel_view(q), kernel_view(k), kernel_view(v),
                          kernel_view(out), lse.contiguous(), sinks, causal, scale)


@_bwd_op.register_fake
def _(do, q, k, v, out, lse, sinks, causal, scale):
    return output_like(q), output_like(k), output_like(v), lse.new_empty(q.shape[1])


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _bwd_op(dout, q, k, v, out, lse, sinks, ctx.causal, ctx.scale)
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The eager door: the custom op's forward and autograd formula without its wrappers.
    Saves the kernel views of q, k, v (the same tensors unless a copy was needed), so the
    backward takes them as they are."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, scale):
        q, k, v = kernel_view(q), kernel_view(k), kernel_view(v)
        out, lse = flash_forward(q, k, v, sinks, causal, scale)
        _setup_context(ctx, (q, k, v, sinks, causal, scale), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if not _eager(dout, q, k):  # traced (compiled autograd): the tracer sees the op
            return _backward(ctx, dout, _dlse)
        dq, dk, dv, dsinks = flash_backward(kernel_view(dout), q, k, v, out, lse, sinks,
                                            ctx.causal, ctx.scale)
        return dq, dk, dv, (dsinks if sinks is not None else None), None, None


def forward(q, k, v, sinks, causal: str, scale: float):
    """``(out, lse)`` of validated inputs in ``(B, H, L, D)``, recording the backward where
    autograd needs it; the custom op ``tvm_flash::fwd`` where a tracer must see it. A head dim
    without kernels is padded to the next (:func:`native_head_dim`)."""
    if q.shape[-1] not in HEAD_DIMS:
        return pad_head_dim(forward, q, k, v, sinks, causal, scale)
    if not _eager(q, k, v):
        return _fwd_op(q, k, v, sinks, causal, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            sinks is not None and sinks.requires_grad)):
        return _Attention.apply(q, k, v, sinks, causal, scale)
    return flash_forward(kernel_view(q), kernel_view(k), kernel_view(v), sinks, causal, scale)


BHLD = "(B, H, L, D)"
"""torch SDPA's layout of q, k, v (:func:`attention`)."""
BLHD = "(B, L, H, D)"
"""flash-attn's layout (:mod:`tvm_flash.flash_attn`)."""
_NAMES = {"q": "q", "k": "k", "v": "v", "scale": "scale"}


def check_inputs(q, k, v, *, causal: str, scale, enable_gqa: bool, sinks=None,
                 layout: str = BHLD, names: dict | None = None) -> float:
    """Validate the public arguments; return the softmax scale to use.

    Every error names the argument and what is supported. ``layout``: the order of q, k and
    v's dimensions, ``BHLD`` or ``BLHD`` (shapes are reported as given). ``names``: what the
    caller calls ``q``, ``k``, ``v`` and ``scale`` where that differs (flash-attn's
    ``softmax_scale``, a slice of a packed tensor).
    """
    n = _NAMES if names is None else {**_NAMES, **names}
    for name, t in ((n["q"], q), (n["k"], k), (n["v"], v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions {layout}, got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of "
                            f"{[str(d) for d in _TORCH_DTYPES]}")
    for name, t in ((n["k"], k), (n["v"], v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {n['q']}'s {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} differs from {n['q']}'s {q.device}")
    if q.device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{n['q']}: device {q.device} is not supported; use a cpu, cuda or "
                         "mps tensor")
    heads = 1 if layout == BHLD else 2
    b, hq, d = q.shape[0], q.shape[heads], q.shape[3]
    if k.shape != v.shape:
        raise ValueError(f"{n['v']}: shape {tuple(v.shape)} differs from {n['k']}'s "
                         f"{tuple(k.shape)} (same batch, heads, key length and head_dim "
                         "required)")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{n['k']}: shape {tuple(k.shape)} does not match {n['q']}'s batch "
                         f"{b} and head_dim {d}")
    if not 1 <= d <= HEAD_DIM_MAX:
        raise ValueError(f"{n['q']}: head_dim {d} is not supported; use 1 to {HEAD_DIM_MAX} "
                         f"(native: {HEAD_DIMS}; others run zero-padded to the next)")
    hkv = k.shape[heads]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{n['k']}: {hkv} key/value heads do not divide {n['q']}'s {hq} "
                         "query heads")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"{n['k']}: {hkv} key/value heads differ from {n['q']}'s {hq} heads; "
                         "pass enable_gqa=True for grouped-query attention")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks: expected a torch.Tensor of shape ({hq},), got "
                            f"{type(sinks).__name__}")
        if sinks.shape != (hq,):
            raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got "
                             f"{tuple(sinks.shape)}")
        if sinks.dtype not in _TORCH_DTYPES:
            raise TypeError(f"sinks: dtype {sinks.dtype} is not supported; use one of "
                            f"{[str(d) for d in _TORCH_DTYPES]}")
        if sinks.device != q.device:
            raise ValueError(f"sinks: device {sinks.device} differs from {n['q']}'s "
                             f"{q.device}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{n['scale']}: must be a finite positive number, got {scale}")
    return scale


def attention(q, k, v, *, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, causal_alignment: str = "top-left",
              sinks: torch.Tensor | None = None, return_lse: bool = False):
    """Flash attention, forward and backward, with torch SDPA's semantics.

    Args:
        q: queries ``(B, Hq, Lq, D)``.
        k: keys ``(B, Hkv, Lk, D)``; ``Hkv`` divides ``Hq`` (GQA/MQA need ``enable_gqa``).
        v: values ``(B, Hkv, Lk, D)``.
        is_causal: mask keys after the query's position.
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hkv < Hq``; query head ``h`` uses key/value head ``h // (Hq/Hkv)``.
        causal_alignment: ``"top-left"`` (torch ``is_causal``: key j visible to query i iff
            ``j <= i``) or ``"bottom-right"`` (flash-attn >= 2.1: iff ``j <= i + Lk - Lq``).
            The two differ only when ``Lq != Lk``.
        sinks: optional learnable sink logits ``(Hq,)``: each row's softmax denominator gains
            ``exp(sinks[h])`` (a virtual key with no value). Differentiable: the gradient is
            ``-sum_rows P_sink * Delta``. Any float dtype; computed in float32.
        return_lse: also return the row logsumexp (including the sink, if any).

    Returns:
        ``out`` ``(B, Hq, Lq, D)`` in the input dtype; with ``return_lse`` also ``lse``
        ``(B, Hq, Lq)`` float32, natural-log units, ``-inf`` for a row that sees no key (its
        output and gradients are zero).

    q, k, v are float16, bfloat16 or float32 on one CPU or CUDA device; D is 1 to 256: the
    kernels' own are ``tvm_flash.HEAD_DIMS``, any other runs zero-padded to the next (a copy
    of q, k, v and of the output; :func:`native_head_dim`). Accumulation is float32. q, k, v
    (and the gradient of out) are read where they lie when their last dimension is contiguous
    and every row starts 16-byte aligned — in particular ``(B, L, H, D)`` storage viewed as
    ``(B, H, L, D)``; other layouts are copied first (``tvm_flash.layout``). ``out`` and the
    gradients come back in torch SDPA's layout: ``out`` like q, each gradient like its input.
    The backward is deterministic (no atomics).
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment: {causal_alignment!r} is not one of "
                         f"{CAUSAL_ALIGNMENTS}")
    causal = causal_alignment if is_causal else "none"
    scale = check_inputs(q, k, v, causal=causal, scale=scale, enable_gqa=enable_gqa,
                         sinks=sinks)
    if sinks is not None:
        sinks = sinks.float().contiguous()  # differentiable cast: dsinks flows back
    out, lse = forward(q, k, v, sinks, causal, scale)
    return (out, lse) if return_lse else out

