"""How an LLM really generates text: Qwen3 from its released files, with MLX.

Part 1, the model, is the first read. At the end of generate() you have seen all of it. Part 2
goes further, in optional sections that build on Part 1. main() wires both into the command. The
program around them is cli.py: checks, download, flags, terminal output. You need not read it.

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

The LM head (language-model head) is the last matrix, (151936, 1024). It turns the last vector
into logits, one score for each of the vocabulary's 151936 tokens. The higher a token's score, the
likelier it comes next.
Shapes are for one sequence, with Qwen3-0.6B's sizes. Attention's arrays lead with a batch of 1.
MLX is lazy. `y = x @ w` only records the operation in a graph, and the arithmetic runs when a
value is needed (`print(y)`, `y.item()`, `mx.eval(y)`). generate() (section 11) builds on that.
"""

import json
import math
import time
from pathlib import Path
from typing import NamedTuple

# cli.py, the program around the model, is imported before MLX. On a Linux CPU it loads OpenBLAS,
# which MLX uses for its float32 matrix products only if loaded first (cli.py's top says why).
import cli
import mlx.core as mx
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# ================================================================================================
# PART 1: THE MODEL
# ================================================================================================
#
# Plain functions that write the math out. `python llm_inference.py --reference-ops` runs exactly
# this code. Only a prompt of over 32 tokens may first go through in pieces (section 14).
# A plain run swaps five of these functions for faster ones that compute the same. MLX's fused
# kernels do in one step on a GPU what several operations do here (section 12). Compilation
# merges a function's element-wise steps into one (section 13). Quantizing, sampling controls,
# several processes, experts and a draft model swap in others. Part 2 says which, and why.

# --- 1. Load: the hyper-parameters from config.json, the weights from *.safetensors ---------------

class Config(NamedTuple):  # what the model reads from config.json
    hidden_size: int  # 1024 numbers per token, in the vectors every layer reads and adds to
    num_hidden_layers: int  # 28 transformer blocks
    num_attention_heads: int  # 16 query heads ...
    num_key_value_heads: int  # ... sharing 8 key/value heads (grouped-query attention, section 6)
    head_dim: int  # 128 channels per head. Qwen3 sets it, wider than hidden_size / 16 = 64.
    intermediate_size: int  # 3072 units: the width of the SwiGLU feed-forward's middle
    vocab_size: int  # 151936 rows in the embedding table
    rope_theta: float  # 1e6: base of the rotary position frequencies
    rms_norm_eps: float  # 1e-6: keeps RMSNorm from dividing by zero
    tie_word_embeddings: bool  # True: the LM head reuses the embedding table
    max_position_embeddings: int  # 40960: the longest sequence (prompt + reply); main() checks it


def load_config(model_dir):
    """config.json's values, each as the type above (JSON's 1000000 becomes rope_theta 1e6)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    # transformers >= 5 writes rope_theta inside a "rope_parameters" dict.
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    return Config(**{name: kind(raw[name]) for name, kind in Config.__annotations__.items()})


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
    """model.safetensors, or the shards that model.safetensors.index.json lists for a larger model:
    {"weight_map": {name: "model-00001-of-00002.safetensors"}}."""
    model_dir = Path(model_dir)
    if (model_dir / "model.safetensors").exists():  # the single file first, as transformers does
        return [model_dir / "model.safetensors"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text(encoding="utf-8"))
    return [model_dir / name for name in sorted(set(index["weight_map"].values()))]


def load_tensors(model_dir):
    """Every tensor of every weight file, by name. Lazy: nothing is read until it is used."""
    tensors = {}
    for path in weight_files(model_dir):
        tensors |= mx.load(str(path))
    return tensors


def load_tensor(tensors, name, dtype):
    """Take one tensor out of the file's, convert it to dtype, and compute it now. Converting one
    tensor at a time means the file's bfloat16 copy of everything never sits beside the converted
    weights. In float32, that would take 1.5x the memory of the weights."""
    weight = tensors.pop(name).astype(dtype)
    mx.eval(weight)
    return weight


def load_weights(model_dir, config, dtype):
    """{"embed_tokens", "layers": [{"q_proj": ..., ...} x 28], "norm", "lm_head"}, as dtype.
    That is mx.bfloat16, as stored, on a GPU, and mx.float32 on a CPU."""
    tensors = load_tensors(model_dir)
    take = lambda name: load_tensor(tensors, name, dtype)
    embed_tokens = take("model.embed_tokens.weight")  # (151936, 1024)
    # Each layer's tensors by short name: "q_proj" for model.layers.{i}.self_attn.q_proj.weight.
    layers = [{name.split(".")[-2]: take(f"model.layers.{i}.{name}")
               for name in layer_shapes(config)} for i in range(config.num_hidden_layers)]
    # Qwen3-0.6B to 4B reuse the embedding table as the LM head. 8B and up store their own.
    lm_head = embed_tokens if config.tie_word_embeddings else take("lm_head.weight")
    return {"embed_tokens": embed_tokens, "layers": layers, "norm": take("model.norm.weight"),
            "lm_head": lm_head}


def load_tokenizer(model_dir):
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


# --- 2. Tokenize: text -> integer ids (byte-level BPE, in tokenizer.json) -------------------------

def tokenize(tokenizer, text):
    """Text -> ids of vocabulary pieces: "The capital of France is" -> [785, 6722, 315, 9625, 374].
    Byte-level BPE cuts the text into word-like chunks, then merges each chunk's UTF-8 bytes pair by
    pair, as the merge list learned in training says. Any string has an encoding, emoji included."""
    return tokenizer.encode(text).ids


def detokenize(tokenizer, token_ids):
    """Ids -> text, special tokens included: the pieces' bytes, joined; [12095] -> " Paris"."""
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def text_stream(tokenizer):
    """A function that takes a reply's ids one at a time and returns the text each one completes.
    A piece is bytes, so two tokens can split a character: 🦜 is [123918, 250], each alone "�".
    DecodeStream keeps such bytes (returning None: "" here) until the token that completes them.
    Special tokens, such as the <|im_end|> that ends a reply, print nothing (<think> is not one)."""
    stream = DecodeStream(skip_special_tokens=True)
    return lambda token_id: stream.step(tokenizer, token_id) or ""


# --- 3. Embed: each id picks one row of the embedding table ---------------------------------------

def embed(token_ids, embed_tokens):
    """(seq,) ids -> (seq, 1024): row i of the table, learned in training, stands for token i."""
    return embed_tokens[token_ids]


# --- 4. RMSNorm: rescale each vector to unit root-mean-square, then by a learned per-channel gain -

def rms_norm(x, weight, eps):
    """x / sqrt(mean(x²) + eps) * weight, over the last axis, so layers read inputs of one scale."""
    x32 = x.astype(mx.float32)  # square and average in float32 (bfloat16 has 8 significant bits)
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


# --- 5. RoPE: encode a token's position by rotating pairs of its query/key channels ---------------

def apply_rope(x, offset, theta):
    """Rotate x (..., seq, head_dim), whose first position is `offset`: a number, or one per row of
    a batch x (B, heads, seq, head_dim). Channel i is paired with channel i + head_dim/2 (Hugging
    Face's "rotate_half" layout), and pair i turns by the angle position * theta^(-2i/head_dim).
    Fast-turning pairs tell nearby tokens apart, slow ones distant tokens. Rotations compose, so the
    dot product of a rotated query and key depends on their positions only through their gap."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (64,)
    positions = (mx.array(offset)[..., None, None] + mx.arange(x.shape[-2])).astype(mx.float32)
    angles = positions[..., None] * inv_freq  # (1, seq, 64), or (B, 1, seq, 64): one per row
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# --- 6. Attention: each position gathers information from itself and the positions before it ------
#
# Each position emits, per head, a query ("what am I looking for?"), a key ("what do I hold?") and a
# value ("what do I pass on?"). Its output is an average of the values, weighted by how well its
# query matches each key: softmax(Q Kᵀ / √128) · V, where √128 keeps the scores' variance near 1.
# RoPE (section 5) puts the positions into queries and keys. A causal mask keeps each position
# from seeing the ones after it, since the model learns to predict them.
#
# Heads look for different things in parallel. In multi-head attention, each query head has a
# key/value (K/V) head of its own. In grouped-query attention, a group of query heads shares one.
# Say 4 query heads share 2 K/V heads. Then query heads 0 and 1 read K/V head 0, and query heads
# 2 and 3 read K/V head 1. That halves the keys and values to compute and to cache, at little cost
# in quality. Qwen3-0.6B's 16 query heads share 8 K/V heads in the same way, 2 to a K/V head.

def linear(x, weight):
    """x @ weight.T, every product with a weight matrix: x (seq, in) -> (seq, out). The checkpoint
    stores each matrix as (out, in), the layout of PyTorch's nn.Linear."""
    return x @ weight.T


def queries_keys_values(x, layer, config, offset):
    """The first half of attention: x (seq, 1024) at positions offset, offset+1, ... -> q, k, v."""
    c, seq = config, x.shape[-2]
    # Project each position to queries, keys and values, and split them into heads of 128.
    q = linear(x, layer["q_proj"]).reshape(-1, seq, c.num_attention_heads, c.head_dim)
    k = linear(x, layer["k_proj"]).reshape(-1, seq, c.num_key_value_heads, c.head_dim)
    v = linear(x, layer["v_proj"]).reshape(-1, seq, c.num_key_value_heads, c.head_dim)
    # QK-norm RMS-normalises each head's 128 query and key channels, which could otherwise grow in
    # training until the softmax saturates. It is new to Qwen in Qwen3 (Qwen2 added biases to q, k
    # and v instead), after ViT-22B, OLMo 2 and Gemma 3. Here each head's channels lie side by side
    # in memory, so a fused RMSNorm (section 12) reads them without a copy.
    q = rms_norm(q, layer["q_norm"], c.rms_norm_eps)
    k = rms_norm(k, layer["k_norm"], c.rms_norm_eps)
    # Heads first, for attention's (batch, heads, seq, head_dim), batch 1 here (reshape's -1). Then
    # rotate, as Qwen3 was trained: RoPE mixes channels i and i + 64, which have gains of their own.
    q = apply_rope(q.swapaxes(1, 2), offset, c.rope_theta)
    k = apply_rope(k.swapaxes(1, 2), offset, c.rope_theta)
    v = v.swapaxes(1, 2)
    return q, k, v  # (1, 16, seq, 128), (1, 8, seq, 128), (1, 8, seq, 128)


class KVCache:
    """One layer's keys and values for every position so far, so a new token computes only its own
    instead of running all the earlier ones through every layer again. Qwen3-0.6B in bfloat16
    caches 28 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 112 KiB per token."""

    GROWTH = 256  # positions added at a time: one copy per 256 tokens, not one per token

    def __init__(self):
        self.keys = self.values = None  # (1, 8, capacity, 128), preallocated, written in place
        self.offset = 0  # positions filled (MLX being lazy, written when next computed)

    def update_and_fetch(self, k, v):
        """Store k, v (1, 8, seq, 128) at positions offset, offset+1, ... Return all so far."""
        end = self.offset + k.shape[-2]
        capacity = 0 if self.keys is None else self.keys.shape[-2]
        if end > capacity:  # full: add room for a whole number of GROWTH positions
            n_added = math.ceil((end - capacity) / self.GROWTH) * self.GROWTH
            added = (*k.shape[:-2], n_added, k.shape[-1])  # the new positions' shape
            if self.keys is None:  # two arrays, not one shared, as the writes below are in place
                self.keys, self.values = mx.zeros(added, k.dtype), mx.zeros(added, v.dtype)
            else:
                self.keys = mx.concatenate([self.keys, mx.zeros(added, k.dtype)], axis=-2)
                self.values = mx.concatenate([self.values, mx.zeros(added, v.dtype)], axis=-2)
        self.keys[..., self.offset : end, :] = k
        self.values[..., self.offset : end, :] = v
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]  # (1, 8, total, 128)


