"""Forward kernel: O = softmax(Q K^T * scale) V, plus the row logsumexp LSE.

One tile of ``block_q`` query rows of one (batch, query head) walks the key tiles with an
online softmax (running max ``m`` and sum ``l`` per row, both in base-2 units) and keeps the
output accumulator in float32. Nothing of size Lq x Lk is ever written to global memory.

Named blocks (the schedules find them by these names):
``tile`` (one query tile), ``Q_load``, ``acc_init``, ``stats_init``, ``K_load``, ``V_load``,
``S_gemm`` (S = Q K^T), ``row_max``, ``P`` (exp2), ``rescale`` (alpha = exp2(m - m_new)),
``row_sum``, ``stats_update`` (m), ``lsum_update``, ``O_gemm`` (PV = P V), ``O_update``
(acc = acc * alpha + PV), ``O_store``, ``lse_store``, inside ``key_step`` (one key tile; see
``common.STEP_NOTE``). P is rounded to the input dtype (as FlashAttention does), so both
GEMMs take 16-bit operands and produce a fresh float32 tile: plain reduction blocks that
schedules can split, bind and tensorize (tensor cores) freely.

The short-query ("vector") forward for a few queries against many keys runs the same tile
loop with two changes (:func:`flash_forward_split`): a tile packs the queries of every head
of a GQA group (so Lq = 1 still fills it and the heads share their K/V reads), and the keys
are cut into splits, each block writing a partial result; :func:`flash_forward_merge`
combines the splits in a fixed order (deterministic, no atomics). Extra blocks:
``part_store``, ``stats_store`` (split) and ``merge`` (merge).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..opspec import PART_STATS
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
    fresh,
    gemm,
    load_tile,
    modified_score,
    neg_inf,
    num_key_tiles,
    pin_element,
    pin_scalars,
    pin_sequence,
    plain,
    require_aligned_rows,
    row_lse,
    split_size,
    store_tile,
    strides,
    transposed,
    trim_params,
    visible,
)


def _attend(head_dim: int, dtype: str, causal: str, tile: TileConfig, sinks: bool,
            rows: Rows, mods: Mods = NO_MODS):
    """Macro: one query tile's online softmax over the keys ``[k_begin, k_end)``
    (``k_begin`` from ``common.first_key``).

    Leaves the unnormalised output in ``acc`` and the running max ``m`` (base 2) and sum
    ``lsum`` per row; ``h``/``r0`` locate the tile's rows (see :class:`Rows`); ``ma``: the
    score modifiers' arguments (``common.ModArgs``; unused without ``mods``). Positions (rows,
    keys, ``Lq``, ``Lk``) count within one sequence; ``q_off``/``k_off``: where its rows start
    in the buffers (None: dense, batch ``vb``); ``sb``: its index among the sequences (ALiBi's
    slope row).
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    load_q, load_k, load_v = fresh(load_tile), fresh(load_tile), fresh(load_tile)
    s_gemm, o_gemm, o_update = fresh(gemm), fresh(gemm), fresh(accumulate)

    def score2(S, scale, scale2, vb, h, row, col, Lq, Lk, ma):
        """A score in base-2 units, modified where the kernel has soft cap or ALiBi."""
        if mods.softcap or mods.alibi:
            return modified_score(S, scale, mods, ma, causal, vb, h, row, col, Lq,
                                  Lk) * T.float32(LOG2E)
        return S * scale2

    @T.macro
    def attend(Q, K, V, Sinks, acc, m, lsum, vb, h, hk, r0, k_begin, k_end, Lq, Lk, scale, ma,
               q_off, k_off, sb):
        Qs = T.sblock_alloc_buffer((BQ, D), dtype)
        Ks = T.sblock_alloc_buffer((BK, D), dtype)
        Vs = T.sblock_alloc_buffer((BK, D), dtype)
        S = T.sblock_alloc_buffer((BQ, BK), f32)
        P = T.sblock_alloc_buffer((BQ, BK), dtype)
        PV = T.sblock_alloc_buffer((BQ, D), f32)
        m_new = T.sblock_alloc_buffer((BQ,), f32)
        l_new = T.sblock_alloc_buffer((BQ,), f32)
        alpha = T.sblock_alloc_buffer((BQ,), f32)
        scale2: T.let[T.float32] = scale * T.float32(LOG2E)

        load_q("Q_load", Qs, Q, vb, h, at(q_off, r0), at(q_off, Lq), BQ, D, dtype, rows)
        for i, d in T.grid(BQ, D):
            with T.sblock("acc_init"):
                vi, vd = T.axis.remap("SS", [i, d])
                acc[vi, vd] = T.float32(0)
        for i in T.serial(BQ):
            with T.sblock("stats_init"):
                vi = T.axis.remap("S", [i])
                if sinks:
                    m[vi] = Sinks[h] * T.float32(LOG2E)
                    lsum[vi] = T.float32(1)
                else:
                    m[vi] = neg_inf()
                    lsum[vi] = T.float32(0)

        steps = T.meta_var(num_key_tiles(causal, r0, BQ, Lq, Lk, BK, k_begin, k_end, mods, ma))
        for kt in T.serial(steps):
            with T.sblock("key_step"):
                # a step carries running sums to the next: an opaque iteration (TVM then keeps the
                # tiles written here allocated across the loop; see common.STEP_NOTE)
                vkt = T.axis.opaque(steps, kt)
                k0 = T.meta_var(k_begin + vkt * BK)
                load_k("K_load", Ks, K, vb, hk, at(k_off, k0), at(k_off, k_end), BK, D, dtype)
                load_v("V_load", Vs, V, vb, hk, at(k_off, k0), at(k_off, k_end), BK, D, dtype)
                s_gemm("S_gemm", S, Qs, Ks, BQ, BK, D, transposed)
                for i, j in T.grid(BQ, BK):
                    with T.sblock("row_max"):
                        vi, vj = T.axis.remap("SR", [i, j])
                        with T.init():
                            m_new[vi] = m[vi]
                        m_new[vi] = T.max(m_new[vi], T.if_then_else(
                            visible(causal, rows.query(r0 + vi, Lq), k0 + vj, Lq, Lk, k_end,
                                    mods, ma),
                            score2(S[vi, vj], scale, scale2, sb, rows.head(h, r0 + vi, Lq),
                                   rows.query(r0 + vi, Lq), k0 + vj, Lq, Lk, ma),
                            neg_inf()))
                for i, j in T.grid(BQ, BK):
                    with T.sblock("P"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        P[vi, vj] = T.cast(T.if_then_else(
                            visible(causal, rows.query(r0 + vi, Lq), k0 + vj, Lq, Lk, k_end,
                                    mods, ma),
                            exp2_clamped(score2(S[vi, vj], scale, scale2, sb,
                                                rows.head(h, r0 + vi, Lq),
                                                rows.query(r0 + vi, Lq), k0 + vj, Lq, Lk, ma)
                                         - m_new[vi]),
                            T.float32(0),
                        ), dtype)
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
                        # the rounded P, so that numerator and denominator agree
                        l_new[vi] = l_new[vi] + T.cast(P[vi, vj], f32)
                # one statistic per block: a GPU schedule guards blocks of fewer rows than threads,
                # and TVM cannot place the barrier a second shared access needs inside the guard
                for i in T.serial(BQ):
                    with T.sblock("stats_update"):
                        vi = T.axis.remap("S", [i])
                        m[vi] = m_new[vi]
                for i in T.serial(BQ):
                    with T.sblock("lsum_update"):
                        vi = T.axis.remap("S", [i])
                        lsum[vi] = l_new[vi]
                o_gemm("O_gemm", PV, P, Vs, BQ, D, BK, plain)
                o_update("O_update", acc, PV, BQ, D, alpha)

    return attend


def _normalised(acc, lsum):
    """A row's output from its unnormalised sum; ``l == 0`` only for a row that saw no key
    (nor sink). A NaN ``l`` (non-finite input) must reach the output: the test is an
    equality."""
    return T.if_then_else(lsum == T.float32(0), T.float32(0), acc / lsum)


def flash_forward(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
                  sinks: bool = False, mods: Mods = NO_MODS, varlen: bool = False):
    """Return the forward PrimFunc ``flash_fwd(q, k, v, sinks, o, lse, scale)`` (with
    ``mods``: ``flash_fwd(q, k, v, sinks, o, lse, scale, slopes, window_left, window_right,
    softcap)``, ``tvm_flash.opspec.MOD_ARGS``; with ``varlen`` then ``VARLEN_ARGS``).

    Shapes: q, o ``(B, Hq, Lq, D)``; k, v ``(B, Hkv, Lk, D)``; lse ``(B, Hq, Lq)`` float32,
    with ``Hq = group * Hkv``; B, Hq, Hkv, Lq, Lk symbolic. ``sinks`` ``(Hq,)`` float32 holds
    per-head sink logits (each row's softmax denominator gains ``exp(sink)``, a key with no
    value); without sinks the buffer is still passed and ignored (any float32 tensor of
    shape (Hq,), so one calling convention serves both).

    With sinks the online softmax simply starts from the sink: ``m = sink * log2(e)``,
    ``l = 1``. The LSE then includes the sink, so the backward kernels need no change.

    ``varlen``: packed sequences. B is 1, Lq and Lk count every sequence's rows, and sequence
    ``s`` owns rows ``[cu_q[s], cu_q[s + 1])`` of q, o, lse and ``[cu_k[s], cu_k[s + 1])`` of
    k, v; the grid walks (sequence, head, query tile up to ``max_seqlen_q``), a tile past its
    sequence's end walks no key, and every mask counts positions within the sequence. Slopes
    are then ``(NS, Hq)``.
    """
    D, BQ = head_dim, tile.block_q
    f32 = "float32"
    attend = _attend(head_dim, dtype, causal, tile, sinks, TILED, mods)
    pin, pin_seq = fresh(pin_scalars), fresh(pin_sequence)

    @T.prim_func(s_tir=True)
    def flash_fwd(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle, o_h: T.handle,
        lse_h: T.handle, scale: T.float32, slopes_h: T.handle, window_left: T.int64,
        window_right: T.int64, softcap: T.float32, cuq_h: T.handle, cuk_h: T.handle,
        max_seqlen_q: T.int64, max_seqlen_k: T.int64,
    ):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        NS1, NSL = T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=strides("o"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)
        Sinks = T.match_buffer(sinks_h, (Hq,), f32)
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), f32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        require_aligned_rows("flash_fwd", Q, K, V)
        Qa = aligned_rows(Q)
        Ka = aligned_rows(K)
        Va = aligned_rows(V)
        ma = T.meta_var(ModArgs(Slopes, window_left, window_right, softcap))

        for b, h, qt in T.grid(NS1 - 1 if varlen else B, Hq,
                               T.ceildiv(max_seqlen_q if varlen else Lq, BQ)):
            with T.sblock("tile"):
                vb, vh, vt = T.axis.remap("SSS", [b, h, qt])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                m = T.sblock_alloc_buffer((BQ,), f32)
                lsum = T.sblock_alloc_buffer((BQ,), f32)
                lnorm = T.sblock_alloc_buffer((BQ,), f32)
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
                attend(Qa, Ka, Va, Sinks, acc, m, lsum, c[0], c[1], c[2], c[3], c[4], c[5], lq, lk,
                       scale, ma,
                       sq[0] if varlen else None, sq[2] if varlen else None,
                       vb if varlen else c[0])

                # O_store's threads read the row sums of other threads (the SIMT schedule
                # keeps them in shared memory, a thread per row). When the key loop runs no
                # step (no key visible to the tile: bottom-right causal with Lq > Lk, a
                # window, a tile past its sequence's end) nothing separates those reads from
                # stats_init's writes: TVM's barrier planner assumes a loop with a barrier
                # runs, and compute-sanitizer's racecheck found the race. Each row's own
                # thread copying its sum gives the planner a write it must order first.
                for i in T.serial(BQ):
                    with T.sblock("row_norm"):
                        vi = T.axis.remap("S", [i])
                        lnorm[vi] = lsum[vi]
                for i, d in T.grid(BQ, D):
                    with T.sblock("O_store"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        if c[3] + vi < lq:
                            O[c[0], c[1], at(sq[0] if varlen else None, c[3] + vi), vd] = T.cast(
                                _normalised(acc[vi, vd], lnorm[vi]), dtype)
                for i in T.serial(BQ):
                    with T.sblock("lse_store"):
                        vi = T.axis.remap("S", [i])
                        if c[3] + vi < lq:
                            LSE[c[0], c[1], at(sq[0] if varlen else None, c[3] + vi)] = row_lse(
                                m[vi], lsum[vi])

    return trim_params(flash_fwd, mods, varlen)


def flash_forward_split(head_dim: int, dtype: str, causal: str, group: int, tile: TileConfig,
                        mods: Mods = NO_MODS):
    """Return ``flash_fwd_split(q, k, v, part, scale)`` (with ``mods`` also
    ``tvm_flash.opspec.MOD_ARGS``): the short-query forward's partial results, one per key
    split.

    Shapes: q ``(B, Hq, Lq, D)``; k, v ``(B, Hkv, Lk, D)``; part ``(NS * B, Hq, Lq, D +
    PART_STATS)`` float32, where NS (the number of key splits) is read off its first
    dimension; split ``s`` of batch ``b`` is row ``s * B + b``. A row of ``part`` holds the
    split's unnormalised output, then its running max (base 2) and sum
    (``tvm_flash.opspec.PART_STATS``); :func:`flash_forward_merge` combines them. Sinks enter
    only at the merge.
    """
    D, BQ, BK = head_dim, tile.block_q, tile.block_k
    f32 = "float32"
    rows = Rows(packed=True, group=group)
    attend = _attend(head_dim, dtype, causal, tile, False, rows, mods)
    store_o = fresh(store_tile)
    pin = fresh(pin_scalars)

    @T.prim_func(s_tir=True)
    def flash_fwd_split(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, part_h: T.handle,
        scale: T.float32, slopes_h: T.handle, window_left: T.int64,
        window_right: T.int64, softcap: T.float32,
    ):
        T.func_attr({"global_symbol": "flash_fwd_split", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk, BS = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        Part = T.match_buffer(part_h, (BS, Hq, Lq, D + PART_STATS), f32)
        Slopes = T.match_buffer(slopes_h, (B, Hq), f32)
        require_aligned_rows("flash_fwd_split", Q, K, V)
        Qa = aligned_rows(Q)
        Ka = aligned_rows(K)
        Va = aligned_rows(V)
        ma = T.meta_var(ModArgs(Slopes, window_left, window_right, softcap))

        for b, hk, rt, s in T.grid(B, Hkv, T.ceildiv(group * Lq, BQ), BS // B):
            with T.sblock("tile"):
                vb, vhk, vt, vs = T.axis.remap("SSSS", [b, hk, rt, s])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((BQ, D), f32)
                m = T.sblock_alloc_buffer((BQ,), f32)
                lsum = T.sblock_alloc_buffer((BQ,), f32)
                # c: batch, first head, kv head, first row, keys [begin, end)
                c = T.sblock_alloc_buffer((6,), "int64", scope="local")
                # packed rows: the tile's first query position is only known to be >= 0
                pin("coords", c, vb, vhk * group, vhk, vt * BQ,
                    first_key(causal, T.int64(0), Lq, Lk, BK, vs * split_size(Lk, BS // B, BK),
                              mods, ma),
                    T.min((vs + 1) * split_size(Lk, BS // B, BK), Lk))
                attend(Qa, Ka, Va, Q, acc, m, lsum, c[0], c[1], c[2], c[3], c[4], c[5], Lq, Lk,
                       scale, ma, None, None,
                       c[0])
                store_o("part_store", Part, acc, vs * B + c[0], c[1], c[3], Lq, BQ, D,
                        T.float32(1), f32, rows)
                for i in T.serial(BQ):
                    with T.sblock("stats_store"):
                        vi = T.axis.remap("S", [i])
                        if c[3] + vi < rows.count(Lq):
                            Part[vs * B + c[0], rows.head(c[1], c[3] + vi, Lq),
                                 rows.query(c[3] + vi, Lq), D] = m[vi]
                            Part[vs * B + c[0], rows.head(c[1], c[3] + vi, Lq),
                                 rows.query(c[3] + vi, Lq), D + 1] = lsum[vi]

    return trim_params(flash_fwd_split, mods)


def flash_forward_merge(head_dim: int, dtype: str, sinks: bool):
    """Return ``flash_fwd_merge(part, sinks, o, lse)``: combine the key
    splits of :func:`flash_forward_split` in split order (and the sink, if any).

    ``M = max(m_s, sink)``, ``w_s = exp2(m_s - M)``, ``L = sum l_s w_s (+ exp2(sink - M))``,
    ``O = sum o_s w_s / L``, ``LSE = (M + log2 L) ln 2``. Named block: ``merge`` (one output
    element; it reads the NS splits in a serial loop).
    """
    D = head_dim
    f32 = "float32"

    @T.prim_func(s_tir=True)
    def flash_fwd_merge(part_h: T.handle, sinks_h: T.handle, o_h: T.handle, lse_h: T.handle):
        T.func_attr({"global_symbol": "flash_fwd_merge", "tirx.noalias": True})
        B, Hq, Lq, BS = T.int64(), T.int64(), T.int64(), T.int64()
        Part = T.match_buffer(part_h, (BS, Hq, Lq, D + PART_STATS), f32)
        Sinks = T.match_buffer(sinks_h, (Hq,), f32)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=strides("o"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), f32)

        for b, h, i, d in T.grid(B, Hq, Lq, D):
            with T.sblock("merge"):
                vb, vh, vi, vd = T.axis.remap("SSSS", [b, h, i, d])
                T.reads(Part[:, vh, vi, vd], Part[:, vh, vi, D:D + 2], Sinks[vh])
                T.writes(O[vb, vh, vi, vd], LSE[vb, vh, vi])
                red = T.sblock_alloc_buffer((3,), f32, scope="local")
                c = T.sblock_alloc_buffer((5,), "int64", scope="local")
                pin_element(c, vb, vh, vi, vd, BS // B)
                red[0] = Sinks[c[1]] * T.float32(LOG2E) if sinks else neg_inf()
                # the splits in batches of MERGE_BATCH (a constant loop the CUDA compiler
                # unrolls): a batch's loads are independent and overlap, where a plain loop
                # waits for each in turn; the additions keep the split order. (T.unroll here
                # makes TVM 0.27 drop the loop's body.)
                for so in T.serial(T.ceildiv(c[4], MERGE_BATCH)):
                    for si in T.serial(MERGE_BATCH):
                        if so * MERGE_BATCH + si < c[4]:
                            red[0] = T.max(red[0], Part[(so * MERGE_BATCH + si) * B + c[0],
                                                        c[1], c[2], D])
                red[1] = T.float32(0)
                if sinks:
                    if Sinks[c[1]] != neg_inf():
                        red[1] = exp2_clamped(Sinks[c[1]] * T.float32(LOG2E) - red[0])
                red[2] = T.float32(0)
                for so in T.serial(T.ceildiv(c[4], MERGE_BATCH)):
                    for si in T.serial(MERGE_BATCH):
                        s = T.meta_var((so * MERGE_BATCH + si) * B + c[0])
                        # a split that saw no key has m = -inf and contributes nothing
                        if so * MERGE_BATCH + si < c[4]:
                            if Part[s, c[1], c[2], D] != neg_inf():
                                red[1] = red[1] + Part[s, c[1], c[2], D + 1] * exp2_clamped(
                                    Part[s, c[1], c[2], D] - red[0])
                                red[2] = red[2] + Part[s, c[1], c[2], c[3]] * exp2_clamped(
                                    Part[s, c[1], c[2], D] - red[0])
                O[c[0], c[1], c[2], c[3]] = T.cast(_normalised(red[2], red[1]), dtype)
                if c[3] == 0:
                    LSE[c[0], c[1], c[2]] = row_lse(red[0], red[1])

    return flash_fwd_merge
