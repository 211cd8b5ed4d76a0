"""Each building block against an independent reference: MLX's own layers and kernels, and mlx-lm.

Every op is checked twice: the hand-written version (the one the tutorial explains) against MLX's
reference layer, and the fused kernel the pipeline runs by default against the same.
"""

import collections
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models import qwen3 as mlx_lm_qwen3

import llm_inference as li
from tests.kernels import kernels

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
    with kernels(fused):
        ours = li.rms_norm(x, w, 1e-6)
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
    with kernels(fused):
        ours = li.apply_rope(x, offset, theta)
    assert ours.dtype == dtype
    # A float32 angle of `offset` radians is only exact to ~offset * 1.2e-7 (its rounding step), and two
    # ways of computing the frequencies may land a few steps apart: allow that on top of the usual error.
    a, b = np.array(ours.astype(mx.float32)), np.array(expected.astype(mx.float32))
    assert np.abs(a - b).max() <= TOL[dtype] + 4 * offset * 1.2e-7 * np.abs(b).max()


def test_apply_rope_is_a_rotation_that_encodes_distance():
    """q.k after RoPE depends only on the distance between positions: the property RoPE exists for."""
    q, k = randn(1, 1, 64), randn(1, 1, 64, seed=1)
    with kernels(fused=False):
        dots = [(li.apply_rope(q, p + 3, 1e4) * li.apply_rope(k, p, 1e4)).sum().item() for p in (0, 10, 500)]
        rotated_norm = mx.linalg.norm(li.apply_rope(q, 123, 1e4)).item()
    assert np.allclose(dots, dots[0], rtol=1e-4)
    assert math.isclose(rotated_norm, mx.linalg.norm(q).item(), rel_tol=1e-5)


def test_rope_rotates_half_split_pairs():
    """Qwen pairs channel i with channel i + head_dim/2 ("rotate_half"), not with channel i+1."""
    x = mx.zeros((1, 1, 8)).at[0, 0, 0].add(1.0)  # unit vector on channel 0
    with kernels(fused=False):
        y = li.apply_rope(x, 1, 1.0)[0, 0]  # theta 1: every pair turns by 1 radian at position 1
    expected = np.zeros(8)
    expected[0], expected[4] = math.cos(1), math.sin(1)
    assert np.allclose(np.array(y), expected, atol=1e-6)


def tiny_config(**overrides):
    values = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=300, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_position_embeddings=4096)
    return li.Config(**(values | overrides))


