"""Score modifiers — sliding window, soft cap, ALiBi — against the float64 reference.

Each alone and combined (with sinks, GQA, every causal mode), odd lengths on both paths (the
short-query one for Lq <= 12), windows that leave rows without keys; then the errors a bad
argument gets. On CUDA float16/bfloat16 run the tensor-core kernels with them (Hopper's on
sm_90a where served, else ``mma.sync``), float32 the SIMT schedule.
"""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch
import tvm
from checks import check_against_reference, make_inputs
from conftest import DEVICES
from tvm.script import tirx as T

from tvm_flash import attention
from tvm_flash.kernels.common import exp2_fma, tanh
from tvm_flash.key import KernelKey

CAUSAL = ["none", "top-left", "bottom-right"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", [(97, 97), (7, 97), (97, 7), (1, 130)])
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (16, -1), (-1, 4)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
def test_window(causal, window, lq, lk, device):
    """Windows around the diagonal (top-left: query i, otherwise i + Lk - Lq), alone and under
    the causal mask; (0, 0) sees one key, and Lq > Lk leaves rows with none (LSE -inf, zero
    output and gradients)."""
    q, k, v, do = make_inputs(2, 4, 2, lq, lk, 64, torch.float16, device)
    check_against_reference(q, k, v, do, causal, window_size=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_long(dtype, device):
    """A window much shorter than the sequence: most key tiles are skipped, the rest
    masked at both edges."""
    q, k, v, do = make_inputs(1, 2, 1, 1025, 1025, 64, dtype, device)
    check_against_reference(q, k, v, do, "bottom-right", window_size=(100, 0))
    check_against_reference(q, k, v, do, "none", window_size=(70, 33))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", [(97, 97), (7, 130)])
@pytest.mark.parametrize("cap", [0.5, 30.0])
@pytest.mark.parametrize("causal", ["none", "bottom-right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_softcap(dtype, causal, cap, lq, lk, device):
    """``cap * tanh(s / cap)``: a small cap saturates most scores (its gradient 1 - tanh^2 is
    then near 0), a large one barely bends them."""
    q, k, v, do = make_inputs(2, 4, 2, lq, lk, 64, dtype, device)
    check_against_reference(q, k, v, do, causal, softcap=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", ["none", "top-left"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softcap_large_scores(dtype, causal, device):
    """Gemma 2's cap of 50 on scores up to ~100 (q scaled by 20): most scores in tanh's bend
    or near saturation, where an approximate tanh's relative error costs the most absolute
    error (the Hopper kernels compute the cap's tanh with ``tanh.approx.f32``: a capped score
    off by up to 50 * 2^-11; ``cuda_hopper.SOFTCAP_TANH``)."""
    q, k, v, do = make_inputs(2, 4, 2, 97, 130, 64, dtype, device)
    check_against_reference(q * 20, k, v, do, causal, softcap=50.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", [(97, 97), (7, 130), (97, 7)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["(H,)", "(B,H)"])
@pytest.mark.parametrize("causal", CAUSAL)
def test_alibi(causal, per_batch, lq, lk, device):
    """``-slope * |c - j|`` with slopes per head or per batch and head (BLOOM's geometric
    slopes, one batch's reversed), GQA 2:1."""
    q, k, v, do = make_inputs(2, 4, 2, lq, lk, 64, torch.float16, device)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 4) for h in range(4)], device=device)
    if per_batch:
        slopes = torch.stack([slopes, slopes.flip(0)])
    check_against_reference(q, k, v, do, causal, alibi_slopes=slopes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (97, 130), (130, 97)])
@pytest.mark.parametrize("d,hq,hkv", [(64, 8, 2), (128, 2, 2)])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combined(dtype, causal, d, hq, hkv, lq, lk, device):
    """Window, soft cap, ALiBi and sinks together; GQA 4:1 and MHA at D 128."""
    q, k, v, do = make_inputs(2, hq, hkv, lq, lk, d, dtype, device)
    sinks = torch.randn(hq, device=device)
    slopes = torch.rand(2, hq, device=device) * 0.2
    check_against_reference(q, k, v, do, causal, sinks=sinks, window_size=(20, 5),
                            softcap=5.0, alibi_slopes=slopes)


def test_plain_call_unchanged():
    """Default arguments build and run the kernels without modifiers (the same keys, code and
    results as before modifiers existed), and an explicit no-op is no modifier."""
    q, k, v, _ = make_inputs(1, 2, 2, 33, 33, 64, torch.float32, "cpu")
    out = attention(q, k, v)
    assert torch.equal(out, attention(q, k, v, window_size=(-1, -1), softcap=0.0,
                                      alibi_slopes=None))
    assert torch.equal(out, attention(q, k, v, window_size=[-1, -1]))


def test_unbounded_window_equals_none():
    """A window wider than both lengths changes nothing (the kernel with the window flag,
    extents clamped to Lq + Lk)."""
    q, k, v, _ = make_inputs(1, 2, 2, 40, 50, 64, torch.float32, "cpu")
    plain = attention(q, k, v, is_causal=True)
    wide = attention(q, k, v, is_causal=True, window_size=(10**9, 10**9))
    torch.testing.assert_close(wide, plain, atol=1e-6, rtol=1e-6)


def test_key_names_and_refusals():
    key = KernelKey("dq", 64, "bfloat16", "none", 2, "cuda-sm_90a", window=True, alibi=True)
    assert key.name == "dq-window-alibi-d64-bf16-none-g2-cuda-sm_90a"
    assert key.mods == ("window", "alibi")
    assert KernelKey("fwd", 64, "bfloat16", "none", 1, "llvm", sinks=True,
                     softcap=True).name == "fwd-sinks-softcap-d64-bf16-none-g1-llvm"
    with pytest.raises(ValueError, match="^softcap: only the"):
        KernelKey("bwd_pre", 64, "bfloat16", "none", 1, "llvm", softcap=True)


BAD = [
    ({"window_size": (-2, 0)}, ValueError, "^window_size: "),
    ({"window_size": (1, 2, 3)}, TypeError, "^window_size: "),
    ({"window_size": 4}, TypeError, "^window_size: "),
    ({"window_size": (1.5, 0)}, TypeError, "^window_size: "),
    ({"softcap": -1.0}, ValueError, "^softcap: "),
    ({"softcap": float("nan")}, ValueError, "^softcap: "),
    ({"softcap": "big"}, TypeError, "^softcap: "),
    ({"alibi_slopes": [0.5, 0.25]}, TypeError, "^alibi_slopes: "),
    ({"alibi_slopes": torch.ones(3)}, ValueError, r"^alibi_slopes: expected shape \(2,\)"),
    ({"alibi_slopes": torch.ones(2, 2)}, ValueError, "^alibi_slopes: "),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError, "^alibi_slopes: "),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_arguments_are_named(kwargs, error, match):
    q, k, v, _ = make_inputs(1, 2, 2, 8, 8, 64, torch.float32, "cpu")
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)


def _bench_features():
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_features.py"
    spec = importlib.util.spec_from_file_location("bench_features", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lq,lk,causal,window", [(7, 7, False, -1), (7, 7, True, -1),
                                                  (5, 9, True, -1), (9, 5, True, -1),
                                                  (12, 12, True, 3), (4, 10, True, 2)])
