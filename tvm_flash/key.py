"""The one frozen key that names every kernel, built module, cache entry and tuning log.

A :class:`KernelKey` fixes everything that changes generated code: which kernel (``op``), the
head dimension, the input dtype, the causal mode, the GQA group size and the target tag.
Batch, head count and sequence lengths are *not* in the key: every kernel takes them
symbolically, so one module serves every shape of its key.
"""

from __future__ import annotations

import dataclasses
import re

from . import opspec
from .opspec import SPECS, OpSpec

OPS = tuple(SPECS)
"""Every kernel (op); :mod:`tvm_flash.opspec` describes each."""
TILED_OPS = tuple(op for op, s in SPECS.items() if not s.short_query)
"""The tiled path: forward (O, LSE); backward preprocess (Delta = rowsum(dO * O)); dQ; dK/dV."""
SHORT_QUERY_OPS = tuple(op for op, s in SPECS.items() if s.short_query)
"""The short-query ("vector") path (``bwd_pre`` is shared with the tiled one)."""
ROW_WISE_OPS = tuple(op for op, s in SPECS.items() if s.row_wise)
"""Row-wise kernels: no causal mode, no GQA group (their keys say ``none`` and ``1``)."""
MERGE_OPS = ROW_WISE_OPS
"""Former name of :data:`ROW_WISE_OPS` (``bwd_pre`` is row-wise but merges nothing)."""
PACKED_BASE = {op: s.packs for op, s in SPECS.items() if s.packs}
"""Packed-row kernels -> the tiled kernel whose blocks and buffers they share."""

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
"""Supported input dtypes (TVM spelling -> short name used in file names)."""

CAUSAL_MODES = ("none", "top-left", "bottom-right")
"""``top-left``: key j is visible to query i iff j <= i (torch ``is_causal``).
``bottom-right``: iff j <= i + (Lk - Lq) (flash-attn >= 2.1); the two agree when Lq == Lk."""

MODS = ("window", "softcap", "alibi")
"""Score modifiers a kernel may be built with (each a :class:`KernelKey` flag), applied to
the scaled scores ``s = (q . k) * scale`` of query i (at diagonal position ``i + offset``,
``offset`` = 0 for a top-left causal mask, ``Lk - Lq`` otherwise, flash-attn's alignment)
and key j: ``softcap``: ``s = cap * tanh(s / cap)``; ``alibi``: ``s -= slope[b, h] *
|i + offset - j|``; ``window``: key j visible iff ``i + offset - left <= j <= i + offset +
right`` (on top of the causal mask). The values (cap, slopes, left and right) are kernel
arguments, so one kernel serves every window and cap."""

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
"""Head dimensions the kernels are written for (multiples of 32 up to 256)."""

LENGTH_BUCKETS = (1024,)
"""Length buckets: a tiled kernel (forward, dQ, dK/dV) may have a build of its own (tuned, or
the schedule's default for calls that short: ``schedules.own_default``) for the calls
whose longest sequence (``max(Lq, Lk)``, packed: the longest sequence's) is at most one of
these (:attr:`KernelKey.lengths`; the runtime takes it where one was built,
``tvm_flash.plan``). ``lengths=0``, every length, is the key of every kernel otherwise."""


def dtype_name(dtype) -> str:
    """Normalise a dtype given as torch dtype, TVM string or short name to the TVM string."""
    s = str(dtype).replace("torch.", "")
    short = {v: k for k, v in DTYPES.items()}
    s = short.get(s, s)
    if s not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return s


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Identity of one compiled kernel.

    ``target`` is a target tag as made by :func:`tvm_flash.target.parse_target`, e.g. ``llvm``,
    ``cuda-sm_90`` or ``metal-apple-m2``. ``sinks``: the forward takes per-head sink logits
    (the backward kernels do not depend on it). ``window``, ``softcap``, ``alibi``: the kernel
    applies a sliding window, logit soft-capping or an ALiBi bias to its scores
    (:data:`MODS`); the key names the feature, the call passes its values. ``varlen``: the
    kernel's variable-length form (packed sequences, ``tvm_flash.opspec.VARLEN_ARGS``).
    ``lengths``: 0 (every length), or the length bucket (:data:`LENGTH_BUCKETS`) this build of
    a tiled kernel was tuned for: the same kernel code, its variant chosen by a tuning log for
    calls that short.
    """

    op: str
    head_dim: int
    dtype: str
    causal: str
    group: int
    target: str
    sinks: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False
    lengths: int = 0

    def __post_init__(self):
        spec = self.spec
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} is not supported; use one of {HEAD_DIMS}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"causal: {self.causal!r} is not one of {CAUSAL_MODES}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group: {self.group!r} must be a positive integer")
        if not re.fullmatch(r"[a-z0-9_.-]+", self.target):
            raise ValueError(f"target: {self.target!r} is not a target tag")
        if self.sinks and not spec.sinks:
            takes = [op for op, s in SPECS.items() if s.sinks]
            raise ValueError(f"sinks: only the {' and '.join(takes)} kernels take sinks, not "
                             f"{self.op!r}")
        mods = self.mods
        if mods and not spec.mods:
            takes = [op for op, s in SPECS.items() if s.mods]
            raise ValueError(f"{mods[0]}: only the {', '.join(takes)} kernels modify scores, "
                             f"not {self.op!r}")
        if self.varlen and not spec.varlen:
            takes = [op for op, s in SPECS.items() if s.varlen]
            raise ValueError(f"varlen: only the {', '.join(takes)} kernels have a "
                             f"variable-length form, not {self.op!r}")
        if self.lengths not in (0, *LENGTH_BUCKETS):
            raise ValueError(f"lengths: {self.lengths!r} is not 0 (every length) or a length "
                             f"bucket of {LENGTH_BUCKETS}")
        if self.lengths and not spec.length_buckets:
            raise ValueError(f"lengths: only the tiled forward, dQ and dK/dV kernels have "
                             f"length buckets, not {self.op!r}")
        if spec.row_wise and (self.causal, self.group) != ("none", 1):
            raise ValueError(f"{self.op}: a row-wise kernel; its key takes causal='none', "
                             f"group=1")

    @property
    def mods(self) -> tuple[str, ...]:
        """The score modifiers this kernel applies, in :data:`MODS` order."""
        return tuple(m for m in MODS if getattr(self, m))

    @property
    def spec(self) -> OpSpec:
        """What the key's op is (:mod:`tvm_flash.opspec`)."""
        return opspec.spec(self.op)

    @property
    def name(self) -> str:
        """File-system safe name, e.g. ``fwd-d64-bf16-top-left-g4-cuda-sm_90``
        (``fwd-sinks-…`` for the forward with sinks, ``dq-window-softcap-…`` for a dQ with
        score modifiers, ``fwd-varlen-…`` for packed sequences; ``dkv_packed-…`` etc.; a
        length bucket before the target: ``…-g1-n1024-cuda-sm_90a``)."""
        op = "-".join((self.op, *(("varlen",) if self.varlen else ()),
                       *(("sinks",) if self.sinks else ()), *self.mods))
        dtype = DTYPES[self.dtype]
        bucket = f"-n{self.lengths}" if self.lengths else ""
        return (f"{op}-d{self.head_dim}-{dtype}-{self.causal}-g{self.group}{bucket}-"
                f"{self.target}")
