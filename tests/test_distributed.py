"""Ring attention (``tvm_flash.distributed``) on two real processes: gloo on the CPU.

Each rank takes its zig-zag shard of the same random inputs, runs the ring forward and
backward, and writes its output and gradient shards; the parent puts them back together and
checks them against the float64 reference (the usual bounds, tests/checks.py) and against
single-process ``tvm_flash.attention`` on the whole sequence."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checks import FLOOR, _err, make_inputs, reference

from tvm_flash import attention
from tvm_flash.distributed import ring_attention, shard, unshard
from tvm_flash.nn import SelfAttention

WORLD = 2
CASES = [  # b, hq, hkv, length, d, causal, dtype, ranks
    (1, 4, 2, 64, 64, True, torch.float32, 2),
    (2, 2, 2, 40, 32, False, torch.float32, 2),
    (1, 2, 1, 64, 64, True, torch.bfloat16, 2),
    (1, 4, 2, 96, 64, True, torch.float32, 3),  # the dK/dV sums pass through a third rank
]


@contextlib.contextmanager
def _group(tmp, rank: int = 0, world: int = 1):
    """A gloo process group of ``world`` ranks meeting at a file in ``tmp``."""
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_rank(rank, world, tmp, body, args):
    with _group(tmp, rank, world):
        torch.save(body(rank, world, *args), tmp / f"rank{rank}.pt")


def _ranks(tmp, world, body, *args) -> list:
    """Run ``body(rank, world, *args)`` in ``world`` processes of one group; what each
    returned, in rank order."""
    mp.spawn(_run_rank, args=(world, tmp, body, args), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _single(inputs, causal: bool, sinks=None) -> list:
    """Output and gradients (q, k, v[, sinks]) of ``attention`` on the whole sequence in this
    process; then the other kernels the ring runs (unmasked off-diagonal blocks; no sinks: it
    folds them itself), so the ranks find every kernel in the JIT cache they share."""
    leaves = [t.clone().requires_grad_() for t in [*inputs[:3], sinks] if t is not None]
    out = attention(*leaves[:3], is_causal=causal, enable_gqa=True,
                    sinks=leaves[3] if sinks is not None else None)
    out.backward(inputs[3])
    for mode in (True, False) if sinks is not None else (False,) if causal else ():
        warm = [t.clone().requires_grad_() for t in inputs[:3]]
        attention(*warm, is_causal=mode, enable_gqa=True).backward(inputs[3])
    return [out.detach(), *(t.grad for t in leaves)]


def _ring_body(rank, world, causal, inputs, sinks=None):
    """One rank: its shards through the ring, forward and backward."""
    q, k, v, do = (shard(t, rank, world) for t in inputs)
    leaves = [t.clone().requires_grad_() for t in [q, k, v, sinks] if t is not None]
    out = ring_attention(*leaves[:3], is_causal=causal, enable_gqa=True,
                         sinks=leaves[3] if sinks is not None else None)
    out.backward(do)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}-{c[2]}l{c[3]}d{c[4]}"
                         f"{'-causal' if c[5] else ''}-{str(c[6])[6:]}-x{c[7]}")
def test_ring_matches_one_process(case, tmp_path):
    b, hq, hkv, length, d, causal, dtype, world = case
    torch.manual_seed(0)
    inputs = make_inputs(b, hq, hkv, length, length, d, dtype, "cpu")
    single = _single(inputs, causal)
    parts = _ranks(tmp_path, world, _ring_body, causal, inputs)
    ring = [unshard([p[i] for p in parts]) for i in range(4)]

    mode = "top-left" if causal else "none"
    exact = reference(*inputs, mode, torch.float64)
    exact = [exact[0], *exact[2:5]]  # out, dq, dk, dv
    lowp = reference(*inputs, mode, dtype)
    lowp = [lowp[0], *lowp[2:5]]
    for name, r, s, e, lp, mult in zip(("out", "dq", "dk", "dv"), ring, single, exact, lowp,
                                       (2, 3, 3, 3), strict=True):
        err, bound = _err(r, e)[0], mult * _err(lp, e)[0] + FLOOR[dtype]
        assert err <= bound, f"{name}: ring error {err:.3g} > {bound:.3g}"
        # partials merged in fp32 and rounded once more: as close to the single pass as
        # either is to float64
        assert _err(r, s)[0] <= err + _err(s, e)[0] + FLOOR[dtype], name


def test_ring_with_sinks(tmp_path):
    """Sinks fold into the merged rows once; their gradient, summed over the ranks, is the
    single process's."""
    torch.manual_seed(3)
    inputs = make_inputs(1, 4, 2, 64, 64, 64, torch.float32, "cpu")
    sinks = torch.randn(4)
    single = _single(inputs, True, sinks)
    parts = _ranks(tmp_path, WORLD, _ring_body, True, inputs, sinks)
    for i, want in enumerate(single[:4]):
        assert _err(unshard([p[i] for p in parts]), want)[0] < 1e-4, i
    assert _err(parts[0][4] + parts[1][4], single[4])[0] < 1e-4


