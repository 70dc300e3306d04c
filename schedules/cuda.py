"""CUDA (sm_80, sm_90).

fp16/bf16 forward, dQ and dK/dV with head dims up to 128 run the warp-level ``mma.sync``
kernels of :mod:`.cuda_mma` (S, P and the running sums in registers, ``cp.async`` double
buffering); everything else — fp32, other head dims, the short-query and merge kernels — is
scheduled from the kernel factories by the GPU schedule: WMMA tensor cores for fp16/bf16 (up to
160 KiB of shared memory per block, tiles with which two blocks share an sm_90 SM first) and
the SIMT schedule otherwise (up to 100 KiB per block).
"""

from __future__ import annotations

from tvm_flash.key import KernelKey

from . import cuda_mma, gpu


class CudaSchedule(gpu.GpuSchedule):
    """The GPU schedule, with the warp-level kernels where they apply (``lowered``)."""

    def lowers(self, key: KernelKey) -> bool:
        return cuda_mma.supports(key)

    def lowered(self, key: KernelKey):
        """The hand-lowered PrimFunc for ``key``, or None where the factory is scheduled."""
        return cuda_mma.kernel(key) if cuda_mma.supports(key) else None

    def tile_config(self, key: KernelKey):
        if cuda_mma.supports(key):
            return cuda_mma.tile(key).tile_config(key.op)
        return super().tile_config(key)


SCHEDULE = CudaSchedule(gpu.GpuParams(name="CUDA", smem_budget=100 * 1024,
                                      smem_scope="shared.dyn", tensor_cores=160 * 1024,
                                      sm_shared=228 * 1024))
