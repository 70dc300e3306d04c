"""Pieces shared by every attention kernel: tile config, masking, the clamped exp2.

Conventions used by all kernels
-------------------------------
* Layout ``(B, H, L, D)`` as torch SDPA, with any batch, head and row strides and a contiguous
  last dimension (:func:`strides`); ``Hq = group * Hkv`` and query head ``h`` reads key/value
  head ``h // group``.
* Scores live in base-2 units: ``s2 = (q . k) * scale * log2(e)``, so softmax uses ``exp2``.
* ``LSE`` is stored in natural-log units (``logsumexp`` of ``(q . k) * scale`` over visible
  keys); a row that sees no key has ``LSE = -inf``, ``O = 0`` and zero gradients.
* Every accumulator is float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ..opspec import MOD_ARGS, VARLEN_ARGS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

STEP_NOTE = """Each kernel's inner loop (over key tiles, or query tiles for dK/dV) has its body in a
block (``key_step`` / ``query_step``) whose iteration variable is opaque: a step updates the
running max, sum and accumulators the next step reads. This also makes TVM allocate the on-chip
tiles written in the loop once, around the whole loop, instead of inside each step, where its
shared-memory planner (which does not see tensor-core fragment loads and stores) would let
tiles that are live at the same time share memory."""


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape a schedule asks the kernel factory for.

    ``block_q`` query rows and ``block_k`` key rows per tile; the schedule decides these
    (they size the on-chip buffers), the factory only uses them.
    """

    block_q: int = 64
    block_k: int = 64


@dataclasses.dataclass(frozen=True)
class Rows:
    """How the rows of a query tile map to (query head, query position).

    ``Rows()``: a tile holds consecutive queries of one head (row ``r`` is query ``r`` of head
    ``h``). ``Rows(packed=True, group=g)``: a tile holds the queries of all ``g`` heads that
    share one key/value head, flattened head-major (row ``r`` is query ``r % Lq`` of head
    ``h + r // Lq``), so a short query length still fills the tile and the heads share
    their K/V reads. ``r`` counts from the first row of the (head or group) and ``h`` is its
    first head. Kernels call these methods inside TVMScript.
    """

    packed: bool = False
    group: int = 1

    def head(self, h, r, lq):
        return h + r // lq if self.packed else h

    def query(self, r, lq):
        return r % lq if self.packed else r

    def count(self, lq):
        """Rows of one head (plain) or of one group (packed)."""
        return lq * self.group if self.packed else lq

    def heads_per_tile_loop(self, group: int) -> int:
        """Query heads a key tile loops over one by one (packed rows hold them all)."""
        return 1 if self.packed else group


TILED = Rows()


def strides(name: str) -> list:
    """``T.match_buffer(..., strides=strides("q"))``: a ``(B, H, L, D)`` tensor with any
    batch, head and row strides and a contiguous last dimension.

    Models hand attention ``(B, L, H, D)`` storage viewed as ``(B, H, L, D)``; with symbolic
    strides the kernels read (and write) such views where they lie instead of needing a copy.
    The three strides become int64 parameters named ``<name>_stride_{b,h,l}`` (int64 as the
    shapes: an index ``b * sb + h * sh + l * sl + d`` may pass 2**31 elements); the host code
    binds them from the DLTensor (or, where its strides are NULL, the compact ones) and
    checks the last stride is 1. Which views the binding passes as they are is
    ``tvm_flash.layout.kernel_view``'s rule (16-byte aligned rows)."""
    return [f"{name}_stride_{axis}" for axis in "bhl"] + [1]


def neg_inf():
    return tirx.const(NEG_INF, "float32")


def exp2_clamped(x):
    """``exp2(min(x, 0))`` for arguments that are <= 0 in exact arithmetic.

    Rounding can push ``s2 - m`` or ``s2 - lse2`` slightly above zero; the clamp keeps a
    probability at most 1 (and never lets exp2 overflow). Written as a select so a NaN
    argument stays NaN instead of being clamped away.
    """
    return T.exp2(T.if_then_else(x > T.float32(0), T.float32(0), x))


