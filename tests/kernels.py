"""Choosing between llm_inference's hand-written math and MLX's fused kernels inside one test process."""

from contextlib import contextmanager

import llm_inference as li


@contextmanager
def kernels(fused):
    """Run llm_inference with MLX's fused kernels (fused=True) or its hand-written math (False).

    The flag is read each time rms_norm, apply_rope and attend run: none of them is compiled (only
    silu_gate is, which does not read it). tests/test_cli.py covers --reference-ops end to end.
    """
    before = li.FUSED_KERNELS
    li.FUSED_KERNELS = fused
    try:
        yield
    finally:
        li.FUSED_KERNELS = before
