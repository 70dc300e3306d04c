"""Which kernels a call runs, in which order, on which workspaces: decided once per signature.

A call's *signature* is what fixes the kernels it runs: device, dtype, head dim, causal mode,
GQA group, sinks, score modifiers (``tvm_flash.key.MODS``), packed sequences (varlen) or not,
short query or not, forward or backward, and the length bucket (a tiled kernel's build for
calls that short, tuned or the schedule's choice for them: :func:`length_bucket`). The first
call of a signature builds its :class:`Plan` — kernel keys made and validated, the target tag
of the device looked up, the kernels loaded, the device's parallel units counted — and the
plan is cached; every later call of that signature does a dictionary lookup, arithmetic on
its shapes and the launches. This module is also what ``scripts/build.py`` asks which
kernels to build (:func:`call_keys`), so the launch sequence is written down once.

Streams: a CUDA kernel runs on PyTorch's current stream without tvm-flash looking it up.
tvm-ffi does that in C on every call that gets a CUDA ``torch.Tensor`` argument: it asks
torch for the tensor's current stream (the DLPack exchange API's ``current_work_stream``, or
``torch._C._cuda_getCurrentRawStream`` for an older torch), makes it the environment stream
TVM's CUDA launches read for the duration of the call, and restores the previous one (tvm_ffi
0.1.14 ``cython/function.pxi`` argument setters, ``tvm_ffi_python_helpers.h``). A
``tvm_ffi.use_raw_stream`` context around the launches would be overridden by it, so there is
none; CUDA-graph capture works because the capturing stream is the current one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading

import torch

from . import artifacts
from .artifacts import kernel
from .key import LENGTH_BUCKETS, KernelKey
from .opspec import PACKED_ROWS, PART_STATS
from .target import target_tag_for_device

# ------------------------------------------------------------------- short-query policy

SHORT_QUERY_MAX = 12
"""Query lengths up to this take the short-query ("vector") kernels: tiles pack the queries
of a GQA group (``PACKED_ROWS`` rows) and the keys are split over blocks. Longer ones take the
tiled kernels. Set from the H200 crossover (docs/perf.md, "Short queries"): the short path
was >= 2x faster through Lq = 12 at batch 1 and 8 (SIMT split), and only broke even with the
tiled kernels at Lq = 16; with the warp-level split (fp16/bf16, sm_80+) it is 1.5-2.1x faster
at Lq 12 (decode-h200-v1.json, bench_decode)."""
KEYS_PER_SPLIT_MIN = 128
"""A key split is never shorter than this (fewer, longer splits merge cheaper). One key tile
of the SIMT short-query kernels: on the H200 (decode, B 1, Hq 32, Hkv 8, Lk 4096, D 128,
bf16) 32 splits of 128 keys took 31 + 18 us (split + merge kernels) where 16 of 256 took 51 +
10 (docs/journal/2026-12-02-host-path.md); 64 was no faster. The warp-level split and merge
(``schedules/cuda_mma.py``) keep it: 32 splits 21 us, 64 splits 22, 16 splits 26, each the
two kernels timed together (docs/results/decode-h200-v1.json)."""


def is_short(lq: int) -> bool:
    """Whether ``lq`` queries take the short-query kernels."""
    return lq <= SHORT_QUERY_MAX


def num_splits(q, k, packed_rows: int, units: int) -> int:
    """Key splits for the short-query kernels: enough blocks to fill ``units`` parallel units
    (:func:`parallel_units`), but splits of at least ``KEYS_PER_SPLIT_MIN`` keys.
    ``packed_rows``: the rows of a short-query tile."""
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    blocks = b * hkv * math.ceil(hq // hkv * lq / packed_rows)
    want = math.ceil(units / blocks)
    return max(1, min(want, math.ceil(lk / KEYS_PER_SPLIT_MIN)))


def parallel_units(device: torch.device) -> int:
    """Blocks that keep ``device`` busy: two per SM on CUDA, one per thread on the CPU."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, torch.get_num_threads())


