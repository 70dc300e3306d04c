#!/usr/bin/env python
"""Build, check and time variants of the Hopper (sm_90a) kernels on the local GPU.

Every variant is compiled in parallel (TVM + nvcc, ``--jobs``), checked against a float64
reference on odd shapes (lengths 1, 7, 97, 300, 1025; more query tiles than SMs; GQA; every
causal mode; sinks; (B, L, H, D) storage viewed as (B, H, L, D)) with NaN-poisoned outputs,
and only then timed at B·N = 16k tokens, hidden 2048, side by side in the same process with:

* forward (``fwd``): torch SDPA's flash and cuDNN backends, and with ``--mma`` the
  ``mma.sync`` forward (``cuda-sm_90`` keys);
* dQ and dK/dV (``dq``, ``dkv``), each kernel alone: with ``--mma`` the ``mma.sync`` kernels of
  the same key (where that family serves it). Their inputs LSE and Delta = rowsum(dO O) come
  from the float64 reference; gradients must be within 3x the error of the same maths in the
  input precision (torch autograd on ``attention_reference``) plus a floor, as in
  tests/checks.py. TFLOP/s count the kernel's own GEMMs: dQ 3 (S, dP, dQ) = 6 B H N^2 D,
  dK/dV 4 (S^T, dP^T, dV, dK) = 8 B H N^2 D, halved causal. A dK/dV tile with ``"dq": true``
  (the 5-GEMM backward: dQ added in key-tile order into a float32 accumulator, see
  ``cuda_hopper.flash_dkv``) is checked for dQ too, for bitwise-equal results on three runs,
  and timed with its accumulator's zeroing and conversion, 5 GEMMs = 10 B H N^2 D: compare
  it with the default tiles' dq + dkv. ``--mods window,softcap+alibi`` adds keys with those
  score modifiers (window (37, 5), cap 5, random slopes; checked against the reference with
  the same; ``cuda_hopper.MODS_WRITTEN``), timed with a (1024, 0) window, a cap of 30 and
  ALiBi's geometric slopes (TFLOP/s count the whole N^2: compare times with the plain key's
  row); ``--tiles`` may name them (``"fwd:128:softcap"``). ``--varlen`` adds the forward for
  packed sequences (``cuda_hopper.VARLEN_WRITTEN``), checked per sequence of a packed batch with an
  empty query sequence, one without keys and Lq != Lk. A check shape, timing or load that
  runs ``--stall-s`` seconds (120) ends the sweep with a ``STALL`` line naming it: a kernel
  that never finishes would otherwise stop it silently.

    python scripts/sweep_hopper.py --head-dims 64,128 --dtypes bf16 --out results.json
    python scripts/sweep_hopper.py --ops dq,dkv --head-dims 64,128 --dtypes bf16,fp16 \
        --seqlens 1024,4096 --mma
    python scripts/sweep_hopper.py --ops dq,dkv --head-dims 128 --gqa 1,2 \
        --tiles '{"dkv:128": [null, {"step": 64, "stages": 2, "dq": true}]}'
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHORT = {"bf16": "bfloat16", "fp16": "float16"}
SYMBOL = {"fwd": "flash_fwd", "dq": "flash_dq", "dkv": "flash_dkv"}
FLOOR = {"float16": 1e-3, "bfloat16": 1e-2}  # tests/checks.py's absolute floors
GEMMS = {"fwd": 2, "dq": 3, "dkv": 4}  # each 2 B H N^2 D FLOP (halved causal)
# (B, Hkv, Lq, Lk); the last two have more query tiles than an H100 or H200 has SMs, so that
# a persistent block walks several (bottom-right, the first of 700 queries over 400 keys walk
# none)
SHAPES = [(2, 2, 97, 97), (1, 1, 1025, 1025), (2, 1, 7, 300), (1, 2, 300, 7), (1, 1, 1, 1),
          (1, 2, 128, 128), (1, 1, 257, 1000), (4, 12, 700, 400), (2, 16, 1000, 1000)]


def _build(key, tile: dict | None, out: str):
    """Worker: lower one variant; write its host module and its device code."""
    import importlib

    import tvm

    # importing tvm_flash.build registers tvm_flash.schedules (also from a plain checkout)
    from tvm_flash.build import compile_device_code, device_source, pass_config
    from tvm_flash.target import make_target

    cuda_hopper = importlib.import_module("tvm_flash.schedules.cuda_hopper")
    cuda_mma = importlib.import_module("tvm_flash.schedules.cuda_mma")

    if key.target == "cuda-sm_90a":
        func, pipeline = cuda_hopper.kernel(key, _tile_of(key, tile) if tile else None), "tirx"
    else:
        func, pipeline = cuda_mma.kernel(key), "default"
    # the target as context: TVM's CUDA compile callback reads the arch from it instead of
    # asking a device (no CUDA context in the build workers)
    with make_target(key.target), tvm.transform.PassContext(config=pass_config("cuda")):
        built = tvm.tirx.build(tvm.IRModule({"main": func}), target=make_target(key.target),
                               pipeline=pipeline)
    src = device_source(built)
    code, fmt = compile_device_code(key, src)
    stem = pathlib.Path(out) / hashlib.sha256(repr((key, tile)).encode()).hexdigest()[:16]
    built.export_library(f"{stem}.so")
    pathlib.Path(f"{stem}.{fmt}").write_bytes(code)
    absorbs = cuda_hopper.ABSORBS.get(key.op) if key.target == "cuda-sm_90a" else None
    return (f"{stem}.so", f"{stem}.{fmt}", hashlib.sha256(src.encode()).hexdigest(), key.op,
            absorbs)


class _Kernel:
    """A built variant's entry function; :meth:`dq` calls a dQ kernel with O where it
    computes Delta itself (``tvm_flash.opspec.OpSpec.absorbs``), as the plan does."""

    def __init__(self, fn, absorbs: str | None):
        self.fn, self.absorbs = fn, absorbs

    def __call__(self, *args):
        return self.fn(*args)

    def dq(self, q, k, v, do, lse, o, delta, *rest):
        if self.absorbs == "bwd_pre":
            return self.fn(q, k, v, do, lse, o, delta, *rest)
        return self.fn(q, k, v, do, lse, delta, *rest)


def _load(so, code, sha, op, absorbs):
    import tvm_ffi

    from tvm_flash import artifacts

    artifacts._install_callback()
    artifacts._prebuilt[sha] = pathlib.Path(code).read_bytes()
    return _Kernel(tvm_ffi.load_module(so)[SYMBOL[op]], absorbs)


WINDOW, CAP = (37, 5), 5.0  # the score modifiers' values a sweep checks with
TIMED_WINDOW, TIMED_CAP = (1024, 0), 30.0  # and times with (scripts/bench_features.py's)


def _mod_args(key, q, k, slopes, window, cap) -> tuple:
    """The kernel's trailing score-modifier arguments (``tvm_flash.opspec.MOD_ARGS``): the
    slopes, the window's extents (``Lq + Lk``: unbounded) and the cap (1 without one)."""
    lq, lk = q.shape[2], k.shape[2]
    left, right = (min(w, lq + lk) for w in window) if key.window else (lq + lk, lq + lk)
    return (slopes, left, right, cap if key.softcap else 1.0)


