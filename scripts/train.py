#!/usr/bin/env python
"""Train a small GPT-style byte-level language model with tvm-flash or torch SDPA attention.

The data is the Python standard library's own source (on every machine, no download), read
byte by byte in a fixed file order; the last 5% of the bytes are the validation set. Both
attention implementations train the same model code from the same seed in one run, and the
script reports loss curves (CSV + PNG), tokens/s and peak memory for each.

    python scripts/train.py --device cuda --steps 1000              # the H200 run
    python scripts/train.py --device cpu --tiny --steps 20          # the CI smoke size
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tvm_flash.nn import SelfAttention  # noqa: E402

# ----------------------------------------------------------------------------------- data


def stdlib_bytes(limit: int | None = None) -> bytes:
    """The standard library's .py files, sorted by relative path, concatenated."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts)
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    return b"".join(chunks)[:limit]


def split(data: bytes, val_fraction: float = 0.05):
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def batch(tokens: torch.Tensor, batch_size: int, seq: int, gen: torch.Generator, device):
    starts = torch.randint(0, len(tokens) - seq - 1, (batch_size,), generator=gen)
    x = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + seq + 1] for s in starts.tolist()])
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------------------- model


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):  # x: (B, H, L, D)
        length = x.shape[2]
        cos, sin = self.cos[:length].to(x.dtype), self.sin[:length].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, impl):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, kv_heads, causal=True, impl=impl)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x, rotary):
        x = x + self.attn(self.ln1(x), rotary)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-norm decoder with rotary positions; ``impl`` picks the attention kernels."""

    def __init__(self, layers=6, width=384, heads=6, kv_heads=None, seq=256, impl="tvm"):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.rotary = Rotary(width // heads, seq)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads, impl) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.rotary)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, 256), targets.view(-1))


# ------------------------------------------------------------------------------- training


def lr_at(step, steps, base, warmup):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, tokens, args, device, autocast):
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same validation batches for every run
    losses = []
    for _ in range(args.eval_batches):
        x, y = batch(tokens, args.batch, args.seq, gen, device)
        with autocast:
            losses.append(model(x, y).item())
    model.train()
    return sum(losses) / len(losses)


class Run:
    """One implementation's training run: its model, optimiser and batch stream, a step at a
    time (:meth:`step`), so that two runs can take turns in one process (``--interleave``)."""

    def __init__(self, impl: str, train_tokens, val_tokens, args, device):
        self.impl, self.tokens, self.val_tokens, self.args = impl, train_tokens, val_tokens, args
        self.device = device
        torch.manual_seed(args.seed)
        self.model = GPT(args.layers, args.width, args.heads, args.kv_heads, args.seq,
                         impl).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.1,
                                     betas=(0.9, 0.95))
        self.step_fn = (torch.compile(self.model, mode=args.compile) if args.compile
                        else self.model)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                                       enabled=device.type == "cuda")
        self.gen = torch.Generator().manual_seed(args.seed)
        self.rows, self.tokens_done, self.timed, self.peak = [], 0, 0.0, 0

    def step(self, step: int) -> None:
        args, cuda = self.args, self.device.type == "cuda"
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x, y = batch(self.tokens, args.batch, args.seq, self.gen, self.device)
        if cuda:
            torch.cuda.synchronize()  # the batch's copy is not this step's time
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with self.autocast:
            loss = self.step_fn(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        loss_value = loss.item()  # synchronises
        if step >= min(10, args.steps // 2):  # skip compilation and warm-up steps
            self.timed += time.perf_counter() - start
            self.tokens_done += x.numel()
        if cuda:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{self.impl}: loss is {loss_value} at step {step}")
        val = None
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(self.model, self.val_tokens, args, self.device, self.autocast)
        self.rows.append({"impl": self.impl, "step": step + 1, "train_loss": loss_value,
                          "val_loss": val})
        if (step + 1) % args.log_every == 0 or val is not None:
            print(f"[{self.impl}] step {step + 1:5d}  loss {loss_value:.4f}"
                  + (f"  val {val:.4f}" if val is not None else "")
                  + f"  {self.tokens_per_s or float('nan'):,.0f} tok/s", flush=True)

    @property
    def tokens_per_s(self):
        return self.tokens_done / self.timed if self.timed else None

    def summary(self) -> dict:
        return {"impl": self.impl, "final_val_loss": self.rows[-1]["val_loss"],
                "tokens_per_s": self.tokens_per_s,
                "peak_memory_mib": self.peak / 2**20 if self.device.type == "cuda" else None}


def train_all(impls, train_tokens, val_tokens, args, device) -> list[Run]:
    """Train each implementation in ``impls``: one after the other, or with ``args.interleave``
    taking turns step by step in alternating order (ABBA...), so that a drift in the host's
    speed over the run — which decides a host-bound step's time — weighs on every
    implementation alike (both models and optimisers are then resident at once, and each
    run's peak memory counts the other's parameters and optimiser state too)."""
    if not args.interleave:
        runs = []
        for impl in impls:
            run = Run(impl, train_tokens, val_tokens, args, device)
            for step in range(args.steps):
                run.step(step)
            runs.append(run)
            del run.model, run.opt, run.step_fn  # free the device memory for the next one
        return runs
    runs = [Run(impl, train_tokens, val_tokens, args, device) for impl in impls]
    for step in range(args.steps):
        for run in (runs if step % 2 == 0 else runs[::-1]):
            run.step(step)
    return runs


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, style in (("tvm", "-"), ("sdpa", "--")):
        pts = [(r["step"], r["train_loss"]) for r in rows if r["impl"] == impl]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, alpha=0.6, label=f"{impl} train")
        val = [(r["step"], r["val_loss"]) for r in rows
               if r["impl"] == impl and r["val_loss"] is not None]
        if val:
            ax.plot(*zip(*val, strict=True), style, marker="o", label=f"{impl} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impls", default="tvm,sdpa", help="comma list of tvm, sdpa")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--tiny", action="store_true",
                   help="CI size: 2 layers, width 128, 2 heads, seq 64, batch 8")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: e.g. 2 (default: heads)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="torch.compile the model (MODE: default; reduce-overhead: CUDA graphs)")
    p.add_argument("--interleave", action="store_true",
                   help="train the implementations in turns, step by step (ABBA), in one process "
                        "(for tokens/s on a host-bound step; see train_all)")
    p.add_argument("--data-bytes", type=int, default=None, help="use only this many bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="train-results")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.batch = 2, 128, 2, 64, 8
        args.warmup, args.eval_every, args.eval_batches = 2, max(1, args.steps // 2), 2
        args.log_every, args.data_bytes = 1, args.data_bytes or 2_000_000
    device = torch.device(args.device)
    train_tokens, val_tokens = split(stdlib_bytes(args.data_bytes))
    print(f"data: {len(train_tokens):,} train / {len(val_tokens):,} val bytes of the Python "
          f"{sys.version.split()[0]} standard library; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = train_all(args.impls.split(","), train_tokens, val_tokens, args, device)
    all_rows = [row for run in runs for row in run.rows]
    summaries = [run.summary() for run in runs]
    with open(out / "losses.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["impl", "step", "train_loss", "val_loss"])
        writer.writeheader()
        writer.writerows(all_rows)
    plot(all_rows, out / "losses.png")
    result = {"args": vars(args), "runs": summaries}
    by = {s["impl"]: s for s in summaries}
    if "tvm" in by and "sdpa" in by:
        rel = abs(by["tvm"]["final_val_loss"] / by["sdpa"]["final_val_loss"] - 1)
        result["val_loss_rel_diff"] = rel
        print(f"final val loss: tvm {by['tvm']['final_val_loss']:.4f}  sdpa "
              f"{by['sdpa']['final_val_loss']:.4f}  relative difference {rel:.2%}")
    for s in summaries:
        mem = f"{s['peak_memory_mib']:.0f} MiB" if s["peak_memory_mib"] is not None else "n/a"
        print(f"{s['impl']}: {s['tokens_per_s'] or float('nan'):,.0f} tokens/s, peak "
              f"memory {mem}")
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'losses.csv'}, {out / 'losses.png'}, {out / 'summary.json'}")


if __name__ == "__main__":
    main()
