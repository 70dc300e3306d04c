#!/usr/bin/env python
"""Benchmark ring (context-parallel) attention on N processes: TFLOP/s and memory per GPU.

Run under torchrun, one process per GPU (NCCL), or on the CPU (gloo; tiny shapes only):

    torchrun --nproc-per-node 2 scripts/bench_ring.py --seqlens 65536,131072 --causal
    torchrun --nproc-per-node 1 scripts/bench_ring.py --seqlens 65536 --causal   # one GPU
    torchrun --nproc-per-node 2 scripts/bench_ring.py --max-len --causal         # longest N

Each rank holds its zig-zag shard of q, k, v (B, H, N / W, D) and times forward+backward of
``tvm_flash.distributed.ring_attention`` (medians of CUDA-event timings; on one process the
ring is the single-device call). TFLOP/s per GPU count the whole sequence's work divided by
the ranks: forward 4·B·H·N²·D, backward 2.5× that, halved causal — the same formula as
scripts/bench.py. ``--torch-cp`` also times torch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel`` around SDPA's flash and cuDNN
backends) on the same shapes. ``--max-len`` doubles N from the first ``--seqlens`` value until
a forward+backward no longer fits and reports the longest that did. Rank 0 prints one line
per configuration and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import _event_ms  # noqa: E402

from tvm_flash.distributed import ring_attention  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timed(fn, device, reps: int) -> float:
    """Median milliseconds of ``fn`` (after two warm-up calls), every rank in step."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        return _event_ms(fn, reps, before=dist.barrier)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ring_step(b, h, n, d, dtype, device, causal, world):
    shape = (b, h, n // world, d)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    do = torch.randn(shape, dtype=dtype, device=device)

    def step():
        ring_attention(q, k, v, is_causal=causal).backward(do)
    return step


def _torch_cp_step(b, h, n, d, dtype, device, causal, world, backend, stack):
    """torch's context parallelism around SDPA with ``backend`` (flash or cudnn): the context
    (entered once, on ``stack``) shards the whole-sequence buffers in place and runs SDPA as a
    ring over them."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(device.type, (world,))
    q, k, v, do = (torch.randn(b, h, n, d, dtype=dtype, device=device) for _ in range(4))
    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    stack.enter_context(context_parallel(mesh, buffers=[q, k, v, do],
                                         buffer_seq_dims=[2, 2, 2, 2]))
    stack.enter_context(sdpa_kernel(kind))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # this rank's shards

    def step():
        F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(do)
    return step


def _measure(make, flops, device, reps):
    """(ms, TFLOP/s per rank, peak MiB) of the step ``make()`` builds, or None if it does
    not fit in memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        ms = _timed(make(), device, reps)
    except torch.OutOfMemoryError:
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return ms, flops / ms / 1e9, peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="65536", help="comma list of whole-sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--torch-cp", action="store_true",
                   help="also time torch's context_parallel with SDPA's flash and cuDNN")
    p.add_argument("--max-len", action="store_true",
                   help="double N from the first --seqlens value until fwd+bwd does not fit")
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []

    def flops(n):
        fwd = 4 * b * h * n * n * d // (2 if args.causal else 1)
        return 3.5 * fwd / world  # forward + backward, this rank's share

    def record(name, n, res):
        row = {"impl": name, "N": n, "world": world, "fits": res is not None}
        if res is not None:
            row.update(ms=res[0], tflops_per_rank=res[1], peak_mib=res[2])
        rows.append(row)
        if rank == 0:
            figs = (f"{res[0]:9.2f} ms {res[1]:7.1f} TFLOP/s/rank {res[2]:9.0f} MiB"
                    if res else "does not fit")
            print(f"{name:14s} N {n:8d} x{world}: {figs}", flush=True)

    if rank == 0:
        print(f"# {world} rank(s), {device.type}, B {b} H {h} D {d} {args.dtype}, "
              f"causal {args.causal}; fwd+bwd FLOPs = 3.5 * 4*B*H*N^2*D"
              f"{' / 2' if args.causal else ''}, per rank / {world}", flush=True)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.max_len:
        n = seqlens[0]
        while True:
            res = _measure(lambda n=n: _ring_step(b, h, n, d, dtype, device, args.causal,
                                                  world), flops(n), device, 1)
            fits = torch.tensor([res is not None], device=device)
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every rank must fit
            record("tvm-flash ring", n, res if bool(fits.item()) else None)
            if not bool(fits.item()):
                break
            n *= 2
    else:
        for n in seqlens:
            record("tvm-flash ring", n, _measure(
                lambda n=n: _ring_step(b, h, n, d, dtype, device, args.causal, world),
                flops(n), device, args.reps))
            if args.torch_cp:
                for backend in ("flash", "cudnn"):
                    try:
                        with contextlib.ExitStack() as stack:
                            res = _measure(lambda n=n, bk=backend, st=stack: _torch_cp_step(
                                b, h, n, d, dtype, device, args.causal, world, bk, st),
                                flops(n), device, args.reps)
                    except (RuntimeError, ImportError) as err:  # not available here
                        if rank == 0:
                            print(f"torch-cp {backend}: not run ({str(err)[:120]})")
                        continue
                    record(f"torch-cp {backend}", n, res)
    if rank == 0 and args.out:
        meta = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "torch": torch.__version__, "B": b, "H": h, "D": d, "dtype": args.dtype,
                "causal": args.causal}
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
