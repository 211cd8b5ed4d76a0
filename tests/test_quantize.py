"""Quantization: each quantized product against MLX's own dequantize + matmul, --quantize against the
folder mlx-lm's converter writes, that folder loaded directly, and both against mlx-lm running it."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG, load_model, weight_bytes

CONFIGS = {"tied": TINY_CONFIG, "untied": TINY_CONFIG | {"tie_word_embeddings": False}}
MATRICES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, checkpoints):  # built once per session (tests/conftest.py)
    return checkpoints(CONFIGS[request.param], seed=1)


@pytest.fixture(scope="module", params=[4, 8])
def converted(request, folder, checkpoints):
    """(bits, the folder mlx_lm.convert writes from `folder`): 4 or 8 bits, or the "mixed_3_6" recipe
    (3 bits, 6 for some layers: settings per layer in config.json). Converted once per session."""
    recipe = request.param
    if recipe == "mixed_3_6":
        out = checkpoints.converted(folder, quantize=True, quant_predicate=recipe, q_group_size=64)
    else:
        out = checkpoints.converted(folder, quantize=True, q_bits=recipe, q_group_size=64)
    return recipe, out


def load_quantized(folder, config, dtype, bits=None):
    """load_weights() with section 16's replacements: each matrix quantized to `bits` as it is read,
    or read as stored quantized (config.json's "quantization"), as load_model() makes them. Part 1's
    load_tensor is put back afterwards, so that a later load in the same test reads floats again
    (linear() and embed() stay replaced: they take plain arrays too)."""
    as_before = li.load_tensor
    li.use_quantization(bits, cli.check_config(folder, li.Config.__annotations__))
    try:
        return li.load_weights(folder, config, dtype)
    finally:
        li.load_tensor = as_before


def checkpoint_names(config):
    """{short name: name after "model.layers.{i}."}: "q_proj": "self_attn.q_proj.weight"."""
    return {name.split(".")[-2]: name for name in li.layer_shapes(config)}


@pytest.fixture(scope="module")
def mlx_lm_loaded():
    """load(folder): mlx_lm.load(folder), that is (model, tokenizer), loaded again only when the
    folder changes (pytest runs the tests of one converted folder in a row). The tests all run the
    model in float32 (set_dtype, the same each time) and only read it and its tokenizer."""
    last = {}

    def load(folder):
        if folder not in last:
            last.clear()  # one at a time: each holds a tokenizer of ~150 MB
            last[folder] = mlx_lm_load(str(folder))
        return last[folder]

    return load


def dequantized(q):
    return mx.dequantize(q.packed, q.scales, q.biases, group_size=q.group_size, bits=q.bits)


def relative_error(approximate, exact):
    return float(mx.linalg.norm(approximate - exact) / mx.linalg.norm(exact))


@pytest.mark.parametrize("bits", [4, 8])
def test_each_quantized_product_is_dequantize_then_matmul(folder, bits):
    config = li.load_config(folder)
    weights = load_quantized(folder, config, mx.float32, bits)
    stored = mx.load(str(folder / "model.safetensors"))
    x = mx.random.normal((3, config.hidden_size), key=mx.random.key(0))
    for i, layer in enumerate(weights["layers"]):
        for short in MATRICES:
            q = layer[short]
            assert isinstance(q, li.Quantized) and (q.bits, q.group_size) == (bits, 64)
            assert q.packed.dtype == mx.uint32 and q.scales.dtype == q.biases.dtype == mx.float32
            w = dequantized(q)  # (out, in)
            x_in = mx.random.normal((3, w.shape[1]), key=mx.random.key(i))
            exact = x_in @ w.T
            assert float(mx.abs(li.linear(x_in, q) - exact).max()) < 1e-4 * float(mx.abs(exact).max())
            # The product is close to the checkpoint's own, not equal to it: within 2x what rounding
            # normal weights costs (a group of 64 spans about 4.8 std; error = level / sqrt(12)).
            name = checkpoint_names(config)[short]
            original = stored[f"model.layers.{i}.{name}"].astype(mx.float32)
            error = relative_error(exact, x_in @ original.T)
            assert 0 < error < {4: 0.2, 8: 0.012}[bits]
        for short in set(checkpoint_names(config)) - set(MATRICES):  # norms stay as they are
            assert layer[short].dtype == mx.float32 and not isinstance(layer[short], li.Quantized)
    table = weights["embed_tokens"]
    ids = mx.array([785, 6722, 315, 151645])
    assert mx.array_equal(li.embed(ids, table), dequantized(table)[ids])  # only these rows unpacked
    head = weights["lm_head"]
    if config.tie_word_embeddings:
        assert head is table
    exact = x @ dequantized(head).T
    assert float(mx.abs(li.linear(x, head) - exact).max()) < 1e-4 * float(mx.abs(exact).max())


def test_quantize_at_load_equals_mlx_lm_convert(folder, converted):
    bits, out = converted
    config = li.load_config(folder)
    theirs = mx.load(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits
    for dtype in (mx.bfloat16, mx.float32):  # the checkpoint's dtype, and float32 activations
        ours = load_quantized(folder, config, dtype, bits)
        named = {"model.embed_tokens": ours["embed_tokens"], "model.norm": ours["norm"]}
        if not config.tie_word_embeddings:
            named["lm_head"] = ours["lm_head"]
        for i, layer in enumerate(ours["layers"]):
            named |= {f"model.layers.{i}.{name[:-len('.weight')]}": layer[short]
                      for short, name in checkpoint_names(config).items()}
        assert sorted(f"{name}.{part}" for name, t in named.items()
                      for part in (["weight", "scales", "biases"] if isinstance(t, li.Quantized) else ["weight"])
                      ) == sorted(theirs)
        for name, t in named.items():
            if isinstance(t, li.Quantized):
                assert mx.array_equal(t.packed, theirs[f"{name}.weight"])  # the same integers
                for part in ("scales", "biases"):  # bfloat16 in the file: exact in float32 too
                    assert getattr(t, part).dtype == dtype
                    assert mx.array_equal(getattr(t, part), theirs[f"{name}.{part}"].astype(dtype))
            else:
                assert mx.array_equal(t, theirs[f"{name}.weight"].astype(dtype))


def equal_weights(a, b):
    if isinstance(a, li.Quantized):
        return (a.group_size, a.bits) == (b.group_size, b.bits) and all(
            mx.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a[:3], b[:3]))
    return mx.array_equal(a, b) and a.dtype == b.dtype


@pytest.mark.parametrize("bits", [4, 8])
def test_load_model_with_bits_loads_what_load_quantized_loads(folder, bits):
    """--quantize: load_model() makes section 16's replacements itself, with the same weights."""
    config, weights, _, _ = load_model(folder, mx.float32, bits)
    expected = load_quantized(folder, config, mx.float32, bits)
    assert isinstance(weights["embed_tokens"], li.Quantized)
    assert (weights["lm_head"] is weights["embed_tokens"]) == config.tie_word_embeddings
    for key in ("embed_tokens", "norm", "lm_head"):
        assert equal_weights(weights[key], expected[key]), key
    for ours, theirs in zip(weights["layers"], expected["layers"]):
        assert all(equal_weights(ours[short], theirs[short]) for short in checkpoint_names(config))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_converted_folder_loads_as_quantized_at_load(folder, converted, dtype):
    bits, out = converted
    config = li.load_config(out)
    assert config == li.load_config(folder)
    direct = load_quantized(out, config, dtype)
    at_load = load_quantized(folder, config, dtype, bits)
    assert isinstance(direct["embed_tokens"], li.Quantized)
    assert (direct["lm_head"] is direct["embed_tokens"]) == config.tie_word_embeddings
    for key in ("embed_tokens", "norm", "lm_head"):
        assert equal_weights(direct[key], at_load[key]), key
    for ours, theirs in zip(direct["layers"], at_load["layers"]):
        assert all(equal_weights(ours[short], theirs[short]) for short in checkpoint_names(config))


@pytest.mark.parametrize("converted, source", [(4, "at load"), (8, "at load"), (4, "converted"),
                                               (8, "converted"), ("mixed_3_6", "converted")],
                         indirect=["converted"])
def test_quantized_model_matches_mlx_lm_on_the_converted_folder(folder, converted, source,
                                                                 mlx_lm_loaded):
    bits, out = converted
    config = li.load_config(folder)
    if source == "at load":  # --quantize on the original checkpoint
        weights = load_quantized(folder, config, mx.float32, bits)
    else:  # the converted folder, read as it is
        weights = load_quantized(out, config, mx.float32)
    model, tokenizer = mlx_lm_loaded(out)
    model.set_dtype(mx.float32)  # scales, biases and norms; the packed integers stay uint32
    ids = tokenizer.encode(PROMPT)
    theirs = model(mx.array(ids)[None])[0]  # (seq, vocab)
    ours = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
    assert float(theirs.abs().max()) > 1
    assert float(mx.abs(ours - theirs).max()) < 1e-4
    ours_tokens = [t for t, _ in li.generate(ids, weights, config, max_tokens=40)]
    theirs_tokens = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]
    assert len(set(ours_tokens)) > 3
    assert ours_tokens == theirs_tokens


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_memory_check_counts_the_quantized_bytes(folder, bits, dtype):
    config = li.load_config(folder)
    weights = load_quantized(folder, config, dtype, bits)
    loaded = {id(w): w for w in [weights["embed_tokens"], weights["norm"], weights["lm_head"],
                                 *(w for layer in weights["layers"] for w in layer.values())]}
    arrays = [a for w in loaded.values() for a in (w[:3] if isinstance(w, li.Quantized) else [w])]
    assert weight_bytes(config, dtype, bits) == sum(a.nbytes for a in arrays)


