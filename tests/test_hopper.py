"""The Hopper (sm_90a) kernel family, checked without a GPU: which keys it serves, that every
one lowers to wgmma + TMA code, and (where nvcc is installed) that ptxas keeps it in registers
and never serialises its wgmma. The maths runs on the H200 (the `gpu` suite picks these kernels
on an sm_90 device, see ``tvm_flash.target.cuda_tag``; scripts/sweep_hopper.py checks each
kernel alone against float64)."""

import dataclasses
import functools
import importlib
import itertools
import re
import shutil

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tvm_flash.build import (
    assemble,
    compile_device_code,
    compile_module,
    device_source,
    pass_config,
    ptxas_figures,
    ptxas_log,
    schedules,
)
from tvm_flash.kernels.common import Mods
from tvm_flash.key import KernelKey
from tvm_flash.target import cuda_tag, make_target, parse_target

hopper = importlib.import_module("tvm_flash.schedules.cuda_hopper")
mma = importlib.import_module("tvm_flash.schedules.cuda_mma")

KEYS = [KernelKey("fwd", d, dt, causal, 1, "cuda-sm_90a")
        for d, dt, causal in itertools.product((64, 128), ("float16", "bfloat16"),
                                               ("none", "top-left", "bottom-right"))]
KEYS += [KernelKey("fwd", 128, "bfloat16", "bottom-right", 4, "cuda-sm_90a", sinks=True)]
# every other head dim once: 32-column atoms (32, 96, 160, 224), shorter steps (192 and up)
KEYS += [KernelKey("fwd", d, "bfloat16", "top-left", 1, "cuda-sm_90a")
         for d in (32, 96, 160, 192, 224, 256)]
# the backward: D 64 and 128 in both dtypes, every causal mode and GQA; every other head dim
# once (each its own register budget: the step shrinks as D grows)
KEYS += [KernelKey(op, d, dt, causal, g, "cuda-sm_90a")
         for op, d, (dt, causal, g) in itertools.product(
             ("dq", "dkv"), (64, 128), (("bfloat16", "top-left", 1), ("float16", "top-left", 1),
                                        ("bfloat16", "none", 1), ("float16", "bottom-right", 2)))]
KEYS += [KernelKey(op, d, "bfloat16", "top-left", 1, "cuda-sm_90a")
         for op in ("dq", "dkv") for d in hopper.OP_HEAD_DIMS[op] if d not in (64, 128)]
# score modifiers: each op with all three, the window alone
MOD_KEYS = [KernelKey(op, d, "bfloat16", "top-left", 1, "cuda-sm_90a", **mods)
            for op, d, mods in itertools.product(
                ("fwd", "dq", "dkv"), (64, 128),
                ({"window": True}, {"window": True, "softcap": True, "alibi": True}))]
# the soft cap alone on dK/dV: its own, longer steps (cuda_hopper._rescored_dkv_step)
MOD_KEYS += [KernelKey("dkv", 128, "bfloat16", "top-left", 1, "cuda-sm_90a", softcap=True)]
# packed sequences: forward, dQ, dK/dV
MOD_KEYS += [KernelKey(op, d, "bfloat16", "top-left", 1, "cuda-sm_90a", varlen=True)
             for op in ("fwd", "dq", "dkv") for d in (64, 128)]
# the window forward as a causal window call runs it (plan.fold_window): its own tile
FOLDED_WINDOW = [KernelKey("fwd", d, "bfloat16", "none", 1, "cuda-sm_90a", window=True)
                 for d in (64, 128)]
KEYS += MOD_KEYS + FOLDED_WINDOW


@functools.cache
def _source(key: KernelKey, tile: hopper.HopperTile | None = None) -> str:
    """CUDA source of the Hopper kernel of ``key``, served or not (dK/dV at D 32 is written
    but not served, see ``cuda_hopper.SERVED``), with its default tile or ``tile``."""
    if hopper.supports(key) and tile is None:
        return device_source(compile_module(key))
    with tvm.transform.PassContext(config=pass_config("cuda")):
        built = tvm.tirx.build(tvm.IRModule({"main": hopper.kernel(key, tile)}),
                               target=make_target(key.target), pipeline="tirx")
    return device_source(built)


def _variant_source(key: KernelKey, **fields) -> str:
    """CUDA source of ``key``'s kernel with ``fields`` changed on its default tile."""
    return _source(key, dataclasses.replace(hopper.tile(key), **fields))


def test_hopper_serves_the_sm90a_forward_and_backward():
    for op in ("fwd", "dq", "dkv"):
        for d, causal, g in ((64, "none", 1), (128, "bottom-right", 4)):
            assert hopper.supports(KernelKey(op, d, "float16", causal, g, "cuda-sm_90a"))
    for key in (KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90"),  # no wgmma
                KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90"),
                KernelKey("fwd", 128, "float32", "none", 1, "cuda-sm_90a"),  # fp32: SIMT
                KernelKey("dkv", 128, "float32", "none", 1, "cuda-sm_90a"),
                KernelKey("bwd_pre", 128, "bfloat16", "none", 1, "cuda-sm_90a"),
                KernelKey("dq_split", 128, "bfloat16", "none", 1, "cuda-sm_90a")):
        assert not hopper.writes(key), key.name
    # dK/dV at D 32 (slower than mma.sync): written, and mma.sync serves it
    key = KernelKey("dkv", 32, "bfloat16", "none", 1, "cuda-sm_90a")
    assert hopper.writes(key) and not hopper.supports(key)
    assert mma.supports(key) and schedules.lowers("cuda", key)
    # from D 192 the split tile serves dK/dV
    for d in hopper.HEAD_DIMS:
        key = KernelKey("dkv", d, "bfloat16", "none", 1, "cuda-sm_90a")
        assert hopper.tile(key).split == (d >= 192) and hopper.supports(key) == (d > 32)
    # the forward and dQ are persistent where that was measured faster and stays in registers
    for d in hopper.HEAD_DIMS:
        for causal in ("none", "top-left"):
            key = KernelKey("fwd", d, "bfloat16", causal, 1, "cuda-sm_90a")
            assert hopper.tile(key).persistent == (d in (32, 64, 128) or d == 256
                                                   and causal != "none")
            # dQ where causal at the head dims measured
            key = KernelKey("dq", d, "bfloat16", causal, 1, "cuda-sm_90a")
            assert hopper.tile(key).persistent == (d in (64, 128, 192) and causal != "none")