def _mods(key, q, k):
    """The key's score modifiers for a check: the kernel's trailing arguments and the
    reference's keyword arguments."""
    import torch

    if not key.mods:
        return (), {}
    slopes = torch.rand(*q.shape[:2], device=q.device) * 0.3
    ref = {"window": WINDOW if key.window else None, "softcap": CAP if key.softcap else 0.0,
           "alibi_slopes": slopes if key.alibi else None}
    return _mod_args(key, q, k, slopes, WINDOW, CAP), ref


def _timed_mods(key, q, k) -> tuple:
    """The kernel's trailing score-modifier arguments for a timing: a (1024, 0) window, a
    soft cap of 30, ALiBi's geometric slopes (``2^(-8 (h + 1) / H)``)."""
    import torch

    if not key.mods:
        return ()
    b, hq = q.shape[:2]
    slopes = torch.exp2(-8 * torch.arange(1, hq + 1, device=q.device) / hq).expand(b, hq)
    return _mod_args(key, q, k, slopes.contiguous(), TIMED_WINDOW, TIMED_CAP)


def _reference(q, k, v, causal, scale, sinks, **mods):
    from tvm_flash import attention_reference

    return attention_reference(q.double(), k.double(), v.double(), causal=causal, scale=scale,
                               sinks=None if sinks is None else sinks.double(),
                               dtype=__import__("torch").float64, **mods)


