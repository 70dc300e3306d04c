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

import dataclasses
import functools
import math
import weakref

import torch
import torch.nn.functional as F

from . import plan
from .key import HEAD_DIMS, MODS
from .layout import kernel_view, output_like

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """A call's score modifiers (``tvm_flash.key.MODS``), validated (:func:`check_mods`):
    ``window`` ``(left, right)`` with -1 unbounded, ``softcap`` (0: none), ``alibi``: slopes
    ``(Hq,)`` or ``(B, Hq)`` float32, or None."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: torch.Tensor | None = None

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The modifiers in effect, in ``MODS`` order: what the kernels are built with."""
        on = {"window": self.window != (-1, -1), "softcap": self.softcap != 0.0,
              "alibi": self.alibi is not None}
        return tuple(m for m in MODS if on[m])

    def kernel_args(self, b: int, hq: int, lq: int, lk: int, device) -> tuple:
        """The kernels' ``MOD_ARGS`` (``tvm_flash.opspec``): slopes ``(B, Hq)`` float32 (a
        placeholder the kernel never reads without ALiBi), the window's extents with
        "unbounded" as ``Lq + Lk`` (no query is that far from any key), the cap (1.0 where
        unused)."""
        if self.alibi is None:
            slopes = torch.empty((b, hq), dtype=torch.float32, device=device)
        else:
            slopes = self.alibi.expand(b, hq).contiguous()
        far = lq + lk
        left, right = (far if w < 0 else min(w, far) for w in self.window)
        return slopes, left, right, self.softcap or 1.0


NO_MODS = ScoreMods()


def fold_causal(causal: str, mods: ScoreMods, lq: int, lk: int,
                packed: Packed | None = None) -> tuple[str, ScoreMods]:
    """``(causal, mods)`` that a call runs its kernels by: the window folded into the mask as
    :func:`tvm_flash.plan.fold_window` decides."""
    run_causal, window = plan.fold_window(causal, mods.window, lq, lk, packed is not None)
    return run_causal, (mods if window == mods.window else
                        dataclasses.replace(mods, window=window))


@dataclasses.dataclass(frozen=True)
class Packed:
    """Packed sequences (varlen), validated (:func:`check_packed`): sequence ``s`` owns rows
    ``[cu_q[s], cu_q[s + 1])`` of the queries and ``[cu_k[s], cu_k[s + 1])`` of the keys
    (int32 ``(NS + 1,)`` on the inputs' device); ``max_q``/``max_k`` bound every length."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def count(self) -> int:
        return self.cu_q.shape[0] - 1

    def kernel_args(self) -> tuple:
        """The kernels' ``VARLEN_ARGS`` (``tvm_flash.opspec``)."""
        return self.cu_q, self.cu_k, self.max_q, self.max_k
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


def _extra(mods: ScoreMods, packed: Packed | None, b, hq, lq, lk, device) -> tuple:
    """The tiled kernels' trailing arguments (``tvm_flash.plan.Plan.forward``)."""
    if packed is not None:  # slopes per sequence; windows bounded by the longest ones
        b, lq, lk = packed.count, packed.max_q, packed.max_k
    extra = mods.kernel_args(b, hq, lq, lk, device) if mods.names else ()
    return extra + packed.kernel_args() if packed is not None else extra


def flash_forward(q, k, v, sinks, causal: str, scale: float, mods: ScoreMods = NO_MODS,
                  packed: Packed | None = None):
    """Run the forward kernels: returns ``(out, lse)``. Inputs must already be validated and
    in the kernels' layout (:func:`tvm_flash.layout.kernel_view`); ``sinks`` is None or a
    float32 ``(Hq,)`` tensor; ``packed``: q, k, v are ``(1, H, rows, D)`` views of packed
    sequences."""
    b, hq, lq, d = q.shape
    out = output_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[2] == 0:  # no keys at all: every row is empty (but for its sink)
        lse.fill_(-math.inf) if sinks is None else lse.copy_(sinks[None, :, None].expand_as(lse))
        return out.zero_(), lse
    causal, mods = fold_causal(causal, mods, lq, k.shape[2], packed)
    run = plan.get(q.device, q.dtype, d, causal, hq // k.shape[1], sinks is not None,
                   packed.max_q if packed else lq, False, mods.names, packed is not None,
                   packed.max_k if packed else k.shape[2])
    run.forward(q, k, v, sinks if sinks is not None else _no_sinks(q.device, hq), out, lse,
                scale, _extra(mods, packed, b, hq, lq, k.shape[2], q.device))
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