EXP2_POLY = (1.0, 0.6931471824645996, 0.24022647738456726, 0.05550329014658928,
             0.009618373587727547, 0.0013399848248809576, 0.00015370704932138324)
"""2^f on [-1/2, 1/2], degree 6 with 2^0 = 1 exactly, fitted here (relative-error-weighted least
squares on Chebyshev nodes): at most 1.0e-7 relative in float32 Horner evaluation, within
the hardware ``ex2.approx``'s 2^-22 (degree 5: 1.9e-7, and the soft cap's tanh 19 ulp)."""

_ROUND = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer
_ROUND_BITS = 0x4B400000  # its bit pattern


def exp2_fma(x):
    """``2^x`` on the FMA and integer pipes instead of the special-function unit (MUFU), which
    the softmax's exponentials (and a soft cap's tanh) keep the busiest pipe of an attention
    kernel (FlashAttention-4 emulates part of them so on Blackwell).

    ``x`` is clamped to [-127, 127] by selects (a NaN stays NaN), split as ``n + f`` by the 1.5
    * 2^23 rounding trick (``n`` the nearest integer, read from the sum's low mantissa bits;
    ``|f| <= 1/2``), ``2^f`` by :data:`EXP2_POLY` and ``2^n`` built from its exponent bits:
    ``2^-127`` comes out as +0.0, so ``-inf`` (a masked score) gives exactly 0 and ``+inf``
    gives 2^127 (finite). Pure expressions only (selects, not branches); the argument, its
    clamp, the rounded sum and the fraction are each bound once (``Let``): printed as nested
    text, CUDA's source repeated the argument's whole expression in every use (three times in
    the clamp alone), which nvcc did not share back (PTX 5.3k -> 9.7k lines for 32 of them, the
    forward 2.5-6x slower: docs/journal/2026-12-01-hopper.md, twelfth session)."""
    xv, zv, jv, fv = (tirx.Var(name, "float32") for name in ("e2_x", "e2_z", "e2_j", "e2_f"))
    z = tirx.Select(xv < T.float32(-127), T.float32(-127),
                    tirx.Select(xv > T.float32(127), T.float32(127), xv))
    # j's bits read back as a float: an opaque step for TVM's simplifier, which would
    # otherwise fold (z + c) - c to z (and f to 0); nvcc and LLVM keep float sums in order
    f = zv - (T.reinterpret("float32", T.reinterpret("int32", jv)) - T.float32(_ROUND))
    p = T.float32(EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):
        p = p * fv + T.float32(c)
    bits = T.reinterpret("int32", jv) - T.int32(_ROUND_BITS - 127)  # n + 127, in 0..254
    y = p * T.reinterpret("float32", T.shift_left(bits, T.int32(23)))
    return tirx.Let(xv, x, tirx.Let(zv, z, tirx.Let(jv, zv + T.float32(_ROUND),
                                                    tirx.Let(fv, f, y))))


_RCP_MAGIC = 0x7EF311C3  # minus a float's bits: its reciprocal within 12% (for normal floats)


def rcp_fma(d):
    """``1 / d`` for ``d`` in [1, 2^64] on the FMA and integer pipes instead of the
    special-function unit: the bits of ``d`` subtracted from :data:`_RCP_MAGIC` give the
    reciprocal within 12%, and three Newton steps ``r + r (1 - d r)`` (two fused
    multiply-adds each, the error squared each time) bring it to 0.5005 ulp where the adds
    are fused (CUDA's ``fmaf``; a float32 model of it in numpy); 1.1 ulp on a CPU target that
    splits them. A NaN stays NaN. Each value bound once (``Let``), as in :func:`exp2_fma`."""
    dv, r0, r1, r2 = (tirx.Var(f"rc_{name}", "float32") for name in "d012")

    def newton(r):  # nvcc contracts both into FFMA (fmad is on); the CPU target does not
        return r + r * (T.float32(1) - dv * r)

    first = T.reinterpret("float32", T.int32(_RCP_MAGIC) - T.reinterpret("int32", dv))
    return tirx.Let(dv, d, tirx.Let(r0, first, tirx.Let(r1, newton(r0), tirx.Let(
        r2, newton(r1), newton(r2)))))


