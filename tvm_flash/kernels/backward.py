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
    MERGE_BATCH,
    NO_MODS,
    TILED,
    ModArgs,
    Mods,
    Rows,
    TileConfig,
    accumulate,
    aligned_rows,
    at,
    exp2_clamped,
    first_key,
    first_query_tile,
    fresh,
    gemm,
    load_row_stats,
    load_tile,
    modified_score,
    neg_inf,
    num_key_tiles,
    pin_element,
    pin_scalars,
    pin_sequence,
    plain,
    query_tiles_end,
    require_aligned_rows,
    softcap_slope,
    split_size,
    store_tile,
    strides,
    transposed,
    trim_params,
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


def _prob(causal, s, scale, lse, row, col, lq, lk, end=None, mods: Mods = NO_MODS, ma=None,
          b=None, h=None):
    """Recomputed probability; 0 where masked or where the row saw no key (LSE = -inf).
    ``mods``: the kernel's score modifiers (``ma`` their arguments, ``b``/``h`` the row's
    batch and query head).

    ``s * scale - lse`` is formed in natural-log units first (one fused multiply-add on GPUs,
    rounded once at the size of the small result) and only then turned into base 2; scaling
    each of ``s`` and ``lse`` to base 2 first would round both at the size of the logits,
    which costs accuracy once logits reach ~1e4.
    """
    # without a soft cap or ALiBi the modified score is ``s * scale`` itself
    score = modified_score(s, scale, mods, ma, causal, b, h, row, col, lq, lk)
    return T.if_then_else(
        tirx.all(visible(causal, row, col, lq, lk, end, mods, ma), lse != neg_inf()),
        exp2_clamped((score - lse) * T.float32(LOG2E)),
        T.float32(0),
    )


def _capped(ds, s, scale, mods: Mods, ma):
    """dS of the scaled score from dS of the modified one: times the soft cap's slope
    ``1 - tanh^2`` (ALiBi's bias and the window do not depend on the score)."""
    slope = softcap_slope(s, scale, mods, ma)
    return ds if slope is None else ds * slope


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


