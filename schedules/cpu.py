"""CPU (``llvm``) schedule: one task per tile, spread over cores; the maths runs as written.

CI proves the TIR maths with this target, so it stays close to the kernel as written.
"""

from __future__ import annotations

from tvm import s_tir

from tvm_flash.kernels.common import TileConfig
from tvm_flash.key import KernelKey


def tile_config(key: KernelKey) -> TileConfig:
    return TileConfig(32, 32)


def schedule(sch: s_tir.Schedule, key: KernelKey, tile: TileConfig) -> s_tir.Schedule:
    if key.op == "bwd_pre":
        block = sch.get_sblock("delta")
        b, h, i, _ = sch.get_loops(block)
        sch.parallel(sch.fuse(b, h, i))
        return sch
    sch.parallel(sch.fuse(*sch.get_loops(sch.get_sblock("tile"))))
    return sch
