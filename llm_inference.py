"""How an LLM really generates text: Qwen3-0.6B from its released files, with MLX, in one file.

Read it top to bottom; every section is one step of the pipeline:

    "The capital of France is"
      -> 1. load     config.json + model.safetensors + tokenizer.json
      -> 2. tokenize [785, 6722, 315, 9625, 374]
      -> 3. embed    one 1024-number vector per token                        (seq, 1024)
      -> 8. 28 x transformer block:
           4. RMSNorm   5. RoPE   6. attention (GQA, QK-norm, KV cache)   7. SwiGLU feed-forward
      -> 9. final norm + LM head   one score per vocabulary entry          (151936,)
      -> 10. sample   " Paris"
      -> 11. generate: feed " Paris" back in, repeat until <|im_end|>

Shapes are written without a batch dimension, as we generate one sequence at a time (inside attention a
leading 1 stands for it, because MLX's attention kernel wants one). Where MLX has a fused kernel for a step
(RMSNorm, RoPE, attention), the function spells out the math and runs the kernel unless fused=False
(--reference-ops); the tests prove the two equal.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

HF_REPO = "Qwen/Qwen3-0.6B"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # the other two are optional extras


class UserError(Exception):
    """A mistake a person can fix (bad flag, missing file, ...): printed as one line, no traceback."""


# ------------------------------------------------------------------------------------------------
# 1. Load: the hyper-parameters from config.json, the weights from model.safetensors
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    hidden_size: int  # 1024: width of the "residual stream" every layer reads and adds to
    num_hidden_layers: int  # 28 transformer blocks
    num_attention_heads: int  # 16 query heads ...
    num_key_value_heads: int  # ... sharing 8 key/value heads (grouped-query attention)
    head_dim: int  # 128; note 16 * 128 = 2048 != 1024: Qwen3 sets it explicitly
    intermediate_size: int  # 3072: width of the SwiGLU feed-forward
    vocab_size: int  # 151936 rows in the embedding table
    rope_theta: float  # 1e6: base of the rotary position frequencies
    rms_norm_eps: float  # 1e-6: keeps RMSNorm from dividing by zero
    tie_word_embeddings: bool  # True: the LM head reuses the embedding table
    max_position_embeddings: int  # 40960: the longest sequence the config allows (prompt + reply)


def load_config(model_dir):
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; re-download it")
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download it")
    if not isinstance(raw, dict) or raw.get("model_type") != "qwen3":
        found = raw.get("model_type") if isinstance(raw, dict) else None
        raise UserError(f"{path} is not a Qwen3 config (model_type is {found!r}, expected 'qwen3')")
    # transformers >= 5 writes rope_theta inside a "rope_parameters" dict.
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if raw.get("rope_scaling") or (raw.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise UserError(f"{path} asks for RoPE scaling, which this script does not implement")
    values = {}
    for name, kind in Config.__annotations__.items():  # kind: int, float or bool
        if raw.get(name) is None:
            raise UserError(f"{path} lacks the required key {name!r}")
        try:
            values[name] = kind(raw[name])
        except (TypeError, ValueError):
            raise UserError(f"{path}: {name!r} should be a number, got {raw[name]!r}")
    return Config(**values)


def weight_shapes(config):
    """Every tensor the model needs, by its name in the Hugging Face checkpoint, with its shape."""
    c = config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_dim, c.hidden_size),  # Linear weights are (out, in)
            p + "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_dim, c.hidden_size),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_dim),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
    return shapes


def load_weights(model_dir, config, dtype):
    """Name -> array, checked against the config and converted to `dtype` (the file stores bfloat16)."""
    path = Path(model_dir) / "model.safetensors"
    try:
        path.open("rb").close()  # a permission problem is not a damaged file: say which it is
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}")
    try:
        tensors = mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e}); re-download it")
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name not in tensors:
            raise UserError(f"{path} lacks the tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
        weights[name] = tensors[name].astype(dtype)
    # Tied embeddings: the LM head *is* the embedding table, so no "lm_head.weight" is kept (any copy
    # in the file is dropped above): 151936 x 1024 numbers saved, 311 MB in bfloat16.
    try:
        mx.eval(weights)  # read the file now, so a truncated download fails here and not mid-sentence
    except RuntimeError as e:
        raise UserError(f"{path} is damaged ({e}); re-download it")
    return weights


def load_tokenizer(model_dir):
    path = Path(model_dir) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception for any unreadable file
        raise UserError(f"cannot load {path} ({e}); re-download it")


def load_generation_config(model_dir):
    """generation_config.json: the end-of-sequence ids and Qwen's recommended sampling settings (optional)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        generation_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} ({e}); delete or re-download it")
    if not isinstance(generation_config, dict):
        raise UserError(f"{path} is not a JSON object; delete or re-download it")
    return generation_config


