"""``python -m tvm_flash``: versions, this machine's target, where kernels are looked up (in
order) and how many each place holds, whether JIT is allowed (:func:`tvm_flash.info`)."""

import tvm_flash

print(tvm_flash.info())
