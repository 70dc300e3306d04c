import os
import tempfile

import pytest
import torch

# Tests build the kernels they need on first use (into a private cache unless the caller chose
# one); set TVM_FLASH_ARTIFACTS to test prebuilt artifacts instead (keys missing there are
# then still built just in time).
os.environ.setdefault("TVM_FLASH_CACHE",
                      os.path.join(tempfile.gettempdir(), "tvm-flash-test-cache"))
os.environ.setdefault("TVM_FLASH_JIT", "1")

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
