"""The whole model against mlx-lm on the same checkpoint, the KV cache against recomputation, and sampling."""

import io
import json
import os
import shutil
import subprocess
import sys
import types

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG, write_checkpoint, load_model, weight_bytes
from tests.kernels import kernels

CONFIGS = {  # name: (config overrides, number of weight files: 1 = model.safetensors, else shards)
    "tied": (TINY_CONFIG, 1),
    "untied-3-shards": (TINY_CONFIG | {"tie_word_embeddings": False}, 3),
    "8q-2kv-2-shards": (TINY_CONFIG | {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                                       "num_hidden_layers": 3}, 2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, checkpoints):  # built once per session (tests/conftest.py)
    overrides, shards = CONFIGS[request.param]
    folder = checkpoints(overrides, seed=1, shards=shards)
    config = li.load_config(folder)
    return folder, config, li.load_weights(folder, config, mx.float32), li.load_tokenizer(folder)


def stored_tensors(folder):
    """Every tensor of every *.safetensors file in the folder, by name."""
    files = sorted(folder.glob("*.safetensors"))
    return {name: tensor for path in files for name, tensor in mx.load(str(path)).items()}


def test_weights_are_held_per_layer_under_short_names(checkpoint):
    folder, config, weights, _ = checkpoint
    stored = stored_tensors(folder)
    assert len(weights["layers"]) == config.num_hidden_layers
    names = li.layer_shapes(config)  # checkpoint names after "model.layers.{i}."
    assert {name.split(".")[-2] for name in names} == {  # the short names, one per tensor
        "input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
        "post_attention_layernorm", "gate_proj", "up_proj", "down_proj"}
    for i, layer in enumerate(weights["layers"]):
        assert set(layer) == {name.split(".")[-2] for name in names}
        for name, shape in names.items():
            short = name.split(".")[-2]
            assert layer[short].shape == shape
            assert mx.array_equal(layer[short], stored[f"model.layers.{i}.{name}"].astype(mx.float32))
    assert mx.array_equal(weights["norm"], stored["model.norm.weight"].astype(mx.float32))
    if config.tie_word_embeddings:
        assert weights["lm_head"] is weights["embed_tokens"]  # the same array, not a copy
    else:
        assert mx.array_equal(weights["lm_head"], stored["lm_head.weight"].astype(mx.float32))


@pytest.fixture(scope="module")
def mlx_lm_model(checkpoint):
    # mlx_lm.load without the tokenizer it would also load (seconds), which these tests do not use.
    model, _ = mlx_lm_load_model(checkpoint[0])
    model.set_dtype(mx.float32)
    return model


PROMPT = "The capital of France is Paris, and the capital of Italy is"


def tokens(generator):
    return [token for token, _ in generator]


@pytest.mark.parametrize("fused", [True, False])
def test_logits_match_mlx_lm(checkpoint, mlx_lm_model, fused):
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    theirs = mlx_lm_model(mx.array(ids)[None])[0]  # (seq, vocab)
    with kernels(fused):
        ours_all = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
        ours_last = li.forward(mx.array(ids), weights, config, li.make_cache(config))
    assert ours_all.shape == (len(ids), config.vocab_size) and ours_last.shape == (config.vocab_size,)
    assert float(theirs.abs().max()) > 1  # logits of healthy scale, so 1e-4 is a tight bound
    assert float(mx.abs(ours_all - theirs).max()) < 1e-4
    assert float(mx.abs(ours_last - theirs[-1]).max()) < 1e-4


@pytest.mark.parametrize("fused", [True, False])
def test_greedy_continuation_matches_mlx_lm(checkpoint, mlx_lm_model, fused):
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    with kernels(fused):
        ours = tokens(li.generate(ids, weights, config, max_tokens=40))
    theirs = [t for t, _ in generate_step(mx.array(ids), mlx_lm_model, max_tokens=40)]
    assert len(set(ours)) > 3  # a continuation that varies, so a divergence would show
    assert ours == theirs


@pytest.mark.parametrize("fused", [True, False])
def test_bfloat16_logits_close_to_mlx_lm(checkpoint, fused):
    folder, config, _, tokenizer = checkpoint
    weights = li.load_weights(folder, config, mx.bfloat16)
    model, _ = mlx_lm_load_model(folder)  # bfloat16, as stored
    ids = mx.array(tokenizer.encode(PROMPT).ids)
    theirs = model(ids[None])[0, -1].astype(mx.float32)
    with kernels(fused):
        ours = li.forward(ids, weights, config, li.make_cache(config)).astype(mx.float32)
    # Two bfloat16 implementations round differently; they must still agree to ~1% of the logits' range.
    assert float(mx.abs(ours - theirs).max()) < 0.02 * float(theirs.abs().max())
    assert int(mx.argmax(ours)) == int(mx.argmax(theirs))


@pytest.mark.parametrize("fused", [True, False])
def test_cached_decoding_equals_recomputing(checkpoint, fused):
    """Prefill 250 tokens, then decode 20 one at a time across the 256-position chunk boundary: each step's
    logits must equal those of running the whole sequence from scratch without reusing anything.

    Both passes score the first 4096 tokens of the vocabulary only (the LM head's first rows): the
    head is the same matrix product at every position, cached or not, and all 151936 rows over
    270 positions made the whole-sequence pass 90% of the test's time (2.5 s of 2.7)."""
    folder, config, weights, _ = checkpoint
    weights = weights | {"lm_head": weights["lm_head"][:4096]}
    ids = mx.random.randint(0, config.vocab_size, (270,), key=mx.random.key(5))
    with kernels(fused):
        full = li.forward(ids, weights, config, li.make_cache(config), last_only=False)
        cache = li.make_cache(config)
        li.forward(ids[:250], weights, config, cache)
        for i in range(250, 270):
            step = li.forward(ids[i : i + 1], weights, config, cache)
            assert float(mx.abs(step - full[i]).max()) < 1e-4, f"position {i}"
    assert all(c.offset == 270 and c.keys.shape[-2] == 2 * li.KVCache.GROWTH for c in cache)


def pieces_of(monkeypatch, n):
    """Prefill pieces of n tokens, however long a layer takes (section 14 sizes them by time), for
    a prompt of any length (no SHORT_PROMPT)."""
    monkeypatch.setattr(li, "PREFILL_CHUNK", n)
    monkeypatch.setattr(li, "LAYER_SECONDS", 10**6)
    monkeypatch.setattr(li, "FIRST_GUESS", 10**9)
    monkeypatch.setattr(li, "layer_tokens", {})
    monkeypatch.setattr(li, "SHORT_PROMPT", 0)


@pytest.mark.parametrize("fused", [True, False])
def test_chunked_prefill_gives_the_same_tokens(checkpoint, monkeypatch, fused):
    folder, config, weights, _ = checkpoint
    prompt = mx.random.randint(0, config.vocab_size, (50,), key=mx.random.key(6)).tolist()
    with kernels(fused):
        whole = tokens(li.generate(prompt, weights, config, max_tokens=10))
        # one piece
        assert tokens(li.generate_long(prompt, weights, config, max_tokens=10)) == whole
        pieces_of(monkeypatch, 16)  # 50 = 16 + 16 + 16 + 2
        assert tokens(li.generate_long(prompt, weights, config, max_tokens=10)) == whole
        monkeypatch.setattr(li, "LAYER_SECONDS", 0)  # then pieces of one token, as on a slow device
        assert tokens(li.generate_long(prompt, weights, config, max_tokens=10)) == whole


def test_generate_stops_at_end_of_sequence(checkpoint):
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    free = tokens(li.generate(ids, weights, config, max_tokens=12))
    stop = free[5]
    stopped = tokens(li.generate(ids, weights, config, max_tokens=12, eos_ids={stop}))
    assert stopped == free[: free.index(stop) + 1]  # the end-of-sequence token is yielded, then it stops
    assert li.load_eos_ids(folder, tokenizer) == {151643, 151645}


@pytest.mark.parametrize("generation_config", [None, {"eos_token_id": 151643},
                                               {"eos_token_id": None}, {"eos_token_id": [7, 8]}])
def test_end_of_sequence_ids_come_from_generation_config(reference, tmp_path, generation_config):
    """A missing file, one id or none: <|im_end|> and <|endoftext|> still end a reply."""
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    listed = (generation_config or {}).get("eos_token_id") or []
    expected = {151643, 151645} | set(listed if isinstance(listed, list) else [listed])
    assert li.load_eos_ids(tmp_path, reference.tokenizer) == expected


def test_text_stream_holds_a_split_character_until_it_is_whole(reference):
    tokenizer = reference.tokenizer
    ids = li.tokenize(tokenizer, "Parrot:🦜, 龘.<|im_end|>")
    # 🦜 is two tokens, and 龘 (after a space) three: each alone decodes to "�".
    assert ids == [4272, 4640, 25, 123918, 250, 11, 18137, 122, 246, 13, 151645]
    text = li.text_stream(tokenizer)
    pieces = [text(token_id) for token_id in ids]
    assert pieces == ["Par", "rot", ":", "", "🦜", ",", "", "", " 龘", ".", ""]  # no <|im_end|>
    assert li.detokenize(tokenizer, ids).endswith("龘.<|im_end|>")


def test_tokenize_and_chat_tokens(checkpoint):
    tokenizer = checkpoint[3]
    assert li.tokenize(tokenizer, "The capital of France is") == [785, 6722, 315, 9625, 374]
    ids = li.tokenize(tokenizer, li.chat_prompt("Hi", think=False))
    assert ids[0] == 151644 and 151645 in ids and ids[-4:] == [151667, 271, 151668, 271]


def test_seeded_sampling_reproduces(checkpoint):
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    run = lambda seed: tokens(li.generate(ids, weights, config, 16, li.Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=seed)))
    first = run(3)
    assert run(3) == first
    assert run(4) != first


