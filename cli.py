"""The program around llm_inference.py (its main() shows how they fit); imports nothing from it."""

import argparse
import contextlib
import ctypes
import errno
import json
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

# MLX's Linux CPU wheel (mlx-cpu, its libraries in mlx_cpu.libs/) does float32 matrix products by
# calling cblas_sgemm from a bundled reference BLAS: plain loops, many times slower than OpenBLAS
# (docs/platforms.md). A library opened with RTLD_GLOBAL before MLX loads comes first when the
# dynamic linker resolves MLX's symbols, so OpenBLAS loaded that way takes those calls; loaded
# after MLX it is never used. So llm_inference.py imports this module before mlx.core.
MLX_CPU_WHEEL = any(Path(folder, "mlx_cpu.libs").is_dir() for folder in sys.path)
try:
    OPENBLAS = (MLX_CPU_WHEEL and os.environ.get("LLM_INFERENCE_BLAS") != "0"
                and "mlx.core" not in sys.modules
                and bool(ctypes.CDLL("libopenblas.so.0", mode=ctypes.RTLD_GLOBAL)))
except OSError:  # not installed: OPENBLAS_HINT says how to install it
    OPENBLAS = False
OPENBLAS_HINT = ("Hint: this CPU runs float32 faster with OpenBLAS, which this script uses once "
                 "installed: sudo apt-get install libopenblas0-pthread")

RUNTIME = ("mlx", "tokenizers", "huggingface_hub")  # requirements.txt's packages
NOT_INSTALLED = ("%s: error: the package %s is not installed here: activate the virtual "
                 "environment (. .venv/bin/activate), or pip install -r requirements.txt")
try:
    import mlx.core as mx  # noqa: E402 (after the preload)
    import tokenizers  # noqa: F401 (llm_inference.py's, found missing here in one line)
except ModuleNotFoundError as e:
    if e.name not in RUNTIME:  # a module missing inside MLX itself: its traceback
        raise
    sys.exit(NOT_INSTALLED % (Path(sys.argv[0]).name, e.name))  # llm_inference.py or bench.py

HF_REPO = "Qwen/Qwen3-0.6B"
SCRIPT_DIR = Path(__file__).resolve().parent  # llm_inference.py's folder, where models may be
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # the other two are optional
WEIGHTS_INDEX = "model.safetensors.index.json"  # stands in for model.safetensors when sharded
# What a repo id's copy in Hugging Face's cache must hold of what its repo has: what is downloaded.
CACHED_FILES = (*MODEL_FILES, "chat_template.jinja", WEIGHTS_INDEX, "model-*-of-*.safetensors")
GROUP_SIZE = 64  # --quantize's group size, llm_inference.GROUP_SIZE: mlx-lm's default


class UserError(Exception):
    """A mistake a person can fix (bad flag, missing file, ...): one line, no traceback."""


class SharedError(UserError):
    """A UserError every process of a group meets alike (section 20): process 0 alone says it."""


@contextlib.contextmanager
def reading(path, fix="re-download it"):
    """A file that cannot be read or parsed in this block: one line, naming it, with the reason."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # OSError, ValueError, RuntimeError; tokenizers raises plain Exception
        reason = getattr(e, "strerror", None) or str(e).strip().split("\n")[0] or type(e).__name__
        raise UserError(f"cannot read {path} ({reason}); {fix}") from None


def read_json(path, fix="re-download it"):
    with reading(path, fix):
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object; {fix}")
    return value


def is_number(value, kind=float):
    """Whether a JSON value is a number of `kind` below 1e308 (float takes ints; true is none)."""
    return (not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
            and (kind is int or abs(value) < 1e308))  # not NaN, infinite, or an int too large


def plural(n, word):
    return f"{n} {word}{'' if n == 1 else 's'}"


def name_of(dtype):
    return str(dtype).split(".")[-1]


# --- The model folder: everything llm_inference.py's loaders assume, each failure one line -------

def check_config(model_dir, fields, bits=None):
    """config.json, a Qwen3 with the fields (name -> type) of its model_type, or fields alone."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    found, rope = raw.get("model_type"), raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: 'rope_parameters' should be an object, got {json.dumps(rope)}")
    types = fields if "qwen3" in fields else {"qwen3": fields}
    if found == "qwen3_moe" and found not in types:  # only a draft's fields lack it (section 22)
        raise UserError(f"{path} is a mixture of experts, which cannot be a draft (section 22 "
                        "drafts with Part 1's dense blocks): use a dense Qwen3 as the draft")
    if found not in types:
        raise UserError(f"{path} is not a Qwen3 config (model_type is {found!r}, expected "
                        f"{' or '.join(map(repr, types))})")
    for feature, asked in {  # variants Part 1 does not implement: refused, not run wrong
        "RoPE scaling": raw.get("rope_scaling") or rope.get("rope_type", "default") != "default",
        f"the activation {raw.get('hidden_act')!r} (hidden_act), not SiLU":
            raw.get("hidden_act", "silu") != "silu",
        "attention bias (attention_bias: true)": raw.get("attention_bias"),
        "sliding-window attention (use_sliding_window: true)": raw.get("use_sliding_window"),
    }.items():
        if asked:
            raise UserError(f"{path} asks for {feature}, which this script does not implement")
    raw.setdefault("rope_theta", rope.get("rope_theta"))  # transformers 5 writes it in there
    kinds = {bool: "true or false", int: "a positive integer", float: "a positive number",
             tuple: "a list of layer numbers"}
    for name, kind in types[found].items():
        value = raw.get(name)
        if value is None:
            raise UserError(f"{path} lacks the required key {name!r}")
        if not (isinstance(value, bool) if kind is bool else isinstance(value, list) and all(
                is_number(i, int) and i >= 0 for i in value) if kind is tuple else
                is_number(value, kind) and value > 0):
            raise UserError(f"{path}: {name!r} should be {kinds[kind]}, got {json.dumps(value)}")
    if found == "qwen3_moe" and raw["num_experts_per_tok"] > raw["num_experts"]:
        raise UserError(f"{path}: 'num_experts_per_tok' ({raw['num_experts_per_tok']}) should be "
                        f"at most 'num_experts' ({raw['num_experts']})")
    if raw["head_dim"] % 2:  # RoPE turns pairs of channels (section 5)
        raise UserError(f"{path}: 'head_dim' should be even, got {raw['head_dim']}")
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if heads % kv_heads:  # whole groups (section 6)
        raise UserError(f"{path}: 'num_attention_heads' ({heads}) should be a multiple of "
                        f"'num_key_value_heads' ({kv_heads})")
    quantization, other = raw.get("quantization") or {}, raw.get("quantization_config")
    method = other.get("quant_method") if isinstance(other, dict) else other
    if other and not quantization:  # transformers' GPTQ, AWQ, FP8, ...; mlx_lm.convert's has both
        raise UserError(f"{path} has a 'quantization_config' (quant_method {method!r}) but no "
                        "'quantization' (MLX's): use an unquantized or mlx_lm.convert checkpoint")
    if not isinstance(quantization, dict):
        raise UserError(f"{path}: 'quantization' should be an object such as "
                        f'{{"group_size": 64, "bits": 4}}, got {quantization!r}')
    layers = {name: how for name, how in quantization.items() if isinstance(how, dict)}
    for layer, how in ({"": quantization} | layers if quantization else {}).items():
        mode, n_bits, group = how.get("mode", "affine"), how.get("bits"), how.get("group_size")
        if (mode != "affine" or not is_number(n_bits, int) or n_bits not in (2, 3, 4, 5, 6, 8)
                or not is_number(group, int) or group not in (32, 64, 128)):
            raise UserError(f"{path} asks for {mode} quantization at {n_bits!r} bits in groups of "
                            f"{group!r}{f' for {layer}' if layer else ''}; this script reads "
                            "affine quantization at 2-6 or 8 bits in groups of 32, 64 or 128")
    if bits and quantization.get("bits") and bits != quantization["bits"]:
        raise UserError(f"{model_dir} is already quantized to {quantization['bits']} bits; drop "
                        "--quantize or point --model at the unquantized model")
    return quantization


