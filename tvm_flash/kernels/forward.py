"""Forward kernel: O = softmax(Q K^T * scale) V, plus the row logsumexp LSE.

One tile of ``block_q`` query rows of one (batch, query head) walks the key tiles with an
online softmax (running max ``m`` and sum ``l`` per row, both in base-2 units) and keeps the
output accumulator in float32. Nothing of size Lq x Lk is ever written to global memory.

Named blocks (the schedules find them by these names):
``tile`` (one query tile), ``Q_load``, ``acc_init``, ``stats_init``, ``K_load``, ``V_load``,
``S_gemm`` (S = Q K^T), ``row_max``, ``P`` (exp2), ``rescale`` (alpha = exp2(m - m_new)),
``row_sum``, ``stats_update``, ``O_gemm`` (acc = acc * alpha + P V), ``O_store``, ``lse_store``.
Each is a complete or reduction block (no block reads what it writes, but for the
accumulating GEMMs), so schedules can split, bind and tensorize them freely.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import (
    LN2,
    LOG2E,
    TileConfig,
    exp2_clamped,
    fresh,
    gemm_nt,
    load_tile,
    neg_inf,
    num_key_tiles,
    visible,
)


def flash_forward(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
                  sinks: bool = False):
    """Return the forward PrimFunc ``flash_fwd(q, k, v, sinks, o, lse, scale)``.

    Shapes: q, o ``(B, Hq, Lq, D)``; k, v ``(B, Hkv, Lk, D)``; lse ``(B, Hq, Lq)`` float32,
    with ``Hq = group * Hkv``; B, Hq, Hkv, Lq, Lk symbolic. ``sinks`` ``(Hq,)`` float32 holds
    per-head sink logits (each row's softmax denominator gains ``exp(sink)``, a key with no
    value); without sinks the buffer is still passed and ignored (any float32 tensor of
    shape (Hq,), so one calling convention serves both).

    With sinks the online softmax simply starts from the sink: ``m = sink * log2(e)``,
    ``l = 1``. The LSE then includes the sink, so the backward kernels need no change.
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    load_q, load_k, load_v, s_gemm = (fresh(load_tile), fresh(load_tile), fresh(load_tile),
                                      fresh(gemm_nt))

    @T.prim_func(s_tir=True)
    def flash_fwd(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle, o_h: T.handle,
        lse_h: T.handle, scale: T.float32,
    ):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Sinks = T.match_buffer(sinks_h, (Hq,), f32)

        for b, h, qt in T.grid(B, Hq, T.ceildiv(Lq, BQ)):
            with T.sblock("tile"):
                vb, vh, vt = T.axis.remap("SSS", [b, h, qt])
                T.reads()
                T.writes()
                Qs = T.sblock_alloc_buffer((BQ, D), dtype)
                Ks = T.sblock_alloc_buffer((BK, D), dtype)
                Vs = T.sblock_alloc_buffer((BK, D), dtype)
                S = T.sblock_alloc_buffer((BQ, BK), f32)
                P = T.sblock_alloc_buffer((BQ, BK), f32)
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                m = T.sblock_alloc_buffer((BQ,), f32)
                lsum = T.sblock_alloc_buffer((BQ,), f32)
                m_new = T.sblock_alloc_buffer((BQ,), f32)
                l_new = T.sblock_alloc_buffer((BQ,), f32)
                alpha = T.sblock_alloc_buffer((BQ,), f32)
                hk: T.let[T.int64] = vh // group
                q0: T.let[T.int64] = vt * BQ
                scale2: T.let[T.float32] = scale * T.float32(LOG2E)

                load_q("Q_load", Qs, Q, vb, vh, q0, Lq, BQ, D, dtype)
                for i, d in T.grid(BQ, D):
                    with T.sblock("acc_init"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        acc[vi, vd] = T.float32(0)
                for i in T.serial(BQ):
                    with T.sblock("stats_init"):
                        vi = T.axis.remap("S", [i])
                        if sinks:
                            m[vi] = Sinks[vh] * T.float32(LOG2E)
                            lsum[vi] = T.float32(1)
                        else:
                            m[vi] = neg_inf()
                            lsum[vi] = T.float32(0)

                for kt in T.serial(num_key_tiles(causal, T.min(q0 + BQ, Lq) - 1, Lq, Lk, BK)):
                    k0: T.let[T.int64] = kt * BK
                    load_k("K_load", Ks, K, vb, hk, k0, Lk, BK, D, dtype)
                    load_v("V_load", Vs, V, vb, hk, k0, Lk, BK, D, dtype)
                    s_gemm("S_gemm", S, Qs, Ks, BQ, BK, D)
                    for i, j in T.grid(BQ, BK):
                        with T.sblock("row_max"):
                            vi, vj = T.axis.remap("SR", [i, j])
                            with T.init():
                                m_new[vi] = m[vi]
                            m_new[vi] = T.max(m_new[vi], T.if_then_else(
                                visible(causal, q0 + vi, k0 + vj, Lq, Lk), S[vi, vj] * scale2, neg_inf()
                            ))
                    for i, j in T.grid(BQ, BK):
                        with T.sblock("P"):
                            vi, vj = T.axis.remap("SS", [i, j])
                            P[vi, vj] = T.if_then_else(
                                visible(causal, q0 + vi, k0 + vj, Lq, Lk),
                                exp2_clamped(S[vi, vj] * scale2 - m_new[vi]),
                                T.float32(0),
                            )
                    for i in T.serial(BQ):
                        with T.sblock("rescale"):
                            vi = T.axis.remap("S", [i])
                            # m_new == -inf: no visible key yet, acc and l are still zero.
                            alpha[vi] = T.if_then_else(
                                m_new[vi] == neg_inf(), T.float32(1), exp2_clamped(m[vi] - m_new[vi])
                            )
                    for i, j in T.grid(BQ, BK):
                        with T.sblock("row_sum"):
                            vi, vj = T.axis.remap("SR", [i, j])
                            with T.init():
                                l_new[vi] = lsum[vi] * alpha[vi]
                            l_new[vi] = l_new[vi] + P[vi, vj]
                    for i in T.serial(BQ):
                        with T.sblock("stats_update"):
                            vi = T.axis.remap("S", [i])
                            m[vi] = m_new[vi]
                            lsum[vi] = l_new[vi]
                    for i, d, j in T.grid(BQ, D, BK):
                        with T.sblock("O_gemm"):
                            vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                            with T.init():
                                acc[vi, vd] = acc[vi, vd] * alpha[vi]
                            acc[vi, vd] = acc[vi, vd] + P[vi, vj] * T.cast(Vs[vj, vd], f32)

                for i, d in T.grid(BQ, D):
                    with T.sblock("O_store"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        if q0 + vi < Lq:
                            # l == 0 only for a row that saw no key (nor sink); a NaN l
                            # (non-finite input) must reach the output, so test equality.
                            O[vb, vh, q0 + vi, vd] = T.cast(T.if_then_else(
                                lsum[vi] == T.float32(0), T.float32(0), acc[vi, vd] / lsum[vi]
                            ), dtype)
                for i in T.serial(BQ):
                    with T.sblock("lse_store"):
                        vi = T.axis.remap("S", [i])
                        if q0 + vi < Lq:
                            LSE[vb, vh, q0 + vi] = T.if_then_else(
                                lsum[vi] == T.float32(0),
                                neg_inf(),
                                (m[vi] + T.log2(lsum[vi])) * T.float32(LN2),
                            )

    return flash_fwd
