"""The SIMT GPU schedule shared by CUDA and Metal; ``GpuParams`` holds what differs.

One thread block (threadgroup) per ``tile`` block of the kernel (a query tile for forward and
dQ, a key tile for dK/dV), ``threads`` threads. The tiles of Q, K, V, dO, S and dP live in
on-chip shared (threadgroup) memory with padded rows; every GEMM gives each thread a register
micro-tile of its output; row statistics (max, sum, LSE, Delta) sit in shared memory, one
thread per row. The tile is the largest candidate whose on-chip footprint fits the target's
budget; a kernel that fits none is refused with the bytes it would need.

On CUDA, fp16/bf16 forward, dQ and dK/dV and the short-query forward's split and merge run
warp-level tensor-core kernels instead (``cuda_mma``); this schedule serves the rest there
(fp32, the short-query dQ and its merge, the packed dK/dV, a split with score modifiers) and
every Metal kernel.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir

from tvm_flash.kernels.common import TileConfig
from tvm_flash.key import KernelKey
from tvm_flash.opspec import PACKED_ROWS

from .common import apply_unroll, has_block, pad_rows, set_scopes

THREADS = 128
ACC_BUDGET = 128  # fp32 accumulator elements per thread
PAD = 4  # elements of padding per shared row


@dataclasses.dataclass(frozen=True)
class GpuParams:
    """What a GPU target changes in the schedule."""

    name: str  # for messages: "CUDA", "Metal"
    smem_budget: int  # bytes of on-chip memory one block may use
    smem_scope: str  # "shared.dyn" (CUDA: dynamic, > 48 KiB possible) or "shared"
    max_head_dim: int = 256  # larger head dims are refused (see ``why_max_head_dim``)
    why_max_head_dim: str = ""
    bf16_bytes: int = 2  # on-chip bytes of a bf16 element (4 where TVM legalizes bf16 to f32)
    vector_loads: bool = False  # tile loads move PAD elements a thread at a time (_spread)

_ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 16))
# Short-query kernels: PACKED_ROWS packed query rows, the longest key tile that fits.
_SHORT_CANDIDATES = tuple((PACKED_ROWS, bk) for bk in (128, 64, 32, 16))

def _blocks_of(key: KernelKey) -> str:
    """The tiled op whose blocks and buffers ``key``'s kernel has (a packed-row kernel shares
    its tiled op's); the tables below are keyed by it."""
    return key.spec.packs or key.op


# buffer -> the block that first writes it, per tiled kernel
_PRODUCERS = {
    "fwd": {"Qs": "Q_load", "Ks": "K_load", "Vs": "V_load", "S": "S_gemm", "P": "P",
            "PV": "O_gemm", "acc": "acc_init", "m": "stats_init", "lsum": "stats_init",
            "m_new": "row_max", "l_new": "row_sum", "alpha": "rescale", "lnorm": "row_norm"},
    "dq": {"Qs": "Q_load", "dOs": "dO_load", "Ks": "K_load", "Vs": "V_load", "S": "S_gemm",
           "dP": "dP_gemm", "dS": "dS", "dQp": "dQ_gemm", "lse_s": "row_load",
           "delta_s": "row_load", "acc": "acc_init"},
    "dkv": {"Ks": "K_load", "Vs": "V_load", "Qs": "Q_load", "dOs": "dO_load", "St": "St_gemm",
            "Pt": "P", "dPt": "dPt_gemm", "dSt": "dS", "dVp": "dV_gemm", "dKp": "dK_gemm",
            "lse_s": "row_load",
            "delta_s": "row_load", "dk_acc": "acc_init", "dv_acc": "acc_init"},
}
# blocks of each kernel by how they are mapped to threads
_TILE_LOADS = ("Q_load", "K_load", "V_load", "dO_load")
_ELEMENTWISE = (*_TILE_LOADS, "row_load", "stats_init", "P",
                "rescale", "stats_update", "lsum_update", "dS", "lse_store", "stats_store",
                "row_norm")
