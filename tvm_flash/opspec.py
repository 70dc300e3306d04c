"""What each kernel (op) is: the one table that describes every op.

Everything else that depends on the op reads it from here: :class:`~tvm_flash.key.KernelKey`
(which key fields an op takes), the loader (the entry symbol of a module), the kernel factories
(``tvm_flash.kernels.FACTORIES``) and the schedules (row-wise kernels, packed rows). Pure data:
importing it compiles nothing, so the loader can use it.
"""

from __future__ import annotations

import dataclasses

PACKED_ROWS = 8
"""Query rows of a short-query (packed-row) tile on every target: the queries of a GQA group
packed into one tile (a decode step of 8 heads, or 8 queries of one head). The schedules ask
the factories for tiles of this many rows; the binding sizes its key splits by it
(``tvm_flash.plan.num_splits``). Here, with the ops, so that the binding reads it without
importing the schedules (loading runs no build code)."""

PART_STATS = 4
"""Columns a short-query forward's partial row (``fwd_split``'s ``Part``, float32 ``(splits
* B, Hq, Lq, D + PART_STATS)``) has after its D unnormalised outputs: the split's running max
(base 2) at D, its sum at D + 1, and two of padding, so that rows stay 16-byte multiples for
vector loads. One workspace, not three: on the H200's host a decode step's allocations are
several microseconds each."""


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One kernel.

    ``args``: the entry function's parameters in order, by the names its kernel gives them
    (the buffers, then ``scale``), as :mod:`tvm_flash.ops` passes them. ``factory`` names the
    function of :mod:`tvm_flash.kernels` that writes it and ``factory_args`` the parameters it
    is called with: key fields (``head_dim``, ``dtype``, ``causal``, ``group``, ``sinks``), the
    ``tile``, ``mods`` (its score modifiers, :class:`tvm_flash.kernels.common.Mods`),
    ``packed`` (true for a kernel over packed rows) and ``varlen``.
    """

    name: str
    symbol: str
    args: tuple[str, ...]
    factory: str
    factory_args: tuple[str, ...]
    row_wise: bool = False
    """One output row from the same row of its inputs: no tile walk, so no causal mode and no
    GQA group (its keys say ``none`` and ``1``)."""
    sinks: bool = False
    """Takes per-head sink logits: its key exists with and without ``sinks``."""
    packs: str | None = None
    """A kernel over packed query rows (the queries of a GQA group in one tile): the tiled op
    whose blocks and buffers it shares, so a schedule treats it as that op."""
    short_query: bool = False
    """Part of the short-query ("vector") path rather than the tiled one."""
    mods: bool = False
    """Computes scores: its key exists with score modifiers (``tvm_flash.key.MODS``), and such
    a kernel takes :data:`MOD_ARGS` after its own arguments."""
    varlen: bool = False
    """Has a variable-length form (packed sequences, ``KernelKey.varlen``), which takes
    :data:`VARLEN_ARGS` last."""
    absorbs: str | None = None
    """An op whose work a kernel family may do inside this one instead: dQ may compute Delta
    = rowsum(dO * O) of the rows it owns (``bwd_pre``'s work) and write it for dK/dV, which
    runs after it — a launch fewer a backward, which at small shapes is host time (the Hopper
    dQ does: ``schedules.absorbs``). Such a build takes :data:`ABSORB_ARGS` before ``Delta``
    (:meth:`args_of`) and writes ``Delta`` instead of reading it. Its artifact records it
    (manifest entry ``absorbs``), so the plan knows whether to launch the absorbed op
    without running schedule code."""

    @property
    def length_buckets(self) -> bool:
        """May have builds tuned for a length bucket (``KernelKey.lengths``): the tiled
        path's kernels that walk tiles (forward, dQ, dK/dV)."""
        return not self.row_wise and not self.short_query

    def args_of(self, mods: bool = False, varlen: bool = False,
                absorbed: bool = False) -> tuple[str, ...]:
        """The entry function's parameters of a kernel built with or without score modifiers,
        in its variable-length form or not, and doing the work of :attr:`absorbs` or not."""
        args = self.args
        if absorbed:
            if self.absorbs is None:
                raise ValueError(f"op {self.name!r} absorbs no other op")
            at = args.index("Delta")
            args = args[:at] + ABSORB_ARGS + args[at:]
        return args + (MOD_ARGS if mods else ()) + (VARLEN_ARGS if varlen else ())


MOD_ARGS = ("Slopes", "window_left", "window_right", "softcap")
"""What a kernel with score modifiers takes after its own arguments, whichever modifiers it
applies (one calling convention; the others are passed and ignored, as ``Sinks`` is):
ALiBi slopes ``(B, Hq)`` float32, the window's left and right extents (int64, each at most
``Lq + Lk``: a larger one is unbounded) and the soft cap (float32)."""

ABSORB_ARGS = ("O",)
"""What a kernel that absorbs ``bwd_pre`` (:attr:`OpSpec.absorbs`) takes before ``Delta``: the
forward's output, whose rows it reduces with dO's."""

VARLEN_ARGS = ("CuQ", "CuK", "max_seqlen_q", "max_seqlen_k")
"""What a variable-length kernel takes last: where each sequence's queries and keys start in
the packed rows (int32 ``(NS + 1,)``, flash-attn's ``cu_seqlens``) and the longest of each
(int64; they size the grid). Its q, k, v, ... are then ``(1, H, total rows, D)``."""


_TILE = ("head_dim", "dtype", "causal", "group", "tile", "mods")

SPECS = {spec.name: spec for spec in (
    # the tiled path: forward (O, LSE); backward preprocess (Delta = rowsum(dO * O)); dQ; dK/dV
    OpSpec("fwd", "flash_fwd", ("Q", "K", "V", "Sinks", "O", "LSE", "scale"),
           "flash_forward", (*_TILE, "sinks", "varlen"), sinks=True, mods=True, varlen=True),
    OpSpec("bwd_pre", "flash_bwd_pre", ("O", "dO", "Delta"),
           "flash_bwd_preprocess", ("head_dim", "dtype", "tile"), row_wise=True),
    OpSpec("dq", "flash_dq", ("Q", "K", "V", "dO", "LSE", "Delta", "dQ", "scale"),
           "flash_dq", (*_TILE, "varlen"), mods=True, varlen=True, absorbs="bwd_pre"),
    OpSpec("dkv", "flash_dkv", ("Q", "K", "V", "dO", "LSE", "Delta", "dK", "dV", "scale"),
           "flash_dkv", (*_TILE, "varlen"), mods=True, varlen=True),
    # the short-query path: forward and dQ cut the keys into splits whose partial results a
    # merge kernel adds up in order; dK/dV is the tiled kernel over packed rows; ``bwd_pre``
    # is shared with the tiled path
    OpSpec("fwd_split", "flash_fwd_split", ("Q", "K", "V", "Part", "scale"),
           "flash_forward_split", _TILE, packs="fwd", short_query=True, mods=True),
    OpSpec("fwd_merge", "flash_fwd_merge", ("Part", "Sinks", "O", "LSE"),
           "flash_forward_merge", ("head_dim", "dtype", "sinks"), row_wise=True, sinks=True,
           short_query=True),
    OpSpec("dq_split", "flash_dq_split",
           ("Q", "K", "V", "dO", "LSE", "Delta", "dQpart", "scale"),
           "flash_dq_split", _TILE, packs="dq", short_query=True, mods=True),
    OpSpec("dq_merge", "flash_dq_merge", ("dQpart", "dQ", "scale"),
           "flash_dq_merge", ("head_dim", "dtype"), row_wise=True, short_query=True),
    OpSpec("dkv_packed", "flash_dkv", ("Q", "K", "V", "dO", "LSE", "Delta", "dK", "dV", "scale"),
           "flash_dkv", (*_TILE, "packed"), packs="dkv", short_query=True, mods=True),
)}
"""Every op by name, the tiled path first."""


def spec(op: str) -> OpSpec:
    """The :class:`OpSpec` of ``op``; a clear error for an unknown one."""
    try:
        return SPECS[op]
    except KeyError:
        raise ValueError(f"op: {op!r} is not one of {tuple(SPECS)}") from None
