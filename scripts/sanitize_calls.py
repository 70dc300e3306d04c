#!/usr/bin/env python
"""Small forward + backward calls for compute-sanitizer: every causal mode on odd shapes,
each output and gradient checked against the float64 reference.

Run it once plainly (it builds the kernels, or point ``TVM_FLASH_ARTIFACTS`` at a
``scripts/build.py`` directory), then under each tool — the kernels are then loaded, not
built, inside the sanitizer:

    python scripts/build.py --head-dims 64 --dtypes bf16 --gqa 2 --jobs 16 --out /tmp/san
    export TVM_FLASH_ARTIFACTS=/tmp/san TVM_FLASH_JIT=0
    python scripts/sanitize_calls.py --head-dims 64 --gqa 2
    for tool in racecheck synccheck memcheck; do
        compute-sanitizer --tool $tool python scripts/sanitize_calls.py --head-dims 64 --gqa 2
    done

The shapes reach what small tests miss: ``(1, 1, 1100, 1100)`` is past the 1024-key length
bucket (the Hopper forward at D 64 takes three consumer warpgroups there), ``(1, 1, 300,
1100)`` and ``(1, 1, 7, 300)`` make the two causal alignments differ, ``(2, 1, 97, 97)`` ends
mid-tile. ``--many-tiles`` adds ``(4, 12, 700, 400)`` and ``(2, 16, 1000, 1000)``: more query
tiles than an H100 or H200 has SMs, so that a block of the persistent Hopper forward and dQ
walks several — bottom-right, whole tiles without keys among them in the first; under a window,
every tile keyed in the second (slow under racecheck). ``--softcap``, ``--alibi``
and ``--window`` run every call with that score modifier (build the kernels with ``build.py
--mods softcap``, ``alibi``, ``window`` or a combination such as ``softcap+alibi``).
``--causal``, ``--forward-only`` and ``--repeat`` narrow a run down to one kernel and repeat
it, for a fault or hang seen once (each call's line gives its time; run it under ``timeout``).
Exits 1 if any case is out of tolerance or not finite.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import tvm_flash  # noqa: E402
from tvm_flash.reference import attention_reference  # noqa: E402

SHAPES = ((2, 1, 97, 97), (1, 1, 300, 1100), (1, 1, 1100, 1100), (1, 1, 7, 300))  # B Hkv Lq Lk
MANY_TILES = ((4, 12, 700, 400), (2, 16, 1000, 1000))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = ((False, "top-left"), (True, "top-left"), (True, "bottom-right"))


def _case(d: int, dtype: torch.dtype, group: int, causal: bool, align: str, shape,
          dev: str, softcap: float = 0.0, alibi: bool = False, backward: bool = True,
          window=(-1, -1)) -> str:
    b, hkv, lq, lk = shape
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dtype, requires_grad=True)
               for h, n in ((hkv * group, lq), (hkv, lk), (hkv, lk)))
    do = torch.randn(b, hkv * group, lq, d, device=dev, dtype=dtype)
    slopes = torch.rand(hkv * group, device=dev) if alibi else None
    out = tvm_flash.attention(q, k, v, is_causal=causal, causal_alignment=align,
                              enable_gqa=True, softcap=softcap, alibi_slopes=slopes,
                              window_size=window)
    if backward:
        out.backward(do)
    if dev == "cuda":
        torch.cuda.synchronize()
    ours = (out, q.grad, k.grad, v.grad) if backward else (out,)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=align if causal else "none",
                                 softcap=softcap, alibi_slopes=slopes, window=window)
    if backward:
        ref.backward(do.double())
    exact = (ref, q64.grad, k64.grad, v64.grad) if backward else (ref,)
    errs = [(a.double() - r).abs().max().item() for a, r in zip(ours, exact, strict=True)]
    finite = all(torch.isfinite(t).all().item() for t in ours)
    # a coarse bound: this script looks for memory and ordering errors, tests/ for accuracy
    ok = finite and max(errs) < {torch.bfloat16: 0.1, torch.float16: 0.02}.get(dtype, 1e-3)
    return f"{'ok  ' if ok else 'FAIL'} max err {max(errs):.3g}{'' if finite else ' non-finite'}"


def _window(text: str) -> tuple[int, int]:
    """``--window LEFT,RIGHT`` as two ints; their range is ``tvm_flash.attention``'s check."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"LEFT,RIGHT: two integers, not {text!r}") from None
    return left, right


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--gqa", default="2", help="GQA group sizes Hq/Hkv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    p.add_argument("--softcap", type=float, default=0.0, help="a soft cap (> 0) on every call")
    p.add_argument("--alibi", action="store_true", help="ALiBi with random slopes on every call")
    p.add_argument("--window", type=_window, default=(-1, -1), metavar="LEFT,RIGHT",
                   help="a sliding window on every call (flash-attn's window_size; -1 "
                        "unbounded; a leading -1 as --window=-1,0)")
    p.add_argument("--many-tiles", action="store_true",
                   help=f"also {MANY_TILES}: persistent blocks walk several query tiles")
    p.add_argument("--causal", default="none,top-left,bottom-right",
                   help="the masks to run (comma-separated)")
    p.add_argument("--forward-only", action="store_true",
                   help="no backward: tells a forward's fault or hang from the backward's")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each call this many times (an intermittent hang: run under "
                        "`timeout`, each call's line printed as it ends)")
    args = p.parse_args()
    shapes = SHAPES[:args.shapes] + (MANY_TILES if args.many_tiles else ())
    masks = args.causal.split(",")
    unknown = set(masks) - {"none", *(align for _, align in CASES)}
    if unknown:
        p.error(f"--causal: unknown {sorted(unknown)}")
    torch.manual_seed(0)
    failed = 0
    for d in (int(x) for x in args.head_dims.split(",")):
        for name in args.dtypes.split(","):
            for g in (int(x) for x in args.gqa.split(",")):
                for (causal, align), shape, rep in itertools.product(
                        CASES, shapes, range(args.repeat)):
                    mode = align if causal else "none"
                    if mode not in masks:
                        continue
                    start = time.perf_counter()
                    res = _case(d, DTYPES[name], g, causal, align, shape, args.device,
                                args.softcap, args.alibi, not args.forward_only, args.window)
                    failed += res.startswith("FAIL")
                    took = time.perf_counter() - start
                    print(f"D {d} {name} GQA {g} {mode:12s} (B, Hkv, Lq, Lk) = {shape}"
                          f"{f' #{rep}' if args.repeat > 1 else ''}: {res} ({took:.1f} s)",
                          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
