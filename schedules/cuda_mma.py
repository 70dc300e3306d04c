"""CUDA (sm_80+, fp16/bf16): forward, dQ and dK/dV written at warp level on ``mma.sync``.

Why these kernels are written here and not scheduled from ``tvm_flash.kernels``: block-level
tensorization (the WMMA schedule of docs/perf.md v3/v4, since removed) keeps a GEMM's product in
an opaque fragment, so S, P and every partial product made a float32 round trip through shared
memory; at best that reached 0.23x the FlashAttention-2 forward. Here each warp owns 16 rows
and holds its S, P, dP, dS and running sums in registers in the documented ``m16n8k16``
accumulator layout, which is also the A-operand layout: P and dS feed the second GEMM without
leaving the registers, and the row statistics need only two shuffles across the 4 lanes that
share a row. The algorithm is the one of ``tvm_flash.kernels`` (same masking, clamped exp2,
rounded P and dS, LSE and Delta conventions, the same ``common`` helpers); what is fixed here is
the thread mapping, so this module is the CUDA schedule of those kernels, written out.

Per kernel (``W`` warps of 32 lanes, ``16 W`` rows per block; ``lane = 4 g + t``):

* operands stay in shared memory, rows padded by 16 bytes so ``ldmatrix`` is conflict-free;
  the tiles the loop walks (K/V, or Q/dO for dK/dV) are double-buffered: ``cp.async`` fills
  the next stage while the tensor cores work on this one;
* a lane holds rows ``g`` and ``g + 8`` of its warp's 16, columns ``8 j + 2 t + {0, 1}``;
* only tiles that cross the causal diagonal or the end of the sequence are masked.

Registers (ptxas, sm_90, bf16; docs/perf.md v5): no spills for D <= 128.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from tvm_flash.kernels.common import (
    LOG2E,
    TileConfig,
    causal_offset,
    exp2_clamped,
    first_query_tile,
    neg_inf,
    num_key_tiles,
    row_lse,
    visible,
)
from tvm_flash.key import KernelKey

WARP = 32
F32 = "float32"
VEC = 8  # 16-bit elements per 16-byte copy
ROW_PAD = 8  # elements of padding per shared row (16 bytes)
OPS = ("fwd", "dq", "dkv")
HEAD_DIMS = (32, 64, 96, 128)  # beyond 128 the running sums outgrow the registers
_PTX = {"float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class MmaTile:
    """A warp-level tile: ``warps`` warps of 16 rows own ``16 * warps`` rows (queries for
    forward and dQ, keys for dK/dV); ``step`` rows of the other side per loop step;
    ``stages`` shared-memory buffers for the walked tiles."""

    warps: int
    step: int
    stages: int = 2

    @property
    def rows(self) -> int:
        return 16 * self.warps

    def check(self, head_dim: int) -> None:
        """Refuse a tile whose copies do not divide over the threads (each thread copies whole
        16-byte vectors)."""
        threads = self.warps * WARP
        if self.step % 16:
            raise ValueError(f"mma tile {self}: the step must be a multiple of 16 rows")
        for rows in (self.rows, self.step):
            if rows * head_dim // VEC % threads:
                raise ValueError(f"mma tile {self}: {rows} rows of D={head_dim} do not divide "
                                 f"over {threads} threads in 16-byte copies")

    def tile_config(self, op: str) -> TileConfig:
        """As a (block_q, block_k) :class:`TileConfig` (names artifacts and tuning logs)."""
        if op == "dkv":
            return TileConfig(self.step, self.rows)
        return TileConfig(self.rows, self.step)


def supports(key: KernelKey) -> bool:
    """Whether ``key`` runs on these kernels: fwd/dq/dkv, fp16/bf16, D in HEAD_DIMS, sm_80+."""
    arch = key.target[len("cuda-sm_"):] if key.target.startswith("cuda-sm_") else ""
    return (key.op in OPS and key.dtype in _PTX and key.head_dim in HEAD_DIMS
            and arch.isdigit() and int(arch) >= 80)


def tile(key: KernelKey) -> MmaTile:
    """Chosen from a sweep on the H200 (docs/perf.md v5): 4 warps with 64-row steps up to
    D = 64 and 32-row steps above (64 at D = 128 costs the forward 8-17%), except dK/dV above
    D = 64: 8 warps own 128 keys and take 64 queries a step (+16% over 4 warps x 32: the Q/dO
    tiles serve twice the keys); two stages (three measured from +1% to -38%)."""
    if key.op == "dkv" and key.head_dim > 64:
        return MmaTile(warps=8, step=64)
    return MmaTile(warps=4, step=64 if key.head_dim <= 64 else 32)


class _Fragments:
    """TVMScript macros shared by the kernels, for head dim ``d`` and input ``dtype``."""

    def __init__(self, d: int, dtype: str, tile: MmaTile):
        tile.check(d)
        threads = tile.warps * WARP
        ab = _PTX[dtype]
        stride, vrow = d + ROW_PAD, d // VEC

        @T.macro
        def copy_rows(dst, base, src, b, h, start, length, rows, tx, asynchronous):
            """``dst[base + i, :] = src[b, h, start + i, :]`` for ``rows`` rows, 16 bytes per
            copy, zero rows past ``length``; ``asynchronous``: ``cp.async`` (the caller commits
            and waits)."""
            for it in T.unroll(rows * vrow // threads):
                row = T.meta_var((it * threads + tx) // vrow)
                col = T.meta_var((it * threads + tx) % vrow * VEC)
                if start + row < length:
                    if asynchronous:
                        T.ptx.cp.async_.cg.shared.global_(
                            dst.access_ptr("w", offset=(base + row) * stride + col),
                            T.address_of(src[b, h, start + row, col]), 16)
                    else:
                        for v in T.vectorized(VEC):
                            dst[base + row, col + v] = src[b, h, start + row, col + v]
                else:
                    for v in T.vectorized(VEC):
                        dst[base + row, col + v] = T.cast(0, dtype)

        @T.macro
        def mma(a, a_off, b, b_off, c, c_off):
            """``c[c_off:+4] += A (16x16, a[a_off:+8]) B (16x8, b[b_off:+4])`` in float32."""
            T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", ab, ab, "fp32", a.data, a_off,
                                        b.data, b_off, c.data, c_off, False, dtype=F32))

        @T.macro
        def ld_a(frag, off, smem, row0, col0, lane):
            """A operand: the 16x16 block of ``smem`` at (row0, col0)."""
            T.evaluate(T.ptx_legacy.ldmatrix(
                False, 4, ".b16", frag.data, off,
                smem.access_ptr("r", offset=(row0 + lane % 16) * stride + col0 + lane // 16 * 8),
                0, dtype=dtype))

        @T.macro
        def ld_b(frag, smem, n0, k0, lane):
            """B operands of two n-tiles (n0, n0 + 8), k0..k0+15, from ``smem`` stored (n, k)."""
            T.evaluate(T.ptx_legacy.ldmatrix(
                False, 4, ".b16", frag.data, 0,
                smem.access_ptr("r", offset=(n0 + lane // 16 * 8 + lane % 8) * stride + k0
                                + lane // 8 % 2 * 8), 0, dtype=dtype))

        @T.macro
        def ld_bt(frag, smem, k0, n0, lane):
            """B operands of two n-tiles (n0, n0 + 8), k0..k0+15, from ``smem`` stored (k, n)."""
            T.evaluate(T.ptx_legacy.ldmatrix(
                True, 4, ".b16", frag.data, 0,
                smem.access_ptr("r", offset=(k0 + lane // 8 % 2 * 8 + lane % 8) * stride + n0
                                + lane // 16 * 8), 0, dtype=dtype))

        @T.macro
        def gemm_nt(acc, a_regs, a_smem, a_row, b_smem, b_row, n, bf, lane):
            """``acc (16 x n) += A B^T`` over the head dim: A the warp's 16 rows (``a_regs``
            preloaded fragments, or ``a_smem`` rows from ``a_row``), B ``n`` rows of ``b_smem``
            from ``b_row``; both stored (row, d)."""
            for kk in T.unroll(d // 16):
                if a_regs is None:
                    ld_a(bf, 8, a_smem, a_row, kk * 16, lane)
                for jp in T.unroll(n // 16):
                    ld_b(bf, b_smem, b_row + jp * 16, kk * 16, lane)
                    for half in T.unroll(2):
                        if a_regs is None:
                            mma(bf, 8, bf, half * 4, acc, (jp * 2 + half) * 4)
                        else:
                            mma(a_regs, kk * 8, bf, half * 4, acc, (jp * 2 + half) * 4)

        @T.macro
        def gemm_nn(acc, a_regs, k, b_smem, b_row, bf, lane):
            """``acc (16 x d) += A B``: A (16 x k) in registers in the accumulator layout of a
            16 x k product (P, dS), B ``k`` rows of ``b_smem`` from ``b_row``, stored (k, d)."""
            for kk in T.unroll(k // 16):
                for np_ in T.unroll(d // 16):
                    ld_bt(bf, b_smem, b_row + kk * 16, np_ * 16, lane)
                    for half in T.unroll(2):
                        mma(a_regs, kk * 8, bf, half * 4, acc, (np_ * 2 + half) * 4)

        @T.macro
        def quad_reduce(x, i, op):
            """Combine ``x[i]`` over the 4 lanes of a row."""
            x[i] = op(x[i], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[i], 1, 32, 32))
            x[i] = op(x[i], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[i], 2, 32, 32))

        @T.macro
        def zero(x, n):
            for i in T.unroll(n):
                x[i] = T.float32(0)

        @T.macro
        def store_rows(dst, b, h, r0, length, acc, scale, w, lane):
            """``dst[b, h, r0 + 16 w + {g, g + 8}, :] = acc * scale`` (rows before ``length``)."""
            for r in T.unroll(2):
                if r0 + w * 16 + lane // 4 + r * 8 < length:
                    for n in T.unroll(d // 8):
                        for e in T.vectorized(2):
                            dst[b, h, r0 + w * 16 + lane // 4 + r * 8, n * 8 + lane % 4 * 2 + e] = (
                                T.cast(acc[n * 4 + r * 2 + e] * scale, dtype))

        self.copy_rows, self.ld_a = copy_rows, ld_a
        self.gemm_nt, self.gemm_nn, self.quad_reduce = gemm_nt, gemm_nn, quad_reduce
        self.zero, self.store_rows = zero, store_rows
        self.ready = _ready(tile.stages)


def _mask_needed(causal: str, first_row, rows: int, first_col, cols: int, col_end, lq, lk,
                 transposed: bool = False):
    """Whether a (rows x cols) score tile may hold a masked element: it crosses ``col_end`` or
    (causal) the diagonal. ``transposed``: rows are keys and columns queries (dK/dV)."""
    crosses_end = first_col + cols > col_end
    if causal == "none":
        return crosses_end
    if transposed:  # a key row j is masked for query i < j - offset
        return T.Or(crosses_end,
                    first_col < first_row + rows - 1 - causal_offset(causal, lq, lk))
    return T.Or(crosses_end, first_col + cols - 1 > first_row + causal_offset(causal, lq, lk))


class _KeyWalk:
    """Macros of the kernels whose block owns a query tile and walks the key tiles (forward,
    dQ): its coordinates, and the ``cp.async`` pipeline over K/V stages."""

    def __init__(self, f: _Fragments, key: KernelKey, tile: MmaTile):
        BQ, BK, stages, causal, group = tile.rows, tile.step, tile.stages, key.causal, key.group

        @T.macro
        def coords(c, bx, nqt, Hq, Lq, Lk):
            """``c``: batch, head, kv head, first query row, key tiles to walk."""
            c[3] = (nqt - 1 - bx % nqt) * BQ  # the longest causal tiles first
            c[0] = bx // nqt // Hq
            c[1] = bx // nqt % Hq
            c[2] = c[1] // group
            c[4] = num_key_tiles(causal, c[3], BQ, Lq, Lk, BK, T.int64(0), Lk)

        @T.macro
        def prefetch(Ks, Vs, K, V, c, t, Lk, tx):
            """Start copying key tile ``t`` (if there is one) into its stage; one commit group
            either way, so that ``ready`` always waits for the right one."""
            if t < c[4]:
                f.copy_rows(Ks, t % stages * BK, K, c[0], c[2], t * BK, Lk, BK, tx, True)
                f.copy_rows(Vs, t % stages * BK, V, c[0], c[2], t * BK, Lk, BK, tx, True)
            T.ptx.cp.async_.commit_group()

        self.coords, self.prefetch, self.ready = coords, prefetch, f.ready


def _ready(stages: int):
    @T.macro
    def ready():
        """Wait for the oldest stage in flight, then for every thread's copies of it."""
        T.ptx.cp.async_.wait_group(stages - 1)
        T.tvm_storage_sync("shared")

    return ready


