"""Packed sequences of different lengths (varlen) against the float64 reference.

Each sequence of a packed batch is checked against the reference run on it alone, with the
tolerance rule of checks.py (2x / 3x the error of the same maths in the input precision):
empty sequences (no queries, or no keys), length 1, Lq != Lk per sequence, GQA, every causal
mode, score modifiers and sinks. Then determinism, flash-attn's varlen entry points and the
errors bad ``cu_seqlens`` get.
"""

import itertools

import pytest
import torch
from checks import FLOOR, _err, reference
from conftest import DEVICES

import tvm_flash
from tvm_flash import flash_attn_varlen_func, varlen_attention
from tvm_flash.flash_attn import flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

CAUSAL = ["none", "top-left", "bottom-right"]


def _cu(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def packed(lens_q, lens_k, hq, hkv, d, dtype, device):
    """q, k, v, dO packed, and their cu_seqlens."""
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device)
    v = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device)
    return q, k, v, torch.randn_like(q), _cu(lens_q, device), _cu(lens_k, device)


def check_varlen(lens_q, lens_k, hq, hkv, d, dtype, device, causal, sinks=None, **mods):
    """Ours on the packed batch; each sequence within bounds of the reference on it alone."""
    q, k, v, do, cu_q, cu_k = packed(lens_q, lens_k, hq, hkv, d, dtype, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    is_causal = causal != "none"
    out, lse = varlen_attention(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                is_causal=is_causal, enable_gqa=True,
                                causal_alignment=causal if is_causal else "top-left",
                                sinks=sinks, return_lse=True, **mods)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    out.backward(do)
    alibi = mods.pop("alibi_slopes", None)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for s, ((q0, q1), (k0, k1)) in enumerate(zip(zip(bq[:-1], bq[1:], strict=True),
                                                 zip(bk[:-1], bk[1:], strict=True),
                                                 strict=True)):
        if q1 == q0:
            continue

        def bhld(t):
            return t.transpose(0, 1)[None]

        one = {**mods, "alibi_slopes": None if alibi is None else (
            alibi if alibi.dim() == 1 else alibi[s])}
        args = (bhld(q[q0:q1]), bhld(k[k0:k1]), bhld(v[k0:k1]), bhld(do[q0:q1]), causal)
        exact = reference(*args, torch.float64, None, sinks, one)
        lowp = reference(*args, dtype, None, sinks, one)
        ours = [bhld(out[q0:q1]).detach(), lse[None, :, q0:q1], bhld(leaves[0].grad[q0:q1]),
                bhld(leaves[1].grad[k0:k1]), bhld(leaves[2].grad[k0:k1])]
        for name, o, e, lp, mult in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, lowp,
                                        (2, 2, 3, 3, 3), strict=False):
            err, _ = _err(o, e)
            bound = mult * _err(lp, e)[0] + FLOOR[dtype]
            assert err <= bound, f"sequence {s} {name}: max error {err:.3g} > {bound:.3g}"
        assert torch.equal(torch.isinf(ours[1]), torch.isinf(exact[1])), f"sequence {s} lse"
    return out, lse, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_packed_batch(dtype, causal, device):
    """Sequences of 1, 97, 0, 7 and 130 queries against 1, 97, 5, 0 and 129 keys: an empty
    query sequence, one with no keys (LSE -inf, zero output), Lq != Lk both ways; GQA 2:1."""
    check_varlen([1, 97, 0, 7, 130], [1, 97, 5, 0, 129], 4, 2, 64, dtype, device, causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,hq,hkv", [(128, 2, 2), (64, 8, 1)])
def test_packed_long_and_heads(d, hq, hkv, device):
    """A sequence past several tiles (1025) next to short ones; MHA at D 128, MQA 8:1."""
    check_varlen([1025, 3, 64], [1025, 40, 64], hq, hkv, d, torch.float32, device,
                 "bottom-right")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_with_modifiers_and_sinks(dtype, causal, device):
    """Window, soft cap, per-sequence ALiBi slopes and sinks on packed sequences."""
    hq = 4
    check_varlen([40, 1, 0, 100], [50, 1, 3, 90], hq, 2, 64, dtype, device, causal,
                 sinks=torch.randn(hq, device=device), window_size=(20, 3), softcap=4.0,
                 alibi_slopes=torch.rand(4, hq, device=device) * 0.3)


def test_packed_equals_dense_batch():
    """Sequences of one length packed give the dense batch's numbers (the same kernels'
    maths), bit for bit, and the backward is deterministic run to run."""
    b, n, h, d = 3, 45, 4, 64
    q, k, v = (torch.randn(b, n, h, d) for _ in range(3))
    do = torch.randn(b, n, h, d)
    dense = tvm_flash.flash_attn_func(q, k, v, causal=True)
    cu = _cu([n] * b, "cpu")
    flat = [t.reshape(b * n, h, d).requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*flat, cu, cu, n, n, is_causal=True)
    torch.testing.assert_close(out.reshape(b, n, h, d), dense, rtol=0, atol=0)
    grads = []
    for _ in range(2):
        out = varlen_attention(*flat, cu, cu, n, n, is_causal=True)
        grads.append(torch.autograd.grad(out, flat, do.reshape(b * n, h, d)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_flash_attn_varlen_entry_points():
    """flash-attn's varlen functions: bottom-right causal per sequence, LSE (Hq, total_q);
    kv- and qkv-packed give the same numbers."""
    lens = [13, 1, 30]
    q, k, v, _, cu, _ = packed(lens, lens, 4, 4, 64, torch.float32, "cpu")
    out, lse, none = flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True,
                                            return_attn_probs=True, window_size=(5, 0))
    ref, ref_lse = varlen_attention(q, k, v, cu, cu, 30, 30, is_causal=True,
                                    causal_alignment="bottom-right", window_size=(5, 0),
                                    return_lse=True)
    assert none is None and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 30, 30, causal=True,
                                                       window_size=(5, 0)), out)
    qkv = torch.stack([q, k, v], dim=1)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(qkv, cu, 30, causal=True,
                                                        window_size=(5, 0)), out)


