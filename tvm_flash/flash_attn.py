"""flash-attn 2's Python interface on tvm-flash kernels: a drop-in for models written for it.

``flash_attn_func``, ``flash_attn_kvpacked_func`` and ``flash_attn_qkvpacked_func`` take the
arguments of flash-attn 2 (``flash_attn.flash_attn_interface``) and its layout, sequence
before heads: ``(B, L, H, D)``, packed ``(B, L, 2, Hkv, D)`` / ``(B, L, 3, H, D)``. Its
conventions hold: ``causal`` is bottom-right aligned (query i sees key j iff
``j <= i + Lk - Lq``), GQA/MQA follow from the head counts, ``softmax_scale`` defaults to
``1 / sqrt(D)``. The kernels get ``.transpose(1, 2)`` views, as ``tvm_flash.attention`` takes
them (``(B, H, L, D)``; :func:`tvm_flash.layout.kernel_view` decides whether such a view is
read in place or copied), and the results come back as views in ``(B, L, H, D)``.

What flash-attn offers and tvm-flash does not raises ``ValueError`` naming the argument
(never a silent fallback): ``dropout_p != 0``, ``window_size != (-1, -1)``, ``softcap != 0``,
``alibi_slopes``. ``deterministic`` is accepted: tvm-flash's backward is always
deterministic. ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: there is no
dropout mask (flash-attn's third value) to return.
"""

from __future__ import annotations

import torch

from .ops import BLHD, check_inputs, forward


def _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: {dropout_p} given, but tvm-flash has no attention "
                         "dropout; pass dropout_p=0.0")
    try:
        window = tuple(window_size)
    except TypeError:
        window = window_size
    if window != (-1, -1):
        raise ValueError(f"window_size: {window_size!r} given, but tvm-flash has no "
                         "sliding-window attention; pass window_size=(-1, -1)")
    if softcap != 0.0:
        raise ValueError(f"softcap: {softcap} given, but tvm-flash has no logit soft-capping; "
                         "pass softcap=0.0")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: given, but tvm-flash has no ALiBi bias; pass "
                         "alibi_slopes=None")


def _attend(q, k, v, softmax_scale, causal, return_attn_probs, names=None):
    """Validated (B, L, H, D) inputs -> flash-attn's return value."""
    mode = "bottom-right" if causal else "none"
    scale = check_inputs(q, k, v, causal=mode, scale=softmax_scale, enable_gqa=True,
                         layout=BLHD, names={"scale": "softmax_scale", **(names or {})})
    out, lse = forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, mode,
                       scale)
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func``: attention on ``(B, L, H, D)`` tensors.

    Args:
        q: queries ``(B, Lq, Hq, D)``.
        k: keys ``(B, Lk, Hkv, D)``; ``Hkv`` divides ``Hq`` (GQA / MQA: query head ``h`` uses
            key/value head ``h // (Hq / Hkv)``).
        v: values ``(B, Lk, Hkv, D)``.
        dropout_p: must be 0.0 (no dropout).
        softmax_scale: scale of ``q k^T``, default ``1 / sqrt(D)``.
        causal: bottom-right causal mask: query ``i`` sees key ``j`` iff
            ``j <= i + Lk - Lq``.
        window_size: must be ``(-1, -1)`` (no sliding window).
        softcap: must be 0.0 (no soft-capping).
        alibi_slopes: must be None (no ALiBi).
        deterministic: accepted; the backward is always deterministic (no atomics).
        return_attn_probs: also return the row logsumexp (and None for flash-attn's
            dropout mask).

    Returns:
        ``out`` ``(B, Lq, Hq, D)`` in the input dtype (a transposed view of a
        ``(B, Hq, Lq, D)`` buffer); with ``return_attn_probs`` the tuple
        ``(out, softmax_lse, None)``, ``softmax_lse`` ``(B, Hq, Lq)`` float32, natural-log
        units, ``-inf`` for a row that sees no key (flash-attn 2 writes ``+inf`` there); its
        output row is zero either way.

    q, k, v are float16, bfloat16 or float32 on one CPU or CUDA device with D from 1 to 256
    (other than ``tvm_flash.HEAD_DIMS`` zero-padded to the next); accumulation is float32.
    Gradients flow to q, k and v.
    """
    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    return _attend(q, k, v, softmax_scale, causal, return_attn_probs)


def _check_packed(name: str, t, parts: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 5 or t.shape[2] != parts:
        raise ValueError(f"{name}: expected 5 dimensions {layout}, got shape "
                         f"{tuple(t.shape)}")


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_kvpacked_func``: keys and values in one tensor.

    Args:
        q: queries ``(B, Lq, Hq, D)``.
        kv: keys ``kv[:, :, 0]`` and values ``kv[:, :, 1]``, ``(B, Lk, 2, Hkv, D)``; ``Hkv``
            divides ``Hq`` (GQA / MQA).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as in :func:`flash_attn_func`.

    Returns:
        ``out`` ``(B, Lq, Hq, D)``; with ``return_attn_probs`` ``(out, softmax_lse, None)``,
        ``softmax_lse`` ``(B, Hq, Lq)`` float32 (see :func:`flash_attn_func`). The gradient
        of ``kv`` has its shape.
    """
    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    _check_packed("kv", kv, 2, "(B, Lk, 2, Hkv, D)")
    return _attend(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, return_attn_probs,
                   names={"k": "kv[:, :, 0]", "v": "kv[:, :, 1]"})


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_qkvpacked_func``: self-attention, q, k, v in one tensor.

    Args:
        qkv: ``(B, L, 3, H, D)``: queries ``qkv[:, :, 0]``, keys ``qkv[:, :, 1]``, values
            ``qkv[:, :, 2]`` (as many key/value heads as query heads).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as in :func:`flash_attn_func`.

    Returns:
        ``out`` ``(B, L, H, D)``; with ``return_attn_probs`` ``(out, softmax_lse, None)``,
        ``softmax_lse`` ``(B, H, L)`` float32 (see :func:`flash_attn_func`). The gradient of
        ``qkv`` has its shape.
    """
    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    _check_packed("qkv", qkv, 3, "(B, L, 3, H, D)")
    return _attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal,
                   return_attn_probs,
                   names={"q": "qkv[:, :, 0]", "k": "qkv[:, :, 1]", "v": "qkv[:, :, 2]"})
