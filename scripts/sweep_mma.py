#!/usr/bin/env python
"""Sweep tiles of the warp-level ``mma.sync`` kernels (``schedules/cuda_mma.py``) on this GPU.

For every head dim x dtype x causal mode x op and every candidate tile: build the kernel with
that tile (``cuda_mma.kernel(key, tile=...)``; assembled as the build does, ``--jobs`` at a time),
check it against a float64 torch reference with NaN-poisoned outputs (Lq x Lk = 97 x 97,
1025 x 1025, 7 x 300, 300 x 7, each MHA and GQA 2:1), then time it alone at each ``--seqlens``
N with B * N = ``--tokens`` and H = ``--hidden`` / D (MHA). Prints one table row per variant
and writes everything (registers, spills, shared memory, errors, TFLOP/s) as JSON to ``--out``.

TFLOP/s count the kernel's GEMMs (fwd 2, dQ 3, dK/dV 4 of 2 * N^2 * D per head; causal
halves), as docs/perf.md's per-kernel sweeps do. The chosen tile of each key is marked ``*``.

    python scripts/sweep_mma.py --out sweep.json            # D 192, 256; bf16; none, top-left
    python scripts/sweep_mma.py --head-dims 160 --dtypes fp16 --ops dkv \\
        --tiles dkv=8x64x1/2,8x32x1/2,4x32x1/2:1 --seqlens 4096 --out dkv160.json

A tile is written ``WARPSxSTEPxMTILES[/SPLIT][:STAGES][z][p]`` (``MmaTile`` fields; split: dK/dV
only; ``z``: ``zfill``, the walked tiles' copies without a branch; ``p``: ``pack``, the
forward's P converted two values an instruction). A tile that does not fit
(shared memory of this arch, split shape) is listed as refused with the reason; a variant whose
check fails is not timed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import importlib
import json
import math
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench.py

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
GEMMS = {"fwd": 2, "dq": 3, "dkv": 4}
CHECK_SHAPES = [(97, 97), (1025, 1025), (7, 300), (300, 7)]
FLOOR = {"float16": 1e-3, "bfloat16": 1e-2}  # tests/checks.py
DEFAULT_TILES = {
    "fwd": ["8x64x1", "8x32x1", "4x64x1", "4x32x1"],
    "dq": ["8x32x1", "4x32x1", "4x64x1", "8x16x1"],
    "dkv": ["8x64x1/2", "8x32x1/2", "4x64x1/2", "8x64x2/4"],
}
"""Candidates for D > 128 (for D <= 128 pass --tiles; docs/journal/perf-history.md v5-v7
swept those)."""


def parse_tile(spec: str):
    from tvm_flash.schedules.cuda_mma import MmaTile

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:/(\d+))?(?::(\d+))?(z)?(p)?", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"tile {spec!r}: expected WARPSxSTEPxMTILES[/SPLIT]"
                                         f"[:STAGES][z][p], e.g. 8x64x1/2 or 8x64x1zp")
    warps, step, mtiles, split, stages, zfill, pack = m.groups()
    return MmaTile(warps=int(warps), step=int(step), mtiles=int(mtiles),
                   split=int(split or 1), stages=int(stages or 2), zfill=bool(zfill),
                   pack=bool(pack))


def tile_name(t) -> str:
    return (f"{t.warps}x{t.step}x{t.mtiles}" + (f"/{t.split}" if t.split > 1 else "")
            + (f":{t.stages}" if t.stages != 2 else "") + ("z" if t.zfill else "")
            + ("p" if t.pack else ""))


# ------------------------------------------------------------------------------ building


def build(job: dict) -> dict:
    """Worker: lower one (key, tile), assemble it as the build does (``build.assemble``);
    paths and ptxas figures, or an error."""
    import tvm

    from tvm_flash.build import (  # registers tvm_flash.schedules
        assemble,
        compile_module,
        device_source,
        ptxas_figures,
    )
    from tvm_flash.key import KernelKey

    cuda_mma = importlib.import_module("tvm_flash.schedules.cuda_mma")

    key, t = KernelKey(**job["key"]), parse_tile(job["tile"])
    out = {**job, "error": None}
    try:
        func = cuda_mma.kernel(key, tile=t)
        out["smem_bytes"] = t.smem_bytes(key.op, key.head_dim)
    except ValueError as e:  # the tile does not fit: reported, not built
        out["error"] = f"refused: {e}"
        return out
    try:
        built = compile_module(key, tvm.IRModule({"main": func}))
    except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
        out["error"] = f"lowering failed: {type(e).__name__}: {str(e)[-300:]}"
        return out
    src = device_source(built)
    safe = job["tile"].replace("/", "s").replace(":", "st")
    stem = pathlib.Path(job["dir"]) / f"{key.name}-{safe}"
    built.export_library(f"{stem}.so")
    pathlib.Path(f"{stem}.cu").write_text(src)
    try:  # as scripts/build.py assembles it: TVM's nvcc flags (fast math and all)
        binary, log = assemble(key.target, src)
        regs, spilled = ptxas_figures(log)
    except (RuntimeError, ValueError) as e:
        out["error"] = f"nvcc failed: {str(e)[-500:]}"
        return out
    pathlib.Path(f"{stem}.fatbin").write_bytes(binary)
    out.update(so=f"{stem}.so", cubin=f"{stem}.fatbin", source_sha256=hashlib.sha256(
        src.encode()).hexdigest(), registers=regs[-1], spill_bytes=spilled)
    return out


def load(entry: dict):
    """The entry function of a built variant (its cubin served to TVM's loader by digest)."""
    import tvm_ffi

    from tvm_flash import artifacts
    from tvm_flash.build import SYMBOLS

    artifacts._install_callback()
    artifacts._prebuilt[entry["source_sha256"]] = pathlib.Path(entry["cubin"]).read_bytes()
    return tvm_ffi.load_module(entry["so"])[SYMBOLS[entry["key"]["op"]]]


# ------------------------------------------------------------------------------ checking


def _inputs(b, hq, hkv, lq, lk, d, dtype):
    import torch

    def r(*s):
        return torch.randn(*s, dtype=dtype, device="cuda")
    return r(b, hq, lq, d), r(b, hkv, lk, d), r(b, hkv, lk, d), r(b, hq, lq, d)


def _reference(q, k, v, do, causal, scale, dtype):

    from tvm_flash import attention_reference

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=causal, scale=scale, dtype=dtype)
    out.backward(do.to(dtype))
    delta = (do.double() * out.detach().to(q.dtype).double()).sum(-1)
    return {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad,
            "dk": leaves[1].grad, "dv": leaves[2].grad, "delta": delta}


