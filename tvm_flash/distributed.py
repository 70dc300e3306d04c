"""Context-parallel (ring) attention over a ``torch.distributed`` process group.

The sequence is sharded across the group's ``W`` ranks; each rank keeps its queries and the
key/value shards travel around the ring, one hop a step, while every rank attends its queries
to the shard it holds. Partial results are merged by their LSE; in the backward the key/value
shards travel again with fp32 dK/dV sums that collect each rank's contribution and come home
after a full turn. Every sum is taken in the same order on every run (no atomics, no
reduction whose order depends on timing): the backward is deterministic, like the single-GPU
one.

Sharding is zig-zag: the sequence is cut into ``2 W`` equal chunks and rank ``r`` holds chunks
``r`` and ``2 W - 1 - r`` (:func:`shard`, :func:`unshard`). Under a causal mask every rank then
does the same work at every step (two of its chunk pairs), where contiguous shards would leave
the first rank idle most of the time.

    x_local = shard(x, dist.get_rank(), dist.get_world_size())   # x: (B, H, L, D)
    out_local = ring_attention(q_local, k_local, v_local, is_causal=True)

The kernels are tvm-flash's own (``tvm_flash.ops``), on each rank's device: NCCL on GPUs,
gloo on the CPU (the CPU CI runs two gloo ranks). Each step posts the next hop's transfers
before computing on the shard it holds, so communication overlaps the kernels where the
backend runs point-to-point operations asynchronously.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .key import HEAD_DIMS
from .layout import kernel_view
from .ops import check_inputs, flash_backward, flash_forward, pad_head_dim, sink_gradient


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zig-zag shard of ``x`` along ``dim`` (the sequence): chunks ``rank``
    and ``2 world - 1 - rank`` of ``2 world`` equal ones, concatenated. ``x.shape[dim]`` must
    be a multiple of ``2 world``."""
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"x: sequence length {n} (dim {dim}) is not a multiple of 2 x world "
                         f"size = {2 * world}, as zig-zag sharding needs")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's :func:`shard`, in rank order."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)]
                     + [halves[r][1] for r in reversed(range(world))], dim=dim)


def _pairs(rank: int, src: int, causal: bool):
    """The (query rows, key rows, causal) blocks rank ``rank`` computes against the shard of
    rank ``src``, in local halves: 0 = the front chunk, 1 = the back chunk. Query chunk ``i``
    sees key chunk ``c`` fully if ``c < i``, along the diagonal if ``c == i``."""
    if not causal:
        return [((0, 2), (0, 2), False)]
    if src == rank:  # front x front on the diagonal; back sees front; back x back diagonal
        return [((0, 1), (0, 1), True), ((1, 2), (0, 1), False), ((1, 2), (1, 2), True)]
    if src < rank:  # both query chunks see the source's front chunk, neither its back one
        return [((0, 2), (0, 1), False)]
    return [((1, 2), (0, 2), False)]  # only the back query chunk, and it sees both


def _rows(t: torch.Tensor, half: tuple[int, int], dim: int = 2) -> torch.Tensor:
    c = t.shape[dim] // 2
    return t.narrow(dim, half[0] * c, (half[1] - half[0]) * c)


