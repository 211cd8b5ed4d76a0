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

# Shared fixtures. Imported after MLX_ENABLE_TF32 is set (tests.checkpoint imports mlx.core).
import hashlib  # noqa: E402
import json  # noqa: E402
from collections import OrderedDict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.checkpoint import TINY_CONFIG, write_checkpoint  # noqa: E402


class Checkpoints:
    """Random-weight checkpoints, and mlx-lm's conversions of them, each made once per test process
    and shared by every module that asks for the same one (under pytest-xdist, once per worker).

    The folders are shared: tests read them or copy them (test_cli.py's `variant`, shutil.copytree)
    and never write into them."""

    def __init__(self, root):
        self.root = root
        self.folders = {}

    def _new_folder(self, name):
        return self.root / str(len(self.folders)) / name

    def __call__(self, overrides, seed=0, dtype="bfloat16", shards=1, tied_head=None,
                 name="model"):
        """What write_checkpoint(folder, overrides, seed, dtype, shards, tied_head) writes, in a
        folder called `name`."""
        key = ("checkpoint", json.dumps(overrides, sort_keys=True), seed, dtype, shards, tied_head,
               name)
        if key not in self.folders:
            self.folders[key] = write_checkpoint(self._new_folder(name), overrides, seed=seed,
                                                 dtype=dtype, shards=shards, tied_head=tied_head)
        return self.folders[key]

    def converted(self, folder, name="mlx", **arguments):
        """The folder `name` that mlx_lm.convert(hf_path=folder, mlx_path=it, **arguments) fills."""
        key = ("converted", str(folder), json.dumps(arguments, sort_keys=True), name)
        if key not in self.folders:
            from mlx_lm import convert

            out = self._new_folder(name)
            out.parent.mkdir(parents=True)
            convert(hf_path=str(folder), mlx_path=str(out), **arguments)
            self.folders[key] = out
        return self.folders[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(overrides, seed=...) and checkpoints.converted(folder, ...): see Checkpoints."""
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tiny_model(checkpoints):
    """The tiny random Qwen3 (TINY_CONFIG, seed 0) that most modules run, in a folder tiny-qwen3."""
    return checkpoints(TINY_CONFIG, name="tiny-qwen3")


@pytest.fixture(scope="session")
def reference(tiny_model):
    """test_cli.py's Reference: the tiny model loaded in this process, to check the CLI against."""
    import llm_inference as li
    from tests.test_cli import Reference

    # The CLI's default --dtype auto: float32 on the CPU, bfloat16 on a GPU; the same rule here.
    return Reference(tiny_model, cli.pick_dtype("auto"))


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model):
    """transformers' tokenizer of the tiny model: it renders Qwen3's official chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# What mlx_lm.utils.load_tokenizer downloads (its allow_patterns), so what it may read.
TOKENIZER_SUFFIXES = {".json", ".py", ".model", ".tiktoken", ".txt", ".jsonl", ".jinja"}
# config.json's keys about the weights alone: their shapes, whether the head is tied, their dtype,
# how they are quantized (added by mlx_lm.convert).
WEIGHT_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "tie_word_embeddings", "torch_dtype", "dtype",
               "quantization", "quantization_config"}


@pytest.fixture(scope="session", autouse=True)
def mlx_lm_loads_a_tokenizer_once():
    """mlx_lm.load and mlx_lm.convert load the checkpoint's tokenizer with transformers every time:
    over 3 s of CPU for Qwen's vocabulary. While this fixture is active, mlx_lm.utils.load_tokenizer
    returns the tokenizer it loaded before (one of the last 4) when every file of the folder that it
    may read is byte for byte the same, and so are its arguments; otherwise it loads as usual. The
    files it may read: the names its download asks for (*.json, *.jinja, ...), but the weights'
    index, and of config.json what is not about the weights (WEIGHT_KEYS: the sizes, and the
    quantization mlx_lm.convert adds), which transformers and mlx-lm never read for a tokenizer.
    So one load serves every test checkpoint, tied or not, of any width, and one more all their
    conversions (mlx_lm.convert rewrites the tokenizer's files). The tests only encode with these
    tokenizers, or let mlx_lm.convert save them, and never change them."""
    import mlx_lm.utils

    load_tokenizer = mlx_lm.utils.load_tokenizer
    loaded = OrderedDict()  # the last 4, the most recently used last: each takes ~150 MB

    def contents(folder):
        files = sorted(folder.iterdir()) if folder.is_dir() else []
        if not files or not all(path.is_file() for path in files):
            return None
        key = []
        for path in files:
            if path.name == "config.json":
                try:
                    config = json.loads(path.read_text())
                except ValueError:  # UnicodeDecodeError too
                    return None
                if not isinstance(config, dict):
                    return None
                kept = {k: v for k, v in config.items() if k not in WEIGHT_KEYS}
                key.append((path.name, json.dumps(kept, sort_keys=True)))
            elif path.suffix in TOKENIZER_SUFFIXES and path.name != "model.safetensors.index.json":
                key.append((path.name, hashlib.sha256(path.read_bytes()).hexdigest()))
        return tuple(key)

    def load_once(model_path, *args, **kwargs):
        files = contents(Path(model_path))
        if files is None:
            return load_tokenizer(model_path, *args, **kwargs)
        key = (files, repr(args), repr(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = load_tokenizer(model_path, *args, **kwargs)
            if len(loaded) > 4:
                loaded.popitem(last=False)
        loaded.move_to_end(key)
        return loaded[key]

    mlx_lm.utils.load_tokenizer = load_once
    yield
    mlx_lm.utils.load_tokenizer = load_tokenizer


import llm_inference as li  # noqa: E402
import cli  # noqa: E402

# Part 2 changes how Part 1 runs by rebinding module names (llm_inference.replace()); main() does
# it, and so do tests. What the module holds before any test runs is Part 1 as written.
AS_IMPORTED = dict(vars(li))


@pytest.fixture(scope="session", autouse=True)
def a_tokenizer_json_is_loaded_once():
    """li.load_tokenizer parses Qwen's 151,643-token BPE in about 0.45 s. While this fixture is
    active, it returns the tokenizer it loaded before from a byte-identical tokenizer.json (one of
    the last 8), and otherwise loads as usual, failures included. The one change made to a loaded
    tokenizer, cli.check_tokenizer's no truncation and no padding, gives the same on every call."""
    load_tokenizer, loaded = li.load_tokenizer, OrderedDict()

    def load_once(model_dir):
        key = hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes()).hexdigest()
        if key not in loaded:
            loaded[key] = load_tokenizer(model_dir)
            if len(loaded) > 8:
                loaded.popitem(last=False)
        loaded.move_to_end(key)
        return loaded[key]

    li.load_tokenizer = load_once
    AS_IMPORTED["load_tokenizer"] = load_once  # what part1_as_written puts back after each test
    yield
    li.load_tokenizer = AS_IMPORTED["load_tokenizer"] = load_tokenizer


@pytest.fixture(autouse=True)
def part1_as_written():
    """Each test starts from Part 1 as written: names a test or main() rebound are put back."""
    yield
    for name, value in AS_IMPORTED.items():
        if vars(li).get(name) is not value:
            setattr(li, name, value)
