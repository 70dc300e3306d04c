"""flash-attn 2's interface (``tvm_flash.flash_attn_func`` and the packed variants): values,
LSE and gradients against float64 in (B, L, H, D), its conventions (bottom-right causal, GQA
from head counts, ``return_attn_probs``), every unsupported argument refused by name, and
``torch.compile``."""

import math
import re

import pytest
import torch
from checks import FLOOR, _err, reference
from conftest import DEVICES

from tvm_flash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


def blhd(b, lq, lk, hq, hkv, d, dtype, device):
    """q (B, Lq, Hq, D), k, v (B, Lk, Hkv, D), dO like q: flash-attn's layout."""
    q = torch.randn(b, lq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, lk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, lk, hkv, d, dtype=dtype, device=device)
    return q, k, v, torch.randn_like(q)


def check(ours, exact, lowp, names, mults, dtype):
    """Each of ours within ``mult`` x the input-precision error of the same maths, + floor."""
    for name, o, e, lp, mult in zip(names, ours, exact, lowp, mults, strict=True):
        assert o.shape == e.shape, name
        assert not torch.isnan(o).any(), f"{name}: NaN"
        err, _ = _err(o, e)
        ref_err, _ = _err(lp, e)
        bound = mult * ref_err + FLOOR[dtype]
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def references(q, k, v, do, causal, scale=None):
    """float64 and input-precision references, converted to (B, L, H, D) (lse: (B, H, Lq))."""
    mode = "bottom-right" if causal else "none"
    t = [x.transpose(1, 2) for x in (q, k, v, do)]
    out = []
    for dtype in (torch.float64, q.dtype):
        o, lse, dq, dk, dv = reference(*t, mode, dtype, scale)
        out.append([o.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2),
                    dv.transpose(1, 2)])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
# (Lq, Lk, Hq, Hkv): odd lengths, Lq < Lk and Lq > Lk (bottom-right: the first rows see no
# key), a short query (the split kernels), GQA 4:1 and MQA
@pytest.mark.parametrize("lq,lk,hq,hkv", [(37, 53, 4, 4), (53, 37, 4, 1), (3, 101, 8, 2),
                                          (97, 97, 4, 1)])
def test_flash_attn_func_matches_reference(lq, lk, hq, hkv, causal, dtype, device):
    q, k, v, do = blhd(2, lq, lk, hq, hkv, 64, dtype, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, probs = flash_attn_func(*leaves, causal=causal, return_attn_probs=True,
                                      deterministic=True)
    assert probs is None
    assert out.shape == (2, lq, hq, 64) and out.dtype == dtype
    assert lse.shape == (2, hq, lq) and lse.dtype == torch.float32
    out.backward(do)
    ours = [out.detach(), lse, *(t.grad for t in leaves)]
    exact, lowp = references(q, k, v, do, causal)
    check(ours, exact, lowp, ["out", "lse", "dq", "dk", "dv"], [2, 2, 3, 3, 3], dtype)
    assert torch.equal(torch.isinf(lse), torch.isinf(exact[1]))


def test_one_autograd_node_and_gradients_in_the_inputs_layout():
    """The (B, L, H, D) <-> (B, H, L, D) views are made inside tvm-flash's autograd node, so a
    backward runs that one node and no transposes of its own (each was a node of the graph,
    a host cost per call); out and the gradients come back in the inputs' layout, as views
    of (B, L, H, D) storage; a head dim without kernels (padded) too."""
    for d in (64, 40):
        q, k, v, do = blhd(2, 33, 33, 4, 2, d, torch.float32, "cpu")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True)
        if d == 64:
            assert type(out.grad_fn).__name__ == "_AttentionBackward"
            assert not any(fn is not None and "Transpose" in type(fn).__name__
                           for fn, _ in out.grad_fn.next_functions)
        assert out.shape == q.shape and out.stride() == q.stride()
        out.backward(do)
        for leaf in leaves:
            assert leaf.grad.shape == leaf.shape and leaf.grad.stride() == leaf.stride()
        exact, lowp = references(q, k, v, do, True)
        check([out.detach(), *(t.grad for t in leaves)], [exact[0], *exact[2:]],
              [lowp[0], *lowp[2:]], ["out", "dq", "dk", "dv"], [2, 3, 3, 3], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_scale_and_plain_return(device):
    q, k, v, do = blhd(1, 19, 23, 4, 2, 128, torch.float32, device)
    out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    exact, lowp = references(q, k, v, do, True, scale=0.3)
    check([out], exact[:1], lowp[:1], ["out"], [2], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_kvpacked_and_qkvpacked_equal_the_unpacked_call(causal, device):
    """The packed variants are the same maths on slices of one tensor: same values, and the
    packed tensor's gradient is the slices' gradients."""
    b, n, h, d = 2, 45, 4, 64
    qkv = torch.randn(b, n, 3, h, d, device=device, requires_grad=True)
    do = torch.randn(b, n, h, d, device=device)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref, ref_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref.backward(do)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
    out.backward(do)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    q = torch.randn(b, n, h, d, device=device, requires_grad=True)
    kv = torch.randn(b, n, 2, h // 2, d, device=device, requires_grad=True)  # GQA 2:1
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    ref = flash_attn_func(q, k, v, causal=causal)
    ref.backward(do)
    out = flash_attn_kvpacked_func(q.detach(), kv, causal=causal)
    out.backward(do)
    assert torch.equal(out, ref)
    assert torch.equal(kv.grad, torch.stack([k.grad, v.grad], dim=2))


UNSUPPORTED = [
    ({"dropout_p": 0.1}, "dropout_p"),
]


@pytest.mark.parametrize("changes,name", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_arguments_are_refused_by_name(changes, name):
    q, k, v, _ = blhd(1, 8, 8, 4, 4, 64, torch.float32, "cpu")
    qkv = torch.stack([q, k, v], dim=2)
    for call in (lambda: flash_attn_func(q, k, v, **changes),
                 lambda: flash_attn_kvpacked_func(q, qkv[:, :, 1:], **changes),
                 lambda: flash_attn_qkvpacked_func(qkv, **changes)):
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()
    # the defaults, and lists where flash-attn's callers pass them, are accepted
    flash_attn_func(q, k, v, dropout_p=0.0, window_size=[-1, -1], softcap=0.0,
                    alibi_slopes=None, deterministic=False)


@pytest.mark.parametrize("causal", [False, True])
def test_score_modifiers_as_flash_attn_defines_them(causal):
    """window_size, softcap and alibi_slopes reach the kernels with flash-attn's bottom-right
    alignment: the same numbers as ``attention`` on the (B, H, L, D) views, on every entry
    point (packed ones too)."""
    from tvm_flash import attention

    q, k, v, _ = blhd(2, 37, 50, 4, 2, 64, torch.float32, "cpu")
    mods = {"window_size": (9, 2), "softcap": 3.0, "alibi_slopes": torch.rand(2, 4)}
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **mods)
    ref, ref_lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             is_causal=causal, causal_alignment="bottom-right", enable_gqa=True,
                             return_lse=True, **mods)
    assert torch.equal(out, ref.transpose(1, 2))
    assert torch.equal(lse, ref_lse)
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(flash_attn_kvpacked_func(q, kv, causal=causal, **mods), out)
    qkv = torch.stack([q[:, :37], q[:, :37], q[:, :37]], dim=2)
    self_ref = attention(*(qkv[:, :, 0].transpose(1, 2),) * 3, is_causal=causal,
                         causal_alignment="bottom-right", **mods)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=causal, **mods),
                               self_ref.transpose(1, 2), rtol=0, atol=0)