def row_lse(m, lsum):
    """A row's LSE (natural log) from its base-2 max and sum; -inf for a row with no key."""
    return T.if_then_else(lsum == T.float32(0), neg_inf(), (m + T.log2(lsum)) * T.float32(LN2))


def split_size(lk, num_splits, block_k: int):
    """Keys per split when ``lk`` keys are cut into ``num_splits`` splits of whole key tiles;
    split ``s`` holds keys ``[s * size, min((s + 1) * size, lk))`` (the last ones may be
    empty)."""
    return T.ceildiv(T.ceildiv(lk, num_splits), block_k) * block_k


def causal_offset(causal: str, lq, lk):
    """Column offset of the causal diagonal: key j visible to query i iff ``j <= i + offset``."""
    if causal == "bottom-right":
        return lk - lq
    return tirx.const(0, "int64")


# --------------------------------------------------------------------------- score modifiers


@dataclasses.dataclass(frozen=True)
class Mods:
    """The score modifiers a kernel is built with (``tvm_flash.key.MODS``: sliding window,
    soft cap, ALiBi). Their values are kernel arguments (:class:`ModArgs`); a kernel built
    with none has exactly the code it had before they existed."""

    window: bool = False
    softcap: bool = False
    alibi: bool = False
    tanh: str = "exp2"
    """How the soft cap's tanh is computed (:data:`TANH_FORMS`, :func:`tanh`): a variant of
    the Hopper kernels (``HopperTile.tanh``), measured there before it is served."""

    def __bool__(self) -> bool:
        return self.window or self.softcap or self.alibi


NO_MODS = Mods()


@dataclasses.dataclass(frozen=True)
class ModArgs:
    """Inside a kernel: its score modifiers' arguments (``tvm_flash.opspec.MOD_ARGS``).
    ``slopes``: the ``(B, Hq)`` ALiBi buffer; ``left``/``right``: the window's extents
    (int64; ``Lq + Lk`` or more is unbounded); ``cap``: the soft cap."""

    slopes: object
    left: object
    right: object
    cap: object


def diagonal(causal: str, lq, lk):
    """Where query i sits among the keys for the window and ALiBi: at ``i + diagonal``, 0 under
    a top-left causal mask, ``Lk - Lq`` otherwise (flash-attn's bottom-right alignment, also
    without a mask)."""
    if causal == "top-left":
        return tirx.const(0, "int64")
    return lk - lq


def visible(causal: str, row, col, lq, lk, end=None, mods: Mods = NO_MODS, ma=None):
    """Whether key ``col`` is visible to query ``row`` (both absolute positions); ``end``:
    keys from there on belong to another split; ``mods.window``: only keys within ``ma``'s
    window of the query's diagonal."""
    conds = [col < (lk if end is None else end)]
    if causal != "none":
        conds.append(col <= row + causal_offset(causal, lq, lk))
    if mods.window:
        centre = row + diagonal(causal, lq, lk)
        conds += [centre - ma.left <= col, col <= centre + ma.right]
    return conds[0] if len(conds) == 1 else tirx.all(*conds)


TANH_FORMS = ("exp2", "approx", "fma", "rcp")
"""The forms of :func:`tanh`: the exp2 one (two special-function operations: the exponential
and the division's reciprocal), the hardware's (``tanh.approx.f32``, one; relative error
about 2^-11, so a soft cap of 30 moves a score by up to 0.015), and the exp2 one with one
of its two operations on the FMA pipe at the same accuracy: ``fma`` the exponential
(:func:`exp2_fma`; as TVM printed it before its values were bound once the soft-capped
kernels ran 9–24x slower on the H200, docs/results/hopper-sweeps-v8.json), ``rcp`` the
reciprocal (:func:`rcp_fma`). The last two are variants to measure, not served."""


