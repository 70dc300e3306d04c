"""Call plans (tvm_flash.plan): made once per signature and reused, launched in the order
their keys say, never reused across artifact sources; the eager and the custom-op doors;
what scripts/build.py builds covers every plan."""

import contextlib
import importlib.util
import itertools
import pathlib

import pytest
import torch
from checks import check_against_reference, make_inputs
from torch.utils._python_dispatch import TorchDispatchMode

import tvm_flash
from tvm_flash import KernelKey, artifacts, ops, plan
from tvm_flash.flash_attn import flash_attn_func

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def counters(monkeypatch):
    """How many kernel keys are built, target tags looked up and kernels loaded."""
    seen = {"keys": 0, "target_tags": 0, "loads": 0}
    post_init = KernelKey.__post_init__

    def counting_post_init(self):
        seen["keys"] += 1
        post_init(self)

    def wrap(name, fn):
        def counted(*args):
            seen[name] += 1
            return fn(*args)
        return counted

    monkeypatch.setattr(KernelKey, "__post_init__", counting_post_init)
    monkeypatch.setattr(plan, "target_tag_for_device", wrap("target_tags",
                                                            plan.target_tag_for_device))
    monkeypatch.setattr(plan, "kernel", wrap("loads", plan.kernel))
    return seen


@pytest.mark.parametrize("lq", [1, 40])  # short-query and tiled plans
def test_second_call_builds_no_key(lq, counters):
    plan.clear()
    q, k, v, do = make_inputs(2, 4, 2, lq, 50, 64, torch.float32, "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        tvm_flash.attention(*leaves, is_causal=True, enable_gqa=True).backward(do)
        flash_attn_func(*(t.transpose(1, 2) for t in leaves), causal=True).sum().backward()

    step()
    assert counters["keys"] > 0 and counters["target_tags"] == 4 and counters["loads"] > 0
    first = dict(counters)
    step()
    assert counters == first  # the second call reuses all four plans: no key, no lookup


def test_launch_order_is_the_plans(monkeypatch):
    """Every kernel a call launches, in order, is its plan's (the keys build.py builds)."""
    launched = []
    real = plan.kernel

    def recording(key):
        fn = real(key)

        def launch(*args):
            launched.append(key)
            return fn(*args)
        return launch

    plan.clear()
    monkeypatch.setattr(plan, "kernel", recording)
    for lq, sinks in itertools.product((3, 30), (False, True)):
        q, k, v, do = make_inputs(1, 4, 1, lq, 40, 64, torch.float32, "cpu")
        s = torch.randn(4, requires_grad=True) if sinks else None
        q.requires_grad_()
        launched.clear()
        tvm_flash.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=s).backward(do)
        short = lq <= plan.SHORT_QUERY_MAX
        args = ("llvm", 64, "float32", "top-left", 4)
        expected = (plan.forward_keys(*args, sinks=sinks, short=short)
                    + plan.backward_keys(*args, short=short))
        assert tuple(launched) == expected
        assert set(expected) <= set(plan.call_keys(*args, sinks=sinks))
    plan.clear()


TILED_OPS = ("fwd", "dq", "dkv", "fwd_split", "dq_split", "dkv_packed")


