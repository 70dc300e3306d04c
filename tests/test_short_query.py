"""The short-query ("vector") path: Lq <= plan.SHORT_QUERY_MAX (12) takes packed-row, key-split
kernels. Values and gradients against float64, with the number of key splits forced so that
splits (including empty ones) and their merge are exercised on every device."""

import pytest
import torch
from checks import check_against_reference, make_inputs
from conftest import DEVICES

from tvm_flash import attention, plan
from tvm_flash.opspec import PART_STATS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CAUSAL = ["none", "top-left", "bottom-right"]
# (head_dim, query heads, key/value heads): MHA, GQA 4:1, MQA 8:1
SHAPES = [(64, 4, 4), (64, 8, 2), (128, 8, 1)]


@pytest.fixture
def launches(monkeypatch):
    """The kernels launched, in order (plans made meanwhile hold recording kernels)."""
    seen = []
    real = plan.kernel

    def recording(key):
        fn = real(key)

        def record(*args):
            seen.append(key.op)
            return fn(*args)
        return record

    plan.clear()
    monkeypatch.setattr(plan, "kernel", recording)
    yield seen
    plan.clear()


def force_splits(monkeypatch, n):
    monkeypatch.setattr(plan, "num_splits", lambda q, k, packed_rows, units: n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,hq,hkv", SHAPES)
@pytest.mark.parametrize("lq", [1, 3, 8])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_query_matches_reference(dtype, causal, lq, d, hq, hkv, device, monkeypatch,
                                       launches):
    force_splits(monkeypatch, 3)  # 700 keys -> splits of 256, 256 and 188 keys
    q, k, v, do = make_inputs(2, hq, hkv, lq, 700, d, dtype, device)
    check_against_reference(q, k, v, do, causal)
    assert launches == ["fwd_split", "fwd_merge", "bwd_pre", "dq_split", "dq_merge",
                        "dkv_packed"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("d,hq,hkv", [(32, 8, 8), (96, 8, 2), (160, 8, 1), (192, 4, 2),
                                      (224, 2, 1), (256, 8, 2)])
@pytest.mark.parametrize("lq", [1, 5])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_short_query_every_head_dim_on_cuda(dtype, causal, lq, d, hq, hkv, monkeypatch,
                                            launches):
    """The ``mma.sync`` split kernel (``cuda_mma.flash_forward_split``) at the head dims the
    other tests leave out, each tile (16-key steps in three stages above D = 128), with an
    empty split and a (B, L, H, D) query view."""
    force_splits(monkeypatch, 6)  # 300 keys -> five splits of up to 64 and an empty one
    q, k, v, do = make_inputs(2, hq, hkv, lq, 300, d, dtype, "cuda")
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    check_against_reference(q, k, v, do, causal)
    assert launches[:2] == ["fwd_split", "fwd_merge"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("causal", CAUSAL)
def test_split_counts_including_empty_splits(causal, splits, device, monkeypatch):
    """100 keys in 8 splits of 64: splits 2..7 hold no key and must add nothing."""
    force_splits(monkeypatch, splits)
    q, k, v, do = make_inputs(1, 4, 2, 5, 100, 64, torch.float16, device)
    check_against_reference(q, k, v, do, causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq", [1, 8, 12])
def test_short_query_with_sinks(lq, causal, device, monkeypatch):
    force_splits(monkeypatch, 4)
    q, k, v, do = make_inputs(2, 8, 2, lq, 300, 64, torch.bfloat16, device)
    sinks = torch.randn(8, device=device)
    check_against_reference(q, k, v, do, causal, sinks=sinks)


@pytest.mark.parametrize("device", DEVICES)
def test_short_and_tiled_paths_agree(device, monkeypatch):
    q, k, v, _ = make_inputs(2, 8, 2, 6, 500, 64, torch.float32, device)
    short = attention(q, k, v, is_causal=True, causal_alignment="bottom-right",
                      enable_gqa=True)
    monkeypatch.setattr(plan, "SHORT_QUERY_MAX", 0)
    tiled = attention(q, k, v, is_causal=True, causal_alignment="bottom-right",
                      enable_gqa=True)
    torch.testing.assert_close(short, tiled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_short_query_backward_is_deterministic(device, monkeypatch):
    force_splits(monkeypatch, 5)
    q, k, v, do = make_inputs(2, 8, 2, 4, 1025, 64, torch.bfloat16, device)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, enable_gqa=True).backward(do)
        return [t.grad for t in leaves]

    for a, b in zip(grads(), grads(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_path_beyond_the_threshold(device, launches):
    q, k, v, do = make_inputs(1, 2, 2, plan.SHORT_QUERY_MAX + 1, 40, 64, torch.float32, device)
    check_against_reference(q, k, v, do, "none")
    assert launches == ["fwd", "bwd_pre", "dq", "dkv"]


def test_num_splits_fills_the_device_but_keeps_splits_long():
    q = torch.empty(1, 32, 1, 128)
    k = torch.empty(1, 8, 128 * 1024, 128)
    units = 2 * 132  # an H100: two blocks per SM
    n = plan.num_splits(q, k, plan.PACKED_ROWS, units)
    assert n == 33  # 8 key/value heads x 1 tile (their 4 query heads packed): 33 x 8 = 264
    assert 1 <= n <= 128 * 1024 // plan.KEYS_PER_SPLIT_MIN
    # 300 keys: at most ceil(300 / KEYS_PER_SPLIT_MIN) splits
    assert plan.num_splits(q, torch.empty(1, 8, 300, 128), plan.PACKED_ROWS, units) == (
        -(-300 // plan.KEYS_PER_SPLIT_MIN))
    # already enough blocks
    assert plan.num_splits(torch.empty(64, 32, 8, 128), k, plan.PACKED_ROWS, units) == 1


@pytest.mark.parametrize("kind", ["llvm", "cuda", "metal"])
def test_packed_rows_is_the_schedules_tile(kind):
    """The split sizing uses the row count every target's schedule gives short-query tiles."""
    from tvm_flash.build import schedules
    from tvm_flash.key import PACKED_BASE, KernelKey

    target = {"llvm": "llvm", "cuda": "cuda-sm_90", "metal": "metal"}[kind]
    for op in PACKED_BASE:
        for dtype in ("float16", "float32"):
            key = KernelKey(op, 64, dtype, "top-left", 4, target)
            assert schedules.for_target(kind).tile_config(key).block_q == plan.PACKED_ROWS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", ["none", "bottom-right"])
def test_raw_short_query_kernels_overwrite_poisoned_outputs(causal, device):
    """Call the short-query kernels directly with NaN-filled partials and outputs (3 splits,
    the last one empty): every element is written."""
    from tvm_flash.artifacts import kernel
    from tvm_flash.key import KernelKey
    from tvm_flash.target import target_tag_for_device

    b, hq, hkv, lq, lk, d, ns = 2, 4, 2, 3, 70, 64, 3
    q, k, v, do = make_inputs(b, hq, hkv, lq, lk, d, torch.float32, device)

    def poisoned(*shape):
        return torch.full(shape, float("nan"), device=device)

    meta = {"head_dim": d, "dtype": "float32", "target": target_tag_for_device(q.device)}
    tiled = {**meta, "causal": causal, "group": hq // hkv}
    row_wise = {**meta, "causal": "none", "group": 1}
    part = poisoned(ns * b, hq, lq, d + PART_STATS)
    out, lse = poisoned(b, hq, lq, d), poisoned(b, hq, lq)
    kernel(KernelKey("fwd_split", **tiled))(q, k, v, part, 0.125)
    kernel(KernelKey("fwd_merge", **row_wise))(part, poisoned(hq), out, lse)
    delta, dq_part = poisoned(b, hq, lq), poisoned(ns * b, hq, lq, d)
    dq, dk, dv = poisoned(*q.shape), poisoned(*k.shape), poisoned(*v.shape)
    kernel(KernelKey("bwd_pre", **row_wise))(out, do, delta)
    kernel(KernelKey("dq_split", **tiled))(q, k, v, do, lse, delta, dq_part, 0.125)
    kernel(KernelKey("dq_merge", **row_wise))(dq_part, dq, 0.125)
    kernel(KernelKey("dkv_packed", **tiled))(q, k, v, do, lse, delta, dk, dv, 0.125)
    if device == "cuda":
        torch.cuda.synchronize()
    # part: outputs, max and sum (its last two columns are padding)
    for name, t in (("part", part[..., :d + 2]), ("out", out),
                    ("lse", lse), ("dq_part", dq_part), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"
    ref = attention(q, k, v, scale=0.125, is_causal=causal != "none",
                    causal_alignment="bottom-right", enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
