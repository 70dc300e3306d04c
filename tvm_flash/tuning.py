"""MetaSchedule tuning of kernel keys, and the tuning logs that carry results between machines.

The explicit schedules are the search space. Each schedule exposes ``tiles(key)`` (the tiles
that fit the target), ``space`` (the decisions tuning may change; first = hand-chosen) and
takes ``decisions``. Structural choices (the tile, the GEMM thread grid ``tc``) are enumerated
as separate design spaces; ``unroll`` is sampled (``sample_categorical``) inside each and varied
by MetaSchedule's unroll mutator. The xgboost cost model and the evolutionary search choose what
to measure; postprocessors (``VerifyGPUCode`` on GPUs) drop candidates that exceed the
target's shared memory or threads before they are measured.

A log lives in ``tuning_logs/<target-tag>/<kernel-key>/``: MetaSchedule's
``database_tuning_record.json`` (pruned to the best few records per workload),
``workloads.json`` (which tile each record's workload is, and its structural hash: the
workload IR itself, ~300 KB per tile, is regenerated from the key when a run resumes) and
``summary.json`` (the best choice, its time, trials, date, device, versions).
``scripts/build.py`` uses ``summary.json`` after checking the whole log (:func:`load_tuned`).

Kernels a target's schedule writes out itself (``schedules.lowers``) have no factory to search
around. Where the schedule offers *variants* of one (``schedules.variants``: the Hopper kernels'
tiles — step, stages, persistence — and the ``mma.sync`` kernels' — warps, m-tiles, step,
stages), each variant is a MetaSchedule workload whose design space
is the kernel as written (:func:`tune_variants`): MetaSchedule's builder compiles them, its
runner times them, every measurement is a record in its database, and its xgboost cost model,
trained on the variants measured so far (MetaSchedule's per-store features of their IR), picks
which to measure next; the summary says how well its ranking predicted the measured order.
Hand-lowered kernels without variants (the backward's row-wise preprocess, keys with score
modifiers or packed sequences) are refused, and so is a log for one.

Lengths: kernels take every length symbolically; tuning measures one representative shape per
length bucket (:data:`BUCKETS`). A key's ``lengths`` names its bucket: 0, every length (GPU:
B = 2, 16 query heads, Lq = Lk = 4096; CPU: B = 1, 4 heads, 256), or one of
``tvm_flash.key.LENGTH_BUCKETS`` (1024: GPU B = 16, 16 heads, 1024;
CPU B = 1, 4 heads, 64), whose tuned variant the runtime takes for calls whose longest
sequence is that short (``tvm_flash.plan``). A bucket without a log has no build of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import statistics
import tempfile

import tvm
import tvm_ffi
from tvm import tirx

from .build import pass_config, schedules
from .kernels import FACTORIES, TileConfig
from .key import KernelKey
from .target import make_target, target_kind

BUCKETS = {0: {"gpu": {"B": 2, "Hq": 16, "L": 4096}, "cpu": {"B": 1, "Hq": 4, "L": 256}},
           1024: {"gpu": {"B": 16, "Hq": 16, "L": 1024}, "cpu": {"B": 1, "Hq": 4, "L": 64}}}
"""Each length bucket's representative shape (``KernelKey.lengths`` -> device kind -> shape)."""

DECISIONS_ANNOTATION = "tvm_flash.decisions"
SUMMARY = "summary.json"
RECORDS = "database_tuning_record.json"
WORKLOAD_INDEX = "workloads.json"
"""The log keeps its workloads as ``[{"tile": [bq, bk], "shash": ...}]`` in database order,
not as IR: a workload is a function of the key, tile and bucket shape, ~300 KB of JSON each,
and is regenerated (and checked against its structural hash) when a tuning run resumes."""


class TuningLogError(RuntimeError):
    """A tuning log is corrupt, for another key or target, or from other TVM versions."""


def log_dir(root: str | os.PathLike, key: KernelKey) -> pathlib.Path:
    return pathlib.Path(root) / key.target / key.name


CUDA_LIMITS = {"max_num_threads": 1024, "max_threads_per_block": 1024, "thread_warp_size": 32,
               "registers_per_block": 65536, "max_shared_memory_per_block": 100 * 1024}


def tuning_target(tag: str) -> tvm.target.Target:
    """The target to measure on: the build target, with the core count MetaSchedule wants."""
    if tag == "llvm":
        return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
    if target_kind(tag) == "cuda":
        # the limits MetaSchedule's VerifyGPUCode checks candidates against (a cuda target
        # made from kind + arch has none); shared memory: the budget our schedules size for
        return tvm.target.Target({**make_target(tag).export(), **CUDA_LIMITS})
    return make_target(tag)


