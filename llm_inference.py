"""How an LLM really generates text: Qwen3 from its released files, with MLX, in one file.

Part 1, the model, is the first read: at the end of generate() you have seen all of it. Part 2
goes further, in optional sections that each build on Part 1 alone. Part 3 is the program around
it: checking and downloading the model, the command line, the chat loop.

    "The capital of France is"
      1. load       config.json, model.safetensors, tokenizer.json
      2. tokenize   -> [785, 6722, 315, 9625, 374], and back: [12095] -> " Paris"
      3. embed      -> one 1024-number vector per token                     (seq, 1024)
      4. RMSNorm  \
      5. RoPE      | the parts of a transformer block
      6. attention |   (grouped-query, QK-norm, KV cache)
      7. SwiGLU   /
      8. block      x + attention(RMSNorm(x)), then + SwiGLU(RMSNorm(...)), 28 times
      9. forward    embed -> 28 blocks -> final RMSNorm -> LM head          (151936,) logits
      10. sample    -> 12095, the id of " Paris"
      11. generate  feed it back in, repeat until an end-of-sequence token

Shapes are written for one sequence, with Qwen3-0.6B's sizes (attention's carry a batch axis of 1,
which MLX's attention kernel wants). MLX is lazy: `y = x @ w` only records the operation in a
graph; the arithmetic runs when a value is needed (`print(y)`, `y.item()`, `mx.eval(y)`).
generate() (section 11) builds on that.
"""

import ctypes
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

# Linux only (a Mac reader can skip these lines): on a CPU, MLX runs faster with OpenBLAS, which
# must be loaded before MLX (Part 3, OpenBLAS).
MLX_CPU_WHEEL = any(Path(folder, "mlx_cpu.libs").is_dir() for folder in sys.path)
try:
    OPENBLAS = (MLX_CPU_WHEEL and os.environ.get("LLM_INFERENCE_BLAS") != "0"
                and "mlx.core" not in sys.modules
                and bool(ctypes.CDLL("libopenblas.so.0", mode=ctypes.RTLD_GLOBAL)))
except OSError:  # not installed: main() prints the command that installs it
    OPENBLAS = False

import mlx.core as mx
from tokenizers import Tokenizer

# ================================================================================================
# PART 1: THE MODEL
# ================================================================================================

# --- 1. Load: the hyper-parameters from config.json, the weights from *.safetensors ---------------

class Config(NamedTuple):  # what the model reads from config.json
    hidden_size: int  # 1024: width of the "residual stream" layers read and add to (section 8)
    num_hidden_layers: int  # 28 transformer blocks
    num_attention_heads: int  # 16 query heads ...
    num_key_value_heads: int  # ... sharing 8 key/value heads (grouped-query attention, section 6)
    head_dim: int  # 128: usually hidden_size / heads (64), but Qwen3 sets it: q is 16 x 128 wide
    intermediate_size: int  # 3072: width of the SwiGLU feed-forward
    vocab_size: int  # 151936 rows in the embedding table
    rope_theta: float  # 1e6: base of the rotary position frequencies
    rms_norm_eps: float  # 1e-6: keeps RMSNorm from dividing by zero
    tie_word_embeddings: bool  # True: the LM head reuses the embedding table
    max_position_embeddings: int  # 40960: the longest sequence (prompt + reply) the config allows


def load_config(model_dir):
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    # transformers >= 5 writes rope_theta inside a "rope_parameters" dict.
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    # Each field's annotation (int, float, bool) converts the JSON value.
    return Config(**{name: kind(raw[name]) for name, kind in Config.__annotations__.items()})


# A layer's tensors: the short name used below -> the name in the checkpoint.
LAYER_TENSORS = {
    "input_layernorm": "input_layernorm.weight",  # (1024,)
    "q_proj": "self_attn.q_proj.weight",  # (2048, 1024) = (16 heads x 128, 1024)
    "k_proj": "self_attn.k_proj.weight",  # (1024, 1024) = (8 heads x 128, 1024)
    "v_proj": "self_attn.v_proj.weight",  # (1024, 1024)
    "q_norm": "self_attn.q_norm.weight",  # (128,)
    "k_norm": "self_attn.k_norm.weight",  # (128,)
    "o_proj": "self_attn.o_proj.weight",  # (1024, 2048)
    "post_attention_layernorm": "post_attention_layernorm.weight",  # (1024,)
    "gate_proj": "mlp.gate_proj.weight",  # (3072, 1024)
    "up_proj": "mlp.up_proj.weight",  # (3072, 1024)
    "down_proj": "mlp.down_proj.weight",  # (1024, 3072)
}


def weight_files(model_dir):
    """model.safetensors, or, for larger models split into shards, the files listed in
    model.safetensors.index.json: {"weight_map": {name: "model-00001-of-00002.safetensors"}}."""
    model_dir = Path(model_dir)
    if (model_dir / "model.safetensors").exists():  # the single file first, as transformers does
        return [model_dir / "model.safetensors"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text(encoding="utf-8"))
    return [model_dir / name for name in sorted(set(index["weight_map"].values()))]


def load_tensors(model_dir):
    """Every tensor of every weight file, by name; lazy: nothing is read until it is used."""
    tensors = {}
    for path in weight_files(model_dir):
        tensors |= mx.load(str(path))
    return tensors


def load_weights(model_dir, config, dtype, take=None):
    """{"embed_tokens", "layers": [{"q_proj": ..., ...} x 28], "norm", "lm_head"}, as `dtype`
    (mx.bfloat16, as stored, on a GPU; mx.float32 on a CPU). Optional: `take` changes how a tensor
    is taken from the file, as section 15 does to quantize."""
    tensors = load_tensors(model_dir)

    # Convert one tensor at a time, so the file's bfloat16 copy of everything never sits beside
    # the converted weights (in float32 that would peak at 1.5x the weights).
    def tensor(name):
        weight = take(tensors, name) if take else tensors.pop(name).astype(dtype)
        mx.eval(weight)
        return weight

    layers = [{short: tensor(f"model.layers.{i}.{name}") for short, name in LAYER_TENSORS.items()}
              for i in range(config.num_hidden_layers)]
    embed_tokens = tensor("model.embed_tokens.weight")  # (151936, 1024)
    # Qwen3-0.6B to 4B tie the LM head to the embedding table: the same array, not a 311 MB copy.
    # Qwen3-8B and up have their own, lm_head.weight.
    lm_head = embed_tokens if config.tie_word_embeddings else tensor("lm_head.weight")
    return {"embed_tokens": embed_tokens, "layers": layers, "norm": tensor("model.norm.weight"),
            "lm_head": lm_head}


def load_tokenizer(model_dir):
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


# --- 2. Tokenize: text -> integer ids (byte-level BPE, in tokenizer.json) -------------------------

def tokenize(tokenizer, text):
    """Text -> ids of vocabulary pieces: "The capital of France is" -> [785, 6722, 315, 9625, 374].

    Byte-level BPE: the text is cut into word-like chunks, and each chunk's UTF-8 bytes are merged
    pair by pair, following the merge list learned in training, until no merge applies. Any string
    has an encoding, emoji included; common words are one token, their leading space included.
    """
    return tokenizer.encode(text).ids


def detokenize(tokenizer, token_ids):
    """Ids -> text: the pieces' bytes joined and read as UTF-8; [12095] -> " Paris"."""
    return tokenizer.decode(token_ids)


# --- 3. Embed: each id picks one row of the embedding table ---------------------------------------

def embed(token_ids, embed_tokens):
    """(seq,) ids -> (seq, 1024): row i of the table, learned in training, stands for token i."""
    if isinstance(embed_tokens, Quantized):  # a table stored in 4 or 8 bits: section 15
        return quantized_embed(token_ids, embed_tokens)
    return embed_tokens[token_ids]


# --- 4. RMSNorm: rescale each vector to unit root-mean-square, then by a learned per-channel gain -

# RMSNorm, RoPE and attention are written out below as math, several MLX operations each. MLX also
# has each as one fused kernel: the same numbers (to rounding; the tests check it) in one pass over
# memory, faster. This flag picks the kernels; --reference-ops clears it.
FUSED_KERNELS = True


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x²) + eps) * weight, over the last axis: layers read inputs of one scale."""
    if not FUSED_KERNELS:
        x32 = x.astype(mx.float32)  # square and average in float32: bfloat16 has 8 significant bits
        x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return weight * x32.astype(x.dtype)
    return mx.fast.rms_norm(x, weight, eps)


# --- 5. RoPE: encode a token's position by rotating pairs of its query/key channels ---------------

def apply_rope(x, offset, theta):
    """Rotate x (..., seq, head_dim), whose first position is the absolute position `offset`.

    Channel i is paired with channel i + head_dim/2 (Hugging Face's "rotate_half" layout; the RoPE
    paper pairs neighbours), and the pair turns by the angle position * theta^(-2i/head_dim):
    fast-turning pairs resolve nearby tokens, slow ones distant tokens. Rotations compose, so the
    dot product of a rotated query and key depends on their positions only through their distance.
    """
    head_dim = x.shape[-1]
    if not FUSED_KERNELS:
        inv_freq = theta ** (-mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (64,)
        positions = (offset + mx.arange(x.shape[-2])).astype(mx.float32)  # (seq,)
        angles = positions[:, None] * inv_freq[None, :]  # (seq, 64)
        cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return mx.fast.rope(x, head_dim, traditional=False, base=theta, scale=1.0, offset=offset)


# --- 6. Attention: each position gathers information from itself and the positions before it ------
#
# Each position emits, per head, a query ("what am I looking for?"), a key ("what do I hold?") and a
# value ("what do I pass on?"). Its output is an average of the values, weighted by how well its
# query matches each key: softmax(Q Kᵀ / √head_dim) · V; √128 keeps the scores' variance ~1.
#
# A dot product cannot tell where tokens are: shuffle the keys and values, and the output stays. So
# RoPE (section 5) mixes positions into queries and keys, and a causal mask keeps each position
# from seeing later ones, which the model had to predict in training.
#
# Heads look for different things in parallel. Multi-head attention gives each of the 16 query
# heads its own key/value head; multi-query attention shares one K/V head among all; Qwen3 takes
# the middle, grouped-query attention: 8 K/V heads, each shared by 2 query heads. Compared with 16
# K/V heads, that halves the keys and values to compute and to cache, at little cost in quality.

def linear(x, weight):
    """x @ weight.T: every matrix product of the model. The checkpoint stores each matrix
    (out, in), PyTorch's nn.Linear layout, so x (seq, in) -> (seq, out)."""
    if isinstance(weight, Quantized):  # a matrix stored in 4 or 8 bits: section 15
        return quantized_linear(x, weight)
    return x @ weight.T