def weight_files(model_dir):
    """The weight files llm_inference.weight_files() reads, with a damaged index as one line."""
    model_dir = Path(model_dir)
    if os.path.lexists(model_dir / "model.safetensors"):  # a link to nothing: unreadable, said so
        return [model_dir / "model.safetensors"]
    weight_map = read_json(model_dir / WEIGHTS_INDEX).get("weight_map")
    names = set(weight_map.values()) if isinstance(weight_map, dict) else ()
    # Plain names of safetensors files: "../x" reads outside the folder, mx.load reads x.npz too.
    if not names or not all(isinstance(name, str) and Path(name).name == name
                            and name.endswith(".safetensors") for name in names):
        raise UserError(f"{model_dir / WEIGHTS_INDEX} is not a valid index of shards (a JSON "
                        "object whose 'weight_map' names a file for each tensor); re-download it")
    return [model_dir / name for name in sorted(names)]


def tensor_shapes(config, layer_shapes, has_experts=None):
    """Every tensor Part 1 loads, with its shape; a block with experts (section 21) has theirs."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    blocks = [layer_shapes(c)] * c.num_hidden_layers
    if hasattr(c, "num_experts"):
        one = layer_shapes(c._replace(intermediate_size=c.moe_intermediate_size))  # an expert's
        experts = {name: shape for name, shape in blocks[0].items() if not name.startswith("mlp.")}
        experts["mlp.gate.weight"] = (c.num_experts, c.hidden_size)  # the router: (128, 2048)
        experts |= {f"mlp.experts.{e}.{name[4:]}": shape for e in range(c.num_experts)
                    for name, shape in one.items() if name.startswith("mlp.")}
        blocks = [experts if has_experts(c, i) else blocks[0] for i in range(len(blocks))]
    for i, block in enumerate(blocks):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in block.items()}
    return shapes


def check_weights(model_dir, config, stored, layer_shapes, has_experts=None):
    """Each tensor's name, shape and dtype (headers only); config, untied for a head of its own."""
    files, tensors, model_dir = weight_files(model_dir), {}, Path(model_dir)
    for path in files:
        with reading(path):
            path.open("rb").close()  # the OS's reason (no such file, a directory): MLX's is vaguer
            tensors |= {name: (path, tensor) for name, tensor in mx.load(str(path)).items()}
    where = files[0] if len(files) == 1 else f"the sharded checkpoint {model_dir}"
    first = next(iter(layer_shapes(config)))
    for i in range(config.num_hidden_layers):  # before listing 10**9 layers' tensors, say
        if f"model.layers.{i}.{first}" not in tensors:
            raise UserError(f"{where} lacks the tensor 'model.layers.{i}.{first}'")
    floats = (mx.bfloat16, mx.float16, mx.float32)
    untied = config._replace(tie_word_embeddings=False)  # a tied checkpoint's head may be used
    shapes = tensor_shapes(untied if "lm_head.weight" in tensors else config, layer_shapes,
                           has_experts)
    for name in [name for name in shapes if ".experts.0." in name]:
        stacked = name.replace(".experts.0.", ".switch_mlp.")  # mlx_lm.convert stacks them
        if stacked in tensors:
            shapes[stacked] = (config.num_experts, *shapes[name])
            for e in range(config.num_experts):
                del shapes[name.replace(".experts.0.", f".experts.{e}.")]
    expected = {name: (shape, floats) for name, shape in shapes.items()}
    for name, (*rows, columns) in shapes.items():
        stem = name.removesuffix(".weight")
        if stored and rows and f"{stem}.scales" in tensors:  # stored quantized (section 16)
            how = stored.get(stem)
            how = how if isinstance(how, dict) else stored
            expected[name] = ((*rows, columns * how["bits"] // 32), (mx.uint32,))
            for part in ("scales", "biases"):
                expected[f"{stem}.{part}"] = ((*rows, columns // how["group_size"]), floats)
    for name, (shape, dtypes) in expected.items():
        if name not in tensors:
            raise UserError(f"{where} lacks the tensor {name!r}")
        path, tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise UserError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                            f"{shape}")
        if tensor.dtype not in dtypes:
            raise UserError(f"{path}: tensor {name!r} is stored as {name_of(tensor.dtype)}, "
                            f"expected {' or '.join(map(name_of, dtypes))}")
    unexplained = [name for name in tensors if name not in expected]
    if unexplained:
        raise UserError(f"{where} holds {plural(len(unexplained), 'tensor')} that config.json "
                        f"does not describe, such as {unexplained[0]!r}: config.json "
                        f"(num_hidden_layers {config.num_hidden_layers}, ...) does not match them")
    if config.tie_word_embeddings and stored_head_differs(files):
        print("Note: config.json ties the LM head to the embeddings, but the checkpoint stores a "
              "different lm_head.weight; using it, as transformers does", file=sys.stderr)
        return untied
    return config


def stored_head_differs(files):
    """Whether a tied checkpoint stores another lm_head.weight (transformers 5 uses it, and so do
    we). 64 rows of each, read past the file's JSON header, tell without reading 2 x 311 MB."""
    entries = {}
    for path in files:
        with reading(path), path.open("rb") as f:  # a header mx.load reads but json does not
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


# Qwen's embedding tables have rows no token uses. Qwen1 had 151,851 tokens and its table 151,936
# rows, the next multiple of 128 (a size matrix products handle well). Qwen3 kept that table for
# 151,669 tokens: 267 rows unused. Up to 1,024 pass; another model's tokenizer is far shorter.
UNUSED_ROWS = 1024
QWEN3_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")  # ends, chat


def check_tokenizer(tokenizer, config, model_dir):
    """Ids the embedding table has rows for, Qwen3's, and every text encoded whole."""
    tokenizer.no_truncation()  # a tokenizer.json may ask to cut or pad every text: not a prompt
    tokenizer.no_padding()
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    missing = [token for token in QWEN3_TOKENS if tokenizer.token_to_id(token) is None]
    if missing or not config.vocab_size - UNUSED_ROWS <= n_tokens <= config.vocab_size:
        raise UserError(f"{Path(model_dir) / 'tokenizer.json'} has another tokenizer ({n_tokens} "
                        f"tokens for {config.vocab_size} embedding rows"
                        f"{', without ' + missing[0] if missing else ''}): put the model's own "
                        "tokenizer.json beside its weights")


def check_ids(ids, config):
    """Refuse ids past the embedding table (embed() would read outside it): an edited tokenizer."""
    if ids and max(ids) >= config.vocab_size:
        raise UserError(f"tokenizer.json gave the token id {max(ids)}, but the embedding table has "
                        f"only {config.vocab_size} rows (vocab_size): not one model's files")


def check_chat_template(model_dir):
    """Refuse --chat's format (section 18) to Qwen3-2507 models: their templates lack it."""
    path = Path(model_dir) / "chat_template.jinja"  # newer checkpoints keep it in its own file
    with reading(path):
        template = path.read_text(encoding="utf-8") if path.is_file() else None
    if template is None:
        path = Path(model_dir) / "tokenizer_config.json"
        template = read_json(path).get("chat_template") if path.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = [t.get("template") for t in template
                    if isinstance(t, dict) and t.get("name") == "default"]
    if template and "enable_thinking" not in str(template):  # no template: given the benefit
        raise UserError(f"{path} holds a chat template other than Qwen3's hybrid-thinking one that "
                        "--chat writes (a Qwen3-2507 model?); run it without --chat")


def check_split(model_dir, config, n, bits, stored, can_split):
    """Refuse n processes the model cannot be split over (section 20's can_split)."""
    # Quantized, each process's columns hold whole groups of the largest size: stored, --quantize's
    sizes = [how.get("group_size", 0) for how in (stored, *stored.values())
             if isinstance(how, dict)]
    group_size = max(sizes + [GROUP_SIZE] * bool(bits))
    if n > 1 and not can_split(config, n, group_size):
        counts = [str(k) for k in range(1, config.num_key_value_heads + 1)
                  if can_split(config, k, group_size)]
        raise SharedError(f"{model_dir} cannot be split over {n} processes (whole heads and "
                          f"quantization groups): use {', '.join(counts)}")


def check_draft(args, model_dir, config, read_config, layer_shapes, read_tokenizer,
                has_experts=None):
    """--draft-model's folder, checked as --model's and able to serve the model (section 22)."""
    if not args.draft_model:
        return None
    if mx.distributed.init().size() > 1:  # each process would need its share of the draft too
        raise SharedError("--draft-model runs in one process only: drop it under mlx.launch")
    # A draft is a dense Qwen3, also for a mixture of experts: read_config's fields, not config's.
    fields, name = type(read_config(model_dir)).__annotations__, f"--draft-model {args.draft_model}"
    folder = find_model(args.draft_model, not args.no_download, fields, "--draft-model")
    stored, draft = check_config(folder, fields), read_config(folder)  # stored quantized: as is
    if draft.vocab_size != config.vocab_size:  # q and p would not line up
        raise UserError(f"{name} has {draft.vocab_size} vocabulary entries, the model "
                        f"{config.vocab_size}: a draft needs the model's vocabulary")
    draft = check_weights(folder, draft, stored, layer_shapes)
    tokens = lambda where: (Path(where) / "tokenizer.json").read_bytes()
    with reading(Path(folder) / "tokenizer.json"):  # the same file, or the same ids for the tokens
        if tokens(folder) != tokens(model_dir) and (read_tokenizer(folder).get_vocab(True)
                                                    != read_tokenizer(model_dir).get_vocab(True)):
            raise UserError(f"{name} has another tokenizer (its tokenizer.json maps ids to other "
                            "tokens): a draft needs the model's tokenizer")
    size = lambda c: sum(map(math.prod, tensor_shapes(c, layer_shapes, has_experts).values()))
    if size(draft) > size(config):
        print(f"warning: {name} has more weights than the model: drafting with it slows decoding "
              "down", file=sys.stderr)
    return folder, draft, stored


# --- Memory: will the weights fit? ----------------------------------------------------------------

def weight_bytes(shapes, dtype, quantizable, bits=None, group_size=GROUP_SIZE, stored=None):
    """The bytes these shapes take loaded: quantized to bits (section 16), or as stored says."""
    total = 0
    for name, shape in shapes.items():
        n, how = math.prod(shape), (stored or {}).get(name.removesuffix(".weight"))
        b, g = (how["bits"], how["group_size"]) if isinstance(how, dict) else (bits, group_size)
        b = None if how is False else b  # a layer stored unquantized
        quantized = b and quantizable(shape, g)
        total += n * b // 8 + 2 * n // g * dtype.size if quantized else n * dtype.size
    return total


def memory_size():
    """What the weights may take: GPU memory, else MemAvailable (Linux kills past it), else RAM."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    size = info.get("memory_size") or info.get("total_memory")  # Metal's key, CUDA's key
    if size:
        return size
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:  # not Linux
        line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024  # "MemAvailable:   23437500 kB"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_working_set():
    """On a Mac, the most memory Metal advises its GPU use (2/3 to 3/4); None elsewhere."""
    if mx.default_device() == mx.gpu:
        return mx.device_info().get("max_recommended_working_set_size")


def check_memory(needed, available, dtype, working_set=None, margin=0, what=""):
    """Refuse weights too large before reading gigabytes; warn when `margin` more would not fit."""
    smaller = "--dtype bfloat16 (half the bytes), " if dtype.size == 4 else ""
    fix = f"try {smaller}--quantize 4, or a smaller model"
    if working_set and needed > working_set:
        has = (f"this Mac's GPU may use only {working_set / 1e9:.1f} GB of its "
               f"{available / 1e9:.1f} GB of memory (Metal's recommended working set)")
    elif needed > available:
        has = f"this machine has {available / 1e9:.1f} GB of memory available"
    else:
        if needed + margin > (working_set or available):
            print(f"warning: the weights take {needed / 1e9:.1f} of the "
                  f"{(working_set or available) / 1e9:.1f} GB available, leaving little for the "
                  f"KV cache and activations; if the run is killed, {fix}", file=sys.stderr)
        return
    raise UserError(f"the weights need {needed / 1e9:.1f} GB as {name_of(dtype)}{what}, but "
                    f"{has}; {fix}")


def check_fit(config, layer_shapes, dtype, bits, stored, quantizable, has_experts=None):
    """check_memory for config's weights (this process's share) and 4,096 positions' KV cache."""
    shapes, c = tensor_shapes(config, layer_shapes, has_experts), config
    needed = weight_bytes(shapes, dtype, quantizable, bits or stored.get("bits"),
                          stored.get("group_size", GROUP_SIZE), stored)
    kv_cache = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype.size * 4096
    what = (f" (all {sum(map(math.prod, shapes.values())) / 1e9:.1f} B parameters: a token uses "
            f"{c.num_experts_per_tok} of a block's {c.num_experts} experts, but any may be next)"
            if hasattr(c, "num_experts") else "")
    check_memory(needed, memory_size(), dtype, gpu_working_set(), kv_cache, what)
    if what and dtype != mx.float32 and not (bits or stored) and mx.default_device() == mx.cpu:
        raise UserError(f"MLX's CPU multiplies unquantized experts (mx.gather_mm) in float32 only, "
                        f"not {name_of(dtype)}: use --dtype float32 or --quantize")


def wire_weights(weights):
    """On a Mac, wire weights over half the GPU's working set, as mlx-lm does, before any work."""
    from mlx.utils import tree_flatten  # only this Mac step needs it

    arrays = {id(a): a for _, a in tree_flatten(weights) if isinstance(a, mx.array)}  # tied: once
    working_set = gpu_working_set()
    if working_set and sum(a.nbytes for a in arrays.values()) > working_set / 2:
        mx.set_wired_limit(working_set)


def pick_dtype(name):
    """'auto': bfloat16 on a GPU; float32 on the CPU, where bfloat16 is slow (docs/platforms.md)."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return getattr(mx, name)


# --- generation_config.json and the flags: one table of rules for both ----------------------------

# The lowest temperature besides 0. Lower, sampling is greedy in all but name (a logit gap of 0.01
# becomes 100), and far lower (1e-45) logits / temperature overflow to inf: the draw gives token 0.
MIN_TEMPERATURE = 1e-4

SETTINGS = {  # each setting's test and what it should be
    "temperature": (lambda t: is_number(t) and (t == 0 or t >= MIN_TEMPERATURE),
                    f"0 (greedy) or at least {MIN_TEMPERATURE}"),
    "top_k": (lambda k: is_number(k, int) and k >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda p: is_number(p) and 0 < p <= 1, "a number in (0, 1]"),
    "min_p": (lambda p: is_number(p) and 0 <= p <= 1, "a number in [0, 1]"),
    "presence_penalty": (lambda p: is_number(p) and 0 <= p <= 2, "a number in [0, 2]"),
    "seed": (lambda s: is_number(s, int) and 0 <= s < 2**64, "an integer in [0, 2**64)"),
    "count": (lambda n: is_number(n, int) and n >= 1, "an integer >= 1"),  # --max-tokens, ...
    "top_probs": (lambda n: is_number(n, int) and 1 <= n <= 1000, "an integer from 1 to 1000"),
    "eos_token_id": (lambda ids: all(is_number(i, int) and i >= 0 for i in
                                     (ids if isinstance(ids, list) else [ids])),
                     "a token id (an integer >= 0) or a list of them"),
}


def load_generation_config(model_dir):
    """generation_config.json (optional): end-of-sequence ids, Qwen's recommended sampling."""
    path = Path(model_dir) / "generation_config.json"
    values = read_json(path, "delete or re-download it") if path.exists() else {}
    values = {key: value for key, value in values.items() if value is not None}  # null: unset
    for key in ("temperature", "top_k", "top_p", "min_p", "eos_token_id"):
        fits, expected = SETTINGS[key]
        if key in values and not fits(values[key]):
            raise UserError(f"{path}: {key!r} should be {expected}, got "
                            f"{json.dumps(values[key])}; fix it or delete the file")
    return values


# --- Finding the model: a folder, or a Hugging Face repo id, downloaded once into its cache -------

def repo_id(text):
    """'owner/name', also from a huggingface.co address or with a trailing slash; else None."""
    address = re.match(r"https?://(?:www\.)?huggingface\.co/([^/?#]+/[^/?#]+)", text)
    text = address.group(1) if address else text.rstrip("/")
    return text if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", text) else None


def download_command(repo, model_dir):
    """`hf download` into the cache (model_dir None) or a relative --local-dir (works elsewhere)."""
    files = f" {' '.join(MODEL_FILES)}" if repo == HF_REPO else ""
    if model_dir is None:
        return f"hf download {repo}{files}"
    model_dir, here, cd = Path(model_dir).absolute(), Path.cwd(), ""
    if model_dir.is_relative_to(here):
        model_dir = model_dir.relative_to(here)
    elif model_dir.is_relative_to(SCRIPT_DIR):  # the default folder may be there
        cd, model_dir = f"cd {shlex.quote(str(SCRIPT_DIR))} && ", model_dir.relative_to(SCRIPT_DIR)
    return f"{cd}hf download {repo}{files} --local-dir {shlex.quote(str(model_dir))}"


def missing_files(names):
    return [name for name in NEEDED_FILES if name not in names
            and not (name == "model.safetensors" and WEIGHTS_INDEX in names)]


def download_model(repo, model_dir, fields):
    """Part 1's files into model_dir (None: the cache): config.json first, checked before gigabytes;
    the weights last, an index after its shards, so a folder cut off midway never looks complete."""
    import huggingface_hub as hub
    from huggingface_hub import constants

    info = hub.HfApi().model_info(repo, files_metadata=True)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings}
    if missing_files(sizes):
        raise UserError(f"{repo} has no {', '.join(missing_files(sizes))}: it is not a Qwen3 "
                        "checkpoint in Hugging Face's safetensors layout")
    get = lambda names, folder: Path(hub.snapshot_download(  # the cache records main's commit
        repo, revision=info.sha if folder else None, local_dir=folder, allow_patterns=names))
    index = [WEIGHTS_INDEX] if "model.safetensors" not in sizes else []
    with tempfile.TemporaryDirectory() as first:
        get(["config.json", *index], first)
        try:
            check_config(first, fields)
            weights = [path.name for path in weight_files(first)] if index else []
        except UserError as e:  # name the repo, not the temporary folder
            raise UserError(str(e).replace(str(Path(first)), repo))
    names = [name for name in (*MODEL_FILES, "chat_template.jinja") if name in sizes]
    total = sum(sizes.get(name, 0) for name in names + weights + index)
    where = f"{model_dir}/" if model_dir else f"Hugging Face's cache ({constants.HF_HUB_CACHE})"
    print(f"Downloading {repo} ({len(names + weights + index)} files, {total / 1e9:.2f} GB) into "
          f"{where}", file=sys.stderr)
    others = [name for name in names if name != "model.safetensors"]
    try:
        for batch in (others, weights or ["model.safetensors"], index):
            folder = get(batch, model_dir) if batch else folder
    except Exception as e:  # what arrived stays, for the next run to resume from (find_model)
        e.resumable = True
        raise
    return folder


def find_model(model_arg, allow_download, fields, flag="--model"):
    """--model's (or flag's) folder, or a repo id's copy in Hugging Face's cache, fetched once."""
    repo = repo_id(model_arg) if model_arg else HF_REPO
    names = lambda folder: {p.name for p in folder.iterdir()} if folder and folder.is_dir() else ()
    try:
        in_cache = bool(model_arg and repo) and not Path(model_arg).exists()
        if in_cache:
            import huggingface_hub as hub  # its cache: ~/.cache/huggingface/hub, or $HF_HOME's

            model_dir = None
            with contextlib.suppress(Exception):  # LocalEntryNotFoundError: not there
                model_dir = Path(hub.snapshot_download(repo, local_files_only=True,
                                                       allow_patterns=CACHED_FILES))
        elif model_arg:
            model_dir, repo = Path(model_arg), None
        else:
            model_dir = Path("Qwen3-0.6B")
            model_dir = model_dir if model_dir.is_dir() else SCRIPT_DIR / model_dir
        # Names, not files: a directory in a file's place is reported as unreadable when read.
        missing = missing_files(names(model_dir))
    except OSError as e:  # a name too long, a folder without permission, ...
        raise UserError(f"cannot read the folder {model_arg or 'Qwen3-0.6B'}: {e.strerror or e}")
    if not missing:
        return model_dir
    what = (f"{repo} is not in the Hugging Face cache" if in_cache and not model_dir else
            f"{repo}'s copy in the Hugging Face cache is incomplete (no {', '.join(missing)})"
            if in_cache else f"{model_dir} lacks {', '.join(missing)}" if model_dir.is_dir() else
            f"{model_dir} is a file, not a model folder" if model_dir.exists() else
            f"model folder {model_dir} not found")
    if repo is None:
        raise UserError(f"{what}; point {flag} at a folder with {', '.join(NEEDED_FILES)} (or "
                        f"{WEIGHTS_INDEX} and its shards), or at a repo id such as Qwen/Qwen3-1.7B")
    model_dir = None if in_cache else model_dir  # where a download goes
    fetch = f"fetch it with: {download_command(repo, model_dir)}"
    if not allow_download:
        raise UserError(f"{what} and --no-download was given; {fetch}")
    from huggingface_hub import constants  # imported only now: a third of a second

    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: huggingface_hub will not download
        raise UserError(f"{what}, and Hugging Face's offline mode is on (HF_HUB_OFFLINE): unset "
                        f"it to download {repo}, or {fetch}")
    try:
        return download_model(repo, model_dir, fields)
    except UserError as e:
        raise UserError(f"{what}, and {e}")
    except Exception as e:  # no network, no such repo, a network error midway, a full disk ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fix = (f"run again to resume, or {fetch}" if getattr(e, "resumable", False) else
               f"{fetch}; to try random weights meanwhile, see README.md's Troubleshooting")
        raise UserError(f"{what}, and could not download {repo} ({type(e).__name__}: {reason}); "
                        f"{fix}")


