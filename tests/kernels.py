"""Choosing between llm_inference's hand-written math (Part 1 as written) and MLX's fused kernels
(section 12 replaces rms_norm, apply_rope and attend with them) inside one test process."""

from contextlib import contextmanager

import llm_inference as li

FUSED = ("rms_norm", "apply_rope", "attend")
PART1 = {name: getattr(li, name) for name in FUSED}  # imported before any test replaces them


@contextmanager
def kernels(fused):
    """Run llm_inference with MLX's fused kernels (fused=True) or Part 1's math (False), then put
    back the functions that were there before."""
    before = {name: getattr(li, name) for name in FUSED}
    for name in FUSED:  # Part 1's own functions: what a fresh import has
        setattr(li, name, PART1[name])
    if fused:
        li.use_fused_kernels()
    try:
        yield
    finally:
        for name, function in before.items():
            setattr(li, name, function)