def queries_keys_values(x, layer, config, offset):
    """The first half of attention: x (seq, 1024) at positions offset, offset+1, ... -> q, k, v."""
    c, seq = config, x.shape[0]
    # Project each position to queries, keys and values, split into heads, heads first. The leading
    # 1 is a batch axis: the attention kernel wants one, and the reshape adds it at no extra cost.
    q = linear(x, layer["q_proj"]).reshape(1, seq, c.num_attention_heads, c.head_dim).swapaxes(1, 2)
    k = linear(x, layer["k_proj"]).reshape(1, seq, c.num_key_value_heads, c.head_dim).swapaxes(1, 2)
    v = linear(x, layer["v_proj"]).reshape(1, seq, c.num_key_value_heads, c.head_dim).swapaxes(1, 2)
    # QK-norm (new in Qwen3 compared with Qwen2.5): RMS-normalise each head's 128 query and key
    # channels. Otherwise their sizes can creep up in training until the softmax saturates and
    # training turns unstable; here their scale is set by two small learned gains. The order matters
    # (per-channel gains do not commute with the rotation), and Qwen3 was trained normalising first.
    q = apply_rope(rms_norm(q, layer["q_norm"], c.rms_norm_eps), offset, c.rope_theta)
    k = apply_rope(rms_norm(k, layer["k_norm"], c.rms_norm_eps), offset, c.rope_theta)
    return q, k, v  # (1, 16, seq, 128), (1, 8, seq, 128), (1, 8, seq, 128)


class KVCache:
    """One layer's keys and values for every position so far, so a new token computes only its own.
    Without it, each new token re-runs all earlier tokens through every weight matrix of every
    layer; with it, only attention reads the earlier positions. Qwen3-0.6B in bfloat16 caches
    28 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 112 KiB per token."""

    GROWTH = 256  # positions added at a time: one copy per 256 tokens, not one per token

    def __init__(self):
        self.keys = self.values = None  # (1, 8, capacity, 128), preallocated, written in place
        self.offset = 0  # positions filled

    def update_and_fetch(self, k, v):
        """Store k, v (1, 8, seq, 128) at positions offset, offset+1, ...; return all so far."""
        end = self.offset + k.shape[-2]
        capacity = 0 if self.keys is None else self.keys.shape[-2]
        if end > capacity:  # full: add room for a whole number of GROWTH positions
            room = math.ceil((end - capacity) / self.GROWTH) * self.GROWTH
            room = (*k.shape[:-2], room, k.shape[-1])
            if self.keys is None:  # two arrays, not one shared: the writes below are in place
                self.keys, self.values = mx.zeros(room, k.dtype), mx.zeros(room, v.dtype)
            else:
                self.keys = mx.concatenate([self.keys, mx.zeros(room, k.dtype)], axis=-2)
                self.values = mx.concatenate([self.values, mx.zeros(room, v.dtype)], axis=-2)
        self.keys[..., self.offset : end, :] = k
        self.values[..., self.offset : end, :] = v
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]  # (1, 8, total, 128)


def make_cache(config):
    return [KVCache() for _ in range(config.num_hidden_layers)]


def attend(q, k, v):
    """softmax(q kᵀ / √d) v for q (1, 16, seq, 128), k and v (1, 8, total, 128) -> like q.
    The queries are the last `seq` of the `total` positions; each sees the keys up to its own."""
    _, n_heads, seq, head_dim = q.shape
    _, n_kv_heads, total, _ = k.shape
    scale = 1 / math.sqrt(head_dim)
    if not FUSED_KERNELS:
        # Grouped-query attention by broadcasting: q viewed as (8 groups, 2 heads, ...) meets k, v
        # viewed as (8, 1, ...), so each pair of query heads shares one K/V head, and no repeated
        # copy of the keys and values is built.
        q = q.reshape(n_kv_heads, n_heads // n_kv_heads, seq, head_dim)  # (8, 2, seq, 128)
        k, v = k.reshape(n_kv_heads, 1, total, head_dim), v.reshape(n_kv_heads, 1, total, head_dim)
        scores = (q * scale) @ k.swapaxes(-1, -2)  # (8, 2, seq, total); scaling q is less work
        # Causal mask: query i sits at position total-seq+i and sees keys 0 ... total-seq+i.
        allowed = mx.arange(total)[None, :] <= (total - seq + mx.arange(seq))[:, None]
        scores = mx.where(allowed, scores, -mx.inf)  # (seq, total) mask, broadcast
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)  # float32 exp/sum
        return (probs @ v).reshape(1, n_heads, seq, head_dim)
    # The kernel does the head groups and the mask itself, aligned as above (the last query sees
    # the last key). A single new token may see every key: no mask.
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                mask="causal" if seq > 1 else None)


def attention(x, layer, config, cache):
    """x (seq, 1024), already normalised -> (seq, 1024): what each position gathers from others."""
    q, k, v = queries_keys_values(x, layer, config, cache.offset)
    k, v = cache.update_and_fetch(k, v)  # (1, 8, total, 128): the earlier positions' and these
    heads = attend(q, k, v)  # (1, 16, seq, 128)
    # Concatenate the heads into one vector per position; the output projection mixes them.
    heads = heads.swapaxes(1, 2).reshape(x.shape[0], -1)  # (seq, 16 x 128 = 2048)
    return linear(heads, layer["o_proj"])  # (seq, 1024)


# --- 7. SwiGLU feed-forward: a gated two-layer MLP applied to each position on its own ------------

def silu_gate(gate, up):
    """silu(gate) * up, element by element. silu(g) = g * σ(g) is a smooth ReLU, not a 0-1 switch;
    multiplied with a second projection, `up`, it gates it. (The command line runs a compiled copy,
    section 12, where print(gate) fails: try it with --no-compile.)"""
    return gate * mx.sigmoid(gate) * up


def swiglu(x, layer):
    """(seq, 1024) -> (seq, 3072) -> (seq, 1024), each position on its own (attention moves
    information between them): about 60% of a block's weights, thought to hold much of what the
    model knows. It widens 3x to have room for many features at once."""
    gate = linear(x, layer["gate_proj"])  # (seq, 3072)
    up = linear(x, layer["up_proj"])  # (seq, 3072)
    return linear(silu_gate(gate, up), layer["down_proj"])  # (seq, 1024)


# --- 8. Transformer block: attention, then feed-forward, each added back to the residual stream ---

def transformer_block(x, layer, config, cache):
    """x (seq, 1024) -> (seq, 1024). Pre-norm: each sub-layer reads a normalised copy of the
    residual stream x and *adds* its result to x, never normalising x itself, so information (and,
    in training, gradient) flows straight from the embedding to the last layer."""
    eps = config.rms_norm_eps
    h = x + attention(rms_norm(x, layer["input_layernorm"], eps), layer, config, cache)
    return h + swiglu(rms_norm(h, layer["post_attention_layernorm"], eps), layer)


# --- 9. Forward: embed -> 28 blocks -> final norm -> LM head --------------------------------------

def forward(token_ids, weights, config, cache, last_only=True):
    """Logits for token_ids (seq,), which continue the sequence already in `cache` (one per layer):
    (vocab,) scores for the next token, or (seq, vocab) for every position if not last_only (what
    training computes, and what the tests compare)."""
    x = embed(token_ids, weights["embed_tokens"])  # (seq, 1024)
    for layer, layer_cache in zip(weights["layers"], cache):
        x = transformer_block(x, layer, config, layer_cache)
    if last_only:  # generating needs only the next token: skip (seq-1) x 151936 dot products
        x = x[-1:]  # (1, 1024)
    x = rms_norm(x, weights["norm"], config.rms_norm_eps)
    logits = linear(x, weights["lm_head"])  # (1 or seq, vocab): a score (logit) per token
    return logits.squeeze(0) if last_only else logits


# --- 10. Sample: pick the next token from the logits ----------------------------------------------

class Sampling(NamedTuple):
    temperature: float = 0.0  # 0 = greedy: always the most likely token
    top_k: int = 0  # keep the k most likely tokens (0 = all) ...
    top_p: float = 1.0  # ... then the fewest whose probabilities add up to >= top_p (nucleus)
    seed: int = 0  # the random stream, so that a run can be repeated


def filter_logits(logits, sampling):
    """Divide by the temperature, then set to -inf every token that top-k or top-p rules out, in
    the order Hugging Face transformers applies them."""
    logits = logits.astype(mx.float32) / sampling.temperature  # < 1 sharpens, > 1 flattens
    top_k, top_p, n_vocab = sampling.top_k, sampling.top_p, len(logits)
    if 0 < top_k < n_vocab:
        candidates = mx.argpartition(-logits, top_k - 1)[:top_k]  # the k largest, unsorted
        # Everything below the k-th largest logit goes (ties with it stay, as in transformers).
        logits = mx.where(logits >= logits[candidates].min(), logits, -mx.inf)
    else:
        candidates = mx.arange(n_vocab)
    if top_p < 1:
        # Walk down from the likeliest token: a token stays if those before it add up to less than
        # top_p (so the one crossing the threshold stays). Only the top-k candidates need sorting.
        order = candidates[mx.argsort(-logits[candidates])]  # token ids, likeliest first
        probs = mx.exp(logits[order] - mx.logsumexp(logits))
        kept = mx.cumsum(probs) - probs < top_p  # the mass before each token
        kept[0] = True  # the likeliest always stays, as in transformers (top_p = 0 keeps it alone)
        bar = mx.where(kept, logits[order], mx.inf).min()  # the least likely token that stays
        logits = mx.where(logits >= bar, logits, -mx.inf)  # (tokens tied with it stay too)
    return logits


def sample(logits, sampling, key):
    """Temperature 0 is greedy (argmax). Otherwise draw from softmax(logits / temperature) over the
    tokens filter_logits keeps."""
    if sampling.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, sampling), key=key)  # renormalises


# --- 11. Generate: prefill the prompt once, then decode one token at a time -----------------------
#
# Written plainly, the decode loop would be:
#     for _ in range(max_tokens):
#         yield token.item()                 # wait for the GPU to compute the token
#         token, logits = step(token[None])  # the GPU idles while Python records this step
# For a small model, recording a step takes a good part of the time the GPU spends running it. So,
# MLX being lazy, step n+1 is recorded on token n before that is computed, and queued
# (mx.async_eval); only then do we wait for token n.