def flash_backward(do, q, k, v, out, lse, sinks, causal: str, scale: float,
                   mods: ScoreMods = NO_MODS, packed: Packed | None = None):
    """Run preprocess, dQ and dK/dV: returns ``(dq, dk, dv, dsinks)``; dsinks is None without
    sinks. Tensors in the kernels' layout, ``lse`` contiguous."""
    b, hq, lq, d = q.shape
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None if sinks is None else lse.new_zeros(hq)
    causal, mods = fold_causal(causal, mods, lq, k.shape[2], packed)
    run = plan.get(q.device, q.dtype, d, causal, hq // k.shape[1], False,
                   packed.max_q if packed else lq, True, mods.names, packed is not None,
                   packed.max_k if packed else k.shape[2])
    delta = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    run.backward(do, q, k, v, out, lse, delta, dq, dk, dv, scale,
                 _extra(mods, packed, b, hq, lq, k.shape[2], q.device))
    return dq, dk, dv, None if sinks is None else sink_gradient(sinks, lse, delta)


def _eager(q, k, v) -> bool:
    """Whether a call may skip the custom ops: not traced by torch.compile / export, plain
    tensors (not fake or subclass ones), no dispatch mode that expects to see the op."""
    return (not torch.compiler.is_compiling() and type(q) is torch.Tensor
            and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch._C._len_torch_dispatch_stack())


# ----------------------------------------------------------------------- torch custom ops
# Opaque to torch.compile (no graph break), with fake impls for tracing and an autograd
# formula that calls the backward op. Defined on a ``torch.library.Library`` with a schema
# written out, not with ``torch.library.custom_op``: its Python wrappers around every call
# (argument binding, the backend dispatch wrapper) cost ~20 us a call on top of a body of
# ~10 (CPU, kernels stubbed; docs/journal/2026-12-02-host-path.md), and under torch.compile
# every attention call of a training step pays them.


# The score modifiers and packed sequences cross the ops as plain values (an op's schema takes
# ints, floats and tensors, not a ScoreMods or a Packed): window_left, window_right, softcap,
# alibi, then cu_q, cu_k, max_q, max_k (no cu_q: dense).
_OPTIONS_SCHEMA = ("SymInt window_left=-1, SymInt window_right=-1, float softcap=0., "
                   "Tensor? alibi=None, Tensor? cu_q=None, Tensor? cu_k=None, SymInt max_q=0, "
                   "SymInt max_k=0")
_OPTIONS = 8
"""The ops' trailing values (see ``_options``), none of them differentiable."""


def _options(window_left, window_right, softcap, alibi, cu_q, cu_k, max_q, max_k):
    """The ops' trailing values -> (ScoreMods, Packed or None)."""
    packed = Packed(cu_q, cu_k, max_q, max_k) if cu_q is not None else None
    if alibi is None and softcap == 0.0 and window_left == window_right == -1:
        return NO_MODS, packed  # the defaults: one object, its names computed once
    return ScoreMods((window_left, window_right), softcap, alibi), packed


def _values(mods: ScoreMods, packed: Packed | None) -> tuple:
    """(ScoreMods, Packed or None) -> the ops' trailing values."""
    seqs = (None, None, 0, 0) if packed is None else packed.kernel_args()
    return (*mods.window, mods.softcap, mods.alibi, *seqs)


_LIB = torch.library.Library("tvm_flash", "DEF")
_LIB.define("fwd(Tensor q, Tensor k, Tensor v, Tensor? sinks, str causal, float scale, "
            f"{_OPTIONS_SCHEMA}) -> (Tensor, Tensor)")
_LIB.define("bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks, "
            f"str causal, float scale, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")
_DEVICE_KEYS = ("CPU", "CUDA", "MPS")
"""The dispatch keys the ops' implementations serve: the devices ``check_inputs`` accepts."""