def _run(fn, q, k, v, sinks, scale, extra=()):
    import torch

    b, hq, lq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, lq), float("nan"), dtype=torch.float32, device=q.device)
    sk = sinks if sinks is not None else torch.zeros(hq, device=q.device)
    fn(q, k, v, sk, out, lse, scale, *extra)
    return out, lse


def _tensor(b, h, n, d, dtype, device, layout, fill=None):
    """A (B, H, N, D) tensor: random, or ``fill``; ``blhd``: (B, N, H, D) storage viewed as
    (B, H, N, D)."""
    import torch

    shape = (b, n, h, d) if layout == "blhd" else (b, h, n, d)
    t = (torch.randn(shape, dtype=dtype, device=device) if fill is None
         else torch.full(shape, fill, dtype=dtype, device=device))
    return t.transpose(1, 2) if layout == "blhd" else t


_STAGE = ["", time.monotonic()]  # what the sweep is running, since when (for _watchdog)


def _at(stage: str) -> None:
    _STAGE[:] = [stage, time.monotonic()]


def _watchdog(limit: float) -> None:
    """A daemon thread's loop: a stage that runs ``limit`` seconds (a check shape, a timing,
    a kernel's load) is a kernel that does not finish — a hang would otherwise stop the sweep
    silently, its last row long printed. Name the stage and end the process."""
    while True:
        time.sleep(min(5.0, limit))
        stage, since = _STAGE
        if stage and time.monotonic() - since > limit:
            print(f"STALL {stage}: no progress for {time.monotonic() - since:.0f} s "
                  "(a kernel that does not finish?); exiting", flush=True)
            os._exit(3)


def _cases(key, device, strided: bool):
    """The check's inputs: per odd shape and layout, ``(b, hkv, lq, lk, layout, q, k, v)``
    random in the key's dtype (GQA group and head dim of the key)."""
    import torch

    dtype, g, d = getattr(torch, key.dtype), key.group, key.head_dim
    for b, hkv, lq, lk in SHAPES:
        for layout in ("bhld", "blhd") if strided else ("bhld",):
            _at(f"{key.name} check {b}x{hkv}x{lq}x{lk} {layout}")
            yield (b, hkv, lq, lk, layout, _tensor(b, hkv * g, lq, d, dtype, device, layout),
                   _tensor(b, hkv, lk, d, dtype, device, layout),
                   _tensor(b, hkv, lk, d, dtype, device, layout))


VARLEN_LENGTHS = ([97, 0, 300, 1, 257, 64], [97, 5, 300, 0, 1000, 64])  # queries, keys


def check_varlen(fn, key, device) -> tuple[bool, str]:
    """The packed-sequence forward on one packed batch: each sequence's output and LSE
    against the reference on it alone (bounds as :func:`check`)."""
    import itertools as it

    import torch

    _at(f"{key.name} check packed {VARLEN_LENGTHS}")
    dtype, g, d = getattr(torch, key.dtype), key.group, key.head_dim
    lens_q, lens_k = VARLEN_LENGTHS
    cu_q, cu_k = ([0, *it.accumulate(lens)] for lens in (lens_q, lens_k))
    hkv = 2
    q = torch.randn(cu_q[-1], hkv * g, d, dtype=dtype, device=device)
    k, v = (torch.randn(cu_k[-1], hkv, d, dtype=dtype, device=device) for _ in range(2))
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    scale = 1 / math.sqrt(d)
    sinks = torch.randn(hkv * g, device=device) if key.sinks else None
    extra, mods = _mods(key, q4, k4)
    if key.alibi:  # one slope row per sequence
        extra = (torch.rand(len(lens_q), hkv * g, device=device) * 0.3, *extra[1:])
        mods["alibi_slopes"] = extra[0]
    packing = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (cu_q, cu_k))
    tail = (*extra, *packing, max(lens_q), max(lens_k))
    if key.op != "fwd":
        return _check_varlen_backward(fn, key, q4, k4, v4, cu_q, cu_k, mods, scale, tail)
    out, lse = _run(fn, q4, k4, v4, sinks, scale, tail)
    worst, ok = 0.0, True
    for s in range(len(lens_q)):
        if not lens_q[s]:
            continue
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        one = {**mods, "alibi_slopes": mods["alibi_slopes"][s] if key.alibi else None}
        ref, ref_lse = _reference(q4[:, :, rows], k4[:, :, keys], v4[:, :, keys], key.causal,
                                  scale, sinks, **one)
        err = (out[:, :, rows].double() - ref).abs().max().item()
        lerr = torch.where(torch.isinf(ref_lse) & torch.isinf(lse[:, :, rows].double()), 0.0,
                           (lse[:, :, rows].double() - ref_lse).abs()).max().item()
        if math.isnan(err) or err > 3e-2 or math.isnan(lerr) or lerr > 2e-2:
            ok = False
            print(f"   FAIL {key.name} sequence {s}: out err {err:.3g}, lse err {lerr:.3g}",
                  flush=True)
        worst = max(worst, err if not math.isnan(err) else float("inf"))
    return ok, f"max out err {worst:.3g} (packed)"


