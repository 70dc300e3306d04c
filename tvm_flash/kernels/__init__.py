"""Target-agnostic TensorIR kernel factories.

Each factory returns a PrimFunc whose blocks carry stable names; the schedules in
``tvm_flash.schedules`` find them by those names. ``FACTORIES[op](key, tile)`` builds the kernel
for a :class:`~tvm_flash.key.KernelKey` and a :class:`~tvm_flash.kernels.common.TileConfig`.
"""

from .backward import flash_bwd_preprocess, flash_dkv, flash_dq, flash_dq_merge, flash_dq_split
from .common import TileConfig
from .forward import flash_forward, flash_forward_merge, flash_forward_split

FACTORIES = {
    "fwd": lambda key, tile: flash_forward(key.head_dim, key.dtype, key.causal, key.group, tile,
                                           key.sinks),
    "bwd_pre": lambda key, tile: flash_bwd_preprocess(key.head_dim, key.dtype, tile),
    "dq": lambda key, tile: flash_dq(key.head_dim, key.dtype, key.causal, key.group, tile),
    "dkv": lambda key, tile: flash_dkv(key.head_dim, key.dtype, key.causal, key.group, tile),
    # the short-query path (see tvm_flash.key.SHORT_QUERY_OPS)
    "fwd_split": lambda key, tile: flash_forward_split(key.head_dim, key.dtype, key.causal,
                                                       key.group, tile),
    "fwd_merge": lambda key, tile: flash_forward_merge(key.head_dim, key.dtype, key.sinks),
    "dq_split": lambda key, tile: flash_dq_split(key.head_dim, key.dtype, key.causal, key.group,
                                                 tile),
    "dq_merge": lambda key, tile: flash_dq_merge(key.head_dim, key.dtype),
    "dkv_packed": lambda key, tile: flash_dkv(key.head_dim, key.dtype, key.causal, key.group,
                                              tile, packed=True),
}

__all__ = ["FACTORIES", "TileConfig", "flash_bwd_preprocess", "flash_dkv", "flash_dq",
           "flash_dq_merge", "flash_dq_split", "flash_forward", "flash_forward_merge",
           "flash_forward_split"]
