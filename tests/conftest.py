import os
import tempfile

import pytest
import torch

# A private module cache per test session unless the caller chose one.
os.environ.setdefault("TVM_FLASH_CACHE",
                      os.path.join(tempfile.gettempdir(), "tvm-flash-test-cache"))

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