def generate(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(), cache=None,
             pick=sample):
    """Yield (token id, the model's logits it was picked from) until an id in eos_ids (yielded
    too) or max_tokens. `cache` may already hold earlier tokens (a chat): prompt_ids continue
    them. At the end the cache holds every token yielded, except the last when max_tokens ended
    the run; stopped early, one token more (section 17 reads how far it got). Optional: pick(logits,
    sampling, key) chooses each token: sample(), or section 16's, with min-p and a presence
    penalty (the logits yielded are the model's, before that penalty)."""
    cache = make_cache(config) if cache is None else cache
    key = mx.random.key(sampling.seed)

    def step(token_ids):  # one forward pass over token_ids (seq,) and the token picked after it
        nonlocal key
        logits = forward(token_ids, weights, config, cache)
        # Fresh randomness for each step, repeatable from the seed; greedy picking needs none.
        key, pick_key = mx.random.split(key) if sampling.temperature else (key, key)
        return pick(logits, sampling, pick_key), logits

    # Prefill: the prompt's tokens are all known, so they go through each layer together (large,
    # efficient matrix products), filling the cache and giving the first new token.
    token, logits = step(mx.array(prompt_ids))
    mx.async_eval(token)
    # Decode: feed each new token back in, as a one-token sequence.
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            following = step(token[None])  # built on the token not yet computed
            mx.async_eval(following[0])
        token_id = token.item()  # waits for token n only
        yield token_id, logits
        if token_id in eos_ids or n + 1 == max_tokens:
            return
        token, logits = following


# ================================================================================================
# PART 2: GOING FURTHER (optional sections; each builds on Part 1 alone)
# ================================================================================================

# --- 12. Compilation: fusing element-wise operations into one kernel -----------------------------
#
# Decoding one token of a small model runs hundreds of small operations, each far too small to keep
# a GPU busy, so their fixed costs (Python recording the graph, one kernel launch each) limit the
# speed, not the arithmetic. mx.compile traces a function once, then replays the recorded graph as
# one call, with element-wise steps fused into single kernels: silu_gate's sigmoid and two
# multiplications become one kernel instead of three. Only element-wise steps fuse; matrix
# products, and RMSNorm, RoPE and attention with FUSED_KERNELS, are single kernels already, and
# replaying a compiled function costs Python more time than recording a few of them
# (docs/performance.md), so silu_gate is all we compile. shapeless=True: one trace serves every
# sequence length.
#
# While tracing, arrays are placeholders: print(x) inside a compiled function fails, and
# print(x.shape) prints once, when it is traced. Without compile_model() (--no-compile), every
# operation runs one by one.

compiled_silu_gate = mx.compile(silu_gate, shapeless=True)


def compile_model():
    """From now on, swiglu() calls the compiled silu_gate: it looks the name up in this module when
    it runs. The command line calls this unless --no-compile."""
    global silu_gate
    silu_gate = compiled_silu_gate


# --- 13. Long prompts: prefill in pieces ----------------------------------------------------------
#
# A piece of 1024 tokens has attention scores of (heads, 1024, total) rather than (heads, total,
# total) for the whole prompt at once: that bounds the memory of one pass, at a small cost in speed
# (docs/performance.md).
PREFILL_CHUNK = 1024


def generate_long(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(),
                  cache=None, pick=sample):
    """generate() for a prompt of any length: all but its last piece first go through the model
    piece by piece, filling the cache."""
    cache = make_cache(config) if cache is None else cache
    while len(prompt_ids) > PREFILL_CHUNK:
        forward(mx.array(prompt_ids[:PREFILL_CHUNK]), weights, config, cache)
        # Run this piece now, freeing its activations. Only the cache is asked for, so (MLX being
        # lazy) the piece's logits are never computed.
        mx.eval([(c.keys, c.values) for c in cache])
        prompt_ids = prompt_ids[PREFILL_CHUNK:]
    yield from generate(prompt_ids, weights, config, max_tokens, sampling, eos_ids, cache, pick)


# --- 14. Without a KV cache: what the cache saves (--no-cache) ------------------------------------

def generate_without_cache(prompt_ids, weights, config, max_tokens, sampling=Sampling(),
                           eos_ids=(), pick=sample):
    """generate() without a KV cache: every step runs the whole sequence so far through the model.
    The same tokens and logits, and work per token that grows with the sequence."""
    token_ids, key = list(prompt_ids), mx.random.key(sampling.seed)
    for _ in range(max_tokens):
        logits = forward(mx.array(token_ids), weights, config, make_cache(config))
        key, pick_key = mx.random.split(key)  # the same keys, in the same order, as generate()
        token_id = pick(logits, sampling, pick_key).item()
        yield token_id, logits
        if token_id in eos_ids:
            return
        token_ids.append(token_id)


# --- 15. Quantization (--quantize 4 or 8): fewer bits per weight ----------------------------------
#
# Generating a token multiplies one vector by every weight matrix: each weight is read from memory
# and used for a single multiply-add. Where reading memory limits decoding (larger models, and a
# Mac's unified memory or a CPU), fewer bytes per weight mean more tokens per second: Qwen3-8B reads
# about 15 GB of bfloat16 weights per token, so 100 GB/s of memory caps it near 7 tokens a second;
# at 4 bits, about 4.3 GB, near 23. A small model on a fast GPU is limited by the fixed cost of each
# operation instead (section 12): there quantizing saves memory, not time. Memory it always saves.
#
# Group-wise affine quantization (MLX's and mlx-lm's): each row of a matrix is cut into groups of
# 64 consecutive weights. A group keeps one scale and one bias, in the weights' float type, and
# 64 integers q from 0 to 2^bits - 1, chosen so that w ≈ scale * q + bias: 2^bits evenly spaced
# levels covering the group's range, nudged so that 0 is exactly one of them. With 16-bit scales and
# biases, a weight costs 4 + 2 x 16 / 64 = 4.5 bits at 4 bits instead of 16 (3.6x smaller; 8 bits:
# 8.5, 1.9x smaller). The price is rounding: most weights move by at most half a level (the nudge,
# and at 8 bits the 16-bit scales and biases, move some further), and every product moves with
# them (docs/performance.md measures how much on a layer).
#
# The model reads quantized matrices as they are, in the two places of Part 1 that touch a matrix:
# linear(), where mx.quantized_matmul unpacks each group inside the matrix product (the
# full-precision matrix never exists in memory), and embed(), which unpacks only the rows it picks.

GROUP_SIZE = 64  # weights sharing one scale and bias (mlx-lm's default)


class Quantized(NamedTuple):  # a NamedTuple, so compiled functions (section 12) accept it
    """A matrix (out, in), quantized in groups along each of its rows: w ≈ scale * q + bias."""
    packed: mx.array  # (out, in * bits / 32) uint32: the integers q, packed bit after bit
    scales: mx.array  # (out, in / group_size): one per group, in --dtype
    biases: mx.array  # (out, in / group_size): each group's offset (not a layer's bias term)
    group_size: int
    bits: int  # 4 or 8 with --quantize; a stored checkpoint may use 2 to 6, or 8


def quantize(weight, bits, dtype):
    """A checkpoint matrix -> Quantized, as mlx_lm.convert does it: from the values as stored
    (bfloat16), so the scales and biases are bfloat16 numbers, then held as `dtype` (float32 keeps
    them exactly)."""
    q, scales, biases = mx.quantize(weight, group_size=GROUP_SIZE, bits=bits)  # affine mode
    return Quantized(q, scales.astype(dtype), biases.astype(dtype), GROUP_SIZE, bits)


def quantized_linear(x, weight):
    """linear() for a Quantized weight: x @ dequantized(weight).T, without the dequantized copy."""
    return mx.quantized_matmul(x, weight.packed, weight.scales, weight.biases, transpose=True,
                               group_size=weight.group_size, bits=weight.bits)


def quantized_embed(token_ids, table):
    """embed() for a Quantized table: unpack the rows picked, not the 151936-row table."""
    return mx.dequantize(table.packed[token_ids], table.scales[token_ids],
                         table.biases[token_ids], group_size=table.group_size, bits=table.bits)


