"""tvm-flash: flash attention forward and backward, written once in TVM TensorIR.

``tvm_flash.attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` is a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` on CPU and CUDA tensors;
``tvm_flash.flash_attn_func`` (and the kv- / qkv-packed variants) one for flash-attn 2;
``tvm_flash.varlen_attention`` and ``flash_attn_varlen_func`` take packed sequences of
different lengths.
``tvm_flash.info()`` (or ``python -m tvm_flash``) says where its kernels come from.
"""

__version__ = "0.1.0"

from .artifacts import ArtifactError, allow_jit, info, use_artifacts  # noqa: E402
from .flash_attn import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .key import CAUSAL_MODES, HEAD_DIMS, OPS, KernelKey  # noqa: E402
from .nn import scaled_dot_product_attention  # noqa: E402
from .ops import attention, varlen_attention  # noqa: E402
from .reference import attention_reference  # noqa: E402

__all__ = ["CAUSAL_MODES", "HEAD_DIMS", "OPS", "ArtifactError", "KernelKey", "allow_jit",
           "attention", "attention_reference", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "info",
           "scaled_dot_product_attention", "use_artifacts", "varlen_attention"]
