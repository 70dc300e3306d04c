"""CUDA sm_90a (Hopper, fp16/bf16): forward, dQ and dK/dV on ``wgmma`` with TMA loads on
mbarriers.

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

The backward keeps the ``mma.sync`` one's split into a dQ and a dK/dV kernel (:func:`flash_dq`,
:func:`flash_dkv`: every output element has one writer, so the gradients are deterministic with
no atomics, where FlashAttention-3's single kernel adds dQ up atomically or in a fixed order
behind semaphores) on the same machinery: the products whose both operands are tiles (S, dP and
their transposes) read shared memory K-major; those with P or dS as A (dQ += dS K, dV += P^T dO,
dK += dS^T Q) take it from registers, rounded in the order of the accumulator it came from, and
read the other operand MN-major, as P V does V. Descriptor strides, in 16-byte units, for a tile
of ``R`` rows stored as atoms of ``ROW`` units a row: K-major LBO 1 (unused by the swizzled
layouts), SBO ``8 ROW`` (the next 8 rows), a k16 step +2 within an atom and ``R ROW`` to the
next atom; MN-major LBO ``R ROW`` (the next atom of columns), SBO ``8 ROW``, a k16 step ``16
ROW`` (16 rows).

The kernels with score modifiers (:data:`MODS_WRITTEN`) or for packed sequences
(:data:`VARLEN_WRITTEN`) are served where they ran against float64 on the H200
(:data:`MODS_SERVED`). Written but not served until it has run there (``scripts/sweep_hopper.py``;
docs/journal/2026-12-01-hopper.md): the 5-GEMM dK/dV (``HopperTile(dq=True)``: dQ added in
key-tile order into a float32 accumulator). :func:`variants` lists the tiles a tuner may measure
for a key.
"""

from __future__ import annotations

import dataclasses
import itertools

from tvm.script import tirx as T

from tvm_flash.kernels.common import (
    LOG2E,
    NO_MODS,
    TANH_FORMS,
    TILED,
    ModArgs,
    Mods,
    TileConfig,
    alibi_slope_raw,
    diagonal,
    exp2_clamped,
    exp2_fma,
    first_key,
    first_query_tile,
    modified_score,
    neg_inf,
    num_key_tiles,
    query_tiles_end,
    row_lse,
    softcap_slope,
    trim_params,
    visible,
)
from tvm_flash.key import KernelKey

from .cuda_mma import (
    _block_order,
    _lane_row,
    _mask_needed,
    _require_vector_rows,
    _row_tree,
    pin_sequence,
    pos_inf,
    widen_half,
)

F32 = "float32"
WG = 128  # threads of a warpgroup
OPS = ("fwd", "dq", "dkv")
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# per op, the head dims written (every one; dK/dV from D 192 with the split tile)
OP_HEAD_DIMS = {"fwd": HEAD_DIMS, "dq": HEAD_DIMS, "dkv": HEAD_DIMS}
_PTX = {"float16": "f16", "bfloat16": "bf16"}
_TMA = "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
_TMA_STORE = "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
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


PERSISTENT_MAX_KEYS = 1024
"""A persistent forward (or dQ) launches one block per SM up to this many keys (Lk), one
block per query tile above: a block's fixed costs (barriers, the first loads, the output's
stores) weigh most where it has few keys to walk, and with more the fixed assignment of tiles
to blocks loses to the hardware's (H200, bf16, forward TFLOP/s one block per tile -> per
SM, causal: D 64 N 512 132 -> 167, N 1024 207 -> 239, N 16384 405 -> 388; D 128 N 512 170 ->
204, N 1024 260 -> 287, N 4096 435 -> 430, N 16384 548 -> 519; unmasked D 128 N 512 315 ->
364, N 16384 585 -> 570)."""


EVERY_LENGTH = 1 << 30
"""``HopperTile.persistent_keys`` of a tile persistent at every length (keys fit int32)."""


@dataclasses.dataclass(frozen=True)
class HopperTile:
    """A kernel's tile and the variants it can be built in (one of :func:`variants`, or a
    sweep's). Forward and dQ: the rows are queries and a step walks keys (K/V in the ring);
    dK/dV: the rows are keys and a step walks queries (Q/dO and their LSE/Delta in the ring).

    * ``consumers``: warpgroups of 64 rows each (plus the producer warpgroup); ``step``: rows
      of the other side a loop step; ``stages``: buffers in the TMA ring.
    * ``split`` (dK/dV): both consumers work on the same 64 keys, one accumulating dV and the
      other dK (D / 2 registers a thread each instead of D), P^T passed through shared memory.
    * ``persistent`` (forward, dQ): where a tile walks at most ``persistent_keys`` keys
      (default :data:`PERSISTENT_MAX_KEYS`), one block per SM walks query tiles in turn, the
      next one's loads overlapping the end of this one.
    * ``dq`` (dK/dV): the 5-GEMM form, dQ added into a float32 accumulator; ``ordered`` (with
      ``dq``): each query tile's additions in key-tile order behind semaphores, the same bits
      on every run (unordered measured only 1-2% faster on the H200, D 128, N 4096-16384: no
      non-deterministic mode; docs/journal/2026-12-01-hopper.md). ``dq_order`` (with ``dq``):
      the blocks' order, ``"key"`` key tile major (every head's first key tile, then every
      head's second...: a block rarely waits on its counter, but the blocks resident at once
      stream as many heads' Q, dO and dQ sums as there are SMs — ncu, D 128 N 4096 unmasked:
      DRAM 39% busy against 4% for the plain dK/dV) or ``"head"`` (a head's key tiles
      adjacent, as FlashAttention-3 launches them: the resident blocks share a few heads' rows
      in the L2, and each waits for the key tile before it, launched just before it).
      ``dq_pad`` (with ``dq``): the float32 dQ tile's rows padded by :data:`DQ_PAD` floats,
      in shared memory and so in the accumulator the bulk add writes (:func:`dq_row` floats a
      row). Unpadded, the rows are 512 bytes apart and a warp's 64-bit stores of 8 rows fall
      in the same 8 banks (ncu, D 128 N 4096 unmasked: 105 M bank conflicts in 485 M shared
      wavefronts, the stores 18% of the stall samples); padded, 4 rows fill all 32 banks.
      A padding keeps the stores' addresses affine (a swizzle of the chunks cost ptxas 28
      more bytes of spill for its per-chunk address arithmetic).
    * ``tanh`` (keys with a soft cap): the form of the cap's tanh
      (``kernels.common.TANH_FORMS``); not a tuning variant (it changes the results): every
      soft-capped key takes :data:`SOFTCAP_TANH` (:func:`tile`).
    * ``clamp``: the softmax's exponent clamped at 0 (``exp2_clamped``) or not — a score is at
      most its row's max (or the LSE), so the argument is above 0 only by a rounding and P at
      most 1 + 2^-23; +inf LSE still gives 0. Every default is off (:func:`tile`). dQ and
      dK/dV with it off also take P = exp2(S scale log2 e - LSE log2 e) in one FFMA on an
      LSE scaled where it is loaded (instead of a multiply, a subtraction, a multiply and the
      clamp's compare and select).
    * ``tma_store`` (forward, head dims that are multiples of 64, not packed sequences): O out
      through a shared tile by bulk tensor stores, which in a persistent grid overlap the
      next tile's first products (the D 128 unmasked forward's default, :func:`tile`).
    * ``exp2_fma`` (forward, 0-8): of every 8 scores a thread holds, this many take the
      softmax's exponential on the FMA pipe (``kernels.common.exp2_fma``, as accurate) instead
      of the special-function unit, the busiest pipe by instructions in ncu's profile of the
      D 128 forward (FlashAttention-4 balances the two so). Measured 1.8–6.0x slower for 1–3
      of 8 on the H200 (docs/results/hopper-sweeps-v8.json): not served.
    * ``l2_bytes`` (causal, not packed sequences): tiles longest first within groups of heads
      whose streamed rows fit this many bytes of L2 — K/V for the forward and dQ, Q/dO for
      dK/dV (``_tile_order``; 0: longest first across all heads), as FlashAttention-3 groups
      heads; the default of dense causal keys up to D 128 (:data:`L2_GROUP_BYTES`).
    * ``p_once`` (dK/dV, not split): P^T converted to the input dtype once, into the words
      dV += P^T dO reads, which dS^T = P^T (dP^T - Delta) widens back — the same bits as
      rounding P^T in place first, one conversion and a widening fewer a score, and S^T's
      registers free once the words are made (in ncu's source view of the D 128 dK/dV the
      conversions drew as many stall samples as the exponentials). The default of every tile
      that is not split (:func:`_dkv_tile`).
    * ``stats_early`` (dK/dV, neither split nor with the fused dQ): each thread reads its
      queries' LSE from the stage into registers right after issuing S^T and dP^T, and their
      Delta right after issuing dV += P^T dO — before the waits on those products, so the
      shared-memory latency hides behind them (ncu, D 128 dK/dV: 22% of stall samples were
      short-scoreboard waits of the FFMA on LSE and the FADD on Delta, read where used). Costs
      ``tile.step / 4`` registers beside the products in flight (ptxas: no spill at D 64-128).
      Measured no gain on the H200 (bf16, the kernel alone, N 4096 / 16384: D 64 unmasked
      -9 / -6%, causal +1%; D 128 unmasked -5 / +2%, causal -2%;
      docs/results/hopper-sweeps-v9.json): not served.
    * ``overlap`` (dK/dV, neither split nor with the fused dQ): a step does not wait for its
      dK += dS^T Q — the next step's S^T and dP^T are issued behind it, and the wait that
      hands the next step its S^T also completes dK (and dV) and frees the stage before. The
      tensor cores then see no gap between a step's last product and the next one's first;
      P^T's and dS^T's words live one wait longer (ptxas: D 64's and 96's default tiles and
      D 128 with 48-query steps keep the wgmma asynchronous; D 128's 64-query steps and D 64's
      128 serialise them, C7512). A variant to measure.
    * ``alibi_rows`` (forward and dQ, ALiBi without a soft cap: :class:`_ByRows`): the bias
      ``-slope * distance`` of a thread's element split into the element's constant part,
      ``slope`` times its column offset within the thread's columns (one FFMA with an
      immediate), and its row's part, which the forward's row max and exponent subtrahend
      (a softmax is invariant under a shift of a row), or dQ's LSE, take once a row —
      instead of an add and an FFMA an element. Without a causal mask the distance's
      absolute value is linear only on one side of the diagonal: the threads it crosses
      take the element's form. The forward's default with ALiBi alone (:func:`alibi_rows`).
    * ``chained`` (a persistent forward, not packed sequences): a block's query tiles follow
      each other without a gap on the tensor cores — the next tile's first S = Q K^T is issued
      with this tile's last P V, and its softmax runs while that P V does (in the plain form
      the tensor cores wait out the first softmax of every tile). Two Q buffers (the next
      tile's Q loads while this one's is read), each with its full and empty mbarriers; a
      tile's LSE is written before the next one is located, its O after the next one's first
      softmax. Worth most where tiles walk few keys: short calls, windows. A variant to
      measure.
    """

    consumers: int = 2
    step: int = 128
    stages: int = 2
    split: bool = False
    persistent: bool = False
    dq: bool = False
    ordered: bool = True
    tanh: str = "exp2"
    clamp: bool = True
    tma_store: bool = False
    persistent_keys: int = PERSISTENT_MAX_KEYS
    exp2_fma: int = 0
    l2_bytes: int = 0
    p_once: bool = False
    stats_early: bool = False
    overlap: bool = False
    dq_order: str = "key"
    dq_pad: bool = False
    alibi_rows: bool = False
    chained: bool = False

    @property
    def rows(self) -> int:
        return 64 if self.split else 64 * self.consumers

    @property
    def threads(self) -> int:
        return WG * (self.consumers + 1)

    def smem_bytes(self, d: int, op: str = "fwd") -> int:
        """Forward: Q tile + the K/V ring; dQ: Q and dO tiles + the K/V ring; dK/dV: K and V
        tiles + the Q/dO ring and its LSE/Delta; + 8 bytes per mbarrier (rounded to 1 KiB)."""
        if op == "fwd":  # (tma_store: O's tile; chained: a second Q tile)
            tiles = 2 * d * (self.rows * (1 + self.tma_store + self.chained)
                             + 2 * self.stages * self.step)
        else:
            tiles = 2 * d * (2 * self.rows + 2 * self.stages * self.step)
            if op == "dkv":  # LSE and Delta rows; split: P^T's words, 4 bytes x 128 threads
                tiles += self.stages * 2 * self.step * 4
                tiles += self.stages * self.step // 4 * WG * 4 if self.split else 0
                if self.dq:  # dS^T of both consumers, double-buffered; the float32 dQ tile
                    tiles += (2 * self.consumers * 64 * self.step * 2
                              + self.step * dq_row(d, self) * 4 + 2048)
        return tiles + 1024

    def tile_config(self, op: str) -> TileConfig:
        """As a (block_q, block_k) :class:`TileConfig` (names artifacts and tuning logs)."""
        if op == "dkv":
            return TileConfig(self.step, self.rows)
        return TileConfig(self.rows, self.step)


SMEM_LIMIT = 227 * 1024  # an sm_90 block's dynamic shared memory with the opt-in


SERVED = {"fwd": HEAD_DIMS, "dq": HEAD_DIMS, "dkv": HEAD_DIMS[1:]}
"""Per op, the head dims whose keys run on these kernels: each written one but dK/dV at D 32,
which the ``mma.sync`` kernel runs faster (H200, bf16, N 4096, the kernel alone: 211 against
188 TFLOP/s, causal 199 against 146; at D 64 it is 268 against 367, at D 128 259 against
509, at D 256 206 against 541 with the split tile)."""


def writes(key: KernelKey) -> bool:
    """Whether this module has a kernel for ``key``: forward, dQ or dK/dV, fp16/bf16, sm_90a,
    a head dim in ``OP_HEAD_DIMS`` of its op (every causal mode and GQA group), score
    modifiers for the ops of :data:`MODS_WRITTEN`, packed sequences for those of
    :data:`VARLEN_WRITTEN`."""
    return (key.op in OPS and key.dtype in _PTX and key.head_dim in OP_HEAD_DIMS[key.op]
            and key.target == "cuda-sm_90a"
            and (not key.varlen or key.head_dim in VARLEN_WRITTEN[key.op])
            and (not key.mods or key.head_dim in MODS_WRITTEN[key.op])
            and not (key.op == "dkv" and key.softcap and _dkv_tile(key.head_dim).split))


MODS_WRITTEN = {"fwd": HEAD_DIMS, "dq": HEAD_DIMS, "dkv": HEAD_DIMS}
"""Per op, the head dims written with score modifiers (``tvm_flash.key.MODS``) too — but the
soft cap on dK/dV's split tile (D 192 and up), whose dK warpgroup would need S^T's slope from
the other (:func:`writes`)."""


VARLEN_WRITTEN = MODS_WRITTEN
"""Per op, the head dims written for packed sequences (``KernelKey.varlen``) too."""


MODS_SERVED = {"fwd": (64, 128, 256), "dq": (64, 128, 256), "dkv": (64, 128)}
"""Per op, the head dims whose keys with score modifiers or for packed sequences run here:
those that have run against float64 on the H200 (``scripts/sweep_hopper.py --mods
window,softcap,alibi,window+softcap+alibi --varlen``, every causal mode, GQA 2, bf16: all
passed; docs/journal/2026-12-01-features.md). The others take the ``mma.sync`` kernels,
which have them at every head dim."""


def supports(key: KernelKey) -> bool:
    """Whether ``key`` runs on these kernels: :data:`SERVED`, or with score modifiers or for
    packed sequences :data:`MODS_SERVED`."""
    if key.mods or key.varlen:
        return writes(key) and key.head_dim in MODS_SERVED[key.op]
    return writes(key) and key.head_dim in SERVED[key.op]


L2_GROUP_BYTES = 32 << 20
"""``HopperTile.l2_bytes`` of dense causal keys up to D 128 without a window: the heads whose
streamed rows fit 32 MiB of the H200's 50 MiB L2 take their tiles together
(:func:`_tile_order`). H200, bf16, causal, the kernel alone, TFLOP/s across all heads -> 32 MiB
groups (16 MiB), N 1024 / 4096 / 16384: forward D 128 293 / 447 / 555 -> 298 / 469 / 560 (261 /
463 / 559), D 64 219 / 350 / 461 -> 226 / 368 / 465; dQ D 128 375 / 528 / 598 -> 373 / 566 /
616 (323 / 576 / 609), D 64 341 / 435 / 502 -> 352 / 481 / 529; dK/dV D 128 304 / 459 / 526 ->
337 / 497 / 537 (351 / 505 / 535), D 64 223 / 322 / 364 -> 230 / 330 / 365 (twelfth session,
docs/results/hopper-sweeps-v8.json). 16 MiB lost at N 1024, where such a group (32 heads of 8
tiles at D 128) is under two waves of 132 SMs; larger head dims were not measured."""


SOFTCAP_TANH = "approx"
"""The form of a soft cap's tanh in these kernels (``HopperTile.tanh``): the hardware's
``tanh.approx.f32``, one MUFU operation a score where the exp2 form takes two (the
exponential and the division's reciprocal). Its relative error, about 2^-11, moves a score
capped at 50 by up to 0.025: below half an fp16 ulp of such a score (0.03) and far below a
bf16 one, the precisions these kernels take (float32 runs the SIMT schedule, which keeps the
float32-accurate form). H200, bf16, the kernels alone, D 128 causal N 4096 / 16384: ÷ the
plain kernel forward 1.33-1.43 -> 1.24-1.25, dQ 1.35-1.37 -> 1.17-1.18, dK/dV 1.28-1.38 ->
1.20-1.25 (docs/journal/2026-12-01-features.md); within the error bounds of
tests/test_score_mods.py (caps 0.5, 5, 30 and 50 on scores up to ~100) on the H200."""


def alibi_rows(key: KernelKey) -> bool:
    """Whether ``key`` takes ALiBi by rows (``HopperTile.alibi_rows``): the forward with
    ALiBi alone (no soft cap, no window). H100, bf16, GQA 1, the kernel alone, TFLOP/s N 4096
    / 16384, element's form -> by rows: D 64 unmasked 400 / 442 -> 414 / 470, causal 318 /
    401 -> 337 / 420; D 128 unmasked 541 / 573 -> 575 / 587, causal 424 / 480 -> 476 / 557
    (plain: 455 / 497, 366 / 477, 594 / 622, 491 / 585); SASS of the D 128 causal forward:
    FADD 258 -> 142, FFMA 260 -> 256. The dQ variant is checked (GQA 2, every causal mode)
    but not yet timed; the same split in dK/dV (a query column's part with its LSE) measured
    1-5% slower and was dropped (docs/journal/2026-12-01-features.md, twenty-fifth
    session)."""
    return key.op == "fwd" and key.alibi and not (key.softcap or key.window)


