#!/usr/bin/env python
"""Where a training step of ``scripts/train.py``'s GPT goes, eager and compiled, tvm-flash
against torch SDPA: wall milliseconds per step (synchronised), the device time per step of
the profiler's rows summed, the attention rows, the top rows by device and by host time; the
device's busy time (the union of its kernels) against the wall, and the host calls that can
wait on the device (``WAITS``).

    python scripts/profile_train.py            # CUDA; kernels built just in time or prebuilt
    python scripts/profile_train.py --modes default,reduce-overhead

The model, batch and precision are ``train.py``'s (6 layers, width 384, 6 heads of D 64,
causal, batch 64 x 256, bf16 autocast, AdamW) on random tokens. The profiler lists an
operator and the kernels it launches as separate rows (a custom op's or SDPA's backward op
and its kernels): compare sums like with like.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from train import GPT  # noqa: E402

ATTENTION = ("flash", "attention", "fmha", "bwd_pre", "cudnn", "tvm_flash")


WAITS = ("ynchronize", "Free", "Malloc", "Memcpy", "EventQuery", "StreamQuery", "HostAlloc")
"""Host API calls that can make the host wait for the device (or allocate outside torch's
caching allocator): a step that waits once per call exposes the host's latency to the
device, which then idles."""


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 15 warm-up)")
    p.add_argument("--modes", default="eager,default",
                   help="comma-separated: eager, or a torch.compile mode (default, "
                        "reduce-overhead: CUDA graphs, which take the host out of both sides)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_train.py: needs a CUDA device")
    dev = torch.device("cuda")
    x = torch.randint(0, 256, (args.batch, args.seq), device=dev)
    y = torch.randint(0, 256, (args.batch, args.seq), device=dev)
    for mode in args.modes.split(","):
        for impl in ("tvm", "sdpa"):
            torch.manual_seed(0)
            model = GPT(seq=args.seq, impl=impl).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            fn = model if mode == "eager" else torch.compile(model, mode=mode)

            def step(fn=fn, opt=opt):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = fn(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(15):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.steps * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            rows = prof.key_averages()
            device = sum(e.self_device_time_total for e in rows) / 5 / 1e3
            attention = sum(e.self_device_time_total for e in rows
                            if any(s in e.key for s in ATTENTION)) / 5 / 1e3
            print(f"## {impl} {mode if mode == 'eager' else 'compiled ' + mode}: "
                  f"{wall:.2f} ms/step wall, "
                  f"{device:.2f} ms device rows, attention rows {attention:.2f} ms "
                  f"({args.batch * args.seq / wall * 1e3:,.0f} tokens/s)", flush=True)
            for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:8]:
                print(f"   {e.self_device_time_total / 5 / 1e3:7.3f} ms  x{e.count // 5:4d}  "
                      f"{e.key[:90]}")
            for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:5]:
                print(f"   host {e.self_cpu_time_total / 5 / 1e3:7.3f} ms  x{e.count // 5:4d}  "
                      f"{e.key[:80]}")
            busy = _busy_ms(prof.events()) / 5
            print(f"   device busy {busy:.2f} ms a step (kernels' union), idle "
                  f"{wall - busy:.2f} ms against the timed steps' wall")
            for e in sorted((e for e in rows if any(s in e.key for s in WAITS)),
                            key=lambda e: -e.self_cpu_time_total):
                print(f"   wait {e.self_cpu_time_total / 5 / 1e3:7.3f} ms  x{e.count / 5:6.1f}  "
                      f"{e.key[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