BAD_INPUTS = [
    ("rank", {"q": torch.randn(1, 5, 64)}, ValueError,
     "q: expected 4 dimensions (B, L, H, D), got shape (1, 5, 64)"),
    ("dtype", {"q": torch.randn(1, 5, 2, 64, dtype=torch.float64)}, TypeError, "q: dtype"),
    ("k dtype", {"k": torch.randn(1, 5, 2, 64, dtype=torch.float16)}, TypeError,
     "k: dtype torch.float16 differs from q's"),
    ("head_dim", {"q": torch.randn(1, 5, 2, 264), "k": torch.randn(1, 5, 2, 264),
                  "v": torch.randn(1, 5, 2, 264)}, ValueError, "q: head_dim 264"),
    ("v shape", {"v": torch.randn(1, 6, 2, 64)}, ValueError, "v: shape (1, 6, 2, 64)"),
    ("heads do not divide", {"k": torch.randn(1, 5, 3, 64), "v": torch.randn(1, 5, 3, 64),
                             "q": torch.randn(1, 5, 4, 64)}, ValueError,
     "k: 3 key/value heads do not divide q's 4 query heads"),
    ("scale", {"softmax_scale": -1.0}, ValueError, "softmax_scale: must be a finite positive"),
    ("not a tensor", {"v": [[1.0]]}, TypeError, "v: expected a torch.Tensor"),
]


@pytest.mark.parametrize("case,changes,exc,text", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_named(case, changes, exc, text):
    kwargs = {"q": torch.randn(1, 5, 2, 64), "k": torch.randn(1, 5, 2, 64),
              "v": torch.randn(1, 5, 2, 64), **changes}
    with pytest.raises(exc, match=re.escape(text)):
        flash_attn_func(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


def test_bad_packed_input_is_named():
    q = torch.randn(1, 5, 2, 64)
    with pytest.raises(ValueError, match=re.escape("kv: expected 5 dimensions "
                                                   "(B, Lk, 2, Hkv, D), got shape (1, 5, 3,")):
        flash_attn_kvpacked_func(q, torch.randn(1, 5, 3, 2, 64))
    with pytest.raises(ValueError, match=re.escape("qkv: expected 5 dimensions "
                                                   "(B, L, 3, H, D)")):
        flash_attn_qkvpacked_func(torch.randn(1, 5, 2, 64))
    with pytest.raises(TypeError, match=re.escape("kv: expected a torch.Tensor")):
        flash_attn_kvpacked_func(q, None)
    with pytest.raises(TypeError, match=re.escape("kv[:, :, 0]: dtype torch.float16 differs")):
        flash_attn_kvpacked_func(q, torch.randn(1, 5, 2, 2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=re.escape("kv[:, :, 0]: shape (1, 5, 2, 32)")):
        flash_attn_kvpacked_func(q, torch.randn(1, 5, 2, 2, 32))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    q, k, v, do = blhd(2, 40, 40, 4, 2, 64, torch.float32, device)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return (out * do).sum() + lse.sum()

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref_loss = step(*leaves)
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    assert math.isfinite(loss.item())