# ---- sample() on a small known distribution --------------------------------------------------------

PROBS = np.array([0.05, 0.4, 0.02, 0.3, 0.2, 0.03])  # token 1 most likely, then 3, 4, 5, 0, 2
LOGITS = mx.array(np.log(PROBS), dtype=mx.float32)


def draw(n, **kw):
    keys = mx.random.split(mx.random.key(0), n)
    return np.array([li.sample(LOGITS, li.Sampling(**kw), keys[i]).item() for i in range(n)])


def test_greedy_is_argmax():
    logits = mx.random.normal((1000,), key=mx.random.key(1))
    assert li.sample(logits, li.Sampling(), mx.random.key(0)).item() == int(np.argmax(np.array(logits)))


@pytest.mark.parametrize(
    "top_k,top_p,kept",
    [
        (0, 1.0, {0, 1, 2, 3, 4, 5}),
        (2, 1.0, {1, 3}),
        (3, 1.0, {1, 3, 4}),
        (0, 0.35, {1}),  # the most likely token alone (0.4) already reaches 0.35
        (0, 0.5, {1, 3}),  # 0.4 < 0.5, so token 3 crosses the threshold and is kept
        (0, 0.75, {1, 3, 4}),
        (0, 0.91, {1, 3, 4, 0}),
        (2, 0.5, {1}),  # top-p acts after top-k, on the renormalised {1: 0.57, 3: 0.43}, as in transformers
        (2, 0.6, {1, 3}),
        (3, 0.95, {1, 3, 4}),
    ],
)
def test_top_k_top_p_keep_exactly_the_right_tokens(top_k, top_p, kept):
    samples = draw(3000, temperature=1.0, top_k=top_k, top_p=top_p)
    assert set(samples.tolist()) == kept
    # Frequencies follow the kept tokens' probabilities, renormalised (5 standard deviations of slack).
    expected = np.array([PROBS[t] if t in kept else 0 for t in range(len(PROBS))])
    expected /= expected.sum()
    freq = np.bincount(samples, minlength=len(PROBS)) / len(samples)
    assert np.all(np.abs(freq - expected) <= 5 * np.sqrt(expected * (1 - expected) / len(samples)) + 1e-9)


