"""dsc kernels: one file per op. Importing this package registers every `dsc::` custom op.

Each op has a plain-torch reference (used on CPU and as the test oracle) and, where one
exists, a Triton kernel used on CUDA devices.
"""

from dsc.kernels import (
    activation,  # noqa: F401  (dsc::swiglu, dsc::gelu)
    attention,  # noqa: F401  (dsc::attention, dsc::causal_attention, dsc::rotary_attention)
    collectives,  # noqa: F401  (registers dsc::all_reduce)
    embedding,  # noqa: F401  (dsc::vocab_embedding)
    encoder_attention,  # noqa: F401  (dsc::encoder_attention: bidirectional, padded)
    fp8,  # noqa: F401  (dsc::linear_fp8)
    int4,  # noqa: F401  (dsc::linear_w4a16)
    int8,  # noqa: F401  (dsc::linear_w8a16, dsc::linear_w8a8)
    linear,  # noqa: F401  (dsc::linear: the decode GEMV)
    moe,  # noqa: F401  (dsc::moe: the experts of a mixture-of-experts layer)
    norm,  # noqa: F401  (dsc::rmsnorm, dsc::add_rmsnorm, dsc::add_layernorm)
    paged_attention,  # noqa: F401  (dsc::ragged_attention, dsc::paged_attention)
    rotary,  # noqa: F401  (dsc::rotary)
)
