"""scripts/build.py artifacts: build, manifest, loading without compiling, refusals."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import HAS_CUDA

import tvm_flash
from tvm_flash import ArtifactError, KernelKey, artifacts
from tvm_flash.target import target_tag_for_device

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = [sys.executable, str(ROOT / "scripts" / "build.py")]


def _build(*args, check=True):
    return subprocess.run(BUILD + list(args), capture_output=True, text=True, check=check,
                          cwd=ROOT)


@pytest.fixture
def artifact_mode(tmp_path, monkeypatch):
    """Load only from artifacts (no JIT) inside the test, with an empty default location (a
    private ``TVM_FLASH_CACHE``); restore the defaults afterwards."""
    monkeypatch.setenv("TVM_FLASH_CACHE", str(tmp_path / "cache"))
    yield
    tvm_flash.use_artifacts(None)
    tvm_flash.allow_jit(None)


@pytest.fixture(scope="module")
def llvm_artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "llvm"
    res = _build("--target", "llvm", "--head-dims", "64", "--dtypes", "fp32,bf16", "--causal",
                 "top-left", "--gqa", "2", "--out", str(out), "--jobs", "2")
    assert "built 18 kernels" in res.stdout, res.stdout + res.stderr
    return out


def test_build_writes_manifest(llvm_artifacts):
    manifest = json.loads((llvm_artifacts / "manifest.json").read_text())
    assert manifest["target"] == "llvm"
    assert {"tvm", "tvm_ffi", "torch"} <= set(manifest["versions"])
    assert "tuning_log" in manifest
    assert len(manifest["kernels"]) == 18
    for name, entry in manifest["kernels"].items():
        assert KernelKey(**entry["key"]).name == name
        assert (llvm_artifacts / entry["file"]).exists()
        assert len(entry["fingerprint"]) == 16


def test_load_from_artifacts_without_jit(llvm_artifacts, artifact_mode):
    tvm_flash.use_artifacts(llvm_artifacts)
    tvm_flash.allow_jit(False)
    q = torch.randn(1, 4, 33, 64, requires_grad=True)
    k, v = torch.randn(1, 2, 33, 64), torch.randn(1, 2, 33, 64)
    out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    ref, _ = tvm_flash.attention_reference(q.detach(), k, v, causal="top-left")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_missing_artifact_names_key_and_command(llvm_artifacts, artifact_mode):
    tvm_flash.use_artifacts(llvm_artifacts)
    tvm_flash.allow_jit(False)
    q = k = v = torch.randn(1, 2, 33, 64)  # MHA (group 1) was not built
    with pytest.raises(ArtifactError) as err:
        tvm_flash.attention(q, k, v, is_causal=True)
    msg = str(err.value)
    assert "fwd-d64-fp32-top-left-g1-llvm" in msg
    assert "scripts/build.py --target llvm --head-dims 64 --dtypes fp32 --causal top-left " \
           "--gqa 1" in msg


def _edited_copy(src, dst, edit):
    """A copy of the artifact directory ``src`` whose manifest entries ``edit`` changed."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for entry in manifest["kernels"].values():
        edit(entry)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize("edit, reason", [
    (lambda e: e.update(source_digest="0" * 64), r"other kernel source \(source digest 0000"),
    (lambda e: e.pop("source_digest"), "no source digest recorded: built by an older"),
    (lambda e: e["runtime"].update(tvm="0.26.0"), "was built with .*0.26.0.*, this machine runs"),
], ids=["other-source", "no-digest", "other-tvm"])
def test_stale_artifact_is_refused(llvm_artifacts, tmp_path, artifact_mode, edit, reason):
    """Built from other kernel source (or by a tvm-flash that recorded none), or with other
    TVM versions: refused with the reason and the command that rebuilds it."""
    copy = _edited_copy(llvm_artifacts, tmp_path / "llvm", edit)
    tvm_flash.use_artifacts(copy)
    tvm_flash.allow_jit(False)
    q, k, v = torch.randn(1, 4, 9, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    with pytest.raises(ArtifactError, match=reason) as err:
        tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert f"--gqa 2 --out {copy}" in str(err.value)


def test_other_target_is_refused(llvm_artifacts, tmp_path, artifact_mode):
    """A manifest for another arch never serves this device."""
    copy = tmp_path / "sm80"
    shutil.copytree(llvm_artifacts, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"] = "cuda-sm_80"
    manifest["kernels"] = {}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    tvm_flash.use_artifacts(copy)
    tvm_flash.allow_jit(False)
    q = torch.randn(1, 2, 9, 64)
    with pytest.raises(ArtifactError, match="built for cuda-sm_80, this device needs llvm"):
        tvm_flash.attention(q, q, q)


def test_default_location_is_found_without_configuration(llvm_artifacts, artifact_mode):
    """Kernels in ``$TVM_FLASH_CACHE/artifacts/<target>`` (where scripts/build.py writes
    without --out) serve with no TVM_FLASH_ARTIFACTS and no JIT."""
    tvm_flash.use_artifacts(None)
    tvm_flash.allow_jit(False)
    default = artifacts.default_artifact_dir("llvm")
    assert default == pathlib.Path(os.environ["TVM_FLASH_CACHE"]) / "artifacts" / "llvm"
    shutil.copytree(llvm_artifacts, default)
    q = torch.randn(1, 4, 33, 64)
    k, v = torch.randn(1, 2, 33, 64), torch.randn(1, 2, 33, 64)
    out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
    ref, _ = tvm_flash.attention_reference(q, k, v, causal="top-left")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_lookup_order(llvm_artifacts, tmp_path, artifact_mode):
    """The chosen directory comes first: its stale kernel is refused although the default
    location has a good one; a kernel it lacks comes from the default location."""
    shutil.copytree(llvm_artifacts, artifacts.default_artifact_dir("llvm"))
    stale = _edited_copy(llvm_artifacts, tmp_path / "stale",
                         lambda e: e.update(source_digest="0" * 64))
    tvm_flash.use_artifacts(stale)
    tvm_flash.allow_jit(False)
    assert [what for what, _ in artifacts.lookup("llvm")] == ["use_artifacts()", "default"]
    q, k, v = torch.randn(1, 4, 9, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    with pytest.raises(ArtifactError, match=f"artifact in {stale} was built from other"):
        tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)
    partial = _edited_copy(llvm_artifacts, tmp_path / "partial", lambda e: None)
    manifest = json.loads((partial / "manifest.json").read_text())
    manifest["kernels"] = {n: e for n, e in manifest["kernels"].items() if "fp32" not in n}
    (partial / "manifest.json").write_text(json.dumps(manifest))
    tvm_flash.use_artifacts(partial)
    out = tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True)  # fp32: the default's
    ref, _ = tvm_flash.attention_reference(q, k, v, causal="top-left")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_info_reports_the_lookup(llvm_artifacts, artifact_mode):
    tvm_flash.use_artifacts(llvm_artifacts)
    tvm_flash.allow_jit(False)
    report = tvm_flash.info()
    assert report.target == "llvm" and not report.jit
    assert set(report.versions) == {"tvm-flash", "tvm", "tvm-ffi", "torch"}
    assert [(p.what, p.path, p.kernels) for p in report.places] == [
        ("use_artifacts()", llvm_artifacts, 18),
        ("default", artifacts.default_artifact_dir("llvm"), 0),
        ("JIT cache", artifacts.jit_dir("llvm"), 0)]
    text = str(report)
    assert f"1. use_artifacts(): {llvm_artifacts}: 18 kernels" in text
    assert "JIT): not allowed" in text


def test_loading_runs_no_build_code(llvm_artifacts):
    """A fresh process that loads prebuilt kernels imports no schedule, kernel factory or
    compiler module (and so runs none of their code)."""
    code = ("import json, sys, torch, tvm_flash\n"
            "q = torch.randn(1, 4, 9, 64, requires_grad=True)\n"
            "k, v = torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)\n"
            "tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()\n"
            "print(json.dumps([m for m in sys.modules if m.startswith('tvm_flash.')]))\n")
    env = {**os.environ, "TVM_FLASH_ARTIFACTS": str(llvm_artifacts), "TVM_FLASH_JIT": "0"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    assert "tvm_flash.artifacts" in loaded
    assert not loaded & {"tvm_flash.schedules", "tvm_flash.kernels", "tvm_flash.build",
                         "tvm_flash.export", "tvm_flash.tuning"}, loaded


@pytest.mark.parametrize("op", tvm_flash.OPS)
def test_op_table_matches_the_kernels(op):
    """The loader calls ``module[spec.symbol]`` and ops.py passes ``spec.args``: both are what
    the factory writes."""
    from tvm_flash.kernels import FACTORIES, TileConfig
    from tvm_flash.opspec import SPECS

    spec = SPECS[op]
    tile = TileConfig(8, 64) if spec.packs else TileConfig(32, 32)
    key = KernelKey(op, 64, "float32", "none", 1, "llvm", sinks=spec.sinks)
    func = FACTORIES[op](key, tile)
    assert func.attrs["global_symbol"] == spec.symbol
    assert tuple(p.name for p in func.params) == spec.args == spec.args_of(False)
    if spec.mods:  # with any modifier the kernel takes MOD_ARGS too
        for mods in ({"window": True}, {"softcap": True, "alibi": True}):
            func = FACTORIES[op](dataclasses.replace(key, **mods), tile)
            assert tuple(p.name for p in func.params) == spec.args_of(True)


@pytest.mark.parametrize("mods", [{}, {"softcap": True, "alibi": True}, {"varlen": True}])
def test_hopper_dq_takes_what_absorbing_bwd_pre_adds(mods):
    """The Hopper dQ computes Delta (``schedules.absorbs``): its parameters are the op's with
    ``ABSORB_ARGS`` before Delta (the plan passes O there), with and without modifiers and
    packed sequences. The ``mma.sync`` dQ (sm_90) keeps the plain convention."""
    from tvm_flash.build import scheduled_module, schedules
    from tvm_flash.opspec import SPECS

    spec = SPECS["dq"]
    key = KernelKey("dq", 128, "bfloat16", "top-left", 2, "cuda-sm_90a", **mods)
    assert schedules.absorbs("cuda", key) == spec.absorbs == "bwd_pre"
    func = scheduled_module(key)["main"]
    want = spec.args_of(bool(key.mods), key.varlen, absorbed=True)
    assert tuple(p.name for p in func.params) == want and want.index("O") == 5
    mma = dataclasses.replace(key, target="cuda-sm_90")
    assert schedules.absorbs("cuda", mma) is None
    assert len(scheduled_module(mma)["main"].params) == len(spec.args_of(bool(key.mods),
                                                                         key.varlen))
    with pytest.raises(ValueError, match="absorbs no other op"):
        SPECS["dkv"].args_of(absorbed=True)


def test_build_rejects_unsupported_requests(tmp_path):
    for args, text in ((["--head-dims", "48"], "head_dim"), (["--dtypes", "fp8"], "--dtypes"),
                       (["--target", "rocm"], "target")):
        res = _build("--out", str(tmp_path / "x"), *args, check=False)
        assert res.returncode != 0
        assert text in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_cross_build_without_gpu(tmp_path):
    """sm_90 and sm_80 device code is compiled ahead of time on a machine without a GPU."""
    for arch in ("sm_90", "sm_80"):
        out = tmp_path / arch
        res = _build("--target", f"cuda:{arch}", "--head-dims", "64", "--dtypes", "bf16",
                     "--causal", "none", "--out", str(out), "--jobs", "2")
        assert res.returncode == 0, res.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["target"] == f"cuda-{arch}"
        for entry in manifest["kernels"].values():
            assert entry["arch"] == arch
            code = (out / entry["device_code"]).read_bytes()
            assert len(code) > 1000 and len(entry["source_sha256"]) == 64


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not os.environ.get("TVM_FLASH_ARTIFACTS"),
                    reason="needs a GPU and TVM_FLASH_ARTIFACTS built by scripts/build.py")
def test_prebuilt_cuda_artifacts_load_without_compiling(artifact_mode, monkeypatch):
    """Every kernel in the carried artifact directory loads and runs with JIT forbidden: the
    CUDA compile callback is answered from the precompiled device code only."""
    directory = pathlib.Path(os.environ["TVM_FLASH_ARTIFACTS"])
    manifest = json.loads((directory / "manifest.json").read_text())
    tag = target_tag_for_device(torch.device("cuda"))
    assert manifest["target"] == tag
    tvm_flash.use_artifacts(directory)
    tvm_flash.allow_jit(False)
    compiled = []
    monkeypatch.setattr(artifacts, "_compile_fallback", [lambda code: compiled.append(code)])
    for entry in manifest["kernels"].values():
        key = KernelKey(**entry["key"])
        if key.op != "fwd":
            continue
        dtype = getattr(torch, key.dtype)
        q = torch.randn(2, 2 * key.group, 77, key.head_dim, dtype=dtype, device="cuda",
                        requires_grad=True)
        k = torch.randn(2, 2, 77, key.head_dim, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        sinks = torch.randn(2 * key.group, device="cuda") if key.sinks else None
        out = tvm_flash.attention(q, k, v, is_causal=key.causal != "none", enable_gqa=True,
                                  causal_alignment="top-left" if key.causal == "none"
                                  else key.causal, sinks=sinks)
        out.float().sum().backward()
        ref, _ = tvm_flash.attention_reference(q.detach(), k, v, causal=key.causal,
                                               sinks=sinks)
        assert (out.double() - ref).abs().max() < 0.05
    torch.cuda.synchronize()
    assert compiled == []
