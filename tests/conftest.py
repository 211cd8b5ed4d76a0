"""Settings for the whole test session, made before any test module imports MLX.

TF32. On hardware with matrix units (CUDA GPUs; on a Mac, M5-generation GPUs with macOS 26.2 or
later: is_nax_available() in mlx/backend/metal/device.cpp), MLX runs float32 matrix products,
quantized products and attention in TF32 (10 mantissa bits instead of 23) unless the environment
variable MLX_ENABLE_TF32 is "0". The float32 comparisons here against mlx-lm and transformers are at
about 1e-4, which TF32 does not meet, so the tests turn it off.

When MLX reads it (the mlx source at 846d176, v0.32.1-26): mlx/utils.h:215,
`static bool enable_tf32_ = get_var("MLX_ENABLE_TF32", 1);`, a function-local static inside
env::enable_tf32(), which calls getenv the first time a GPU backend asks: at the first float32
product run on the GPU (mlx/backend/metal: matmul.cpp, quantized.cpp,
scaled_dot_product_attention.cpp; mlx/backend/cuda: gemms/cublas_gemm.cpp, conv.cpp), not at import.
The CPU backend never asks. From then on the value is fixed for the life of the process: a later
change is ignored. Setting it here, when pytest imports this file, before any test module imports
mlx.core, is early enough. os.environ calls putenv, so MLX's getenv sees it, and the subprocesses
the tests start inherit it: they all run with tests/test_cli.py's cli_env(), a copy of os.environ
(tests/test_cli.py::test_tf32_is_off_in_the_tests_and_their_subprocesses checks both).
"""

import os

os.environ["MLX_ENABLE_TF32"] = "0"

import pytest  # noqa: E402 (after the environment is set)

import llm_inference as li  # noqa: E402

# Part 2 changes how Part 1 runs by rebinding module names (llm_inference.replace()); main() does
# it, and so do tests. What the module holds before any test runs is Part 1 as written.
AS_IMPORTED = dict(vars(li))


@pytest.fixture(autouse=True)
def part1_as_written():
    """Each test starts from Part 1 as written: names a test or main() rebound are put back."""
    yield
    for name, value in AS_IMPORTED.items():
        if vars(li).get(name) is not value:
            setattr(li, name, value)
