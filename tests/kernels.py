"""Choosing between llm_inference's hand-written math and MLX's fused kernels inside one test process."""

from contextlib import contextmanager

import mlx.core as mx

import llm_inference as li


@contextmanager
def kernels(fused):
    """Run llm_inference with MLX's fused kernels (fused=True) or its hand-written math (False).

    The hand-written path runs with compilation off: a compiled function replays the trace it recorded
    first, so flipping FUSED_KERNELS under it would change nothing. (The CLI sets the flag once, before
    anything is compiled; tests/test_cli.py covers --reference-ops with compilation on.)
    """
    before = li.FUSED_KERNELS
    li.FUSED_KERNELS = fused
    if not fused:
        mx.disable_compile()
    try:
        yield
    finally:
        li.FUSED_KERNELS = before
        mx.enable_compile()