def _fwd_impl(q, k, v, sinks, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
              alibi=None, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """``tvm_flash::fwd``: ``(out, lse)`` (:func:`flash_forward` on the kernel views). The
    dispatcher hands a Python kernel the arguments as the caller gave them: the schema's
    defaults are repeated here."""
    return flash_forward(kernel_view(q), kernel_view(k), kernel_view(v), sinks, causal, scale,
                         *_options(window_left, window_right, softcap, alibi, cu_q, cu_k,
                                   max_q, max_k))


def _fwd_fake(q, k, v, sinks, causal, scale, *options):
    # fakes allocate like the real ops (layout.output_like), so their strides agree
    return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_impl(do, q, k, v, out, lse, sinks, causal, scale, window_left=-1, window_right=-1,
              softcap=0.0, alibi=None, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """``tvm_flash::bwd``: ``(dq, dk, dv, dsinks)``; an op returns tensors, so without sinks
    ``dsinks`` is an empty ``(0,)`` tensor (no fill launched for a gradient nobody reads)."""
    dq, dk, dv, dsinks = flash_backward(
        kernel_view(do), kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(out),
        lse.contiguous(), sinks, causal, scale,
        *_options(window_left, window_right, softcap, alibi, cu_q, cu_k, max_q, max_k))
    return dq, dk, dv, dsinks if dsinks is not None else lse.new_empty(0)


def _bwd_fake(do, q, k, v, out, lse, sinks, causal, scale, *options):
    return (output_like(q), output_like(k), output_like(v),
            lse.new_empty(q.shape[1] if sinks is not None else 0))


for _key in _DEVICE_KEYS:
    _LIB.impl("fwd", _fwd_impl, _key)
    _LIB.impl("bwd", _bwd_impl, _key)
torch.library.register_fake("tvm_flash::fwd", _fwd_fake, lib=_LIB)
torch.library.register_fake("tvm_flash::bwd", _bwd_fake, lib=_LIB)
_fwd_op = torch.ops.tvm_flash.fwd.default
_bwd_op = torch.ops.tvm_flash.bwd.default


def _save(ctx, q, k, v, out, lse, sinks, causal, scale, mods: ScoreMods,
          packed: Packed | None, transposed: bool = False):
    """Keep on ``ctx`` what the backward needs (:func:`_saved` gives it back): the tensors
    through ``save_for_backward`` (autograd then refuses a backward after one was modified in
    place), the static facts as one attribute (each attribute set on ``ctx`` costs a
    dictionary write, ~0.25 us on a 2-core host)."""
    ctx.save_for_backward(q, k, v, out, lse, sinks, mods.alibi,
                          *((packed.cu_q, packed.cu_k) if packed else (None, None)))
    ctx.facts = (causal, scale, mods.window, mods.softcap,
                 (packed.max_q, packed.max_k) if packed else (0, 0), transposed)
    ctx.mark_non_differentiable(lse)
    # lse has no gradient: without this autograd would fill a zero tensor for it every
    # backward (a launch a call), which the backward never reads
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, causal, scale, *options = inputs
    _save(ctx, q, k, v, *output, sinks, causal, scale, *_options(*options))


def _saved(ctx):
    """What :func:`_save` kept: ``(q, k, v, out, lse, sinks)``, ``(ScoreMods, Packed or
    None)`` and ``(causal, scale, transposed)``."""
    q, k, v, out, lse, sinks, alibi, cu_q, cu_k = ctx.saved_tensors
    causal, scale, window, softcap, max_seqlens, transposed = ctx.facts
    return ((q, k, v, out, lse, sinks), _options(*window, softcap, alibi, cu_q, cu_k,
                                                 *max_seqlens), (causal, scale, transposed))


def _grads(dq, dk, dv, dsinks, sinks):
    """The gradients of the forward's inputs (none of the mask, scale and options)."""
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None, *([None] * _OPTIONS)


def _backward(ctx, dout, _dlse):
    if dout is None:  # no gradient reached out (lse has none): none for the inputs either
        return _grads(None, None, None, None, None)
    (q, k, v, out, lse, sinks), (mods, packed), (causal, scale, _) = _saved(ctx)
    dq, dk, dv, dsinks = _bwd_op(dout, q, k, v, out, lse, sinks, causal, scale,
                                 *_values(mods, packed))
    return _grads(dq, dk, dv, dsinks, sinks)


torch.library.register_autograd("tvm_flash::fwd", _backward, setup_context=_setup_context,
                                lib=_LIB)


def _swap(t, transposed: bool):
    """``t`` with dims 1 and 2 swapped where the caller's layout is ``(B, L, H, D)``."""
    return t.transpose(1, 2) if transposed else t


def _kernel_side(t, transposed: bool):
    """The caller's ``t`` as the kernels take it: :func:`kernel_view`, then :func:`_swap`.
    Asked in that order because the caller's ``(B, L, H, D)`` tensor is the contiguous one,
    whose test is one call (the transposed view's strides take a loop); the answer is the
    same either way."""
    return _swap(kernel_view(t), transposed)


class _Attention(torch.autograd.Function):
    """The eager door: the custom op's forward and autograd formula without its wrappers.
    Saves the kernel views of q, k, v (the same tensors unless a copy was needed), so the
    backward takes them as they are. ``transposed``: q, k, v and out are the caller's
    ``(B, L, H, D)`` tensors, whose ``(B, H, L, D)`` views the kernels take — made here, so
    that autograd records this one node and not four transposes besides (each a node of its
    own in the backward: ~180 us more a call for flash_attn_func's forward and backward on the
    H200's host, docs/journal/2026-12-02-host-path.md); gradients come back in that layout.

    What is not a tensor arrives as one tuple, ``call = (causal, scale, transposed, mods,
    packed)``: ``apply`` costs per argument (~3 us more for the op's 15 than for 5 on a
    2-core host), and ``mods`` / ``packed`` carry their tensors (ALiBi slopes, cu_seqlens,
    never differentiated) to :func:`_save`, which saves them for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        causal, scale, transposed, mods, packed = call
        q, k, v = (_kernel_side(t, transposed) for t in (q, k, v))
        out, lse = flash_forward(q, k, v, sinks, causal, scale, mods, packed)
        _save(ctx, q, k, v, out, lse, sinks, causal, scale, mods, packed, transposed)
        return _swap(out, transposed), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # grads are not materialised (_save)
            return None, None, None, None, None
        (q, k, v, out, lse, sinks), (mods, packed), (causal, scale, transposed) = _saved(ctx)
        if not _eager(dout, q, k):  # traced (compiled autograd): the tracer sees the op
            dq, dk, dv, dsinks = _bwd_op(_swap(dout, transposed), q, k, v, out, lse, sinks,
                                         causal, scale, *_values(mods, packed))
        else:
            dq, dk, dv, dsinks = flash_backward(_kernel_side(dout, transposed), q, k, v, out,
                                                lse, sinks, causal, scale, mods, packed)
        return (_swap(dq, transposed), _swap(dk, transposed), _swap(dv, transposed),
                dsinks if sinks is not None else None, None)


def forward(q, k, v, sinks, causal: str, scale: float, mods: ScoreMods = NO_MODS,
            packed: Packed | None = None, transposed: bool = False):
    """``(out, lse)`` of validated inputs in ``(B, H, L, D)`` (packed sequences: ``(1, H,
    rows, D)`` views and ``packed``; ``transposed``: q, k, v and out in ``(B, L, H, D)``),
    recording the backward where autograd needs it; the custom op ``tvm_flash::fwd`` where a
    tracer must see it. A head dim without kernels is padded to the next
    (:func:`native_head_dim`)."""
    if q.shape[-1] not in HEAD_DIMS:
        return pad_head_dim(forward, q, k, v, sinks, causal, scale, mods, packed, transposed)
    eager = _eager(q, k, v)
    if eager and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or (sinks is not None and sinks.requires_grad)):
        return _Attention.apply(q, k, v, sinks, (causal, scale, transposed, mods, packed))
    if eager:
        q, k, v = (_kernel_side(t, transposed) for t in (q, k, v))
        out, lse = flash_forward(q, k, v, sinks, causal, scale, mods, packed)
    else:
        q, k, v = (_swap(t, transposed) for t in (q, k, v))
        out, lse = _fwd_op(q, k, v, sinks, causal, scale, *_values(mods, packed))
    return _swap(out, transposed), lse


BHLD = "(B, H, L, D)"
"""torch SDPA's layout of q, k, v (:func:`attention`)."""
BLHD = "(B, L, H, D)"
"""flash-attn's layout (:mod:`tvm_flash.flash_attn`)."""
THD = "(total, H, D)"
"""Packed sequences (:func:`varlen_attention`): every sequence's rows, one after the other."""
_HEADS = {BHLD: 1, BLHD: 2, THD: 1}
"""Where each layout keeps the heads."""
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
    # plain tensors whose static facts passed before pass again: one tuple and a lookup
    # instead of the checks below (a training step calls attention with the same shapes in
    # every layer; the scale and the sinks are checked every time)
    seen = None
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        seen = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                v.device, enable_gqa, layout)
        if seen in _checked:
            if sinks is not None:
                _check_sinks(sinks, q.shape[1 if layout == BHLD else 2], q.device, n["q"])
            return _softmax_scale(scale, q.shape[3], n["scale"])
    for name, t in ((n["q"], q), (n["k"], k), (n["v"], v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions {layout}, got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of "
                            f"{[str(d) for d in _TORCH_DTYPES]}")
    device = q.device  # one device object for the comparisons (each .device makes one)
    for name, t in ((n["k"], k), (n["v"], v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {n['q']}'s {q.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: device {t.device} differs from {n['q']}'s {device}")
    if device.type not in ("cpu", "cuda", "mps"):
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
        _check_sinks(sinks, hq, device, n["q"])
    if seen is not None:
        if len(_checked) >= _CHECKED_KEPT:
            _checked.clear()
        _checked.add(seen)
    return _softmax_scale(scale, d, n["scale"])


_CHECKED_KEPT = 256
_checked: set = set()
"""The static facts of inputs :func:`check_inputs` passed (shapes, dtypes, devices, GQA
allowed, layout), the last few hundred."""


def _check_sinks(sinks, hq: int, device, q_name: str = "q") -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a torch.Tensor of shape ({hq},), got "
                        f"{type(sinks).__name__}")
    if sinks.shape != (hq,):
        raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.dtype not in _TORCH_DTYPES:
        raise TypeError(f"sinks: dtype {sinks.dtype} is not supported; use one of "
                        f"{[str(d) for d in _TORCH_DTYPES]}")
    if sinks.device != device:
        raise ValueError(f"sinks: device {sinks.device} differs from {q_name}'s {device}")


def _softmax_scale(scale, d: int, name: str) -> float:
    """The softmax scale to use: ``1 / sqrt(d)`` by default; a given one must be a finite
    positive number (``name``: what the caller calls it)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: must be a finite positive number, got {scale}")
    return scale


def check_mods(q, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               layout: str = BHLD, batch: int | None = None) -> ScoreMods:
    """Validate the score modifiers (q already checked by :func:`check_inputs`); return them
    as the kernels take them. Errors name the argument. ``batch``: the number of sequences
    where it is not q's first dimension (packed sequences)."""
    if (alibi_slopes is None and type(softcap) is float and softcap == 0.0
            and type(window_size) is tuple and window_size == (-1, -1)):
        return NO_MODS  # the defaults: every call without modifiers, checked in one line
    try:
        window = tuple(window_size)
    except TypeError:
        raise TypeError(f"window_size: expected a pair (left, right) of ints, got "
                        f"{window_size!r}") from None
    if len(window) != 2 or not all(isinstance(w, int) and not isinstance(w, bool)
                                   for w in window):
        raise TypeError(f"window_size: expected a pair (left, right) of ints, got "
                        f"{window_size!r}")
    if min(window) < -1:
        raise ValueError(f"window_size: {window} has a negative extent; use >= 0, or -1 for "
                         "unbounded")
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap: expected a number, got {softcap!r}") from None
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap: must be a finite number >= 0 (0: no cap), got {softcap}")
    b, hq = q.shape[0] if batch is None else batch, q.shape[_HEADS[layout]]
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes: expected a torch.Tensor of shape ({hq},) or "
                            f"({b}, {hq}), got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes: dtype {alibi_slopes.dtype}; ALiBi slopes are "
                            "float32")
        if tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({b}, {hq}), got "
                             f"{tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes: device {alibi_slopes.device} differs from q's "
                             f"{q.device}")
    return ScoreMods(window, cap, alibi_slopes)


def attention(q, k, v, *, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, causal_alignment: str = "top-left",
              sinks: torch.Tensor | None = None, window_size=(-1, -1), softcap: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, return_lse: bool = False):
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
        window_size: sliding window ``(left, right)``, -1 unbounded: query i sees key j iff
            ``c - left <= j <= c + right`` (and the causal mask), where ``c`` is the query's
            diagonal: ``c = i`` under a top-left causal mask, ``c = i + Lk - Lq`` otherwise
            (flash-attn's alignment). Key tiles outside the window are skipped.
        softcap: if > 0, scores ``s = q.k * scale`` become ``softcap * tanh(s / softcap)``
            (Gemma 2), with the exact gradient.
        alibi_slopes: ALiBi slopes ``(Hq,)`` or ``(B, Hq)``, float32: scores gain
            ``-slope * |c - j|`` (after the soft cap); not differentiated.
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
    mods = check_mods(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    if sinks is not None:
        sinks = sinks.float().contiguous()  # differentiable cast: dsinks flows back
    out, lse = forward(q, k, v, sinks, causal, scale, mods)
    return (out, lse) if return_lse else out



_CU_FACTS_KEPT = 8
_cu_facts_seen: dict[int, tuple] = {}


def _cu_facts(cu: torch.Tensor) -> tuple:
    """``(first, last, (index, length) of the shortest sequence, longest length)`` of a
    ``cu_seqlens`` tensor, read on the host — a synchronisation on a GPU — once per tensor and
    content: a model hands every layer the same ``cu_seqlens`` object, so only its first
    attention call waits. Kept for the last few tensors, each by identity (a weak reference:
    a new tensor at a freed one's address is read anew) and version (any in-place write,
    through any view, bumps it)."""
    try:
        version = cu._version
    except RuntimeError:  # an inference-mode tensor keeps no version: read it every time
        version = None
    seen = _cu_facts_seen.get(id(cu))
    if seen is not None and version is not None and seen[0]() is cu and seen[1] == version:
        return seen[2]
    host = cu.tolist()
    lengths = [b - a for a, b in zip(host[:-1], host[1:], strict=True)]
    shortest = min(enumerate(lengths), key=lambda p: p[1])
    facts = (host[0], host[-1], shortest, max(lengths))
    if version is None:
        return facts
    if len(_cu_facts_seen) >= _CU_FACTS_KEPT:
        _cu_facts_seen.pop(next(iter(_cu_facts_seen)))
    _cu_facts_seen[id(cu)] = (weakref.ref(cu), version, facts)
    return facts


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 names: dict | None = None) -> Packed:
    """Validate packed sequences: ``(total, H, D)`` q, k, v (their other facts are
    :func:`check_inputs`' on the ``(1, H, total, D)`` views) and the ``cu_seqlens``. Reads the
    ``cu_seqlens`` on the host (a synchronisation on a GPU; once per tensor and content,
    :func:`_cu_facts`): a length past ``max_seqlen`` or past the rows there are would make the
    kernels skip rows or read out of bounds."""
    n = _NAMES if names is None else {**_NAMES, **names}
    for name, t in ((n["q"], q), (n["k"], k), (n["v"], v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected 3 dimensions {THD}, got shape "
                             f"{tuple(t.shape)}")
    cus = {}
    for name, cu, rows in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                           ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: dtype {cu.dtype}; cu_seqlens are int32")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1, got "
                             f"{tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name}: device {cu.device} differs from q's {q.device}")
        first, last, shortest, longest = _cu_facts(cu)
        if first != 0 or last != rows:
            raise ValueError(f"{name}: must start at 0 and end at the {rows} rows given, got "
                             f"{first} ... {last}")
        if shortest[1] < 0:
            raise ValueError(f"{name}: must not decrease (sequence {shortest[0]} has length "
                             f"{shortest[1]})")
        cus[name] = (cu if cu.is_contiguous() else cu.contiguous(), longest)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: shape {tuple(cu_seqlens_k.shape)} differs from "
                         f"cu_seqlens_q's {tuple(cu_seqlens_q.shape)} (one entry per sequence)")
    maxes = []
    for name, given, (_, longest) in (("max_seqlen_q", max_seqlen_q, cus["cu_seqlens_q"]),
                                      ("max_seqlen_k", max_seqlen_k, cus["cu_seqlens_k"])):
        if not isinstance(given, int) or isinstance(given, bool):
            raise TypeError(f"{name}: expected an int, got {type(given).__name__}")
        if given < longest:
            raise ValueError(f"{name}: {given} is shorter than the longest sequence "
                             f"({longest} rows)")
        maxes.append(given)
    return Packed(cus["cu_seqlens_q"][0], cus["cu_seqlens_k"][0], *maxes)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal: str, scale, enable_gqa: bool, sinks=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, names: dict | None = None):
    """Every check of a packed-sequence call, in order — the packing (:func:`check_packed`),
    q, k, v and the rest as :func:`check_inputs` sees them on the ``(1, H, total, D)`` views,
    the score modifiers (slopes per sequence) — returning ``(Packed, scale, ScoreMods)``."""
    packed = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names)
    scale = check_inputs(_packed_view(q), _packed_view(k), _packed_view(v), causal=causal,
                         scale=scale, enable_gqa=enable_gqa, sinks=sinks, names=names)
    mods = check_mods(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                      layout=THD, batch=packed.count)
    return packed, scale, mods


