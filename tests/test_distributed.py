"""Ring attention (``tvm_flash.distributed``) on two real processes: gloo on the CPU.

Each rank takes its zig-zag shard of the same random inputs, runs the ring forward and
backward, and writes its output and gradient shards; the parent puts them back together and
checks them against the float64 reference (the usual bounds, tests/checks.py) and against
single-process ``tvm_flash.attention`` on the whole sequence."""

import os

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


def _rank(rank, init, tmp, case, inputs):
    """One rank: its shards through the ring, forward and backward; results to ``tmp``."""
    os.environ.setdefault("TVM_FLASH_JIT", "1")
    world = case[7]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        causal = case[5]
        q, k, v, do = (shard(t, rank, world) for t in inputs)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, is_causal=causal, enable_gqa=True)
        out.backward(do)
        torch.save([out.detach(), *(t.grad for t in leaves)], tmp / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}-{c[2]}l{c[3]}d{c[4]}"
                         f"{'-causal' if c[5] else ''}-{str(c[6])[6:]}-x{c[7]}")
def test_ring_matches_one_process(case, tmp_path):
    b, hq, hkv, length, d, causal, dtype, world = case
    torch.manual_seed(0)
    inputs = make_inputs(b, hq, hkv, length, length, d, dtype, "cpu")
    # the whole sequence in this process first (unmasked too: the ring's off-diagonal blocks
    # are unmasked), so the ranks find every kernel in the JIT cache they share
    single = None
    for mode in ((True, False) if causal else (False,)):
        leaves = [t.clone().requires_grad_() for t in inputs[:3]]
        out = attention(*leaves, is_causal=mode, enable_gqa=True)
        out.backward(inputs[3])
        single = single or [out.detach(), *(t.grad for t in leaves)]
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, tmp_path, case, inputs), nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
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


def _sinks_rank(rank, init, tmp, inputs, sinks):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        q, k, v, do = (shard(t, rank, WORLD) for t in inputs)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = ring_attention(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3])
        out.backward(do)
        torch.save([out.detach(), *(t.grad for t in leaves)], tmp / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ring_with_sinks(tmp_path):
    """Sinks fold into the merged rows once; their gradient, summed over the ranks, is the
    single process's."""
    torch.manual_seed(3)
    inputs = make_inputs(1, 4, 2, 64, 64, 64, torch.float32, "cpu")
    sinks = torch.randn(4)
    leaves = [t.clone().requires_grad_() for t in (*inputs[:3], sinks)]
    single = attention(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3])
    single.backward(inputs[3])
    for causal in (True, False):  # the ring's kernels (no sinks: it folds them itself)
        warm = [t.clone().requires_grad_() for t in inputs[:3]]
        attention(*warm, is_causal=causal, enable_gqa=True).backward(inputs[3])
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_sinks_rank, args=(init, tmp_path, inputs, sinks), nprocs=WORLD, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for i, want in enumerate([single.detach(), *(t.grad for t in leaves[:3])]):
        assert _err(unshard([p[i] for p in parts]), want)[0] < 1e-4, i
    assert _err(parts[0][4] + parts[1][4], leaves[3].grad)[0] < 1e-4


def _layer_rank(rank, init, tmp, x, state):
    """One rank of a context-parallel SelfAttention: its shard of x in, its shard out."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        layer = SelfAttention(128, 4, 2, cp_group=dist.group.WORLD)
        layer.load_state_dict(state)
        xs = shard(x, rank, WORLD, dim=1).requires_grad_()
        out = layer(xs)
        out.square().sum().backward()
        torch.save([out.detach(), xs.grad, layer.qkv.weight.grad], tmp / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_layer_rank, args=(init, tmp_path, x, layer.state_dict()), nprocs=WORLD,
             join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
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
    init = f"file://{tmp_path / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        q = torch.randn(1, 2, 8, 64)
        with pytest.raises(ValueError, match="local length"):
            ring_attention(q, q[:, :, :6], q[:, :, :6])
        with pytest.raises(ValueError, match="odd"):
            ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7])
    finally:
        dist.destroy_process_group()


def test_ring_of_one_rank_is_attention(tmp_path):
    """A one-rank group: the ring is the single-device call."""
    init = f"file://{tmp_path / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        torch.manual_seed(1)
        q, k, v, _ = make_inputs(1, 2, 2, 24, 24, 64, torch.float32, "cpu")
        for causal in (False, True):
            grads = []
            for fn in (ring_attention, attention):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves, is_causal=causal)
                out.backward(q)
                grads.append([out.detach(), *(t.grad for t in leaves)])
            for r, o in zip(*grads, strict=True):
                assert _err(r, o)[0] <= 1e-5
    finally:
        dist.destroy_process_group()