_ROW_REDUCTIONS = ("row_max", "row_sum")
_SHARED_GEMMS = ("S_gemm", "dP_gemm", "St_gemm", "dPt_gemm")
# GEMMs whose product only feeds a running sum (SIMT: in registers, mapped like the sum)
_PART_GEMMS = ("O_gemm", "dQ_gemm", "dV_gemm", "dK_gemm")
_PARTS = ("PV", "dQp", "dVp", "dKp")
_REGISTER_TILES = ("acc_init", "O_update", "O_store", "dQ_update", "dQ_store", "dV_update",
                   "dK_update", "dK_store", "dV_store", "part_store")
_REGISTERS = ("acc", "dk_acc", "dv_acc")
_PADDED = ("Qs", "Ks", "Vs", "dOs", "S", "P", "dP", "dS", "St", "Pt", "dPt", "dSt")

def _operand_rows(op: str, bq: int, bk: int) -> int:
    """Rows of the input-dtype operand tiles (Q, K, V, dO) a kernel keeps on chip."""
    return {"fwd": bq + 2 * bk, "dq": 2 * bq + 2 * bk, "dkv": 2 * bq + 2 * bk}[op]


def _footprint(op: str, d: int, esize: int, bq: int, bk: int) -> tuple[int, int]:
    """(shared-memory bytes, fp32 accumulator elements per thread) of a tile choice."""
    smem = _operand_rows(op, bq, bk) * (d + PAD) * esize
    # score-shaped tiles: float32 S (dP) and P (dS) in the input dtype
    smem += {"fwd": bq * (bk + PAD) * (4 + esize), "dq": bq * (bk + PAD) * (8 + esize),
             "dkv": bk * (bq + PAD) * (8 + 2 * esize)}[op]
    # row statistics, float32 (the forward's m, l, m_new, l_new, alpha and its row_norm copy)
    smem += (6 if op == "fwd" else 5) * bq * 4
    # running sums plus the product of the GEMM that feeds them, both in registers
    acc = {"fwd": 2 * bq * d, "dq": 2 * bq * d, "dkv": 3 * bk * d}[op] // THREADS
    return smem, acc


def tiles(key: KernelKey, params: GpuParams) -> list[TileConfig]:
    """Every tile that fits the on-chip memory and register budgets, largest first."""
    if key.head_dim > params.max_head_dim:
        raise ValueError(f"head_dim {key.head_dim} is not supported on {params.name} (at most "
                         f"{params.max_head_dim}): {params.why_max_head_dim}")
    if key.spec.row_wise:
        return [TileConfig(THREADS, THREADS)]
    esize = _element_bytes(key.dtype, params)
    op = _blocks_of(key)
    fits = []
    for bq, bk in _SHORT_CANDIDATES if key.spec.packs else _CANDIDATES:
        smem, acc = _footprint(op, key.head_dim, esize, bq, bk)
        if smem <= params.smem_budget and acc <= ACC_BUDGET and _splits(op, key.head_dim, bq,
                                                                         bk):
            fits.append(TileConfig(bq, bk))
    return fits


def tile_config(key: KernelKey, params: GpuParams) -> TileConfig:
    """The largest tile that fits (see :func:`tiles`); refuses a kernel that fits none."""
    fits = tiles(key, params)
    if fits:
        return fits[0]
    esize = _element_bytes(key.dtype, params)
    need = _footprint(_blocks_of(key), key.head_dim, esize, *_CANDIDATES[-1])[0]
    raise ValueError(
        f"{key.op} with head_dim {key.head_dim} and {key.dtype} needs {need} bytes of "
        f"{params.name} on-chip memory even with the smallest {_CANDIDATES[-1][0]}x"
        f"{_CANDIDATES[-1][1]} tile; {params.name} allows {params.smem_budget} bytes per block")


def _element_bytes(dtype: str, params: GpuParams) -> int:
    return params.bf16_bytes if dtype == "bfloat16" else _ESIZE[dtype]


