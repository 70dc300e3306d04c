"""Target-agnostic TensorIR kernel factories.

Each factory returns a PrimFunc whose blocks carry stable names; the schedules in
``tvm_flash.schedules`` find them by those names. ``FACTORIES[op](key, tile)`` builds the kernel
for a :class:`~tvm_flash.key.KernelKey` and a :class:`~tvm_flash.kernels.common.TileConfig`,
calling the factory its :class:`~tvm_flash.opspec.OpSpec` names with the parameters it lists.
"""

from ..opspec import SPECS, OpSpec
from .backward import flash_bwd_preprocess, flash_dkv, flash_dq, flash_dq_merge, flash_dq_split
from .common import Mods, TileConfig
from .forward import flash_forward, flash_forward_merge, flash_forward_split

_FUNCTIONS = {f.__name__: f for f in (flash_forward, flash_forward_split, flash_forward_merge,
                                       flash_bwd_preprocess, flash_dq, flash_dq_split,
                                       flash_dq_merge, flash_dkv)}


def _factory(spec: OpSpec):
    func = _FUNCTIONS[spec.factory]

    def build(key, tile: TileConfig):
        given = {"head_dim": key.head_dim, "dtype": key.dtype, "causal": key.causal,
                 "group": key.group, "sinks": key.sinks, "tile": tile,
                 "packed": spec.packs is not None,
                 "mods": Mods(key.window, key.softcap, key.alibi), "varlen": key.varlen}
        return func(**{name: given[name] for name in spec.factory_args})

    build.__name__ = build.__qualname__ = f"{spec.name}_factory"
    return build


FACTORIES = {op: _factory(spec) for op, spec in SPECS.items()}
"""op -> ``factory(key, tile) -> PrimFunc``."""

__all__ = ["FACTORIES", "TileConfig", "flash_bwd_preprocess", "flash_dkv", "flash_dq",
           "flash_dq_merge", "flash_dq_split", "flash_forward", "flash_forward_merge",
           "flash_forward_split"]
