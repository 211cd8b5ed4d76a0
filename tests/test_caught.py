"""Bugs the rest of the suite let through: each was injected into llm_inference.py (or bench.py) once,
and survived every other test. Each test here fails on its bug (the bug is named in its docstring)."""

import io
import json
import shlex
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import bench
import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG, write_checkpoint, load_model, weight_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("caught") / "tiny", TINY_CONFIG)


def test_the_lowest_temperature_and_min_p_0_are_accepted():
    """Bugs: the temperature floor itself refused (> instead of >=); --min-p 0 refused."""
    assert cli.parse_args(["--temperature", str(cli.MIN_TEMPERATURE)]).temperature == cli.MIN_TEMPERATURE
    assert cli.parse_args(["--min-p", "0"]).min_p == 0
    with pytest.raises(SystemExit):
        cli.parse_args(["--temperature", str(cli.MIN_TEMPERATURE / 2)])


def test_a_transformers_5_config_with_rope_theta_in_rope_parameters(tiny):
    """Bug: rope_theta read only at the top level, so transformers 5's configs were refused."""
    raw = json.loads((tiny / "config.json").read_text())
    theta = raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    (tiny.parent / "t5").mkdir(exist_ok=True)
    for path in tiny.iterdir():
        (tiny.parent / "t5" / path.name).write_bytes(path.read_bytes())
    (tiny.parent / "t5" / "config.json").write_text(json.dumps(raw))
    cli.check_config(tiny.parent / "t5", li.Config.__annotations__)
    config = li.load_config(tiny.parent / "t5")
    assert config.rope_theta == theta == li.load_config(tiny).rope_theta


def test_the_chat_format_counts_the_system_message(tmp_path):
    """Bug: --chat's start-up check of --max-tokens counted the format without --system."""
    folder = write_checkpoint(tmp_path / "m", TINY_CONFIG | {"max_position_embeddings": 80})
    tokenizer = li.load_tokenizer(folder)
    system = "You are a helpful assistant who answers briefly."
    n_format = len(li.tokenize(tokenizer, li.chat_prompt("", system, True)))
    assert n_format > len(li.tokenize(tokenizer, li.chat_prompt("", None, True))) + 5
    fits = 80 - n_format - 1  # one token left for a message
    flags = ["--model", str(folder), "--chat", "--system", system, "--temperature", "0.6"]
    with pytest.raises(cli.UserError, match="and --system takes"):
        li.main([*flags, "--max-tokens", str(fits + 1)])
    sys.stdin = io.TextIOWrapper(io.BytesIO(b"/exit\n"))
    try:
        assert li.main([*flags, "--max-tokens", str(fits)]) == 0
    finally:
        sys.stdin = sys.__stdin__


def test_make_room_drops_the_last_turn_too(tmp_path):
    """Bug: make_room stopped before dropping the last remaining turn (dropped < len(turns) - 1)."""
    folder = write_checkpoint(tmp_path / "m", TINY_CONFIG | {"max_position_embeddings": 80})
    config, tokenizer = li.load_config(folder), li.load_tokenizer(folder)
    chat = li.Chat(None, config, tokenizer)
    chat.turns = [("One", li.tokenize(tokenizer, "A reply of a few tokens."))]
    alone = len(li.Chat(None, config, tokenizer).prompt_ids("Two"))
    cli.make_room(chat, "Two", 80 - alone)  # fits only without the one earlier turn
    assert chat.turns == []


def test_the_trace_numbers_blocks_from_0(tiny, capsys):
    """Bug: --trace numbered the blocks from 1."""
    config, weights = li.load_config(tiny), li.load_weights(tiny, li.load_config(tiny), mx.float32)
    tokenizer = li.load_tokenizer(tiny)
    li.trace(li.tokenize(tokenizer, "The capital of France is"), weights, config, tokenizer)
    blocks = [line.split()[1] for line in capsys.readouterr().out.splitlines()
              if line.startswith("block ") and " done:" in line]
    assert blocks == [str(i) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize("reference_ops", [False, True])
def test_reference_ops_runs_part_1_as_written(tiny, monkeypatch, capsys, reference_ops):
    """Bug: --reference-ops did not take effect (the fused kernels ran anyway)."""
    calls = []
    for name in ("rms_norm", "rope", "scaled_dot_product_attention"):
        kernel = getattr(mx.fast, name)
        monkeypatch.setattr(mx.fast, name, lambda *a, _k=kernel, _n=name, **kw:
                            calls.append(_n) or _k(*a, **kw))
    flags = ["--reference-ops"] if reference_ops else []
    assert li.main(["--model", str(tiny), "--max-tokens", "3", *flags]) == 0
    assert capsys.readouterr().out.strip()  # some text came out
    if reference_ops:
        assert calls == [] and li.rms_norm.__name__ == "rms_norm"
        assert li.silu_gate is not li.compiled_silu_gate
    else:
        assert set(calls) == {"rms_norm", "rope", "scaled_dot_product_attention"}


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


def test_the_printed_download_command_quotes_its_path(tmp_path, monkeypatch):
    """Bug: the --local-dir of the printed `hf download` command was not shell-quoted."""
    folder = tmp_path / "my models" / "Qwen3 0.6B"
    monkeypatch.chdir(tmp_path)
    words = shlex.split(cli.download_command("Qwen/Qwen3-0.6B", folder))
    assert words[-2:] == ["--local-dir", "my models/Qwen3 0.6B"]


def test_a_differing_stored_head_is_quantized_too(tmp_path):
    """Bug: with --quantize, a tied config's different stored lm_head.weight stayed in floats."""
    folder = write_checkpoint(tmp_path / "m", TINY_CONFIG, tied_head="different")
    _, weights, _, _ = load_model(folder, mx.float32, 4)
    assert isinstance(weights["lm_head"], li.Quantized) and weights["lm_head"].bits == 4
    assert weights["lm_head"] is not weights["embed_tokens"]


def test_the_primitives_total_counts_primitives_not_kinds(capsys):
    """Bug: bench.py's printed total counted the kinds of primitive, not the primitives."""
    import collections
    counts = {"ours": collections.Counter(Matmul=8, Add=3),
              "mlx-lm": collections.Counter(Matmul=8, Add=5, Exp=1)}
    bench.print_primitives(counts)
    first = capsys.readouterr().out.splitlines()[0]
    assert "ours 11," in first and "mlx-lm 14 " in first


def test_the_memory_check_counts_an_untied_head(tmp_path, monkeypatch):
    """Bug: load_model's memory check counted an untied model as tied, leaving out its LM head
    (1.24 GB for Qwen3-8B in bfloat16)."""
    folder = write_checkpoint(tmp_path / "m", TINY_CONFIG | {"tie_word_embeddings": False})
    config = li.load_config(folder)
    needed = weight_bytes(config, mx.float32)
    assert needed > weight_bytes(config._replace(tie_word_embeddings=True), mx.float32)
    monkeypatch.setattr(cli, "memory_size", lambda: needed - 1)
    monkeypatch.setattr(cli, "gpu_working_set", lambda: None)
    with pytest.raises(cli.UserError, match="the weights need"):
        load_model(folder, mx.float32)
    monkeypatch.setattr(cli, "memory_size", lambda: needed)
    load_model(folder, mx.float32)
