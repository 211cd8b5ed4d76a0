"""Each building block against an independent reference: MLX's own layers and kernels, and mlx-lm.

Every op is checked twice: the hand-written version (fused=False, the one the tutorial explains) against
MLX's reference layer, and the fused kernel the pipeline runs by default (fused=True) against the same.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models import qwen3 as mlx_lm_qwen3

import llm_inference as li

# float32 results should agree to rounding; bfloat16 keeps 8 mantissa bits (~0.4% relative error) per
# rounding, so a few roundings in a row stay within a few percent of the values' scale. A wrong formula
# (a missing scale, a swapped half, an off-by-one position) is off by O(1), far beyond either.
TOL = {mx.float32: 1e-5, mx.bfloat16: 3e-2}


def close(a, b, dtype, scale=1.0):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    assert a.shape == b.shape
    err = np.abs(a - b).max() / scale
    assert err <= TOL[dtype], f"max error {err:.3g} > {TOL[dtype]}"


def randn(*shape, dtype=mx.float32, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


DTYPES = [mx.float32, mx.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_matches_mlx(dtype, fused):
    x = randn(7, 64, dtype=dtype) * 3 + 1
    w = (1 + 0.1 * randn(64, seed=1)).astype(dtype)
    ours = li.rms_norm(x, w, 1e-6, fused=fused)
    assert ours.dtype == dtype
    close(ours, mx.fast.rms_norm(x, w, 1e-6), dtype, scale=3)
    layer = nn.RMSNorm(64, eps=1e-6)
    layer.weight = w
    close(ours, layer(x), dtype, scale=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("offset", [0, 1, 37, 4000, 40000])
def test_apply_rope_matches_nn_rope(dtype, fused, offset):
    head_dim, theta = 128, 1e6
    x = randn(4, 5, head_dim, dtype=dtype)
    expected = nn.RoPE(head_dim, traditional=False, base=theta)(x, offset=offset)
    ours = li.apply_rope(x, offset, theta, fused=fused)
    assert ours.dtype == dtype
    # A float32 angle of `offset` radians is only exact to ~offset * 1.2e-7 (its rounding step), and two
    # ways of computing the frequencies may land a few steps apart: allow that on top of the usual error.
    a, b = np.array(ours.astype(mx.float32)), np.array(expected.astype(mx.float32))
    assert np.abs(a - b).max() <= TOL[dtype] + 4 * offset * 1.2e-7 * np.abs(b).max()


def test_apply_rope_is_a_rotation_that_encodes_distance():
    """q.k after RoPE depends only on the distance between positions: the property RoPE exists for."""
    q, k = randn(1, 1, 64), randn(1, 1, 64, seed=1)
    dots = [
        (li.apply_rope(q, p + 3, 1e4, fused=False) * li.apply_rope(k, p, 1e4, fused=False)).sum().item()
        for p in (0, 10, 500)
    ]
    assert np.allclose(dots, dots[0], rtol=1e-4)
    norm_before = mx.linalg.norm(q).item()
    assert math.isclose(mx.linalg.norm(li.apply_rope(q, 123, 1e4, fused=False)).item(), norm_before, rel_tol=1e-5)


def test_rope_rotates_half_split_pairs():
    """Qwen pairs channel i with channel i + head_dim/2 ("rotate_half"), not with channel i+1."""
    x = mx.zeros((1, 1, 8)).at[0, 0, 0].add(1.0)  # unit vector on channel 0
    y = li.apply_rope(x, 1, 1.0, fused=False)[0, 0]  # theta 1: every pair turns by 1 radian at position 1
    expected = np.zeros(8)
    expected[0], expected[4] = math.cos(1), math.sin(1)
    assert np.allclose(np.array(y), expected, atol=1e-6)


def tiny_config(**overrides):
    values = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=300, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_position_embeddings=4096)
    return li.Config(**(values | overrides))


def random_weights(config, dtype=mx.float32, seed=0):
    weights = {}
    for i, (name, shape) in enumerate(li.weight_shapes(config).items()):
        if len(shape) == 1:  # norm gains near 1
            weights[name] = (1 + 0.1 * randn(*shape, seed=seed * 1000 + i)).astype(dtype)
        else:  # keep activations O(1): std 1/sqrt(fan_in)
            weights[name] = (randn(*shape, seed=seed * 1000 + i) / math.sqrt(shape[1])).astype(dtype)
    return weights


def sdpa_reference(q, k, v, offset):
    """mx.fast.scaled_dot_product_attention on (heads, seq, dim) arrays with an explicit causal mask."""
    seq, total = q.shape[1], k.shape[1]
    mask = mx.arange(total)[None, :] <= (offset + mx.arange(seq))[:, None]
    return mx.fast.scaled_dot_product_attention(
        q[None], k[None], v[None], scale=1 / math.sqrt(q.shape[-1]), mask=mask
    )[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("offset,seq", [(0, 6), (5, 3), (9, 1)])
def test_attention_matches_mlx_sdpa(dtype, fused, heads, kv_heads, offset, seq):
    """Our attention = input norm + projections + QK-norm + RoPE + MLX's SDPA with a causal mask."""
    c = tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    w = random_weights(c, dtype)
    p = "model.layers.0."
    past = randn(offset, c.hidden_size, dtype=dtype, seed=7)
    x = randn(seq, c.hidden_size, dtype=dtype, seed=8)

    cache = li.KVCache()
    li.reserve_cache(cache, c, offset, dtype)
    if offset:
        li.attention(past, w, 0, c, cache, fused)
    cache.offset = offset
    li.reserve_cache(cache, c, seq, dtype)
    ours = li.attention(x, w, 0, c, cache, fused)

    # The same computation from MLX reference pieces, over the full sequence past + x.
    full = mx.fast.rms_norm(mx.concatenate([past, x]) if offset else x, w[p + "input_layernorm.weight"], c.rms_norm_eps)

    def heads_of(name, n):
        return (full @ w[p + "self_attn." + name].T).reshape(offset + seq, n, c.head_dim).swapaxes(0, 1)

    norm = lambda t, name: mx.fast.rms_norm(t, w[p + "self_attn." + name], c.rms_norm_eps)
    rope = nn.RoPE(c.head_dim, traditional=False, base=c.rope_theta)
    q = rope(norm(heads_of("q_proj.weight", heads), "q_norm.weight"))[:, offset:]
    k = rope(norm(heads_of("k_proj.weight", kv_heads), "k_norm.weight"))
    v = heads_of("v_proj.weight", kv_heads)
    close(ours, sdpa_reference(q, k, v, offset)[None], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_nn_silu(dtype):
    x = randn(5, 64, dtype=dtype)
    gate, up, down = (randn(96, 64, seed=1) / 8).astype(dtype), (randn(96, 64, seed=2) / 8).astype(dtype), (
        randn(64, 96, seed=3) / 10).astype(dtype)
    expected = (nn.silu(x @ gate.T) * (x @ up.T)) @ down.T
    close(li.swiglu(x, gate, up, down), expected, dtype)


def mlx_lm_block(config, weights, layer=0):
    args = mlx_lm_qwen3.ModelArgs(
        model_type="qwen3", hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps, vocab_size=config.vocab_size,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings, rope_theta=config.rope_theta)
    block = mlx_lm_qwen3.TransformerBlock(args)
    prefix = f"model.layers.{layer}."
    block.load_weights([(k[len(prefix):], v) for k, v in weights.items() if k.startswith(prefix)])
    return block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_transformer_block_matches_mlx_lm(dtype, fused):
    """Prefill 7 positions then decode 2, through our block and mlx-lm's, with their own caches."""
    c = tiny_config()
    w = random_weights(c, dtype, seed=3)
    block = mlx_lm_block(c, w)
    theirs_cache = mlx_lm_cache.KVCache()
    ours_cache = li.KVCache()
    for seq in (7, 1, 1):
        x = randn(seq, c.hidden_size, dtype=dtype, seed=seq + ours_cache.offset)
        mask = "causal" if seq > 1 else None
        theirs = block(x[None], mask=mask, cache=theirs_cache)[0]
        li.reserve_cache(ours_cache, c, seq, dtype)
        ours = li.transformer_block(x, w, 0, c, ours_cache, fused)
        ours_cache.offset += seq
        close(ours, theirs, dtype, scale=float(mx.abs(theirs.astype(mx.float32)).max()))


def test_kv_cache_grows_in_chunks_and_keeps_contents():
    c = tiny_config()
    cache = li.KVCache()
    li.reserve_cache(cache, c, 3, mx.float32)
    assert cache.keys[0].shape == (1, c.num_key_value_heads, li.CACHE_CHUNK, c.head_dim)
    cache.keys[1][:, :, :3] = mx.ones((1, c.num_key_value_heads, 3, c.head_dim))
    cache.offset = 3
    li.reserve_cache(cache, c, li.CACHE_CHUNK - 3, mx.float32)  # fits exactly: no growth
    assert cache.keys[0].shape[2] == li.CACHE_CHUNK
    li.reserve_cache(cache, c, li.CACHE_CHUNK, mx.float32)  # needs 3 + 256 positions: two chunks
    assert cache.keys[1].shape[2] == 2 * li.CACHE_CHUNK and len(cache.values) == c.num_hidden_layers
    assert mx.all(cache.keys[1][:, :, :3] == 1).item() and mx.all(cache.keys[1][:, :, 3:] == 0).item()


def test_chat_prompt_matches_qwen3_template():
    assert li.chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert li.chat_prompt("Hi", system="Be brief.", think=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
