"""Bad inputs that ended in a traceback, a hang, a crash or a wrong answer instead of one line: each
was found by trying some 200 damaged folders, flags and streams on the script, and each test here
fails on the code before its fix (the fix is named in its docstring)."""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG, load_model
from tests.test_cli import SCRIPT, assert_one_line_error, cli_env, parse_success, run_cli
from tests.test_distributed import Group


@pytest.fixture
def tiny(tiny_model):
    """tests/conftest.py's tiny checkpoint, made once per process (only read, or copied)."""
    return tiny_model


def copy(tiny, folder, **files):
    """A copy of the tiny checkpoint in `folder`; each keyword (dots as underscores) replaces a file
    with bytes, or with a dict written as JSON."""
    shutil.copytree(tiny, folder)
    for name, content in files.items():
        name = name.replace("_json", ".json").replace("_safetensors", ".safetensors")
        (folder / name).write_bytes(json.dumps(content).encode() if isinstance(content, dict)
                                    else content)
    return folder


def config_with(tiny, **changes):
    return json.loads((tiny / "config.json").read_text()) | changes


def test_a_model_path_too_long_for_the_file_system(tmp_path):
    """Fix: find_model's Path.exists() raised ENAMETOOLONG as a traceback."""
    with pytest.raises(cli.UserError, match="cannot read the folder a+: File name too long"):
        cli.find_model("a" * 300, False, li.Config.__annotations__)


@pytest.mark.parametrize("shard, message", [
    ("a" * 300 + ".safetensors", "cannot read {folder}/{shard} (File name too long); re-download it"),
    ("weights.npz", "{folder}/model.safetensors.index.json is not a valid index of shards")],
    ids=["too long", "npz"])
def test_an_index_naming_a_file_too_long_or_not_safetensors(tiny, tmp_path, shard, message):
    """Fix: a weight_map name too long raised ENAMETOOLONG; one naming weights.npz was read by
    mx.load (by its extension), then the stored-head check took "PK..." for a header length."""
    folder = copy(tiny, tmp_path / "m")
    tensors = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    if shard.endswith(".npz"):
        mx.savez(str(folder / shard), **tensors)
    (folder / cli.WEIGHTS_INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(tensors, shard)}))
    with pytest.raises(cli.UserError, match="^" + re.escape(message.format(folder=folder, shard=shard))):
        load_model(folder, mx.float32)


@pytest.mark.parametrize("file", ["config.json", "generation_config.json", cli.WEIGHTS_INDEX])
def test_json_nested_too_deep(tiny, tmp_path, file):
    """Fix: json.loads' RecursionError (a RuntimeError) escaped read_json and the index check."""
    deep = b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    folder = copy(tiny, tmp_path / "m", **{file.replace(".json", "_json"): deep})
    if file == cli.WEIGHTS_INDEX:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    fix = "delete or re-download it" if file == "generation_config.json" else "re-download it"
    with pytest.raises(cli.UserError, match=rf"^cannot read {re.escape(str(folder / file))} "
                                            rf"\(maximum recursion depth exceeded[^)]*\); {fix}$"):
        load_model(folder, mx.float32)


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": [1]}, "'rope_parameters' should be an object, got [1]"),
    ({"rope_theta": 10**400}, "'rope_theta' should be a positive number"),
    ({"rms_norm_eps": 10**400}, "'rms_norm_eps' should be a positive number"),
    ({"quantization": {"bits": 4.0, "group_size": 64}}, "at 4.0 bits in groups of 64"),
    ({"quantization": {"bits": 4, "group_size": 64.0}}, "at 4 bits in groups of 64.0"),
    ({"quantization": {"bits": 4, "group_size": 64, "model.norm": {"bits": 4.0, "group_size": 64}}},
     "at 4.0 bits in groups of 64 for model.norm"),
], ids=["rope_parameters", "rope_theta", "rms_norm_eps", "bits", "group_size", "a layer's bits"])
def test_config_values_that_passed_the_checks(tiny, tmp_path, changes, message):
    """Fix: a rope_parameters list raised AttributeError; ints too large for a float, and float
    bits or group sizes (4.0 in (2, 3, 4, ...) is True), passed, then failed inside MLX."""
    folder = copy(tiny, tmp_path / "m", config_json=config_with(tiny, **changes))
    with pytest.raises(cli.UserError, match=message.replace("[", r"\[").replace(".", r"\.")):
        cli.check_config(folder, li.Config.__annotations__)


