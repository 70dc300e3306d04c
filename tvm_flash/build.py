"""Compile a :class:`KernelKey`: kernel factory + schedule -> runtime module (+ device code).

This module only compiles; :mod:`tvm_flash.export` writes compiled kernels as artifacts and
:mod:`tvm_flash.artifacts` loads them (without importing this module for a prebuilt one).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import threading

import tvm

from . import _schedules_path
from .kernels import FACTORIES, TileConfig
from .key import KernelKey
from .opspec import SPECS
from .source import source_digest
from .target import make_target, target_kind

schedules = _schedules_path.load()

SYMBOLS = {op: spec.symbol for op, spec in SPECS.items()}
"""Name of the entry function of each kernel's module."""


def scheduled_module(key: KernelKey, tuned: dict | None = None) -> tvm.IRModule:
    """The kernel for ``key`` with its target's schedule applied (not yet compiled).

    ``tuned``: ``{"tile": [block_q, block_k], "decisions": {...}}`` from a tuning log
    (:func:`tvm_flash.tuning.load_tuned`); default: the hand-chosen tile and decisions. Where
    the target's schedule writes the kernel out itself (``schedules.lowered``) that kernel is
    used as it is, or the variant a tuning log chose (``{"variant": {...}}``).
    """
    kind = target_kind(key.target)
    if schedules.lowers(kind, key):
        if tuned and "variant" not in tuned:
            raise ValueError(f"{key.name}: a hand-lowered kernel; a tile log does not apply")
        return tvm.IRModule({"main": schedules.lowered(kind, key, (tuned or {}).get("variant"))})
    if tuned and "variant" in tuned:
        raise ValueError(f"{key.name}: scheduled from its factory; a variant log does not apply")
    sched = schedules.for_target(kind)
    tile = TileConfig(*tuned["tile"]) if tuned else sched.tile_config(key)
    sch = tvm.s_tir.Schedule(FACTORIES[key.op](key, tile))
    sched.schedule(sch, key, tile, tuned["decisions"] if tuned else None)
    return sch.mod


def fingerprint(key: KernelKey, tuned: dict | None = None) -> str:
    """What an artifact of ``key`` was built from: the source digest, the key, its tile and
    its tuned decisions if any.

    Deliberately text-based rather than a hash of the lowered IR, so the same checkout gives
    the same fingerprint on every machine and Python version. It names JIT cache entries and is
    recorded in manifests; loading a prebuilt kernel checks the recorded source digest instead
    (recomputing this would run schedule code).
    """
    if not tuned:
        return _default_fingerprint(key)
    if "variant" in tuned:
        return _digest(key, f"variant:{sorted(tuned['variant'].items())}")
    choice = f"tuned:{tuned['tile']}:{sorted(tuned['decisions'].items())}"
    return _digest(key, choice)


@functools.cache
def _default_fingerprint(key: KernelKey) -> str:
    """The fingerprint with the schedule's own tile, once per key and process."""
    return _digest(key, str(schedules.for_target(target_kind(key.target)).tile_config(key)))


def _digest(key: KernelKey, choice: str) -> str:
    return hashlib.sha256(f"{source_digest()};{key.name};{choice}".encode()).hexdigest()[:16]


def compile_module(key: KernelKey, mod: tvm.IRModule | None = None):
    """Lower ``key`` for its target. For CUDA the result holds CUDA source, see
    :func:`compile_device_code`."""
    mod = scheduled_module(key) if mod is None else mod
    kind = target_kind(key.target)
    with tvm.transform.PassContext(config=pass_config(kind)):
        return tvm.tirx.build(mod, target=make_target(key.target),
                              pipeline=schedules.pipeline(kind, key))


def pass_config(kind: str) -> dict:
    """Lowering options for a target kind (``llvm``, ``cuda``, ``metal``); every build of a
    kernel (artifacts, just in time, tuning) lowers with them.

    CUDA: TVM's StorageRewrite may place a float32 tile in the shared memory of a dead 16-bit
    one and then rejects the tensor-core fragment pointers into it ("tvm_access_ptr element
    type must match the source buffer"); the kernels' on-chip buffers are sized by the
    schedule anyway, so the rewrite is off.
    """
    return {"tirx.disable_storage_rewrite": True} if kind == "cuda" else {}


