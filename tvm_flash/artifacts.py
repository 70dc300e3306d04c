"""Compiled kernels on disk: where they are looked up, and loading them without compiling.

An artifact directory (written by ``scripts/build.py`` through :mod:`tvm_flash.export`) holds,
per :class:`KernelKey`:

* ``<key>.so`` — the exported TVM module (host code; for CUDA it embeds the CUDA source);
* ``<key>.fatbin`` / ``<key>.cubin`` — CUDA only: the device code compiled ahead of time for
  the target arch, so a training machine never compiles CUDA;
* an entry in ``manifest.json``: file names, target, arch, the digest of the kernel and
  schedule source it was built from, its fingerprint, the TVM / tvm-ffi versions that built it,
  and the op whose work the kernel does too (``absorbs``, where it does: :func:`absorbs`).

Where kernels come from, in order (:func:`lookup`):

1. the artifact directory given by :func:`use_artifacts` or ``$TVM_FLASH_ARTIFACTS``;
2. the default artifact directory of the key's target, ``$TVM_FLASH_CACHE/artifacts/<target>``
   (:func:`default_artifact_dir`; ``TVM_FLASH_CACHE`` defaults to ``~/.cache/tvm-flash``):
   where ``scripts/build.py`` writes without ``--out``, so kernels built by the README's setup
   command are found with no configuration, from a checkout or an installed wheel alike;
3. when just-in-time building is allowed (:func:`allow_jit` or ``TVM_FLASH_JIT=1``): a kernel
   built on first use into ``$TVM_FLASH_CACHE/<target>``, one entry per key and fingerprint.

The first directory whose manifest has the key serves it. An entry built for another target,
from other kernel source or with other TVM / tvm-ffi versions is refused with the reason (never
passed over for a later place, never run). No kernel anywhere and no JIT: :class:`ArtifactError`
naming the key, where it looked and the command that builds it.

Loading runs no build code: it imports neither the compiler nor the schedules nor the kernel
factories, and checks an entry by its recorded source digest (:mod:`tvm_flash.source`, file
text only). Only building on first use imports the builder.

Loading CUDA: TVM's CUDA module keeps source and calls ``tvm_callback_cuda_compile`` when it
is loaded. tvm-flash answers that callback with the precompiled device code whose source
digest matches, and refuses to compile anything else unless JIT is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import threading

import tvm
import tvm_ffi

from .key import DTYPES, KernelKey
from .source import source_digest
from .target import target_tag_for_device

MANIFEST = "manifest.json"
FORMAT = 1


class ArtifactError(RuntimeError):
    """A kernel is missing from the artifacts, or the artifact does not fit this machine."""


_state = {"dir": None, "jit": None}
_lock = threading.RLock()


def use_artifacts(path: str | os.PathLike | None) -> None:
    """Load kernels from the artifact directory ``path`` first (``None``: back to the
    environment)."""
    with _lock:
        _state["dir"] = None if path is None else pathlib.Path(path)
        _load.cache_clear()


def allow_jit(enabled: bool | None = True) -> None:
    """Allow (or forbid) building missing kernels on first use; ``None``: follow the
    ``TVM_FLASH_JIT`` environment variable."""
    with _lock:
        _state["jit"] = enabled
        _load.cache_clear()


def artifact_dir() -> pathlib.Path | None:
    """The explicitly chosen artifact directory (:func:`use_artifacts`, else
    ``$TVM_FLASH_ARTIFACTS``), or None."""
    if _state["dir"] is not None:
        return _state["dir"]
    env = os.environ.get("TVM_FLASH_ARTIFACTS")
    return pathlib.Path(env) if env else None


def jit_allowed() -> bool:
    if _state["jit"] is not None:
        return _state["jit"]
    return os.environ.get("TVM_FLASH_JIT", "0").lower() in ("1", "true", "yes", "on")


def cache_dir() -> pathlib.Path:
    """``$TVM_FLASH_CACHE``, default ``~/.cache/tvm-flash``: per user, so an installed package
    (which has no checkout to write into) has a place too."""
    return pathlib.Path(os.environ.get("TVM_FLASH_CACHE", "~/.cache/tvm-flash")).expanduser()


def default_artifact_dir(target: str) -> pathlib.Path:
    """Where ``scripts/build.py`` writes ``target``'s kernels without ``--out``, and where they
    are looked up without configuration (the one definition both use)."""
    return cache_dir() / "artifacts" / target


def jit_dir(target: str) -> pathlib.Path:
    """The just-in-time cache of ``target``'s kernels."""
    return cache_dir() / target


