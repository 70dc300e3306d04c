"""CPU (``llvm``) schedule: one task per tile, spread over cores; the maths runs as written.

CI proves the TIR maths with this target, so it stays close to the kernel as written.
"""

from __future__ import annotations

from tvm import s_tir

from tvm_flash.kernels.common import TileConfig
from tvm_flash.key import MERGE_OPS, PACKED_BASE, KernelKey
from tvm_flash.opspec import PACKED_ROWS

from .common import apply_unroll

defaults = {"unroll": 0}
"""Hand-chosen decisions (auto-unroll depth; 0: off)."""
space = {"unroll": (0, 16, 64)}
"""What tuning may choose from (first = default)."""


def tile_config(key: KernelKey) -> TileConfig:
    # short-query kernels (a few packed query rows): long key tiles
    return TileConfig(PACKED_ROWS, 64) if key.op in PACKED_BASE else TileConfig(32, 32)


def tiles(key: KernelKey) -> list[TileConfig]:
    """The tuning space's tiles: just the one (CPU tiles matter little)."""
    return [tile_config(key)]


def schedule(sch: s_tir.Schedule, key: KernelKey, tile: TileConfig,
             decisions: dict | None = None) -> s_tir.Schedule:
    decisions = {**defaults, **(decisions or {})}
    if key.op in MERGE_OPS:  # row-wise kernels
        block = sch.get_sblock("delta" if key.op == "bwd_pre" else "merge")
        b, h, i, _ = sch.get_loops(block)
        sch.parallel(sch.fuse(b, h, i))
        return sch
    loop = sch.fuse(*sch.get_loops(sch.get_sblock("tile")))
    sch.parallel(loop)
    apply_unroll(sch, loop, decisions["unroll"], space["unroll"])
    return sch