@pytest.mark.parametrize("temperature", [0.3, 3.0])
def test_temperature_reshapes_the_distribution(temperature):
    """Sampling at temperature T draws from softmax(logits / T), i.e. probabilities ~ p^(1/T)."""
    samples = draw(3000, temperature=temperature, top_k=0, top_p=1.0)
    expected = PROBS ** (1 / temperature) / (PROBS ** (1 / temperature)).sum()
    freq = np.bincount(samples, minlength=len(PROBS)) / len(samples)
    assert np.all(np.abs(freq - expected) <= 5 * np.sqrt(expected * (1 - expected) / len(samples)) + 1e-9)


def test_each_sampled_token_uses_a_fresh_split_key(tiny):
    """Bug: generate() drew with the carried key instead of the one split off for the step."""
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    sampling = li.Sampling(temperature=1.0, seed=11)
    prompt = li.tokenize(li.load_tokenizer(tiny), "The capital of France is")
    got = [t for t, _ in li.generate(prompt, weights, config, 12, sampling)]
    ids, key, expected = list(prompt), mx.random.key(11), []
    for _ in range(12):  # the whole sequence again at every step: no cache to get wrong
        logits = li.forward(mx.array(ids), weights, config, li.make_cache(config))
        key, pick = mx.random.split(key)
        expected.append(mx.random.categorical(li.filter_logits(logits, sampling), key=pick).item())
        ids.append(expected[-1])
    assert got == expected


def test_top_p_drops_a_token_whose_preceding_mass_equals_top_p():
    """Bug: top-p kept a token when the mass before it was exactly top_p (<= instead of <)."""
    logits = mx.array([3.0, 2.0, 1.0, 0.5, 0.0])
    probs = mx.softmax(logits)
    before = (mx.cumsum(probs) - probs)[2].item()  # the exact float32 mass before the third token
    kept = li.filter_logits(logits, li.Sampling(temperature=1.0, top_p=before)) > -mx.inf
    assert kept.tolist() == [True, True, False, False, False]


