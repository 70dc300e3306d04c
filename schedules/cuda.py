"""CUDA (sm_80, sm_90, sm_90a).

On ``sm_90a`` (Hopper with its arch-specific instructions) the fp16/bf16 forward at every
head dim (32-256) runs the ``wgmma`` + TMA kernel of :mod:`.cuda_hopper`. Elsewhere fp16/bf16
forward, dQ and dK/dV at every head dim (32-256) run the warp-level ``mma.sync`` kernels of
:mod:`.cuda_mma` (S, P and the running sums in registers, ``cp.async`` double buffering; above
D = 128 one m-tile per warp and dK/dV split over two warps per key group), and so do the
short-query forward's split (plain keys) and its merge; everything else — fp32, the
short-query dQ, its merge and the packed dK/dV — is scheduled from the kernel factories by the
SIMT GPU schedule (up to 100 KiB of dynamic shared memory per block, two blocks per SM). The
block-level WMMA schedule that preceded the warp-level kernels (docs/journal/perf-history.md
v3, v4) was removed with them: on sm_80+ it no longer served any kernel.
"""

from __future__ import annotations

import dataclasses

from tvm_flash.key import KernelKey

from . import cuda_hopper, cuda_mma, gpu


class CudaSchedule(gpu.GpuSchedule):
    """The GPU schedule, with the warp-level kernels where they apply (``lowered``)."""

    def lowers(self, key: KernelKey) -> bool:
        return cuda_hopper.supports(key) or cuda_mma.supports(key)

    def lowered(self, key: KernelKey, variant: dict | None = None):
        """The hand-lowered PrimFunc for ``key``, or None where the factory is scheduled;
        ``variant``: the fields of one of :meth:`variants` (a tuning log's choice)."""
        if cuda_hopper.supports(key):
            return cuda_hopper.kernel(key, cuda_hopper.HopperTile(**variant) if variant
                                      else None)
        if not cuda_mma.supports(key):
            return None
        return cuda_mma.kernel(key, cuda_mma.MmaTile(**variant) if variant else None)

    def absorbs(self, key: KernelKey) -> str | None:
        """The op whose work ``key``'s kernel does too: the Hopper dQ's Delta
        (``cuda_hopper.ABSORBS``); the ``mma.sync`` and SIMT kernels do none."""
        return cuda_hopper.ABSORBS.get(key.op) if cuda_hopper.supports(key) else None

    def variant(self, key: KernelKey, fields: dict) -> dict:
        """A variant's fields as :meth:`variants` lists them today: fields a tile gained after
        a tuning log was written take their defaults (the kernel the log measured)."""
        if cuda_hopper.supports(key):
            return dataclasses.asdict(cuda_hopper.HopperTile(**fields))
        return dataclasses.asdict(cuda_mma.MmaTile(**fields))

    def variants(self, key: KernelKey) -> list[dict]:
        """The variants of a hand-lowered kernel a tuner may measure (the default first), as
        the fields of their tiles (``cuda_hopper.variants``, ``cuda_mma.variants``)."""
        if cuda_hopper.supports(key):
            return [dataclasses.asdict(t) for t in cuda_hopper.variants(key)]
        if cuda_mma.supports(key):
            return [dataclasses.asdict(t) for t in cuda_mma.variants(key)]
        return []

    def pipeline(self, key: KernelKey) -> str | None:
        """TVM's lowering pipeline: the Hopper kernels are written in TIRx's device-region
        form (``T.device_entry``, host-side tensor maps) and need its ``tirx`` pipeline."""
        return "tirx" if cuda_hopper.supports(key) else None

    def tile_config(self, key: KernelKey):
        if cuda_hopper.supports(key):
            return cuda_hopper.tile(key).tile_config(key.op)
        if cuda_mma.supports(key):
            return cuda_mma.tile_config(key)
        return super().tile_config(key)


SCHEDULE = CudaSchedule(gpu.GpuParams(name="CUDA", smem_budget=100 * 1024,
                                      smem_scope="shared.dyn", vector_loads=True))