def eos_token_ids(generation_config, tokenizer):
    """Ids that end a reply: <|im_end|> (151645) ends a chat turn, <|endoftext|> (151643) a document."""
    ids = generation_config.get("eos_token_id", [])
    ids = set(ids if isinstance(ids, list) else [ids])
    for token in ("<|im_end|>", "<|endoftext|>"):
        if tokenizer.token_to_id(token) is not None:
            ids.add(tokenizer.token_to_id(token))
    return ids


# ------------------------------------------------------------------------------------------------
# 2. Tokenize: text -> integer ids (byte-level BPE, in tokenizer.json)
# ------------------------------------------------------------------------------------------------

def tokenize(tokenizer, text):
    """Split text into pieces of the vocabulary: "The capital of France is" -> [785, 6722, 315, 9625, 374].

    Byte-level BPE: the text is cut into word-like chunks, and each chunk's UTF-8 bytes are merged pair by
    pair, following the merge list learned in training (in tokenizer.json), until no merge applies. Any
    string, emoji included, has an encoding; common words are one token, leading space included (" Paris").
    """
    return tokenizer.encode(text).ids


def chat_prompt(user, system=None, think=True):
    """Qwen3's chat format, written out by hand: each turn is <|im_start|>role\\n ... <|im_end|>\\n.

    The text ends by opening the assistant's turn, so the model's most likely continuation is a reply.
    Qwen3 first "thinks" inside <think>...</think>; an empty think block (what Qwen's template emits for
    enable_thinking=False) tells it to answer directly.
    """
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return text if think else text + "<think>\n\n</think>\n\n"


# ------------------------------------------------------------------------------------------------
# 3. Embed: each id picks one row of the embedding table
# ------------------------------------------------------------------------------------------------

def embed(token_ids, embed_tokens):
    return embed_tokens[token_ids]  # (seq,) ids -> (seq, 1024)


# ------------------------------------------------------------------------------------------------
# 4. RMSNorm: rescale each vector to unit root-mean-square, then by a learned per-channel gain
# ------------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps, fused=True):
    if fused:  # mx.fast.rms_norm runs the three lines below as one kernel; tests prove them equal
        return mx.fast.rms_norm(x, weight, eps)
    x32 = x.astype(mx.float32)  # square and average in float32: bfloat16 keeps only 8 significant bits
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# 5. RoPE: encode a token's position by rotating pairs of its query/key channels
# ------------------------------------------------------------------------------------------------