def tile(key: KernelKey) -> HopperTile:
    """The default tile of ``key`` (:func:`_tile`), its causal blocks grouped for the L2
    (:data:`L2_GROUP_BYTES`) where they are dense, without a window and D <= 128 (a window
    bounds the keys a tile streams anyway, and the grouped order cost the windowed causal
    forward at D 128 4 bytes of spill: ptxas); ALiBi by rows where :func:`alibi_rows`."""
    chosen = _tile(key)
    if key.softcap:
        chosen = dataclasses.replace(chosen, tanh=SOFTCAP_TANH)
    if alibi_rows(key):
        chosen = dataclasses.replace(chosen, alibi_rows=True)
    if key.causal != "none" and not (key.varlen or key.window) and key.head_dim <= 128:
        return dataclasses.replace(chosen, l2_bytes=L2_GROUP_BYTES)
    return chosen


def _tile(key: KernelKey) -> HopperTile:
    """Two consumer warpgroups (128 query rows; three at D 64, :func:`_fwd_consumers`) and two
    stages; 128-key steps up to D 160, fewer above, where O's D / 2 registers a thread crowd
    out S and P (D 256: 128 + 32 + 16) and the K/V ring outgrows shared memory. D 64 and 128
    from an H200 sweep (docs/perf.md, "Hopper forward"): at D 128 bf16 N 4096 532 TFLOP/s
    against 523 with three stages, 532 with 176-key steps (which spilled then; with the exp2
    unclamped, ptxas keeps 144-192-key steps in registers unmasked: to measure) and 432 for
    the best tile without the producer warpgroup."""
    d = key.head_dim
    # a soft cap or ALiBi rewrites every score in registers (dK/dV under a cap also keeps
    # 1 - tanh^2 beside S^T): shorter steps keep them in registers (ptxas, bf16 unmasked:
    # dQ D 64 104 -> 0 bytes spilled, dK/dV D 128 192-196 -> 0, packed dK/dV D 128 causal
    # 196 -> 0); dK/dV with P^T converted once has room for longer ones (_rescored_dkv_step)
    rescored = key.softcap or key.alibi
    if key.op == "dq":  # packed sequences: never persistent
        chosen = _dq_tile(d, key.causal != "none" and not key.varlen)
        return (dataclasses.replace(chosen, step=_rescored_dq_step(key, chosen.step)) if rescored
                else chosen)
    plain = not (key.mods or key.varlen)
    # a soft cap or ALiBi alone (no window, not packed): the forward takes the plain one's
    # tile, three consumers at D 64 (with its 1024 bucket) and bulk stores at every length at
    # D 128 unmasked. H200, bf16, the kernel alone, TFLOP/s, N 1024 / 4096 / 16384 (sixteenth
    # session, docs/results/hopper-sweeps-v12.json): D 64 two -> three consumers, ALiBi
    # unmasked 274 / 301 / 319 -> 295 / 364 / 404, causal 192 / 272 / 318 -> 182 / 294 / 361;
    # soft cap unmasked 198 / 211 / 220 -> 194 / 228 / 247, causal 153 / 199 / 223 -> 128 /
    # 199 / 234 (ptxas: 0-40 bytes spilled, 40 for ALiBi causal); D 128 unmasked ALiBi 389 /
    # 452 / 463 -> 417 / 470 / 470, soft cap 326 / 379 / 383 -> 338 / 388 / 383 (4 bytes, as
    # the plain one); causal at every length 10-13% slower, so not there (as the plain one)
    alone = _rescored_alone(key)
    if key.op == "dkv":  # also packed sequences: the sequence's rows and lengths take registers
        chosen = _dkv_tile(d)
        if (rescored or key.varlen) and not chosen.split:
            return dataclasses.replace(chosen, step=_rescored_dkv_step(key))
        if d == 64 and key.causal != "none" and plain:
            # 192 keys a block, 32-query steps (64 spill); H200, bf16, the kernel alone,
            # causal N 1024 / 4096 / 16384: 187 / 276 / 345 -> 225 / 324 / 366 TFLOP/s;
            # unmasked 279 / 375 / 409 -> 279 / 337 / 360, so not there. The exp2 unclamped as
            # for every dK/dV (HopperTile.clamp; this tile kept the clamp by an oversight until
            # the twelfth session): causal N 1024 / 4096 / 16384 222 / 320 / 366 -> 226 / 328 /
            # 389 TFLOP/s (docs/results/hopper-sweeps-v7.json)
            return HopperTile(consumers=3, step=32, stages=3, clamp=False, p_once=True)
        if d == 64 and key.lengths == 1024 and plain:
            # calls up to 1024 long: 96-query steps leave a third of the last step empty at
            # N 512; H200, bf16, the kernel alone, unmasked N 512 / 1024: 214 / 279 -> 228 /
            # 288 TFLOP/s with 128 (64: 229 / 282)
            return dataclasses.replace(chosen, step=128)
        return chosen
    # persistent where ptxas keeps it in registers and it was measured faster (D 96, 160-224
    # spill 4-200 bytes with the tile loop; D 256 causal N 512 / 1024 +8 / +5%, unmasked
    # 0 / -4%)
    # packed sequences: one block per (sequence, head, tile), never persistent
    # the scores' exp2 unclamped (HopperTile.clamp): H200, bf16, TFLOP/s clamped -> not,
    # N 1024 / 4096 / 16384, D 64 unmasked 357 -> 368, 439 -> 443, 487 -> 478, causal 213 ->
    # 219, 339 -> 343, 439 -> 451; D 128 unmasked 455 -> 464, 535 -> 552, 577 -> 594, causal
    # 288 -> 291, 433 -> 431, 538 -> 531 (+1.4% on average, two fewer instructions a score;
    # O rescaled lazily lost 1-8%: docs/journal/2026-12-01-hopper.md, tenth session)
    # D 128 unmasked: O out by bulk tensor stores, persistent at every length (the store
    # overlaps the next tile's first products; unmasked tiles walk the same keys, so the
    # fixed assignment stays balanced). H200, bf16, TFLOP/s, N 1024 / 4096 / 16384: 475 / 564
    # / 606 -> 497 / 596 / 611 (cuDNN in the same rows 569 / 609 / 618 -> 530 / 563 / 598:
    # compare ratios); the store alone 497 / 568 / 598; causal 302 / 459 / 569 -> 310 / 472 /
    # 548, so not there (eleventh session)
    fast_store = (plain or alone) and d == 128 and key.causal == "none"
    return HopperTile(consumers=_fwd_consumers(key) if plain or alone else 2,
                      step=128 if d <= 160 else 96 if d == 192 else 64,
                      persistent=not key.varlen and (
                          d in (32, 64, 128) or d == 256 and key.causal != "none"),
                      clamp=False, tma_store=fast_store,
                      persistent_keys=EVERY_LENGTH if fast_store else PERSISTENT_MAX_KEYS)


def _fwd_consumers(key: KernelKey) -> int:
    """Three consumer warpgroups (192 query rows, FlashAttention-3's D 64 tile) at D 64 but
    causal calls up to 1024 long (the length bucket ``key.lengths == 1024``), else two. H200,
    bf16, TFLOP/s two -> three, unmasked N 512 / 1024 / 2048 / 4096 / 16384: 283 -> 295,
    341 -> 350, 348 -> 401, 385 -> 443, 413 -> 483; causal 167 -> 150, 237 -> 213, 268 ->
    278, 315 -> 331, 394 -> 429 (short causal calls have few rows a head: 192-row tiles
    waste more of them). D 128 at three (64- or 80-key steps; 96 spill): N 16384 +3%
    unmasked, 1024 -7%, causal -1...-9% (docs/journal/2026-12-01-hopper.md)."""
    if key.head_dim != 64:
        return 2
    return 2 if key.causal != "none" and key.lengths == 1024 else 3


def _rescored_alone(key: KernelKey) -> bool:
    """A soft cap or ALiBi and no other modifier, not packed sequences: where the rescored
    kernels were measured on longer steps or the plain forward's tile."""
    return key.mods in (("softcap",), ("alibi",)) and not key.varlen


def _rescored_dq_step(key: KernelKey, step: int) -> int:
    """The key step of a dQ under a soft cap or ALiBi, ``step`` the plain tile's: at most 64 (the
    rewritten S beside dP), but at D 64 under one of them alone, where ptxas keeps the plain
    kernel's 128-key steps in registers since the exp2 was unclamped (0 bytes spilled; 104
    before) — 96 for the soft cap unmasked. H200, bf16, the kernel alone, TFLOP/s on the whole
    N^2, 64 -> 96 / 128, N 1024 / 4096 / 16384 (sixteenth session,
    docs/results/hopper-sweeps-v12.json): soft cap unmasked 253 / 280 / 289 -> 264 / 308 / 321
    (128: 249 / 276 / 285), causal 205 / 257 / 280 -> 200 / 274 / 306 with 128 (96: 199 / 264 /
    292); ALiBi unmasked 424 / 493 / 495 -> 457 / 539 / 544, causal 293 / 399 / 432 -> 327 / 453
    / 501 with 128."""
    if key.head_dim == 64 and _rescored_alone(key):
        return 96 if key.softcap and key.causal == "none" else 128
    return min(step, 64)


def _dq_tile(d: int, causal: bool) -> HopperTile:
    """dQ: 128 query rows, three stages; 128-key steps up to D 64, where S and dP (BK / 2
    registers each) and dS's words (BK / 4) fit beside dQ's D / 2 (ptxas: 222 registers at
    D 64); 64 up to D 160; 32 above, where the third stage fits only beside shorter steps. The
    dQ product waits on the stage of the step before, so a third stage keeps a load in flight
    behind it. H200, bf16, N 4096, the kernel alone, TFLOP/s unmasked / causal: D 64 508
    (two stages 375), D 128 660 (465; 96-key steps 494), D 192 592 / 498 (64-key steps, two
    stages: 522 / 466), D 224 589 / 500 (358 / 357), D 256 597 / 524 (394 / 396).

    Persistent (up to ``PERSISTENT_MAX_KEYS``) where causal at D 64, 128 and 192, where it was
    measured (the same machine and call, one block per tile -> per SM, causal N 512 / 1024):
    D 64 203 -> 227 / 290 -> 295, D 128 258 -> 264 / 342 -> 354, D 192 244 -> 252 / 326 ->
    326; unmasked it lost at N 1024 (D 64 438 -> 421, D 128 536 -> 509), where every block
    has the same work and the hardware's assignment of tiles already balances.

    The exp2 unclamped on an LSE in base 2 (``HopperTile.clamp``), as for dK/dV: H200, bf16,
    the kernel alone, TFLOP/s clamped -> not, N 1024 / 4096 / 16384, D 64 unmasked 450 / 524 /
    530 -> 499 / 576 / 587, causal 316 / 417 / 451 -> 349 / 448 / 514; D 128 unmasked 561 /
    669 / 662 -> 579 / 715 / 725, causal 371 / 524 / 570 -> 388 / 539 / 599; dK/dV D 64
    unmasked 271 / 369 / 409 -> 279 / 379 / 452, causal 222 / 320 / 366 -> 226 / 328 / 389;
    D 128 unmasked 446 / 547 / 561 -> 441 / 558 / 567, causal 300 / 457 / 506 -> 298 / 457 /
    526 (docs/journal/2026-12-01-hopper.md, eleventh session)."""
    return HopperTile(step=128 if d <= 64 else 64 if d <= 160 else 32, stages=3,
                      persistent=causal and d in (64, 128, 192), clamp=False)


def _rescored_dkv_step(key: KernelKey) -> int:
    """The query step of a dK/dV under a soft cap or ALiBi, or for packed sequences (below D
    192): 64 at D 64, 32 above; 96 at D 64 unmasked and 48 at D 128 under a soft cap where one
    of the two modifiers alone, without a window, runs every length (ptxas, P^T converted once:
    0 bytes spilled, but 40 under the soft cap unmasked, which measured faster anyway). H200,
    bf16, the kernel alone, TFLOP/s on the whole N^2, N 1024 / 4096 / 16384 (fourteenth session,
    docs/results/hopper-sweeps-v10.json): D 64 unmasked ALiBi 275 / 365 / 474 -> 282 / 378 /
    501, soft cap 277 / 334 / 350 -> 265 / 350 / 385 (causal ALiBi 241 / 350 / 412 -> 229 / 355
    / 422, soft cap -3 to -11%; with a window and both -10 to -12%: not there); D 128 soft cap
    359 / 412 / 416 -> 340 / 446 / 467, causal 280 / 389 / 411 -> 266 / 404 / 446 (ALiBi with
    48: 506 / 534 -> 481 / 558 at 4096 / 16384, not there). Calls up to 1024 long
    (``KernelKey.lengths``), where the soft cap's longer steps lose 4-5%, keep the short step."""
    d = key.head_dim
    longer = _rescored_alone(key) and not key.lengths
    if longer and d == 64 and key.causal == "none":
        return 96
    if longer and d == 128 and key.softcap:
        return 48
    return 64 if d <= 64 else 32


def _dkv_tile(d: int) -> HopperTile:
    """dK/dV: from D 192 the split tile (64 keys, dV and dK in different warpgroups, 64-query
    steps; three stages where they fit, at D 192). Below, 128 keys and three stages; 64-query
    steps up to D 128 (the highest register the consumers touch, in ptxas's code: 235 of 240
    at D 128), 32 at D 160 (225), as dK and dV take D of a thread's 240 registers; 96 at D 64.
    H200, bf16, N 4096, the kernel alone, TFLOP/s unmasked / causal: D 64 375 / 276 (split:
    246 / 160), D 96 452 / 364 (311 / 224), D 128 537 / 449 (split, three stages: 414 / 301),
    D 160 495 / 418 (440 / 330); D 192 split 502 / 388 (two stages 482 / 376; not split,
    16-query steps, 345 / 339 with 204 bytes spilled), D 224 split 492 / 385, D 256 541 / 422
    (32-query steps, three stages: 467 / 394; ``mma.sync`` 206 / 189). The split tile loses
    below D 192: each warpgroup issues only half of a step's GEMMs, and 64 keys a block reread
    Q and dO twice as often.

    P^T converted once (``HopperTile.p_once``; the split tile's dK warpgroup widens the words
    it is handed anyway): H200, bf16, the kernel alone, TFLOP/s rounded in place -> once,
    N 1024 / 4096 / 16384, D 64 unmasked 286 / 389 / 454 -> 296 / 395 / 489, causal 235 / 350
    / 392 -> 246 / 377 / 434; D 128 unmasked 452 / 552 / 563 -> 436 / 565 / 574, causal 339 /
    502 / 526 -> 340 / 511 / 570; N 4096 / 16384, D 96 unmasked 453 / 491 -> 477 / 539, causal
    421 / 471 -> 437 / 484, D 160 unmasked 512 / 536 -> 529 / 558, causal 432 / 486 -> 442 /
    514 (thirteenth session, docs/results/hopper-sweeps-v9.json; ptxas: D 128 unmasked 8
    bytes spilled -> 0)."""
    if d >= 192:
        return HopperTile(step=64, stages=3 if d == 192 else 2, split=True, clamp=False)
    return HopperTile(step=96 if d == 64 else 64 if d <= 128 else 32, stages=3, clamp=False,
                      p_once=True)


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


@T.macro
def gemm_ss(mma, acc, n, a, a_rows, b, b_rows, steps, ka, row):
    """``acc`` (``n`` registers) = A B^T over ``steps`` k16 chunks, one commit group: A and B
    K-major tiles of ``a_rows`` / ``b_rows`` rows from descriptors ``a`` / ``b``, an atom every
    ``ka`` chunks (+ rows x ``row`` 16-byte units), a chunk +2 units within one."""
    for kk in T.unroll(steps):
        T.ptx[mma](*[acc[i] for i in range(n)],
                   a + T.uint64(kk // ka * a_rows * row + kk % ka * 2),
                   b + T.uint64(kk // ka * b_rows * row + kk % ka * 2),
                   T.bool(kk > 0), 1, 1, 0, 0)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro
def gemm_rs(mma, acc, n, aw, b, steps, row):
    """``acc`` += A B over ``steps`` k16 chunks, one commit group: A from registers (chunk
    ``kk`` in words ``4 kk .. 4 kk + 3`` of ``aw``, the accumulator layout of the product that
    made it), B read MN-major from descriptor ``b`` (16 rows of ``row`` units a chunk)."""
    for kk in T.unroll(steps):
        T.ptx[mma](*[acc[i] for i in range(n)], aw[4 * kk], aw[4 * kk + 1], aw[4 * kk + 2],
                   aw[4 * kk + 3], b + T.uint64(kk * 16 * row), T.bool(True), 1, 1, 1)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro
def release_keyless(bars, qe, cw, elected):
    """Consumer warpgroup ``cw`` releases a query tile that walks no key tile (its rows see no
    key) back to the producer: one arrive on mbarrier ``qe`` (Q empty), but only once all its
    four warps have passed their wait for that Q. With keys, the tile's first product (a
    wgmma, which all four warps issue) is the rendezvous before the elected thread's arrive;
    without one, a slow warp could still be waiting for this Q when the producer, released,
    loads the next tile's: the phase completes again and the slow warp then waits on the
    parity of a phase that never completes. That hung the persistent forward under memcheck
    where a block walked a keyless tile between two others (bottom-right, Lq - Lk >= 256:
    Hopper journal, thirtieth and thirty-first sessions). Named barrier ``1 + cw``: the
    warpgroup's own, as the forward's bulk store of O takes it."""
    T.ptx.barrier.sync.aligned(T.cast(1 + cw, "uint32"), WG)
    if elected:
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[qe]))


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


def _tmap(m, buf, box_cols: int, box_rows: int, swizzle: int):
    """Encode the 4-D tensor map ``m`` (head dim, length, heads, batch) of the (B, H, L, D)
    tensor ``buf``, read in boxes of ``box_rows`` rows x ``box_cols`` columns: no interleave,
    the given swizzle, 128-byte L2 promotion, zero fill out of bounds."""
    b, h, length, d = buf.shape
    return T.call_packed("runtime.cuTensorMapEncodeTiled", m, str(buf.dtype), 4, buf.data, d,
                         length, h, b, *_tma_strides(buf), box_cols, box_rows, 1, 1, 1, 1, 1, 1,
                         0, swizzle, 2, 0)




def _snake(it, bx, grid, persistent: bool):
    """Position of block ``bx``'s query tile in round ``it`` of a persistent grid: rounds of
    ``grid`` adjacent positions, walked forward in even rounds and backward in odd ones (else
    the block's one tile, ``bx``)."""
    return it * grid + T.if_then_else(it % 2 == 0, bx, grid - 1 - bx) if persistent else bx


def _sm_count(persistent: bool):
    """Host code: the SMs of device 0 for a persistent grid, else 0. Not q's device: in the
    kernel's host code q_h has become q's data pointer (the host LLVM IR reads a "DLTensor" at
    %Q, device memory: a segfault on the H200, 2026-12-01), and the device id is not a
    variable there. A node's GPUs are alike; another count changes only the balance."""
    return (T.call_packed("runtime.GetDeviceAttr", T.int32(2), T.int32(0), T.int32(7))
            if persistent else T.int32(0))


