"""flash-attn 2's Python interface on tvm-flash kernels: a drop-in for models written for it.

``flash_attn_func``, ``flash_attn_kvpacked_func`` and ``flash_attn_qkvpacked_func`` take the
arguments of flash-attn 2 (``flash_attn.flash_attn_interface``) and its layout, sequence
before heads: ``(B, L, H, D)``, packed ``(B, L, 2, Hkv, D)`` / ``(B, L, 3, H, D)``. Its
conventions hold: ``causal`` is bottom-right aligned (query i sees key j iff
``j <= i + Lk - Lq``), GQA/MQA follow from the head counts, ``softmax_scale`` defaults to
``1 / sqrt(D)``. The kernels get ``.transpose(1, 2)`` views, as ``tvm_flash.attention`` takes
them (``(B, H, L, D)``; :func:`tvm_flash.layout.kernel_view` decides whether such a view is
read in place or copied), and the results come back as views in ``(B, L, H, D)`` — the views
made inside the autograd node (``tvm_flash.ops.forward(..., transposed=True)``).

``window_size``, ``softcap`` and ``alibi_slopes`` mean what they mean there (bottom-right
aligned; see ``tvm_flash.attention``), on every device and dtype. What flash-attn offers and
tvm-flash does not raises ``ValueError`` naming the argument (never a silent fallback):
``dropout_p != 0``. ``deterministic`` is accepted: tvm-flash's backward is always
deterministic. ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: there is no
dropout mask (flash-attn's third value) to return.
"""

from __future__ import annotations

import torch

from .ops import BLHD, check_inputs, check_mods, check_varlen_inputs, forward, varlen_forward


def _refuse_unsupported(dropout_p) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: {dropout_p} given, but tvm-flash has no attention "
                         "dropout; pass dropout_p=0.0")


def _attend(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_attn_probs, names=None):
    """Validated (B, L, H, D) inputs -> flash-attn's return value."""
    mode = "bottom-right" if causal else "none"
    scale = check_inputs(q, k, v, causal=mode, scale=softmax_scale, enable_gqa=True,
                         layout=BLHD, names={"scale": "softmax_scale", **(names or {})})
    mods = check_mods(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                      layout=BLHD)
    out, lse = forward(q, k, v, None, mode, scale, mods, transposed=True)
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
        window_size: ``(left, right)``, -1 unbounded: query ``i`` sees key ``j`` iff
            ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (and the causal mask).
        softcap: if > 0, scores ``s`` become ``softcap * tanh(s / softcap)``.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` float32: scores gain
            ``-slope * |i + Lk - Lq - j|``.
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
    _refuse_unsupported(dropout_p)
    return _attend(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs)


def _check_packed(name: str, t, parts: int, layout: str, dims: int = 5, axis: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.shape[axis] != parts:
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
    _refuse_unsupported(dropout_p)
    _check_packed("kv", kv, 2, "(B, Lk, 2, Hkv, D)")
    return _attend(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs,
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
    _refuse_unsupported(dropout_p)
    _check_packed("qkv", qkv, 3, "(B, L, 3, H, D)")
    return _attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs,
                   names={"q": "qkv[:, :, 0]", "k": "qkv[:, :, 1]", "v": "qkv[:, :, 2]"})


# ------------------------------------------------------------------------ packed sequences


def _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, names=None):
    """Validated packed ``(total, H, D)`` inputs -> flash-attn's return value."""
    mode = "bottom-right" if causal else "none"
    packed, scale, mods = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=mode,
        scale=softmax_scale, enable_gqa=True, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, names={"scale": "softmax_scale", **(names or {})})
    out, lse = varlen_forward(q, k, v, packed, None, mode, scale, mods)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func``: packed sequences of different lengths.

    Args:
        q: ``(total_q, Hq, D)``: the sequences' queries one after the other.
        k, v: ``(total_k, Hkv, D)``; ``Hkv`` divides ``Hq``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)``: sequence ``s`` owns rows
            ``[cu_seqlens[s], cu_seqlens[s + 1])`` (0 first, ``total`` last, never
            decreasing).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's length.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
            return_attn_probs: as in :func:`flash_attn_func`, within each sequence
            (bottom-right causal per sequence).
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` float32.
        block_table: must be None (no paged KV cache).

    Returns:
        ``out`` ``(total_q, Hq, D)``; with ``return_attn_probs`` ``(out, softmax_lse, None)``,
        ``softmax_lse`` ``(Hq, total_q)`` float32, ``-inf`` for a row that sees no key.

    Validating the ``cu_seqlens`` reads them on the host (a synchronisation on a GPU) once per
    tensor: later calls with the same, unmodified tensor (every layer of a model) do not wait.
    """
    _refuse_unsupported(dropout_p)
    if block_table is not None:
        raise ValueError("block_table: given, but tvm-flash has no paged KV cache; pass "
                         "block_table=None")
    return _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_size, softcap, alibi_slopes,
                          return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash-attn 2's ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, Hkv, D)``,
    the rest as :func:`flash_attn_varlen_func`."""
    _refuse_unsupported(dropout_p)
    _check_packed("kv", kv, 2, "(total_k, 2, Hkv, D)", dims=4, axis=1)
    return _attend_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, return_attn_probs,
                          names={"k": "kv[:, 0]", "v": "kv[:, 1]"})


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, H, D)``,
    one ``cu_seqlens`` and ``max_seqlen`` for queries and keys, the rest as
    :func:`flash_attn_varlen_func`."""
    _refuse_unsupported(dropout_p)
    _check_packed("qkv", qkv, 3, "(total, 3, H, D)", dims=4, axis=1)
    return _attend_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                          max_seqlen, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, return_attn_probs,
                          names={"q": "qkv[:, 0]", "k": "qkv[:, 1]", "v": "qkv[:, 2]"})