def test_compiled_filter_logits_follows_each_new_sampling():
    """Section 13's compiled filter_logits keeps the tokens Part 1's keeps, with the same logits,
    for Samplings that change from call to call: each is a new trace, not the first one replayed."""
    logits = mx.random.normal((1000,), key=mx.random.key(2)) * 3
    for kw in [dict(top_p=0.5), dict(temperature=0.6, top_k=20, top_p=0.95), dict(top_p=0.5),
               dict(temperature=2.0, top_k=5), dict(top_k=999, top_p=0.99)]:
        sampling = li.Sampling(**{"temperature": 1.0} | kw)
        compiled = li.compiled_filter_logits(logits, sampling)
        plain = li.filter_logits(logits, sampling)
        kept = plain > -mx.inf
        assert (compiled > -mx.inf).tolist() == kept.tolist(), kw
        assert mx.allclose(mx.where(kept, compiled, 0), mx.where(kept, plain, 0)), kw


def test_compiled_filter_logits_takes_any_seed():
    """Bug: the seed, which filter_logits never reads, went into mx.compile's trace, and a seed
    from 2**63 on crashed it (cli.py takes seeds up to 2**64 - 1)."""
    logits = mx.random.normal((1000,), key=mx.random.key(3))
    sampling = li.Sampling(temperature=0.7, top_p=0.9)
    expected = li.filter_logits(logits, sampling)
    kept = expected > -mx.inf
    for seed in (0, 5, 2**63, 2**64 - 1):
        got = li.compiled_filter_logits(logits, sampling._replace(seed=seed))
        assert (got > -mx.inf).tolist() == kept.tolist()
        assert mx.allclose(mx.where(kept, got, 0), mx.where(kept, expected, 0))


@pytest.mark.parametrize("fused", [True, False])
def test_without_the_cache_the_tokens_and_logits_are_the_same(checkpoint, fused):
    """--no-cache recomputes the whole sequence at every step: slower, but the very same results."""
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    with kernels(fused):
        cached = list(li.generate(ids, weights, config, max_tokens=12))
        recomputed = list(li.generate_without_cache(ids, weights, config, max_tokens=12))
    assert [t for t, _ in recomputed] == [t for t, _ in cached]
    for (_, a), (_, b) in zip(cached, recomputed):
        assert float(mx.abs(a - b).max()) < 1e-4


def test_generate_yields_the_logits_each_token_was_sampled_from(checkpoint):
    folder, config, weights, tokenizer = checkpoint
    ids = tokenizer.encode(PROMPT).ids
    (first, logits), (second, _) = li.generate(ids, weights, config, max_tokens=2)
    expected = li.forward(mx.array(ids), weights, config, li.make_cache(config))
    assert float(mx.abs(logits - expected).max()) < 1e-4 and first == int(mx.argmax(expected))


def test_loading_float32_keeps_the_peak_near_the_weights(tmp_path):
    """The file holds bfloat16; converting one tensor at a time means the bfloat16 copy of everything
    never sits beside the float32 one (that would peak at 1.5x the float32 weights)."""
    small_vocab = TINY_CONFIG | {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768,
                                 "num_hidden_layers": 6, "head_dim": 64}
    folder = write_checkpoint(tmp_path / "m", small_vocab)
    config = li.load_config(folder)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    weights = li.load_weights(folder, config, mx.float32)
    peak = mx.get_peak_memory() - base
    f32_bytes = sum(w.nbytes for w in [weights["embed_tokens"], weights["norm"]]
                    + [w for layer in weights["layers"] for w in layer.values()])
    assert peak < 1.15 * f32_bytes, f"peak {peak / f32_bytes:.2f}x the float32 weights"


def test_weight_bytes_counts_every_tensor_once(checkpoint):
    folder, config, weights, _ = checkpoint
    loaded = {id(w): w for w in [weights["embed_tokens"], weights["norm"], weights["lm_head"],
                                 *(w for layer in weights["layers"] for w in layer.values())]}
    float32_bytes = sum(w.nbytes for w in loaded.values())  # the tied head is the embedding: once
    assert weight_bytes(config, mx.float32) == float32_bytes
    assert weight_bytes(config, mx.bfloat16) == float32_bytes // 2


def test_memory_check_refuses_only_what_does_not_fit():
    cli.check_memory(8 * 10**9, 8 * 10**9, mx.bfloat16)  # exactly fits: runs
    with pytest.raises(cli.UserError, match=r"need 8\.0 GB as bfloat16, but this machine has "
                                           r"7\.9 GB of memory available; "
                                           r"try --quantize 4, or a smaller model"):
        cli.check_memory(8 * 10**9, 7.9e9, mx.bfloat16)
    with pytest.raises(cli.UserError, match=r"16\.4 GB as float32.*try --dtype bfloat16 \(half the bytes\), --quantize 4"):
        cli.check_memory(16.4e9, 8e9, mx.float32)