def _score(s, scale, mods: Mods, ma, causal: str, row, col, Lq, Lk, offset, unit: float,
           scaled: bool = True):
    """Element ``s``'s modified score (``common.modified_score``; the slope in
    ``ma.slopes[0, 0]``) in ``unit``s (``LOG2E``: an exp2's argument). ALiBi without a soft
    cap takes the raw form (the slope register holds ``slope / scale``:
    ``alibi_slope_raw``), times ``scale * unit`` unless ``scaled`` is off (the forward scales
    it with the plain scores' factor): an add and an FFMA a score where the scaled form took
    a multiply, an add and an FFMA."""
    at = (s, scale, mods, ma, causal, 0, 0, row, col, Lq, Lk, offset)
    if mods.alibi and not mods.softcap:
        raw = modified_score(*at, raw=True)
        return raw * (scale * T.float32(unit)) if scaled else raw
    return modified_score(*at, unit=unit) if scaled else modified_score(*at) * T.float32(unit)


@dataclasses.dataclass(frozen=True)
class _ByRows:
    """ALiBi by rows (``HopperTile.alibi_rows``) in a forward or dQ thread's accumulator
    layout: element ``i`` of the thread whose first element is at query ``row``, key ``k0 +
    lane % 4 * 2``, sits at distance ``distance + 8 (i % 4 // 2) - (8 (i // 4) + i % 2)``
    (``row + diagonal - col``), so a thread's distances lie in ``[E - (step - 7), E + 8]``.
    Where they share a sign, the bias ``-slope * |distance|`` is ``slope`` (signed) times the
    element's constant ``8 (i // 4) + i % 2`` (:meth:`element`) less the row's part
    (:meth:`bias`), which the softmax takes once a row."""

    causal: str
    step: int

    def distance(self, row, k0, lane, Lq, Lk):
        return row + diagonal(self.causal, Lq, Lk) - (k0 + lane % 4 * 2)

    def crossed(self, row, k0, lane, Lq, Lk):
        """Whether the diagonal crosses the thread's elements (never under a causal mask:
        every visible distance is >= 0): those take the element's form."""
        e = self.distance(row, k0, lane, Lq, Lk)
        return T.And(e < self.step - 7, e + 8 > 0)

    def slope(self, row, k0, lane, Lq, Lk, ma):
        """The raw form's slope (``slope / scale``), negated where the distances are <= 0."""
        if self.causal != "none":
            return ma.slopes[0, 0]
        e = self.distance(row, k0, lane, Lq, Lk)
        return T.if_then_else(e + 8 <= 0, -ma.slopes[0, 0], ma.slopes[0, 0])

    def element(self, x, i, row, k0, lane, Lq, Lk, ma):
        """Raw score ``x`` of element ``i`` plus its constant part: an FFMA with an
        immediate."""
        return x + self.slope(row, k0, lane, Lq, Lk, ma) * T.float32(i // 4 * 8 + i % 2)

    def bias(self, r, row, k0, lane, Lq, Lk, ma):
        """The thread's row ``r``'s part, ``slope * (E + 8 r)``, to subtract."""
        return self.slope(row, k0, lane, Lq, Lk, ma) * T.cast(
            self.distance(row, k0, lane, Lq, Lk) + r * 8, "float32")


PERSISTENT_MAX_WINDOW = 2048
"""Under a sliding window a persistent forward (or dQ) stays one block per SM while a tile
walks at most this many keys (:func:`_few_keys`): every tile but the first few walks about the
same keys, so the fixed assignment stays balanced where causal tiles' would not, and with ~10
steps a tile its fixed costs weigh as they do below ``PERSISTENT_MAX_KEYS``."""


def _few_keys(Lk, rows: int, step: int, mods: Mods, window_left, window_right,
              max_keys: int = PERSISTENT_MAX_KEYS):
    """Host code: whether a tile of ``rows`` queries walks few enough keys for a persistent
    grid: ``Lk <= max_keys`` (``HopperTile.persistent_keys``), or under a window its extent
    (one step more for the first tile's alignment) at most ``PERSISTENT_MAX_WINDOW``."""
    if not mods.window:
        return Lk <= max_keys
    return T.min(Lk, window_left + window_right + rows + step) <= PERSISTENT_MAX_WINDOW


def _every_tile_keyed(causal: str, rows: int, step: int, Lq, Lk, mods: Mods, window_left,
                      window_right, varlen: bool):
    """Host code: whether every query tile of a dense call walks a key tile (``c[4] > 0`` in
    :func:`_locator`), so that a persistent grid may walk them (:func:`_grid`). Tiles
    without one lie at one end (the first ones under a bottom-right mask or a window's right
    edge, the last ones past a top-left window's left edge), so the first and the last tile
    decide. Why: under memcheck on an H100 the persistent forward never finished where a
    block walked a keyless tile between two others (bottom-right, Lq - Lk >= 256, three
    tiles a block; docs/perf.md, "The memcheck hang, found"), and one sweep stalled on that
    forward unsanitized. One block a tile finished on the same shapes, so such calls take
    that grid. The cause, found since, is fixed in the kernels (:func:`release_keyless`);
    this bound stays until that fix has run on a GPU with the persistent grid on those
    shapes. Packed sequences are never persistent."""
    if varlen or (causal == "none" and not mods.window):
        return T.bool(True)
    ma = ModArgs(None, window_left, window_right, None)

    def keyed(r0):
        begin = first_key(causal, r0, Lq, Lk, step, T.int64(0), mods, ma)
        return num_key_tiles(causal, r0, rows, Lq, Lk, step, begin, Lk, mods, ma) > 0

    return T.And(keyed(T.int64(0)), keyed((T.ceildiv(Lq, rows) - 1) * rows))


def _grid(total, sms, tile: HopperTile, causal: str, mods: Mods, varlen: bool, Lq, Lk,
          window_left, window_right):
    """Host code: the int32 count of blocks of the forward's or dQ's grid over ``total`` row
    tiles — one per SM where ``tile.persistent``, a tile walks few keys (:func:`_few_keys`)
    and every tile walks some (:func:`_every_tile_keyed`), else one per tile."""
    if not tile.persistent:
        return T.cast(total, "int32")
    persist = T.And(_few_keys(Lk, tile.rows, tile.step, mods, window_left, window_right,
                              tile.persistent_keys),
                    _every_tile_keyed(causal, tile.rows, tile.step, Lq, Lk, mods, window_left,
                                      window_right, varlen))
    return T.cast(T.if_then_else(persist,
                                 T.min(total, T.max(T.cast(sms, "int64"), T.int64(1))), total),
                  "int32")


def _mine(total, grid, bx, persistent: bool):
    """Row tiles block ``bx`` walks (:func:`_snake`): one round each but, where the last
    round is short, for the blocks it leaves out. int32 like the grid: positions in 64 bits
    cost the persistent forward at D 128 36 bytes of spills (ptxas, 2026-12-01)."""
    total = T.cast(total, "int32")
    rounds = T.ceildiv(total, grid)
    return (T.if_then_else(_snake(rounds - 1, bx, grid, True) < total, rounds, rounds - 1)
            if persistent else 1)


def _fused_block(order: str, bx, tiles, batch, heads):
    """The 5-GEMM dK/dV's block ``bx``: (key tile, batch, KV head) among ``tiles`` key tiles
    of ``batch`` x ``heads`` (``HopperTile.dq_order``): key tile major (``"key"``: every
    head's first key tile, then every head's second) or a head's key tiles adjacent
    (``"head"``). Either way the block before it of its head — the one whose dQ additions it
    waits for — has a smaller ``bx``, so it was launched first. Works on TIR expressions and on
    Python ints alike."""
    if order == "head":
        return bx % tiles, bx // tiles // heads, bx // tiles % heads
    return bx // (batch * heads), bx % (batch * heads) // heads, bx % heads


def _grouped_order(pos, tiles, heads, group_heads):
    """Causal tiles longest first *within* groups of ``group_heads`` (batch x head) pairs,
    group after group: :func:`_block_order` takes them longest first across every head, so
    the blocks resident at once read as many heads' K/V as there are SMs — at N 4096, D 128
    132 heads of 2 MiB each, far beyond the 50 MiB L2, each block streaming its keys from
    DRAM (~2 GiB for the bench's causal forward, ~0.45 ms at 4.8 TB/s against ~0.6 ms of
    products). Groups whose K/V fit the L2 keep them there while every tile of the group
    reads them; the hardware still starts the next group's longest tiles as SMs free up.
    Returns (tile counted from the last, batch x head), a bijection of ``tiles * heads``
    positions (the last group may hold fewer heads)."""
    span = group_heads * tiles
    g = pos // span
    inner = pos - g * span
    members = T.min(group_heads, heads - g * group_heads)
    return inner // members, g * group_heads + inner % members


def _tile_order(causal: str, pos, tiles, heads, l2_bytes: int, head_bytes, sharing: int = 1):
    """The block order of every kernel here: (tile counted from the last, batch x head) of
    position ``pos``. Causal with ``l2_bytes`` (``HopperTile.l2_bytes``): longest first within
    groups of as many heads as fit that many bytes of L2 (:func:`_grouped_order`), each head
    streaming ``head_bytes`` (int64 expression) that ``sharing`` heads of the order share (a
    KV head's K/V rows serve its ``group`` query heads); else :func:`_block_order`."""
    if not (l2_bytes and causal != "none"):
        return _block_order(causal, pos, tiles, heads)
    return _grouped_order(pos, tiles, heads, T.max(
        T.int64(1), T.int64(l2_bytes * sharing) // T.max(head_bytes, T.int64(1))))


def _locator(causal: str, rows: int, step: int, group: int, mods: Mods = NO_MODS,
             varlen: bool = False, l2_bytes: int = 0, row_bytes: int = 0):
    """A macro ``locate(c, pos, nqt, heads, Hq, Lq, Lk, ma, sq, cu_q, cu_k)``: the row tile at
    ``pos`` in :func:`_block_order` — batch, query head, KV head, first query row and key
    tiles into ``c[0:5]`` (forward and dQ blocks of ``rows`` queries, keys walked ``step`` at
    a time); under a window (``ma`` its arguments) also the first key tile's first key into
    ``c[6]``. ``varlen``: the (batch x head) index is (sequence x head); the sequence's first
    query row, query length, first key row, key length and index go to ``sq[0:5]`` (from
    ``cu_q``, ``cu_k``), the batch is 0, positions count within the sequence and a tile past
    its end gets no key tile. ``l2_bytes`` (causal): blocks ordered by :func:`_tile_order`
    in groups of heads whose K/V rows (``row_bytes`` a key, shared by ``group`` query heads)
    fit that many bytes."""

    @T.macro
    def locate(c, pos, nqt, heads, Hq, Lq, Lk, ma, sq, cu_q, cu_k):
        t, bh = T.meta_var(_tile_order(causal, T.cast(pos, "int64"), nqt, heads, l2_bytes,
                                       Lk * T.int64(row_bytes), group))
        c[3] = (nqt - 1 - t) * rows
        if varlen:
            c[0] = T.int64(0)
            pin_sequence(sq, bh // Hq, cu_q, cu_k)
        else:
            c[0] = bh // Hq
        c[1] = bh % Hq
        c[2] = c[1] // group
        lq = T.meta_var(sq[1] if varlen else Lq)
        lk = T.meta_var(sq[3] if varlen else Lk)
        if mods.window:
            c[6] = first_key(causal, c[3], lq, lk, step, T.int64(0), mods, ma)
        c[4] = num_key_tiles(causal, c[3], rows, lq, lk, step, c[6] if mods.window else
                             T.int64(0), lk, mods, ma)
        if varlen:
            if c[3] >= lq:
                c[4] = T.int64(0)

    return locate


PRODUCER_REGS = 24
"""The registers a producer warpgroup keeps (``setmaxnreg.dec``): enough to issue TMA copies
(and, in the 5-GEMM dK/dV, the dQ writer warp's bulk adds); the rest go to the consumers
(:func:`consumer_regs`)."""


def consumer_regs(consumers: int) -> int:
    """The registers a consumer warpgroup's threads get (``setmaxnreg.inc``) when the
    producer keeps :data:`PRODUCER_REGS`, at most 240.

    ``setmaxnreg`` only moves registers within the block's launch allocation, which is not the
    whole 64 Ki register file: the compiled count (the launch bound, one block per SM, at most
    255, a multiple of 8) times the threads, 168 x 384 = 64512 with two consumers. An ``inc``
    asking for more than the producer's ``dec`` freed waits forever: the 5-GEMM dK/dV's
    producer at 32 with consumers at 240 (32 x 128 + 240 x 256 = 65536) hung on the H200."""
    threads = (1 + consumers) * WG
    pool = min(255, 65536 // threads) // 8 * 8 * threads
    return min(240, (pool - PRODUCER_REGS * WG) // (consumers * WG) // 8 * 8)


def _swizzled(chunk, row):
    """Where the 128-byte swizzle (TMA's and wgmma's ``SWIZZLE[128]``) puts 16-byte chunk
    ``chunk`` of 128-byte row ``row`` of a 1024-byte-aligned tile: for threads that write a
    tile which the copy engine or the tensor cores read next."""
    return chunk ^ row % 8


DQ_PAD = 8
"""Floats added to each row of the fused dQ tile with ``HopperTile.dq_pad``: 32 bytes, so
that rows r and r + 1 start 8 banks apart."""


def dq_row(d: int, tile: HopperTile) -> int:
    """Floats a row of the fused dQ tile and of its float32 accumulator take: ``d``, plus
    :data:`DQ_PAD` with ``tile.dq_pad`` (the accumulator's columns ``d`` on are padding)."""
    return d + (DQ_PAD if tile.dq_pad else 0)


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
    round P_j into the registers the next P V reads.

    A block walks one query tile, or (``tile.persistent``, up to ``PERSISTENT_MAX_KEYS`` keys)
    one block per SM walks several in turn (:func:`_snake`): the K/V ring's slots and phases
    run on across them, and a "Q empty" mbarrier lets the producer load the next Q tile once
    both consumers' last S = Q K^T completed, while they still finish P V and store O. FA3's
    ping-pong (the two consumers taking turns to issue their GEMMs on named barriers) was
    measured on top of this and dropped: 0-3% slower at D 64-256 (the journal)."""
    D, dtype, causal, sinks, group = key.head_dim, key.dtype, key.causal, key.sinks, key.group
    mods = Mods(key.window, key.softcap, key.alibi, tile.tanh)
    # scores rewritten before the softmax: in base 2 under a soft cap; ALiBi alone in the raw
    # score's units (modified_score's raw form), scaled as a plain score
    rescored = mods.softcap or mods.alibi
    rows_form, by_rows = tile.alibi_rows, _ByRows(causal, tile.step)  # (``kernel`` checks)
    varlen = key.varlen  # packed sequences (``tvm_flash.kernels.forward.flash_forward``)
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
    chained = tile.chained  # two Q buffers, the next tile's first S with the last P V
    k_off = q_bytes * (2 if chained else 1)
    v_off = k_off + ST * kv_bytes
    o_off = v_off + ST * kv_bytes  # tile.tma_store: O's tile, 64 rows a consumer
    TS = tile.tma_store
    bar_off = o_off + (BM * D * 2 if TS else 0)
    # Q full; K full, V full, K empty, V empty per stage; Q empty (chained: Q full and Q empty
    # of the second Q buffer after them)
    NB = 2 + 4 * ST + (2 if chained else 0)
    pool_bytes = bar_off + 8 * NB
    # descriptor strides (16-byte units): K-major Q and K, 8-row groups 8 ROW apart (SBO);
    # V read MN-major: its atoms (head-dim columns) a stage's rows apart (LBO), 8-row groups
    # 8 ROW apart (SBO)
    v_ldo, v_sdo = BK * ROW, 8 * ROW
    FK, FV, EK, EV = 1, 1 + ST, 1 + 2 * ST, 1 + 3 * ST  # first barrier of each kind
    QE = 1 + 4 * ST
    # (chained) the second Q buffer's full and empty barriers: QF1, QF1 + 1 (past the last
    # barrier otherwise)
    QF1 = 2 + 4 * ST
    regs_consumer = consumer_regs(NC)
    exp2 = exp2_clamped if tile.clamp else T.exp2

    @T.macro
    def load(buf, bars, tmap, j, g, full, hk, b, koff):
        """Key tile ``j`` of this query tile into ring slot ``g`` (counted over the block's
        query tiles); ``koff``: the sequence's first key row (packed sequences)."""
        st = T.meta_var(g % ST)
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[full + st]),
                                                   T.uint32(kv_bytes))
        for a in T.unroll(NA):
            T.ptx[_TMA](T.address_of(buf[st, a, 0, 0]), T.address_of(tmap), a * ATOM,
                        T.cast(j * BK + koff if varlen else j * BK, "int32"),
                        T.cast(hk, "int32"), T.cast(b, "int32"), T.address_of(bars[full + st]))

    @T.macro
    def issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, js, jv, do_s: bool, do_pv: bool):
        """Issue S = Q K_js and/or O += P V_jv (``js``, ``jv``: ring slots), each one commit
        group, once their tiles have arrived. Descriptors and operands are final before the
        one fence: a register a wgmma reads that changes after the fence makes ptxas inject
        another (C7519)."""
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
            gemm_ss(mma_s, s, NS * 4, dq[0], BM, dk[0], BK, D // 16, KA, ROW)
        if do_pv:
            gemm_rs(mma_o, acc, NO * 4, pw, dv[0], BK // 16, ROW)

    @T.macro
    def pv_done(acc, bars, g, elected):
        """Wait for every product issued (the last, P V of ring slot ``g``) and release its
        V."""
        T.ptx.wgmma.wait_group.sync.aligned(0)
        pin(acc, NO * 4)
        if elected:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EV + g % ST]))

    def row_part(r, row, k0, lane, Lq, Lk, ma):
        """ALiBi by rows: the part of row ``r``'s bias the elements left out (none where the
        diagonal crosses them)."""
        b = by_rows.bias(r, row, k0, lane, Lq, Lk, ma)
        if causal != "none":
            return b
        return T.if_then_else(by_rows.crossed(row, k0, lane, Lq, Lk), T.float32(0), b)

    @T.macro
    def rescore(s, row, k0, lane, Lq, Lk, scale, ma):
        """S_j's modified scores, each element by ``modified_score`` (in base 2 under a soft
        cap; ALiBi alone in the raw score's units)."""
        for i in T.unroll(NS * 4):
            s[i] = _score(s[i], scale, mods, ma, causal, row + i % 4 // 2 * 8,
                          k0 + lane % 4 * 2, Lq, Lk, -(i // 4 * 8 + i % 2), LOG2E,
                          scaled=False)

    @T.macro
    def softmax(s, p, acc, m, mn, msub, lsum, bars, j, g, row, lane, scale2, elected,
                Lq, Lk, c, scale, ma, last_pv: bool = False, rescale: bool = True):
        """S_j (ring slot ``g``) is complete: release K_j, online softmax in place; once
        P_{j-1} V_{j-1} is complete, release V_{j-1}, rescale O and round P_j into the
        registers it read. Score modifiers (``ma``: their arguments, the slope in a register)
        rewrite S_j in base 2 first; under a window the key tiles are counted from ``c[6]``
        and a step is masked where it crosses an edge (:func:`_mask_needed`).
        ``tile.clamp`` off: exp2 of the scores unclamped (``HopperTile``). ``last_pv``
        (chained, ``j`` 0): the P V to wait for is the last tile's; ``rescale`` off: O is not
        this tile's yet (chained) or still zero, left as it is."""
        k0 = T.meta_var((j + c[6] // BK) * BK if mods.window else j * BK)
        pin(s, NS * 4)
        if elected:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EK + g % ST]))
        if rows_form and causal == "none" and by_rows.crossed(row, k0, lane, Lq, Lk):
            rescore(s, row, k0, lane, Lq, Lk, scale, ma)  # the diagonal crosses the thread
        elif rows_form:  # the element's part; the row's part below
            for i in T.unroll(NS * 4):
                s[i] = by_rows.element(s[i], i, row, k0, lane, Lq, Lk, ma)
        elif rescored:
            rescore(s, row, k0, lane, Lq, Lk, scale, ma)
        if _mask_needed(causal, c[3], BM, k0, BK, Lk, Lq, Lk, mods=mods, ma=ma):
            for i in T.unroll(NS * 4):
                if not visible(causal, row + i % 4 // 2 * 8,
                               k0 + i // 4 * 8 + lane % 4 * 2 + i % 2, Lq, Lk, None, mods, ma):
                    s[i] = neg_inf()
        for r in T.unroll(2):
            mn[r] = _row_tree(T.max, s, r, NS)
            if rows_form:  # the thread's row part, before the quad's max (crossed: 0) ...
                mn[r] = mn[r] - row_part(r, row, k0, lane, Lq, Lk, ma)
            quad_reduce(mn, r, T.max)
            mn[r] = T.max(m[r], mn[r] * scale2)
            if rows_form:  # ... and into the exponent's subtrahend
                msub[r] = (T.if_then_else(mn[r] == neg_inf(), T.float32(0), mn[r])
                           + row_part(r, row, k0, lane, Lq, Lk, ma) * scale2)
            else:
                msub[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(0), mn[r])
        for i in T.unroll(NS * 4):
            if i % 8 < tile.exp2_fma:  # (unrolled: a constant per element)
                s[i] = exp2_fma(s[i] * scale2 - msub[_lane_row(i, NS)])
            else:
                s[i] = exp2(s[i] * scale2 - msub[_lane_row(i, NS)])
        for r in T.unroll(2):
            m[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(1),
                                  exp2(m[r] - mn[r]))
            lsum[r] = lsum[r] * m[r] + _row_tree(T.Add, s, r, NS)
        if last_pv:
            pv_done(acc, bars, g - 1, elected)
        elif j > 0:
            pv_done(acc, bars, g - 1, elected)  # P_{j-1} V_{j-1}
        if rescale:
            for i in T.unroll(NO * 4):  # O times its rows' factors
                acc[i] = acc[i] * m[_lane_row(i, NO)]
        for r in T.unroll(2):
            m[r] = mn[r]
        for i in T.unroll(NS * 4):
            p[i] = T.cast(s[i], dtype)

    @T.macro
    def sums(lsum, inv):
        """A tile's row sums over their quads, and their inverses into ``inv`` (0 for a row
        that saw no key)."""
        for r in T.unroll(2):
            quad_reduce(lsum, r, T.Add)
            inv[r] = T.if_then_else(lsum[r] == T.float32(0), T.float32(0),
                                    T.float32(1) / lsum[r])

    @T.macro
    def begin(acc, m, lsum, sl, c, sq, lane, Slopes, Sinks, scale, zero_acc: bool):
        """A query tile's start: its ALiBi slope, O zero (``zero_acc``), the running max and
        sum (a sink's logit, or none)."""
        if mods.alibi:
            sl[0, 0] = alibi_slope_raw(mods, Slopes[sq[4] if varlen else c[0], c[1]], scale)
        if zero_acc:
            for i in T.unroll(NO * 4):
                acc[i] = T.float32(0)
        for r in T.unroll(2):
            if sinks:
                m[r] = Sinks[c[1]] * T.float32(LOG2E)
                lsum[r] = T.if_then_else(lane % 4 == 0, T.float32(1), T.float32(0))
            else:
                m[r] = neg_inf()
                lsum[r] = T.float32(0)

    @T.macro
    def store(Os, Of, omap, LSE, acc, inv, m, lsum, b, h, q0, sq, it, cw, lane, tx, elected,
              Lq, ob, oh, ol, lse: bool):
        """Query tile ``it`` (batch ``b``, head ``h``, first row ``q0``) out: O times ``inv``
        (the rows' 1 / sums) and, with ``lse``, its LSE from ``m`` and ``lsum``.
        ``tile.tma_store``: O into this consumer's shared tile, swizzled as the tensor map
        reads it (_swizzled), then one bulk store per atom; rows past Lq are outside the map
        and not written. The tile is rewritten only once the last tile's store has read it."""
        row = T.meta_var(q0 + cw * 64 + tx % WG // 32 * 16 + lane // 4)  # + 8 r
        if TS:
            orl = T.meta_var(tx % WG // 32 * 16 + lane // 4)  # + 8 r
            if it > 0:
                if elected:
                    T.ptx["cp.async.bulk.wait_group.read"](0)
                T.ptx.barrier.sync.aligned(T.cast(1 + cw, "uint32"), WG)
            for r in T.unroll(2):
                for n in T.unroll(NO):
                    for e in T.vectorized(2):
                        Os[cw, n * 8 // ATOM, orl + r * 8,
                           _swizzled(n % (ATOM // 8), lane // 4 + r * 8) * 8
                           + lane % 4 * 2 + e] = T.cast(acc[n * 4 + r * 2 + e] * inv[r],
                                                        dtype)
            T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.barrier.sync.aligned(T.cast(1 + cw, "uint32"), WG)
            if elected:
                for a in T.unroll(NA):
                    T.ptx[_TMA_STORE](T.address_of(omap), a * ATOM,
                                      T.cast(q0 + cw * 64, "int32"),
                                      T.cast(h, "int32"), T.cast(b, "int32"),
                                      T.address_of(Os[cw, a, 0, 0]))
                T.ptx["cp.async.bulk.commit_group"]()
        for r in T.unroll(2):
            if row + r * 8 < (sq[1] if varlen else Lq):
                orow = T.meta_var(row + r * 8 + sq[0] if varlen else row + r * 8)
                if not TS:
                    for n in T.unroll(NO):
                        for e in T.vectorized(2):
                            Of[b * ob + h * oh + orow * ol + n * 8
                               + lane % 4 * 2 + e] = T.cast(acc[n * 4 + r * 2 + e]
                                                            * inv[r], dtype)
                if lse:
                    if lane % 4 == 0:
                        LSE[b, h, orow] = row_lse(m[r], lsum[r])

    locate = _locator(causal, BM, BK, group, mods, varlen, tile.l2_bytes, 4 * D)

    @T.prim_func
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle,
                  o_h: T.handle, lse_h: T.handle, scale: T.float32, slopes_h: T.handle,
                  window_left: T.int64, window_right: T.int64, softcap: T.float32,
                  cuq_h: T.handle, cuk_h: T.handle, max_seqlen_q: T.int64,
                  max_seqlen_k: T.int64):
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
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_fwd", Q, K, V, O)
        # the grid, decided here on the host (persistent: one block per SM, which one block
        # fills): the kernel receives it as one number
        sms: T.let[T.int32] = _sm_count(tile.persistent)
        nqt = T.meta_var(T.ceildiv(max_seqlen_q if varlen else Lq, BM))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hq)  # (batch or sequence) x head
        total = T.meta_var(heads * nqt)  # query tiles
        grid: T.let[T.int32] = _grid(total, sms, tile, causal, mods, varlen, Lq, Lk,
                                     window_left, window_right)
        qmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(qmap, Q, ATOM, BM, SW)
        kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(kmap, K, ATOM, BK, SW)
        vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(vmap, V, ATOM, BK, SW)
        omap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        if TS:
            _tmap(omap, O, ATOM, 64, SW)
        T.device_entry()
        # one block per SM: the register cap that setmaxnreg redistributes
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx = T.cta_id([grid])
        tx = T.thread_id([NT])
        pool = T.alloc_buffer((pool_bytes,), "uint8", scope="shared.dyn", align=1024)
        Qs = T.decl_buffer((NA, BM, ATOM), dtype, data=pool.data, elem_offset=0,
                           scope="shared.dyn")
        Q2 = T.decl_buffer((2, NA, BM, ATOM), dtype, data=pool.data, elem_offset=0,
                           scope="shared.dyn")  # (chained) both Q buffers
        Ks = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=k_off // 2,
                           scope="shared.dyn")
        Vs = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=v_off // 2,
                           scope="shared.dyn")
        bars = T.decl_buffer((NB,), "uint64", data=pool.data, elem_offset=bar_off // 8,
                             scope="shared.dyn")
        Os = T.decl_buffer((NC, NA, 64, ATOM), dtype, data=pool.data, elem_offset=o_off // 2,
                           scope="shared.dyn")
        Of = T.decl_buffer((B * ob,), dtype, data=O.data)
        # b, h, kv head, q0, key tiles of the query tile; ring slots used by the ones before
        c = T.alloc_buffer((7 if mods.window else 6,), "int64", scope="local")
        if varlen:  # the tile's sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        # the block's query tiles, in rounds over _block_order (causal: longest first): bx in
        # even rounds, grid - 1 - bx in odd ones, so that a block's long and short tiles even
        # out; a round's blocks walk adjacent tiles (a head's, sharing its K/V in L2)
        mine = T.meta_var(_mine(total, grid, bx, tile.persistent))
        if tx == 0:
            for i in T.unroll(NB):
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[i]),
                                               T.uint32(1 if i < EK or i == QF1 else NC))
            T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        c[5] = T.int64(0)

        if tx < WG:  # ------------------------------------------------------------ producer
            T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS)
            if tx == 0:
                for it in T.serial(mine):
                    locate(c, _snake(it, bx, grid, tile.persistent), nqt, heads, Hq, Lq, Lk,
                           ModArgs(Slopes, window_left, window_right, softcap),
                           sq if varlen else None, CuQ, CuK)
                    # the Q tile is reloaded once both consumers' products with it completed
                    if chained:  # into buffer it % 2, last read by tile it - 2
                        if it > 1:
                            T.cuda.mbarrier_wait(T.address_of(bars[QE + it % 2 * 2]),
                                                 (it // 2 - 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(
                            T.address_of(bars[it % 2 * QF1]), T.uint32(q_bytes))
                        for a in T.unroll(NA):
                            T.ptx[_TMA](T.address_of(Q2[it % 2, a, 0, 0]), T.address_of(qmap),
                                        a * ATOM, T.cast(c[3], "int32"), T.cast(c[1], "int32"),
                                        T.cast(c[0], "int32"), T.address_of(bars[it % 2 * QF1]))
                    else:
                        if it > 0:
                            T.cuda.mbarrier_wait(T.address_of(bars[QE]), (it - 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[0]),
                                                                   T.uint32(q_bytes))
                        for a in T.unroll(NA):
                            T.ptx[_TMA](T.address_of(Qs[a, 0, 0]), T.address_of(qmap),
                                        a * ATOM,
                                        T.cast(c[3] + sq[0] if varlen else c[3], "int32"),
                                        T.cast(c[1], "int32"), T.cast(c[0], "int32"),
                                        T.address_of(bars[0]))
                    for j in T.serial(c[4]):
                        # a slot is refilled once both consumers released its previous tile
                        g = T.meta_var(c[5] + j)
                        if g >= ST:
                            T.cuda.mbarrier_wait(T.address_of(bars[EK + g % ST]),
                                                 (g // ST - 1) % 2)
                        load(Ks, bars, kmap, j + c[6] // BK if mods.window else j, g, FK, c[2],
                             c[0], sq[2] if varlen else None)
                        if g >= ST:
                            T.cuda.mbarrier_wait(T.address_of(bars[EV + g % ST]),
                                                 (g // ST - 1) % 2)
                        load(Vs, bars, vmap, j + c[6] // BK if mods.window else j, g, FV, c[2],
                             c[0], sq[2] if varlen else None)
                    c[5] = c[5] + c[4]
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
            scale2 = T.meta_var(T.float32(1) if mods.softcap else scale * T.float32(LOG2E))
            if mods.alibi:  # the query tile's slope (its head's), as ModArgs.slopes[0, 0]
                sl = T.alloc_buffer((1, 1), F32, scope="local")
            ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                    softcap))
            elected = T.meta_var(tx % WG == 0)  # one thread per warpgroup arrives
            if chained:
                # tile it's O waits for the next tile's first softmax: its 1 / sums, batch,
                # head, first row and key tiles meanwhile
                inv = T.alloc_buffer((2,), F32, scope="local")
                co = T.alloc_buffer((4,), "int64", scope="local")
                # tile 0 (every block has one): its first S alone
                locate(c, _snake(0, bx, grid, True), nqt, heads, Hq, Lq, Lk, ma, None, CuQ, CuK)
                begin(acc, m, lsum, sl if mods.alibi else None, c, None, lane, Slopes, Sinks,
                      scale, True)
                _desc(dq[0], T.address_of(Q2[0, 0, cw * 64, 0]), 1, 8 * ROW, SW)
                T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
                if c[4] > 0:
                    issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, c[5], c[5], True, False)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    softmax(s, p, acc, m, mn, msub, lsum, bars, T.int64(0), c[5], row, lane,
                            scale2, elected, Lq, Lk, c, scale, ma, rescale=False)
                for it in T.serial(mine):
                    # tile it's S_0 is in P; steps 1..n-1 as below
                    n = T.meta_var(c[4])
                    g = T.meta_var(c[5])
                    for j in T.serial(n - 1):
                        issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, g + j + 1, g + j, True,
                              True)
                        T.ptx.wgmma.wait_group.sync.aligned(1)  # S done, P V may run on
                        softmax(s, p, acc, m, mn, msub, lsum, bars, j + 1, g + j + 1, row,
                                lane, scale2, elected, Lq, Lk, c, scale, ma)
                    # every S with this Q buffer is complete: the producer may refill it
                    if n > 0:
                        if elected:
                            T.ptx.mbarrier.arrive.shared.b64(
                                T.address_of(bars[QE + it % 2 * 2]))
                    else:
                        release_keyless(bars, QE + it % 2 * 2, cw, elected)
                    sums(lsum, inv)
                    for r in T.unroll(2):  # the tile's LSE, before the next tile's m, lsum
                        if row + r * 8 < Lq:
                            if lane % 4 == 0:
                                LSE[c[0], c[1], row + r * 8] = row_lse(m[r], lsum[r])
                    co[0] = c[0]
                    co[1] = c[1]
                    co[2] = c[3]
                    co[3] = c[4]
                    c[5] = c[5] + c[4]
                    if it + 1 < mine:
                        locate(c, _snake(it + 1, bx, grid, True), nqt, heads, Hq, Lq, Lk, ma,
                               None, CuQ, CuK)
                        begin(acc, m, lsum, sl if mods.alibi else None, c, None, lane, Slopes,
                              Sinks, scale, False)
                        _desc(dq[0], T.address_of(Q2[(it + 1) % 2, 0, cw * 64, 0]), 1, 8 * ROW,
                              SW)
                        T.cuda.mbarrier_wait(T.address_of(bars[(it + 1) % 2 * QF1]),
                                             (it + 1) // 2 % 2)
                    else:
                        c[4] = T.int64(0)
                    # the next tile's S_0 and this one's last P V in flight together; the
                    # next tile's first softmax while P V runs (O left as it is)
                    if co[3] > 0 and c[4] > 0:
                        issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, c[5], c[5] - 1, True, True)
                        T.ptx.wgmma.wait_group.sync.aligned(1)
                        softmax(s, p, acc, m, mn, msub, lsum, bars, T.int64(0), c[5], row, lane,
                                scale2, elected, Lq, Lk, c, scale, ma, last_pv=True,
                                rescale=False)
                    else:
                        if co[3] > 0:
                            issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, c[5] - 1, c[5] - 1,
                                  False, True)
                            pv_done(acc, bars, c[5] - 1, elected)
                        if c[4] > 0:
                            issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, c[5], c[5], True,
                                  False)
                            T.ptx.wgmma.wait_group.sync.aligned(0)
                            softmax(s, p, acc, m, mn, msub, lsum, bars, T.int64(0), c[5], row,
                                    lane, scale2, elected, Lq, Lk, c, scale, ma, rescale=False)
                    store(Os, Of, omap, LSE, acc, inv, m, lsum, co[0], co[1], co[2], None, it,
                          cw, lane, tx, elected, Lq, ob, oh, ol, False)
                    for i in T.unroll(NO * 4):
                        acc[i] = T.float32(0)
            else:
                _desc(dq[0], T.address_of(Qs[0, cw * 64, 0]), 1, 8 * ROW, SW)
                for it in T.serial(mine):
                    locate(c, _snake(it, bx, grid, tile.persistent), nqt, heads, Hq, Lq, Lk, ma,
                           sq if varlen else None, CuQ, CuK)
                    begin(acc, m, lsum, sl if mods.alibi else None, c, sq if varlen else None, lane,
                          Slopes, Sinks, scale, True)
                    T.cuda.mbarrier_wait(T.address_of(bars[0]), it % 2)
                    n = T.meta_var(c[4])
                    g = T.meta_var(c[5])
                    if n > 0:
                        # step 0: S_0 alone; steps 1..n-1: S_j = Q K_j and O += P_{j-1} V_{j-1}
                        # in flight together; then the last P V. Peeled so that the steady loop
                        # has no branch around a wgmma (ptxas serialises wgmma it cannot follow).
                        issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, g, g, True, False)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        softmax(s, p, acc, m, mn, msub, lsum, bars, T.int64(0), g, row, lane,
                                scale2, elected, sq[1] if varlen else Lq, sq[3] if varlen else Lk,
                                c, scale, ma)
                        for j in T.serial(n - 1):
                            issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, g + j + 1, g + j, True,
                                  True)
                            T.ptx.wgmma.wait_group.sync.aligned(1)  # S done, P V may run on
                            softmax(s, p, acc, m, mn, msub, lsum, bars, j + 1, g + j + 1, row,
                                    lane, scale2, elected, sq[1] if varlen else Lq,
                                    sq[3] if varlen else Lk, c, scale, ma)
                        # every S is complete: the producer may load the next query tile
                        if elected:
                            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[QE]))
                        issue(s, pw, acc, Ks, Vs, bars, dq, dk, dv, g + n - 1, g + n - 1, False,
                              True)
                        pv_done(acc, bars, g + n - 1, elected)
                    else:
                        release_keyless(bars, QE, cw, elected)

                    sums(lsum, mn)
                    store(Os, Of, omap, LSE, acc, mn, m, lsum, c[0], c[1], c[3],
                          sq if varlen else None, it, cw, lane, tx, elected, Lq, ob, oh, ol, True)
                    c[5] = c[5] + c[4]
            if TS and elected:  # the shared tile outlives its last store's reads
                T.ptx["cp.async.bulk.wait_group.read"](0)

    return trim_params(flash_fwd, mods, varlen)


