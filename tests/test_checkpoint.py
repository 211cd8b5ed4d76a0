"""Synthetic checkpoints must load like real Qwen3 ones in mlx-lm and transformers.

These test the fixture builder (tests/checkpoint.py), not llm_inference.py: the other tests compare
the script with the references on these checkpoints. They are not counted among the tests of the
script."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import torch
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from safetensors import safe_open
from transformers import Qwen3ForCausalLM

from tests.checkpoint import (
    QWEN3_0_6B_CONFIG,
    QWEN3_GENERATION_CONFIG,
    TINY_CONFIG,
    weight_shapes,
    write_checkpoint,
)

PROMPT = "The capital of France is"
PROMPT_IDS = [785, 6722, 315, 9625, 374]


@pytest.fixture(scope="session")
def tiny(tiny_model):  # tests/conftest.py: write_checkpoint(folder, TINY_CONFIG), built once
    return tiny_model


@pytest.fixture(scope="session")
def tiny_f32(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny_f32"), TINY_CONFIG, dtype="float32")


@pytest.fixture(scope="session")
def tiny_mlx(tiny):
    """(model, tokenizer) from mlx-lm; loading the tokenizer takes a second or two."""
    return mlx_lm.load(str(tiny))


def read_tensors(folder):
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}


def test_files(tiny):
    names = sorted(p.name for p in tiny.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tiny / "config.json").read_text())
    assert config == {**QWEN3_0_6B_CONFIG, **TINY_CONFIG}
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert generation == QWEN3_GENERATION_CONFIG


def test_real_shape_has_qwen3_0_6b_parameter_count():
    shapes = weight_shapes(QWEN3_0_6B_CONFIG)
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == 596_049_920
    assert "lm_head.weight" not in shapes  # tied to the embeddings


def test_tensor_names_shapes_and_dtype(tiny):
    metadata, tensors = read_tensors(tiny)
    assert metadata == {"format": "pt"}
    expected = weight_shapes({**QWEN3_0_6B_CONFIG, **TINY_CONFIG})
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "model.layers.1.self_attn.q_norm.weight" in tensors


def test_float32_and_untied(tmp_path):
    folder = write_checkpoint(tmp_path, {**TINY_CONFIG, "tie_word_embeddings": False}, dtype="float32")
    _, tensors = read_tensors(folder)
    assert tensors["lm_head.weight"].shape == (151936, 64)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
    model, info = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_seed_determinism(tmp_path, tiny):
    same = write_checkpoint(tmp_path / "same", TINY_CONFIG, seed=0)
    other = write_checkpoint(tmp_path / "other", TINY_CONFIG, seed=1)
    weights = (tiny / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_loads_in_mlx_lm(tiny_mlx):
    model, tokenizer = tiny_mlx
    assert tokenizer.encode(PROMPT) == PROMPT_IDS
    logits = model(mx.array([PROMPT_IDS]))
    assert logits.shape == (1, len(PROMPT_IDS), 151936)
    assert mx.all(mx.isfinite(logits)).item()


def test_loads_in_transformers(tiny):
    model, info = Qwen3ForCausalLM.from_pretrained(tiny, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits
    assert torch.isfinite(logits).all()


def test_transformers_tokenizer(hf_tokenizer):
    tokenizer = hf_tokenizer  # tests/conftest.py: AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token_id == 151643
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_mlx_lm_and_transformers_agree(tiny_f32):
    """Both libraries read the same weights the same way (float32: tight tolerance)."""
    mlx_model, _ = mlx_lm_load_model(tiny_f32)  # mlx_lm.load without its tokenizer (seconds)
    mlx_logits = np.array(mlx_model(mx.array([PROMPT_IDS]))[0])
    hf_model = Qwen3ForCausalLM.from_pretrained(tiny_f32, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([PROMPT_IDS])).logits[0].numpy()
    np.testing.assert_allclose(mlx_logits, hf_logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("prompt", [PROMPT, "def fibonacci(n):\n    ", "我喜欢吃"])
def test_random_model_is_not_degenerate(tiny_mlx, prompt):
    """Greedy decoding gives varied tokens; the model is confident but not certain."""
    model, tokenizer = tiny_mlx
    tokens, top1 = [], []
    steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=32)
    for token, logprobs in steps:
        tokens.append(int(token))
        top1.append(mx.exp(logprobs.max()).item())
    assert len(tokens) == 32
    assert len(set(tokens)) >= 8
    assert 0.01 < np.median(top1) < 0.9


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_checkpoint_is_the_single_file_split(tmp_path, tie):
    """shards=3 writes Hugging Face's layout: transformers reads it through the index, with the same
    tensors as the single-file checkpoint of the same seed."""
    overrides = {**TINY_CONFIG, "tie_word_embeddings": tie}
    single = write_checkpoint(tmp_path / "single", overrides, seed=7)
    sharded = write_checkpoint(tmp_path / "sharded", overrides, seed=7, shards=3)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == names
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    _, tensors = read_tensors(single)
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in tensors.values())}
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(names)
    for name, file in index["weight_map"].items():
        with safe_open(sharded / file, framework="pt") as f:
            assert torch.equal(f.get_tensor(name), tensors[name]), name
    model, info = Qwen3ForCausalLM.from_pretrained(sharded, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, tensors.get(name, tensors["model.embed_tokens.weight"]).float()), name