def _splits(op: str, head_dim: int, bq: int, bk: int) -> bool:
    """Whether every 2-D block of the kernel divides over the threads for this tile."""
    rows_cols = {"fwd": [(bq, bk), (bq, head_dim)], "dq": [(bq, bk), (bq, head_dim)],
                 "dkv": [(bk, bq), (bk, head_dim)]}[op]
    try:
        for rows, cols in rows_cols:
            _thread_grid(rows, cols)
    except ValueError:
        return False
    return True


def _own_loops(sch: s_tir.Schedule, block):
    """The loops that belong to ``block`` itself (one per block iteration variable)."""
    return sch.get_loops(block)[-len(sch.get(block).iter_vars):]


DEFAULTS = {"tc": 16, "unroll": 0}
"""Hand-chosen decisions: threads across a GEMM tile's columns; auto-unroll depth (0: off)."""
SPACE = {"tc": (16, 8, 32), "unroll": (0, 16, 64, 512)}
"""What tuning may choose from (first = default). ``tc`` changes the loop structure and is
enumerated as separate design spaces; ``unroll`` is sampled (``sample_categorical``)."""


def _thread_grid(rows: int, cols: int, tc: int = DEFAULTS["tc"]) -> tuple[int, int]:
    tc = min(cols, tc)
    tr = THREADS // tc
    if rows % tr or cols % tc:
        raise ValueError(f"tile {rows}x{cols} does not split over {THREADS} threads")
    return tr, tc


def _spread(sch: s_tir.Schedule, name: str, lanes: int = 1) -> None:
    """Elementwise block: flatten its loops and deal iterations to threads round-robin;
    ``lanes`` > 1 (a tile load): a thread moves that many neighbouring elements of a row at a
    time, one vector load and store."""
    block = sch.get_sblock(name)
    loops = _own_loops(sch, block)
    if lanes > 1:
        # the lanes split off the row before the flattening, so that the row guard of the
        # load (kernels.common.load_tile) stays one scalar test per vector
        *outer, cols = loops
        col, lane = sch.split(cols, [None, lanes])
        loops = [*outer, col]
    fused = sch.fuse(*loops)
    _, t = sch.split(fused, [None, THREADS])
    sch.bind(t, "threadIdx.x")
    if lanes > 1:
        sch.vectorize(lane)


def _rows(sch: s_tir.Schedule, name: str) -> None:
    """Row reduction: one thread per row, the reduction serial in a register, then stored."""
    block = sch.get_sblock(name)
    write_back = sch.cache_write(block, 0, "local")
    for blk in (block, write_back):
        _, t = sch.split(_own_loops(sch, blk)[0], [None, THREADS])
        sch.bind(t, "threadIdx.x")


def _micro_tile(sch: s_tir.Schedule, name, to_registers: bool = False,
                tc: int = DEFAULTS["tc"]) -> None:
    """Give each thread a (rows/tr) x (cols/tc) piece of a block's 2-D output (a band of
    rows, every tc-th column).

    For a GEMM block (third loop a reduction) the reduction runs inside the thread, over its
    micro-tile; with ``to_registers`` the partial sums stay in registers and are written to the
    block's (shared) output once.
    """
    block = sch.get_sblock(name) if isinstance(name, str) else name
    write_back = sch.cache_write(block, 0, "local") if to_registers else None
    loops = _own_loops(sch, block)
    r, c = loops[:2]
    rows, cols = (int(sch.get(lp).extent) for lp in (r, c))
    tr, tc = _thread_grid(rows, cols, tc)
    r_o, r_i = sch.split(r, [tr, None])
    # a thread's columns are interleaved (c_i * tc + c_o): neighbouring threads read
    # neighbouring rows/columns of the shared operands, which fall in different banks
    c_i, c_o = sch.split(c, [None, tc])
    if len(loops) == 3:
        sch.reorder(r_o, c_o, loops[2], r_i, c_i)
    else:
        sch.reorder(r_o, c_o, r_i, c_i)
    sch.bind(sch.fuse(r_o, c_o), "threadIdx.x")
    if len(loops) == 3:
        sch.unroll(r_i)
        sch.unroll(c_i)
        if sch.get(block).name_hint.endswith("_gemm"):
            # a fresh product starts from zero once; an update's init (its decay) has to stay
            # in place: its running sum has other writers
            sch.decompose_reduction(block, loops[2])
    if write_back is not None:
        # the register partial sums go to shared memory with the same thread mapping
        _micro_tile(sch, write_back, tc=tc)