def test_the_memory_check_counts_an_untied_head(checkpoints, monkeypatch):
    """Bug: main()'s memory check counted an untied model as tied, leaving out its LM head (1.24 GB
    for Qwen3-8B in bfloat16)."""
    folder = checkpoints(TINY_CONFIG | {"tie_word_embeddings": False})
    config = li.load_config(folder)
    needed = weight_bytes(config, mx.float32)
    assert needed > weight_bytes(config._replace(tie_word_embeddings=True), mx.float32)
    monkeypatch.setattr(cli, "memory_size", lambda: needed - 1)
    monkeypatch.setattr(cli, "gpu_working_set", lambda: None)
    flags = ["--model", str(folder), "--dtype", "float32", "--max-tokens", "2"]
    with pytest.raises(cli.UserError, match="the weights need"):
        li.main(flags)
    monkeypatch.setattr(cli, "memory_size", lambda: needed)
    assert li.main(flags) == 0


def test_memory_size_is_this_machines_memory():
    if mx.default_device() == mx.gpu and not mx.metal.is_available():  # CUDA: the card's own memory
        total = mx.device_info()["total_memory"]
    elif sys.platform == "darwin":  # unified memory: the GPU's is the machine's
        total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True).stdout)
    else:  # Linux: the memory available (it changes as other processes run: read around)
        available = lambda: int(next(line for line in open("/proc/meminfo")
                                     if line.startswith("MemAvailable:")).split()[1]) * 1024
        before, size, after = available(), cli.memory_size(), available()
        assert 0.95 * min(before, after) < size < 1.05 * max(before, after)
        return
    assert abs(cli.memory_size() - total) < 0.05 * total