def workload(key: KernelKey, tile: TileConfig, shape: dict | None = None) -> tvm.IRModule:
    """The kernel with batch, heads, lengths and scale fixed to a representative instance
    (MetaSchedule measures concrete shapes and takes no scalar arguments)."""
    return _specialized(FACTORIES[key.op](key, tile), key, shape)


def variant_workload(key: KernelKey, variant: dict) -> tvm.IRModule:
    """A hand-lowered kernel's variant (``schedules.variants``) as it is deployed: batch,
    heads and lengths taken at run time (the timing's shape is in :func:`variant_args`), only
    the softmax scale fixed (MetaSchedule's runner passes no scalar). Timing the kernel with
    its shapes folded in instead (:func:`workload`'s way) chose variants that ran slower as
    built (docs/journal/2026-12-01-tuning.md, eighth session): a persistent grid's loop
    bounds, among others, become constants there."""
    func = schedules.lowered(target_kind(key.target), key, variant)
    scale = [p for p in func.params if not hasattr(p, "shape")]
    func = func.specialize({p: tirx.const(1.0 / key.head_dim**0.5, "float32") for p in scale})
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def variant_args(key: KernelKey, mod: tvm.IRModule, shape: dict | None = None) -> list:
    """The arguments the runner allocates for a :func:`variant_workload`: its buffers at the
    length bucket's representative shape (``shape`` overrides it)."""
    from tvm.s_tir import meta_schedule as ms

    dims = _dims(key, shape)
    return [ms.arg_info.TensorInfo(str(p.dtype), [dims[d.name] if isinstance(d, tirx.Var)
                                                 else int(d) for d in p.shape])
            for p in mod["main"].params]


