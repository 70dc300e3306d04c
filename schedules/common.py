"""Helpers the per-target schedules share. They find kernel blocks by the names the kernel
factories in ``tvm_flash.kernels`` give them."""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.schedule import _ffi_api as schedule_ffi


def has_block(sch: s_tir.Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - TVM raises ScheduleError subclasses of several kinds
        return False
    return True


def written_buffers(sch: s_tir.Schedule, block_name: str) -> list[str]:
    """Names of the buffers a block writes, in write-region order."""
    return [r.source.name for r in sch.get(sch.get_sblock(block_name)).writes]


def set_scopes(sch: s_tir.Schedule, scopes: dict[str, str], producers: dict[str, str]) -> None:
    """Give each on-chip buffer its storage scope.

    ``producers`` maps buffer name -> the block that writes it; ``scopes`` maps buffer name ->
    scope. Buffers are found by name so the schedule stays valid if a kernel adds buffers.
    """
    for buf, scope in scopes.items():
        block = producers[buf]
        idx = written_buffers(sch, block).index(buf)
        sch.set_scope(block, idx, scope)


def pad_rows(sch: s_tir.Schedule, producers: dict[str, str], names, pad: int) -> None:
    """Pad the row stride of 2-D shared buffers to ``cols + pad`` elements.

    Rows of 64 or 128 half-precision elements start in the same shared-memory bank; threads
    reading one column of consecutive rows then conflict. A small pad staggers the rows.
    """
    for buf in names:
        block = producers[buf]
        regions = sch.get(sch.get_sblock(block)).writes
        idx = [r.source.name for r in regions].index(buf)
        cols = int(regions[idx].source.shape[1])
        align_rows(sch, sch.get_sblock(block), idx, cols, pad)


def align_rows(sch: s_tir.Schedule, block, index: int, cols: int, pad: int) -> None:
    """What ``storage_align(block, index, axis=0, factor=cols, offset=pad)`` does, written as
    the block annotation it sets: TVM 0.27's ``storage_align`` edits the block in place, which
    changes every schedule sharing the IR (MetaSchedule's design spaces start from copies)."""
    stmt = sch.get(block)
    rules = [list(r) for r in stmt.annotations.get("buffer_dim_align", [])]
    rules = [r for r in rules if r[0] != index] + [[index, 0, cols, pad]]
    # Schedule.annotate's type check refuses nested lists; the primitive itself takes them
    schedule_ffi.ScheduleAnnotate(sch, block, "buffer_dim_align", rules)


UNROLL_ANNOTATION = "meta_schedule.unroll_explicit"


def apply_unroll(sch: s_tir.Schedule, loop, unroll, candidates) -> None:
    """Auto-unroll (up to ``unroll`` steps) everything under the kernel's outermost loop.

    ``unroll == "sample"`` makes it a tuning decision: a ``sample_categorical`` over
    ``candidates`` on the ``tile`` block, which MetaSchedule's unroll postprocessor applies and
    its mutator varies. A number applies the same pragmas directly; 0 leaves the loop alone.
    """
    if unroll == "sample":
        choice = sch.sample_categorical(list(candidates), [1 / len(candidates)] * len(candidates))
        sch.annotate(sch.get_sblock("tile"), UNROLL_ANNOTATION, choice)
    elif unroll:
        sch.annotate(loop, "pragma_auto_unroll_max_step", int(unroll))
        sch.annotate(loop, "pragma_unroll_explicit", 1)