def stored_quantization(model_dir):
    """How a checkpoint stored already quantized was made: config.json's "quantization" entry, as
    mlx_lm.convert writes it (mlx-community's and Qwen's own "-MLX-4bit" models). Each quantized
    matrix x.weight is then stored as three tensors: x.weight (the packed uint32), x.scales and
    x.biases. Returns {"group_size": 64, "bits": 4, "mode": "affine"} plus, for the layers quantized
    differently (mixed precision), their own settings by name; {} for a checkpoint in floats."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return raw.get("quantization") or {}


def take_tensor(tensors, name, dtype, bits, stored):
    """Take tensor `name` out of the checkpoint's `tensors`: stored quantized, with its .scales and
    .biases, it is used as it is; with bits (--quantize), a matrix is quantized now; otherwise it is
    converted to `dtype`."""
    weight = tensors.pop(name)
    stem = name.removesuffix(".weight")
    if f"{stem}.scales" in tensors:  # stored quantized: the integers are used as they are
        how = stored.get(stem, stored)  # a layer may have settings of its own
        return Quantized(weight, tensors.pop(f"{stem}.scales").astype(dtype),
                         tensors.pop(f"{stem}.biases").astype(dtype), how["group_size"],
                         how["bits"])
    # Matrices whose rows split into whole groups (all of Qwen3's); mlx-lm leaves others as is.
    if bits and weight.ndim == 2 and weight.shape[1] % GROUP_SIZE == 0:
        return quantize(weight, bits, dtype)
    return weight.astype(dtype)


def load_quantized(model_dir, config, dtype, bits=None):
    """load_weights() with every matrix quantized to `bits` as it is read, or read as it is from a
    checkpoint stored quantized."""
    stored = stored_quantization(model_dir)
    return load_weights(model_dir, config, dtype,
                        take=lambda tensors, name: take_tensor(tensors, name, dtype, bits, stored))


# --- 16. More sampling controls: min-p and a presence penalty -------------------------------------
#
# Min-p keeps the tokens at least min_p times as likely as the likeliest one, after top-k and top-p
# (transformers' order): a cut that scales with the model's confidence, strict when one token
# dominates. The presence penalty lowers the logit of every token already in the reply by the same
# amount, however often it occurred (OpenAI's and vLLM's meaning): against the endless loops a small
# model can fall into. It needs to remember the reply's tokens, so it is a pick() for generate()
# that keeps state; being built from MLX arrays, it works on tokens not yet computed.

def filter_min_p(logits, min_p):
    """Set to -inf the tokens less than min_p times as likely as the likeliest, in logits already
    divided by the temperature and filtered by top-k and top-p (filter_logits)."""
    probs = mx.softmax(logits)
    return mx.where(probs >= min_p * probs.max(), logits, -mx.inf)


def extra_sampling(min_p, presence_penalty, vocab_size):
    """A pick(logits, sampling, key) for generate() with min-p and a presence penalty. It remembers
    the tokens it picked: make a new one for each reply."""
    in_reply = mx.zeros(vocab_size)  # 1 for each token picked so far

    def pick(logits, sampling, key):
        nonlocal in_reply
        logits = logits - presence_penalty * in_reply
        if sampling.temperature == 0 or min_p == 0:
            token = sample(logits, sampling, key)
        else:
            logits = filter_min_p(filter_logits(logits, sampling), min_p)
            token = mx.random.categorical(logits, key=key)
        in_reply = in_reply.at[token].maximum(1.0)  # a copy with in_reply[token] = 1
        return token

    return pick


# --- 17. Chat: one KV cache for a whole conversation ----------------------------------------------
#
# Qwen3 was trained on conversations in a chat format, each turn <|im_start|>role\n...<|im_end|>\n.
# At every turn, its chat template (in tokenizer_config.json) renders the whole conversation again,
# and the model reads all of it:
#
#   <|im_start|>system\n{system}<|im_end|>\n            (if there is one)
#   <|im_start|>user\n{message}<|im_end|>\n
#   <|im_start|>assistant\n{answer}<|im_end|>\n         (an earlier reply, without its thinking)
#   ...
#   <|im_start|>user\n{new message}<|im_end|>\n
#   <|im_start|>assistant\n                             (+ <think>\n\n</think>\n\n for no thinking)
#
# Most of that is already in the cache from the turn before, so only the rest needs a prefill: the
# cache keeps the longest prefix it shares with the new rendering and forgets what follows. That
# costs nothing: setting `offset` back is enough, as new keys and values are written over the old.
# Only a prefix can be kept: a token's keys and values depend on its position (RoPE) and, through
# the layers below, on every token before it. After the first token that differs, everything is
# computed again, even text that reappears unchanged at new positions.
#
# Why would anything differ? Because the template rewrites history. Once a new user message
# follows, a reply's <think>...</think> reasoning is dropped: it has served its purpose, keeping it
# would fill the context, and Qwen3 was trained on conversations without it. The empty think block
# of a reply made without thinking goes too. So each turn rolls back to the start of the last
# reply, then prefills its answer and the new message; everything before is reused. (A reply cut
# off while thinking has no </think>: the template keeps it whole, and so do we.)
#
# Earlier replies enter the history as the token ids the model generated: tokenizing their text
# again could give other ids for the same text (a different split into pieces), and the cache holds
# the generated ones.

def chat_prompt(user, system=None, think=True):
    """Qwen3's chat format for one message, written out by hand.

    The text ends by opening the assistant's turn, so the likeliest continuation is a reply. Qwen3
    first "thinks" inside <think>...</think>; an empty think block (what Qwen's template writes for
    enable_thinking=False) makes it answer directly. system="" writes an empty system turn; None
    writes none. The tokenizer maps each marker such as <|im_start|> to one special id.
    """
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return text if think else text + "<think>\n\n</think>\n\n"


class Chat:
    """A conversation: its turns so far, and one KV cache that every turn reuses."""

    def __init__(self, weights, config, tokenizer, system=None, think=True):
        self.weights, self.config, self.tokenizer = weights, config, tokenizer
        self.system, self.think = system, think
        self.turns = []  # (user message, reply ids) per turn; the program may drop or clear them
        self.cache = make_cache(config)
        self.cached_ids = []  # the ids whose keys and values are in the cache, in order
        self.reused = self.prefilled = 0  # the last turn's tokens taken from the cache / computed

    def prompt_ids(self, message):
        """The conversation so far plus a new message, as Qwen3's chat template renders them."""
        tokens = lambda text: tokenize(self.tokenizer, text)
        system = self.system
        ids = tokens(f"<|im_start|>system\n{system}<|im_end|>\n") if system is not None else []
        for user, reply in self.turns:
            ids += tokens(chat_prompt(user))  # ...user\n{user}<|im_end|>\n<|im_start|>assistant\n
            ids += self.answer(reply) + tokens("<|im_end|>\n")
        return ids + tokens(chat_prompt(message, think=self.think))

    def answer(self, reply):
        """A reply as the template keeps it: what follows the last </think>, without the newlines
        that start it. A reply without </think> (say, stopped while thinking) is kept whole."""
        end_think = self.tokenizer.token_to_id("</think>")
        if end_think not in reply:
            return reply
        last = len(reply) - 1 - reply[::-1].index(end_think)  # where the last </think> is
        answer = reply[last + 1:]
        text = lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False)
        while answer and text(answer[0]).strip("\n") == "":  # the newlines opening the answer
            answer = answer[1:]
        return answer

    def reply(self, message, max_tokens, sampling=Sampling(), eos_ids=(), pick=sample):
        """Yield (token id, logits) of the reply to `message`, like generate() (through section
        13's generate_long, as a first message may be long). The reply joins the history also when
        the caller stops early (then close() this generator), even if empty."""
        ids = self.prompt_ids(message)
        # How many leading ids the cache already holds. The last id is always fed again: its logits
        # give the reply's first token.
        self.reused = 0
        for cached, new in zip(self.cached_ids, ids[:-1]):
            if cached != new:
                break
            self.reused += 1
        for layer_cache in self.cache:
            layer_cache.offset = self.reused  # the roll-back
        self.prefilled, reply = len(ids) - self.reused, []
        try:
            for token_id, logits in generate_long(ids[self.reused:], self.weights, self.config,
                                                  max_tokens, sampling, eos_ids, self.cache, pick):
                if token_id not in eos_ids:  # the template closes each turn with <|im_end|>
                    reply.append(token_id)
                yield token_id, logits
        finally:  # finished, stopped by the caller, or interrupted by Ctrl-C inside generate()
            self.turns.append((message, reply))
            # What the cache holds now. `offset` counts the positions already written (MLX computes
            # them when next read): generate() may have fed one token more than it yielded (the
            # <|im_end|> that ended the reply, not in `reply`, is left out here), and a step
            # interrupted midway may have reached only some layers.
            self.cached_ids = (ids + reply)[:min(c.offset for c in self.cache)]


# --- 18. The logit lens: what the model would say after each block --------------------------------
#
# Every block reads and adds to the same residual stream, and only the final norm and the LM head
# turn it into logits. Applied early, to the stream after block 5, say, they show what the model
# would say if it stopped there: with the real weights, watch in which block " Paris" takes the
# lead. After the last block, the lens is the model's own output. --trace shows it at every block.

def logit_lens(x, weights, config):
    """The next-token logits (vocab,) read off the residual stream x (seq, 1024) at its last
    position, as forward() reads them after the last block."""
    return linear(rms_norm(x[-1:], weights["norm"], config.rms_norm_eps), weights["lm_head"])[0]


# ================================================================================================
# PART 3: THE PROGRAM AROUND IT
# ================================================================================================

import argparse  # the imports only the program needs
import re
import shlex
import shutil
import tempfile
import time

from tokenizers.decoders import DecodeStream

HF_REPO = "Qwen/Qwen3-0.6B"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # the other two are optional
WEIGHTS_INDEX = "model.safetensors.index.json"  # stands in for model.safetensors when sharded


class UserError(Exception):
    """A mistake a person can fix (bad flag, missing file, ...): one line, no traceback."""


# --- Checking the model folder: everything Part 1's loaders assume, each failure one line ---------

def check_config(model_dir):
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; re-download it")
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download it")
    found = raw.get("model_type") if isinstance(raw, dict) else None
    if found == "qwen3_moe":
        raise UserError(f"{path} describes a mixture-of-experts model (model_type 'qwen3_moe'), "
                        "which this script does not implement; use a dense Qwen3 model")
    if found != "qwen3":
        raise UserError(f"{path} is not a Qwen3 config (model_type is {found!r}, expected 'qwen3')")
    rope = raw.get("rope_parameters") or {}
    unsupported = {  # variants Part 1 does not implement: refuse them rather than run them wrong
        "RoPE scaling": raw.get("rope_scaling") or rope.get("rope_type", "default") != "default",
        "attention bias (attention_bias: true)": raw.get("attention_bias"),
        "sliding-window attention (use_sliding_window: true)": raw.get("use_sliding_window"),
    }
    for feature, asked in unsupported.items():
        if asked:
            raise UserError(f"{path} asks for {feature}, which this script does not implement")
    raw.setdefault("rope_theta", rope.get("rope_theta"))
    for name, kind in Config.__annotations__.items():  # kind: int, float or bool
        value = raw.get(name)
        if value is None:
            raise UserError(f"{path} lacks the required key {name!r}")
        if kind is bool:
            fits, expected = isinstance(value, bool), "true or false"
        else:  # sizes and counts, rope_theta and rms_norm_eps: 0 or less makes no model
            fits = is_number(value, kind) and value > 0
            expected = f"a positive {'integer' if kind is int else 'number'}"
        if not fits:
            raise UserError(f"{path}: {name!r} should be {expected}, got {json.dumps(value)}")
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if heads % kv_heads:  # each key/value head serves a whole group of query heads (section 6)
        raise UserError(f"{path}: 'num_attention_heads' ({heads}) should be a multiple of "
                        f"'num_key_value_heads' ({kv_heads})")
    check_quantization(path, raw)


def is_number(value, kind=float):
    """Whether a value read from JSON is a number of `kind` (int, or float which takes ints too).
    Python's json reads true as True, a bool, which Python counts as an int: no number here. 2.0 is
    no int (an int is what JSON writes without a point), and NaN or Infinity, which Python's json
    also reads, are no usable value."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)  # isfinite fails on ints above 1e308


def check_quantization(path, raw):
    """A checkpoint stored quantized must be in MLX's format, with settings MLX's kernels take:
    affine mode, 2 to 8 bits, groups of 32, 64 or 128 (what section 15 reads); else one line."""
    quantization = raw.get("quantization")
    if quantization is None:
        other = raw.get("quantization_config")  # how transformers describes GPTQ, AWQ, FP8, ...
        if other:
            method = other.get("quant_method") if isinstance(other, dict) else other
            raise UserError(f"{path}: the weights are quantized with {method!r}, which this script "
                            "does not read; use an unquantized or an MLX-format (mlx_lm.convert) "
                            "checkpoint")
        return
    if not isinstance(quantization, dict):
        raise UserError(f"{path}: 'quantization' should be an object such as "
                        f'{{"group_size": 64, "bits": 4}}, got {quantization!r}')
    layers = {name: how for name, how in quantization.items() if isinstance(how, dict)}
    for layer, how in ({"": quantization} | layers).items():
        mode, bits, group = how.get("mode", "affine"), how.get("bits"), how.get("group_size")
        if mode != "affine" or bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128):
            raise UserError(f"{path} asks for {mode} quantization at {bits} bits in groups of "
                            f"{group}{f' for {layer}' if layer else ''}; this script reads affine "
                            "quantization at 2-6 or 8 bits in groups of 32, 64 or 128")


def weight_shapes(config):
    """Every tensor Part 1 loads, by its name in the Hugging Face checkpoint, with its shape."""
    c = config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer_shapes = {
        "input_layernorm": (c.hidden_size,), "post_attention_layernorm": (c.hidden_size,),
        "q_proj": (q_dim, c.hidden_size), "k_proj": (kv_dim, c.hidden_size),
        "v_proj": (kv_dim, c.hidden_size), "o_proj": (c.hidden_size, q_dim),
        "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{LAYER_TENSORS[short]}": shape
                   for short, shape in layer_shapes.items()}
    return shapes


def checked_weight_files(model_dir):
    """Part 1's weight_files(), with a damaged model.safetensors.index.json as one line. The files
    are not checked: when downloading, the index arrives before the shards it names."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX
    try:
        files = weight_files(model_dir)
    except OSError as e:
        raise UserError(f"cannot read {index}: {e.strerror or e}")
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, AttributeError):
        files = []
    # Plain names of files beside the index: a path such as "../x" would read outside the folder.
    if not files or any(path.parent != model_dir for path in files):
        raise UserError(f"{index} is not a valid index of shards (a JSON object whose "
                        "'weight_map' names a file for each tensor); re-download it")
    return files


