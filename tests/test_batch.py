"""Section 23, many prompts at once: generate_batch() gives each prompt the tokens it gets alone.

Greedy, in float32, with prompts of different lengths, rows that end at different steps and
prompts that join mid-way (one longer than the batch's cache). Sampled with a seed, each row's
tokens are the prompt's alone with that seed. The greedy tokens are mlx-lm's batch_generate's.
The mask: a row's logits do not change when another row's prompt (and so its padding) changes.
The command line (--prompts, --batch-size) is checked in tests/test_cli.py.
"""

import itertools
import json
import random
from types import SimpleNamespace

import mlx.core as mx
import pytest

import llm_inference as li
from tests.checkpoint import QWEN3_0_6B_CONFIG, TINY_CONFIG, TINY_MOE_CONFIG, random_weights

SMALL = QWEN3_0_6B_CONFIG | TINY_CONFIG | {"vocab_size": 1024}  # a forward pass in about a ms
LENGTHS = [2, 9, 3, 1, 17, 5, 11, 4]  # the 17-token prompt joins a batch of fewer columns


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, config, float32 weights) of a tiny random Qwen3 with a 1024-token vocabulary, and
    prompts of LENGTHS tokens. The folder holds config.json and the weights, all mlx-lm reads."""
    folder = tmp_path_factory.mktemp("small-qwen3")
    mx.save_safetensors(str(folder / "model.safetensors"), random_weights(SMALL))
    (folder / "config.json").write_text(json.dumps(SMALL))
    config = li.load_config(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in LENGTHS]
    return folder, config, li.load_weights(folder, config, mx.float32), prompts


def alone(prompts, weights, config, max_tokens, sampling=li.Sampling(), eos_ids=()):
    return [[t for t, _ in li.generate_long(p, weights, config, max_tokens, sampling, eos_ids)]
            for p in prompts]


def batched(prompts, weights, config, max_tokens, sampling=li.Sampling(), eos_ids=(),
            batch_size=8, join_rows=8):
    tokens = [[] for _ in prompts]
    for i, token in li.generate_batch(prompts, weights, config, max_tokens, sampling, eos_ids,
                                      batch_size, join_rows):
        tokens[i].append(token)
    return tokens


@pytest.mark.parametrize("batch_size", [3, 8])
def test_greedy_each_prompt_gets_its_tokens_alone(model, batch_size):
    _, config, weights, prompts = model
    li.use_fused_kernels()  # as a plain run, which main() sets up
    li.compile_model()
    # End-of-sequence ids that end some rows early, each at its own step.
    free = alone(prompts, weights, config, 8)
    eos_ids = {free[0][2], free[3][5], free[6][0]}
    expected = alone(prompts, weights, config, 8, eos_ids=eos_ids)
    assert len({len(tokens) for tokens in expected}) > 2  # rows end at different steps
    assert batched(prompts, weights, config, 8, eos_ids=eos_ids, batch_size=batch_size) == expected


def test_each_prompt_may_have_its_own_max_tokens(model):
    """bench.py's mix gives each prompt its own count, as mlx-lm's batch_generate takes them."""
    _, config, weights, prompts = model
    limits = [3, 0, 1, 5, 2, 4, 0, 6]
    expected = [alone([prompt], weights, config, n)[0] for prompt, n in zip(prompts, limits)]
    assert batched(prompts, weights, config, limits, batch_size=3) == expected


def test_sampled_each_prompt_gets_its_tokens_alone_with_the_same_seed(model):
    _, config, weights, prompts = model
    sampling = li.Sampling(temperature=1.5, top_k=50, top_p=0.9, seed=7)
    eos_ids = set(range(0, config.vocab_size, 8))  # rows end at different steps, and then
    expected = alone(prompts, weights, config, 8, sampling, eos_ids)  # rows' keys differ
    assert len({len(tokens) for tokens in expected}) > 2
    assert len({tuple(tokens[:2]) for tokens in expected}) == len(prompts)
    assert batched(prompts, weights, config, 8, sampling, eos_ids, batch_size=3) == expected


def test_greedy_tokens_are_mlx_lms_batch_generate(model):
    from mlx_lm.generate import batch_generate
    from mlx_lm.utils import load_model

    folder, config, weights, prompts = model
    theirs, _ = load_model(folder)
    theirs.set_dtype(mx.float32)
    # All that batch_generate reads of a tokenizer: no end-of-sequence ids, and a decode().
    no_eos = SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")
    answer = batch_generate(theirs, no_eos, prompts, max_tokens=6, return_token_ids=True)
    assert batched(prompts, weights, config, 6, batch_size=4) == [list(t) for t in answer.token_ids]


def test_a_rows_logits_do_not_change_when_another_rows_prompt_does(model):
    _, config, weights, prompts = model
    row = prompts[2]  # 3 tokens, padded on the left by the other row's length - 3
    single = li.forward(mx.array(row), weights, config, li.make_cache(config))
    for other in prompts[1], prompts[4]:  # 9 and 17 tokens
        longest = len(other)
        ids = mx.array([[0] * (longest - len(row)) + row, other])
        logits = li.forward_batch(ids, weights, config, li.make_cache(config),
                                  [longest - len(row), 0])
        assert mx.allclose(logits[0], single, atol=1e-5).item()


def test_no_column_is_padding_in_every_row(model, monkeypatch):
    """Rows that end take their columns with them: the cache does not grow without end."""
    _, config, weights, prompts = model
    forward_batch, calls = li.forward_batch, []

    def recorded(token_ids, weights, config, cache, pads):
        calls.append(list(pads))  # pads is a list that generate_batch changes later
        return forward_batch(token_ids, weights, config, cache, pads)

    monkeypatch.setattr(li, "forward_batch", recorded)
    assert list(itertools.islice(li.generate_batch(prompts, weights, config, 0), 1)) == []
    eos_ids = set(range(0, config.vocab_size, 8))  # an eighth of the vocabulary: rows end early
    expected = alone(prompts, weights, config, 12, eos_ids=eos_ids)
    assert batched(prompts, weights, config, 12, eos_ids=eos_ids, batch_size=3) == expected
    assert len(calls) > len(prompts) and all(min(pads) == 0 for pads in calls)


def test_a_joining_prefill_runs_a_layer_per_eval(model, monkeypatch):
    """Ctrl-C waits for the mx.eval() under way. So a prefill of joining prompts evaluates one
    layer's keys and values at a time, all before the first token, not the whole model at once."""
    _, config, weights, prompts = model
    evaluated, evaluate = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: (evaluated.append(arrays), evaluate(*arrays)))
    run = li.generate_batch(prompts[:3], weights, config, 2, batch_size=3)
    next(run)
    n = config.num_hidden_layers
    assert len(evaluated) == n  # the three prompts join in one prefill
    assert [[a.shape[:2] for a in arrays] for arrays in evaluated] == [
        [(3, config.num_key_value_heads)] * 2] * n  # a layer's keys and values, 3 rows each