def test_a_large_integer_rope_theta_runs_as_a_float(tiny, tmp_path, capsys):
    """Fix: "rope_theta": 10**20 (an int in JSON) reached RoPE as an int: std::bad_cast."""
    folder = copy(tiny, tmp_path / "m", config_json=config_with(tiny, rope_theta=10**20))
    assert li.load_config(folder).rope_theta == 1e20
    assert li.main(["--model", str(folder), "--max-tokens", "2", "--reference-ops"]) == 0


def test_a_transformers_5_config_with_rope_theta_in_rope_parameters(tiny, tmp_path):
    """Bug: rope_theta read only at the top level, so transformers 5's configs were refused."""
    raw = json.loads((tiny / "config.json").read_text())
    theta = raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    folder = copy(tiny, tmp_path / "t5", config_json=raw)
    cli.check_config(folder, li.Config.__annotations__)
    config = li.load_config(folder)
    assert config.rope_theta == theta == li.load_config(tiny).rope_theta


def test_a_min_p_of_0_in_generation_config_is_accepted(tiny, tmp_path):
    """Bug: generation_config.json's "min_p": 0 (off, transformers' default) was refused, as if
    outside [0, 1]."""
    generation_config = json.loads((tiny / "generation_config.json").read_text()) | {"min_p": 0}
    folder = copy(tiny, tmp_path / "m", generation_config_json=generation_config)
    assert cli.load_generation_config(folder)["min_p"] == 0
    assert li.main(["--model", str(folder), "--max-tokens", "2", "--temperature", "0.7"]) == 0


def test_an_odd_head_dim(checkpoints):
    """Fix: head_dim 15 (with tensors to match) failed in RoPE, which turns pairs of channels."""
    folder = checkpoints(TINY_CONFIG | {"head_dim": 15})
    with pytest.raises(cli.UserError, match="'head_dim' should be even, got 15"):
        cli.check_config(folder, li.Config.__annotations__)


def test_a_billion_layers_is_refused_at_once(tiny, tmp_path):
    """Fix: check_weights listed 11 names per layer before the first check: 10**9 layers hung."""
    folder = copy(tiny, tmp_path / "m", config_json=config_with(tiny, num_hidden_layers=10**9))
    result = run_cli("--model", folder, cwd=tmp_path, timeout=60)
    assert_one_line_error(result, 1, "lacks the tensor 'model.layers.2.")


