"""Attention sinks (values and all gradients) and numeric guards."""

import math

import pytest
import torch
from checks import check_against_reference, make_inputs
from conftest import DEVICES

from tvm_flash import attention, attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 97), (97, 97), (97, 7), (3, 300)])
@pytest.mark.parametrize("causal", ["none", "top-left", "bottom-right"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sinks_values_and_gradients(dtype, causal, lq, lk, device):
    """O, LSE and the gradients of q, k, v and the sinks against float64 autograd."""
    q, k, v, do = make_inputs(2, 8, 2, lq, lk, 64, dtype, device)
    sinks = 2 * torch.randn(8, device=device)
    check_against_reference(q, k, v, do, causal, sinks=sinks)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("lq,lk", [(97, 97), (300, 33)])
@pytest.mark.parametrize("causal", ["top-left", "bottom-right"])
@pytest.mark.parametrize("d,dtype", [(160, torch.bfloat16), (256, torch.float16)])
def test_sinks_large_head_dims(d, dtype, causal, lq, lk, device):
    """Sinks on the D > 128 warp-level kernels (GPU only)."""
    q, k, v, do = make_inputs(1, 4, 2, lq, lk, d, dtype, device)
    sinks = 2 * torch.randn(4, device=device)
    check_against_reference(q, k, v, do, causal, sinks=sinks)


@pytest.mark.parametrize("device", DEVICES)
def test_sinks_in_input_dtype_get_gradient_in_that_dtype(device):
    q, k, v, do = make_inputs(1, 4, 4, 9, 9, 64, torch.bfloat16, device)
    sinks = torch.randn(4, device=device, dtype=torch.bfloat16, requires_grad=True)
    attention(q, k, v, sinks=sinks).backward(do)
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (4,)


@pytest.mark.parametrize("device", DEVICES)
def test_sinks_with_no_keys(device):
    """Lk = 0: the sink is the only 'key'; O = 0 and LSE = sink, gradients zero."""
    q = torch.randn(1, 2, 3, 64, device=device)
    k = v = torch.randn(1, 2, 0, 64, device=device)
    sinks = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
    out, lse = attention(q, k, v, sinks=sinks, return_lse=True)
    assert torch.all(out == 0)
    torch.testing.assert_close(lse, sinks.detach()[None, :, None].expand(1, 2, 3))
    out.sum().backward()
    assert torch.all(sinks.grad == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_sinks_fully_masked_rows(device):
    """Bottom-right with Lq > Lk: rows with no key still see the sink: O = 0, LSE = sink."""
    q, k, v, do = make_inputs(1, 2, 2, 12, 4, 64, torch.float32, device)
    sinks = torch.randn(2, device=device)
    out, lse, dq, _, _, _ = check_against_reference(q, k, v, do, "bottom-right", sinks=sinks)
    assert torch.all(out[:, :, :8] == 0) and torch.all(dq[:, :, :8] == 0)
    torch.testing.assert_close(lse[:, :, :8], sinks[None, :, None].expand(1, 2, 8))


# ------------------------------------------------------------------------- numeric guards


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", ["none", "top-left"])
def test_large_logits_fp32(causal, device):
    """|q.k| * scale around 1e4: the online softmax stays finite and accurate.

    The backward recomputes P from the stored float32 LSE, which at |LSE| ~ 1e4 is itself only
    known to ~1e-3 (its ulp): P, and so every gradient, carries that relative error. The floor
    is that ulp times the size of dO (torch's own backward reuses its softmax output instead).
    """
    q, k, v, do = make_inputs(1, 2, 2, 65, 65, 64, torch.float32, device)
    q, k = q * 12, k * 12  # q.k ~ 144 * 8 = 1.2e3 typical, ~1e4 at the tails, scale 1
    logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * logits * do.abs().max().item()
    check_against_reference(q, k, v, do, causal, scale=1.0, floor=floor)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_near_max_never_overflows(device):
    """fp16 values near the top of the range: products and sums are fp32, the output is fine.

    (Computing the same in fp16 would overflow, so this compares with float64 directly.)
    """
    q, k, v, _ = make_inputs(1, 2, 2, 40, 40, 64, torch.float16, device)
    q, k = (q.float() * 60).half(), (k.float() * 60).half()  # logits ~ 1e4..1e5 in fp32
    v = (v.float().clamp(-2, 2) * 30000).half()  # |v| up to 60000 (fp16 max 65504)
    out = attention(q, k, v, is_causal=True)
    ref, _ = attention_reference(q, k, v, causal="top-left")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=60, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_propagate_to_what_they_touch(bad, dtype, device):
    """Defined behaviour: a non-finite input is never silently dropped.

    * q[b, h, i] non-finite -> exactly row i of head h is non-finite.
    * k[b, hk, j] or v[b, hk, j] non-finite -> every row that sees key j (with causal
      top-left masking, rows i >= j of every query head reading key/value head hk) is
      non-finite; query heads reading other key/value heads stay finite. Rows that mask key j
      but share its tile may turn non-finite too (0 * NaN in P V, exactly as in torch SDPA's
      maths). An infinite key entry gives the logit +-inf by the sign of the query entry it
      meets: -inf is a masked key (those rows stay finite), +inf makes the row non-finite.
    """
    b, hq, hkv, length, d = 1, 4, 2, 20, 64
    for which in ("q", "k", "v"):
        q, k, v, _ = make_inputs(b, hq, hkv, length, length, d, dtype, device)
        t = {"q": q, "k": k, "v": v}[which]
        t[0, 1, 7, 3] = bad
        out = attention(q, k, v, is_causal=True, enable_gqa=True)
        nonfinite = ~torch.isfinite(out).all(dim=-1)[0]  # (heads, rows)
        if which == "q":
            expected = torch.zeros_like(nonfinite)
            expected[1, 7] = True
            assert torch.equal(nonfinite, expected), f"q: rows {nonfinite.nonzero().tolist()}"
        else:  # key/value head 1 serves query heads 2 and 3
            touched = nonfinite[2:, 7:]
            if which == "k" and bad == math.inf:
                touched = touched[q[0, 2:, 7:, 3] > 0]
            assert touched.all(), f"{which}: rows {nonfinite.nonzero().tolist()}"
            assert not nonfinite[:2].any(), f"{which}: rows {nonfinite.nonzero().tolist()}"
