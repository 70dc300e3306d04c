"""Backward kernels: preprocess, dQ and dK/dV.

The backward never stores P: each kernel recomputes ``P = exp2((s * scale - LSE) * log2(e))``
from Q, K and the forward's LSE. With ``Delta = rowsum(dO * O)``:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta)
    dQ = scale * dS K  dK = scale * dS^T Q

Two kernels split the work so that every output element has exactly one writer — no atomics,
bitwise deterministic gradients:

* ``flash_dq``: one tile of query rows loops over the key tiles.
* ``flash_dkv``: one tile of key rows of one key/value head *owns* its dK/dV rows and loops
  over every query head of its GQA group and every query tile. dK/dV start from zero.

P and dS are rounded to the input dtype before their GEMMs (as FlashAttention does); every
GEMM writes a fresh float32 tile from 16-bit operands (a plain reduction block, which
schedules may split, bind and tensorize) that an elementwise block adds to the running sum,
zeroed once by ``acc_init``.

Short queries (the "vector" path) pack the queries of a GQA group into one tile (see
``common.Rows``): ``flash_dkv`` takes packed rows as they are, and ``flash_dq_split`` cuts
the keys into splits that write partial dQ sums, added up in split order by
``flash_dq_merge`` (deterministic).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .common import (
    LOG2E,
    TILED,
    Rows,
    TileConfig,
    accumulate,
    exp2_clamped,
    first_query_tile,
    fresh,
    gemm,
    load_row_stats,
    load_tile,
    neg_inf,
    num_key_tiles,
    pin_scalars,
    plain,
    split_size,
    store_tile,
    strides,
    transposed,
    visible,
)


class _Macros:
    """One fresh macro per use inside a kernel (see ``common.fresh``)."""

    def __init__(self):
        self.load_q, self.load_do, self.load_k, self.load_v = (fresh(load_tile)
                                                               for _ in range(4))
        self.load_rows = fresh(load_row_stats)
        self.gemm_1, self.gemm_2, self.gemm_3, self.gemm_4 = (fresh(gemm) for _ in range(4))
        self.add_1, self.add_2 = fresh(accumulate), fresh(accumulate)
        self.store_1, self.store_2 = fresh(store_tile), fresh(store_tile)
        self.pin = fresh(pin_scalars)


def _prob(causal, s, scale, lse, row, col, lq, lk, end=None):
    """Recomputed probability; 0 where masked or where the row saw no key (LSE = -inf).

    ``s * scale - lse`` is formed in natural-log units first (one fused multiply-add on GPUs,
    rounded once at the size of the small result) and only then turned into base 2; scaling
    each of ``s`` and ``lse`` to base 2 first would round both at the size of the logits,
    which costs accuracy once logits reach ~1e4.
    """
    return T.if_then_else(
        tirx.all(visible(causal, row, col, lq, lk, end), lse != neg_inf()),
        exp2_clamped((s * scale - lse) * T.float32(LOG2E)),
        T.float32(0),
    )


def flash_bwd_preprocess(head_dim: int, dtype: str, tile: TileConfig):
    """Return ``flash_bwd_pre(o, do, delta)``: ``delta[b, h, i] = sum_d o * do`` in float32.

    Shapes: o, do ``(B, H, L, D)``; delta ``(B, H, L)`` float32. Rows are independent, so the
    tile is unused: the schedule alone decides how rows map to threads.
    """
    D = head_dim
    f32 = "float32"

    @T.prim_func(s_tir=True)
    def flash_bwd_pre(o_h: T.handle, do_h: T.handle, delta_h: T.handle):
        T.func_attr({"global_symbol": "flash_bwd_pre", "tirx.noalias": True})
        B, H, L = T.int64(), T.int64(), T.int64()
        O = T.match_buffer(o_h, (B, H, L, D), dtype, strides=strides("o"))
        dO = T.match_buffer(do_h, (B, H, L, D), dtype, strides=strides("do"))
        Delta = T.match_buffer(delta_h, (B, H, L), f32)
        for b, h, i, d in T.grid(B, H, L, D):
            with T.sblock("delta"):
                vb, vh, vi, vd = T.axis.remap("SSSR", [b, h, i, d])
                with T.init():
                    Delta[vb, vh, vi] = T.float32(0)
                Delta[vb, vh, vi] = Delta[vb, vh, vi] + T.cast(O[vb, vh, vi, vd], f32) * T.cast(
                    dO[vb, vh, vi, vd], f32
                )

    return flash_bwd_pre


def _dq_tile(head_dim: int, dtype: str, causal: str, tile: TileConfig, rows: Rows):
    """Macro: the unscaled dQ sum of one query tile over the keys ``[k_begin, k_end)``,
    left in ``acc``."""
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    m = _Macros()

    @T.macro
    def dq_tile(Q, K, V, dO, LSE, Delta, acc, vb, h, hk, r0, k_begin, k_end, Lq, Lk, scale):
        Qs = T.sblock_alloc_buffer((BQ, D), dtype)
        dOs = T.sblock_alloc_buffer((BQ, D), dtype)
        Ks = T.sblock_alloc_buffer((BK, D), dtype)
        Vs = T.sblock_alloc_buffer((BK, D), dtype)
        lse_s = T.sblock_alloc_buffer((BQ,), f32)
        delta_s = T.sblock_alloc_buffer((BQ,), f32)
        S = T.sblock_alloc_buffer((BQ, BK), f32)
        dP = T.sblock_alloc_buffer((BQ, BK), f32)
        dS = T.sblock_alloc_buffer((BQ, BK), dtype)
        dQp = T.sblock_alloc_buffer((BQ, D), f32)

        m.load_q("Q_load", Qs, Q, vb, h, r0, Lq, BQ, D, dtype, rows)
        m.load_do("dO_load", dOs, dO, vb, h, r0, Lq, BQ, D, dtype, rows)
        m.load_rows("row_load", lse_s, delta_s, LSE, Delta, vb, h, r0, Lq, BQ, rows)
        for i, d in T.grid(BQ, D):
            with T.sblock("acc_init"):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = T.float32(0)

        steps = T.meta_var(num_key_tiles(causal, r0, BQ, Lq, Lk, BK, k_begin, k_end))
        for kt in T.serial(steps):
            with T.sblock("key_step"):
                # a step carries running sums to the next: an opaque iteration (TVM then keeps the
                # tiles written here allocated across the loop; see common.STEP_NOTE)
                vkt = T.axis.opaque(steps, kt)
                k0 = T.meta_var(k_begin + vkt * BK)
                m.load_k("K_load", Ks, K, vb, hk, k0, k_end, BK, D, dtype)
                m.load_v("V_load", Vs, V, vb, hk, k0, k_end, BK, D, dtype)
                m.gemm_1("S_gemm", S, Qs, Ks, BQ, BK, D, transposed)
                m.gemm_2("dP_gemm", dP, dOs, Vs, BQ, BK, D, transposed)
                for i, j in T.grid(BQ, BK):
                    with T.sblock("dS"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        dS[vi, vj] = T.cast(_prob(causal, S[vi, vj], scale, lse_s[vi],
                                                  rows.query(r0 + vi, Lq), k0 + vj, Lq, Lk, k_end)
                                            * (dP[vi, vj] - delta_s[vi]), dtype)
                m.gemm_3("dQ_gemm", dQp, dS, Ks, BQ, D, BK, plain)
                m.add_1("dQ_update", acc, dQp, BQ, D)

    return dq_tile


def flash_dq(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig):
    """Return ``flash_dq(q, k, v, do, lse, delta, dq, scale)``.

    Shapes: q, do, dq ``(B, Hq, Lq, D)``; k, v ``(B, Hkv, Lk, D)``; lse, delta ``(B, Hq, Lq)``.

    Named blocks: ``tile``, ``Q_load``, ``dO_load``, ``row_load``, ``acc_init``, ``K_load``,
    ``V_load``, ``S_gemm``, ``dP_gemm``, ``dS`` (P and dS elementwise), ``dQ_gemm`` (dQp = dS K),
    ``dQ_update`` (acc += dQp), ``dQ_store``.
    """
    D, BQ = head_dim, tile.block_q
    f32 = "float32"
    dq_tile = _dq_tile(head_dim, dtype, causal, tile, TILED)
    store, pin = fresh(store_tile), fresh(pin_scalars)

    @T.prim_func(s_tir=True)
    def flash_dq(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, dq_h: T.handle, scale: T.float32,
    ):
        T.func_attr({"global_symbol": "flash_dq", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), f32)
        dQ = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype, strides=strides("dq"))

        for b, h, qt in T.grid(B, Hq, T.ceildiv(Lq, BQ)):
            with T.sblock("tile"):
                vb, vh, vt = T.axis.remap("SSS", [b, h, qt])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                pin("coords", c, vb, vh, vh // group, vt * BQ, T.int64(0), Lk)
                dq_tile(Q, K, V, dO, LSE, Delta, acc, c[0], c[1], c[2], c[3], c[4], c[5], Lq, Lk,
                        scale)
                store("dQ_store", dQ, acc, c[0], c[1], c[3], Lq, BQ, D, scale, dtype)

    return flash_dq


def flash_dq_split(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig):
    """Return ``flash_dq_split(q, k, v, do, lse, delta, dq_part, scale)``: short-query dQ,
    one unscaled float32 partial sum per key split.

    Shapes as :func:`flash_dq` but ``dq_part`` ``(NS * B, Hq, Lq, D)`` float32 (split ``s``
    of batch ``b`` is row ``s * B + b``; NS read off the buffer). Tiles pack the queries of
    a GQA group. Blocks as :func:`flash_dq`, with ``part_store`` for ``dQ_store``.
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    rows = Rows(packed=True, group=group)
    dq_tile = _dq_tile(head_dim, dtype, causal, tile, rows)
    store, pin = fresh(store_tile), fresh(pin_scalars)

    @T.prim_func(s_tir=True)
    def flash_dq_split(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, part_h: T.handle, scale: T.float32,
    ):
        T.func_attr({"global_symbol": "flash_dq_split", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk, BS = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), f32)
        dQpart = T.match_buffer(part_h, (BS, Hq, Lq, D), f32)

        for b, hk, rt, s in T.grid(B, Hkv, T.ceildiv(group * Lq, BQ), BS // B):
            with T.sblock("tile"):
                vb, vhk, vt, vs = T.axis.remap("SSSS", [b, hk, rt, s])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                pin("coords", c, vb, vhk * group, vhk, vt * BQ, vs * split_size(Lk, BS // B, BK),
                    T.min((vs + 1) * split_size(Lk, BS // B, BK), Lk))
                dq_tile(Q, K, V, dO, LSE, Delta, acc, c[0], c[1], c[2], c[3], c[4], c[5], Lq, Lk,
                        scale)
                store("part_store", dQpart, acc, vs * B + c[0], c[1], c[3], Lq, BQ, D,
                      T.float32(1), f32, rows)

    return flash_dq_split


def flash_dq_merge(head_dim: int, dtype: str):
    """Return ``flash_dq_merge(dq_part, dq, scale)``: ``dq = scale * sum_s dq_part[s]``, the
    splits added in order. Named block: ``merge``."""
    D = head_dim
    f32 = "float32"

    @T.prim_func(s_tir=True)
    def flash_dq_merge(part_h: T.handle, dq_h: T.handle, scale: T.float32):
        T.func_attr({"global_symbol": "flash_dq_merge", "tirx.noalias": True})
        B, Hq, Lq, BS = T.int64(), T.int64(), T.int64(), T.int64()
        dQpart = T.match_buffer(part_h, (BS, Hq, Lq, D), f32)
        dQ = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype, strides=strides("dq"))
        for b, h, i, d in T.grid(B, Hq, Lq, D):
            with T.sblock("merge"):
                vb, vh, vi, vd = T.axis.remap("SSSS", [b, h, i, d])
                T.reads(dQpart[:, vh, vi, vd])
                T.writes(dQ[vb, vh, vi, vd])
                red = T.sblock_alloc_buffer((1,), f32, scope="local")
                red[0] = T.float32(0)
                for s in T.serial(BS // B):
                    red[0] = red[0] + dQpart[s * B + vb, vh, vi, vd]
                dQ[vb, vh, vi, vd] = T.cast(red[0] * scale, dtype)

    return flash_dq_merge


def flash_dkv(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
              packed: bool = False):
    """Return ``flash_dkv(q, k, v, do, lse, delta, dk, dv, scale)``.

    ``packed``: query tiles pack the queries of all heads of the GQA group (the short-query
    path; see ``common.Rows``) instead of walking the heads one by one.

    Shapes as :func:`flash_dq`, plus dk, dv ``(B, Hkv, Lk, D)``. One ``tile`` block per
    (batch, key/value head, key tile) loops over the ``group`` query heads sharing that head
    and over the query tiles that can see its keys.

    Named blocks: ``tile``, ``K_load``, ``V_load``, ``acc_init``, ``Q_load``, ``dO_load``,
    ``row_load``, ``St_gemm`` (S^T = K Q^T), ``P``, ``dV_gemm`` (dVp = P^T dO), ``dV_update``,
    ``dPt_gemm`` (dP^T = V dO^T), ``dS``, ``dK_gemm`` (dKp = dS^T Q), ``dK_update``,
    ``dK_store``, ``dV_store``.
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    m = _Macros()
    rows = Rows(packed=packed, group=group)

    @T.prim_func(s_tir=True)
    def flash_dkv(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, dk_h: T.handle, dv_h: T.handle, scale: T.float32,
    ):
        T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), f32)
        dK = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype, strides=strides("dk"))
        dV = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype, strides=strides("dv"))

        for b, hk, kt in T.grid(B, Hkv, T.ceildiv(Lk, BK)):
            with T.sblock("tile"):
                vb, vhk, vt = T.axis.remap("SSS", [b, hk, kt])
                T.reads()
                T.writes()
                Ks = T.sblock_alloc_buffer((BK, D), dtype)
                Vs = T.sblock_alloc_buffer((BK, D), dtype)
                Qs = T.sblock_alloc_buffer((BQ, D), dtype)
                dOs = T.sblock_alloc_buffer((BQ, D), dtype)
                lse_s = T.sblock_alloc_buffer((BQ,), f32)
                delta_s = T.sblock_alloc_buffer((BQ,), f32)
                St = T.sblock_alloc_buffer((BK, BQ), f32)
                Pt = T.sblock_alloc_buffer((BK, BQ), dtype)
                dPt = T.sblock_alloc_buffer((BK, BQ), f32)
                dSt = T.sblock_alloc_buffer((BK, BQ), dtype)
                dVp = T.sblock_alloc_buffer((BK, D), f32)
                dKp = T.sblock_alloc_buffer((BK, D), f32)
                dk_acc = T.sblock_alloc_buffer((BK, D), f32)
                dv_acc = T.sblock_alloc_buffer((BK, D), f32)
                # c: batch, kv head, first key, first query tile that sees it
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                m.pin("coords", c, vb, vhk, vt * BK,
                      first_query_tile(causal, vt * BK, Lq, Lk, BQ, rows), T.int64(0), T.int64(0))

                m.load_k("K_load", Ks, K, c[0], c[1], c[2], Lk, BK, D, dtype)
                m.load_v("V_load", Vs, V, c[0], c[1], c[2], Lk, BK, D, dtype)
                for j, d in T.grid(BK, D):
                    with T.sblock("acc_init"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dk_acc[vj, vd] = T.float32(0)
                        dv_acc[vj, vd] = T.float32(0)

                q_tiles = T.meta_var(T.ceildiv(rows.count(Lq), BQ) - c[3])
                for g, qt in T.grid(rows.heads_per_tile_loop(group), q_tiles):
                    with T.sblock("query_step"):
                        # a step carries running sums to the next: an opaque iteration (TVM then keeps the
                        # tiles written here allocated across the loop; see common.STEP_NOTE)
                        vg = T.axis.opaque(rows.heads_per_tile_loop(group), g)
                        vqt = T.axis.opaque(q_tiles, qt)
                        hq = T.meta_var(c[1] * group + vg)
                        q0 = T.meta_var((c[3] + vqt) * BQ)
                        m.load_q("Q_load", Qs, Q, c[0], hq, q0, Lq, BQ, D, dtype, rows)
                        m.load_do("dO_load", dOs, dO, c[0], hq, q0, Lq, BQ, D, dtype, rows)
                        m.load_rows("row_load", lse_s, delta_s, LSE, Delta, c[0], hq, q0, Lq, BQ,
                                    rows)
                        m.gemm_1("St_gemm", St, Ks, Qs, BK, BQ, D, transposed)
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("P"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                Pt[vj, vi] = T.cast(_prob(causal, St[vj, vi], scale, lse_s[vi],
                                                          rows.query(q0 + vi, Lq), c[2] + vj, Lq,
                                                          Lk), dtype)
                        m.gemm_3("dV_gemm", dVp, Pt, dOs, BK, D, BQ, plain)
                        m.add_1("dV_update", dv_acc, dVp, BK, D)
                        m.gemm_2("dPt_gemm", dPt, Vs, dOs, BK, BQ, D, transposed)
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("dS"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                dSt[vj, vi] = T.cast(T.cast(Pt[vj, vi], f32)
                                                     * (dPt[vj, vi] - delta_s[vi]), dtype)
                        m.gemm_4("dK_gemm", dKp, dSt, Qs, BK, D, BQ, plain)
                        m.add_2("dK_update", dk_acc, dKp, BK, D)

                m.store_1("dK_store", dK, dk_acc, c[0], c[1], c[2], Lk, BK, D, scale, dtype)
                m.store_2("dV_store", dV, dv_acc, c[0], c[1], c[2], Lk, BK, D, T.float32(1),
                          dtype)

    return flash_dkv
