"""Strided inputs (tvm_flash.layout): the layouts the kernels read where they lie, the copies
made of the others, and the layout of outputs and gradients (torch SDPA's)."""

import pytest
import torch
from checks import check_against_reference, launch_dq
from conftest import DEVICES
from torch._subclasses.fake_tensor import FakeTensorMode

import tvm_flash
import tvm_flash.ops
import tvm_flash.plan
from tvm_flash import KernelKey, attention_reference, layout
from tvm_flash.artifacts import kernel
from tvm_flash.target import target_tag_for_device


def _blhd(b, h, length, d, dtype, device, width=None):
    """``(B, H, L, D)`` view of ``(B, L, H, width)`` storage (``width`` default D), as a model's
    QKV projection followed by ``.transpose(1, 2)`` hands attention."""
    x = torch.randn(b, length, h, width or d, dtype=dtype, device=device)
    return x[..., :d].transpose(1, 2)


def _blhd_strides(t):
    """The strides of a dense (B, L, H, D)-backed (B, H, L, D) tensor shaped like ``t``."""
    b, h, length, d = t.shape
    return (length * h * d, d, h * d, 1)


@pytest.fixture
def launched(monkeypatch):
    """Every kernel launch's op and tensor arguments, as the binding passes them (the plans
    made while the fixture is active load spying kernels)."""
    calls = []
    load = tvm_flash.plan.kernel

    def spying(key):
        fn = load(key)

        def run(*args):
            calls.append((key.op, [a for a in args if isinstance(a, torch.Tensor)]))
            return fn(*args)
        return run

    monkeypatch.setattr(tvm_flash.plan, "kernel", spying)
    tvm_flash.plan.clear()
    yield calls
    tvm_flash.plan.clear()


def _passed_as_is(t, calls, ops):
    """Whether each of ``ops`` received ``t`` itself: its data pointer and strides."""
    for op in ops:
        args = [a for name, tensors in calls if name == op for a in tensors]
        assert args, f"{op} was not launched"
        assert any(a.data_ptr() == t.data_ptr() and a.stride() == t.stride() for a in args), op
    return True