def tanh(x, form: str = "exp2"):
    """``tanh(x)`` as ``1 - 2 / (exp(2 x) + 1)``, float32-accurate on every target (``approx``:
    ``T.tanh``, the ``tanh.approx.f32`` instruction on CUDA; ``fma``: the exponential by
    :func:`exp2_fma`; ``rcp``: the reciprocal by :func:`rcp_fma`: :data:`TANH_FORMS`).

    Not ``T.tanh`` by default: TVM compiles CUDA with ``--use_fast_math``, which turns ``tanhf``
    into the ``tanh.approx.f32`` instruction (relative error about 2^-11); on the H200 float32
    soft-capped outputs and gradients were then 1.2-2.5x the error bound of the float32
    reference. ``exp2`` and the division stay within a few ulp under fast math; the form
    saturates to +-1 (an infinite exponential gives 1, a zero one -1) and keeps a NaN."""
    if form == "approx":
        return T.tanh(x)
    if form == "rcp":  # the exponent clamped to 64 (tanh is 1 in float32 from 9), NaN kept;
        # bound once like rcp_fma's values (the select reads it twice)
        t = tirx.Var("th_t", "float32")
        e = T.exp2(tirx.Select(t > T.float32(64), T.float32(64), t))
        return tirx.Let(t, x * T.float32(2 * LOG2E),
                        T.float32(1) - T.float32(2) * rcp_fma(e + T.float32(1)))
    exp2 = exp2_fma if form == "fma" else T.exp2
    return T.float32(1) - T.float32(2) / (exp2(x * T.float32(2 * LOG2E)) + T.float32(1))


def modified_score(s, scale, mods: Mods, ma, causal: str, b, h, row, col, lq, lk,
                   offset=0, unit: float = 1.0, raw: bool = False):
    """The scaled score ``s * scale`` (natural-log units) with ``mods``' soft cap and ALiBi
    bias (:data:`tvm_flash.key.MODS`); ``h``: the query head (its slope). ``offset``: a
    constant added to the query's distance from the key, ``row + diagonal - col``: a kernel
    whose thread holds many elements passes the positions they share as ``row`` and ``col``
    and their constant difference as ``offset``, so that the integer distance is converted to
    float once per row instead of once per element (int64 to float32 conversions run at a
    sixteenth of the FMA rate). ``unit``: the result times this (``LOG2E``: base 2, an exp2's
    argument), folded into the scale, cap and slope, which a kernel computes once, instead
    of one more multiply a score.

    ``raw`` (ALiBi without a soft cap): ``ma.slopes`` holds ``slope / scale``
    (:func:`alibi_slope_raw`) and the result is ``s - (slope / scale) * |distance|``, the
    biased score in the raw score's units, which the caller scales as it scales a plain
    score — one FFMA with the exp2's argument, so the bias costs an add and an FFMA a score
    where the scaled form takes a multiply more. Under a causal mask the distance of every
    visible key is >= 0, so its absolute value is not taken: the caller must overwrite the
    masked elements (it does: -inf before the softmax, 0 for P), never scale them by a 0/1
    mask. ``scale`` and ``unit`` are not used."""

    def times_unit(x):
        return x if unit == 1.0 else x * T.float32(unit)

    def distance(signed: bool = False):
        d = T.cast(row + diagonal(causal, lq, lk) - col, "float32")
        if not isinstance(offset, int) or offset:  # an unrolled loop's index: a constant
            d = d + T.cast(offset, "float32")
        return d if signed else T.fabs(d)

    if raw:
        if mods.softcap or not mods.alibi:
            raise ValueError("modified_score(raw=True) is ALiBi's form without a soft cap")
        return s - ma.slopes[b, h] * distance(signed=causal != "none")
    t = s * times_unit(scale)
    if mods.softcap:
        t = tanh(s * (scale / ma.cap), mods.tanh) * times_unit(ma.cap)
    if mods.alibi:
        t = t - times_unit(ma.slopes[b, h]) * distance()
    return t


def alibi_slope_raw(mods: Mods, slope, scale):
    """What a kernel keeps as a query head's ALiBi slope: ``slope / scale`` where it takes
    :func:`modified_score`'s ``raw`` form (ALiBi without a soft cap), else ``slope``. The
    quotient is finite wherever ``slope * distance`` is in float32 for realistic scales
    (``scale`` is a finite positive float32, ``ops`` checks; overflow needs ``|slope| >
    2^128 * scale``)."""
    # the reciprocal is loop-invariant: nvcc computes it once, a multiply a tile
    return slope * (T.float32(1) / scale) if mods.alibi and not mods.softcap else slope