def variants(key: KernelKey) -> list[HopperTile]:
    """The tiles a tuner may measure for ``key`` (``tvm_flash.tuning.tune_variants``), its
    default (:func:`tile`) first: every step of 32-192 rows in 16-row multiples the tile's
    other side allows, two or three stages, persistent or not (forward and dQ) — each one
    :func:`kernel` accepts (shared memory, shape rules). Registers are not checked: a variant
    that spills measures slow. The fused dQ tile is not among them (another calling
    convention); keys with score modifiers or packed sequences have none (their extra
    arguments are scalars, or sized by the data)."""
    default = tile(key)
    if key.mods or key.varlen:
        return []
    found = [default]
    persistent = (False, True) if key.op != "dkv" else (False,)
    for consumers, step, stages, pers in itertools.product(
            (2, 3), (32, 64, 96, 128, 160, 192), (2, 3), persistent):
        if consumers == 3 and (default.split or not _three_fit(key, step)):
            continue
        candidate = dataclasses.replace(default, consumers=consumers, step=step, stages=stages,
                                        persistent=pers)
        if candidate in found:
            continue
        try:
            _check(key, candidate)
        except ValueError:
            continue
        found.append(candidate)
    return found


def _three_fit(key: KernelKey, step: int) -> bool:
    """Whether three consumer warpgroups (160 registers a thread) keep ``step``-row steps in
    registers, from ptxas (bf16): the forward while O's D / 2, S's step / 2 and P's step / 4
    registers leave ~30 (D 64 step 128 and D 128 step 80 fit, D 128 step 96 spills 32 bytes);
    dQ at D 64 up to 64-key steps and dK/dV at D 64 up to 32-query steps (dK/dV 64: 92
    bytes, dQ D 128 64: 204)."""
    if key.op == "fwd":
        return key.head_dim // 2 + 3 * step // 4 <= 130
    if key.head_dim > 64:
        return False
    return step <= (64 if key.op == "dq" else 32)


