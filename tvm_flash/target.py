"""Target tags: what a tag names, how a user spec or a torch device maps to one, and the TVM
target it compiles for. Light on purpose: loading a kernel needs the tag of a device, not the
compiler."""

from __future__ import annotations

import os

import tvm


def target_kind(tag: str) -> str:
    return tag.split("-", 1)[0]


METAL_HOST = {"kind": "llvm", "mtriple": "arm64-apple-macos"}
"""Host code for Metal artifacts: Apple silicon Macs."""


def parse_target(spec: str) -> str:
    """Target tag from a user spec: ``llvm``, ``cuda:sm_90`` / ``cuda-sm_90`` (``sm_90a``:
    Hopper's arch-specific instructions, which its wgmma kernels need), ``cuda`` (the
    local GPU's arch), ``metal`` or ``metal:apple-m2`` (a chip name for tuning logs)."""
    spec = spec.strip().lower().replace(":", "-")
    if spec in ("llvm", "cpu"):
        return "llvm"
    if spec == "metal" or (spec.startswith("metal-") and spec[6:].replace("-", "").isalnum()):
        return spec
    if spec == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("target: 'cuda' needs a visible GPU to pick the arch; name it, "
                             "e.g. cuda:sm_90")
        return cuda_tag(*torch.cuda.get_device_capability())
    if spec.startswith("cuda-sm_") and spec[len("cuda-sm_"):].removesuffix("a").isdigit():
        return spec
    raise ValueError(f"target: {spec!r} is not one of llvm, cuda, cuda:sm_XY, metal, "
                     "metal:CHIP")


HOPPER_ENV = "TVM_FLASH_HOPPER"
"""``0`` keeps a Hopper GPU on its plain ``cuda-sm_90`` kernels (the ``mma.sync`` family), so
the two families can be compared side by side; anything else (the default) uses ``cuda-sm_90a``
and its ``wgmma`` kernels where they exist."""


def cuda_tag(major: int, minor: int) -> str:
    """Target tag of a CUDA device of compute capability ``major.minor``: Hopper (9.0) gets
    ``cuda-sm_90a``, whose arch-specific instructions (wgmma, setmaxnreg) its fastest kernels
    need, unless ``TVM_FLASH_HOPPER=0``."""
    if (major, minor) == (9, 0) and os.environ.get(HOPPER_ENV, "1") != "0":
        return "cuda-sm_90a"
    return f"cuda-sm_{major}{minor}"


def make_target(tag: str) -> tvm.target.Target:
    """TVM target for a target tag: ``llvm`` or ``cuda-sm_XY``."""
    if tag == "llvm":
        return tvm.target.Target({"kind": "llvm"})
    if tag.startswith("cuda-sm_"):
        return tvm.target.Target({"kind": "cuda", "arch": tag[len("cuda-"):]})
    if target_kind(tag) == "metal":
        return tvm.target.Target({"kind": "metal"}, host=METAL_HOST)
    raise ValueError(f"target: unknown target tag {tag!r}; use llvm, cuda-sm_XY or metal")


def target_tag_for_device(device) -> str:
    """Target tag for a torch device: ``llvm`` for CPU, ``cuda-sm_XY`` for a CUDA device."""
    if device.type == "cpu":
        return "llvm"
    if device.type == "cuda":
        import torch

        return cuda_tag(*torch.cuda.get_device_capability(device))
    if device.type == "mps":
        return "metal"
    raise ValueError(f"device: tvm-flash runs on cpu, cuda and mps tensors, not {device.type!r}")