def _dims(key: KernelKey, shape: dict | None) -> dict:
    """Batch, heads and lengths of ``key``'s bucket's representative shape, by the names the
    kernels give them."""
    shape = shape or BUCKETS[key.lengths]["cpu" if key.target == "llvm" else "gpu"]
    hq = shape["Hq"]
    return {"B": shape["B"], "Hq": hq, "H": hq, "Hkv": max(1, hq // key.group),
            "Lq": shape["L"], "Lk": shape["L"], "L": shape["L"]}


def _specialized(func, key: KernelKey, shape: dict | None) -> tvm.IRModule:
    dims = _dims(key, shape)
    fixed = {}
    for param in func.params:
        try:
            param_shape = param.shape
        except AttributeError:  # the scalar softmax scale
            fixed[param] = tirx.const(1.0 / key.head_dim**0.5, "float32")
            continue
        # constant dims must stay the same objects for specialize()
        new_shape = [tirx.const(dims[d.name], "int64") if isinstance(d, tirx.Var) else d
                     for d in param_shape]
        fixed[param] = tirx.decl_buffer(new_shape, param.dtype, name=param.name,
                                        elem_offset=param.elem_offset, strides=param.strides,
                                        data_alignment=param.data_alignment,
                                        offset_factor=param.offset_factor)
    return tvm.IRModule({"main": func.specialize(fixed).with_attr("global_symbol", "main")})


def design_spaces(key: KernelKey, tile: TileConfig):
    """``fn(sch) -> [Schedule]``: one design space per thread grid, unroll sampled in each."""
    sched = schedules.for_target(target_kind(key.target))
    thread_grids = sched.space.get("tc", (None,))

    def spaces(sch):
        out = []
        for tc in thread_grids:
            # an independent copy of the IR, not sch.copy(): with the GEMMs' scope blocks some
            # TVM 0.27 primitives edit blocks in place, which would leak into the next space
            candidate = tvm.s_tir.Schedule(tvm.ir.load_json(tvm.ir.save_json(sch.mod)))
            fixed = {} if tc is None else {"tc": tc}
            try:
                sched.schedule(candidate, key, tile, {**fixed, "unroll": "sample"})
            except (ValueError, tvm.s_tir.schedule.ScheduleError):
                continue  # this thread grid does not divide this tile
            fixed["tile"] = [tile.block_q, tile.block_k]
            candidate.annotate(candidate.get_sblock("tile"), DECISIONS_ANNOTATION,
                               json.dumps(fixed, sort_keys=True))
            out.append(candidate)
        return out

    return spaces


def space_size(key: KernelKey) -> int:
    """Distinct candidates of one tile's design spaces (thread grids x sampled unroll)."""
    space = schedules.for_target(target_kind(key.target)).space
    return len(space.get("tc", (None,))) * len(space.get("unroll", (0,)))


def _space_generator(key: KernelKey, tile: TileConfig):
    from tvm.s_tir import meta_schedule as ms

    # Left out on purpose: RewriteReductionBlock (the accumulating GEMMs keep their init in the
    # reduction loop, as their accumulator has another writer) and DisallowDynamicLoop (causal
    # kernels skip key tiles, so their key loop's extent depends on the tile).
    postprocs = [ms.postproc.RewriteParallelVectorizeUnroll()]
    if target_kind(key.target) != "llvm":
        postprocs.append(ms.postproc.VerifyGPUCode())
    return ms.space_generator.ScheduleFn(design_spaces(key, tile), sch_rules=[],
                                         postprocs=postprocs,
                                         mutator_probs={ms.mutator.MutateUnroll(): 1.0})


def decisions_of(trace) -> dict:
    """``{"tile": [bq, bk], "decisions": {...}}`` chosen by a tuning record's trace."""
    fixed, unroll = None, 0
    for inst in trace.insts:
        kind = inst.kind.name
        if kind == "Annotate" and str(inst.attrs[0]) == DECISIONS_ANNOTATION:
            fixed = json.loads(str(inst.inputs[1]))
        elif kind == "SampleCategorical":
            unroll = int(inst.attrs[0][int(trace.decisions[inst])])
    if fixed is None:
        raise TuningLogError("a tuning record's trace carries no tvm-flash decisions")
    tile = fixed.pop("tile")
    return {"tile": [int(x) for x in tile], "decisions": {**fixed, "unroll": unroll}}


def _mean_secs(run_secs) -> float:
    secs = [float(s) for s in (run_secs or [])]
    return sum(secs) / len(secs) if secs and max(secs) < 1e9 else float("inf")


def tune(key: KernelKey, root: str | os.PathLike, trials: int, *, max_tiles: int = 2,
         keep_top: int = 2, shape: dict | None = None, seed: int = 0, log=print) -> dict:
    """Tune ``key`` on this machine with MetaSchedule (xgboost cost model, evolutionary
    search), resuming from the log already under ``root``; write the log and return its
    summary."""
    from tvm.s_tir import meta_schedule as ms

    _refuse_lowered(key)
    sched = schedules.for_target(target_kind(key.target))
    directory = log_dir(root, key)
    directory.mkdir(parents=True, exist_ok=True)
    tiles = sched.tiles(key)[:max_tiles]
    # never ask for more trials than a tile's space holds: MetaSchedule's search would then
    # keep drawing no new candidate, forever
    per_tile = max(1, min(trials // len(tiles), space_size(key)))
    with _work_database(directory,
                        lambda: _regenerate_workloads(directory, key, shape)) as (database, tmp):
        for tile in tiles:
            log(f"{key.name}: tile {tile.block_q}x{tile.block_k}, {per_tile} trials")
            _drop_unnamed_log_handlers()
            ms.tune_tir(workload(key, tile, shape), tuning_target(key.target), str(tmp / "work"),
                        per_tile, num_trials_per_iter=min(64, per_tile),
                        space=_space_generator(key, tile), database=database,
                        builder=ms.builder.LocalBuilder(f_build=build_candidate),
                        cost_model="xgb", seed=seed)
        records = database.get_all_tuning_records()
        best = min(records, key=lambda r: _mean_secs(r.run_secs), default=None)
        if best is None or _mean_secs(best.run_secs) == float("inf"):
            raise TuningLogError(f"{key.name}: no candidate was measured successfully")
        _keep_log(directory, tmp, keep_top,
                  _workload_index(tmp / WORKLOAD_FILE, key, shape))
    summary = {"key": key.name, "target": key.target, "bucket": key.lengths,
               "best": {**decisions_of(best.trace), "run_us": _mean_secs(best.run_secs) * 1e6},
               "measured": len(records), "date": datetime.date.today().isoformat(),
               "device": _device_name(key.target),
               "versions": {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}}
    (directory / SUMMARY).write_text(json.dumps(summary, indent=1, sort_keys=True))
    log(f"{key.name}: best {summary['best']} of {len(records)} measured candidates")
    return summary


WORKLOAD_FILE = "database_workload.json"
"""A tuning run's scratch workload file (the log keeps an index instead, ``WORKLOAD_INDEX``)."""


@contextlib.contextmanager
def _work_database(directory: pathlib.Path, regenerate):
    """``(database, tmp)``: a scratch MetaSchedule JSON database in ``tmp`` for one tuning
    run, holding the log's records under ``directory`` when it resumes one (its workloads
    made again by ``regenerate()``)."""
    from tvm.s_tir import meta_schedule as ms

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if (directory / RECORDS).exists():  # resume
            (tmp / WORKLOAD_FILE).write_text(regenerate())
            shutil.copy(directory / RECORDS, tmp / RECORDS)
        yield ms.database.JSONDatabase(str(tmp / WORKLOAD_FILE), str(tmp / RECORDS)), tmp


def _keep_log(directory: pathlib.Path, tmp: pathlib.Path, keep_top: int, index: list) -> None:
    """Write a tuning run's records back to its log (the fastest ``keep_top`` per workload)
    with the index of their workloads."""
    _prune(tmp / RECORDS, keep_top)
    shutil.copy(tmp / RECORDS, directory / RECORDS)
    (directory / WORKLOAD_INDEX).write_text(json.dumps(index, indent=1) + "\n")


def _refuse_lowered(key: KernelKey, variants_ok: bool = False) -> None:
    """Refuse a hand-lowered key: every one for the factory path, those without variants
    (``schedules.variants``) for the variant path too."""
    kind = target_kind(key.target)
    if not schedules.lowers(kind, key):
        return
    if schedules.variants(kind, key):
        if variants_ok:
            return
        raise TuningLogError(f"{key.name}: written out at warp level by the {key.target} "
                             "schedule: its variants are tuned (tune_variants), not a factory's "
                             "design space")
    raise TuningLogError(f"{key.name}: written out at warp level by the {key.target} schedule "
                         "(schedules/cuda_mma.py, cuda_hopper.py) and offering no variants: "
                         "there is no search space to tune")


def _workload_index(path: pathlib.Path, key: KernelKey, shape: dict | None) -> list[dict]:
    """Which tile each workload of a database file is, by structural hash."""
    from tvm.s_tir import meta_schedule as ms

    sched = schedules.for_target(target_kind(key.target))
    by_hash = {ms.database.Workload(workload(key, tile, shape)).as_json()[0]: tile
               for tile in sched.tiles(key)}
    index = []
    for line in path.read_text().splitlines():
        shash = json.loads(line)[0]
        tile = by_hash[shash]
        index.append({"tile": [tile.block_q, tile.block_k], "shash": shash})
    return index


def _regenerate_workloads(directory: pathlib.Path, key: KernelKey, shape: dict | None) -> str:
    """The database workload file of a log, rebuilt from its index; refuses a log whose
    workloads the current kernel source no longer produces."""
    return _regenerate(directory, "tile",
                       lambda tile: workload(key, TileConfig(*tile), shape))


def _regenerate(directory: pathlib.Path, field: str, make) -> str:
    """A log's database workload file from its index (``[{field: ..., "shash": ...}]``),
    each workload made again by ``make(entry[field])`` and checked against its hash."""
    from tvm.s_tir import meta_schedule as ms

    try:
        index = json.loads((directory / WORKLOAD_INDEX).read_text())
        entries = [(entry[field], entry["shash"]) for entry in index]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TuningLogError(f"{directory}: corrupt workload index ({err!r})") from err
    lines = []
    for value, shash in entries:
        entry = ms.database.Workload(make(value)).as_json()
        if entry[0] != shash:
            raise TuningLogError(f"{directory}: the kernel source (or the bucket shape) no "
                                 f"longer produces the workload tuned for {field} {value}; "
                                 "retune into a fresh log")
        lines.append(json.dumps(list(entry)))
    return "".join(line + "\n" for line in lines)


def _drop_unnamed_log_handlers() -> None:
    """MetaSchedule rebuilds its loggers with ``logging.config.dictConfig``, naming every
    handler already on its logger; a handler someone attached without a name (seen after
    torch.compile ran in the same process) makes that fail. Such handlers are dropped."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(ms_logger.handlers):
        if handler.get_name() is None:
            ms_logger.removeHandler(handler)


def _device_name(tag: str) -> str:
    if target_kind(tag) == "cuda":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return platform.processor() or platform.machine()


def _prune(path: pathlib.Path, keep_top: int) -> None:
    """Keep the ``keep_top`` fastest records of each workload."""
    by_workload: dict[int, list] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            workload_idx, record = json.loads(line)
            by_workload.setdefault(workload_idx, []).append([workload_idx, record])
    kept = [item for items in by_workload.values()
            for item in sorted(items, key=lambda it: _mean_secs(it[1][1]))[:keep_top]]
    path.write_text("".join(json.dumps(item) + "\n" for item in kept))


def load_tuned(root: str | os.PathLike, key: KernelKey) -> dict | None:
    """The tuned choice for ``key`` from its log; ``None`` if there is no log for it.

    Refuses (:class:`TuningLogError`) a log that is corrupt, names another key or target, holds
    a record measured for another target kind or arch, was made by another TVM version, or
    picks a tile this target cannot hold (or a variant its kernel does not have). Returns
    ``{"tile", "decisions", "digest", "why"}``, for a hand-lowered kernel ``{"variant",
    "digest", "why"}``; ``why`` says in words what the choice beat, from the summary.
    """
    directory = log_dir(root, key)
    summary_path = directory / SUMMARY
    if not summary_path.exists():
        return None
    kind = target_kind(key.target)
    lowered = schedules.lowers(kind, key)
    _refuse_lowered(key, variants_ok=True)
    try:
        summary = json.loads(summary_path.read_text())
        best = summary["best"]
        if lowered:
            tuned = {"variant": schedules.variant(
                kind, key, {str(k): v for k, v in best["variant"].items()})}
        else:
            tuned = {"tile": [int(x) for x in best["tile"]],
                     "decisions": {str(k): int(v) for k, v in best["decisions"].items()}}
        records_text = (directory / RECORDS).read_text()
        targets = [json.loads(line)[1][2] for line in records_text.splitlines() if line.strip()]
        kinds = [(t["kind"], t.get("arch")) for t in targets]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise TuningLogError(f"{directory}: corrupt tuning log ({err!r})") from err
    if summary.get("key") != key.name or summary.get("target") != key.target:
        raise TuningLogError(f"{directory}: the log is for {summary.get('key')} on "
                             f"{summary.get('target')}, not {key.name}")
    if summary.get("versions", {}).get("tvm") != tvm.__version__:
        raise TuningLogError(f"{directory}: tuned with TVM {summary.get('versions')}, this "
                             f"install has {tvm.__version__}; retune")
    want = make_target(key.target)
    want_arch = want.attrs.get("arch")
    for kind, arch in kinds:
        if kind != want.kind.name or (want_arch is not None and arch != str(want_arch)):
            raise TuningLogError(f"{directory}: holds a record tuned for {kind} "
                                 f"{arch or ''}, not {key.target}")
    if lowered:
        if tuned["variant"] not in schedules.variants(kind, key):
            raise TuningLogError(f"{directory}: variant {tuned['variant']} is not one of "
                                 f"{key.name}'s on {key.target}")
    elif TileConfig(*tuned["tile"]) not in schedules.for_target(kind).tiles(key):
        raise TuningLogError(f"{directory}: tile {tuned['tile']} does not fit {key.target}")
    digest = hashlib.sha256(summary_path.read_bytes() + records_text.encode()).hexdigest()
    return {**tuned, "digest": digest[:16], "why": _why(summary)}


def _why(summary: dict) -> str:
    """Why a log's choice was made, in words (``scripts/build.py`` prints it)."""
    best, default = summary["best"].get("run_us"), summary.get("default_us")
    measured = summary.get("measured", "?")
    of = (f"{measured} of {summary['variants']} variants" if "variants" in summary
          else f"{measured} candidates")
    timing = f"{best:.0f} us" if best is not None else "time not recorded"
    if best is not None and default not in (None, float("inf")):
        timing += f" vs the default's {default:.0f} us"
    confirmed = summary.get("confirmed")
    if confirmed:
        timing += (f"; timed again {confirmed['rounds']} times each, alternating: "
                   f"{confirmed['variant_us']:.0f} vs {confirmed['default_us']:.0f} us")
    return (f"fastest of {of} measured on {summary.get('device', '?')} "
            f"({summary.get('date', '?')}, {_bucket_words(summary.get('bucket', 0))}): "
            f"{timing}")


def _bucket_words(bucket) -> str:
    """A summary's length bucket in words (logs before buckets say ``any``)."""
    return f"calls up to {bucket} long" if bucket not in (0, "any") else "every length"


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """MetaSchedule's build function (its ``default_build``), lowering with the same options
    as every other build of the kernels (:func:`tvm_flash.build.pass_config`)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with tvm.transform.PassContext(config=pass_config(target.kind.name)):
        return tvm.tirx.build(mod, target=target)


def build_lowered(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """MetaSchedule's build function for a hand-lowered variant of a kernel written in TIRx's
    device-region form (the Hopper kernels: ``schedules.pipeline`` says ``tirx``), with the
    kernels' lowering options."""
    with tvm.transform.PassContext(config=pass_config(target.kind.name)):
        return tvm.tirx.build(mod, target=target, pipeline="tirx")


def build_lowered_default(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """:func:`build_lowered` for the other hand-lowered kernels (``mma.sync``): TVM's default
    pipeline."""
    with tvm.transform.PassContext(config=pass_config(target.kind.name)):
        return tvm.tirx.build(mod, target=target)


def _build_function(key: KernelKey):
    """The build function of ``key``'s variants (MetaSchedule's builder pickles it by name:
    module level, one per pipeline)."""
    tirx = schedules.pipeline(target_kind(key.target), key) == "tirx"
    return build_lowered if tirx else build_lowered_default


def _spearman(xs: list, ys: list) -> float | None:
    """Rank correlation of two equally long lists (None below three pairs)."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


L2_FLUSH_BYTES = 256 << 20
"""Bytes :func:`flushed_run_evaluator` writes before each timed call — as
``triton.testing.do_bench`` (``scripts/bench.py``, ``scripts/sweep_hopper.py``) clears the L2
before each of its calls."""

_FLUSH = "tvm_flash.tuning.flush"  # the flush, a global function in the timing process


def flushed_run_evaluator(rt_mod, device, evaluator_config, repeated_args,
                          flush_bytes: int = L2_FLUSH_BYTES) -> list[float]:
    """MetaSchedule's run evaluator (``LocalRunner(f_run_evaluator=...)``), but every call
    timed alone after ``flush_bytes`` of memory were written (``number * repeat`` calls an
    argument set): the kernel measured from memory, as the benchmarks measure it, not from
    the L2 its previous call left warm. MetaSchedule's own evaluator times ``number`` calls
    back to back (the tuner's dQ D 128 choices, 2-5% faster so, ran the backward 7-8% slower
    in ``scripts/bench.py``: docs/journal/2026-12-01-tuning.md). TVM's timer runs the
    function once before its repeats; the flush, its ``f_preproc``, runs before each."""
    flush = _flusher(device, flush_bytes)

    def preproc(*_):  # TVM's timer passes the arguments; it takes no result back
        flush()

    tvm_ffi.register_global_func(_FLUSH, preproc, override=True)
    calls = evaluator_config.number * evaluator_config.repeat
    evaluator = rt_mod.time_evaluator(rt_mod.entry_name, device, number=1, repeat=calls,
                                      min_repeat_ms=0, f_preproc=_FLUSH)
    costs = []
    for args in repeated_args:
        device.sync()
        costs.extend(float(x) for x in evaluator(*args).results)
    return costs


def _flusher(device, nbytes: int):
    """A function that writes ``nbytes`` on ``device`` and waits for it: through torch on a
    CUDA device (its kernels run on the stream TVM's timer then uses, after the wait), with
    numpy on the CPU."""
    if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        import numpy as np

        host = np.empty(nbytes // 4, dtype=np.int32)
        return lambda: host.fill(0)
    import torch

    cache = torch.empty(nbytes // 4, dtype=torch.int32, device=f"cuda:{device.index}")

    def flush():
        cache.zero_()
        torch.cuda.synchronize(cache.device)
    return flush


def tune_variants(key: KernelKey, root: str | os.PathLike, trials: int, *, keep_top: int = 2,
                  shape: dict | None = None, seed: int = 0, batch: int = 4,
                  measure_lock: str | os.PathLike | None = None,
                  build_workers: int | None = None, confirm: int = 3,
                  flush_l2: bool = False, log=print) -> dict:
    """Tune a hand-lowered kernel over its variants (``schedules.variants``) on this machine,
    resuming from its log under ``root``; write the log and return its summary.

    Each variant is a workload (:func:`variant_workload`); MetaSchedule's ``LocalBuilder``
    compiles a batch of them, its ``LocalRunner`` times them, each result is a record in its
    JSON database. The first batch is the default and ``batch - 1`` variants drawn with
    ``seed``; after each batch the xgboost cost model (``XGBModel`` over ``PerStoreFeature``)
    is trained on every measurement so far and the next batch is the unmeasured variants it
    ranks fastest. ``summary["ranking"]``: the Spearman correlation between the model's scores
    for the variants it chose (scored before they ran) and their measured speed.

    ``confirm``: when the search's fastest variant is not the default, the two are timed
    again ``confirm`` times each, alternating, and the default stays unless the variant's
    median is faster (``summary["confirmed"]``); 0 skips this. ``flush_l2``: each call timed
    alone from a cleared L2 (:func:`flushed_run_evaluator`), as the benchmarks time them.

    A log that already holds ``trials`` measurements (or every variant) is returned as it is.
    ``measure_lock``: a file that several tuning processes lock while they time candidates
    (``scripts/tune.py --jobs``): they build in parallel, and only one measures on the device
    at a time. ``build_workers``: the builder's processes (default: one per CPU).
    """
    import random

    from tvm.s_tir import meta_schedule as ms

    _refuse_lowered(key, variants_ok=True)
    kind = target_kind(key.target)
    found = schedules.variants(kind, key)
    target = tuning_target(key.target)
    directory = log_dir(root, key)
    done = variants_tuned(root, key, trials)
    if done is not None:
        log(f"{key.name}: already tuned ({done['measured']} measured), kept")
        return done
    directory.mkdir(parents=True, exist_ok=True)
    mods = [variant_workload(key, v) for v in found]
    shashes = [ms.database.Workload(m).as_json()[0] for m in mods]
    with _work_database(directory,
                        lambda: _regenerate_variants(directory, key)) as (database, tmp):
        secs = {}  # variant index -> mean seconds
        for rec in database.get_all_tuning_records():
            shash = ms.database.Workload(rec.workload.mod).as_json()[0]
            if shash in shashes:
                secs[shashes.index(shash)] = _mean_secs(rec.run_secs)
        context = ms.TuneContext(mod=mods[0], target=target, space_generator="post-order-apply",
                                 search_strategy="evolutionary", task_name=key.name)
        model = ms.cost_model.XGBModel(
            extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=False,
            num_warmup_samples=0, config=ms.cost_model.xgb_model.XGBConfig(seed=seed),
            verbose_eval=0)
        args = [variant_args(key, m, shape) for m in mods]

        def candidate(i):
            return ms.MeasureCandidate(tvm.s_tir.Schedule(mods[i]), args[i])

        def train():
            done = sorted(secs)
            results = [ms.runner.RunnerResult([tvm.runtime.convert(secs[i])], None)
                       if secs[i] != float("inf") else ms.runner.RunnerResult(None, "failed")
                       for i in done]
            model.update(context, [candidate(i) for i in done], results)

        rng = random.Random(seed)
        builder = ms.builder.LocalBuilder(f_build=_build_function(key),
                                          max_workers=build_workers)
        # three timings of ~100 ms each per candidate (MetaSchedule's default is one)
        runner = ms.runner.LocalRunner(
            evaluator_config=ms.runner.EvaluatorConfig(
                number=3, repeat=3, min_repeat_ms=0 if flush_l2 else 100),
            **({"f_run_evaluator": flushed_run_evaluator} if flush_l2 else {}))

        def measure(order: list[int]) -> dict[int, list[float]]:
            """Build and time the variants ``order`` names (in that order; one may repeat),
            commit each timing to the database; their timings (inf: failed)."""
            built = builder.build([ms.builder.BuilderInput(mods[i], target) for i in order])
            inputs, ok, times = [], [], {}
            for i, b in zip(order, built, strict=True):
                if b.error_msg:
                    log(f"{key.name}: build failed for {found[i]}: {b.error_msg[-300:]}")
                    times.setdefault(i, []).append(float("inf"))
                    continue
                inputs.append(ms.runner.RunnerInput(b.artifact_path, kind, args[i]))
                ok.append(i)
            with _exclusive(measure_lock):  # one process times on the device at a time
                results = [fut.result() for fut in runner.run(inputs)]
            for i, res in zip(ok, results, strict=True):
                run = [float(x) for x in (res.run_secs or [])]
                if res.error_msg or not run:
                    log(f"{key.name}: run failed for {found[i]}: {(res.error_msg or '')[-300:]}")
                    times.setdefault(i, []).append(float("inf"))
                    continue
                times.setdefault(i, []).append(_mean_secs(run))
                workload_ = database.commit_workload(mods[i])
                database.commit_tuning_record(ms.database.TuningRecord(
                    tvm.s_tir.Schedule(mods[i]).trace, workload_,
                    [tvm.runtime.convert(x) for x in run], target, args[i]))
            return times

        predicted = {}  # variant index -> the model's score when it chose it
        budget = min(trials, len(found))
        while len(secs) < budget:
            todo = [i for i in range(len(found)) if i not in secs]
            take = min(batch, budget - len(secs))
            if not secs:  # the default first, then a seeded draw
                chosen = ([0] if 0 in todo else []) + rng.sample(
                    [i for i in todo if i != 0], max(0, take - (0 in todo)))
            else:
                train()
                scores = model.predict(context, [candidate(i) for i in todo])
                ranked = sorted(zip(scores, todo, strict=True), key=lambda p: -p[0])[:take]
                chosen = [i for _, i in ranked]
                predicted.update({i: float(sc) for sc, i in ranked})
            log(f"{key.name}: measuring {[found[i] for i in chosen]}")
            secs.update({i: t[0] for i, t in measure(chosen).items()})
        measured = {i: t for i, t in secs.items() if t != float("inf")}
        if not measured:
            raise TuningLogError(f"{key.name}: no variant was measured successfully")
        best = min(measured, key=measured.get)
        confirmed = None
        if confirm and best != 0 and 0 in measured:
            # The search timed each variant once, the default first in its batch; on the H200
            # choices made so did not hold up in scripts/bench.py (docs/journal/2026-12-01-
            # tuning.md). Before the log names another variant than the default, the two are
            # timed again, alternating, and the faster median wins.
            again = measure([best, 0] * confirm)
            median = {i: statistics.median(again.get(i, [float("inf")])) for i in (best, 0)}
            confirmed = {"rounds": confirm, "variant_us": median[best] * 1e6,
                         "default_us": median[0] * 1e6}
            log(f"{key.name}: confirming {found[best]}: {median[best] * 1e6:.0f} us vs the "
                f"default's {median[0] * 1e6:.0f} us over {confirm} alternating rounds")
            if median[0] <= median[best]:
                best = 0
        scored = [i for i in predicted if i in measured]
        ranking = _spearman([predicted[i] for i in scored], [1 / measured[i] for i in scored])
        lines = (tmp / WORKLOAD_FILE).read_text().splitlines()
        _keep_log(directory, tmp, keep_top,
                  [{"variant": found[shashes.index(json.loads(line)[0])],
                    "shash": json.loads(line)[0]} for line in lines if line.strip()])
    summary = {"key": key.name, "target": key.target, "bucket": key.lengths,
               "best": {"variant": found[best], "run_us": measured[best] * 1e6},
               "default_us": measured.get(0, float("inf")) * 1e6, "measured": len(measured),
               "variants": len(found),
               "ranking": {"spearman": ranking, "scored": len(scored)},
               "confirmed": confirmed,
               "timed": "the kernel as built, shapes at run time (variant_workload)"
                        + ("; each call alone, the L2 cleared before it" if flush_l2 else ""),
               "date": datetime.date.today().isoformat(), "device": _device_name(key.target),
               "versions": {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__}}
    (directory / SUMMARY).write_text(json.dumps(summary, indent=1, sort_keys=True))
    log(f"{key.name}: best {found[best]} ({measured[best] * 1e6:.0f} us; default "
        f"{summary['default_us']:.0f}) of {len(measured)} measured; xgboost ranking "
        f"{ranking}")
    return summary


def variants_tuned(root: str | os.PathLike, key: KernelKey, trials: int) -> dict | None:
    """The summary of ``key``'s variant log under ``root`` if it is complete for ``trials``
    measurements (or every variant), else None: what :func:`tune_variants` would keep as it
    is. ``scripts/tune.py`` leaves such keys out before it shares the rest among workers."""
    found = schedules.variants(target_kind(key.target), key)
    return _finished(log_dir(root, key), key, min(trials, len(found)))


def _finished(directory: pathlib.Path, key: KernelKey, wanted: int) -> dict | None:
    """The summary of a complete variant log for ``key`` (``wanted`` measurements), else
    None."""
    try:
        summary = json.loads((directory / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    if summary.get("key") != key.name or summary.get("measured", 0) < wanted \
            or not (directory / RECORDS).exists():
        return None
    return summary


@contextlib.contextmanager
def _exclusive(path: str | os.PathLike | None):
    """Hold an exclusive lock on the file ``path`` (nothing if None)."""
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _regenerate_variants(directory: pathlib.Path, key: KernelKey) -> str:
    """A variant log's database workload file, rebuilt from its index (:func:`_regenerate`)."""
    return _regenerate(directory, "variant",
                       lambda variant: variant_workload(key, dict(variant)))


def dry_run(key: KernelKey, log=print) -> int:
    """Generate every design space of ``key`` and build each with its first sampled decisions,
    measuring nothing (for targets this machine cannot run, e.g. Metal on Linux); for a
    hand-lowered kernel, build every variant's workload as the tuner would."""
    kind = target_kind(key.target)
    if schedules.lowers(kind, key):
        _refuse_lowered(key, variants_ok=True)
        found = schedules.variants(kind, key)
        for variant in found:
            _build_function(key)(variant_workload(key, variant), tuning_target(key.target))
        log(f"{key.name}: {len(found)} variants built")
        return len(found)
    _refuse_lowered(key)
    sched = schedules.for_target(target_kind(key.target))
    built = 0
    for tile in sched.tiles(key):
        base = tvm.s_tir.Schedule(workload(key, tile))
        for space in design_spaces(key, tile)(base):
            build_candidate(space.mod, make_target(key.target), None)
            built += 1
    log(f"{key.name}: {built} design spaces generated and built")
    return built
