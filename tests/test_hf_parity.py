"""The whole pipeline against Hugging Face transformers, the reference implementation of Qwen3.

Each random checkpoint (tests/checkpoint.py: real Qwen3 file layout and tokenizer, random weights) is
loaded twice from the same folder: into transformers.Qwen3ForCausalLM and into llm_inference, both in
float32. Then, with our fused kernels and with the hand-written reference ops:

* the next-token logits, and the logits at every position of a 22-token prompt, agree to 1e-4;
* feeding the prompt in two pieces through our KV cache gives the same logits as HF's single pass;
* greedy decoding produces the same 32 tokens.

Why 1e-4 is tight: the random checkpoints are scaled so that logits have a standard deviation of ~4 and
extremes of ~20 (checked below), and what we observe is a max difference of ~2e-5, i.e. float32 rounding
(a few ulps of 20 is ~1e-5) accumulated over differently ordered sums. A real bug is nowhere near that:
a RoPE pair swapped, a GQA head mapped to the wrong KV head, the untied LM head ignored, a position off by
one in the cache, or a missing QK-norm change logits by O(1), i.e. 10^4 times the tolerance.

The greedy test needs the random model to produce varied text, or two diverging implementations could
both emit one repeated token; so it also checks the continuations contain several distinct tokens.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import llm_inference as li
from tests.checkpoint import TINY_CONFIG, load_model
from tests.kernels import kernels

TOL = 1e-4  # max abs logit difference; see the module docstring
N_NEW = 32  # greedy tokens compared
MIN_DISTINCT = 5  # a continuation with fewer distinct tokens would make the greedy comparison toothless

PROMPTS = {
    "short": "The capital of France is",
    "long": "The quick brown fox jumps over the lazy dog, then it runs back into the forest to rest before sunset.",
}

CHECKPOINTS = {
    # TINY_CONFIG: 2 layers, 4 query heads sharing 2 KV heads, head_dim 16, tied embeddings. Named
    # so that it is the very folder of tests/conftest.py's tiny_model, which other modules use.
    "tied": (TINY_CONFIG, 0, {"name": "tiny-qwen3"}),
    # Separate lm_head.weight: catches a head that silently falls back to the embedding table. Split into
    # three shards with an index, as Qwen3-1.7B and larger ship.
    "untied_3_shards": ({**TINY_CONFIG, "tie_word_embeddings": False}, 1, {"shards": 3}),
    # 4 query heads per KV head, wider heads, an odd number of layers; tied, in two shards.
    "gqa4_hd32_3layers_2_shards": (
        {**TINY_CONFIG, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
         "num_hidden_layers": 3, "max_window_layers": 3},
        2,
        {"shards": 2},
    ),
    # Tied in config.json, yet the file also holds a different lm_head.weight: transformers 5 then
    # leaves the two untied and uses the stored head (checked below), and so must we.
    "tied_differing_head": (TINY_CONFIG, 5, {"tied_head": "different"}),
}


@dataclass
class Case:
    name: str
    config: li.Config
    weights: dict
    prompts: dict  # name -> token ids
    hf_logits: dict  # prompt name -> (seq, vocab) float32 numpy, HF's logits at every position
    hf_greedy: dict  # prompt name -> list of N_NEW ids
    hf_lens: list  # per block, HF's hidden state at the last position of "short" -> norm -> LM head


@pytest.fixture(scope="module", params=list(CHECKPOINTS), ids=list(CHECKPOINTS))
def case(request, checkpoints):
    """Build one checkpoint, load it into both implementations, run HF once and keep its results.
    The checkpoint is built once per session (tests/conftest.py), shared with other modules."""
    torch.set_grad_enabled(False)
    torch.manual_seed(0)  # nothing in HF's eager float32 path is random; pinned anyway
    overrides, seed, *options = CHECKPOINTS[request.param]
    folder = checkpoints(overrides, seed=seed, **(options[0] if options else {}))

    # transformers 5 takes `dtype` (`torch_dtype` is its deprecated alias). The file holds bfloat16, which
    # both sides widen exactly to float32, so both start from bit-identical weights.
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    separate_head = not overrides.get("tie_word_embeddings", True) or bool(options and "tied_head" in options[0])
    if separate_head:  # make sure HF really uses a separate head
        assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    else:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    # generation_config.json lists <|im_end|>/<|endoftext|> as EOS; drop them so HF always makes N_NEW
    # tokens, like our generate(..., eos_ids=()). (Unlike min_new_tokens, this does not mask EOS logits,
    # which would change the greedy choice if EOS ever won.) do_sample=False ignores the file's
    # temperature/top_k/top_p.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    config = li.load_config(folder)
    weights = load_model(folder, mx.float32)[1]  # with the checks, and a tied but stored head
    assert (weights["lm_head"] is not weights["embed_tokens"]) == separate_head
    tokenizer = li.load_tokenizer(folder)
    prompts = {name: tokenizer.encode(text).ids for name, text in PROMPTS.items()}

    # The logit lens by hand on HF's hidden states: hidden_states[i + 1] is block i's output, except
    # the last, which HF returns already normalised (so its lens is the model's logits).
    states = hf(torch.tensor([prompts["short"]]), output_hidden_states=True).hidden_states
    hf_lens = [hf.lm_head(hf.model.norm(h[0, -1:]))[0].numpy() for h in states[1:-1]]
    hf_lens.append(hf(torch.tensor([prompts["short"]])).logits[0, -1].numpy())
    hf_logits, hf_greedy = {}, {}
    for name, ids in prompts.items():
        input_ids = torch.tensor([ids])
        hf_logits[name] = hf(input_ids).logits[0].float().numpy()
        out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                          max_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
        hf_greedy[name] = out[0, len(ids):].tolist()
        assert len(hf_greedy[name]) == N_NEW
    return Case(request.param, config, weights, prompts, hf_logits, hf_greedy, hf_lens)


def max_diff(ours, ref):
    ours = np.array(ours.astype(mx.float32))
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max())


def test_checkpoint_is_meaningful(case):
    """The premises of the tolerance and of the greedy test: logits spread over ~O(10), varied text."""
    assert case.prompts["short"] == [785, 6722, 315, 9625, 374]  # the real Qwen3 tokenization
    assert 15 <= len(case.prompts["long"]) <= 30
    for name, logits in case.hf_logits.items():
        print(f"{case.name}/{name}: HF logits std {logits.std():.2f}, max |logit| {np.abs(logits).max():.1f}")
        assert logits.std() > 1.0  # so TOL=1e-4 is < 1e-4 relative to a typical logit
    for name, tokens in case.hf_greedy.items():
        print(f"{case.name}/{name}: {len(set(tokens))} distinct of {N_NEW} greedy tokens")
        assert len(set(tokens)) >= MIN_DISTINCT, f"greedy output collapsed: {tokens}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference_ops"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_last_logits_match_hf(case, prompt, fused):
    ids = case.prompts[prompt]
    with kernels(fused):
        ours = li.forward(mx.array(ids), case.weights, case.config, li.make_cache(case.config))
    diff = max_diff(ours, case.hf_logits[prompt][-1])
    print(f"{case.name}/{prompt}/fused={fused}: last-position max |diff| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference_ops"])
def test_all_logits_match_hf(case, fused):
    ids = case.prompts["long"]
    cache = li.make_cache(case.config)
    with kernels(fused):
        ours = li.forward(mx.array(ids), case.weights, case.config, cache, last_only=False)
    assert all(layer_cache.offset == len(ids) for layer_cache in cache)
    diff = max_diff(ours, case.hf_logits["long"])
    print(f"{case.name}/long/fused={fused}: all-position max |diff| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference_ops"])
def test_cached_prefill_matches_hf(case, fused):
    """Prompt fed in two pieces: the second piece's positions, causal mask and keys come from the cache."""
    ids = case.prompts["long"]
    split = 9
    cache = li.make_cache(case.config)
    with kernels(fused):
        first = li.forward(mx.array(ids[:split]), case.weights, case.config, cache, last_only=False)
        second = li.forward(mx.array(ids[split:]), case.weights, case.config, cache, last_only=False)
    diff = max_diff(mx.concatenate([first, second]), case.hf_logits["long"])
    print(f"{case.name}/long/fused={fused}: two-piece prefill max |diff| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference_ops"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_generation_matches_hf(case, prompt, fused):
    with kernels(fused):
        ours = [t for t, _ in li.generate(case.prompts[prompt], case.weights, case.config, N_NEW, eos_ids=())]
    assert ours == case.hf_greedy[prompt]
    assert len(set(ours)) >= MIN_DISTINCT


@pytest.mark.parametrize("fused, compiled", [(False, False), (True, False), (True, True)],
                         ids=["reference_ops", "fused", "fused and compiled"])
def test_logit_lens_after_each_block_matches_hf(case, fused, compiled):
    """--trace's lens: the final norm and LM head applied to the residual stream after each block.
    After the last block it is the model's own next-token logits. As --reference-ops runs it (Part
    1 as written), and with section 12's kernels, with and without section 13's compilation (as
    the command line runs it)."""
    if compiled:  # compile_model() rebinds a module name; tests/conftest.py puts it back afterwards
        li.compile_model()
        assert li.silu_gate is li.compiled_silu_gate
    ids = mx.array(case.prompts["short"])
    with kernels(fused):
        x, cache = li.embed(ids, case.weights["embed_tokens"]), li.make_cache(case.config)
        for i, (layer, layer_cache) in enumerate(zip(case.weights["layers"], cache)):
            x = li.transformer_block(x, layer, case.config, layer_cache)
            diff = max_diff(li.logit_lens(x, case.weights, case.config), case.hf_lens[i])
            assert diff <= TOL, f"block {i}: {diff:.2e}"
        last = li.forward(ids, case.weights, case.config, li.make_cache(case.config))
        assert mx.array_equal(li.logit_lens(x, case.weights, case.config), last)
