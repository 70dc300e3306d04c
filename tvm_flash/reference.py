"""Float64 PyTorch reference for the output, the LSE and every gradient.

Used by the tests, the benchmark and the scripts. It materialises the full Lq x Lk score
matrix, so it is for checking, not for speed.
"""

from __future__ import annotations

import math

import torch

from .key import CAUSAL_MODES


def causal_mask(lq: int, lk: int, causal: str, device=None) -> torch.Tensor | None:
    """Boolean (Lq, Lk) mask, True where key j is visible to query i; None for no masking."""
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal: {causal!r} is not one of {CAUSAL_MODES}")
    if causal == "none":
        return None
    offset = lk - lq if causal == "bottom-right" else 0
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + offset


def window_mask(lq: int, lk: int, causal: str, window, device=None) -> torch.Tensor:
    """Boolean (Lq, Lk) mask of a sliding window ``(left, right)`` (-1: unbounded): key j
    visible to query i iff ``c - left <= j <= c + right`` with ``c = i + diagonal`` (0 under a
    top-left causal mask, ``Lk - Lq`` otherwise: ``tvm_flash.key.MODS``)."""
    left, right = window
    c = torch.arange(lq, device=device)[:, None] + (0 if causal == "top-left" else lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= c - left
    if right >= 0:
        mask &= j <= c + right
    return mask


def alibi_bias(slopes, lq: int, lk: int, causal: str, dtype=torch.float64) -> torch.Tensor:
    """``-slope * |i + diagonal - j|`` of shape ``(B or 1, H, Lq, Lk)`` for slopes ``(H,)`` or
    ``(B, H)`` (diagonal as :func:`window_mask`)."""
    slopes = slopes.to(dtype)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    c = torch.arange(lq, device=slopes.device)[:, None] + (0 if causal == "top-left" else lk - lq)
    j = torch.arange(lk, device=slopes.device)[None, :]
    return -slopes[:, :, None, None] * (c - j).abs().to(dtype)


def attention_reference(q, k, v, *, causal: str = "none", scale: float | None = None,
                        sinks=None, window=None, softcap: float = 0.0, alibi_slopes=None,
                        dtype=torch.float64):
    """Attention in ``dtype`` (float64 by default) with the kernels' conventions.

    q ``(B, Hq, Lq, D)``, k and v ``(B, Hkv, Lk, D)`` with ``Hq`` a multiple of ``Hkv``.
    Returns ``(out, lse)``: out ``(B, Hq, Lq, D)`` in ``dtype``; lse ``(B, Hq, Lq)`` in natural-log
    units. A row that sees no key gives out = 0 and lse = -inf (and zero gradients).
    ``sinks`` ``(Hq,)``: per-head logits of a virtual key with no value, included in each row's
    softmax denominator (and in lse). ``window`` ``(left, right)``, ``softcap`` (> 0) and
    ``alibi_slopes`` (``(Hq,)`` or ``(B, Hq)``) modify the scaled scores as
    ``tvm_flash.key.MODS`` says: cap, then bias, then the masks.
    Differentiable: call ``.backward`` on a function of ``out`` to get reference gradients
    (of q, k, v and sinks).
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    lq, lk = q.shape[2], k.shape[2]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, lq, lk, causal, dtype)
    mask = causal_mask(lq, lk, causal, q.device)
    if window is not None and tuple(window) != (-1, -1):
        wmask = window_mask(lq, lk, causal, window, q.device)
        mask = wmask if mask is None else mask & wmask
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) with lse = -inf (no visible key) would be NaN; such rows get p = 0.
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])
    p = torch.where(finite[..., None], p, 0.0)
    return p @ v, lse
