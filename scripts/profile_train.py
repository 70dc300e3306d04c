#!/usr/bin/env python
"""Where a training step of ``scripts/train.py``'s GPT goes, tvm-flash against torch SDPA,
both models in one process taking turns (ABBA, as ``train.py --interleave``): wall
milliseconds per step (synchronised), the device's busy time (the union of its kernels)
against the wall, the attention rows' device time, and the host: each operator's self time
on the host (torch.profiler's CPU rows, the Python of an autograd Function's forward or
backward included in its row) for both implementations side by side, largest difference
first — so a host-bound step's difference is attributed to the rows that make it.

    python scripts/profile_train.py            # CUDA; kernels built just in time or prebuilt
    python scripts/profile_train.py --modes default,reduce-overhead --out profile.json

The model, batch and precision are ``train.py``'s (6 layers, width 384, 6 heads of D 64,
causal, batch 64 x 256, bf16 autocast, AdamW) on one batch of random tokens, no gradient
clipping and no ``loss.item()`` (one synchronisation per timed block). The profiler lists an
operator and the kernels it launches as separate rows, and a row's host time includes the
profiler's own cost per row (a few microseconds): compare the two implementations' sums, and
take the wall figures from outside the profiler.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from train import GPT  # noqa: E402

ATTENTION = ("flash", "attention", "Attention", "fmha", "bwd_pre", "cudnn", "tvm_flash")
"""Substrings of the profiler rows that belong to attention, ours or SDPA's."""
IMPLS = ("tvm", "sdpa")


def _busy_ms(events) -> float:
    """The union of the device kernels' intervals, ms: what the device was busy with."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e3


def _stepper(impl: str, mode: str, x, y):
    torch.manual_seed(0)
    model = GPT(seq=x.shape[1], impl=impl).to(x.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fn = model if mode == "eager" else torch.compile(model, mode=mode)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_mode(mode: str, x, y, rounds: int, block: int, profiled: int,
                 trace: pathlib.Path | None = None) -> dict:
    """Both implementations in turns: ``rounds`` x (``block`` steps each, ABBA) timed, then
    ``profiled`` blocks of 5 steps each under the profiler, also in turns; ``trace``: a
    directory to write each implementation's last profiled block to as a Chrome trace
    (``<mode>-<impl>.json``: the host threads' ops beside the device's kernels)."""
    steps = {impl: _stepper(impl, mode, x, y) for impl in IMPLS}
    for _ in range(15):
        for impl in IMPLS:
            steps[impl]()
    torch.cuda.synchronize()
    wall = {impl: [] for impl in IMPLS}
    for r in range(rounds):
        for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            start = time.perf_counter()
            for _ in range(block):
                steps[impl]()
            torch.cuda.synchronize()
            wall[impl].append((time.perf_counter() - start) / block * 1e3)
    host = {impl: collections.Counter() for impl in IMPLS}
    count = {impl: collections.Counter() for impl in IMPLS}
    device = dict.fromkeys(IMPLS, 0.0)
    attention = dict.fromkeys(IMPLS, 0.0)
    busy = dict.fromkeys(IMPLS, 0.0)
    n = 5 * profiled
    for r in range(2 * profiled):
        impl = (IMPLS if (r // 2) % 2 == 0 else IMPLS[::-1])[r % 2]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                steps[impl]()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            host[impl][e.key] += e.self_cpu_time_total / n / 1e3
            count[impl][e.key] += e.count / n
            device[impl] += e.self_device_time_total / n / 1e3
            if any(s in e.key for s in ATTENTION):
                attention[impl] += e.self_device_time_total / n / 1e3
        busy[impl] += _busy_ms(prof.events()) / n
        if trace is not None and r >= 2 * profiled - 2:
            trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace / f"{mode}-{impl}.json"))
    med = {impl: sorted(w)[len(w) // 2] for impl, w in wall.items()}
    keys = set(host["tvm"]) | set(host["sdpa"])
    diff = sorted(keys, key=lambda k: -abs(host["tvm"][k] - host["sdpa"][k]))
    rows = [{"op": k[:80], "calls": [round(count[i][k], 1) for i in IMPLS],
             "host_ms": [round(host[i][k], 4) for i in IMPLS]} for k in diff[:25]]
    return {"mode": mode, "wall_ms": {i: round(med[i], 3) for i in IMPLS},
            "wall_ms_blocks": {i: [round(w, 3) for w in wall[i]] for i in IMPLS},
            "host_rows_ms": {i: round(sum(host[i].values()), 3) for i in IMPLS},
            "host_attention_ms": {i: round(sum(t for k, t in host[i].items()
                                               if any(s in k for s in ATTENTION)), 3)
                                  for i in IMPLS},
            "device_rows_ms": {i: round(device[i], 3) for i in IMPLS},
            "device_attention_ms": {i: round(attention[i], 3) for i in IMPLS},
            "device_busy_ms": {i: round(busy[i], 3) for i in IMPLS},
            "largest_host_differences": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8, help="timed blocks per implementation")
    p.add_argument("--block", type=int, default=20, help="steps in a timed block")
    p.add_argument("--profiled", type=int, default=2,
                   help="profiled blocks of 5 steps per implementation")
    p.add_argument("--modes", default="eager,default",
                   help="comma-separated: eager, or a torch.compile mode (default, "
                        "reduce-overhead: CUDA graphs, which take the host out of both sides)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--trace", default=None,
                   help="a directory for Chrome traces of one profiled block per mode and "
                        "implementation")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_train.py: needs a CUDA device")
    dev = torch.device("cuda")
    x = torch.randint(0, 256, (args.batch, args.seq), device=dev)
    y = torch.randint(0, 256, (args.batch, args.seq), device=dev)
    results = []
    for mode in args.modes.split(","):
        res = profile_mode(mode, x, y, args.rounds, args.block, args.profiled,
                           pathlib.Path(args.trace) if args.trace else None)
        results.append(res)
        w = res["wall_ms"]
        print(f"## {mode}: wall {w['tvm']:.2f} / {w['sdpa']:.2f} ms a step (tvm / sdpa, "
              f"{w['sdpa'] / w['tvm']:.3f}x SDPA's tokens/s); device busy "
              f"{res['device_busy_ms']['tvm']:.2f} / {res['device_busy_ms']['sdpa']:.2f}, "
              f"attention rows on the device {res['device_attention_ms']['tvm']:.2f} / "
              f"{res['device_attention_ms']['sdpa']:.2f}; host rows "
              f"{res['host_rows_ms']['tvm']:.2f} / {res['host_rows_ms']['sdpa']:.2f} ms, of "
              f"which attention {res['host_attention_ms']['tvm']:.2f} / "
              f"{res['host_attention_ms']['sdpa']:.2f}", flush=True)
        for r in res["largest_host_differences"][:14]:
            print(f"   host {r['host_ms'][0]:7.3f} / {r['host_ms'][1]:7.3f} ms  "
                  f"x{r['calls'][0]:5.1f} / {r['calls'][1]:5.1f}  {r['op'][:70]}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
