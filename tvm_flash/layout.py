"""Which tensor layouts the kernels read as they are, and the copy made of any other.

One place for the rule, so the binding, the benchmarks and the tests agree on when a copy
happens.
"""

from __future__ import annotations

import torch

VECTOR_ALIGN = 16
"""Bytes the kernels' vector loads (CUDA: 16-byte ``cp.async`` / vector copies of tile rows)
need a tensor's data to be aligned to. A tensor at another address (a view with an odd storage
offset) is copied."""


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and ``VECTOR_ALIGN``-aligned: itself when it is, else a copy."""
    t = t.contiguous()
    return t if t.data_ptr() % VECTOR_ALIGN == 0 else t.clone()