def softcap_slope(s, scale, mods: Mods, ma):
    """d(capped score) / d(scaled score) = ``1 - tanh^2``: what the backward multiplies dS by
    under a soft cap (1 without one, returned as None)."""
    if not mods.softcap:
        return None
    t = tanh(s * (scale / ma.cap), mods.tanh)
    if mods.tanh in ("exp2", "approx"):
        return T.float32(1) - t * t
    # the FMA-pipe forms bind their values (Let), which a tree may hold only once
    tv = tirx.Var("sc_t", "float32")
    return tirx.Let(tv, t, T.float32(1) - tv * tv)


def first_key(causal: str, q_first, lq, lk, block_k: int, begin, mods: Mods = NO_MODS,
              ma=None):
    """Where a query tile's key walk over ``[begin, ...)`` starts: ``begin``, or under a
    window the key tile (counted from ``begin``) that holds the first key the tile's first
    query ``q_first`` sees."""
    if not mods.window:
        return begin
    lo = q_first + diagonal(causal, lq, lk) - ma.left
    return begin + T.max(lo - begin, 0) // block_k * block_k


def num_key_tiles(causal: str, r0, block_q: int, lq, lk, block_k: int, begin, end,
                  mods: Mods = NO_MODS, ma=None):
    """Key tiles of ``[begin, end)`` that hold at least one key visible to a query tile whose
    rows start at ``r0`` (``begin`` from :func:`first_key` under a window).

    Tiles past the causal diagonal (or the window's right edge) are skipped entirely, not
    masked. The tile's last query is at most ``min(r0 + block_q, lq) - 1``; that bound also
    holds for packed rows (row ``r`` is query ``r % lq <= r``).
    """
    stop = lk
    q_last = T.min(r0 + block_q, lq) - 1
    if causal != "none":
        stop = T.min(lk, T.max(q_last + causal_offset(causal, lq, lk) + 1, 0))
    if mods.window:
        stop = T.min(stop, T.max(q_last + diagonal(causal, lq, lk) + ma.right + 1, 0))
    return T.ceildiv(T.max(T.min(end, stop) - begin, 0), block_k)


def first_query_tile(causal: str, k0, lq, lk, block_q: int, rows: Rows = TILED,
                     mods: Mods = NO_MODS, ma=None):
    """First query tile that sees any key of a key tile starting at ``k0`` (packed rows: 0,
    their positions are not ordered)."""
    if rows.packed or (causal == "none" and not mods.window):
        return tirx.const(0, "int64")
    first = None
    if causal != "none":
        first = k0 - causal_offset(causal, lq, lk)
    if mods.window:
        after = k0 - diagonal(causal, lq, lk) - ma.right
        first = after if first is None else T.max(first, after)
    return T.min(T.max(first, 0), lq) // block_q


def query_tiles_end(lq, lk, block_q: int, block_k: int, k0, causal: str, rows: Rows = TILED,
                    mods: Mods = NO_MODS, ma=None):
    """One past the last query tile that sees a key of the key tile starting at ``k0``: all
    of them but under a window, whose left edge leaves out the later queries (packed rows:
    all)."""
    end = rows.count(lq)
    if mods.window and not rows.packed:
        last = k0 + block_k - 1 - diagonal(causal, lq, lk) + ma.left
        end = T.min(end, T.max(last + 1, 0))
    return T.ceildiv(end, block_q)


def trim_params(func, mods: Mods, varlen: bool = False):
    """A kernel written with every optional parameter (its own, then
    :data:`tvm_flash.opspec.MOD_ARGS`, then ``VARLEN_ARGS``), without those of the features
    it is not built with (which its body then never uses): a kernel keeps the calling
    convention, and the code, it had before those features existed."""
    drop = (() if mods else MOD_ARGS) + (() if varlen else VARLEN_ARGS)
    if not drop:
        return func
    keep = [p for p in func.params if p.name not in drop]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


def at(off, row):
    """Row ``row`` of a sequence whose rows start at ``off`` in its buffer: ``off + row``; a
    dense kernel (``off`` None) indexes its rows as they are."""
    return row if off is None else off + row