def read_header(path):
    """A safetensors file starts with a length, then JSON: tensor name -> dtype, shape, byte range
    after the header. Returns (header, where the tensor bytes start, the file's size)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_size = int.from_bytes(f.read(8), "little")
            header = f.read(header_size) if 8 + header_size <= size else b""
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}")
    try:
        header = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a readable safetensors file (no valid header); "
                        "re-download it")
    return header, 8 + header_size, size


def check_weights(model_dir, config):
    """Read the weight files' headers and check that every tensor Part 1 needs is there, with its
    shape and a dtype it reads, inside its file (no weight is read)."""
    files = checked_weight_files(model_dir)
    missing = [path.name for path in files if not path.exists()]  # a directory: read_header says
    if missing:
        raise UserError(f"{model_dir} lacks {missing[0]}, one of the {len(files)} shards named in "
                        f"{WEIGHTS_INDEX} ({len(missing)} missing); re-download it")
    found = {}  # tensor name -> (file, its header entry, where the file's tensor bytes start, size)
    for path in files:
        header, start, size = read_header(path)
        found |= {name: (path, entry, start, size) for name, entry in header.items()}
    expected = weight_shapes(config)
    if "lm_head.weight" in found:  # a tied checkpoint's extra head may be loaded (load_model)
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    floats = ("BF16", "F16", "F32")
    dtypes = dict.fromkeys(expected, floats)  # what each tensor may be stored as
    quantization = stored_quantization(model_dir)
    for name, (rows, columns) in [(n, s) for n, s in expected.items() if len(s) == 2]:
        stem = name.removesuffix(".weight")
        if quantization and f"{stem}.scales" in found:  # stored quantized (section 15)
            how = quantization.get(stem, quantization)
            expected[name], dtypes[name] = (rows, columns * how["bits"] // 32), ("U32",)
            for part in ("scales", "biases"):
                expected[f"{stem}.{part}"] = (rows, columns // how["group_size"])
                dtypes[f"{stem}.{part}"] = floats
    for name, shape in expected.items():
        if name not in found or not isinstance(found[name][1], dict):
            where = files[0] if len(files) == 1 else f"the sharded checkpoint {model_dir}"
            raise UserError(f"{where} lacks the tensor {name!r}")
        path, entry, start, size = found[name]
        stored, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(stored, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise UserError(f"{path} is damaged (a malformed header entry for {name!r}); "
                            "re-download it")
        if tuple(stored) != shape:
            raise UserError(f"{path}: tensor {name!r} has shape {tuple(stored)}, expected {shape}")
        if entry.get("dtype") not in dtypes[name]:
            raise UserError(f"{path}: tensor {name!r} is stored as {entry.get('dtype')}, "
                            f"expected {'BF16, F16 or F32' if dtypes[name] == floats else 'U32'}")
        if not isinstance(offsets[1], int) or start + offsets[1] > size:
            raise UserError(f"{path} is damaged (it ends inside tensor {name!r}: an interrupted "
                            "download?); re-download it")


def check_chat_template(model_dir):
    """--chat writes Qwen3's hybrid-thinking format by hand (section 17). Qwen3-2507 Instruct (never
    thinks) and Thinking (always thinks) were trained on other formats: their templates, unlike the
    hybrid one, have no enable_thinking switch. A folder without a template is given the benefit."""
    model_dir = Path(model_dir)
    path = model_dir / "chat_template.jinja"  # newer checkpoints keep the template in its own file
    try:
        if path.is_file():
            template = path.read_text(encoding="utf-8")
        else:
            path = model_dir / "tokenizer_config.json"
            config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            template = config.get("chat_template") or ""
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                template = "".join(t.get("template", "") for t in template
                                   if t.get("name") == "default")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"cannot read {path} ({e}); re-download it")
    if template and "enable_thinking" not in template:
        raise UserError(f"{path} holds a chat template other than Qwen3's hybrid-thinking one that "
                        "--chat writes (a Qwen3-2507 model?); run it without --chat")


def weight_bytes(config, dtype, bits=None, group_size=GROUP_SIZE, stored=None):
    """The bytes Part 1's weights take once loaded as dtype (a tied head shares the embedding's);
    quantized, a matrix whose rows split into whole groups takes `bits` per weight plus a scale and
    a bias (dtype) per group. stored: config.json's "quantization", whose settings for a matrix
    (mixed precision) win over bits and group_size."""
    total = 0
    for name, shape in weight_shapes(config).items():
        n, how = math.prod(shape), (stored or {}).get(name.removesuffix(".weight"))
        b, g = (how["bits"], how["group_size"]) if isinstance(how, dict) else (bits, group_size)
        quantized = b and len(shape) == 2 and shape[1] % g == 0  # as take_tensor and mlx-lm do
        total += n * b // 8 + 2 * n // g * dtype.size if quantized else n * dtype.size
    return total


def memory_size():
    """The memory the weights must fit in: on a GPU, its memory as MLX reports it (on a Mac, the
    unified memory the GPU shares with the CPU; on CUDA, the card's); on the CPU, the RAM."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    size = info.get("memory_size") or info.get("total_memory")  # Metal's key, CUDA's key
    return size or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_working_set():
    """On a Mac, the memory Metal recommends its GPU use at most: about two thirds to three
    quarters of the unified memory. Beyond it MLX still allocates, but the weights are paged in
    and out on every token. None elsewhere: CUDA reports no such size, and the CPU has the RAM."""
    if mx.default_device() != mx.gpu:
        return None
    return mx.device_info().get("max_recommended_working_set_size")


def check_memory(needed, available, dtype, working_set=None):
    """Refuse weights larger than the whole memory, or on a Mac than the GPU's working set, before
    reading gigabytes only to crash or swap. Anything smaller is left to run: the OS can usually
    make room."""
    if working_set and needed > working_set:
        has = (f"this Mac's GPU may use only {working_set / 1e9:.1f} GB of its "
               f"{available / 1e9:.1f} GB of memory (Metal's recommended working set)")
    elif needed > available:
        has = f"this machine has {available / 1e9:.1f} GB of memory"
    else:
        return
    name = str(dtype).split(".")[-1]
    smaller = "--dtype bfloat16 (half the bytes), " if dtype.size == 4 else ""
    raise UserError(f"the weights need {needed / 1e9:.1f} GB as {name}, but {has}; try "
                    f"{smaller}--quantize 4, or a smaller model")


def wire_weights(weights):
    """On a Mac, keep weights that fill more than half the GPU's working set resident ("wired")
    while generating, as mlx-lm's generate does: macOS could otherwise page them out, and every
    token reads all of them. Called once, before anything is generated: MLX asks that the limit
    not change while work is queued. It lasts until the process ends."""
    from mlx.utils import tree_flatten  # only this Mac step needs it

    working_set = gpu_working_set()
    arrays = {id(a): a for _, a in tree_flatten(weights) if isinstance(a, mx.array)}  # tied: once
    if working_set and sum(a.nbytes for a in arrays.values()) > working_set / 2:
        mx.set_wired_limit(working_set)


# The lowest temperature besides 0. Lower, sampling is greedy in all but name (a logit gap of 0.01
# becomes 100), and far lower (1e-45) logits / temperature overflow to inf: the draw gives token 0.
MIN_TEMPERATURE = 1e-4

# What the program reads from generation_config.json: each key's test, and what it should be.
GENERATION_KEYS = {
    "temperature": (lambda t: is_number(t) and (t == 0 or t >= MIN_TEMPERATURE),
                    f"0 (greedy) or at least {MIN_TEMPERATURE}"),
    "top_k": (lambda k: is_number(k, int) and k >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda p: is_number(p) and 0 < p <= 1, "a number in (0, 1]"),
    "min_p": (lambda p: is_number(p) and 0 <= p <= 1, "a number in [0, 1]"),
    "eos_token_id": (lambda ids: all(is_number(i, int) and i >= 0 for i in
                                     (ids if isinstance(ids, list) else [ids])),
                     "a token id (an integer >= 0) or a list of them"),
}


def load_generation_config(model_dir):
    """generation_config.json (optional): end-of-sequence ids, Qwen's recommended sampling."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        generation_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} ({e}); delete or re-download it")
    if not isinstance(generation_config, dict):
        raise UserError(f"{path} is not a JSON object; delete or re-download it")
    generation_config = {key: value for key, value in generation_config.items()
                         if value is not None}  # null: unset
    for key, (fits, expected) in GENERATION_KEYS.items():
        if key in generation_config and not fits(generation_config[key]):
            raise UserError(f"{path}: {key!r} should be {expected}, got "
                            f"{json.dumps(generation_config[key])}; fix it or delete the file")
    return generation_config


def eos_token_ids(generation_config, tokenizer):
    """Ids that end a reply: <|im_end|> (151645) ends a chat turn, <|endoftext|> (151643) a text."""
    ids = generation_config.get("eos_token_id", [])
    ids = set(ids if isinstance(ids, list) else [ids])
    for token in ("<|im_end|>", "<|endoftext|>"):
        if tokenizer.token_to_id(token) is not None:
            ids.add(tokenizer.token_to_id(token))
    return ids


def use_stored_head(model_dir, weights, dtype, bits, stored):
    """A checkpoint whose config ties the LM head to the embeddings may store lm_head.weight too:
    a copy, dropped, or a different matrix, which transformers 5 uses, and so do we (mlx-lm drops
    it). Compared as stored, before any conversion."""
    tensors = load_tensors(model_dir)
    head = tensors.get("lm_head.weight")
    if head is not None and not mx.array_equal(head, tensors["model.embed_tokens.weight"]).item():
        weights["lm_head"] = take_tensor(tensors, "lm_head.weight", dtype, bits, stored)
        mx.eval(weights["lm_head"])


def load_model(model_dir, dtype, bits=None):
    """Part 1's loaders, after checking what they assume; bits: --quantize.
    Returns (config, weights, tokenizer, generation config)."""
    check_config(model_dir)
    config = load_config(model_dir)
    quantization = stored_quantization(model_dir)  # {} unless stored quantized (section 15)
    stored_bits = quantization.get("bits")
    if bits and stored_bits and bits != stored_bits:
        raise UserError(f"{model_dir} is already quantized to {stored_bits} bits; drop --quantize "
                        "or point --model at the unquantized model")
    check_weights(model_dir, config)  # first: the memory needed is computed from config.json
    group_size = quantization.get("group_size", GROUP_SIZE)
    check_memory(weight_bytes(config, dtype, bits or stored_bits, group_size, quantization),
                 memory_size(), dtype, gpu_working_set())
    path = Path(model_dir) / "tokenizer.json"
    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as e:  # the Rust library raises a plain Exception for any unreadable file
        raise UserError(f"cannot load {path} ({e}); re-download it")
    generation_config = load_generation_config(model_dir)
    try:
        if bits or quantization:
            weights = load_quantized(model_dir, config, dtype, bits)
        else:
            weights = load_weights(model_dir, config, dtype)
        if config.tie_word_embeddings:
            use_stored_head(model_dir, weights, dtype, bits, quantization)
    except (RuntimeError, ValueError, OSError) as e:  # e.g. a read error halfway through a file
        files = weight_files(model_dir)
        where = files[0] if len(files) == 1 else f"a shard in {model_dir}"
        raise UserError(f"{where} is damaged ({e}); re-download it")
    return config, weights, tokenizer, generation_config


# --- Finding the model: a folder, or a Hugging Face repo id downloaded once into a folder ---------

def default_model_dir():
    """./Qwen3-0.6B when present, otherwise the Qwen3-0.6B folder next to this script."""
    here = Path("Qwen3-0.6B")
    return here if here.is_dir() else Path(__file__).resolve().parent / "Qwen3-0.6B"


def is_repo_id(text):
    """'owner/name', as Hugging Face spells repo ids: letters, digits, '-', '_' and '.'."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text) is not None


def repo_dir(repo):
    """Where a repo id's files go: Qwen/Qwen3-1.7B -> Qwen/Qwen3-1.7B next to this script."""
    return Path(__file__).resolve().parent / repo


def download_command(repo, model_dir):
    """The `hf download` command that fetches repo into model_dir, to print. Its --local-dir is
    relative, so that the command also works on another machine, run from the same place: to the
    current folder when model_dir is under it, else to this script's folder, with a cd there."""
    files = f" {' '.join(MODEL_FILES)}" if repo == HF_REPO else ""
    model_dir, here = Path(model_dir).absolute(), Path.cwd()
    script_dir, cd = Path(__file__).resolve().parent, ""
    if model_dir.is_relative_to(here):
        model_dir = model_dir.relative_to(here)
    elif model_dir.is_relative_to(script_dir):  # repo_dir() and default_model_dir() are there
        cd, model_dir = f"cd {shlex.quote(str(script_dir))} && ", model_dir.relative_to(script_dir)
    return f"{cd}hf download {repo}{files} --local-dir {shlex.quote(str(model_dir))}"


def missing_files(names):
    """The NEEDED_FILES not among the file names given (a folder's, or a repo's); a sharded
    checkpoint's index stands in for model.safetensors (check_weights then checks its shards)."""
    return [name for name in NEEDED_FILES if name not in names
            and not (name == "model.safetensors" and WEIGHTS_INDEX in names)]


def download_model(repo, model_dir):
    """Fetch the files Part 1 reads from a Hugging Face repo into model_dir, all or nothing.

    Files land in a temporary folder first and are moved in only once all have arrived, so an
    interrupted download never leaves a folder that looks complete, nor any new folder at all.
    """
    import huggingface_hub  # only needed here, on the first run

    model_dir = Path(model_dir)
    staging = None
    try:
        info = huggingface_hub.HfApi().model_info(repo, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings}  # every file in the repo
        lacking = missing_files(sizes)
        if lacking:
            raise UserError(f"{repo} has no {', '.join(lacking)}: it is not a Qwen3 checkpoint "
                            "in Hugging Face's safetensors layout")
        root = next(folder for folder in model_dir.parents if folder.is_dir())
        staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.download-", dir=root))
        fetch = lambda name: huggingface_hub.hf_hub_download(repo, name, local_dir=staging)
        fetch("config.json")
        check_config(staging)  # refuse a model this script does not run before fetching gigabytes
        names = [name for name in (*MODEL_FILES, "chat_template.jinja") if name in sizes]
        if "model.safetensors" not in sizes:
            fetch(WEIGHTS_INDEX)
            names += [WEIGHTS_INDEX, *(path.name for path in checked_weight_files(staging))]
        print(f"Downloading {repo} ({len(names)} files, "
              f"{sum(sizes.get(name, 0) for name in names) / 1e9:.2f} GB) into {model_dir}/",
              file=sys.stderr)
        for name in names:
            if not (staging / name).exists():
                fetch(name)
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            os.replace(staging / name, model_dir / name)
    except UserError as e:  # name the repo in the message, not the temporary folder
        raise UserError(str(e).replace(str(staging), repo) if staging else str(e))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not download {repo} ({type(e).__name__}: {reason}); "
                        f"fetch it by hand with: {download_command(repo, model_dir)}")
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def find_model(model_arg, allow_download):
    """The model folder to use. --model is a folder when that path exists or is no repo id; it is
    never downloaded into, as it may hold another model. A repo id (the default: Qwen/Qwen3-0.6B)
    is downloaded into its folder when that is missing or incomplete."""
    if model_arg and (Path(model_arg).exists() or not is_repo_id(model_arg)):
        model_dir, repo = Path(model_arg), None
    else:
        repo = model_arg or HF_REPO
        model_dir = repo_dir(repo) if model_arg else default_model_dir()
    # exists(), not is_file(): a directory in a file's place is reported as unreadable when read,
    # rather than as missing (a download would then fail writing over it).
    present = {name for name in (*NEEDED_FILES, WEIGHTS_INDEX) if (model_dir / name).exists()}
    missing = missing_files(present)
    if not missing:
        return model_dir
    if model_dir.is_dir():
        what = f"{model_dir} lacks {', '.join(missing)}"
    elif model_dir.exists():  # say, --model Qwen3-0.6B/config.json
        what = f"{model_dir} is a file, not a model folder"
    else:
        what = f"model folder {model_dir} not found"
    if repo is None:
        raise UserError(f"{what}; point --model at a folder with {', '.join(NEEDED_FILES)} "
                        f"(or {WEIGHTS_INDEX} and its shards), or at a repo id such as "
                        "Qwen/Qwen3-1.7B")
    if not allow_download:
        raise UserError(f"{what} and --no-download was given; "
                        f"fetch it with: {download_command(repo, model_dir)}")
    try:
        download_model(repo, model_dir)
    except UserError as e:
        raise UserError(f"{what}, and {e}")
    return model_dir


