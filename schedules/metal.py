"""Metal (Apple GPUs): the SIMT GPU schedule within 32 KiB of threadgroup memory.

Threadgroups of 128 threads (4 simdgroups of 32), fp32 accumulators in registers, the tiles in
threadgroup memory. The tile shrinks until every kernel fits 32 KiB; head dims above 128 are
refused (their backward tiles cannot fit at a useful size). Simdgroup matrix instructions (8x8)
are the next step.
"""

from . import gpu

THREADGROUP_MEMORY = 32 * 1024

SCHEDULE = gpu.GpuSchedule(gpu.GpuParams(
    name="Metal", smem_budget=THREADGROUP_MEMORY, smem_scope="shared", max_head_dim=128,
    why_max_head_dim="its dQ and dK/dV tiles need more than Metal's 32 KiB of threadgroup "
                     "memory even at 16x16 (37440 bytes in fp16)",
    # TVM's Metal codegen keeps bf16 in device memory as ushort but computes and stages it
    # in float: a bf16 element takes 4 bytes of threadgroup memory
    bf16_bytes=4))
