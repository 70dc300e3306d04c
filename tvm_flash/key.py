"""The one frozen key that names every kernel, built module, cache entry and tuning log.

A :class:`KernelKey` fixes everything that changes generated code: which kernel (``op``), the
head dimension, the input dtype, the causal mode, the GQA group size and the target tag.
Batch, head count and sequence lengths are *not* in the key: every kernel takes them
symbolically, so one module serves every shape of its key.
"""

from __future__ import annotations

import dataclasses
import re

TILED_OPS = ("fwd", "bwd_pre", "dq", "dkv")
"""Kernels: forward (O, LSE); backward preprocess (Delta = rowsum(dO * O)); dQ; dK/dV."""
SHORT_QUERY_OPS = ("fwd_split", "fwd_merge", "dq_split", "dq_merge", "dkv_packed")
"""The short-query ("vector") path: tiles pack the queries of a GQA group; forward and dQ cut
the keys into splits whose partial results a merge kernel adds up in order; dK/dV as the
tiled kernel over packed rows. ``bwd_pre`` is shared."""
OPS = TILED_OPS + SHORT_QUERY_OPS
PACKED_BASE = {"fwd_split": "fwd", "dq_split": "dq", "dkv_packed": "dkv"}
"""Packed-row kernels -> the tiled kernel whose blocks and buffers they share."""
MERGE_OPS = ("bwd_pre", "fwd_merge", "dq_merge")
"""Row-wise kernels: no causal mode, no GQA group (their keys say ``none`` and ``1``)."""

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
"""Supported input dtypes (TVM spelling -> short name used in file names)."""

CAUSAL_MODES = ("none", "top-left", "bottom-right")
"""``top-left``: key j is visible to query i iff j <= i (torch ``is_causal``).
``bottom-right``: iff j <= i + (Lk - Lq) (flash-attn >= 2.1); the two agree when Lq == Lk."""

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
"""Head dimensions the kernels are written for (multiples of 32 up to 256)."""


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

    ``target`` is a target tag as made by :func:`tvm_flash.build.parse_target`, e.g. ``llvm``,
    ``cuda-sm_90`` or ``metal-apple-m2``. ``sinks``: the forward takes per-head sink logits
    (the backward kernels do not depend on it).
    """

    op: str
    head_dim: int
    dtype: str
    causal: str
    group: int
    target: str
    sinks: bool = False

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op: {self.op!r} is not one of {OPS}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} is not supported; use one of {HEAD_DIMS}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"causal: {self.causal!r} is not one of {CAUSAL_MODES}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group: {self.group!r} must be a positive integer")
        if not re.fullmatch(r"[a-z0-9_.-]+", self.target):
            raise ValueError(f"target: {self.target!r} is not a target tag")
        if self.sinks and self.op not in ("fwd", "fwd_merge"):
            raise ValueError(f"sinks: only the fwd and fwd_merge kernels take sinks, not "
                             f"{self.op!r}")
        if self.op in MERGE_OPS and (self.causal, self.group) != ("none", 1):
            raise ValueError(f"{self.op}: a row-wise kernel; its key takes causal='none', "
                             f"group=1")

    @property
    def name(self) -> str:
        """File-system safe name, e.g. ``fwd-d64-bf16-top-left-g4-cuda-sm_90``
        (``fwd-sinks-…`` for the forward with sinks; ``dkv_packed-…`` etc.)."""
        op = f"{self.op}-sinks" if self.sinks else self.op
        dtype = DTYPES[self.dtype]
        return f"{op}-d{self.head_dim}-{dtype}-{self.causal}-g{self.group}-{self.target}"
