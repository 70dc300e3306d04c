#!/usr/bin/env python
"""Short queries against long keys: the short-query ("vector") kernels vs the tiled ones, and
torch SDPA's flash and cuDNN backends, side by side in one run.

For each (Lq, Lk) both of our paths run on the same tensors (the path is forced through
``tvm_flash.plan.SHORT_QUERY_MAX``), so the table shows where the short-query kernels stop
paying: the crossover that sets ``SHORT_QUERY_MAX``.

Figures: median ms of the forward (and of the backward with ``--backward``), and the forward's
effective bandwidth: bytes of K and V read once, 2 * B * Hkv * Lk * D * element size, over
the time (decode is bound by reading K/V). FLOPs (for reference): 4 * B * Hq * Lq * Lk * D.

    python scripts/bench_decode.py --lq 1,2,4,8,12,16 --lk 1024,4096,16384,65536,131072
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import BACKENDS, DTYPES, _commit, _time_ms  # noqa: E402

from tvm_flash import plan  # noqa: E402

PATHS = {"short": 1 << 30, "tiled": 0}  # SHORT_QUERY_MAX that forces each path


@contextlib.contextmanager
def _forced(name):
    """Inside: our kernels take the path ``name`` names (forward and backward alike)."""
    saved = plan.SHORT_QUERY_MAX
    plan.SHORT_QUERY_MAX = PATHS.get(name.removeprefix("tvm-flash-"), saved)
    try:
        yield
    finally:
        plan.SHORT_QUERY_MAX = saved


def measure(b, hq, hkv, lq, lk, d, dtype, backends, backward, reps):
    q = torch.randn(b, hq, lq, d, dtype=dtype, device="cuda")
    k = torch.randn(b, hkv, lk, d, dtype=dtype, device="cuda")
    v = torch.randn(b, hkv, lk, d, dtype=dtype, device="cuda")
    do = torch.randn_like(q) if backward else None
    runs = {f"tvm-flash-{p}": BACKENDS["tvm-flash"] for p in PATHS}
    runs.update({name: BACKENDS[name] for name in backends})
    row = {}
    for name, run in runs.items():
        with _forced(name):
            row[name] = _entry(run, q, k, v, do, reps)
    return row


def _entry(run, q, k, v, do, reps):
    """Forward (and backward, given ``do``) times of one backend; all non-causal (every key
    visible), as SDPA's ``is_causal`` is top-left, not the bottom-right that decoding means."""
    b, hkv, lk, d = k.shape

    def fwd():
        with torch.no_grad():
            run(q, k, v, False)
    try:
        fwd()
    except RuntimeError as err:  # a backend that refuses the shape
        return {"error": str(err).splitlines()[0][:120]}
    entry = {"fwd_ms": _time_ms(fwd, reps)}
    entry["fwd_GBps"] = 2 * b * hkv * lk * d * q.element_size() / entry["fwd_ms"] / 1e6
    if do is not None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves, False)
        entry["bwd_ms"] = _time_ms(
            lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), reps)
    return entry


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lq", default="1,2,4,8,12,16")
    p.add_argument("--lk", default="1024,4096,16384,65536,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--backends", default="flash,cudnn")
    p.add_argument("--backward", action="store_true", help="also time the backward")
    p.add_argument("--rep-ms", type=int, default=50)
    p.add_argument("--out", default="bench-decode.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench_decode.py needs a CUDA GPU")
    hq, hkv = (int(x) for x in args.heads.split(","))
    backends = [x for x in args.backends.split(",") if x]
    results = []
    print(f"# {torch.cuda.get_device_name()}, B={args.batch}, Hq={hq}, Hkv={hkv}, "
          f"D={args.head_dim}, {args.dtype}; fwd ms (GB/s of K+V read)")
    for lq, lk in itertools.product((int(x) for x in args.lq.split(",")),
                                    (int(x) for x in args.lk.split(","))):
        row = measure(args.batch, hq, hkv, lq, lk, args.head_dim, DTYPES[args.dtype], backends,
                      args.backward, args.rep_ms)
        results.append({"lq": lq, "lk": lk, **row})
        cells = []
        for name, e in row.items():
            if "error" in e:
                cells.append(f"{name} n/a")
                continue
            bwd = f" bwd {e['bwd_ms']:.3f}" if "bwd_ms" in e else ""
            cells.append(f"{name} {e['fwd_ms']:.3f} ({e['fwd_GBps']:.0f}){bwd}")
        print(f"Lq={lq:3d} Lk={lk:7d}: " + " | ".join(cells), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": _commit(), "date": datetime.date.today().isoformat(),
            "batch": args.batch, "hq": hq, "hkv": hkv, "head_dim": args.head_dim,
            "dtype": args.dtype, "short_query_max": plan.SHORT_QUERY_MAX}
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