# Lq 97 takes the tiled kernels (fwd, bwd_pre, dq, dkv), Lq <= SHORT_QUERY_MAX the
# short-query ones (fwd_split, fwd_merge, dq_split, dq_merge, dkv_packed).
LENGTHS = [(97, 97), (33, 130), (130, 7), (5, 130), (1, 33)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", ["none", "bottom-right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blhd_views_match_reference_in_sdpa_layout(dtype, causal, lq, lk, device):
    """q, k, v and dout as (B, L, H, D) storage viewed (B, H, L, D), GQA 4:1, odd lengths:
    forward and gradients against the float64 reference; out, dq, dk and dv come back
    (B, L, H, D)-backed, as torch SDPA returns them."""
    q, do = _blhd(2, 8, lq, 64, dtype, device), _blhd(2, 8, lq, 64, dtype, device)
    k, v = _blhd(2, 2, lk, 64, dtype, device), _blhd(2, 2, lk, 64, dtype, device)
    for t in (q, k, v, do):
        assert layout.kernel_view(t) is t
    out, lse, dq, dk, dv = check_against_reference(q, k, v, do, causal)
    for name, t, like in (("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert t.stride() == _blhd_strides(like), name
    assert lse.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq", [97, 5])
def test_blhd_views_reach_every_kernel_uncopied(lq, device, launched):
    """No copy anywhere: each kernel receives the caller's (B, L, H, D)-backed q, k, v and
    dout (same data pointer and strides) and writes out and the gradients in that layout."""
    q, do = _blhd(1, 4, lq, 64, torch.float16, device), _blhd(1, 4, lq, 64, torch.float16,
                                                                device)
    k, v = _blhd(1, 2, 80, 64, torch.float16, device), _blhd(1, 2, 80, 64, torch.float16,
                                                               device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(do)
    short = tvm_flash.plan.is_short(lq)
    fwd = ["fwd_split"] if short else ["fwd"]
    bwd = ["dq_split", "dkv_packed"] if short else ["dq", "dkv"]
    for t in (q, k, v):
        assert _passed_as_is(t, launched, fwd + bwd)
    # Delta: bwd_pre's, or the tiled dQ's where it computes it (the Hopper dQ: OpSpec.absorbs)
    delta_by = ["bwd_pre"] if any(op == "bwd_pre" for op, _ in launched) else ["dq"]
    assert not short or delta_by == ["bwd_pre"]
    assert _passed_as_is(do, launched, delta_by + bwd)
    assert _passed_as_is(out, launched, ["fwd_merge" if short else "fwd"] + delta_by)
    # the gradients the kernels write (the last tensor arguments) take their input's strides;
    # autograd hands them on (.grad is a copy here only because `launched` holds a reference)
    dq_op, dkv_op = ("dq_merge", "dkv_packed") if short else ("dq", "dkv")
    written = {"dq": [a for op, args in launched if op == dq_op for a in args[-1:]],
               "dk, dv": [a for op, args in launched if op == dkv_op for a in args[-2:]]}
    assert [t.stride() for t in written["dq"]] == [q.stride()]
    assert [t.stride() for t in written["dk, dv"]] == [k.stride(), v.stride()]
    for t in (q, k, v):
        assert t.grad.stride() == t.stride()


def _odd_head_stride(b, h, length, d, dtype, device):
    """Rows of a (B, L, H, D + 1) buffer: the head and row strides are not 16-byte multiples."""
    return _blhd(b, h, length, d, dtype, device, width=d + 1)


def _odd_offset(b, h, length, d, dtype, device):
    """A contiguous tensor whose data starts one element past a 16-byte boundary."""
    flat = torch.randn(b * h * length * d + 1, dtype=dtype, device=device)
    return flat[1:].view(b, h, length, d)


def _strided_last_dim(b, h, length, d, dtype, device):
    """(B, H, L, D) with D not contiguous (a transposed (B, H, D, L))."""
    return torch.randn(b, h, d, length, dtype=dtype, device=device).transpose(-1, -2)


def _fused_qkv_rows(b, h, length, d, dtype, device):
    """One third of a fused (B, L, 3, H, D) projection: aligned strides, not dense."""
    return torch.randn(b, length, 3, h, d, dtype=dtype, device=device)[:, :, 1].transpose(1, 2)


# (layout, copied by the binding, layout of the copy and of the outputs: "blhd" or "bhld")
LAYOUTS = [(_odd_head_stride, True, "blhd"), (_odd_offset, True, "bhld"),
           (_strided_last_dim, True, "bhld"), (_fused_qkv_rows, False, "blhd")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,copied,out_layout", LAYOUTS, ids=[m[0].__name__ for m in LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_unreadable_layouts_are_copied(dtype, make, copied, out_layout, device):
    """What the kernels cannot read (rows off 16-byte boundaries, a strided last dimension) is
    copied, and the result is still right; what they can read is not."""
    q, do = make(2, 4, 33, 64, dtype, device), make(2, 4, 33, 64, dtype, device)
    k, v = make(2, 2, 50, 64, dtype, device), make(2, 2, 50, 64, dtype, device)
    for t in (q, k, v, do):
        view = layout.kernel_view(t)
        assert (view is not t) == copied
        assert layout.readable(view) and torch.equal(view, t)
    out, lse = check_against_reference(q, k, v, do, "top-left")[:2]
    # the gradients as the backward op returns them (autograd makes a leaf's gradient
    # contiguous where the leaf is not dense, as it would SDPA's)
    dq, dk, dv, _ = torch.ops.tvm_flash.bwd(do, q, k, v, out, lse, None, "top-left", 0.125)
    for name, t, like in (("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        want = _blhd_strides(like) if out_layout == "blhd" else like.new_empty(like.shape).stride()
        assert t.stride() == want, name


def test_readable_rule():
    """The rule of layout.readable, case by case (16 bytes: 8 fp16 or 4 fp32 elements)."""
    assert layout.readable(torch.randn(2, 3, 5, 64))
    assert layout.readable(torch.randn(2, 5, 3, 64).transpose(1, 2))
    assert not layout.readable(torch.randn(2, 5, 3, 66)[..., :64].transpose(1, 2))
    assert layout.readable(torch.randn(2, 5, 3, 68)[..., :64].transpose(1, 2))  # 272 B rows
    assert not layout.readable(torch.randn(2, 5, 3, 68, dtype=torch.float16)[..., :64])
    assert layout.readable(torch.randn(2, 5, 3, 72, dtype=torch.float16)[..., :64])
    # a dimension of size 1 is never stepped over: its stride does not matter
    assert layout.readable(torch.randn(1, 3, 5, 64).as_strided((1, 3, 5, 64), (7, 320, 64, 1)))
    assert not layout.readable(torch.randn(2, 3, 64, 5).transpose(-1, -2))
    assert not layout.readable(torch.randn(2 * 3 * 5 * 64 + 1)[1:].view(2, 3, 5, 64))


def test_fake_ops_give_the_real_strides():
    """torch.compile traces the fake implementations: they return the strides the real ops
    do, for (B, L, H, D)-backed, copied and contiguous inputs."""
    for make in (_blhd, _strided_last_dim, _odd_head_stride):
        q, do = make(1, 4, 20, 64, torch.float32, "cpu"), make(1, 4, 20, 64, torch.float32, "cpu")
        k, v = make(1, 2, 30, 64, torch.float32, "cpu"), make(1, 2, 30, 64, torch.float32, "cpu")
        real = torch.ops.tvm_flash.fwd(q, k, v, None, "none", 0.125)
        real_bwd = torch.ops.tvm_flash.bwd(do, q, k, v, real[0], real[1], None, "none", 0.125)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fq, fk, fv, fdo = (mode.from_tensor(t) for t in (q, k, v, do))
            fake = torch.ops.tvm_flash.fwd(fq, fk, fv, None, "none", 0.125)
            fake_bwd = torch.ops.tvm_flash.bwd(fdo, fq, fk, fv, fake[0], fake[1], None, "none",
                                               0.125)
        for r, f in zip((*real, *real_bwd), (*fake, *fake_bwd), strict=True):
            assert (r.shape, r.stride()) == (f.shape, f.stride()), make.__name__


@pytest.mark.parametrize("device", DEVICES)
def test_raw_kernels_write_strided_outputs_in_place(device):
    """The compiled kernels called directly with (B, L, H, D)-backed inputs, and outputs that
    are rows of wider NaN-filled buffers: every element of each output view is written, and
    nothing between its rows."""
    b, hq, hkv, lq, lk, d, dt = 2, 4, 2, 45, 70, 64, torch.float32
    q, do = _blhd(b, hq, lq, d, dt, device), _blhd(b, hq, lq, d, dt, device)
    k, v = _blhd(b, hkv, lk, d, dt, device), _blhd(b, hkv, lk, d, dt, device)

    def poisoned_rows(h, length):
        wide = torch.full((b, length, h, 2 * d), float("nan"), dtype=dt, device=device)
        return wide, wide[..., :d].transpose(1, 2)

    meta = {"head_dim": d, "dtype": "float32", "causal": "top-left", "group": hq // hkv,
            "target": target_tag_for_device(q.device)}
    scale = 0.125
    (out_buf, out), (dq_buf, dq) = poisoned_rows(hq, lq), poisoned_rows(hq, lq)
    (dk_buf, dk), (dv_buf, dv) = poisoned_rows(hkv, lk), poisoned_rows(hkv, lk)
    lse, delta = q.new_empty(q.shape[:3]), q.new_empty(q.shape[:3])
    kernel(KernelKey("fwd", **meta))(q, k, v, lse.new_empty(hq), out, lse, scale)
    kernel(KernelKey("bwd_pre", **{**meta, "causal": "none", "group": 1}))(out, do, delta)
    launch_dq(KernelKey("dq", **meta), q, k, v, do, lse, out, delta, dq, scale)
    kernel(KernelKey("dkv", **meta))(q, k, v, do, lse, delta, dk, dv, scale)
    if device == "cuda":
        torch.cuda.synchronize()
    for name, buf in (("out", out_buf), ("dq", dq_buf), ("dk", dk_buf), ("dv", dv_buf)):
        assert not torch.isnan(buf[..., :d]).any(), f"{name}: unwritten elements"
        assert torch.isnan(buf[..., d:]).all(), f"{name}: written outside its rows"
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(qr, kr, vr, causal="top-left", scale=scale)
    ref.backward(do.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for name, got, want in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_kernels_refuse_rows_off_16_bytes():
    """Called directly (past kernel_view), the warp-level CUDA kernels refuse strides that are
    not multiples of 16 bytes with an error instead of reading misaligned rows."""
    q = _odd_head_stride(1, 2, 64, 64, torch.bfloat16, "cuda")
    k, v = (torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out, lse = torch.empty_like(k), torch.empty(1, 2, 64, device="cuda")
    fn = kernel(KernelKey("fwd", 64, "bfloat16", "none", 1, target_tag_for_device(q.device)))
    with pytest.raises(ValueError, match="multiples of 8 elements"):
        fn(q, k, v, lse.new_empty(2), out, lse, 0.125)