def _run(fn, op, q, k, v, do, ref, scale):
    """Call a raw kernel with NaN-poisoned outputs; its outputs by name."""
    import torch

    f32 = dict(dtype=torch.float32, device="cuda")
    nan = float("nan")
    lse, delta = ref["lse"].float().contiguous(), ref["delta"].float().contiguous()
    if op == "fwd":
        o, lse_o = torch.full_like(q, nan), torch.full(q.shape[:3], nan, **f32)
        fn(q, k, v, torch.zeros(q.shape[1], **f32), o, lse_o, scale)
        return {"out": o, "lse": lse_o}
    if op == "dq":
        dq = torch.full_like(q, nan)
        fn(q, k, v, do, lse, delta, dq, scale)
        return {"dq": dq}
    dk, dv = torch.full_like(k, nan), torch.full_like(v, nan)
    fn(q, k, v, do, lse, delta, dk, dv, scale)
    return {"dk": dk, "dv": dv}


def check(fn, op, d, dtype_name, causal, hq, hkv) -> tuple[bool, float]:
    """Ours vs float64 on the check shapes: error <= 2x (O, LSE) / 3x (gradients) that of the
    same maths in the input precision plus tests/checks.py's floor. (passed, worst ratio of
    error to bound)."""
    import torch

    dtype = getattr(torch, dtype_name)
    worst = 0.0
    for lq, lk in CHECK_SHAPES:
        q, k, v, do = _inputs(1, hq, hkv, lq, lk, d, dtype)
        scale = 1 / math.sqrt(d)
        exact = _reference(q, k, v, do, causal, scale, torch.float64)
        lowp = _reference(q, k, v, do, causal, scale, dtype)
        ours = _run(fn, op, q, k, v, do, exact, scale)
        torch.cuda.synchronize()
        for name, o in ours.items():
            if torch.isnan(o).any():
                return False, math.inf
            e, lp = exact[name].double(), lowp[name].double()
            both_inf = torch.isinf(e) & (o.double() == e)
            err = torch.where(both_inf, 0.0, (o.double() - e).abs()).max().item()
            ref_err = torch.where(torch.isinf(e) & (lp == e), 0.0, (lp - e).abs()).max().item()
            bound = (2 if name in ("out", "lse") else 3) * ref_err + FLOOR[dtype_name]
            worst = max(worst, err / bound)
    return worst <= 1.0, worst