@pytest.mark.parametrize("causal, lq, window, folded", [
    ("bottom-right", 30, (9, 3), ("none", (9, 0))),
    ("top-left", 40, (9, -1), ("none", (9, 0))),  # Lq = Lk: the diagonals agree
    ("top-left", 30, (9, 3), ("top-left", (9, 3))),  # they do not
    ("top-left", 30, (-1, 3), ("top-left", None)),  # the causal mask alone
    ("none", 30, (9, 3), ("none", (9, 3))),
    ("bottom-right", 7, (9, 3), ("none", (9, 0))),  # the short-query path
])
def test_a_causal_window_runs_folded(monkeypatch, causal, lq, window, folded):
    """A causal call with a window runs the kernels ``ops.fold_causal`` names, forward and
    backward (keys that ``call_keys`` lists, so build.py builds them); results as the float64
    reference's with the call's own mask and window."""
    launched = []
    real = plan.kernel

    def recording(key):
        launched.append(key)
        return real(key)

    plan.clear()
    monkeypatch.setattr(plan, "kernel", recording)
    try:
        q, k, v, do = make_inputs(1, 2, 1, lq, 40, 64, torch.float32, "cpu")
        check_against_reference(q, k, v, do, causal, window_size=window)
    finally:
        plan.clear()
    tiled = [key for key in launched if key.op in TILED_OPS]
    assert len(tiled) == 3  # fwd, dq, dkv or their short-query forms
    assert {(key.causal, key.window) for key in tiled} == {(folded[0], folded[1] is not None)}
    assert ops.fold_causal(causal, ops.ScoreMods(window=window), lq, 40) == (
        folded[0], ops.ScoreMods(window=folded[1] or (-1, -1)))
    built = plan.call_keys("llvm", 64, "float32", causal, 2, mods=("window",))
    assert set(launched) <= set(built)
    # a form no call runs is not built: bottom-right with a window always folds
    assert not any(key.causal == "bottom-right" and key.window for key in built)


def test_a_dq_that_computes_delta_replaces_bwd_pre(monkeypatch):
    """Where the dQ artifact records that it does ``bwd_pre``'s work (``absorbs``, the Hopper
    dQ), the tiled backward launches dQ with O before Delta and no ``bwd_pre``, and dK/dV reads
    the Delta it wrote. Here the llvm dQ stands in, Delta made beside it as the kernel would."""
    launched = []
    real = plan.kernel

    def recording(key):
        fn = real(key)
        if key.op != "dq":
            return lambda *args: (launched.append(key.op), fn(*args))

        def absorbing(q, k, v, do, lse, o, delta, *rest):
            launched.append("dq")
            delta.copy_((do.float() * o.float()).sum(-1))
            return fn(q, k, v, do, lse, delta, *rest)
        return absorbing

    plan.clear()
    monkeypatch.setattr(plan, "kernel", recording)
    monkeypatch.setattr(plan.artifacts, "absorbs",
                        lambda key: "bwd_pre" if key.op == "dq" else None)
    try:
        for lq in (3, 30):  # the short path keeps bwd_pre
            q, k, v, do = make_inputs(1, 4, 2, lq, 40, 64, torch.float32, "cpu")
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            launched.clear()
            out = tvm_flash.attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(do)
            want = (("fwd_split", "fwd_merge", "bwd_pre", "dq_split", "dq_merge", "dkv_packed")
                    if lq <= plan.SHORT_QUERY_MAX else ("fwd", "dq", "dkv"))
            assert tuple(launched) == want
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            tvm_flash.attention_reference(*ref, causal="top-left")[0].backward(do.double())
            for ours, exact in zip(leaves, ref, strict=True):
                torch.testing.assert_close(ours.grad.double(), exact.grad, atol=1e-4,
                                           rtol=1e-4)
    finally:
        plan.clear()


def test_plans_follow_the_artifact_source(tmp_path):
    """A plan holds loaded kernels: after use_artifacts / allow_jit the next call loads again
    (here: refuses, the directory is empty), never runs the earlier plan's kernels."""
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.float32, "cpu")
    tvm_flash.attention(q, k, v)  # a plan from the just-in-time cache
    try:
        tvm_flash.use_artifacts(tmp_path)
        tvm_flash.allow_jit(False)
        with pytest.raises(artifacts.ArtifactError, match="no manifest.json"):
            tvm_flash.attention(q, k, v)
    finally:
        tvm_flash.use_artifacts(None)
        tvm_flash.allow_jit(None)
    tvm_flash.attention(q, k, v)


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_the_custom_op():
    """With a dispatch mode active the call goes through ``tvm_flash::fwd`` (the mode sees
    it, as a tracer would); without one it skips the op's wrappers. Same result."""
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.float32, "cpu")
    eager = tvm_flash.attention(q, k, v, is_causal=True)
    with _SeenOps() as mode:
        traced = tvm_flash.attention(q, k, v, is_causal=True)
    assert torch.ops.tvm_flash.fwd.default in mode.ops
    assert torch.equal(eager, traced)