def lookup(target: str) -> list[tuple[str, pathlib.Path]]:
    """The artifact directories searched for ``target``'s kernels, in order, each with what
    put it there; the JIT cache (:func:`jit_dir`) comes after them when JIT is allowed."""
    places = []
    explicit = artifact_dir()
    if explicit is not None:
        places.append(("use_artifacts()" if _state["dir"] is not None else
                       "TVM_FLASH_ARTIFACTS", explicit))
    default = default_artifact_dir(target)
    if explicit is None or explicit.expanduser().resolve() != default.resolve():
        places.append(("default", default))
    return places


def machine_target() -> str:
    """The target tag of this machine: its (first) CUDA GPU's if torch sees one, else ``llvm``
    (what ``scripts/build.py`` builds by default)."""
    import torch

    if torch.cuda.is_available():
        return target_tag_for_device(torch.device("cuda"))
    return "llvm"


@functools.cache
def runtime_versions() -> dict:
    """Versions a built module must be loaded with (its ABI)."""
    return {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}


def build_command(key: KernelKey, out: str | os.PathLike | None = None) -> str:
    """The ``scripts/build.py`` command that builds ``key`` (into ``out``; without it, into
    the default directory, where it is found without configuration)."""
    target = key.target.replace("-", ":", 1)
    cmd = (f"python scripts/build.py --target {target} --head-dims {key.head_dim} "
           f"--dtypes {DTYPES[key.dtype]} --causal {key.causal} --gqa {key.group}")
    cmd += " --sinks" if key.sinks else ""
    cmd += f" --mods {'+'.join(key.mods)}" if key.mods else ""
    cmd += " --varlen" if key.varlen else ""
    if out is not None and pathlib.Path(out) != default_artifact_dir(key.target):
        cmd += f" --out {out}"
    return cmd


# ---------------------------------------------------------------------------------- manifests


def read_manifest(path: pathlib.Path) -> dict:
    """A manifest's contents; :class:`ArtifactError` if it is not a readable tvm-flash one."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot read artifact manifest {path}: {err}") from err
    if manifest.get("format") != FORMAT or "kernels" not in manifest:
        raise ArtifactError(f"{path}: not a tvm-flash manifest of format {FORMAT}")
    return manifest


def _manifest(directory: pathlib.Path) -> dict | None:
    """``directory``'s manifest (None: there is none), read again only when it changed."""
    path = directory / MANIFEST
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    return _read_once(path, stamp)


@functools.lru_cache(maxsize=16)
def _read_once(path: pathlib.Path, stamp: int) -> dict:
    return read_manifest(path)


def _refusal(entry: dict, key: KernelKey) -> str | None:
    """Why ``entry`` cannot serve ``key`` on this install (None: it can)."""
    if entry.get("target") != key.target:
        return f"was built for {entry.get('target')}, this device needs {key.target}"
    if entry.get("runtime") != runtime_versions():
        return f"was built with {entry.get('runtime')}, this machine runs {runtime_versions()}"
    recorded = entry.get("source_digest")
    if recorded != source_digest():
        why = (f"source digest {recorded[:16]}, this install has {source_digest()[:16]}"
               if recorded else "no source digest recorded: built by an older tvm-flash")
        return f"was built from other kernel source ({why})"
    return None