# --- Experiments: --top-probs and --trace ---------------------------------------------------------

def print_top_probs(logits, tokenizer, n):
    """A table of the n likeliest next tokens and their probabilities (" Paris" first)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    top = mx.argsort(-probs)[:n].tolist()
    print(f"{'rank':>4}  {'token':<16} {'id':>7}  probability", file=sys.stderr)
    for rank, token_id in enumerate(top, 1):
        token = tokenizer.decode([token_id], skip_special_tokens=False)  # show <|im_end|> too
        print(f"{rank:>4}  {token!r:<16} {token_id:>7}  {probs[token_id].item():.4f}",
              file=sys.stderr)


# What each traced step does, for --trace.
TRACED_STEPS = {
    "embed": "one table row per token",
    "rms_norm": "scale each vector to RMS 1, times the learned gains",
    "apply_rope": "rotate channel pairs by position",
    "queries_keys_values": "project to q, k, v heads; QK-norm and RoPE (the lines above)",
    "cache.update_and_fetch": "store this layer's new keys/values, fetch all so far",
    "attend": "softmax(q kᵀ/√d) v, each K/V head shared by a group of q heads",
    "attention": "heads joined, output projection",
    "swiglu": "feed-forward, widened inside, per position",
}


def shape(value):
    return f"{tuple(value.shape)} {str(value.dtype).split('.')[-1]}"


def trace(prompt_ids, weights, config, tokenizer):
    """--trace: one forward pass over the prompt, narrated while it runs.

    Part 1 is untouched: for this one pass, the functions forward() calls are replaced, in this
    module's namespace where it looks them up, by wrappers that print each call's shapes. Block 0
    is shown call by call (a call prints when it returns, so a function's inner calls come before
    it), then every block by the size (RMS) of the residual stream it leaves and its logit lens
    (section 18): the likeliest next token if the model stopped there.
    """
    log = lambda text: print(text, file=sys.stderr)
    replaced = {name: globals()[name] for name in TRACED_STEPS if name != "cache.update_and_fetch"}
    replaced["transformer_block"] = transformer_block
    update = KVCache.update_and_fetch
    block = 0  # the block being run

    def wrap(name, function):
        def traced(*args):
            out = function(*args)
            if block == 0:
                inputs = ", ".join(shape(a) for a in args if isinstance(a, mx.array))
                outs = ", ".join(shape(o) for o in (out if isinstance(out, tuple) else (out,)))
                log(f"  {name:<22} {inputs} -> {outs}\n  {'':<22} ({TRACED_STEPS[name]})")
            return out
        return traced

    def traced_block(x, layer, config, cache):
        nonlocal block
        if block == 0:
            log("block 0, call by call:")
        out = replaced["transformer_block"](x, layer, config, cache)
        block += 1  # before the lens, whose own calls are not part of block 0's narration
        rms = mx.sqrt(mx.mean(out.astype(mx.float32) ** 2)).item()  # runs the block now
        probs = mx.softmax(logit_lens(out, weights, config).astype(mx.float32))
        top = mx.argmax(probs).item()
        log(f"block {block - 1:>2} done: residual stream {shape(out)}, RMS {rms:.3f}, lens: "
            f"{piece(top)!r} {probs[top].item():.3f}")
        return out

    piece = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
    pieces = " ".join(repr(piece(i)) for i in prompt_ids)
    log(f"tokens: {len(prompt_ids)} ids {prompt_ids}\n        {pieces}")
    log("after each block: the residual stream's size (RMS) and its logit lens, the likeliest next "
        "token if the model stopped there")
    globals().update({name: wrap(name, f) for name, f in replaced.items()})
    globals()["transformer_block"] = traced_block
    KVCache.update_and_fetch = wrap("cache.update_and_fetch", update)
    try:
        logits = forward(mx.array(prompt_ids), weights, config, make_cache(config))
        mx.eval(logits)
    finally:
        globals().update(replaced)
        KVCache.update_and_fetch = update
    log(f"final RMSNorm + LM head -> logits {shape(logits)}; the next token's probabilities:")
    print_top_probs(logits, tokenizer, 5)


# --- The command line: python llm_inference.py --prompt "..." [flags] -----------------------------

DEFAULT_PROMPT = "The capital of France is"
CHAT_MAX_TOKENS = 8192  # enough for Qwen3 to finish thinking on most questions (README, Chat)


def device_name():
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "gpu (Metal)" if mx.metal.is_available() else "gpu (CUDA)"


# --- OpenBLAS: the lines before `import mlx.core` at the top of the file --------------------------
#
# MLX's Linux CPU wheel (the mlx-cpu package, unpacked
# next to mlx/ with its libraries in mlx_cpu.libs/) does float32 matrix products by calling
# cblas_sgemm from a bundled reference BLAS: plain loops, fine for decoding's one-token products
# but many times slower than OpenBLAS on a whole prompt (docs/platforms.md). A library opened with
# RTLD_GLOBAL before MLX loads comes first when the dynamic linker resolves MLX's symbols, so
# loading OpenBLAS that way sends those calls to it; loaded after MLX it is never used. macOS and
# the CUDA wheel do matrix products on the GPU: there the lines load nothing.
OPENBLAS_HINT = ("Hint: this CPU runs float32 faster with OpenBLAS, which this script uses once "
                 "installed: sudo apt-get install libopenblas0-pthread")


def pick_dtype(name):
    """'auto' = bfloat16 on a GPU; float32 on the CPU, where MLX runs bfloat16 products through
    its own slower loops, with or without OpenBLAS (docs/platforms.md)."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return getattr(mx, name)