def flash_forward(key: KernelKey, tile: MmaTile):
    """``flash_fwd(q, k, v, sinks, o, lse, scale)`` as ``kernels.forward.flash_forward``."""
    D, dtype, causal, sinks = key.head_dim, key.dtype, key.causal, key.sinks
    W, BQ, BK, stages = tile.warps, tile.rows, tile.step, tile.stages
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    walk = _KeyWalk(f, key, tile)
    NS, NO = BK // 8, D // 8  # n-tiles of S and of O

    @T.prim_func
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle,
                  o_h: T.handle, lse_h: T.handle, scale: T.float32):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Sinks = T.match_buffer(sinks_h, (Hq,), F32)
        nqt = T.meta_var(T.ceildiv(Lq, BQ))
        bx = T.launch_thread("blockIdx.x", B * Hq * nqt)
        tx = T.launch_thread("threadIdx.x", NT)
        Qs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        Ks = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        qf = T.alloc_buffer((D // 2,), dtype, scope="local")  # Q's A fragments, D/16 x 8
        bf = T.alloc_buffer((16,), dtype, scope="local")  # B fragments (and an A one)
        s = T.alloc_buffer((NS * 4,), F32, scope="local")
        p = T.alloc_buffer((NS * 4,), dtype, scope="local")
        acc = T.alloc_buffer((NO * 4,), F32, scope="local")
        m = T.alloc_buffer((2,), F32, scope="local")
        mn = T.alloc_buffer((2,), F32, scope="local")
        lsum = T.alloc_buffer((2,), F32, scope="local")
        c = T.alloc_buffer((5,), "int64", scope="local")
        walk.coords(c, bx, nqt, Hq, Lq, Lk)
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        row = T.meta_var(c[3] + w * 16 + lane // 4)  # + 8 r: this lane's rows

        f.copy_rows(Qs, 0, Q, c[0], c[1], c[3], Lq, BQ, tx, False)
        for pt in T.unroll(stages - 1):
            walk.prefetch(Ks, Vs, K, V, c, T.int64(pt), Lk, tx)
        T.tvm_storage_sync("shared")
        for kk in T.unroll(D // 16):
            f.ld_a(qf, kk * 8, Qs, w * 16, kk * 16, lane)
        f.zero(acc, NO * 4)
        for r in T.unroll(2):
            if sinks:  # the softmax starts from the sink (one lane of the row counts it)
                m[r] = Sinks[c[1]] * T.float32(LOG2E)
                lsum[r] = T.if_then_else(lane % 4 == 0, T.float32(1), T.float32(0))
            else:
                m[r] = neg_inf()
                lsum[r] = T.float32(0)

        for kt in T.serial(c[4]):
            k0 = T.meta_var(kt * BK)
            walk.prefetch(Ks, Vs, K, V, c, kt + stages - 1, Lk, tx)
            walk.ready()
            f.zero(s, NS * 4)
            f.gemm_nt(s, qf, None, 0, Ks, kt % stages * BK, BK, bf, lane)
            for i in T.unroll(NS * 4):
                s[i] = s[i] * (scale * T.float32(LOG2E))
            if _mask_needed(causal, c[3], BQ, k0, BK, Lk, Lq, Lk):
                for j, e in T.grid(NS, 4):
                    if not visible(causal, row + e // 2 * 8, k0 + j * 8 + lane % 4 * 2 + e % 2,
                                   Lq, Lk):
                        s[j * 4 + e] = neg_inf()
            # online softmax in base 2 (kernels.forward): new max, rounded P, rescale
            for r in T.unroll(2):
                mn[r] = m[r]
            for j, e in T.grid(NS, 4):
                mn[e // 2] = T.max(mn[e // 2], s[j * 4 + e])
            for r in T.unroll(2):
                f.quad_reduce(mn, r, T.max)
            for j, e in T.grid(NS, 4):
                p[j * 4 + e] = T.cast(T.if_then_else(
                    s[j * 4 + e] == neg_inf(), T.float32(0),
                    exp2_clamped(s[j * 4 + e] - mn[e // 2])), dtype)
            for r in T.unroll(2):
                # m[r] holds the rescale factor until the new max replaces it
                m[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(1),
                                      exp2_clamped(m[r] - mn[r]))
                lsum[r] = lsum[r] * m[r]
            for j, e in T.grid(NS, 4):
                lsum[e // 2] = lsum[e // 2] + T.cast(p[j * 4 + e], F32)
            for n, e in T.grid(NO, 4):
                acc[n * 4 + e] = acc[n * 4 + e] * m[e // 2]
            for r in T.unroll(2):
                m[r] = mn[r]
            f.gemm_nn(acc, p, BK, Vs, kt % stages * BK, bf, lane)
            T.tvm_storage_sync("shared")  # this stage is refilled next step

        for r in T.unroll(2):
            f.quad_reduce(lsum, r, T.Add)
            # l == 0 only for a row that saw no key (nor sink): O = 0, LSE = -inf
            mn[r] = T.if_then_else(lsum[r] == T.float32(0), T.float32(0),
                                   T.float32(1) / lsum[r])
        for n, e in T.grid(NO, 4):
            acc[n * 4 + e] = acc[n * 4 + e] * mn[e // 2]
        f.store_rows(O, c[0], c[1], c[3], Lq, acc, T.float32(1), w, lane)
        for r in T.unroll(2):
            if lane % 4 == 0 and row + r * 8 < Lq:
                LSE[c[0], c[1], row + r * 8] = row_lse(m[r], lsum[r])

    return flash_fwd


def _prob(s, scale, lse):
    """``kernels.backward._prob`` on an unmasked element: 0 for a row without keys."""
    return T.if_then_else(lse == neg_inf(), T.float32(0),
                          exp2_clamped((s * scale - lse) * T.float32(LOG2E)))


def flash_dq(key: KernelKey, tile: MmaTile):
    """``flash_dq(q, k, v, do, lse, delta, dq, scale)`` as ``kernels.backward.flash_dq``."""
    D, dtype, causal = key.head_dim, key.dtype, key.causal
    W, BQ, BK, stages = tile.warps, tile.rows, tile.step, tile.stages
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    walk = _KeyWalk(f, key, tile)
    NS, NO = BK // 8, D // 8

    @T.prim_func
    def flash_dq(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
                 delta_h: T.handle, dq_h: T.handle, scale: T.float32):
        T.func_attr({"global_symbol": "flash_dq", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype)
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dQ = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype)
        nqt = T.meta_var(T.ceildiv(Lq, BQ))
        bx = T.launch_thread("blockIdx.x", B * Hq * nqt)
        tx = T.launch_thread("threadIdx.x", NT)
        Qs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        dOs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        Ks = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        bf = T.alloc_buffer((16,), dtype, scope="local")
        s = T.alloc_buffer((NS * 4,), F32, scope="local")
        dp = T.alloc_buffer((NS * 4,), F32, scope="local")
        ds = T.alloc_buffer((NS * 4,), dtype, scope="local")
        acc = T.alloc_buffer((NO * 4,), F32, scope="local")
        lse = T.alloc_buffer((2,), F32, scope="local")
        delta = T.alloc_buffer((2,), F32, scope="local")
        c = T.alloc_buffer((5,), "int64", scope="local")
        walk.coords(c, bx, nqt, Hq, Lq, Lk)
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        row = T.meta_var(c[3] + w * 16 + lane // 4)

        f.copy_rows(Qs, 0, Q, c[0], c[1], c[3], Lq, BQ, tx, False)
        f.copy_rows(dOs, 0, dO, c[0], c[1], c[3], Lq, BQ, tx, False)
        for pt in T.unroll(stages - 1):
            walk.prefetch(Ks, Vs, K, V, c, T.int64(pt), Lk, tx)
        for r in T.unroll(2):
            lse[r] = neg_inf()
            delta[r] = T.float32(0)
            if row + r * 8 < Lq:
                lse[r] = LSE[c[0], c[1], row + r * 8]
                delta[r] = Delta[c[0], c[1], row + r * 8]
        f.zero(acc, NO * 4)

        for kt in T.serial(c[4]):
            k0 = T.meta_var(kt * BK)
            walk.prefetch(Ks, Vs, K, V, c, kt + stages - 1, Lk, tx)
            walk.ready()
            f.zero(s, NS * 4)
            f.gemm_nt(s, None, Qs, w * 16, Ks, kt % stages * BK, BK, bf, lane)
            f.zero(dp, NS * 4)
            f.gemm_nt(dp, None, dOs, w * 16, Vs, kt % stages * BK, BK, bf, lane)
            # P recomputed from the LSE; dS = P (dP - Delta) rounded to the input dtype
            for j, e in T.grid(NS, 4):
                s[j * 4 + e] = _prob(s[j * 4 + e], scale, lse[e // 2])
            if _mask_needed(causal, c[3], BQ, k0, BK, Lk, Lq, Lk):
                for j, e in T.grid(NS, 4):
                    if not visible(causal, row + e // 2 * 8, k0 + j * 8 + lane % 4 * 2 + e % 2,
                                   Lq, Lk):
                        s[j * 4 + e] = T.float32(0)
            for j, e in T.grid(NS, 4):
                ds[j * 4 + e] = T.cast(s[j * 4 + e] * (dp[j * 4 + e] - delta[e // 2]), dtype)
            f.gemm_nn(acc, ds, BK, Ks, kt % stages * BK, bf, lane)
            T.tvm_storage_sync("shared")

        f.store_rows(dQ, c[0], c[1], c[3], Lq, acc, scale, w, lane)

    return flash_dq


def flash_dkv(key: KernelKey, tile: MmaTile):
    """``flash_dkv(q, k, v, do, lse, delta, dk, dv, scale)`` as ``kernels.backward.flash_dkv``:
    a block owns ``tile.rows`` keys of one key/value head and walks every query head of its
    group and every query tile that sees those keys (one flattened, double-buffered loop)."""
    D, dtype, causal, group = key.head_dim, key.dtype, key.causal, key.group
    W, BK, BQ, stages = tile.warps, tile.rows, tile.step, tile.stages
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    NS, NO = BQ // 8, D // 8
    if 2 * BQ > NT:
        raise ValueError(f"mma tile {tile}: one thread per LSE and Delta row needs {2 * BQ}")

    @T.macro
    def load_step(Qs, dOs, stats, Q, dO, LSE, Delta, b, hq, q0, Lq, stage, tx):
        """Stage ``stage``: the Q and dO tile of query head ``hq`` from row ``q0``, and its LSE
        and Delta (LSE -inf and Delta 0 past the end)."""
        f.copy_rows(Qs, stage * BQ, Q, b, hq, q0, Lq, BQ, tx, True)
        f.copy_rows(dOs, stage * BQ, dO, b, hq, q0, Lq, BQ, tx, True)
        if tx < 2 * BQ:
            if q0 + tx % BQ < Lq:
                if tx < BQ:
                    T.ptx.cp.async_.ca.shared.global_(
                        stats.access_ptr("w", offset=stage * 2 * BQ + tx),
                        T.address_of(LSE[b, hq, q0 + tx]), 4)
                else:
                    T.ptx.cp.async_.ca.shared.global_(
                        stats.access_ptr("w", offset=stage * 2 * BQ + tx),
                        T.address_of(Delta[b, hq, q0 + tx - BQ]), 4)
            else:
                stats[stage * 2 * BQ + tx] = T.if_then_else(tx < BQ, neg_inf(), T.float32(0))

    @T.prim_func
    def flash_dkv(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                  lse_h: T.handle, delta_h: T.handle, dk_h: T.handle, dv_h: T.handle,
                  scale: T.float32):
        T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype)
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dK = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype)
        dV = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype)
        nkt = T.meta_var(T.ceildiv(Lk, BK))
        bx = T.launch_thread("blockIdx.x", B * Hkv * nkt)
        tx = T.launch_thread("threadIdx.x", NT)
        Ks = T.alloc_buffer((BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Qs = T.alloc_buffer((stages * BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        dOs = T.alloc_buffer((stages * BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        stats = T.alloc_buffer((stages * 2 * BQ,), F32, scope="shared.dyn")  # LSE, Delta
        bf = T.alloc_buffer((16,), dtype, scope="local")
        st = T.alloc_buffer((NS * 4,), F32, scope="local")
        dpt = T.alloc_buffer((NS * 4,), F32, scope="local")
        pt = T.alloc_buffer((NS * 4,), dtype, scope="local")
        dk = T.alloc_buffer((NO * 4,), F32, scope="local")
        dv = T.alloc_buffer((NO * 4,), F32, scope="local")
        # c: batch, kv head, first key, first query tile that sees it, query tiles per head,
        # steps (query tiles x heads of the group)
        c = T.alloc_buffer((6,), "int64", scope="local")
        c[2] = (nkt - 1 - bx % nkt) * BK  # causal: the keys seen by the most queries first
        c[0] = bx // nkt // Hkv
        c[1] = bx // nkt % Hkv
        c[3] = first_query_tile(causal, c[2], Lq, Lk, BQ)
        c[4] = T.ceildiv(Lq, BQ) - c[3]
        c[5] = c[4] * group
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        key_row = T.meta_var(c[2] + w * 16 + lane // 4)  # + 8 r: this lane's keys

        f.copy_rows(Ks, 0, K, c[0], c[1], c[2], Lk, BK, tx, False)
        f.copy_rows(Vs, 0, V, c[0], c[1], c[2], Lk, BK, tx, False)
        for ps in T.unroll(stages - 1):
            if T.int64(ps) < c[5]:
                load_step(Qs, dOs, stats, Q, dO, LSE, Delta, c[0],
                          c[1] * group + T.int64(ps) // c[4], (c[3] + T.int64(ps) % c[4]) * BQ,
                          Lq, ps, tx)
            T.ptx.cp.async_.commit_group()
        f.zero(dk, NO * 4)
        f.zero(dv, NO * 4)

        for i in T.serial(c[5]):
            q0 = T.meta_var((c[3] + i % c[4]) * BQ)
            ahead = T.meta_var(i + stages - 1)
            if ahead < c[5]:
                load_step(Qs, dOs, stats, Q, dO, LSE, Delta, c[0], c[1] * group + ahead // c[4],
                          (c[3] + ahead % c[4]) * BQ, Lq, ahead % stages, tx)
            T.ptx.cp.async_.commit_group()
            f.ready()
            sq = T.meta_var(i % stages * BQ)  # this step's rows of Qs / dOs
            ss = T.meta_var(i % stages * 2 * BQ)  # and of stats
            # S^T = K Q^T, P^T recomputed from the LSE of each column (query)
            f.zero(st, NS * 4)
            f.gemm_nt(st, None, Ks, w * 16, Qs, sq, BQ, bf, lane)
            for j, e in T.grid(NS, 4):
                st[j * 4 + e] = T.cast(T.cast(_prob(
                    st[j * 4 + e], scale, stats[ss + j * 8 + lane % 4 * 2 + e % 2]), dtype), F32)
            if _mask_needed(causal, c[2], BK, q0, BQ, Lq, Lq, Lk, transposed=True):
                for j, e in T.grid(NS, 4):
                    if not visible(causal, q0 + j * 8 + lane % 4 * 2 + e % 2,
                                   key_row + e // 2 * 8, Lq, Lk):
                        st[j * 4 + e] = T.float32(0)
            for i2 in T.unroll(NS * 4):
                pt[i2] = T.cast(st[i2], dtype)
            f.gemm_nn(dv, pt, BQ, dOs, sq, bf, lane)  # dV += P^T dO
            f.zero(dpt, NS * 4)
            f.gemm_nt(dpt, None, Vs, w * 16, dOs, sq, BQ, bf, lane)  # dP^T = V dO^T
            for j, e in T.grid(NS, 4):
                pt[j * 4 + e] = T.cast(st[j * 4 + e] * (
                    dpt[j * 4 + e] - stats[ss + BQ + j * 8 + lane % 4 * 2 + e % 2]), dtype)
            f.gemm_nn(dk, pt, BQ, Qs, sq, bf, lane)  # dK += dS^T Q
            T.tvm_storage_sync("shared")

        f.store_rows(dK, c[0], c[1], c[2], Lk, dk, scale, w, lane)
        f.store_rows(dV, c[0], c[1], c[2], Lk, dv, T.float32(1), w, lane)

    return flash_dkv


KERNELS = {"fwd": flash_forward, "dq": flash_dq, "dkv": flash_dkv}


def kernel(key: KernelKey):
    """The warp-level PrimFunc for ``key`` (see :func:`supports`)."""
    return KERNELS[key.op](key, tile(key))
