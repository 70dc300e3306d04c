"""Metal: every kernel lowers within Apple GPU limits; artifacts hold Mach-O arm64 host code.

No Apple hardware here: these tests inspect what the compiler emits (see README "Metal")."""

import json
import pathlib
import re
import subprocess
import sys
import tarfile

import pytest
import tvm

from tvm_flash import KernelKey
from tvm_flash.artifacts import metal_resources
from tvm_flash.build import compile_module, device_source, scheduled_module
from tvm_flash.key import MERGE_OPS, OPS

ROOT = pathlib.Path(__file__).resolve().parent.parent
MACHO_ARM64 = bytes.fromhex("cffaedfe0c000001")  # MH_MAGIC_64, CPU_TYPE_ARM64


def _thread_extents(mod):
    text = mod.script()
    pattern = r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="threadIdx\.'
    return [int(n) for n in re.findall(pattern, text)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kernel_lowers_within_metal_limits(op, d, dtype, tmp_path):
    row_wise = op in MERGE_OPS
    key = KernelKey(op, d, dtype, "none" if row_wise else "bottom-right", 1 if row_wise else 4,
                    "metal")
    mod = scheduled_module(key)
    extents = _thread_extents(mod)
    assert extents and max(extents) <= 1024
    built = compile_module(key, mod)
    src = device_source(built)
    res = metal_resources(src)
    assert res["threadgroup_bytes"] <= 32 * 1024, res
    assert "double" not in src
    if not row_wise:
        # every kernel that stages data in threadgroup memory reuses it across the key loop
        assert res["threadgroup_bytes"] > 0 and res["barriers"] >= 3, res
    path = tmp_path / "k.tar"
    built.export_library(str(path))
    with tarfile.open(path) as tar:
        objects = [m for m in tar.getmembers() if m.name.endswith(".o")]
        assert objects
        for member in objects:
            assert tar.extractfile(member).read(8) == MACHO_ARM64, member.name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_head_dim_256_refused_with_reason(dtype):
    with pytest.raises(ValueError, match="not supported on Metal.*32 KiB of threadgroup memory"):
        scheduled_module(KernelKey("fwd", 256, dtype, "none", 1, "metal"))


def test_build_script_writes_metal_artifacts(tmp_path):
    out = tmp_path / "metal"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--target",
                          "metal:apple-m2", "--head-dims", "64,128", "--dtypes", "fp16,fp32",
                          "--causal", "top-left", "--out", str(out), "--jobs", "2"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "metal-apple-m2"
    assert len(manifest["kernels"]) == 36  # 4 x (3 row-wise + 6 per causal mode)
    for entry in manifest["kernels"].values():
        assert entry["file"].endswith(".tar") and (out / entry["file"]).exists()
        assert "#include <metal_stdlib>" in (out / entry["metal_source"]).read_text()
        assert entry["threadgroup_bytes"] <= 32 * 1024


def test_metal_target_has_macos_arm64_host():
    from tvm_flash.target import make_target

    target = make_target("metal-apple-m3")
    assert target.kind.name == "metal"
    assert str(target.host.attrs["mtriple"]) == "arm64-apple-macos"
    assert isinstance(target, tvm.target.Target)
