"""The compiler passes: one file per pass (compiler/pipeline.py lists them in order)."""

import dsc.kernels  # noqa: F401  (registers the dsc ops the passes match and emit: torch.ops.dsc.*)
