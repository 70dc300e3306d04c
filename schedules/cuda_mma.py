"""CUDA (sm_80+, fp16/bf16): forward, dQ and dK/dV written at warp level on ``mma.sync``,
and the backward's preprocess (Delta), which every fp16/bf16 backward on sm_80+ runs (the Hopper
kernels' too).

Why these kernels are written here and not scheduled from ``tvm_flash.kernels``: block-level
tensorization (the WMMA schedule of docs/journal/perf-history.md v3/v4, since removed) keeps a
GEMM's product in an opaque fragment, so S, P and every partial product made a float32 round trip
through shared memory; at best that reached 0.23x the FlashAttention-2 forward. Here each warp owns
16 or 32 rows (one or two m-tiles) and holds its S, P, dP, dS and running sums in registers in the
documented ``m16n8k16`` accumulator layout, which is also the A-operand layout: P and dS feed the
second GEMM without leaving the registers, and the row statistics need only two shuffles across the
4 lanes that share a row. The algorithm is the one of ``tvm_flash.kernels`` (same masking, clamped
exp2, rounded P and dS, LSE and Delta conventions, the same ``common`` helpers); what is fixed here
is the thread mapping, so this module is the CUDA schedule of those kernels, written out.

Per kernel (``W`` warps of 32 lanes and ``mt`` m-tiles, ``16 mt W`` rows per block;
``lane = 4 g + t``):

* operands stay in shared memory, rows padded by 16 bytes so ``ldmatrix`` is conflict-free;
  the tiles the loop walks (K/V, or Q/dO for dK/dV) are double-buffered: ``cp.async`` fills
  the next stage while the tensor cores work on this one;
* a lane holds rows ``16 mi + g`` and ``16 mi + g + 8`` of its warp's, columns
  ``8 j + 2 t + {0, 1}``; with two m-tiles every B fragment loaded feeds two MMAs;
* only tiles that cross the causal diagonal or the end of the sequence are masked, and causal
  blocks take their tiles longest first across all heads (:func:`_block_order`);
* dK/dV's two pairs of independent products (S^T and dP^T, then dV and dK) each run in one
  loop, two chains of MMAs for the scheduler to interleave;
* the forward's row max and sum are balanced trees over a lane's elements, its exponent one
  FMA (scale and log2(e) folded), and the -inf guards are per row, not per element;
* head dims 160-256 (:data:`LARGE_D_TILES`): one m-tile per warp, Q read from shared memory,
  and dK/dV with the head dim split over two or four warps that share one step's P^T and dS^T
  through shared memory (``MmaTile.split``; four-way with two m-tiles a warp at D 192/256);
  the tiles take up to 217 KiB of shared memory (sm_90), less where the arch allows less.

Registers (ptxas, sm_90; docs/journal/perf-history.md v6, v7): at most 255, a few spilled bytes
where measured faster (see :func:`tile`).

Also here: the short-query (decode) forward's split kernel (:func:`flash_forward_split`: one
warp a block, the GQA group's packed rows as the MMA's n) and its merge
(:func:`flash_fwd_merge`, a warp per output row), which replaced the SIMT schedule's on
fp16/bf16 (decode, B 1, Hq 32, Hkv 8, Lk 4096, D 128 on the H200: 49 µs of kernels a call ->
12, docs/journal/2026-12-02-host-path.md).
"""

from __future__ import annotations

import dataclasses
import itertools

from tvm.script import tirx as T

from tvm_flash.kernels.common import (
    LOG2E,
    NO_MODS,
    ModArgs,
    Mods,
    Rows,
    TileConfig,
    causal_offset,
    diagonal,
    exp2_clamped,
    first_key,
    first_query_tile,
    modified_score,
    neg_inf,
    num_key_tiles,
    query_tiles_end,
    require_aligned_rows,
    row_lse,
    softcap_slope,
    split_size,
    strides,
    trim_params,
    visible,
)
from tvm_flash.key import KernelKey
from tvm_flash.opspec import PACKED_ROWS, PART_STATS