def make_cache(config):
    return [KVCache() for _ in range(config.num_hidden_layers)]


def attend(q, k, v):
    """softmax(q kᵀ / √d) v for q (1, 16, seq, 128), k and v (1, 8, total, 128) -> like q.
    The queries are the last `seq` of the `total` positions. Each sees the keys up to its own."""
    _, n_heads, seq, head_dim = q.shape
    _, n_kv_heads, total, _ = k.shape
    scale = 1 / math.sqrt(head_dim)
    # Grouped-query attention by broadcasting. q, viewed as (8 groups, 2 heads, ...), meets k and v
    # viewed as (8, 1, ...). So query head h uses key/value head h // 2 (heads 0 and 1 share K/V
    # head 0), and no repeated copy of the keys and values is built.
    q = q.reshape(n_kv_heads, n_heads // n_kv_heads, seq, head_dim)  # (8, 2, seq, 128)
    k, v = k.reshape(n_kv_heads, 1, total, head_dim), v.reshape(n_kv_heads, 1, total, head_dim)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (8, 2, seq, total); scaling q: fewer numbers
    # Causal mask: query i sits at position total-seq+i and sees keys 0 ... total-seq+i.
    allowed = mx.arange(total)[None, :] <= (total - seq + mx.arange(seq))[:, None]
    scores = mx.where(allowed, scores, -mx.inf)  # (seq, total) mask, broadcast
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)  # exp, sum in float32
    return (probs @ v).reshape(1, n_heads, seq, head_dim)


def attention(x, layer, config, cache):
    """x (seq, 1024), already normalised -> (seq, 1024), what each position gathers from others."""
    q, k, v = queries_keys_values(x, layer, config, cache.offset)
    k, v = cache.update_and_fetch(k, v)  # (1, 8, total, 128): the earlier positions' and these
    heads = attend(q, k, v)  # (1, 16, seq, 128)
    # Concatenate the heads into one vector per position. The output projection mixes them.
    heads = heads.swapaxes(1, 2).reshape(x.shape[0], -1)  # (seq, 16 x 128 = 2048)
    return linear(heads, layer["o_proj"])  # (seq, 1024)


# --- 7. SwiGLU feed-forward: a gated two-layer MLP applied to each position on its own ------------

def silu_gate(gate, up):
    """silu(gate) * up, element by element. silu(g) = g * σ(g) is a smooth ReLU. It scales `up`,
    a second projection of the same input: a learned gate, not a 0-1 switch."""
    return gate * mx.sigmoid(gate) * up


def swiglu(x, layer):
    """(seq, 1024) -> (seq, 3072) -> (seq, 1024), each position on its own. It holds about 60% of a
    block's weights, and is thought to hold much of what the model knows. The 3x wider middle
    leaves room for many features."""
    gate = linear(x, layer["gate_proj"])  # (seq, 3072)
    up = linear(x, layer["up_proj"])  # (seq, 3072)
    return linear(silu_gate(gate, up), layer["down_proj"])  # (seq, 1024)


# --- 8. Transformer block: attention, then feed-forward, each added back to the residual stream ---

def transformer_block(x, layer, config, cache):
    """x (seq, 1024) -> (seq, 1024). Pre-norm: each sub-layer reads a normalised copy of the
    residual stream x and *adds* its result to x. x itself is never normalised, so information
    (and, in training, gradient) flows straight from the embedding to the last layer."""
    eps = config.rms_norm_eps
    h = x + attention(rms_norm(x, layer["input_layernorm"], eps), layer, config, cache)
    return h + swiglu(rms_norm(h, layer["post_attention_layernorm"], eps), layer)


# --- 9. Forward: embed -> 28 blocks -> final norm -> LM head --------------------------------------

def forward(token_ids, weights, config, cache, last_only=True):
    """Logits for token_ids (seq,), which continue the sequence in `cache` (a KVCache per layer):
    (vocab,) scores for the next token, or every position's (seq, vocab) if not last_only."""
    x = embed(token_ids, weights["embed_tokens"])  # (seq, 1024)
    for layer, layer_cache in zip(weights["layers"], cache):
        x = transformer_block(x, layer, config, layer_cache)
    if last_only:  # generating needs the next token only (training and the tests use every one)
        x = x[-1:]  # (1, 1024)
    x = rms_norm(x, weights["norm"], config.rms_norm_eps)
    logits = linear(x, weights["lm_head"])  # (1 or seq, vocab): a score (logit) per token
    return logits.squeeze(0) if last_only else logits


# --- 10. Sample: pick the next token from the logits ----------------------------------------------

class Sampling(NamedTuple):
    """Greedy by default. cli.py fills in what no flag sets. --temperature alone also brings
    generation_config.json's top-k and top-p: 20 and 0.95 for Qwen3 (without the file, 50 and
    1.0, transformers' defaults). A thinking chat takes all three from it: temperature 0.6, top-k
    20, top-p 0.95. cli.py also draws a random seed, unless given one."""
    temperature: float = 0.0  # 0 = greedy: always the most likely token
    top_k: int = 0  # keep the k most likely tokens (0 = all) ...
    top_p: float = 1.0  # ... then the fewest whose probabilities add up to >= top_p (nucleus)
    seed: int = 0  # the random stream, so that a run can be repeated


def filter_logits(logits, sampling):
    """Divide by the temperature. Then set to -inf every token that top-k or top-p rules out, in
    the order Hugging Face transformers applies them."""
    # float32: bfloat16 keeps 8 significant bits, too few for top-p's running sum of probabilities.
    logits = logits.astype(mx.float32) / sampling.temperature  # < 1 sharpens, > 1 flattens
    top_k, top_p, candidates = sampling.top_k, sampling.top_p, None  # None: every token
    if 0 < top_k < len(logits):
        candidates = mx.argpartition(-logits, top_k - 1)[:top_k]  # the k largest, unsorted
        # Everything below the k-th largest logit goes. Ties with it stay, as in transformers.
        logits = mx.where(logits >= logits[candidates].min(), logits, -mx.inf)
    if top_p < 1:
        # Walk down from the likeliest token. A token stays if those before it add up to less than
        # top_p, so the one that crosses the threshold stays. Only the top-k candidates are sorted.
        order = (mx.argsort(-logits) if candidates is None  # token ids, likeliest first
                 else candidates[mx.argsort(-logits[candidates])])
        ranked = logits[order]  # their logits
        probs = mx.exp(ranked - mx.logsumexp(logits))  # softmax of what top-k left
        kept = mx.cumsum(probs) - probs < top_p  # the mass before each token
        kept[0] = True  # the likeliest stays, as in transformers (top_p = 0: it and its ties)
        bar = mx.where(kept, ranked, mx.inf).min()  # the least likely token that stays
        logits = mx.where(logits >= bar, logits, -mx.inf)  # (tokens tied with it stay too)
    return logits


def sample(logits, sampling, key):
    """Greedy (argmax) at temperature 0. Otherwise a draw from the softmax of filter_logits()."""
    if sampling.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, sampling), key=key)  # renormalises


# --- 11. Generate: prefill the prompt once, then decode one token at a time -----------------------
#
# From text to text, with Part 1 alone:
#     ids, eos_ids = tokenize(tokenizer, prompt), load_eos_ids(model_dir, tokenizer)
#     text = text_stream(tokenizer)
#     for token_id, _ in generate(ids, weights, config, 99, eos_ids=eos_ids):
#         print(text(token_id), end="", flush=True)

def load_eos_ids(model_dir, tokenizer):
    """The ids that end a reply: generation_config.json's, and <|im_end|> (151645), which closes a
    chat turn, and <|endoftext|> (151643), which ends a document, if the tokenizer has them."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    listed = config.get("eos_token_id")  # one id, a list of them, or null
    ids = set(mx.array(listed).reshape(-1).tolist()) if listed is not None else set()  # flat
    return (ids | {tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}) - {None}


# Written plainly, the decode loop would be:
#     for _ in range(max_tokens):
#         yield token.item()                 # wait for the GPU to compute the token
#         token, logits = step(token[None])  # the GPU idles while Python records the next step
# For a small model on a fast GPU, recording a step takes a good part of the time that running it
# takes (docs/performance.md). MLX being lazy, generate() records step n+1 on token n before token
# n is computed, queues it (mx.async_eval), and only then waits for token n.

def generate(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(), cache=None):
    """Yield (token id, the logits it was picked from) until an id in eos_ids (yielded too), or
    max_tokens of them. `cache` may already hold earlier tokens, which prompt_ids continue. A token
    enters the cache in the step after it, so the last one yielded may be missing from it."""
    cache = make_cache(config) if cache is None else cache
    key = mx.random.key(sampling.seed)

    def step(token_ids):  # one forward pass over token_ids (seq,) and the token picked after it
        nonlocal key
        logits = forward(token_ids, weights, config, cache)
        # Fresh randomness for each step, repeatable from the seed: split one key into two, one
        # kept for later steps and one for this pick. Greedy picking needs none.
        key, pick_key = mx.random.split(key) if sampling.temperature else (key, key)
        return sample(logits, sampling, pick_key), logits

    # Prefill: the prompt's tokens are all known, so they go through each layer together, in large
    # and efficient matrix products. That fills the cache and gives the first new token.
    token, logits = step(mx.array(prompt_ids))
    mx.async_eval(token)
    for n in range(max_tokens):  # decode: feed each new token back in, as a one-token sequence
        if n + 1 < max_tokens:
            following = step(token[None])  # built on the token not yet computed
            mx.async_eval(following[0])
        token_id = token.item()  # waits for token n only
        yield token_id, logits
        if token_id in eos_ids or n + 1 == max_tokens:  # then `following` is not needed
            return
        token, logits = following


# ================================================================================================
# PART 2: GOING FURTHER (optional sections that build on Part 1)
# ================================================================================================
#
# Some sections change how Part 1 runs, with replace(). replace(rms_norm=fused_rms_norm) makes
# this module's global name rms_norm stand for fused_rms_norm. Python looks a global name up each
# time a line that uses it runs. So from then on, every call of rms_norm() in Part 1, such as
# transformer_block()'s, runs fused_rms_norm, and Part 1 still reads as you read it. A replacement
# may keep the function it replaces and call it, as section 20's loader calls section 16's. So
# main() makes them in a set order, all in one block. Names marked (14) are section 14's:
#   12. fused kernels     rms_norm, apply_rope, attend    unless --reference-ops
#   13. compilation       silu_gate, filter_logits        unless --reference-ops or --no-compile
#   16. quantization      load_tensor, linear, embed      --quantize, or a folder stored quantized
#   17. sampling          sample                          --min-p or --presence-penalty
#   20. several machines  load_tensor, attention, swiglu, tokens_per_layer (14)   under mlx.launch
#   21. experts           layer_shapes, load_tensor, swiglu   a qwen3_moe model
#   22. speculative       make_cache, generate_long (14)  --draft-model

def replace(**functions):
    """Rebind these names (see above). A misspelt one would replace nothing, so it is refused."""
    unknown = set(functions) - set(globals())
    if unknown:
        raise NameError(f"no function {', '.join(sorted(unknown))} to replace")
    globals().update(functions)


# --- 12. Fused kernels: RMSNorm, RoPE and attention in one kernel each ----------------------------
#
# On a GPU, each MLX operation runs as a kernel: a small program that reads its inputs from memory
# and writes its output back. For a small model on a fast GPU, this cost per kernel, not reading
# the weights, sets the pace of decoding (docs/performance.md#what-limits-decoding).
# In bfloat16, rms_norm() is 9 operations: a cast to float32, x², a sum, its division by 1024,
# + eps, rsqrt, a product, a cast back and the gain. For one token, each of the 9 kernels reads
# and writes about 1024 numbers. A fused kernel does the 9 steps in one: it reads x and the gain
# once and writes the result once. A decode step of Qwen3-0.6B normalises 113 times (4 times a
# block, then the final norm): 113 kernels, not 1,017.
# mx.fast's fused kernels for RMSNorm, RoPE and attention do Part 1's math, to rounding, as
# tests/test_ops.py checks both ways against MLX's own layers. On a CPU, mx.fast runs the same
# separate operations: docs/performance.md#fused-kernels---reference-ops measures no gain.
# Try it: on a Mac, compare the decode rate of `python llm_inference.py` and of its --reference-ops.

def fused_rms_norm(x, weight, eps):
    """mx.fast.rms_norm: rms_norm()'s x / sqrt(mean(x²) + eps) * weight, over the last axis."""
    return mx.fast.rms_norm(x, weight, eps)


