"""CUDA sm_90a (Hopper, fp16/bf16): the forward on ``wgmma`` with TMA loads on mbarriers.

Why a second CUDA family: ``mma.sync`` (:mod:`.cuda_mma`) issues one 16x8x16 product per warp
and instruction and feeds it from registers that ``ldmatrix`` fills; on Hopper that path tops
out near FlashAttention-2 (docs/perf.md). ``wgmma`` lets a warpgroup (4 warps, 128 threads)
multiply a 64 x N tile with both operands read by the tensor cores straight from shared memory
(or A from registers), asynchronously, and the bulk tensor copy engine (TMA) fills shared memory
without occupying threads. The algorithm is the one of ``tvm_flash.kernels.forward`` and of the
``mma.sync`` forward (same masking, clamped exp2 in base 2, rounded P, LSE convention, sinks,
``common`` helpers); what is written here is the thread mapping and the data movement.

Per block: a producer warpgroup and ``consumers`` warpgroups of 64 query rows each
(``BM = 64 consumers``), FlashAttention-3's warp specialisation:

* the producer gives most of its registers to the consumers (``setmaxnreg``) and one of its
  threads issues TMA copies of the Q tile (once) and of K/V tiles into a ring of ``stages``
  shared-memory stages; each copy completes on a "full" mbarrier that counts its bytes, which
  the consumers wait on (parity = how many times the stage was filled before, mod 2); the
  consumers release a stage's K and its V on separate "empty" mbarriers, so the next K can
  arrive while this V is still being read;
* tiles are stored as 64-column "atoms" of 128-byte rows in the 128-byte swizzle that both
  TMA and ``wgmma`` descriptors understand (an atom's 8-row groups are 1024 bytes apart; head
  dims that are not a multiple of 64 take 32-column atoms in the 64-byte swizzle), so no thread
  ever computes a shared-memory address for the operands;
* S = Q K^T: ``wgmma`` m64 n``BK`` k16 with both operands from shared memory (K-major);
  P = exp2(S scale log2 e - m) rounded to the input dtype stays in registers, where the
  accumulator layout of S is the A-operand layout of the next product; O += P V: ``wgmma``
  with A from registers and V read MN-major (its rows are keys, its columns the head dim);
* a consumer issues S_j = Q K_j and O += P_{j-1} V_{j-1} together and does the softmax of S_j
  while P V runs (intra-warpgroup overlap); the first and last steps are peeled so that no
  branch stands around a wgmma in the loop (ptxas serialises wgmma it cannot follow);
* the tensor map of each tensor is built on the host per call (4-D: head dim, length, heads,
  batch, with the tensor's own strides), so strided inputs such as (B, L, H, D) storage viewed
  as (B, H, L, D) are read in place, and rows past the sequence end are filled with zeros by
  the copy engine (masked like any key past ``Lk``).

A lane ``4 g + t`` of warp ``w`` of a warpgroup holds rows ``16 w + g`` and ``16 w + g + 8`` of
the warpgroup's 64, columns ``8 j + 2 t + {0, 1}`` for every n8 chunk ``j``: the ``mma.sync``
accumulator layout per warp, so the row statistics take two shuffles, as in :mod:`.cuda_mma`.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from tvm_flash.kernels.common import (
    LOG2E,
    TileConfig,
    exp2_clamped,
    neg_inf,
    num_key_tiles,
    row_lse,
    visible,
)
from tvm_flash.key import KernelKey

from .cuda_mma import _block_order, _lane_row, _mask_needed, _require_vector_rows, _row_tree

F32 = "float32"
WG = 128  # threads of a warpgroup
OPS = ("fwd",)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
_PTX = {"float16": "f16", "bfloat16": "bf16"}
_TMA = "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
# ``asm volatile("" : "+f"(r))``: pins an accumulator register in place around wgmma's
# asynchronous writes, so the compiler neither reads it before ``wait_group`` nor moves a write
# of it past ``fence`` (TVM 0.27's ``T.cuda.wgmma.noop_barrier`` is broken: shared/hopper/NOTES).
_PIN = '#define TVMF_PIN(r) asm volatile("" : "+f"(r) :: "memory")\n'
_PIN_U32 = '#define TVMF_PIN_U32(r) asm volatile("" : "+r"(r) :: "memory")\n'
SWIZZLE = {128: 3, 64: 2}  # descriptor and tensor-map codes of the 128/64-byte swizzles


def atom(d: int) -> int:
    """Columns of a tile's swizzle atom: 64 (128-byte rows, the widest swizzle) where the head
    dim is a multiple of 64, else 32 (64-byte rows; every supported head dim is a multiple of
    32)."""
    return 64 if d % 64 == 0 else 32


@dataclasses.dataclass(frozen=True)
class HopperTile:
    """``consumers`` warpgroups of 64 query rows (plus the producer warpgroup); ``step`` keys
    per loop step; ``stages`` K/V buffers in the TMA ring."""

    consumers: int = 2
    step: int = 128
    stages: int = 2

    @property
    def rows(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return WG * (self.consumers + 1)

    def smem_bytes(self, d: int) -> int:
        """Q tile + the K/V ring + 8 bytes per mbarrier (rounded to 1 KiB)."""
        tiles = 2 * d * (self.rows + 2 * self.stages * self.step)
        return tiles + 1024

    def tile_config(self, op: str) -> TileConfig:
        return TileConfig(self.rows, self.step)


SMEM_LIMIT = 227 * 1024  # an sm_90 block's dynamic shared memory with the opt-in


def supports(key: KernelKey) -> bool:
    """Whether ``key`` runs on these kernels: the forward, fp16/bf16, D in HEAD_DIMS, sm_90a."""
    return (key.op in OPS and key.dtype in _PTX and key.head_dim in HEAD_DIMS
            and key.target == "cuda-sm_90a")


def tile(key: KernelKey) -> HopperTile:
    """Two consumer warpgroups (128 query rows) and two stages; 128-key steps up to D 160, fewer
    above, where O's D / 2 registers a thread crowd out S and P (D 256: 128 + 32 + 16) and the
    K/V ring outgrows shared memory. D 64 and 128 from an H200 sweep (docs/perf.md, "Hopper
    forward"): at D 128 bf16 N 4096 532 TFLOP/s against 523 with three stages, 532 with
    176-key steps (which spill) and 432 for the best tile without the producer warpgroup."""
    d = key.head_dim
    return HopperTile(step=128 if d <= 160 else 96 if d == 192 else 64)


@T.macro
def pin(x, n):
    for i in T.unroll(n):
        T.cuda.func_call("TVMF_PIN", x[i], source_code=_PIN)


@T.macro
def pin_u32(x, n):
    for i in T.unroll(n):
        T.cuda.func_call("TVMF_PIN_U32", x[i], source_code=_PIN_U32)


@T.macro
def quad_reduce(x, i, op):
    """Combine ``x[i]`` over the 4 lanes of a row."""
    x[i] = op(x[i], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[i], 1, 32, 32))
    x[i] = op(x[i], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[i], 2, 32, 32))


def _tma_strides(buf):
    """Byte strides of a (B, H, L, D) tensor's rows, heads and batches for its tensor map. The
    copy engine wants every stride a multiple of 16 bytes, also that of a dimension of size 1,
    whose stride torch leaves arbitrary (nothing reads by it): such a one is replaced by the
    compact stride, a multiple of 16 bytes like the others (``_require_vector_rows``)."""
    b, h, length, d = buf.shape
    sb, sh, sl = buf.strides[:3]
    rows = T.if_then_else(length == 1, T.int64(d), sl)
    heads = T.if_then_else(h == 1, rows * length, sh)
    batches = T.if_then_else(b == 1, heads * h, sb)
    return rows * 2, heads * 2, batches * 2


def _desc(d, ptr, ldo: int, sdo: int, swizzle: int):
    """Fill the 64-bit ``wgmma`` matrix descriptor ``d`` for a swizzled tile at ``ptr``
    (offsets in 16-byte units)."""
    return T.cuda.wgmma.encode_matrix_descriptor(T.address_of(d), ptr, ldo, sdo, swizzle)


def flash_forward(key: KernelKey, tile: HopperTile):
    """The forward with a producer warpgroup and the next step's S = Q K^T in flight during
    this step's softmax and P V (FlashAttention-3's structure, without its ping-pong).

    Warpgroup 0 gives its registers away (``setmaxnreg``) and one of its threads issues every
    TMA copy: K tile ``j`` once the consumers have released the stage's previous K (its
    S = Q K^T completed), V tile ``j`` once they have released the previous V (its P V
    completed); separate "empty" mbarriers for K and V let the next K arrive while this V is
    still read. Consumer warpgroup step ``j``: issue S_j = Q K_j and O += P_{j-1} V_{j-1}, wait
    for S_j only, release K_j, softmax S_j in float32 in place (the running sum adds the
    unrounded probabilities, as FlashAttention-3 does), wait for P V, release V_{j-1}, rescale O,
    round P_j into the registers the next P V reads."""
    D, dtype, causal, sinks, group = key.head_dim, key.dtype, key.causal, key.sinks, key.group
    BM, BK, ST, NC = tile.rows, tile.step, tile.stages, tile.consumers
    NT = tile.threads
    ATOM = atom(D)
    NA, KA = D // ATOM, ATOM // 16  # atoms of a tile row; k16 steps of an atom
    ROW = ATOM * 2 // 16  # an atom row, in 16-byte units
    SW = SWIZZLE[ATOM * 2]
    NS, NO = BK // 8, D // 8
    ab = _PTX[dtype]
    mma_s = f"wgmma.mma_async.sync.aligned.m64n{BK}k16.f32.{ab}.{ab}"
    mma_o = f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"
    q_bytes, kv_bytes = BM * D * 2, BK * D * 2
    k_off = q_bytes
    v_off = k_off + ST * kv_bytes
    bar_off = v_off + ST * kv_bytes
    NB = 1 + 4 * ST  # Q; K full, V full, K empty, V empty per stage
    pool_bytes = bar_off + 8 * NB
    # descriptor strides (16-byte units): K-major Q and K, 8-row groups 8 ROW apart (SBO);
    # V read MN-major: its atoms (head-dim columns) a stage's rows apart (LBO), 8-row groups
    # 8 ROW apart (SBO)
    v_ldo, v_sdo = BK * ROW, 8 * ROW
    FK, FV, EK, EV = 1, 1 + ST, 1 + 2 * ST, 1 + 3 * ST  # first barrier of each kind
    # registers: the producer keeps 24, the consumers share the rest of the 64 Ki
    regs_consumer = min(240, (65536 // WG - 24) // NC // 8 * 8)

    @T.macro
    def load(buf, bars, tmap, j, full, hk, b):
        st = T.meta_var(j % ST)
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[full + st]),
                                                   T.uint32(kv_bytes))
        for a in T.unroll(NA):
            T.ptx[_TMA](T.address_of(buf[st, a, 0, 0]), T.address_of(tmap), a * ATOM,
                        T.cast(j * BK, "int32"), T.cast(hk, "int32"), T.cast(b, "int32"),
                        T.address_of(bars[full + st]))

    @T.macro
    def issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, js, jv, do_s: bool, do_pv: bool):
        """Issue S = Q K_js and/or O += P V_jv, each one commit group, once their tiles have
        arrived. Descriptors and operands are final before the one fence: a register a wgmma
        reads that changes after the fence makes ptxas inject another (C7519)."""
        if do_s:
            _desc(dk[0], T.address_of(Ks[js % ST, 0, 0, 0]), 1, 8 * ROW, SW)
            T.cuda.mbarrier_wait(T.address_of(bars[FK + js % ST]), js // ST % 2)
        if do_pv:
            _desc(dv[0], T.address_of(Vs[jv % ST, 0, 0, 0]), v_ldo, v_sdo, SW)
            T.cuda.mbarrier_wait(T.address_of(bars[FV + jv % ST]), jv // ST % 2)
        pin(s, NS * 4)
        pin_u32(pw, NS * 2)
        pin(acc, NO * 4)
        T.ptx.wgmma.fence.sync.aligned()
        if do_s:
            for kk in T.unroll(D // 16):
                T.ptx[mma_s](*[s[i] for i in range(NS * 4)],
                             dq[0] + T.uint64(kk // KA * BM * ROW + kk % KA * 2),
                             dk[0] + T.uint64(kk // KA * BK * ROW + kk % KA * 2),
                             T.bool(kk > 0), 1, 1, 0, 0)
            T.ptx.wgmma.commit_group.sync.aligned()
        if do_pv:
            for kk in T.unroll(BK // 16):
                T.ptx[mma_o](*[acc[i] for i in range(NO * 4)],
                             pw[4 * kk], pw[4 * kk + 1], pw[4 * kk + 2], pw[4 * kk + 3],
                             dv[0] + T.uint64(kk * 16 * ROW), T.bool(True), 1, 1, 1)
            T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def softmax(s, p, acc, m, mn, msub, lsum, bars, j, row, lane, scale2, elected, Lq, Lk, c):
        """S_j is complete: release K_j, online softmax in place; once P_{j-1} V_{j-1} is
        complete, release V_{j-1}, rescale O and round P_j into the registers it read."""
        k0 = T.meta_var(j * BK)
        pin(s, NS * 4)
        if elected:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EK + j % ST]))
        if _mask_needed(causal, c[3], BM, k0, BK, Lk, Lq, Lk):
            for i in T.unroll(NS * 4):
                if not visible(causal, row + i % 4 // 2 * 8,
                               k0 + i // 4 * 8 + lane % 4 * 2 + i % 2, Lq, Lk):
                    s[i] = neg_inf()
        for r in T.unroll(2):
            mn[r] = _row_tree(T.max, s, r, NS)
            quad_reduce(mn, r, T.max)
            mn[r] = T.max(m[r], mn[r] * scale2)
            msub[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(0), mn[r])
        for i in T.unroll(NS * 4):
            s[i] = exp2_clamped(s[i] * scale2 - msub[_lane_row(i, NS)])
        for r in T.unroll(2):
            m[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(1),
                                  exp2_clamped(m[r] - mn[r]))
            lsum[r] = lsum[r] * m[r] + _row_tree(T.Add, s, r, NS)
        if j > 0:
            T.ptx.wgmma.wait_group.sync.aligned(0)  # P_{j-1} V_{j-1} done
            pin(acc, NO * 4)
            if elected:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EV + (j - 1) % ST]))
        for i in T.unroll(NO * 4):
            acc[i] = acc[i] * m[_lane_row(i, NO)]
        for r in T.unroll(2):
            m[r] = mn[r]
        for i in T.unroll(NS * 4):
            p[i] = T.cast(s[i], dtype)

    @T.prim_func
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle,
                  o_h: T.handle, lse_h: T.handle, scale: T.float32):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qb, qh, ql, kb, kh, kl = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        vb, vh, vl, ob, oh, ol = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=(qb, qh, ql, 1), align=16)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=(kb, kh, kl, 1), align=16)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=(vb, vh, vl, 1), align=16)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=(ob, oh, ol, 1), align=16)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Sinks = T.match_buffer(sinks_h, (Hq,), F32)
        _require_vector_rows("flash_fwd", Q, K, V, O)
        qmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", qmap, dtype, 4, Q.data, D, Lq, Hq, B,
                      *_tma_strides(Q), ATOM, BM, 1, 1, 1, 1, 1, 1, 0, SW, 2, 0)
        kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", kmap, dtype, 4, K.data, D, Lk, Hkv, B,
                      *_tma_strides(K), ATOM, BK, 1, 1, 1, 1, 1, 1, 0, SW, 2, 0)
        vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", vmap, dtype, 4, V.data, D, Lk, Hkv, B,
                      *_tma_strides(V), ATOM, BK, 1, 1, 1, 1, 1, 1, 0, SW, 2, 0)
        T.device_entry()
        # one block per SM: the register cap that setmaxnreg redistributes
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        nqt = T.meta_var(T.ceildiv(Lq, BM))
        bx = T.cta_id([T.cast(B * Hq * nqt, "int32")])
        tx = T.thread_id([NT])
        pool = T.alloc_buffer((pool_bytes,), "uint8", scope="shared.dyn", align=1024)
        Qs = T.decl_buffer((NA, BM, ATOM), dtype, data=pool.data, elem_offset=0,
                           scope="shared.dyn")
        Ks = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=k_off // 2,
                           scope="shared.dyn")
        Vs = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=v_off // 2,
                           scope="shared.dyn")
        bars = T.decl_buffer((NB,), "uint64", data=pool.data, elem_offset=bar_off // 8,
                             scope="shared.dyn")
        Of = T.decl_buffer((B * ob,), dtype, data=O.data)
        c = T.alloc_buffer((5,), "int64", scope="local")  # b, h, kv head, q0, key tiles

        t, bh = T.meta_var(_block_order(causal, T.cast(bx, "int64"), nqt, B * Hq))
        c[3] = (nqt - 1 - t) * BM
        c[0] = bh // Hq
        c[1] = bh % Hq
        c[2] = c[1] // group
        c[4] = num_key_tiles(causal, c[3], BM, Lq, Lk, BK, T.int64(0), Lk)
        if tx == 0:
            for i in T.unroll(NB):
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[i]),
                                               T.uint32(1 if i < EK else NC))
            T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()

        if tx < WG:  # ------------------------------------------------------------ producer
            T.ptx.setmaxnreg.dec.sync.aligned.u32(24)
            if tx == 0:
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[0]),
                                                           T.uint32(q_bytes))
                for a in T.unroll(NA):
                    T.ptx[_TMA](T.address_of(Qs[a, 0, 0]), T.address_of(qmap), a * ATOM,
                                T.cast(c[3], "int32"), T.cast(c[1], "int32"),
                                T.cast(c[0], "int32"), T.address_of(bars[0]))
                for j in T.serial(c[4]):
                    # a stage is refilled once both consumers released its previous tile
                    if j >= ST:
                        T.cuda.mbarrier_wait(T.address_of(bars[EK + j % ST]), (j // ST - 1) % 2)
                    load(Ks, bars, kmap, j, FK, c[2], c[0])
                    if j >= ST:
                        T.cuda.mbarrier_wait(T.address_of(bars[EV + j % ST]), (j // ST - 1) % 2)
                    load(Vs, bars, vmap, j, FV, c[2], c[0])
        else:  # ------------------------------------------------------------------ consumers
            T.ptx.setmaxnreg.inc.sync.aligned.u32(regs_consumer)
            s = T.alloc_buffer((NS * 4,), F32, scope="local")
            p = T.alloc_buffer((NS * 4,), dtype, scope="local")
            pw = T.decl_buffer((NS * 2,), "uint32", data=p.data, scope="local")
            acc = T.alloc_buffer((NO * 4,), F32, scope="local")
            m = T.alloc_buffer((2,), F32, scope="local")
            mn = T.alloc_buffer((2,), F32, scope="local")
            msub = T.alloc_buffer((2,), F32, scope="local")
            lsum = T.alloc_buffer((2,), F32, scope="local")
            dq = T.alloc_buffer((1,), "uint64", scope="local")
            dk = T.alloc_buffer((1,), "uint64", scope="local")
            dv = T.alloc_buffer((1,), "uint64", scope="local")
            cw = T.meta_var(tx // WG - 1)  # consumer warpgroup
            lane = T.meta_var(tx % 32)
            row = T.meta_var(c[3] + cw * 64 + tx % WG // 32 * 16 + lane // 4)  # + 8 r
            scale2 = T.meta_var(scale * T.float32(LOG2E))
            elected = T.meta_var(tx % WG == 0)  # one thread per warpgroup arrives

            for i in T.unroll(NO * 4):
                acc[i] = T.float32(0)
            for r in T.unroll(2):
                if sinks:
                    m[r] = Sinks[c[1]] * T.float32(LOG2E)
                    lsum[r] = T.if_then_else(lane % 4 == 0, T.float32(1), T.float32(0))
                else:
                    m[r] = neg_inf()
                    lsum[r] = T.float32(0)
            _desc(dq[0], T.address_of(Qs[0, cw * 64, 0]), 1, 8 * ROW, SW)
            T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
            n = T.meta_var(c[4])
            if n > 0:
                # step 0: S_0 alone; steps 1..n-1: S_j = Q K_j and O += P_{j-1} V_{j-1} in
                # flight together; then the last P V. Peeled so that the steady loop has no
                # branch around a wgmma (ptxas serialises wgmma it cannot follow).
                issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, T.int64(0), T.int64(0), True, False)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                softmax(s, p, acc, m, mn, msub, lsum, bars, T.int64(0), row, lane, scale2,
                        elected, Lq, Lk, c)
                for j in T.serial(n - 1):
                    issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, j + 1, j, True, True)
                    T.ptx.wgmma.wait_group.sync.aligned(1)  # S done, P V may run on
                    softmax(s, p, acc, m, mn, msub, lsum, bars, j + 1, row, lane, scale2,
                            elected, Lq, Lk, c)
                issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, n - 1, n - 1, False, True)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                pin(acc, NO * 4)

            for r in T.unroll(2):
                quad_reduce(lsum, r, T.Add)
                mn[r] = T.if_then_else(lsum[r] == T.float32(0), T.float32(0),
                                       T.float32(1) / lsum[r])
            for r in T.unroll(2):
                if row + r * 8 < Lq:
                    for n in T.unroll(NO):
                        for e in T.vectorized(2):
                            Of[c[0] * ob + c[1] * oh + (row + r * 8) * ol + n * 8 + lane % 4 * 2
                               + e] = T.cast(acc[n * 4 + r * 2 + e] * mn[r], dtype)
                    if lane % 4 == 0:
                        LSE[c[0], c[1], row + r * 8] = row_lse(m[r], lsum[r])

    return flash_fwd


def kernel(key: KernelKey, tile_override: HopperTile | None = None):
    """The PrimFunc of ``key`` (a key :func:`supports`)."""
    if not supports(key):
        raise ValueError(f"{key.name}: not a Hopper kernel key")
    chosen = tile_override or tile(key)
    if chosen.smem_bytes(key.head_dim) > SMEM_LIMIT:
        raise ValueError(f"{key.name}: tile {chosen} needs {chosen.smem_bytes(key.head_dim)} "
                         f"bytes of shared memory, more than {SMEM_LIMIT}")
    return flash_forward(key, chosen)
