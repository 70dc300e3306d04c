#!/usr/bin/env python
"""Benchmark tvm-flash against torch SDPA's flash, cuDNN and efficient backends, side by side.

Every configuration runs all backends on the same tensors in one process. Shapes follow the
flash-attention convention: B * N = --tokens, H * D = --hidden.

FLOPs counted (printed with the results):
    forward   4 * B * Hq * N^2 * D      (two GEMMs of 2 * N^2 * D each per head)
    backward  2.5 * forward             (five GEMMs instead of two)
    causal    half of the above
Times are medians (triton.testing.do_bench when triton is present, else CUDA events).

--layouts picks how q, k, v and dout lie in memory: ``bhld`` contiguous (B, H, L, D) tensors,
``blhd`` (B, L, H, D) storage viewed as (B, H, L, D) by ``.transpose(1, 2)``, as a model's QKV
projection hands them to attention.

    python scripts/bench.py --dtypes bf16 --head-dims 64,128 --seqlens 1024,4096 --causal both
    python scripts/bench.py --dtypes bf16 --head-dims 128 --seqlens 4096 --causal yes \
        --layouts bhld,blhd --backends tvm-flash,flash

--artifacts NAME=DIR (repeatable) adds a backend ``tvm-flash:NAME``: tvm-flash with the kernels
``scripts/build.py`` wrote to DIR and nothing built on first use, e.g. builds with and without
the tuning logs side by side:

    python scripts/build.py --target cuda:sm_90a --out /tmp/tuned --jobs 16
    python scripts/build.py --target cuda:sm_90a --out /tmp/default --tuning-logs none
    python scripts/bench.py --artifacts default=/tmp/default --artifacts tuned=/tmp/tuned \
        --backends tvm-flash:default,tvm-flash:tuned,flash,cudnn
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import tvm_flash  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd")
LAYOUTS = ("bhld", "blhd")
FLOP_FORMULA = ("fwd = 4*B*Hq*N^2*D; bwd = 2.5*fwd; fwd+bwd = 3.5*fwd; causal halves each")


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return run


def _ours(q, k, v, causal):
    return tvm_flash.attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


BACKENDS = {"tvm-flash": _ours, "flash": _sdpa("flash"), "cudnn": _sdpa("cudnn"),
            "efficient": _sdpa("efficient")}


def _tensor(b, h, n, d, dtype, layout):
    """A (B, H, N, D) tensor: contiguous (``bhld``) or a view of (B, N, H, D) storage."""
    if layout == "blhd":
        return torch.randn(b, n, h, d, dtype=dtype, device="cuda").transpose(1, 2)
    return torch.randn(b, h, n, d, dtype=dtype, device="cuda")


def _event_ms(fn, reps: int, before=None) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn``; ``before()``, if given, runs ahead of
    each one, untimed."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_ms(fn, reps: int) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=reps, return_mode="median"))
    except ImportError:
        for _ in range(3):
            fn()
        return _event_ms(fn, 20)


def _measure(run, q, k, v, do, causal, reps):
    """Times of fwd, bwd, fwd+bwd in ms and peak extra memory of fwd+bwd in bytes."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            run(*leaves, causal)

    def fwd_bwd():
        out = run(*leaves, causal)
        torch.autograd.grad(out, leaves, do)

    out = run(*leaves, causal)  # also checks the backend accepts the shape

    def bwd():
        torch.autograd.grad(out, leaves, do, retain_graph=True)

    bwd()
    torch.cuda.synchronize()
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = run(*leaves, causal)
    times = {"fwd": _time_ms(fwd, reps), "bwd": _time_ms(bwd, reps),
             "fwd+bwd": _time_ms(fwd_bwd, reps)}
    return times, peak


def flops(mode, b, hq, n, d, causal):
    f = 4 * b * hq * n * n * d * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
    return f / 2 if causal else f


