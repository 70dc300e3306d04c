"""CPU smoke test of scripts/train.py: the tiny model trains, and tvm-flash and SDPA agree."""

import csv
import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("train", ROOT / "scripts" / "train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)


def test_tiny_training_run_decreases_loss(tmp_path):
    train.main(["--device", "cpu", "--tiny", "--steps", "12", "--impls", "tvm",
                "--kv-heads", "1", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "losses.csv")))
    losses = [float(r["train_loss"]) for r in rows]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert (tmp_path / "summary.json").exists()


def test_first_step_gradients_match_sdpa():
    data = train.stdlib_bytes(200_000)
    tokens, _ = train.split(data)
    x, y = train.batch(tokens, 4, 64, torch.Generator().manual_seed(0), "cpu")
    grads = {}
    for impl in ("tvm", "sdpa"):
        torch.manual_seed(0)
        model = train.GPT(layers=2, width=128, heads=2, kv_heads=1, seq=64, impl=impl)
        model(x, y).backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["tvm"].items():
        torch.testing.assert_close(g, grads["sdpa"][name], atol=2e-5, rtol=1e-3, msg=name)