def test_backward_tiles_fit_shared_memory():
    """The default tile of every served key fits, dK/dV's tile config is (queries, keys), and
    a step that is not a multiple of 16 rows (one k16 chunk of the register operand) is
    refused."""
    for op in ("dq", "dkv"):
        for d in hopper.OP_HEAD_DIMS[op]:
            key = KernelKey(op, d, "bfloat16", "none", 1, "cuda-sm_90a")
            assert hopper.tile(key).smem_bytes(d, op) <= hopper.SMEM_LIMIT, key.name
    t = hopper.tile(KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a"))
    assert (t.tile_config("dkv").block_q, t.tile_config("dkv").block_k) == (t.step, t.rows)
    key = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="multiple of 16"):
        hopper.kernel(key, hopper.HopperTile(step=40))
    with pytest.raises(ValueError, match="dK/dV is not persistent"):
        hopper.kernel(key, hopper.HopperTile(step=64, persistent=True))
    with pytest.raises(ValueError, match="split tile"):
        hopper.kernel(KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a"),
                      hopper.HopperTile(step=64, split=True))
    with pytest.raises(ValueError, match="bytes of shared memory"):
        hopper.kernel(KernelKey("dq", 256, "bfloat16", "none", 1, "cuda-sm_90a"),
                      hopper.HopperTile(step=64))


def test_hopper_devices_get_the_sm90a_tag(monkeypatch):
    monkeypatch.delenv("TVM_FLASH_HOPPER", raising=False)
    assert cuda_tag(9, 0) == "cuda-sm_90a"
    assert cuda_tag(8, 0) == "cuda-sm_80"
    monkeypatch.setenv("TVM_FLASH_HOPPER", "0")  # the mma.sync kernels, side by side
    assert cuda_tag(9, 0) == "cuda-sm_90"
    assert parse_target("cuda:sm_90a") == "cuda-sm_90a"
    with pytest.raises(ValueError, match="target"):
        parse_target("cuda:sm_9x")


def test_tile_must_fit_shared_memory():
    key = KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="bytes of shared memory"):
        hopper.kernel(key, hopper.HopperTile(step=256, stages=3))


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_every_hopper_key_lowers_to_wgmma_and_tma(key):
    _lowers_to_wgmma_and_tma(_source(key))


def _lowers_to_wgmma_and_tma(src: str) -> None:
    for needle in ("wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.tensor.4d",
                   "mbarrier.try_wait", "setmaxnreg.inc", "__grid_constant__ CUtensorMap",
                   "_ss_mma_async", "_rs_mma_async"):  # operands from shared memory; A in regs
        assert needle in src, needle
    assert "mma.sync" not in src and "ldmatrix" not in src
    # every tensor copy starts at a row (16-byte aligned): a 1-D copy of LSE rows started at
    # any float and stopped the H200 with "illegal instruction" (cuda_hopper.flash_dkv)
    assert re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", src) and all(
        n == "4" for n in re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", src))


