"""Checking ours against a float64 reference.

Tolerance, as flash-attention tests it: the error of ours (vs float64) may be at most 2x
(output, LSE) or 3x (gradients) the error of the same maths done by PyTorch in the input
precision, plus a small absolute floor. Max and mean errors are printed (pytest -s shows them).
"""

import torch

from tvm_flash import attention, attention_reference
from tvm_flash.artifacts import absorbs, kernel

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def make_inputs(b, hq, hkv, lq, lk, d, dtype, device):
    q = torch.randn(b, hq, lq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, lk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, lk, d, dtype=dtype, device=device)
    do = torch.randn(b, hq, lq, d, dtype=dtype, device=device)
    return q, k, v, do


def reference(q, k, v, do, causal, dtype, scale=None, sinks=None, mods=None):
    """Output, LSE and gradients (q, k, v[, sinks]) of the reference computed in ``dtype``;
    ``mods``: ``window_size``, ``softcap``, ``alibi_slopes`` as ``attention`` takes them."""
    mods = mods or {}
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().to(dtype).requires_grad_())
    out, lse = attention_reference(*leaves[:3], causal=causal, scale=scale,
                                   sinks=leaves[3] if sinks is not None else None,
                                   window=mods.get("window_size"),
                                   softcap=mods.get("softcap", 0.0),
                                   alibi_slopes=mods.get("alibi_slopes"), dtype=dtype)
    out.backward(do.to(dtype))
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def _err(a, b):
    """Max and mean |a - b| in float64; entries that are -inf in both count as equal."""
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    diff = torch.where(both_inf, 0.0, (a - b).abs())
    if diff.numel() == 0:
        return 0.0, 0.0
    return diff.max().item(), diff.mean().item()


def check_against_reference(q, k, v, do, causal, *, scale=None, enable_gqa=True, sinks=None,
                            floor=None, **mods):
    """Run ours forward and backward; assert every output and gradient is within bounds.

    ``floor`` raises the absolute floor (default: per dtype, ``FLOOR``); ``mods``: score
    modifiers (``window_size``, ``softcap``, ``alibi_slopes``) for ours and the reference.
    """
    dtype = q.dtype
    is_causal = causal != "none"
    # detach, not clone: the leaves keep the caller's strides and data pointer (layout tests)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().requires_grad_())
    out, lse = attention(*leaves[:3], is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                         causal_alignment=causal if is_causal else "top-left",
                         sinks=leaves[3] if sinks is not None else None, return_lse=True,
                         **mods)
    out.backward(do)
    ours = [out.detach(), lse, *(t.grad for t in leaves)]
    exact = reference(q, k, v, do, causal, torch.float64, scale, sinks, mods)
    lowp = reference(q, k, v, do, causal, dtype, scale, sinks, mods)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"][:len(ours)]
    mults = [2, 2, 3, 3, 3, 3][:len(ours)]
    for name, o, e, lp, mult in zip(names, ours, exact, lowp, mults, strict=True):
        assert o.shape == e.shape, name
        assert not torch.isnan(o).any(), f"{name}: NaN in output"
        err, mean = _err(o, e)
        ref_err, _ = _err(lp, e)
        bound = mult * ref_err + (FLOOR[dtype] if floor is None else floor)
        print(f"{name}: max err {err:.3g} (mean {mean:.3g}), torch {dtype} err {ref_err:.3g}, "
              f"bound {bound:.3g}")
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
    # rows that see no key: LSE -inf exactly where the reference says so
    assert torch.equal(torch.isinf(lse), torch.isinf(exact[1]))
    return ours


def launch_dq(key, q, k, v, do, lse, out, delta, dq, scale, *extra):
    """Launch the tiled dQ kernel ``key`` as ``tvm_flash.plan`` does: with ``out`` where it
    computes Delta itself (``OpSpec.absorbs``; it then writes ``delta``), else reading
    ``delta``."""
    o = (out,) if absorbs(key) == "bwd_pre" else ()
    kernel(key)(q, k, v, do, lse, *o, delta, dq, scale, *extra)