def checked_text(text, what):
    """Text from the command line. Bytes that are not UTF-8 (say, cut mid-character) arrive as lone
    surrogates, which the tokenizer would only reject after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not valid UTF-8 text (cut in the middle of a character?)")
    return text


def read_prompt(text):
    if text == "-":  # read the prompt from stdin
        if sys.stdin.isatty():
            print("Reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr)
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError("the prompt on stdin is not valid UTF-8 text")
        text = text[:-1] if text.endswith("\n") else text  # `echo ... |` adds a newline
    checked_text(text, "--prompt")
    if not text.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    return text


def number(kind, low=None, high=None, low_open=False):
    """An argparse type: a number of `kind` within [low, high] (or (low, high] if low_open)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        if not math.isfinite(value):  # float("nan") parses, and compares False with every bound
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low}, {'inf)' if high is None else f'{high}]'}"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value
    return parse


def temperature(text):
    """An argparse type for --temperature: 0 (greedy), or at least MIN_TEMPERATURE."""
    value = number(float, 0)(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be 0 or at least {MIN_TEMPERATURE}, got {text}; "
                                         "use 0 for greedy")
    return value


def model_name(text):
    """An argparse type for --model: a folder or a repo id. An empty one (a shell variable that was
    never set?) would otherwise mean the default model, and a 1.5 GB download."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a model folder, or a repo id such as "
                                         f"{HF_REPO}")
    return text


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block; exit code 2 as usual
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(prog="llm_inference.py", description="Generate text with Qwen3 on MLX.")
    ap.add_argument("--prompt", help="the text to continue ('-' reads stdin; default: "
                    f"{DEFAULT_PROMPT!r}); with --chat, one message and its reply")
    ap.add_argument("--max-tokens", type=number(int, 1),
                    help=f"stop after this many new tokens (100; {CHAT_MAX_TOKENS} with --chat, at "
                    "most half the context)")
    ap.add_argument("--temperature", type=temperature,
                    help="0 = greedy (default; with --chat 0.6, or 0.7 with --no-think)")
    ap.add_argument("--top-p", type=number(float, 0, 1, low_open=True),
                    help="nucleus sampling mass (generation_config.json's; 0.8 with --no-think)")
    ap.add_argument("--top-k", type=number(int, 0),
                    help="keep only the k most likely tokens, 0 = all (generation_config.json's)")
    ap.add_argument("--min-p", type=number(float, 0, 1),
                    help="keep tokens at least this fraction as likely as the likeliest (0)")
    ap.add_argument("--presence-penalty", type=number(float, 0, 2),
                    help="lower the logit of tokens already in the reply, against repetition (0)")
    ap.add_argument("--seed", type=number(int, 0, 2**64 - 1),
                    help="random seed for sampling (default: a fresh one)")
    ap.add_argument("--model", type=model_name,
                    help="a model folder, or a Hugging Face repo id such as Qwen/Qwen3-1.7B, "
                    "downloaded once into the folder Qwen/Qwen3-1.7B next to this script "
                    "(default: ./Qwen3-0.6B, else the one next to this script)")
    ap.add_argument("--no-download", action="store_true",
                    help="never download the model, fail instead")
    ap.add_argument("--chat", action="store_true",
                    help="talk with the model in Qwen3's chat format (README, Chat)")
    ap.add_argument("--system", help="system message for --chat")
    ap.add_argument("--no-think", action="store_true",
                    help="with --chat: skip Qwen3's <think> reasoning")
    ap.add_argument("--hide-think", action="store_true",
                    help="with --chat: show a progress line instead of the reasoning")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                    help="auto = bfloat16 on a GPU, float32 on the CPU. M1/M2 Macs have no "
                    "bfloat16 arithmetic: float16 runs faster there (29 vs 19 tok/s on an M2 "
                    "Ultra), but Qwen3 can overflow it. On CUDA and M5 Macs, MLX multiplies "
                    "float32 with TF32 (less precise) unless MLX_ENABLE_TF32=0 is set")
    ap.add_argument("--quantize", type=int, choices=[4, 8], metavar="{4,8}",
                    help="store the weights in 4 or 8 bits, as mlx_lm.convert does: less memory "
                         "(what it does to speed: README, Quantization)")
    lab = ap.add_argument_group("experiments (README, Experiments)")
    lab.add_argument("--top-probs", type=number(int, 1), metavar="N",
                     help="print the N likeliest first tokens and their probabilities")
    lab.add_argument("--trace", action="store_true",
                     help="narrate one forward pass over the prompt (shapes, sizes); no reply")
    lab.add_argument("--no-cache", action="store_true",
                     help="recompute the whole sequence at every step, without the KV cache")
    lab.add_argument("--no-compile", action="store_true",
                     help="run every operation one by one, so print() inside the model works")
    lab.add_argument("--reference-ops", action="store_true",
                     help="run the hand-written RMSNorm/RoPE/attention, not MLX's fused kernels")
    args = ap.parse_args(argv)
    if (args.system is not None or args.no_think or args.hide_think) and not args.chat:
        ap.error("--system, --no-think and --hide-think only apply with --chat")
    if args.chat and args.prompt is None:
        for flag, given in (("--top-probs", args.top_probs), ("--trace", args.trace),
                            ("--no-cache", args.no_cache)):
            if given:
                ap.error(f"{flag} needs a single message: add --prompt to --chat")
    if args.trace and args.top_probs:  # the trace computes no reply, and shows its own top 5
        ap.error("--top-probs does not apply to --trace, which ends with the 5 likeliest tokens")
    return args


# Qwen's recommended sampling (model card). Thinking mode's values are also in
# generation_config.json; a model's file wins over them.
QWEN3_THINKING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
QWEN3_NO_THINK = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
# What transformers' generate() falls back on for a value generation_config.json lacks.
TRANSFORMERS_DEFAULTS = {"top_p": 1.0, "top_k": 50, "min_p": 0.0}


def sampling_settings(args, generation_config):
    """(Sampling, min_p, presence penalty). Explicit flags win. --chat then takes Qwen's
    recommendations: generation_config.json's values in thinking mode, the model card's for
    --no-think. Plain completion is greedy unless --temperature is given; its top-k/top-p/min-p
    then come from generation_config.json, as in transformers."""
    if args.chat and args.no_think:
        recommended = QWEN3_NO_THINK
    elif args.chat:
        recommended = QWEN3_THINKING | generation_config
    else:
        recommended = TRANSFORMERS_DEFAULTS | generation_config | {"temperature": 0.0}
    given = lambda flag, name: flag if flag is not None else recommended[name]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = Sampling(temperature=float(given(args.temperature, "temperature")),
                        top_k=int(given(args.top_k, "top_k")),
                        top_p=float(given(args.top_p, "top_p")), seed=seed)
    return sampling, float(given(args.min_p, "min_p")), args.presence_penalty or 0.0


def picker(min_p, presence_penalty, config):
    """A function that makes generate()'s pick for one reply: Part 1's sample(), or, with min-p
    or a presence penalty, section 16's (a new one per reply, as it remembers the reply)."""
    if min_p or presence_penalty:
        return lambda: extra_sampling(min_p, presence_penalty, config.vocab_size)
    return lambda: sample


def describe(sampling, min_p, presence_penalty):
    """The sampling settings in the order they apply."""
    s = sampling
    how = f"presence penalty {presence_penalty}, " if presence_penalty else ""
    if s.temperature == 0:
        return how + "greedy"
    how += f"temperature {s.temperature}, top-k {s.top_k or 'off'}, top-p {s.top_p}"
    return how + (f", min-p {min_p}" if min_p else "") + f", seed {s.seed}"


# --- Showing a reply, and the chat loop -----------------------------------------------------------

def plural(n, word):
    """'1 token', '2 tokens'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def rate(n, seconds):
    """', 12.3 tok/s' for n tokens in `seconds`; nothing when no token was timed (a decode rate
    counts the tokens after the first: one token gives none)."""
    return f", {n / seconds:.1f} tok/s" if n > 0 and seconds > 0 else ""


def shortened(text, limit=60):
    """The start of a long text, for a one-line header: a prompt may be a whole file."""
    return text if len(text) <= limit else text[:limit] + "…"


class ReplyPrinter:
    """Writes a reply to stdout as its tokens arrive. On a terminal, Qwen3's <think>...</think>
    reasoning is dimmed; hide_think shows a "thinking... (N tokens)" line instead, on stderr.
    Elsewhere (a pipe, a file) the text is written as it is, without colour codes."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, tokenizer, hide_think):
        self.tokenizer, self.hide_think = tokenizer, hide_think
        self.think_ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        self.colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ  # no-color.org
        self.progress = sys.stderr.isatty()
        # DecodeStream holds back the bytes of a character split across tokens (emoji, CJK) until
        # it is complete: nothing prints as garbage.
        self.stream = DecodeStream(skip_special_tokens=True)
        self.thinking, self.n_thinking, self.n_tokens = False, 0, 0
        self.answer_started = False  # for hide_think: the newlines after </think> are dropped

    def add(self, token_id):
        self.n_tokens += 1
        piece = self.stream.step(self.tokenizer, token_id) or ""
        start, end = self.think_ids
        if token_id == start and not self.thinking:
            self.thinking = True
            piece = "" if self.hide_think else (self.DIM if self.colour else "") + piece
        elif token_id == end and self.thinking:
            self.thinking = False
            if self.hide_think:
                piece = ""
                self.clear_progress()
            elif self.colour:
                piece += self.PLAIN
        elif self.thinking:
            self.n_thinking += 1
            if self.hide_think:
                piece = ""
                if self.progress:
                    sys.stderr.write(f"\rthinking… ({self.n_thinking} tokens)")
                    sys.stderr.flush()
        elif self.hide_think and not self.answer_started:
            piece = piece.lstrip("\n")
            self.answer_started = bool(piece)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def clear_progress(self):
        if self.progress and self.n_thinking:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

    def finish(self):
        """End the reply's line, restoring the colour if it stopped while thinking."""
        if self.thinking and self.colour and not self.hide_think:
            sys.stdout.write(self.PLAIN)
        if self.thinking and self.hide_think:
            self.clear_progress()
        sys.stdout.write("\n")
        sys.stdout.flush()