# ------------------------------------------------------------------------------------------------
# Folders stored quantized with other settings: groups of 32 and 128, mixed precision; read by the
# program's own loader (load_model: the folder checks, the memory check), not only load_quantized
# ------------------------------------------------------------------------------------------------

# Groups of 128 need rows of 128: a wider model (every matrix quantized), and TINY_CONFIG, whose
# 64-wide rows mlx-lm leaves in bfloat16 (only down_proj, 128 wide, is quantized).
WIDE_CONFIG = TINY_CONFIG | {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}
STORED = {  # name: (config, mlx_lm.convert arguments)
    "4-bit-groups-of-32": (TINY_CONFIG, dict(q_bits=4, q_group_size=32)),
    "4-bit-groups-of-128": (WIDE_CONFIG, dict(q_bits=4, q_group_size=128)),
    "4-bit-groups-of-128-partly": (TINY_CONFIG, dict(q_bits=4, q_group_size=128)),
    "mixed_3_6": (TINY_CONFIG, dict(quant_predicate="mixed_3_6", q_group_size=64)),
}


@pytest.fixture(scope="module", params=list(STORED))
def stored(request, checkpoints, mlx_lm_loaded):
    """(the checkpoint, the folder mlx_lm.convert writes from it, mlx-lm's settings per matrix).
    Built and converted once per session (tests/conftest.py)."""
    config, arguments = STORED[request.param]
    folder = checkpoints(config, seed=1)
    out = checkpoints.converted(folder, quantize=True, **arguments)
    model, _ = mlx_lm_loaded(out)
    settings = {name: (module.group_size, module.bits) for name, module in model.named_modules()
                if hasattr(module, "group_size")}  # mlx-lm's QuantizedLinear and QuantizedEmbedding
    return folder, out, settings


