"""Drop-in pieces for models: an SDPA-compatible function and a self-attention module.

One-line swap in existing model code::

    from tvm_flash.nn import scaled_dot_product_attention
    # instead of torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .ops import attention


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, window_size=(-1, -1),
                                 softcap: float = 0.0, alibi_slopes=None):
    """``torch.nn.functional.scaled_dot_product_attention``'s signature on tvm-flash kernels.

    Shapes as there: query ``(B, Hq, Lq, D)``, key and value ``(B, Hkv, Lk, D)``; returns
    ``(B, Hq, Lq, D)``. Arbitrary masks and dropout are not supported and raise (never a silent
    fallback to another implementation); ``is_causal`` is torch's top-left causal mask.
    ``window_size``, ``softcap``, ``alibi_slopes``: tvm-flash's score modifiers, as
    :func:`tvm_flash.attention` takes them.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: tvm-flash supports only is_causal masking, not an "
                         "explicit mask")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: tvm-flash has no attention dropout, got {dropout_p}")
    return attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al., 2022, as BLOOM and MPT use them): for ``heads``
    a power of two ``2^(-8 h / heads)``, h = 1..heads; otherwise those of the power of two
    below, then every other slope of the one above. float32 ``(heads,)``."""
    def powers(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    low = 2 ** math.floor(math.log2(heads))
    slopes = powers(low) + powers(2 * low)[0::2][:heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention on ``(B, L, width)`` inputs.

    ``heads`` query heads of size ``width // heads`` and ``kv_heads`` key/value heads
    (``kv_heads`` divides ``heads``; fewer is GQA). ``impl="tvm"`` uses tvm-flash,
    ``impl="sdpa"`` torch SDPA — the same module otherwise, for A/B comparisons.

    ``window_size``, ``softcap``, ``alibi``: score modifiers (:func:`tvm_flash.attention`;
    ``alibi=True`` uses :func:`alibi_slopes`), tvm-flash only: ``impl="sdpa"`` and
    ``cp_group`` refuse them.

    ``cp_group`` (a ``torch.distributed`` process group, ``impl="tvm"``): context parallel —
    ``x`` is this rank's zig-zag shard of the sequence (``tvm_flash.distributed.shard`` along
    dim 1), the projections run on it locally and attention runs as a ring over the group
    (:func:`tvm_flash.distributed.ring_attention`); the output is this rank's shard. A rotary
    embedding must then be given the shard's positions.
    """

    def __init__(self, width: int, heads: int, kv_heads: int | None = None, *,
                 causal: bool = True, impl: str = "tvm", bias: bool = False, cp_group=None,
                 window_size=(-1, -1), softcap: float = 0.0, alibi: bool = False):
        super().__init__()
        kv_heads = kv_heads or heads
        if width % heads:
            raise ValueError(f"width: {width} is not a multiple of heads={heads}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads: {kv_heads} does not divide heads={heads}")
        if impl not in ("tvm", "sdpa"):
            raise ValueError(f"impl: {impl!r} is not 'tvm' or 'sdpa'")
        if cp_group is not None and impl != "tvm":
            raise ValueError("cp_group: context parallelism runs tvm-flash's ring; use "
                             "impl='tvm'")
        mods = {"window_size": tuple(window_size) != (-1, -1), "softcap": softcap != 0.0,
                "alibi": alibi}
        asked = [name for name, on in mods.items() if on]
        if asked and (impl != "tvm" or cp_group is not None):
            raise ValueError(f"{asked[0]}: score modifiers run on tvm-flash's single-device "
                             "attention only (impl='tvm', no cp_group)")
        self.window_size, self.softcap = tuple(window_size), softcap
        self.register_buffer("alibi", alibi_slopes(heads) if alibi else None, persistent=False)
        self.cp_group = cp_group
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.causal, self.impl = causal, impl
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = q.view(b, length, self.heads, d).transpose(1, 2)
        k = k.view(b, length, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, length, self.kv_heads, d).transpose(1, 2)
        if rotary is not None:
            q, k = rotary(q), rotary(k)
        gqa = self.kv_heads != self.heads
        if self.cp_group is not None:
            from .distributed import ring_attention  # torch.distributed only when asked for

            o = ring_attention(q, k, v, group=self.cp_group, is_causal=self.causal,
                               enable_gqa=gqa)
        elif self.impl == "tvm":
            o = attention(q, k, v, is_causal=self.causal, enable_gqa=gqa,
                          window_size=self.window_size, softcap=self.softcap,
                          alibi_slopes=self.alibi)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, enable_gqa=gqa)
        return self.proj(o.transpose(1, 2).reshape(b, length, self.heads * d))