def kernel(key: KernelKey, tile_override: HopperTile | None = None):
    """The PrimFunc of ``key`` (a key this module :func:`writes`; the sweep builds unserved
    ones too)."""
    chosen = tile_override or tile(key)
    _check(key, chosen)
    return KERNELS[key.op](key, chosen)


def _check(key: KernelKey, chosen: HopperTile) -> None:
    """Refuse a key this module does not write, or a tile it cannot build for it."""
    if not writes(key):
        raise ValueError(f"{key.name}: not a Hopper kernel key")
    if chosen.step % 16:
        raise ValueError(f"{key.name}: tile {chosen}: the step must be a multiple of 16 rows")
    if chosen.consumers not in (2, 3):
        raise ValueError(f"{key.name}: tile {chosen}: two or three consumer warpgroups")
    if chosen.split and (key.op != "dkv" or chosen.consumers != 2):
        raise ValueError(f"{key.name}: tile {chosen}: a split tile is a dK/dV one of two "
                         "consumer warpgroups")
    if chosen.persistent and key.op == "dkv":
        raise ValueError(f"{key.name}: tile {chosen}: dK/dV is not persistent")
    if chosen.dq and (key.op != "dkv" or key.head_dim != 128 or chosen.step != 64
                      or chosen.consumers != 2 or chosen.split or key.mods or key.varlen):
        raise ValueError(f"{key.name}: tile {chosen}: the fused dQ is written for dK/dV at D 128, "
                         "64-query steps, two consumer warpgroups, not split, no score "
                         "modifier")
    if not chosen.ordered and not chosen.dq:
        raise ValueError(f"{key.name}: tile {chosen}: only the fused dQ has an order to drop")
    if chosen.dq_order not in ("key", "head") or chosen.dq_order != "key" and not chosen.dq:
        raise ValueError(f"{key.name}: tile {chosen}: dq_order is the fused dQ's block order, "
                         "'key' or 'head'")
    if chosen.dq_pad and not chosen.dq:
        raise ValueError(f"{key.name}: tile {chosen}: dq_pad is the fused dQ tile's layout")
    if chosen.tma_store and (key.op != "fwd" or key.varlen or atom(key.head_dim) != 64):
        raise ValueError(f"{key.name}: tile {chosen}: the bulk store of O is the forward's, at "
                         "head dims that are multiples of 64, without packed sequences")
    if chosen.chained and (key.op != "fwd" or not chosen.persistent or key.varlen):
        raise ValueError(f"{key.name}: tile {chosen}: chained tiles are a persistent forward's, "
                         "without packed sequences")
    if not 0 <= chosen.exp2_fma <= 8 or chosen.exp2_fma and key.op != "fwd":
        raise ValueError(f"{key.name}: tile {chosen}: exp2_fma is the forward's, 0 to 8 of "
                         "every 8 scores")
    if chosen.alibi_rows and (not key.alibi or key.softcap or key.op == "dkv"
                              or key.op == "dq" and chosen.clamp):
        raise ValueError(f"{key.name}: tile {chosen}: alibi_rows is the forward's and the "
                         "unclamped dQ's, for ALiBi without a soft cap")
    for field in ("overlap", "stats_early"):  # written into the plain dK/dV step only
        if getattr(chosen, field) and (key.op != "dkv" or chosen.split or chosen.dq):
            raise ValueError(f"{key.name}: tile {chosen}: {field} is the dK/dV's, neither "
                             "split nor with the fused dQ")
    if chosen.p_once and key.op != "dkv":
        raise ValueError(f"{key.name}: tile {chosen}: p_once is the dK/dV's")
    if chosen.l2_bytes < 0 or chosen.l2_bytes and key.varlen:
        raise ValueError(f"{key.name}: tile {chosen}: l2_bytes orders the blocks of dense "
                         "calls (not packed sequences), a byte count >= 0")
    if chosen.persistent_keys < 1:
        raise ValueError(f"{key.name}: tile {chosen}: persistent_keys must be positive")
    if chosen.tanh not in TANH_FORMS:
        raise ValueError(f"{key.name}: tile {chosen}: tanh must be one of {TANH_FORMS}")
    if chosen.tanh != "exp2" and not key.softcap:
        raise ValueError(f"{key.name}: tile {chosen}: a tanh form is for keys with a soft cap")
    if chosen.smem_bytes(key.head_dim, key.op) > SMEM_LIMIT:
        raise ValueError(f"{key.name}: tile {chosen} needs "
                         f"{chosen.smem_bytes(key.head_dim, key.op)} bytes of shared memory, "
                         f"more than {SMEM_LIMIT}")


# --------------------------------------------------------------------------------- backward
# The maths of ``kernels.backward`` and of the ``mma.sync`` backward (P recomputed from the LSE
# with the clamped exp2, 0 where masked or where the row saw no key; dS = P (dP - Delta); P and
# dS rounded to the input dtype before their products; dQ and dK scaled by ``scale`` on the
# way out), split as there into a dQ kernel and a dK/dV kernel so that every output element
# has exactly one writer: no atomics, the same bits on every run.


