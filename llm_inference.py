"""How an LLM really generates text: Qwen3 from its released files, with MLX, in one file.

Part 1, the model, is the first read: at the end of generate() you have seen all of it. Part 2
goes further, in optional sections that build on Part 1. Part 3 is the program around it.

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

Shapes are written for one sequence, with Qwen3-0.6B's sizes (attention's lead with a batch of 1).
MLX is lazy: `y = x @ w` only records the operation in a graph; the arithmetic runs when a value
is needed (`print(y)`, `y.item()`, `mx.eval(y)`). generate() (section 11) builds on that.
"""

import ctypes
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

# Linux CPUs only (Mac readers, skip this): OpenBLAS speeds up MLX's CPU build if loaded first.
MLX_CPU_WHEEL = any(Path(folder, "mlx_cpu.libs").is_dir() for folder in sys.path)
try:
    OPENBLAS = (MLX_CPU_WHEEL and os.environ.get("LLM_INFERENCE_BLAS") != "0"
                and "mlx.core" not in sys.modules
                and bool(ctypes.CDLL("libopenblas.so.0", mode=ctypes.RTLD_GLOBAL)))
except OSError:  # not installed: the command line says how to install it (Part 3, OpenBLAS)
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
    """config.json's values as they are (JSON numbers and true/false); a missing one is None."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    # transformers >= 5 writes rope_theta inside a "rope_parameters" dict.
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    return Config(**{name: raw.get(name) for name in Config._fields})


def layer_shapes(c):
    """One block's tensors, by their names in the checkpoint (after "model.layers.{i}.")."""
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "input_layernorm.weight": (c.hidden_size,),  # (1024,)
        "self_attn.q_proj.weight": (q_dim, c.hidden_size),  # (2048, 1024) = (16 heads x 128, 1024)
        "self_attn.k_proj.weight": (kv_dim, c.hidden_size),  # (1024, 1024) = (8 heads x 128, 1024)
        "self_attn.v_proj.weight": (kv_dim, c.hidden_size),  # (1024, 1024)
        "self_attn.q_norm.weight": (c.head_dim,),  # (128,)
        "self_attn.k_norm.weight": (c.head_dim,),  # (128,)
        "self_attn.o_proj.weight": (c.hidden_size, q_dim),  # (1024, 2048)
        "post_attention_layernorm.weight": (c.hidden_size,),  # (1024,)
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),  # (3072, 1024)
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),  # (3072, 1024)
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),  # (1024, 3072)
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


def load_tensor(tensors, name, dtype):
    """Take one tensor out of the file's, as dtype, and compute it now. One at a time, the file's
    bfloat16 copy of everything never sits beside the converted weights (in float32 that would
    peak at 1.5x the weights)."""
    weight = tensors.pop(name).astype(dtype)
    mx.eval(weight)
    return weight


def load_weights(model_dir, config, dtype):
    """{"embed_tokens", "layers": [{"q_proj": ..., ...} x 28], "norm", "lm_head"}, as dtype
    (mx.bfloat16, as stored, on a GPU; mx.float32 on a CPU)."""
    tensors = load_tensors(model_dir)
    take = lambda name: load_tensor(tensors, name, dtype)
    embed_tokens = take("model.embed_tokens.weight")  # (151936, 1024)
    # Each layer's tensors by short name: "q_proj" for model.layers.{i}.self_attn.q_proj.weight.
    layers = [{name.split(".")[-2]: take(f"model.layers.{i}.{name}")
               for name in layer_shapes(config)} for i in range(config.num_hidden_layers)]
    # Qwen3-0.6B to 4B tie the LM head to the embeddings (not a 311 MB copy); 8B and up have one.
    lm_head = embed_tokens if config.tie_word_embeddings else take("lm_head.weight")
    return {"embed_tokens": embed_tokens, "layers": layers, "norm": take("model.norm.weight"),
            "lm_head": lm_head}


def load_tokenizer(model_dir):
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


# --- 2. Tokenize: text -> integer ids (byte-level BPE, in tokenizer.json) -------------------------

def tokenize(tokenizer, text):
    """Text -> ids of vocabulary pieces: "The capital of France is" -> [785, 6722, 315, 9625, 374].
    Byte-level BPE: the text is cut into word-like chunks, and each chunk's UTF-8 bytes are merged
    pair by pair, following the merge list learned in training, until no merge applies. Any string
    has an encoding, emoji included; common words are one token, their leading space included."""
    return tokenizer.encode(text).ids


def detokenize(tokenizer, token_ids):
    """Ids -> text, special tokens included: the pieces' bytes joined; [12095] -> " Paris"."""
    return tokenizer.decode(token_ids, skip_special_tokens=False)


# --- 3. Embed: each id picks one row of the embedding table ---------------------------------------

def embed(token_ids, embed_tokens):
    """(seq,) ids -> (seq, 1024): row i of the table, learned in training, stands for token i."""
    return embed_tokens[token_ids]


# --- 4. RMSNorm: rescale each vector to unit root-mean-square, then by a learned per-channel gain -

def rms_norm(x, weight, eps):
    """x / sqrt(mean(x²) + eps) * weight, over the last axis: layers read inputs of one scale."""
    x32 = x.astype(mx.float32)  # square and average in float32: bfloat16 has 8 significant bits
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


# --- 5. RoPE: encode a token's position by rotating pairs of its query/key channels ---------------

def apply_rope(x, offset, theta):
    """Rotate x (..., seq, head_dim), whose first position is the absolute position `offset`.
    Channel i is paired with channel i + head_dim/2 (Hugging Face's "rotate_half" layout; the RoPE
    paper pairs neighbours), and the pair turns by the angle position * theta^(-2i/head_dim):
    fast-turning pairs resolve nearby tokens, slow ones distant tokens. Rotations compose, so the
    dot product of a rotated query and key depends on their positions only through their gap."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (64,)
    positions = (offset + mx.arange(x.shape[-2])).astype(mx.float32)  # (seq,)
    angles = positions[:, None] * inv_freq[None, :]  # (seq, 64)
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# --- 6. Attention: each position gathers information from itself and the positions before it ------
#
# Each position emits, per head, a query ("what am I looking for?"), a key ("what do I hold?") and a
# value ("what do I pass on?"). Its output is an average of the values, weighted by how well its
# query matches each key: softmax(Q Kᵀ / √head_dim) · V; √128 keeps the scores' variance ~1.
# A dot product cannot tell where tokens are, so RoPE (section 5) mixes positions into queries and
# keys, and a causal mask keeps each position from seeing later ones (which it must predict).
#
# Heads look for different things in parallel. Multi-head attention gives each of the 16 query
# heads its own key/value head; multi-query attention shares one among all; Qwen3's grouped-query
# attention has 8 K/V heads, each shared by 2 query heads: half the keys and values to compute
# and to cache, at little cost in quality.

def linear(x, weight):
    """x @ weight.T: every matrix product of the model. The checkpoint stores each matrix
    (out, in), PyTorch's nn.Linear layout, so x (seq, in) -> (seq, out)."""
    return x @ weight.T


def queries_keys_values(x, layer, config, offset):
    """The first half of attention: x (seq, 1024) at positions offset, offset+1, ... -> q, k, v."""
    c, seq = config, x.shape[0]
    # Project each position to queries, keys and values, split into heads, heads first. The leading
    # 1 is a batch axis: attention is written for (batch, heads, seq, head_dim), here one sequence.
    q = linear(x, layer["q_proj"]).reshape(1, seq, c.num_attention_heads, c.head_dim).swapaxes(1, 2)
    k = linear(x, layer["k_proj"]).reshape(1, seq, c.num_key_value_heads, c.head_dim).swapaxes(1, 2)
    v = linear(x, layer["v_proj"]).reshape(1, seq, c.num_key_value_heads, c.head_dim).swapaxes(1, 2)
    # QK-norm (new in Qwen3): RMS-normalise each head's 128 query and key channels, else their sizes
    # can creep up in training until the softmax saturates. Normalise, then rotate: the order
    # Qwen3 was trained with (per-channel gains do not commute with the rotation).
    q = apply_rope(rms_norm(q, layer["q_norm"], c.rms_norm_eps), offset, c.rope_theta)
    k = apply_rope(rms_norm(k, layer["k_norm"], c.rms_norm_eps), offset, c.rope_theta)
    return q, k, v  # (1, 16, seq, 128), (1, 8, seq, 128), (1, 8, seq, 128)


class KVCache:
    """One layer's keys and values for every position so far, so a new token computes only its own
    (without it, every token re-runs all earlier ones through every layer). Qwen3-0.6B in bfloat16
    caches 28 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 112 KiB per token."""

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
    multiplied with a second projection, `up`, it gates it."""
    return gate * mx.sigmoid(gate) * up


def swiglu(x, layer):
    """(seq, 1024) -> (seq, 3072) -> (seq, 1024), each position on its own: about 60% of a block's
    weights, thought to hold much of what the model knows, widened 3x for room for many features."""
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
    (vocab,) scores for the next token, or (seq, vocab), every position's, if not last_only."""
    x = embed(token_ids, weights["embed_tokens"])  # (seq, 1024)
    for layer, layer_cache in zip(weights["layers"], cache):
        x = transformer_block(x, layer, config, layer_cache)
    if last_only:  # generating needs the next token only (training and the tests: every one)
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
    """Greedy (argmax) at temperature 0; else a draw from the softmax of filter_logits' logits."""
    if sampling.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, sampling), key=key)  # renormalises


# --- 11. Generate: prefill the prompt once, then decode one token at a time -----------------------
#
# Written plainly, the decode loop would be:
#     for _ in range(max_tokens):
#         yield token.item()                 # wait for the GPU to compute the token
#         token, logits = step(token[None])  # the GPU idles while Python records this step
# Recording a step takes time too: for a small model on a fast GPU, about as long as running it.
# So, MLX being lazy, step n+1 is recorded on token n before that is computed, and queued
# (mx.async_eval); only then do we wait for token n.