# --- The command line: python llm_inference.py --prompt "..." [flags] -----------------------------

DEFAULT_PROMPT = "The capital of France is"
MAX_TOKENS, CHAT_MAX_TOKENS = 100, 8192  # 8192: enough to finish thinking, mostly (README, Chat)
NUM_DRAFT_TOKENS = 2  # --num-draft-tokens' default
# Qwen's recommended sampling (model card); in thinking mode generation_config.json's win.
QWEN3_THINKING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
QWEN3_NO_THINK = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
# What transformers' generate() falls back on for a value generation_config.json lacks.
TRANSFORMERS_DEFAULTS = {"top_p": 1.0, "top_k": 50, "min_p": 0.0}


def as_text(data, what, error=UserError):
    """Text as an editor reads it: UTF-8, no BOM, CRLF or CR as newlines; fsencode undoes argv's."""
    try:
        text = (os.fsencode(data) if isinstance(data, str) else data).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise error(f"{what} is not valid UTF-8 text (cut in the middle of a character?)")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_prompt(args, group):
    """--prompt's text (stdin for '-'), as process 0 reads it; None for a chat without one. With
    --prompts, the lines of its file (stdin for '-'), each a prompt: an empty one is refused."""
    if args.prompts is not None:
        if group.size() > 1:  # section 23 decodes in one process
            raise SharedError("--prompts runs in one process only: drop it under mlx.launch")
        where = "stdin" if args.prompts == "-" else Path(args.prompts)
        with reading(where, "give --prompts a text file with one prompt per line"):
            data = sys.stdin.buffer.read() if args.prompts == "-" else where.read_bytes()
        prompts = as_text(data, where).removesuffix("\n").split("\n")  # empty: one empty line
        for number, prompt in enumerate(prompts, 1):
            if not prompt.strip():
                raise UserError(f"line {number} of {where} is empty: --prompts takes one prompt "
                                "per line, none empty")
        return prompts
    if args.chat and args.prompt is None:
        return None
    if group.size() > 1 and args.prompt == "-":  # mlx.launch never closes the processes' input
        raise SharedError("under mlx.launch stdin never ends: give --prompt the text, not -")
    if group.rank() > 0:
        return share(None, group)
    text = DEFAULT_PROMPT if args.prompt is None else as_text(args.prompt, "--prompt")
    if text == "-":  # stdin, less the newline that echo ends it with
        if sys.stdin.isatty():
            print("Reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr)
        text = as_text(sys.stdin.buffer.read(), "the prompt on stdin").removesuffix("\n")
    if not text.strip():
        fix = "pipe some text in" if args.prompt == "-" else "pass some text with --prompt"
        raise UserError(f"the prompt is empty; {fix}")
    return share(text, group) if group.size() > 1 else text


def number(kind, rule):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        if not SETTINGS[rule][0](value):  # NaN and inf too: is_number refuses them
            raise argparse.ArgumentTypeError(f"must be {SETTINGS[rule][1]}, got {text}")
        return value
    return parse


def model_name(text):
    """--model's type: an empty one (a variable never set?) would mean a 1.5 GB download."""
    if not text:
        raise argparse.ArgumentTypeError(f"is empty; give a folder, or a repo id such as {HF_REPO}")
    return text


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block; exit code 2 as usual
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(prog="llm_inference.py", description="Generate text with Qwen3 on MLX.")
    add = ap.add_argument
    add("--prompt", help=f"the text to continue ('-' reads stdin; default: {DEFAULT_PROMPT!r}); "
        "with --chat, one message and its reply")
    add("--prompts", metavar="FILE", help="many prompts, one per line ('-' reads stdin), decoded "
        "together (section 23): a JSON line for each on stdout, in the file's order")
    add("--batch-size", type=number(int, "count"), default=16, metavar="N", help="with --prompts: "
        "the most prompts decoded together (%(default)s; docs/performance.md, Many prompts)")
    add("--max-tokens", type=number(int, "count"), help=f"stop after this many new tokens "
        f"({MAX_TOKENS}; {CHAT_MAX_TOKENS} with --chat; at most half the context)")
    for name, kind, text in (  # the sampling flags, each checked by its rule in SETTINGS
            ("temperature", float, "0 = greedy (default; 0.6 with --chat, 0.7 with --no-think)"),
            ("top_p", float, "the nucleus mass (generation_config.json's; 0.8 with --no-think)"),
            ("top_k", int, "keep the k likeliest tokens, 0 = all (generation_config.json's)"),
            ("min_p", float, "keep tokens at least this fraction as likely as the likeliest (0)"),
            ("presence_penalty", float, "lower the logit of tokens already in the reply (0)"),
            ("seed", int, "random seed for sampling (default: fresh)")):
        add(f"--{name.replace('_', '-')}", type=number(kind, name), help=text)
    add("--model", type=model_name, help="a model folder, or a Hugging Face repo id such as "
        "Qwen/Qwen3-1.7B, downloaded once to its cache (default: ./Qwen3-0.6B, else the script's)")
    add("--no-download", action="store_true", help="never download the model, fail instead")
    add("--chat", action="store_true", help="talk with the model in Qwen3's chat format")
    add("--system", help="system message for --chat")
    add("--no-think", action="store_true", help="with --chat: skip Qwen3's <think> reasoning")
    add("--hide-think", action="store_true", help="with --chat: a progress line, not the reasoning")
    add("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
        help="auto = bfloat16 on a GPU, float32 on the CPU. float16 can run faster on M1/M2 "
        "Macs (no bfloat16 arithmetic), but Qwen3 can overflow it. On CUDA and M5 Macs, float32 "
        "products use TF32 unless MLX_ENABLE_TF32=0 (docs/platforms.md)")
    add("--quantize", type=int, choices=[4, 8], metavar="{4,8}",
        help="store the weights in 4 or 8 bits, as mlx_lm.convert does: less memory")
    add("--draft-model", type=model_name, help="a smaller Qwen3 with the same tokenizer (folder or "
        "repo id) that proposes tokens for the model to check (speculative decoding, section 22)")
    add("--num-draft-tokens", type=number(int, "count"), metavar="N",
        help=f"tokens the draft proposes per round ({NUM_DRAFT_TOKENS}: docs/performance.md)")
    lab = ap.add_argument_group("experiments (README, Experiments)").add_argument
    lab("--top-probs", type=number(int, "top_probs"), metavar="N",
        help="print the N likeliest first tokens (at most 1000) and their probabilities")
    lab("--trace", action="store_true",
        help="narrate one forward pass over the prompt (shapes, sizes, logit lens); no reply")
    lab("--no-cache", action="store_true", help="recompute all tokens at every step (no KV cache)")
    lab("--no-compile", action="store_true",
        help="run silu_gate and filter_logits uncompiled (section 13), so print() works inside")
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
            ap.error(f"{flag} does not apply to --trace, which runs one pass and makes no reply")
    if args.draft_model and (args.no_cache or args.trace or args.presence_penalty):
        ap.error("--draft-model does not apply with --no-cache, --trace or --presence-penalty")
    clashes = [f"--{name.replace('_', '-')}" for name in ("prompt", "chat", "draft_model", "trace",
               "no_cache", "top_probs", "presence_penalty") if getattr(args, name) not in (None, 0)]
    if args.prompts is not None and clashes:  # False == 0: a store_true flag not given
        ap.error(f"--prompts does not apply with {', '.join(clashes)}")
    if args.system is not None:  # the same on every process: said once (section 20)
        args.system = as_text(args.system, "--system", SharedError)
    if args.chat and args.temperature == 0:
        print("warning: Qwen advises against greedy decoding (--temperature 0) in chat: in "
              "thinking mode it leads to endless repetition", file=sys.stderr)
    ignored = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "min_p", "seed")
               if getattr(args, name) is not None]
    if (args.temperature == 0 or args.temperature is None and not args.chat) and ignored:
        warn_ignored(ignored, "when sampling", "greedy decoding", "--temperature")
    if args.num_draft_tokens and not args.draft_model:
        warn_ignored(["--num-draft-tokens"], "with --draft-model", "a run without one",
                     "--draft-model")
    args.num_draft_tokens = args.num_draft_tokens or NUM_DRAFT_TOKENS
    return args


