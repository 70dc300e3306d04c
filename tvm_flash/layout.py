"""Which tensor layouts the kernels read as they are, the copy made of any other, and the
layout of what they return.

One place for the rule, so the binding, the benchmarks and the tests agree on when a copy
happens.

The kernels take every ``(B, H, L, D)`` tensor with symbolic batch, head and row strides and
a contiguous last dimension (``tvm_flash.kernels.common.strides``). So the layout models hand
attention — ``(B, L, H, D)`` storage (the QKV projection's output) viewed as ``(B, H, L, D)``
by ``.transpose(1, 2)`` — is read and written where it lies, with no copy, as are contiguous
``(B, H, L, D)`` tensors, slices of a batch or of the heads, and rows of a wider buffer (a
slice of a fused QKV tensor). Outputs and gradients come back in torch SDPA's layout:
``out`` like ``q``, ``dq``/``dk``/``dv`` like ``q``/``k``/``v`` (:func:`output_like`).
"""

from __future__ import annotations

import torch

VECTOR_ALIGN = 16
"""Bytes the kernels' vector copies of tile rows (CUDA: 16-byte ``cp.async`` and vector loads
and stores) need every row of a tensor to start at: its data pointer and every stride but
the last must be multiples of this."""


def _rows_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides meet :func:`readable`'s rule (its data pointer aside)."""
    if t.is_contiguous() and t.shape[-1] * t.element_size() % VECTOR_ALIGN == 0:
        return True  # every stride a multiple of the row's bytes: the common case, one C call
    strides, shape = t.stride(), t.shape
    if strides[-1] != 1 and shape[-1] != 1:
        return False
    vec = VECTOR_ALIGN // t.element_size()
    for i in range(len(strides) - 1):  # a plain loop: this runs on every call, 4-8 times
        if strides[i] % vec and shape[i] != 1:
            return False
    return True


def readable(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t`` as it is: its last dimension is contiguous (stride 1),
    its data pointer is ``VECTOR_ALIGN``-aligned and every other stride is a multiple of
    ``VECTOR_ALIGN`` bytes (``VECTOR_ALIGN / element_size`` elements) or belongs to a
    dimension of size 1 (never stepped over).

    Together these make every row of D elements start 16-byte aligned, as the CUDA kernels'
    16-byte vector copies need (the CUDA kernels check the strides again and refuse others;
    CPU and Metal kernels would read any strides, but one rule serves every device).
    """
    return _rows_aligned(t) and t.data_ptr() % VECTOR_ALIGN == 0


def output_like(t: torch.Tensor) -> torch.Tensor:
    """A new, uninitialised tensor shaped like ``t`` in the layout torch SDPA gives the
    matching result: ``t``'s dimension order (``torch.empty_like``: a ``(B, L, H, D)``-backed
    view gives a ``(B, L, H, D)``-backed result, as SDPA's flash backend does for ``out`` and
    autograd for the gradients), densely packed. Where that order does not keep the last
    dimension innermost (stride 1), a contiguous ``(B, H, L, D)`` tensor instead.

    Fake (meta) tensors give the same strides as real ones: the custom ops' fake
    implementations allocate with this too. A new allocation is aligned, and its strides are
    multiples of D, so the kernels write it as it is (:func:`readable`).
    """
    out = torch.empty_like(t, memory_format=torch.preserve_format)
    if out.stride(-1) == 1 and out.shape[-1] * out.element_size() % VECTOR_ALIGN == 0:
        return out  # dense, rows innermost: every other stride a multiple of a row
    return out if _rows_aligned(out) else t.new_empty(t.shape)


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernels read it as it is (:func:`readable`), else a copy in
    :func:`output_like`'s layout.

    Copied are only tensors the kernels cannot read: a last dimension that is not contiguous,
    a data pointer off a 16-byte boundary (a view at an odd element offset), or a batch, head
    or row stride that is not a multiple of 16 bytes (e.g. the rows of a fused buffer of odd
    width). The copy keeps ``t``'s dimension order, so the outputs allocated from it have the
    layout they would have had without the copy, and ``kernel_view(t).transpose(1, 2)`` is
    ``kernel_view(t.transpose(1, 2))`` (the rule does not depend on the dimension order):
    the flash-attn door asks about the caller's ``(B, L, H, D)`` tensor, whose common form,
    contiguous, takes the one-call test.
    """
    return t if readable(t) else output_like(t).copy_(t)
