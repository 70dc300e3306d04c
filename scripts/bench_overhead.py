#!/usr/bin/env python
"""Per-call wall time of tvm-flash against torch SDPA at shapes small enough that the host
side (Python, dispatch, allocation, launches) is what a call costs.

Three cases (issue #20's shapes; bf16 on CUDA):

    fwd      B 2, H 8, N 128, D 64, causal                     forward only, no autograd graph
    fwd+bwd  the same, forward and backward                    out.backward(do)
    decode   B 1, Hq 32, Hkv 8, Lq 1, Lk 4096, D 128           forward only, no mask

Rows: torch SDPA (``F.scaled_dot_product_attention``), ``tvm_flash.attention`` on
(B, H, L, D) tensors and, where the package has it, ``tvm_flash.flash_attn_func`` on
(B, L, H, D) tensors. A figure is the median over ``--repeats`` runs of ``--iters``
back-to-back calls, divided by ``--iters``; the device is synchronised after each run. The
rows of a shape are timed in turns (``measure_case``) and a ratio to SDPA is the median of
the turns' ratios; the ratio of the two rows' fastest runs is printed beside it (a host shared
with other work slows some runs by up to 2x: the fastest run is the least disturbed). With
tiny kernels the device finishes each call before the host issues the next, so this is the
host's cost per call.

On CUDA if present, else on the CPU (``--device`` overrides); ``--tiny`` shrinks every shape
(CPU: lets the host part show next to the CPU kernels' own time).

    TVM_FLASH_JIT=1 python scripts/bench_overhead.py --out overhead.json          # H200
    TVM_FLASH_JIT=1 python scripts/bench_overhead.py --tiny --dtype fp32          # CPU

``--compiled`` adds each row once more through ``torch.compile`` (the function compiled, so
``tvm_flash`` runs as its two custom ops inside the compiled graphs, as in a compiled
training step). ``--profile`` then shows, per row and case, where the time goes
(torch.profiler: device kernels per call, host ops). ``--tensormaps`` times what the Hopper
kernels add to each call on the host: encoding a TMA tensor map (``cuTensorMapEncodeTiled``,
called from libcuda directly, the ctypes call's own cost measured on ``cuDriverGetVersion``
and taken off) — three maps a forward, four a dQ or dK/dV kernel
(``schedules/cuda_hopper.py``, ``_tmap``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import DTYPES, _commit  # noqa: E402

import tvm_flash  # noqa: E402

# name -> (B, Hq, Hkv, Lq, Lk, D, causal, backward)
SHAPES = {"fwd": (2, 8, 8, 128, 128, 64, True, False),
          "fwd+bwd": (2, 8, 8, 128, 128, 64, True, True),
          "decode": (1, 32, 8, 1, 4096, 128, False, False)}
TINY = {"fwd": (1, 2, 2, 16, 16, 64, True, False),
        "fwd+bwd": (1, 2, 2, 16, 16, 64, True, True),
        "decode": (1, 4, 1, 1, 64, 64, False, False)}


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attention(q, k, v, causal):
    return tvm_flash.attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _flash_attn(q, k, v, causal):  # (B, L, H, D) in and out
    return tvm_flash.flash_attn_func(q, k, v, causal=causal)


IMPLS = {"sdpa": (_sdpa, "bhld"), "tvm_flash.attention": (_attention, "bhld")}
if hasattr(tvm_flash, "flash_attn_func"):
    IMPLS["tvm_flash.flash_attn_func"] = (_flash_attn, "blhd")


def _per_call_us(fn, device, iters: int, repeats: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(max(3, iters // 10)):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        runs.append((time.perf_counter() - start) / iters)
    return statistics.median(runs) * 1e6


def measure_case(shape, impls: dict, dtype, device, iters, repeats) -> dict:
    """Per-call µs of every row at one shape, the rows timed in turns (run ``r`` of each row
    before run ``r + 1`` of any, the first row rotating): the host drifts by tens of percent
    within minutes, which a row timed after another would take for its own cost. Returns
    ``{row: [per-call µs of each run]}``."""
    calls = {name: _call(shape, impl, layout, dtype, device)
             for name, (impl, layout) in impls.items()}
    for fn in calls.values():
        _per_call_us(fn, device, iters, 1)  # warm-up (and the first call's build)
    runs = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(_per_call_us(calls[name], device, iters, 1))
    return runs


def profile(case, shape, impl, layout, dtype, device, calls: int = 50) -> None:
    """Where one call's time goes: torch.profiler over ``calls`` calls — the device kernels
    (their summed time per call says whether the call is bound by them or by the host) and
    the host ops."""
    fn = _call(shape, impl, layout, dtype, device)
    for _ in range(10):
        fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / calls
    print(f"\n## {case}: {device_us:.1f} us of device kernels per call")
    print(events.table(sort_by="self_device_time_total" if device.type == "cuda"
                       else "self_cpu_time_total", row_limit=15, max_name_column_width=50))


def _call(shape, impl, layout, dtype, device):
    """One call of ``impl`` on fresh random inputs of ``shape`` (forward, or forward and
    backward), as a no-argument function."""
    b, hq, hkv, lq, lk, d, causal, backward = shape
    q = torch.randn(b, hq, lq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, lk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, lk, d, dtype=dtype, device=device)
    do = torch.randn(b, hq, lq, d, dtype=dtype, device=device)
    if layout == "blhd":  # flash-attn's layout, contiguous as a model's projections give it
        q, k, v, do = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def fn():
            impl(q, k, v, causal).backward(do)
    else:
        def fn():
            with torch.no_grad():
                impl(q, k, v, causal)
    return fn


TENSOR_MAPS = {"fwd": 3, "dq": 4, "dkv": 4}  # _tmap calls per Hopper kernel launch


def tensormap_us(device, calls: int = 20000) -> float:
    """Microseconds of one ``cuTensorMapEncodeTiled`` with the forward's arguments for K at
    issue #20's small shape (bf16, D 64, 128 rows, 8 heads, batch 2; 64 x 128 boxes, 128-byte
    swizzle), less the cost of a ctypes call into the driver."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    t = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, device=device)
    tmap = (ctypes.c_uint64 * 16)()  # CUtensorMap: 128 bytes, 64-byte aligned by ctypes' heap
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * 4)(64, 128, 8, 2)
    strides = (u64 * 3)(64 * 2, 128 * 64 * 2, 8 * 128 * 64 * 2)
    box, one = (u32 * 4)(64, 128, 1, 1), (u32 * 4)(1, 1, 1, 1)
    bf16, swizzle_128b, l2_128b = 9, 3, 2  # CUtensorMapDataType, ...Swizzle, ...L2promotion
    args = (ctypes.byref(tmap), bf16, 4, ctypes.c_void_p(t.data_ptr()), dims, strides, box,
            one, 0, swizzle_128b, l2_128b, 0)
    encode = cuda.cuTensorMapEncodeTiled
    err = encode(*args)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled returned CUresult {err}")
    version = ctypes.byref(ctypes.c_int())
    return (_per_call_us(lambda: encode(*args), device, calls, 5)
            - _per_call_us(lambda: cuda.cuDriverGetVersion(version), device, calls, 5))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--tiny", action="store_true", help="shrink every shape (see TINY)")
    p.add_argument("--iters", type=int, default=200, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs (median taken)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", action="store_true",
                   help="then profile each row in each case (torch.profiler)")
    p.add_argument("--compiled", action="store_true",
                   help="also each row through torch.compile")
    p.add_argument("--tensormaps", action="store_true",
                   help="also time the TMA tensor maps the Hopper kernels encode per call")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tmap_us = None
    if args.tensormaps:
        if device.type != "cuda":
            raise SystemExit("--tensormaps: needs a CUDA device")
        tmap_us = tensormap_us(device)
        print(f"# cuTensorMapEncodeTiled: {tmap_us:.2f} us a map; per launch "
              + ", ".join(f"{op} {n * tmap_us:.2f} us" for op, n in TENSOR_MAPS.items()))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shapes = TINY if args.tiny else SHAPES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, {dtype}, torch {torch.__version__}; microseconds per call "
          f"(median of {args.repeats} x {args.iters} calls)")
    impls = dict(IMPLS)
    if args.compiled:
        impls.update({f"{name} (compiled)": (torch.compile(impl), layout)
                      for name, (impl, layout) in IMPLS.items()})
    runs = {case: measure_case(shape, impls, dtype, device, args.iters, args.repeats)
            for case, shape in shapes.items()}
    results = {name: {c: statistics.median(runs[c][name]) for c in shapes} for name in impls}
    print(f"{'':34}" + "".join(f"{case:>10}" for case in shapes))
    for impl_name in impls:
        print(f"{impl_name:34}" + "".join(f"{results[impl_name][c]:10.1f}" for c in shapes))
    ratios, best_ratios = {}, {}
    for impl_name in impls:
        base = "sdpa (compiled)" if impl_name.endswith("(compiled)") else "sdpa"
        if not impl_name.startswith("sdpa"):
            # the median of the per-turn ratios: each compares runs made moments apart
            ratios[impl_name] = {c: statistics.median(
                a / b for a, b in zip(runs[c][impl_name], runs[c][base], strict=True))
                for c in shapes}
            best = best_ratios[impl_name] = {
                c: min(runs[c][impl_name]) / min(runs[c][base]) for c in shapes}
            print(f"# {impl_name} / {base} (median per-turn ratio): "
                  + " ".join(f"{c} {ratios[impl_name][c]:.2f}x" for c in shapes)
                  + "; best run / best run: " + " ".join(f"{c} {best[c]:.2f}x" for c in shapes))
    if args.out:
        meta = {"device": name, "dtype": str(dtype), "torch": torch.__version__,
                "commit": _commit(), "date": datetime.date.today().isoformat(),
                "iters": args.iters, "repeats": args.repeats,
                "shapes": {c: dict(zip(("B", "Hq", "Hkv", "Lq", "Lk", "D", "causal",
                                        "backward"), s, strict=True))
                           for c, s in shapes.items()}, "tensormap_us": tmap_us}
        pathlib.Path(args.out).write_text(json.dumps(
            {"meta": meta, "us_per_call": results, "ratio_to_sdpa": ratios,
             "best_run_ratio_to_sdpa": best_ratios,
             "runs": {c: {n: [round(x, 1) for x in r] for n, r in rc.items()}
                      for c, rc in runs.items()}}, indent=1))
        print(f"wrote {args.out}")
    if args.profile:
        for impl_name, (impl, layout) in impls.items():
            for case, shape in shapes.items():
                profile(f"{impl_name}, {case}", shape, impl, layout, dtype, device)


if __name__ == "__main__":
    main()
