"""CUDA (sm_80, sm_90): the SIMT GPU schedule with up to 100 KiB of dynamic shared memory per
block (two blocks per SM on sm_80 and sm_90). Tensor cores (ldmatrix + mma.sync), cp.async
pipelining and swizzled layouts are the next step."""

from . import gpu

SCHEDULE = gpu.GpuSchedule(gpu.GpuParams(name="CUDA", smem_budget=100 * 1024,
                                         smem_scope="shared.dyn"))
