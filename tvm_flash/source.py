"""The source files that decide the generated code, and their digest.

An artifact records the digest of the source it was built from; the loader compares it with
this install's. Reading files only: nothing here imports the schedules or the kernel factories,
so checking a prebuilt kernel runs no build code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent

DECIDING = ("key.py", "opspec.py", "target.py", "build.py")
"""Modules of the package besides ``kernels/`` whose text changes what a key compiles to: the
key and the op table, the TVM target of a tag, the lowering options."""


def schedules_dir() -> pathlib.Path:
    """Where ``tvm_flash.schedules`` lives, found as :mod:`tvm_flash._schedules_path` would
    import it (installed, else the checkout's ``schedules/``) without importing it."""
    found = importlib.util.find_spec("tvm_flash.schedules")
    if found is not None and found.origin:
        return pathlib.Path(found.origin).resolve().parent
    return _PACKAGE.parent / "schedules"


def source_files() -> list[pathlib.Path]:
    """The files whose text decides the generated code: kernels, schedules, key, compiler."""
    files = sorted((_PACKAGE / "kernels").glob("*.py"))
    files += sorted(schedules_dir().glob("*.py"))
    return files + [_PACKAGE / name for name in DECIDING]


@functools.cache
def source_digest() -> str:
    """Digest of the kernel, schedule and build sources (line endings normalised); computed
    once per process."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()
