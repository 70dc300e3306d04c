"""CUDA (sm_80, sm_90): the GPU schedule with tensor cores for fp16/bf16 (WMMA) and the SIMT
schedule otherwise (up to 100 KiB of shared memory per block, two blocks per SM).

A tensor-core block may use up to 160 KiB of shared memory (sm_80's 164 KiB also allows it);
a tile with which two blocks share an sm_90 SM (228 KiB) comes first where one fits: at one
block per SM (4 warps) the backward kernels were latency-bound (ncu, docs/perf.md v4).
``mma.sync`` with register-resident S/P/O, cp.async pipelining and swizzled layouts are the next
steps (docs/perf.md)."""

from . import gpu

SCHEDULE = gpu.GpuSchedule(gpu.GpuParams(name="CUDA", smem_budget=100 * 1024,
                                         smem_scope="shared.dyn", tensor_cores=160 * 1024,
                                         sm_shared=228 * 1024))