def schedule(sch: s_tir.Schedule, key: KernelKey, tile: TileConfig, params: GpuParams,
             decisions: dict | None = None) -> s_tir.Schedule:
    """Schedule ``key``'s kernel. ``decisions`` override ``DEFAULTS``; ``"sample"`` for
    ``unroll`` makes it a tuning decision."""
    decisions = {**DEFAULTS, **(decisions or {})}
    if key.op == "bwd_pre":
        # a warp per row: its 32 lanes read the row side by side (each warp load one coalesced
        # 64-byte run, where a thread per row made every load touch 32 rows) and add their
        # partial sums by shuffles; THREADS / 32 rows a block. Every head dim is a multiple
        # of 32 (tvm_flash.key.HEAD_DIMS).
        block = sch.get_sblock("delta")
        b, h, i, d = sch.get_loops(block)
        bx, ty = sch.split(sch.fuse(b, h, i), [None, THREADS // 32])
        _, tx = sch.split(d, [None, 32])
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        return sch
    if key.spec.row_wise:  # the merges: one thread per output element
        bx, tx = sch.split(sch.fuse(*sch.get_loops(sch.get_sblock("merge"))), [None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch

    producers = _PRODUCERS[_blocks_of(key)]
    pad_rows(sch, producers, [b for b in _PADDED if b in producers], PAD)
    scopes = {b: params.smem_scope for b, block in producers.items() if has_block(sch, block)}
    scopes.update({b: "local" for b in _REGISTERS + _PARTS if b in scopes})
    set_scopes(sch, scopes, producers)

    block_loop = sch.fuse(*sch.get_loops(sch.get_sblock("tile")))
    sch.bind(block_loop, "blockIdx.x")
    apply_unroll(sch, block_loop, decisions["unroll"], SPACE["unroll"])
    for name in _ELEMENTWISE:
        if has_block(sch, name):
            # PAD elements: a padded shared row (D + PAD elements) keeps a vector of them
            # aligned, and so does a global row (16-byte aligned, tvm_flash.layout)
            vector = params.vector_loads and name in _TILE_LOADS
            _spread(sch, name, PAD if vector else 1)
    for name in _ROW_REDUCTIONS:
        if has_block(sch, name):
            _rows(sch, name)
    for name in _SHARED_GEMMS:
        if has_block(sch, name):
            _micro_tile(sch, name, to_registers=True, tc=decisions["tc"])
    for name in _PART_GEMMS + _REGISTER_TILES:
        if has_block(sch, name):
            _micro_tile(sch, name, tc=decisions["tc"])
    return sch


class GpuSchedule:
    """``tile_config`` / ``tiles`` / ``space`` / ``schedule`` of one GPU target, as
    :func:`schedules.for_target` hands them out."""

    space = SPACE

    def __init__(self, params: GpuParams):
        self.params = params

    def tile_config(self, key: KernelKey) -> TileConfig:
        return tile_config(key, self.params)

    def schedule(self, sch: s_tir.Schedule, key: KernelKey, tile: TileConfig,
                 decisions: dict | None = None) -> s_tir.Schedule:
        return schedule(sch, key, tile, self.params, decisions)

    def tiles(self, key: KernelKey) -> list[TileConfig]:
        """Every tile that fits this target for ``key``, largest first (the tuning space)."""
        return tiles(key, self.params)