def _layer_body(rank, world, x, state):
    """One rank of a context-parallel SelfAttention: its shard of x in, its shard out."""
    layer = SelfAttention(128, 4, 2, cp_group=dist.group.WORLD)
    layer.load_state_dict(state)
    xs = shard(x, rank, world, dim=1).requires_grad_()
    out = layer(xs)
    out.square().sum().backward()
    return [out.detach(), xs.grad, layer.qkv.weight.grad]


def test_context_parallel_layer_matches_one_process(tmp_path):
    """SelfAttention(cp_group=...) on two ranks: the output and x's gradient are the single
    layer's, and the weight gradients summed over the ranks (what a data-parallel reduction
    does) are the single layer's."""
    torch.manual_seed(2)
    layer = SelfAttention(128, 4, 2)
    x = torch.randn(2, 32, 128)
    xs = x.clone().requires_grad_()
    out = layer(xs)
    out.square().sum().backward()
    parts = _ranks(tmp_path, WORLD, _layer_body, x, layer.state_dict())
    assert _err(unshard([p[0] for p in parts], dim=1), out.detach())[0] < 1e-4
    assert _err(unshard([p[1] for p in parts], dim=1), xs.grad)[0] < 1e-3
    assert _err(parts[0][2] + parts[1][2], layer.qkv.weight.grad)[0] < 1e-3
    with pytest.raises(ValueError, match="cp_group"):
        SelfAttention(128, 4, cp_group=object(), impl="sdpa")


def test_zigzag_shards_round_trip_and_balance():
    x = torch.arange(2 * 16, dtype=torch.float32).reshape(1, 1, 32, 1).expand(1, 1, 32, 2)
    shards = [shard(x, r, 4) for r in range(4)]
    assert [s[0, 0, :, 0].tolist()[::4] for s in shards[:1]] == [[0, 28]]
    assert torch.equal(unshard(shards), x)
    with pytest.raises(ValueError, match="multiple of 2 x world"):
        shard(torch.zeros(1, 1, 30, 2), 0, 4)


def test_ring_needs_an_initialised_group():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


def test_ring_refuses_mismatched_local_lengths(tmp_path):
    with _group(tmp_path):
        q = torch.randn(1, 2, 8, 64)
        with pytest.raises(ValueError, match="local length"):
            ring_attention(q, q[:, :, :6], q[:, :, :6])
        with pytest.raises(ValueError, match="odd"):
            ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7])


def test_ring_of_one_rank_is_attention(tmp_path):
    """A one-rank group: the ring is the single-device call (also at a padded head dim)."""
    with _group(tmp_path):
        torch.manual_seed(1)
        for d, causal in ((64, False), (64, True), (40, True)):
            q, k, v, _ = make_inputs(1, 2, 2, 24, 24, d, torch.float32, "cpu")
            grads = []
            for fn in (ring_attention, attention):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves, is_causal=causal)
                out.backward(q)
                grads.append([out.detach(), *(t.grad for t in leaves)])
            for r, o in zip(*grads, strict=True):
                assert _err(r, o)[0] <= 1e-5

