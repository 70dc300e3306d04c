"""Compiled kernels on disk: build them, describe them in a manifest, load them.

An artifact directory (written by ``scripts/build.py``) holds, per :class:`KernelKey`:

* ``<key>.so`` — the exported TVM module (host code; for CUDA it embeds the CUDA source);
* ``<key>.fatbin`` / ``<key>.cubin`` — CUDA only: the device code compiled ahead of time for
  the target arch, so a training machine never compiles CUDA;
* an entry in ``manifest.json``: file names, target, arch, the fingerprint of the kernel and
  schedule sources it was built from, the TVM / tvm-ffi versions that built it.

Where kernels come from, in order:

1. the artifact directory given by :func:`use_artifacts` or ``$TVM_FLASH_ARTIFACTS``;
2. when just-in-time building is allowed (:func:`allow_jit` or ``TVM_FLASH_JIT=1``): a kernel
   built on first use into the cache ``$TVM_FLASH_CACHE`` (default ``~/.cache/tvm-flash``),
   one entry per key and fingerprint.

Anything else raises :class:`ArtifactError` naming the key and the command that builds it.
An artifact built for another arch or from other kernel source is refused, never run.

Loading CUDA: TVM's CUDA module keeps source and calls ``tvm_callback_cuda_compile`` when it
is loaded. tvm-flash answers that callback with the precompiled device code whose source
digest matches, and refuses to compile anything else unless JIT is allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib
import json
import os
import pathlib
import platform
import re
import tempfile
import threading

import tvm
import tvm_ffi

from .build import (
    SYMBOLS,
    compile_device_code,
    compile_module,
    cuda_compiler,
    device_source,
    fingerprint,
    scheduled_module,
)
from .key import DTYPES, KernelKey
from .target import target_kind

MANIFEST = "manifest.json"
FORMAT = 1


class ArtifactError(RuntimeError):
    """A kernel is missing from the artifacts, or the artifact does not fit this machine."""


_state = {"dir": None, "jit": None}
_lock = threading.RLock()


def use_artifacts(path: str | os.PathLike | None) -> None:
    """Load kernels from the artifact directory ``path`` (``None``: back to the environment)."""
    with _lock:
        _state["dir"] = None if path is None else pathlib.Path(path)
        _load.cache_clear()
        _manifest.cache_clear()


def allow_jit(enabled: bool | None = True) -> None:
    """Allow (or forbid) building missing kernels on first use; ``None``: follow the
    ``TVM_FLASH_JIT`` environment variable."""
    with _lock:
        _state["jit"] = enabled
        _load.cache_clear()


def artifact_dir() -> pathlib.Path | None:
    if _state["dir"] is not None:
        return _state["dir"]
    env = os.environ.get("TVM_FLASH_ARTIFACTS")
    return pathlib.Path(env) if env else None


def jit_allowed() -> bool:
    if _state["jit"] is not None:
        return _state["jit"]
    return os.environ.get("TVM_FLASH_JIT", "0").lower() in ("1", "true", "yes", "on")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TVM_FLASH_CACHE", "~/.cache/tvm-flash")).expanduser()


def _runtime_versions() -> dict:
    """Versions a built module must be loaded with (its ABI)."""
    return {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}


def versions(target: str) -> dict:
    """Versions of everything that built artifacts for ``target`` (recorded in the manifest)."""
    import torch

    v = {**_runtime_versions(), "torch": torch.__version__, "python": platform.python_version()}
    if target_kind(target) == "cuda":
        v["cuda_compiler"] = cuda_compiler()
        if v["cuda_compiler"] == "nvcc":
            nvcc = importlib.import_module("tvm.support.nvcc")
            v["cuda"] = ".".join(map(str, nvcc.get_cuda_version()))
    return v


def build_command(key: KernelKey, out: str | os.PathLike | None = None) -> str:
    """The ``scripts/build.py`` command that builds ``key``."""
    target = key.target.replace("-", ":", 1)
    cmd = (f"python scripts/build.py --target {target} --head-dims {key.head_dim} "
           f"--dtypes {DTYPES[key.dtype]} --causal {key.causal} --gqa {key.group}")
    cmd += " --sinks" if key.sinks else ""
    return cmd + (f" --out {out}" if out else "")


# --------------------------------------------------------------------------------- building


def build_artifact(key: KernelKey, out_dir: pathlib.Path, with_fingerprint: bool = False,
                   tuned: dict | None = None) -> dict:
    """Compile ``key`` into ``out_dir``; return its manifest entry. Files appear atomically.

    Files are named by the key, and by its fingerprint too with ``with_fingerprint`` (the JIT
    cache, where builds of several kernel versions live side by side). ``tuned``: the choice
    of a tuning log (:func:`tvm_flash.tuning.load_tuned`), recorded in the entry.
    """
    choice = {"tile": tuned["tile"], "decisions": tuned["decisions"]} if tuned else None
    fp = fingerprint(key, choice)
    built = compile_module(key, scheduled_module(key, choice))
    stem = f"{key.name}-{fp}" if with_fingerprint else key.name
    kind = target_kind(key.target)
    # Metal host code is for arm64 macOS: shipped as objects in a tar that the Mac links
    ext = "tar" if kind == "metal" else "so"
    entry = {"key": dataclasses.asdict(key), "target": key.target, "fingerprint": fp,
             "file": f"{stem}.{ext}", "runtime": _runtime_versions(),
             "schedule": "tuned" if tuned else "default"}
    if tuned:
        entry.update(tuned=choice, tuning_log_digest=tuned["digest"])
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp = pathlib.Path(tmp)
        files = {entry["file"]: None}
        built.export_library(str(tmp / entry["file"]))
        if kind == "metal":
            src = device_source(built)
            entry.update(metal_source=f"{stem}.metal", **metal_resources(src))
            (tmp / entry["metal_source"]).write_text(src)
            files[entry["metal_source"]] = None
        if kind == "cuda":
            src = device_source(built)
            binary, fmt = compile_device_code(key, src)
            entry.update(arch=key.target[len("cuda-"):], device_code=f"{stem}.{fmt}",
                         source_sha256=hashlib.sha256(src.encode()).hexdigest(),
                         cuda_compiler=cuda_compiler())
            (tmp / entry["device_code"]).write_bytes(binary)
            files[entry["device_code"]] = None
        for name in files:
            os.replace(tmp / name, out_dir / name)
    return entry


def write_manifest(out_dir: pathlib.Path, target: str, entries: list[dict]) -> pathlib.Path:
    """Merge ``entries`` into ``out_dir/manifest.json`` (one target per directory)."""
    path = out_dir / MANIFEST
    manifest = _read_manifest(path) if path.exists() else None
    if manifest is not None and manifest["target"] != target:
        raise ArtifactError(f"{path} holds artifacts for {manifest['target']}, not {target}: "
                            "use another --out directory")
    if manifest is None:
        manifest = {"format": FORMAT, "target": target, "kernels": {}}
    manifest.update(versions=versions(target),
                    built=datetime.datetime.now().isoformat(timespec="seconds"))
    for e in entries:
        manifest["kernels"][KernelKey(**e["key"]).name] = e
    # digest of the tuning log each tuned kernel was built from (None: all default schedules)
    manifest["tuning_log"] = {name: e["tuning_log_digest"] for name, e in
                              manifest["kernels"].items() if "tuning_log_digest" in e} or None
    part = path.with_suffix(".part")
    part.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(part, path)
    _manifest.cache_clear()
    return path


# ---------------------------------------------------------------------------------- loading


def _read_manifest(path: pathlib.Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot read artifact manifest {path}: {err}") from err
    if manifest.get("format") != FORMAT or "kernels" not in manifest:
        raise ArtifactError(f"{path}: not a tvm-flash manifest of format {FORMAT}")
    return manifest


@functools.cache
def _manifest(directory: pathlib.Path) -> dict | None:
    path = directory / MANIFEST
    return _read_manifest(path) if path.exists() else None


_prebuilt: dict[str, bytes] = {}
_compile_fallback = []


def _serve_device_code(code: str):
    """``tvm_callback_cuda_compile`` while tvm-flash is loaded: hand out precompiled code."""
    digest = hashlib.sha256(code.encode()).hexdigest()
    if digest in _prebuilt:
        return bytearray(_prebuilt[digest])
    if jit_allowed() and _compile_fallback:
        return _compile_fallback[0](code)
    raise ArtifactError("tvm-flash: a CUDA module asked to compile source at load time and no "
                        "precompiled device code matches it; rebuild the artifacts with "
                        "scripts/build.py, or set TVM_FLASH_JIT=1 to allow compiling")


def _install_callback():
    if _compile_fallback:
        return
    _compile_fallback.append(tvm_ffi.get_global_func("tvm_callback_cuda_compile",
                                                     allow_missing=True))
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _serve_device_code, override=True)


def _open(directory: pathlib.Path, entry: dict, key: KernelKey):
    """Load one artifact entry after checking it was built for this key, arch and source."""
    if entry["target"] != key.target:
        raise ArtifactError(f"{key.name}: artifact in {directory} was built for "
                            f"{entry['target']}, this device needs {key.target}; run "
                            f"{build_command(key)}")
    if entry.get("runtime") != _runtime_versions():
        raise ArtifactError(f"{key.name}: artifact in {directory} was built with "
                            f"{entry.get('runtime')}, this machine runs {_runtime_versions()}; "
                            f"rebuild: {build_command(key, directory)}")
    expected = fingerprint(key, entry.get("tuned"))
    if entry["fingerprint"] != expected:
        raise ArtifactError(
            f"{key.name}: artifact in {directory} was built from other kernel source "
            f"(fingerprint {entry['fingerprint']}, this install has "
            f"{expected}); rebuild: {build_command(key, directory)}")
    if "device_code" in entry:
        _install_callback()
        _prebuilt[entry["source_sha256"]] = (directory / entry["device_code"]).read_bytes()
    path = directory / entry["file"]
    if path.suffix == ".tar":  # objects to link on this machine (Metal on a Mac)
        module = tvm.runtime.load_module(str(path))
    else:
        module = tvm_ffi.load_module(str(path))
    return module[SYMBOLS[key.op]]


_MSL_BYTES = {"half": 2, "bfloat": 2, "ushort": 2, "short": 2, "float": 4, "int": 4,
              "uint": 4, "char": 1, "uchar": 1}


def metal_resources(source: str) -> dict:
    """Threadgroup memory the Metal source declares, and whether it synchronises it."""
    total = 0
    for dtype, count in re.findall(r"threadgroup\s+(\w+)\s+\w+\[(\d+)\]", source):
        if dtype not in _MSL_BYTES:
            raise ValueError(f"metal source: unknown threadgroup element type {dtype!r}")
        total += _MSL_BYTES[dtype] * int(count)
    return {"threadgroup_bytes": total, "barriers": source.count("threadgroup_barrier")}


def _from_cache(key: KernelKey):
    """JIT: build into the cache (once per key and fingerprint) and open from there."""
    directory = cache_dir() / key.target
    fp = fingerprint(key)
    sidecar = directory / f"{key.name}-{fp}.json"
    if sidecar.exists():
        entry = json.loads(sidecar.read_text())
    else:
        entry = build_artifact(key, directory, with_fingerprint=True)
        part = sidecar.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(entry))
        os.replace(part, sidecar)
    return _open(directory, entry, key)


@functools.cache
def _load(key: KernelKey):
    directory = artifact_dir()
    if directory is not None:
        manifest = _manifest(directory)
        if manifest is None and not jit_allowed():
            raise ArtifactError(f"{key.name}: no {MANIFEST} in artifact directory {directory}; "
                                f"build with: {build_command(key, directory)}")
        if manifest is not None:
            entry = manifest["kernels"].get(key.name)
            if entry is not None:
                return _open(directory, entry, key)
            if manifest["target"] != key.target and not jit_allowed():
                raise ArtifactError(
                    f"{key.name}: artifacts in {directory} were built for "
                    f"{manifest['target']}, this device needs {key.target}; build with: "
                    f"{build_command(key, directory)}")
    if jit_allowed():
        return _from_cache(key)
    where = f"in {directory}" if directory else "(no artifact directory set)"
    raise ArtifactError(
        f"{key.name}: no compiled kernel {where}. Build it with: "
        f"{build_command(key, directory)} and point TVM_FLASH_ARTIFACTS (or "
        f"tvm_flash.use_artifacts) at the output, or allow building on first use with "
        f"TVM_FLASH_JIT=1 (tvm_flash.allow_jit()).")


def kernel(key: KernelKey):
    """The callable entry function of ``key``'s module, loaded once per process."""
    with _lock:
        return _load(key)