# ------------------------------------------------------------------------------ timing


def _time_ms(fn) -> float:
    """bench.py's timer (triton's ``do_bench`` median, else CUDA events), 60 ms a figure."""
    from bench import _time_ms as time_ms  # imported here: the build workers never need torch

    return time_ms(fn, 60)


_TIMING_INPUTS: dict = {}


def timing_inputs(n, d, dtype_name, causal, tokens, hidden):
    """Random q, k, v, dO with their LSE and Delta (torch, float32), cached per shape."""
    import torch
    import torch.nn.functional as F

    key = (n, d, dtype_name, causal, tokens, hidden)
    if key not in _TIMING_INPUTS:  # kept: a few hundred MiB per shape
        b, h = max(1, tokens // n), max(1, hidden // d)
        q, k, v, do = _inputs(b, h, h, n, n, d, getattr(torch, dtype_name))
        scale = 1 / math.sqrt(d)
        lse = torch.empty(b, h, n, dtype=torch.float32, device="cuda")
        mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril() if causal != "none" \
            else None
        for i in range(b):
            for j in range(h):
                s = (q[i, j].float() @ k[i, j].float().T) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, -math.inf)
                lse[i, j] = s.logsumexp(-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal != "none")
        delta = (do.float() * out.float()).sum(-1)
        _TIMING_INPUTS[key] = (b, h, q, k, v, do, lse, delta, scale)
    return _TIMING_INPUTS[key]


def time_variant(fn, op, d, dtype_name, causal, n, tokens, hidden) -> float:
    """TFLOP/s of the kernel's GEMMs at sequence length ``n``."""
    import torch

    b, h, q, k, v, do, lse, delta, scale = timing_inputs(n, d, dtype_name, causal, tokens,
                                                         hidden)
    if op == "fwd":
        o, lse_o = torch.empty_like(q), torch.empty_like(lse)
        sinks = torch.zeros(h, dtype=torch.float32, device="cuda")
        ms = _time_ms(lambda: fn(q, k, v, sinks, o, lse_o, scale))
    elif op == "dq":
        dq = torch.empty_like(q)
        ms = _time_ms(lambda: fn(q, k, v, do, lse, delta, dq, scale))
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        ms = _time_ms(lambda: fn(q, k, v, do, lse, delta, dk, dv, scale))
    flops = GEMMS[op] * 2 * b * h * n * n * d / (2 if causal != "none" else 1)
    return flops / ms / 1e9