def random_layer(config, dtype=mx.float32, seed=0):
    """One layer's weights under llm_inference's short names, and under mlx-lm's (checkpoint) names."""
    layer, named = {}, {}
    for i, (name, shape) in enumerate(li.layer_shapes(config).items()):
        short = name.split(".")[-2]  # "q_proj" for "self_attn.q_proj.weight"
        if len(shape) == 1:  # norm gains near 1
            layer[short] = (1 + 0.1 * randn(*shape, seed=seed * 1000 + i)).astype(dtype)
        else:  # keep activations O(1): std 1/sqrt(fan_in)
            layer[short] = (randn(*shape, seed=seed * 1000 + i) / math.sqrt(shape[1])).astype(dtype)
        named[name] = layer[short]
    return layer, named


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
    """Our attention = projections + QK-norm + RoPE + the cache + MLX's SDPA with a causal mask + o_proj."""
    c = tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    w, _ = random_layer(c, dtype)
    past = randn(offset, c.hidden_size, dtype=dtype, seed=7)
    x = randn(seq, c.hidden_size, dtype=dtype, seed=8)

    cache = li.KVCache()
    with kernels(fused):
        if offset:
            li.attention(past, w, c, cache)
        ours = li.attention(x, w, c, cache)
    assert cache.offset == offset + seq

    # The same computation from MLX reference pieces, over the full sequence past + x.
    full = mx.concatenate([past, x]) if offset else x

    def heads_of(name, n):
        return (full @ w[name].T).reshape(offset + seq, n, c.head_dim).swapaxes(0, 1)

    norm = lambda t, name: mx.fast.rms_norm(t, w[name], c.rms_norm_eps)
    rope = nn.RoPE(c.head_dim, traditional=False, base=c.rope_theta)
    q = rope(norm(heads_of("q_proj", heads), "q_norm"))[:, offset:]
    k = rope(norm(heads_of("k_proj", kv_heads), "k_norm"))
    v = heads_of("v_proj", kv_heads)
    out = sdpa_reference(q, k, v, offset)  # (heads, seq, head_dim)
    expected = out.swapaxes(0, 1).reshape(seq, -1) @ w["o_proj"].T
    close(ours, expected, dtype, scale=float(mx.abs(expected.astype(mx.float32)).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_nn_silu(dtype):
    x = randn(5, 64, dtype=dtype)
    gate, up, down = (randn(96, 64, seed=1) / 8).astype(dtype), (randn(96, 64, seed=2) / 8).astype(dtype), (
        randn(64, 96, seed=3) / 10).astype(dtype)
    expected = (nn.silu(x @ gate.T) * (x @ up.T)) @ down.T
    close(li.swiglu(x, {"gate_proj": gate, "up_proj": up, "down_proj": down}), expected, dtype)


def mlx_lm_block(config, named):
    args = mlx_lm_qwen3.ModelArgs(
        model_type="qwen3", hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps, vocab_size=config.vocab_size,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings, rope_theta=config.rope_theta)
    block = mlx_lm_qwen3.TransformerBlock(args)
    block.load_weights(list(named.items()))
    return block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_transformer_block_matches_mlx_lm(dtype, fused):
    """Prefill 7 positions then decode 2, through our block and mlx-lm's, with their own caches."""
    c = tiny_config()
    w, named = random_layer(c, dtype, seed=3)
    block = mlx_lm_block(c, named)
    theirs_cache = mlx_lm_cache.KVCache()
    ours_cache = li.KVCache()
    for seq in (7, 1, 1):
        x = randn(seq, c.hidden_size, dtype=dtype, seed=seq + ours_cache.offset)
        mask = "causal" if seq > 1 else None
        theirs = block(x[None], mask=mask, cache=theirs_cache)[0]
        with kernels(fused):
            ours = li.transformer_block(x, w, c, ours_cache)
        close(ours, theirs, dtype, scale=float(mx.abs(theirs.astype(mx.float32)).max()))


def test_kv_cache_grows_in_chunks_and_keeps_contents():
    cache, chunk = li.KVCache(), li.KVCache.GROWTH
    first = randn(2, 3, 16)
    keys, values = cache.update_and_fetch(first, -first)
    assert cache.keys.shape == (2, chunk, 16) and cache.offset == 3
    assert mx.array_equal(keys, first) and mx.array_equal(values, -first)
    fill = randn(2, chunk - 3, 16, seed=1)
    cache.update_and_fetch(fill, fill)  # fits exactly: no growth
    assert cache.keys.shape[1] == chunk
    more = randn(2, chunk, 16, seed=2)
    keys, values = cache.update_and_fetch(more, more)  # 2 * chunk positions: one more chunk
    assert cache.keys.shape[1] == 2 * chunk and cache.offset == 2 * chunk
    assert mx.array_equal(keys, mx.concatenate([first, fill, more], axis=1))
    assert mx.array_equal(values, mx.concatenate([-first, fill, more], axis=1))
    cache.update_and_fetch(first[:, :1], first[:, :1])  # one past two chunks: grows by one more
    assert cache.keys.shape[1] == 3 * chunk and cache.offset == 2 * chunk + 1


def test_chat_prompt_matches_qwen3_template():
    assert li.chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert li.chat_prompt("Hi", system="Be brief.", think=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Qwen's template keeps an empty system message as a (empty) system turn.
    assert li.chat_prompt("Hi", system="") == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_part1_as_written_runs_no_fused_kernel_and_use_fused_kernels_runs_them(monkeypatch):
    """--reference-ops in one process: Part 1 as written computes RMSNorm, RoPE and attention with
    its own math, never an mx.fast kernel; after use_fused_kernels() (section 12), every call of
    rms_norm, apply_rope and attend in Part 1 runs the kernel instead, with the same logits."""
    c = tiny_config()
    layers = [random_layer(c, seed=i)[0] for i in range(c.num_hidden_layers)]
    table = randn(c.vocab_size, c.hidden_size, seed=9) / 4
    weights = {"embed_tokens": table, "layers": layers, "norm": 1 + 0.1 * randn(c.hidden_size),
               "lm_head": table}
    kernels_used = collections.Counter()
    names = ("rms_norm", "rope", "scaled_dot_product_attention")

    def run():  # a prefill of 5 tokens (a causal mask) and a decode step of one (none)
        cache = li.make_cache(c)
        first = li.forward(mx.arange(5), weights, c, cache)
        return mx.stack([first, li.forward(mx.array([7]), weights, c, cache)])

    def forbidden(name):
        def kernel(*args, **kwargs):
            raise AssertionError(f"Part 1 as written ran mx.fast.{name}")
        return kernel

    for name in names:
        monkeypatch.setattr(mx.fast, name, forbidden(name))
    reference = run()
    mx.eval(reference)
    monkeypatch.undo()

    def counted(name, kernel):
        def counting(*args, **kwargs):
            kernels_used[name] += 1
            return kernel(*args, **kwargs)
        return counting

    for name in names:
        monkeypatch.setattr(mx.fast, name, counted(name, getattr(mx.fast, name)))
    li.use_fused_kernels()  # put back after the test (tests/conftest.py)
    fused = run()
    mx.eval(fused)
    # Per block and step: 4 norms (input, q, k, post-attention), 2 rotations (q, k), 1 attention;
    # then the final norm. Two steps.
    blocks = 2 * c.num_hidden_layers
    assert kernels_used == {"rms_norm": 4 * blocks + 2, "rope": 2 * blocks,
                            "scaled_dot_product_attention": blocks}
    scale = float(mx.abs(reference).max())
    assert scale > 1 and float(mx.abs(fused - reference).max()) <= 1e-4 * scale


def test_replace_refuses_a_name_part_1_does_not_have():
    """Issue 32: without its guard, replace(rms_nrom=...) added a global of that name and replaced
    nothing: Part 1 went on running its own rms_norm, and nothing said so."""
    rms_norm = li.rms_norm
    with pytest.raises(NameError, match="^no function rms_nrom to replace$"):
        li.replace(rms_nrom=li.fused_rms_norm)
    assert "rms_nrom" not in vars(li) and li.rms_norm is rms_norm