def device_source(module) -> str:
    """The device code (CUDA C or Metal shading language) a GPU build carries."""
    return module.imports[0].inspect_source()


def cuda_compiler() -> str:
    """``nvcc`` where it is installed, else NVRTC; ``TVM_CUDA_COMPILE_MODE`` overrides."""
    return os.environ.get("TVM_CUDA_COMPILE_MODE") or ("nvcc" if shutil.which("nvcc") else
                                                       "nvrtc")


def compile_device_code(key: KernelKey, source: str) -> tuple[bytes, str]:
    """Compile CUDA source ahead of time for the key's arch (no GPU needed with nvcc).

    Returns the device code and its format: ``fatbin`` (nvcc) or ``cubin`` (NVRTC)."""
    return _compile_cuda(key.target, source, cuda_compiler())


def _compile_cuda(target: str, source: str, compiler: str) -> tuple[bytes, str]:
    nvcc = importlib.import_module("tvm.support.nvcc")
    arch = target[len("cuda-"):]
    sm = arch[len("sm_"):]
    fmt = "fatbin" if compiler == "nvcc" else "cubin"
    with make_target(target):
        arch_opt = ["-gencode", f"arch=compute_{sm},code={arch}"] if compiler == "nvcc" else arch
        binary = nvcc.compile_cuda(source, target_format=fmt, arch=arch_opt, compiler=compiler)
    return bytes(binary), fmt


def assemble(target: str, source: str) -> tuple[bytes, str]:
    """CUDA ``source`` compiled with nvcc for ``target`` (a tag such as ``cuda-sm_90a``)
    exactly as :func:`compile_device_code` compiles it — TVM's ``compile_cuda`` and its flags
    (``-O3 --use_fast_math``, ptxas ``--register-usage-level=10``) — and what ptxas printed
    (``-v``: registers, spill bytes, its notes): ``(fatbin, log)``. The flags move the
    figures: with them the unmasked Hopper dK/dV at D 128 spills 8 bytes and the causal
    forward at D 256 16, without them none; the soft-capped D 64 forward 32 bytes instead of
    56 (nvcc 13.0). So tests and sweeps assemble with this, never with a bare ``nvcc``.
    ``compile_cuda`` shows the compiler's output only when it fails: for the call its module's
    ``subprocess`` is one that keeps a copy (:class:`_Recording`). Needs nvcc on the PATH."""
    if not shutil.which("nvcc"):
        raise RuntimeError("assembling CUDA source for its ptxas figures needs nvcc on the PATH")
    nvcc = importlib.import_module("tvm.support.nvcc")
    recording = _Recording()
    with _LOG_LOCK:
        nvcc.subprocess, real = recording, nvcc.subprocess
        try:
            binary, _ = _compile_cuda(target, source, "nvcc")
        finally:
            nvcc.subprocess = real
    return binary, "".join(recording.outputs)


def ptxas_log(target: str, source: str) -> str:
    """What ptxas prints assembling ``source`` for ``target`` as the build does
    (:func:`assemble`)."""
    return assemble(target, source)[1]


def ptxas_figures(log: str) -> tuple[list[int], int]:
    """The registers of each kernel in a :func:`ptxas_log` and the most bytes any of them
    spills (stores)."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    if not registers or not spills:
        raise ValueError(f"no ptxas -v figures in: {log[-500:]}")
    return registers, max(spills)


_LOG_LOCK = threading.Lock()


class _Recording:
    """``subprocess`` as :func:`ptxas_log` lends it to ``tvm.support.nvcc``: the module's
    own, but each process's ``communicate()`` output kept in ``outputs``."""

    def __init__(self):
        self.outputs: list[str] = []

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, *args, **kwargs):  # noqa: N802 - subprocess's name
        proc = subprocess.Popen(*args, **kwargs)
        communicate, outputs = proc.communicate, self.outputs

        def kept(*a, **kw):
            out, err = communicate(*a, **kw)
            for part in (out, err):
                if part:
                    outputs.append(part.decode("utf-8", errors="replace")
                                   if isinstance(part, bytes) else part)
            return out, err

        proc.communicate = kept
        return proc
