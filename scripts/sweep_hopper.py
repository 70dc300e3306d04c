#!/usr/bin/env python
"""Build, check and time variants of the Hopper (sm_90a) forward on the local GPU.

Every variant is compiled in parallel (TVM + nvcc, ``--jobs``), checked against a float64
reference on odd shapes (lengths 1, 7, 97, 300, 1025; GQA; every causal mode; sinks;
(B, L, H, D) storage viewed as (B, H, L, D)) with NaN-poisoned outputs, and only then timed at
B·N = 16k tokens, hidden 2048, side by side with torch SDPA's flash and cuDNN backends and the
``mma.sync`` forward (``cuda-sm_90`` keys) in the same process.

    python scripts/sweep_hopper.py --head-dims 64,128 --dtypes bf16 --out results.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHORT = {"bf16": "bfloat16", "fp16": "float16"}


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
        t = cuda_hopper.HopperTile(**tile) if tile else None
        func, pipeline = cuda_hopper.kernel(key, t), "tirx"
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
    return f"{stem}.so", f"{stem}.{fmt}", hashlib.sha256(src.encode()).hexdigest()


def _load(so, code, sha):
    import tvm_ffi

    from tvm_flash import artifacts

    artifacts._install_callback()
    artifacts._prebuilt[sha] = pathlib.Path(code).read_bytes()
    return tvm_ffi.load_module(so)["flash_fwd"]


def _reference(q, k, v, causal, scale, sinks):
    from tvm_flash import attention_reference

    return attention_reference(q.double(), k.double(), v.double(), causal=causal, scale=scale,
                               sinks=None if sinks is None else sinks.double(),
                               dtype=__import__("torch").float64)


def _run(fn, q, k, v, sinks, scale):
    import torch

    b, hq, lq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, lq), float("nan"), dtype=torch.float32, device=q.device)
    sk = sinks if sinks is not None else torch.zeros(hq, device=q.device)
    fn(q, k, v, sk, out, lse, scale)
    return out, lse


def check(fn, key, device, strided: bool = True) -> tuple[bool, str]:
    """Max errors over the odd shapes, vs the same maths in the input precision."""
    import torch

    dtype = getattr(torch, key.dtype)
    g, d = key.group, key.head_dim
    worst, ok = 0.0, True
    shapes = [(2, 2, 97, 97), (1, 1, 1025, 1025), (2, 1, 7, 300), (1, 2, 300, 7), (1, 1, 1, 1),
              (1, 2, 128, 128), (1, 1, 257, 1000)]
    for b, hkv, lq, lk in shapes:
        for layout in ("bhld", "blhd") if strided else ("bhld",):
            hq = hkv * g
            if layout == "blhd":
                q = torch.randn(b, lq, hq, d, dtype=dtype, device=device).transpose(1, 2)
                k = torch.randn(b, lk, hkv, d, dtype=dtype, device=device).transpose(1, 2)
                v = torch.randn(b, lk, hkv, d, dtype=dtype, device=device).transpose(1, 2)
            else:
                q, k, v = (torch.randn(b, h, n, d, dtype=dtype, device=device)
                           for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
            sinks = torch.randn(hq, device=device) if key.sinks else None
            scale = 1 / math.sqrt(d)
            out, lse = _run(fn, q, k, v, sinks, scale)
            ref, ref_lse = _reference(q, k, v, key.causal, scale, sinks)
            lowp, _ = (__import__("tvm_flash").attention_reference(
                q.float(), k.float(), v.float(), causal=key.causal, scale=scale,
                sinks=sinks, dtype=torch.float32))
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
    ms = do_bench(lambda: _run(fn, q, k, v, None, 1 / math.sqrt(d)), warmup=50, rep=300,
                  return_mode="median")
    res["ours"] = flops / ms / 1e9
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
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--causal", default="none,top-left,bottom-right")
    p.add_argument("--gqa", default="1,2")
    p.add_argument("--tiles", default="[null]",
                   help="JSON list of HopperTile fields (null: the default tile), or a dict of "
                        "such lists by head dim, e.g. '{\"64\": [{\"step\": 192}]}'")
    p.add_argument("--seqlens", default="4096")
    p.add_argument("--mma", action="store_true", help="also time the mma.sync forward")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--sass", action="store_true", help="count HGMMA/HMMA in each variant's SASS")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from tvm_flash.key import KernelKey

    tiles = json.loads(args.tiles)
    jobs = []
    for d, dt, causal, g in itertools.product(
            [int(x) for x in args.head_dims.split(",")], args.dtypes.split(","),
            args.causal.split(","), [int(x) for x in args.gqa.split(",")]):
        for sinks in ((False, True) if (causal, g) == ("top-left", 1) else (False,)):
            key = KernelKey("fwd", d, SHORT[dt], causal, g, "cuda-sm_90a", sinks=sinks)
            jobs += [(key, t) for t in (tiles[str(d)] if isinstance(tiles, dict) else tiles)]
            if args.mma and not sinks and g == 1:
                jobs.append((KernelKey("fwd", d, SHORT[dt], causal, g, "cuda-sm_90"), None))
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
                      f"{sass.count('HMMA')}, LDL/STL {sass.count('LDL') + sass.count('STL')}")
    device = torch.device("cuda")
    rows = []
    for (key, t), files in zip(jobs, built, strict=True):
        if files is None:
            continue
        row = {"key": key.name, "tile": t}
        try:
            fn = _load(*files)
            row["ok"], row["check"] = check(fn, key, device, strided=key.target != "cuda-sm_90")
            if row["ok"] and not key.sinks and key.group == 1:
                for n in [int(x) for x in args.seqlens.split(",")]:
                    row[f"n{n}"] = timing(fn, key, n, device)
        except Exception as err:  # noqa: BLE001 - a failing variant must not hide the others
            row["ok"], row["check"] = False, f"error: {str(err)[-600:]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| key | tile | ok | TFLOP/s ours / flash / cudnn |")
    for r in rows:
        figs = " ".join(f"N{k[1:]}: {v['ours']:.0f}/{v['flash'] or 0:.0f}/{v['cudnn'] or 0:.0f}"
                        for k, v in r.items() if k.startswith("n") and isinstance(v, dict))
        print(f"| {r['key']} | {r['tile']} | {r['ok']} | {figs} |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