def _partials(q, splits: int, *trailing):
    """float32 workspace of shape ``(splits * B, Hq, Lq, *trailing)``."""
    b, hq, lq, _ = q.shape
    return torch.empty((splits * b, hq, lq, *trailing), dtype=torch.float32, device=q.device)


# ------------------------------------------------------------------------ length buckets


def length_bucket(longest: int) -> int:
    """The length bucket (``tvm_flash.key.LENGTH_BUCKETS``) of a call whose longest sequence
    is ``longest``: the smallest that holds it, or 0 (every length)."""
    for bucket in LENGTH_BUCKETS:
        if longest <= bucket:
            return bucket
    return 0


def _bucketed(key: KernelKey, bucket: int) -> KernelKey:
    """``key``'s build for ``bucket`` where an artifact directory has one (only
    ``scripts/build.py`` makes them: from a tuning log for that bucket, or where the
    schedule's default variant for calls that short differs), or where just-in-time building
    is allowed and the schedule's default differs (what ``build.py`` would have built);
    else ``key``: the same kernel with its every-length variant."""
    if not bucket or not key.spec.length_buckets:
        return key
    tuned = dataclasses.replace(key, lengths=bucket)
    if artifacts.has(tuned) or (artifacts.jit_allowed() and _own_default(tuned)):
        return tuned
    return key


def _own_default(key: KernelKey) -> bool:
    """Whether the bucket ``key`` has a default variant of its own (``schedules.own_default``).
    Build code: asked only where just-in-time building is allowed."""
    from .build import schedules
    from .target import target_kind

    return schedules.own_default(target_kind(key.target), key)


# ------------------------------------------------------------- the kernels of each call


def _fields(target, head_dim, dtype, causal, group, mods=(), varlen=False):
    """Key fields of a tiled kernel (with its score modifiers ``mods``, names from
    ``tvm_flash.key.MODS``, and ``varlen``), and of a row-wise one (no causal mode, no group,
    no modifier; packed sequences are just rows to it)."""
    row_wise = {"head_dim": head_dim, "dtype": dtype, "causal": "none", "group": 1,
                "target": target}
    tiled = {**row_wise, "causal": causal, "group": group, **dict.fromkeys(mods, True)}
    return ({**tiled, "varlen": True} if varlen else tiled), row_wise


def forward_keys(target, head_dim, dtype, causal, group, *, sinks: bool, short: bool,
                 mods=(), varlen: bool = False) -> tuple[KernelKey, ...]:
    """The forward's kernels in launch order (see :meth:`Plan.forward`); packed sequences
    (``varlen``) always take the tiled path."""
    tiled, row_wise = _fields(target, head_dim, dtype, causal, group, mods, varlen)
    if short:  # per-split partial (O, max, sum), then their merge in split order (+ sinks)
        return (KernelKey("fwd_split", **tiled),
                KernelKey("fwd_merge", **row_wise, sinks=sinks))
    return (KernelKey("fwd", **tiled, sinks=sinks),)


def backward_keys(target, head_dim, dtype, causal, group, *, short: bool,
                  mods=(), varlen: bool = False) -> tuple[KernelKey, ...]:
    """The backward's kernels in launch order (see :meth:`Plan.backward`; the plan drops
    ``bwd_pre`` from the tiled path where the dQ artifact does its work). Sinks change no
    backward kernel (the forward's LSE includes them)."""
    tiled, row_wise = _fields(target, head_dim, dtype, causal, group, mods, varlen)
    pre = KernelKey("bwd_pre", **row_wise)
    if short:
        return (pre, KernelKey("dq_split", **tiled), KernelKey("dq_merge", **row_wise),
                KernelKey("dkv_packed", **tiled))
    return pre, KernelKey("dq", **tiled), KernelKey("dkv", **tiled)