# ---------------------------------------------------------------------------------- loading


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


@dataclasses.dataclass(frozen=True)
class _Loaded:
    fn: object  # the module's entry function
    absorbs: str | None  # the entry's ``absorbs``


def _open(directory: pathlib.Path, entry: dict, key: KernelKey) -> _Loaded:
    """Load one artifact entry after checking it was built for this key, arch and source."""
    refusal = _refusal(entry, key)
    if refusal is not None:
        raise ArtifactError(f"{key.name}: artifact in {directory} {refusal}; rebuild: "
                            f"{build_command(key, directory)}")
    if "device_code" in entry:
        _install_callback()
        _prebuilt[entry["source_sha256"]] = (directory / entry["device_code"]).read_bytes()
    path = directory / entry["file"]
    if path.suffix == ".tar":  # objects to link on this machine (Metal on a Mac)
        module = tvm.runtime.load_module(str(path))
    else:
        module = tvm_ffi.load_module(str(path))
    entry_fn = module[key.spec.symbol]
    if not key.target.startswith("llvm"):
        # A GPU kernel's call only launches (microseconds, never waits for the device): keep
        # the GIL across it, as torch's own launches do. tvm-ffi releases it by default, and
        # each release lets another Python thread (a data loader's, autograd's) take it, to
        # be waited for before the next launch. CPU kernels compute: they release it.
        entry_fn.release_gil = False
    return _Loaded(entry_fn, entry.get("absorbs"))


def _from_cache(key: KernelKey):
    """JIT: build into the cache (once per key and fingerprint) and open from there."""
    from . import build, export  # the compiler: imported only to build on first use

    directory = jit_dir(key.target)
    fp = build.fingerprint(key)
    sidecar = directory / f"{key.name}-{fp}.json"
    if sidecar.exists():
        entry = json.loads(sidecar.read_text())
    else:
        entry = export.build_artifact(key, directory, with_fingerprint=True)
        part = sidecar.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(entry))
        os.replace(part, sidecar)
    return _open(directory, entry, key)


@functools.cache
def _load(key: KernelKey):
    looked = []
    for _, directory in lookup(key.target):
        manifest = _manifest(directory)
        if manifest is None:
            looked.append(f"{directory} has no {MANIFEST}")
            continue
        entry = manifest["kernels"].get(key.name)
        if entry is not None:
            return _open(directory, entry, key)
        if manifest["target"] != key.target:
            looked.append(f"artifacts in {directory} were built for {manifest['target']}, "
                          f"this device needs {key.target}")
        else:
            looked.append(f"{directory} does not have it")
    if jit_allowed():
        return _from_cache(key)
    # build where the user pointed, unless that directory holds another target's kernels
    explicit = artifact_dir()
    manifest = _manifest(explicit) if explicit is not None else None
    out = explicit if manifest is None or manifest["target"] == key.target else None
    raise ArtifactError(
        f"{key.name}: no compiled kernel ({'; '.join(looked)}). Build it with: "
        f"{build_command(key, out)}, or allow building on first use with TVM_FLASH_JIT=1 "
        f"(tvm_flash.allow_jit()).")


def has(key: KernelKey) -> bool:
    """Whether an artifact directory (:func:`lookup`; not the JIT cache) lists ``key``. The
    runtime asks it of a length bucket's build (``tvm_flash.plan``): one made by
    ``scripts/build.py`` (from a tuning log for the bucket, or where the schedule's default
    for the bucket differs: ``schedules.own_default``); a bucket built just in time is in the
    JIT cache, not here."""
    for _, directory in lookup(key.target):
        manifest = _manifest(directory)
        if manifest is not None and key.name in manifest["kernels"]:
            return True
    return False


def kernel(key: KernelKey):
    """The callable entry function of ``key``'s module, loaded once per process."""
    with _lock:
        return _load(key).fn