WARP = 32
F32 = "float32"
VEC = 8  # 16-bit elements per 16-byte copy
ROW_PAD = 8  # elements of padding per shared row (16 bytes)
OPS = ("fwd", "dq", "dkv")
ROW_OPS = ("bwd_pre", "fwd_merge")  # row-wise kernels written here (no tile, no mma)
SPLIT_OP = "fwd_split"  # the short-query forward (decode): :func:`flash_forward_split`
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
SMEM_LIMIT = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99, 121: 99}
"""Dynamic shared memory a block may opt into, KiB, per compute capability (CUDA programming
guide, "Technical specifications"); an arch not listed is given the smallest, 99."""
_PTX = {"float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class MmaTile:
    """A warp-level tile: ``warps`` warps of ``16 * mtiles`` rows own ``rows`` rows (queries
    for forward and dQ, keys for dK/dV); ``step`` rows of the other side per loop step;
    ``stages`` shared-memory buffers for the walked tiles. A warp with two m-tiles feeds each B
    fragment it loads to two MMAs, halving the ``ldmatrix`` traffic per MMA.

    ``split`` (dK/dV only): that many warps share one group of ``16 * mtiles`` keys
    (FlashAttention-2's layout). Each computes S^T and dP^T for ``step / split`` of the step's
    queries over the whole head dim and puts its P^T and dS^T in shared memory; after a barrier
    each takes the whole step's P^T and dS^T for its ``head_dim / split`` columns of dK and dV.
    That divides the dK and dV sums, ``2 * 16 mtiles * head_dim / 32`` registers per lane (256
    at D = 256), by ``split`` without computing anything twice.

    ``zfill``: the walked tiles' 16-byte ``cp.async`` copies without a branch — a row past the
    end copies 0 bytes (the instruction's src-size) and the rest is zero-filled, as
    FlashAttention-2's predicated copies do — instead of a branch around the copy and a zero
    store. ncu of the D 256 forward (H200, 62932ce): the step's copies, each beside its
    predicated-off zero store, drew 23% of the stall samples (MIO throttle). The default of
    the D 192/256 forward and the D 256 dK/dV (:func:`_large_d_copies`).

    ``pack`` (forward): P rounded to the input dtype two values a PTX ``cvt.rn.bf16x2.f32`` /
    ``f16x2.f32`` into the words its MMAs read. In the same profile ptxas had left P's
    conversions one ``F2F`` a value (the conversion unit, beside MUFU's exponentials) plus a
    byte permute a pair, where at D 64/128 it had paired them itself (``F2FP ... PACK_AB``).
    The default of the D 192/256 forward (:func:`_large_d_copies`)."""

    warps: int
    step: int
    stages: int = 2
    mtiles: int = 1
    split: int = 1
    zfill: bool = False
    pack: bool = False

    @property
    def rows(self) -> int:
        return 16 * self.mtiles * self.warps // self.split

    def check(self, head_dim: int) -> None:
        """Refuse a tile whose parts are not whole ``m16n8k16`` tiles."""
        if self.step % 16:
            raise ValueError(f"mma tile {self}: the step must be a multiple of 16 rows")
        if self.split > 1 and (self.warps % self.split or self.step // self.split % 16
                               or head_dim // self.split % 16):
            raise ValueError(f"mma tile {self}: split {self.split} must divide the warps, and "
                             f"leave multiples of 16 of the step and of D={head_dim}")
        if self.split > 1 and 2 * self.rows * (self.step + ROW_PAD) * 2 > 48 * 1024:
            raise ValueError(f"mma tile {self}: P^T and dS^T of a step exceed the 48 KiB of "
                             f"static shared memory")

    def smem_bytes(self, op: str, head_dim: int) -> int:
        """Shared memory of ``op``'s kernel with this tile: dynamic, plus a split tile's P^T
        and dS^T in static shared memory."""
        row = (head_dim + ROW_PAD) * 2
        if op == SPLIT_OP:  # the packed rows of Q; K and V stages
            return (PACKED_ROWS + 2 * self.stages * self.step) * row
        if op == "fwd":  # Q; K and V stages
            return (self.rows + 2 * self.stages * self.step) * row
        if op == "dq":  # Q and dO; K and V stages
            return (2 * self.rows + 2 * self.stages * self.step) * row
        # K and V; Q and dO stages, their LSE and Delta; split: P^T and dS^T of a step
        shared = (2 * self.rows + 2 * self.stages * self.step) * row + self.stages * self.step * 8
        if self.split > 1:
            shared += 2 * self.rows * (self.step + ROW_PAD) * 2
        return shared

    def tile_config(self, op: str) -> TileConfig:
        """As a (block_q, block_k) :class:`TileConfig` (names artifacts and tuning logs)."""
        if op == "dkv":
            return TileConfig(self.step, self.rows)
        if op == SPLIT_OP:
            return TileConfig(PACKED_ROWS, self.step)
        return TileConfig(self.rows, self.step)


def writes(key: KernelKey) -> bool:
    """Whether this module has a kernel for ``key``: fwd/dq/dkv, the row-wise bwd_pre and
    fwd_merge, and the short-query forward's split (:data:`SPLIT_OP`, without score
    modifiers), fp16/bf16, D in HEAD_DIMS, sm_80+; forward, dQ and dK/dV also with score
    modifiers (``tvm_flash.key.MODS``) and for packed sequences (``varlen``)."""
    # "90a": Hopper with its arch-specific instructions, still an sm_90 for mma.sync
    arch = key.target[len("cuda-sm_"):].removesuffix("a") if key.target.startswith(
        "cuda-sm_") else ""
    op_here = key.op in OPS + ROW_OPS or (key.op == SPLIT_OP and not key.mods)
    return (op_here and key.dtype in _PTX and key.head_dim in HEAD_DIMS
            and arch.isdigit() and int(arch) >= 80)


def supports(key: KernelKey) -> bool:
    """Whether ``key`` runs on these kernels (:func:`writes`). Those with score modifiers or
    for packed sequences ran against float64 on the H200 (cuda-sm_90 keys, forward, dQ and
    dK/dV at D 64, 128 and 256, soft cap alone and with window and ALiBi, packed, bf16:
    ``scripts/sweep_hopper.py --mma --mods ... --varlen``)."""
    return writes(key)


def tile_config(key: KernelKey) -> TileConfig:
    """The (block_q, block_k) naming ``key``'s artifacts: its tile's, and for the row-wise
    preprocess, which has none, the SIMT schedule's name for it (128 x 128)."""
    return TileConfig(128, 128) if key.op in ROW_OPS else tile(key).tile_config(key.op)


def tile(key: KernelKey) -> MmaTile:
    """Chosen from sweeps on the H200 (docs/journal/perf-history.md v5-v7):

    * forward and dQ: 4 warps of two m-tiles (128 query rows; v6: dQ +16-24%, forward up to
      +15% over one m-tile), 64-key steps up to D = 64 and 32 above, except the bf16 forward
      at D = 128, which takes 64-key steps (+5-10%; in fp16 that tile spills 44 bytes);
    * dK/dV: above D = 64 8 warps of one m-tile own 128 keys and take 64 queries a step (v5:
      +16% over 4 warps x 32); up to D = 64 4 warps of two m-tiles own 128 keys and take 32
      queries a step (v7, with S^T/dP^T and dV/dK each in one loop: +6-12% over one m-tile);
      splitting D over two warps with P and dS through shared memory (FlashAttention-2's
      layout) measured +0.5-2% at D = 128 (noise) and -5-35% at D = 64 (v7), so it is not done;
    * two stages (three measured from +1% to -38%, and for dK/dV from +1% to -20%);
    * D > 128: :data:`LARGE_D_TILES`, at D 192/256 with the copies and conversions of
      :func:`_large_d_copies`; dQ :data:`DQ_PAIR_TILE` where two blocks fit an SM.

    Some of these sit at ptxas's 255 registers with a few bytes spilled (at most 40,
    docs/journal/perf-history.md v6, v7); they measured faster than every spill-free alternative."""
    d, op = key.head_dim, key.op
    if op == SPLIT_OP:
        if d > 128:
            return dataclasses.replace(SPLIT_TILE, step=16, stages=3)
        return dataclasses.replace(SPLIT_TILE, zfill=True) if d <= 96 else SPLIT_TILE
    if d > 128:
        if op == "dq" and _two_blocks_fit(key, DQ_PAIR_TILE):
            return DQ_PAIR_TILE
        for candidate in LARGE_D_TILES[op]:
            if candidate.split > 2 and (key.mods or key.varlen):
                continue  # the four-way split ran against float64 on plain keys only
            try:  # e.g. a four-way split of D = 160 or 224, or over the arch's shared memory
                candidate.check(d)
                _check_fits(key, candidate)
            except ValueError:
                continue
            return _large_d_copies(key, candidate)
        raise ValueError(f"{key.name}: no mma tile of D={d} fits the {_smem_limit(key)} bytes "
                         f"of shared memory of {key.target}")
    if op == "dkv":
        return MmaTile(warps=8, step=64) if d > 64 else MmaTile(warps=4, step=32, mtiles=2)
    wide = d <= 64 or (op == "fwd" and d == 128 and key.dtype == "bfloat16")
    return MmaTile(warps=4, step=64 if wide else 32, mtiles=2)


def _large_d_copies(key: KernelKey, chosen: MmaTile) -> MmaTile:
    """``chosen`` with the copy and conversion forms measured faster at D 192 and 256 on plain
    keys: the forward's walked tiles copied without a branch and its P converted two values an
    instruction (``MmaTile.zfill``, ``pack``), the D 256 dK/dV's copies without a branch. H200,
    cuda-sm_90 keys, bf16, the kernel alone, TFLOP/s default -> with them, N 1024 / 4096
    (seventeenth session, docs/results/hopper-sweeps-v13.json): forward D 192 unmasked 182 /
    213 -> 193 / 226, causal 143 / 198 -> 151 / 215; D 256 unmasked 188 / 219 -> 199 / 235,
    causal 150 / 204 -> 160 / 222 (``pack`` alone 3-8%, ``zfill`` alone 1-4%); dK/dV D 256
    unmasked 194 / 221 -> 199 / 227, causal 159 / 200 -> 162 / 205 (D 192: within 0.3%, so
    not there). The bench grid's fp16 forward gained 0-4% (docs/results/bench-mma-d192-256-v3.json).
    ptxas: no spill either way. D 160 and 224, score modifiers and packed sequences were not
    measured and keep the branched copies; the smaller archs' D 192/256 tiles (sm_80/86/89,
    :data:`LARGE_D_TILES`) take the same forms, not measured there."""
    if key.mods or key.varlen or key.head_dim not in (192, 256):
        return chosen
    if key.op == "fwd":
        return dataclasses.replace(chosen, zfill=True, pack=True)
    if key.op == "dkv" and key.head_dim == 256:
        return dataclasses.replace(chosen, zfill=True)
    return chosen


_chosen_tile = tile  # for kernel(), whose override argument is named tile


def variants(key: KernelKey) -> list[MmaTile]:
    """The tiles a tuner may measure for ``key`` (``tvm_flash.tuning.tune_variants``), its
    default (:func:`tile`) first: 4 or 8 warps, one or two m-tiles (one above D = 128, where
    the sums alone take ``D / 2`` registers a lane, but two with a four-way split), 16- to
    64-row steps, two or three stages, and for dK/dV above D = 128 the head dim split over two
    or four warps — each one whose shape
    :meth:`MmaTile.check` accepts, that fits the arch's shared memory and, for dK/dV, has a
    thread per LSE and Delta row. Registers are not checked: a variant that spills measures
    slow. Keys with score modifiers or packed sequences have none (their extra arguments are
    scalars, or sized by the data); nor has the row-wise preprocess."""
    if key.op in ROW_OPS or key.op == SPLIT_OP or key.mods or key.varlen:
        return []
    default = _chosen_tile(key)
    d = key.head_dim
    found = [default]
    splits = (2, 4) if key.op == "dkv" and d > 128 else (1,)
    for warps, mtiles, step, stages, split in itertools.product(
            (4, 8), (1, 2), (16, 32, 64), (2, 3), splits):
        candidate = MmaTile(warps=warps, step=step, stages=stages, mtiles=mtiles, split=split)
        if candidate in found or (key.op == "dkv" and 2 * step > warps * WARP):
            continue
        if d > 128 and mtiles != (2 if split == 4 else 1):  # one m-tile a warp, two split 4
            continue
        try:
            candidate.check(d)
            _check_fits(key, candidate)
        except ValueError:
            continue
        found.append(candidate)
    return found


SPLIT_TILE = MmaTile(warps=1, step=32)
"""The short-query split's tile (:func:`flash_forward_split`, chosen by :func:`tile`): one
warp, 32-key steps, two stages; above D = 128 16-key steps in three stages; up to D = 96 the
copies without a branch (``zfill``). Measured on the H200 (bf16, Hq 32, Hkv 8, split + merge;
docs/results/decode-h200-v1.json): against 64-key steps at D 128 equal at B 1 Lk 4096 and
4-15% faster at B 8 or Lk 32768; the copies with a branch against ``zfill`` equal at D 64,
4-9% faster at D 128 and 256 (at D 96 they spill 4-8 bytes, ``zfill`` none). ptxas (nvcc 13.0,
sm_80 and sm_90a): no spill at any head dim (D 128: 202-232 registers, D 224: 255); 64-key
steps at D 96-128 and 32 at D 256 sit at 255 registers and spill (the copies' addresses)."""


LARGE_D_TILES = {
    "fwd": (MmaTile(warps=8, step=64), MmaTile(warps=8, step=32), MmaTile(warps=4, step=32)),
    "dq": (MmaTile(warps=8, step=32), MmaTile(warps=4, step=32), MmaTile(warps=4, step=16)),
    "dkv": (MmaTile(warps=8, step=64, mtiles=2, split=4), MmaTile(warps=8, step=64, split=2),
            MmaTile(warps=8, step=32, split=2), MmaTile(warps=4, step=32, stages=1, split=2)),
}
"""Tiles for D = 160-256, in order of preference; :func:`tile` takes the first whose shape
:meth:`MmaTile.check` accepts for the head dim and that fits the arch's shared memory (at D = 256
the first two fit sm_90's 227 KiB, the third sm_80's 163 KiB, the last 99 KiB). One m-tile per
warp but in dK/dV's first: the O or dQ sums alone take ``D / 2`` registers per lane and m-tile
(128 at D = 256). dK/dV splits the head dim over the warps that share a step's P^T and dS^T
(``MmaTile.split``): unsplit, its dK and dV sums would take ``D`` registers per lane; split four
ways (D = 192 and 256, where a quarter is whole 16-column tiles) a warp holds two m-tiles of a
quarter, so each B fragment it loads feeds two MMAs. Q stays in shared memory (the forward's
Q-in-registers path would add ``D / 4`` per m-tile). FlashAttention-2 runs D = 256 on the same
instruction with a 128 x 64 forward tile of 8 warps and 64 x 64 backward tiles of 8 warps.

Measured (``scripts/sweep_mma.py`` on the H200, cuda-sm_90 keys, bf16, N 1024 and 4096,
unmasked and causal; ``docs/results/hopper-sweeps-v11.json``): the forward's and dQ's first
tiles were the fastest of four at D 256 and within 1% at D 192 but for dQ, where 4 warps x 32
(two blocks an SM in sm_90's shared memory, one on sm_80) measured 4-9% faster — taken where
two blocks fit (:data:`DQ_PAIR_TILE`); dK/dV's four-way split 5-6% faster than the
two-way one at every point (D 160 and 224 keep the two-way split, not measured against it).

ptxas (nvcc 13.0, sm_90, fp16/bf16, every causal mode): the four-way dK/dV of D 192/256 224-242
registers, no spill; the other chosen tiles (also sm_80) no spills, registers fwd 209-245, dQ
166-249, dK/dV 170-244 (D 160: 209-217 / 166-172 / 176-177; D 256: 234-241 / 245-249 /
232-243)."""


DQ_PAIR_TILE = MmaTile(warps=4, step=32)
"""dQ above D = 128 where two of its blocks fit one SM's shared memory (:func:`tile`; sm_90
and sm_100 at D 160 and 192, 84 and 100 KiB a block): two 4-warp blocks an SM, each waiting
at its own barriers, against one 8-warp block. H100, cuda-sm_90 keys, the kernel alone, bf16
and fp16, unmasked and causal, N 1024 and 4096 (docs/results/hopper-sweeps-v17.json): 3.6-11.5%
faster than 8 warps x 32 at every point. ptxas (nvcc 13.0, the build's flags, every causal
mode): D 160 232-246 registers, D 192 240-246, no spill. Where only one block fits (sm_80's
164 KiB, D 224/256) the 8-warp tile stays first."""


def _two_blocks_fit(key: KernelKey, tile: MmaTile) -> bool:
    """Whether two blocks of ``tile`` fit one SM of the key's arch. An SM's shared memory is
    a block's opt-in limit (:data:`SMEM_LIMIT`) plus the 1 KiB the system reserves per block
    (CUDA programming guide: 228 KiB an SM on sm_90, 164 on sm_80, 100 on sm_86/89/120)."""
    return 2 * (tile.smem_bytes(key.op, key.head_dim) + 1024) <= _smem_limit(key) + 1024


class _Fragments:
    """TVMScript macros shared by the kernels, for head dim ``d`` and input ``dtype``."""

    def __init__(self, d: int, dtype: str, tile: MmaTile):
        tile.check(d)
        threads, mt = tile.warps * WARP, tile.mtiles
        ab = _PTX[dtype]
        stride, vrow = d + ROW_PAD, d // VEC
        dc = d // tile.split  # columns of the head dim a warp's dK/dV sums hold

        @T.macro
        def copy_vector(dst, base, src, b, h, start, length, vec, asynchronous):
            """Copy ``vec`` of :func:`copy_rows`: row ``vec // vrow``, 16 bytes from column
            ``vec % vrow * 8``."""
            row = T.meta_var(vec // vrow)
            col = T.meta_var(vec % vrow * VEC)
            # (asynchronous) the source offset computed outside the branch: nvcc then adds the
            # row stride to the previous copy's instead of multiplying per copy
            at = T.alloc_buffer((1,), "int64", scope="local")
            if asynchronous and tile.zfill:
                # no branch: a row past ``length`` copies 0 of its 16 bytes (cp.async's
                # src-size; the rest is zero-filled) from the first row, which every call has
                inside = T.meta_var(start + row < length)
                at[0] = src.offset_of([b, h, T.if_then_else(inside, start + row, T.int64(0)),
                                       col])[0]
                T.ptx.cp.async_.cg.shared.global_(
                    dst.access_ptr("w", offset=(base + row) * stride + col),
                    src.access_ptr("r", offset=at[0]), 16,
                    T.if_then_else(inside, T.uint32(16), T.uint32(0)))
            else:
                if asynchronous:
                    at[0] = src.offset_of([b, h, start + row, col])[0]
                if start + row < length:
                    if asynchronous:
                        T.ptx.cp.async_.cg.shared.global_(
                            dst.access_ptr("w", offset=(base + row) * stride + col),
                            src.access_ptr("r", offset=at[0]), 16)
                    else:
                        for v in T.vectorized(VEC):
                            dst[base + row, col + v] = src[b, h, start + row, col + v]
                else:
                    for v in T.vectorized(VEC):
                        dst[base + row, col + v] = T.cast(0, dtype)

        @T.macro
        def copy_rows(dst, base, src, b, h, start, length, rows, tx, asynchronous):
            """``dst[base + i, :] = src[b, h, start + i, :]`` for ``rows`` rows, 16 bytes per
            copy, zero rows past ``length``; ``asynchronous``: ``cp.async`` (the caller commits
            and waits)."""
            if rows * vrow % threads == 0:
                for it in T.unroll(rows * vrow // threads):
                    copy_vector(dst, base, src, b, h, start, length, it * threads + tx,
                                asynchronous)
            else:  # the last round is partial (D = 160 or 224 with some tiles)
                for it in T.unroll((rows * vrow + threads - 1) // threads):
                    if it * threads + tx < rows * vrow:
                        copy_vector(dst, base, src, b, h, start, length, it * threads + tx,
                                    asynchronous)

        @T.macro
        def mma(a, a_off, b, b_off, c, c_off):
            """``c[c_off:+4] += A (16x16, a[a_off:+8]) B (16x8, b[b_off:+4])`` in float32."""
            T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", ab, ab, "fp32", a.data, a_off,
                                        b.data, b_off, c.data, c_off, False, dtype=F32))

        def a_loader(row_stride: int):
            @T.macro
            def ld_a(frag, off, smem, row0, col0, lane):
                """A operand: the 16x16 block of ``smem`` at (row0, col0)."""
                T.evaluate(T.ptx_legacy.ldmatrix(
                    False, 4, ".b16", frag.data, off,
                    smem.access_ptr("r", offset=(row0 + lane % 16) * row_stride + col0
                                    + lane // 16 * 8), 0, dtype=dtype))

            return ld_a

        ld_a = a_loader(stride)  # rows of the head dim
        ld_a_step = a_loader(tile.step + ROW_PAD)  # rows of a step's P^T or dS^T (split)

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
        def load_a(a_regs, smem, row0, lane):
            """The A fragments of the warp's ``16 mt`` rows of ``smem`` from ``row0``, over the
            head dim, into ``a_regs`` (m-tile ``mi``, k-chunk ``kk`` at ``mi d / 2 + 8 kk``)."""
            for mi in T.unroll(mt):
                for kk in T.unroll(d // 16):
                    ld_a(a_regs, mi * (d // 2) + kk * 8, smem, row0 + mi * 16, kk * 16, lane)

        @T.macro
        def gemm_nt_pair(acc, a_regs, a_smem, b_smem, acc2, a2_smem, b2_smem, a_row, b_row, n,
                         bf, bf2, lane):
            """``acc (16 mt x n) += A B^T`` over the head dim: A the warp's rows (``a_regs``
            preloaded by ``load_a``, or ``a_smem`` rows from ``a_row``), B ``n`` rows of
            ``b_smem`` from ``b_row``; both stored (row, d). ``acc``: m-tile ``mi`` from
            ``mi n / 2``. Unless ``acc2`` is None, ``acc2 += A2 B2^T`` likewise (A2 always from
            ``a2_smem``, fragments in ``bf2``) in the same loop: two independent chains of MMAs
            for the scheduler to interleave."""
            for kk in T.unroll(d // 16):
                for mi in T.unroll(mt):
                    if a_regs is None:
                        ld_a(bf, 8 + mi * 8, a_smem, a_row + mi * 16, kk * 16, lane)
                    if acc2 is not None:
                        ld_a(bf2, 8 + mi * 8, a2_smem, a_row + mi * 16, kk * 16, lane)
                for jp in T.unroll(n // 16):
                    ld_b(bf, b_smem, b_row + jp * 16, kk * 16, lane)
                    if acc2 is not None:
                        ld_b(bf2, b2_smem, b_row + jp * 16, kk * 16, lane)
                    for half in T.unroll(2):
                        for mi in T.unroll(mt):
                            if a_regs is None:
                                mma(bf, 8 + mi * 8, bf, half * 4, acc,
                                    mi * (n // 2) + (jp * 2 + half) * 4)
                            else:
                                mma(a_regs, mi * (d // 2) + kk * 8, bf, half * 4, acc,
                                    mi * (n // 2) + (jp * 2 + half) * 4)
                            if acc2 is not None:
                                mma(bf2, 8 + mi * 8, bf2, half * 4, acc2,
                                    mi * (n // 2) + (jp * 2 + half) * 4)

        @T.macro
        def gemm_nt(acc, a_regs, a_smem, a_row, b_smem, b_row, n, bf, lane):
            """One product of :func:`gemm_nt_pair`."""
            gemm_nt_pair(acc, a_regs, a_smem, b_smem, None, None, None, a_row, b_row, n, bf,
                         None, lane)

        @T.macro
        def gemm_nn_pair(acc, a_regs, b_smem, acc2, a2_regs, b2_smem, k, b_row, bf, bf2, lane):
            """``acc (16 mt x d) += A B``: A (16 mt x k) in registers in the accumulator layout
            of a 16 mt x k product (P, dS), B ``k`` rows of ``b_smem`` from ``b_row``, stored
            (k, d). Unless ``acc2`` is None, ``acc2 += A2 B2`` likewise in the same loop."""
            for kk in T.unroll(k // 16):
                for np_ in T.unroll(d // 16):
                    ld_bt(bf, b_smem, b_row + kk * 16, np_ * 16, lane)
                    if acc2 is not None:
                        ld_bt(bf2, b2_smem, b_row + kk * 16, np_ * 16, lane)
                    for half in T.unroll(2):
                        for mi in T.unroll(mt):
                            mma(a_regs, mi * (k // 2) + kk * 8, bf, half * 4, acc,
                                mi * (d // 2) + (np_ * 2 + half) * 4)
                            if acc2 is not None:
                                mma(a2_regs, mi * (k // 2) + kk * 8, bf2, half * 4, acc2,
                                    mi * (d // 2) + (np_ * 2 + half) * 4)

        @T.macro
        def gemm_nn(acc, a_regs, k, b_smem, b_row, bf, lane):
            """One product of :func:`gemm_nn_pair`."""
            gemm_nn_pair(acc, a_regs, b_smem, None, None, None, k, b_row, bf, None, lane)

        @T.macro
        def gemm_nn_pair_split(acc, a_smem, b_smem, acc2, a2_smem, b2_smem, a_row, b_row, col0,
                               bf, bf2, lane):
            """``acc (16 mt x d / split) += A B`` and ``acc2 += A2 B2`` in one loop, for a
            split tile: A the warp's rows of ``a_smem`` from ``a_row`` over the step (P^T or
            dS^T, stored (row, step)), B the step's rows of ``b_smem`` from ``b_row``, columns
            ``col0`` to ``col0 + d / split``, stored (step, d)."""
            for kk in T.unroll(tile.step // 16):
                for mi in T.unroll(mt):
                    ld_a_step(bf, 8 + mi * 8, a_smem, a_row + mi * 16, kk * 16, lane)
                    ld_a_step(bf2, 8 + mi * 8, a2_smem, a_row + mi * 16, kk * 16, lane)
                for np_ in T.unroll(dc // 16):
                    ld_bt(bf, b_smem, b_row + kk * 16, col0 + np_ * 16, lane)
                    ld_bt(bf2, b2_smem, b_row + kk * 16, col0 + np_ * 16, lane)
                    for half in T.unroll(2):
                        for mi in T.unroll(mt):
                            mma(bf, 8 + mi * 8, bf, half * 4, acc,
                                mi * (dc // 2) + (np_ * 2 + half) * 4)
                            mma(bf2, 8 + mi * 8, bf2, half * 4, acc2,
                                mi * (dc // 2) + (np_ * 2 + half) * 4)

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
            """``dst[b, h, r0 + 16 (mt w + mi) + {g, g + 8}, :] = acc * scale`` (rows before
            ``length``)."""
            for mi in T.unroll(mt):
                for r in T.unroll(2):
                    row = T.meta_var(r0 + (w * mt + mi) * 16 + lane // 4 + r * 8)
                    if row < length:
                        for n in T.unroll(d // 8):
                            for e in T.vectorized(2):
                                dst[b, h, row, n * 8 + lane % 4 * 2 + e] = T.cast(
                                    acc[(mi * (d // 8) + n) * 4 + r * 2 + e] * scale, dtype)

        @T.macro
        def store_split(dst, b, h, r0, length, acc, scale, grp, col0, lane):
            """:func:`store_rows` for a split tile: ``acc`` holds the columns ``col0`` to
            ``col0 + d / split`` of the rows of key group ``grp``."""
            for mi in T.unroll(mt):
                for r in T.unroll(2):
                    row = T.meta_var(r0 + (grp * mt + mi) * 16 + lane // 4 + r * 8)
                    if row < length:
                        for n in T.unroll(dc // 8):
                            for e in T.vectorized(2):
                                dst[b, h, row, col0 + n * 8 + lane % 4 * 2 + e] = T.cast(
                                    acc[(mi * (dc // 8) + n) * 4 + r * 2 + e] * scale, dtype)

        self.copy_rows, self.load_a, self.mma, self.ld_a = copy_rows, load_a, mma, ld_a
        self.gemm_nn_pair_split, self.store_split = gemm_nn_pair_split, store_split
        self.gemm_nt, self.gemm_nn, self.quad_reduce = gemm_nt, gemm_nn, quad_reduce
        self.gemm_nt_pair, self.gemm_nn_pair = gemm_nt_pair, gemm_nn_pair
        self.zero, self.store_rows = zero, store_rows
        self.ready = _ready(tile.stages)


def _cvt_pair(dtype: str):
    """PTX ``cvt.rn`` of two float32 values into one word of ``dtype`` (bf16x2 or f16x2):
    called ``(word, high, low)`` — the element with the lower index is the low half."""
    return T.ptx.cvt.rn.bf16x2.f32 if dtype == "bfloat16" else T.ptx.cvt.rn.f16x2.f32


def _vector_rows(buf):
    """``buf`` (a strided ``(B, H, L, D)`` argument) declared with strides that are visibly
    multiples of ``VEC``: only then does TVM's CUDA codegen emit the 16-byte (and 4-byte)
    vector copies of a row (``ramp`` loads and stores whose base it cannot prove aligned
    become one scalar access per element). ``s // VEC * VEC`` is ``s`` wherever it matters:
    :func:`_require_vector_rows` refuses other strides."""
    return T.decl_buffer(buf.shape, buf.dtype, data=buf.data,
                         strides=[s // VEC * VEC for s in buf.strides[:3]] + [1])


def _require_vector_rows(name: str, *bufs):
    """Host check of kernel ``name``: every stride of ``bufs`` but the last is a multiple of
    ``VEC`` (or its dimension is 1), as ``tvm_flash.layout.kernel_view`` passes them."""
    return require_aligned_rows(name, *bufs, elements=VEC, unit=" (16 bytes)")


def _lane_row(i, n: int):
    """Which of its ``2 mt`` rows a lane's element ``i`` of a (16 mt x 8 n) accumulator is in:
    ``2 mi + r`` for m-tile ``mi`` and row ``g + 8 r`` of it."""
    return i // (4 * n) * 2 + i % 4 // 2


def _row_offset(i, n: int):
    """The row of element ``i`` within the warp's rows, less ``g``."""
    r = _lane_row(i, n)
    return r // 2 * 16 + r % 2 * 8


def _col_offset(i, n: int):
    """The column of element ``i``, less ``2 t``: n-tile ``8 j`` plus its pair member."""
    return i // 4 % n * 8 + i % 2


def pos_inf():
    return -neg_inf()


def _mask_needed(causal: str, first_row, rows: int, first_col, cols: int, col_end, lq, lk,
                 transposed: bool = False, mods: Mods = NO_MODS, ma=None):
    """Whether a (rows x cols) score tile may hold a masked element: it crosses ``col_end``,
    (causal) the diagonal or (``mods.window``, ``ma`` its arguments) an edge of the window.
    ``transposed``: rows are keys and columns queries (dK/dV). Under a window only the first
    and last few steps of a walk cross an edge: the others skip the mask."""
    crosses = [first_col + cols > col_end]
    if transposed:  # a key row j is masked for query i < j - offset
        if causal != "none":
            crosses.append(first_col < first_row + rows - 1 - causal_offset(causal, lq, lk))
        if mods.window:  # key j is visible to query i iff i + diag - left <= j <= i + diag + right
            diag = diagonal(causal, lq, lk)
            crosses += [first_row < first_col + cols - 1 + diag - ma.left,
                        first_row + rows - 1 > first_col + diag + ma.right]
    else:
        if causal != "none":
            crosses.append(first_col + cols - 1 > first_row + causal_offset(causal, lq, lk))
        if mods.window:
            diag = diagonal(causal, lq, lk)
            crosses += [first_col < first_row + rows - 1 + diag - ma.left,
                        first_col + cols - 1 > first_row + diag + ma.right]
    return _any(crosses)


def _any(conds):
    """The disjunction of ``conds`` (TIR expressions), left to right."""
    out = conds[0]
    for cond in conds[1:]:
        out = T.Or(out, cond)
    return out


class _KeyWalk:
    """Macros of the kernels whose block owns a query tile and walks the key tiles (forward,
    dQ): its coordinates, and the ``cp.async`` pipeline over K/V stages."""

    def __init__(self, f: _Fragments, key: KernelKey, tile: MmaTile):
        BQ, BK, stages, causal, group = tile.rows, tile.step, tile.stages, key.causal, key.group
        mods, varlen = Mods(key.window, key.softcap, key.alibi), key.varlen

        @T.macro
        def coords(c, bx, nqt, heads, Hq, Lq, Lk, ma, sq, cu_q, cu_k, slopes):
            """``c``: batch, head, kv head, first query row, key tiles to walk, and under a
            window the first key tile's first key. ``varlen``: the (batch x head) index is
            (sequence x head); the sequence goes to ``sq`` (:func:`pin_sequence`), the batch
            is 0, positions count within the sequence and a tile past its end walks no key
            tile. ALiBi: the tile's slope (its head's) from ``slopes`` into ``ma.slopes[0,
            0]``."""
            t, bh = T.meta_var(_block_order(causal, bx, nqt, heads))
            c[3] = (nqt - 1 - t) * BQ
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
                c[5] = first_key(causal, c[3], lq, lk, BK, T.int64(0), mods, ma)
            c[4] = num_key_tiles(causal, c[3], BQ, lq, lk, BK, c[5] if mods.window
                                 else T.int64(0), lk, mods, ma)
            if varlen:
                if c[3] >= lq:
                    c[4] = T.int64(0)
            if mods.alibi:
                ma.slopes[0, 0] = slopes[sq[4] if varlen else c[0], c[1]]

        @T.macro
        def prefetch(Ks, Vs, K, V, c, t, Lk, tx, sq):
            """Start copying key tile ``t`` (if there is one) into its stage; one commit group
            either way, so that ``ready`` always waits for the right one."""
            first = T.meta_var(_plus(sq[2] if varlen else 0, c[5] if mods.window else 0))
            end = T.meta_var(sq[2] + sq[3] if varlen else Lk)
            if t < c[4]:
                f.copy_rows(Ks, t % stages * BK, K, c[0], c[2], _plus(t * BK, first), end, BK,
                            tx, True)
                f.copy_rows(Vs, t % stages * BK, V, c[0], c[2], _plus(t * BK, first), end, BK,
                            tx, True)
            T.ptx.cp.async_.commit_group()

        self.coords, self.prefetch, self.ready = coords, prefetch, f.ready


@T.macro
def pin_sequence(sq, seq, cu_q, cu_k):
    """``sq[0:5]``: sequence ``seq``'s first query row, query length, first key row and key
    length in the packed rows (flash-attn's ``cu_seqlens``, int32) as int64, and ``seq``
    itself (its ALiBi slopes' row), computed once per tile (``kernels.common.pin_scalars``
    says why values in a small local buffer)."""
    sq[4] = seq
    sq[0] = T.cast(cu_q[sq[4]], "int64")
    sq[1] = T.cast(cu_q[sq[4] + 1], "int64") - sq[0]
    sq[2] = T.cast(cu_k[sq[4]], "int64")
    sq[3] = T.cast(cu_k[sq[4] + 1], "int64") - sq[2]


def _block_order(causal: str, bx, tiles, heads):
    """Block ``bx``'s (tile, counted from the last; batch x head) among ``tiles`` tiles of each
    of ``heads`` (batch, head) pairs. Causal tiles differ in length, the last (longest) ones
    most, so blocks take them longest first across all heads: the final wave holds the
    shortest (docs/journal/perf-history.md v7b: +4-11% causal forward, +11% GQA dK/dV). Unmasked
    tiles are equal and a head's tiles stay adjacent, sharing its K/V (or Q/dO) in L2."""
    if causal == "none":
        return bx % tiles, bx // tiles
    return bx // heads, bx % heads


def _plus(*terms):
    """The sum of ``terms`` without the literal zeros (0 where all are), added left to right:
    a split or windowed kernel's offsets vanish from the others' source, which stays as it
    was."""
    kept = [t for t in terms if not (isinstance(t, int) and t == 0)]
    total = kept[0] if kept else 0
    for t in kept[1:]:
        total = total + t
    return total


def _smem_limit(key: KernelKey) -> int:
    """Bytes of dynamic shared memory a block may use on the key's arch."""
    return SMEM_LIMIT.get(int(key.target[len("cuda-sm_"):].rstrip("a")), 99) * 1024


def _check_fits(key: KernelKey, tile: MmaTile) -> None:
    need = tile.smem_bytes(key.op, key.head_dim)
    if need > _smem_limit(key):
        raise ValueError(f"mma tile {tile}: {key.op} at D={key.head_dim} needs {need} bytes of "
                         f"shared memory, {key.target} allows {_smem_limit(key)}")


def _ready(stages: int):
    @T.macro
    def ready():
        """Wait for the oldest stage in flight, then for every thread's copies of it."""
        T.ptx.cp.async_.wait_group(stages - 1)
        T.tvm_storage_sync("shared")

    return ready


def _any_not_one(x, n: int):
    """Whether any of ``x[0:n]`` differs from 1 (a rescale factor that changes something)."""
    cond = x[0] != T.float32(1)
    for i in range(1, n):
        cond = T.Or(cond, x[i] != T.float32(1))
    return cond


def _row_tree(op, x, r, ns: int, dtype: str | None = None):
    """``op`` over this lane's ``2 ns`` elements of its row ``r`` (m-tile ``r // 2``, half
    ``r % 2``) of the accumulator-layout ``x``, as a balanced tree: short dependency chains
    instead of one of length ``2 ns``."""
    vals = [x[(r // 2 * ns + j) * 4 + r % 2 * 2 + e] for j in range(ns) for e in range(2)]
    vals = [T.cast(v, dtype) for v in vals] if dtype else vals
    while len(vals) > 1:
        vals = [op(*vals[i:i + 2]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


def flash_forward(key: KernelKey, tile: MmaTile):
    """``flash_fwd(q, k, v, sinks, o, lse, scale)`` as ``kernels.forward.flash_forward``.

    Differences in expression only: the row max is taken on the raw scores (``scale > 0``), so
    the scale and log2(e) fold into the exponent's FMA; the output rows are rescaled only when
    one of the thread's row maxima moved (the factor is exactly 1 otherwise).

    Score modifiers (``key.window``, ``softcap``, ``alibi``; their values the trailing
    ``MOD_ARGS``): the window's key tiles only, each masked; a soft cap or ALiBi rewrites S in
    base 2 before the softmax (then the row max is the rewritten one's). ``key.varlen``: a
    block's query tile lies in one sequence of the packed rows (``VARLEN_ARGS``)."""
    D, dtype, causal, sinks = key.head_dim, key.dtype, key.causal, key.sinks
    mods, varlen = Mods(key.window, key.softcap, key.alibi), key.varlen
    rescored = mods.softcap or mods.alibi
    W, BQ, BK, stages, MT = tile.warps, tile.rows, tile.step, tile.stages, tile.mtiles
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    _check_fits(key, tile)
    walk = _KeyWalk(f, key, tile)
    NS, NO = BK // 8, D // 8  # n-tiles of S and of O
    QREG = D * MT <= 128  # Q's A fragments stay in (at most 32) registers
    R = 2 * MT  # rows per lane

    @T.prim_func
    def flash_fwd(q_h: T.handle, k_h: T.handle, v_h: T.handle, sinks_h: T.handle,
                  o_h: T.handle, lse_h: T.handle, scale: T.float32, slopes_h: T.handle,
                  window_left: T.int64, window_right: T.int64, softcap: T.float32,
                  cuq_h: T.handle, cuk_h: T.handle, max_seqlen_q: T.int64,
                  max_seqlen_k: T.int64):
        T.func_attr({"global_symbol": "flash_fwd", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q_in = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K_in = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V_in = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        O_in = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=strides("o"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Sinks = T.match_buffer(sinks_h, (Hq,), F32)
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_fwd", Q_in, K_in, V_in, O_in)
        Q = _vector_rows(Q_in)
        K = _vector_rows(K_in)
        V = _vector_rows(V_in)
        O = _vector_rows(O_in)
        nqt = T.meta_var(T.ceildiv(max_seqlen_q if varlen else Lq, BQ))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hq)  # (batch or sequence) x head
        bx = T.launch_thread("blockIdx.x", heads * nqt)
        tx = T.launch_thread("threadIdx.x", NT)
        Qs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        Ks = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        qf = T.alloc_buffer((MT * D // 2,), dtype, scope="local")  # Q's A fragments (QREG)
        bf = T.alloc_buffer((8 + 8 * MT,), dtype, scope="local")  # B fragments, A ones
        s = T.alloc_buffer((MT * NS * 4,), F32, scope="local")
        p = T.alloc_buffer((MT * NS * 4,), dtype, scope="local")
        pw = T.decl_buffer((MT * NS * 2,), "uint32", data=p.data, scope="local")  # (pack)
        acc = T.alloc_buffer((MT * NO * 4,), F32, scope="local")
        m = T.alloc_buffer((R,), F32, scope="local")
        mn = T.alloc_buffer((R,), F32, scope="local")
        msub = T.alloc_buffer((R,), F32, scope="local")
        lsum = T.alloc_buffer((R,), F32, scope="local")
        c = T.alloc_buffer((6 if mods.window else 5,), "int64", scope="local")
        if varlen:  # the tile's sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        if mods.alibi:  # the tile's slope (its head's), as ModArgs.slopes[0, 0]
            sl = T.alloc_buffer((1, 1), F32, scope="local")
        ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                softcap))
        walk.coords(c, bx, nqt, heads, Hq, Lq, Lk, ma, sq if varlen else None, CuQ, CuK,
                    Slopes)
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        row = T.meta_var(c[3] + w * MT * 16 + lane // 4)  # + 16 mi + 8 r: this lane's rows
        scale2 = T.meta_var(T.float32(1) if rescored else scale * T.float32(LOG2E))
        lq = T.meta_var(sq[1] if varlen else Lq)  # positions count within the sequence
        lk = T.meta_var(sq[3] if varlen else Lk)
        qoff = T.meta_var(sq[0] if varlen else 0)  # its first row in the packed rows

        f.copy_rows(Qs, 0, Q, c[0], c[1], _plus(qoff, c[3]), _plus(qoff, lq), BQ, tx,
                    False)
        for pt in T.unroll(stages - 1):
            walk.prefetch(Ks, Vs, K, V, c, T.int64(pt), Lk, tx, sq if varlen else None)
        T.tvm_storage_sync("shared")
        if QREG:
            f.load_a(qf, Qs, w * MT * 16, lane)
        f.zero(acc, MT * NO * 4)
        for r in T.unroll(R):
            if sinks:  # the softmax starts from the sink (one lane of the row counts it)
                m[r] = Sinks[c[1]] * T.float32(LOG2E)
                lsum[r] = T.if_then_else(lane % 4 == 0, T.float32(1), T.float32(0))
            else:
                m[r] = neg_inf()
                lsum[r] = T.float32(0)

        for kt in T.serial(c[4]):
            k0 = T.meta_var(_plus(kt * BK, c[5] if mods.window else 0))
            walk.prefetch(Ks, Vs, K, V, c, kt + stages - 1, Lk, tx, sq if varlen else None)
            walk.ready()
            f.zero(s, MT * NS * 4)
            if QREG:
                f.gemm_nt(s, qf, None, 0, Ks, kt % stages * BK, BK, bf, lane)
            else:
                f.gemm_nt(s, None, Qs, w * MT * 16, Ks, kt % stages * BK, BK, bf, lane)
            if rescored:  # the modified score in base 2 (scale2 is then 1)
                for i in T.unroll(MT * NS * 4):
                    s[i] = modified_score(s[i], scale, mods, ma, causal, 0, 0,
                                          row + _row_offset(i, NS),
                                          k0 + lane % 4 * 2 + _col_offset(i, NS), lq,
                                          lk) * T.float32(LOG2E)
            if _mask_needed(causal, c[3], BQ, k0, BK, lk, lq, lk, mods=mods, ma=ma):
                for i in T.unroll(MT * NS * 4):
                    if not visible(causal, row + _row_offset(i, NS),
                                   k0 + lane % 4 * 2 + _col_offset(i, NS), lq, lk, None, mods,
                                   ma):
                        s[i] = neg_inf()
            # online softmax in base 2 (kernels.forward): new max, rounded P, rescale
            for r in T.unroll(R):
                mn[r] = _row_tree(T.max, s, r, NS)
                f.quad_reduce(mn, r, T.max)
                mn[r] = T.max(m[r], mn[r] * scale2)
                # subtracted from the row: a row with max -inf holds only -inf scores, and
                # -inf - 0 gives P = 0 where -inf - -inf would give NaN
                msub[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(0), mn[r])
            if tile.pack:  # P in S's registers, then two a conversion into its words
                for i in T.unroll(MT * NS * 4):
                    s[i] = exp2_clamped(s[i] * scale2 - msub[_lane_row(i, NS)])
                for i in T.unroll(MT * NS * 2):
                    _cvt_pair(dtype)(pw[i], s[2 * i + 1], s[2 * i])
            else:
                for i in T.unroll(MT * NS * 4):
                    p[i] = T.cast(exp2_clamped(s[i] * scale2 - msub[_lane_row(i, NS)]), dtype)
            for r in T.unroll(R):
                # m[r] holds the rescale factor until the new max replaces it
                m[r] = T.if_then_else(mn[r] == neg_inf(), T.float32(1),
                                      exp2_clamped(m[r] - mn[r]))
                lsum[r] = lsum[r] * m[r] + _row_tree(T.Add, p, r, NS, F32)
            if _any_not_one(m, R):
                for i in T.unroll(MT * NO * 4):
                    acc[i] = acc[i] * m[_lane_row(i, NO)]
            for r in T.unroll(R):
                m[r] = mn[r]
            f.gemm_nn(acc, p, BK, Vs, kt % stages * BK, bf, lane)
            T.tvm_storage_sync("shared")  # this stage is refilled next step

        for r in T.unroll(R):
            f.quad_reduce(lsum, r, T.Add)
            # l == 0 only for a row that saw no key (nor sink): O = 0, LSE = -inf
            mn[r] = T.if_then_else(lsum[r] == T.float32(0), T.float32(0),
                                   T.float32(1) / lsum[r])
        for i in T.unroll(MT * NO * 4):
            acc[i] = acc[i] * mn[_lane_row(i, NO)]
        f.store_rows(O, c[0], c[1], _plus(qoff, c[3]), _plus(qoff, lq), acc, T.float32(1),
                     w, lane)
        for mi in T.unroll(MT):
            for r in T.unroll(2):
                if lane % 4 == 0 and row + mi * 16 + r * 8 < lq:
                    LSE[c[0], c[1], _plus(qoff, row + mi * 16 + r * 8)] = row_lse(
                        m[mi * 2 + r], lsum[mi * 2 + r])

    return trim_params(flash_fwd, mods, varlen)


def flash_forward_split(key: KernelKey, tile: MmaTile):
    """``flash_fwd_split(q, k, v, part, scale)`` as
    ``kernels.forward.flash_forward_split`` (same partials, so ``flash_fwd_merge`` combines
    them): the short-query forward of a key split, one warp per block over ``PACKED_ROWS``
    packed query rows (a GQA group's queries, head-major).

    A decode step has a handful of query rows against thousands of keys, so the products run
    transposed, with the queries as the MMA's ``n = 8``: ``S^T = K Q^T`` (K from shared memory
    as the A operand, Q^T's B fragments loaded once) and ``O^T += V^T P^T`` (V^T by
    ``ldmatrix.trans``). No MMA row is padding, and O^T takes ``D / 4`` registers a lane. S^T's
    accumulator holds a lane's keys ``g, g + 8`` for queries ``2 t, 2 t + 1``; the B operand
    wants keys ``2 t, 2 t + 1`` for query ``g``: one ``movmatrix.trans`` per 8 x 8 block of
    rounded P^T moves it there without shared memory. A query's statistics live in the 8
    lanes of one ``t`` (three shuffles). The key tiles stream through ``stages`` shared
    buffers by ``cp.async`` as in the forward; the block's K/V tile is the only traffic that
    matters, which is why decode wants this kernel (the SIMT split moved ~0.5 TB/s).

    Plain keys only (:func:`writes`): a score modifier needs per-row slopes and windows that
    the packed rows would take from different heads; those keep the SIMT split kernel."""
    D, dtype, causal, group = key.head_dim, key.dtype, key.causal, key.group
    BK, stages = tile.step, tile.stages
    R = PACKED_ROWS
    rows = Rows(packed=True, group=group)  # packed row p: query p % Lq of head h + p // Lq
    f = _Fragments(D, dtype, tile)
    _check_fits(key, tile)
    stride = D + ROW_PAD
    MK, MD = BK // 16, D // 16  # m-tiles of S^T (a step's keys) and of O^T (the head dim)
    cvt = _cvt_pair(dtype)

    @T.macro
    def ld_q(frag, smem, lane):
        """Q^T's B fragments (k = the head dim, n = the 8 rows), 32 columns an ldmatrix:
        chunk ``kk`` of 16 at ``frag[4 kk:]``."""
        for c in T.unroll(D // 32):
            T.evaluate(T.ptx_legacy.ldmatrix(
                False, 4, ".b16", frag.data, c * 8,
                smem.access_ptr("r", offset=lane % 8 * stride + c * 32 + lane // 8 * 8), 0,
                dtype=dtype))

    @T.macro
    def ld_vt(frag, smem, k0, d0, lane):
        """V^T's A operand (16 of the head dim x 16 keys) from V stored (key, d)."""
        T.evaluate(T.ptx_legacy.ldmatrix(
            True, 4, ".b16", frag.data, 0,
            smem.access_ptr("r", offset=(k0 + lane // 16 * 8 + lane % 8) * stride + d0
                            + lane // 8 % 2 * 8), 0, dtype=dtype))

    @T.macro
    def quad_columns(x, j, op):
        """Combine ``x[j]`` over the 8 lanes of one query column (same ``t``)."""
        for sh in T.unroll(3):
            x[j] = op(x[j], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[j], 4 << sh, 32,
                                                    32))

    @T.prim_func
    def flash_fwd_split(q_h: T.handle, k_h: T.handle, v_h: T.handle, part_h: T.handle,
                        scale: T.float32):
        T.func_attr({"global_symbol": "flash_fwd_split", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk, BS = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q_in = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K_in = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V_in = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        Part = T.match_buffer(part_h, (BS, Hq, Lq, D + PART_STATS), F32)
        _require_vector_rows("flash_fwd_split", Q_in, K_in, V_in)
        Q = _vector_rows(Q_in)
        K = _vector_rows(K_in)
        V = _vector_rows(V_in)
        nrt = T.meta_var(T.ceildiv(rows.count(Lq), R))  # row tiles of a group
        nsp = T.meta_var(BS // B)  # key splits
        bx = T.launch_thread("blockIdx.x", B * Hkv * nrt * nsp)
        lane = T.launch_thread("threadIdx.x", WARP)
        Qs = T.alloc_buffer((R, stride), dtype, scope="shared.dyn")
        Ks = T.alloc_buffer((stages * BK, stride), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((stages * BK, stride), dtype, scope="shared.dyn")
        qf = T.alloc_buffer((D // 4,), dtype, scope="local")  # Q^T's B fragments
        af = T.alloc_buffer((8,), dtype, scope="local")  # an A fragment (K or V^T)
        s = T.alloc_buffer((MK * 4,), F32, scope="local")  # S^T, then P^T unrounded
        pr = T.alloc_buffer((MK * 4,), dtype, scope="local")  # P^T rounded, C layout
        prw = T.decl_buffer((MK * 2,), "uint32", data=pr.data, scope="local")
        pb = T.alloc_buffer((MK * 4,), dtype, scope="local")  # P^T as B fragments
        pbw = T.decl_buffer((MK * 2,), "uint32", data=pb.data, scope="local")
        acc = T.alloc_buffer((MD * 4,), F32, scope="local")  # O^T
        m = T.alloc_buffer((2,), F32, scope="local")  # per query column 2 t + j
        mn = T.alloc_buffer((2,), F32, scope="local")
        msub = T.alloc_buffer((2,), F32, scope="local")
        lsum = T.alloc_buffer((2,), F32, scope="local")
        # c: batch, kv head, first packed row, split, first key, end of the split's keys,
        # key tiles
        c = T.alloc_buffer((7,), "int64", scope="local")
        c[2] = bx % nrt * R
        c[3] = bx // nrt % nsp
        c[1] = bx // (nrt * nsp) % Hkv
        c[0] = bx // (nrt * nsp * Hkv)
        c[4] = c[3] * split_size(Lk, nsp, BK)
        # the split's keys, and none past the last one any query sees (top-left causal)
        c[5] = T.min(c[4] + split_size(Lk, nsp, BK), Lk)
        if causal != "none":
            c[5] = T.min(c[5], Lq + causal_offset(causal, Lq, Lk))
        c[6] = T.ceildiv(T.max(c[5] - c[4], T.int64(0)), BK)
        g = T.meta_var(lane // 4)
        t = T.meta_var(lane % 4)
        scale2 = T.meta_var(scale * T.float32(LOG2E))

        # Q's packed rows (zeros past the group's), read once, synchronously
        for it in T.unroll(D // 32):
            row = T.meta_var((it * WARP + lane) // (D // VEC))
            col = T.meta_var((it * WARP + lane) % (D // VEC) * VEC)
            p = T.meta_var(c[2] + row)
            if p < rows.count(Lq):
                for v in T.vectorized(VEC):
                    Qs[row, col + v] = Q[c[0], rows.head(c[1] * group, p, Lq),
                                         rows.query(p, Lq), col + v]
            else:
                for v in T.vectorized(VEC):
                    Qs[row, col + v] = T.cast(0, dtype)
        for pt in T.unroll(stages - 1):
            if T.int64(pt) < c[6]:
                f.copy_rows(Ks, pt * BK, K, c[0], c[1], c[4] + pt * BK, c[5], BK, lane, True)
                f.copy_rows(Vs, pt * BK, V, c[0], c[1], c[4] + pt * BK, c[5], BK, lane, True)
            T.ptx.cp.async_.commit_group()
        T.tvm_storage_sync("shared")
        ld_q(qf, Qs, lane)
        f.zero(acc, MD * 4)
        for j in T.unroll(2):
            m[j] = neg_inf()
            lsum[j] = T.float32(0)

        for kt in T.serial(c[6]):
            k0 = T.meta_var(c[4] + kt * BK)
            nxt = T.meta_var(kt + stages - 1)
            if nxt < c[6]:
                f.copy_rows(Ks, nxt % stages * BK, K, c[0], c[1], c[4] + nxt * BK, c[5], BK,
                            lane, True)
                f.copy_rows(Vs, nxt % stages * BK, V, c[0], c[1], c[4] + nxt * BK, c[5], BK,
                            lane, True)
            T.ptx.cp.async_.commit_group()
            f.ready()
            f.zero(s, MK * 4)
            for kk in T.unroll(MD):
                for mi in T.unroll(MK):
                    f.ld_a(af, 0, Ks, kt % stages * BK + mi * 16, kk * 16, lane)
                    f.mma(af, 0, qf, kk * 4, s, mi * 4)
            # element i: key k0 + 16 (i // 4) + g + 8 (i % 4 // 2), query column 2 t + i % 2
            if causal != "none" or k0 + BK > c[5]:
                for i in T.unroll(MK * 4):
                    if not visible(causal, (c[2] + t * 2 + i % 2) % Lq,
                                   k0 + i // 4 * 16 + g + i % 4 // 2 * 8, Lq, Lk, c[5]):
                        s[i] = neg_inf()
            for j in T.unroll(2):
                mn[j] = neg_inf()
                for i in T.unroll(MK * 2):
                    mn[j] = T.max(mn[j], s[i * 2 + j])
                quad_columns(mn, j, T.max)
                mn[j] = T.max(m[j], mn[j] * scale2)
                msub[j] = T.if_then_else(mn[j] == neg_inf(), T.float32(0), mn[j])
            for i in T.unroll(MK * 4):
                s[i] = exp2_clamped(s[i] * scale2 - msub[i % 2])
            for i in T.unroll(MK * 2):
                cvt(prw[i], s[2 * i + 1], s[2 * i])
                T.ptx.movmatrix.sync.aligned.m8n8.trans.b16(pbw[i], prw[i])
            for j in T.unroll(2):
                # m[j] holds the rescale factor until the new max replaces it
                m[j] = T.if_then_else(mn[j] == neg_inf(), T.float32(1),
                                      exp2_clamped(m[j] - mn[j]))
                lsum[j] = lsum[j] * m[j]
                for i in T.unroll(MK * 2):
                    lsum[j] = lsum[j] + T.cast(pr[i * 2 + j], F32)
            if _any_not_one(m, 2):
                for i in T.unroll(MD * 4):
                    acc[i] = acc[i] * m[i % 2]
            for j in T.unroll(2):
                m[j] = mn[j]
            for kk in T.unroll(MK):
                for md in T.unroll(MD):
                    ld_vt(af, Vs, kt % stages * BK + kk * 16, md * 16, lane)
                    f.mma(af, 0, pb, kk * 4, acc, md * 4)
            T.tvm_storage_sync("shared")  # this stage is refilled next step

        for j in T.unroll(2):
            quad_columns(lsum, j, T.Add)
        # lane: head-dim rows 16 md + g (+ 8), query columns 2 t + j
        for j in T.unroll(2):
            p = T.meta_var(c[2] + t * 2 + j)
            if p < rows.count(Lq):
                h = T.meta_var(rows.head(c[1] * group, p, Lq))
                for md in T.unroll(MD):
                    for r in T.unroll(2):
                        Part[c[3] * B + c[0], h, rows.query(p, Lq), md * 16 + g + r * 8] = acc[
                            md * 4 + r * 2 + j]
                if g == 0:
                    Part[c[3] * B + c[0], h, rows.query(p, Lq), D] = m[j]
                    Part[c[3] * B + c[0], h, rows.query(p, Lq), D + 1] = lsum[j]

    return flash_fwd_split


def _prob(score, lse, guarded: bool = True):
    """``kernels.backward._prob`` on an unmasked element of scaled (and modified) ``score``
    (``common.modified_score``): 0 for a row without keys (LSE -inf). Unguarded: the caller
    passes LSE = +inf for such a row (``exp2(-inf) = 0``), one select per row instead of one
    per element."""
    p = exp2_clamped((score - lse) * T.float32(LOG2E))
    return T.if_then_else(lse == neg_inf(), T.float32(0), p) if guarded else p


def flash_dq(key: KernelKey, tile: MmaTile):
    """``flash_dq(q, k, v, do, lse, delta, dq, scale)`` as ``kernels.backward.flash_dq``
    (score modifiers and packed sequences as :func:`flash_forward`; under a soft cap dS is
    scaled by its slope ``1 - tanh^2`` of S, taken before P replaces S)."""
    D, dtype, causal = key.head_dim, key.dtype, key.causal
    mods, varlen = Mods(key.window, key.softcap, key.alibi), key.varlen
    W, BQ, BK, stages, MT = tile.warps, tile.rows, tile.step, tile.stages, tile.mtiles
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    _check_fits(key, tile)
    walk = _KeyWalk(f, key, tile)
    NS, NO = BK // 8, D // 8

    @T.prim_func
    def flash_dq(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, lse_h: T.handle,
                 delta_h: T.handle, dq_h: T.handle, scale: T.float32, slopes_h: T.handle,
                 window_left: T.int64, window_right: T.int64, softcap: T.float32,
                 cuq_h: T.handle, cuk_h: T.handle, max_seqlen_q: T.int64,
                 max_seqlen_k: T.int64):
        T.func_attr({"global_symbol": "flash_dq", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q_in = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K_in = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V_in = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO_in = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dQ_in = T.match_buffer(dq_h, (B, Hq, Lq, D), dtype, strides=strides("dq"))
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_dq", Q_in, K_in, V_in, dO_in, dQ_in)
        Q = _vector_rows(Q_in)
        K = _vector_rows(K_in)
        V = _vector_rows(V_in)
        dO = _vector_rows(dO_in)
        dQ = _vector_rows(dQ_in)
        nqt = T.meta_var(T.ceildiv(max_seqlen_q if varlen else Lq, BQ))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hq)  # (batch or sequence) x head
        bx = T.launch_thread("blockIdx.x", heads * nqt)
        tx = T.launch_thread("threadIdx.x", NT)
        Qs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        dOs = T.alloc_buffer((BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        Ks = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((stages * BK, D + ROW_PAD), dtype, scope="shared.dyn")
        bf = T.alloc_buffer((8 + 8 * MT,), dtype, scope="local")
        s = T.alloc_buffer((MT * NS * 4,), F32, scope="local")
        dp = T.alloc_buffer((MT * NS * 4,), F32, scope="local")
        ds = T.alloc_buffer((MT * NS * 4,), dtype, scope="local")
        acc = T.alloc_buffer((MT * NO * 4,), F32, scope="local")
        lse = T.alloc_buffer((2 * MT,), F32, scope="local")
        delta = T.alloc_buffer((2 * MT,), F32, scope="local")
        c = T.alloc_buffer((6 if mods.window else 5,), "int64", scope="local")
        if varlen:  # the tile's sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        if mods.alibi:  # the tile's slope (its head's), as ModArgs.slopes[0, 0]
            sl = T.alloc_buffer((1, 1), F32, scope="local")
        ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                softcap))
        walk.coords(c, bx, nqt, heads, Hq, Lq, Lk, ma, sq if varlen else None, CuQ, CuK,
                    Slopes)
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        row = T.meta_var(c[3] + w * MT * 16 + lane // 4)  # + 16 mi + 8 r: this lane's rows
        lq = T.meta_var(sq[1] if varlen else Lq)  # positions count within the sequence
        lk = T.meta_var(sq[3] if varlen else Lk)
        qoff = T.meta_var(sq[0] if varlen else 0)  # its first row in the packed rows

        f.copy_rows(Qs, 0, Q, c[0], c[1], _plus(qoff, c[3]), _plus(qoff, lq), BQ, tx,
                    False)
        f.copy_rows(dOs, 0, dO, c[0], c[1], _plus(qoff, c[3]), _plus(qoff, lq), BQ, tx,
                    False)
        for pt in T.unroll(stages - 1):
            walk.prefetch(Ks, Vs, K, V, c, T.int64(pt), Lk, tx, sq if varlen else None)
        for mi in T.unroll(MT):
            for r in T.unroll(2):
                lse[mi * 2 + r] = pos_inf()  # P = 0 in rows past the end or without keys
                delta[mi * 2 + r] = T.float32(0)
                if row + mi * 16 + r * 8 < lq:
                    lse[mi * 2 + r] = LSE[c[0], c[1], _plus(qoff, row + mi * 16 + r * 8)]
                    delta[mi * 2 + r] = Delta[c[0], c[1], _plus(qoff, row + mi * 16 + r * 8)]
                    if lse[mi * 2 + r] == neg_inf():
                        lse[mi * 2 + r] = pos_inf()
        f.zero(acc, MT * NO * 4)

        for kt in T.serial(c[4]):
            k0 = T.meta_var(_plus(kt * BK, c[5] if mods.window else 0))
            walk.prefetch(Ks, Vs, K, V, c, kt + stages - 1, Lk, tx, sq if varlen else None)
            walk.ready()
            f.zero(s, MT * NS * 4)
            f.gemm_nt(s, None, Qs, w * MT * 16, Ks, kt % stages * BK, BK, bf, lane)
            f.zero(dp, MT * NS * 4)
            f.gemm_nt(dp, None, dOs, w * MT * 16, Vs, kt % stages * BK, BK, bf, lane)
            # P recomputed from the LSE; dS = P (dP - Delta) rounded to the input dtype
            if mods.softcap:  # dP - Delta times the cap's slope, from S before P replaces it
                for i in T.unroll(MT * NS * 4):
                    dp[i] = (dp[i] - delta[_lane_row(i, NS)]) * softcap_slope(s[i], scale,
                                                                              mods, ma)
            for i in T.unroll(MT * NS * 4):
                s[i] = _prob(modified_score(s[i], scale, mods, ma, causal, 0, 0,
                                            row + _row_offset(i, NS),
                                            k0 + lane % 4 * 2 + _col_offset(i, NS), lq, lk),
                             lse[_lane_row(i, NS)], False)
            if _mask_needed(causal, c[3], BQ, k0, BK, lk, lq, lk, mods=mods, ma=ma):
                for i in T.unroll(MT * NS * 4):
                    if not visible(causal, row + _row_offset(i, NS),
                                   k0 + lane % 4 * 2 + _col_offset(i, NS), lq, lk, None, mods,
                                   ma):
                        s[i] = T.float32(0)
            for i in T.unroll(MT * NS * 4):
                ds[i] = T.cast(s[i] * (dp[i] if mods.softcap
                                       else dp[i] - delta[_lane_row(i, NS)]), dtype)
            f.gemm_nn(acc, ds, BK, Ks, kt % stages * BK, bf, lane)
            T.tvm_storage_sync("shared")

        f.store_rows(dQ, c[0], c[1], _plus(qoff, c[3]), _plus(qoff, lq), acc, scale, w,
                     lane)

    return trim_params(flash_dq, mods, varlen)


def flash_dkv(key: KernelKey, tile: MmaTile):
    """``flash_dkv(q, k, v, do, lse, delta, dk, dv, scale)`` as ``kernels.backward.flash_dkv``:
    a block owns ``tile.rows`` keys of one key/value head and walks every query head of its
    group and every query tile that sees those keys (one flattened, double-buffered loop).
    A split tile (``MmaTile.split``) passes each step's P^T and dS^T through shared memory.
    Score modifiers and packed sequences as :func:`flash_forward` (a block's keys lie in one
    sequence; under a window it walks only the query tiles that see them; ALiBi's slope is
    the step's query head's)."""
    D, dtype, causal, group = key.head_dim, key.dtype, key.causal, key.group
    mods, varlen = Mods(key.window, key.softcap, key.alibi), key.varlen
    W, BK, BQ, stages, MT = tile.warps, tile.rows, tile.step, tile.stages, tile.mtiles
    SP = tile.split
    NT = W * WARP
    f = _Fragments(D, dtype, tile)
    _check_fits(key, tile)
    BQW = BQ // SP  # queries of a warp's S^T and dP^T
    NS, NO = BQW // 8, D // SP // 8
    if 2 * BQ > NT:
        raise ValueError(f"mma tile {tile}: one thread per LSE and Delta row needs {2 * BQ}")

    @T.macro
    def load_step(Qs, dOs, stats, Q, dO, LSE, Delta, b, hq, q0, Lq, stage, tx):
        """Stage ``stage``: the Q and dO tile of query head ``hq`` from row ``q0``, and its LSE
        and Delta (LSE -inf and Delta 0 from row ``Lq`` on)."""
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
                  scale: T.float32, slopes_h: T.handle, window_left: T.int64,
                  window_right: T.int64, softcap: T.float32, cuq_h: T.handle, cuk_h: T.handle,
                  max_seqlen_q: T.int64, max_seqlen_k: T.int64):
        T.func_attr({"global_symbol": "flash_dkv", "tirx.noalias": True})
        B, Hq, Hkv, Lq, Lk = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Q_in = T.match_buffer(q_h, (B, Hq, Lq, D), dtype, strides=strides("q"))
        K_in = T.match_buffer(k_h, (B, Hkv, Lk, D), dtype, strides=strides("k"))
        V_in = T.match_buffer(v_h, (B, Hkv, Lk, D), dtype, strides=strides("v"))
        dO_in = T.match_buffer(do_h, (B, Hq, Lq, D), dtype, strides=strides("do"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        Delta = T.match_buffer(delta_h, (B, Hq, Lq), F32)
        dK_in = T.match_buffer(dk_h, (B, Hkv, Lk, D), dtype, strides=strides("dk"))
        dV_in = T.match_buffer(dv_h, (B, Hkv, Lk, D), dtype, strides=strides("dv"))
        NS1, NSL = T.int64(), T.int64()
        Slopes = T.match_buffer(slopes_h, (NSL if varlen else B, Hq), F32)
        CuQ = T.match_buffer(cuq_h, (NS1,), "int32")
        CuK = T.match_buffer(cuk_h, (NS1,), "int32")
        _require_vector_rows("flash_dkv", Q_in, K_in, V_in, dO_in, dK_in, dV_in)
        Q = _vector_rows(Q_in)
        K = _vector_rows(K_in)
        V = _vector_rows(V_in)
        dO = _vector_rows(dO_in)
        dK = _vector_rows(dK_in)
        dV = _vector_rows(dV_in)
        nkt = T.meta_var(T.ceildiv(max_seqlen_k if varlen else Lk, BK))
        heads = T.meta_var((NS1 - 1 if varlen else B) * Hkv)  # (batch or sequence) x kv head
        bx = T.launch_thread("blockIdx.x", heads * nkt)
        tx = T.launch_thread("threadIdx.x", NT)
        Ks = T.alloc_buffer((BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Vs = T.alloc_buffer((BK, D + ROW_PAD), dtype, scope="shared.dyn")
        Qs = T.alloc_buffer((stages * BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        dOs = T.alloc_buffer((stages * BQ, D + ROW_PAD), dtype, scope="shared.dyn")
        stats = T.alloc_buffer((stages * 2 * BQ,), F32, scope="shared.dyn")  # LSE, Delta
        if SP > 1:  # the step's P^T and dS^T (rounded), the A operands of dV and dK; static
            # shared memory: TVM merges all shared.dyn buffers into one, and its barrier planner
            # would then see these writes conflict with the step's reads of Q and dO, and add
            # a barrier before them
            Ps = T.alloc_buffer((BK, BQ + ROW_PAD), dtype, scope="shared")
            dSs = T.alloc_buffer((BK, BQ + ROW_PAD), dtype, scope="shared")
        bf = T.alloc_buffer((8 + 8 * MT,), dtype, scope="local")
        bf2 = T.alloc_buffer((8 + 8 * MT,), dtype, scope="local")
        st = T.alloc_buffer((MT * NS * 4,), F32, scope="local")
        dpt = T.alloc_buffer((MT * NS * 4,), F32, scope="local")
        pt = T.alloc_buffer((MT * NS * 4,), dtype, scope="local")
        dst = T.alloc_buffer((MT * NS * 4,), dtype, scope="local")
        dk = T.alloc_buffer((MT * NO * 4,), F32, scope="local")
        dv = T.alloc_buffer((MT * NO * 4,), F32, scope="local")
        # c: batch, kv head, first key, first query tile that sees it, query tiles per head,
        # steps (query tiles x heads of the group)
        c = T.alloc_buffer((6,), "int64", scope="local")
        if varlen:  # the keys' sequence: first q row, length, first k row, length, index
            sq = T.alloc_buffer((5,), "int64", scope="local")
        if mods.alibi:  # the step's slope (its query head's), as ModArgs.slopes[0, 0]
            sl = T.alloc_buffer((1, 1), F32, scope="local")
        ma = T.meta_var(ModArgs(sl if mods.alibi else None, window_left, window_right,
                                softcap))
        t, bh = T.meta_var(_block_order(causal, bx, nkt, heads))
        c[2] = (nkt - 1 - t) * BK  # causal: the keys seen by the most queries first
        if varlen:
            c[0] = T.int64(0)
            pin_sequence(sq, bh // Hkv, CuQ, CuK)
        else:
            c[0] = bh // Hkv
        c[1] = bh % Hkv
        lq = T.meta_var(sq[1] if varlen else Lq)  # positions count within the sequence
        lk = T.meta_var(sq[3] if varlen else Lk)
        qoff = T.meta_var(sq[0] if varlen else 0)  # its first rows in the packed rows
        koff = T.meta_var(sq[2] if varlen else 0)
        c[3] = first_query_tile(causal, c[2], lq, lk, BQ, mods=mods, ma=ma)
        if mods.window:
            c[4] = T.max(query_tiles_end(lq, lk, BQ, BK, c[2], causal, mods=mods, ma=ma)
                         - c[3], 0)
        else:
            c[4] = T.ceildiv(lq, BQ) - c[3]
        c[5] = c[4] * group
        if varlen:
            if c[2] >= lk:  # a key tile past the sequence's end
                c[5] = T.int64(0)
        w = T.meta_var(tx // WARP)
        lane = T.meta_var(tx % WARP)
        if SP > 1:  # warp w: keys of group w // SP, queries and columns of part w % SP
            kg = T.meta_var(w // SP)
            qw = T.meta_var(w % SP * BQW)  # its first query of the step
        else:
            kg = T.meta_var(w)
            qw = T.meta_var(0)
        key_row = T.meta_var(c[2] + kg * MT * 16 + lane // 4)  # + 16 mi + 8 r: this lane's keys

        f.copy_rows(Ks, 0, K, c[0], c[1], _plus(koff, c[2]), _plus(koff, lk), BK, tx, False)
        f.copy_rows(Vs, 0, V, c[0], c[1], _plus(koff, c[2]), _plus(koff, lk), BK, tx, False)
        for ps in T.unroll(stages - 1):
            if T.int64(ps) < c[5]:
                load_step(Qs, dOs, stats, Q, dO, LSE, Delta, c[0],
                          c[1] * group + T.int64(ps) // c[4],
                          _plus(qoff, (c[3] + T.int64(ps) % c[4]) * BQ), _plus(qoff, lq),
                          ps, tx)
            T.ptx.cp.async_.commit_group()
        f.zero(dk, MT * NO * 4)
        f.zero(dv, MT * NO * 4)

        for i in T.serial(c[5]):
            q0 = T.meta_var((c[3] + i % c[4]) * BQ)
            ahead = T.meta_var(i + stages - 1)
            if ahead < c[5]:
                load_step(Qs, dOs, stats, Q, dO, LSE, Delta, c[0], c[1] * group + ahead // c[4],
                          _plus(qoff, (c[3] + ahead % c[4]) * BQ), _plus(qoff, lq),
                          ahead % stages, tx)
            T.ptx.cp.async_.commit_group()
            f.ready()
            sq_ = T.meta_var(i % stages * BQ)  # this step's rows of Qs / dOs
            ss = T.meta_var(i % stages * 2 * BQ)  # and of stats
            # S^T = K Q^T and dP^T = V dO^T in one loop; P^T recomputed from the LSE of each
            # column (query)
            f.zero(st, MT * NS * 4)
            f.zero(dpt, MT * NS * 4)
            f.gemm_nt_pair(st, None, Ks, Qs, dpt, Vs, dOs, kg * MT * 16, _plus(sq_, qw), BQW,
                           bf, bf2, lane)
            if mods.alibi:
                sl[0, 0] = Slopes[sq[4] if varlen else c[0], c[1] * group + i // c[4]]
            if mods.softcap:  # dP^T - Delta times the cap's slope, from S^T before P^T
                for i2, e in T.grid(MT * NS, 4):
                    dpt[i2 * 4 + e] = (dpt[i2 * 4 + e] - stats[
                        _plus(ss + BQ, qw) + lane % 4 * 2 + _col_offset(i2 * 4 + e, NS)]
                    ) * softcap_slope(st[i2 * 4 + e], scale, mods, ma)
            for i2, e in T.grid(MT * NS, 4):
                st[i2 * 4 + e] = T.cast(T.cast(_prob(
                    modified_score(st[i2 * 4 + e], scale, mods, ma, causal, 0, 0,
                                   _plus(q0, qw) + lane % 4 * 2 + _col_offset(i2 * 4 + e, NS),
                                   key_row + _row_offset(i2 * 4 + e, NS), lq, lk),
                    stats[_plus(ss, qw) + lane % 4 * 2 + _col_offset(i2 * 4 + e, NS)]),
                    dtype), F32)
            if _mask_needed(causal, c[2], BK, q0, BQ, lq, lq, lk, transposed=True, mods=mods,
                            ma=ma):
                for i2, e in T.grid(MT * NS, 4):
                    if not visible(causal,
                                   _plus(q0, qw) + lane % 4 * 2 + _col_offset(i2 * 4 + e, NS),
                                   key_row + _row_offset(i2 * 4 + e, NS), lq, lk, None, mods,
                                   ma):
                        st[i2 * 4 + e] = T.float32(0)
            # dS^T = P^T (dP^T - Delta); dV += P^T dO and dK += dS^T Q in one loop
            for i2, e in T.grid(MT * NS, 4):
                pt[i2 * 4 + e] = T.cast(st[i2 * 4 + e], dtype)
                dst[i2 * 4 + e] = T.cast(st[i2 * 4 + e] * (
                    dpt[i2 * 4 + e] if mods.softcap  # already (dP^T - Delta) times the slope
                    else dpt[i2 * 4 + e] - stats[_plus(ss + BQ, qw) + lane % 4 * 2
                                                 + _col_offset(i2 * 4 + e, NS)]), dtype)
            if SP > 1:  # every warp of the group takes the whole step's P^T and dS^T
                for i2, e in T.grid(MT * NS * 2, 2):
                    Ps[kg * MT * 16 + lane // 4 + _row_offset(i2 * 2, NS),
                       qw + lane % 4 * 2 + _col_offset(i2 * 2, NS) + e] = pt[i2 * 2 + e]
                    dSs[kg * MT * 16 + lane // 4 + _row_offset(i2 * 2, NS),
                        qw + lane % 4 * 2 + _col_offset(i2 * 2, NS) + e] = dst[i2 * 2 + e]
                T.tvm_storage_sync("shared")
                f.gemm_nn_pair_split(dv, Ps, dOs, dk, dSs, Qs, kg * MT * 16, sq_,
                                     w % SP * D // SP, bf, bf2, lane)
            else:
                f.gemm_nn_pair(dv, pt, dOs, dk, dst, Qs, BQ, sq_, bf, bf2, lane)
            T.tvm_storage_sync("shared")

        k_first = T.meta_var(_plus(koff, c[2]))
        k_end = T.meta_var(_plus(koff, lk))
        if SP > 1:
            f.store_split(dK, c[0], c[1], k_first, k_end, dk, scale, kg, w % SP * D // SP, lane)
            f.store_split(dV, c[0], c[1], k_first, k_end, dv, T.float32(1), kg,
                          w % SP * D // SP, lane)
        else:
            f.store_rows(dK, c[0], c[1], k_first, k_end, dk, scale, w, lane)
            f.store_rows(dV, c[0], c[1], k_first, k_end, dv, T.float32(1), w, lane)

    return trim_params(flash_dkv, mods, varlen)


def widen_half(dtype: str, w, hi: bool):
    """Element ``hi`` of the two fp16/bf16 values in the 32-bit word ``w``, as float32."""
    if dtype == "bfloat16":
        return T.reinterpret(F32, (w & T.uint32(0xFFFF0000)) if hi else (w << T.uint32(16)))
    half = (w >> T.uint32(16)) if hi else (w & T.uint32(0xFFFF))
    return T.cast(T.reinterpret("float16", T.cast(half, "uint16")), F32)


PRE_ROWS = 32
"""Rows a block of the backward's preprocess reduces: 4 lanes a row, 128 threads."""


def flash_bwd_pre(key: KernelKey, tile=None):
    """``Delta[b, h, i] = sum_d O * dO`` in float32 (``tvm_flash.kernels``'
    ``flash_bwd_preprocess``), for fp16/bf16 at any head dim in ``HEAD_DIMS``.

    A memory-bound row reduction: four lanes share a row, each reading 16 bytes of O and of dO
    per load (a quad covers 64 contiguous bytes), the products summed in float32 and then over
    the quad by two shuffles. The block's first row and (batch, head) come from one int32
    division of the block index. The SIMT schedule of the factory (a warp per row, 2-byte
    loads, the row's coordinates recomputed per thread with 64-bit divisions) took 302 µs at
    B·L = 16k, H·D = 2048 on the H200, 4x FlashAttention-2's preprocess, which also zeroes
    dQ's float32 accumulator."""
    D, dtype = key.head_dim, key.dtype
    NC = D // 32  # 16-byte loads per lane: 8 elements of each of its row's 32-column stripes
    NT = 128

    @T.prim_func
    def flash_bwd_pre(o_h: T.handle, do_h: T.handle, delta_h: T.handle):
        T.func_attr({"global_symbol": "flash_bwd_pre", "tirx.noalias": True})
        B, H, L = T.int64(), T.int64(), T.int64()
        O_in = T.match_buffer(o_h, (B, H, L, D), dtype, strides=strides("o"))
        dO_in = T.match_buffer(do_h, (B, H, L, D), dtype, strides=strides("do"))
        Delta = T.match_buffer(delta_h, (B, H, L), F32)
        _require_vector_rows("flash_bwd_pre", O_in, dO_in)
        # 32-bit words (two elements) at strides visibly multiples of 4: 16-byte loads
        Ow = T.decl_buffer((B, H, L, D // 2), "uint32", data=O_in.data,
                           strides=[s // VEC * (VEC // 2) for s in O_in.strides[:3]] + [1])
        dOw = T.decl_buffer((B, H, L, D // 2), "uint32", data=dO_in.data,
                            strides=[s // VEC * (VEC // 2) for s in dO_in.strides[:3]] + [1])
        nt = T.meta_var(T.ceildiv(L, PRE_ROWS))
        bx = T.launch_thread("blockIdx.x", B * H * nt)
        tx = T.launch_thread("threadIdx.x", NT)
        o = T.alloc_buffer((4 * NC,), "uint32", scope="local")
        do = T.alloc_buffer((4 * NC,), "uint32", scope="local")
        acc = T.alloc_buffer((1,), F32, scope="local")
        # the grid has fewer than 2^31 blocks: int32 quotients, non-negative (truncating)
        bh = T.meta_var(T.truncdiv(T.cast(bx, "int32"), T.cast(nt, "int32")))
        b = T.meta_var(T.cast(T.truncdiv(bh, T.cast(H, "int32")), "int64"))
        h = T.meta_var(T.cast(T.truncmod(bh, T.cast(H, "int32")), "int64"))
        row = T.meta_var(T.cast(T.truncmod(T.cast(bx, "int32"), T.cast(nt, "int32")), "int64")
                         * PRE_ROWS + tx // 4)
        acc[0] = T.float32(0)
        if row < L:
            # every load issued before the first use: one memory latency, not NC
            for c in T.unroll(NC):
                for v in T.vectorized(4):
                    o[c * 4 + v] = Ow[b, h, row, (c * 4 + tx % 4) * 4 + v]
                for v in T.vectorized(4):
                    do[c * 4 + v] = dOw[b, h, row, (c * 4 + tx % 4) * 4 + v]
            for v in T.unroll(4 * NC):
                acc[0] = acc[0] + widen_half(dtype, o[v], False) * widen_half(dtype, do[v], False)
                acc[0] = acc[0] + widen_half(dtype, o[v], True) * widen_half(dtype, do[v], True)
        # every lane takes part in the shuffles (a row past L adds zeros)
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), acc[0], 1, 32, 32)
        acc[0] = acc[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), acc[0], 2, 32, 32)
        if tx % 4 == 0 and row < L:
            Delta[b, h, row] = acc[0]

    return flash_bwd_pre


MERGE_ROWS = 4
"""Rows of a merge block: one warp each."""


def flash_fwd_merge(key: KernelKey, tile=None):
    """``flash_fwd_merge(part, sinks, o, lse)`` as
    ``kernels.forward.flash_forward_merge``: the key splits of :func:`flash_forward_split`
    combined in split order (and the sink), for fp16/bf16 at any head dim in ``HEAD_DIMS``.

    A warp per output row. Its lanes read the splits' maxima and sums 32 at a time (lane ``s``
    split ``s``), a butterfly of shuffles gives the row's max, and each lane turns its split's
    max into the split's weight; then the warp walks the splits in order, the weight passed
    from its lane by a shuffle, each lane adding ``D / 32`` contiguous columns of the split's
    partial output — the 32 splits' loads independent, so they overlap. The sum of the
    weighted sums is one more butterfly (the same tree in every lane: deterministic). The
    factory's merge under the SIMT schedule (a thread per element, the splits read one after
    the other) took 30 µs for 32 splits at decode on the H200 (B 1, Hq 32, D 128), twice the
    split kernel."""
    D, dtype, sinks = key.head_dim, key.dtype, key.sinks
    NC = D // 32  # columns per lane
    V = 4 if NC % 4 == 0 else 2 if NC % 2 == 0 else 1  # float32 elements per load
    NB = 32 if NC <= 4 else 16  # splits loaded at once (at most 128 registers of them)

    @T.macro
    def butterfly(x, op):
        for sh in T.unroll(5):
            x[0] = op(x[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x[0], 16 >> sh, 32, 32))

    @T.prim_func
    def flash_fwd_merge(part_h: T.handle, sinks_h: T.handle, o_h: T.handle, lse_h: T.handle):
        T.func_attr({"global_symbol": "flash_fwd_merge", "tirx.noalias": True})
        B, Hq, Lq, BS = T.int64(), T.int64(), T.int64(), T.int64()
        Part = T.match_buffer(part_h, (BS, Hq, Lq, D + PART_STATS), F32)
        Sinks = T.match_buffer(sinks_h, (Hq,), F32)
        O = T.match_buffer(o_h, (B, Hq, Lq, D), dtype, strides=strides("o"))
        LSE = T.match_buffer(lse_h, (B, Hq, Lq), F32)
        bx = T.launch_thread("blockIdx.x", T.ceildiv(B * Hq * Lq, MERGE_ROWS))
        tx = T.launch_thread("threadIdx.x", MERGE_ROWS * WARP)
        mx = T.alloc_buffer((1,), F32, scope="local")  # the row's max (base 2)
        ls = T.alloc_buffer((1,), F32, scope="local")  # its sum
        wt = T.alloc_buffer((1,), F32, scope="local")  # the weight of this lane's split
        wj = T.alloc_buffer((1,), F32, scope="local")  # split j's, from its lane
        ov = T.alloc_buffer((NB * NC,), F32, scope="local")  # NB splits' output columns
        acc = T.alloc_buffer((NC,), F32, scope="local")
        # c: batch, head, query, splits, row
        c = T.alloc_buffer((5,), "int64", scope="local")
        lane = T.meta_var(tx % WARP)
        c[4] = bx * MERGE_ROWS + tx // WARP
        if c[4] < B * Hq * Lq:  # the same for the warp's lanes
            c[2] = c[4] % Lq
            c[1] = c[4] // Lq % Hq
            c[0] = c[4] // (Lq * Hq)
            c[3] = BS // B
            mx[0] = Sinks[c[1]] * T.float32(LOG2E) if sinks else neg_inf()
            for so in T.serial(T.ceildiv(c[3], WARP)):
                if so * WARP + lane < c[3]:
                    mx[0] = T.max(mx[0], Part[(so * WARP + lane) * B + c[0], c[1], c[2], D])
            butterfly(mx, T.max)
            ls[0] = T.float32(0)
            for e in T.unroll(NC):
                acc[e] = T.float32(0)
            for so in T.serial(T.ceildiv(c[3], WARP)):
                # a split that saw no key has m = -inf and weighs nothing
                wt[0] = T.float32(0)
                if so * WARP + lane < c[3]:
                    if Part[(so * WARP + lane) * B + c[0], c[1], c[2], D] != neg_inf():
                        wt[0] = exp2_clamped(
                            Part[(so * WARP + lane) * B + c[0], c[1], c[2], D] - mx[0])
                        ls[0] = ls[0] + Part[(so * WARP + lane) * B + c[0], c[1], c[2],
                                             D + 1] * wt[0]
                # NB splits' loads at once, unconditional (past the last split they reread
                # it, weighted 0) so that none waits for the previous one's sum
                for jb in T.unroll(WARP // NB):
                    for j in T.unroll(NB):
                        for e0 in T.unroll(NC // V):
                            for e in T.vectorized(V):
                                ov[j * NC + e0 * V + e] = Part[
                                    T.min(so * WARP + jb * NB + j, c[3] - 1) * B + c[0], c[1],
                                    c[2], lane * NC + e0 * V + e]
                    for j in T.unroll(NB):
                        wj[0] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), wt[0], jb * NB + j, 32,
                                                   32)
                        for e in T.unroll(NC):
                            acc[e] = acc[e] + wj[0] * ov[j * NC + e]
            butterfly(ls, T.Add)
            if sinks:
                if Sinks[c[1]] != neg_inf():
                    ls[0] = ls[0] + exp2_clamped(Sinks[c[1]] * T.float32(LOG2E) - mx[0])
            for e in T.unroll(NC):
                # l == 0 only for a row that saw no key (nor sink): O = 0, LSE = -inf
                O[c[0], c[1], c[2], lane * NC + e] = T.cast(
                    T.if_then_else(ls[0] == T.float32(0), T.float32(0), acc[e] / ls[0]), dtype)
            if lane == 0:
                LSE[c[0], c[1], c[2]] = row_lse(mx[0], ls[0])

    return flash_fwd_merge


KERNELS = {"fwd": flash_forward, "dq": flash_dq, "dkv": flash_dkv, "bwd_pre": flash_bwd_pre,
           "fwd_split": flash_forward_split, "fwd_merge": flash_fwd_merge}


def kernel(key: KernelKey, tile: MmaTile | None = None):
    """The warp-level PrimFunc for ``key`` (see :func:`supports`); ``tile`` overrides the
    chosen one (``scripts/sweep_mma.py`` measures candidates this way)."""
    if key.op in ROW_OPS:
        return KERNELS[key.op](key)
    return KERNELS[key.op](key, tile or _chosen_tile(key))