def fused_rope(x, offset, theta):
    """mx.fast.rope rotates the first `dims` channels of x (..., seq, head_dim), here all, as
    apply_rope() does. traditional=False pairs channel i with i + dims/2 (Hugging Face's layout;
    True: 2i with 2i + 1). base is theta. scale multiplies positions. offset is the first one."""
    return mx.fast.rope(x, x.shape[-1], traditional=False, base=theta, scale=1.0, offset=offset)


def fused_attend(q, k, v):
    """attend() in one kernel: mx.fast.scaled_dot_product_attention, softmax(q kᵀ * scale) v, with
    attend()'s shapes and grouped heads. mask="causal" lets query i see keys up to total - seq + i,
    as attend() does. mask=None lets each query see every key: the same for one new token."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]),
                                                mask="causal" if q.shape[2] > 1 else None)


def use_fused_kernels():
    replace(rms_norm=fused_rms_norm, apply_rope=fused_rope, attend=fused_attend)


# --- 13. Compilation: fusing element-wise operations into one kernel ------------------------------
#
# Other steps are several kernels too, at section 12's cost. silu_gate(g, u) = g σ(g) u is three (σ
# and two products), 28 times a step. filter_logits is many small ones. mx.compile(f) returns a
# function that, at its first call, traces f: it runs f's Python once on stand-in arrays with no
# values yet (print() of one fails: hence --no-compile), recording the operations as a graph. Later
# calls replay the graph without f's Python, with chains of element-wise steps fused into one
# kernel. For one token, silu_gate's 3 kernels read 5 arrays of 3072 numbers and write 3. Fused, one
# kernel reads g and u and writes the result.
# A trace serves one input shape, unless shapeless=True. Then it serves every sequence length,
# which silu_gate's steps do not depend on. An argument that is not an array, such as a Sampling,
# is a constant of the trace. Its values steer f's Python (filter_logits' `if top_p < 1`), so the
# graph holds only the steps they chose, and MLX keeps a trace per value. A Sampling also holds
# the seed, which filter_logits never reads. Left in, each new seed would trace again (a chat
# draws one per reply), and a seed from 2**63 on fails, as MLX keys traces on signed 64-bit
# integers. So the seed is set to 0 first: a trace per Sampling, not per seed.
# The same operations, to rounding, as tests/test_model.py and tests/test_cli.py check.
# Try it: `python bench.py --primitives` counts a Compiled... kind per block, not silu_gate's parts.

compiled_silu_gate = mx.compile(silu_gate, shapeless=True)
traced = mx.compile(filter_logits)  # its Sampling's seed is always 0 (above)
compiled_filter_logits = lambda logits, sampling: traced(logits, sampling._replace(seed=0))


def compile_model():
    """Replaces silu_gate (section 7) and filter_logits (section 10) with compiled copies."""
    replace(silu_gate=compiled_silu_gate, filter_logits=compiled_filter_logits)


# --- 14. Long prompts: prefill in pieces ----------------------------------------------------------
#
# The problem: Python acts on Ctrl-C only between mx.eval() calls, so one pass over a long prompt
# can't be stopped, and shows no progress. On this project's CPU, 1,024 tokens of Qwen3-0.6B took
# 35.6 s (docs/performance.md#prefill-ctrl-c-and-progress).
#
# The idea: with the cache (section 6), a prompt can go through in pieces, each continuing the one
# before. Its pace, how many tokens one layer runs in LAYER_SECONDS, is measured on each piece and
# sets the next: a piece has at most pace tokens (and PREFILL_CHUNK), rounded down to a power of
# two, and runs pace // size layers per mx.eval(). It leaves at least one token for generate(),
# whose logits give the first new token. generate() runs all layers in one mx.eval(), so it may
# take at most pace // n_layers tokens (at least one). A worked example: 28 layers, on a CPU where
# a layer runs 600 tokens in 0.2 s, and a 100-token prompt.
#   1. Not yet timed: a first piece of FIRST_GUESS = 8 tokens, a layer per mx.eval(). It takes
#      2.67 ms a layer, so the pace is 600, and generate() may take 600 // 28 = 21 tokens.
#   2. 92 tokens are left, more than 21: a piece of 64 (the power of two below 91), 600 // 64 =
#      9 layers per mx.eval().
#   3. 28 left: a piece of 16, all 28 layers in one mx.eval(). The last 12 go through generate().
# A prompt of at most SHORT_PROMPT tokens always goes through generate() in one pass: on a CPU,
# each piece would read all the weights again. A GPU, not yet timed, is guessed to run a whole
# piece through all its layers in 0.2 s (a pace of PREFILL_CHUNK x n_layers). So a prompt of up to
# PREFILL_CHUNK tokens goes in one pass, first as later, while the GPU keeps that pace (the page
# above). A GPU pays for each new shape the first time: MLX compiles kernels for it. Sizes that
# recur (a whole prompt, powers of two) keep that to a few.
#
# Pieces also bound memory. attend() builds a piece's scores at once, as MLX's fused attention
# (section 12) does on a CPU: (heads, piece, total) numbers, not (heads, total, total). On a Mac's
# GPU, for heads of 128 channels, that kernel reads the keys in tiles and never builds them.
#
# Try it: `python llm_inference.py --prompt - < README.md` shows a prefill's progress on stderr
# within seconds on a CPU, and Ctrl-C stops it. Nothing is replaced: main() calls generate_long().

PREFILL_CHUNK = 2048  # tokens in a piece, at most (as mlx-lm's prefill_step_size)
SHORT_PROMPT = 32  # a prompt this short goes through generate() in one pass
LAYER_SECONDS = 0.2  # how long one mx.eval() of a piece should take: what Ctrl-C may wait
FIRST_GUESS = 8  # tokens a layer runs in LAYER_SECONDS on a CPU, before the model is timed
layer_tokens = {}  # the same, last measured, per model (by id() of its weights): a draft is faster


def generate_long(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(),
                  cache=None, progress=None):
    """generate() for a prompt of any length: all but its last piece first fill the cache, piece
    by piece. progress(done, total), if given, runs after each mx.eval()."""
    cache = make_cache(config) if cache is None else cache
    done, total, n_layers = 0, len(prompt_ids), len(cache)
    guess = PREFILL_CHUNK * n_layers if mx.default_device() == mx.gpu else FIRST_GUESS
    pace = layer_tokens.get(id(weights), guess)
    while total > SHORT_PROMPT and total - done > min(max(pace // n_layers, 1), PREFILL_CHUNK):
        size = min(pace, PREFILL_CHUNK, total - done - 1)
        size = 2 ** int(math.log2(size))  # a power of two: at most halving it
        start = time.perf_counter()
        forward(mx.array(prompt_ids[done : done + size]), weights, config, cache)  # recorded only
        # mx.eval() of some layers' keys and values runs those layers, never the logits.
        at_once = max(1, min(pace // size, n_layers))  # layers per mx.eval()
        for first in range(0, n_layers, at_once):
            mx.eval([(c.keys, c.values) for c in cache[first : first + at_once]])
            if progress:
                progress(done + size * min(first + at_once, n_layers) // n_layers, total)
        done += size
        pace = tokens_per_layer(size, (time.perf_counter() - start) / n_layers)
        layer_tokens[id(weights)] = pace
    yield from generate(prompt_ids[done:], weights, config, max_tokens, sampling, eos_ids, cache)


def tokens_per_layer(size, seconds):
    """The tokens a layer runs in LAYER_SECONDS, where `size` tokens took `seconds` a layer."""
    return max(1, round(size * LAYER_SECONDS / seconds))


# --- 15. Without a KV cache: what the cache saves (--no-cache) ------------------------------------
#
# Without section 6's KVCache, each new token runs the whole sequence so far through every layer
# again. For a prompt of 5 tokens and 3 new ones, generate() runs 5 + 1 + 1 = 7 positions through
# the model. This function runs 5 + 6 + 7 = 18, and the gap grows with each token. At 512 tokens
# of context, a CPU decoded 9.2x slower (docs/performance.md#the-kv-cache---no-cache).
# Try it: python bench.py --tiny --device cpu --cache-lengths 12 128 512
# main() calls it instead of generate_long() (section 14). It is safe: the tokens are the same,
# and the logits to rounding (on a Linux CPU, bit for bit: the same page), as tests/test_model.py
# checks. A row of a (seq, in) product may be summed in another order than a (1, in) product.

def generate_without_cache(prompt_ids, weights, config, max_tokens, sampling=Sampling(),
                           eos_ids=()):
    """generate() without a KV cache: each step runs the whole sequence so far, in a fresh cache."""
    token_ids, key = list(prompt_ids), mx.random.key(sampling.seed)
    for _ in range(max_tokens):
        logits = forward(mx.array(token_ids), weights, config, make_cache(config))
        key, pick_key = mx.random.split(key)  # as in generate()
        token_id = sample(logits, sampling, pick_key).item()
        yield token_id, logits
        if token_id in eos_ids:
            return
        token_ids.append(token_id)


# --- 16. Quantization (--quantize 4 or 8): fewer bits per weight ----------------------------------
#
# Decoding a token reads every weight matrix once. Fewer bits per weight always save memory. They
# save time only where reading the weights limits decoding, as expected for large models on a Mac.
# Qwen3-8B reads 15.1 GB of matrices per token in bfloat16 (of the embedding table, one row). At
# 100 GB/s that takes 151 ms per token, and its 4.3 GB at 4 bits 43 ms. For a small model on a big
# GPU, each operation's fixed cost sets the pace instead. On a CPU, MLX's quantized product is
# barely faster than its float32 one (docs/performance.md#quantized-weights).
#
# Group-wise affine quantization, as in mlx-lm, cuts each row into groups of 64 weights. A group
# keeps an integer q from 0 to 2^bits - 1 per weight, and one scale and one bias, so that
# w ≈ scale * q + bias. With 16-bit scales and biases, a weight costs 4 + 2 x 16 / 64 = 4.5 bits
# at 4 bits, instead of 16 (8.5 at 8 bits). The price is rounding.
# An example at 2 bits (levels q = 0 to 3), for a group of 4 (MLX's groups hold 32, 64 or 128):
# w = [-0.4, 0.1, 0.5, 0.2]. Its range, 0.9, would give 3 steps of 0.3. But MLX keeps the end of
# larger size, 0.5, exact, and it puts a level at exactly 0, so zeros stay zeros. 0.5 is 1.67
# steps of 0.3, rounded to 2, so a step becomes 0.5 / 2 = 0.25. q counts down from 0.5. So
# bias = 0.5 and scale = -0.25, and the levels are 0.5, 0.25, 0 and -0.25.
# q = round((w - bias) / scale), kept within 0 to 3, is [3, 2, 0, 1]. Back come
# [-0.25, 0, 0.5, 0.25]. 0.1 moves by 0.1, less than half a level, as any weight between two
# levels does. But -0.4 lies beyond the last level, and moves by 0.15: 0.6 of a level. Such an end
# can move by up to a whole level. In random bfloat16 weights (normal, std 0.02) of Qwen3-0.6B's
# shapes, 39% of the 4-bit groups have a weight that moves by over half a level (in float32, before
# any rounding of the result). The mean move is a quarter of a level. At 8 bits, the scale's
# rounding to bfloat16 adds to that, as q reaches 255 (docs/performance.md#quantized-weights, with
# the effect on one layer's products).
# Try it: python llm_inference.py --quantize 4
# use_quantization() replaces load_tensor, linear and embed. Other weights take Part 1's math.
# tests/test_quantize.py finds it is mlx-lm's: the weights mlx_lm.convert writes, and the logits.

GROUP_SIZE = 64  # weights sharing one scale and bias (mlx-lm's default)


class Quantized(NamedTuple):
    """A matrix (out, in), quantized in groups along each of its rows: w ≈ scale * q + bias."""
    packed: mx.array  # (out, in * bits / 32) uint32: 32 / bits integers q each, the first lowest
    scales: mx.array  # (out, in / group_size): one per group, in --dtype
    biases: mx.array  # (out, in / group_size): each group's offset (not a layer's bias term)
    group_size: int
    bits: int  # 4 or 8 with --quantize; stored, 2 to 6 or 8


def quantizable(shape, group_size=GROUP_SIZE):
    """Matrices, or stacks of them, whose rows split into whole groups; mlx-lm leaves others."""
    return len(shape) >= 2 and shape[-1] % group_size == 0


def quantize(weight, bits, dtype):
    """A checkpoint matrix -> Quantized, as mlx_lm.convert makes it: from the stored bfloat16
    values, so the scales and biases are bfloat16 numbers, held as `dtype`. mx.quantize returns
    the packed q, the scales and the biases, with Quantized's shapes, chosen as in the example."""
    q, scales, biases = mx.quantize(weight, group_size=GROUP_SIZE, bits=bits)  # affine mode
    return Quantized(q, scales.astype(dtype), biases.astype(dtype), GROUP_SIZE, bits)