def test_a_join_or_an_end_copies_the_cache_a_layer_per_eval_and_leaves_room(model, monkeypatch):
    """A GPU frees a kernel's inputs only once its batch of kernels has run. Copied in one
    evaluation, every layer's old and new cache lived at once (section 23's Memory). So a join or
    an end evaluates each layer's copy alone, with room after it: the next step writes in place."""
    _, config, weights, prompts = model
    evaluated, evaluate = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: (evaluated.extend(arrays), evaluate(*arrays)))
    forward_batch, last, checked = li.forward_batch, {}, []

    def recorded(token_ids, weights, config, cache, *args):
        decoding = token_ids.shape[1] == 1 and cache[0].offset  # a prefill's cache is empty
        for i, c in enumerate(cache if decoding else []):
            if c.keys is not last.get(i):  # a join or an end copied it since the last step
                checked.append((any(c.keys is a for a in evaluated), c.keys.shape[2] > c.offset))
        logits = forward_batch(token_ids, weights, config, cache, *args)
        last.update(enumerate(c.keys for c in cache) if decoding else ())
        return logits

    monkeypatch.setattr(li, "forward_batch", recorded)
    eos_ids = set(range(0, config.vocab_size, 8))  # rows end early, and prompts wait to join
    expected = alone(prompts, weights, config, 12, eos_ids=eos_ids)
    assert batched(prompts, weights, config, 12, eos_ids=eos_ids, batch_size=3) == expected
    assert len(checked) >= 4 * config.num_hidden_layers
    assert all(was_evaluated for was_evaluated, _ in checked)
    assert all(has_room for _, has_room in checked)