def _packed_view(t):
    """``(total, H, D)`` -> the kernels' ``(1, H, total, D)`` view (no copy)."""
    return t.transpose(0, 1).unsqueeze(0)


def varlen_forward(q, k, v, packed: Packed, sinks, causal: str, scale: float,
                   mods: ScoreMods = NO_MODS):
    """``(out, lse)`` of validated packed sequences: out ``(total_q, Hq, D)``, lse
    ``(Hq, total_q)``."""
    # (1, total, H, D) is (B, L, H, D) with B = 1: the transposes happen inside the autograd
    # node (``forward``'s ``transposed``)
    out, lse = forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sinks, causal, scale,
                       mods, packed, transposed=True)
    return out[0], lse[0]


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                     max_seqlen_k: int, *, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, causal_alignment: str = "top-left",
                     sinks: torch.Tensor | None = None, window_size=(-1, -1),
                     softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                     return_lse: bool = False):
    """Attention over a batch of packed sequences of different lengths (no padding).

    Args:
        q: ``(total_q, Hq, D)``: every sequence's queries, one sequence after the other.
        k, v: ``(total_k, Hkv, D)``, packed the same way; ``Hkv`` divides ``Hq`` (GQA needs
            ``enable_gqa``).
        cu_seqlens_q: int32 ``(B + 1,)``: sequence ``s`` owns query rows
            ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])``; starts at 0, never decreases (empty
            sequences are fine), ends at ``total_q``.
        cu_seqlens_k: int32 ``(B + 1,)``, the same for keys and values.
        max_seqlen_q, max_seqlen_k: at least the longest sequence's length (they size the
            kernels' grids; a longer bound costs idle blocks, a shorter one is refused).
        is_causal, scale, enable_gqa, causal_alignment, sinks, window_size, softcap:
            as :func:`attention`, within each sequence (positions count from its start;
            ``causal_alignment`` applies to each sequence's own lengths).
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` float32 (per sequence).
        return_lse: also return the row logsumexp.

    Returns:
        ``out`` ``(total_q, Hq, D)``; with ``return_lse`` also ``lse`` ``(Hq, total_q)``
        float32 (flash-attn's varlen layout), ``-inf`` for a row that sees no key.

    Validating the ``cu_seqlens`` reads them on the host (a synchronisation on a GPU) once
    per tensor: later calls with the same, unmodified tensor (every layer of a model) do not
    wait. The backward is deterministic, as :func:`attention`'s.
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment: {causal_alignment!r} is not one of "
                         f"{CAUSAL_ALIGNMENTS}")
    causal = causal_alignment if is_causal else "none"
    packed, scale, mods = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=scale, enable_gqa=enable_gqa, sinks=sinks, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out, lse = varlen_forward(q, k, v, packed, sinks, causal, scale, mods)
    return (out, lse) if return_lse else out