def _dq_tile(head_dim: int, dtype: str, causal: str, tile: TileConfig, rows: Rows,
             mods: Mods = NO_MODS):
    """Macro: the unscaled dQ sum of one query tile over the keys ``[k_begin, k_end)``
    (``k_begin`` from ``common.first_key``), left in ``acc``; ``ma``: the score modifiers'
    arguments (``common.ModArgs``); ``q_off``, ``k_off``, ``sb`` as in the forward's
    ``_attend`` (packed sequences)."""
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    m = _Macros()

    @T.macro
    def dq_tile(Q, K, V, dO, LSE, Delta, acc, vb, h, hk, r0, k_begin, k_end, Lq, Lk, scale, ma,
                q_off, k_off, sb):
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

        m.load_q("Q_load", Qs, Q, vb, h, at(q_off, r0), at(q_off, Lq), BQ, D, dtype, rows)
        m.load_do("dO_load", dOs, dO, vb, h, at(q_off, r0), at(q_off, Lq), BQ, D, dtype, rows)
        m.load_rows("row_load", lse_s, delta_s, LSE, Delta, vb, h, at(q_off, r0), at(q_off, Lq),
                    BQ, rows)
        for i, d in T.grid(BQ, D):
            with T.sblock("acc_init"):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = T.float32(0)

        steps = T.meta_var(num_key_tiles(causal, r0, BQ, Lq, Lk, BK, k_begin, k_end, mods, ma))
        for kt in T.serial(steps):
            with T.sblock("key_step"):
                # a step carries running sums to the next: an opaque iteration (TVM then keeps the
                # tiles written here allocated across the loop; see common.STEP_NOTE)
                vkt = T.axis.opaque(steps, kt)
                k0 = T.meta_var(k_begin + vkt * BK)
                m.load_k("K_load", Ks, K, vb, hk, at(k_off, k0), at(k_off, k_end), BK, D, dtype)
                m.load_v("V_load", Vs, V, vb, hk, at(k_off, k0), at(k_off, k_end), BK, D, dtype)
                m.gemm_1("S_gemm", S, Qs, Ks, BQ, BK, D, transposed)
                m.gemm_2("dP_gemm", dP, dOs, Vs, BQ, BK, D, transposed)
                for i, j in T.grid(BQ, BK):
                    with T.sblock("dS"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        dS[vi, vj] = T.cast(_capped(
                            _prob(causal, S[vi, vj], scale, lse_s[vi], rows.query(r0 + vi, Lq),
                                  k0 + vj, Lq, Lk, k_end, mods, ma, sb,
                                  rows.head(h, r0 + vi, Lq))
                            * (dP[vi, vj] - delta_s[vi]), S[vi, vj], scale, mods, ma), dtype)
                m.gemm_3("dQ_gemm", dQp, dS, Ks, BQ, D, BK, plain)
                m.add_1("dQ_update", acc, dQp, BQ, D)

    return dq_tile


def flash_dq(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
             mods: Mods = NO_MODS, varlen: bool = False):
    """Return ``flash_dq(q, k, v, do, lse, delta, dq, scale)`` (with ``mods`` also
    ``tvm_flash.opspec.MOD_ARGS``, with ``varlen`` then ``VARLEN_ARGS``).

    Shapes: q, do, dq ``(B, Hq, Lq, D)``; k, v ``(B, Hkv, Lk, D)``; lse, delta ``(B, Hq, Lq)``;
    packed sequences (``varlen``) as in ``flash_forward``.

    Named blocks: ``tile``, ``Q_load``, ``dO_load``, ``row_load``, ``acc_init``, ``K_load``,
    ``V_load``, ``S_gemm``, ``dP_gemm``, ``dS`` (P and dS elementwise), ``dQ_gemm`` (dQp = dS K),
    ``dQ_update`` (acc += dQp), ``dQ_store``.
    """
    D, BQ = head_dim, tile.block_q
    f32 = "float32"
    dq_tile = _dq_tile(head_dim, dtype, causal, tile, TILED, mods)
    store, pin, pin_seq = fresh(store_tile), fresh(pin_scalars), fresh(pin_sequence)

    @T.prim_func(s_tir=True)
    def flash_dq(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, dq_h: T.handle, scale: T.float32, slopes_h: T.handle,
        window_left: T.int64, window_right: T.int64, softcap: T.float32, cuq_h: T.handle,
        cuk_h: T.handle, max_seqlen_q: T.int64, max_seqlen_k: T.int64,
    ):
        T.func_attr({"global_symbol": "flash_dq", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        NS1, NSL = T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), f32)
        dQ = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype, strides=strides("dq"))
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), f32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        require_aligned_rows("flash_dq", Q, K, V, dO)
        Qa = aligned_rows(Q)
        Ka = aligned_rows(K)
        Va = aligned_rows(V)
        dOa = aligned_rows(dO)
        ma = T.meta_var(ModArgs(Slopes, window_left, window_right, softcap))

        for b, h, qt in T.grid(NS1 - 1 if varlen else B, Hq,
                               T.ceildiv(max_seqlen_q if varlen else Lq, BQ)):
            with T.sblock("tile"):
                vb, vh, vt = T.axis.remap("SSS", [b, h, qt])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                if varlen:  # the sequence: its first q row, length, first k row, length
                    sq = T.sblock_alloc_buffer((4,), "int64", scope="local")
                    pin_seq("sequence", sq, CuQ, CuK, vb)
                lq = T.meta_var(sq[1] if varlen else Lq)
                lk = T.meta_var(sq[3] if varlen else Lk)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                pin("coords", c, T.int64(0) if varlen else vb, vh, vh // group, vt * BQ,
                    first_key(causal, vt * BQ, lq, lk, tile.block_k, T.int64(0), mods,
                              ma),
                    # a tile past its sequence's end walks no key
                    T.if_then_else(vt * BQ < lq, lk, T.int64(0)) if varlen else Lk)
                dq_tile(Qa, Ka, Va, dOa, LSE, Delta, acc, c[0], c[1], c[2], c[3], c[4], c[5], lq, lk,
                        scale, ma,
                        sq[0] if varlen else None, sq[2] if varlen else None,
                        vb if varlen else c[0])
                store("dQ_store", dQ, acc, c[0], c[1], at(sq[0] if varlen else None, c[3]),
                      at(sq[0] if varlen else None, lq), BQ, D, scale, dtype)

    return trim_params(flash_dq, mods, varlen)


