"""PyTorch binding: input checks, kernel launches through DLPack, autograd.

The compiled kernels take torch tensors directly (tvm-ffi reads them through DLPack): no host
copies, no ``.numpy()``. CUDA kernels run on PyTorch's current stream.
"""

from __future__ import annotations

import functools
import math

import torch
import tvm
import tvm_ffi

from .artifacts import kernel
from .key import HEAD_DIMS, KernelKey
from .layout import kernel_view as _dense
from .layout import output_like
from .target import target_tag_for_device

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
CAUSAL_ALIGNMENTS = ("top-left", "bottom-right")


def _launch(op: str, meta: dict, *args) -> None:
    device = args[0].device
    key = KernelKey(op=op, target=target_tag_for_device(device), **meta)
    fn = kernel(key)
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).cuda_stream
        with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", device.index), stream):
            fn(*args)
    elif device.type == "mps":
        # TVM's Metal runtime has its own command queue: order it after torch's and back.
        # (Not run yet: no Mac here; see README "Metal".)
        torch.mps.synchronize()
        fn(*args)
        tvm.runtime.device("metal", 0).sync()
    else:
        fn(*args)


def _meta(q, k, causal: str) -> dict:
    return {"head_dim": q.shape[-1], "dtype": _TORCH_DTYPES[q.dtype], "causal": causal,
            "group": q.shape[1] // k.shape[1]}


def _row_wise(meta: dict) -> dict:
    """The key fields of a row-wise kernel (no causal mode, no group)."""
    return {**meta, "causal": "none", "group": 1}


SHORT_QUERY_MAX = 12
"""Query lengths up to this take the short-query ("vector") kernels: tiles pack the queries
of a GQA group (8 rows) and the keys are split over blocks. Longer ones take the tiled kernels.
Set from the H200 crossover (docs/perf.md, "Short queries"): the short path is >= 2x faster
through Lq = 12 at batch 1 and 8, and only breaks even with the tiled kernels at Lq = 16."""
KEYS_PER_SPLIT_MIN = 256
"""A key split is never shorter than this (fewer, longer splits merge cheaper)."""
_PACKED_ROWS = 8  # rows of a short-query tile (schedules pick 8; only used to size the grid)


@functools.cache
def _parallel_units(device) -> int:
    """Blocks that keep ``device`` busy: two per SM on CUDA, one per thread on the CPU."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, torch.get_num_threads())


def num_splits(q, k) -> int:
    """Key splits for the short-query kernels: enough blocks to fill the device, but splits
    of at least ``KEYS_PER_SPLIT_MIN`` keys."""
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    blocks = b * hkv * math.ceil(hq // hkv * lq / _PACKED_ROWS)
    want = math.ceil(_parallel_units(q.device) / blocks)
    return max(1, min(want, math.ceil(lk / KEYS_PER_SPLIT_MIN)))


def _partials(q, splits: int, *trailing):
    """float32 workspace of shape ``(splits * B, Hq, Lq, *trailing)``."""
    b, hq, lq, _ = q.shape
    return torch.empty((splits * b, hq, lq, *trailing), dtype=torch.float32, device=q.device)


def _short(q) -> bool:
    return q.shape[2] <= SHORT_QUERY_MAX


def flash_forward(q, k, v, sinks, causal: str, scale: float):
    """Run the forward kernels: returns ``(out, lse)``. Inputs must already be validated;
    ``sinks`` is None or a float32 ``(Hq,)`` tensor."""
    out = output_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[2] == 0:  # no keys at all: every row is empty (but for its sink)
        lse.fill_(-math.inf) if sinks is None else lse.copy_(sinks[None, :, None].expand_as(lse))
        return out.zero_(), lse
    meta = _meta(q, k, causal)
    with_sinks = {"sinks": sinks is not None}
    # without sinks the kernel ignores this (Hq,) buffer; it only fixes the calling convention
    sink_arg = sinks if sinks is not None else lse.new_empty(q.shape[1])
    if _short(q):
        splits = num_splits(q, k)
        o_part, m_part, l_part = _partials(q, splits, q.shape[3]), _partials(q, splits), \
            _partials(q, splits)
        _launch("fwd_split", meta, q, k, v, o_part, m_part, l_part, scale)
        _launch("fwd_merge", {**_row_wise(meta), **with_sinks}, o_part, m_part, l_part, sink_arg,
                out, lse)
    else:
        _launch("fwd", {**meta, **with_sinks}, q, k, v, sink_arg, out, lse, scale)
    return out, lse


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
    shape (Hq,) without sinks."""
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    dsinks = lse.new_zeros(q.shape[1])
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dsinks
    meta = _meta(q, k, causal)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _launch("bwd_pre", _row_wise(meta), out, do, delta)
    if _short(q):
        dq_part = _partials(q, num_splits(q, k), q.shape[3])
        _launch("dq_split", meta, q, k, v, do, lse, delta, dq_part, scale)
        _launch("dq_merge", _row_wise(meta), dq_part, dq, scale)
        _launch("dkv_packed", meta, q, k, v, do, lse, delta, dk, dv, scale)
    else:
        _launch("dq", meta, q, k, v, do, lse, delta, dq, scale)
        _launch("dkv", meta, q, k, v, do, lse, delta, dk, dv, scale)
    if sinks is not None:
        dsinks = sink_gradient(sinks, lse, delta)
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------- torch custom ops
# Opaque to torch.compile (no graph break), with fake impls for tracing and an autograd
# formula that calls the backward op.


@torch.library.custom_op("tvm_flash::fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
            causal: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(_dense(q), _dense(k), _dense(v), sinks, causal, scale)


# Fakes allocate like the real ops (layout.output_like), so their strides agree.
@_fwd_op.register_fake
def _(q, k, v, sinks, causal, scale):
    return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tvm_flash::bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, causal: str,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(_dense(do), _dense(q), _dense(k), _dense(v), _dense(out),
                          lse.contiguous(), sinks, causal, scale)


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


def check_inputs(q, k, v, *, causal: str, scale, enable_gqa: bool, sinks=None) -> float:
    """Validate the public arguments; return the softmax scale to use.

    Every error names the argument and what is supported.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions (B, H, L, D), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of "
                            f"{[str(d) for d in _TORCH_DTYPES]}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} differs from q's {q.device}")
    if q.device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"q: device {q.device} is not supported; use a cpu, cuda or mps "
                         "tensor")
    b, hq, _, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)} "
                         "(same batch, heads, key length and head_dim required)")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q's batch {b} and "
                         f"head_dim {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {d} is not supported; use one of {HEAD_DIMS}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k: {hkv} key/value heads do not divide q's {hq} query heads")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"k: {hkv} key/value heads differ from q's {hq} heads; pass "
                         "enable_gqa=True for grouped-query attention")
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
            raise ValueError(f"sinks: device {sinks.device} differs from q's {q.device}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: must be a finite positive number, got {scale}")
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

    q, k, v are float16, bfloat16 or float32 on one CPU or CUDA device; D is one of
    ``tvm_flash.HEAD_DIMS``. Accumulation is float32. q, k, v (and the gradient of out) are
    read where they lie when their last dimension is contiguous and every row starts 16-byte
    aligned — in particular ``(B, L, H, D)`` storage viewed as ``(B, H, L, D)``; other layouts
    are copied first (``tvm_flash.layout``). ``out`` and the gradients come back in torch
    SDPA's layout: ``out`` like q, each gradient like its input. The backward is
    deterministic (no atomics).
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment: {causal_alignment!r} is not one of "
                         f"{CAUSAL_ALIGNMENTS}")
    causal = causal_alignment if is_causal else "none"
    scale = check_inputs(q, k, v, causal=causal, scale=scale, enable_gqa=enable_gqa,
                         sinks=sinks)
    if sinks is not None:
        sinks = sinks.float().contiguous()  # differentiable cast: dsinks flows back
    out, lse = _fwd_op(q, k, v, sinks, causal, scale)
    return (out, lse) if return_lse else out