def test_on_linux_the_memory_check_counts_the_memory_available(tiny, monkeypatch, capsys):
    """Issue 32: float32 weights of 25.0 GB on a machine of 25.3 GB passed the check, which read
    the total, and the kernel killed the run (23 GB in, nothing said). The check reads what is
    available (a /proc/meminfo with 24.0 GB of it here), and warns when what is left is less than
    a 4,096-token KV cache needs."""
    total, meminfo = 25.3e9, "MemTotal:  24707031 kB\nMemAvailable:  23437500 kB\n"
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # a Linux machine without a GPU
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PHYS_PAGES": total / 4096,
                                                     "SC_PAGE_SIZE": 4096}[name])
    monkeypatch.setattr(cli, "open", lambda path, *args: io.StringIO(meminfo)
                        if path == "/proc/meminfo" else open(path, *args), raising=False)
    assert cli.memory_size() == 24.0e9
    with pytest.raises(cli.UserError, match=r"^the weights need 25\.0 GB as float32, but this "
                                            r"machine has 24\.0 GB of memory available; try"):
        cli.check_memory(25.0e9, cli.memory_size(), mx.float32)
    config = li.load_config(tiny)
    needed = weight_bytes(config, mx.float32)
    c = config
    kv_cache = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * 4096  # float32
    for kib, warned in (((needed + kv_cache + 1023) // 1024, False),
                        ((needed + kv_cache - 1) // 1024, True)):
        meminfo = f"MemAvailable: {kib} kB\n"
        load_model(tiny, mx.float32)  # checks the memory as main() does
        err = capsys.readouterr().err
        assert err == ("warning: the weights take 0.0 of the 0.0 GB available, leaving little "
                       "for the KV cache and activations; if the run is killed, try --dtype "
                       "bfloat16 (half the bytes), --quantize 4, or a smaller model\n"
                       if warned else ""), err


def test_memory_check_on_a_mac_compares_with_the_gpus_working_set():
    """Qwen3-8B in bfloat16 (16.4 GB) on a 16 GB Mac fits the memory, not the 10.7 GB its GPU may use."""
    cli.check_memory(10 * 10**9, 17.2e9, mx.bfloat16, working_set=10.7e9)  # within the working set: runs
    with pytest.raises(cli.UserError, match=r"^the weights need 16\.4 GB as bfloat16, but this Mac's GPU may use "
                                           r"only 10\.7 GB of its 17\.2 GB of memory \(Metal's recommended "
                                           r"working set\); try --quantize 4, or a smaller model$"):
        cli.check_memory(16.4e9, 17.2e9, mx.bfloat16, working_set=10.7e9)


@pytest.fixture(scope="module")
def tiny(tiny_model):  # tests/conftest.py: write_checkpoint(folder, TINY_CONFIG), built once
    return tiny_model


@pytest.fixture
def mac(monkeypatch):
    """What llm_inference sees of a Mac's GPU, without one: mx.default_device() is the GPU, device_info()
    has Metal's keys (the returned dict: change them), and set_wired_limit() records its calls."""
    info = {"memory_size": 16 * 2**30, "max_recommended_working_set_size": 12 * 2**30}
    wired = []
    monkeypatch.setattr(li.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(li.mx, "device_info", lambda: info)
    monkeypatch.setattr(li.mx, "set_wired_limit", lambda limit: wired.append(limit) or 0)
    return info, wired


def test_on_a_mac_weights_above_the_working_set_are_refused(tiny, mac):
    info, _ = mac
    config = li.load_config(tiny)
    needed = weight_bytes(config, mx.float32)  # 39 MB
    info["max_recommended_working_set_size"] = needed - 1
    with pytest.raises(cli.UserError, match=r"this Mac's GPU may use only .*Metal's recommended working set.*"
                                           r"--quantize 4"):
        load_model(tiny, mx.float32)
    info["max_recommended_working_set_size"] = needed
    load_model(tiny, mx.float32)  # just fits


def test_on_a_mac_weights_filling_much_of_the_working_set_are_wired(tiny, mac):
    info, wired = mac
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    loaded = {id(w): w.nbytes for w in [weights["embed_tokens"], weights["norm"], weights["lm_head"],
                                        *(w for layer in weights["layers"] for w in layer.values())]}
    nbytes = sum(loaded.values())  # the tied head once
    info["max_recommended_working_set_size"] = 2 * nbytes + 1  # less than half: left to macOS
    cli.wire_weights(weights)
    assert wired == []
    info["max_recommended_working_set_size"] = 2 * nbytes - 1  # more than half: wired up to the working set
    cli.wire_weights(weights)
    assert wired == [2 * nbytes - 1]


def test_off_a_mac_nothing_is_wired(tiny, monkeypatch):
    wired = []
    monkeypatch.setattr(li.mx, "default_device", lambda: mx.cpu)
    monkeypatch.setattr(li.mx, "set_wired_limit", lambda limit: wired.append(limit) or 0)
    config = li.load_config(tiny)
    cli.wire_weights(li.load_weights(tiny, config, mx.float32))
    assert wired == [] and cli.gpu_working_set() is None


# ---- load_model's checks of a folder whose files do not belong together --------------------------

def copy_with_config(source, folder, **changes):
    """A copy of a checkpoint folder, its config.json changed."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tiny, tmp_path):
    """config.json says 1 layer, the file holds 2: every tensor Part 1 loads is there, but layer 1's
    would be silently ignored, giving a different model. Refused, naming one of them."""
    folder = copy_with_config(tiny, tmp_path / "m", num_hidden_layers=1)
    with pytest.raises(cli.UserError) as error:
        load_model(folder, mx.float32)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{folder / 'model.safetensors'} holds 11 tensors that config.json "
                              "does not describe, such as 'model.layers.1.")
    assert "does not match" in message


def test_a_tensor_config_json_does_not_describe_is_refused(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "m")
    tensors = mx.load(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = mx.zeros((4,), mx.bfloat16)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    with pytest.raises(cli.UserError) as error:
        load_model(folder, mx.float32)
    message = str(error.value)
    assert "\n" not in message and "does not match" in message
    assert message.startswith(f"{folder / 'model.safetensors'} holds 1 tensor that config.json "
                              "does not describe, such as 'model.layers.0.mlp.extra.weight'")


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path):
    """The real Qwen3 tokenizer (151669 tokens) beside a 1000-row embedding table: its ids would
    index rows the table lacks. One line, before any weight is loaded."""
    folder = write_checkpoint(tmp_path / "m", TINY_CONFIG | {"vocab_size": 1000})
    n_tokens = li.load_tokenizer(folder).get_vocab_size(with_added_tokens=True)
    assert n_tokens == 151669
    with pytest.raises(cli.UserError) as error:
        load_model(folder, mx.float32)
    assert str(error.value) == (f"{folder / 'tokenizer.json'} has another tokenizer (151669 tokens "
                                "for 1000 embedding rows): put the model's own tokenizer.json "
                                "beside its weights")


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("head, differs", [(None, False), ("same", False), ("different", True)],
                         ids=["no stored head", "an exact copy", "a different matrix"])
def test_stored_head_differs_only_for_a_different_matrix(checkpoints, head, differs, shards):
    folder = checkpoints(TINY_CONFIG, tied_head=head, shards=shards)  # read, never written
    assert cli.stored_head_differs(cli.weight_files(folder)) is differs
    config, weights, _, _ = load_model(folder, mx.float32)
    assert config.tie_word_embeddings is not differs  # check_weights unties it for a head of its own
    if differs:  # the stored head is used, as transformers 5 uses it
        stored = stored_tensors(folder)["lm_head.weight"].astype(mx.float32)
        assert weights["lm_head"] is not weights["embed_tokens"]
        assert mx.array_equal(weights["lm_head"], stored)
        assert not mx.array_equal(weights["lm_head"], weights["embed_tokens"])
    else:  # tied: one array, not a copy
        assert weights["lm_head"] is weights["embed_tokens"]



@pytest.mark.parametrize("length, calls", [
    (50, [16, 32, 48]),  # pieces of 16: 16 + 16 + 16 + 2
    (32, [16]),  # the last piece, 16 tokens, goes to generate()
    (17, [16]),
    (16, []),  # one piece: nothing to report
    (1, []),
], ids=["50", "32", "17", "16", "1"])
def test_generate_long_reports_its_progress_after_each_piece(tiny, monkeypatch, length, calls):
    """progress(done, total) after each piece that goes through the model before the last: done
    counts the prompt's tokens now in the cache (the piece has run), total the prompt's; with
    PREFILL_CHUNK 2048, (2048, total), (4096, total), ... Never for a prompt of one piece, and
    always before the first token. Where a piece runs within LAYER_SECONDS (here: always), it runs
    in one mx.eval(), all its layers at once. The tokens are generate()'s."""
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    pieces_of(monkeypatch, 16)  # 1024 would take seconds of CPU here
    prompt = mx.random.randint(0, config.vocab_size, (length,), key=mx.random.key(8)).tolist()
    whole = tokens(li.generate(prompt, weights, config, max_tokens=5))
    cache, events, evaluate = li.make_cache(config), [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: (events.append("eval"), evaluate(*arrays)))

    def progress(done, total):
        events.append((done, total, [c.offset for c in cache]))

    generated = []
    for token_id, _ in li.generate_long(prompt, weights, config, 5, cache=cache, progress=progress):
        generated.append(token_id)
        events.append("token")
    assert generated == whole
    reported = [event for event in events if isinstance(event, tuple)]
    assert [(done, total) for done, total, _ in reported] == [(done, length) for done in calls]
    assert events[:2 * len(reported)] == [e for r in reported for e in ("eval", r)]  # then tokens
    for done, _, offsets in reported:
        assert offsets == [done] * config.num_hidden_layers  # the piece is in the cache


def prefill_clock(monkeypatch, cache, seconds):
    """A clock set by hand: each mx.eval() of a prefill takes seconds(tokens, layers), for the
    tokens of the piece last given to forward() and the layers of `cache` it runs. Returns the
    sizes given to forward(), and the layers each mx.eval() ran: [[(0, "keys"), (0, "values")]...]."""
    clock, sizes, evals = [0.0], [], []
    evaluate, forward = mx.eval, li.forward

    def timed_eval(*arrays):
        ran = [(i, name) for _, a in tree_flatten(arrays) for i, c in enumerate(cache)
               for name in ("keys", "values") if getattr(c, name) is a]
        evals.append(ran)
        clock[0] += seconds(sizes[-1], len(ran) // 2)
        evaluate(*arrays)

    monkeypatch.setattr(mx, "eval", timed_eval)
    monkeypatch.setattr(li.mx, "default_device", lambda: mx.cpu)  # FIRST_GUESS, on any machine
    monkeypatch.setattr(li, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(li, "forward", lambda ids, *args, **kwargs: (
        sizes.append(len(ids)), forward(ids, *args, **kwargs))[1])
    monkeypatch.setattr(li, "layer_tokens", {})
    return sizes, evals


def test_a_prefill_runs_a_layer_per_eval_in_pieces_sized_by_time(tiny, monkeypatch):
    """Issue 32: Ctrl-C waited for a whole 1024-token piece (27.5 s on a CPU), since Python acts on
    it only between mx.eval() calls. Now each mx.eval() of a prefill runs one layer of a piece (its
    keys and values, in order), and each piece holds the tokens a layer ran in LAYER_SECONDS in
    the piece before: here, on a clock set by hand, a layer takes 0.4 s whatever its size, so the
    sizes halve from the first guess of 8 tokens. generate() gets at most what a layer runs in
    LAYER_SECONDS (at least a token), and the count carries over to the model's next prefill."""
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    cache = li.make_cache(config)
    _, evals = prefill_clock(monkeypatch, cache, lambda tokens, layers: 0.4 * layers)
    monkeypatch.setattr(li, "SHORT_PROMPT", 16)  # the 20-token prompt is not short
    assert (li.FIRST_GUESS, li.LAYER_SECONDS) == (8, 0.2)
    prompt = mx.random.randint(0, config.vocab_size, (20,), key=mx.random.key(9)).tolist()
    pieces = []
    generated = tokens(li.generate_long(prompt, weights, config, 3, cache=cache, progress=lambda
                                        done, total: pieces.append(done)))
    assert generated == tokens(li.generate(prompt, weights, config, 3))
    # After each layer: 8 tokens in 2 layers (4, 8), then 4 (10, 12), 2 (13, 14), then 1 each.
    assert pieces == [4, 8, 10, 12, 13, 14, 14, 15, 15, 16, 16, 17, 17, 18, 18, 19]
    assert evals[:16] == [[(0, "keys"), (0, "values")], [(1, "keys"), (1, "values")]] * 8
    assert li.layer_tokens == {id(weights): 1}  # for this model's next prefill


def test_the_worked_example_of_section_14(checkpoints, monkeypatch):
    """Section 14's example, on its clock: 28 layers, a layer runs 600 tokens in 0.2 s, and a
    100-token prompt goes in pieces of 8 (a layer per mx.eval()), 64 (9 layers per mx.eval()) and
    16 (all 28 at once); the last 12 tokens go through generate(). Piece sizes are powers of two."""
    folder = checkpoints(TINY_CONFIG | {"num_hidden_layers": 28, "max_window_layers": 28})
    config = li.load_config(folder)
    weights = li.load_weights(folder, config, mx.float32)
    cache = li.make_cache(config)
    sizes, evals = prefill_clock(monkeypatch, cache, lambda tokens, layers: tokens * layers / 3000)
    prompt = mx.random.randint(0, config.vocab_size, (100,), key=mx.random.key(4)).tolist()
    generate = li.generate
    monkeypatch.setattr(li, "generate", lambda ids, *args: iter([(len(ids), None)]))
    assert tokens(li.generate_long(prompt, weights, config, 1, cache=cache)) == [12]
    assert sizes == [8, 64, 16]
    assert [len(ran) // 2 for ran in evals] == [1] * 28 + [9, 9, 9, 1] + [28]
    assert li.layer_tokens == {id(weights): 600}
    assert generate is not li.generate


def test_a_short_prompt_goes_through_generate_in_one_pass(tiny, monkeypatch):
    """Issue 40: the first guess split even a 4-token prompt into pieces [3, 1]. A prompt of at
    most SHORT_PROMPT tokens goes through Part 1's generate() as it is, timed or not; so does a
    prompt of PREFILL_CHUNK tokens once a layer is timed to run far more in LAYER_SECONDS."""
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    monkeypatch.setattr(li, "layer_tokens", {})
    calls, generate = [], li.generate
    monkeypatch.setattr(li, "generate", lambda ids, *args: (calls.append(len(ids)),
                                                             generate(ids, *args))[1])
    for length in (1, 4, li.SHORT_PROMPT):
        prompt = mx.random.randint(0, config.vocab_size, (length,), key=mx.random.key(3)).tolist()
        assert tokens(li.generate_long(prompt, weights, config, 2)) == tokens(
            generate(prompt, weights, config, 2))
        assert calls.pop() == length
    assert li.layer_tokens == {}  # nothing was timed
    li.layer_tokens[id(weights)] = 10**6  # as on a fast GPU
    tokens(li.generate_long(list(range(li.PREFILL_CHUNK)), weights, config, 1))
    assert calls == [li.PREFILL_CHUNK]


def test_a_gpus_first_prompt_goes_as_its_later_ones(tiny, mac, monkeypatch):
    """Issue 41: on an H100, the first prefill of a process was cut into pieces its later ones never
    met (8, 64, 52 tokens, then 128 at once), and each new shape compiled kernels during the timed
    runs. A GPU not yet timed takes a prompt of up to PREFILL_CHUNK tokens in one pass, as a timed
    one does; a longer one in whole pieces, all layers in one mx.eval()."""
    config = li.load_config(tiny)
    weights = li.load_weights(tiny, config, mx.float32)
    cache = li.make_cache(config)
    sizes, evals = prefill_clock(monkeypatch, cache, lambda tokens, layers: 0.001)
    monkeypatch.setattr(li.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(li, "PREFILL_CHUNK", 64)
    tokens(li.generate_long(list(range(64)), weights, config, 1, cache=cache))
    assert sizes[0] == 64
    sizes.clear()
    evals.clear()
    cache[:] = li.make_cache(config)  # the list prefill_clock watches
    tokens(li.generate_long(list(range(100)), weights, config, 1, cache=cache))
    assert sizes[:2] == [64, 36]
    assert evals[0] == [(0, "keys"), (0, "values"), (1, "keys"), (1, "values")]


def test_each_model_keeps_its_own_prefill_pace(tiny, monkeypatch):
    """Issue 40: one pace for all models sized the target's first piece by its draft's (section
    22): with a 0.6B draft for an 8B target, a 12x longer wait for Ctrl-C. A model whose prefill
    was never timed starts from FIRST_GUESS, whatever another model's pace."""
    config = li.load_config(tiny)
    draft = li.load_weights(tiny, config, mx.float32)
    target = li.load_weights(tiny, config, mx.float32)
    sizes, _ = prefill_clock(monkeypatch, [], lambda tokens, layers: 0.001)
    tokens(li.generate_long(list(range(100)), draft, config, 1))  # fast: 8, then 92 in one pass
    assert sizes == [8, 92] and li.layer_tokens[id(draft)] >= 100
    sizes.clear()
    tokens(li.generate_long(list(range(100)), target, config, 1))
    assert sizes[0] == li.FIRST_GUESS