def test_a_differing_stored_head_is_quantized_too(checkpoints):
    """Bug: with --quantize, a tied config's different stored lm_head.weight stayed in floats."""
    folder = checkpoints(TINY_CONFIG, tied_head="different")
    _, weights, _, _ = load_model(folder, mx.float32, 4)
    assert isinstance(weights["lm_head"], li.Quantized) and weights["lm_head"].bits == 4
    assert weights["lm_head"] is not weights["embed_tokens"]


def named_matrices(weights, config):
    named = {"model.embed_tokens": weights["embed_tokens"]}
    if not config.tie_word_embeddings:
        named["lm_head"] = weights["lm_head"]
    for i, layer in enumerate(weights["layers"]):
        named |= {f"model.layers.{i}.{name.removesuffix('.weight')}": layer[short]
                  for short, name in checkpoint_names(config).items() if short in MATRICES}
    return named


def test_stored_group_sizes_and_mixed_precision_match_mlx_lm(stored, mlx_lm_loaded):
    folder, out, settings = stored
    config = li.load_config(out)
    weights = load_quantized(out, config, mx.float32)
    ours = {name: (w.group_size, w.bits) for name, w in named_matrices(weights, config).items()
            if isinstance(w, li.Quantized)}
    assert ours == settings  # the same matrices quantized, each with mlx-lm's group size and bits
    model, tokenizer = mlx_lm_loaded(out)
    model.set_dtype(mx.float32)
    ids = tokenizer.encode(PROMPT)
    theirs = model(mx.array(ids)[None])[0]
    logits = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
    assert float(theirs.abs().max()) > 1
    assert float(mx.abs(logits - theirs).max()) < 1e-4
    ours_tokens = [t for t, _ in li.generate(ids, weights, config, max_tokens=40)]
    assert len(set(ours_tokens)) > 3
    assert ours_tokens == [t for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]


def loaded_bytes(weights):
    loaded = {id(w): w for w in [weights["embed_tokens"], weights["norm"], weights["lm_head"],
                                 *(w for layer in weights["layers"] for w in layer.values())]}
    return sum(a.nbytes for w in loaded.values() for a in (w[:3] if isinstance(w, li.Quantized) else [w]))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_load_model_reads_a_stored_folder_and_counts_its_bytes(stored, dtype, monkeypatch):
    """The CLI's loader: its checks of the folder pass, it loads what load_quantized loads, and its
    memory check counts exactly the bytes loaded, refusing one byte less memory."""
    _, out, _ = stored
    direct = load_quantized(out, li.load_config(out), dtype)
    needed = loaded_bytes(direct)
    monkeypatch.setattr(cli, "gpu_working_set", lambda: None)
    monkeypatch.setattr(cli, "memory_size", lambda: needed - 1)
    with pytest.raises(cli.UserError, match="the weights need"):
        load_model(out, dtype)
    monkeypatch.setattr(cli, "memory_size", lambda: needed)
    config, weights, _, _ = load_model(out, dtype)
    assert config == li.load_config(out)
    for key in ("embed_tokens", "norm", "lm_head"):
        assert equal_weights(weights[key], direct[key]), key
    for ours, theirs in zip(weights["layers"], direct["layers"]):
        assert all(equal_weights(ours[short], theirs[short]) for short in checkpoint_names(config))