def fold_window(causal: str, window: tuple[int, int], lq: int, lk: int,
                packed: bool) -> tuple[str, tuple[int, int]]:
    """The causal mode and window a call with mask ``causal`` and ``window`` ``(left, right)``
    (-1 unbounded) runs by, forward and backward (flash-attn 2 folds the same way). A causal
    mask and a window ``(l, r)`` let query i see the keys ``c - l <= j <= c`` (``r`` past the
    diagonal adds nothing), which is the unmasked key's window ``(l, 0)`` wherever the two
    diagonals agree: bottom-right always (the unmasked kernels put the window's and ALiBi's
    diagonal there), top-left where Lq = Lk in every sequence (not known for ``packed``
    ones). The unmasked window kernels walk the same key tiles without the causal mask's tile
    logic and ran faster on the H100 (docs/journal/2026-12-01-hopper.md, twenty-ninth
    session). A window ``(-1, r)`` under a causal mask is the causal mask alone. Softcap,
    ALiBi and sinks mean the same in either form."""
    if causal == "none" or window == (-1, -1):
        return causal, window
    left = window[0]
    if left < 0:
        return causal, (-1, -1)
    if causal == "top-left" and (packed or lq != lk):
        return causal, window
    return "none", (left, 0)


def _folds(causal: str, mods: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """The (causal mode, modifiers) forms :func:`fold_window` gives calls with these static
    facts: its outcomes over a bounded and an unbounded left extent, Lq = Lk or not, packed
    or not."""
    if "window" not in mods:
        return [(causal, mods)]
    forms = []
    for window, lq, packed in itertools.product(((1, 1), (-1, 1)), (1, 2), (False, True)):
        run_causal, run_window = fold_window(causal, window, lq, 2, packed)
        form = (run_causal, mods if run_window != (-1, -1) else
                tuple(m for m in mods if m != "window"))
        if form not in forms:
            forms.append(form)
    return forms


def call_keys(target, head_dim, dtype, causal, group, *, sinks: bool = False,
              mods=(), varlen: bool = False) -> list[KernelKey]:
    """Every kernel a call with these static facts may run: both paths (short and tiled;
    packed sequences only the tiled one), forward and backward. What ``scripts/build.py``
    builds."""
    keys = []
    for short in ((False,) if varlen else (False, True)):
        for run_causal, run_mods in _folds(causal, tuple(mods)):
            keys += forward_keys(target, head_dim, dtype, run_causal, group, sinks=sinks,
                                 short=short, mods=run_mods, varlen=varlen)
            keys += backward_keys(target, head_dim, dtype, run_causal, group, short=short,
                                  mods=run_mods, varlen=varlen)
    return keys


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """One signature's launch sequence: its kernels (keys and the loaded callables, in launch
    order) and the facts that size its workspaces. Made by :func:`get`."""

    keys: tuple[KernelKey, ...]
    kernels: tuple
    short: bool
    units: int  # parallel units of the device (short path: sizes the key splits)
    mps: bool  # TVM's Metal queue is not torch's: synchronise around the launches
    delta_in_dq: bool = False  # the tiled dQ computes Delta itself: no bwd_pre (_make)

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(key.op for key in self.keys)

    def forward(self, q, k, v, sink_arg, out, lse, scale: float, extra=()) -> None:
        """Fill ``out`` and ``lse``. Inputs in the kernels' layout, ``Lk > 0``; ``sink_arg``:
        float32 ``(Hq,)``, ignored by kernels built without sinks; ``extra``: the tiled
        kernels' trailing arguments (``tvm_flash.opspec``: ``MOD_ARGS`` where the plan has
        score modifiers, then ``VARLEN_ARGS`` for packed sequences)."""
        if self.mps:
            torch.mps.synchronize()
        if self.short:
            split, merge = self.kernels
            splits = num_splits(q, k, PACKED_ROWS, self.units)
            part = _partials(q, splits, q.shape[3] + PART_STATS)
            split(q, k, v, part, scale, *extra)
            merge(part, sink_arg, out, lse)
        else:
            (fwd,) = self.kernels
            fwd(q, k, v, sink_arg, out, lse, scale, *extra)
        if self.mps:
            _metal_sync()

    def backward(self, do, q, k, v, out, lse, delta, dq, dk, dv, scale: float,
                 extra=()) -> None:
        """Fill ``delta`` (rowsum(dO * O): by ``bwd_pre``, or by the dQ kernel where it
        computes it, ``delta_in_dq``), ``dq``, ``dk`` and ``dv``. Non-empty inputs; ``extra``
        as :meth:`forward`."""
        if self.mps:
            torch.mps.synchronize()
        if self.short:
            pre, dq_split, dq_merge, dkv = self.kernels
            pre(out, do, delta)
            dq_part = _partials(q, num_splits(q, k, PACKED_ROWS, self.units), q.shape[3])
            dq_split(q, k, v, do, lse, delta, dq_part, scale, *extra)
            dq_merge(dq_part, dq, scale)
        elif self.delta_in_dq:  # it takes O and writes Delta (opspec.ABSORB_ARGS)
            dq_tiled, dkv = self.kernels
            dq_tiled(q, k, v, do, lse, out, delta, dq, scale, *extra)
        else:
            pre, dq_tiled, dkv = self.kernels
            pre(out, do, delta)
            dq_tiled(q, k, v, do, lse, delta, dq, scale, *extra)
        dkv(q, k, v, do, lse, delta, dk, dv, scale, *extra)
        if self.mps:
            _metal_sync()


def _metal_sync():
    # (Not run yet: no Mac here; see README "Metal".)
    import tvm

    tvm.runtime.device("metal", 0).sync()


# ----------------------------------------------------------------------------- the cache

_plans: dict[tuple, Plan] = {}
_lock = threading.Lock()


def get(device: torch.device, dtype: torch.dtype, head_dim: int, causal: str, group: int,
        sinks: bool, lq: int, backward: bool, mods: tuple[str, ...] = (),
        varlen: bool = False, lk: int = 0) -> Plan:
    """The plan of a call (made on the first call of its signature). Arguments must already
    be validated (``tvm_flash.ops.check_inputs``); ``mods``: the score modifiers applied
    (names from ``tvm_flash.key.MODS``, in that order); ``varlen``: packed sequences (``lq``
    and ``lk`` then the longest one's; they take the tiled kernels whatever they are).
    ``max(lq, lk)`` picks the length bucket (:func:`length_bucket`)."""
    short = is_short(lq) and not varlen
    # A plan holds loaded kernels: where they come from (use_artifacts / allow_jit) is part
    # of the signature, so switching the artifact directory or JIT never reuses a plan.
    signature = (device, dtype, head_dim, causal, group, sinks and not backward, short,
                 backward, mods, varlen, 0 if short else length_bucket(max(lq, lk)),
                 artifacts._state["dir"], artifacts._state["jit"])
    found = _plans.get(signature)
    return found if found is not None else _make(signature)


def _make(signature: tuple) -> Plan:
    (device, dtype, head_dim, causal, group, sinks, short, backward, mods, varlen,
     bucket) = signature[:11]
    with _lock:
        if signature in _plans:
            return _plans[signature]
        target = target_tag_for_device(device)
        if backward:
            keys = backward_keys(target, head_dim, dtype, causal, group, short=short, mods=mods,
                                 varlen=varlen)
        else:
            keys = forward_keys(target, head_dim, dtype, causal, group, sinks=sinks,
                                short=short, mods=mods, varlen=varlen)
        keys = tuple(_bucketed(key, bucket) for key in keys)
        # a tiled dQ that computes Delta itself, as its artifact records (OpSpec.absorbs):
        # bwd_pre is not launched (nor loaded)
        delta_in_dq = (backward and not short
                       and artifacts.absorbs(keys[1]) == keys[0].op == "bwd_pre")
        if delta_in_dq:
            keys = keys[1:]
        found = Plan(keys, tuple(kernel(key) for key in keys), short, parallel_units(device),
                     device.type == "mps", delta_in_dq)
        _plans[signature] = found
        return found


def clear() -> None:
    """Forget every plan (the next call of each signature makes it again)."""
    with _lock:
        _plans.clear()
