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


def attention_reference(q, k, v, *, causal: str = "none", scale: float | None = None,
                        sinks=None, dtype=torch.float64):
    """Attention in ``dtype`` (float64 by default) with the kernels' conventions.

    q ``(B, Hq, Lq, D)``, k and v ``(B, Hkv, Lk, D)`` with ``Hq`` a multiple of ``Hkv``.
    Returns ``(out, lse)``: out ``(B, Hq, Lq, D)`` in ``dtype``; lse ``(B, Hq, Lq)`` in natural-log
    units. A row that sees no key gives out = 0 and lse = -inf (and zero gradients).
    ``sinks`` ``(Hq,)``: per-head logits of a virtual key with no value, included in each row's
    softmax denominator (and in lse).
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
    mask = causal_mask(q.shape[2], k.shape[2], causal, q.device)
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
