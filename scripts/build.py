#!/usr/bin/env python
"""Compile tvm-flash kernels for a target and write them, with a manifest, to a directory.

Runs without a GPU: CUDA device code is compiled ahead of time with nvcc (or NVRTC) for the
named arch. One exported module per kernel key (forward, backward preprocess, dQ, dK/dV for
each head dim x dtype x causal mode x GQA group) plus ``manifest.json``.

Examples:
    python scripts/build.py                          # the local machine: its GPU, else CPU
    python scripts/build.py --target cuda:sm_90 --head-dims 64,128 --dtypes bf16,fp16
    python scripts/build.py --target llvm --out artifacts/llvm

Without ``--out`` the kernels go to ``$TVM_FLASH_CACHE/artifacts/<target>`` (default
``~/.cache/tvm-flash/artifacts/<target>``), where tvm-flash finds them without configuration.
Point it at any other directory with ``TVM_FLASH_ARTIFACTS=DIR`` or
``tvm_flash.use_artifacts(DIR)``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import itertools
import multiprocessing
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tvm_flash import artifacts, export, tuning  # noqa: E402
from tvm_flash.build import schedules  # noqa: E402
from tvm_flash.key import (  # noqa: E402
    CAUSAL_MODES,
    DTYPES,
    HEAD_DIMS,
    LENGTH_BUCKETS,
    MODS,
    KernelKey,
)
from tvm_flash.plan import call_keys  # noqa: E402
from tvm_flash.target import parse_target, target_kind  # noqa: E402

SHORT = {v: k for k, v in DTYPES.items()}


def _csv(text, convert=str):
    return [convert(x) for x in text.split(",") if x]


def plan(target: str, head_dims, dtypes, causals, groups, sinks=False,
         mods=(), varlen=False) -> list[KernelKey]:
    """Every kernel key to build: what calls with these static facts run, short-query and
    tiled, forward and backward (:func:`tvm_flash.plan.call_keys`); with ``sinks`` the
    forward and its merge with and without sink logits; ``mods``: combinations of score
    modifiers (tuples of names from ``MODS``) built besides the plain kernels; ``varlen``:
    each also for packed sequences. Each key once (the row-wise kernels are shared by every
    causal mode, group and modifier)."""
    keys = []
    for d, dt, causal, g, s, m, p in itertools.product(head_dims, dtypes, causals, groups,
                                                       (False, True) if sinks else (False,),
                                                       ((), *mods),
                                                       (False, True) if varlen else (False,)):
        keys += call_keys(target, d, dt, causal, g, sinks=s, mods=m, varlen=p)
    return list(dict.fromkeys(keys))


def parse_mods(text: str) -> list[tuple[str, ...]]:
    """``--mods``: comma-separated combinations, each of modifiers joined by ``+``
    (``window+softcap,alibi``), as tuples in ``MODS`` order."""
    combos = []
    for combo in _csv(text):
        names = set(combo.split("+"))
        unknown = sorted(names - set(MODS))
        if unknown:
            raise ValueError(f"--mods: {unknown} not in {list(MODS)}")
        combos.append(tuple(m for m in MODS if m in names))
    return combos


def check_supported(keys) -> None:
    """Fail before building anything if a requested combination cannot be built."""
    for key in keys:
        sched = schedules.for_target(target_kind(key.target))
        try:
            sched.tile_config(key)
        except ValueError as err:
            sys.exit(f"error: {key.name} is not supported on {key.target}: {err}")


def _build_one(key: KernelKey, out: pathlib.Path, tuned):
    start = time.time()
    entry = export.build_artifact(key, out, tuned=tuned)
    return entry, time.time() - start


def tuned_choices(keys, logs: pathlib.Path) -> dict:
    """The tuning-log choice for every key that has a log (refusing bad logs up front), and
    for each tiled kernel's length buckets (``tvm_flash.key.LENGTH_BUCKETS``: a build of its
    own, which the runtime takes for calls that short): the bucket's log where it has one;
    where only the every-length log exists, ``None`` — the default variant. A log speaks for
    the lengths it was measured at (``tuning.BUCKETS``: N 4096 for every length); on the H200
    variants chosen there lost to the default at N 512-1024 (docs/journal/2026-12-01-tuning.md),
    so short calls keep the default until a log for their bucket says otherwise."""
    choices = {}
    for key in keys:
        buckets = LENGTH_BUCKETS if key.spec.length_buckets else ()
        for candidate in (key, *(dataclasses.replace(key, lengths=b) for b in buckets)):
            try:
                found = tuning.load_tuned(logs, candidate)
            except tuning.TuningLogError as err:
                sys.exit(f"error: {err}")
            if found is not None or (candidate.lengths and key in choices):
                choices[candidate] = found
    return choices


def own_buckets(keys, tuned: dict) -> list[KernelKey]:
    """The length buckets of ``keys`` without a tuning log of their own whose default variant
    differs from the every-length one (``schedules.own_default``: e.g. the Hopper forward at
    D 64, causal, keeps two consumer warpgroups up to 1024 keys): built so that the runtime
    takes them for calls that short."""
    found = []
    for key in keys:
        for n in LENGTH_BUCKETS if key.spec.length_buckets else ():
            bucket = dataclasses.replace(key, lengths=n)
            if bucket not in tuned and schedules.own_default(target_kind(key.target), bucket):
                found.append(bucket)
    return found


def _how(key, tuned: dict | None) -> str:
    """Which variant or tile a kernel was built with, and why."""
    lowered = schedules.lowers(target_kind(key.target), key)
    if tuned is None and schedules.own_default(target_kind(key.target), key):
        return (f"the schedule's default variant for calls up to {key.lengths} long, its own: "
                "no tuning log for this bucket")
    if tuned is None and key.lengths:
        return (f"the default {'variant' if lowered else 'tile'} for calls up to "
                f"{key.lengths} long: the kernel's log was measured at longer ones and this "
                "bucket has none")
    if tuned is None:
        return ("hand-written kernel, its default variant: no tuning log" if lowered
                else "the schedule's default tile: no tuning log")
    chosen = (f"variant {tuned['variant']}" if "variant" in tuned
              else f"tile {tuned['tile']} {tuned['decisions']}")
    return f"tuned {chosen}: {tuned['why']}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None,
                   help="llvm | cuda (the local GPU's arch) | cuda:sm_80 | cuda:sm_90 ... "
                        "(default: cuda if a GPU is visible, else llvm)")
    p.add_argument("--head-dims", default="64,128",
                   help=f"comma list from {','.join(map(str, HEAD_DIMS))} (default 64,128)")
    p.add_argument("--dtypes", default=None,
                   help="comma list of bf16, fp16, fp32 (default: bf16,fp16 for CUDA; "
                        "bf16,fp16,fp32 for llvm)")
    p.add_argument("--causal", default=",".join(CAUSAL_MODES),
                   help=f"comma list of {', '.join(CAUSAL_MODES)} (default: all)")
    p.add_argument("--gqa", default="1",
                   help="comma list of GQA group sizes Hq/Hkv, e.g. 1,2,4,8 (default 1)")
    p.add_argument("--sinks", action="store_true",
                   help="also build the forward with per-head sink logits")
    p.add_argument("--mods", default="",
                   help="also build kernels with score modifiers: comma-separated combinations "
                        "of window, softcap, alibi joined by '+' (e.g. window,window+softcap); "
                        "a call needs the kernels of exactly its combination")
    p.add_argument("--varlen", action="store_true",
                   help="also build the kernels for packed sequences (tvm_flash.varlen_attention)")
    p.add_argument("--tuning-logs", default=str(ROOT / "tuning_logs"),
                   help="apply MetaSchedule logs from DIR/<target>/<kernel key>/ where present "
                        "(default: the repo's tuning_logs); 'none' to ignore logs")
    p.add_argument("--out", default=None,
                   help="output directory (default: $TVM_FLASH_CACHE/artifacts/<target tag>, "
                        "where tvm-flash looks without configuration; TVM_FLASH_CACHE "
                        "defaults to ~/.cache/tvm-flash)")
    p.add_argument("--jobs", type=int, default=None,
                   help="parallel compiler processes (default: number of CPUs)")
    args = p.parse_args(argv)

    try:
        target = parse_target(args.target) if args.target else artifacts.machine_target()
        dtypes = args.dtypes or ("bf16,fp16" if target != "llvm" else "bf16,fp16,fp32")
        unknown = [d for d in _csv(dtypes) if d not in SHORT]
        if unknown:
            raise ValueError(f"--dtypes: {unknown} not in {sorted(SHORT)}")
        keys = plan(target, _csv(args.head_dims, int), [SHORT[d] for d in _csv(dtypes)],
                    _csv(args.causal), _csv(args.gqa, int), args.sinks,
                    parse_mods(args.mods), args.varlen)
    except ValueError as err:
        p.error(str(err))
    check_supported(keys)
    logs = None if args.tuning_logs == "none" else pathlib.Path(args.tuning_logs)
    tuned = tuned_choices(keys, logs) if logs else {}
    buckets = [k for k in tuned if k.lengths]  # length buckets' own builds
    own = own_buckets(keys, tuned)
    keys += buckets + own
    logged = [k for k, found in tuned.items() if found is not None]
    short = sum(1 for k in logged if k.lengths)
    out = pathlib.Path(args.out) if args.out else artifacts.default_artifact_dir(target)
    print(f"building {len(keys)} kernels for {target} into {out} ({len(logged)} from tuning "
          f"logs, {short} of them for a length bucket; {len(keys) - len(logged)} with the "
          f"default schedule, {len(buckets) - short} of those for a length bucket whose "
          f"kernel has only an every-length log, {len(own)} for a length bucket with a "
          "default of its own)", flush=True)
    entries, failures, start = [], [], time.time()
    # spawned, not forked: a worker forked from a process that touched the CUDA runtime
    # (a GPU machine) fails with an initialization error
    spawn = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as pool:
        futures = {pool.submit(_build_one, k, out, tuned.get(k)): k for k in keys}
        for i, fut in enumerate(cf.as_completed(futures), 1):
            key = futures[fut]
            try:
                entry, secs = fut.result()
            except Exception as err:  # noqa: BLE001 - report every failure, then exit non-zero
                failures.append((key, err))
                print(f"[{i:3}/{len(keys)}] FAILED {key.name}: {err}", flush=True)
                continue
            entries.append(entry)
            how = _how(key, tuned.get(key))
            print(f"[{i:3}/{len(keys)}] {key.name}  {secs:.1f}s  ({how})", flush=True)
    if failures:
        print(f"error: {len(failures)} of {len(keys)} kernels failed; manifest not written",
              file=sys.stderr)
        return 1
    manifest = export.write_manifest(out, target, entries)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"built {len(entries)} kernels in {time.time() - start:.0f}s, "
          f"{size / 2**20:.1f} MiB; manifest {manifest}")
    if out == artifacts.default_artifact_dir(target):
        print("tvm-flash finds them there without configuration (python -m tvm_flash shows "
              "where it looks)")
    else:
        print(f"use them with: TVM_FLASH_ARTIFACTS={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
