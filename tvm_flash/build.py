"""Turn a :class:`KernelKey` into a compiled module: kernel factory + target schedule + build.

Built modules are cached in memory (once per process) and on disk under
``$TVM_FLASH_CACHE`` (default ``~/.cache/tvm-flash``), in a file named by the key and a
fingerprint of the scheduled kernel and the TVM / tvm-ffi versions, so a change to a kernel,
a schedule or the compiler never reuses a stale module.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import pathlib
import tempfile
import threading

import tvm
import tvm_ffi

from . import _schedules_path
from .kernels import FACTORIES
from .key import KernelKey

schedules = _schedules_path.load()

SYMBOLS = {"fwd": "flash_fwd", "bwd_pre": "flash_bwd_pre", "dq": "flash_dq", "dkv": "flash_dkv"}
"""Name of the entry function of each kernel's module."""


def target_kind(tag: str) -> str:
    return tag.split("-", 1)[0]


def make_target(tag: str) -> tvm.target.Target:
    """TVM target for a target tag: ``llvm`` or ``cuda-sm_XY``."""
    kind = target_kind(tag)
    if tag == "llvm":
        return tvm.target.Target({"kind": "llvm"})
    if kind == "cuda" and tag.startswith("cuda-sm_"):
        return tvm.target.Target({"kind": "cuda", "arch": tag[len("cuda-"):]})
    raise ValueError(f"target: unknown target tag {tag!r}; use 'llvm' or 'cuda-sm_XY'")


def target_tag_for_device(device) -> str:
    """Target tag for a torch device: ``llvm`` for CPU, ``cuda-sm_XY`` for a CUDA device."""
    if device.type == "cpu":
        return "llvm"
    if device.type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm_{major}{minor}"
    raise ValueError(f"device: tvm-flash runs on 'cpu' and 'cuda' tensors, not {device.type!r}")


def scheduled_module(key: KernelKey) -> tvm.IRModule:
    """The kernel for ``key`` with its target's schedule applied (not yet compiled)."""
    sched = schedules.for_target(target_kind(key.target))
    tile = sched.tile_config(key)
    sch = tvm.s_tir.Schedule(FACTORIES[key.op](key, tile))
    sched.schedule(sch, key, tile)
    return sch.mod


def fingerprint(mod: tvm.IRModule) -> str:
    """Digest of the scheduled kernel text and the compiler versions."""
    h = hashlib.sha256()
    h.update(mod.script().encode())
    h.update(f"tvm={tvm.__version__};tvm_ffi={tvm_ffi.__version__}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TVM_FLASH_CACHE", "~/.cache/tvm-flash")).expanduser()


def compile_module(key: KernelKey, mod: tvm.IRModule | None = None):
    """Compile ``key`` for its target and return the runtime module (no caching)."""
    mod = scheduled_module(key) if mod is None else mod
    if target_kind(key.target) == "cuda":
        importlib.import_module("tvm.support.nvcc")  # registers the CUDA compile callback
    return tvm.tirx.build(mod, target=make_target(key.target))


_lock = threading.Lock()


@functools.cache
def _load(key: KernelKey):
    mod = scheduled_module(key)
    path = cache_dir() / f"{key.name}-{fingerprint(mod)}.so"
    if not path.exists():
        built = compile_module(key, mod)
        path.parent.mkdir(parents=True, exist_ok=True)
        # write to a private name, then rename: concurrent builders never see half a file
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            part = pathlib.Path(tmp) / path.name
            built.export_library(str(part))
            os.replace(part, path)
    return tvm_ffi.load_module(str(path))[SYMBOLS[key.op]]


def kernel(key: KernelKey):
    """The callable entry function of ``key``'s module, built on first use and cached."""
    with _lock:
        return _load(key)
