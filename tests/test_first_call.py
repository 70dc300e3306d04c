"""A newcomer's first call: what the README says, done in a scratch directory.

``scripts/build.py`` without ``--out`` writes where tvm-flash looks without configuration, and
the README's first example then runs as written in a fresh process with neither
``TVM_FLASH_ARTIFACTS`` nor ``TVM_FLASH_JIT`` set. The build is a small subset of the README's
(one head dim, dtype and causal mode: 9 kernels instead of 126) with ``TVM_FLASH_CACHE`` in the
test's temporary directory.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# after the README's example has run: ours against float64, within 2x the error of torch's
# SDPA in the same precision (plus bf16's floor); the gradients exist and are finite
CHECK = """
exact, _ = tvm_flash.attention_reference(*(t.detach().double() for t in (q, k, v)),
                                         causal="top-left")
sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.detach() for t in (q, k, v)),
                                                        is_causal=True)
err = (out.detach().double() - exact).abs().max().item()
base = (sdpa.double() - exact).abs().max().item()
assert err <= 2 * base + 1e-2, (err, base)
assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v))
print("first call ok", out.dtype, out.device)
"""


def first_example() -> str:
    """The first Python block of the README's "Use" section."""
    text = (ROOT / "README.md").read_text()
    use = text.index("\n## Use\n")
    return re.search(r"```python\n(.*?)```", text[use:], re.S).group(1)


def test_readme_first_call_in_a_scratch_directory(tmp_path):
    scratch, cache = tmp_path / "scratch", tmp_path / "cache"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_FLASH_ARTIFACTS",
                                                             "TVM_FLASH_JIT")}
    # this checkout's package, a private cache, and the CPU: CI's machine whatever runs it
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TVM_FLASH_CACHE=str(cache), CUDA_VISIBLE_DEVICES="")

    def run(*args):
        res = subprocess.run([sys.executable, *args], cwd=scratch, env=env, capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    built = run(str(ROOT / "scripts" / "build.py"), "--head-dims", "64", "--dtypes", "bf16",
                "--causal", "top-left", "--jobs", "2")
    default = cache / "artifacts" / "llvm"
    assert f"into {default}" in built and "without configuration" in built, built
    assert len(json.loads((default / "manifest.json").read_text())["kernels"]) == 9
    assert not any(scratch.iterdir()), "build.py wrote into the working directory"

    report = run("-m", "tvm_flash")
    assert f"default: {default}: 9 kernels" in report, report
    assert "target of this machine: llvm" in report and "JIT): not allowed" in report, report
    for name in ("tvm-flash", "tvm", "tvm-ffi", "torch"):
        assert f"{name} " in report, report

    example = first_example()
    assert "tvm_flash.attention(" in example
    assert "first call ok" in run("-c", example + CHECK)