def apply_rope(x, offset, theta, fused=True):
    """Rotate x (..., seq, head_dim), whose first position sits at absolute position `offset`.

    Channel i is paired with channel i + head_dim/2 (the "half-split" layout of Hugging Face's rotate_half,
    traditional=False in MLX; the RoPE paper pairs adjacent channels), and the pair is rotated by the angle
    position * theta^(-2i/head_dim): fast-turning pairs resolve nearby tokens, slow ones far-away tokens.
    Because rotations compose, the dot product of a rotated query and key depends on their two positions
    only through their distance, which is what attention needs.
    """
    head_dim = x.shape[-1]
    if fused:  # one kernel computing exactly the lines below (see tests/test_ops.py)
        return mx.fast.rope(x, head_dim, traditional=False, base=theta, scale=1.0, offset=offset)
    inv_freq = theta ** (-mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (64,)
    positions = (offset + mx.arange(x.shape[-2])).astype(mx.float32)  # (seq,); offset may be an mx.array
    angles = positions[:, None] * inv_freq[None, :]  # (seq, 64)
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ------------------------------------------------------------------------------------------------
# 6. Attention, with grouped-query heads, QK-norm and a KV cache
# ------------------------------------------------------------------------------------------------

CACHE_CHUNK = 256  # the cache grows 256 positions at a time: one copy per chunk, not one per token


@dataclass
class KVCache:
    """The keys and values of every past position, per layer, so each new token only computes its own.

    Without it, producing token n would rerun all n previous tokens through every layer; with it, a step
    projects only the new token, and only attention still reads all n cached keys: O(n) work per step
    instead of O(n^2).
    Buffers are preallocated (1, kv_heads, capacity, head_dim) and written in place; `offset` positions
    are filled. (The leading 1 is the batch axis MLX's attention kernel expects; kept here so no step has
    to add it.) Qwen3-0.6B: 28 layers x 2 (K and V) x 8 heads x 128 x 2 bytes = 112 KiB per token (bf16).
    """

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    offset: int = 0


def reserve_cache(cache, config, n_new, dtype):
    """Make room for n_new more positions, growing every layer's buffers by whole chunks."""
    capacity = cache.keys[0].shape[2] if cache.keys else 0
    if cache.offset + n_new <= capacity:
        return
    extra = math.ceil((cache.offset + n_new - capacity) / CACHE_CHUNK) * CACHE_CHUNK
    shape = (1, config.num_key_value_heads, extra, config.head_dim)
    if not cache.keys:
        cache.keys = [mx.zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
        cache.values = [mx.zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
    else:
        cache.keys = [mx.concatenate([k, mx.zeros(shape, dtype)], axis=2) for k in cache.keys]
        cache.values = [mx.concatenate([v, mx.zeros(shape, dtype)], axis=2) for v in cache.values]


# Speed: decoding one token runs ~40 small operations per layer, each far too small to keep a GPU busy,
# so their fixed cost (Python building the graph, one kernel launch each) limits tokens per second, not
# arithmetic. mx.compile traces a function once per input shape and afterwards replays it as one call,
# fusing element-wise operations into single kernels. So a block is cut into three: qkv_heads and
# block_output (section 8) are compiled; only the cache work in between runs op by op, because its shapes
# change at every position. Compiled functions take arrays and plain numbers, hence explicit parameters.

@mx.compile
def qkv_heads(x, input_layernorm, q_proj, k_proj, v_proj, q_norm, k_norm, offset, n_heads, n_kv_heads, eps,
              theta, fused=True):
    """Queries (1, heads, seq, head_dim) and keys, values (1, kv_heads, seq, head_dim) for x (seq, 1024)."""
    seq, head_dim = x.shape[0], q_norm.shape[0]
    x = rms_norm(x, input_layernorm, eps, fused)  # pre-norm: see transformer_block
    # Project, split the last axis into heads, and put the head axis before the positions (after the
    # batch axis of 1 that attention kernels expect).
    q = (x @ q_proj.T).reshape(1, seq, n_heads, head_dim).swapaxes(1, 2)  # (1, 16, seq, 128)
    k = (x @ k_proj.T).reshape(1, seq, n_kv_heads, head_dim).swapaxes(1, 2)  # (1, 8, seq, 128)
    v = (x @ v_proj.T).reshape(1, seq, n_kv_heads, head_dim).swapaxes(1, 2)  # (1, 8, seq, 128)
    # QK-norm (new in Qwen3): RMS-normalise each head's query and key so their dot products cannot blow up.
    # It comes *before* RoPE: the learned per-channel gain must see channels in a fixed frame, and the
    # rotation then mixes channel pairs by position, keeping the norm it just set.
    q = apply_rope(rms_norm(q, q_norm, eps, fused), offset, theta, fused)
    k = apply_rope(rms_norm(k, k_norm, eps, fused), offset, theta, fused)
    return q, k, v


def attention(x, weights, layer, config, cache, fused=True):
    """The attention heads of layer `layer` for x (seq, 1024) at positions cache.offset, ...: (1, 16, seq, 128).

    Each position's query is compared with the keys of itself and every earlier position; the softmax of
    those scores weights the matching values. block_output projects the heads back to 1024 numbers.
    """
    c, p = config, f"model.layers.{layer}."
    seq, offset = x.shape[0], cache.offset
    q, k, v = qkv_heads(x, weights[p + "input_layernorm.weight"], weights[p + "self_attn.q_proj.weight"],
                        weights[p + "self_attn.k_proj.weight"], weights[p + "self_attn.v_proj.weight"],
                        weights[p + "self_attn.q_norm.weight"], weights[p + "self_attn.k_norm.weight"],
                        mx.array(offset),  # an array, not a constant, so one compiled trace serves every position
                        c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, c.rope_theta, fused)
    # Append this step's keys/values to the cache (in place), then attend over all positions so far.
    cache.keys[layer][:, :, offset : offset + seq] = k
    cache.values[layer][:, :, offset : offset + seq] = v
    k = cache.keys[layer][:, :, : offset + seq]  # (1, 8, total, 128), total = offset + seq
    v = cache.values[layer][:, :, : offset + seq]
    scale = 1 / math.sqrt(c.head_dim)  # keeps the dot products' variance ~1 whatever head_dim is

    # A single new token is the last position: it may see every cached key, so it needs no mask.
    if fused:  # one kernel for the lines below: it handles the head groups and the mask itself
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if seq > 1 else None)
    # Grouped-query attention: 16 query heads share 8 KV heads, 2 each. View q as (8 groups, 2, ...) and let
    # broadcasting pair each group with its KV head: the cache stores 8 heads, not 16, halving its memory,
    # and nothing is copied (no `repeat`).
    group = c.num_attention_heads // c.num_key_value_heads
    q = q.reshape(c.num_key_value_heads, group, seq, c.head_dim)  # (8, 2, seq, 128)
    k, v = k.swapaxes(0, 1), v.swapaxes(0, 1)  # (8, 1, total, 128): one KV head per group
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (8, 2, seq, total)
    if seq > 1:  # causal mask: the query at position offset+i may look at keys 0 ... offset+i only
        allowed = mx.arange(offset + seq)[None, :] <= (offset + mx.arange(seq))[:, None]  # (seq, total)
        scores = mx.where(allowed, scores, -mx.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)  # exp/sum in float32
    return (probs @ v).reshape(1, c.num_attention_heads, seq, c.head_dim)  # (1, 16, seq, 128)


# ------------------------------------------------------------------------------------------------
# 7. SwiGLU feed-forward: a gated two-layer MLP applied to each position on its own
# ------------------------------------------------------------------------------------------------

def swiglu(x, gate_proj, up_proj, down_proj):
    gate = x @ gate_proj.T  # (seq, 3072)
    up = x @ up_proj.T  # (seq, 3072)
    # silu(g) = g * sigmoid(g) decides, per channel, how much of `up` passes through.
    return (gate * mx.sigmoid(gate) * up) @ down_proj.T  # (seq, 1024)


# ------------------------------------------------------------------------------------------------
# 8. Transformer block: attention then feed-forward, each on a normalised copy added back (residual)
# ------------------------------------------------------------------------------------------------

@mx.compile
def block_output(x, heads, o_proj, post_attention_layernorm, gate_proj, up_proj, down_proj, eps, fused=True):
    """The rest of a block after attention: project the heads back and add, then the feed-forward sub-layer."""
    heads = heads[0].swapaxes(0, 1).reshape(x.shape[0], -1)  # concatenate the heads: (seq, 16 * 128)
    x = x + heads @ o_proj.T  # (seq, 2048) -> (seq, 1024), added to the residual stream
    return x + swiglu(rms_norm(x, post_attention_layernorm, eps, fused), gate_proj, up_proj, down_proj)


def transformer_block(x, weights, layer, config, cache, fused=True):
    """x (seq, 1024) -> x + attention(norm(x)) -> that + swiglu(norm(that)), keeping the shape.

    Pre-norm: each sub-layer reads a normalised copy of the residual stream x and *adds* its result to x,
    never normalising x itself, so information (and, in training, gradient) flows straight from the
    embedding to the last layer.
    """
    p = f"model.layers.{layer}."
    heads = attention(x, weights, layer, config, cache, fused)  # normalises x itself (in qkv_heads)
    return block_output(x, heads, weights[p + "self_attn.o_proj.weight"],
                        weights[p + "post_attention_layernorm.weight"], weights[p + "mlp.gate_proj.weight"],
                        weights[p + "mlp.up_proj.weight"], weights[p + "mlp.down_proj.weight"],
                        config.rms_norm_eps, fused)


# ------------------------------------------------------------------------------------------------
# 9. Forward: embed -> 28 blocks -> final norm -> LM head
# ------------------------------------------------------------------------------------------------

def forward(token_ids, weights, config, cache, last_only=True, fused=True):
    """Logits for the positions of token_ids (seq,), which continue the sequence held in `cache`.

    Returns (vocab,) scores for the next token, or (seq, vocab) for every position if not last_only.
    """
    x = embed(token_ids, weights["model.embed_tokens.weight"])  # (seq, 1024)
    reserve_cache(cache, config, len(token_ids), x.dtype)
    for layer in range(config.num_hidden_layers):
        x = transformer_block(x, weights, layer, config, cache, fused)
    cache.offset += len(token_ids)
    if last_only:  # generation only needs the next token: skip (seq-1) x 151936 useless dot products
        x = x[-1]
    x = rms_norm(x, weights["model.norm.weight"], config.rms_norm_eps, fused)
    head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return x @ head.T  # (vocab,) or (seq, vocab): a score (logit) per token; softmax makes probabilities


# ------------------------------------------------------------------------------------------------
# 10. Sample: pick the next token from the logits
# ------------------------------------------------------------------------------------------------

def sample(logits, temperature, top_k, top_p, key):
    """Temperature 0 = greedy (argmax). Otherwise softmax(logits / temperature), restricted to the top_k
    most likely tokens (0 = no limit), then to the smallest set of those whose renormalised probability
    reaches top_p (the token that crosses the threshold is kept), as Hugging Face transformers does;
    renormalised again and sampled with the random `key`."""
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    logits = logits.astype(mx.float32) / temperature  # < 1 sharpens the distribution, > 1 flattens it
    if 0 < top_k < logits.shape[-1]:  # only the k largest can survive: sort those, not all 151936
        candidates = mx.argpartition(-logits, top_k - 1)[:top_k]
    else:  # no top-k: the whole vocabulary is sorted (top-p needs the order)
        candidates = mx.arange(logits.shape[-1])
    order = candidates[mx.argsort(-logits[candidates])]  # token ids, most likely first
    sorted_logits = logits[order]
    if top_p < 1:
        probs = mx.softmax(sorted_logits)
        # Keep a token if the tokens strictly more likely than it sum to less than top_p.
        sorted_logits = mx.where(mx.cumsum(probs) - probs < top_p, sorted_logits, -mx.inf)
    return order[mx.random.categorical(sorted_logits, key=key)]  # categorical renormalises what is left


# ------------------------------------------------------------------------------------------------
# 11. Generate: prefill the prompt once, then decode one token at a time
# ------------------------------------------------------------------------------------------------

# Long prompts go through in pieces: one piece's attention scores grow with the square of its length, so
# this bounds the memory of a forward pass (on the H200, a 2048-token prompt peaked at 1.80 GB in pieces
# of 1024 vs 2.26 GB in one piece, for 28 vs 21 ms to the first token).
PREFILL_CHUNK = 1024


def generate(prompt_ids, weights, config, max_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             eos_ids=(), fused=True):
    """Yield generated token ids one at a time, stopping after an end-of-sequence id or max_tokens."""
    cache, key = KVCache(), mx.random.key(seed)
    prompt = mx.array(prompt_ids)

    def step(token_ids):  # tokens -> (lazy) next token; nothing runs until MLX is asked for a value
        nonlocal key
        key, sample_key = mx.random.split(key)
        return sample(forward(token_ids, weights, config, cache, fused=fused), temperature, top_k, top_p, sample_key)

    # Prefill: the prompt's tokens are known, so all of them go through each layer together (big,
    # efficient matrix products); it fills the cache and gives the first new token.
    while len(prompt) > PREFILL_CHUNK:
        forward(prompt[:PREFILL_CHUNK], weights, config, cache, fused=fused)
        mx.eval(cache.keys, cache.values)  # run this chunk now, so its activations can be freed
        prompt = prompt[PREFILL_CHUNK:]
    token = step(prompt)
    mx.async_eval(token)
    # Decode: each step feeds the previous token back in. MLX is lazy, so we *build* step n+1 from the
    # not-yet-computed token n and queue it (async_eval) before waiting for token n: the GPU never idles
    # while Python prepares the next step.
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_token = step(token[None])  # (1,): a one-token sequence
            mx.async_eval(next_token)
        token_id = token.item()  # waits for step n only
        yield token_id
        if token_id in eos_ids or n + 1 == max_tokens:  # (a step queued after an end token is discarded)
            return
        token = next_token


# ------------------------------------------------------------------------------------------------
# The command line: python llm_inference.py --prompt "..." [flags]
# ------------------------------------------------------------------------------------------------

def default_model_dir():
    """./Qwen3-0.6B when present, otherwise the Qwen3-0.6B folder next to this script."""
    here = Path("Qwen3-0.6B")
    return here if here.is_dir() else Path(__file__).resolve().parent / "Qwen3-0.6B"


def download_command(model_dir):
    return f"hf download {HF_REPO} {' '.join(MODEL_FILES)} --local-dir {model_dir}"


def download_model(model_dir):
    """Fetch Qwen3-0.6B's files from Hugging Face into model_dir, all or nothing.

    Files land in a temporary folder beside model_dir first and are moved in only once all have
    arrived, so an interrupted download never leaves a folder that looks complete.
    """
    import huggingface_hub  # only needed here, on the first run

    model_dir = Path(model_dir)
    staging = None
    try:
        info = huggingface_hub.HfApi().model_info(HF_REPO, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings}
        total = sum(sizes.get(name, 0) for name in MODEL_FILES)
        print(f"Downloading {HF_REPO} ({len(MODEL_FILES)} files, {total / 1e9:.2f} GB) into {model_dir}/",
              file=sys.stderr)
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.download-", dir=model_dir.parent))
        for name in MODEL_FILES:
            huggingface_hub.hf_hub_download(HF_REPO, name, local_dir=staging)
        model_dir.mkdir(exist_ok=True)
        for name in MODEL_FILES:
            os.replace(staging / name, model_dir / name)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not download {HF_REPO} ({type(e).__name__}: {reason}); "
                        f"fetch it by hand with: {download_command(model_dir)}")
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def find_model(model_arg, allow_download):
    """The model folder to use; downloads the default one when it is missing or incomplete."""
    model_dir = Path(model_arg) if model_arg else default_model_dir()
    missing = [name for name in NEEDED_FILES if not (model_dir / name).is_file()]
    if not missing:
        return model_dir
    if model_dir.is_dir():
        what = f"{model_dir} lacks {', '.join(missing)}"
    else:
        what = f"model folder {model_dir} not found"
    if model_arg:  # an explicit folder is never filled with 0.6B files: it may hold another model
        raise UserError(f"{what}; point --model at a folder with {', '.join(NEEDED_FILES)}")
    if not allow_download:
        raise UserError(f"{what} and --no-download was given; fetch it with: {download_command(model_dir)}")
    try:
        download_model(model_dir)
    except UserError as e:
        raise UserError(f"{what}, and {e}")
    return model_dir


def device_name():
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "gpu (Metal)" if mx.metal.is_available() else "gpu (CUDA)"


def pick_dtype(name):
    """'auto' = bfloat16 on a GPU; float32 on the CPU, where MLX runs bfloat16 through a slow path (a
    matrix-vector product read 2.7 GB/s of bfloat16 vs 9.5 GB/s of float32 on a 2-core x86 machine)."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return getattr(mx, name)


def read_prompt(text):
    if text == "-":  # read the prompt from stdin
        if sys.stdin.isatty():
            print("Reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr)
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError("the prompt on stdin is not valid UTF-8 text")
        text = text[:-1] if text.endswith("\n") else text  # `echo ... |` adds a newline nobody typed
    if not text.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    return text


def print_top_probs(logits, tokenizer, n):
    """A table of the n most likely next tokens and their probabilities (" Paris" first, for the default)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    top = mx.argsort(-probs)[:n].tolist()
    print(f"{'rank':>4}  {'token':<16} {'id':>7}  probability", file=sys.stderr)
    for rank, token_id in enumerate(top, 1):
        token = tokenizer.decode([token_id], skip_special_tokens=False)  # show <|im_end|> too
        print(f"{rank:>4}  {token!r:<16} {token_id:>7}  {probs[token_id].item():.4f}",
              file=sys.stderr)


def number(kind, low=None, high=None, low_open=False):
    """An argparse type: a number of `kind` within [low, high] (or (low, high] if low_open)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(value):  # float("nan") parses, and compares False with every bound
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low}, {'inf)' if high is None else f'{high}]'}"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value
    return parse


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block; exit code 2 as usual
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(prog="llm_inference.py", description="Generate text with Qwen3-0.6B on MLX.")
    ap.add_argument("--prompt", default="The capital of France is", help="the text to continue ('-' reads stdin)")
    ap.add_argument("--max-tokens", type=number(int, 1), default=100, help="stop after this many new tokens (100)")
    ap.add_argument("--temperature", type=number(float, 0), help="0 = greedy (default; 0.6 with --chat)")
    ap.add_argument("--top-p", type=number(float, 0, 1, low_open=True), help="nucleus sampling mass (0.95)")
    ap.add_argument("--top-k", type=number(int, 0),
                    help="keep only the k most likely tokens, 0 = all (0; 20 with --chat)")
    ap.add_argument("--seed", type=number(int, 0, 2**64 - 1), help="random seed for sampling (default: a fresh one)")
    ap.add_argument("--model", help="model folder (default: ./Qwen3-0.6B, else Qwen3-0.6B next to this script)")
    ap.add_argument("--no-download", action="store_true", help="never download the model, fail instead")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in Qwen3's chat format")
    ap.add_argument("--system", help="system message for --chat")
    ap.add_argument("--no-think", action="store_true", help="with --chat: skip Qwen3's <think> reasoning")
    ap.add_argument("--top-probs", type=number(int, 1), metavar="N", help="first print the N most likely next tokens")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                    help="auto = bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--reference-ops", action="store_true",
                    help="run the hand-written RMSNorm/RoPE/attention, not MLX's fused kernels (slower)")
    args = ap.parse_args(argv)
    if (args.system or args.no_think) and not args.chat:
        ap.error("--system and --no-think only apply with --chat")
    return args


def sampling_settings(args, generation_config):
    """Explicit flags win; with --chat, the model's generation_config.json fills the rest (Qwen3: 0.6,
    0.95, 20); plain completion defaults to greedy decoding, the most likely token every time."""
    recommended = generation_config if args.chat else {}
    temperature = args.temperature if args.temperature is not None else recommended.get("temperature", 0.0)
    top_p = args.top_p if args.top_p is not None else recommended.get("top_p", 0.95)
    top_k = args.top_k if args.top_k is not None else recommended.get("top_k", 0)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    return float(temperature), float(top_p), int(top_k), seed


def main(argv=None):
    args = parse_args(argv)
    prompt = read_prompt(args.prompt)
    model_dir = find_model(args.model, allow_download=not args.no_download)
    dtype = pick_dtype(args.dtype)
    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    weights = load_weights(model_dir, config, dtype)
    generation_config = load_generation_config(model_dir)
    eos_ids = eos_token_ids(generation_config, tokenizer)
    temperature, top_p, top_k, seed = sampling_settings(args, generation_config)

    text = chat_prompt(prompt, args.system, think=not args.no_think) if args.chat else prompt
    prompt_ids = tokenize(tokenizer, text)
    if len(prompt_ids) + args.max_tokens > config.max_position_embeddings:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; with --max-tokens {args.max_tokens} that exceeds "
                        f"the model's {config.max_position_embeddings}-token context: shorten it or lower --max-tokens")

    c = config
    print(f"Model: {model_dir.name} ({c.num_hidden_layers} layers, {c.hidden_size} dim, {c.num_attention_heads} Q "
          f"heads, {c.num_key_value_heads} KV heads) on {device_name()}, {str(dtype).split('.')[-1]}", file=sys.stderr)
    sampling = "greedy" if temperature == 0 else f"temperature {temperature}, top-p {top_p}, top-k {top_k}, seed {seed}"
    print(f"Prompt: {prompt!r} ({len(prompt_ids)} tokens), {sampling}", file=sys.stderr)
    if args.top_probs:  # a separate prompt pass just for the table (one piece: fine for prompts of any sane length)
        print_top_probs(forward(mx.array(prompt_ids), weights, c, KVCache(), fused=not args.reference_ops),
                        tokenizer, args.top_probs)

    # Stream: print each piece as soon as it is decoded. DecodeStream holds back bytes of a character
    # split across tokens (emoji, CJK) until the character is complete, so nothing prints as garbage.
    stream, n_generated, interrupted = DecodeStream(skip_special_tokens=True), 0, False
    start = first = time.perf_counter()
    try:
        for token_id in generate(prompt_ids, weights, config, args.max_tokens, temperature, top_k, top_p, seed,
                                 eos_ids, fused=not args.reference_ops):
            if n_generated == 0:
                first = time.perf_counter()  # prefill done: time to first token
            n_generated += 1
            piece = stream.step(tokenizer, token_id)
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    prefill_rate = len(prompt_ids) / (first - start) if n_generated else 0.0
    decode_rate = (n_generated - 1) / (end - first) if n_generated > 1 else 0.0
    print(f"{'Interrupted. ' if interrupted else ''}Prompt: {len(prompt_ids)} tokens, "
          f"{prefill_rate:.1f} tok/s | Generated: {n_generated} tokens, {decode_rate:.1f} tok/s | "
          f"Total: {end - start:.2f} s | Peak memory: {mx.get_peak_memory() / 1e9:.2f} GB", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"llm_inference.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        print("\nInterrupted.", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail too
        sys.exit(141)
