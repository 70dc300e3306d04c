"""Target-agnostic TensorIR kernel factories.

Each factory returns a PrimFunc whose blocks carry stable names; the schedules in
``tvm_flash.schedules`` find them by those names. ``FACTORIES[op](key, tile)`` builds the kernel
for a :class:`~tvm_flash.key.KernelKey` and a :class:`~tvm_flash.kernels.common.TileConfig`.
"""

from .backward import flash_bwd_preprocess, flash_dkv, flash_dq
from .common import TileConfig
from .forward import flash_forward

FACTORIES = {
    "fwd": lambda key, tile: flash_forward(key.head_dim, key.dtype, key.causal, key.group, tile,
                                           key.sinks),
    "bwd_pre": lambda key, tile: flash_bwd_preprocess(key.head_dim, key.dtype, tile),
    "dq": lambda key, tile: flash_dq(key.head_dim, key.dtype, key.causal, key.group, tile),
    "dkv": lambda key, tile: flash_dkv(key.head_dim, key.dtype, key.causal, key.group, tile),
}

__all__ = ["FACTORIES", "TileConfig", "flash_bwd_preprocess", "flash_dkv", "flash_dq",
           "flash_forward"]
