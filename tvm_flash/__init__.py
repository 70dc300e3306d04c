"""tvm-flash: flash attention forward and backward, written once in TVM TensorIR.

``tvm_flash.attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` is a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` on CPU and CUDA tensors.
"""

from .key import CAUSAL_MODES, HEAD_DIMS, OPS, KernelKey
from .ops import attention
from .reference import attention_reference

__all__ = ["CAUSAL_MODES", "HEAD_DIMS", "OPS", "KernelKey", "attention", "attention_reference"]
__version__ = "0.1.0"