def generate(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(), cache=None):
    """Yield (token id, the logits it was picked from) until an id in eos_ids (yielded too) or
    max_tokens. `cache` may already hold earlier tokens: prompt_ids continue them. At the end the
    cache holds every token yielded, except the last when max_tokens ended the run (a token's keys
    and values enter the cache in the step that follows it)."""
    cache = make_cache(config) if cache is None else cache
    key = mx.random.key(sampling.seed)

    def step(token_ids):  # one forward pass over token_ids (seq,) and the token picked after it
        nonlocal key
        logits = forward(token_ids, weights, config, cache)
        # Fresh randomness for each step, repeatable from the seed; greedy picking needs none.
        key, pick_key = mx.random.split(key) if sampling.temperature else (key, key)
        return sample(logits, sampling, pick_key), logits

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
# PART 2: GOING FURTHER (optional sections that build on Part 1)
# ================================================================================================
#
# Some sections change how Part 1 runs: fused kernels (12), compilation (13), quantized matrices
# (16) and several machines (20). Each replaces Part 1 functions by name, with replace(): Python
# looks a global name up each time it is called, so after replace(rms_norm=fused_rms_norm) every
# call of rms_norm() in Part 1 runs the kernel, and Part 1 reads as you read it. The command line
# makes the replacements in one place, main(); with --reference-ops it runs Part 1 as written.

def replace(**functions):
    """From now on, calls by these names (Part 1's functions, or Part 3's) run the functions given.
    A misspelt name would replace nothing: refused. Restarting Python undoes it all."""
    unknown = set(functions) - set(globals())
    if unknown:
        raise NameError(f"no function {', '.join(sorted(unknown))} to replace")
    globals().update(functions)


# --- 12. Fused kernels: RMSNorm, RoPE and attention in one kernel each ----------------------------
#
# Written out as math (sections 4 to 6), each of these runs several MLX operations, each a pass over
# memory. MLX also has each as a single kernel, mx.fast.*: the same numbers, to rounding (the tests
# check it), in one pass. use_fused_kernels() replaces rms_norm, apply_rope and attend with them.

def fused_rms_norm(x, weight, eps):
    return mx.fast.rms_norm(x, weight, eps)


def fused_rope(x, offset, theta):
    return mx.fast.rope(x, x.shape[-1], traditional=False, base=theta, scale=1.0, offset=offset)