def _check_varlen_backward(fn, key, q4, k4, v4, cu_q, cu_k, mods, scale, tail):
    """dq or dkv on a packed batch, fed each sequence's float64 LSE and Delta: each
    sequence's gradients within 3x the error of the same maths in the input precision."""
    import torch

    dtype = q4.dtype
    do4 = torch.randn_like(q4)
    lse = torch.full(q4.shape[:3], float("-inf"), dtype=torch.float32, device=q4.device)
    delta = torch.zeros(q4.shape[:3], dtype=torch.float32, device=q4.device)
    o4 = torch.zeros_like(q4)  # O rounded as the forward returns it, for a dQ that takes it
    refs = []
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        one = {**mods, "alibi_slopes": mods["alibi_slopes"][s] if key.alibi else None}
        args = (q4[:, :, rows], k4[:, :, keys], v4[:, :, keys], do4[:, :, rows], key.causal,
                scale)
        out, seq_lse, exact = _grads(*args, torch.float64, **one)
        _, _, lowp = _grads(*args, dtype, **one)
        lse[:, :, rows] = seq_lse.float()
        o4[:, :, rows] = out.to(dtype)
        delta[:, :, rows] = (do4[:, :, rows].double() * o4[:, :, rows].double()).sum(-1).float()
        refs.append((rows, keys, exact, lowp))
    names = ("dq",) if key.op == "dq" else ("dk", "dv")
    outs = [torch.full_like(q4 if key.op == "dq" else k4, float("nan")) for _ in names]
    if key.op == "dq":
        fn.dq(q4, k4, v4, do4, lse, o4, delta, *outs, scale, *tail)
    else:
        fn(q4, k4, v4, do4, lse, delta, *outs, scale, *tail)
    worst, ok = 0.0, True
    for s, (rows, keys, exact, lowp) in enumerate(refs):
        for name, o, i in zip(names, outs, (0,) if key.op == "dq" else (1, 2), strict=True):
            part = o[:, :, rows if key.op == "dq" else keys]
            if part.numel() == 0:
                continue
            err = (part.double() - exact[i]).abs().max().item()
            bound = 3 * (lowp[i].double() - exact[i]).abs().max().item() + FLOOR[key.dtype]
            if math.isnan(err) or err > bound:
                ok = False
                print(f"   FAIL {key.name} sequence {s}: {name} err {err:.3g} > {bound:.3g}",
                      flush=True)
            worst = max(worst, err if not math.isnan(err) else float("inf"))
    return ok, f"max grad err {worst:.3g} (packed)"


def check(fn, key, device, strided: bool = True, fused: int | None = None,
          deterministic: bool = True) -> tuple[bool, str]:
    """Max errors over the odd shapes, vs the same maths in the input precision."""
    if key.varlen:
        return check_varlen(fn, key, device)
    if key.op != "fwd":
        return check_backward(fn, key, device, strided, fused, deterministic)
    import torch

    dtype = getattr(torch, key.dtype)
    worst, ok = 0.0, True
    for b, hkv, lq, lk, layout, q, k, v in _cases(key, device, strided):
        sinks = torch.randn(q.shape[1], device=device) if key.sinks else None
        scale = 1 / math.sqrt(key.head_dim)
        extra, mods = _mods(key, q, k)
        out, lse = _run(fn, q, k, v, sinks, scale, extra)
        ref, ref_lse = _reference(q, k, v, key.causal, scale, sinks, **mods)
        lowp, _ = (__import__("tvm_flash").attention_reference(
            q.float(), k.float(), v.float(), causal=key.causal, scale=scale,
            sinks=sinks, dtype=torch.float32, **mods))
        lowp = lowp.to(dtype)
        err = (out.double() - ref).abs().max().item()
        base = (lowp.double() - ref).abs().max().item()
        lerr = torch.where(torch.isinf(ref_lse) & torch.isinf(lse.double()), 0.0,
                           (lse.double() - ref_lse).abs()).max().item()
        lse_tol = 2e-2 if dtype == torch.bfloat16 else 4e-3  # P is summed rounded, as FA does
        bad = (math.isnan(err) or err > 2 * base + 1e-2 or math.isnan(lerr)
               or lerr > lse_tol)
        if bad:
            ok = False
            print(f"   FAIL {key.name} {layout} b{b} hkv{hkv} lq{lq} lk{lk}: out err {err:.3g}"
                  f" (base {base:.3g}), lse err {lerr:.3g}", flush=True)
        worst = max(worst, err if not math.isnan(err) else float("inf"))
    return ok, f"max out err {worst:.3g}"