# ------------------------------------------------------------------------------ main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="192,256")
    p.add_argument("--dtypes", default="bf16", help="bf16,fp16")
    p.add_argument("--causal", default="none,top-left", help="none,top-left,bottom-right")
    p.add_argument("--ops", default="fwd,dq,dkv")
    p.add_argument("--tiles", action="append", default=[], metavar="OP=TILE[,TILE...]",
                   help="candidates of one op (replaces its defaults; repeat per op)")
    p.add_argument("--seqlens", default="4096,1024")
    p.add_argument("--tokens", type=int, default=16384, help="B * N")
    p.add_argument("--hidden", type=int, default=2048, help="H * D")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--arch", help="sm_XX (default: this GPU's)")
    p.add_argument("--build-only", action="store_true",
                   help="build and report registers / spills only (no GPU needed)")
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)

    import torch

    import tvm_flash.build  # noqa: F401 - registers tvm_flash.schedules (also from a checkout)
    from tvm_flash.key import KernelKey

    cuda_mma = importlib.import_module("tvm_flash.schedules.cuda_mma")

    if args.arch is None:
        if not torch.cuda.is_available():
            p.error("no CUDA device: pass --arch (with --build-only)")
        major, minor = torch.cuda.get_device_capability()
        args.arch = f"sm_{major}{minor}"
    tiles = {op: [parse_tile(s) for s in specs] for op, specs in DEFAULT_TILES.items()}
    for spec in args.tiles:
        op, _, rest = spec.partition("=")
        if op not in GEMMS or not rest:
            p.error(f"--tiles {spec!r}: expected OP=TILE[,TILE...] with OP in {list(GEMMS)}")
        tiles[op] = [parse_tile(s) for s in rest.split(",")]
    ops = args.ops.split(",")
    dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]

    tmp = tempfile.mkdtemp(prefix="sweep-mma-")
    jobs = []
    for d in dims:
        for dt in args.dtypes.split(","):
            for causal in args.causal.split(","):
                for op in ops:
                    for group in (1, 2):  # timing and MHA checks; the GQA check
                        key = KernelKey(op, d, DTYPES[dt], causal, group, f"cuda-{args.arch}")
                        try:
                            chosen = cuda_mma.tile(key) if cuda_mma.supports(key) else None
                        except ValueError:  # no tile fits this arch
                            chosen = None
                        for t in dict.fromkeys(tiles[op] + ([chosen] if chosen else [])):
                            jobs.append({"key": {"op": op, "head_dim": d, "dtype": DTYPES[dt],
                                                 "causal": causal, "group": group,
                                                 "target": f"cuda-{args.arch}"},
                                         "tile": tile_name(t), "chosen": t == chosen,
                                         "dir": tmp})
    t0 = time.time()
    print(f"building {len(jobs)} kernels with {args.jobs} jobs into {tmp} ...", flush=True)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as ex:
        built = list(ex.map(build, jobs))
    print(f"built in {time.time() - t0:.0f} s", flush=True)

    rows = {}
    for entry in built:  # one row per (op, D, dtype, causal, tile): the group 1 and 2 builds
        k = entry["key"]
        rid = (k["op"], k["head_dim"], k["dtype"], k["causal"], entry["tile"])
        row = rows.setdefault(rid, {"op": k["op"], "head_dim": k["head_dim"],
                                    "dtype": k["dtype"], "causal": k["causal"],
                                    "tile": entry["tile"], "chosen": False, "error": None,
                                    "tflops": {}})
        row["chosen"] |= entry["chosen"]
        if entry["error"]:
            row["error"] = row["error"] or entry["error"]
            continue
        for f in ("registers", "spill_bytes", "smem_bytes"):
            row[f] = max(row.get(f) or 0, entry[f] or 0)
        row[f"group{k['group']}"] = entry

    header = (f"{'op':4} {'D':>3} {'dtype':8} {'causal':12} {'tile':11} {'regs':>4} "
              f"{'spill':>5} {'smem':>6} {'check':>6} "
              + " ".join(f"{'N=' + str(n):>7}" for n in seqlens))
    print(header)
    for row in rows.values():
        op, d, dt, causal = row["op"], row["head_dim"], row["dtype"], row["causal"]
        if not row["error"] and not args.build_only:
            try:
                ok1, w1 = check(load(row["group1"]), op, d, dt, causal, 2, 2)
                ok2, w2 = check(load(row["group2"]), op, d, dt, causal, 4, 2)
                row["check_worst_ratio"] = max(w1, w2)
                if not (ok1 and ok2):
                    row["error"] = f"check failed (error / bound {max(w1, w2):.2f})"
                else:
                    fn = load(row["group1"])
                    for n in seqlens:
                        row["tflops"][n] = time_variant(fn, op, d, dt, causal, n, args.tokens,
                                                        args.hidden)
            except Exception as e:  # noqa: BLE001 - a variant that crashes is reported
                row["error"] = f"{type(e).__name__}: {e}"[:300]
        for g in ("group1", "group2"):
            row.pop(g, None)
        mark = "*" if row["chosen"] else " "
        figures = " ".join(f"{row['tflops'].get(n, float('nan')):7.1f}" for n in seqlens)
        print(f"{op:4} {d:>3} {dt:8} {causal:12} {mark}{row['tile']:10} "
              f"{row.get('registers') or '-':>4} {row.get('spill_bytes', '-'):>5} "
              f"{(row.get('smem_bytes') or 0) // 1024:>5}K "
              f"{row.get('check_worst_ratio', float('nan')):6.2f} {figures}"
              + (f"  {row['error']}" if row["error"] else ""), flush=True)

    if args.out:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "arch": args.arch, "tokens": args.tokens, "hidden": args.hidden,
            "flops": "TFLOP/s of the kernel's GEMMs: fwd 2, dq 3, dkv 4 x 2*N^2*D per head; "
                     "causal halves", "results": list(rows.values())}, indent=1))
        print(f"wrote {args.out}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
