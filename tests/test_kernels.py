"""Kernel structure, the raw kernel entry points with poisoned outputs, and input errors."""

import dataclasses
import functools
import importlib
import itertools
import math
import re
import shutil

import pytest
import torch
import tvm
from checks import FLOOR, _err, launch_dq, make_inputs, reference
from conftest import DEVICES

from tvm_flash import KernelKey, attention, attention_reference
from tvm_flash.artifacts import kernel
from tvm_flash.build import (
    compile_module,
    device_source,
    ptxas_figures,
    ptxas_log,
    scheduled_module,
    schedules,
)
from tvm_flash.kernels import FACTORIES, TileConfig
from tvm_flash.key import HEAD_DIMS, MERGE_OPS, OPS
from tvm_flash.target import make_target, target_tag_for_device


def _key(op, d, dtype, target, causal="bottom-right", group=4):
    """A key for ``op``; row-wise kernels get the causal mode and group they are keyed by."""
    if op in MERGE_OPS:
        causal, group = "none", 1
    return KernelKey(op, d, dtype, causal, group, target)


def _allocation_shapes(func):
    """Shapes of every buffer a kernel allocates, as written in its TVMScript."""
    return re.findall(r"T\.sblock_alloc_buffer\(\(([^)]*)\)", func.script())


@pytest.mark.parametrize("op", OPS)
def test_no_sequence_sized_buffer(op):
    """Every on-chip buffer has a constant shape: nothing Lq x Lk (or Lq-sized) is allocated."""
    key = _key(op, 64, "float16", "cuda-sm_90", "top-left", 2)
    shapes = _allocation_shapes(FACTORIES[op](key, TileConfig(64, 64)))
    assert shapes or op == "bwd_pre"  # the preprocess allocates nothing
    for shape in shapes:
        assert re.fullmatch(r"[\d, ]+", shape), f"symbolic allocation shape ({shape})"