# ------------------------------------------------------------------------------- macros
# Building blocks every kernel writes the same way. Each expands, in place, to one block named
# by its first argument, which the schedules find. TVMScript suffixes the block names of a
# macro's second and later expansions ("_1", "_2"), so a kernel takes a fresh macro for every
# use: ``load_q = fresh(load_tile)``.


def fresh(fn):
    """A new TVMScript macro of ``fn`` (its blocks keep their names on first expansion)."""
    return T.macro(fn)


def pin_scalars(name, buf, v0, v1, v2, v3, v4, v5):
    """``buf[0:6] = v0..v5``: a tile's integer coordinates, computed once per block.

    TVM substitutes integer ``let`` values (and block coordinates) into every use; inside the
    loops that expands into 64-bit divisions per element, which the CUDA compiler cannot hoist
    out of the guarded loads. Values read from a small ``local`` buffer stay in registers.
    """
    with T.sblock(name):
        T.reads()
        T.writes(buf[0:6])
        buf[0] = v0
        buf[1] = v1
        buf[2] = v2
        buf[3] = v3
        buf[4] = v4
        buf[5] = v5


def pin_sequence(name, buf, cu_q, cu_k, s):
    """``buf[0:4]``: sequence ``s``'s first query row, query length, first key row and key
    length in packed buffers (flash-attn's ``cu_seqlens``, int32), as int64 computed once per
    block (see :func:`pin_scalars`)."""
    with T.sblock(name):
        T.reads(cu_q[s:s + 2], cu_k[s:s + 2])
        T.writes(buf[0:4])
        buf[0] = T.cast(cu_q[s], "int64")
        buf[1] = T.cast(cu_q[s + 1] - cu_q[s], "int64")
        buf[2] = T.cast(cu_k[s], "int64")
        buf[3] = T.cast(cu_k[s + 1] - cu_k[s], "int64")


MERGE_BATCH = 16
"""Key splits a merge kernel's thread reads at once (``forward.flash_forward_merge``,
``backward.flash_dq_merge``): their loads overlap, the sums keep the split order."""


@T.macro
def pin_element(c, b, h, i, d, splits):
    """``c[0:5]``: a merge thread's element (batch, head, row, column) and the number of
    splits, computed once (see :func:`pin_scalars`: else their 64-bit divisions repeat in
    every split iteration)."""
    c[0] = b
    c[1] = h
    c[2] = i
    c[3] = d
    c[4] = splits

ROW_ALIGN = 4
"""Elements every batch, head and row stride of a ``(B, H, L, D)`` input is a multiple of
(where its dimension is not 1): ``tvm_flash.layout.kernel_view`` passes rows that start
16-byte aligned, which hold at least 4 elements of any dtype (:func:`require_aligned_rows`)."""


def require_aligned_rows(name: str, *bufs, elements: int = ROW_ALIGN, unit: str = ""):
    """Host check of kernel ``name``: every stride of ``bufs`` but the last is a multiple of
    ``elements`` (or its dimension is 1), as :func:`aligned_rows` assumes (the warp-level
    kernels' 16-byte copies ask for 8 16-bit elements: ``unit`` says so in the message)."""
    ok = [T.Or(buf.strides[i] % elements == 0, buf.shape[i] == 1) for buf in bufs
          for i in range(3)]
    return T.Assert(tirx.all(*ok), f"{name}: the batch, head and row strides of every "
                    f"(B, H, L, D) tensor must be multiples of {elements} elements{unit}; "
                    "tvm_flash.layout.kernel_view copies tensors with others", "ValueError")