def fused_attend(q, k, v):
    """attend() in one kernel. It does the head groups and the causal mask itself, aligned as
    attend() aligns it (the last query sees the last key); a single new token sees every key."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]),
                                                mask="causal" if q.shape[2] > 1 else None)


def use_fused_kernels():
    replace(rms_norm=fused_rms_norm, apply_rope=fused_rope, attend=fused_attend)


# --- 13. Compilation: fusing element-wise operations into one kernel ------------------------------
#
# mx.compile traces a function once, then replays the recorded graph as one call, with element-wise
# steps fused into single kernels: silu_gate's sigmoid and two multiplications become one kernel
# instead of three, one pass over the (seq, 3072) activations instead of three. That matters where
# per-operation costs dominate, as for a small model on a big GPU; on a Mac, for most models,
# reading the weights dominates (docs/performance.md). Matrix products, and the fused kernels of
# section 12, are single kernels already, and replaying a compiled function costs Python more than
# recording a few of them, so silu_gate is all we compile. shapeless=True: one trace serves every
# sequence length. While tracing, arrays are placeholders: print(x) inside a compiled function
# fails (try it with --no-compile, which skips this).

compiled_silu_gate = mx.compile(silu_gate, shapeless=True)


def compile_model():
    """Replaces silu_gate (section 7) with its compiled copy."""
    replace(silu_gate=compiled_silu_gate)


# --- 14. Long prompts: prefill in pieces ----------------------------------------------------------
#
# A piece of 1024 tokens has attention scores of (heads, 1024, total) rather than (heads, total,
# total) for the whole prompt at once: that bounds the memory of one pass, at a small cost in speed
# (docs/performance.md).
PREFILL_CHUNK = 1024


def generate_long(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(),
                  cache=None):
    """generate() for a prompt of any length: all but its last piece first go through the model
    piece by piece, filling the cache."""
    cache = make_cache(config) if cache is None else cache
    while len(prompt_ids) > PREFILL_CHUNK:
        forward(mx.array(prompt_ids[:PREFILL_CHUNK]), weights, config, cache)
        # Run this piece now, freeing its activations. Only the cache is asked for, so (MLX being
        # lazy) the piece's logits are never computed.
        mx.eval([(c.keys, c.values) for c in cache])
        prompt_ids = prompt_ids[PREFILL_CHUNK:]
    yield from generate(prompt_ids, weights, config, max_tokens, sampling, eos_ids, cache)


# --- 15. Without a KV cache: what the cache saves (--no-cache) ------------------------------------

def generate_without_cache(prompt_ids, weights, config, max_tokens, sampling=Sampling(),
                           eos_ids=()):
    """generate() without a KV cache: every step runs the whole sequence so far through the model.
    The same tokens and logits, and work per token that grows with the sequence."""
    token_ids, key = list(prompt_ids), mx.random.key(sampling.seed)
    for _ in range(max_tokens):
        logits = forward(mx.array(token_ids), weights, config, make_cache(config))
        key, pick_key = mx.random.split(key)  # the same keys, in the same order, as generate()
        token_id = sample(logits, sampling, pick_key).item()
        yield token_id, logits
        if token_id in eos_ids:
            return
        token_ids.append(token_id)


# --- 16. Quantization (--quantize 4 or 8): fewer bits per weight ----------------------------------
#
# Generating a token multiplies one vector by every weight matrix: each weight is read from memory
# and used for a single multiply-add. Where reading memory limits decoding (a Mac's unified memory
# or a CPU, for most models), fewer bytes per weight mean more tokens per second: Qwen3-8B reads
# about 15 GB of bfloat16 weights per token, so 100 GB/s of memory caps it near 7 tokens a second;
# at 4 bits, about 4.3 GB, near 23. Where the fixed cost of each operation limits it (a small model
# on a big GPU), quantizing saves memory, not time. Memory it always saves.
#
# Group-wise affine quantization (MLX's and mlx-lm's): each row of a matrix is cut into groups of
# 64 consecutive weights. A group keeps one scale and one bias, in the weights' float type, and
# 64 integers q from 0 to 2^bits - 1, chosen so that w ≈ scale * q + bias: 2^bits evenly spaced
# levels covering the group's range, nudged so that 0 is exactly one of them. With 16-bit scales and
# biases, a weight costs 4 + 2 x 16 / 64 = 4.5 bits at 4 bits instead of 16 (3.6x smaller; 8 bits:
# 8.5, 1.9x smaller). The price is rounding: most weights move by at most half a level, and every
# product moves with them (docs/performance.md measures how much on a layer).
#
# use_quantization() replaces three Part 1 functions: load_tensor() quantizes each matrix as it is
# read (or takes it as stored quantized), linear() multiplies with mx.quantized_matmul, which
# unpacks each group inside the product (the full-precision matrix never exists in memory), and
# embed() unpacks only the rows it picks.

GROUP_SIZE = 64  # weights sharing one scale and bias (mlx-lm's default)


class Quantized(NamedTuple):
    """A matrix (out, in), quantized in groups along each of its rows: w ≈ scale * q + bias."""
    packed: mx.array  # (out, in * bits / 32) uint32: the integers q, packed bit after bit
    scales: mx.array  # (out, in / group_size): one per group, in --dtype
    biases: mx.array  # (out, in / group_size): each group's offset (not a layer's bias term)
    group_size: int
    bits: int  # 4 or 8 with --quantize; a stored checkpoint may use 2 to 6, or 8


def quantizable(shape, group_size=GROUP_SIZE):
    """Matrices whose rows split into whole groups (all of Qwen3's); mlx-lm leaves others as is."""
    return len(shape) == 2 and shape[1] % group_size == 0


def quantize(weight, bits, dtype):
    """A checkpoint matrix -> Quantized, as mlx_lm.convert does it: from the values as stored
    (bfloat16), so the scales and biases are bfloat16 numbers, then held as `dtype` (float32 keeps
    them exactly)."""
    q, scales, biases = mx.quantize(weight, group_size=GROUP_SIZE, bits=bits)  # affine mode
    return Quantized(q, scales.astype(dtype), biases.astype(dtype), GROUP_SIZE, bits)


def quantized_linear(x, weight):
    """linear() that also takes Quantized weights: x @ dequantized(weight).T, without the
    dequantized copy. (Once replaced, the name linear is this function: calling it would loop.)"""
    if not isinstance(weight, Quantized):
        return x @ weight.T
    return mx.quantized_matmul(x, weight.packed, weight.scales, weight.biases, transpose=True,
                               group_size=weight.group_size, bits=weight.bits)


def quantized_embed(token_ids, table):
    """embed() for a Quantized table too: unpack the rows picked, not the 151936-row table."""
    if not isinstance(table, Quantized):
        return table[token_ids]
    return mx.dequantize(table.packed[token_ids], table.scales[token_ids],
                         table.biases[token_ids], group_size=table.group_size, bits=table.bits)


def use_quantization(bits=None, stored=None):
    """From now on, load_weights() quantizes each matrix to `bits` (4 or 8) as it reads it, or
    reads it as stored quantized, and linear() and embed() take Quantized matrices. stored: how a
    checkpoint stored quantized was made, config.json's "quantization" entry as mlx_lm.convert
    writes it: {"group_size": 64, "bits": 4, "mode": "affine"}, plus, for layers quantized
    differently (mixed precision), their own settings by name. Such a checkpoint stores each
    quantized matrix x.weight as three tensors: x.weight (the packed uint32), x.scales, x.biases."""
    stored = stored or {}

    def load_quantized(tensors, name, dtype):
        weight = tensors.pop(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in tensors:  # stored quantized: the integers are used as they are
            how = stored.get(stem)  # a layer may have settings of its own (a dict)
            how = how if isinstance(how, dict) else stored
            weight = Quantized(weight, tensors.pop(f"{stem}.scales").astype(dtype),
                               tensors.pop(f"{stem}.biases").astype(dtype), how["group_size"],
                               how["bits"])
        elif bits and quantizable(weight.shape):
            weight = quantize(weight, bits, dtype)
        else:
            weight = weight.astype(dtype)
        mx.eval(weight)
        return weight

    replace(load_tensor=load_quantized, linear=quantized_linear, embed=quantized_embed)


# --- 17. More sampling controls: min-p and a presence penalty -------------------------------------
#
# Min-p keeps the tokens at least min_p times as likely as the likeliest one, after top-k and top-p
# (transformers' order): a cut that scales with the model's confidence, strict when one token
# dominates. The presence penalty lowers the logit of every token already in the reply by the same
# amount, however often it occurred (OpenAI's and vLLM's meaning): against the endless loops a small
# model can fall into. It needs to remember the reply's tokens, so it is a sample() that keeps
# state; being built from MLX arrays, it works on tokens not yet computed.

def filter_min_p(logits, min_p):
    """Set to -inf the tokens less than min_p times as likely as the likeliest, in logits already
    divided by the temperature and filtered by top-k and top-p (filter_logits)."""
    probs = mx.softmax(logits)
    return mx.where(probs >= min_p * probs.max(), logits, -mx.inf)


def use_extra_sampling(min_p, presence_penalty, vocab_size):
    """Replaces sample() (section 10) with one that also applies min-p and the presence penalty.
    It remembers the tokens it picked: call this again before each reply."""
    in_reply = mx.zeros(vocab_size)  # 1 for each token picked so far

    def sample_more(logits, sampling, key):
        nonlocal in_reply
        logits = logits - presence_penalty * in_reply
        if sampling.temperature == 0:
            token = mx.argmax(logits, axis=-1)
        else:  # min-p 0 keeps every token filter_logits keeps: sample()'s draw
            logits = filter_min_p(filter_logits(logits, sampling), min_p)
            token = mx.random.categorical(logits, key=key)
        in_reply = in_reply.at[token].maximum(1.0)  # a copy with in_reply[token] = 1
        return token

    replace(sample=sample_more)


# --- 18. Chat: one KV cache for a whole conversation ----------------------------------------------
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
        self.replies = 0  # replies so far, also before a /reset: each draws with its own seed

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
        while answer and detokenize(self.tokenizer, answer[:1]).strip("\n") == "":  # newlines
            answer = answer[1:]
        return answer

    def reply(self, message, max_tokens, sampling=Sampling(), eos_ids=()):
        """Yield (token id, logits) of the reply to `message`, like generate() (through section
        14's generate_long, as a first message may be long). The reply joins the history also when
        the caller stops early (then close() this generator), even if empty."""
        ids = self.prompt_ids(message)
        # A fresh draw for each reply, and the whole conversation repeatable from the seed.
        sampling = sampling._replace(seed=(sampling.seed + self.replies) % 2**64)
        self.replies += 1
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
                                                  max_tokens, sampling, eos_ids, self.cache):
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


# --- 19. The logit lens: what the model would say after each block (--trace, --top-probs) --------
#
# Every block reads and adds to the same residual stream, and only the final norm and the LM head
# turn it into logits. Applied early, to the stream after block 5, say, they show what the model
# would say if it stopped there: with the real weights, watch in which block " Paris" takes the
# lead. After the last block, the lens is the model's own output. --trace shows it at every block.

import unicodedata  # for print_top_probs' column widths


def logit_lens(x, weights, config):
    """The next-token logits (vocab,) read off the residual stream x (seq, 1024) at its last
    position, as forward() reads them after the last block."""
    return linear(rms_norm(x[-1:], weights["norm"], config.rms_norm_eps), weights["lm_head"])[0]


def shown(text):
    """A token or text in quotes, escapes as Python writes them, but emoji kept whole (their
    zero-width joiners are no escape)."""
    return repr(text).replace("\\u200d", "\u200d")


def columns(text):
    """The columns a terminal gives text: CJK characters take two, combining marks none."""
    return sum(0 if unicodedata.category(ch) in ("Mn", "Me", "Cf")
               else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def print_top_probs(logits, tokenizer, n, file=None):
    """A table of the n likeliest next tokens and their probabilities (" Paris" first), on file
    (sys.stderr as it is at the call)."""
    file = file or sys.stderr
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    print(f"{'rank':>4}  {'token':<16} {'id':>7}  probability", file=file)
    for rank, token_id in enumerate(mx.argsort(-probs)[:min(n, probs.size)].tolist(), 1):
        token = shown(detokenize(tokenizer, [token_id]))
        print(f"{rank:>4}  {token}{' ' * (16 - columns(token))} {token_id:>7}  "
              f"{probs[token_id].item():.4f}", file=file)


def trace(prompt_ids, weights, config, tokenizer, final=None):
    """--trace: one forward pass over the prompt, narrated. Block 0 step by step, with the shape
    of what each step makes; then, after each block, the size (RMS) of the residual stream and
    its logit lens: the likeliest next token there, and the rank of the model's final pick.
    final: the model's own logits for the prompt, if the caller has computed them."""
    c, ids, cache = config, mx.array(prompt_ids), make_cache(config)
    if final is None:
        final = forward(ids, weights, config, make_cache(config))
    pick = mx.argmax(final).item()
    piece = lambda token_id: shown(detokenize(tokenizer, [token_id]))
    shape = lambda a: f"{tuple(a.shape)} {str(a.dtype).split('.')[-1]}"
    some = lambda items: " ".join(items[:16]) + (f" … ({len(items)})" if len(items) > 16 else "")
    print(f"tokens: {len(prompt_ids)} ids {some([str(i) for i in prompt_ids])}\n"
          f"        {some([piece(i) for i in prompt_ids])}")

    def step(name, out, what):
        outs = out if isinstance(out, tuple) else (out,)
        print(f"  {name:<26} -> {', '.join(map(shape, outs))}  ({what})")
        return out

    print("block 0, step by step:")
    layer, eps = weights["layers"][0], c.rms_norm_eps
    x = step("embed", embed(ids, weights["embed_tokens"]), "one table row per token")
    n = step("rms_norm", rms_norm(x, layer["input_layernorm"], eps), "vectors to RMS 1, x gains")
    q, k, v = step("queries_keys_values", queries_keys_values(n, layer, c, 0),
                   "q, k, v heads; QK-norm and RoPE")
    step("attend", attend(q, k, v), "softmax(q kᵀ/√d) v; a K/V head serves a group of q heads")
    h = step("x + attention", x + attention(n, layer, c, cache[0]),
             "the same through the cache; heads joined, projected by o_proj, added")
    n = rms_norm(h, layer["post_attention_layernorm"], eps)
    x = step("h + swiglu(rms_norm(h))", h + swiglu(n, layer), "feed-forward, added")
    print(f"after each block: the residual stream's size (RMS) and its logit lens: the likeliest "
          f"next token if the model stopped there, and the rank there of {piece(pick)}, the final "
          "pick. Early blocks often show the last prompt token: the stream still holds its "
          "embedding, which the LM head, tied to the embeddings, reads back as that token.")
    for i, (layer, layer_cache) in enumerate(zip(weights["layers"], cache)):
        if i:
            x = transformer_block(x, layer, c, layer_cache)
        probs = mx.softmax(logit_lens(x, weights, c).astype(mx.float32))
        top, rank = mx.argmax(probs).item(), (probs > probs[pick]).sum().item() + 1
        rms = mx.sqrt(mx.mean(x.astype(mx.float32) ** 2)).item()
        print(f"block {i:>2} done: residual stream {shape(x)}, RMS {rms:.3f}, lens: {piece(top)} "
              f"{probs[top].item():.3f}, {piece(pick)} #{rank}")
    print(f"final RMSNorm + LM head -> logits {shape(final)}; the next token's probabilities:")
    print_top_probs(final, tokenizer, 5, file=sys.stdout)


# --- 20. Several machines: one model split across processes (tensor parallelism) ------------------
#
# A model larger than one Mac's memory can be split across several: Qwen3-32B takes about 65 GB in
# bfloat16. mlx.launch starts one process per machine (or several on one, to learn), and
# mx.distributed connects them: over TCP (the ring backend: Ethernet, or Thunderbolt as IP), RDMA
# over Thunderbolt 5 (JACCL, macOS 26.2+) or NCCL between CUDA GPUs. Each of n processes keeps 1/n
# of every block, and the split falls where the block needs no exchange:
# - attention: each process keeps whole heads, 16/n query heads and 8/n key/value heads (rows of
#   q_proj, k_proj, v_proj: (2048/n, 1024), (1024/n, 1024) each), so it attends on its own;
#   its heads meet only in o_proj, whose matching columns (1024, 2048/n) it keeps. The products
#   of n column blocks add up to the whole product: an all_sum of n (seq, 1024) partial outputs.
# - the feed-forward: each keeps 3072/n of the intermediate channels (rows of gate_proj and
#   up_proj, columns of down_proj): silu_gate works channel by channel, so the same holds.
# Two all_sums per block; everything else (embeddings, norms, the LM head, sampling) is whole and
# identical on every process, so every process picks the same token. Per token that is 2 x 28
# all_sums of 1024 numbers for Qwen3-0.6B, each a round trip over the link: its latency, not its
# bandwidth, sets the cost (docs/performance.md measures it). RDMA's few microseconds make it pay;
# TCP's tens to hundreds cost more than a Mac saves. Over plain Ethernet, pipeline parallelism is
# the alternative: whole blocks per machine, one transfer per machine and token, but the machines
# take turns on a single sequence: it adds memory, not speed.

SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # out channels: heads, units
SPLIT_COLUMNS = ("o_proj", "down_proj")  # in channels: the same heads and units


def split_config(config, n):
    """The model as one of n processes runs it: 1/n of the heads and of the feed-forward."""
    return config._replace(num_attention_heads=config.num_attention_heads // n,
                           num_key_value_heads=config.num_key_value_heads // n,
                           intermediate_size=config.intermediate_size // n)


def can_split(config, n, group_size=None):
    """Whether the heads and the feed-forward divide by n, and, quantized, whether each process's
    columns of o_proj and down_proj hold whole groups (a group's scale cannot be split)."""
    c = config  # (query heads are a multiple of key/value heads: whole groups split too)
    if c.num_key_value_heads % n or c.intermediate_size % n:
        return False
    columns = (c.num_attention_heads * c.head_dim // n, c.intermediate_size // n)
    return not group_size or all(x % group_size == 0 for x in columns)


def use_tensor_parallelism(group):
    """From now on, load_tensor() keeps this process's share of each block's matrices, and
    attention() and swiglu() add up their partial outputs over the group (run them with
    split_config's config)."""
    # The load_tensor() in place now: Part 1's, or section 16's when quantizing (replaced first).
    load_whole, n, rank = load_tensor, group.size(), group.rank()

    def load_share(tensors, name, dtype):
        weight, kind = load_whole(tensors, name, dtype), name.split(".")[-2]
        axis = 0 if kind in SPLIT_ROWS else 1 if kind in SPLIT_COLUMNS else None
        if axis is None:
            return weight
        # A contiguous copy of the share: a slice alone would keep the whole matrix alive.
        parts = [mx.contiguous(mx.split(part, n, axis=axis)[rank])  # Quantized: packed, scales,
                 for part in (weight[:3] if isinstance(weight, Quantized) else [weight])]  # biases
        mx.eval(parts)
        if isinstance(weight, Quantized):
            return Quantized(*parts, weight.group_size, weight.bits)
        return parts[0]

    # summed(f) runs f, then adds up its partial outputs over the group.
    summed = lambda function: lambda *args: mx.distributed.all_sum(function(*args), group=group)
    replace(load_tensor=load_share, attention=summed(attention), swiglu=summed(swiglu))


# ================================================================================================
# PART 3: THE PROGRAM AROUND IT
# ================================================================================================

import argparse  # the imports only the program needs
import errno
import re
import shlex
import signal
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


class SharedError(UserError):
    """A UserError every process of a group meets alike (section 20): process 0 alone says it."""


def damaged(path, what):
    return UserError(f"{path} {what}; re-download it")


def read_json(path, fix="re-download it"):
    """A JSON object from a file a person may have damaged or edited."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}")
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested too deep
        raise UserError(f"{path} is not valid JSON ({e}); {fix}")
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object; {fix}")
    return value


def is_number(value, kind=float):
    """Whether a JSON value is a number of `kind` below 1e308 (float takes ints; true is none)."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return kind is int or abs(value) < 1e308  # not NaN, infinite, or an int too large (10**400)


# --- Checking the model folder: everything Part 1's loaders assume, each failure one line ---------

def check_config(model_dir):
    """config.json, checked: (Config, its "quantization" entry, {} for weights stored as floats)."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    found, rope = raw.get("model_type"), raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: 'rope_parameters' should be an object, got {json.dumps(rope)}")
    if found == "qwen3_moe":
        raise UserError(f"{path} describes a mixture-of-experts model (model_type 'qwen3_moe'), "
                        "which this script does not implement; use a dense Qwen3 model")
    if found != "qwen3":
        raise UserError(f"{path} is not a Qwen3 config (model_type is {found!r}, expected 'qwen3')")
    for feature, asked in {  # variants Part 1 does not implement: refused, not run wrong
        "RoPE scaling": raw.get("rope_scaling") or rope.get("rope_type", "default") != "default",
        "attention bias (attention_bias: true)": raw.get("attention_bias"),
        "sliding-window attention (use_sliding_window: true)": raw.get("use_sliding_window"),
    }.items():
        if asked:
            raise UserError(f"{path} asks for {feature}, which this script does not implement")
    config = load_config(model_dir)
    kinds = {bool: "true or false", int: "a positive integer", float: "a positive number"}
    for name, kind in Config.__annotations__.items():
        value = getattr(config, name)
        if value is None:
            raise UserError(f"{path} lacks the required key {name!r}")
        if not (isinstance(value, bool) if kind is bool else is_number(value, kind) and value > 0):
            raise UserError(f"{path}: {name!r} should be {kinds[kind]}, got {json.dumps(value)}")
    config = config._replace(rope_theta=float(config.rope_theta),  # 10**20 is an int in JSON
                             rms_norm_eps=float(config.rms_norm_eps))
    if config.head_dim % 2:  # RoPE turns pairs of channels (section 5)
        raise UserError(f"{path}: 'head_dim' should be even, got {config.head_dim}")
    if config.num_attention_heads % config.num_key_value_heads:  # whole groups (section 6)
        raise UserError(f"{path}: 'num_attention_heads' ({config.num_attention_heads}) should be a "
                        f"multiple of 'num_key_value_heads' ({config.num_key_value_heads})")
    quantization, other = raw.get("quantization") or {}, raw.get("quantization_config")
    if other and not quantization:  # how transformers describes GPTQ, AWQ, FP8, ...
        raise UserError(f"{path}: the weights are quantized with "
                        f"{other.get('quant_method') if isinstance(other, dict) else other!r}, "
                        "which this script does not read; use an unquantized or an MLX-format "
                        "(mlx_lm.convert) checkpoint")
    if not isinstance(quantization, dict):
        raise UserError(f"{path}: 'quantization' should be an object such as "
                        f'{{"group_size": 64, "bits": 4}}, got {quantization!r}')
    layers = {name: how for name, how in quantization.items() if isinstance(how, dict)}
    for layer, how in ({"": quantization} | layers if quantization else {}).items():
        mode, bits, group = how.get("mode", "affine"), how.get("bits"), how.get("group_size")
        if (mode != "affine" or not is_number(bits, int) or bits not in (2, 3, 4, 5, 6, 8)
                or not is_number(group, int) or group not in (32, 64, 128)):
            raise UserError(f"{path} asks for {mode} quantization at {bits!r} bits in groups of "
                            f"{group!r}{f' for {layer}' if layer else ''}; this script reads "
                            "affine quantization at 2-6 or 8 bits in groups of 32, 64 or 128")
    return config, quantization


def tensor_shapes(c):
    """Every tensor Part 1 loads, by its name in the checkpoint, with its shape."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer_shapes(c).items()}
    return shapes


def checked_weight_files(model_dir):
    """Part 1's weight_files(), with a damaged model.safetensors.index.json as one line."""
    model_dir = Path(model_dir)
    try:
        files = weight_files(model_dir)
    except OSError as e:
        raise UserError(f"cannot read {model_dir / WEIGHTS_INDEX}: {e.strerror or e}")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # not JSON, no map
        files = []
    # Plain names of safetensors files beside the index: "../x" would read outside the folder,
    # and mx.load reads x.npz too.
    if not files or any(path.parent != model_dir or path.suffix != ".safetensors"
                        for path in files):
        raise damaged(model_dir / WEIGHTS_INDEX, "is not a valid index of shards (a JSON object "
                      "whose 'weight_map' names a file for each tensor)")
    return files


def check_weights(model_dir, config, quantization):
    """Check that the weight files hold every tensor Part 1 needs, with its shape and a dtype it
    reads, and none that config.json does not describe. mx.load reads only the files' headers
    (it is lazy), and refuses a file that ends before its last tensor."""
    files, tensors = checked_weight_files(model_dir), {}
    try:
        missing = [path.name for path in files if not path.exists()]
    except OSError as e:  # a name too long, say
        raise damaged(model_dir / WEIGHTS_INDEX, f"names a file that cannot be read ({e})")
    if missing:
        raise damaged(model_dir, f"lacks {missing[0]}, one of the {len(files)} shards named in "
                      f"{WEIGHTS_INDEX} ({len(missing)} missing)")
    for path in files:
        if not path.is_file():
            raise UserError(f"cannot read {path}: a directory or no file")
        try:
            tensors |= {name: (path, tensor) for name, tensor in mx.load(str(path)).items()}
        except (RuntimeError, ValueError) as e:
            raise damaged(path, f"is not a readable safetensors file ({e})")
    where = files[0] if len(files) == 1 else f"the sharded checkpoint {model_dir}"
    first = next(iter(layer_shapes(config)))
    for i in range(config.num_hidden_layers):  # before listing 10**9 layers' tensors, say
        if f"model.layers.{i}.{first}" not in tensors:
            raise UserError(f"{where} lacks the tensor 'model.layers.{i}.{first}'")
    floats = (mx.bfloat16, mx.float16, mx.float32)
    expected = {name: (shape, floats) for name, shape in tensor_shapes(config).items()}
    if "lm_head.weight" in tensors:  # a tied checkpoint's extra head may be used (load_model)
        expected["lm_head.weight"] = ((config.vocab_size, config.hidden_size), floats)
    for name, ((rows, *columns), _) in list(expected.items()):
        stem = name.removesuffix(".weight")
        if quantization and columns and f"{stem}.scales" in tensors:  # stored quantized (sec. 16)
            how = quantization.get(stem)
            how = how if isinstance(how, dict) else quantization
            expected[name] = ((rows, columns[0] * how["bits"] // 32), (mx.uint32,))
            for part in ("scales", "biases"):
                expected[f"{stem}.{part}"] = ((rows, columns[0] // how["group_size"]), floats)
    for name, (shape, dtypes) in expected.items():
        if name not in tensors:
            raise UserError(f"{where} lacks the tensor {name!r}")
        path, tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise UserError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                            f"{shape}")
        if tensor.dtype not in dtypes:
            name_of = lambda dtype: str(dtype).split(".")[-1]
            raise UserError(f"{path}: tensor {name!r} is stored as {name_of(tensor.dtype)}, "
                            f"expected {' or '.join(map(name_of, dtypes))}")
    unexplained = [name for name in tensors if name not in expected]
    if unexplained:
        raise UserError(f"{where} holds {plural(len(unexplained), 'tensor')} that config.json "
                        f"does not describe, such as {unexplained[0]!r}: config.json "
                        f"(num_hidden_layers {config.num_hidden_layers}, ...) does not match them")


def stored_head_differs(model_dir):
    """A checkpoint whose config ties the LM head to the embeddings may store lm_head.weight too: a
    copy (Qwen3-0.6B's), or a different matrix, which transformers 5 uses, and so do we (mlx-lm
    drops it). A different matrix differs in nearly every row, so 64 rows spread over both, read
    straight from the files, tell them apart without reading 2 x 311 MB on every run. (A
    safetensors file starts with a length, then that much JSON: name -> dtype, shape, bytes.)"""
    entries = {}
    for path in weight_files(model_dir):
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            entries |= {name: (path, 8 + length, entry)
                        for name, entry in json.loads(f.read(length)).items()}

    def rows(path, start, entry):
        (begin, end), n_rows = entry["data_offsets"], entry["shape"][0]
        with path.open("rb") as f:
            for i in range(0, n_rows, max(1, n_rows // 64)):
                f.seek(start + begin + i * ((end - begin) // n_rows))
                yield f.read((end - begin) // n_rows)

    head, table = entries.get("lm_head.weight"), entries["model.embed_tokens.weight"]
    if head is None:
        return False
    alike = (head[2]["dtype"], head[2]["shape"]) == (table[2]["dtype"], table[2]["shape"])
    return not alike or list(rows(*head)) != list(rows(*table))


def check_chat_template(model_dir):
    """--chat writes Qwen3's hybrid-thinking format (section 18). Qwen3-2507 Instruct and Thinking
    were trained on others: their templates lack its enable_thinking switch."""
    path = Path(model_dir) / "chat_template.jinja"  # newer checkpoints keep it in its own file
    try:
        template = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, ValueError) as e:
        raise damaged(path, f"cannot be read ({e})")
    if template is None:
        path = Path(model_dir) / "tokenizer_config.json"
        template = read_json(path).get("chat_template") if path.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = [t.get("template") for t in template
                    if isinstance(t, dict) and t.get("name") == "default"]
    if template and "enable_thinking" not in str(template):  # no template: given the benefit
        raise UserError(f"{path} holds a chat template other than Qwen3's hybrid-thinking one that "
                        "--chat writes (a Qwen3-2507 model?); run it without --chat")


# --- Memory: will the weights fit? ----------------------------------------------------------------

def weight_bytes(config, dtype, bits=None, group_size=GROUP_SIZE, stored=None):
    """The bytes Part 1's weights take once loaded (a tied head shares the embedding's). Quantized
    (section 16), a matrix takes `bits` per weight plus a scale and a bias per group; stored:
    config.json's "quantization", whose settings for a matrix (mixed precision) win."""
    total = 0
    for name, shape in tensor_shapes(config).items():
        n, how = math.prod(shape), (stored or {}).get(name.removesuffix(".weight"))
        b, g = (how["bits"], how["group_size"]) if isinstance(how, dict) else (bits, group_size)
        b = None if how is False else b  # a layer stored unquantized
        quantized = b and quantizable(shape, g)
        total += n * b // 8 + 2 * n // g * dtype.size if quantized else n * dtype.size
    return total


def memory_size():
    """A GPU's memory as MLX reports it (a Mac's unified memory, a CUDA card's); else the RAM."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    size = info.get("memory_size") or info.get("total_memory")  # Metal's key, CUDA's key
    return size or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_working_set():
    """On a Mac, the memory Metal recommends its GPU use at most (2/3 to 3/4 of it): beyond, the
    weights are paged in and out on every token. None elsewhere (CUDA and the CPU have no such)."""
    if mx.default_device() == mx.gpu:
        return mx.device_info().get("max_recommended_working_set_size")


def check_memory(needed, available, dtype, working_set=None):
    """Refuse weights larger than the memory, or on a Mac than the GPU's working set, before
    reading gigabytes only to crash or swap. Smaller ones run: the OS can usually make room."""
    if working_set and needed > working_set:
        has = (f"this Mac's GPU may use only {working_set / 1e9:.1f} GB of its "
               f"{available / 1e9:.1f} GB of memory (Metal's recommended working set)")
    elif needed > available:
        has = f"this machine has {available / 1e9:.1f} GB of memory"
    else:
        return
    smaller = "--dtype bfloat16 (half the bytes), " if dtype.size == 4 else ""
    raise UserError(f"the weights need {needed / 1e9:.1f} GB as {str(dtype).split('.')[-1]}, but "
                    f"{has}; try {smaller}--quantize 4, or a smaller model")


def wire_weights(weights):
    """On a Mac, keep weights that fill more than half the GPU's working set resident ("wired"),
    as mlx-lm does: every token reads all of them. Set once, before anything is queued (MLX asks
    that the limit not change while work is queued)."""
    from mlx.utils import tree_flatten  # only this Mac step needs it

    arrays = {id(a): a for _, a in tree_flatten(weights) if isinstance(a, mx.array)}  # tied: once
    working_set = gpu_working_set()
    if working_set and sum(a.nbytes for a in arrays.values()) > working_set / 2:
        mx.set_wired_limit(working_set)


# --- Loading: the checks, then Part 1's loaders ---------------------------------------------------

# The lowest temperature besides 0. Lower, sampling is greedy in all but name (a logit gap of 0.01
# becomes 100), and far lower (1e-45) logits / temperature overflow to inf: the draw gives token 0.
MIN_TEMPERATURE = 1e-4

# Settings from generation_config.json (or a flag): the test each value passes, what it should be.
SETTINGS = {
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
    values = read_json(path, "delete or re-download it") if path.exists() else {}
    values = {key: value for key, value in values.items() if value is not None}  # null: unset
    for key, (fits, expected) in SETTINGS.items():
        if key in values and not fits(values[key]):
            raise UserError(f"{path}: {key!r} should be {expected}, got "
                            f"{json.dumps(values[key])}; fix it or delete the file")
    return values


def eos_token_ids(generation_config, tokenizer):
    """Ids that end a reply: <|im_end|> (151645) ends a chat turn, <|endoftext|> (151643) a text."""
    ids = generation_config.get("eos_token_id", [])
    ids = set(ids if isinstance(ids, list) else [ids])
    return ids | {tokenizer.token_to_id(token) for token in ("<|im_end|>", "<|endoftext|>")
                  if tokenizer.token_to_id(token) is not None}


def load_model(model_dir, dtype, bits=None, group=None):
    """Part 1's loaders, after checking what they assume. bits (--quantize) makes section 16's
    replacements; a group of several processes section 20's, and each loads its share.
    Returns (config, weights, tokenizer, generation config); config is this process's share."""
    config, stored = check_config(model_dir)
    if bits and stored.get("bits") and bits != stored["bits"]:
        raise UserError(f"{model_dir} is already quantized to {stored['bits']} bits; drop "
                        "--quantize or point --model at the unquantized model")
    check_weights(model_dir, config, stored)  # first: the sizes come from config.json
    n = group.size() if group else 1
    # Quantized, each process's columns must hold whole groups (of the largest size: 128, say).
    sizes = [how.get("group_size", 0) for how in (stored, *stored.values())
             if isinstance(how, dict)]
    group_size = GROUP_SIZE if bits else max(sizes)
    if n > 1 and not can_split(config, n, group_size):
        counts = [str(k) for k in range(1, config.num_key_value_heads + 1)
                  if can_split(config, k, group_size)]
        raise SharedError(f"{model_dir} cannot be split over {n} processes (whole heads and "
                        f"quantization groups): use {', '.join(counts)}")
    try:
        own_head = config.tie_word_embeddings and stored_head_differs(model_dir)  # loaded too
    except (ValueError, RecursionError) as e:  # a header mx.load reads but json does not
        raise damaged(model_dir, f"holds a weight file whose header is not plain JSON ({e})")
    shares = split_config(config, n)._replace(  # a tied head stored apart is loaded too
        tie_word_embeddings=config.tie_word_embeddings and not own_head)
    check_memory(weight_bytes(shares, dtype, bits or stored.get("bits"),
                              stored.get("group_size", GROUP_SIZE), stored),
                 memory_size(), dtype, gpu_working_set())
    path = Path(model_dir) / "tokenizer.json"
    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as e:  # the Rust library raises a plain Exception for any unreadable file
        raise damaged(path, f"cannot be loaded ({e})")
    tokenizer.no_truncation()  # a tokenizer.json may ask to cut or pad every text: not a prompt
    tokenizer.no_padding()
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > config.vocab_size:  # its ids would pick rows the embedding table lacks
        raise UserError(f"{path} has {n_tokens} tokens, but the embedding table has only "
                        f"{config.vocab_size} rows (vocab_size): not one model's files")
    generation_config = load_generation_config(model_dir)
    if bits or stored:
        use_quantization(bits, stored)
    if n > 1:
        use_tensor_parallelism(group)
    try:
        weights = load_weights(model_dir, config, dtype)
        if config.tie_word_embeddings and own_head:
            weights["lm_head"] = load_tensor(load_tensors(model_dir), "lm_head.weight", dtype)
    except (RuntimeError, ValueError, OSError) as e:  # e.g. a read error halfway through a file
        raise damaged(model_dir, f"holds a damaged weight file ({e})")
    return split_config(config, n), weights, tokenizer, generation_config


# --- Finding the model: a folder, or a Hugging Face repo id downloaded once into a folder ---------

def repo_id(text):
    """'owner/name' as Hugging Face spells repo ids, also pasted as a huggingface.co address or
    with a trailing slash; None for anything else."""
    address = re.match(r"https?://(?:www\.)?huggingface\.co/([^/?#]+/[^/?#]+)", text)
    text = address.group(1) if address else text.rstrip("/")
    return text if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text) else None


def download_command(repo, model_dir):
    """The `hf download` command to print. Its --local-dir is relative, so that it works on another
    machine too: to the current folder when model_dir is under it, else to this script's (cd)."""
    files = f" {' '.join(MODEL_FILES)}" if repo == HF_REPO else ""
    model_dir, here = Path(model_dir).absolute(), Path.cwd()
    script_dir, cd = Path(__file__).resolve().parent, ""
    if model_dir.is_relative_to(here):
        model_dir = model_dir.relative_to(here)
    elif model_dir.is_relative_to(script_dir):  # repo ids' and the default folder are there
        cd, model_dir = f"cd {shlex.quote(str(script_dir))} && ", model_dir.relative_to(script_dir)
    return f"{cd}hf download {repo}{files} --local-dir {shlex.quote(str(model_dir))}"


def missing_files(names):
    """The NEEDED_FILES not among these file names; a sharded checkpoint's index stands in for
    model.safetensors (check_weights then checks its shards)."""
    return [name for name in NEEDED_FILES if name not in names
            and not (name == "model.safetensors" and WEIGHTS_INDEX in names)]


def download_model(repo, model_dir):
    """Fetch the files Part 1 reads from a Hugging Face repo into model_dir. huggingface_hub writes
    each file under a temporary name and renames it once complete. The weights come last, an index
    after its shards: a folder cut off midway never looks complete, and the next run fetches what
    is missing."""
    import huggingface_hub as hub  # only needed here, on the first run

    sizes = {s.rfilename: s.size or 0
             for s in hub.HfApi().model_info(repo, files_metadata=True).siblings}
    if missing_files(sizes):
        raise UserError(f"{repo} has no {', '.join(missing_files(sizes))}: it is not a Qwen3 "
                        "checkpoint in Hugging Face's safetensors layout")
    sharded = "model.safetensors" not in sizes
    with tempfile.TemporaryDirectory() as first:  # refuse a model we cannot run before gigabytes
        for name in ["config.json"] + [WEIGHTS_INDEX] * sharded:
            hub.hf_hub_download(repo, name, local_dir=first)
        try:
            check_config(first)
            weights = ([path.name for path in checked_weight_files(first)] + [WEIGHTS_INDEX]
                       if sharded else ["model.safetensors"])
        except UserError as e:  # name the repo, not the temporary folder
            raise UserError(str(e).replace(str(Path(first)), repo))
    names = [name for name in (*MODEL_FILES, "chat_template.jinja") if name in sizes
             and name != "model.safetensors"] + weights
    print(f"Downloading {repo} ({len(names)} files, "
          f"{sum(sizes.get(name, 0) for name in names) / 1e9:.2f} GB) into {model_dir}/",
          file=sys.stderr)
    for name in names:
        hub.hf_hub_download(repo, name, local_dir=model_dir)


def find_model(model_arg, allow_download):
    """The model folder. --model is a folder when that path exists or is no repo id, and is never
    downloaded into (it may hold another model). A repo id (default: Qwen/Qwen3-0.6B, in
    ./Qwen3-0.6B if present) is downloaded into its folder next to this script when incomplete."""
    repo, script_dir = repo_id(model_arg or HF_REPO), Path(__file__).resolve().parent
    try:
        if model_arg and Path(model_arg).exists() and (
                repo is None or Path(model_arg).resolve() != script_dir / repo):  # no download
            repo = None
        if repo is None:
            model_dir = Path(model_arg)
        elif model_arg:
            model_dir = script_dir / repo
        else:  # ./Qwen3-0.6B when present, else the one next to this script
            model_dir = Path("Qwen3-0.6B")
            model_dir = model_dir if model_dir.is_dir() else script_dir / model_dir
        # Names, not files: a directory in a file's place is reported as unreadable when read.
        names = {p.name for p in model_dir.iterdir()} if model_dir.is_dir() else ()
    except OSError as e:  # a name too long, a folder without permission, ...
        raise UserError(f"cannot read the model folder {model_arg or 'Qwen3-0.6B'}: "
                        f"{e.strerror or e}")
    missing = missing_files(names)
    if not missing:
        return model_dir
    what = (f"{model_dir} lacks {', '.join(missing)}" if model_dir.is_dir() else
            f"{model_dir} is a file, not a model folder" if model_dir.exists() else
            f"model folder {model_dir} not found")
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
    except Exception as e:  # offline, no such repo, a network error midway, a full disk ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what}, and could not download {repo} ({type(e).__name__}: {reason}); "
                        "run again to resume, or fetch it with: "
                        f"{download_command(repo, model_dir)}")
    return model_dir


# --- OpenBLAS: the lines before `import mlx.core` at the top of the file, and the dtype -----------
#
# MLX's Linux CPU wheel (the mlx-cpu package, with its libraries in mlx_cpu.libs/) does float32
# matrix products by calling cblas_sgemm from a bundled reference BLAS: plain loops, many times
# slower than OpenBLAS on a whole prompt (docs/platforms.md). A library opened with RTLD_GLOBAL
# before MLX loads comes first when the dynamic linker resolves MLX's symbols, so loading OpenBLAS
# that way sends those calls to it; loaded after MLX it is never used.
OPENBLAS_HINT = ("Hint: this CPU runs float32 faster with OpenBLAS, which this script uses once "
                 "installed: sudo apt-get install libopenblas0-pthread")


def pick_dtype(name):
    """'auto' = bfloat16 on a GPU; float32 on the CPU, where MLX runs bfloat16 products through
    its own slower loops, with or without OpenBLAS (docs/platforms.md)."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return getattr(mx, name)


# --- The command line: python llm_inference.py --prompt "..." [flags] -----------------------------

DEFAULT_PROMPT = "The capital of France is"
MAX_TOKENS, CHAT_MAX_TOKENS = 100, 8192  # 8192: enough to finish thinking, mostly (README, Chat)
# Qwen's recommended sampling (model card); in thinking mode generation_config.json's win.
QWEN3_THINKING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
QWEN3_NO_THINK = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
# What transformers' generate() falls back on for a value generation_config.json lacks.
TRANSFORMERS_DEFAULTS = {"top_p": 1.0, "top_k": 50, "min_p": 0.0}


def as_text(data, what):
    """Text as a text editor reads it: UTF-8 without a byte-order mark, with Windows (CRLF) and
    old Mac (CR) line ends as newlines. A str from the command line that was not UTF-8 (cut
    mid-character?) holds lone surrogates, which os.fsencode turns back into its bytes."""
    try:
        text = (os.fsencode(data) if isinstance(data, str) else data).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{what} is not valid UTF-8 text (cut in the middle of a character?)")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_prompt(text):
    if text == "-":  # read the prompt from stdin
        if sys.stdin.isatty():
            print("Reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr)
        text = as_text(sys.stdin.buffer.read(), "the prompt on stdin").removesuffix("\n")  # echo's
    text = as_text(text, "--prompt")
    if not text.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    return text


def number(kind, low=None, high=None, low_open=False, rule=None):
    """An argparse type: a number of `kind` in [low, high] (or (low, high]), that passes
    SETTINGS[rule] if given."""
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
        if rule and not SETTINGS[rule][0](value):
            raise argparse.ArgumentTypeError(f"must be {SETTINGS[rule][1]}, got {text}")
        return value
    return parse


def model_name(text):
    """An argparse type for --model. An empty one (a shell variable never set?) would otherwise
    mean the default model, and a 1.5 GB download."""
    if not text:
        raise argparse.ArgumentTypeError(f"is empty; give a model folder, or a repo id such as "
                                         f"{HF_REPO}")
    return text


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block; exit code 2 as usual
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(prog="llm_inference.py", description="Generate text with Qwen3 on MLX.")
    add = ap.add_argument
    add("--prompt", help=f"the text to continue ('-' reads stdin; default: {DEFAULT_PROMPT!r}); "
        "with --chat, one message and its reply")
    add("--max-tokens", type=number(int, 1), help=f"stop after this many new tokens ({MAX_TOKENS}; "
        f"{CHAT_MAX_TOKENS} with --chat; at most half the context)")
    add("--temperature", type=number(float, 0, rule="temperature"),
        help="0 = greedy (default; with --chat 0.6, or 0.7 with --no-think)")
    add("--top-p", type=number(float, 0, 1, low_open=True),
        help="nucleus sampling mass (generation_config.json's; 0.8 with --no-think)")
    add("--top-k", type=number(int, 0),
        help="keep only the k most likely tokens, 0 = all (generation_config.json's)")
    add("--min-p", type=number(float, 0, 1),
        help="keep tokens at least this fraction as likely as the likeliest (0)")
    add("--presence-penalty", type=number(float, 0, 2),
        help="lower the logit of tokens already in the reply, against repetition (0)")
    add("--seed", type=number(int, 0, 2**64 - 1), help="random seed for sampling (default: fresh)")
    add("--model", type=model_name, help="a model folder, or a Hugging Face repo id such as "
        "Qwen/Qwen3-1.7B, downloaded once into the folder Qwen/Qwen3-1.7B next to this script "
        "(default: ./Qwen3-0.6B, else the one next to this script)")
    add("--no-download", action="store_true", help="never download the model, fail instead")
    add("--chat", action="store_true", help="talk with the model in Qwen3's chat format")
    add("--system", help="system message for --chat")
    add("--no-think", action="store_true", help="with --chat: skip Qwen3's <think> reasoning")
    add("--hide-think", action="store_true",
        help="with --chat: show a progress line instead of the reasoning")
    add("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
        help="auto = bfloat16 on a GPU, float32 on the CPU. M1/M2 Macs have no bfloat16 "
        "arithmetic: float16 runs faster there (29 vs 19 tok/s on an M2 Ultra), but Qwen3 can "
        "overflow it. On CUDA and M5 Macs, MLX multiplies float32 with TF32 (less precise) "
        "unless MLX_ENABLE_TF32=0 is set")
    add("--quantize", type=int, choices=[4, 8], metavar="{4,8}",
        help="store the weights in 4 or 8 bits, as mlx_lm.convert does: less memory")
    lab = ap.add_argument_group("experiments (README, Experiments)").add_argument
    lab("--top-probs", type=number(int, 1), metavar="N",
        help="print the N likeliest first tokens and their probabilities")
    lab("--trace", action="store_true",
        help="narrate one forward pass over the prompt (shapes, sizes, logit lens); no reply")
    lab("--no-cache", action="store_true",
        help="recompute the whole sequence at every step, without the KV cache")
    lab("--no-compile", action="store_true",
        help="run silu_gate uncompiled (section 13), so print() works inside it")
    lab("--reference-ops", action="store_true",
        help="run Part 1 as written: no fused kernels (section 12), no compilation")
    args = ap.parse_args(argv)
    if (args.system is not None or args.no_think or args.hide_think) and not args.chat:
        ap.error("--system, --no-think and --hide-think only apply with --chat")
    for flag, given in (("--top-probs", args.top_probs), ("--trace", args.trace),
                        ("--no-cache", args.no_cache)):
        if given and args.chat and args.prompt is None:
            ap.error(f"{flag} needs a single message: add --prompt to --chat")
        if given and args.trace and flag != "--trace":  # the trace makes no reply
            ap.error(f"{flag} does not apply to --trace, which runs one forward pass and ends "
                     "with the 5 likeliest tokens")
    return args


def sampling_settings(args, generation_config):
    """(Sampling, min_p, presence penalty). Flags win. --chat then takes Qwen's recommendations:
    generation_config.json's in thinking mode, the model card's for --no-think. Completion is
    greedy unless --temperature is given; top-k/p and min-p then come from the file (as in
    transformers)."""
    if args.chat and args.no_think:
        recommended = QWEN3_NO_THINK
    elif args.chat:
        recommended = QWEN3_THINKING | generation_config
    else:
        recommended = TRANSFORMERS_DEFAULTS | generation_config | {"temperature": 0.0}
    given = lambda flag, name: flag if flag is not None else recommended[name]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = Sampling(float(given(args.temperature, "temperature")),
                        int(given(args.top_k, "top_k")), float(given(args.top_p, "top_p")), seed)
    return sampling, float(given(args.min_p, "min_p")), args.presence_penalty or 0.0


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
    return f"{n} {word}{'' if n == 1 else 's'}"


def rate(n, seconds):
    """', 12.3 tok/s', or nothing when no token was timed (a decode rate counts the tokens after
    the first: one token gives none)."""
    return f", {n / seconds:.1f} tok/s" if n > 0 and seconds > 0 else ""


class ReplyPrinter:
    """Writes a reply to stdout as its tokens arrive. On a terminal, Qwen3's <think>...</think>
    reasoning is dimmed; hide_think shows a "thinking... (N tokens)" line instead, on stderr.
    In a pipe or a file the text is written as it is, without colour codes."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, tokenizer, hide_think):
        self.tokenizer, self.hide_think = tokenizer, hide_think
        self.think_ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        self.colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ  # no-color.org
        self.progress = hide_think and sys.stderr.isatty()
        # DecodeStream holds back the bytes of a character split across tokens (emoji, CJK) until
        # it is complete: nothing prints as garbage.
        self.stream = DecodeStream(skip_special_tokens=True)
        self.thinking, self.n_thinking, self.n_tokens = False, 0, 0
        self.answer_started = False  # for hide_think: the newlines after </think> are dropped

    def add(self, token_id):
        self.n_tokens += 1
        piece = self.stream.step(self.tokenizer, token_id) or ""
        if token_id == self.think_ids[self.thinking]:  # <think> opens, </think> closes
            self.thinking = not self.thinking
            self.show_progress(clear=True)
            piece = "" if self.hide_think else piece
            if self.colour and not self.hide_think:
                piece = self.DIM + piece if self.thinking else piece + self.PLAIN
        elif self.thinking:
            self.n_thinking += 1
            piece = "" if self.hide_think else piece
            self.show_progress()
        elif self.hide_think and not self.answer_started:
            piece = piece.lstrip("\n")
            self.answer_started = bool(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    def show_progress(self, clear=False):
        if self.progress and self.n_thinking:
            sys.stderr.write("\r\x1b[K" if clear else f"\rthinking… ({self.n_thinking} tokens)")
            sys.stderr.flush()

    def finish(self):
        """End the reply's line, restoring the colour if it stopped while thinking."""
        if self.thinking:
            self.show_progress(clear=True)
            sys.stdout.write(self.PLAIN if self.colour and not self.hide_think else "")
        sys.stdout.write("\n")
        sys.stdout.flush()


def check_logits(logits):
    """Refuse logits that are NaN or infinite, before they are shown as text or probabilities."""
    if not mx.all(mx.isfinite(logits)).item():
        raise UserError("the model computed NaN or infinite logits: its activations overflowed "
                        "(float16 can, with Qwen3: try --dtype bfloat16 or float32), or the "
                        "weights hold NaN (re-download them)")


def stream(tokens, printer, on_first_logits=None):
    """Print (token id, logits) pairs as they are generated, until the end or Ctrl-C. Returns
    (interrupted, seconds to the first token: the prefill, seconds for the rest: the decode)."""
    start = first = time.perf_counter()
    interrupted = False
    try:
        for token_id, logits in tokens:
            if printer.n_tokens == 0:
                first = time.perf_counter()
                check_logits(logits)  # once: no cost per token
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


CHAT_HELP = ('/reset (or /clear) starts over; /exit (/quit, /bye, Ctrl-D) ends; /help shows this; '
             'Ctrl-C stops a reply; """ on a line of its own starts and ends a message of several '
             'lines')
COMMANDS = {"/exit": "exit", "/quit": "exit", "/bye": "exit", "/reset": "reset",
            "/clear": "reset", "/help": "help", "/?": "help"}


def read_line(interactive, prompt):
    """A line of input, None at its end. On a terminal, input() has line editing and history
    (readline, imported by chat_loop)."""
    if interactive:
        if not sys.stdout.isatty():  # input() would write the prompt among the replies
            print(prompt, end="", file=sys.stderr, flush=True)
            prompt = ""
        try:
            return as_text(input(prompt), "the message")
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return None
    line = sys.stdin.buffer.readline()
    return as_text(line, "the message").removesuffix("\n") if line else None


def read_message(interactive):
    """The next message, None at the end of input: a line, or the lines between two lines of
    triple quotes."""
    line = read_line(interactive, ">>> ")
    if line is None or line.strip() != '"""':
        return line
    lines, error = [], None
    while True:
        try:
            line = read_line(interactive, "... ")
        except UserError as e:  # a bad line spoils the message: read on to its end, then say so
            error, line = e, ""
        if line is None or line.strip() == '"""':
            break
        lines.append(line)
    if error:
        raise error
    return "\n".join(lines)


def check_ids(ids, config):
    """Refuse token ids the embedding table has no row for (embed() would read outside it): an
    edited tokenizer.json can give them, which its size alone (checked at load) does not show."""
    if ids and max(ids) >= config.vocab_size:
        raise UserError(f"tokenizer.json gave the token id {max(ids)}, but the embedding table has "
                        f"only {config.vocab_size} rows (vocab_size): not one model's files")


def make_room(chat, message, max_tokens):
    """Forget the oldest turns until the conversation, the new message and a whole reply fit in
    the context, and say so. A message too long even alone is a UserError, and leaves the
    conversation as it was. Once the context is full, every turn prefills it all again."""
    context, turns, dropped = chat.config.max_position_embeddings, chat.turns, 0
    ids = chat.prompt_ids(message)
    check_ids(ids, chat.config)
    n_prompt = len(ids)
    try:
        while n_prompt + max_tokens > context and dropped < len(turns):
            dropped += 1
            chat.turns = turns[dropped:]  # the cache rolls back to the system message
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
              f"{plural(dropped, 'turn')})", file=sys.stderr)


def chat_loop(chat, max_tokens, sampling, eos_ids, hide_think, new_reply=lambda: None):
    """Talk until end of input, Ctrl-D or /exit. Replies go to stdout, everything else to
    stderr. new_reply() runs before each reply (section 17's sampling starts afresh)."""
    interactive = sys.stdin.isatty()
    if interactive:
        if hasattr(sys.stdin, "reconfigure"):  # bytes not UTF-8 then reach as_text: one line
            sys.stdin.reconfigure(errors="surrogateescape")
        try:
            import readline  # noqa: F401 (importing it is what gives input() editing and history)
        except ImportError:  # not on every platform; input() still works without
            pass
    turn = 0
    while True:
        try:
            message = read_message(interactive)
            command = "/exit" if message is None else message.strip().lower()
            if re.fullmatch(r"/[a-z?]+", command):  # a command, not a message
                action = COMMANDS.get(command)
                if action == "exit":
                    return
                if action == "reset":
                    chat.turns.clear()  # the cache rolls back by itself at the next turn
                    turn = 0
                print("(conversation reset)" if action == "reset" else
                      f"{'' if action else f'unknown command {command}: '}{CHAT_HELP}",
                      file=sys.stderr)
                continue
            if not command:
                continue
            make_room(chat, message, max_tokens)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in Python's REPL
            print(file=sys.stderr)
            continue
        except UserError as e:  # a bad message is skipped; the chat goes on
            print(f"error: {e}", file=sys.stderr)
            continue
        n_turns, printer = len(chat.turns), ReplyPrinter(chat.tokenizer, hide_think)
        new_reply()
        interrupted, prefill_s, decode_s = stream(
            chat.reply(message, max_tokens, sampling, eos_ids), printer)
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


# --- Several processes (mlx.launch, section 20): process 0 reads the input and prints ------------

def share(text, group):
    """Process 0's text (None: the end of input) on every process of the group: all_sum adds the
    others' zeros to its bytes."""
    first = group.rank() == 0
    data = (text or "").encode("utf-8", "surrogateescape") if first else b""
    length = mx.array(len(data) + 1 if first and text is not None else 0)  # 0 stands for None
    length = mx.distributed.all_sum(length, group=group).item()
    if length == 0:
        return None
    data = mx.array(list(data), mx.uint8) if first else mx.zeros(length - 1, mx.uint8)
    return bytes(mx.distributed.all_sum(data, group=group).tolist()).decode("utf-8",
                                                                           "surrogateescape")


def join(group):
    """Run as one of the group's processes. Process 0 reads the input, for all (mlx.launch sends
    stdin to every process), and prints; the others print only their own errors, and die at once
    on Ctrl-C: generating in step, no process can stop a reply alone."""
    first, read_prompt_alone, read_message_alone = group.rank() == 0, read_prompt, read_message
    if first:
        signal.signal(signal.SIGINT, lambda *_: sys.exit(print("\nInterrupted.", file=sys.stderr)
                                                         or 130))
    else:  # its own errors go to a copy of stderr; the rest, MLX's messages too, nowhere
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.__stderr__ = os.fdopen(os.dup(2), "w", buffering=1)
        for fd in (1, 2):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    replace(read_prompt=lambda text: share(read_prompt_alone(text) if first else None, group),
            read_message=lambda interactive: share(
                read_message_alone(interactive) if first else None, group))


def main(argv=None):
    if sys.stdout is None:  # closed (>&-)
        raise UserError("standard output is closed: nowhere to write the text")
    if sys.stdin is None:  # closed (<&-): read as empty. /dev/null also fills descriptor 0, where
        sys.stdin = open(os.devnull)  # MLX would take a weight file it opens for a failure.
    group = mx.distributed.init()  # several processes when mlx.launch started this (section 20)
    if group.size() > 1:
        join(group)
    args = parse_args(argv)
    if group.size() > 1 and args.prompt == "-":  # mlx.launch never closes the processes' input
        raise SharedError("--prompt - reads stdin to its end, which never comes under mlx.launch: "
                          "give the text itself with --prompt")
    multi_turn = args.chat and args.prompt is None
    prompt = None if multi_turn else read_prompt(
        DEFAULT_PROMPT if args.prompt is None else args.prompt)
    try:
        system = as_text(args.system, "--system") if args.system is not None else None
    except UserError as e:  # the same on every process: said once (section 20)
        raise SharedError(e) from None
    if args.chat and args.temperature == 0:
        print("warning: Qwen advises against greedy decoding (--temperature 0) in chat: in "
              "thinking mode it leads to endless repetition", file=sys.stderr)
    ignored = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                        ("--min-p", args.min_p), ("--seed", args.seed))
               if value is not None]
    if (args.temperature == 0 or args.temperature is None and not args.chat) and ignored:
        print(f"warning: {', '.join(ignored)} only matter{'s' * (len(ignored) == 1)} when "
              f"sampling; greedy decoding ignores {'it' if len(ignored) == 1 else 'them'} (add "
              "--temperature)", file=sys.stderr)
    model_dir = find_model(args.model, allow_download=not args.no_download)
    if args.chat:
        check_chat_template(model_dir)
    dtype = pick_dtype(args.dtype)
    config, weights, tokenizer, generation_config = load_model(model_dir, dtype, args.quantize,
                                                               group)
    wire_weights(weights)
    # Part 2's replacements, made here (load_model made section 16's for quantized weights).
    if not args.reference_ops:
        use_fused_kernels()  # section 12
        if not args.no_compile:
            compile_model()  # section 13
    eos_ids = eos_token_ids(generation_config, tokenizer)
    sampling, min_p, presence_penalty = sampling_settings(args, generation_config)
    if group.size() > 1:  # process 0's seed: every process draws the same tokens
        sampling = sampling._replace(seed=int(share(str(sampling.seed), group)))
    new_reply = lambda: None
    if min_p or presence_penalty:  # section 17, afresh for each reply
        new_reply = lambda: use_extra_sampling(min_p, presence_penalty, config.vocab_size)
    c, context = config, config.max_position_embeddings
    max_tokens = args.max_tokens or min(CHAT_MAX_TOKENS if args.chat else MAX_TOKENS, context // 2)
    if multi_turn:  # a whole reply must fit beside each message
        n_format = len(tokenize(tokenizer, chat_prompt("", system, not args.no_think)))
        if n_format + max_tokens >= context:  # >=: a message adds at least one token
            raise SharedError(f"--max-tokens {max_tokens} leaves no room for a message in the "
                              f"model's {context}-token context (the chat format"
                              f"{' and --system' * bool(system)} takes {n_format} tokens); lower "
                              f"--max-tokens{' or shorten --system' * bool(system)}")
    else:
        text = chat_prompt(prompt, system, think=not args.no_think) if args.chat else prompt
        prompt_ids = tokenize(tokenizer, text)
        check_ids(prompt_ids, config)
        if args.trace and len(prompt_ids) > context:  # the trace makes no reply
            raise SharedError(f"the prompt has {plural(len(prompt_ids), 'token')}, more than the "
                              f"model's {context}-token context: shorten it")
        if not args.trace and len(prompt_ids) + max_tokens > context:
            raise SharedError(f"the prompt has {plural(len(prompt_ids), 'token')}; with "
                              f"--max-tokens {max_tokens} that exceeds the model's "
                              f"{context}-token context: shorten it or lower --max-tokens")

    matrices = [weights["embed_tokens"], weights["lm_head"],
                *(w for layer in weights["layers"] for w in layer.values())]
    bits = "/".join(map(str, sorted({w.bits for w in matrices if isinstance(w, Quantized)})))
    n = group.size()  # config holds this process's 1/n of the heads
    print(f"Model: {model_dir.resolve().name} ({c.num_hidden_layers} layers, {c.hidden_size} dim, "
          f"{c.num_attention_heads * n} Q heads, {c.num_key_value_heads * n} KV heads) on "
          f"{'gpu' if mx.default_device() == mx.gpu else 'cpu'}"
          f"{f' x {n} processes' if n > 1 else ''}, {str(dtype).split('.')[-1]}"
          f"{f', {bits}-bit weights' if bits else ''}", file=sys.stderr)
    if MLX_CPU_WHEEL and not OPENBLAS:
        print(OPENBLAS_HINT, file=sys.stderr)
    if c.tie_word_embeddings and weights["lm_head"] is not weights["embed_tokens"]:
        print("Note: config.json ties the LM head to the embeddings, but the checkpoint stores a "
              "different lm_head.weight; using it, as transformers does", file=sys.stderr)
    how = describe(sampling, min_p, presence_penalty)
    if multi_turn:
        print(f"Chat: {how}, up to {max_tokens} tokens per reply. {CHAT_HELP}.", file=sys.stderr)
        chat = Chat(weights, config, tokenizer, system, think=not args.no_think)
        chat_loop(chat, max_tokens, sampling, eos_ids, args.hide_think, new_reply)
        return 0
    shortened = prompt if len(prompt) <= 60 else prompt[:60] + "…"  # a prompt may be a file
    print(f"Prompt: {shown(shortened)} ({plural(len(prompt_ids), 'token')}), {how}",
          file=sys.stderr)
    if args.trace:
        final = forward(mx.array(prompt_ids), weights, config, make_cache(config))
        check_logits(final)  # before a table of NaN probabilities
        trace(prompt_ids, weights, config, tokenizer, final)
        return 0
    printer = ReplyPrinter(tokenizer, args.hide_think)
    top_probs = args.top_probs and (lambda logits: print_top_probs(logits, tokenizer,
                                                                   args.top_probs))
    new_reply()
    run = generate_without_cache if args.no_cache else generate_long
    interrupted, prefill_s, decode_s = stream(
        run(prompt_ids, weights, config, max_tokens, sampling, eos_ids), printer, top_probs)
    n = printer.n_tokens
    print(f"{'Interrupted. ' if interrupted else ''}Prompt: {plural(len(prompt_ids), 'token')}"
          f"{rate(len(prompt_ids) if n else 0, prefill_s)} | Generated: {plural(n, 'token')}"
          f"{rate(n - 1, decode_s)} | Total: {prefill_s + decode_s:.2f} s | Peak memory: "
          f"{mx.get_peak_memory() / 1e9:.2f} GB", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:  # each process's own, but once for what every process meets alike
        rank = mx.distributed.init().rank()
        if rank == 0 or not isinstance(e, SharedError):
            print(f"llm_inference.py: error{f' (process {rank})' if rank else ''}: {e}",
                  file=sys.__stderr__)
        sys.exit(1)
    except RuntimeError as e:  # in a group of processes, most likely another one stopped
        if mx.distributed.init().size() == 1:
            raise
        what = "another process stopped" if "peer" in str(e) else "a process failed"
        print(f"llm_inference.py: error: {what} ({e}); ending", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        mx.synchronize()  # nothing left queued on the GPU at exit, as after Ctrl-C in stream()
        print("\nInterrupted.", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # writing failed: the reader went away (`... | head`), or a full disk
        if not isinstance(e, BrokenPipeError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush can't fail
        if isinstance(e, BrokenPipeError):  # stop quietly, as Unix tools do
            sys.exit(141)
        print(f"llm_inference.py: error: cannot write the text: {e.strerror}", file=sys.stderr)
        sys.exit(1)