def test_a_token_id_beyond_the_embedding_table(tiny, tmp_path, monkeypatch, capsys):
    """Fix: only the tokenizer's size was compared with the table; an id beyond it read outside
    the table (at 2 * 10**9, a segmentation fault). Refused in the prompt; in a chat, the message."""
    tokenizer = json.loads((tiny / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["The"] = 2 * 10**9
    folder = copy(tiny, tmp_path / "m", tokenizer_json=tokenizer)
    with pytest.raises(cli.UserError, match="gave the token id 2000000000, but the embedding table"):
        li.main(["--model", str(folder), "--max-tokens", "2"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The end\nHi\n")))
    assert li.main(["--model", str(folder), "--chat", "--max-tokens", "2"]) == 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gave the token id 2000000000" in errors[0]


@pytest.mark.parametrize("tokenizer", ["a 300-token BPE", "Qwen's without </think>"])
def test_a_tokenizer_from_another_model_smaller_than_the_table_is_refused(tiny, tmp_path, tokenizer):
    """Fix: only a tokenizer larger than the embedding table was refused. A small BPE beside the
    151,936-row table printed an empty reply and exited 0; one without Qwen3's special tokens split
    them into bytes in a chat. (Qwen's own, 151,669 tokens, passes: every other test runs it.)"""
    if tokenizer == "a 300-token BPE":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.train_from_iterator(["The capital of France is Paris. "] * 50, trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        content, why = bpe.to_str().encode(), f"({bpe.get_vocab_size()} tokens for 151936 "
    else:
        content = json.loads((tiny / "tokenizer.json").read_text())
        content["added_tokens"] = [t for t in content["added_tokens"] if t["content"] != "</think>"]
        why = "(151668 tokens for 151936 embedding rows, without </think>)"
    folder = copy(tiny, tmp_path / "m", tokenizer_json=content)
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          f"{folder / 'tokenizer.json'} has another tokenizer {why}")


def test_a_token_id_equal_to_the_table_size_is_refused(tiny):
    """Bug: check_ids let the id vocab_size itself through (> for >=): the row after the table's
    last, read outside it. (test_a_token_id_beyond_the_embedding_table runs one through main().)"""
    config = li.load_config(tiny)
    with pytest.raises(cli.UserError, match=f"gave the token id {config.vocab_size}, but the "
                                            f"embedding table has only {config.vocab_size} rows"):
        cli.check_ids([5, config.vocab_size, 7], config)
    cli.check_ids([5, config.vocab_size - 1, 7], config)  # the table's last row: no error


def test_a_tokenizer_that_truncates_or_pads_leaves_the_prompt_whole(tiny, tmp_path, capsys):
    """Fix: a truncation section in tokenizer.json cut the prompt to 2 tokens, and one with a
    stride above its length panicked in the Rust library (a BaseException)."""
    tokenizer = json.loads((tiny / "tokenizer.json").read_text())
    tokenizer["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst",
                               "stride": 5}
    tokenizer["padding"] = {"strategy": {"Fixed": 50}, "direction": "Right", "pad_to_multiple_of":
                            None, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"}
    folder = copy(tiny, tmp_path / "m", tokenizer_json=tokenizer)
    assert li.main(["--model", str(folder), "--max-tokens", "2"]) == 0
    assert "'The capital of France is' (5 tokens)" in capsys.readouterr().err


@pytest.mark.parametrize("templates", [["x", 1], [{"name": "default", "template": "enable_thinking"},
                                                   None]])
def test_a_chat_template_list_with_entries_that_are_not_objects(tiny, tmp_path, templates):
    """Fix: check_chat_template called .get() on each entry: AttributeError."""
    folder = copy(tiny, tmp_path / "m", tokenizer_config_json={"chat_template": templates})
    cli.check_chat_template(folder)  # no template named default: given the benefit of the doubt


@pytest.mark.parametrize("change", ["padded with NUL bytes", "nested 3000 deep"])
def test_a_safetensors_header_that_mlx_reads_and_json_does_not(tiny, tmp_path, change):
    """Fix: mx.load reads a header padded with NUL bytes, or with an entry nested 3000 deep; the
    stored-head check's json.loads did not (JSONDecodeError, RecursionError: tracebacks)."""
    data = (tiny / "model.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = data[8:8 + length]
    if change == "padded with NUL bytes":
        header += b"\0" * 8
    else:
        header = header.replace(b'"model.norm.weight":{',
                                b'"model.norm.weight":{"x":' + b"[" * 3000 + b"]" * 3000 + b",")
    changed = len(header).to_bytes(8, "little") + header + data[8 + length:]
    folder = copy(tiny, tmp_path / "m", model_safetensors=changed)
    assert mx.load(str(folder / "model.safetensors")).keys() == mx.load(str(tiny / "model.safetensors")).keys()
    reason = "Extra data" if change == "padded with NUL bytes" else "maximum recursion depth exceeded"
    with pytest.raises(cli.UserError, match=rf"^cannot read {re.escape(str(folder / 'model.safetensors'))} "
                                            rf"\({reason}.*\); re-download it$"):
        load_model(folder, mx.float32)


def test_top_probs_beyond_the_vocabulary(tiny, capsys):
    """Fix: --top-probs 10**12 sliced with an index MLX refuses: ValueError."""
    cli.print_top_probs(mx.arange(6, dtype=mx.float32), li.load_tokenizer(tiny), 10**12)
    assert len(capsys.readouterr().err.splitlines()) == 1 + 6


def test_trace_refuses_nan_logits(tiny, tmp_path):
    """Fix: --trace printed a table of nan probabilities and exited 0; a reply says it in one line."""
    tensors = mx.load(str(tiny / "model.safetensors"))
    tensors["model.norm.weight"] = mx.full(tensors["model.norm.weight"].shape, mx.nan, mx.bfloat16)
    folder = copy(tiny, tmp_path / "m")
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    with pytest.raises(cli.UserError, match="NaN or infinite logits"):
        li.main(["--model", str(folder), "--trace"])


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "float16 overflow"])
def test_logits_partly_nan_or_infinite_are_refused(bad):
    """Bug: check_logits refused only logits that were all NaN or infinite (mx.any for mx.all):
    float16 overflow makes some of them inf, and the table or the draw ran on."""
    logits = mx.array([1.0, -2.0, 3.0, 0.5], mx.float16)
    cli.check_logits(logits)  # all finite: no error
    if bad == "float16 overflow":
        logits = (mx.array([1.0, -2.0, 3.0, 0.5]) * mx.array([1.0, 1.0, 3e4, 1.0])).astype(mx.float16)
    else:
        logits[2] = float(bad)
    assert not mx.isfinite(logits)[2].item() and mx.isfinite(logits).sum().item() == 3
    with pytest.raises(cli.UserError, match="NaN or infinite logits"):
        cli.check_logits(logits)


def run_shell(command, tiny, tmp_path):
    """The script under bash, for redirections that subprocess cannot make (a closed stream)."""
    proc = subprocess.run(["bash", "-c", f"{sys.executable} {SCRIPT} --model {tiny} --max-tokens 2 "
                           f"{command}"], cwd=tmp_path, capture_output=True, timeout=120,
                          env=cli_env(tmp_path / ".hf-home"))
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def test_closed_stdin(tiny, tmp_path):
    """Fix: with stdin closed (<&-), --prompt - raised AttributeError, and any other run called a
    good model.safetensors damaged (MLX opened it as descriptor 0 and took that for a failure)."""
    parse_success(run_shell("<&-", tiny, tmp_path))
    assert_one_line_error(run_shell("--prompt - <&-", tiny, tmp_path), 1, "the prompt is empty")


def test_closed_stdout(tiny, tmp_path):
    """Fix: a closed stdout (>&-) raised AttributeError as a traceback."""
    assert_one_line_error(run_shell(">&-", tiny, tmp_path), 1, "standard output is closed")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="macOS has no /dev/full")
def test_a_full_stdout(tiny, tmp_path):
    """Fix: writing to a full disk (/dev/full) raised OSError as a traceback."""
    rc, _, err = run_shell("> /dev/full", tiny, tmp_path)
    assert rc == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "llm_inference.py: error: cannot write the text: No space left on device"


def test_prompt_from_stdin_is_refused_under_several_processes(tiny, monkeypatch):
    """Fix: under mlx.launch, which never closes the processes' input, --prompt - waited forever
    for the end of stdin."""
    monkeypatch.setattr(li.mx.distributed, "init", lambda: Group(2))
    monkeypatch.setattr(cli, "join", lambda group: None)  # no signal handlers, no shared reads
    with pytest.raises(cli.SharedError, match="under mlx.launch stdin never ends: give --prompt the text"):
        li.main(["--model", str(tiny), "--prompt", "-"])


@pytest.mark.parametrize("flags", [["--max-tokens", "40960"], ["--chat", "--max-tokens", "40960"],
                                   ["--chat", "--system", os.fsdecode(b"caf\xc3")]],
                         ids=["prompt too long", "no room in a chat", "--system not UTF-8"])
def test_refusals_every_process_meets_are_said_once(tiny, flags):
    """Fix: these were plain UserErrors, which every process of a group prints: under mlx.launch,
    the same line twice. A SharedError is said by process 0 alone."""
    with pytest.raises(cli.SharedError):
        li.main(["--model", str(tiny), *flags])


def test_trace_takes_a_prompt_that_fills_the_context(checkpoints, capsys):
    """Fix: --trace, which makes no reply, refused a prompt that left no room for the default
    --max-tokens (half the context)."""
    folder = checkpoints(TINY_CONFIG | {"max_position_embeddings": 64})
    prompt = " a" * 63  # 63 tokens, and no room for more
    assert li.main(["--model", str(folder), "--trace", "--prompt", prompt]) == 0
    assert "final RMSNorm + LM head" in capsys.readouterr().out
    with pytest.raises(cli.SharedError, match="the prompt has 65 tokens, more than the model's 64"):
        li.main(["--model", str(folder), "--trace", "--prompt", prompt + " a a"])