def test_backward_fills_nothing_for_the_lse():
    """lse has no gradient, so autograd materialises none: no zero fill a call on either door
    (the eager ``_Attention`` and the ops' formula, which a dispatch mode active during the
    forward takes), and the
    backward op returns an empty ``dsinks`` without sinks (an op returns tensors)."""
    q, k, v, do = make_inputs(1, 2, 2, 20, 20, 64, torch.float32, "cpu")
    grads = []
    for traced in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        # a mode active during the forward makes it take the op and the op's formula
        with _SeenOps() if traced else contextlib.nullcontext():
            out = tvm_flash.attention(*leaves, is_causal=True)
        with _SeenOps() as mode:
            out.backward(do)
        filled = [f for f in mode.ops if f.overloadpacket in (
            torch.ops.aten.fill_, torch.ops.aten.zero_, torch.ops.aten.zeros_like,
            torch.ops.aten.zeros, torch.ops.aten.new_zeros)]
        assert filled == []
        grads.append([t.grad for t in leaves])
    for eager_grad, traced_grad in zip(*grads, strict=True):
        assert torch.equal(eager_grad, traced_grad)
    out, lse = torch.ops.tvm_flash.fwd(q, k, v, None, "top-left", 0.125)
    assert torch.ops.tvm_flash.bwd(do, q, k, v, out, lse, None, "top-left", 0.125)[3].shape == (0,)


def test_build_plan_covers_every_call_plan():
    spec = importlib.util.spec_from_file_location("build_script", ROOT / "scripts" / "build.py")
    build_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_script)
    built = set(build_script.plan("cuda-sm_90", [64, 128], ["bfloat16"],
                                  ["none", "bottom-right"], [1, 4], sinks=True))
    for d, causal, g, sinks, short in itertools.product((64, 128), ("none", "bottom-right"),
                                                        (1, 4), (False, True), (False, True)):
        args = ("cuda-sm_90", d, "bfloat16", causal, g)
        assert set(plan.forward_keys(*args, sinks=sinks, short=short)) <= built
        assert set(plan.backward_keys(*args, short=short)) <= built
    # per D: bwd_pre, dq_merge, fwd_merge with and without sinks; per (D, causal, group):
    # fwd, dq, dkv, fwd_split, dq_split, dkv_packed and the forward with sinks
    assert len(built) == 2 * 4 + 2 * 2 * 2 * 7
    # score modifiers and packed sequences: one combination, its tiled and short-query keys
    # (the row-wise ones are shared); packed sequences only the tiled ones
    mods = build_script.parse_mods("window+softcap")
    assert mods == [("window", "softcap")]
    more = set(build_script.plan("cuda-sm_90", [64], ["bfloat16"], ["none"], [1], mods=mods,
                                 varlen=True))
    for short, varlen in ((False, False), (True, False), (False, True)):
        args = ("cuda-sm_90", 64, "bfloat16", "none", 1)
        for m in ((), mods[0]):
            assert set(plan.forward_keys(*args, sinks=False, short=short, mods=m,
                                         varlen=varlen)) <= more
            assert set(plan.backward_keys(*args, short=short, mods=m, varlen=varlen)) <= more
    assert len(more) == 3 + 2 * 6 + 2 * 3
    with pytest.raises(ValueError, match="--mods"):
        build_script.parse_mods("window+dropout")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ffi_calls_run_on_torchs_current_stream():
    """What the plan relies on instead of a stream context: tvm-ffi makes torch's current
    stream the environment stream for a call that gets a CUDA tensor."""
    import tvm_ffi

    seen = []
    probe = tvm_ffi.convert(lambda t: seen.append(
        tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", torch.cuda.current_device()))))
    x = torch.empty(1, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        probe(x)
    probe(x)
    assert seen == [side.cuda_stream, torch.cuda.current_stream().cuda_stream]
