"""Explicit schedules, keyed by target kind.

Each target module provides ``tile_config(key) -> TileConfig`` (the tile shape the kernel
factory is asked for) and ``schedule(sch, key, tile) -> Schedule`` (loop transformations that
find the kernel's blocks by name). Installed as ``tvm_flash.schedules``.
"""

from __future__ import annotations

from importlib import import_module

_BY_KIND = {"llvm": "cpu", "cuda": "cuda"}


def for_target(kind: str):
    """The schedule module for a target kind (``llvm``, ``cuda``)."""
    if kind not in _BY_KIND:
        raise ValueError(f"target: no schedules for target kind {kind!r}; have {sorted(_BY_KIND)}")
    return import_module(f"{__name__}.{_BY_KIND[kind]}")