def flash_dq(key: KernelKey, tile: HopperTile):
    """``flash_dq(q, k, v, do, lse, o, delta, dq, scale)``: a block owns ``tile.rows`` query
    rows (64 per consumer warpgroup) of one query head and walks the key tiles its rows see.

    It also computes Delta = rowsum(dO * O) of its rows and writes it (``bwd_pre``'s work,
    absorbed: :data:`ABSORBS`): each consumer thread reduces its two rows in the layout its
    LSE and Delta are read in, four lanes a row, 16-byte loads of O and dO issued before the
    first product and summed in float32, then two shuffles; a quad's first lane writes the
    row's Delta, which dK/dV (launched after this kernel) reads. It runs while the producer's
    loads of Q, dO and the first key tiles are in flight.

    The producer loads the Q and dO tiles once and K_j and V_j (``tile.step`` keys) into a ring
    of ``tile.stages`` stages, one "full" and one "empty" mbarrier per stage. Consumer step
    ``j``: S_j = Q K_j^T and dP_j = dO V_j^T (both operands from shared memory, K-major: V's
    rows are keys like K's), then dQ += dS_{j-1} K_{j-1} (dS from registers in the A layout,
    K read MN-major as V is in the forward's P V) — three commit groups in flight together;
    P_j from the LSE once S_j is complete, dS_j = P_j (dP_j - Delta) once dP_j is, and only
    once dQ += dS_{j-1} K_{j-1} is complete are dS_j's rounded words written over those it
    read and the stage of K_{j-1}, V_{j-1} released. The first and last steps are peeled (no
    branch around a wgmma in the loop). LSE and Delta of the thread's two rows stay in
    registers; a row past the end or without any key gets LSE = +inf, hence P = 0.

    ``tile.persistent``: as the forward's (:func:`flash_forward`), one block per SM walks row
    tiles up to ``PERSISTENT_MAX_KEYS`` keys; the ring runs on across them and a "Q empty"
    mbarrier lets the producer load the next Q and dO tiles once both consumers' last S and
    dP completed."""
    D, dtype, causal = key.head_dim, key.dtype, key.causal
    mods = Mods(key.window, key.softcap, key.alibi, tile.tanh)
    rows_form, by_rows = tile.alibi_rows, _ByRows(causal, tile.step)  # (``kernel`` checks)
    varlen = key.varlen  # packed sequences, as the forward's
    BM, BK, ST, NC = tile.rows, tile.step, tile.stages, tile.consumers
    NT = tile.threads
    ATOM = atom(D)
    NA, KA = D // ATOM, ATOM // 16
    ROW = ATOM * 2 // 16
    SW = SWIZZLE[ATOM * 2]
    NS, NO = BK // 8, D // 8
    ab = _PTX[dtype]
    mma_s = f"wgmma.mma_async.sync.aligned.m64n{BK}k16.f32.{ab}.{ab}"
    mma_o = f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"
    q_bytes, kv_bytes = BM * D * 2, BK * D * 2
    do_off = q_bytes
    k_off = 2 * q_bytes
    v_off = k_off + ST * kv_bytes
    bar_off = v_off + ST * kv_bytes
    NB = 2 + 2 * ST  # Q and dO full; full, empty per stage; Q and dO empty
    FULL, EMPTY, QE = 1, 1 + ST, 1 + 2 * ST
    pool_bytes = bar_off + 8 * NB
    kt_ldo, kt_sdo = BK * ROW, 8 * ROW  # K read MN-major (dQ += dS K), as V in the forward
    regs_consumer = consumer_regs(NC)
    # Delta's 16-byte loads of O and of dO in flight at once per lane, a divisor of the row's
    # D / 32 (D 160 and 224: 5 and 7, one at a time): all of a row's up to D 128, at most 4
    # above (32 registers of each; ptxas spills the same with 1 to 8 at D 256)
    DW = max(w for w in range(1, 5) if D // 32 % w == 0)

    @T.macro
    def issue(s, dp, dsw, acc, Ks, Vs, bars, dqa, doa, dk, dv, dkt, js, jd, do_sd: bool,
              do_dq: bool):
        """Issue S_js = Q K_js^T, dP_js = dO V_js^T (once their stage has arrived; one commit
        group each) and/or dQ += dS_jd K_jd (one group), behind one fence, with nothing in
        flight (``js``, ``jd``: ring slots)."""
        if do_sd:
            _desc(dk[0], T.address_of(Ks[js % ST, 0, 0, 0]), 1, 8 * ROW, SW)
            _desc(dv[0], T.address_of(Vs[js % ST, 0, 0, 0]), 1, 8 * ROW, SW)
            T.cuda.mbarrier_wait(T.address_of(bars[FULL + js % ST]), js // ST % 2)
        if do_dq:
            _desc(dkt[0], T.address_of(Ks[jd % ST, 0, 0, 0]), kt_ldo, kt_sdo, SW)
        pin(s, NS * 4)
        pin(dp, NS * 4)
        pin_u32(dsw, NS * 2)
        pin(acc, NO * 4)
        T.ptx.wgmma.fence.sync.aligned()
        if do_sd:
            gemm_ss(mma_s, s, NS * 4, dqa[0], BM, dk[0], BK, D // 16, KA, ROW)
            gemm_ss(mma_s, dp, NS * 4, doa[0], BM, dv[0], BK, D // 16, KA, ROW)
        if do_dq:
            gemm_rs(mma_o, acc, NO * 4, dsw, dkt[0], BK // 16, ROW)

    def prob(s, i, row, lane, k0, lse, scale, Lq, Lk, ma):
        """P of element ``i`` of a complete S (``_prob`` unguarded) of its modified score
        (``s * scale`` itself without a soft cap or ALiBi; ``ma.slopes[0, 0]``: the tile's
        slope)."""
        score = _score(s[i], scale, mods, ma, causal, row + i % 4 // 2 * 8, k0 + lane % 4 * 2,
                       Lq, Lk, -(i // 4 * 8 + i % 2), 1.0 if tile.clamp else LOG2E)
        if not tile.clamp:  # the LSE in base 2 (scaled where loaded): one FFMA a score
            return T.exp2(score - lse[i % 4 // 2])
        return exp2_clamped((score - lse[i % 4 // 2]) * T.float32(LOG2E))

    @T.macro
    def grads(s, dp, ds, acc, lse, delta, bars, j, g, row0, row, lane, elected, scale, Lq,
              Lk, dq_in_flight: bool, c, ma):
        """S_j and dP_j (ring slot ``g``) are in flight (and dQ += dS_{j-1} K_{j-1} after
        them): P_j in place of S_j once S_j is complete, dS_j in place once dP_j is; once the
        dQ product is complete, release slot g - 1 and round dS_j into the words it read.
        Under a soft cap dS_j needs S_j itself (``1 - tanh^2``): both are awaited first and
        dS_j made in one pass. Under a window the key tiles are counted from ``c[6]`` and a
        step is masked where it crosses an edge."""
        k0 = T.meta_var((j + c[6] // BK) * BK if mods.window else j * BK)
        masked = T.meta_var(_mask_needed(causal, row0, 64, k0, BK, Lk, Lq, Lk, mods=mods,
                                         ma=ma))
        if mods.softcap:
            T.ptx.wgmma.wait_group.sync.aligned(1 if dq_in_flight else 0)  # S_j, dP_j done
            pin(s, NS * 4)
            pin(dp, NS * 4)
            for i in T.unroll(NS * 4):
                s[i] = (prob(s, i, row, lane, k0, lse, scale, Lq, Lk, ma)
                        * (dp[i] - delta[i % 4 // 2]) * softcap_slope(s[i], scale, mods, ma))
            if masked:
                for i in T.unroll(NS * 4):
                    if not visible(causal, row + i % 4 // 2 * 8,
                                   k0 + i // 4 * 8 + lane % 4 * 2 + i % 2, Lq, Lk, None, mods,
                                   ma):
                        s[i] = T.float32(0)
        else:
            T.ptx.wgmma.wait_group.sync.aligned(2 if dq_in_flight else 1)  # S_j done
            pin(s, NS * 4)
            if rows_form and not (causal == "none" and by_rows.crossed(row, k0, lane, Lq, Lk)):
                for i in T.unroll(NS * 4):  # the element's part; the row's part in the LSE
                    s[i] = T.exp2(by_rows.element(s[i], i, row, k0, lane, Lq, Lk, ma)
                                  * (scale * T.float32(LOG2E))
                                  - (lse[i % 4 // 2] + by_rows.bias(i % 4 // 2, row, k0, lane,
                                                                    Lq, Lk, ma)
                                     * (scale * T.float32(LOG2E))))
            else:
                for i in T.unroll(NS * 4):
                    s[i] = prob(s, i, row, lane, k0, lse, scale, Lq, Lk, ma)
            if masked:
                for i in T.unroll(NS * 4):
                    if not visible(causal, row + i % 4 // 2 * 8,
                                   k0 + i // 4 * 8 + lane % 4 * 2 + i % 2, Lq, Lk, None, mods,
                                   ma):
                        s[i] = T.float32(0)
            T.ptx.wgmma.wait_group.sync.aligned(1 if dq_in_flight else 0)  # dP_j done
            pin(dp, NS * 4)
            for i in T.unroll(NS * 4):
                s[i] = s[i] * (dp[i] - delta[i % 4 // 2])
        if dq_in_flight:
            T.ptx.wgmma.wait_group.sync.aligned(0)  # dQ += dS_{j-1} K_{j-1} done
            pin(acc, NO * 4)
            if elected:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + (g - 1) % ST]))
        for i in T.unroll(NS * 4):
            ds[i] = T.cast(s[i], dtype)

    locate = _locator(causal, BM, BK, key.group, mods, varlen, tile.l2_bytes, 4 * D)

    @T.prim_func
    def flash_dq(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
                 o_h: T.handle, delta_h: T.handle, dq_h: T.handle, scale: T.float32,
                 slopes_h: T.handle,
                 window_left: T.int64, window_right: T.int64, softcap: T.float32,
                 cuq_h: T.handle, cuk_h: T.handle, max_seqlen_q: T.int64,
                 max_seqlen_k: T.int64):
        T.func_attr({"global_symbol": "flash_dq", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qb, qh, ql, kb, kh, kl = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        vb, vh, vl, ob, oh, ol = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        gb, gh, gl, pb, ph, pl = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=(qb, qh, ql, 1), align=16)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=(kb, kh, kl, 1), align=16)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=(vb, vh, vl, 1), align=16)
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=(gb, gh, gl, 1), align=16)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=(pb, ph, pl, 1), align=16)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dQ = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype, strides=(ob, oh, ol, 1), align=16)
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_dq", Q, K, V, dO, O, dQ)
        qmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(qmap, Q, ATOM, BM, SW)
        domap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(domap, dO, ATOM, BM, SW)
        kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(kmap, K, ATOM, BK, SW)
        vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(vmap, V, ATOM, BK, SW)
        sms: T.let[T.int32] = _sm_count(tile.persistent)
        nqt = T.meta_var(T.ceildiv(max_seqlen_q if varlen else Lq, BM))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hq)  # (batch or sequence) x head
        total = T.meta_var(heads * nqt)  # query tiles
        grid: T.let[T.int32] = _grid(total, sms, tile, causal, mods, varlen, Lq, Lk,
                                     window_left, window_right)
        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx = T.cta_id([grid])
        tx = T.thread_id([NT])
        pool = T.alloc_buffer((pool_bytes,), "uint8", scope="shared.dyn", align=1024)
        Qs = T.decl_buffer((NA, BM, ATOM), dtype, data=pool.data, elem_offset=0,
                           scope="shared.dyn")
        dOs = T.decl_buffer((NA, BM, ATOM), dtype, data=pool.data, elem_offset=do_off // 2,
                            scope="shared.dyn")
        Ks = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=k_off // 2,
                           scope="shared.dyn")
        Vs = T.decl_buffer((ST, NA, BK, ATOM), dtype, data=pool.data, elem_offset=v_off // 2,
                           scope="shared.dyn")
        bars = T.decl_buffer((NB,), "uint64", data=pool.data, elem_offset=bar_off // 8,
                             scope="shared.dyn")
        dQf = T.decl_buffer((B * ob,), dtype, data=dQ.data)
        # O and dO as flat 32-bit words (a 4-D view's strides are lost in this pipeline, as
        # dQf's would be), indexed at strides visibly multiples of 4 words: 16-byte loads
        Ow = T.decl_buffer((B * pb // 2,), "uint32", data=O.data)
        dOw = T.decl_buffer((B * gb // 2,), "uint32", data=dO.data)
        # b, h, kv head, q0, key tiles of the row tile; ring slots used by the ones before
        c = T.alloc_buffer((7 if mods.window else 6,), "int64", scope="local")
        if varlen:  # the tile's sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        mine = T.meta_var(_mine(total, grid, bx, tile.persistent))
        if tx == 0:
            for i in T.unroll(NB):
                T.ptx.mbarrier.init.shared.b64(T.address_of(bars[i]),
                                               T.uint32(1 if i < EMPTY else NC))
            T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        c[5] = T.int64(0)

        if tx < WG:  # ------------------------------------------------------------ producer
            T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS)
            if tx == 0:
                for it in T.serial(mine):
                    locate(c, _snake(it, bx, grid, tile.persistent), nqt, heads, Hq, Lq, Lk,
                           ModArgs(Slopes, window_left, window_right, softcap),
                           sq if varlen else None, CuQ, CuK)
                    # Q and dO are reloaded once both consumers' S and dP with them completed
                    if it > 0:
                        T.cuda.mbarrier_wait(T.address_of(bars[QE]), (it - 1) % 2)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[0]),
                                                               T.uint32(2 * q_bytes))
                    for a in T.unroll(NA):
                        T.ptx[_TMA](T.address_of(Qs[a, 0, 0]), T.address_of(qmap), a * ATOM,
                                    T.cast(c[3] + sq[0] if varlen else c[3], "int32"),
                                    T.cast(c[1], "int32"), T.cast(c[0], "int32"),
                                    T.address_of(bars[0]))
                        T.ptx[_TMA](T.address_of(dOs[a, 0, 0]), T.address_of(domap), a * ATOM,
                                    T.cast(c[3] + sq[0] if varlen else c[3], "int32"),
                                    T.cast(c[1], "int32"), T.cast(c[0], "int32"),
                                    T.address_of(bars[0]))
                    for j in T.serial(c[4]):
                        # a slot is refilled once both consumers' dQ += dS K of its last tile
                        # completed
                        g = T.meta_var(c[5] + j)
                        if g >= ST:
                            T.cuda.mbarrier_wait(T.address_of(bars[EMPTY + g % ST]),
                                                 (g // ST - 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(
                            T.address_of(bars[FULL + g % ST]), T.uint32(2 * kv_bytes))
                        for a in T.unroll(NA):
                            T.ptx[_TMA](T.address_of(Ks[g % ST, a, 0, 0]), T.address_of(kmap),
                                        a * ATOM, T.cast(((j + c[6] // BK) * BK if mods.window
                                                          else j * BK)
                                                         + (sq[2] if varlen else 0), "int32"),
                                        T.cast(c[2], "int32"), T.cast(c[0], "int32"),
                                        T.address_of(bars[FULL + g % ST]))
                            T.ptx[_TMA](T.address_of(Vs[g % ST, a, 0, 0]), T.address_of(vmap),
                                        a * ATOM, T.cast(((j + c[6] // BK) * BK if mods.window
                                                          else j * BK)
                                                         + (sq[2] if varlen else 0), "int32"),
                                        T.cast(c[2], "int32"), T.cast(c[0], "int32"),
                                        T.address_of(bars[FULL + g % ST]))
                    c[5] = c[5] + c[4]
        else:  # ------------------------------------------------------------------ consumers
            T.ptx.setmaxnreg.inc.sync.aligned.u32(regs_consumer)
            s = T.alloc_buffer((NS * 4,), F32, scope="local")
            dp = T.alloc_buffer((NS * 4,), F32, scope="local")
            ds = T.alloc_buffer((NS * 4,), dtype, scope="local")
            dsw = T.decl_buffer((NS * 2,), "uint32", data=ds.data, scope="local")
            acc = T.alloc_buffer((NO * 4,), F32, scope="local")
            lse = T.alloc_buffer((2,), F32, scope="local")
            delta = T.alloc_buffer((2,), F32, scope="local")
            ow = T.alloc_buffer((DW * 4,), "uint32", scope="local")  # words of O, dO
            dow = T.alloc_buffer((DW * 4,), "uint32", scope="local")
            dqa = T.alloc_buffer((1,), "uint64", scope="local")
            doa = T.alloc_buffer((1,), "uint64", scope="local")
            dk = T.alloc_buffer((1,), "uint64", scope="local")
            dv = T.alloc_buffer((1,), "uint64", scope="local")
            dkt = T.alloc_buffer((1,), "uint64", scope="local")
            cw = T.meta_var(tx // WG - 1)
            lane = T.meta_var(tx % 32)
            row0 = T.meta_var(c[3] + cw * 64)  # the warpgroup's first row
            row = T.meta_var(row0 + tx % WG // 32 * 16 + lane // 4)  # + 8 r
            elected = T.meta_var(tx % WG == 0)
            if mods.alibi:  # the query tile's slope (its head's), as ModArgs.slopes[0, 0]
                sl = T.alloc_buffer((1, 1), F32, scope="local")
            ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                    softcap))

            _desc(dqa[0], T.address_of(Qs[0, cw * 64, 0]), 1, 8 * ROW, SW)
            _desc(doa[0], T.address_of(dOs[0, cw * 64, 0]), 1, 8 * ROW, SW)

            for it in T.serial(mine):
                locate(c, _snake(it, bx, grid, tile.persistent), nqt, heads, Hq, Lq, Lk, ma,
                       sq if varlen else None, CuQ, CuK)
                if mods.alibi:
                    sl[0, 0] = alibi_slope_raw(mods, Slopes[sq[4] if varlen else c[0], c[1]],
                                                scale)
                for r in T.unroll(2):  # Delta = rowsum(dO * O): 0 past the end
                    delta[r] = T.float32(0)
                    if row + r * 8 < (sq[1] if varlen else Lq):
                        lrow = T.meta_var(row + r * 8 + sq[0] if varlen else row + r * 8)
                        for h in T.unroll(D // 32 // DW):  # DW stripes' loads, then sums
                            for w in T.unroll(DW):  # the lane's 8 columns of a 32-column stripe
                                col = T.meta_var(((h * DW + w) * 4 + lane % 4) * 4)
                                for e in T.vectorized(4):
                                    ow[w * 4 + e] = Ow[c[0] * (pb // 8 * 4) + c[1] * (ph // 8 * 4)
                                                       + lrow * (pl // 8 * 4) + col + e]
                                for e in T.vectorized(4):
                                    dow[w * 4 + e] = dOw[c[0] * (gb // 8 * 4)
                                                         + c[1] * (gh // 8 * 4)
                                                         + lrow * (gl // 8 * 4) + col + e]
                            for e in T.unroll(DW * 4):
                                delta[r] = delta[r] + (widen_half(dtype, ow[e], False)
                                                       * widen_half(dtype, dow[e], False))
                                delta[r] = delta[r] + (widen_half(dtype, ow[e], True)
                                                       * widen_half(dtype, dow[e], True))
                    quad_reduce(delta, r, T.Add)
                    if lane % 4 == 0 and row + r * 8 < (sq[1] if varlen else Lq):
                        Delta[c[0], c[1], row + r * 8 + sq[0] if varlen else row + r * 8] = (
                            delta[r])
                for i in T.unroll(NO * 4):
                    acc[i] = T.float32(0)
                for r in T.unroll(2):
                    # P = exp2(-inf) = 0 in rows past the end or without keys
                    lse[r] = pos_inf()
                    if row + r * 8 < (sq[1] if varlen else Lq):
                        lrow = T.meta_var(row + r * 8 + sq[0] if varlen else row + r * 8)
                        lse[r] = LSE[c[0], c[1], lrow]
                        if lse[r] == neg_inf():
                            lse[r] = pos_inf()
                        if not tile.clamp:  # base 2, for prob's single FFMA
                            lse[r] = lse[r] * T.float32(LOG2E)
                T.cuda.mbarrier_wait(T.address_of(bars[0]), it % 2)
                n = T.meta_var(c[4])
                g = T.meta_var(c[5])
                if n > 0:
                    issue(s, dp, dsw, acc, Ks, Vs, bars, dqa, doa, dk, dv, dkt, g, g, True,
                          False)
                    grads(s, dp, ds, acc, lse, delta, bars, T.int64(0), g, row0, row, lane,
                          elected, scale, sq[1] if varlen else Lq, sq[3] if varlen else Lk,
                          False, c, ma)
                    for j in T.serial(n - 1):
                        issue(s, dp, dsw, acc, Ks, Vs, bars, dqa, doa, dk, dv, dkt, g + j + 1,
                              g + j, True, True)
                        grads(s, dp, ds, acc, lse, delta, bars, j + 1, g + j + 1, row0, row,
                              lane, elected, scale, sq[1] if varlen else Lq,
                              sq[3] if varlen else Lk, True, c, ma)
                    # every S and dP is complete: the producer may load the next Q and dO
                    if elected:
                        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[QE]))
                    issue(s, dp, dsw, acc, Ks, Vs, bars, dqa, doa, dk, dv, dkt, g + n - 1,
                          g + n - 1, False, True)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pin(acc, NO * 4)
                    if elected:
                        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + (g + n - 1)
                                                                            % ST]))
                else:
                    release_keyless(bars, QE, cw, elected)

                for r in T.unroll(2):
                    if row + r * 8 < (sq[1] if varlen else Lq):
                        orow = T.meta_var(row + r * 8 + sq[0] if varlen else row + r * 8)
                        for n in T.unroll(NO):
                            for e in T.vectorized(2):
                                dQf[c[0] * ob + c[1] * oh + orow * ol + n * 8
                                    + lane % 4 * 2 + e] = T.cast(
                                        acc[n * 4 + r * 2 + e] * scale, dtype)
                c[5] = c[5] + c[4]

    return trim_params(flash_dq, mods, varlen)


def flash_dkv(key: KernelKey, tile: HopperTile):
    """``flash_dkv(q, k, v, do, lse, delta, dk, dv, scale)``: a block owns ``tile.rows`` keys
    (64 per consumer warpgroup) of one key/value head, holds their dK and dV in registers and
    walks, in a fixed order, every query tile of every query head of the GQA group that sees
    them (``tile.step`` queries a step): one writer per output element, no atomics.

    The producer loads K and V once and each step's Q and dO tiles into a ring of
    ``tile.stages`` stages (TMA, by one lane), and the tile's rows of LSE and Delta beside them
    (plain loads, by the producer warp's 32 lanes, each arriving on the stage's "full" barrier
    after its stores). Not by TMA: a tensor copy must start 16-byte aligned in its innermost
    dimension, and a tile's first row of LSE is at any float of the (B, H, Lq) array — the 1-D
    copy stopped the H200 with "illegal instruction" wherever Lq % 4 != 0. A row past Lq or
    without any key gets LSE = +inf (hence P = 0: no select per element) and Delta = 0; its Q
    and dO rows are zero-filled. Consumer step: S^T = K Q^T and dP^T = V dO^T
    (shared memory, K-major; two commit groups); once S^T is complete, P^T from the LSE of each
    column (query), rounded, and dV += P^T dO issued (P^T from registers, dO read MN-major)
    while dP^T runs on; once dP^T is complete, dS^T = P^T (dP^T - Delta) rounded and dK += dS^T
    Q issued (Q MN-major); once both are complete every consumer thread releases the stage
    (its own reads of the stage's LSE and Delta are done by then).

    ``tile.split`` (D 192 and up, where dK and dV of 64 keys would take a thread's 192–256 of
    240 registers): the block owns 64 keys and its consumers split the work — the first computes
    S^T and P^T, hands P^T's words to the second through shared memory (one slot per stage, a
    "P ready" mbarrier per stage) and accumulates dV += P^T dO; the second computes dP^T, waits
    for P^T, and accumulates dK += dS^T Q. Four GEMMs a step as before, two per warpgroup, each
    thread holding D / 2 registers of sums."""
    D, dtype, causal, group = key.head_dim, key.dtype, key.causal, key.group
    # the plain tile only (MODS_WRITTEN)
    mods = Mods(key.window, key.softcap, key.alibi, tile.tanh)
    varlen = key.varlen  # packed sequences: the plain tile only (VARLEN_WRITTEN)
    BN, BQ, ST, NC, SPLIT = tile.rows, tile.step, tile.stages, tile.consumers, tile.split
    NT = tile.threads
    ATOM = atom(D)
    NA, KA = D // ATOM, ATOM // 16
    ROW = ATOM * 2 // 16
    SW = SWIZZLE[ATOM * 2]
    NS, NO = BQ // 8, D // 8
    ab = _PTX[dtype]
    mma_s = f"wgmma.mma_async.sync.aligned.m64n{BQ}k16.f32.{ab}.{ab}"
    mma_o = f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"
    k_bytes, q_bytes = BN * D * 2, BQ * D * 2
    v_off = k_bytes
    q_off = 2 * k_bytes
    do_off = q_off + ST * q_bytes
    stat_off = do_off + ST * q_bytes
    slot_off = stat_off + ST * 2 * BQ * 4
    NW = BQ // 4  # split: P^T's 32-bit words a thread hands over a step
    bar_off = slot_off + (ST * NW * WG * 4 if SPLIT else 0)
    DQ = tile.dq
    ORDERED = tile.ordered
    if DQ:  # dS^T (2 buffers x consumers, 64 keys x BQ queries) and the dQ tile (BQ x D, f32)
        dst_off = (bar_off + 1023) // 1024 * 1024
        dqt_off = dst_off + 2 * NC * 64 * BQ * 2
        DQ_ROW = dq_row(D, tile)  # the dQ tile's and accumulator's row, in floats
        bar_off = dqt_off + BQ * DQ_ROW * 4
    NB = 1 + (3 if SPLIT else 2) * ST  # K and V; full, empty (split: P ready) per stage
    FULL, EMPTY, PREADY = 1, 1 + ST, 1 + 2 * ST
    pool_bytes = bar_off + 8 * NB
    qt_ldo, qt_sdo = BQ * ROW, 8 * ROW  # Q and dO read MN-major (dK += dS^T Q, dV += P^T dO)
    regs_consumer = consumer_regs(NC)

    def prob_t(st, e, stats, sg, q0, key_row, lane, scale, Lq, Lk, ma, sr=None):
        """P^T of element ``e`` (``_prob`` unguarded) of its modified score (``s * scale``
        itself without a soft cap or ALiBi; ``ma.slopes[0, 0]``: the step's query head's
        slope); its LSE from the stage, or from ``sr`` (``tile.stats_early``)."""
        lse = (sr[e // 4 * 2 + e % 2] if sr is not None
               else stats[sg, 0, e // 4 * 8 + lane % 4 * 2 + e % 2])
        score = _score(st[e], scale, mods, ma, causal, q0 + lane % 4 * 2, key_row, Lq, Lk,
                       e // 4 * 8 + e % 2 - e % 4 // 2 * 8, 1.0 if tile.clamp else LOG2E)
        if not tile.clamp:  # the LSE in base 2 (stat_row): one FFMA a score
            return T.exp2(score - lse)
        return exp2_clamped((score - lse) * T.float32(LOG2E))

    @T.macro
    def probs(st, p, stats, sg, q0, key_row, row0, lane, scale, Lq, Lk, ma, sc, sr=None):
        """P^T of a complete S^T: rounded to the input dtype (``p``; as float in ``st`` too,
        but with ``tile.p_once``: ``st`` unrounded, read no more), 0 where the causal mask (or
        the window) hides the key; under a soft cap its slope ``1 - tanh^2`` of S^T into
        ``sc`` first (dS^T needs it)."""
        # element e: key row ``key_row + e % 4 // 2 * 8``, query column ``q0 + col(e)``
        if mods.softcap:
            for e in T.unroll(NS * 4):
                sc[e] = softcap_slope(st[e], scale, mods, ma)
        for e in T.unroll(NS * 4):
            pe = T.meta_var(prob_t(st, e, stats, sg, q0, key_row, lane, scale, Lq, Lk, ma,
                                   sr))
            st[e] = pe if tile.p_once else T.cast(T.cast(pe, dtype), F32)
        # the columns past Lq need no mask (LSE +inf there): only the causal diagonal (and,
        # under a window, its edges: _mask_needed)
        if _mask_needed(causal, row0, 64, q0, BQ, q0 + BQ, Lq, Lk, transposed=True, mods=mods,
                        ma=ma):
            for e in T.unroll(NS * 4):
                if not visible(causal, q0 + e // 4 * 8 + lane % 4 * 2 + e % 2,
                               key_row + e % 4 // 2 * 8, Lq, Lk, None, mods, ma):
                    st[e] = T.float32(0)
        for e in T.unroll(NS * 4):
            p[e] = T.cast(st[e], dtype)

    @T.macro
    def accumulate_and_release(acc, aw, b, bars, sg):
        """Split, either warpgroup's last product of a step: ``acc`` += A B (A's words ``aw``
        from registers, B from descriptor ``b``), completed, then stage ``sg`` released."""
        pin(acc, NO * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_rs(mma_o, acc, NO * 4, aw, b[0], BQ // 16, ROW)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        pin(acc, NO * 4)
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + sg]))

    @T.macro
    def step_dv(st, p, pw, dv, Qs, dOs, stats, slots, bars, ka, bq, bdot, i, q0, key_row, row0,
                lane, t, scale, Lq, Lk, ma):
        """Split, the dV warpgroup's step: S^T, P^T (handed over), dV += P^T dO."""
        sg = T.meta_var(i % ST)
        _desc(bq[0], T.address_of(Qs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
        _desc(bdot[0], T.address_of(dOs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
        T.cuda.mbarrier_wait(T.address_of(bars[FULL + sg]), i // ST % 2)
        pin(st, NS * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_ss(mma_s, st, NS * 4, ka[0], BN, bq[0], BQ, D // 16, KA, ROW)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        pin(st, NS * 4)
        probs(st, p, stats, sg, q0, key_row, row0, lane, scale, Lq, Lk, ma, None)
        pin_u32(pw, NW)
        for j in T.unroll(NW):  # the dK warpgroup's thread t holds the same elements of dP^T
            slots[sg, j, t] = pw[j]
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[PREADY + sg]))
        accumulate_and_release(dv, pw, bdot, bars, sg)

    @T.macro
    def step_dk(dpt, p, pw, ds, dsw, dk, Qs, dOs, stats, slots, bars, va, bdo, bqt, i, lane, t):
        """Split, the dK warpgroup's step: dP^T, P^T from the dV warpgroup, dK += dS^T Q."""
        sg = T.meta_var(i % ST)
        _desc(bdo[0], T.address_of(dOs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
        _desc(bqt[0], T.address_of(Qs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
        T.cuda.mbarrier_wait(T.address_of(bars[FULL + sg]), i // ST % 2)
        pin(dpt, NS * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_ss(mma_s, dpt, NS * 4, va[0], BN, bdo[0], BQ, D // 16, KA, ROW)
        T.cuda.mbarrier_wait(T.address_of(bars[PREADY + sg]), i // ST % 2)
        for j in T.unroll(NW):
            pw[j] = slots[sg, j, t]
        T.ptx.wgmma.wait_group.sync.aligned(0)
        pin(dpt, NS * 4)
        for e in T.unroll(NS * 4):
            ds[e] = T.cast(T.cast(p[e], F32) * (dpt[e] - stats[sg, 1, e // 4 * 8 + lane % 4 * 2
                                                                 + e % 2]), dtype)
        pin_u32(dsw, NW)
        accumulate_and_release(dk, dsw, bqt, bars, sg)

    @T.macro
    def drain(dk, dv, bars, sg):
        """dV and dK of the step on stage ``sg`` complete; the stage is free."""
        T.ptx.wgmma.wait_group.sync.aligned(0)
        pin(dv, NO * 4)
        pin(dk, NO * 4)
        # every thread arrives after its own reads of the stage's LSE and Delta: one arrival
        # per warp (after a __syncwarp) or per warpgroup (after a named barrier) orders them as
        # well, but compute-sanitizer's racecheck, which follows only a thread's own arrival,
        # reports the producer's next writes racing those reads
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + sg]))

    @T.macro
    def step(st, dpt, p, pw, ds, dsw, dk, dv, Qs, dOs, stats, bars, ka, va, bq, bdo, bqt,
             bdot, i, q0, key_row, row0, lane, scale, Lq, Lk, ma, sc, sr):
        """One query tile (step ``i``, rows from ``q0``): dV += P^T dO, dK += dS^T Q (with
        ``tile.overlap`` left running: :func:`drain` after the last step)."""
        sg = T.meta_var(i % ST)
        _desc(bq[0], T.address_of(Qs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
        _desc(bdo[0], T.address_of(dOs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
        _desc(bqt[0], T.address_of(Qs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
        _desc(bdot[0], T.address_of(dOs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
        T.cuda.mbarrier_wait(T.address_of(bars[FULL + sg]), i // ST % 2)
        pin(st, NS * 4)
        pin(dpt, NS * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_ss(mma_s, st, NS * 4, ka[0], BN, bq[0], BQ, D // 16, KA, ROW)
        gemm_ss(mma_s, dpt, NS * 4, va[0], BN, bdo[0], BQ, D // 16, KA, ROW)
        if tile.stats_early:  # the queries' LSE while S^T runs
            for j in T.unroll(NS * 2):
                sr[j] = stats[sg, 0, j // 2 * 8 + lane % 4 * 2 + j % 2]
        T.ptx.wgmma.wait_group.sync.aligned(1)  # S^T done (overlap: the step before's too)
        pin(st, NS * 4)
        if tile.overlap:  # the step before's dV and dK read these words until now
            pin_u32(pw, NS * 2)
            pin_u32(dsw, NS * 2)
            pin(dv, NO * 4)
            pin(dk, NO * 4)
            if i > 0:  # its stage is free
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + (i - 1) % ST]))
        probs(st, p, stats, sg, q0, key_row, row0, lane, scale, Lq, Lk, ma, sc,
              sr if tile.stats_early else None)
        pin_u32(pw, NS * 2)
        pin(dv, NO * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_rs(mma_o, dv, NO * 4, pw, bdot[0], BQ // 16, ROW)
        if tile.stats_early:  # their Delta while dP^T runs (the LSE's registers)
            for j in T.unroll(NS * 2):
                sr[j] = stats[sg, 1, j // 2 * 8 + lane % 4 * 2 + j % 2]
        T.ptx.wgmma.wait_group.sync.aligned(1)  # dP^T done; dV += P^T dO may run on
        pin(dpt, NS * 4)
        for e in T.unroll(NS * 4):  # P^T rounded: in place, or widened from its words
            pt = T.meta_var(T.cast(p[e], F32) if tile.p_once else st[e])
            delta = T.meta_var(sr[e // 4 * 2 + e % 2] if tile.stats_early
                               else stats[sg, 1, e // 4 * 8 + lane % 4 * 2 + e % 2])
            ds[e] = T.cast(pt * (dpt[e] - delta) * (sc[e] if mods.softcap else T.float32(1)),
                           dtype)
        pin_u32(dsw, NS * 2)
        pin(dk, NO * 4)
        T.ptx.wgmma.fence.sync.aligned()
        gemm_rs(mma_o, dk, NO * 4, dsw, bqt[0], BQ // 16, ROW)
        if not tile.overlap:
            drain(dk, dv, bars, sg)

    @T.macro
    def first(w, c, Lq):
        """The first step: the first query tile that sees the keys, of the group's first
        head."""
        w[0] = c[3] * BQ
        w[1] = c[1] * group

    @T.macro
    def advance(w, c, Lq):
        """The next step: the next query tile, or the next head's first one (under a window,
        the head's tiles end at ``c[3] + c[4]``; ``Lq``: the sequence's, packed)."""
        w[0] = w[0] + BQ
        if w[0] >= ((c[3] + c[4]) * BQ if mods.window else Lq):
            w[0] = c[3] * BQ
            w[1] = w[1] + 1

    @T.macro
    def stat_row(stats, sg, r, LSE, Delta, c, w, Lq, sq):
        """Row ``r`` of stage ``sg``'s LSE and Delta: +inf and 0 past Lq or where the row saw
        no key (LSE -inf), so that P = exp2(-inf) = 0 there without a select per element
        (packed sequences: ``sq``, the sequence's first row and length)."""
        stats[sg, 0, r] = pos_inf()
        stats[sg, 1, r] = T.float32(0)
        grow = T.meta_var(w[0] + r + sq[0] if varlen else w[0] + r)
        if w[0] + r < (sq[1] if varlen else Lq):
            if LSE[c[0], w[1], grow] != neg_inf():
                # base 2 for prob_t's single FFMA where the exp2 is unclamped
                stats[sg, 0, r] = (LSE[c[0], w[1], grow] if tile.clamp
                                   else LSE[c[0], w[1], grow] * T.float32(LOG2E))
                stats[sg, 1, r] = Delta[c[0], w[1], grow]

    @T.macro
    def store(Out, Of, ob, oh, ol, acc, factor, c, key_row, lane, Lk, sq):
        for r in T.unroll(2):
            if key_row + r * 8 < (sq[3] if varlen else Lk):
                grow = T.meta_var(key_row + r * 8 + sq[2] if varlen else key_row + r * 8)
                for n in T.unroll(NO):
                    for e in T.vectorized(2):
                        Of[c[0] * ob + c[1] * oh + grow * ol + n * 8 + lane % 4 * 2
                           + e] = T.cast(acc[n * 4 + r * 2 + e] * factor, dtype)

    @T.macro
    def load_kv(Ks, Vs, kmap, vmap, bars, c, sq):
        """Thread 0: the block's K and V tiles, once, on barrier 0."""
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[0]), T.uint32(2 * k_bytes))
        for a in T.unroll(NA):
            T.ptx[_TMA](T.address_of(Ks[a, 0, 0]), T.address_of(kmap), a * ATOM,
                        T.cast(c[2] + sq[2] if varlen else c[2], "int32"),
                        T.cast(c[1], "int32"), T.cast(c[0], "int32"), T.address_of(bars[0]))
            T.ptx[_TMA](T.address_of(Vs[a, 0, 0]), T.address_of(vmap), a * ATOM,
                        T.cast(c[2] + sq[2] if varlen else c[2], "int32"),
                        T.cast(c[1], "int32"), T.cast(c[0], "int32"), T.address_of(bars[0]))

    @T.macro
    def stage_steps(Qs, dOs, stats, qmap, domap, bars, LSE, Delta, c, w, Lq, tx, start, step_on,
                    sq):
        """Warp 0, step after step (``start``/``step_on``: the walk's first step and the next):
        once the stage is free, its LSE and Delta rows (each lane some) and its Q and dO tiles
        (TMA, lane 0), every lane arriving on the stage's "full" barrier."""
        start(w, c, Lq)
        for i in T.serial(c[5]):
            if i >= ST:
                T.cuda.mbarrier_wait(T.address_of(bars[EMPTY + i % ST]), (i // ST - 1) % 2)
            for r in T.unroll((BQ + 31) // 32):
                if r * 32 + tx < BQ:
                    stat_row(stats, i % ST, r * 32 + tx, LSE, Delta, c, w, Lq, sq)
            if tx == 0:  # its arrival counts one of the 32
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[FULL + i % ST]),
                                                           T.uint32(2 * q_bytes))
                for a in T.unroll(NA):
                    T.ptx[_TMA](T.address_of(Qs[i % ST, a, 0, 0]), T.address_of(qmap), a * ATOM,
                                T.cast(w[0] + sq[0] if varlen else w[0], "int32"),
                                T.cast(w[1], "int32"), T.cast(c[0], "int32"),
                                T.address_of(bars[FULL + i % ST]))
                    T.ptx[_TMA](T.address_of(dOs[i % ST, a, 0, 0]), T.address_of(domap),
                                a * ATOM, T.cast(w[0] + sq[0] if varlen else w[0], "int32"),
                                T.cast(w[1], "int32"), T.cast(c[0], "int32"),
                                T.address_of(bars[FULL + i % ST]))
            else:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[FULL + i % ST]))
            step_on(w, c, Lq)

    if DQ:
        # ---------------------------------------------------- the 5-GEMM form (tile.dq)
        NQ = (D // 2) // 8  # n8 chunks of a consumer's half of the dQ tile's columns
        mma_q = f"wgmma.mma_async.sync.aligned.m64n{D // 2}k16.f32.{ab}.{ab}"
        DS_BOTH, DQ_FULL, DQ_EMPTY = 1, 2, 3  # named barriers (0 is __syncthreads')
        DQ_THREADS = NC * WG + 32  # the consumers and the writer warp
        dq_bytes = BQ * DQ_ROW * 4

        @T.macro
        def first_dq(w, c, Lq):
            """The first step: the last query tile, of the group's first head (query tiles are
            walked last to first, see below)."""
            w[0] = (T.ceildiv(Lq, BQ) - 1) * BQ
            w[1] = c[1] * group

        @T.macro
        def advance_dq(w, c, Lq):
            """The next step: the query tile before, or the next head's last one."""
            w[0] = w[0] - BQ
            if w[0] < c[3] * BQ:
                w[0] = (T.ceildiv(Lq, BQ) - 1) * BQ
                w[1] = w[1] + 1

        @T.macro
        def step_dq(st, dpt, p, pw, ds, dsw, dk, dv, dqa, Qs, dOs, Ks, stats, dst, dstw, dqt,
                    bars, ka, va, bq, bdo, bqt, bdot, bdsk, bds0, bds1, bkq, i, q0, key_row, row0,
                    lane, cw, t, scale, Lq, Lk):
            """One query tile: dV += P^T dO and dK += dS^T Q as :func:`step`, with dS^T through
            shared memory; then this warpgroup's half of the tile's dQ (columns ``64 cw ..``)
            = dS K over both warpgroups' keys, handed to the writer warp."""
            sg = T.meta_var(i % ST)
            db = T.meta_var(i % 2)
            _desc(bq[0], T.address_of(Qs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
            _desc(bdo[0], T.address_of(dOs[sg, 0, 0, 0]), 1, 8 * ROW, SW)
            _desc(bqt[0], T.address_of(Qs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
            _desc(bdot[0], T.address_of(dOs[sg, 0, 0, 0]), qt_ldo, qt_sdo, SW)
            # dS^T K-major for dK (rows keys); dS MN-major for dQ (its rows are the k dim)
            _desc(bdsk[0], T.address_of(dst[db, cw, 0, 0]), 1, 8 * ROW, SW)
            _desc(bds0[0], T.address_of(dst[db, 0, 0, 0]), 64 * ROW, 8 * ROW, SW)
            _desc(bds1[0], T.address_of(dst[db, 1, 0, 0]), 64 * ROW, 8 * ROW, SW)
            _desc(bkq[0], T.address_of(Ks[cw, 0, 0]), BN * ROW, 8 * ROW, SW)
            T.cuda.mbarrier_wait(T.address_of(bars[FULL + sg]), i // ST % 2)
            pin(st, NS * 4)
            pin(dpt, NS * 4)
            T.ptx.wgmma.fence.sync.aligned()
            gemm_ss(mma_s, st, NS * 4, ka[0], BN, bq[0], BQ, D // 16, KA, ROW)
            gemm_ss(mma_s, dpt, NS * 4, va[0], BN, bdo[0], BQ, D // 16, KA, ROW)
            T.ptx.wgmma.wait_group.sync.aligned(1)  # S^T done
            pin(st, NS * 4)
            probs(st, p, stats, sg, q0, key_row, row0, lane, scale, Lq, Lk, None, None)
            pin_u32(pw, NS * 2)
            pin(dv, NO * 4)
            T.ptx.wgmma.fence.sync.aligned()
            gemm_rs(mma_o, dv, NO * 4, pw, bdot[0], BQ // 16, ROW)
            T.ptx.wgmma.wait_group.sync.aligned(1)  # dP^T done; dV += P^T dO may run on
            pin(dpt, NS * 4)
            for e in T.unroll(NS * 4):  # from P's rounded values (S^T's registers are free)
                ds[e] = T.cast(T.cast(p[e], F32) * (dpt[e] - stats[sg, 1, e // 4 * 8
                                                                   + lane % 4 * 2 + e % 2]),
                               dtype)
            # dS^T into shared memory, 128-byte rows (one per key) swizzled as TMA would write
            # them: the 16-byte chunk j of row r at chunk j ^ (r % 8)
            for r in T.unroll(2):
                for j in T.unroll(NS):
                    dstw[db, cw, (key_row - row0 + r * 8) * 32
                         + _swizzled(j, key_row - row0 + r * 8) * 4 + lane % 4] = dsw[j * 2 + r]
            T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.barrier.sync.aligned(DS_BOTH, NC * WG)  # both halves of dS^T written
            # dQ first, then dK: dQ's result goes to the writer through shared memory while
            # dK still runs (FlashAttention-3's order; the tensor cores idled during that
            # store when dK came first and the store waited for all three products)
            pin(dqa, NQ * 4)
            pin(dk, NO * 4)
            T.ptx.wgmma.fence.sync.aligned()
            for kk in T.unroll(BN // 16):  # dQ[:, 64 cw ..] = dS K: both MN-major
                T.ptx[mma_q](*[dqa[e] for e in range(NQ * 4)],
                             T.if_then_else(kk < 4, bds0[0], bds1[0])
                             + T.uint64(kk % 4 * 16 * ROW),
                             bkq[0] + T.uint64(kk * 16 * ROW), T.bool(kk > 0), 1, 1, 1, 1)
            T.ptx.wgmma.commit_group.sync.aligned()
            for kk in T.unroll(BQ // 16):  # dK += dS^T Q: A K-major from shared, Q MN-major
                T.ptx[mma_o](*[dk[e] for e in range(NO * 4)], bdsk[0] + T.uint64(kk * 2),
                             bqt[0] + T.uint64(kk * 16 * ROW), T.bool(True), 1, 1, 0, 1)
            T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(1)  # dV and dQ done; dK may run on
            pin(dqa, NQ * 4)
            T.ptx.barrier.sync.aligned(DQ_EMPTY, DQ_THREADS)  # the writer is done with dqt
            for r in T.unroll(2):
                for n in T.unroll(NQ):
                    for e in T.unroll(2):
                        dqt[(t // 32 * 16 + lane // 4 + r * 8) * DQ_ROW + cw * (D // 2) + n * 8
                            + lane % 4 * 2 + e] = dqa[n * 4 + r * 2 + e]
            T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.barrier.arrive.aligned(DQ_FULL, DQ_THREADS)
            T.ptx.wgmma.wait_group.sync.aligned(0)  # dK done too: the stage is free
            pin(dv, NO * 4)
            pin(dk, NO * 4)
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(bars[EMPTY + sg]))

        @T.prim_func
        def flash_dkv_dq(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                         lse_h: T.handle, delta_h: T.handle, dk_h: T.handle, dv_h: T.handle,
                         scale: T.float32, dqacc_h: T.handle, sem_h: T.handle):
            T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
            B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            qb, qh, ql, kb, kh, kl = (T.int64(), T.int64(), T.int64(), T.int64(), T.int64(),
                                      T.int64())
            vb, vh, vl, gb, gh, gl = (T.int64(), T.int64(), T.int64(), T.int64(), T.int64(),
                                      T.int64())
            kob, koh, kol, vob, voh, vol = (T.int64(), T.int64(), T.int64(), T.int64(),
                                            T.int64(), T.int64())
            Lqp, NQT = T.int64(), T.int64()
            Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=(qb, qh, ql, 1), align=16)
            K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=(kb, kh, kl, 1), align=16)
            V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=(vb, vh, vl, 1), align=16)
            dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=(gb, gh, gl, 1), align=16)
            LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
            Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
            dK = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype, strides=(kob, koh, kol, 1),
                                align=16)
            dV = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype, strides=(vob, voh, vol, 1),
                                align=16)
            # dQ's float32 sums, rows padded to whole query tiles, and one counter per
            # (batch, query head, query tile): how many key tiles have added theirs
            DQacc = T.match_buffer(dqacc_h, (B, Hq, Lqp, DQ_ROW), F32, align=16)
            Sem = T.match_buffer(sem_h, (B, Hq, NQT), "int32")
            _require_vector_rows("flash_dkv", Q, K, V, dO, dK, dV)
            qmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            _tmap(qmap, Q, ATOM, BQ, SW)
            domap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            _tmap(domap, dO, ATOM, BQ, SW)
            kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            _tmap(kmap, K, ATOM, BN, SW)
            vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            _tmap(vmap, V, ATOM, BN, SW)
            T.device_entry()
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
            nkt = T.meta_var(T.ceildiv(Lk, BN))
            bx = T.cta_id([T.cast(B * Hkv * nkt, "int32")])
            tx = T.thread_id([NT])
            pool = T.alloc_buffer((pool_bytes,), "uint8", scope="shared.dyn", align=1024)
            Ks = T.decl_buffer((NA, BN, ATOM), dtype, data=pool.data, elem_offset=0,
                               scope="shared.dyn")
            Vs = T.decl_buffer((NA, BN, ATOM), dtype, data=pool.data, elem_offset=v_off // 2,
                               scope="shared.dyn")
            Qs = T.decl_buffer((ST, NA, BQ, ATOM), dtype, data=pool.data,
                               elem_offset=q_off // 2, scope="shared.dyn")
            dOs = T.decl_buffer((ST, NA, BQ, ATOM), dtype, data=pool.data,
                                elem_offset=do_off // 2, scope="shared.dyn")
            stats = T.decl_buffer((ST, 2, BQ), F32, data=pool.data, elem_offset=stat_off // 4,
                                  scope="shared.dyn")
            dst = T.decl_buffer((2, NC, 64, BQ), dtype, data=pool.data,
                                elem_offset=dst_off // 2, scope="shared.dyn")
            dstw = T.decl_buffer((2, NC, 64 * BQ // 2), "uint32", data=pool.data,
                                 elem_offset=dst_off // 4, scope="shared.dyn")
            dqt = T.decl_buffer((BQ * DQ_ROW,), F32, data=pool.data, elem_offset=dqt_off // 4,
                                scope="shared.dyn")
            bars = T.decl_buffer((NB,), "uint64", data=pool.data, elem_offset=bar_off // 8,
                                 scope="shared.dyn")
            dKf = T.decl_buffer((B * kob,), dtype, data=dK.data)
            dVf = T.decl_buffer((B * vob,), dtype, data=dV.data)
            c = T.alloc_buffer((6,), "int64", scope="local")
            w = T.alloc_buffer((2,), "int64", scope="local")
            seen = T.alloc_buffer((1,), "int32", scope="local")

            blk = T.meta_var(_fused_block(tile.dq_order, T.cast(bx, "int64"), nkt, B, Hkv))
            c[2] = blk[0] * BN
            c[0] = blk[1]
            c[1] = blk[2]
            c[3] = first_query_tile(causal, c[2], Lq, Lk, BQ)
            c[4] = T.ceildiv(Lq, BQ) - c[3]
            c[5] = c[4] * group
            if tx == 0:
                for i in T.unroll(NB):
                    T.ptx.mbarrier.init.shared.b64(
                        T.address_of(bars[i]),
                        T.uint32(1 if i < FULL else 32 if i < EMPTY else WG * NC))
                T.ptx.fence.proxy.async_.shared__cta()
            T.cuda.cta_sync()

            if tx < WG:  # -------------------------------------------------------- producer
                # the dQ writer warp too: keeping 32 would leave the consumers 232, and ptxas
                # spills 124 bytes there instead of 68
                T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS)
                if tx == 0 and c[5] > 0:
                    load_kv(Ks, Vs, kmap, vmap, bars, c, None)
                if tx < 32:  # warp 0: the stages, last query tile first
                    stage_steps(Qs, dOs, stats, qmap, domap, bars, LSE, Delta, c, w, Lq, tx,
                                first_dq, advance_dq, None)
                elif tx < 64:  # warp 1: adds each step's dQ tile, in key tile order
                    first_dq(w, c, Lq)
                    if c[5] > 0:
                        T.ptx.barrier.arrive.aligned(DQ_EMPTY, DQ_THREADS)
                    for i in T.serial(c[5]):
                        T.ptx.barrier.sync.aligned(DQ_FULL, DQ_THREADS)
                        if tx == 32:
                            # the key tiles before this one that see the query tile have added
                            # theirs (the tiles that see it are 0 .. t: first_query_tile grows
                            # with the key)
                            if ORDERED:
                                seen[0] = T.int32(-1)
                                while seen[0] != T.cast(c[2] // BN, "int32"):
                                    T.ptx["ld.acquire.gpu.global.b32"](
                                        seen[0], T.address_of(Sem[c[0], w[1], w[0] // BQ]))
                            T.ptx["cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"](
                                T.address_of(DQacc[c[0], w[1], w[0], 0]),
                                T.address_of(dqt[0]), T.uint32(dq_bytes))
                            T.ptx["cp.async.bulk.commit_group"]()
                            # the tile read: the consumers may write the next one while the
                            # add goes on in the L2 (FlashAttention-3 frees its tile so)
                            T.ptx["cp.async.bulk.wait_group.read"](0)
                        T.cuda.warp_sync()
                        if i + 1 < c[5]:
                            T.ptx.barrier.arrive.aligned(DQ_EMPTY, DQ_THREADS)
                        if tx == 32:  # the counter moves on only once the add is complete
                            T.ptx["cp.async.bulk.wait_group"](0)
                            T.ptx["fence.proxy.async.global"]()
                            T.ptx["fence.acq_rel.gpu"]()
                            T.ptx["red.release.gpu.global.add.s32"](
                                T.address_of(Sem[c[0], w[1], w[0] // BQ]), T.int32(1))
                        T.cuda.warp_sync()  # converged for the next aligned barrier
                        advance_dq(w, c, Lq)
            else:  # -------------------------------------------------------------- consumers
                T.ptx.setmaxnreg.inc.sync.aligned.u32(regs_consumer)
                st = T.alloc_buffer((NS * 4,), F32, scope="local")
                dpt = T.alloc_buffer((NS * 4,), F32, scope="local")
                p = T.alloc_buffer((NS * 4,), dtype, scope="local")
                pw = T.decl_buffer((NS * 2,), "uint32", data=p.data, scope="local")
                ds = T.alloc_buffer((NS * 4,), dtype, scope="local")
                dsw = T.decl_buffer((NS * 2,), "uint32", data=ds.data, scope="local")
                dk = T.alloc_buffer((NO * 4,), F32, scope="local")
                dv = T.alloc_buffer((NO * 4,), F32, scope="local")
                dqa = T.alloc_buffer((NQ * 4,), F32, scope="local")
                ka = T.alloc_buffer((1,), "uint64", scope="local")
                va = T.alloc_buffer((1,), "uint64", scope="local")
                bq = T.alloc_buffer((1,), "uint64", scope="local")
                bdo = T.alloc_buffer((1,), "uint64", scope="local")
                bqt = T.alloc_buffer((1,), "uint64", scope="local")
                bdot = T.alloc_buffer((1,), "uint64", scope="local")
                bdsk = T.alloc_buffer((1,), "uint64", scope="local")
                bds0 = T.alloc_buffer((1,), "uint64", scope="local")
                bds1 = T.alloc_buffer((1,), "uint64", scope="local")
                bkq = T.alloc_buffer((1,), "uint64", scope="local")
                cw = T.meta_var(tx // WG - 1)
                lane = T.meta_var(tx % 32)
                row0 = T.meta_var(c[2] + cw * 64)
                key_row = T.meta_var(row0 + tx % WG // 32 * 16 + lane // 4)
                for e in T.unroll(NO * 4):
                    dk[e] = T.float32(0)
                    dv[e] = T.float32(0)
                if c[5] > 0:
                    _desc(ka[0], T.address_of(Ks[0, cw * 64, 0]), 1, 8 * ROW, SW)
                    _desc(va[0], T.address_of(Vs[0, cw * 64, 0]), 1, 8 * ROW, SW)
                    T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
                    first_dq(w, c, Lq)
                    for i in T.serial(c[5]):
                        step_dq(st, dpt, p, pw, ds, dsw, dk, dv, dqa, Qs, dOs, Ks, stats, dst,
                                dstw, dqt, bars, ka, va, bq, bdo, bqt, bdot, bdsk, bds0, bds1,
                                bkq, i, w[0], key_row, row0, lane, cw, tx % WG, scale, Lq, Lk)
                        advance_dq(w, c, Lq)
                store(dK, dKf, kob, koh, kol, dk, scale, c, key_row, lane, Lk, None)
                store(dV, dVf, vob, voh, vol, dv, T.float32(1), c, key_row, lane, Lk, None)

        return flash_dkv_dq

    @T.prim_func
    def flash_dkv(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                  lse_h: T.handle, delta_h: T.handle, dk_h: T.handle, dv_h: T.handle,
                  scale: T.float32, slopes_h: T.handle, window_left: T.int64,
                  window_right: T.int64, softcap: T.float32, cuq_h: T.handle,
                  cuk_h: T.handle, max_seqlen_q: T.int64, max_seqlen_k: T.int64):
        T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qb, qh, ql, kb, kh, kl = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        vb, vh, vl, gb, gh, gl = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        kob, koh, kol, vob, voh, vol = (T.int64(), T.int64(), T.int64(), T.int64(), T.int64(),
                                        T.int64())
        Q = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=(qb, qh, ql, 1), align=16)
        K = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=(kb, kh, kl, 1), align=16)
        V = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=(vb, vh, vl, 1), align=16)
        dO = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=(gb, gh, gl, 1), align=16)
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dK = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype, strides=(kob, koh, kol, 1), align=16)
        dV = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype, strides=(vob, voh, vol, 1), align=16)
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_dkv", Q, K, V, dO, dK, dV)
        qmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(qmap, Q, ATOM, BQ, SW)
        domap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(domap, dO, ATOM, BQ, SW)
        kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(kmap, K, ATOM, BN, SW)
        vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        _tmap(vmap, V, ATOM, BN, SW)
        T.device_entry()
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        nkt = T.meta_var(T.ceildiv(max_seqlen_k if varlen else Lk, BN))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hkv)  # (batch or sequence) x head
        bx = T.cta_id([T.cast(heads * nkt, "int32")])
        tx = T.thread_id([NT])
        pool = T.alloc_buffer((pool_bytes,), "uint8", scope="shared.dyn", align=1024)
        Ks = T.decl_buffer((NA, BN, ATOM), dtype, data=pool.data, elem_offset=0,
                           scope="shared.dyn")
        Vs = T.decl_buffer((NA, BN, ATOM), dtype, data=pool.data, elem_offset=v_off // 2,
                           scope="shared.dyn")
        Qs = T.decl_buffer((ST, NA, BQ, ATOM), dtype, data=pool.data, elem_offset=q_off // 2,
                           scope="shared.dyn")
        dOs = T.decl_buffer((ST, NA, BQ, ATOM), dtype, data=pool.data, elem_offset=do_off // 2,
                            scope="shared.dyn")
        stats = T.decl_buffer((ST, 2, BQ), F32, data=pool.data, elem_offset=stat_off // 4,
                              scope="shared.dyn")  # LSE, Delta of the stage's queries
        slots = T.decl_buffer((ST, NW, WG) if SPLIT else (1,), "uint32", data=pool.data,
                              elem_offset=slot_off // 4, scope="shared.dyn")  # split: P^T
        bars = T.decl_buffer((NB,), "uint64", data=pool.data, elem_offset=bar_off // 8,
                             scope="shared.dyn")
        dKf = T.decl_buffer((B * kob,), dtype, data=dK.data)
        dVf = T.decl_buffer((B * vob,), dtype, data=dV.data)
        # c: batch, kv head, first key, first query tile that sees it, query tiles per head,
        # steps (query tiles x heads of the group)
        c = T.alloc_buffer((6,), "int64", scope="local")
        # w: the step's first query row and query head, advanced step by step (no division)
        w = T.alloc_buffer((2,), "int64", scope="local")
        if varlen:  # the block's sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        lq = T.meta_var(sq[1] if varlen else Lq)
        lk = T.meta_var(sq[3] if varlen else Lk)

        # causal: the keys seen by the most queries first (tile.l2_bytes: within groups of
        # KV heads whose group's Q, dO rows fit the L2, _tile_order)
        t, bh = T.meta_var(_tile_order(causal, T.cast(bx, "int64"), nkt, heads, tile.l2_bytes,
                                       Lq * T.int64(4 * D * key.group)))
        c[2] = t * BN
        if varlen:
            c[0] = T.int64(0)
            pin_sequence(sq, bh // Hkv, CuQ, CuK)
        else:
            c[0] = bh // Hkv
        c[1] = bh % Hkv
        c[3] = first_query_tile(causal, c[2], lq, lk, BQ, TILED, mods,
                                ModArgs(Slopes, window_left, window_right, softcap))
        if mods.window:  # the tiles up to the window's left edge seen from the last key
            c[4] = T.max(query_tiles_end(lq, lk, BQ, BN, c[2], causal, TILED, mods,
                                         ModArgs(Slopes, window_left, window_right, softcap))
                         - c[3], T.int64(0))
        elif varlen:
            c[4] = T.max(T.ceildiv(lq, BQ) - c[3], T.int64(0))
        else:
            c[4] = T.ceildiv(Lq, BQ) - c[3]
        if varlen:
            if c[2] >= lk:  # a key tile past its sequence's end: no step
                c[4] = T.int64(0)
        c[5] = c[4] * group
        if tx == 0:
            for i in T.unroll(NB):
                T.ptx.mbarrier.init.shared.b64(
                    T.address_of(bars[i]),
                    T.uint32(1 if i < FULL else 32 if i < EMPTY else WG * NC if i < PREADY
                             else WG))
            T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()

        if tx < WG:  # ------------------------------------------------------------ producer
            T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS)
            if tx == 0 and c[5] > 0:
                load_kv(Ks, Vs, kmap, vmap, bars, c, sq if varlen else None)
            if tx < 32:
                stage_steps(Qs, dOs, stats, qmap, domap, bars, LSE, Delta, c, w, lq, tx, first,
                            advance, sq if varlen else None)
        else:  # ------------------------------------------------------------------ consumers
            T.ptx.setmaxnreg.inc.sync.aligned.u32(regs_consumer)
            st = T.alloc_buffer((NS * 4,), F32, scope="local")
            dpt = T.alloc_buffer((NS * 4,), F32, scope="local")
            p = T.alloc_buffer((NS * 4,), dtype, scope="local")
            pw = T.decl_buffer((NS * 2,), "uint32", data=p.data, scope="local")
            ds = T.alloc_buffer((NS * 4,), dtype, scope="local")
            dsw = T.decl_buffer((NS * 2,), "uint32", data=ds.data, scope="local")
            dk = T.alloc_buffer((NO * 4,), F32, scope="local")
            dv = T.alloc_buffer((NO * 4,), F32, scope="local")
            ka = T.alloc_buffer((1,), "uint64", scope="local")
            va = T.alloc_buffer((1,), "uint64", scope="local")
            bq = T.alloc_buffer((1,), "uint64", scope="local")
            bdo = T.alloc_buffer((1,), "uint64", scope="local")
            bqt = T.alloc_buffer((1,), "uint64", scope="local")
            bdot = T.alloc_buffer((1,), "uint64", scope="local")
            if mods.softcap:  # S^T's 1 - tanh^2, for dS^T
                sc = T.alloc_buffer((NS * 4,), F32, scope="local")
            if mods.alibi:  # the step's query head's slope, as ModArgs.slopes[0, 0]
                sl = T.alloc_buffer((1, 1), F32, scope="local")
            if tile.stats_early:  # the step's LSE, then Delta, of the thread's queries
                sr = T.alloc_buffer((NS * 2,), F32, scope="local")
            ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                    softcap))
            cw = T.meta_var(tx // WG - 1)
            lane = T.meta_var(tx % 32)
            row0 = T.meta_var(c[2] + (0 if SPLIT else cw * 64))  # the warpgroup's first key
            key_row = T.meta_var(row0 + tx % WG // 32 * 16 + lane // 4)  # + 8 r

            if SPLIT:  # each warpgroup its own sums, set inside its branch (else both are live
                # where the branch starts: 2 D / 2 registers)
                if cw == 0:
                    for e in T.unroll(NO * 4):
                        dv[e] = T.float32(0)
                    if c[5] > 0:
                        _desc(ka[0], T.address_of(Ks[0, 0, 0]), 1, 8 * ROW, SW)
                        T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
                        first(w, c, lq)
                        for i in T.serial(c[5]):
                            if mods.alibi:
                                sl[0, 0] = alibi_slope_raw(
                                    mods, Slopes[sq[4] if varlen else c[0], w[1]], scale)
                            step_dv(st, p, pw, dv, Qs, dOs, stats, slots, bars, ka, bq, bdot, i,
                                    w[0], key_row, row0, lane, tx % WG, scale, lq, lk, ma)
                            advance(w, c, lq)
                    store(dV, dVf, vob, voh, vol, dv, T.float32(1), c, key_row, lane, Lk,
                          sq if varlen else None)
                else:
                    for e in T.unroll(NO * 4):
                        dk[e] = T.float32(0)
                    if c[5] > 0:
                        _desc(va[0], T.address_of(Vs[0, 0, 0]), 1, 8 * ROW, SW)
                        T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
                        first(w, c, lq)
                        for i in T.serial(c[5]):
                            step_dk(dpt, p, pw, ds, dsw, dk, Qs, dOs, stats, slots, bars, va,
                                    bdo, bqt, i, lane, tx % WG)
                            advance(w, c, lq)
                    store(dK, dKf, kob, koh, kol, dk, scale, c, key_row, lane, Lk,
                          sq if varlen else None)
            else:
                for e in T.unroll(NO * 4):
                    dk[e] = T.float32(0)
                    dv[e] = T.float32(0)
            if not SPLIT and c[5] > 0:
                _desc(ka[0], T.address_of(Ks[0, cw * 64, 0]), 1, 8 * ROW, SW)
                _desc(va[0], T.address_of(Vs[0, cw * 64, 0]), 1, 8 * ROW, SW)
                T.cuda.mbarrier_wait(T.address_of(bars[0]), 0)
                first(w, c, lq)
                for i in T.serial(c[5]):
                    if mods.alibi:
                        sl[0, 0] = alibi_slope_raw(mods, Slopes[sq[4] if varlen else c[0], w[1]],
                                                    scale)
                    step(st, dpt, p, pw, ds, dsw, dk, dv, Qs, dOs, stats, bars, ka, va, bq, bdo,
                         bqt, bdot, i, w[0], key_row, row0, lane, scale, lq, lk, ma,
                         sc if mods.softcap else None, sr if tile.stats_early else None)
                    advance(w, c, lq)
                if tile.overlap:  # the last step's dK
                    drain(dk, dv, bars, (c[5] - 1) % ST)
            if not SPLIT:
                store(dK, dKf, kob, koh, kol, dk, scale, c, key_row, lane, Lk,
                      sq if varlen else None)
                store(dV, dVf, vob, voh, vol, dv, T.float32(1), c, key_row, lane, Lk,
                      sq if varlen else None)

    return trim_params(flash_dkv, mods, varlen)


KERNELS = {"fwd": flash_forward, "dq": flash_dq, "dkv": flash_dkv}

ABSORBS = {"dq": "bwd_pre"}
"""Per op, the op whose work its kernel here does too (``tvm_flash.opspec.OpSpec.absorbs``):
dQ computes Delta (:func:`flash_dq`), so a backward on these kernels launches no ``bwd_pre``.
Measured (H100, 2026-12-06, ``docs/results/delta-in-dq-h100-v1.json``): the backward at D
64/128/256, N 4096/16384, bf16, 0.98-1.04x the time of ``bwd_pre`` + the plain dQ (within the
run-to-run spread); a launch fewer per backward on the host path."""