def quantized_linear(x, weight):
    """linear() for Quantized weights too. mx.quantized_matmul(x (seq, in), packed, scales,
    biases, transpose=True) computes x @ (scale * q + bias).T -> (seq, out). It unpacks each group
    inside the product, so the full matrix never exists. (Calling linear() here would recurse.)"""
    if not isinstance(weight, Quantized):
        return x @ weight.T
    return mx.quantized_matmul(x, weight.packed, weight.scales, weight.biases, transpose=True,
                               group_size=weight.group_size, bits=weight.bits)


def quantized_embed(token_ids, table):
    """embed() for a Quantized table too: unpack the rows picked, not the 151936-row table.
    mx.dequantize(packed, scales, biases) gives scale * q + bias: here (seq, 1024)."""
    if not isinstance(table, Quantized):
        return table[token_ids]
    return mx.dequantize(table.packed[token_ids], table.scales[token_ids],
                         table.biases[token_ids], group_size=table.group_size, bits=table.bits)


def use_quantization(bits=None, stored=None):
    """stored: config.json's "quantization" in a folder that mlx_lm.convert wrote:
    {"group_size": 64, "bits": 4, ...}, and entries for some layers."""
    stored = stored or {}

    def load_quantized(tensors, name, dtype):
        weight = tensors.pop(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in tensors:  # stored quantized: used as it is
            how = stored.get(stem)  # a layer's own settings (a dict), if any
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
# Two failings of sampling from a small model, each with a control (both off by default).
# A long tail. At a temperature, any of thousands of unlikely tokens may be drawn, and top-p keeps
# a fixed share of the probability, whatever its shape. Min-p keeps the tokens at least min_p
# times as likely as the likeliest, after top-k and top-p (transformers' order). With min_p 0.2,
# probabilities [0.6, 0.3, 0.1] have the bar 0.2 x 0.6 = 0.12. So 0.1 goes, and the draw is from
# [0.67, 0.33, 0]. [0.9, 0.06, 0.04] have the bar 0.18: min-p cuts more when one token dominates.
# Loops. The presence penalty lowers the logit of each token already in the reply by the same
# amount, however often it came (OpenAI's meaning). With a penalty of 1.5, a logit of 2.0 becomes
# 0.5. The prompt's tokens are spared.
# Try it: python llm_inference.py --min-p 0.05 --temperature 0.7 --top-probs 5
# use_extra_sampling() replaces sample() (section 10). With min_p 0 and no penalty, it draws as
# sample() does. tests/test_chat.py checks min-p against transformers', and the penalty.

def filter_min_p(logits, min_p):
    """Min-p, on logits that filter_logits() has divided and filtered: the rest become -inf."""
    probs = mx.softmax(logits)
    return mx.where(probs >= min_p * probs.max(), logits, -mx.inf)


def use_extra_sampling(min_p, presence_penalty, vocab_size):
    """Call the new_reply() it returns before each reply."""
    # 1 for each token of the reply so far. An MLX array, as generate() records step n + 1 on token
    # n before token n is computed (section 11). A Python set would wait for each (token.item()).
    in_reply = mx.zeros(vocab_size)  # (vocab,)

    def sample_more(logits, sampling, key):
        nonlocal in_reply
        logits = logits - presence_penalty * in_reply
        if sampling.temperature == 0:
            token = mx.argmax(logits, axis=-1)
        else:  # with min-p 0, this is sample()'s draw
            logits = filter_min_p(filter_logits(logits, sampling), min_p)
            token = mx.random.categorical(logits, key=key)
        # x.at[i].maximum(1.0) records a new array: x, with x[i] = max(x[i], 1.0). i may be a lazy
        # token. The maximum makes a token's 1 stay 1 when it comes again: the penalty is once.
        in_reply = in_reply.at[token].maximum(1.0)
        return token

    def new_reply():
        nonlocal in_reply
        in_reply = mx.zeros(vocab_size)

    replace(sample=sample_more)
    return new_reply


# --- 18. Chat: one KV cache for a whole conversation ----------------------------------------------
#
# Qwen3 was trained on chats in this format, each marker one special id. At every turn, its chat
# template (tokenizer_config.json) renders the whole conversation again:
#
#   <|im_start|>system\n{system}<|im_end|>\n      (if there is one)
#   <|im_start|>user\n{message}<|im_end|>\n
#   <|im_start|>assistant\n{answer}<|im_end|>\n   (an earlier reply, less its thinking)
#   ...
#   <|im_start|>user\n{new message}<|im_end|>\n
#   <|im_start|>assistant\n                       (+ <think>\n\n</think>\n\n for no thinking)
#
# Prefilled whole, turn 3 of a chat (a system prompt, one-line questions, 48-token replies) is 166
# tokens. Keeping the cache, it is 20 (docs/performance.md#chat-turns-what-keeping-the-cache-saves).
# So Chat keeps one cache. Each turn, it reuses the longest prefix that the cached ids share with
# the new rendering. Setting each layer's `offset` back to its end rolls the rest back: attention
# reads only up to `offset`, and the next tokens overwrite what lies after it. Only a prefix can be
# kept, as a token's keys and values depend on its position (RoPE) and on every token before it.
#
# The template rewrites history, and so sets how much is reused. Once a new message follows, a
# reply that wrote </think> is rendered as what follows its last </think>, less leading newlines.
# A reply cut off inside its <think> block stays whole. A reply made without thinking loses the
# empty block that its prompt ended with (4 ids). An example, with Qwen3's tokenizer:
#   turn 1  "Hi" renders as 9 ids, all prefilled. The reply is 9 ids, "<think>\nA greeting.\n
#           </think>\n\nHello!", then <|im_end|>. generate() fed <|im_end|> too, in the step it
#           queued before the id was known (section 11). So the cache holds 9 + 9 + 1 = 19
#           positions, and cached_ids the first 18: the fed <|im_end|> is left out (see reply()).
#   turn 2  "Bye" renders as 23 ids: turn 1's 9, "Hello!" (2 ids), "<|im_end|>\n" (2), and 10 for
#           the new message and "<|im_start|>assistant\n". The first 9 agree with the cached ids,
#           up to <think>. So 9 are reused, the 10 positions after them rolled back, 14 prefilled.
# Replies enter the history as the ids generated. Their text, tokenized again, could split
# otherwise, and then fewer ids would agree.
# Try it: python llm_inference.py --chat
# Chat replaces nothing. It calls generate_long() with a cache that holds a prefix, as generate()
# allows. tests/test_chat.py checks the ids against the template, and reuse against recomputing.

def chat_prompt(user, system=None, think=True):
    """One message in Qwen3's chat format. It ends by opening the assistant's turn, so the
    likeliest continuation is a reply. system="" writes an empty system turn, and None none."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return text if think else text + "<think>\n\n</think>\n\n"


class Chat:
    """A conversation: its turns, and one KV cache for all."""

    def __init__(self, weights, config, tokenizer, system=None, think=True):
        self.weights, self.config, self.tokenizer = weights, config, tokenizer
        self.system, self.think = system, think
        self.turns = []  # (message, reply ids), which cli.py may drop or clear
        self.cache = make_cache(config)
        self.cached_ids = []  # the cached ids, in order
        self.reused = self.prefilled = 0  # the last turn's tokens: cached, computed
        self.replies = 0  # replies so far, across /resets

    def prompt_ids(self, message):
        """The conversation so far and a new message, as the template renders it."""
        tokens = lambda text: tokenize(self.tokenizer, text)
        ids, system = [], self.system  # the system turn opens the first
        for user, reply in self.turns:
            ids += tokens(chat_prompt(user, system)) + self.answer(reply) + tokens("<|im_end|>\n")
            system = None
        return ids + tokens(chat_prompt(message, system, self.think))

    def answer(self, reply):
        """A reply as the template keeps it: after the last </think>, less leading newlines."""
        end_think = self.tokenizer.token_to_id("</think>")
        if end_think not in reply:
            return reply
        answer = reply[len(reply) - reply[::-1].index(end_think):]  # after the last </think>
        while answer and detokenize(self.tokenizer, answer[:1]).strip("\n") == "":
            answer = answer[1:]
        return answer

    def reply(self, message, max_tokens, sampling=Sampling(), eos_ids=(), progress=None):
        """Yield (token id, logits) of the reply (section 14's generate_long). It joins the history
        even if empty or stopped early (then close() this generator)."""
        ids = self.prompt_ids(message)
        # A new draw per reply, the conversation repeatable from the seed.
        sampling = sampling._replace(seed=(sampling.seed + self.replies) % 2**64)
        self.replies += 1
        # Reuse the leading ids that agree with the cached ones, but never the last new id. It is
        # fed again, as its logits give the reply's first token.
        agree = [cached == new for cached, new in zip(self.cached_ids, ids[:-1])]
        self.reused = (agree + [False]).index(False)  # those before the first disagreement
        for layer_cache in self.cache:
            layer_cache.offset = self.reused  # the roll-back
        self.prefilled, reply = len(ids) - self.reused, []
        try:
            for token_id, logits in generate_long(
                    ids[self.reused:], self.weights, self.config, max_tokens, sampling, eos_ids,
                    self.cache, progress):
                if token_id not in eos_ids:  # prompt_ids closes each turn itself
                    reply.append(token_id)
                yield token_id, logits
        finally:  # done, closed by the caller, or Ctrl-C in generate()
            self.turns.append((message, reply))
            # The cache holds the `offset` ids fed, the least over the layers (Ctrl-C may stop a
            # step midway). An end id fed after the reply is not in `reply`, so the slice leaves
            # its position out. A last id that max_tokens kept from being fed is dropped too.
            self.cached_ids = (ids + reply)[:min(c.offset for c in self.cache)]


# --- 19. The logit lens: what the model would say after each block (--trace) ---------------------
#
# forward() shows only its end, the logits after the last block. What each of the 28 blocks does
# stays hidden. Only the final RMSNorm and LM head turn the residual stream into logits, and a block
# only adds to that stream (section 8). So, applied after any block, they show what the model would
# say if it stopped there: the "logit lens". With real weights, see where " Paris" comes first.
#
# trace() computes, and cli.TracePrinter (`show`) prints, one line a call:
#   show.step(name, out, what)  block 0's step `name`, the shape and dtype of each array in `out`
#                               ("(5, 1024) float32"), and `what` it does. It returns `out`.
#   show.block(i, x, ...)       after block i, the stream's shape and RMS (its size), the lens's
#                               likeliest token with its probability, and the rank in the lens of
#                               the final pick (the likeliest token of forward()'s logits)
# show.lens_intro prints a heading, and show.final the 5 likeliest tokens of the final logits.
# With the tests' tiny model of 2 blocks, the final pick ranks 39th in block 0's lens, and 1st at
# 0.846 in block 1's, the final answer.
# Try it: `python llm_inference.py --trace`. It replaces nothing: it calls Part 1's functions.

def logit_lens(x, weights, config):
    """The next-token logits (vocab,) read off the stream x (seq, 1024), as forward() ends."""
    return linear(rms_norm(x[-1:], weights["norm"], config.rms_norm_eps), weights["lm_head"])[0]


def trace(prompt_ids, weights, config, tokenizer, final=None):
    """--trace: one forward pass over prompt_ids, narrated. final: its logits, if known already."""
    c, ids, cache = config, mx.array(prompt_ids), make_cache(config)
    if final is None:
        final = forward(ids, weights, config, make_cache(config))
    cli.check_logits(final)
    pick = mx.argmax(final).item()
    show = cli.TracePrinter(tokenizer, prompt_ids)
    layer, eps = weights["layers"][0], c.rms_norm_eps
    x = show.step("embed", embed(ids, weights["embed_tokens"]), "one table row per token")
    n = show.step("rms_norm", rms_norm(x, layer["input_layernorm"], eps),
                  "vectors to RMS 1, x gains")
    q, k, v = show.step("queries_keys_values", queries_keys_values(n, layer, c, 0),
                        "q, k, v heads; QK-norm and RoPE")
    show.step("attend", attend(q, k, v), "softmax(q kᵀ/√d) v; a K/V head serves a group of q heads")
    h = show.step("x + attention", x + attention(n, layer, c, cache[0]),
                  "the same through the cache; heads joined, projected by o_proj, added")
    n = rms_norm(h, layer["post_attention_layernorm"], eps)
    x = show.step("h + swiglu(rms_norm(h))", h + swiglu(n, layer), "feed-forward, added")
    show.lens_intro(pick, tied=weights["lm_head"] is weights["embed_tokens"])
    for i, (layer, layer_cache) in enumerate(zip(weights["layers"], cache)):
        if i:  # block 0 ran step by step above
            x = transformer_block(x, layer, c, layer_cache)
        probs = mx.softmax(logit_lens(x, weights, c).astype(mx.float32))
        top, rank = mx.argmax(probs).item(), (probs > probs[pick]).sum().item() + 1
        rms = mx.sqrt(mx.mean(x.astype(mx.float32) ** 2)).item()
        show.block(i, x, rms, top, probs[top].item(), pick, rank)
    show.final(final)


# --- 20. Several machines: one model split across processes (tensor parallelism) ------------------
#
# Qwen3-32B takes 65.5 GB in bfloat16, more than most Macs have. Split over 2 processes, each holds
# 34.3 GB, and over 4, 18.7 GB. The price is two exchanges over the link per block, for each token.
# Over TCP, a split model decoded many times slower (docs/performance.md#several-processes).
#
# The idea, for one product y = x Wᵀ (section 6's linear(), W stored (out, in)) and 2 processes:
#   x = [1, 2, 3, 4]    W = [[1, 0, 0, 1],    y = [1+4, 2+3, 1+2, 3+4] = [5, 5, 3, 7]
#                            [0, 1, 1, 0],
#                            [1, 1, 0, 0],
#                            [0, 0, 1, 1]]
# Split by rows (outputs). Process 0 holds rows 0-1 and the whole x, and computes y0, y1 = [5, 5].
# Process 1 holds rows 2-3 and computes y2, y3 = [3, 7]. Neither needs the other's numbers.
# Split by columns (inputs). Process 0 holds columns 0-1 and x0, x1 = [1, 2], and computes
# 1·[1, 0, 1, 0] + 2·[0, 1, 1, 0] = [1, 2, 3, 0]. Process 1 holds columns 2-3 and x2, x3 = [3, 4],
# and computes 3·[0, 1, 0, 1] + 4·[1, 0, 0, 1] = [4, 3, 0, 7]. Each holds a part of every output.
# One exchange adds the parts up, and both get [5, 5, 3, 7].
# Megatron-LM, which writes y = x A with A = Wᵀ, calls these two splits column- and row-parallel.
#
# A block pairs the two splits. A first product split by rows leaves each process a slice of its
# outputs. That slice is just the input that the process's columns of a second product need. So a
# pair costs one exchange, after the second product, and a block is two pairs:
#
#   x -> rms_norm -> q, k, v (its heads) -> attend -> o_proj (its columns) -> all_sum -> + x = h
#   h -> rms_norm -> gate, up (its units) -> silu_gate -> down_proj (its columns) -> all_sum -> + h
#
# A head attends on its own, so each process computes and caches only its heads' keys and values.
# silu_gate works unit by unit, so the feed-forward units split too. Process 0 of 2 holds:
#   q_proj (1024, 1024)         rows 0-1023 of (2048, 1024): query heads 0-7 of 16
#   k_proj, v_proj (512, 1024)  rows 0-511 of (1024, 1024): key/value heads 0-3 of 8
#   o_proj (1024, 1024)         columns 0-1023 of (1024, 2048): what heads 0-7 wrote
#   gate_proj, up_proj (1536, 1024), down_proj (1024, 1536): units 0-1535 of 3072
#   whole copies: embed_tokens (151936, 1024), also the LM head, and every norm
# That is 0.75 GB of Qwen3-0.6B in bfloat16, not half of 1.19 GB: the embedding table is much of it.
#
# In MLX, `mlx.launch` starts this script once per process. In each, mx.distributed.init() (in
# main()) connects them over TCP (the default `ring` backend), RDMA over Thunderbolt 5 (`jaccl`), or
# NCCL between CUDA GPUs. It returns their *group*: group.size() processes, each with its *rank*,
# group.rank(), from 0 to size - 1. Run alone, the group has one process.
# mx.distributed.all_sum(x, group=group) is the exchange. Each process hands in an array of the
# same shape, and gets back the element-wise sum over all processes, of that shape. Saved as
# sum.py, these lines run as `mlx.launch -n 2 python sum.py`, and both processes print 3:
#     import mlx.core as mx
#     group = mx.distributed.init()
#     print(f"process {group.rank()}: {mx.distributed.all_sum(mx.array(group.rank() + 1))}")
# All draw with one seed from equal logits, so all pick the same token. Process 0 alone prints it.
#
# Try it: `mlx.launch -n 2 python llm_inference.py --trace`. Block 0's queries show 8 heads, not
# 16, and `x + attention` is whole again, (5, 1024): the all_sum added the heads' parts up.
# It replaces Part 1's load_tensor (to keep a process's rows or columns), attention and swiglu (to
# all_sum their outputs), and section 14's tokens_per_layer (below). That is safe. Each output sums
# the same products, in another order, so it is the same to rounding, as tests/test_distributed.py
# checks against mlx-lm's split model and against one process.
#
# With RDMA's microseconds per exchange, a split pays for a model too big for one machine.
# Pipeline parallelism (whole layers per machine) crosses the link less, but its machines take
# turns unless several sequences are in flight (section 23): one chat gains memory, not speed.

SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
SPLIT_COLUMNS = ("o_proj", "down_proj")


def split_config(config, n):
    """The config of one process of n: 1/n of the heads and feed-forward units (experts' too)."""
    split = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
             "moe_intermediate_size")
    return config._replace(**{name: getattr(config, name) // n for name in split
                              if hasattr(config, name)})


def can_split(config, n, group_size=None):
    """Whether n divides the heads and feed-forward units, and, quantized, leaves each process's
    columns of o_proj and down_proj in whole groups."""
    c = config  # query heads are a multiple of key/value heads, so they split too
    units = {c.intermediate_size, getattr(c, "moe_intermediate_size", c.intermediate_size)}
    if c.num_key_value_heads % n or any(u % n for u in units):
        return False
    columns = (c.num_attention_heads * c.head_dim // n, *(u // n for u in units))
    return not group_size or all(x % group_size == 0 for x in columns)


def use_tensor_parallelism(group):
    load_whole = load_tensor  # section 16's or 21's, if they replaced it already
    n, rank = group.size(), group.rank()  # this process is number `rank`, from 0 to n - 1

    def load_share(tensors, name, dtype):
        weight = load_whole(tensors, name, dtype)
        kind = name.split(".")[-2]  # "q_proj" for model.layers.0.self_attn.q_proj.weight
        # Rows are axis -2 of (out, in), and columns axis -1, also in experts' (128, out, in).
        axis = -2 if kind in SPLIT_ROWS else -1 if kind in SPLIT_COLUMNS else None
        if axis is None:
            return weight
        # mx.split cuts an array into n equal parts along axis. This process keeps part `rank`, as
        # a contiguous copy: a slice would keep the whole matrix alive. A Quantized matrix's packed
        # integers, scales and biases split alike (can_split keeps its groups whole).
        parts = [mx.contiguous(mx.split(part, n, axis=axis)[rank])
                 for part in (weight[:3] if isinstance(weight, Quantized) else [weight])]
        mx.eval(parts)
        return Quantized(*parts, *weight[3:]) if isinstance(weight, Quantized) else parts[0]

    summed = lambda function: lambda *args: mx.distributed.all_sum(function(*args), group=group)
    # Each all_sum must meet arrays of one shape in every process, or it sums wrong or loses the
    # connection. So all cut a prompt alike, by process 0's measure: the others hand in 0.
    pace = tokens_per_layer  # section 14's: each process times its pieces on its own clock
    first = lambda *args: mx.distributed.all_sum(pace(*args) if rank == 0 else 0,
                                                 group=group).item()
    replace(load_tensor=load_share, attention=summed(attention), swiglu=summed(swiglu),
            tokens_per_layer=first)


# --- 21. Mixture of experts: each token through 8 of 128 feed-forwards (Qwen3-30B-A3B) -----------
#
# The problem. A dense model reads all its weights for each token. Qwen3-30B-A3B (hidden_size 2048)
# holds 30.5 B parameters, but a token reads only about 3.3 B of them, as a 3B model would (its
# speed: docs/performance.md#mixture-of-experts-qwen3-30b-a3bs-shape).
#
# The idea. A block's SwiGLU (section 7) becomes 128 smaller ones, "experts" of 768 units, and a
# router, a (128, 2048) matrix: x @ router.T scores each expert for the token x. The token goes
# through its 8 best-scored experts only. Their outputs are added up, weighted by the softmax of the
# scores. With norm_topk_prob (true in Qwen3-30B-A3B), the 8 weights are rescaled to add up to 1.
# The next token may pick any expert, so all 128 stay in memory.
# By hand, with 4 experts and 2 per token: one token scores [0, 1.79, 0, 0.69] (ln 1, ln 6, ln 1,
# ln 2). The softmax is [1, 6, 1, 2] / 10 = [0.1, 0.6, 0.1, 0.2]. Experts 1 and 3 win, weighted 0.6
# and 0.2. With norm_topk_prob, 0.6 / 0.8 = 0.75 and 0.2 / 0.8 = 0.25, the softmax of their two
# scores alone ([6, 2] / 8). The output is 0.75 * expert_1(x) + 0.25 * expert_3(x).
# A trap in the names: the checkpoint stores the router as mlp.gate.weight, beside each expert's
# mlp.experts.{e}.gate_proj.weight. So a block's layer["gate"] is its router, not SwiGLU's gate.
#
# The experts in one operation. Each projection's experts are stacked: gate_proj's (128, 768, 2048).
# mx.gather_mm(a, b, rhs_indices=chosen) multiplies each (1, in) row of a by the matrix of b that
# chosen names, copying none: out[t, j] = a[t, 0] @ b[chosen[t, j]]. a's leading axes broadcast
# against chosen's shape, as in NumPy. So x as (seq, 1, 1, 2048), times the stack as (128, 2048,
# 768) at the (seq, 8) picks, gives (seq, 8, 1, 768). mx.gather_qmm does this for a Quantized stack.
# A prompt has many (token, expert) pairs. Sorted by expert, the pairs that share an expert sit side
# by side. sorted_indices=True tells a GPU kernel so. MLX's Metal and CUDA kernels then multiply a
# run of such rows by their expert's matrix at once, reading it once, not once per row.
# The sort is a permutation of the pairs, and argsort of it is the inverse. For 2 tokens, 2 picks
# of 4 experts: picks [[2, 0], [1, 2]] flatten to [2, 0, 1, 2] (pair i is token i // 2's). order =
# argsort([2, 0, 1, 2]) = [1, 2, 0, 3] lists the pairs by expert (0, 1, 2, 2: expert 2's two side
# by side), and order // 2 = [0, 1, 0, 1] their tokens. argsort(order) = [2, 0, 1, 3] is where each
# pair went (pair 0 to row 2, pair 1 to row 0): y[argsort(order)] puts the rows back in pair order.
#
# Try it: `python llm_inference.py --model Qwen/Qwen3-30B-A3B --quantize 4` (17.6 GB: the README's
# table). The page linked above writes a small random mixture in one line, for bench.py.
#
# It replaces layer_shapes (a block gains the router), load_tensor (it stacks a block's experts)
# and swiglu, for a qwen3_moe model only. tests/test_moe.py checks the logits against transformers
# and mlx-lm, and the mixture, sorted or not, against a loop over each token's experts.

MOE_FIELDS = {  # config.json's fields for experts (Qwen3-30B-A3B's values)
    "num_experts": int,  # 128 experts in a block ...
    "num_experts_per_tok": int,  # ... of which the router picks 8 for each token
    "moe_intermediate_size": int,  # 768 units in each
    "norm_topk_prob": bool,  # true: the 8 picks' probabilities rescaled to add up to 1
    "decoder_sparse_step": int,  # 1: every block has experts; 2: every second one; ...
    "mlp_only_layers": tuple,  # []: blocks that keep a dense SwiGLU
}
MoEConfig = NamedTuple("MoEConfig", [*Config.__annotations__.items(), *MOE_FIELDS.items()])
MODEL_TYPES = {"qwen3": Config.__annotations__, "qwen3_moe": MoEConfig.__annotations__}


def with_experts(config, model_dir):
    """config, or for a model_type "qwen3_moe", a MoEConfig: config and MOE_FIELDS' values."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    values = [kind(raw[name]) for name, kind in MOE_FIELDS.items() if raw["model_type"] != "qwen3"]
    return MoEConfig(*config, *values) if values else config


def has_experts(config, i):
    return i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0


def route(x, router, k, norm_topk_prob):
    """x (seq, 2048) -> each token's k experts (seq, 8) and their weights (seq, 8). Softmax keeps
    the scores' order, so the likeliest are the best-scored."""
    scores = linear(x, router)  # (seq, 128)
    # mx.argpartition: each row's indices, reordered so that the k largest scores' come last.
    chosen = mx.argpartition(scores, -k, axis=-1)[:, -k:]  # (seq, 8) expert ids
    # mx.take_along_axis(a, chosen, axis=-1)[t, j] is a[t, chosen[t, j]]: (seq, 128) -> (seq, 8).
    if norm_topk_prob:  # precise: the softmax in float32
        return chosen, mx.softmax(mx.take_along_axis(scores, chosen, axis=-1), -1, precise=True)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return chosen, mx.take_along_axis(probs, chosen, axis=-1)


def mixture(x, layer, k, norm_topk_prob):
    """swiglu() with experts: x (seq, 2048) -> each token's experts' SwiGLUs, weighted, summed."""
    router = layer["gate"]  # mlp.gate.weight (128, 2048), the router: not gate_proj
    chosen, weights = route(x, router, k, norm_topk_prob)  # (seq, 8) each
    x = x[:, None, None, :]  # (seq, 1, 1, 2048): a (1, 2048) row per token, for its 8 experts
    # Sort from 64 pairs on, as mlx-lm does: a prompt, not a decoded token (docs/performance.md).
    by_expert = chosen.size >= 64
    if by_expert:
        order = mx.argsort(chosen.flatten())  # (seq x 8,): the pairs, by expert
        x = x[order // k, 0]  # (seq x 8, 1, 2048): each sorted pair's token
        chosen = chosen.flatten()[order]  # (seq x 8,): its expert

    def product(x, w):  # linear() with each token's experts: (..., 1, in) -> (..., 1, out)
        if isinstance(w, Quantized):
            return mx.gather_qmm(x, *w[:3], rhs_indices=chosen, transpose=True, bits=w.bits,
                                 group_size=w.group_size, sorted_indices=by_expert)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=chosen, sorted_indices=by_expert)

    gate = product(x, layer["gate_proj"])  # (seq, 8, 1, 768), or sorted (seq x 8, 1, 768)
    up = product(x, layer["up_proj"])
    y = product(silu_gate(gate, up), layer["down_proj"])  # (seq, 8, 1, 2048), or sorted
    if by_expert:  # the inverse permutation: back in token order
        y = y[mx.argsort(order)].reshape(-1, k, 1, y.shape[-1])  # (seq, 8, 1, 2048)
    return (weights[:, None, :] @ y[:, :, 0])[:, 0]  # (seq, 1, 8) @ (seq, 8, 2048): weighted sum


def use_experts(config, bits=None):
    """bits: --quantize, with routers at 8 bits, as in mlx-lm."""
    shapes, load_one, dense = layer_shapes, load_tensor, swiglu

    def load_stacked(tensors, name, dtype):
        *block, kind, _ = name.split(".")  # model, layers, {i}, mlp; gate_proj; weight
        if block[3:] != ["mlp"] or not has_experts(config, int(block[2])):
            # with_router (below) gives every block a router. A dense block has none in the file.
            return None if kind == "gate" else load_one(tensors, name, dtype)
        block = ".".join(block)
        if kind == "gate" and bits and f"{block}.gate.scales" not in tensors:  # the router
            router = quantize(tensors.pop(name), 8, dtype)
            mx.eval(router)
            return router
        stacked = f"{block}.switch_mlp.{kind}.weight"  # as mlx_lm.convert stores them
        if kind != "gate" and stacked not in tensors:  # Hugging Face's: a tensor per expert
            tensors[stacked] = mx.stack([tensors.pop(f"{block}.experts.{e}.{kind}.weight")
                                         for e in range(config.num_experts)])
        # gate_proj's stack: (128, 768, 2048). load_one computes it now, which frees its parts.
        return load_one(tensors, name if kind == "gate" else stacked, dtype)

    with_router = lambda c: shapes(c) | {"mlp.gate.weight": (config.num_experts, c.hidden_size)}
    # None marks a dense block, and a draft's blocks (section 22) have no "gate": Part 1's swiglu.
    either = lambda x, layer: dense(x, layer) if layer.get("gate") is None else mixture(
        x, layer, config.num_experts_per_tok, config.norm_topk_prob)
    replace(layer_shapes=with_router, load_tensor=load_stacked, swiglu=either)


# --- 22. Speculative decoding: a small model drafts, the large one checks (--draft-model) --------
#
# The problem. Where reading the weights limits decoding (section 16), generate() reads all of them
# for each token. Yet one pass over 5 positions costs far less than 5 passes: 5.03 ms, not 5 × 3.61,
# for 12 of Qwen3-8B's layers on an H100 (docs/performance.md#speculative-decoding---draft-model).
#
# The idea (Leviathan et al. 2023; Chen et al. 2023). A small draft model with the same tokenizer
# (Qwen3-0.6B for Qwen3-8B) proposes k tokens. The target checks them all in one pass, keeps some,
# and adds one of its own. One cache list holds both models: the target's layers, then the draft's
# (make_cache below). So Chat (section 18), which sets `offset` on each layer, rolls back both.
# A round, for k = 4, after t, the last token out:
#   1. draft      the draft reads t (first d4 of the round before, if all passed), then draws
#                 d1 ... d4 from its distribution q (kept), reading each but d4 in turn (4, vocab)
#   2. verify     the target's forward([t, d1, ..., d4], last_only=False) gives p    (5, vocab)
#   3. accept     each d in turn with probability min(1, p(d) / q(d)), up to the first rejection.
#                 There the target draws from max(0, p − q), normalised (after d4: from p).
#   4. roll back  both caches forget the rejected positions: `offset` moves back, nothing is copied
#
# Why each token is as likely as in the target's own draw. At one position, the draft proposes x
# with probability q(x) and it passes with min(1, p(x) / q(x)). So P(accept x) = min(p(x), q(x)).
# For each token, p = min(p, q) + max(0, p − q). So P(reject) = 1 − Σ min(p, q) =
# Σ max(0, p − q), which is also the residual's normaliser. A rejection then yields x with
# probability max(0, p(x) − q(x)), and in all:
#   P(x) = min(p, q) + max(0, p − q) = p(x)
# With 3 words, p = (0.5, 0.3, 0.2) and q = (0.3, 0.2, 0.5): min(p, q) = (0.3, 0.2, 0.2) passes,
# 0.7 in all. The 0.3 rejected draws from max(0, p − q) = (0.2, 0.1, 0), normalised (2/3, 1/3, 0).
# P = (0.3 + 0.3 · 2/3, 0.2 + 0.3 · 1/3, 0.2 + 0) = (0.5, 0.3, 0.2) = p.
# The proof needs q to be what the draft truly drew from, and p what the target's own draw would
# use: filtered (filter_logits, min-p). Raw softmaxes would bring back what top-k and top-p removed.
# A rejection at d_i ends the round: the later proposals and p were computed after d_i, now not in
# the text. So each token out follows p given the tokens truly before it, as in the target's run.
# Greedy, a proposal passes if it is the target's argmax, else that argmax replaces it. The text
# is the target's, to rounding: one pass over 5 positions may round unlike 5 passes over one.
# mlx-lm does step 3 another way. It draws the target's own token at each position, and keeps the
# proposal only if the two are the same. That is exact too. But two draws agree with probability
# Σ p·q, which is at most Σ min(p, q). For p = q = (0.5, 0.5), it keeps half the proposals, and
# this rule all (measured: the page linked above).
# Try it: `python llm_inference.py --model Qwen/Qwen3-8B --draft-model Qwen/Qwen3-0.6B`. Its last
# line counts the proposals accepted and the tokens per pass of the target.
# It replaces make_cache (section 6) and generate_long (section 14), whose prefill it reuses.
# tests/test_speculative.py checks it: greedy, the target's tokens; sampled, p (though a seed draws
# other tokens than without a draft). After rejections, both caches hold what a plain run's would.

def distribution(logits, sampling, min_p=0.0):
    """What sample() draws from, per row (rows, vocab), no presence penalty (cli.py refuses one)."""
    rows = [filter_min_p(filter_logits(row, sampling), min_p) for row in logits]  # mx.vmap: slower
    return mx.softmax(mx.stack(rows), axis=-1)


def verify(p, q, proposals, test_key, draw_key):
    """Step 3 for p (k + 1, vocab), q (k, vocab) and the k proposals: which pass (k,), and at
    each position a draw from max(0, p − q) (k + 1,). Leading axes (a test's rounds) ride along."""
    # at(q)[i] = q_i(d_i): each row's probability of its own proposal (take_along_axis: 21).
    at = lambda probs: mx.take_along_axis(probs, proposals[..., None], axis=-1)[..., 0]
    # mx.random.uniform: numbers spread evenly over [0, 1). u < p(d) / q(d) has probability
    # min(1, p(d) / q(d)). q(d) > 0, as d was drawn from q.
    passed = mx.random.uniform(shape=proposals.shape, key=test_key) * at(q) < at(p[..., :-1, :])
    # After dk, q is 0 (no proposal), so the residual is p.
    residual = mx.maximum(p - mx.concatenate([q, mx.zeros_like(q[..., :1, :])], axis=-2), 0)
    # log(residual) as logits: their softmax is residual / Σ residual. log 0 = -inf: never drawn.
    return passed, mx.random.categorical(mx.log(residual), key=draw_key)


def load_draft(folder, config, stored, dtype, bits):
    """The draft's (weights, config), quantized by --quantize, or as stored (section 16)."""
    if bits or stored:
        use_quantization(bits, stored)
    with cli.reading(folder, "re-download the draft model"):
        return load_weights(folder, config, dtype), config


def use_speculative(draft, k, min_p=0.0):
    """Replaces make_cache and generate_long (14). Returns the last run's (accepted, k) a round."""
    one_cache, prefill_long, rounds = make_cache, generate_long, []

    def generate_drafted(prompt_ids, weights, config, max_tokens, sampling=Sampling(), eos_ids=(),
                         cache=None, progress=None):
        cache = make_cache(config) if cache is None else cache
        target, drafter = cache[: config.num_hidden_layers], cache[config.num_hidden_layers :]
        rounds.clear()
        next(prefill_long(prompt_ids, *draft, 1, cache=drafter))  # the draft's prefill
        _, logits = next(prefill_long(prompt_ids, weights, config, 1, cache=target,
                                      progress=progress))
        if max_tokens < 1:  # as generate(): the prompt prefilled, no token out
            return
        key, pick = mx.random.split(mx.random.key(sampling.seed))  # as in generate()
        new = [(sample(logits, sampling, pick).item(), logits)]  # tokens to yield, with logits
        n_out = 0  # tokens yielded
        unread = []  # besides t, what the draft has not read: dk, after a round that kept all
        while True:
            for token, logits in new:  # `token` stays the last one yielded: t
                yield token, logits
                n_out += 1
                if token in eos_ids or n_out == max_tokens:
                    return
            x = mx.array(unread + [token])  # 1. draft: read what it has not, then draw
            proposals, q = [], []  # d1 ... dk, (1,) each; if sampling, q at each, (vocab,)
            for _ in range(k):
                drafted = forward(x, *draft, drafter)  # (vocab,)
                if sampling.temperature == 0:
                    x = drafted.argmax()[None]  # (1,): q is one-hot, step 3 needs no more
                else:  # filtered once, as top-p sorts the vocabulary: d is drawn from q, as tested
                    key, pick = mx.random.split(key)
                    q.append(distribution(drafted[None], sampling, min_p)[0])  # (vocab,)
                    x = mx.random.categorical(mx.log(q[-1]), key=pick)[None]  # (1,)
                mx.async_eval(x)  # computed while the next is recorded
                proposals.append(x)
            start = target[0].offset  # t's position
            proposals = mx.concatenate(proposals)  # (k,)
            logits = forward(mx.concatenate([mx.array([token]), proposals]), weights, config,
                             target, last_only=False)  # 2. verify: (k + 1, vocab)
            mx.async_eval(logits)  # runs while the rest is recorded
            if sampling.temperature == 0:  # 3. accept: one-hot p and q
                passed, extra = logits[:k].argmax(-1) == proposals, logits.argmax(-1)
            else:
                p = distribution(logits, sampling, min_p)  # (k + 1, vocab)
                key, *keys = mx.random.split(key, 3)  # 3 keys: one kept, one to test, one to draw
                passed, extra = verify(p, mx.stack(q), proposals, *keys)
            mx.eval(passed, extra)
            n = (passed.tolist() + [False]).index(False)  # proposals before the first failure
            proposals = proposals.tolist()
            # 4. roll back to t, d1 ... dn: offset start + 1 + n. If n = k, the draft keeps its
            # start + k. It never read dk, as that pass would be wasted whenever a proposal fails.
            for layer_cache in cache:
                layer_cache.offset = min(layer_cache.offset, start + 1 + n)
            unread = proposals[-1:] if n == k else []  # the next round's step 1 reads it
            rounds.append((n, k))
            new = list(zip(proposals[:n] + [extra.tolist()[n]], logits))

    replace(make_cache=lambda config: one_cache(config) + one_cache(draft[1]),
            generate_long=generate_drafted)
    return rounds


# --- 23. Many prompts at once: batched decoding and continuous batching (--prompts) -------------
#
# The problem. A decode step reads every weight once for one token (section 16), so 50 prompts
# in turn read them 50 times. B prompts decoded in one pass share one read and one set of kernels:
# on an H100, 16 gave 9.3x the tok/s of one (docs/performance.md#many-prompts-at-once---prompts).
#
# A static batch. Prompts are padded on the left, so that every row's last prompt token sits in
# one column (padded on the right, each would end in its own). Each decode step then appends a
# column to all rows, and takes every row's next token from the last column's logits.
# By hand, a b, c d e f and g h i, padded to 4 columns (_). x: keys a query sees (padding: itself).
#   row 0   _ _ a b   pad 2        row 0's mask   key: 0 1 2 3
#   row 1   c d e f   pad 0                   query 0  x . . .     query 2  . . x .
#   row 2   _ g h i   pad 1                   query 1  . x . .     query 3  . . x x
# RoPE. Each row's tokens keep the positions they have alone: column j of row b is at j - pad[b], so
# a is at 0. RoPE (mx.fast.rope, apply_rope) takes one such offset per row. Position j in every row
# would give the same scores too, as a score depends only on the query-key gap (section 5), but only
# to rounding: 1 of 16 prompts of the 0.6B shape then changed a greedy token (docs/performance.md).
# Continuous batching. Say row 0 ends after 3 new tokens: 7 columns (4 + 3: the step that yields
# the third also caches it). A waiting prompt of 5 tokens, prefilled in a cache of its own, joins
# as a new last row in columns 2 to 6 (pad 2). One of 9 would need columns -2 to 6. So every row
# first gains 2 columns of padding on the left, and its pad grows by 2: no position changes. When
# rows end, columns that are padding in every remaining row go, and each pad drops as much.
# Memory. At most join_rows (8, as in mlx-lm) join in a prefill: its mask grows as rows x longest².
# A join into rows, or an end, copies the cache a layer per mx.eval(): on a GPU, MLX frees inputs
# only after their batch of kernels has run, and all layers at once had peaked at 1.46x mlx-lm's.
# Sampling per row. Each row splits its own key from mx.random.key(seed) as generate() does, so a
# prompt's text is its text alone, greedy or with the same seed (checked: tests/test_batch.py).
# Shapes, for B = 4 prompts of at most 12 tokens, and Qwen3-0.6B (a layer's KV cache last):
#   prefill  ids (4, 12), x (4, 12, 1024), q (4, 16, 12, 128), mask (4, 1, 12, 12), (4, 8, 12, 128)
#   decode   ids (4, 1), q (4, 16, 1, 128), mask (4, 1, 1, 13), (4, 8, 13, 128); logits (4, 151936)
# Not built: paged attention. Here one (B, 8, total, 128) array holds the keys. The longest row sets
# total, the others hold padding, and a join or an end copies it all. vLLM keeps each sequence's
# cache in blocks of 16 positions from one pool, found through a table: nothing is padded or
# copied, and prompts that begin alike share blocks. MLX's attention kernels read no such table.
# Try it: python llm_inference.py --prompts prompts.txt --batch-size 16. It replaces nothing:
# main() calls it for --prompts. Attention is mx.fast's, even with --reference-ops.

def forward_batch(token_ids, weights, config, cache, pads):
    """forward() for rows: token_ids (B, seq) continue `cache`, row b padded before column pads[b].
    -> (B, vocab) logits. A boolean mask, broadcast to (B, 16, seq, total), hides a key if false."""
    c = config
    rows, seq = token_ids.shape
    columns = mx.arange(cache[0].offset + seq)  # (total,): these seq tokens are the last
    positions = cache[0].offset - mx.array(pads)  # (B,): RoPE's offset, one per row
    # A query sees from its row's first token to itself. A padding query sees itself alone, so no
    # softmax row is all -inf (which a kernel might turn into NaN).
    start = mx.minimum(mx.array(pads)[:, None], columns[None, -seq:])  # (B, seq)
    mask = (columns >= start[..., None]) & (columns <= columns[-seq:, None])  # (B, seq, total)
    x = embed(token_ids, weights["embed_tokens"])  # (B, seq, 1024)
    for layer, layer_cache in zip(weights["layers"], cache):  # transformer_block(), for rows
        h = rms_norm(x, layer["input_layernorm"], c.rms_norm_eps)
        # Part 1's, with B rows: q (B, 16, seq, 128), k and v (B, 8, seq, 128).
        q, k, v = queries_keys_values(h, layer, c, positions)
        k, v = layer_cache.update_and_fetch(k, v)  # (B, 8, total, 128)
        h = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(c.head_dim),
                                                 mask=mask[:, None])  # (B, 16, seq, 128)
        x = x + linear(h.swapaxes(1, 2).reshape(rows, seq, -1), layer["o_proj"])  # (B, seq, 1024)
        h = rms_norm(x, layer["post_attention_layernorm"], c.rms_norm_eps)
        x = x + swiglu(h.reshape(rows * seq, -1), layer).reshape(x.shape)  # 2-D for mixture() (21)
    return linear(rms_norm(x[:, -1], weights["norm"], c.rms_norm_eps), weights["lm_head"])


def join_cache(cache, new_cache, grow, shift):
    """Append new_cache's rows to cache's, written once per layer into zeros: cache's moved `grow`
    columns right, new_cache's `shift`. Then GROWTH (256) free columns for the next steps."""
    for layer_cache, new in zip(cache, new_cache):
        end = layer_cache.offset + grow  # = new.offset + shift: all rows end at column end - 1
        for name in ("keys", "values"):
            above, below = getattr(layer_cache, name), getattr(new, name)
            rows, heads, _, dim = above.shape  # (B, 8, capacity, 128)
            both = mx.zeros((rows + len(below), heads, end + KVCache.GROWTH, dim), above.dtype)
            both[:rows, :, grow:end] = above[..., : layer_cache.offset, :]
            both[rows:, :, shift:end] = below[..., : new.offset, :]
            setattr(layer_cache, name, both)
        layer_cache.offset = end
        mx.eval(layer_cache.keys, layer_cache.values)  # a layer at a time (Memory, above)


def generate_batch(prompts, weights, config, max_tokens, sampling=Sampling(), eos_ids=(),
                   batch_size=16, join_rows=8):
    """Yield (i, token_id) for prompts (lists of ids), i a prompt's index, as steps compute them: at
    most batch_size rows at a time, at most join_rows joining in a prefill. A prompt ends as in
    generate(), after a token in eos_ids (yielded) or max_tokens (one or a list; 0: never joins)."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    queue = [i for i in reversed(range(len(prompts))) if limits[i] > 0]  # pop(): prompt 0 first
    rows, pads, keys, counts = [], [], [], []  # per row: prompt index, padding, key, tokens out
    cache = make_cache(config)
    tokens = no_tokens = mx.zeros((0,), mx.uint32)  # each row's next token, not yet cached

    def pick(logits, row_keys):  # (B, vocab) -> (B,), splitting each row's key as generate() does
        if sampling.temperature == 0:
            return sample(logits, sampling, None)  # the argmax of each row, in one operation
        split = [mx.random.split(key) for key in row_keys]  # per row: its next key, this pick's
        row_keys[:] = [key for key, _ in split]
        return mx.stack([sample(row, sampling, pick) for row, (_, pick) in zip(logits, split)])

    def join(joining):  # 1. prefill new prompts, padded on the left, and add them as rows
        nonlocal cache
        longest = max(len(prompts[i]) for i in joining)
        new_pads = [longest - len(prompts[i]) for i in joining]
        ids = mx.array([[0] * pad + prompts[i] for pad, i in zip(new_pads, joining)])
        end = cache[0].offset if rows else longest  # column end takes every row's next token
        new_cache = make_cache(config)
        new_keys = [mx.random.key(sampling.seed)] * len(joining)  # as generate() starts its key
        logits = forward_batch(ids, weights, config, new_cache, new_pads)
        grow = max(0, longest - end)  # columns of padding the batch gains on the left
        if rows:
            join_cache(cache, new_cache, grow, grow + end - longest)
        else:
            cache = new_cache
            for layer_cache in cache:  # a layer per mx.eval(), so Ctrl-C waits for one (as in 14)
                mx.eval(layer_cache.keys, layer_cache.values)
        new_tokens = pick(logits, new_keys)
        pads[:] = [pad + grow for pad in pads] + [pad + grow + end - longest for pad in new_pads]
        for per_row, added in (rows, joining), (keys, new_keys), (counts, [0] * len(joining)):
            per_row.extend(added)
        return new_tokens

    while rows or queue:
        joining = [queue.pop() for _ in range(min(batch_size - len(rows), len(queue), join_rows))]
        if joining:
            tokens = mx.concatenate([tokens, join(joining)])
        following = no_tokens  # 2. decode, on tokens not yet computed, unless max_tokens ends all
        if any(count + 1 < limits[i] for i, count in zip(rows, counts)):
            logits = forward_batch(tokens[:, None], weights, config, cache, pads)
            following = pick(logits, keys)  # (B,)
            mx.async_eval(following)  # runs while step 3 yields, before it shows which rows end
        ended = set()
        for row, token_id in enumerate(tokens.tolist()):  # 3. yield: waits for the tokens
            yield rows[row], token_id
            counts[row] += 1
            if token_id in eos_ids or counts[row] == limits[rows[row]]:
                ended.add(row)
        tokens = following
        if ended:  # 4. end: drop their rows, and columns that are padding in every remaining row
            kept = [row for row in range(len(rows)) if row not in ended]
            trim = min([pads[row] for row in kept], default=0)
            index = mx.array(kept, mx.uint32)
            for layer_cache in cache:  # one copy a layer, keeping its free room after offset
                layer_cache.keys = layer_cache.keys[index, :, trim:]
                layer_cache.values = layer_cache.values[index, :, trim:]
                layer_cache.offset -= trim
                mx.eval(layer_cache.keys, layer_cache.values)  # a layer at a time (Memory, above)
            for per_row in (rows, pads, keys, counts):
                per_row[:] = [per_row[row] for row in kept]
            pads[:] = [pad - trim for pad in pads]
            tokens = following[index] if kept else no_tokens


# ================================================================================================
# MAIN: the wiring of `python llm_inference.py` (the program around it is in cli.py)
# ================================================================================================

def main(argv=None):
    group = mx.distributed.init()  # several processes under mlx.launch (section 20)
    if group.size() > 1:
        cli.join(group)  # process 0 reads the input for all, and prints
    args = cli.parse_args(argv)
    prompt = cli.read_prompt(args, group)  # None: a chat's messages come later. A list: --prompts
    model_dir = cli.find_model(args.model, not args.no_download, MODEL_TYPES)  # or downloads it
    if args.chat:
        cli.check_chat_template(model_dir)  # refuses a template without Qwen3's chat format
    dtype = cli.pick_dtype(args.dtype)  # --dtype; auto: bfloat16 on a GPU, float32 on a CPU

    # Load (section 1), after checks that make a broken file one line.
    stored = cli.check_config(model_dir, MODEL_TYPES, args.quantize)  # how it is stored quantized
    config = with_experts(load_config(model_dir), model_dir)  # MoEConfig: section 21
    config = cli.check_weights(model_dir, config, stored, layer_shapes, has_experts)  # may untie
    n = group.size()
    cli.check_split(model_dir, config, n, args.quantize, stored, can_split)  # splits n ways?
    shares = split_config(config, n)  # this process's share (section 20)
    # Refuse weights that would not fit in memory. Warn if a 4,096-token KV cache would not.
    cli.check_fit(shares, layer_shapes, dtype, args.quantize, stored, quantizable, has_experts)
    with cli.reading(model_dir / "tokenizer.json"):  # a broken file: one line naming it
        tokenizer = load_tokenizer(model_dir)
    cli.check_tokenizer(tokenizer, config, model_dir)  # refuses another model's tokenizer
    draft = cli.check_draft(args, model_dir, config, load_config, layer_shapes, load_tokenizer,
                            has_experts)  # --draft-model's (folder, config, quantization) or None
    # Flags first. What they leave out comes as section 10's Sampling says.
    sampling, min_p, presence_penalty = cli.sampling_settings(
        args, cli.load_generation_config(model_dir), Sampling, group)

    # Part 2's replacements, all of them. Section 22 first: its draft loads with its own settings.
    rounds = draft and use_speculative(load_draft(*draft, dtype, args.quantize),
                                       args.num_draft_tokens, min_p)
    if args.quantize or stored:
        use_quantization(args.quantize, stored)  # section 16
    if isinstance(config, MoEConfig):  # before section 20, which splits what this loads
        use_experts(config, args.quantize)  # section 21
    if n > 1:  # after section 16: each process keeps its share of what it loads
        use_tensor_parallelism(group)  # section 20
    if not args.reference_ops:
        use_fused_kernels()  # section 12
        if not args.no_compile:
            compile_model()  # section 13
    new_reply = lambda: None
    if min_p or presence_penalty:  # section 17
        new_reply = use_extra_sampling(min_p, presence_penalty, config.vocab_size)

    with cli.reading(model_dir, "re-download the model"):  # a file cut short
        weights = load_weights(model_dir, config, dtype)
    cli.wire_weights(weights)  # on a Mac, keep them resident
    config = shares  # from here on, this process's share
    eos_ids = load_eos_ids(model_dir, tokenizer)  # section 11
    max_tokens = cli.max_tokens(args, config.max_position_embeddings)
    how = None if args.trace else cli.describe(sampling, min_p, presence_penalty)  # trace: no draw

    if prompt is None:  # --chat (section 18)
        n_format = len(tokenize(tokenizer, chat_prompt("", args.system, not args.no_think)))
        cli.check_chat_room(n_format, max_tokens, config.max_position_embeddings, args.system)
        cli.print_header(args.model, model_dir, config, n, dtype, weights, how, max_tokens)
        chat = Chat(weights, config, tokenizer, args.system, think=not args.no_think)
        return cli.chat_loop(chat, text_stream, max_tokens, sampling, eos_ids, args.hide_think,
                             new_reply, group, rounds)
    if isinstance(prompt, list):  # --prompts: many prompts at once (section 23)
        prompts_ids = [tokenize(tokenizer, line) for line in prompt]
        for number, ids in enumerate(prompts_ids, 1):  # each fits the context, before any runs
            cli.check_prompt(ids, config, max_tokens, False, f"the prompt on line {number}")
        cli.print_header(args.model, model_dir, config, n, dtype, weights, how, max_tokens, prompt,
                         sum(map(len, prompts_ids)))
        tokens = generate_batch(prompts_ids, weights, config, max_tokens, sampling, eos_ids,
                                args.batch_size)
        return cli.complete_batch(tokens, prompt, tokenizer, text_stream, max_tokens, eos_ids)
    text = chat_prompt(prompt, args.system, not args.no_think) if args.chat else prompt
    prompt_ids = tokenize(tokenizer, text)
    cli.check_prompt(prompt_ids, config, max_tokens, args.trace)  # in the table and the context
    cli.print_header(args.model, model_dir, config, n, dtype, weights, how, max_tokens, prompt,
                     len(prompt_ids))
    if args.trace:  # section 19
        trace(prompt_ids, weights, config, tokenizer)
        return 0
    new_reply()  # section 17: the reply has no tokens yet
    if args.no_cache:  # section 15
        tokens = generate_without_cache(prompt_ids, weights, config, max_tokens, sampling, eos_ids)
    else:  # section 14, showing a long prefill's progress
        tokens = generate_long(prompt_ids, weights, config, max_tokens, sampling, eos_ids,
                               progress=cli.PREFILL.show)
    # complete() prints the reply, then statistics. --top-probs shows what token 1 is drawn from.
    drawn = lambda logits: filter_min_p(filter_logits(logits, sampling), min_p)
    return cli.complete(tokens, tokenizer, text_stream, args, len(prompt_ids),
                        drawn if sampling.temperature else None, rounds)


if __name__ == "__main__":
    cli.run(main)