def _commit():
    if os.environ.get("TVM_FLASH_COMMIT"):  # a copy of the tree without .git
        return os.environ["TVM_FLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16, fp32")
    p.add_argument("--head-dims", default="64,128", help="comma list of head dims")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384",
                   help="comma list of sequence lengths N (Lq = Lk = N)")
    p.add_argument("--tokens", type=int, default=16384, help="B * N (batch from the length)")
    p.add_argument("--hidden", type=int, default=2048, help="Hq * D (query heads from D)")
    p.add_argument("--gqa", default="1", help="comma list of Hq/Hkv ratios, e.g. 1,8")
    p.add_argument("--causal", default="both", choices=["no", "yes", "both"])
    p.add_argument("--layouts", default="bhld",
                   help="comma list of bhld (contiguous), blhd ((B, L, H, D) viewed (B, H, L, D))")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--artifacts", action="append", default=[], metavar="NAME=DIR",
                   help="add backend tvm-flash:NAME running the kernels built into DIR")
    p.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement")
    p.add_argument("--out", default="bench-results", help="directory for results.json (+ png)")
    p.add_argument("--replot", metavar="RESULTS_JSON", help="only redraw the plot of a run")
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA device")

    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    backends = args.backends.split(",")
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            sys.exit(f"--layouts: unknown layout {name!r}; use {', '.join(LAYOUTS)}")
    places = {}  # backend -> (artifact directory, JIT allowed); None: the environment's
    for spec in args.artifacts:
        label, sep, directory = spec.partition("=")
        if not sep or not label or not pathlib.Path(directory, "manifest.json").exists():
            sys.exit(f"--artifacts: {spec!r} is not NAME=DIR with DIR written by build.py")
        places[f"tvm-flash:{label}"] = (directory, False)
    known = {**BACKENDS, **dict.fromkeys(places, _ours)}
    for name in backends:
        if name not in known:
            sys.exit(f"--backends: unknown backend {name!r}; use {', '.join(known)}")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {_commit()}")
    print(f"FLOPs: {FLOP_FORMULA}")
    header = (f"{'dtype':5} {'D':>4} {'N':>6} {'B':>3} {'Hq':>3} {'Hkv':>3} {'layout':6} "
              f"{'causal':6} {'mode':8}")
    print(header + "".join(f" {b:>11}" for b in backends) + "   (TFLOP/s)")
    rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for d in map(int, args.head_dims.split(",")):
            for ratio in map(int, args.gqa.split(",")):
                for n, layout in itertools.product(map(int, args.seqlens.split(",")), layouts):
                    b, hq = max(1, args.tokens // n), args.hidden // d
                    hkv = hq // ratio
                    q = _tensor(b, hq, n, d, dtype, layout)
                    k = _tensor(b, hkv, n, d, dtype, layout)
                    v = _tensor(b, hkv, n, d, dtype, layout)
                    do = torch.randn_like(q)  # q's strides: the gradient of a blhd output
                    for causal in causals:
                        res = {}
                        for name in backends:
                            directory, jit = places.get(name, (None, None))
                            tvm_flash.use_artifacts(directory)  # plans follow the switch
                            tvm_flash.allow_jit(jit)
                            try:
                                res[name] = _measure(known[name], q, k, v, do, causal,
                                                     args.rep_ms)
                            except RuntimeError as e:  # backend refuses this shape
                                res[name] = None
                                print(f"  {name}: not run ({str(e).splitlines()[0][:80]})")
                        for mode in MODES:
                            f = flops(mode, b, hq, n, d, causal)
                            cells, row = [], {
                                "dtype": dname, "D": d, "N": n, "B": b, "Hq": hq, "Hkv": hkv,
                                "layout": layout, "causal": causal, "mode": mode, "flops": f,
                                "ms": {}, "tflops": {}, "peak_bytes": {}}
                            for name in backends:
                                if res[name] is None:
                                    cells.append(f" {'n/a':>11}")
                                    continue
                                ms = res[name][0][mode]
                                row["ms"][name] = ms
                                row["tflops"][name] = f / ms / 1e9
                                row["peak_bytes"][name] = res[name][1]
                                cells.append(f" {f / ms / 1e9:11.1f}")
                            rows.append(row)
                            print(f"{dname:5} {d:4} {n:6} {b:3} {hq:3} {hkv:3} {layout:6} "
                                  f"{str(causal):6} {mode:8}" + "".join(cells), flush=True)
                        mem = "  ".join(f"{nm} {res[nm][1] / 2**20:.0f} MiB" for nm in backends
                                        if res[nm] is not None)
                        print(f"{'':51}peak fwd+bwd memory: {mem}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": _commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "flop_formula": FLOP_FORMULA,
            "artifacts": {name: place[0] for name, place in places.items()}}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, backends, out)
    print(f"wrote {out / 'results.json'}")


def _plot(rows, backends, out):
    """One panel per (dtype, D, GQA, layout) x causal; colour = backend, solid = fwd, dashed =
    bwd."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    def panel(r):
        return r["dtype"], r["D"], r["Hq"] // r["Hkv"], r.get("layout", "bhld")

    panel_rows = sorted({panel(r) for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(panel_rows), len(causals), squeeze=False, sharey=True,
                             figsize=(4.5 * len(causals), 2.6 * len(panel_rows)))
    colors = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"],
                      strict=False))
    for (i, prow), (j, causal) in itertools.product(enumerate(panel_rows), enumerate(causals)):
        ax = axes[i, j]
        for name, mode in itertools.product(backends, ("fwd", "bwd")):
            pts = sorted((r["N"], r["tflops"][name]) for r in rows
                         if panel(r) == prow
                         and r["causal"] == causal and r["mode"] == mode and name in r["tflops"])
            if pts:
                ax.plot(*zip(*pts, strict=True), color=colors[name], marker=".",
                        linestyle="-" if mode == "fwd" else "--", label=f"{name} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{prow[0]} D={prow[1]} gqa={prow[2]} {prow[3]} causal={causal}",
                     fontsize=9)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "tflops.png", dpi=60)
    plt.close(fig)


def replot(results_json: str) -> None:
    """Redraw the plot of an earlier run from its results.json."""
    path = pathlib.Path(results_json)
    data = json.loads(path.read_text())
    backends = list(dict.fromkeys(n for r in data["rows"] for n in r["tflops"]))
    _plot(data["rows"], backends, path.parent)
    print(f"wrote {path.parent / 'tflops.png'}")


if __name__ == "__main__":
    main()