def _register_handoff_fits(src: str) -> None:
    """``setmaxnreg`` moves registers only within the block's launch allocation (the compiled
    count, at most 65536 / threads rounded down to 8, times the threads): the producer's
    ``dec`` must free what the consumers' ``inc`` takes, or the ``inc`` waits forever (the
    fused dK/dV hung so on the H200 with 32 + 2 x 240)."""
    threads = int(re.search(r"__launch_bounds__\((\d+)", src)[1])
    dec = [int(n) for n in re.findall(r"setmaxnreg_dec_sync_aligned_u32_(\d+)\(\)", src)]
    inc = [int(n) for n in re.findall(r"setmaxnreg_inc_sync_aligned_u32_(\d+)\(\)", src)]
    assert len(set(dec)) == 1 and len(set(inc)) == 1, (dec, inc)
    allocation = min(255, 65536 // threads) // 8 * 8 * threads
    assert dec[0] * 128 + inc[0] * (threads - 128) <= allocation, (threads, dec, inc)


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_register_handoff_fits_the_launch_allocation(key):
    _register_handoff_fits(_source(key))


ASSEMBLED = [k for k in KEYS if k.group == 1 and k.causal == "top-left"] + FOLDED_WINDOW
"""The keys :func:`test_hopper_kernels_stay_in_registers_and_keep_wgmma_asynchronous`
assembles (and the folded window's, whose tile is its own)."""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("key", ASSEMBLED, ids=lambda k: k.name)
def test_hopper_kernels_stay_in_registers_and_keep_wgmma_asynchronous(key):
    """No spill beyond :data:`SPILL_ALLOWANCE`; and none of ptxas's notes that it injected a
    wgmma fence or wait (C7517, C7519) or serialised the wgmma of a pipeline stage
    (C7510-C7516): each would mean the tensor cores wait on the softmax, the overlap the
    kernel is built for."""
    spilled, notes, log = _ptxas(_source(key))
    assert spilled <= SPILL_ALLOWANCE.get((key.op, key.head_dim, key.causal), 0), log
    assert not notes, log


def _ptxas(src: str, target: str = "cuda-sm_90a") -> tuple[int, list, str]:
    """ptxas on ``src`` as ``scripts/build.py`` assembles it (``build.ptxas_log``: TVM's nvcc
    flags, fast math and the register usage level included): the bytes spilled, its notes
    C7510-C7519 (an injected wgmma fence or wait, or a stage's wgmma serialised), and its
    log."""
    log = ptxas_log(target, src)
    return ptxas_figures(log)[1], re.findall(r"\(C75(1[0-9])\)", log), log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
def test_ptxas_figures_come_from_the_build_s_own_compile():
    """``build.assemble``, which these tests and ``scripts/sweep_mma.py`` read ptxas's figures
    from, makes the very device code ``scripts/build.py`` ships for the key (TVM's nvcc flags:
    fast math and the register usage level move spills) and keeps ptxas's report, which
    ``compile_cuda`` discards unless it fails."""
    key = KernelKey("fwd", 64, "bfloat16", "top-left", 1, "cuda-sm_90a")
    src = _source(key)
    binary, log = assemble(key.target, src)
    assert binary == compile_device_code(key, src)[0]
    assert ptxas_figures(log) == ([128], 0) and "flash_fwd_kernel" in log, log


SPILL_ALLOWANCE = {("fwd", 128, "none"): 4, ("fwd", 256, "top-left"): 16,
                   ("fwd", 256, "bottom-right"): 16, ("dq", 256, "none"): 24,
                   ("dq", 256, "top-left"): 32, ("dq", 256, "bottom-right"): 52,
                   ("dkv", 128, "none"): 8, ("dkv", 160, "none"): 16}
"""Bytes ptxas (nvcc 13.0, the build's flags: :func:`_ptxas`) spills in the served plain
tiles that spill at all (docs/perf.md, "CUDA Hopper kernels"), each as measured on the H200
with them: the D 128 unmasked forward's persistent tile loop, the unmasked dQ at D 256 and
dK/dV at D 160, each timed faster than its spill-free alternatives; the causal dQ at D 256
(32 bytes top-left, 52 bottom-right: its causal offset beside the top-left tile's registers;
0 / 44 before it computed Delta itself, ``cuda_hopper.ABSORBS``); the causal forward at D 256 and
the unmasked bf16 dK/dV at D 128 (8 bytes; fp16 none), found when this test took the build's
flags (fast math, the register usage level: without them both spill nothing). Every other
served key spills nothing."""

SERVED_PLAIN = [k for k in (KernelKey(op, d, dtype, causal, 1, "cuda-sm_90a")
                            for op in hopper.OPS for d in hopper.HEAD_DIMS
                            for dtype in ("bfloat16", "float16")
                            for causal in ("none", "top-left", "bottom-right"))
                if hopper.supports(k) and k not in ASSEMBLED]
"""Every other served key without modifiers, GQA or sinks (both dtypes: their registers
differ, e.g. the unmasked dK/dV at D 128 spills 8 bytes in bf16 and none in fp16)."""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("key", SERVED_PLAIN, ids=lambda k: k.name)
def test_every_served_key_builds_within_the_spill_allowance(key):
    """Each served plain key lowers to wgmma + TMA, its register hand-off fits, and ptxas
    keeps it within :data:`SPILL_ALLOWANCE` with its wgmma asynchronous."""
    src = _source(key)
    _lowers_to_wgmma_and_tma(src)
    _register_handoff_fits(src)
    spilled, notes, log = _ptxas(src)
    assert spilled <= SPILL_ALLOWANCE.get((key.op, key.head_dim, key.causal), 0), log
    assert not notes, log


FUSED = hopper.HopperTile(step=64, stages=2, dq=True)
"""The 5-GEMM dK/dV tile (dQ added in key-tile order into a float32 accumulator): written; on
the H200 its first version hung (producer 32 + consumers 240 registers, more than the launch
allocation), so nothing selects it (``cuda_hopper._dkv_tile``) until it has run."""


@functools.cache
def _fused_source(causal: str) -> str:
    return _source(KernelKey("dkv", 128, "bfloat16", causal, 1, "cuda-sm_90a"), FUSED)


@pytest.mark.parametrize("causal", ["none", "top-left"])
def test_fused_dq_tile_lowers_and_adds_in_order(causal):
    """The fused dK/dV + dQ kernel lowers to wgmma (dS^T from shared memory, dQ's operands
    both MN-major; dQ before dK), adds its dQ tile by a bulk reduce once the tile's counter
    says the key tiles before it have, and releases the counter after the add completed; it
    is built only at D 128 and never selected by ``tile``. The writer frees the shared dQ
    tile for the next step once the add has read it, before the add completes."""
    src = _fused_source(causal)
    _register_handoff_fits(src)
    for needle in ("wgmma.mma_async.sync.aligned.m64n64k16", "ld.acquire.gpu.global.b32",
                   "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
                   "cp.async.bulk.wait_group 0", "red.release.gpu.global.add.s32",
                   "barrier.sync.aligned"):
        assert needle in src, needle
    # at the call sites (the last occurrences; the first are the helpers' definitions)
    assert (src.rindex("wait_group_0()") < src.rindex("fence_acq_rel_gpu()")
            < src.rindex("red_release_gpu_global_add_s32("))
    # the writer: the tile read, the consumers told (DQ_EMPTY, 288 threads), then completion
    add_at = src.rindex("add_f32(")
    read_at = src.index("wait_group_read_0()", add_at)
    assert read_at < src.index("(uint)288", read_at) < src.rindex("wait_group_0()")
    # a step: dQ (both operands MN-major) issued before dK, and its result stored for the
    # writer while dK runs (wait_group 1), the stage released after both (wait_group 0)
    dq_at = src.rindex("m64n64k16_f32_bf16_bf16_1_1_1_1(")
    dk_at = src.rindex("m64n128k16_f32_bf16_bf16_1_1_0_1(")
    store_at = src.index("(uint)288", dk_at)  # DQ_EMPTY, then the store, then DQ_FULL
    assert dq_at < dk_at < src.index("wait_group_sync_aligned_1()", dk_at) < store_at
    assert store_at < src.index("wait_group_sync_aligned_0()", store_at)
    assert not any(hopper.tile(KernelKey("dkv", d, "bfloat16", causal, 1, "cuda-sm_90a")).dq
                   for d in hopper.OP_HEAD_DIMS["dkv"])
    with pytest.raises(ValueError, match="fused dQ"):
        hopper.kernel(KernelKey("dkv", 64, "bfloat16", causal, 1, "cuda-sm_90a"), FUSED)


def test_fused_dq_pad():
    """``HopperTile.dq_pad``: the fused dQ tile's rows (and its accumulator's) padded by
    ``DQ_PAD`` floats, so that a warp's 64-bit stores of 8 rows x 8 columns fall in 32
    distinct banks per 4 rows instead of 8 (512-byte rows); the tile, its bulk add and the
    accumulator's row grow by the padding; only the fused dQ has it."""
    key = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    padded = dataclasses.replace(FUSED, dq_pad=True)
    row = hopper.dq_row(128, padded)
    assert row == 128 + hopper.DQ_PAD and hopper.dq_row(128, FUSED) == 128
    banks = {(r * row + n * 8 + j) % 32 for r in range(4) for n in (0,) for j in range(8)}
    assert len(banks) == 32
    src = _source(key, padded)
    assert f"(uint){64 * row * 4}" in src and f"(uint){64 * 128 * 4}" in _fused_source("none")
    _register_handoff_fits(src)
    assert padded.smem_bytes(128, "dkv") == FUSED.smem_bytes(128, "dkv") + 64 * 8 * 4
    with pytest.raises(ValueError, match="dq_pad"):
        hopper.kernel(key, dataclasses.replace(hopper.tile(key), dq_pad=True))


def test_fused_dq_block_orders():
    """``HopperTile.dq_order``: the 5-GEMM dK/dV's blocks key tile major (the default: every
    head's first key tile, then every head's second) or with a head's key tiles adjacent
    (``"head"``). Either way block ``bx`` waits on its counter only for the key tile before it
    of its head, which has a smaller ``bx`` (launched before it), and the grid covers every
    (key tile, batch, KV head) once; the order is only the fused dQ's."""
    nkt, b, hkv = 5, 2, 3
    for order in ("key", "head"):
        where = {hopper._fused_block(order, bx, nkt, b, hkv): bx for bx in range(nkt * b * hkv)}
        assert sorted(where) == [(t, bb, h) for t in range(nkt) for bb in range(b)
                                 for h in range(hkv)]
        assert all(where[(t - 1, bb, h)] < bx for (t, bb, h), bx in where.items() if t)
    key = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    head = _source(key, dataclasses.replace(FUSED, dq_order="head"))
    assert head != _fused_source("none")
    _register_handoff_fits(head)
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in head
    for bad in (dataclasses.replace(hopper.tile(key), dq_order="head"),
                dataclasses.replace(FUSED, dq_order="query")):
        with pytest.raises(ValueError, match="dq_order"):
            hopper.kernel(key, bad)


def test_forward_bulk_store_of_o():
    """``HopperTile(tma_store=True)`` (the D 128 unmasked forward's default, persistent at
    every length): O leaves through a shared tile per consumer, one bulk tensor store per
    64-column atom, after a proxy fence and the consumer's named barrier; in a persistent grid
    the tile is rewritten only after the previous store read it, and the block waits for its
    last store's reads before it ends. Not for dQ or dK/dV, packed sequences, or 32-column
    atoms; causal and D 64 keys store O from registers. A soft cap or ALiBi alone takes the
    plain key's tile; a window or both do not (not measured)."""
    key = KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    for alone in (key, dataclasses.replace(key, softcap=True),
                  dataclasses.replace(key, alibi=True)):
        default = hopper.tile(alone)
        assert default.tma_store and default.persistent
        assert default.persistent_keys == hopper.EVERY_LENGTH
    for other in (dataclasses.replace(key, causal="top-left"),
                  dataclasses.replace(key, head_dim=64), dataclasses.replace(key, window=True),
                  dataclasses.replace(key, softcap=True, alibi=True)):
        assert not hopper.tile(other).tma_store, other.name
        assert hopper.tile(other).persistent_keys == hopper.PERSISTENT_MAX_KEYS, other.name
    src = _source(key)
    store = "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
    assert store in src and store not in _variant_source(key, tma_store=False)
    body = src[src.index("extern \"C\" __global__"):]
    calls = [m.start() for m in re.finditer(r"bulk_tensor_s2g\w*\(", body)]
    assert len(calls) == 128 // 64
    fence = [m.start() for m in re.finditer(r"fence_proxy\w*shared__cta\(\)",
                                            body[:calls[0]])][-1]
    assert body.rindex("barrier_sync_count_sync_aligned(", 0, calls[0]) > fence
    reads = [m.start() for m in re.finditer(r"wait_group_read_0\(\)", body)]
    assert len(reads) == 2 and reads[0] < fence < calls[0] < reads[1]
    for bad in (KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a"),
                KernelKey("fwd", 96, "bfloat16", "none", 1, "cuda-sm_90a"),
                KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90a", varlen=True)):
        with pytest.raises(ValueError, match="bulk store"):
            hopper.kernel(bad, dataclasses.replace(hopper.tile(bad), tma_store=True))


@pytest.mark.parametrize("d, causal, mods, spill", [
    (128, "none", {}, 8), (128, "top-left", {}, 4), (64, "bottom-right", {}, 0),
    (128, "top-left", {"window": True}, 0), (128, "none", {"sinks": True, "alibi": True}, 8)])
def test_forward_chained_query_tiles(d, causal, mods, spill):
    """``HopperTile(chained=True)`` (a persistent forward): two Q buffers, each with a full and
    an empty mbarrier; a tile's LSE is stored before the next tile's first S = Q K^T is issued
    with the tile's last P V, and its O after the next tile's first softmax. ptxas keeps the
    wgmma asynchronous (spills as measured: the tile's coordinates and 1 / sums live across
    the next tile's first step). Not for dQ, a tile that is not persistent, packed sequences;
    at D 256 the second Q buffer does not fit."""
    key = KernelKey("fwd", d, "bfloat16", causal, 1, "cuda-sm_90a", **mods)
    plain, chained = hopper.tile(key), dataclasses.replace(hopper.tile(key), chained=True)
    assert chained.smem_bytes(d) == plain.smem_bytes(d) + chained.rows * d * 2
    src, base = _variant_source(key, chained=True), _source(key)
    body = src[src.index("extern \"C\" __global__"):]
    inits = len(re.findall(r"mbarrier_init", body))
    assert inits == len(re.findall(r"mbarrier_init", base[base.index("extern \"C\""):])) + 2
    lse = body.index("LSE_ptr[")  # in the consumers' walk over their query tiles
    stores = r"bulk_tensor_s2g|\(O_ptr \+"  # O's: bulk (tma_store) or from registers
    o = re.search(stores, body[lse:]).start() + lse
    assert lse < body.index("_ss_mma_async", lse) < body.index("exp2", lse) < o
    assert not re.search(stores, body[:lse])
    if shutil.which("nvcc"):
        spilled, notes, log = _ptxas(src)
        assert spilled <= spill and not notes, log
    for bad in (KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a"),
                KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90a", varlen=True)):
        with pytest.raises(ValueError, match="chained"):
            hopper.kernel(bad, dataclasses.replace(hopper.tile(bad), chained=True))
    with pytest.raises(ValueError, match="chained"):
        hopper.kernel(key, dataclasses.replace(plain, chained=True, persistent=False))
    wide = KernelKey("fwd", 256, "bfloat16", "top-left", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="shared memory"):
        hopper.kernel(wide, dataclasses.replace(hopper.tile(wide), chained=True))


@pytest.mark.parametrize("op", ["dq", "dkv"])
@pytest.mark.parametrize("mods", [{}, {"softcap": True, "alibi": True}])
def test_backward_probabilities_in_one_ffma(op, mods):
    """dQ and dK/dV with ``HopperTile.clamp`` off (their default, as the forward's): P from
    the LSE scaled to base 2 where it is loaded — the same exp2 calls as the clamped variant,
    no clamp's selects, fewer multiplies by log2 e — with or without score modifiers."""
    key = KernelKey(op, 128, "bfloat16", "top-left", 1, "cuda-sm_90a", **mods)
    default = hopper.tile(key)
    assert not default.clamp
    base = _variant_source(key, clamp=True)
    src = _source(key)
    # (the clamp's select repeats its argument in the source text: a soft cap's tanh, with
    # its own exp2, appears twice there; nvcc computes it once)
    assert src.count("exp2f(") == base.count("exp2f(") or mods and (
        src.count("exp2f(") < base.count("exp2f("))
    if not mods:  # (with them the folded cap and slope repeat log2 e in the text)
        assert src.count("1.442695") < base.count("1.442695")
    assert src.count("condval") < base.count("condval") or src.count("?") < base.count("?")


@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
def test_alibi_alone_biases_the_raw_score(op):
    """ALiBi without a soft cap (``common.modified_score(raw=True)``): the slope register
    holds ``slope / scale`` and the bias is taken from the raw score, which is then scaled
    as a plain one — the forward's exp2 argument keeps the plain ``scale * log2 e`` factor,
    the backward's P one FFMA after it; under a causal mask no absolute value (every
    visible distance is >= 0); with a soft cap the scaled form stays."""
    for causal, abs_count in (("top-left", 0), ("none", None)):
        key = KernelKey(op, 128, "bfloat16", causal, 1, "cuda-sm_90a", alibi=True)
        src = _source(key)
        assert "(1.000000e+00f / scale)" in src or "0x1p+0f/*1.000000e+00*/ / scale)" in src
        fabs = src.count("fabsf(")
        assert fabs == 0 if abs_count == 0 else fabs >= 16
        if op == "fwd":
            assert "exp2f(((s_ptr[0] * (scale * 0x1.71547652b82fep+0f" in src
    capped = _source(KernelKey(op, 128, "bfloat16", "top-left", 1, "cuda-sm_90a",
                               softcap=True, alibi=True))
    assert "/ scale)" not in capped and capped.count("fabsf(") >= 16



@pytest.mark.parametrize("op", ["fwd", "dq"])
def test_alibi_by_rows(op):
    """``HopperTile(alibi_rows=True)`` (the forward's default with ALiBi alone,
    ``cuda_hopper.alibi_rows``; a dQ variant): ALiBi's bias split into the element's constant
    part (its offset among the thread's columns times the slope: an FFMA with an immediate)
    and a row's part, taken once a row (forward: the max and the exponent's subtrahend; dQ:
    the LSE). Under a causal mask no element converts a distance; without one the threads
    the diagonal crosses keep the element's form (its absolute value). Within registers
    (ptxas); dK/dV, soft-capped and plain keys refuse it, as does the clamped dQ."""
    for causal in ("top-left", "none"):
        key = KernelKey(op, 128, "bfloat16", causal, 1, "cuda-sm_90a", alibi=True)
        assert hopper.tile(key).alibi_rows == (op == "fwd")
        src = _variant_source(key, alibi_rows=True)
        if causal == "none":
            assert src.count("fabsf(") >= 16
        else:  # element 5's column offset 9, an immediate times the slope
            assert "fabsf(" not in src
            assert "+ (sl_ptr[0] * 0x1.2p+3f/*9.000000e+00*/)" in src
        if shutil.which("nvcc"):
            spilled, notes, _ = _ptxas(src)
            assert spilled <= SPILL_ALLOWANCE.get((op, 128, causal), 0) and not notes
    bad = [KernelKey(op, 64, "bfloat16", "none", 1, "cuda-sm_90a", **mods) for mods in
           ({}, {"softcap": True, "alibi": True})]
    bad.append(KernelKey("dkv", 64, "bfloat16", "none", 1, "cuda-sm_90a", alibi=True))
    for key in bad:
        with pytest.raises(ValueError, match="alibi_rows"):
            hopper.kernel(key, dataclasses.replace(hopper.tile(key), alibi_rows=True))
    if op == "dq":
        key = KernelKey(op, 64, "bfloat16", "none", 1, "cuda-sm_90a", alibi=True)
        with pytest.raises(ValueError, match="alibi_rows"):
            hopper.kernel(key, dataclasses.replace(hopper.tile(key), alibi_rows=True,
                                                   clamp=True))

def test_dkv_probabilities_converted_once():
    """``HopperTile(p_once=True)`` (the default of every dK/dV tile but the split one): P^T
    goes to the input dtype once, into the words dV's product reads, and dS^T widens those
    words back — no round trip of P^T through the dtype in place (one conversion a score
    fewer, the same rounded values). ptxas (CPU, bf16, D 128 unmasked): 8 bytes spilled -> 0.
    The other kernels refuse the field."""
    key = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    for d, causal in ((64, "none"), (64, "top-left"), (96, "none"), (128, "bottom-right"),
                      (160, "none"), (192, "none"), (256, "top-left")):
        chosen = hopper.tile(KernelKey("dkv", d, "float16", causal, 2, "cuda-sm_90a"))
        assert chosen.p_once != chosen.split
    once, base = _source(key), _variant_source(key, p_once=False)
    round_trip = "((float)((nv_bfloat16)exp2f("
    assert base.count(round_trip) == 32 and round_trip not in once
    assert once.count("(nv_bfloat16)") == base.count("(nv_bfloat16)") - 32
    bad = KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="p_once"):
        hopper.kernel(bad, dataclasses.replace(hopper.tile(bad), p_once=True))


def test_dkv_statistics_read_before_the_waits():
    """``HopperTile(stats_early=True)`` (a dK/dV variant): each thread's 16 LSE (D 128, 64-query
    steps) and then its 16 Delta leave shared memory into registers right before the wait on
    S^T and on dP^T, the products that precede their use — the default reads them where used,
    after. Neither the split nor the fused dQ tile has it, nor the other kernels."""
    key = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    wait = "wait_group_sync_aligned_1();"
    for src, early in ((_source(key), False), (_variant_source(key, stats_early=True), True)):
        lines = src.splitlines()
        at = [i for i, line in enumerate(lines) if line.strip().endswith(wait)]
        assert len(at) == 2  # S^T complete, then dP^T complete
        for i in at:
            ahead = lines[i - 16:i]
            assert all(line.strip().startswith("sr_ptr[") and "pool_ptr" in line
                       for line in ahead) == early
        assert ("sr_ptr" in src) == early
    for bad in (KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a"),
                KernelKey("dkv", 256, "bfloat16", "none", 1, "cuda-sm_90a")):
        with pytest.raises(ValueError, match="stats_early"):
            hopper.kernel(bad, dataclasses.replace(hopper.tile(bad), stats_early=True))
    with pytest.raises(ValueError, match="stats_early"):
        hopper.kernel(key, dataclasses.replace(FUSED, stats_early=True))


def test_dkv_overlapped_steps():
    """``HopperTile(overlap=True)`` (a dK/dV variant): a step leaves its dK += dS^T Q running;
    the next step frees the stage before once its own S^T is awaited (that wait completes the
    step before's products too), and the last step's are awaited after the loop. ptxas keeps
    the D 64 default tile in registers with the wgmma unserialised (at D 128 it serialises
    them: C7512). Not for the split or fused tiles or the other kernels."""
    key = KernelKey("dkv", 64, "bfloat16", "none", 1, "cuda-sm_90a")
    loop = "for (int64_t i_1 = (int64_t)0; i_1 < c_ptr[5]; ++i_1) {"
    for src, overlapped in ((_source(key), False), (_variant_source(key, overlap=True), True)):
        body = src[src.rindex(loop):]  # the consumers' walk over the steps
        wait0 = body.index("wait_group_sync_aligned_0();")
        assert ("if ((int64_t)0 < i_1) {" in body[:wait0]) == overlapped  # the stage before
        arrive = body.index("mbarrier_arrive", wait0)  # the stage the wait frees: the last
        assert ("c_ptr[5]" in body[arrive:body.index("\n", arrive)]) == overlapped
    if shutil.which("nvcc"):
        spilled, notes, log = _ptxas(_variant_source(key, overlap=True))
        assert spilled == 0 and not notes, log
    for bad, tile in ((KernelKey("dq", 64, "bfloat16", "none", 1, "cuda-sm_90a"), None),
                      (KernelKey("dkv", 256, "bfloat16", "none", 1, "cuda-sm_90a"), None),
                      (KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a"), FUSED)):
        with pytest.raises(ValueError, match="overlap"):
            hopper.kernel(bad, dataclasses.replace(tile or hopper.tile(bad), overlap=True))


def test_every_default_tile_unclamped():
    """No default Hopper tile clamps the softmax's exponent (``HopperTile.clamp``, measured
    slower for every op); one special case of the D 64 causal dK/dV kept it by an oversight."""
    for op, d, causal, g, varlen, mods in itertools.product(
            ("fwd", "dq", "dkv"), hopper.OP_HEAD_DIMS["fwd"], ("none", "top-left", "bottom-right"),
            (1, 8), (False, True), ({}, {"softcap": True}, {"window": True})):
        for lengths in (0, 1024):
            key = KernelKey(op, d, "bfloat16", causal, g, "cuda-sm_90a", varlen=varlen,
                            lengths=lengths, **mods)
            if hopper.supports(key):
                assert not hopper.tile(key).clamp, key.name


def test_score_modifiers_served_where_checked():
    """Hopper kernels with window, soft cap and ALiBi and for packed sequences run where they
    passed against float64 on the H200 (``cuda_hopper.MODS_SERVED``); at the other head dims,
    and for the soft cap on dK/dV's split tile (not written), the CUDA schedule takes the
    ``mma.sync`` kernels, which have them at every head dim — never the SIMT schedule."""
    for key in MOD_KEYS:
        assert hopper.writes(key) and hopper.supports(key), key.name
        assert schedules.lowers("cuda", key), key.name
    split = KernelKey("dkv", 256, "bfloat16", "none", 1, "cuda-sm_90a", softcap=True)
    assert not hopper.writes(split)  # the split tile has no soft cap yet
    for mods in ({"varlen": True}, {"window": True, "alibi": True}):  # but these it has
        key = KernelKey("dkv", 256, "bfloat16", "none", 1, "cuda-sm_90a", **mods)
        assert hopper.writes(key) and not hopper.supports(key)
    for key in (split, KernelKey("fwd", 96, "float16", "none", 2, "cuda-sm_90a", window=True),
                KernelKey("dq", 32, "bfloat16", "top-left", 1, "cuda-sm_90a", varlen=True)):
        assert not hopper.supports(key) and mma.supports(key), key.name
        assert schedules.lowers("cuda", key), key.name


def test_rescored_dkv_steps():
    """Under one score modifier without a window, dK/dV takes the longer steps measured faster
    at every length (96 at D 64 unmasked, 48 at D 128 under a soft cap); causal at D 64, the
    1024 bucket, combinations, packed sequences and ALiBi at D 128 keep the short ones, which
    measured faster or were not measured."""
    def step(d, causal="none", lengths=0, **mods):
        key = KernelKey("dkv", d, "bfloat16", causal, 1, "cuda-sm_90a", lengths=lengths, **mods)
        return hopper.tile(key).step
    assert step(64, alibi=True) == step(64, softcap=True) == 96
    assert step(128, softcap=True) == step(128, "top-left", softcap=True) == 48
    assert step(64, "top-left", alibi=True) == step(64, "top-left", softcap=True) == 64
    assert step(64, lengths=1024, softcap=True) == step(64, softcap=True, alibi=True) == 64
    assert step(64, window=True, softcap=True) == step(64, varlen=True) == 64
    assert step(128, alibi=True) == step(128, lengths=1024, softcap=True) == 32


def test_rescored_forward_and_dq_tiles():
    """A soft cap or ALiBi alone (no window, not packed) gives the D 64 forward the plain one's
    three consumers (two for causal calls up to 1024 long) and dQ at D 64 its longer steps (96
    for the soft cap unmasked, else 128), measured faster; combinations, a window and packed
    sequences keep two consumers and 64-key steps, and no dQ step grows past the plain one's."""
    def tile(op, d, causal="none", lengths=0, **mods):
        return hopper.tile(KernelKey(op, d, "bfloat16", causal, 1, "cuda-sm_90a",
                                     lengths=lengths, **mods))
    for mod in ("softcap", "alibi"):
        assert tile("fwd", 64, **{mod: True}).consumers == 3
        assert tile("fwd", 64, "top-left", **{mod: True}).consumers == 3
        assert tile("fwd", 64, "top-left", lengths=1024, **{mod: True}).consumers == 2
        assert tile("dq", 64, "top-left", **{mod: True}).step == 128
    assert tile("dq", 64, softcap=True).step == 96 and tile("dq", 64, alibi=True).step == 128
    for mods in ({"softcap": True, "alibi": True}, {"window": True, "softcap": True},
                 {"varlen": True, "alibi": True}):
        assert tile("fwd", 64, **mods).consumers == 2
        assert tile("dq", 64, **mods).step == 64
    assert tile("dq", 128, alibi=True).step == 64 and tile("dq", 256, softcap=True).step == 32


@pytest.mark.parametrize("op", ["fwd", "dq", "dkv"])
def test_tanh_forms_of_the_soft_cap(op):
    """A soft-capped key takes ``tanh.approx.f32`` (``cuda_hopper.SOFTCAP_TANH``): ``tanhf``,
    one such instruction under nvcc's fast math, where the exp2 form (``tanh="exp2"``, the
    float32-accurate one the other families use) takes an exp2 and a division; ``fma`` and
    ``rcp`` move the exponential or the division's reciprocal to the FMA pipe (variants, each
    value bound once: every op lowers them, dQ and dK/dV also in ``1 - tanh^2``); keys without
    a soft cap refuse them."""
    key = KernelKey(op, 128, "bfloat16", "none", 1, "cuda-sm_90a", softcap=True)
    assert hopper.tile(key).tanh == hopper.SOFTCAP_TANH == "approx"
    src = _source(key)
    accurate = _variant_source(key, tanh="exp2")
    assert len(re.findall(r"\btanhf\(", src)) >= 16 and not re.findall(r"\btanhf\(", accurate)
    assert src.count("exp2f(") < accurate.count("exp2f(")
    division = "/*2.000000e+00*/ / (exp2f("
    assert accurate.count(division) >= 16
    fma, rcp = _variant_source(key, tanh="fma"), _variant_source(key, tanh="rcp")
    assert fma.count("float e2_x") >= 16 and fma.count("exp2f(") < accurate.count("exp2f(")
    assert rcp.count("float rc_d") >= 16 and rcp.count(division) == 0
    plain = KernelKey(op, 128, "bfloat16", "none", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="a tanh form is for keys with a soft cap"):
        hopper.kernel(plain, dataclasses.replace(hopper.tile(plain), tanh="approx"))


def test_forward_exponentials_on_the_fma_pipe():
    """``HopperTile(exp2_fma=k)`` (a forward variant): k of every 8 scores a thread holds take
    the softmax's exponential by ``kernels.common.exp2_fma`` (FMA and integer instructions)
    instead of ``exp2f`` (the special-function unit); the soft cap's ``tanh="fma"`` form moves
    its exponential there too. dQ and dK/dV refuse the field. Each such exponential computes
    its argument once (bound by a ``Let``; nested text repeated it in every use, which nvcc
    did not share back: twice the PTX)."""
    key = KernelKey("fwd", 128, "bfloat16", "top-left", 1, "cuda-sm_90a")
    assert hopper.tile(key).exp2_fma == 0
    base = _source(key).count("exp2f(")
    src = _variant_source(key, exp2_fma=2)
    assert src.count("exp2f(") == base - 32  # 2 of 8 of 128
    assert src.count("float e2_x") == 32 and src.count("0x1.fcp+6f") == 32 * 4  # one clamp each
    capped = KernelKey("fwd", 128, "bfloat16", "top-left", 1, "cuda-sm_90a", softcap=True)
    assert (_variant_source(capped, tanh="fma").count("exp2f(")
            == _variant_source(capped, tanh="exp2").count("exp2f(") - 128)
    bad = KernelKey("dq", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    with pytest.raises(ValueError, match="exp2_fma"):
        hopper.kernel(bad, dataclasses.replace(hopper.tile(bad), exp2_fma=2))
    with pytest.raises(ValueError, match="exp2_fma"):
        hopper.kernel(key, dataclasses.replace(hopper.tile(key), exp2_fma=9))


@pytest.mark.parametrize("tiles, heads, group_heads", [(32, 64, 6), (5, 7, 3), (4, 3, 8),
                                                      (1, 5, 2), (9, 4, 1)])
def test_causal_blocks_grouped_for_l2(tiles, heads, group_heads):
    """``cuda_hopper._grouped_order`` (the block order of ``HopperTile.l2_bytes``), compiled for
    the CPU: every (tile, head) exactly once; heads taken in groups of ``group_heads`` (the
    last may be short), group after group; within a group the longest tiles (counted from the
    last) first, a round over the group's heads each."""
    n = tiles * heads

    @T.prim_func
    def f(t: T.Buffer((n,), "int64"), bh: T.Buffer((n,), "int64")):
        for pos in range(n):
            a, b = T.meta_var(hopper._grouped_order(T.int64(pos), T.int64(tiles),
                                                    T.int64(heads), T.int64(group_heads)))
            t[pos] = a
            bh[pos] = b

    lib = tvm.tirx.build(tvm.IRModule({"main": f}), target="llvm")
    t, bh = tvm.runtime.empty((n,), "int64"), tvm.runtime.empty((n,), "int64")
    lib(t, bh)
    t, bh = t.numpy(), bh.numpy()
    pairs = sorted(zip(t.tolist(), bh.tolist(), strict=True))
    assert pairs == [(a, b) for a in range(tiles) for b in range(heads)]
    group = bh // group_heads
    assert (np.diff(group) >= 0).all()
    for g in np.unique(group):
        members = min(group_heads, heads - g * group_heads)
        assert (t[group == g] == np.repeat(np.arange(tiles), members)).all()


def test_causal_blocks_grouped_for_l2_by_default():
    """Dense causal keys up to D 128 take their blocks in L2-sized groups of heads
    (``HopperTile.l2_bytes``, ``cuda_hopper.L2_GROUP_BYTES``); the field changes the causal
    kernels' block order only: the unmasked kernels' source is the same with it; larger head
    dims and windowed keys keep the order across all heads; packed sequences refuse it."""
    for op in ("fwd", "dq", "dkv"):
        causal = KernelKey(op, 128, "bfloat16", "top-left", 1, "cuda-sm_90a")
        assert hopper.tile(causal).l2_bytes == hopper.L2_GROUP_BYTES
        assert _variant_source(causal, l2_bytes=0) != _source(causal)
        plain = dataclasses.replace(causal, causal="none")
        assert hopper.tile(plain).l2_bytes == 0
        assert _variant_source(plain, l2_bytes=32 << 20) == _source(plain)
        wide = dataclasses.replace(causal, head_dim=256)
        assert hopper.tile(wide).l2_bytes == 0
        assert hopper.tile(dataclasses.replace(causal, window=True)).l2_bytes == 0
    packed = KernelKey("fwd", 128, "bfloat16", "top-left", 1, "cuda-sm_90a", varlen=True)
    assert hopper.tile(packed).l2_bytes == 0
    with pytest.raises(ValueError, match="l2_bytes"):
        hopper.kernel(packed, dataclasses.replace(hopper.tile(packed), l2_bytes=1 << 20))


def test_forward_exp2_unclamped():
    """The forward's default exp2 is unclamped (``HopperTile.clamp`` off: a compare and a
    select fewer a score than the clamped variant, the same exp2 calls)."""
    key = KernelKey("fwd", 128, "bfloat16", "none", 1, "cuda-sm_90a")
    default = hopper.tile(key)
    assert not default.clamp
    base = _source(key)
    src = _variant_source(key, clamp=True)
    assert src.count("exp2f(") == base.count("exp2f(")
    assert base.count("condval") < src.count("condval") or base.count("?") < src.count("?")


def test_sweep_names_a_stalled_stage():
    """``scripts/sweep_hopper.py``'s watchdog: a stage that makes no progress for
    ``--stall-s`` seconds (a kernel that never finishes) ends the sweep with exit status 3 and
    a line naming the stage; stages that advance are left alone."""
    import pathlib
    import subprocess
    import sys

    scripts = pathlib.Path(__file__).resolve().parent.parent / "scripts"
    start = (f"import sys, threading, time\nsys.path.insert(0, {str(scripts)!r})\n"
             "import sweep_hopper as sw\n"
             "threading.Thread(target=sw._watchdog, args=(0.5,), daemon=True).start()\n")
    stalled = subprocess.run(
        [sys.executable, "-c", start + "sw._at('fwd-x check 4x12x700x400 bhld')\n"
                                       "time.sleep(5)\nprint('not ended')\n"],
        capture_output=True, text=True, timeout=60)
    assert stalled.returncode == 3, stalled
    assert "STALL fwd-x check 4x12x700x400 bhld" in stalled.stdout
    moving = subprocess.run(
        [sys.executable, "-c", start + "for i in range(8):\n    sw._at(str(i))\n"
                                       "    time.sleep(0.2)\nsw._at('')\ntime.sleep(1)\n"
                                       "print('done')\n"],
        capture_output=True, text=True, timeout=60)
    assert moving.returncode == 0 and "done" in moving.stdout, moving


@pytest.mark.parametrize("causal, lq, lk, window, keyed", [
    ("bottom-right", 527, 400, None, True),  # row 127 sees key 0
    ("bottom-right", 528, 400, None, False),  # the first tile sees none
    ("bottom-right", 700, 400, None, False),  # two such tiles a head (the memcheck hang)
    ("top-left", 700, 400, None, True),
    ("none", 700, 400, None, True),
    ("none", 700, 400, (1024, 0), False),  # a folded window: the diagonal at i - 300
    ("top-left", 1000, 200, (10, 5), False),  # the last tiles start past the keys
    ("top-left", 300, 200, (10, 5), True),  # its last tile walks one masked key tile
])
def test_persistent_grid_only_where_every_query_tile_walks_keys(causal, lq, lk, window, keyed):
    """The persistent forward and dQ take one block a tile where some query tile walks no
    key tile (``cuda_hopper._every_tile_keyed``): under memcheck the persistent forward never
    finished where a block walked such a tile between two others (docs/perf.md, "The memcheck
    hang, found")."""
    far = lq + lk
    left, right = window or (far, far)
    cond = hopper._every_tile_keyed(causal, 128, 128, T.int64(lq), T.int64(lk),
                                    Mods(window=window is not None), T.int64(left),
                                    T.int64(right), False)
    assert bool(tvm.sym.Analyzer().simplify(cond)) is keyed


@pytest.mark.parametrize("op, chained", [("fwd", False), ("fwd", True), ("dq", False)])
def test_keyless_tile_releases_q_only_after_its_whole_warpgroup_waited_for_it(op, chained):
    """A query tile that walks no key tile releases its Q (one elected thread's arrive on Q
    empty) only after its warpgroup's named barrier (``cuda_hopper.release_keyless``): no
    wgmma ties the four warps together there, so a warp still waiting for this Q could see the
    next tile's Q complete the phase after it and then wait forever — the persistent forward
    hung so under memcheck (Hopper journal, thirty-first session). The barrier is the
    consumer's own (id 1 + its index, 128 threads) and the only named barrier of these
    kernels, which store O from registers."""
    key = KernelKey(op, 128, "bfloat16", "bottom-right", 1, "cuda-sm_90a")
    src = _variant_source(key, chained=True) if chained else _source(key)
    body = src[src.index("extern \"C\" __global__"):]
    sync = "barrier_sync_count_sync_aligned(((uint)(((int)threadIdx.x) >> 7)), (uint)128);"
    assert body.count("barrier_sync_count_sync_aligned(") == body.count(sync) == 1
    after = body[body.index(sync) + len(sync):]
    arrive = after.index("mbarrier_arrive_nocount_arrive_shared_b64(")
    assert re.fullmatch(r"\s*if \([^;{}]*\) \{\s*tvm_builtin_ptx_", after[:arrive]), after[:arrive]