def absorbs(key: KernelKey) -> str | None:
    """The op whose work ``key``'s kernel does too, as its artifact records it
    (``tvm_flash.opspec.OpSpec.absorbs``): then it takes ``ABSORB_ARGS`` and that op is not
    launched (``tvm_flash.plan``). Loads the kernel; runs no build code."""
    with _lock:
        return _load(key).absorbs


# ------------------------------------------------------------------------------ description


@dataclasses.dataclass(frozen=True)
class Place:
    """One place kernels are looked up: what put it there, the directory, how many kernels of
    the target it holds that this install accepts, and a note (why others are refused)."""

    what: str
    path: pathlib.Path
    kernels: int
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Info:
    """What :func:`tvm_flash.info` reports; ``str()`` gives it as lines of text."""

    versions: dict
    target: str
    places: tuple[Place, ...]
    jit: bool

    def __str__(self) -> str:
        v = self.versions
        lines = [f"tvm-flash {v['tvm-flash']} (tvm {v['tvm']}, tvm-ffi {v['tvm-ffi']}, "
                 f"torch {v['torch']})",
                 f"target of this machine: {self.target}"
                 + ("" if self.target == "llvm" else " (CPU tensors: llvm)"),
                 "kernels are looked up in order:"]
        for i, p in enumerate(self.places, 1):
            note = f" ({p.note})" if p.note else ""
            lines.append(f"  {i}. {p.what}: {p.path}: {p.kernels} kernels{note}")
        lines.append(f"building on first use (JIT): "
                     f"{'allowed' if self.jit else 'not allowed (TVM_FLASH_JIT=1 allows it)'}")
        return "\n".join(lines)


def _describe(what: str, directory: pathlib.Path, target: str) -> Place:
    try:
        manifest = _manifest(directory)
    except ArtifactError as err:
        return Place(what, directory, 0, str(err))
    if manifest is None:
        return Place(what, directory, 0, f"no {MANIFEST}")
    if manifest["target"] != target:
        return Place(what, directory, 0, f"built for {manifest['target']}")
    return _count(what, directory, manifest["kernels"].values(), target)


def _count(what: str, directory: pathlib.Path, entries, target: str) -> Place:
    usable, refused = 0, {}
    for entry in entries:
        try:
            refusal = _refusal(entry, KernelKey(**entry["key"]))
        except (KeyError, TypeError, ValueError):
            refusal = "has an unreadable key"
        if refusal is None:
            usable += 1
        else:
            reason = refusal.split(" (")[0]
            refused[reason] = refused.get(reason, 0) + 1
    note = "; ".join(f"{n} refused: {why}" for why, n in refused.items())
    return Place(what, directory, usable, note)


def info() -> Info:
    """Versions, this machine's target, where its kernels are looked up (in order) and how
    many each place holds, whether JIT is allowed."""
    import torch

    import tvm_flash

    target = machine_target()
    places = [_describe(what, d, target) for what, d in lookup(target)]
    jit = jit_dir(target)
    entries = []
    for sidecar in sorted(jit.glob("*.json")) if jit.is_dir() else ():
        try:
            entries.append(json.loads(sidecar.read_text()))
        except (OSError, ValueError):
            continue
    place = _count("JIT cache", jit, entries, target)
    if not jit_allowed():
        place = dataclasses.replace(place, note="used only when JIT is allowed" +
                                    (f"; {place.note}" if place.note else ""))
    return Info(versions={"tvm-flash": tvm_flash.__version__, "tvm": tvm.__version__,
                          "tvm-ffi": tvm_ffi.__version__, "torch": torch.__version__},
                target=target, places=(*places, place), jit=jit_allowed())


# The build side's names, for callers that still import them from here; importing them loads
# the compiler, so only on use.
_BUILD_SIDE = ("build_artifact", "write_manifest", "metal_resources")


def __getattr__(name: str):
    if name in _BUILD_SIDE:
        from . import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
