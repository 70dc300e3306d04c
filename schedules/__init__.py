"""Explicit schedules, keyed by target kind.

For each target kind :func:`for_target` gives an object with ``tile_config(key) -> TileConfig``
(the tile shape the kernel factory is asked for) and ``schedule(sch, key, tile) -> Schedule``
(loop transformations that find the kernel's blocks by name): the CPU module itself, or the
``SCHEDULE`` of a GPU target module (``gpu.GpuSchedule`` with that target's parameters).
A schedule may also offer ``lowered(key) -> PrimFunc | None``: a kernel it writes out at warp
level itself (CUDA's ``mma.sync`` kernels, :mod:`.cuda_mma`), used instead of scheduling the
factory's.
Installed as ``tvm_flash.schedules``.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module

_BY_KIND = {"llvm": "cpu", "cuda": "cuda", "metal": "metal"}



def for_target(kind: str):
    """The schedule for a target kind (``llvm``, ``cuda``, ``metal``)."""
    if kind not in _BY_KIND:
        raise ValueError(f"target: no schedules for target kind {kind!r}; have {sorted(_BY_KIND)}")
    module = import_module(f"{__name__}.{_BY_KIND[kind]}")
    return getattr(module, "SCHEDULE", module)


def lowered(kind: str, key, variant: dict | None = None):
    """The hand-lowered kernel of ``key`` on a target kind, or None (see the module doc);
    ``variant``: one of :func:`variants` (default: the schedule's own choice)."""
    hook = getattr(for_target(kind), "lowered", None)
    if hook is None:
        return None
    return hook(key, variant) if variant else hook(key)


def variants(kind: str, key) -> list[dict]:
    """The variants of a hand-lowered kernel a tuner may measure, default first (empty where
    the schedule offers none)."""
    hook = getattr(for_target(kind), "variants", None)
    return hook(key) if hook else []


def own_default(kind: str, key) -> bool:
    """Whether ``key``, a length bucket's build (``key.lengths``), has a default variant of
    its own: the schedule chooses differently for calls that short than for every length
    (``scripts/build.py`` then builds the bucket even without a tuning log)."""
    if not key.lengths:
        return False
    mine = variants(kind, key)
    return bool(mine) and mine[0] != variants(kind, dataclasses.replace(key, lengths=0))[0]


def variant(kind: str, key, fields: dict) -> dict:
    """A tuning log's variant ``fields`` completed with the defaults of fields added since (so
    it compares equal to one of :func:`variants`)."""
    return for_target(kind).variant(key, fields)


def pipeline(kind: str, key) -> str:
    """TVM's lowering pipeline for ``key``'s kernel on a target kind: the schedule's choice
    (the Hopper kernels need ``tirx``), else ``default``."""
    hook = getattr(for_target(kind), "pipeline", None)
    return (hook(key) if hook else None) or "default"


def absorbs(kind: str, key) -> str | None:
    """The op whose work ``key``'s kernel does too on a target kind
    (``tvm_flash.opspec.OpSpec.absorbs``: the Hopper dQ computes ``bwd_pre``'s Delta), or
    None. ``tvm_flash.export`` records it in the artifact, where the plan reads it."""
    hook = getattr(for_target(kind), "absorbs", None)
    return hook(key) if hook else None


def lowers(kind: str, key) -> bool:
    """Whether the target kind's schedule writes ``key``'s kernel out itself (no factory, no
    tuning space)."""
    hook = getattr(for_target(kind), "lowers", None)
    return bool(hook and hook(key))
