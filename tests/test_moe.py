"""Section 21, mixture of experts: tiny random qwen3_moe checkpoints in Hugging Face's layout (one
tensor per expert) against transformers' Qwen3MoeForCausalLM and mlx-lm's qwen3_moe; the folders
mlx_lm.convert writes (experts stacked, routers at 8 bits); the router against a plain loop over
experts; the cache, the flags, and the checks of cli.py on bad folders."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import cli
import llm_inference as li
from tests.checkpoint import QWEN3_30B_A3B_SHAPE, TINY_MOE_CONFIG, load_model
from tests.conftest import AS_IMPORTED

TOL = 1e-4  # float32 logits, as tests/test_hf_parity.py
PROMPT = "The capital of France is Paris, and the capital of Italy is"
CONFIGS = {
    # 8 experts, 2 per token, renormalised; layer 1 in mlp_only_layers keeps a dense SwiGLU.
    "8-experts-top-2": TINY_MOE_CONFIG,
    # 16 experts, 4 per token, not renormalised; decoder_sparse_step 2: only layer 1 has experts.
    "16-experts-top-4": TINY_MOE_CONFIG | {"num_experts": 16, "num_experts_per_tok": 4,
                                           "norm_topk_prob": False, "decoder_sparse_step": 2,
                                           "mlp_only_layers": [], "num_hidden_layers": 2,
                                           "tie_word_embeddings": False},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe(request, checkpoints):
    """(folder, config, float32 weights, tokenizer): built once per session."""
    folder = checkpoints(CONFIGS[request.param], seed=3, name=request.param)
    loaded = folder, *load_model(folder, mx.float32)[:3]
    restore()
    return loaded


def restore():
    """Part 1 as written (what main() and load_model() replaced goes back), as after each test."""
    li.__dict__.update(AS_IMPORTED)


def experts(moe):
    """The fixture's model, with section 21's swiglu in place (Part 1's is, after each test)."""
    li.use_experts(moe[1])
    return moe


def tokens(generator):
    return [token for token, _ in generator]


def test_blocks_hold_stacked_experts_and_a_router(moe):
    folder, config, weights, _ = moe
    stored = mx.load(str(folder / "model.safetensors"))
    assert isinstance(config, li.MoEConfig)
    for i, layer in enumerate(weights["layers"]):
        if not li.has_experts(config, i):
            assert layer["gate"] is None and layer["gate_proj"].shape == (128, 64)  # dense
            continue
        assert layer["gate_proj"].shape == (config.num_experts, 64, 64)
        for e in (0, config.num_experts - 1):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                expert = stored[f"model.layers.{i}.mlp.experts.{e}.{kind}.weight"]
                assert mx.array_equal(layer[kind][e], expert.astype(mx.float32))
        assert mx.array_equal(layer["gate"], stored[f"model.layers.{i}.mlp.gate.weight"])
    assert [li.has_experts(config, i) for i in range(config.num_hidden_layers)] == (
        [True, False, True] if config.num_experts == 8 else [False, True])


def test_logits_and_greedy_tokens_match_transformers_and_mlx_lm(moe):
    import torch
    import transformers

    folder, config, weights, tokenizer = experts(moe)
    ids = tokenizer.encode(PROMPT).ids
    ours = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
    model, _ = mlx_lm_load_model(folder)
    model.set_dtype(mx.float32)
    assert mx.abs(ours - model(mx.array(ids)[None])[0]).max().item() < TOL
    torch.set_grad_enabled(False)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert np.abs(np.array(ours) - hf(torch.tensor([ids])).logits[0].numpy()).max() < TOL
    greedy = tokens(li.generate(ids, weights, config, 12))
    assert greedy == tokens(generate_step(mx.array(ids), model, max_tokens=12))
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert greedy == out[0, len(ids):].tolist() and len(set(greedy)) > 4


@pytest.mark.parametrize("n", [3, 40])  # 40 tokens x 2 experts: sorted by expert (section 21)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_mixture_is_a_loop_over_each_tokens_experts(moe, n, norm_topk_prob):
    """The router and the experts against Part 1's swiglu, token by token, expert by expert."""
    _, config, weights, _ = moe
    layer, k = next(layer for layer in weights["layers"] if layer["gate"] is not None), 3
    x = mx.random.normal((n, 64), key=mx.random.key(n))
    ours = li.mixture(x, layer, k, norm_topk_prob)
    for t in range(n):
        probs = np.array(mx.softmax(x[t] @ layer["gate"].T))
        best = np.argsort(-probs)[:k]
        weights_ = probs[best] / (probs[best].sum() if norm_topk_prob else 1)
        expected = sum(w * li.swiglu(x[t:t + 1], {kind: layer[kind][int(e)] for kind in
                                                  ("gate_proj", "up_proj", "down_proj")})[0]
                       for e, w in zip(best, weights_))
        assert mx.abs(ours[t] - expected).max().item() < 1e-4, t


def test_cache_gives_what_recomputing_gives(moe):
    """The whole prompt at once (its tokens sorted by expert) against 32 tokens, then the rest one
    at a time (not sorted), through the cache."""
    _, config, weights, tokenizer = experts(moe)
    ids = mx.array(tokenizer.encode(PROMPT * 3).ids)  # 38 tokens
    whole = li.forward(ids, weights, config, li.make_cache(config), last_only=False)
    cache = li.make_cache(config)
    steps = [li.forward(ids[:32], weights, config, cache, last_only=False)]
    steps += [li.forward(ids[i:i + 1], weights, config, cache, False) for i in range(32, len(ids))]
    assert mx.abs(whole - mx.concatenate(steps)).max().item() < TOL


def main_output(capsys, folder, *flags):
    """What main() prints on stdout for these flags, with Part 1 as written again after it."""
    assert li.main(["--model", str(folder), "--max-tokens", "10", "--dtype", "float32",
                    *flags]) == 0
    restore()
    return capsys.readouterr().out


def test_flags_give_the_same_text(tiny_moe, capsys):
    """--reference-ops, --no-cache and --top-probs as the default; --trace narrates the blocks."""
    texts = [main_output(capsys, tiny_moe, *flags) for flags in (
        (), ("--reference-ops",), ("--no-cache",), ("--top-probs", "3"))]
    assert texts[1:] == texts[:1] * 3 and len(texts[0]) > 10
    assert main_output(capsys, tiny_moe, "--trace").count(" done: residual stream ") == 3


def test_a_dense_draft_serves_a_mixture(tiny_moe, tiny_model, capsys):
    """--draft-model with a dense Qwen3 of the same tokenizer (section 22) on a mixture of experts:
    the draft is checked as a dense model, its blocks run Part 1's SwiGLU, and the greedy text is
    the mixture's own."""
    plain = main_output(capsys, tiny_moe)
    drafted = main_output(capsys, tiny_moe, "--draft-model", str(tiny_model))
    assert drafted == plain and len(plain) > 10


def test_chat_reuses_its_cache(moe):
    """The second turn's reply, its conversation prefilled in part (the first turn cached) or in
    full (in one pass, its tokens sorted by expert), is the same."""
    _, config, weights, tokenizer = experts(moe)
    chat = li.Chat(weights, config, tokenizer)
    list(chat.reply(PROMPT, 6))
    second = tokens(chat.reply("Tell me more", 6))
    assert chat.reused > 16
    fresh = li.Chat(weights, config, tokenizer)
    fresh.turns = chat.turns[:1]
    assert tokens(fresh.reply("Tell me more", 6)) == second and fresh.reused == 0


@pytest.fixture(scope="module")
def tiny_moe(checkpoints):
    return checkpoints(TINY_MOE_CONFIG, seed=3, name="8-experts-top-2")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_as_mlx_lm_convert(tiny_moe, checkpoints, bits):
    """--quantize gives the arrays mlx_lm.convert writes (routers at 8 bits), that folder loads as
    it is, and both generate mlx-lm's tokens."""
    converted = checkpoints.converted(tiny_moe, quantize=True, q_bits=bits, q_group_size=64)
    _, ours, tokenizer, _ = load_model(tiny_moe, mx.float32, bits)
    restore()
    config, stored, _, _ = load_model(converted, mx.float32)
    for short in ("gate", "gate_proj", "down_proj", "q_proj"):
        a, b = ours["layers"][0][short], stored["layers"][0][short]
        assert a.bits == b.bits == (8 if short == "gate" else bits)
        assert all(mx.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
    ids = tokenizer.encode(PROMPT).ids
    model, _ = mlx_lm_load_model(converted)
    model.set_dtype(mx.float32)
    theirs = tokens(generate_step(mx.array(ids), model, max_tokens=10))
    assert tokens(li.generate(ids, stored, config, 10)) == theirs
    assert tokens(li.generate(ids, ours, config, 10)) == theirs


def test_quantize_on_a_converted_folder_uses_its_routers_as_stored(tiny_moe, checkpoints):
    """--quantize 4 on the folder mlx_lm.convert wrote at 4 bits: its routers, stored at 8 bits,
    are used as they are (not quantized again from their packed integers), as every other matrix
    is. The logits are mlx-lm's on that folder."""
    converted = checkpoints.converted(tiny_moe, quantize=True, q_bits=4, q_group_size=64)
    config, weights, tokenizer, _ = load_model(converted, mx.float32, 4)
    assert weights["layers"][0]["gate"].bits == 8
    ids = tokenizer.encode(PROMPT).ids
    ours = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
    model, _ = mlx_lm_load_model(converted)
    model.set_dtype(mx.float32)
    assert mx.abs(ours - model(mx.array(ids)[None])[0]).max().item() < TOL


def test_stacked_float_folder_loads(tiny_moe, checkpoints):
    """mlx_lm.convert without -q: experts stacked as switch_mlp, floats."""
    converted = checkpoints.converted(tiny_moe)
    hf = load_model(tiny_moe, mx.float32)[1]
    restore()
    stacked = load_model(converted, mx.float32)[1]
    for short in ("gate", "gate_proj", "up_proj", "down_proj"):
        assert mx.array_equal(hf["layers"][2][short], stacked["layers"][2][short])


# ------------------------------------------------------------------------------------------------
# cli.py's checks: one line each
# ------------------------------------------------------------------------------------------------

def edited(folder, tmp_path, config=None, drop=None):
    """A copy of the folder in tmp_path with config.json's keys changed (None: removed), or
    without the tensor `drop`; the other files linked."""
    copy = tmp_path / folder.name
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).hardlink_to(path)
    if config:
        raw = json.loads((folder / "config.json").read_text()) | config
        (copy / "config.json").unlink()
        kept = {key: value for key, value in raw.items() if value is not None}
        (copy / "config.json").write_text(json.dumps(kept))
    if drop:
        tensors = mx.load(str(folder / "model.safetensors"))
        del tensors[drop]
        (copy / "model.safetensors").unlink()
        mx.save_safetensors(str(copy / "model.safetensors"), tensors)
    return copy


def refusal(folder):
    """The one line load_model's checks (main()'s) refuse the folder with."""
    with pytest.raises(cli.UserError) as e:
        load_model(folder, mx.float32)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_more_experts_per_token_than_experts(tiny_moe, tmp_path):
    message = refusal(edited(tiny_moe, tmp_path, {"num_experts_per_tok": 9}))
    assert "'num_experts_per_tok' (9) should be at most 'num_experts' (8)" in message


def test_every_expert_per_token_runs_as_mlx_lm_does(checkpoints):
    """num_experts_per_tok equal to num_experts is valid: each token goes through all 8 experts,
    weighted by the router. The prompt's logits (its tokens sorted by expert) and the greedy
    tokens after it (one at a time) are mlx-lm's."""
    folder = checkpoints(TINY_MOE_CONFIG | {"num_experts_per_tok": 8}, seed=3, name="top-8-of-8")
    config, weights, tokenizer, _ = load_model(folder, mx.float32)
    assert config.num_experts_per_tok == config.num_experts == 8
    ids = tokenizer.encode(PROMPT).ids
    ours = li.forward(mx.array(ids), weights, config, li.make_cache(config), last_only=False)
    model, _ = mlx_lm_load_model(folder)
    model.set_dtype(mx.float32)
    assert mx.abs(ours - model(mx.array(ids)[None])[0]).max().item() < TOL
    theirs = tokens(generate_step(mx.array(ids), model, max_tokens=6))
    assert tokens(li.generate(ids, weights, config, 6)) == theirs


def test_expert_width_that_the_tensors_do_not_have(tiny_moe, tmp_path):
    message = refusal(edited(tiny_moe, tmp_path, {"moe_intermediate_size": 128}))
    assert "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has shape (64, 64), " \
           "expected (128, 64)" in message


def test_a_missing_expert(tiny_moe, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    assert refusal(edited(tiny_moe, tmp_path, drop=name)).endswith(f"lacks the tensor {name!r}")


def test_stacked_folder_without_num_experts(tiny_moe, checkpoints, tmp_path):
    folder = edited(checkpoints.converted(tiny_moe, quantize=True, q_bits=4, q_group_size=64),
                    tmp_path, {"num_experts": None})
    assert refusal(folder).endswith("config.json lacks the required key 'num_experts'")


def test_mlp_only_layers_not_a_list(tiny_moe, tmp_path):
    message = refusal(edited(tiny_moe, tmp_path, {"mlp_only_layers": 1}))
    assert message.endswith("'mlp_only_layers' should be a list of layer numbers, got 1")


def test_memory_check_counts_every_expert(tmp_path, monkeypatch):
    """Qwen3-30B-A3B's shape: 61.1 GB in bfloat16 for all 30.5 B parameters (README's table); at 4
    bits, 17.2 GB, which fits 32 GB."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_SHAPE | {
        "vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960}))
    config = li.with_experts(li.load_config(tmp_path), tmp_path)
    monkeypatch.setattr(cli, "memory_size", lambda: 32e9)
    monkeypatch.setattr(cli, "gpu_working_set", lambda: None)
    fit = lambda bits: cli.check_fit(config, li.layer_shapes, mx.bfloat16, bits, {},
                                     li.quantizable, li.has_experts)
    with pytest.raises(cli.UserError, match=r"need 61\.1 GB as bfloat16 \(all 30\.5 B parameters: "
                                            r"a token uses 8 of a block's 128 experts"):
        fit(None)
    fit(4)


def test_two_processes_split_each_expert(moe):
    """Each of 2 processes keeps half of every expert's units (and of the heads): its memory check
    counts that half. Quantized, its columns of down_proj must hold whole groups of 64."""
    config = moe[1]
    shares = li.split_config(config, 2)
    assert shares == config._replace(num_attention_heads=2, num_key_value_heads=1,
                                     intermediate_size=64, moe_intermediate_size=32)
    wider = config._replace(head_dim=32)  # 64 columns of o_proj each, 64 of the dense down_proj
    assert li.can_split(wider, 2) and not li.can_split(wider, 2, 64)  # but 32 of each expert's
    assert li.can_split(wider._replace(moe_intermediate_size=128), 2, 64)


def test_unquantized_experts_in_bfloat16_on_the_cpu(tiny_moe, monkeypatch):
    """MLX's CPU runs mx.gather_mm in float32 only: bfloat16 is one line, not a traceback; quantized
    experts (mx.gather_qmm) run."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        with pytest.raises(cli.UserError, match=r"float32 only, not bfloat16: use --dtype float32"):
            load_model(tiny_moe, mx.bfloat16)
        restore()
        config, weights, tokenizer, _ = load_model(tiny_moe, mx.bfloat16, 4)
        assert len(tokens(li.generate(tokenizer.encode(PROMPT).ids, weights, config, 2))) == 2
    finally:
        mx.set_default_device(device)
