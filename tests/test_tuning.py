"""MetaSchedule tuning on the CPU (llvm): logs, reuse by build.py, refusals, Metal dry run."""

import dataclasses
import importlib
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import tvm_flash
from tvm_flash import KernelKey, tuning
from tvm_flash.build import scheduled_module
from tvm_flash.key import CAUSAL_MODES, HEAD_DIMS, LENGTH_BUCKETS

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = KernelKey("fwd", 64, "float32", "top-left", 1, "llvm")
SHAPE = {"B": 1, "Hq": 2, "L": 96}


def _tune_dry_run(target: str, kernels: str, head_dims: str, dtypes: str, causal: str,
                  *more: str):
    """``scripts/tune.py --dry-run`` for these kernels; it must succeed."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--target", target,
                          "--kernels", kernels, "--head-dims", head_dims, "--dtypes", dtypes,
                          "--causal", causal, "--dry-run", *more], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuning_logs")
    summary = tuning.tune(KEY, root, trials=4, shape=SHAPE)
    assert summary["measured"] >= 1
    return root


def test_tuning_writes_small_metaschedule_logs(logs):
    directory = tuning.log_dir(logs, KEY)
    names = {p.name for p in directory.iterdir()}
    assert names == {"summary.json", "database_tuning_record.json", "workloads.json"}
    assert sum(p.stat().st_size for p in directory.iterdir()) < 32 * 1024
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["target"] == "llvm" and summary["key"] == KEY.name
    assert summary["best"]["tile"] == [32, 32]
    assert summary["best"]["decisions"]["unroll"] in (0, 16, 64)
    assert summary["best"]["run_us"] > 0


def test_tuning_resumes_from_its_log(logs, tmp_path):
    root = tmp_path / "logs"
    shutil.copytree(logs, root)
    before = len((tuning.log_dir(root, KEY) / "database_tuning_record.json").read_text()
                 .splitlines())
    summary = tuning.tune(KEY, root, trials=2, shape=SHAPE)
    assert summary["measured"] >= before


def test_resume_refuses_a_log_whose_workload_changed(logs, tmp_path):
    root = tmp_path / "logs"
    shutil.copytree(logs, root)
    index_path = tuning.log_dir(root, KEY) / "workloads.json"
    index = json.loads(index_path.read_text())
    index[0]["shash"] = "0"  # as if the kernel source had changed since
    index_path.write_text(json.dumps(index))
    with pytest.raises(tuning.TuningLogError, match="no longer produces the workload"):
        tuning.tune(KEY, root, trials=2, shape=SHAPE)


def _short_calls_take_the_bucket(artifacts_dir, bucket):
    """With only ``artifacts_dir``'s kernels, a call 70 long runs ``bucket``'s build and one
    1030 long the every-length kernel, both correct."""
    from tvm_flash import plan

    try:
        tvm_flash.use_artifacts(artifacts_dir)
        tvm_flash.allow_jit(False)
        for n, want in ((70, bucket), (1030, KEY)):
            q = torch.randn(1, 2, n, 64)
            out = tvm_flash.attention(q, q, q, is_causal=True)
            ref, _ = tvm_flash.attention_reference(q, q, q, causal="top-left")
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
            run = plan.get(q.device, q.dtype, 64, "top-left", 1, False, n, False, lk=n)
            assert run.keys == (want,)
    finally:
        tvm_flash.use_artifacts(None)
        tvm_flash.allow_jit(None)


def test_build_from_logs_is_deterministic_and_runs(logs, tmp_path):
    tuned = tuning.load_tuned(logs, KEY)
    assert tuned is not None
    choice = {"tile": tuned["tile"], "decisions": tuned["decisions"]}
    assert scheduled_module(KEY, choice).script() == scheduled_module(KEY, choice).script()
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--target",
                              "llvm", "--head-dims", "64", "--dtypes", "fp32", "--causal",
                              "top-left", "--tuning-logs", str(logs), "--out", str(out)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "1 from tuning logs" in res.stdout
        assert f"{KEY.name}" in res.stdout and "(tuned tile" in res.stdout
        assert "fastest of" in res.stdout  # and why (tuning.load_tuned's "why")
        outs.append(json.loads((out / "manifest.json").read_text()))
    entry_a, entry_b = (m["kernels"][KEY.name] for m in outs)
    assert entry_a["schedule"] == "tuned" and entry_a["fingerprint"] == entry_b["fingerprint"]
    # the log was measured at every-length's shape: short calls get the default tile, built
    # as the length bucket's kernel, and the runtime takes it for them
    bucket = dataclasses.replace(KEY, lengths=1024)
    assert outs[0]["kernels"][bucket.name]["schedule"] == "default"
    assert "this bucket has none" in res.stdout
    assert outs[0]["tuning_log"] == {KEY.name: tuned["digest"]}
    _short_calls_take_the_bucket(tmp_path / "a", bucket)


def test_length_bucket_gets_its_own_build_and_the_runtime_takes_it(tmp_path):
    """A log for calls up to 1024 long (``--lengths 1024``) becomes a build of its own, which
    calls that short run and longer ones do not; without such a build every call runs the
    every-length kernel."""
    from tvm_flash import plan

    bucket = dataclasses.replace(KEY, lengths=1024)
    assert bucket.name == "fwd-d64-fp32-top-left-g1-n1024-llvm"
    logs = tmp_path / "logs"
    summary = tuning.tune(bucket, logs, trials=2)
    assert summary["bucket"] == 1024 and "calls up to 1024 long" in tuning.load_tuned(
        logs, bucket)["why"]
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--target",
                          "llvm", "--head-dims", "64", "--dtypes", "fp32", "--causal",
                          "top-left", "--tuning-logs", str(logs), "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 of them for a length bucket" in res.stdout and bucket.name in res.stdout
    manifest = json.loads((out / "manifest.json").read_text())["kernels"]
    assert bucket.name in manifest and KEY.name in manifest
    _short_calls_take_the_bucket(out, bucket)
    # no bucket build: the every-length kernel serves short calls too (JIT)
    tvm_flash.allow_jit(True)
    try:
        run = plan.get(torch.device("cpu"), torch.float32, 64, "top-left", 1, False, 70, False,
                       lk=70)
        assert run.keys == (KEY,)
    finally:
        tvm_flash.allow_jit(None)


def test_length_bucket_keys_are_checked():
    with pytest.raises(ValueError, match="lengths: 512 is not 0"):
        dataclasses.replace(KEY, lengths=512)
    with pytest.raises(ValueError, match="only the tiled forward"):
        KernelKey("fwd_merge", 64, "float32", "none", 1, "llvm", lengths=1024)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--target", "llvm",
                          "--lengths", "0,2048", "--dry-run"], capture_output=True, text=True)
    assert res.returncode != 0 and "lengths: 2048" in res.stderr


def test_log_for_another_target_is_refused(logs, tmp_path):
    cuda_key = KEY.__class__("fwd", 64, "float32", "top-left", 1, "cuda-sm_90")
    target_dir = tuning.log_dir(tmp_path, cuda_key)
    shutil.copytree(tuning.log_dir(logs, KEY), target_dir)
    summary = json.loads((target_dir / "summary.json").read_text())
    summary.update(key=cuda_key.name, target=cuda_key.target)  # relabelled, records still llvm
    (target_dir / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(tuning.TuningLogError, match="tuned for llvm"):
        tuning.load_tuned(tmp_path, cuda_key)


@pytest.mark.parametrize("damage", ["summary", "records"])
def test_corrupt_log_is_refused(logs, tmp_path, damage):
    shutil.copytree(logs, tmp_path / "logs")
    directory = tuning.log_dir(tmp_path / "logs", KEY)
    name = "summary.json" if damage == "summary" else "database_tuning_record.json"
    (directory / name).write_text((directory / name).read_text()[:40])
    with pytest.raises(tuning.TuningLogError, match="corrupt"):
        tuning.load_tuned(tmp_path / "logs", KEY)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--target", "llvm",
                          "--head-dims", "64", "--dtypes", "fp32", "--causal", "top-left",
                          "--tuning-logs", str(tmp_path / "logs"), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True)
    assert res.returncode != 0 and "corrupt" in res.stderr
    assert not (tmp_path / "out").exists()


def _committed_logs() -> dict:
    """The committed tuning logs: their directory -> key."""
    names = {k.name: k for k in (
        KernelKey(op, d, dt, c, g, t, lengths=n) for op in ("fwd", "dq", "dkv")
        for d in HEAD_DIMS for dt in ("float16", "bfloat16", "float32") for c in CAUSAL_MODES
        for g in (1, 2, 4, 8) for t in ("llvm", "cuda-sm_80", "cuda-sm_90", "cuda-sm_90a")
        for n in (0, *LENGTH_BUCKETS))}
    return {p.parent: names[p.parent.name]
            for p in sorted((ROOT / "tuning_logs").glob("*/*/summary.json"))}


def test_committed_logs_load():
    """Every committed log passes load_tuned's checks (key, target, TVM version, a variant
    its kernel has) and says why its choice was made; together they stay well under 1 MiB."""
    logs = _committed_logs()
    assert logs
    for directory, key in logs.items():
        assert directory.parent.name == key.target
        tuned = tuning.load_tuned(ROOT / "tuning_logs", key)
        assert tuned is not None and "fastest of" in tuned["why"], directory
    size = sum(p.stat().st_size for p in (ROOT / "tuning_logs").rglob("*") if p.is_file())
    assert size < 512 * 1024


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU)")
def test_build_applies_a_committed_hopper_log(tmp_path):
    """build.py cross-compiles an H200 log's variant (the D 64 dK/dV's) on a GPU-less host and
    says so."""
    key = KernelKey("dkv", 64, "bfloat16", "none", 1, "cuda-sm_90a")
    assert (ROOT / "tuning_logs" / key.target / key.name / "summary.json").exists()
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--target",
                          "cuda:sm_90a", "--head-dims", "64", "--dtypes", "bf16", "--causal",
                          "none", "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if f" {key.name} " in x)
    assert "tuned variant" in line and "NVIDIA H200" in line, line
    entry = json.loads((tmp_path / "manifest.json").read_text())["kernels"][key.name]
    assert entry["schedule"] == "tuned" and "why" not in entry["tuned"]


def test_length_buckets_with_a_default_of_their_own_are_built():
    """The Hopper forward at D 64 takes three consumer warpgroups but for causal calls up to
    1024 long (``cuda_hopper.tile``): that bucket has a default of its own
    (``schedules.own_default``), which build.py builds with no tuning log and says so; buckets
    whose default is the every-length one are not built without a log."""
    from tvm_flash.build import schedules

    spec = importlib.util.spec_from_file_location("build_script", ROOT / "scripts" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    causal, plain, wide = (KernelKey("fwd", d, "bfloat16", c, 1, "cuda-sm_90a")
                           for d, c in ((64, "top-left"), (64, "none"), (128, "top-left")))
    short = dataclasses.replace(causal, lengths=1024)
    assert schedules.own_default("cuda", short)
    assert not schedules.own_default("cuda", causal)
    assert not schedules.own_default("cuda", dataclasses.replace(plain, lengths=1024))
    assert not schedules.own_default("cuda", dataclasses.replace(wide, lengths=1024))
    assert build.own_buckets([causal, plain, wide], {}) == [short]
    assert build.own_buckets([causal], {short: None}) == []  # a logged kernel's bucket
    assert "its own" in build._how(short, None)
    tiles = [schedules.variants("cuda", k)[0]["consumers"] for k in (causal, short, plain)]
    assert tiles == [3, 2, 3]
    # dK/dV at D 64 unmasked: 128-query steps for calls up to 1024 long, 96 beyond
    dkv = KernelKey("dkv", 64, "bfloat16", "none", 1, "cuda-sm_90a")
    dkv_short = dataclasses.replace(dkv, lengths=1024)
    assert schedules.own_default("cuda", dkv_short)
    assert build.own_buckets([dkv], {}) == [dkv_short]
    assert [schedules.variants("cuda", k)[0]["step"] for k in (dkv, dkv_short)] == [96, 128]


def test_just_in_time_calls_take_a_bucket_with_a_default_of_its_own(monkeypatch):
    """Where just-in-time building is allowed, a short call takes its length bucket's build if
    the schedule's default differs there (as build.py would have built it), else the
    every-length kernel; with JIT forbidden only artifact directories decide."""
    from tvm_flash import plan

    key = KernelKey("fwd", 64, "bfloat16", "top-left", 1, "cuda-sm_90a")
    short = dataclasses.replace(key, lengths=1024)
    monkeypatch.setattr(tvm_flash.artifacts, "has", lambda k: False)
    try:
        tvm_flash.allow_jit(True)
        assert plan._bucketed(key, 1024) == short
        assert plan._bucketed(dataclasses.replace(key, causal="none"), 1024).lengths == 0
        assert plan._bucketed(key, 0) == key
        tvm_flash.allow_jit(False)
        assert plan._bucketed(key, 1024) == key
    finally:
        tvm_flash.allow_jit(None)


def test_no_log_means_default_schedule():
    assert tuning.load_tuned(ROOT / "tuning_logs", KEY.__class__(
        "dkv", 96, "float16", "none", 8, "llvm")) is None


def test_metal_tuning_dry_run():
    """The Metal tuning path (space generation + build) runs on a machine without a Mac."""
    res = _tune_dry_run("metal:apple-m2", "fwd,dkv", "64", "fp16", "top-left")
    assert res.stdout.count("design spaces generated and built") == 2


def test_warp_level_kernels_without_variants_are_not_tuned(tmp_path):
    """A hand-lowered kernel is tuned over its variants only: the factory tuner refuses it,
    and one without variants (score modifiers, the row-wise preprocess) is refused by both,
    its log too; scripts/tune.py says it skips it."""
    key = KernelKey("fwd", 64, "bfloat16", "none", 1, "cuda-sm_90")
    with pytest.raises(tuning.TuningLogError, match="its variants are tuned"):
        tuning.tune(key, tmp_path, trials=4)
    bare = KernelKey("fwd", 64, "bfloat16", "none", 1, "cuda-sm_90", softcap=True)
    with pytest.raises(tuning.TuningLogError, match="no variants"):
        tuning.tune_variants(bare, tmp_path, trials=4)
    directory = tuning.log_dir(tmp_path, bare)
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text("{}")
    with pytest.raises(tuning.TuningLogError, match="no variants"):
        tuning.load_tuned(tmp_path, bare)
    res = _tune_dry_run("cuda:sm_90", "bwd_pre", "64", "bf16", "none")
    assert "skipped: written out at warp level" in res.stdout


def test_mma_variants_dry_run():
    """The mma.sync kernels are tuned over their tiles (warps, m-tiles, step, stages; the
    default first, each fitting the arch's shared memory); every variant's workload builds
    as the tuner builds it (TVM's default pipeline)."""
    from tvm_flash.build import schedules

    key = KernelKey("dkv", 256, "bfloat16", "none", 1, "cuda-sm_90")
    found = schedules.variants("cuda", key)
    assert len(found) > 1 and all(v["split"] in (2, 4) for v in found)  # D split over warps
    assert any(v["split"] == 2 for v in found) and any(v["split"] == 4 for v in found)
    mma = importlib.import_module("tvm_flash.schedules.cuda_mma")
    assert found[0] == dataclasses.asdict(mma.tile(key))
    smaller = dataclasses.replace(key, target="cuda-sm_89")  # 99 KiB of shared memory
    assert len(schedules.variants("cuda", smaller)) < len(found)
    res = _tune_dry_run("cuda:sm_90", "dkv", "256", "bf16", "none")
    assert f"{len(found)} variants built" in res.stdout


HOPPER = KernelKey("dkv", 128, "bfloat16", "none", 1, "cuda-sm_90a")  # 7 variants


def test_hopper_variants_dry_run():
    """The Hopper kernels are tuned over their variants (tiles); on a machine without the GPU
    every variant's workload is built as the tuner would build it."""
    res = _tune_dry_run("cuda:sm_90a", "dkv", "128", "bf16", "none,top-left", "--jobs", "2")
    built = f"{len(tvm_flash.build.schedules.variants('cuda', HOPPER))} variants built"
    assert built in res.stdout and res.stdout.count("variants built") == 2  # one key each
    assert "[worker 0]" in res.stdout and "[worker 1]" in res.stdout


def test_tuned_and_excluded_kernels_are_left_out_before_sharing():
    """`tune.py` leaves out, before it shares kernels among `--jobs` workers, those whose
    variant log is complete (the committed H200 logs) and those `--exclude` names; with
    nothing left the workers time nothing (no GPU needed)."""
    logged = KernelKey("dkv", 64, "bfloat16", "none", 1, "cuda-sm_90a")
    assert tuning.variants_tuned(ROOT / "tuning_logs", logged, 8) is not None
    assert tuning.variants_tuned(ROOT / "tuning_logs", logged, 10**6) is None  # wants more
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--target",
                          "cuda:sm_90a", "--kernels", "dkv,dq", "--head-dims", "64",
                          "--dtypes", "bf16", "--causal", "none,top-left", "--trials", "8",
                          "--jobs", "2", "--exclude", "dq-*"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("already tuned, kept") == 2 and "dq-" not in res.stdout
    assert "[1/" not in res.stdout and res.stdout.count("done in") == 2


def test_parallel_tuning_refuses_factory_kernels():
    """`tune.py --jobs` serializes the timing of variant kernels; MetaSchedule's own search
    (the factory kernels) times on its own, so it is refused rather than measured in parallel."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--target", "llvm",
                          "--kernels", "fwd", "--head-dims", "64", "--jobs", "2"],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "--jobs tunes variant kernels only" in res.stderr


def test_variant_workload_is_the_deployed_kernel():
    """The tuner times a variant as it is built for use — shapes taken at run time, only the
    softmax scale fixed (the runner passes no scalar) — at the bucket's shape."""
    from tvm import tirx

    from tvm_flash.build import schedules

    variant = schedules.variants("cuda", HOPPER)[0]  # the default
    mod = tuning.variant_workload(HOPPER, variant)
    workload = mod["main"]
    deployed = scheduled_module(HOPPER)["main"]
    scale = deployed.params[-1]
    fixed = deployed.specialize({scale: tirx.const(1.0 / HOPPER.head_dim**0.5, "float32")})
    assert workload.script() == fixed.with_attr("global_symbol", "main").script()
    assert any(isinstance(d, tirx.Var) for d in workload.params[0].shape)
    args = tuning.variant_args(HOPPER, mod)
    shape = tuning.BUCKETS[0]["gpu"]
    assert [int(x) for x in args[0].shape] == [shape["B"], shape["Hq"], shape["L"], 128]


def test_flushed_evaluator_times_each_call_after_a_flush(monkeypatch):
    """``tune.py --flush-l2``'s run evaluator: ``number * repeat`` calls per argument set,
    each timed alone right after the flush (TVM's timer calls its ``f_preproc`` before every
    repeat), as ``scripts/bench.py`` times kernels — here on the CPU, where the flush is a
    host write."""
    import numpy as np
    from tvm.s_tir import meta_schedule as ms
    from tvm.script import tirx as T

    tvm = tuning.tvm

    @T.prim_func
    def add_one(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i in range(256):
            b[i] = a[i] + T.float32(1)

    mod = tvm.tirx.build(tvm.IRModule({"main": add_one}), target="llvm")
    flushes = []
    real = tuning._flusher

    def counted(device, nbytes):
        flush = real(device, nbytes)
        return lambda: (flushes.append(nbytes), flush())

    monkeypatch.setattr(tuning, "_flusher", counted)
    dev = tvm.cpu(0)
    a = tvm.runtime.tensor(np.random.rand(256).astype("float32"), dev)
    b = tvm.runtime.tensor(np.zeros(256, "float32"), dev)
    costs = tuning.flushed_run_evaluator(mod, dev, ms.runner.EvaluatorConfig(number=2, repeat=3),
                                         [[a, b], [a, b]], flush_bytes=1 << 16)
    assert len(costs) == 12 and all(c > 0 for c in costs)
    assert flushes == [1 << 16] * 12
    np.testing.assert_allclose(b.numpy(), a.numpy() + 1)


def test_flush_l2_is_for_variant_kernels():
    """``tune.py --flush-l2`` refuses a kernel MetaSchedule's own search tunes (its timing is
    not the variant tuner's), naming it."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), "--target", "llvm",
                          "--kernels", "fwd", "--head-dims", "64", "--dtypes", "fp32",
                          "--causal", "none", "--flush-l2"], capture_output=True, text=True)
    assert res.returncode == 2 and "--flush-l2" in res.stderr and "fwd-d64" in res.stderr


def test_variant_tuning_loop(tmp_path, monkeypatch):
    """The variant tuner's loop — first batch the default and a seeded draw, then the variants
    the xgboost model ranks fastest, records in MetaSchedule's database, resume, summary, and
    build.py's use of the log — with MetaSchedule's builder and runner replaced by stand-ins
    (a CPU cannot run these kernels): each variant "takes" a time set by its step and stages,
    so the loop must find the fastest. Nothing here is a measurement; no log is kept."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_flash.build import schedules

    found = schedules.variants("cuda", HOPPER)
    time_of = {i: 1e-3 * (1 + abs(v["step"] - 96) / 96 + 0.1 * (v["stages"] == 3))
               for i, v in enumerate(found)}
    fastest = min(time_of, key=time_of.get)

    class Builder:
        def __init__(self, **_):
            pass

        def build(self, inputs):
            return [ms.builder.BuilderResult(str(found.index(_variant_of(i.mod))), None)
                    for i in inputs]

    class Future:
        def __init__(self, secs):
            self.secs = secs

        def result(self):
            return ms.runner.RunnerResult([tvm_flash.tuning.tvm.runtime.convert(self.secs)],
                                          None)

    timed = []
    fluke = set()  # variants whose first timing comes out 10x too fast

    class Runner:
        def __init__(self, **_):
            pass

        def run(self, inputs):
            futures = []
            for i in (int(x.artifact_path) for x in inputs):
                first = i not in timed
                timed.append(i)
                futures.append(Future(time_of[i] / (10 if first and i in fluke else 1)))
            return futures

    workloads = {}

    def _variant_of(mod):
        return workloads[tvm_flash.tuning.tvm_ffi.structural_hash(mod)]

    for v in found:
        workloads[tvm_flash.tuning.tvm_ffi.structural_hash(
            tuning.variant_workload(HOPPER, v))] = v
    monkeypatch.setattr(ms.builder, "LocalBuilder", Builder)
    monkeypatch.setattr(ms.runner, "LocalRunner", Runner)
    # one batch (timing under the lock `tune.py --jobs` shares), then resumed to the end
    first = tuning.tune_variants(HOPPER, tmp_path, trials=3, batch=3, confirm=0,
                                 measure_lock=tmp_path / "device.lock")
    assert first["measured"] == 3 and len(timed) == 3 and timed[0] == 0  # the default first
    summary = tuning.tune_variants(HOPPER, tmp_path, trials=len(found), batch=3)
    assert summary["measured"] == len(found) and summary["variants"] == len(found)
    # each variant timed once, then the winner and the default again, alternating
    assert sorted(timed[:len(found)]) == list(range(len(found)))
    assert fastest != 0 and timed[len(found):] == [fastest, 0] * 3
    assert summary["confirmed"]["rounds"] == 3
    assert summary["confirmed"]["variant_us"] < summary["confirmed"]["default_us"]
    assert summary["best"]["variant"] == found[fastest]
    directory = tuning.log_dir(tmp_path, HOPPER)
    records = (directory / "database_tuning_record.json").read_text().splitlines()
    assert records and len(records) <= 2 * len(found)
    # a complete log is kept as it is: nothing built or timed again
    again = tuning.tune_variants(HOPPER, tmp_path, trials=len(found), batch=3)
    assert again["best"] == summary["best"] and len(timed) == len(found) + 6
    tuned = tuning.load_tuned(tmp_path, HOPPER)
    assert tuned["variant"] == found[fastest]
    chosen = schedules.lowered("cuda", HOPPER, found[fastest])
    assert tvm_flash.tuning.tvm_ffi.structural_equal(scheduled_module(HOPPER, tuned)["main"],
                                                     chosen)
    assert tvm_flash.build.fingerprint(HOPPER, tuned) != tvm_flash.build.fingerprint(HOPPER)
    # a variant that was fast once (a fluke) does not survive its confirmation
    slow = max(time_of, key=time_of.get)
    fluke.add(slow)
    timed.clear()
    fresh = tuning.tune_variants(HOPPER, tmp_path / "again", trials=len(found), batch=3)
    assert fresh["best"]["variant"] == found[0] and timed[len(found):] == [slow, 0] * 3
    assert fresh["confirmed"]["variant_us"] > fresh["confirmed"]["default_us"]
    assert "timed again 3 times each" in tuning.load_tuned(tmp_path / "again", HOPPER)["why"]
