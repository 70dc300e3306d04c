#!/usr/bin/env python
"""Tune tvm-flash kernels with MetaSchedule on this machine and write tuning logs.

The search space is the explicit schedule itself (tiles that fit, GEMM thread grids, sampled
unroll); MetaSchedule's xgboost cost model and evolutionary search choose what to measure on the
local device. Kernels written out at warp level are tuned over their variants where their
schedule offers some (the Hopper and ``mma.sync`` kernels' tiles:
``tvm_flash.tuning.tune_variants``), each variant a workload, the xgboost model choosing which
to measure next; those without (keys with score modifiers or packed sequences) are skipped.
Logs go to ``tuning_logs/<target>/<kernel key>/`` and a rerun resumes from them;
``scripts/build.py`` applies them on any machine, GPU or not.

    python scripts/tune.py --target cuda:sm_90 --kernels fwd,dq,dkv --head-dims 64,128 \\
        --dtypes bf16 --trials 256 --time-budget 20m
    python scripts/tune.py --target cuda:sm_90a --kernels fwd,dq,dkv --head-dims 64,128 \\
        --dtypes bf16 --causal none,top-left --trials 12   # Hopper variants (an H100/H200)
    python scripts/tune.py --target metal --dry-run      # space generation + build, no GPU
    python scripts/tune.py --target cuda:sm_90a --kernels fwd --lengths 0,1024 --trials 12
        # a log for every length and one for calls up to 1024 long (their own build)
    python scripts/tune.py --target cuda:sm_90a --dtypes bf16,fp16 --lengths 0,1024 \
        --trials 8 --jobs 6   # six processes build at once; one times on the GPU at a time

A kernel whose log already holds ``--trials`` measurements is skipped, so an interrupted run
continues where it stopped.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tvm_flash import tuning  # noqa: E402
from tvm_flash.build import schedules  # noqa: E402
from tvm_flash.key import CAUSAL_MODES, DTYPES, LENGTH_BUCKETS, KernelKey  # noqa: E402
from tvm_flash.target import parse_target, target_kind  # noqa: E402

SHORT = {v: k for k, v in DTYPES.items()}


def _csv(text, convert=str):
    return [convert(x) for x in text.split(",") if x]


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--time-budget: {text!r} is not like 90s, 20m, 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="llvm | cuda | cuda:sm_XY | metal[:chip]")
    p.add_argument("--kernels", default="fwd,dq,dkv", help="comma list of fwd, dq, dkv")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp16, fp32")
    p.add_argument("--causal", default="none,top-left", help=f"from {', '.join(CAUSAL_MODES)}")
    p.add_argument("--gqa", default="1", help="comma list of GQA group sizes")
    p.add_argument("--lengths", default="0",
                   help="comma list of length buckets: 0 (every length) and/or "
                        f"{', '.join(map(str, LENGTH_BUCKETS))} (calls whose longest sequence "
                        "is that short get their own build, tuned at that length)")
    p.add_argument("--exclude", default="",
                   help="comma list of kernel-key name patterns (fnmatch) to leave out, e.g. "
                        "a log removed on purpose: 'dq-d128-*-g1-cuda-sm_90a'")
    p.add_argument("--trials", type=int, default=256, help="measured candidates per kernel")
    p.add_argument("--max-tiles", type=int, default=2,
                   help="how many of the largest fitting tiles to search (trials split evenly)")
    p.add_argument("--time-budget", type=_seconds, default=None,
                   help="start no new kernel after this long (e.g. 20m)")
    p.add_argument("--keep-top", type=int, default=2, help="records kept per workload")
    p.add_argument("--logs", default=str(ROOT / "tuning_logs"), help="tuning log root")
    p.add_argument("--dry-run", action="store_true",
                   help="generate and build every design space; measure nothing")
    p.add_argument("--flush-l2", action="store_true",
                   help="variant kernels: time each call alone after clearing the GPU's L2, "
                        "as scripts/bench.py's timings do (default: MetaSchedule's, calls "
                        "back to back)")
    p.add_argument("--jobs", type=int, default=1,
                   help="tuning processes (variant kernels): each tunes every N-th kernel, "
                        "building in parallel with the others; timing on the device is "
                        "serialized by a lock, so measurements never overlap")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/N,lockfile"
    p.add_argument("--build-workers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        target = parse_target(args.target)
        keys = [KernelKey(op, d, SHORT[dt], causal, g, target, lengths=n)
                for n, op, d, dt, causal, g in itertools.product(
                    _csv(args.lengths, int), _csv(args.kernels), _csv(args.head_dims, int),
                    _csv(args.dtypes), _csv(args.causal), _csv(args.gqa, int))]
    except (ValueError, KeyError) as err:
        p.error(str(err))
    patterns = _csv(args.exclude)
    keys = [k for k in keys if not any(fnmatch.fnmatchcase(k.name, pat) for pat in patterns)]
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    # keys MetaSchedule's own search tunes: it times inside tune(), outside --jobs' lock and
    # with its own evaluator
    factory = [k.name for k in keys if not schedules.lowers(target_kind(k.target), k)]
    if args.jobs > 1 and not args.dry_run and factory:
        p.error(f"--jobs tunes variant kernels only; {factory[0]} is searched by "
                "MetaSchedule's tuner, run it with --jobs 1")
    if args.flush_l2 and not args.dry_run and factory:
        p.error(f"--flush-l2 times variant kernels only; {factory[0]} is searched by "
                "MetaSchedule's tuner")
    if args.worker is None and not args.dry_run:
        # variant logs already complete are left out here, once, so that --jobs shares out
        # only the kernels still to tune
        done = [k for k in keys if schedules.lowers(target_kind(k.target), k)
                and schedules.variants(target_kind(k.target), k)
                and tuning.variants_tuned(args.logs, k, args.trials) is not None]
        for k in done:
            print(f"{k.name}: already tuned, kept", flush=True)
        keys = [k for k in keys if k not in done]
    if args.jobs > 1 and args.worker is None:
        return _spawn(argv if argv is not None else sys.argv[1:], args.jobs,
                      [k.name for k in keys])
    lock, prefix = None, ""
    if args.worker is not None:
        share, lock = args.worker.split(",", 1)
        index, count = map(int, share.split("/"))
        chosen = pathlib.Path(lock).with_name(KEYS_FILE).read_text().split()
        keys = [k for k in keys if k.name in chosen][index::count]
        prefix = f"[worker {index}] "
    start = time.time()
    for i, key in enumerate(keys, 1):
        if args.time_budget is not None and time.time() - start > args.time_budget:
            print(f"time budget spent: {len(keys) - i + 1} kernels not tuned")
            break
        print(f"{prefix}[{i}/{len(keys)}] {key.name}", flush=True)
        kind = target_kind(key.target)
        lowered = schedules.lowers(kind, key)
        if lowered and not schedules.variants(kind, key):
            print(f"  skipped: written out at warp level for {key.target} with no variants, "
                  "nothing to tune", flush=True)
            continue
        if args.dry_run:
            tuning.dry_run(key)
        elif lowered:  # its variants as workloads, xgboost choosing which to measure
            tuning.tune_variants(key, args.logs, args.trials, keep_top=args.keep_top,
                                 measure_lock=lock, build_workers=args.build_workers,
                                 flush_l2=args.flush_l2,
                                 log=lambda line: print(prefix + line, flush=True))
        else:
            tuning.tune(key, args.logs, args.trials, max_tiles=args.max_tiles,
                        keep_top=args.keep_top)
    print(f"{prefix}done in {time.time() - start:.0f}s")
    return 0


KEYS_FILE = "keys.txt"
"""Beside ``--jobs``' lock file: the names of the kernels the workers share out."""


def _spawn(argv: list[str], jobs: int, names: list[str]) -> int:
    """Run ``jobs`` tuning processes over the kernels ``names`` (every ``jobs``-th each),
    sharing one lock file for the device, their builder processes splitting the CPUs."""
    builders = max(1, (os.cpu_count() or 1) // jobs)
    with tempfile.TemporaryDirectory() as tmp:
        lock = os.path.join(tmp, "device.lock")
        pathlib.Path(tmp, KEYS_FILE).write_text("\n".join(names) + "\n")
        procs = [subprocess.Popen([sys.executable, __file__, *argv,
                                   "--worker", f"{i}/{jobs},{lock}",
                                   "--build-workers", str(builders)])
                 for i in range(jobs)]
        codes = [proc.wait() for proc in procs]
    failed = [i for i, code in enumerate(codes) if code]
    if failed:
        print(f"tuning workers {failed} failed (exit codes {[codes[i] for i in failed]})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