def read_message(interactive):
    """The next line of input, or None at the end. On a terminal, input() has line editing and
    history (readline, imported by chat_loop)."""
    if interactive:
        try:
            text = input(">>> ")
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return None
    else:
        line = sys.stdin.buffer.readline()
        if not line:
            return None
        text = line.decode("utf-8", "surrogateescape").rstrip("\r\n")
    return checked_text(text, "the message")


def make_room(chat, message, max_tokens):
    """Forget the oldest turns until the conversation, the new message and a whole reply fit in
    the context; say so on stderr. A message too long even alone is a UserError, and leaves the
    conversation as it was. Once the context is full, each turn drops the oldest and prefills the
    whole conversation again: slower turns."""
    context, turns, dropped = chat.config.max_position_embeddings, chat.turns, 0
    n_prompt = len(chat.prompt_ids(message))
    try:
        while n_prompt + max_tokens > context and dropped < len(turns):
            dropped += 1
            # Without the oldest turns (the cache rolls back to the system message, then prefills).
            chat.turns = turns[dropped:]
            n_prompt = len(chat.prompt_ids(message))
        if n_prompt + max_tokens > context:
            raise UserError(f"this message makes a {n_prompt}-token prompt; with --max-tokens "
                            f"{max_tokens} that exceeds the model's {context}-token context: "
                            "shorten it")
    except BaseException:  # refused, or Ctrl-C while counting: the earlier turns stay
        chat.turns = turns
        raise
    if dropped:
        print(f"(the conversation outgrew the {context}-token context: forgot the oldest "
              f"{dropped} turn{'s' if dropped > 1 else ''})", file=sys.stderr)


def check_chat_max_tokens(tokenizer, system, think, context, max_tokens):
    """--chat: refuse at start-up a --max-tokens that leaves no room in the context for a message
    (make_room would refuse every one)."""
    n_format = len(tokenize(tokenizer, chat_prompt("", system, think)))  # all but the message
    if n_format + max_tokens >= context:  # >=: a message adds at least one token
        system_too = " and --system" if system else ""
        raise UserError(f"--max-tokens {max_tokens} leaves no room for a message in the model's "
                        f"{context}-token context (the chat format{system_too} takes {n_format} "
                        f"tokens); lower --max-tokens{' or shorten --system' if system else ''}")


def stream(tokens, printer, on_first_logits=None):
    """Print (token id, logits) pairs as they are generated, until the end or Ctrl-C. Returns
    (interrupted, seconds to the first token: the prefill, seconds for the rest: the decode)."""
    start = first = time.perf_counter()
    interrupted = False
    try:
        for token_id, logits in tokens:
            if printer.n_tokens == 0:
                first = time.perf_counter()
                if on_first_logits:
                    on_first_logits(logits)
            printer.add(token_id)  # <|im_end|> prints nothing
    except KeyboardInterrupt:
        interrupted = True
        # generate() queues the next step before yielding a token: let it finish before the program
        # exits or goes on (quitting with GPU work queued has crashed other MLX programs).
        mx.synchronize()
    finally:
        tokens.close()  # for Chat.reply: the (partial) reply joins the history now
    end = time.perf_counter()
    printer.finish()
    return interrupted, first - start, end - first


def chat_loop(chat, max_tokens, sampling, eos_ids, hide_think, new_pick=lambda: sample):
    """Talk until end of input, Ctrl-D or /exit. Each line is one message; its reply goes to
    stdout, everything else to stderr. new_pick() gives each reply its pick (see picker())."""
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 (importing it is what gives input() editing and history)
        except ImportError:  # not on every platform; input() still works without
            pass
    turn = 0
    while True:
        try:
            message = read_message(interactive)
            if message is None or message.strip() == "/exit":
                return
            if not message.strip():
                continue
            if message.strip() == "/reset":
                chat.turns.clear()  # the cache rolls back by itself at the next turn
                turn = 0
                print("(conversation reset)", file=sys.stderr)
                continue
            make_room(chat, message, max_tokens)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in Python's REPL
            print(file=sys.stderr)
            continue
        except UserError as e:  # a bad message is skipped; the chat goes on
            print(f"error: {e}", file=sys.stderr)
            continue
        n_turns, printer = len(chat.turns), ReplyPrinter(chat.tokenizer, hide_think)
        interrupted, prefill_s, decode_s = stream(
            chat.reply(message, max_tokens, sampling, eos_ids, new_pick()), printer)
        if len(chat.turns) == n_turns:  # Ctrl-C before the reply began: nothing happened
            print("Interrupted.", file=sys.stderr)
            continue
        turn += 1
        n = len(chat.turns[-1][1])  # the reply as the history keeps it (without <|im_end|>)
        prefill = chat.prefilled / prefill_s if printer.n_tokens else 0.0
        thinking = f", {printer.n_thinking} thinking" if printer.n_thinking else ""
        print(f"{'Interrupted. ' if interrupted else ''}Turn {turn}: {chat.reused} tokens reused "
              f"from the cache, {chat.prefilled} prefilled at {prefill:.1f} tok/s | Reply: "
              f"{plural(n, 'token')}{thinking}{rate(printer.n_tokens - 1, decode_s)}",
              file=sys.stderr)


def main(argv=None):
    global FUSED_KERNELS
    args = parse_args(argv)
    multi_turn = args.chat and args.prompt is None
    prompt = None if multi_turn else read_prompt(
        DEFAULT_PROMPT if args.prompt is None else args.prompt)
    system = checked_text(args.system, "--system") if args.system is not None else None
    if args.chat and args.temperature == 0:
        print("warning: Qwen advises against greedy decoding (--temperature 0) in chat: in "
              "thinking mode it leads to endless repetition", file=sys.stderr)
    greedy = args.temperature == 0 or (args.temperature is None and not args.chat)
    ignored = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                        ("--min-p", args.min_p)) if value is not None]
    if greedy and ignored:
        one = len(ignored) == 1
        print(f"warning: {', '.join(ignored)} only matter{'s' if one else ''} when sampling; "
              f"greedy decoding ignores {'it' if one else 'them'} (add --temperature)",
              file=sys.stderr)
    model_dir = find_model(args.model, allow_download=not args.no_download)
    if args.chat:
        check_chat_template(model_dir)
    dtype = pick_dtype(args.dtype)
    config, weights, tokenizer, generation_config = load_model(model_dir, dtype, args.quantize)
    wire_weights(weights)
    matrices = [weights["embed_tokens"], weights["lm_head"],
                *(w for layer in weights["layers"] for w in layer.values())]
    bits = "/".join(map(str, sorted({w.bits for w in matrices if isinstance(w, Quantized)})))
    eos_ids = eos_token_ids(generation_config, tokenizer)
    sampling, min_p, presence_penalty = sampling_settings(args, generation_config)
    new_pick = picker(min_p, presence_penalty, config)
    how = describe(sampling, min_p, presence_penalty)
    context = config.max_position_embeddings
    max_tokens = args.max_tokens or (min(CHAT_MAX_TOKENS, context // 2) if args.chat else 100)
    FUSED_KERNELS = not args.reference_ops  # set once, before anything runs or is compiled
    if not args.no_compile:
        compile_model()

    if not multi_turn:
        text = chat_prompt(prompt, system, think=not args.no_think) if args.chat else prompt
        prompt_ids = tokenize(tokenizer, text)
        if len(prompt_ids) + max_tokens > context:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens; with --max-tokens "
                            f"{max_tokens} that exceeds the model's {context}-token context: "
                            "shorten it or lower --max-tokens")
    else:  # a whole reply must fit beside each message
        check_chat_max_tokens(tokenizer, system, not args.no_think, context, max_tokens)

    c = config
    print(f"Model: {model_dir.resolve().name} ({c.num_hidden_layers} layers, {c.hidden_size} dim, "
          f"{c.num_attention_heads} Q heads, {c.num_key_value_heads} KV heads) on {device_name()}, "
          f"{str(dtype).split('.')[-1]}{f', {bits}-bit weights' if bits else ''}",
          file=sys.stderr)
    if MLX_CPU_WHEEL and not OPENBLAS:
        print(OPENBLAS_HINT, file=sys.stderr)
    if c.tie_word_embeddings and weights["lm_head"] is not weights["embed_tokens"]:
        print("Note: config.json ties the LM head to the embeddings, but the checkpoint stores a "
              "different lm_head.weight; using it, as transformers does", file=sys.stderr)
    if multi_turn:
        print(f"Chat: {how}, up to {max_tokens} tokens per reply. /reset starts "
              "over; /exit or Ctrl-D ends; Ctrl-C stops a reply.", file=sys.stderr)
        chat = Chat(weights, config, tokenizer, system, think=not args.no_think)
        chat_loop(chat, max_tokens, sampling, eos_ids, args.hide_think, new_pick)
        return 0

    print(f"Prompt: {shortened(prompt)!r} ({plural(len(prompt_ids), 'token')}), {how}",
          file=sys.stderr)
    if args.trace:
        trace(prompt_ids, weights, config, tokenizer)
        return 0

    printer = ReplyPrinter(tokenizer, args.hide_think)
    top_probs = args.top_probs and (lambda logits: print_top_probs(logits, tokenizer,
                                                                   args.top_probs))
    run = generate_without_cache if args.no_cache else generate_long
    tokens = run(prompt_ids, weights, config, max_tokens, sampling, eos_ids, pick=new_pick())
    interrupted, prefill_s, decode_s = stream(tokens, printer, top_probs)
    n_generated = printer.n_tokens
    print(f"{'Interrupted. ' if interrupted else ''}Prompt: {plural(len(prompt_ids), 'token')}"
          f"{rate(len(prompt_ids) if n_generated else 0, prefill_s)} | Generated: "
          f"{plural(n_generated, 'token')}{rate(n_generated - 1, decode_s)} | "
          f"Total: {prefill_s + decode_s:.2f} s | Peak memory: "
          f"{mx.get_peak_memory() / 1e9:.2f} GB", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"llm_inference.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        mx.synchronize()  # nothing left queued on the GPU at exit, as after Ctrl-C in stream()
        print("\nInterrupted.", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush can't fail
        sys.exit(141)