def warn_ignored(flags, when, run, flag):
    """A warning about flags this run ignores (bench.py's too): `flag` would make them count."""
    one = len(flags) == 1
    print(f"warning: {', '.join(flags)} only matter{'s' * one} {when}; {run} ignores "
          f"{'it' if one else 'them'} (add {flag})", file=sys.stderr)


class Default(int):
    """A number of tokens the user did not give: check_context says it is the default."""


def max_tokens(args, context):
    return args.max_tokens or Default(min(CHAT_MAX_TOKENS if args.chat else MAX_TOKENS,
                                          context // 2))


def sampling_settings(args, generation_config, sampling_type, group):
    """Flags, else Qwen's advice (--chat) or transformers' (greedy); a group, process 0's seed."""
    if args.chat:
        recommended = QWEN3_NO_THINK if args.no_think else QWEN3_THINKING | generation_config
    else:
        recommended = TRANSFORMERS_DEFAULTS | generation_config | {"temperature": 0.0}
    given = lambda name: recommended[name] if getattr(args, name) is None else getattr(args, name)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if group.size() > 1:
        seed = int(share(str(seed), group))
    sampling = sampling_type(float(given("temperature")), int(given("top_k")),
                             float(given("top_p")), seed)
    return sampling, float(given("min_p")), args.presence_penalty or 0.0


def describe(sampling, min_p, presence_penalty):
    """The sampling settings in the order they apply."""
    s = sampling
    how = f"presence penalty {presence_penalty}, " if presence_penalty else ""
    if s.temperature == 0:
        return how + "greedy"
    how += f"temperature {s.temperature}, top-k {s.top_k or 'off'}, top-p {s.top_p}"
    return how + (f", min-p {min_p}" if min_p else "") + f", seed {s.seed}"


def check_context(n_prompt, new_tokens, context, prompt, fix, error=SharedError):
    """Refuse a prompt of n_prompt tokens (called `prompt`) that new_tokens would overflow."""
    if n_prompt + new_tokens > context:
        default = isinstance(new_tokens, Default) and " (not given: its default" + (  # max_tokens
            ", half the context)" if new_tokens == context // 2 else ")")
        limit = (f"; with --max-tokens {new_tokens}{default or ''} that exceeds" if new_tokens
                 else ", more than")
        raise error(f"{prompt}{limit} the model's {context}-token context: {fix}")


def check_prompt(prompt_ids, config, max_new, trace, what="the prompt"):
    check_ids(prompt_ids, config)
    fix = "shorten it" + ("" if trace else " or lower --max-tokens")
    check_context(len(prompt_ids), 0 if trace else max_new, config.max_position_embeddings,
                  f"{what} has {plural(len(prompt_ids), 'token')}", fix)


# --- Terminal output: the header, a reply as it comes, tables, the statistics line -------------

def print_header(model_arg, model_dir, config, n, dtype, weights, how, max_tokens, prompt=None,
                 n_prompt=0):
    """Model: ..., an OpenBLAS hint, then Prompt: ..., or Chat: ... for a chat (prompt None)."""
    repo = model_arg and not Path(model_arg).exists() and repo_id(model_arg)
    folder = os.path.abspath(model_dir)  # a link named as given, not as its target
    c, matrices = config, [weights["embed_tokens"], weights["lm_head"],
                           *(w for layer in weights["layers"] for w in layer.values())]
    bits = "/".join(map(str, sorted({w.bits for w in matrices if hasattr(w, "bits")})))
    # The share of parameters quantized (section 16 leaves some); a tied head once, no norm vectors.
    size = lambda w: w.packed.size * 32 // w.bits if hasattr(w, "bits") else w.size
    matrices = [w for w in {id(w): w for w in matrices}.values()
                if hasattr(w, "bits") or getattr(w, "ndim", 0) > 1]
    share = sum(size(w) for w in matrices if hasattr(w, "bits")) / sum(map(size, matrices))
    share = math.floor(share * 1000) / 10  # 99.95 is not 100: rounded down
    print(f"Model: {repo or Path(folder).name} ({c.num_hidden_layers} layers, "
          f"{c.hidden_size} dim, {c.num_attention_heads * n} Q heads, {c.num_key_value_heads * n} "
          f"KV heads) on {'gpu' if mx.default_device() == mx.gpu else 'cpu'}"
          f"{f' x {n} processes' if n > 1 else ''}, {name_of(dtype)}"
          f"{f', {bits}-bit weights' if bits else ''}"
          f"{f' (partly quantized: {share}% of the parameters)' * (share < 100) if bits else ''}"
          f", from {'the Hugging Face cache' if repo else folder}", file=sys.stderr)
    if MLX_CPU_WHEEL and not OPENBLAS:
        print(OPENBLAS_HINT, file=sys.stderr)
    if prompt is None:
        print(f"Chat: {how}, up to {max_tokens} tokens per reply. {CHAT_HELP}.", file=sys.stderr)
    elif isinstance(prompt, list):  # --prompts
        print(f"Prompts: {len(prompt)} ({plural(n_prompt, 'token')}), {how}", file=sys.stderr)
    else:
        shortened = prompt if len(prompt) <= 60 else prompt[:60] + "…"  # a prompt may be a file
        how = f", {how}" if how else ""  # --trace draws nothing
        print(f"Prompt: {shown(shortened)} ({plural(n_prompt, 'token')}){how}", file=sys.stderr)


def rate(n, seconds):
    return f", {n / seconds:.1f} tok/s" if n > 0 and seconds > 0 else ""


def shown(text):
    """Text in quotes, escaped as Python does, but emoji whole (their zero-width joiners too)."""
    return repr(text).replace("\\u200d", "\u200d")


def columns(text):
    """The columns a terminal gives text: CJK characters take two, combining marks none."""
    return sum(0 if unicodedata.category(ch) in ("Mn", "Me", "Cf")
               else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def pad(text, width):
    """text and the spaces that fill `width` columns of a terminal (f"{text:<16}" counts chars)."""
    return text + " " * (width - columns(text))


# GPT-2's byte-level alphabet, which Qwen's tokenizer.json uses: byte b is written as chr(b) when
# that is printable, else as chr(256 + k), for the k-th of the other bytes.
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
BYTE_OF = {chr(c): b for b, c in zip(PRINTABLE + [b for b in range(256) if b not in PRINTABLE],
                                     PRINTABLE + [256 + k for k in range(256 - len(PRINTABLE))])}
# A token's columns (at least) in --top-probs and --trace: <0xF0><0x9F><0x98> fits; 855 are wider.
TOKEN_COLUMNS = 18


def piece(tokenizer, token_id):
    """A token as shown(): its text, <0xEF> per byte of a split character, or <unused id>."""
    if tokenizer.id_to_token(token_id) is None:
        return "<unused id>"
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return shown(text)
    raw = bytes(BYTE_OF.get(ch, 63) for ch in tokenizer.id_to_token(token_id) or "")
    parts = re.split(r"([\udc80-\udcff]+)", raw.decode("utf-8", "surrogateescape"))
    return "".join("".join(f"<0x{ord(ch) - 0xDC00:02X}>" for ch in part) if i % 2 else
                   shown(part) if part else "" for i, part in enumerate(parts))


def print_top_probs(logits, tokenizer, n, file=None, drawn=None):
    """The n likeliest next tokens and their probabilities; with drawn(logits), a draw's too."""
    file = file or sys.stderr
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    chance = mx.softmax(drawn(logits), axis=-1) if drawn else None
    tokens = {i: piece(tokenizer, i) for i in mx.argsort(-probs)[:min(n, probs.size)].tolist()}
    width = max(TOKEN_COLUMNS, *map(columns, tokens.values()))  # wider for a long token
    print(f"{'rank':>4}  {pad('token', width)} {'id':>7}  probability" + "  sampled" * bool(drawn),
          file=file)
    for rank, (token_id, token) in enumerate(tokens.items(), 1):
        print(f"{rank:>4}  {pad(token, width)} {token_id:>7}  {probs[token_id].item():.4f}" +
              (f"  {chance[token_id].item():9.4f}" if drawn else ""), file=file)


class TracePrinter:
    """--trace's output (llm_inference.trace computes what it shows)."""

    def __init__(self, tokenizer, prompt_ids):
        self.tokenizer = tokenizer
        some = lambda items: " ".join(items[:16]) + (f" … ({len(items)})" * (len(items) > 16))
        print(f"tokens: {len(prompt_ids)} ids {some([str(i) for i in prompt_ids])}\n"
              f"        {some([piece(tokenizer, i) for i in prompt_ids])}\nblock 0, step by step:")

    shape = staticmethod(lambda a: f"{tuple(a.shape)} {name_of(a.dtype)}")  # "(5, 1024) float32"

    def step(self, name, out, what):
        outs = out if isinstance(out, tuple) else (out,)
        print(f"  {name:<26} -> {', '.join(map(self.shape, outs))}  ({what})")
        return out

    def lens_intro(self, pick, tied):
        print(f"after each block: the residual stream's size (RMS) and its logit lens: the "
              f"likeliest next token if the model stopped there, and the rank there of "
              f"{piece(self.tokenizer, pick)}, the final pick." + (" Early blocks often show the "
              "last prompt token: the tied LM head reads its embedding back as it." * tied))

    def block(self, i, x, rms, top, p_top, pick, rank):
        print(f"block {i:>2} done: residual stream {self.shape(x)}, RMS {rms:.3f}, lens: "
              f"{pad(piece(self.tokenizer, top), TOKEN_COLUMNS)} {p_top:.3f}, "
              f"{piece(self.tokenizer, pick)} #{rank}")

    def final(self, logits):
        print(f"final RMSNorm + LM head -> logits {self.shape(logits)}; next-token probabilities:")
        print_top_probs(logits, self.tokenizer, 5, file=sys.stdout)


class ReplyPrinter:
    """A reply on stdout as it comes; on a terminal, <think>... dimmed or (hide_think) counted."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, tokenizer, text_stream, hide_think):
        self.hide_think = hide_think
        self.think_ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        self.colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ  # no-color.org
        self.progress = hide_think and sys.stderr.isatty()
        self.text = text_stream(tokenizer)  # llm_inference.text_stream: whole characters only
        self.thinking, self.n_thinking, self.n_tokens = False, 0, 0
        self.answer_started = False  # for hide_think: the newlines after </think> are dropped

    def add(self, token_id):
        self.n_tokens += 1
        piece = self.text(token_id)
        # With hide_think, <think>, what follows it and </think> print nothing.
        hidden = self.hide_think and (self.thinking or token_id == self.think_ids[0])
        if token_id == self.think_ids[self.thinking]:  # <think> opens, </think> closes
            self.thinking = not self.thinking
            self.show_progress(clear=True)
            if self.colour and not self.hide_think:
                piece = self.DIM + piece if self.thinking else piece + self.PLAIN
        elif self.thinking:
            self.n_thinking += 1
            self.show_progress()
        elif self.hide_think and not self.answer_started:
            piece = piece.lstrip("\n")
            self.answer_started = bool(piece)
        print("" if hidden else piece, end="", flush=True)

    def show_progress(self, clear=False):
        if self.progress and self.n_thinking:
            sys.stderr.write("\r\x1b[K" if clear else f"\rthinking… ({self.n_thinking} tokens)")
            sys.stderr.flush()

    def finish(self):
        if self.thinking:
            self.show_progress(clear=True)
            sys.stdout.write(self.PLAIN if self.colour and not self.hide_think else "")
        print(flush=True)


def check_logits(logits):
    if not mx.all(mx.isfinite(logits)).item():
        raise UserError("the model computed NaN or infinite logits: float16 overflows with Qwen3 "
                        "(try --dtype bfloat16 or float32), or the weights hold NaN (re-download)")


class Prefill:
    """generate_long's progress (show) on stderr; the time that takes (`spent`) goes untimed."""

    PROGRESS_AFTER = 2.0

    def start(self):
        self.began, self.spent, self.last = time.perf_counter(), 0.0, None

    def show(self, done, total, what="prefill: {}/{} tokens", n_tokens=None):
        now = time.perf_counter()
        seconds = now - self.began - self.spent
        if seconds >= self.PROGRESS_AFTER and (self.last is None or now - self.last >= 1 or
                                               sys.stderr.isatty()):
            line = f"{what.format(done, total)}, {(n_tokens or done) / seconds:.0f} tok/s"
            sys.stderr.write(f"\r\x1b[K{line}" if sys.stderr.isatty() else f"{line}\n")  # redrawn
            sys.stderr.flush()
            self.last = now
        self.spent += time.perf_counter() - now

    def finish(self):
        if self.last is not None and sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")  # the reply takes the line's place


PREFILL = Prefill()


def stream(tokens, printer, on_first_logits=None):
    """Print tokens to the end or Ctrl-C: (interrupted, prefill s, decode s), less untimed work."""
    PREFILL.start()
    start = first = time.perf_counter()
    interrupted, untimed = False, 0.0
    try:
        for token_id, logits in tokens:
            if printer.n_tokens == 0:
                first = time.perf_counter()
                PREFILL.finish()
                check_logits(logits)  # once: no cost per token
                if on_first_logits:
                    on_first_logits(logits)
                    untimed = time.perf_counter() - first
            printer.add(token_id)  # <|im_end|> prints nothing
    except KeyboardInterrupt:
        interrupted = True
        first = first if printer.n_tokens else time.perf_counter()  # in the prefill: it ran to now
        # generate() queues the next step before yielding a token: let it finish before the program
        # exits or goes on (quitting with GPU work queued has crashed other MLX programs).
        mx.synchronize()
    finally:
        tokens.close()  # for Chat.reply: the (partial) reply joins the history now
    end = time.perf_counter()
    printer.finish()
    return interrupted, first - start - PREFILL.spent, end - first - untimed


def complete_batch(tokens, prompts, tokenizer, text_stream, max_tokens, eos_ids):
    """A JSON line per prompt on stdout, in the file's order; progress and statistics on stderr."""
    replies, ended, printed, n = [[] for _ in prompts], set(), 0, 0
    PREFILL.start()  # its progress line, here the prompts done
    try:
        for n, (i, token_id) in enumerate(tokens, 1):
            replies[i].append(token_id)
            if token_id in eos_ids or len(replies[i]) == max_tokens:
                ended.add(i)
                PREFILL.finish()  # on a terminal, lines go where the progress line was
                while printed in ended:  # in order: a prompt ended early waits for those before
                    ids, text = replies[printed], text_stream(tokenizer)
                    reply = {"prompt": prompts[printed], "text": "".join(map(text, ids)),
                             "tokens": len(ids), "finish_reason": "stop" if ids[-1] in eos_ids
                             else "length"}  # one write below: a line is whole or absent
                    print(json.dumps(reply, ensure_ascii=False) + "\n", end="", flush=True)
                    printed += 1
                PREFILL.show(len(ended), len(prompts), "prompts: {}/{} done", n)
    finally:  # after Ctrl-C too, before run() says "Interrupted." and exits with 130
        seconds = time.perf_counter() - PREFILL.began
        PREFILL.finish()
        print(f"Prompts: {printed} of {len(prompts)} printed | Generated: {plural(n, 'token')}"
              f"{rate(n, seconds)} | Time: {seconds:.2f} s | Peak memory: "
              f"{mx.get_peak_memory() / 1e9:.2f} GB", file=sys.stderr)
    return 0


def drafted(rounds, n):
    """' | Draft: 40/48 accepted (83%), ...' for n tokens and a draft model's rounds, else ''."""
    if not rounds:
        return ""
    accepted, proposed = map(sum, zip(*rounds))
    return (f" | Draft: {accepted}/{proposed} accepted ({accepted / proposed:.0%}), "
            f"{(n - 1) / len(rounds):.2f} tokens per target pass")  # the first: the prefill's


def complete(tokens, tokenizer, text_stream, args, n_prompt, drawn=None, rounds=None):
    """Print a completion as it comes (and --top-probs' table), then the statistics; exit code."""
    printer = ReplyPrinter(tokenizer, text_stream, args.hide_think)
    top_probs = args.top_probs and (lambda logits: print_top_probs(
        logits, tokenizer, args.top_probs, drawn=drawn))
    interrupted, prefill_s, decode_s = stream(tokens, printer, top_probs)
    n = printer.n_tokens
    print(f"{'Interrupted. ' if interrupted else ''}Prompt: {plural(n_prompt, 'token')}"
          f"{rate(n_prompt if n else 0, prefill_s)} | Generated: {plural(n, 'token')}"
          f"{rate(n - 1, decode_s)} | Prefill + decode: {prefill_s + decode_s:.2f} s | "
          f"Peak memory: {mx.get_peak_memory() / 1e9:.2f} GB{drafted(rounds, n)}",
          file=status(interrupted))
    return 130 if interrupted else 0


# --- Chat: reading messages, and the loop ---------------------------------------------------------

CHAT_HELP = ('/reset (or /clear) starts over; /exit (/quit, /bye, Ctrl-D) ends; /help shows this; '
             'Ctrl-C stops a reply; """ on a line of its own starts and ends a message of several '
             'lines, Ctrl-D inside one cancels it')
COMMANDS = {"/exit": "exit", "/quit": "exit", "/bye": "exit", "/reset": "reset",
            "/clear": "reset", "/help": "help", "/?": "help"}


def read_line(interactive, prompt):
    """A line of input, None at its end; on a terminal with input()'s editing (readline)."""
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


def read_message(interactive, group=None):
    """The next message (a line, or lines between two of triple quotes), as process 0 reads it."""
    if group and group.rank() > 0:
        return share(None, group)
    line = read_line(interactive, ">>> ")
    if line is not None and line.strip() == '"""':
        lines, error = [], None
        while True:
            try:
                line = read_line(interactive, "... ")
            except UserError as e:  # a bad line spoils the message: read on to its end, then say
                error, line = e, ""
            if line is None or line.strip() == '"""':
                break
            lines.append(line)
        if line is None:  # Ctrl-D (the input's end) before the closing """
            print("(message cancelled)", file=sys.stderr)
            lines = []
        elif error:
            raise error
        line = "\n".join(lines)
    return share(line, group) if group and group.size() > 1 else line


def make_room(chat, message, max_tokens):
    """Forget the oldest turns until the conversation, the message and a whole reply fit; say so."""
    context, turns, dropped = chat.config.max_position_embeddings, chat.turns, 0
    ids = chat.prompt_ids(message)
    check_ids(ids, chat.config)
    n_prompt = len(ids)
    try:
        while n_prompt + max_tokens > context and dropped < len(turns):
            dropped += 1
            chat.turns = turns[dropped:]  # the cache rolls back to the system message
            n_prompt = len(chat.prompt_ids(message))
        check_context(n_prompt, max_tokens, context,
                      f"this message makes a {n_prompt}-token prompt", "shorten it", UserError)
    except BaseException:  # refused, or Ctrl-C while counting: the earlier turns stay
        chat.turns = turns
        raise
    if dropped:
        print(f"(the conversation outgrew the {context}-token context: forgot the oldest "
              f"{plural(dropped, 'turn')})", file=sys.stderr)


def check_chat_room(n_format, max_tokens, context, system):
    extra = " and --system" * bool(system)
    check_context(n_format + 1, max_tokens, context,  # + 1: a message adds at least one token
                  f"the chat format{extra} takes {n_format} tokens, and a message at least one",
                  f"lower --max-tokens{' or shorten --system' * bool(system)}")


def chat_loop(chat, text_stream, max_tokens, sampling, eos_ids, hide_think, new_reply=lambda: None,
              group=None, rounds=None):
    """Talk until the input ends or /exit; new_reply() runs before each reply (section 17)."""
    interactive = sys.stdin.isatty()
    if interactive:
        if hasattr(sys.stdin, "reconfigure"):  # bytes not UTF-8 then reach as_text: one line
            sys.stdin.reconfigure(errors="surrogateescape")
        with contextlib.suppress(ImportError):  # not on every platform; input() works without
            import readline  # noqa: F401 (importing it is what gives input() editing and history)
    turn = 0
    while True:
        try:
            message = read_message(interactive, group)
            command = "/exit" if message is None else message.strip().lower()
            if re.fullmatch(r"/[a-z?]+", command):  # a command, not a message
                action = COMMANDS.get(command)
                if action == "exit":
                    return 0
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
            if group and group.size() > 1:  # the others wait in step: the chat ends (join)
                return 130
            continue
        except UserError as e:  # a bad message is skipped; the chat goes on
            print(f"error: {e}", file=sys.stderr)
            continue
        n_turns, printer = len(chat.turns), ReplyPrinter(chat.tokenizer, text_stream, hide_think)
        new_reply()
        interrupted, prefill_s, decode_s = stream(
            chat.reply(message, max_tokens, sampling, eos_ids, PREFILL.show), printer)
        if len(chat.turns) == n_turns:  # Ctrl-C before the reply began: nothing happened
            print("Interrupted.", file=status(True))
        elif interrupted and not chat.turns[-1][1]:  # in the prefill: as if never sent
            chat.turns.pop()  # the cache keeps what it computed: sent again, the prefill resumes
            done = len(chat.cached_ids) - chat.reused  # the planned chat.prefilled, if all ran
            print(f"Interrupted. {done} of {chat.prefilled} tokens prefilled{rate(done, prefill_s)}"
                  " | The message is left out of the conversation", file=status(True))
        else:
            turn += 1
            n = len(chat.turns[-1][1])  # the reply as the history keeps it (without <|im_end|>)
            prefill = chat.prefilled / prefill_s if printer.n_tokens else 0.0
            thinking = f", {printer.n_thinking} thinking" if printer.n_thinking else ""
            print(f"{'Interrupted. ' if interrupted else ''}Turn {turn}: {chat.reused} tokens "
                  f"reused from the cache, {chat.prefilled} prefilled at {prefill:.1f} tok/s | "
                  f"Reply: {plural(n, 'token')}{thinking}{rate(printer.n_tokens - 1, decode_s)}"
                  f"{drafted(rounds, printer.n_tokens)}", file=status(interrupted))
        if interrupted and group and group.size() > 1:  # the others wait in step: the chat ends
            return 130


# --- Several processes (mlx.launch, section 20): process 0 reads the input and prints ------------

AFTER_CTRL_C = None  # process 0's terminal, under mlx.launch (join)


def share(text, group):
    """Process 0's text (None: end of input) on every process: all_sum adds zeros to its bytes."""
    first = group.rank() == 0
    data = (text or "").encode("utf-8", "surrogateescape") if first else b""
    length = mx.array(len(data) + 1 if first and text is not None else 0)  # 0 stands for None
    length = mx.distributed.all_sum(length, group=group).item()
    if length == 0:
        return None
    data = mx.array(list(data), mx.uint8) if first else mx.zeros(length - 1, mx.uint8)
    return bytes(mx.distributed.all_sum(data, group=group).tolist()).decode("utf-8",
                                                                           "surrogateescape")


def status(interrupted):
    """stderr, or after Ctrl-C under mlx.launch (it stops passing output on) the terminal."""
    if interrupted and AFTER_CTRL_C:
        AFTER_CTRL_C.write("\n")  # the reply's last newline went to stdout, never passed on
        return AFTER_CTRL_C
    return sys.stderr


def join(group):
    """Process 0 reads the input, prints for all and takes Ctrl-C; the others print errors only."""
    global AFTER_CTRL_C
    if group.rank() == 0:
        with contextlib.suppress(OSError):  # no terminal (ssh, a pipe): stderr it is
            AFTER_CTRL_C = open("/dev/tty", "w")
    else:  # its own errors go to a copy of stderr; the rest, MLX's too, nowhere
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.__stderr__ = os.fdopen(os.dup(2), "w", buffering=1)
        for fd in (1, 2):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


# --- The top level: each expected failure one line, with an exit code -----------------------------

def run(main):
    """sys.exit(main()), with a UserError, Ctrl-C, a closed pipe or a full disk as one line."""
    try:
        if sys.stdout is None:  # closed (>&-)
            raise UserError("standard output is closed: nowhere to write the text")
        if sys.stdin is None:  # closed (<&-): read as empty. /dev/null also fills descriptor 0,
            sys.stdin = open(os.devnull)  # where MLX would take a weight file it opens.
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
    except ModuleNotFoundError as e:  # huggingface_hub, imported where first needed
        if e.name not in RUNTIME:
            raise
        sys.exit(NOT_INSTALLED % ("llm_inference.py", e.name))
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        mx.synchronize()  # nothing left queued on the GPU at exit, as after Ctrl-C in stream()
        print("\nInterrupted.", file=status(True))
        sys.exit(130)
    except OSError as e:  # writing failed: the reader went away (`... | head`), or a full disk
        if not isinstance(e, BrokenPipeError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush can't fail
        if isinstance(e, BrokenPipeError):  # stop quietly, as Unix tools do
            sys.exit(141)
        print(f"llm_inference.py: error: cannot write the text: {e.strerror}", file=sys.stderr)
        sys.exit(1)
