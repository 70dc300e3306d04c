"""Write compiled kernels as artifacts: the files of one key, and the manifest of a directory.

The build side of :mod:`tvm_flash.artifacts` (which loads what this writes): used by
``scripts/build.py`` and, for a kernel built on first use, by the loader's JIT path.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib
import json
import os
import pathlib
import platform
import re
import tempfile

from .artifacts import FORMAT, MANIFEST, ArtifactError, read_manifest, runtime_versions
from .build import (
    compile_device_code,
    compile_module,
    cuda_compiler,
    device_source,
    fingerprint,
    scheduled_module,
    schedules,
)
from .key import KernelKey
from .source import source_digest
from .target import target_kind


def build_versions(target: str) -> dict:
    """Versions of everything that built artifacts for ``target`` (recorded in the manifest)."""
    import torch

    v = {**runtime_versions(), "torch": torch.__version__, "python": platform.python_version()}
    if target_kind(target) == "cuda":
        v["cuda_compiler"] = cuda_compiler()
        if v["cuda_compiler"] == "nvcc":
            nvcc = importlib.import_module("tvm.support.nvcc")
            v["cuda"] = ".".join(map(str, nvcc.get_cuda_version()))
    return v


def build_artifact(key: KernelKey, out_dir: pathlib.Path, with_fingerprint: bool = False,
                   tuned: dict | None = None) -> dict:
    """Compile ``key`` into ``out_dir``; return its manifest entry. Files appear atomically.

    Files are named by the key, and by its fingerprint too with ``with_fingerprint`` (the JIT
    cache, where builds of several kernel versions live side by side). ``tuned``: the choice
    of a tuning log (:func:`tvm_flash.tuning.load_tuned`), recorded in the entry. The entry
    records the source digest the loader checks, and the op whose work the kernel does too
    (``absorbs``, ``tvm_flash.opspec.OpSpec.absorbs``) where it does.
    """
    choice = {k: v for k, v in tuned.items() if k not in ("digest", "why")} if tuned else None
    fp = fingerprint(key, choice)
    built = compile_module(key, scheduled_module(key, choice))
    stem = f"{key.name}-{fp}" if with_fingerprint else key.name
    kind = target_kind(key.target)
    # Metal host code is for arm64 macOS: shipped as objects in a tar that the Mac links
    ext = "tar" if kind == "metal" else "so"
    entry = {"key": dataclasses.asdict(key), "target": key.target, "fingerprint": fp,
             "source_digest": source_digest(), "file": f"{stem}.{ext}",
             "runtime": runtime_versions(), "schedule": "tuned" if tuned else "default"}
    if tuned:
        entry.update(tuned=choice, tuning_log_digest=tuned["digest"])
    absorbed = schedules.absorbs(kind, key)
    if absorbed:  # its calling convention and the plan's launches depend on it
        entry["absorbs"] = absorbed
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
    manifest = read_manifest(path) if path.exists() else None
    if manifest is not None and manifest["target"] != target:
        raise ArtifactError(f"{path} holds artifacts for {manifest['target']}, not {target}: "
                            "use another --out directory")
    if manifest is None:
        manifest = {"format": FORMAT, "target": target, "kernels": {}}
    manifest.update(versions=build_versions(target),
                    built=datetime.datetime.now().isoformat(timespec="seconds"))
    for e in entries:
        manifest["kernels"][KernelKey(**e["key"]).name] = e
    # digest of the tuning log each tuned kernel was built from (None: all default schedules)
    manifest["tuning_log"] = {name: e["tuning_log_digest"] for name, e in
                              manifest["kernels"].items() if "tuning_log_digest" in e} or None
    part = path.with_suffix(".part")
    part.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(part, path)
    return path


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