@pytest.mark.parametrize("target", ["llvm", "cuda-sm_80", "cuda-sm_90"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_schedules_build(target, op, d, dtype):
    """Every kernel schedules and lowers for every target (CUDA source made without a GPU)."""
    mod = scheduled_module(_key(op, d, dtype, target))
    tvm.tirx.build(mod, target=make_target(target))


@pytest.mark.parametrize("target", ["cuda-sm_80", "cuda-sm_90"])
@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_tiled_kernels_are_warp_level_mma(target, op, dtype):
    """fp16/bf16 forward, dQ and dK/dV on sm_80+ are the warp-level kernels of
    schedules/cuda_mma.py: m16n8k16 tensor-core MMAs fed by ldmatrix, cp.async double buffering,
    no WMMA fragments."""
    key = _key(op, 64, dtype, target, "top-left", 2)
    src = device_source(compile_module(key))
    ptx = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4" in src and "cp.async.cg.shared.global" in src
    assert "wmma" not in src


# D > 128, a few keys each (lowering one takes seconds): every D and op, both dtypes and
# targets; sm_80 gets other tiles than sm_90 at D >= 224 (163 KiB of shared memory, not 227)
LARGE_D_CASES = [(160, "float16", "cuda-sm_80"), (192, "bfloat16", "cuda-sm_90"),
                 (224, "bfloat16", "cuda-sm_80"), (256, "float16", "cuda-sm_90"),
                 (256, "bfloat16", "cuda-sm_80")]


@functools.cache
def _mma_source(op, d, dtype, target, group):
    return device_source(compile_module(_key(op, d, dtype, target, "top-left", group)))


@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
@pytest.mark.parametrize("d,dtype,target", LARGE_D_CASES)
def test_large_head_dims_are_warp_level_mma(op, d, dtype, target):
    """D 160-256 in fp16/bf16 run the warp-level kernels too (one m-tile per warp; dK/dV with
    the head dim split over two warps), lowered for sm_80 and sm_90."""
    src = _mma_source(op, d, dtype, target, 2)
    ptx = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4" in src and "cp.async.cg.shared.global" in src


MAX_SPILL_BYTES = 48
"""ptxas spill allowance of the warp-level kernels: the chosen D <= 128 tiles sit at 255
registers, and those spilling at most 40 bytes measured faster than every spill-free
alternative (docs/journal/perf-history.md v6, v7); a fragment array pushed out to local memory
would spill hundreds. The D > 128 tiles spill nothing (``cuda_mma.LARGE_D_TILES``)."""


def _ptxas_spills(src, target):
    """Bytes ptxas spills in ``src`` assembled as ``scripts/build.py`` does
    (``build.ptxas_log``), and its log."""
    log = ptxas_log(target, src)
    return ptxas_figures(log)[1], log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_warp_level_kernels_stay_in_registers(op, d, dtype):
    """ptxas keeps every warp-level kernel in registers but for a few bytes
    (``MAX_SPILL_BYTES``)."""
    src = device_source(compile_module(_key(op, d, dtype, "cuda-sm_90", "top-left", 1)))
    spilled, log = _ptxas_spills(src, "cuda-sm_90")
    assert spilled <= MAX_SPILL_BYTES, log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
@pytest.mark.parametrize("d,dtype,target", LARGE_D_CASES)
def test_large_head_dim_kernels_stay_in_registers(op, d, dtype, target):
    """The D > 128 tiles assemble for their arch within the same allowance."""
    spilled, log = _ptxas_spills(_mma_source(op, d, dtype, target, 2), target)
    assert spilled <= MAX_SPILL_BYTES, log


@pytest.mark.parametrize("op,d,dtype,target", [
    ("fwd", 64, "float32", "cuda-sm_90"),  # fp32: the SIMT schedule
    ("fwd", 256, "float32", "cuda-sm_90"),
    ("bwd_pre", 64, "float32", "cuda-sm_90"),
    ("dq_split", 64, "bfloat16", "cuda-sm_90"),  # short-query path: dQ and its merge
    ("dq_merge", 64, "bfloat16", "cuda-sm_90"),
    ("fwd_split", 64, "float32", "cuda-sm_90"),
    ("dq", 64, "float16", "llvm"),
])
def test_other_kernels_are_scheduled_from_the_factories(op, d, dtype, target):
    assert not schedules.lowers(target.split("-")[0], _key(op, d, dtype, target))


def test_short_query_forward_with_score_modifiers_keeps_the_simt_split():
    """The warp-level split takes plain keys only (its packed rows span heads, whose ALiBi
    slopes and windows differ); a key with a modifier is scheduled from the factory."""
    key = dataclasses.replace(_key("fwd_split", 64, "bfloat16", "cuda-sm_90"), softcap=True)
    assert not schedules.lowers("cuda", key)


@functools.cache
def _short_source(op, d, dtype, target):
    return device_source(compile_module(_key(op, d, dtype, target)))


SHORT_CASES = [(32, "float16", "cuda-sm_80"), (64, "bfloat16", "cuda-sm_90"),
               (128, "float16", "cuda-sm_90"), (160, "bfloat16", "cuda-sm_80"),
               (256, "bfloat16", "cuda-sm_90a")]


@pytest.mark.parametrize("d,dtype,target", SHORT_CASES)
def test_short_query_forward_is_warp_level(d, dtype, target):
    """fp16/bf16 decode on sm_80+ runs ``cuda_mma.flash_forward_split`` (the queries as the
    MMA's n, P^T moved into B fragments by ``movmatrix``) and the warp-per-row merge."""
    src = _short_source("fwd_split", d, dtype, target)
    ptx = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in src
    assert "movmatrix.sync.aligned.m8n8.trans.b16" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in src and "cp.async.cg.shared.global" in src
    merge = _short_source("fwd_merge", d, dtype, target)
    assert "__shfl_sync" in merge and "__shfl_xor_sync" in merge


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("op", ["fwd_split", "fwd_merge"])
@pytest.mark.parametrize("d,dtype,target", SHORT_CASES)
def test_short_query_forward_spills_nothing(op, d, dtype, target):
    """ptxas keeps the split and merge kernels in registers (``cuda_mma.SPLIT_TILE``)."""
    spilled, log = _ptxas_spills(_short_source(op, d, dtype, target), target)
    assert spilled == 0, log


@pytest.mark.parametrize("target", ["cuda-sm_80", "cuda-sm_90"])
def test_no_16_bit_tiled_kernel_takes_the_simt_schedule(target):
    """Every fp16/bf16 forward, backward preprocess, dQ and dK/dV key on sm_80+ is a
    warp-level kernel, at every head dim, with a tile that fits the arch's shared memory."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    for op, d, dtype in itertools.product(("fwd", "bwd_pre", "dq", "dkv"), HEAD_DIMS,
                                          ("float16", "bfloat16")):
        key = _key(op, d, dtype, target)
        assert schedules.lowers("cuda", key), key
        if d > 128 and op != "bwd_pre":
            t = mma.tile(key)
            t.check(d)
            assert t.smem_bytes(op, d) <= mma._smem_limit(key), (key, t)


def test_mma_tile_refusals():
    """A split that leaves partial m16n8k16 tiles, or a tile over the arch's shared memory, is
    refused with the reason."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    key = _key("dkv", 160, "bfloat16", "cuda-sm_90")
    with pytest.raises(ValueError, match="split 4 must divide"):
        mma.flash_dkv(key, mma.MmaTile(warps=8, step=64, mtiles=2, split=4))
    with pytest.raises(ValueError, match="bytes of shared memory"):
        mma.flash_dkv(_key("dkv", 256, "bfloat16", "cuda-sm_80"),
                      mma.MmaTile(warps=8, step=64, split=2))


def test_mma_large_d_dkv_tile_choice():
    """dK/dV at D 192/256 on sm_90 splits the head dim four ways (two m-tiles a warp; measured
    5-6% faster than two ways), plain keys only; D 160/224 (a quarter is not whole 16-column
    tiles), score modifiers, packed sequences and smaller shared memories keep the two-way
    split."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    for d in (192, 256):
        four = mma.tile(_key("dkv", d, "bfloat16", "cuda-sm_90"))
        assert (four.split, four.mtiles, four.warps, four.step) == (4, 2, 8, 64)
        four.check(d)
        for extra in ({"softcap": True}, {"varlen": True}):
            key = KernelKey("dkv", d, "bfloat16", "top-left", 1, "cuda-sm_90", **extra)
            assert mma.tile(key).split == 2, key.name
        assert mma.tile(_key("dkv", d, "bfloat16", "cuda-sm_80")).split == 2
    for d in (160, 224):
        assert mma.tile(_key("dkv", d, "float16", "cuda-sm_90")).split == 2


def test_mma_large_d_dq_tile_choice():
    """dQ above D 128 takes 4 warps x 32 (``cuda_mma.DQ_PAIR_TILE``) where two blocks fit one
    SM's shared memory (sm_90/100 at D 160 and 192), else the first of ``LARGE_D_TILES``
    that fits."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    for target, d in itertools.product(("cuda-sm_80", "cuda-sm_90", "cuda-sm_100"),
                                       (160, 192, 224, 256)):
        key = _key("dq", d, "bfloat16", target)
        if target != "cuda-sm_80" and d in (160, 192):
            assert mma.tile(key) == mma.DQ_PAIR_TILE, key.name
            need = mma.DQ_PAIR_TILE.smem_bytes("dq", d)
            assert 2 * need < mma._smem_limit(key) + 1024 < 3 * need  # 228 KiB an SM
        else:
            first = next(t for t in mma.LARGE_D_TILES["dq"]
                         if t.smem_bytes("dq", d) <= mma._smem_limit(key))
            assert mma.tile(key) == first, key.name


def test_mma_copy_and_conversion_variants():
    """``MmaTile(zfill=True)``: the walked K/V tiles' copies take cp.async's src-size operand
    (a row past the end reads 0 bytes and is zero-filled) instead of a branch around them;
    ``pack=True``: the forward's P is rounded two values a ``cvt.rn.bf16x2.f32``. Defaults
    where the H200 measured them faster (``cuda_mma._large_d_copies``): the D 192/256 forward
    both, the D 256 dK/dV ``zfill``; elsewhere neither (D 64's default source has neither)."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    key = _key("fwd", 64, "bfloat16", "cuda-sm_90", "top-left", 1)
    default = device_source(compile_module(key))
    variant = dataclasses.replace(mma.tile(key), zfill=True, pack=True)
    src = device_source(compile_module(key, tvm.IRModule({"main": mma.kernel(key, variant)})))
    zfill, pack = "cp.async.cg.shared.global [%0], [%1], 16, %2;", "cvt.rn.bf16x2.f32"
    assert zfill in src and pack in src
    assert zfill not in default and pack not in default
    served = {("fwd", 192): (True, True), ("fwd", 256): (True, True), ("dkv", 256): (True, False)}
    for op, d in itertools.product(("fwd", "dq", "dkv"), (64, 160, 192, 224, 256)):
        for target in ("cuda-sm_80", "cuda-sm_90"):
            tile = mma.tile(_key(op, d, "bfloat16", target))
            assert (tile.zfill, tile.pack) == served.get((op, d), (False, False)), (op, d)
        modded = KernelKey(op, d, "bfloat16", "top-left", 1, "cuda-sm_90", softcap=True)
        assert not (mma.tile(modded).zfill or mma.tile(modded).pack), modded.name


@pytest.mark.parametrize("causal", ["none", "top-left"])
def test_mma_block_order_visits_every_tile_once(causal):
    """Causal blocks are numbered longest tile first across all heads, unmasked ones head by
    head; either way the grid covers every (tile, batch x head) exactly once."""
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    tiles, heads = 5, 3
    order = [mma._block_order(causal, bx, tiles, heads) for bx in range(tiles * heads)]
    assert sorted(order) == [(t, h) for t in range(tiles) for h in range(heads)]
    first = [t for t, _ in order[:heads]]
    assert first == ([0] * heads if causal != "none" else [0, 1, 2])


def _poisoned(shape, dtype, device):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 96, 256])
def test_backward_preprocess_16_bit(d, dtype, device):
    """Delta = rowsum(O dO) in float32 (on sm_80+ the warp-level kernel of cuda_mma: 16-byte
    loads, four lanes a row) against float64, at odd lengths (a block of 32 rows partly past
    the end), several batches and heads, and on (B, L, H, D) storage viewed as (B, H, L, D):
    every element written (poisoned before), none past the end."""
    b, h = 3, 5
    for length in (1, 7, 97, 1025):
        out = torch.randn(b, length, h, d, dtype=dtype, device=device).transpose(1, 2)
        do = torch.randn(b, h, length, d, dtype=dtype, device=device)
        n = b * h * length
        flat = _poisoned((n + 64,), torch.float32, device)
        delta = flat[:n].view(b, h, length)
        key = KernelKey("bwd_pre", d, str(dtype).removeprefix("torch."), "none", 1,
                        target_tag_for_device(do.device))
        kernel(key)(out, do, delta)
        want = (out.double() * do.double()).sum(-1)
        # float32 sums of float32 products of 16-bit values: a few ulp of the sum's terms
        tol = 1e-5 * (out.double() * do.double()).abs().sum(-1) + 1e-6
        assert ((delta.double() - want).abs() <= tol).all(), (length, d)
        assert flat[n:].isnan().all(), "wrote past the end"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", ["none", "top-left"])
def test_raw_kernels_overwrite_poisoned_outputs(causal, device):
    """Call the four compiled kernels directly with NaN-filled outputs: every element is written."""
    b, hq, hkv, lq, lk, d, dt = 2, 4, 2, 45, 70, 64, torch.float32
    q = torch.randn(b, hq, lq, d, device=device)
    k = torch.randn(b, hkv, lk, d, device=device)
    v = torch.randn(b, hkv, lk, d, device=device)
    do = torch.randn(b, hq, lq, d, device=device)
    tag = target_tag_for_device(q.device)
    meta = {"head_dim": d, "dtype": "float32", "causal": causal, "group": hq // hkv,
            "target": tag}
    scale = 0.125
    out, lse = _poisoned(q.shape, dt, device), _poisoned(q.shape[:3], dt, device)
    no_sinks = _poisoned((hq,), dt, device)  # ignored by the kernel built without sinks
    kernel(KernelKey("fwd", **meta))(q, k, v, no_sinks, out, lse, scale)
    delta = _poisoned(q.shape[:3], dt, device)
    kernel(KernelKey("bwd_pre", **{**meta, "causal": "none", "group": 1}))(out, do, delta)
    dq = _poisoned(q.shape, dt, device)
    dk, dv = _poisoned(k.shape, dt, device), _poisoned(v.shape, dt, device)
    launch_dq(KernelKey("dq", **meta), q, k, v, do, lse, out, delta, dq, scale)
    kernel(KernelKey("dkv", **meta))(q, k, v, do, lse, delta, dk, dv, scale)
    if device == "cuda":
        torch.cuda.synchronize()
    for name, t in (("out", out), ("lse", lse), ("delta", delta), ("dq", dq), ("dk", dk),
                    ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(qr, kr, vr, causal=causal, scale=scale)
    ref.backward(do.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.double(), qr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dk.double(), kr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv.double(), vr.grad, atol=1e-4, rtol=1e-4)


# (description, kwargs changes, exception, text the message must contain)
BAD_INPUTS = [
    ("rank 3 q", {"q": torch.randn(2, 5, 64)}, ValueError, "q: expected 4 dimensions"),
    ("int q", {"q": torch.ones(1, 2, 5, 64, dtype=torch.int32)}, TypeError, "q: dtype"),
    ("float64", {"q": torch.randn(1, 2, 5, 64, dtype=torch.float64)}, TypeError, "q: dtype"),
    ("k dtype differs", {"k": torch.randn(1, 2, 5, 64, dtype=torch.float16)}, TypeError,
     "k: dtype"),
    ("head_dim 320", {"q": torch.randn(1, 2, 5, 320), "k": torch.randn(1, 2, 5, 320),
                      "v": torch.randn(1, 2, 5, 320)}, ValueError, "head_dim 320"),
    ("head_dim 0", {"q": torch.randn(1, 2, 5, 0), "k": torch.randn(1, 2, 5, 0),
                    "v": torch.randn(1, 2, 5, 0)}, ValueError, "head_dim 0"),
    ("v length differs", {"v": torch.randn(1, 2, 6, 64)}, ValueError, "v: shape"),
    ("k batch differs", {"k": torch.randn(2, 2, 5, 64), "v": torch.randn(2, 2, 5, 64)},
     ValueError, "k: shape"),
    ("heads do not divide", {"k": torch.randn(1, 3, 5, 64), "v": torch.randn(1, 3, 5, 64),
                             "enable_gqa": True}, ValueError, "do not divide"),
    ("gqa without flag", {"k": torch.randn(1, 1, 5, 64), "v": torch.randn(1, 1, 5, 64)},
     ValueError, "enable_gqa=True"),
    ("zero scale", {"scale": 0.0}, ValueError, "scale"),
    ("nan scale", {"scale": math.nan}, ValueError, "scale"),
    ("bad alignment", {"is_causal": True, "causal_alignment": "diagonal"}, ValueError,
     "causal_alignment"),
    ("not a tensor", {"q": [[1.0]]}, TypeError, "q: expected a torch.Tensor"),
    ("sinks wrong shape", {"sinks": torch.zeros(3)}, ValueError, "sinks: expected shape (2,)"),
    ("sinks int dtype", {"sinks": torch.zeros(2, dtype=torch.int64)}, TypeError,
     "sinks: dtype"),
    ("sinks not a tensor", {"sinks": [0.0, 0.0]}, TypeError, "sinks: expected a torch.Tensor"),
]


@pytest.mark.parametrize("case,changes,exc,text", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_named(case, changes, exc, text):
    kwargs = {"q": torch.randn(1, 2, 5, 64), "k": torch.randn(1, 2, 5, 64),
              "v": torch.randn(1, 2, 5, 64)}
    kwargs.update(changes)
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    with pytest.raises(exc, match=re.escape(text)):
        attention(q, k, v, **kwargs)


def test_bad_input_is_named_after_good_calls_of_the_same_shapes():
    """check_inputs passes the static facts it has seen pass without re-checking them: every
    bad input above still gets its error after good calls with the same shapes (the scale and
    the sinks are checked every time)."""
    from tvm_flash import ops

    good = torch.randn(1, 2, 5, 64)
    attention(good, good, good)
    attention(good, good, good, sinks=torch.zeros(2))
    assert len(ops._checked) >= 1
    for _, changes, exc, text in BAD_INPUTS:
        kwargs = {"q": good, "k": good, "v": good, **changes}
        q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
        with pytest.raises(exc, match=re.escape(text)):
            attention(q, k, v, **kwargs)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("causal", ["none", "bottom-right"])
@pytest.mark.parametrize("d,dtype", [(160, torch.float16), (256, torch.bfloat16)])
def test_large_head_dim_raw_kernels_overwrite_poisoned_outputs(d, dtype, causal, device):
    """The D > 128 warp-level kernels (GQA 2:1, lengths that end mid-tile) write every element
    of NaN-filled outputs, within the bounds of tests/checks.py."""
    b, hq, hkv, lq, lk = 2, 4, 2, 45, 70
    q, k, v, do = make_inputs(b, hq, hkv, lq, lk, d, dtype, device)
    scale = d ** -0.5
    exact = reference(q, k, v, do, causal, torch.float64, scale)
    lowp = reference(q, k, v, do, causal, dtype, scale)
    meta = {"head_dim": d, "dtype": dtype, "causal": causal, "group": hq // hkv,
            "target": target_tag_for_device(q.device)}
    f32 = {"dtype": torch.float32, "device": device}
    out, lse = _poisoned(q.shape, dtype, device), _poisoned(q.shape[:3], torch.float32, device)
    kernel(KernelKey("fwd", **meta))(q, k, v, torch.zeros(hq, **f32), out, lse, scale)
    ref_lse = exact[1].float().contiguous()
    rounded = exact[0].to(dtype)  # O as the forward returns it: Delta from its rounded values
    delta = (do.double() * rounded.double()).sum(-1).float()
    dq = _poisoned(q.shape, dtype, device)
    dk, dv = _poisoned(k.shape, dtype, device), _poisoned(v.shape, dtype, device)
    launch_dq(KernelKey("dq", **meta), q, k, v, do, ref_lse, rounded, delta, dq, scale)
    kernel(KernelKey("dkv", **meta))(q, k, v, do, ref_lse, delta, dk, dv, scale)
    torch.cuda.synchronize()
    for name, ours, e, lp, mult in zip(("out", "lse", "dq", "dk", "dv"),
                                       (out, lse, dq, dk, dv), exact, lowp, (2, 2, 3, 3, 3),
                                       strict=True):
        assert not torch.isnan(ours).any(), f"{name} has unwritten (NaN) elements"
        err, _ = _err(ours, e)
        bound = mult * _err(lp, e)[0] + FLOOR[dtype]
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