def _grads(q, k, v, do, causal, scale, dtype, **mods):
    """Output, LSE and (dq, dk, dv) of ``attention_reference`` computed in ``dtype``."""
    import torch

    from tvm_flash import attention_reference

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=causal, scale=scale, dtype=dtype, **mods)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    return out.detach(), lse.detach(), grads


def _fused_workspace(q, row: int):
    """The 5-GEMM dK/dV's extra arguments: dQ's float32 sums (rows padded to 64-row query
    tiles, ``row`` floats each: ``cuda_hopper.dq_row``) and one counter per (batch, head,
    query tile), both zeroed."""
    import torch

    b, hq, lq, d = q.shape
    tiles = -(-lq // 64)
    return (torch.zeros(b, hq, tiles * 64, row, dtype=torch.float32, device=q.device),
            torch.zeros(b, hq, tiles, dtype=torch.int32, device=q.device))


def _tile_of(key, tile: dict):
    """The HopperTile a sweep's tile names (``"+"``: fields changed on the key's default
    tile)."""
    import importlib

    cuda_hopper = importlib.import_module("tvm_flash.schedules.cuda_hopper")
    if tile.get("+"):
        return dataclasses.replace(cuda_hopper.tile(key),
                                   **{f: x for f, x in tile.items() if f != "+"})
    return cuda_hopper.HopperTile(**tile)


def _fused_dq(acc, lq: int, d: int, scale: float, dtype):
    """dQ from the 5-GEMM dK/dV's float32 sums: rows cut to ``lq``, a padded tile's columns
    (``HopperTile.dq_pad``) to ``d``, scaled, rounded."""
    return (acc[:, :, :lq, :d] * scale).to(dtype)


def _run_backward(fn, op, q, k, v, do, lse, o, delta, scale, layout,
                  fused: int | None = None, extra=()):
    """Call the dq or dkv kernel on NaN-poisoned outputs (in ``layout``); its gradients
    (``fused``, the dQ accumulator's row of a 5-GEMM dK/dV: dq, dk, dv). ``o``: the forward's
    output, for a dQ that computes Delta from it."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if op == "dq":
        dq = _tensor(b, hq, lq, d, q.dtype, q.device, layout, float("nan"))
        fn.dq(q, k, v, do, lse, o, delta, dq, scale, *extra)
        return (dq,)
    dk = _tensor(b, hkv, lk, d, q.dtype, q.device, layout, float("nan"))
    dv = _tensor(b, hkv, lk, d, q.dtype, q.device, layout, float("nan"))
    if fused:
        acc, sem = _fused_workspace(q, fused)
        fn(q, k, v, do, lse, delta, dk, dv, scale, acc, sem)
        return _fused_dq(acc, lq, d, scale, q.dtype), dk, dv
    fn(q, k, v, do, lse, delta, dk, dv, scale, *extra)
    return dk, dv


def check_backward(fn, key, device, strided: bool = True, fused: int | None = None,
                   deterministic: bool = True) -> tuple[bool, str]:
    """dq or dkv alone, fed the float64 reference's LSE and Delta = rowsum(dO O): its
    gradients vs float64 within 3x the error of the same maths in the input precision + a
    floor (tests/checks.py). ``fused`` (its dQ row): the 5-GEMM dK/dV, dQ too, and every case
    run three times with bitwise-equal results (unless ``deterministic`` is False: its dQ adds in
    arrival order)."""
    import torch

    dtype = getattr(torch, key.dtype)
    names = ("dq",) if key.op == "dq" else ("dq", "dk", "dv") if fused else ("dk", "dv")
    worst, ok = 0.0, True
    for b, hkv, lq, lk, layout, q, k, v in _cases(key, device, strided):
        do = _tensor(*q.shape[:3], key.head_dim, dtype, device, layout)
        scale = 1 / math.sqrt(key.head_dim)
        extra, mods = _mods(key, q, k)
        out, lse, exact = _grads(q, k, v, do, key.causal, scale, torch.float64, **mods)
        _, _, lowp = _grads(q, k, v, do, key.causal, scale, dtype, **mods)
        o = out.to(dtype)  # as the forward returns it
        delta = (do.double() * o.double()).sum(-1).float().contiguous()
        ours = _run_backward(fn, key.op, q, k, v, do, lse.float().contiguous(), o, delta,
                             scale, layout, fused, extra)
        if fused and deterministic:
            for _ in range(2):
                again = _run_backward(fn, key.op, q, k, v, do, lse.float().contiguous(), o,
                                      delta, scale, layout, fused)
                if not all(torch.equal(a, o) for a, o in zip(again, ours, strict=True)):
                    ok = False
                    print(f"   FAIL {key.name} {layout} b{b} hkv{hkv} lq{lq} lk{lk}: runs "
                          "differ", flush=True)
        if q.is_cuda:
            torch.cuda.synchronize()
        pick = (0,) if key.op == "dq" else (0, 1, 2) if fused else (1, 2)
        for name, o, i in zip(names, ours, pick, strict=True):
            err = (o.double() - exact[i]).abs().max().item()
            base = (lowp[i].double() - exact[i]).abs().max().item()
            bound = 3 * base + FLOOR[key.dtype]
            if math.isnan(err) or err > bound:
                ok = False
                print(f"   FAIL {key.name} {layout} b{b} hkv{hkv} lq{lq} lk{lk}: {name} err "
                      f"{err:.3g} > bound {bound:.3g} (torch {key.dtype} err {base:.3g})",
                      flush=True)
            worst = max(worst, err if not math.isnan(err) else float("inf"))
    return ok, f"max grad err {worst:.3g}"


PROFILE_ONCE = False
"""``--profile-once``: each timed call runs once more between cudaProfilerStart and Stop, for
``ncu --profile-from-start off`` (or nsys) to profile exactly that call."""


def _profile_once(call) -> None:
    import torch

    if PROFILE_ONCE:
        torch.cuda.synchronize()
        with torch.cuda.profiler.profile():
            call()
            torch.cuda.synchronize()


def timing_backward(fn, key, n: int, device, fused: int | None = None) -> dict:
    """The kernel alone at B N = 16k tokens, hidden 2048 (inputs contiguous); ``fused`` (its
    dQ row): the 5-GEMM dK/dV with its accumulator zeroed before and converted after."""
    import torch
    from triton.testing import do_bench

    dtype = getattr(torch, key.dtype)
    d = key.head_dim
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v, do = (torch.randn(b, h, n, d, dtype=dtype, device=device) for _ in range(4))
    # LSE of a typical row (its scores spread ~N(0, 1)): P stays away from 0 and 1
    lse = torch.full((b, h, n), math.log(n) + 0.5, dtype=torch.float32, device=device)
    delta = torch.randn(b, h, n, dtype=torch.float32, device=device)
    o = torch.randn_like(q)  # a dQ that computes Delta reads it
    outs = [torch.empty_like(q) for _ in range(1 if key.op == "dq" else 2)]
    scale = 1 / math.sqrt(d)
    gemms = 5 if fused else GEMMS[key.op]
    flops = gemms * 2 * b * h * n * n * d // (2 if key.causal != "none" else 1)
    if fused:
        acc, sem = _fused_workspace(q, fused)
        dq = torch.empty_like(q)

        def call():
            acc.zero_()
            sem.zero_()
            fn(q, k, v, do, lse, delta, *outs, scale, acc, sem)
            dq.copy_(_fused_dq(acc, n, d, scale, dq.dtype))
    else:
        extra = _timed_mods(key, q, k)

        def call():
            if key.op == "dq":
                fn.dq(q, k, v, do, lse, o, delta, *outs, scale, *extra)
            else:
                fn(q, k, v, do, lse, delta, *outs, scale, *extra)
    ms = do_bench(call, warmup=50, rep=300, return_mode="median")
    _profile_once(call)
    return {"ours": flops / ms / 1e9, "ms": ms}


def timing(fn, key, n: int, device) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    dtype = getattr(torch, key.dtype)
    d = key.head_dim
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, device=device) for _ in range(3))
    causal = key.causal != "none"
    flops = 4 * b * h * n * n * d // (2 if causal else 1)
    res = {}
    extra = _timed_mods(key, q, k)
    ms = do_bench(lambda: _run(fn, q, k, v, None, 1 / math.sqrt(d), extra), warmup=50,
                  rep=300, return_mode="median")
    _profile_once(lambda: _run(fn, q, k, v, None, 1 / math.sqrt(d), extra))
    res["ours"], res["ms"] = flops / ms / 1e9, ms
    if key.mods:  # torch's backends have none of them: the plain key's row is the comparison
        return res
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                              warmup=50, rep=300, return_mode="median")
            res[name] = flops / ms / 1e9
        except RuntimeError:
            res[name] = None
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="fwd", help="kernels: fwd, dq, dkv (comma-separated)")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--causal", default="none,top-left,bottom-right")
    p.add_argument("--gqa", default="1,2")
    p.add_argument("--tiles", default="[null]",
                   help="JSON list of HopperTile fields (null: the default tile; with "
                        "\"+\": true, fields changed on the default tile), or a dict of such "
                        "lists by head dim, op:head dim or op:head dim:modifiers, e.g. "
                        "'{\"64\": [{\"step\": 192}], \"dkv:128\": [null, {\"step\": 32}], "
                        "\"fwd:128:softcap\": [null, {\"+\": true, \"tanh\": \"approx\"}]}'")
    p.add_argument("--seqlens", default="4096", help="timed lengths ('' : check only)")
    p.add_argument("--mma", action="store_true",
                   help="also check and time the mma.sync kernels (cuda-sm_90 keys; with "
                        "--mods / --varlen theirs too, checked)")
    p.add_argument("--mods", default="",
                   help="also score modifiers: comma-separated combinations of window, "
                        "softcap, alibi joined by '+' (checked; timed with a (1024, 0) window, a "
                        "cap of 30, ALiBi's geometric slopes: compare with the plain row)")
    p.add_argument("--varlen", action="store_true",
                   help="also the kernels for packed sequences (checked, not timed)")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--sass", action="store_true",
                   help="count HGMMA/HMMA, spills and conversions in each variant's SASS")
    p.add_argument("--profile-once", action="store_true",
                   help="run each timed call once more between cudaProfilerStart/Stop (for "
                        "ncu --profile-from-start off)")
    p.add_argument("--stall-s", type=float, default=120.0,
                   help="end the sweep, naming the stage, when a check shape, timing or load "
                        "runs this long (0: never; off with --profile-once)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    global PROFILE_ONCE
    PROFILE_ONCE = args.profile_once

    import importlib

    import torch

    import tvm_flash.build  # noqa: F401 - registers tvm_flash.schedules (also from a checkout)
    from tvm_flash.key import KernelKey

    cuda_hopper = importlib.import_module("tvm_flash.schedules.cuda_hopper")
    cuda_mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    torch.manual_seed(0)  # the same inputs on every run: a failure can be reproduced

    tiles = json.loads(args.tiles)
    combos = [dict.fromkeys(c.split("+"), True) for c in args.mods.split(",") if c]
    jobs = []
    for op, d, dt, causal, g in itertools.product(
            args.ops.split(","), [int(x) for x in args.head_dims.split(",")],
            args.dtypes.split(","), args.causal.split(","),
            [int(x) for x in args.gqa.split(",")]):
        with_sinks = op == "fwd" and (causal, g) == ("top-left", 1)
        for sinks in ((False, True) if with_sinks else (False,)):
            key = KernelKey(op, d, SHORT[dt], causal, g, "cuda-sm_90a", sinks=sinks)
            if not cuda_hopper.writes(key):  # written, served or not: a sweep decides that
                print(f"skipped {key.name}: no Hopper kernel", flush=True)
                continue
            if isinstance(tiles, dict):
                chosen = tiles.get(f"{op}:{d}", tiles.get(str(d), [None]))
            else:
                chosen = tiles
            jobs += [(key, t) for t in chosen]
            for combo, packed in itertools.product(
                    [{}, *combos] if not sinks else [], (False, True) if args.varlen else
                    (False,)):
                if not combo and not packed:
                    continue
                modded = KernelKey(op, d, SHORT[dt], causal, g, "cuda-sm_90a", varlen=packed,
                                   **combo)
                if cuda_hopper.writes(modded):
                    named = f"{op}:{d}:{'+'.join(combo)}" if not packed else None
                    picked = tiles.get(named, [None]) if isinstance(tiles, dict) else [None]
                    jobs += [(modded, t) for t in picked]
                modded = KernelKey(op, d, SHORT[dt], causal, g, "cuda-sm_90", varlen=packed,
                                   **combo)
                if args.mma and cuda_mma.writes(modded):
                    jobs.append((modded, None))
            mma = KernelKey(op, d, SHORT[dt], causal, g, "cuda-sm_90")
            if args.mma and not sinks and g == 1 and cuda_mma.supports(mma):
                jobs.append((mma, None))
    tmp = tempfile.mkdtemp()
    built = [None] * len(jobs)
    with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futs = {pool.submit(_build, *job, tmp): i for i, job in enumerate(jobs)}
        for fut in cf.as_completed(futs):
            try:
                built[futs[fut]] = fut.result()
            except Exception as err:  # noqa: BLE001 - report every failing variant
                print(f"BUILD FAIL {jobs[futs[fut]]}: {str(err)[-800:]}", flush=True)
    if args.sass:  # which tensor-core instructions each variant's machine code holds
        import subprocess

        for (key, t), files in zip(jobs, built, strict=True):
            if files is not None:
                sass = subprocess.run(["cuobjdump", "--dump-sass", files[1]], capture_output=True,
                                      text=True).stdout
                print(f"SASS {key.name} {t}: HGMMA {sass.count('HGMMA')}, HMMA "
                      f"{sass.count('HMMA')}, LDL/STL {sass.count('LDL') + sass.count('STL')}, "
                      f"F2F {sass.count('F2F.')}, F2FP {sass.count('F2FP')}, "
                      f"PRMT {sass.count('PRMT')}, MUFU {sass.count('MUFU')}, FFMA "
                      f"{sass.count('FFMA')}, FADD {sass.count('FADD')}, FMUL "
                      f"{sass.count('FMUL')}")
    device = torch.device("cuda")
    if args.stall_s > 0 and not args.profile_once:
        threading.Thread(target=_watchdog, args=(args.stall_s,), daemon=True).start()
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    rows = []
    for (key, t), files in zip(jobs, built, strict=True):
        if files is None:
            continue
        row = {"key": key.name, "tile": t}
        fused = (cuda_hopper.dq_row(key.head_dim, _tile_of(key, t)) if t and t.get("dq")
                 else None)
        try:
            _at(f"{key.name} {t} load")
            fn = _load(*files)
            row["ok"], row["check"] = check(fn, key, device, strided=key.target != "cuda-sm_90",
                                            fused=fused,
                                            deterministic=bool(t is None or t.get("ordered",
                                                                                  True)))
            if row["ok"] and not key.sinks and key.group == 1 and not key.varlen:
                for n in seqlens:
                    _at(f"{key.name} {t} timing N {n}")
                    row[f"n{n}"] = (timing(fn, key, n, device) if key.op == "fwd"
                                    else timing_backward(fn, key, n, device, fused))
        except Exception as err:  # noqa: BLE001 - a failing variant must not hide the others
            row["ok"], row["check"] = False, f"error: {str(err)[-600:]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    _at("")
    print("\nTFLOP/s: fwd 4 B H N^2 D (ours / torch flash / cudnn); dq 6 B H N^2 D and dkv "
          "8 B H N^2 D, the kernel alone (ours (mma.sync)); all halved causal")
    print("| key | tile | ok | TFLOP/s |")
    by_name = {r["key"]: r for r in rows if r["tile"] is None}
    for r in rows:
        if r["key"].endswith("cuda-sm_90") and not r["key"].startswith("fwd"):
            continue  # shown beside its Hopper row
        figs = []
        for k, v in r.items():
            if not (k.startswith("n") and isinstance(v, dict)):
                continue
            if "flash" in v or r["key"].startswith("fwd"):
                figs.append(f"N{k[1:]}: {v['ours']:.0f}/{v.get('flash') or 0:.0f}/"
                            f"{v.get('cudnn') or 0:.0f}")
            else:
                mma = by_name.get(r["key"].replace("cuda-sm_90a", "cuda-sm_90"), {}).get(k)
                figs.append(f"N{k[1:]}: {v['ours']:.0f}"
                            + (f" ({mma['ours']:.0f})" if mma else ""))
        print(f"| {r['key']} | {r['tile']} | {r['ok']} | {' '.join(figs)} |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
