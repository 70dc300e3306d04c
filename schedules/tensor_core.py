"""Tensor-core GEMMs for the CUDA schedule (fp16 and bf16 inputs, fp32 accumulators).

Every GEMM of the kernels writes a fresh float32 tile from two 16-bit shared-memory operands
(``kernels.common.gemm``: C = A B^T or C = A B), inside a scope block of its own. Here such a
GEMM becomes warp-level WMMA 16x16x16 operations: the four warps of a block take the output's
16-row bands in turn, each warp walks the reduction in 16-wide steps loading one A fragment
and, per 16-column band, one B fragment, keeps the fp32 accumulators of its whole row band in
registers and stores them to the (shared) output once at the end. On sm_80 and sm_90 each
WMMA operation is HMMA.16816 instructions.

The fragment intrinsics come from ``tvm.s_tir.tensor_intrin.cuda``'s generators; TVM only
registers fp16 ones, so the bf16 ones (same generators, same CUDA ``wmma`` API) are
registered here under our own names, both dtypes alike.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.tensor_intrin import cuda as cuda_intrins

from .common import align_rows

FRAG = 16  # WMMA m = n = k
WARPS = 4
WARP_SIZE = 32
DTYPES = ("float16", "bfloat16")


def _intrin(kind: str, dtype: str, scope: str, **variant) -> str:
    """Name of one fragment intrinsic, registered on first use."""
    name = f"tvm_flash_wmma_{kind}_{dtype}_{scope}" + "".join(
        f"_{k}{int(v)}" for k, v in sorted(variant.items()))
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        if kind == "load":
            parts = cuda_intrins.get_wmma_load_intrin(FRAG, FRAG, FRAG, dtype, scope,
                                                      variant["b"], variant["col"])
        elif kind == "sync":
            parts = cuda_intrins.get_wmma_sync_intrin(FRAG, FRAG, FRAG, dtype, "float32",
                                                      variant["bt"])
        elif kind == "fill":
            parts = cuda_intrins.get_wmma_fill_intrin(FRAG, FRAG, FRAG, "float32")
        else:
            parts = cuda_intrins.get_wmma_store_intrin(FRAG, FRAG, FRAG, "float32", scope)
        s_tir.TensorIntrin.register(name, *parts)
    return name


def gemm(sch: s_tir.Schedule, name: str, dtype: str, pad: int) -> None:
    """Run the GEMM block ``name`` (C = A B or A B^T, operands and C in shared memory) on
    tensor cores. Threads must be bound as (threadIdx.y, threadIdx.x) = (WARPS, 32).

    C's rows are padded by ``pad`` float32 elements (a WMMA row stride must be a multiple of 4):
    the row statistics read C one thread per row, and unpadded rows of 64 or 128 floats would
    all start in the same shared-memory bank (32-way conflicts; docs/perf.md, v4)."""
    block = sch.get_sblock(name)
    stmt = sch.get(block)
    out = stmt.writes[0].source
    a_buf, b_buf = [r.source for r in stmt.reads if not r.source.same_as(out)]
    # B^T when B is indexed by the output's column first (B[j, r])
    b_region = stmt.reads[_read_index(stmt, b_buf)].region
    b_transposed = b_region[0].min.same_as(stmt.iter_vars[1].var)
    i, j, k = sch.get_loops(block)[-3:]
    i0, i1 = sch.split(i, [None, FRAG])
    j0, j1 = sch.split(j, [None, FRAG])
    k0, k1 = sch.split(k, [None, FRAG])
    warp, band = sch.split(i0, [WARPS, None])
    sch.reorder(warp, band, k0, j0, i1, j1, k1)
    sch.bind(warp, "threadIdx.y")

    acc = sch.cache_write(block, 0, "wmma.accumulator")
    sch.reverse_compute_at(acc, band)
    frag_a = sch.cache_read(block, _read_index(stmt, a_buf), "wmma.matrix_a")
    frag_b = sch.cache_read(block, _read_index(stmt, b_buf), "wmma.matrix_b")
    sch.compute_at(frag_a, k0)
    sch.compute_at(frag_b, j0)
    init = sch.decompose_reduction(block, k0)

    sch.tensorize(sch.get_loops(init)[-2], _intrin("fill", dtype, "-"))
    sch.tensorize(sch.get_loops(frag_a)[-2],
                  _intrin("load", dtype, a_buf.scope(), b=False, col=False))
    sch.tensorize(sch.get_loops(frag_b)[-2],
                  _intrin("load", dtype, b_buf.scope(), b=True, col=b_transposed))
    sch.tensorize(i1, _intrin("sync", dtype, "-", bt=b_transposed))
    rows, cols = sch.get_loops(acc)[-2:]
    c0, c1 = sch.split(cols, [None, FRAG])
    sch.reorder(c0, rows, c1)
    write_back = sch.get(acc).name_hint
    sch.tensorize(rows, _intrin("store", dtype, out.scope()))
    # the padding goes on the block tensorize leaves (it drops annotations of the one it replaces)
    align_rows(sch, sch.get_sblock(write_back + "_o"), 0, int(out.shape[1]), pad)


def _read_index(stmt, buf) -> int:
    return [i for i, r in enumerate(stmt.reads) if r.source.same_as(buf)][0]