def aligned_rows(buf):
    """A view of ``buf`` (strided, :func:`strides`) with its strides spelled ``s // 4 * 4``,
    declared at the top of a kernel (a view declared inside a block would be among the reads
    TVM infers for the blocks around it, before its declaration):
    the same addresses (:func:`require_aligned_rows`), but TVM's code generators then see
    that ``ROW_ALIGN`` neighbouring elements of a row start aligned and load them as one
    vector; with a bare symbolic stride they gather them one element at a time (they test
    the alignment of an index with an analyzer that knows nothing of the strides)."""
    return T.decl_buffer(buf.shape, buf.dtype, data=buf.data,
                         strides=[s // ROW_ALIGN * ROW_ALIGN for s in buf.strides[:-1]] + [1])


def load_tile(name, dst, src, b, h, start, length, rows, cols, dtype, lay=TILED):
    """``dst[i, :] = src[b, h, start + i, :]`` for ``rows`` rows, zero past ``length``
    (``lay``: packed query rows, see :class:`Rows`). Pass ``src`` as its
    :func:`aligned_rows` view, so that a schedule may vectorise along the row."""
    for i, d in T.grid(rows, cols):
        with T.sblock(name):
            vi, vd = T.axis.remap("SS", [i, d])
            if start + vi < lay.count(length):
                dst[vi, vd] = src[b, lay.head(h, start + vi, length),
                                  lay.query(start + vi, length), vd]
            else:
                dst[vi, vd] = T.cast(0, dtype)


def load_row_stats(name, lse_s, delta_s, LSE, Delta, b, h, start, length, rows, lay=TILED):
    """The LSE and Delta of ``rows`` query rows (-inf and 0 past ``length``)."""
    for i in T.serial(rows):
        with T.sblock(name):
            vi = T.axis.remap("S", [i])
            if start + vi < lay.count(length):
                lse_s[vi] = LSE[b, lay.head(h, start + vi, length), lay.query(start + vi, length)]
                delta_s[vi] = Delta[b, lay.head(h, start + vi, length),
                                    lay.query(start + vi, length)]
            else:
                lse_s[vi] = neg_inf()
                delta_s[vi] = T.float32(0)


def transposed(b, r, j):
    """``gemm``'s B operand stored as (n, k): C = A B^T."""
    return b[j, r]


def plain(b, r, j):
    """``gemm``'s B operand stored as (k, n): C = A B."""
    return b[r, j]


def gemm(name, C, A, B, m, n, k, b_at):
    """``C = A B^T`` (``b_at=transposed``) or ``A B`` (``b_at=plain``) in float32, C starting
    from zero.

    Every GEMM of the kernels writes a fresh tile from operands in the input dtype; a running
    sum adds the tile in a separate elementwise block (:func:`accumulate`). Each GEMM is then
    a plain reduction block that a schedule can hand to tensor cores as it is. The loop nest
    sits in a scope block of its own (``<name>_scope``): the kernels' loop steps update their
    running sums in place, so only there can a schedule move operand and result caches
    (tensor-core fragments) around the GEMM's loops.
    """
    with T.sblock(name + "_scope"):
        for i, j, r in T.grid(m, n, k):
            with T.sblock(name):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    C[vi, vj] = T.float32(0)
                C[vi, vj] = C[vi, vj] + T.cast(A[vi, vr], "float32") * T.cast(b_at(B, vr, vj),
                                                                                "float32")


def accumulate(name, acc, part, rows, cols, decay=None):
    """``acc = acc * decay[i] + part`` elementwise (``decay`` None: 1): a GEMM's fresh product
    added to a running sum.

    Written as a reduction over one step whose init applies the decay: a block that reads and
    writes ``acc`` is then still a reduction block, which schedules may split and bind.
    """
    for i, d, u in T.grid(rows, cols, 1):
        with T.sblock(name):
            vi, vd, vu = T.axis.remap("SSR", [i, d, u])
            with T.init():
                if decay is None:
                    acc[vi, vd] = acc[vi, vd]
                else:
                    acc[vi, vd] = acc[vi, vd] * decay[vi]
            acc[vi, vd] = acc[vi, vd] + part[vi + vu, vd]


def store_tile(name, dst, acc, b, h, start, length, rows, cols, scale, dtype, lay=TILED):
    """``dst[b, h, start + i, :] = acc[i, :] * scale`` in ``dtype`` for rows before ``length``."""
    for i, d in T.grid(rows, cols):
        with T.sblock(name):
            vi, vd = T.axis.remap("SS", [i, d])
            if start + vi < lay.count(length):
                dst[b, lay.head(h, start + vi, length), lay.query(start + vi, length),
                    vd] = T.cast(acc[vi, vd] * scale, dtype)