def test_at_most_join_rows_prompts_are_prefilled_together(model, monkeypatch):
    """A prefill's scores grow as rows x longest². So prompts join join_rows at a time (8 by
    default, as mlx-lm's prefill_batch_size), even with more free rows, and get their tokens."""
    _, config, weights, prompts = model
    forward_batch, prefills = li.forward_batch, []

    def recorded(token_ids, weights, config, cache, *args):
        if cache[0].offset == 0:  # a fresh cache: a prefill
            prefills.append(token_ids.shape[0])
        return forward_batch(token_ids, weights, config, cache, *args)

    monkeypatch.setattr(li, "forward_batch", recorded)
    expected = alone(prompts, weights, config, 4)
    assert batched(prompts, weights, config, 4, batch_size=8, join_rows=3) == expected
    assert prefills[:3] == [3, 3, 2]  # 8 prompts, 8 free rows
    prefills.clear()
    list(li.generate_batch(prompts * 2, weights, config, 2, batch_size=16))
    assert prefills[:2] == [8, 8]  # the default


def test_quantized_mixture_of_experts_rows_get_their_tokens_alone(tmp_path):
    moe = QWEN3_0_6B_CONFIG | TINY_MOE_CONFIG | {"vocab_size": 1024}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), random_weights(moe, seed=3))
    (tmp_path / "config.json").write_text(json.dumps(moe))
    config = li.with_experts(li.load_config(tmp_path), tmp_path)
    li.use_quantization(4)  # in main()'s order
    li.use_experts(config, 4)
    weights = li.load_weights(tmp_path, config, mx.float32)
    prompts = [[5, 17, 300], [9] * 7, [1000, 2]]
    expected = alone(prompts, weights, config, 6)
    assert batched(prompts, weights, config, 6, batch_size=2) == expected


def test_each_row_caches_its_keys_alone_at_its_own_positions(model, monkeypatch):
    """A row's tokens keep the positions they have alone, through joins and ends (section 23's
    RoPE), so its cached keys are its keys alone. Shifted by the padding, the scores match only
    to rounding, and a near-tie flipped a greedy token (docs/performance.md, the CPU's table)."""
    _, config, weights, prompts = model
    eos_ids = set(range(0, config.vocab_size, 8))  # rows end early, and prompts wait to join
    expected = alone(prompts, weights, config, 12, eos_ids=eos_ids)
    forward_batch, checked = li.forward_batch, []

    def keys_alone(ids):  # layer 0's keys for ids, run alone from position 0: (8, len(ids), 128)
        cache = li.make_cache(config)
        li.forward(mx.array(ids), weights, config, cache)
        return cache[0].keys[0, :, : len(ids)]

    firsts = [keys_alone(p[:1])[:, 0] for p in prompts]  # tells which prompt a row holds

    def recorded(token_ids, weights, config, cache, pads):
        for row, pad in enumerate(pads if cache[0].offset else []):  # a decode step
            held = cache[0].keys[row, :, pad : cache[0].offset]  # (8, tokens, 128)
            match = [i for i, k in enumerate(firsts) if mx.allclose(held[:, 0], k, atol=1e-5)]
            seqs = [(prompts[i] + expected[i])[: held.shape[1]] for i in match]
            checked.append(any(mx.allclose(held, keys_alone(s), atol=1e-5).item() for s in seqs))
        return forward_batch(token_ids, weights, config, cache, pads)

    monkeypatch.setattr(li, "forward_batch", recorded)
    assert batched(prompts, weights, config, 12, eos_ids=eos_ids, batch_size=3) == expected
    assert len(checked) > 2 * len(prompts) and all(checked)
