"""The GPU check suite: one file per section (kernels, attention, fused_decode, int8, pdl,
collectives, runtime), each checking dsc's kernels or runtime against references at real shapes.

    pytest tests/gpu                     # on a CUDA machine (collectives: 2+ GPUs); under 6 minutes on an H200
    OUT=DIR pytest tests/gpu             # also a compact JSON summary per section under DIR
    pytest tests/gpu -m "not gpu"        # the CPU smoke variants only (tiny shapes, Triton interpreter)

Tests marked `gpu` skip without CUDA; each section's smoke variant runs the same code at tiny
shapes on the CPU so that the ordinary suite exercises it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