def flash_dq_split(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
                   mods: Mods = NO_MODS):
    """Return ``flash_dq_split(q, k, v, do, lse, delta, dq_part, scale)`` (with ``mods`` also
    ``tvm_flash.opspec.MOD_ARGS``): short-query dQ, one unscaled float32 partial sum per key
    split.

    Shapes as :func:`flash_dq` but ``dq_part`` ``(NS * B, Hq, Lq, D)`` float32 (split ``s``
    of batch ``b`` is row ``s * B + b``; NS read off the buffer). Tiles pack the queries of
    a GQA group. Blocks as :func:`flash_dq`, with ``part_store`` for ``dQ_store``.
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    rows = Rows(packed=True, group=group)
    dq_tile = _dq_tile(head_dim, dtype, causal, tile, rows, mods)
    store, pin = fresh(store_tile), fresh(pin_scalars)

    @T.prim_func(s_tir=True)
    def flash_dq_split(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, part_h: T.handle, scale: T.float32, slopes_h: T.handle,
        window_left: T.int64, window_right: T.int64, softcap: T.float32,
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
        Slopes = T.match_buffer(slopes_h, (B, Hq), f32)
        require_aligned_rows("flash_dq_split", Q, K, V, dO)
        Qa = aligned_rows(Q)
        Ka = aligned_rows(K)
        Va = aligned_rows(V)
        dOa = aligned_rows(dO)
        ma = T.meta_var(ModArgs(Slopes, window_left, window_right, softcap))

        for b, hk, rt, s in T.grid(B, Hkv, T.ceildiv(group * Lq, BQ), BS // B):
            with T.sblock("tile"):
                vb, vhk, vt, vs = T.axis.remap("SSSS", [b, hk, rt, s])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                # packed rows: the tile's first query position is only known to be >= 0
                pin("coords", c, vb, vhk * group, vhk, vt * BQ,
                    first_key(causal, T.int64(0), Lq, Lk, BK, vs * split_size(Lk, BS // B, BK),
                              mods, ma),
                    T.min((vs + 1) * split_size(Lk, BS // B, BK), Lk))
                dq_tile(Qa, Ka, Va, dOa, LSE, Delta, acc, c[0], c[1], c[2], c[3], c[4], c[5], Lq, Lk,
                        scale, ma, None, None,
                        c[0])
                store("part_store", dQpart, acc, vs * B + c[0], c[1], c[3], Lq, BQ, D,
                      T.float32(1), f32, rows)

    return trim_params(flash_dq_split, mods)


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
                c = T.sblock_alloc_buffer((5,), "int64", scope="local")
                pin_element(c, vb, vh, vi, vd, BS // B)
                red[0] = T.float32(0)
                for so in T.serial(T.ceildiv(c[4], MERGE_BATCH)):  # in split order
                    for si in T.serial(MERGE_BATCH):
                        if so * MERGE_BATCH + si < c[4]:
                            red[0] = red[0] + dQpart[(so * MERGE_BATCH + si) * B + c[0], c[1],
                                                     c[2], c[3]]
                dQ[c[0], c[1], c[2], c[3]] = T.cast(red[0] * scale, dtype)

    return flash_dq_merge


def flash_dkv(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
              packed: bool = False, mods: Mods = NO_MODS, varlen: bool = False):
    """Return ``flash_dkv(q, k, v, do, lse, delta, dk, dv, scale)`` (with ``mods`` also
    ``tvm_flash.opspec.MOD_ARGS``, with ``varlen`` then ``VARLEN_ARGS``: packed sequences as
    in ``flash_forward``, the grid walking (sequence, key/value head, key tile up to
    ``max_seqlen_k``)).

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
    pin_seq = fresh(pin_sequence)
    rows = Rows(packed=packed, group=group)

    @T.prim_func(s_tir=True)
    def flash_dkv(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
        delta_h: T.handle, dk_h: T.handle, dv_h: T.handle, scale: T.float32,
        slopes_h: T.handle, window_left: T.int64, window_right: T.int64, softcap: T.float32,
        cuq_h: T.handle, cuk_h: T.handle, max_seqlen_q: T.int64, max_seqlen_k: T.int64,
    ):
        T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        NS1, NSL = T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), f32)
        dK = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype, strides=strides("dk"))
        dV = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype, strides=strides("dv"))
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), f32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        require_aligned_rows("flash_dkv", Q, K, V, dO)
        Qa = aligned_rows(Q)
        Ka = aligned_rows(K)
        Va = aligned_rows(V)
        dOa = aligned_rows(dO)
        ma = T.meta_var(ModArgs(Slopes, window_left, window_right, softcap))

        for b, hk, kt in T.grid(NS1 - 1 if varlen else B, Hkv,
                                T.ceildiv(max_seqlen_k if varlen else Lk, BK)):
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
                if varlen:  # the sequence: its first q row, length, first k row, length
                    sq = T.sblock_alloc_buffer((4,), "int64", scope="local")
                    pin_seq("sequence", sq, CuQ, CuK, vb)
                lq = T.meta_var(sq[1] if varlen else Lq)
                lk = T.meta_var(sq[3] if varlen else Lk)
                q_off = T.meta_var(sq[0] if varlen else None)
                k_off = T.meta_var(sq[2] if varlen else None)
                # c: batch, kv head, first key, first query tile that sees it (and, under a
                # window or for packed sequences, one past the last: none past the sequence)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                m.pin("coords", c, T.int64(0) if varlen else vb, vhk, vt * BK,
                      first_query_tile(causal, vt * BK, lq, lk, BQ, rows, mods,
                                       ma),
                      T.if_then_else(vt * BK < lk, query_tiles_end(
                          lq, lk, BQ, BK, vt * BK, causal, rows, mods,
                          ma), T.int64(0))
                      if varlen else query_tiles_end(
                          Lq, Lk, BQ, BK, vt * BK, causal, rows, mods,
                          ma)
                      if mods.window else T.int64(0), T.int64(0))

                m.load_k("K_load", Ks, Ka, c[0], c[1], at(k_off, c[2]), at(k_off, lk), BK, D,
                         dtype)
                m.load_v("V_load", Vs, Va, c[0], c[1], at(k_off, c[2]), at(k_off, lk), BK, D,
                         dtype)
                for j, d in T.grid(BK, D):
                    with T.sblock("acc_init"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dk_acc[vj, vd] = T.float32(0)
                        dv_acc[vj, vd] = T.float32(0)

                q_tiles = T.meta_var(T.max(c[4] - c[3], T.int64(0)) if varlen else (
                    c[4] if mods.window else T.ceildiv(rows.count(Lq), BQ)) - c[3])
                for g, qt in T.grid(rows.heads_per_tile_loop(group), q_tiles):
                    with T.sblock("query_step"):
                        # a step carries running sums to the next: an opaque iteration (TVM then keeps the
                        # tiles written here allocated across the loop; see common.STEP_NOTE)
                        vg = T.axis.opaque(rows.heads_per_tile_loop(group), g)
                        vqt = T.axis.opaque(q_tiles, qt)
                        hq = T.meta_var(c[1] * group + vg)
                        q0 = T.meta_var((c[3] + vqt) * BQ)
                        m.load_q("Q_load", Qs, Qa, c[0], hq, at(q_off, q0), at(q_off, lq), BQ, D,
                                 dtype, rows)
                        m.load_do("dO_load", dOs, dOa, c[0], hq, at(q_off, q0), at(q_off, lq), BQ,
                                  D, dtype, rows)
                        m.load_rows("row_load", lse_s, delta_s, LSE, Delta, c[0], hq,
                                    at(q_off, q0), at(q_off, lq), BQ, rows)
                        m.gemm_1("St_gemm", St, Ks, Qs, BK, BQ, D, transposed)
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("P"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                Pt[vj, vi] = T.cast(_prob(causal, St[vj, vi], scale, lse_s[vi],
                                                          rows.query(q0 + vi, lq), c[2] + vj, lq,
                                                          lk, None, mods, ma,
                                                          vb if varlen else c[0],
                                                          rows.head(hq, q0 + vi, lq)),
                                                    dtype)
                        m.gemm_3("dV_gemm", dVp, Pt, dOs, BK, D, BQ, plain)
                        m.add_1("dV_update", dv_acc, dVp, BK, D)
                        m.gemm_2("dPt_gemm", dPt, Vs, dOs, BK, BQ, D, transposed)
                        for j, i in T.grid(BK, BQ):
                            with T.sblock("dS"):
                                vj, vi = T.axis.remap("SS", [j, i])
                                dSt[vj, vi] = T.cast(_capped(
                                    T.cast(Pt[vj, vi], f32) * (dPt[vj, vi] - delta_s[vi]),
                                    St[vj, vi], scale, mods,
                                    ma), dtype)
                        m.gemm_4("dK_gemm", dKp, dSt, Qs, BK, D, BQ, plain)
                        m.add_2("dK_update", dk_acc, dKp, BK, D)

                m.store_1("dK_store", dK, dk_acc, c[0], c[1], at(k_off, c[2]), at(k_off, lk), BK,
                          D, scale, dtype)
                m.store_2("dV_store", dV, dv_acc, c[0], c[1], at(k_off, c[2]), at(k_off, lk), BK,
                          D, T.float32(1), dtype)

    return trim_params(flash_dkv, mods, varlen)
