"""Custom ops, torch.compile, CUDA graphs, the SDPA-compatible function and the module."""

import pytest
import torch
from conftest import DEVICES

import tvm_flash
from tvm_flash.nn import SelfAttention, scaled_dot_product_attention


def _qkv(device, dtype=torch.float32, lq=40, lk=40, hq=4, hkv=2, d=64):
    q = torch.randn(2, hq, lq, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, hkv, lk, d, device=device, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v = _qkv(device)
    sinks = torch.randn(4, device=device, requires_grad=True)
    # non-contiguous q, as a fused qkv projection gives it: out takes q's layout in both the
    # real and the fake op
    q_view = torch.randn(2, 40, 4, 64, device=device).transpose(1, 2).requires_grad_()
    torch.library.opcheck(torch.ops.tvm_flash.fwd.default, (q_view, k, v, None, "none", 0.1))
    for s in (None, sinks):
        torch.library.opcheck(torch.ops.tvm_flash.fwd.default, (q, k, v, s, "top-left", 0.125))
        out, lse = torch.ops.tvm_flash.fwd(q, k, v, s, "top-left", 0.125)
        do = torch.randn_like(out)
        torch.library.opcheck(torch.ops.tvm_flash.bwd.default,
                              (do, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                               None if s is None else s.detach(), "top-left", 0.125))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_no_graph_break(device):
    q, k, v = _qkv(device)

    def step(q, k, v):
        return (tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True) * 2).sum()

    # On CPU aot_eager checks tracing (fake impls, autograd) without a C++ toolchain run;
    # on CUDA the default inductor backend compiles the surrounding graph.
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = step(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_replay_is_identical():
    q, k, v = _qkv("cuda", torch.bfloat16, lq=300, lk=300)
    do = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: load modules, allocate outside the capture
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, eager, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_current_stream():
    """Work queued on a side stream is ordered by that stream, not the default one."""
    q, k, v = _qkv("cuda", torch.float16, lq=512, lk=512)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = q * 1.0
        out = tvm_flash.attention(a, k, v, enable_gqa=True)
        expected = torch.nn.functional.scaled_dot_product_attention(a, k, v, enable_gqa=True)
    side.synchronize()
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_compatible_function(device):
    q, k, v = _qkv(device)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_self_attention_module_matches_sdpa(device):
    torch.manual_seed(1)
    ours = SelfAttention(256, heads=4, kv_heads=2, impl="tvm").to(device)
    ref = SelfAttention(256, heads=4, kv_heads=2, impl="sdpa").to(device)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 50, 256, device=device)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_modifiers_and_packed_sequences(device):
    """The ops' trailing values (window, cap, slopes, cu_seqlens, max lengths) keep their
    fake implementations, schemas and autograd formula right, and torch.compile traces a call
    with modifiers without a graph break."""
    q, k, v = _qkv(device)
    slopes = torch.rand(2, 4, device=device)
    options = (5, 0, 3.0, slopes)
    torch.library.opcheck(torch.ops.tvm_flash.fwd.default,
                          (q, k, v, None, "bottom-right", 0.125, *options))
    out, lse = torch.ops.tvm_flash.fwd(q, k, v, None, "bottom-right", 0.125, *options)
    torch.library.opcheck(torch.ops.tvm_flash.bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                           out.detach(), lse, None, "bottom-right", 0.125, *options))
    # packed sequences: (1, H, total, D) views of (total, H, D) tensors
    cu = torch.tensor([0, 30, 30, 80], dtype=torch.int32, device=device)
    pq, pk, pv = (torch.randn(80, h, 64, device=device).transpose(0, 1)[None].requires_grad_()
                  for h in (4, 2, 2))
    torch.library.opcheck(torch.ops.tvm_flash.fwd.default,
                          (pq, pk, pv, None, "none", 0.125, -1, -1, 0.0, None, cu, cu, 50, 50))

    def step(q, k, v):
        out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True, window_size=(8, 0),
                                  softcap=2.0, alibi_slopes=slopes)
        return (out * 2).sum()

    backend = "inductor" if device == "cuda" else "aot_eager"
    loss = torch.compile(step, fullgraph=True, backend=backend)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref = torch.autograd.grad(step(q, k, v), (q, k, v))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r)


def test_self_attention_module_with_modifiers():
    """nn.SelfAttention's window, soft cap and ALiBi reach the kernels (the module equals
    attention() on its projections), and impl="sdpa" refuses them by name."""
    torch.manual_seed(1)
    module = SelfAttention(256, heads=4, kv_heads=2, window_size=(6, 0), softcap=5.0,
                           alibi=True)
    x = torch.randn(2, 30, 256)
    b, n, _ = x.shape
    q, k, v = module.qkv(x).split([256, 128, 128], -1)
    q, k, v = (t.view(b, n, -1, 64).transpose(1, 2) for t in (q, k, v))
    o = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True, window_size=(6, 0),
                            softcap=5.0, alibi_slopes=tvm_flash.nn.alibi_slopes(4))
    torch.testing.assert_close(module(x), module.proj(o.transpose(1, 2).reshape(b, n, 256)))
    with pytest.raises(ValueError, match="^window_size: "):
        SelfAttention(256, heads=4, impl="sdpa", window_size=(6, 0))