class _Ring:
    """Point-to-point hops around the ring: send to ``rank + 1``, receive from ``rank - 1``."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self._global((self.rank + step) % self.world)
                                for step in (1, -1))

    def _global(self, rank: int) -> int:
        """The global rank of the group's ``rank`` (point-to-point ops address those)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start(self, tensors):
        """Post the hop of ``tensors``; returns (received buffers, requests)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(requests):
        for req in requests:
            req.wait()


def _merge(out, lse, part, part_lse):
    """Fold a partial result into the running fp32 ``out`` / ``lse`` (in place), weighting each
    by ``exp(its lse - merged lse)``. Rows that saw no key have LSE -inf and weight 0."""
    new = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(lse - new), 0.0)
    w_new = torch.where(finite, torch.exp(part_lse - new), 0.0)
    out.mul_(w_old.unsqueeze(-1)).add_(part.float() * w_new.unsqueeze(-1))
    lse.copy_(new)


def _forward(ring: _Ring, q, k, v, causal: bool, scale: float):
    b, hq, n, d = q.shape
    out = torch.zeros((b, hq, n, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, n), -math.inf, dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:
            nxt, reqs = ring.start(kv)
        for qh, kh, diag in _pairs(ring.rank, src, causal):
            part, part_lse = flash_forward(_rows(q, qh), _rows(kv[0], kh), _rows(kv[1], kh),
                                           None, "top-left" if diag else "none", scale)
            _merge(_rows(out, qh), _rows(lse, qh), part, part_lse)
        if step + 1 < ring.world:
            ring.finish(reqs)
            kv = tuple(nxt)
    return out, lse


def _backward(ring: _Ring, do, q, k, v, out, lse, causal: bool, scale: float):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    # the fp32 sums of the travelling shard's dK, dV: each rank adds its part, then passes
    # them on; after the last step they take one more hop, home to the shard's owner. A hop
    # of the sums overlaps the next shard's kernels: the sums are awaited only to add to them.
    sums = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
            torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    arrived, sum_reqs = sums, None
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:  # the next shard's k, v travel while this one is computed
            nxt, kv_reqs = ring.start(kv)
        parts = []
        for qh, kh, diag in _pairs(ring.rank, src, causal):
            pdq, pdk, pdv, _ = flash_backward(_rows(do, qh), _rows(q, qh), _rows(kv[0], kh),
                                              _rows(kv[1], kh), _rows(out, qh),
                                              _rows(lse, qh).contiguous(), None,
                                              "top-left" if diag else "none", scale)
            _rows(dq, qh).add_(pdq.float())
            parts.append((kh, pdk, pdv))
        if sum_reqs is not None:  # the sums of this step's shard, from the previous rank
            ring.finish(sum_reqs)
            sums = tuple(arrived)
        for kh, pdk, pdv in parts:
            _rows(sums[0], kh).add_(pdk.float())
            _rows(sums[1], kh).add_(pdv.float())
        if ring.world == 1:  # home already
            arrived, sum_reqs = sums, []
            break
        arrived, sum_reqs = ring.start(sums)
        if step + 1 < ring.world:
            ring.finish(kv_reqs)
            kv = tuple(nxt)
    ring.finish(sum_reqs)  # home
    return dq.to(q.dtype), arrived[0].to(k.dtype), arrived[1].to(v.dtype)


def _fold_sinks(out, lse, sinks):
    """Add each head's sink (a key with no value) to the merged rows: the denominator gains
    ``exp(sink)``, so the output shrinks by ``exp(lse - lse')`` and the LSE becomes ``lse'``
    (a row with no key: output 0, LSE = the sink), as the single-device forward does."""
    new = torch.logaddexp(lse, sinks[None, :, None].expand_as(lse))
    out.mul_(torch.where(torch.isfinite(lse), torch.exp(lse - new), 0.0).unsqueeze(-1))
    return new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, scale):
        ring = _Ring(group)
        # k and v travel: point-to-point transfers need them contiguous
        q, k, v = kernel_view(q), kernel_view(k).contiguous(), kernel_view(v).contiguous()
        out, lse = _forward(ring, q, k, v, causal, scale)
        if sinks is not None:
            lse = _fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = kernel_view(dout)
        dq, dk, dv = _backward(ctx.ring, dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        dsinks = None
        if sinks is not None:  # this rank's rows' part (see ring_attention)
            delta = (dout.float() * out.float()).sum(-1)
            dsinks = sink_gradient(sinks, lse, delta)
        return dq, dk, dv, dsinks, None, None, None


def ring_attention(q, k, v, *, group=None, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, sinks: torch.Tensor | None = None):
    """Attention over a sequence sharded across ``group`` (default: the world), forward and
    backward, equal to ``tvm_flash.attention`` on the whole sequence.

    Args:
        q: this rank's queries ``(B, Hq, L / W, D)``, its :func:`shard` of ``(B, Hq, L, D)``.
        k: this rank's keys ``(B, Hkv, L / W, D)``, sharded the same way.
        v: this rank's values ``(B, Hkv, L / W, D)``.
        group: the ``torch.distributed`` process group (``W`` ranks) the sequence is sharded
            over; ``None`` for the default group.
        is_causal: causal mask over the whole sequence (queries and keys share positions:
            top-left and bottom-right coincide).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hkv < Hq`` as in :func:`tvm_flash.attention`.
        sinks: optional sink logits ``(Hq,)``, as in :func:`tvm_flash.attention`, the same on
            every rank. Its gradient on each rank is the part of this rank's rows: sum it over
            the group (as a data-parallel reduction of a replicated parameter does).

    Returns:
        this rank's output ``(B, Hq, L / W, D)`` (its shard of the whole output), in q's dtype.

    D as in :func:`tvm_flash.attention` (any other than ``tvm_flash.HEAD_DIMS`` zero-padded).
    Every rank calls it with the same shapes. ``Lq != Lk`` is not supported here (use
    :func:`tvm_flash.attention` on one device). The local length must be even (two zig-zag
    chunks).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first")
    scale = check_inputs(q, k, v, causal="top-left" if is_causal else "none", scale=scale,
                         enable_gqa=enable_gqa, sinks=sinks)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: local length {k.shape[2]} differs from q's {q.shape[2]}; the ring "
                         "shards queries and keys of one sequence alike")
    if q.shape[2] % 2:
        raise ValueError(f"q: local length {q.shape[2]} is odd; a zig-zag shard is two equal "
                         "chunks (the whole length a multiple of 2 x world size)")
    if sinks is not None:
        sinks = sinks.float().contiguous()  # differentiable cast: the gradient flows back
    if q.shape[-1] not in HEAD_DIMS:
        return pad_head_dim(_ring, q, k, v, sinks, group, bool(is_causal), scale)[0]
    return _RingAttention.apply(q, k, v, sinks, group, bool(is_causal), scale)


def _ring(q, k, v, sinks, group, causal: bool, scale: float):
    return (_RingAttention.apply(q, k, v, sinks, group, causal, scale),)
