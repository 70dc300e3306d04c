"""CUDA (sm_80, sm_90): the GPU schedule with tensor cores for fp16/bf16 (WMMA, up to 160 KiB of
shared memory per block, which sm_80's 164 KiB also allows) and the SIMT schedule otherwise (up
to 100 KiB, two blocks per SM). ``mma.sync`` with register-resident S/P/O, cp.async pipelining
and swizzled layouts are the next steps (docs/perf.md, v3)."""

from . import gpu

SCHEDULE = gpu.GpuSchedule(gpu.GpuParams(name="CUDA", smem_budget=100 * 1024,
                                         smem_scope="shared.dyn", tensor_cores=160 * 1024))
