"""dsc kernels: one file per op. Importing this package registers every `dsc::` custom op.

Each op has a plain-torch reference (used on CPU and as the test oracle) and, where one
exists, a Triton kernel used on CUDA devices.
"""
from dsc.kernels import attention  # noqa: F401  (dsc::attention, dsc::causal_attention, dsc::rotary_attention)
from dsc.kernels import collectives  # noqa: F401  (registers dsc::all_reduce)
from dsc.kernels import norm  # noqa: F401  (dsc::rmsnorm, dsc::add_rmsnorm, dsc::add_layernorm)
from dsc.kernels import activation  # noqa: F401  (dsc::swiglu, dsc::gelu)
from dsc.kernels import rotary  # noqa: F401  (dsc::rotary)
from dsc.kernels import int8  # noqa: F401  (dsc::linear_w8a16, dsc::linear_w8a8)
from dsc.kernels import fp8  # noqa: F401  (dsc::linear_fp8)
from dsc.kernels import int4  # noqa: F401  (dsc::linear_w4a16)
from dsc.kernels import linear  # noqa: F401  (dsc::linear: the decode GEMV)
from dsc.kernels import embedding  # noqa: F401  (dsc::vocab_embedding)
from dsc.kernels import paged_attention  # noqa: F401  (dsc::ragged_attention, dsc::paged_attention)
from dsc.kernels import moe  # noqa: F401  (dsc::moe: the experts of a mixture-of-experts layer)
from dsc.kernels import encoder_attention  # noqa: F401  (dsc::encoder_attention: bidirectional, padded)