def test_features_benchmark_counts_the_pairs_it_computes(lq, lk, causal, window):
    """The FLOPs the features benchmark credits: exactly the (query, key) pairs flash-attn's
    bottom-right causal mask and left window keep."""
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window >= 0:
        keep &= j >= i - window
    assert _bench_features().attended_pairs(lq, lk, causal, window) == int(keep.sum())


def test_features_benchmark_runs_on_the_cpu(tmp_path):
    """``scripts/bench_features.py --tiny`` (issue #21's speed comparisons) runs end to end
    here: every case timed, its ratios and the targets in the JSON."""
    out = tmp_path / "features.json"
    assert _bench_features().main(["--device", "cpu", "--tiny", "--modes", "fwd",
                                   "--rep-ms", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["varlen", "varlen", "window", "mods", "mods"]
    assert sum(rows[0]["lengths"]) == 96 and len(rows[0]["lengths"]) == 4
    assert {"varlen/dense", "window/full", "softcap/plain", "alibi/plain"} <= {
        name for r in rows for name in r["ratios"]}
    assert all(ms > 0 for r in rows for ms in r["ms"].values())


@pytest.mark.parametrize("form", ["exp2", "fma", "rcp"])
def test_tanh_is_float32_accurate(form):
    """The soft cap's tanh (``kernels.common.tanh``: the default form, and the one with its
    exponential on the FMA pipe, the one with its reciprocal there) compiled for the CPU and
    run on a dense grid and +-inf, NaN: within 16 float32 ulp of float64's tanh where |tanh|
    >= 2^-4 and 5e-7 everywhere (below, ``1 - 2 / (e + 1)`` loses digits to cancellation);
    saturating to +-1 and keeping a NaN. The reciprocal's Newton steps are fused
    multiply-adds, which this CPU target splits (``llvm.fmuladd``): 18 ulp for that form here
    (on CUDA 0.5 ulp of reciprocal, 15.2 of tanh in a float32 model of ``fmaf``)."""
    n = 200_003

    @T.prim_func
    def f(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n):
            y[i] = tanh(x[i], form)

    lib = tvm.tirx.build(tvm.IRModule({"main": f}), target="llvm")
    x = np.concatenate([np.linspace(-12, 12, n - 3), [np.inf, -np.inf, np.nan]]).astype(np.float32)
    y = tvm.runtime.empty((n,), "float32")
    lib(tvm.runtime.tensor(x), y)
    got, ref = y.numpy().astype(np.float64), np.tanh(x.astype(np.float64))
    assert np.isnan(got[-1]) and got[-3] == 1 and got[-2] == -1
    ulp = np.spacing(np.abs(ref[:-3]).astype(np.float32)).astype(np.float64)
    err = np.abs(got[:-3] - ref[:-3])
    assert (err / ulp)[np.abs(ref[:-3]) >= 2 ** -4].max() <= (18 if form == "rcp" else 16)
    assert err.max() < 5e-7


def test_exp2_on_the_fma_pipe():
    """``kernels.common.exp2_fma`` (the softmax's and the soft cap's exponential without the
    special-function unit) compiled for the CPU: within 2^-22 relative of float64's 2^x over
    [-126, 127), exactly 1 at 0; 0 at -inf and below -127 (a masked score's probability), a
    finite 2^127 at +inf, NaN kept — and its rounding step not folded away by TVM's simplifier
    (which turns ``(z + c) - c`` into ``z``)."""
    n = 100_007

    @T.prim_func
    def f(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n):
            y[i] = exp2_fma(x[i])

    lib = tvm.tirx.build(tvm.IRModule({"main": f}), target="llvm")
    grid = np.random.default_rng(0).uniform(-126, 127, n - 7)
    x = np.concatenate([grid, [0.0, -np.inf, np.inf, np.nan, -127.5, -1e30, 1e30]])
    x = x.astype(np.float32)
    y = tvm.runtime.empty((n,), "float32")
    lib(tvm.runtime.tensor(x), y)
    got = y.numpy()
    rel = np.abs(got[:-7].astype(np.float64) / np.exp2(x[:-7].astype(np.float64)) - 1)
    assert rel.max() <= 2.0 ** -22, rel.max()
    assert got[-7] == 1 and got[-6] == 0 and got[-3] == 0 and got[-2] == 0
    assert np.isfinite(got[-5]) and got[-5] == got[-1] and got[-5] > 1e38
    assert np.isnan(got[-4])