def _inputs():
    q, k, v, _, cu_q, cu_k = packed([3, 5], [4, 4], 2, 2, 64, torch.float32, "cpu")
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": 5, "max_seqlen_k": 4}


BAD = [
    ({"cu_seqlens_q": torch.tensor([0, 3, 8])}, TypeError, "^cu_seqlens_q: dtype"),
    ({"cu_seqlens_q": [0, 3, 8]}, TypeError, "^cu_seqlens_q: expected a torch.Tensor"),
    ({"cu_seqlens_k": torch.tensor([[0, 4, 8]], dtype=torch.int32)}, ValueError,
     r"^cu_seqlens_k: expected shape \(batch \+ 1,\)"),
    ({"cu_seqlens_q": torch.tensor([0, 6, 8], dtype=torch.int32)}, ValueError,
     "^max_seqlen_q: 5 is shorter"),
    ({"cu_seqlens_q": torch.tensor([0, 9, 8], dtype=torch.int32)}, ValueError,
     "^cu_seqlens_q: must not decrease"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 9], dtype=torch.int32)}, ValueError,
     "^cu_seqlens_q: must start at 0 and end at the 8 rows"),
    ({"cu_seqlens_k": torch.tensor([1, 4, 8], dtype=torch.int32)}, ValueError,
     "^cu_seqlens_k: must start at 0"),
    ({"cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}, ValueError,
     "^cu_seqlens_k: shape"),
    ({"max_seqlen_k": 4.0}, TypeError, "^max_seqlen_k: expected an int"),
    ({"q": torch.randn(1, 8, 2, 64)}, ValueError, r"^q: expected 3 dimensions \(total, H, D\)"),
    ({"k": torch.randn(8, 3, 64), "v": torch.randn(8, 3, 64)}, ValueError,
     "^k: 3 key/value heads do not divide"),
]


@pytest.mark.parametrize("changes,error,match", BAD, ids=[b[2] for b in BAD])
def test_bad_packing_is_named(changes, error, match):
    with pytest.raises(error, match=match):
        varlen_attention(**{**_inputs(), **changes})


def test_cu_seqlens_are_read_once_per_tensor_and_content(monkeypatch):
    """A model hands every layer the same cu_seqlens: only the first call reads them on the
    host (a GPU synchronisation); an in-place change, or a new tensor, is read and checked
    again."""
    from tvm_flash import ops

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or real(t))
    args = _inputs()
    cu_q = args["cu_seqlens_q"]
    varlen_attention(**args)
    assert len(reads) == 2  # cu_seqlens_q and cu_seqlens_k
    varlen_attention(**args)
    assert len(reads) == 2  # nothing read again
    cu_q[1] = 9  # in place: the version moves, the bad content is seen
    with pytest.raises(ValueError, match="^cu_seqlens_q: must not decrease"):
        varlen_attention(**args)
    fresh = {**args, "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32)}
    varlen_attention(**fresh)
    assert len(reads) == 4  # the new cu_seqlens_q; cu_seqlens_k is still known
    with torch.inference_mode():  # no version counter: read every time
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        for _ in range(2):
            varlen_attention(**{**args, "cu_seqlens_q": cu})
    assert len(reads) == 6
    assert len(ops._cu_facts_seen) <= ops._CU_FACTS_KEPT
