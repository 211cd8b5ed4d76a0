"""The command line, end to end: `python llm_inference.py ...` as real subprocesses.

Every run gets a controlled environment: the working directory is a temporary folder (so the default
./Qwen3-0.6B is under the test's control), HF_HOME points at a temporary folder (no user cache is read or
written) and HF_HUB_OFFLINE=1 unless a test says otherwise, so nothing ever reaches the network; the
download tests talk to a closed port or to a fake Hugging Face hub served on 127.0.0.1 by this file.

The model is a tiny random-weight Qwen3 (tests/checkpoint.py: 2 layers, real 151936-token vocabulary and
real Qwen tokenizer), built once per session; bad-input cases copy it and break one thing.
"""

import ast
import contextlib
import hashlib
import http.server
import io
import itertools
import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

import mlx.core as mx
import pytest

import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG, load_model, weight_bytes
from tests.test_model import pieces_of

SCRIPT = Path(li.__file__).resolve()
PROGRAM = (SCRIPT, Path(cli.__file__).resolve())  # the script and its companion module


def copy_script(folder):
    """A copy of the script, with the module it imports, in folder."""
    for path in PROGRAM:
        shutil.copy(path, folder / path.name)
PROMPT = "The capital of France is"  # 5 tokens with Qwen's tokenizer
STATS = re.compile(  # a rate is left out where there is none (no token generated; one: no decode rate)
    r"Prompt: (\d+) tokens?(?:, [\d.]+ tok/s)? \| Generated: (\d+) tokens?(?:, [\d.]+ tok/s)? \| "
    r"Prefill \+ decode: [\d.]+ s \| Peak memory: [\d.]+ GB$"
)
ERROR_PREFIX = "llm_inference.py: error: "
MANUAL_DOWNLOAD = "hf download Qwen/Qwen3-0.6B"
DEVICE = "gpu" if mx.default_device() == mx.gpu else "cpu"  # as the model line names it


# ------------------------------------------------------------------------------------------------
# Running the script
# ------------------------------------------------------------------------------------------------

def cli_env(home, **overrides):
    """os.environ without any Hugging Face settings or tokens, offline, with a private HF_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_cli(*args, cwd, stdin=b"", script=SCRIPT, timeout=120, **env):
    """Run the script; returns (exit code, stdout, stderr) with the streams decoded as UTF-8."""
    cwd = Path(cwd)
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, input=stdin,
                          capture_output=True, timeout=timeout, env=cli_env(cwd / ".hf-home", **env))
    return proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")


def unreadable(path, fix="re-download it"):
    """The two ends of cli.reading's line for a file that cannot be read or parsed:
    'cannot read PATH (REASON); FIX', REASON being the OS's or the library's."""
    return f"cannot read {path} (", f"); {fix}"


def assert_one_line_error(result, code=1, *needles):
    """Exit `code`, nothing on stdout, exactly one line on stderr that names the problem."""
    rc, out, err = result
    assert "Traceback" not in err, err
    assert rc == code, f"exit code {rc}, expected {code}; stderr:\n{err}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert err.endswith("\n")
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert out == "", f"unexpected stdout: {out!r}"
    return lines[0]


def stderr_lines(err):
    """stderr's lines without the OpenBLAS hint, which follows the model line on a Linux CPU without
    OpenBLAS (tests/test_openblas.py checks it): the same lines on every machine."""
    return [line for line in err.splitlines() if line != cli.OPENBLAS_HINT]


def parse_success(result):
    """Checks a normal run; returns (generated text, stderr lines, prompt tokens, generated tokens)."""
    rc, out, err = result
    assert rc == 0, f"exit code {rc}; stderr:\n{err}"
    assert "Traceback" not in err, err
    assert out.endswith("\n"), repr(out)
    lines = stderr_lines(err)
    assert lines[0].startswith("Model: "), lines
    stats = STATS.search(lines[-1])
    assert stats and lines[-1].startswith("Prompt: "), lines[-1]
    return out[:-1], lines, int(stats[1]), int(stats[2])


def test_tf32_is_off_in_the_tests_and_their_subprocesses(tmp_path):
    """tests/conftest.py keeps float32 products in full precision on CUDA and M5 Macs (MLX_ENABLE_TF32=0):
    in this process, and in every script the tests run, as they all run with cli_env()."""
    assert os.environ.get("MLX_ENABLE_TF32") == "0"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MLX_ENABLE_TF32'))"],
                          env=cli_env(tmp_path / ".hf-home"), capture_output=True, text=True, timeout=60)
    assert proc.stdout == "0\n", proc.stderr


# ------------------------------------------------------------------------------------------------
# The tiny checkpoint and the in-process reference (the fixtures tiny_model and reference, which
# other modules share, are in tests/conftest.py)
# ------------------------------------------------------------------------------------------------

class Reference:
    """The same model loaded in this process with the library functions, to compare the CLI against."""

    def __init__(self, folder, dtype, bits=None):
        self.folder = folder
        self.config = li.load_config(folder)
        self.tokenizer = li.load_tokenizer(folder)  # parsed once per file (tests/conftest.py)
        self.weights = load_model(folder, dtype, bits)[1]
        self.eos_ids = li.load_eos_ids(folder, self.tokenizer)

    def ids(self, text):
        return self.tokenizer.encode(text).ids

    def generate(self, text, max_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        sampling = li.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return [t for t, _ in li.generate(self.ids(text), self.weights, self.config, max_tokens, sampling,
                                          self.eos_ids)]

    def text(self, *args, **kwargs):
        return self.tokenizer.decode(self.generate(*args, **kwargs), skip_special_tokens=True)


@pytest.fixture(scope="session")
def greedy_24(reference):
    ids = reference.generate(PROMPT, 24)
    assert len(ids) == 24, "the tiny model hit end-of-sequence early; pick another checkpoint seed"
    return reference.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture
def variant(tiny_model, tmp_path):
    """make(name, **files): a copy of the tiny checkpoint in tmp_path/name; each keyword replaces one file
    (dots as underscores: config_json=...) with bytes, a dict (written as JSON) or None (file left out).
    Unchanged files are hard links (never written to); replaced ones are new files."""

    def make(name="model", **files):
        folder = tmp_path / name
        folder.mkdir()
        replace = {key.replace("_json", ".json").replace("_safetensors", ".safetensors"): value
                   for key, value in files.items()}
        for source in tiny_model.iterdir():
            target = folder / source.name
            if source.name not in replace:
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
        for filename, content in replace.items():
            if content is None:
                continue
            if isinstance(content, dict):
                content = json.dumps(content).encode()
            (folder / filename).write_bytes(content)
        return folder

    return make


def tiny_config(tiny_model):
    return json.loads((tiny_model / "config.json").read_text())


# ------------------------------------------------------------------------------------------------
# 1. Happy paths
# ------------------------------------------------------------------------------------------------

def test_greedy_matches_in_process_generation(tiny_model, greedy_24, tmp_path):
    text, lines, n_prompt, n_generated = parse_success(run_cli("--model", tiny_model, "--max-tokens", 24,
                                                               cwd=tmp_path))
    assert text == greedy_24
    dtype = str(cli.pick_dtype("auto")).split(".")[-1]  # --dtype auto, by the same rule
    assert lines[0] == ("Model: tiny-qwen3 (2 layers, 64 dim, 4 Q heads, 2 KV heads) "
                        f"on {DEVICE}, {dtype}, from {tiny_model}")
    assert lines[1] == f"Prompt: {PROMPT!r} (5 tokens), greedy"
    assert len(lines) == 3
    assert (n_prompt, n_generated) == (5, 24)
    assert "Prompt: 5 tokens" in lines[-1] and "Generated: 24 tokens" in lines[-1]


def test_top_probs_table(tiny_model, reference, greedy_24, tmp_path):
    text, lines, _, n_generated = parse_success(
        run_cli("--model", tiny_model, "--max-tokens", 24, "--top-probs", 5, cwd=tmp_path))
    assert text == greedy_24 and n_generated == 24
    header = lines.index("rank  token                   id  probability")
    rows = lines[header + 1:-1]
    assert len(rows) == 5, lines
    parsed = [re.fullmatch(r"\s*(\d+)  (.+?)\s+(\d+)  (\d\.\d{4})", row) for row in rows]
    assert all(parsed), rows
    assert [int(m[1]) for m in parsed] == [1, 2, 3, 4, 5]
    probs = [float(m[4]) for m in parsed]
    assert all(a >= b for a, b in zip(probs, probs[1:])), probs
    assert probs[0] > probs[-1] and 0 < sum(probs) <= 1
    # The same five tokens as the model's own next-token distribution, rank 1 being greedy's first token.
    logits = li.forward(mx.array(reference.ids(PROMPT)), reference.weights, reference.config,
                        li.make_cache(reference.config))
    top5 = mx.argsort(-logits)[:5].tolist()
    assert [int(m[3]) for m in parsed] == top5
    assert top5[0] == reference.generate(PROMPT, 2)[0]
    for m, token_id in zip(parsed, top5):
        assert m[2] == repr(reference.tokenizer.decode([token_id]))


@pytest.mark.parametrize("stdin", [PROMPT + "\n", "\ufeff" + PROMPT + "\r\n"],
                         ids=["echo", "BOM and CRLF"])
def test_prompt_from_stdin(tiny_model, greedy_24, tmp_path, stdin):
    # `echo ... |` adds a newline: it is not part of the prompt. A file saved by Windows Notepad
    # starts with a byte-order mark and ends its lines with CRLF: the same prompt.
    text, lines, n_prompt, n_generated = parse_success(
        run_cli("--model", tiny_model, "--max-tokens", 24, "--prompt", "-", cwd=tmp_path,
                stdin=stdin.encode()))
    assert text == greedy_24
    assert lines[1] == f"Prompt: {PROMPT!r} (5 tokens), greedy"
    assert (n_prompt, n_generated) == (5, 24)


def test_chat_no_think_with_system(tiny_model, reference, tmp_path):
    system, user = "You are terse.", "Name a colour."
    # Qwen3's chat format, written out independently of llm_inference.chat_prompt.
    chat = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    text, lines, n_prompt, n_generated = parse_success(
        run_cli("--model", tiny_model, "--max-tokens", 16, "--chat", "--no-think", "--system", system,
                "--prompt", user, "--seed", 7, cwd=tmp_path))
    # --chat --no-think takes Qwen3's recommended non-thinking sampling: 0.7 / 0.8 / top-k 20.
    assert lines[1] == f"Prompt: {user!r} ({len(reference.ids(chat))} tokens), temperature 0.7, top-k 20, top-p 0.8, seed 7"
    expected = reference.generate(chat, 16, temperature=0.7, top_k=20, top_p=0.8, seed=7)
    assert n_prompt == len(reference.ids(chat))
    assert n_generated == len(expected)
    assert text == reference.tokenizer.decode(expected, skip_special_tokens=True)


def test_sampling_is_reproducible_per_seed(tiny_model, reference, tmp_path):
    # top-k and top-p come from generation_config.json (20, 0.95), as in transformers.
    def sample(seed):
        text, lines, _, n_generated = parse_success(
            run_cli("--model", tiny_model, "--max-tokens", 12, "--temperature", 0.8, "--seed", seed, cwd=tmp_path))
        assert lines[1].endswith(f"temperature 0.8, top-k 20, top-p 0.95, seed {seed}")
        return text

    first, again, other = sample(3), sample(3), sample(4)
    assert first == again
    assert first != other
    assert first == reference.text(PROMPT, 12, temperature=0.8, top_k=20, top_p=0.95, seed=3)


def test_reference_ops_give_the_same_greedy_text(tiny_model, greedy_24, tmp_path):
    text, _, _, n_generated = parse_success(
        run_cli("--model", tiny_model, "--max-tokens", 24, "--reference-ops", cwd=tmp_path))
    assert (text, n_generated) == (greedy_24, 24)


def test_dtype_bfloat16(tiny_model, tmp_path):
    expected = Reference(tiny_model, mx.bfloat16).text(PROMPT, 12)
    text, lines, _, _ = parse_success(run_cli("--model", tiny_model, "--max-tokens", 12, "--dtype", "bfloat16",
                                              cwd=tmp_path))
    assert lines[0].endswith(f", bfloat16, from {tiny_model}")
    assert text == expected


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize(tiny_model, greedy_24, tmp_path, bits):
    expected = Reference(tiny_model, cli.pick_dtype("auto"), bits).text(PROMPT, 24)
    text, lines, _, n_generated = parse_success(
        run_cli("--model", tiny_model, "--max-tokens", 24, "--quantize", bits, cwd=tmp_path))
    assert lines[0].endswith(f", {bits}-bit weights, from {tiny_model}")
    assert (text, n_generated) == (expected, 24)
    assert text != greedy_24  # rounding the weights changed the continuation of this random model


def test_quantize_says_partly_when_matrices_stay_unquantized(checkpoints, capsys):
    """Widths of 80 do not split into groups of 64: most matrices stay as they are, and the model
    line said "4-bit weights" all the same. It says which share of the matrices' parameters is
    quantized (the embedding table, 151936 x 80, is most of them)."""
    from tests.checkpoint import QWEN3_0_6B_CONFIG, weight_shapes

    config = TINY_CONFIG | {"hidden_size": 80}
    shapes = [shape for shape in weight_shapes(QWEN3_0_6B_CONFIG | config).values()
              if len(shape) == 2]  # the tied head once
    share = sum(math.prod(s) for s in shapes if s[-1] % 64 == 0) / sum(map(math.prod, shapes))
    assert li.main(["--model", str(checkpoints(config)), "--max-tokens", "1", "--quantize", "4"]) == 0
    assert (f", 4-bit weights (partly quantized: {math.floor(share * 1000) / 10}% of the "
            "parameters), from ") in capsys.readouterr().err


def test_max_tokens_one(tiny_model, reference, tmp_path):
    text, lines, n_prompt, n_generated = parse_success(run_cli("--model", tiny_model, "--max-tokens", 1,
                                                               cwd=tmp_path))
    assert (n_prompt, n_generated) == (5, 1)
    assert text == reference.tokenizer.decode(reference.generate(PROMPT, 1), skip_special_tokens=True)
    # One token: no decode rate (it counts the tokens after the first), rather than "0.0 tok/s".
    assert re.match(r"Prompt: 5 tokens, [\d.]+ tok/s \| Generated: 1 token \| Prefill",
                    lines[-1]), lines[-1]


def test_a_one_token_prompt_is_one_token(tiny_model, reference, tmp_path):
    assert len(reference.ids("Hi")) == 1
    _, lines, _, _ = parse_success(run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 2,
                                           cwd=tmp_path))
    assert lines[1] == "Prompt: 'Hi' (1 token), greedy"
    assert re.match(r"Prompt: 1 token, [\d.]+ tok/s \| Generated: 2 tokens, [\d.]+ tok/s \| ", lines[-1])


def test_a_long_prompt_is_shortened_in_the_header(tiny_model, reference, tmp_path):
    """23 KB, as from a file on stdin, all of it read. Its lines of 1000 "=" make it 616 tokens
    (Qwen's BPE has a token for 64 of them), not the 5500 of 22 KB of words, whose prefill made
    this test 5 s longer."""
    prompt = ("All work and no play makes Jack a dull boy. " + "=" * 1000 + "\n") * 22
    assert len(prompt.encode()) > 22_000
    _, lines, n_prompt, _ = parse_success(run_cli("--model", tiny_model, "--prompt", "-", "--max-tokens", 2,
                                                  stdin=prompt.encode(), cwd=tmp_path))
    assert n_prompt == len(reference.ids(prompt))  # all of it read
    assert lines[1] == f"Prompt: {prompt[:60] + '…'!r} ({n_prompt} tokens), greedy"


def test_the_header_shows_the_prompt_escaped_but_emoji_whole(tiny_model, reference, tmp_path):
    prompt = "Family:\t\U0001f468\u200d\U0001f469\u200d\U0001f467"  # a tab; 3 emoji joined by ZWJ
    _, lines, n_prompt, _ = parse_success(run_cli("--model", tiny_model, "--prompt", prompt,
                                                  "--max-tokens", 1, cwd=tmp_path))
    assert n_prompt == len(reference.ids(prompt))
    shown = "'Family:\\t\U0001f468\u200d\U0001f469\u200d\U0001f467'"  # repr() writes \u200d
    assert lines[1] == f"Prompt: {shown} ({n_prompt} tokens), greedy"


def test_model_dot_is_named_after_its_folder(variant, tmp_path):
    folder = variant("my-qwen")
    _, lines, _, _ = parse_success(run_cli("--model", ".", "--max-tokens", 2, cwd=folder))
    assert lines[0].startswith("Model: my-qwen (2 layers, "), lines[0]


def test_model_path_to_a_file(tiny_model, tmp_path):
    path = tiny_model / "config.json"
    assert_one_line_error(run_cli("--model", path, cwd=tmp_path), 1, f"{path} is a file, not a model folder",
                          "point --model at a folder")


def test_context_limit_is_inclusive(tiny_model, variant, tmp_path):
    # 5 prompt tokens + 11 new = 16 = max_position_embeddings: allowed (one more is refused, below).
    folder = variant(config_json=tiny_config(tiny_model) | {"max_position_embeddings": 16})
    _, _, n_prompt, n_generated = parse_success(run_cli("--model", folder, "--max-tokens", 11, cwd=tmp_path))
    assert (n_prompt, n_generated) == (5, 11)


def test_default_max_tokens_is_at_most_half_the_context(tiny_model, variant, tmp_path):
    _, _, n_prompt, n_generated = parse_success(run_cli("--model", tiny_model, cwd=tmp_path))
    assert (n_prompt, n_generated) == (5, 100)
    # Half of a 16-token context: 8 (a whole prompt of 8 more would still fit).
    folder = variant(config_json=tiny_config(tiny_model) | {"max_position_embeddings": 16})
    _, _, n_prompt, n_generated = parse_success(run_cli("--model", folder, cwd=tmp_path))
    assert (n_prompt, n_generated) == (5, 8)


def test_a_default_max_tokens_too_large_is_called_the_default(tiny_model, variant):
    """Fix: an 8-token context, no --max-tokens: the error said "with --max-tokens 4", a number
    the user never gave (the default, 100, cut to half the context)."""
    folder = variant(config_json=tiny_config(tiny_model) | {"max_position_embeddings": 8})
    for flags, said in (([], " (not given: its default, half the context)"), (["--max-tokens", "4"], "")):
        with pytest.raises(cli.SharedError) as refused:
            li.main(["--model", str(folder), *flags])
        assert str(refused.value) == (f"the prompt has 5 tokens; with --max-tokens 4{said} that exceeds "
                                      "the model's 8-token context: shorten it or lower --max-tokens")


@pytest.mark.parametrize("flags, fused, compiled",
                         [([], True, True), (["--no-compile"], True, False),
                          (["--reference-ops"], False, False)],
                         ids=["default", "--no-compile", "--reference-ops"])
def test_flags_choose_part_2s_replacements(tiny_model, capsys, flags, fused, compiled):
    """main() makes section 12's and 13's replacements unless told not to: --reference-ops runs
    Part 1 as written, compilation included."""
    part1 = {name: getattr(li, name)
             for name in ("rms_norm", "apply_rope", "attend", "silu_gate", "filter_logits")}
    assert li.main(["--model", str(tiny_model), "--max-tokens", "1", *flags]) == 0
    assert capsys.readouterr().out
    kernels = (li.fused_rms_norm, li.fused_rope, li.fused_attend) if fused else (
        part1["rms_norm"], part1["apply_rope"], part1["attend"])
    assert (li.rms_norm, li.apply_rope, li.attend) == kernels
    assert li.silu_gate is (li.compiled_silu_gate if compiled else part1["silu_gate"])
    assert li.filter_logits is (li.compiled_filter_logits if compiled else part1["filter_logits"])


def test_no_cache_and_no_compile_give_the_same_greedy_text(tiny_model, greedy_24, tmp_path):
    for flags in (["--no-cache"], ["--no-compile"], ["--no-cache", "--no-compile", "--reference-ops"]):
        text, _, _, n_generated = parse_success(run_cli("--model", tiny_model, "--max-tokens", 24, *flags,
                                                        cwd=tmp_path))
        assert (text, n_generated) == (greedy_24, 24), flags


TRACE_STEP = re.compile(r"  (\S.*?) +-> (.+?)  \((.+)\)")  # name, the shapes it makes, what it does


@pytest.mark.parametrize("flags", [[], ["--no-compile"]], ids=["compiled", "not compiled"])
def test_trace_narrates_one_forward_pass(tiny_model, reference, tmp_path, flags):
    # float32 by name: --dtype auto is bfloat16 on a GPU.
    rc, out, err = run_cli("--model", tiny_model, "--trace", "--dtype", "float32", *flags,
                           cwd=tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    # The trace is the program's output (stdout); stderr has the header and no statistics line.
    header = stderr_lines(err)
    assert len(header) == 2, err
    assert header[0].startswith("Model: tiny-qwen3 (2 layers, ")
    assert header[0].endswith(f" on {DEVICE}, float32, from {tiny_model}"), header[0]
    assert header[1] == f"Prompt: {PROMPT!r} (5 tokens)"  # no sampling settings: a trace samples nothing
    lines = out.splitlines()
    assert lines[:3] == ["tokens: 5 ids 785 6722 315 9625 374",
                         "        'The' ' capital' ' of' ' France' ' is'",
                         "block 0, step by step:"], lines[:3]
    c = reference.config
    # Block 0 step by step, in pipeline order, each with the shapes it makes (no batch axis
    # outside attention), from the embedding rows to the residual stream the block leaves.
    steps = [TRACE_STEP.fullmatch(line) for line in itertools.takewhile(
        lambda line: line.startswith("  "), lines[3:])]
    assert steps and all(steps), lines[3:]
    shapes = {m[1]: m[2] for m in steps}
    names = [m[1] for m in steps]
    part1 = ["embed", "rms_norm", "queries_keys_values", "attend"]
    assert names[0] == "embed" and [n for n in names if n in part1] == part1, names
    q, kv = (f"(1, {heads}, 5, {c.head_dim}) float32"
             for heads in (c.num_attention_heads, c.num_key_value_heads))
    assert shapes["embed"] == shapes["rms_norm"] == "(5, 64) float32"
    assert shapes["queries_keys_values"] == f"{q}, {kv}, {kv}"
    assert shapes["attend"] == q
    assert steps[-1][2] == "(5, 64) float32"
    # The model's own next token: greedy's first, in float32 as traced; the top five as its logits.
    float32 = Reference(tiny_model, mx.float32)
    logits = li.forward(mx.array(float32.ids(PROMPT)), float32.weights, float32.config,
                        li.make_cache(float32.config))
    top5 = mx.argsort(-logits)[:5].tolist()
    assert top5[0] == float32.generate(PROMPT, 1)[0]
    pick = repr(float32.tokenizer.decode([top5[0]]))
    rest = lines[3 + len(steps):]
    assert rest[0].startswith("after each block: ") and f"the rank there of {pick}" in rest[0]
    # After each block, in order: the residual stream's size and its logit lens, with the rank
    # there of the final pick.
    done = [re.fullmatch(rf"block +(\d+) done: residual stream \(5, 64\) float32, RMS ([\d.]+), "
                         rf"lens: (.+) ([\d.]+), {re.escape(pick)} #(\d+)", line)
            for line in rest[1:1 + c.num_hidden_layers]]
    assert all(done), rest
    assert [int(m[1]) for m in done] == list(range(c.num_hidden_layers))
    assert all(float(m[2]) > 0 and int(m[5]) >= 1 for m in done)
    # The last block's lens is the model's output: its top token is the pick, ranked first.
    assert (ast.literal_eval(done[-1][3]), int(done[-1][5])) == (ast.literal_eval(pick), 1)
    # The top-5 table ends the trace, headed by the pick.
    assert rest[1 + c.num_hidden_layers:] == [
        f"final RMSNorm + LM head -> logits ({c.vocab_size},) float32; next-token probabilities:", "rank  token                   id  probability", *rest[-5:]], rest
    table = [re.fullmatch(r"\s*(\d+)  (.+?)\s+(\d+)  (\d\.\d{4})", row) for row in rest[-5:]]
    assert all(table), rest[-5:]
    assert [int(m[1]) for m in table] == [1, 2, 3, 4, 5]
    assert [int(m[3]) for m in table] == top5
    assert [ast.literal_eval(m[2]) for m in table] == [float32.tokenizer.decode([i]) for i in top5]
    assert float(done[-1][4]) == pytest.approx(float(table[0][4]), abs=1e-3)


def test_trace_shows_special_tokens_as_they_are(tiny_model, reference, tmp_path):
    message = "What is the capital of France, and what is the capital of Spain?"
    rc, out, err = run_cli("--model", tiny_model, "--chat", "--prompt", message, "--trace",
                           cwd=tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    ids = reference.ids(f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) > 16  # the first 16 are shown, then the count
    pieces = [repr(reference.tokenizer.decode([i], skip_special_tokens=False)) for i in ids[:16]]
    tokens, shown = out.splitlines()[:2]
    assert tokens == f"tokens: {len(ids)} ids {' '.join(map(str, ids[:16]))} … ({len(ids)})"
    assert shown == f"        {' '.join(pieces)} … ({len(ids)})"
    assert shown.split()[:3] == ["'<|im_start|>'", "'user'", "'\\n'"], shown


def test_help_says_what_each_dtype_costs(tmp_path):
    rc, out, err = run_cli("--help", cwd=tmp_path)
    assert rc == 0 and err == ""
    dtype = " ".join(out.split("--dtype {auto,bfloat16,float16,float32}")[-1].split())
    assert "float16 can run faster on M1/M2 Macs (no bfloat16 arithmetic)" in dtype
    assert "Qwen3 can overflow it" in dtype
    assert "On CUDA and M5 Macs, float32 products use TF32 unless MLX_ENABLE_TF32=0" in dtype


def test_prompt_argument_not_utf8_fails_before_loading(tmp_path):
    """Bytes cut mid-character arrive as lone surrogates; caught before the (missing) model is looked at."""
    cut = os.fsdecode("café".encode()[:-1])  # b"caf\xc3"
    assert_one_line_error(run_cli("--model", tmp_path / "absent", "--prompt", cut, cwd=tmp_path), 1,
                          "--prompt", "not valid UTF-8")


def test_empty_system_message_is_kept(tiny_model, reference, tmp_path):
    chat = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    _, lines, n_prompt, _ = parse_success(run_cli("--model", tiny_model, "--chat", "--system", "", "--prompt", "Hi",
                                                  "--max-tokens", 2, "--seed", 1, cwd=tmp_path))
    assert n_prompt == len(reference.ids(chat))


def test_null_generation_config_values_are_unset(tiny_model, variant, tmp_path):
    folder = variant(generation_config_json={"temperature": None, "top_p": None, "top_k": None,
                                             "eos_token_id": None})
    _, lines, _, _ = parse_success(run_cli("--model", folder, "--chat", "--prompt", "Hi", "--max-tokens", 3,
                                           "--seed", 1, cwd=tmp_path))
    # Unset: Qwen's recommendations for thinking mode (model card) apply.
    assert lines[1].endswith("temperature 0.6, top-k 20, top-p 0.95, seed 1")


# --prompts FILE: many prompts at once (section 23), a JSON line for each

BATCH_PROMPTS = ["The capital of France is", "Hi",
                 "Once upon a time, in a land far away, there lived"]


def prompts_file(tmp_path, lines, data=None):
    path = tmp_path / "prompts.txt"
    path.write_bytes("".join(line + "\n" for line in lines).encode() if data is None else data)
    return str(path)


def alone(model, prompt, *flags):
    """The text a single-prompt run prints, in this process; then Part 2's replacements undone, so
    that the next run makes its own (as tests/conftest.py's part1_as_written does after a test)."""
    names = dict(vars(li))
    with contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(io.StringIO()):
        assert li.main(["--model", str(model), "--prompt", prompt, *flags]) == 0
    vars(li).update(names)
    return out.getvalue().removesuffix("\n")


def test_prompts_print_a_json_line_each_in_the_files_order(reference, variant, capsys,
                                                         monkeypatch, tmp_path):
    """Greedy, --batch-size 2 for 3 prompts: prompt 2 ends first, on an end token that
    generation_config.json adds, and prompt 3 takes its place; the lines still come in the file's
    order, each with the text a run of that prompt alone prints."""
    stop = reference.generate(BATCH_PROMPTS[1], 3)[2]  # prompt 2's third token ends it
    config = json.loads((reference.folder / "generation_config.json").read_text())
    model = variant(generation_config_json=config | {"eos_token_id": [*reference.eos_ids, stop]})
    flags = ["--max-tokens", "8"]
    texts = [alone(model, prompt, *flags) for prompt in BATCH_PROMPTS]
    monkeypatch.setattr(cli.Prefill, "PROGRESS_AFTER", 0)  # progress from the first prompt on
    assert li.main(["--model", str(model), "--prompts", prompts_file(tmp_path, BATCH_PROMPTS),
                    "--batch-size", "2", *flags]) == 0
    out, err = capsys.readouterr()
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) == 4, out
    replies = [json.loads(line) for line in lines[:-1]]
    assert replies == [{"prompt": prompt, "text": text, "tokens": n, "finish_reason": reason}
                       for prompt, text, n, reason in zip(BATCH_PROMPTS, texts, [8, 3, 8],
                                                          ["length", "stop", "length"])]
    err = stderr_lines(err)
    n_prompt = sum(len(reference.ids(prompt)) for prompt in BATCH_PROMPTS)
    assert err[0].startswith("Model: model (")
    assert err[1] == f"Prompts: 3 ({n_prompt} tokens), greedy"
    assert re.fullmatch(r"prompts: 1/3 done, \d+ tok/s", err[2]), err  # then one a second at most
    assert all(re.fullmatch(r"prompts: [23]/3 done, \d+ tok/s", line) for line in err[3:-1]), err
    assert re.fullmatch(r"Prompts: 3 of 3 printed \| Generated: 19 tokens, [\d.]+ tok/s \| "
                        r"Time: [\d.]+ s \| Peak memory: [\d.]+ GB", err[-1]), err[-1]


def test_prompts_from_stdin_sample_each_as_alone(tiny_model, capsys, monkeypatch):
    """Sampled with min-p and a seed, each prompt's text is the one it gets alone with that seed.
    stdin is read as an editor reads a file: a BOM and CRLF line ends are no part of a prompt."""
    flags = ["--max-tokens", "6", "--temperature", "1.5", "--top-k", "0", "--top-p", "1", "--min-p",
             "0.2", "--seed", "7"]  # top-k 0 and top-p 1 leave min-p the tokens to rule out
    texts = [alone(tiny_model, prompt, *flags) for prompt in BATCH_PROMPTS]
    data = "\ufeff" + "".join(prompt + "\r\n" for prompt in BATCH_PROMPTS)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode())))
    assert li.main(["--model", str(tiny_model), "--prompts", "-", *flags]) == 0
    out, err = capsys.readouterr()
    replies = [json.loads(line) for line in out.split("\n")[:-1]]
    assert [(r["prompt"], r["text"]) for r in replies] == list(zip(BATCH_PROMPTS, texts)), err
    assert "min-p 0.2, seed 7" in err


# ------------------------------------------------------------------------------------------------
# 2. Bad input: one line on stderr, no traceback, exit 2 for flags and 1 for everything else
# ------------------------------------------------------------------------------------------------

BAD_FLAGS = [
    (["--temperature", "-1"], ["--temperature", "-1"]),
    (["--top-p", "0"], ["--top-p", "0"]),
    (["--top-p", "1.5"], ["--top-p", "1.5"]),
    (["--top-k", "-1"], ["--top-k", "-1"]),
    (["--max-tokens", "0"], ["--max-tokens", "0"]),
    (["--max-tokens", "2.5"], ["--max-tokens", "2.5"]),
    (["--seed", "abc"], ["--seed", "abc"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--temperature", "nan"], ["argument --temperature: must be 0 (greedy) or at least 0.0001, got nan"]),
    (["--temperature", "1e-45"],  # printed token 0
     ["--temperature", "must be 0 (greedy) or at least 0.0001, got 1e-45"]),
    (["--top-p", "inf"], ["argument --top-p: must be a number in (0, 1], got inf"]),
    (["--top-probs", "0"], ["--top-probs", "0"]),
    (["--dtype", "int8"], ["--dtype", "int8"]),
    (["--quantize", "3"], ["--quantize", "3"]),
    (["--quantize", "16"], ["--quantize", "16"]),
    (["--system", "hi"], ["--system", "--chat"]),
    (["--system", ""], ["--system", "--chat"]),
    (["--no-think"], ["--no-think", "--chat"]),
    (["--bogus"], ["--bogus"]),
    (["--model", ""], ["--model", "is empty", "repo id"]),  # meant the default, and a 1.5 GB download
    (["--trace", "--top-probs", "3"], ["--top-probs", "--trace"]),  # the trace showed 5 rows all the same
    (["--trace", "--no-cache"], ["--no-cache does not apply to --trace"]),  # one pass, no cache
]


@pytest.mark.parametrize("flags, needles", BAD_FLAGS, ids=[" ".join(flags) for flags, _ in BAD_FLAGS])
def test_bad_flag(tiny_model, tmp_path, flags, needles):
    assert_one_line_error(run_cli("--model", tiny_model, *flags, cwd=tmp_path), 2, *needles)


def test_prompts_refuse_the_flags_they_do_not_apply_with(capsys):
    """Each flag that a batch of plain completions cannot honour is refused in one line, exit 2;
    --min-p applies (each row draws through sample()), and so does --min-p 0."""
    for flags in (["--prompt", ""], ["--chat"], ["--draft-model", "d"], ["--trace"],
                  ["--no-cache"], ["--top-probs", "3"], ["--presence-penalty", "0.5"]):
        with pytest.raises(SystemExit) as refused:
            cli.parse_args(["--prompts", "p.txt", *flags])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err == (f"llm_inference.py: error: --prompts does not "
                                                   f"apply with {flags[0]} (see --help)\n"), err
    for flags in (["--min-p", "0"], ["--min-p", "0.1", "--temperature", "1"]):
        assert cli.parse_args(["--prompts", "p.txt", *flags]).batch_size == 16


@pytest.mark.parametrize("data, message", [
    (b"", "line 1 of {} is empty: --prompts takes one prompt per line, none empty"),
    (b"Hi\n\nthere\n", "line 2 of {} is empty: --prompts takes one prompt per line, none empty"),
    (b"Hi\r\n \t\r\n", "line 2 of {} is empty: --prompts takes one prompt per line, none empty"),
    (b"Hi\ncaf\xc3\n", "{} is not valid UTF-8 text (cut in the middle of a character?)"),
    (None, "cannot read {} (No such file or directory); give --prompts a text file with one prompt "
           "per line"),
    (b"Hi\n" + "The capital of France is\n".encode(),
     "the prompt on line 2 has 5 tokens; with --max-tokens 40956 that exceeds the model's "
     "40960-token context: shorten it or lower --max-tokens")],
    ids=["empty file", "empty line", "blank line", "not UTF-8", "missing", "too long"])
def test_prompts_a_bad_file_is_one_line_naming_the_line(tiny_model, capsys, tmp_path,
                                                        data, message):
    """Refused before any prompt runs: nothing on stdout. A prompt too long for the context with
    --max-tokens is named by its line (line 1, of 1 token, fits)."""
    path = tmp_path / "prompts.txt"
    if data is not None:
        path.write_bytes(data)
    max_tokens = "40956" if "context" in message else "2"  # short, should the check miss
    with pytest.raises(cli.UserError) as refused:
        li.main(["--model", str(tiny_model), "--prompts", str(path), "--max-tokens", max_tokens])
    assert str(refused.value) == message.format(path)
    assert capsys.readouterr().out == ""


def test_prompts_are_refused_under_several_processes(tiny_model, monkeypatch):
    """Under mlx.launch, once (a SharedError), before reading the file."""
    from tests.test_distributed import Group

    monkeypatch.setattr(li.mx.distributed, "init", lambda: Group(2))
    monkeypatch.setattr(cli, "join", lambda group: None)  # no signal handlers, no shared reads
    with pytest.raises(cli.SharedError, match="^--prompts runs in one process only: drop it under "
                                              "mlx.launch$"):
        li.main(["--model", str(tiny_model), "--prompts", "absent.txt"])


def test_model_folder_missing(tmp_path):
    missing = tmp_path / "no-such-model"
    assert_one_line_error(run_cli("--model", missing, cwd=tmp_path), 1, f"model folder {missing} not found")
    assert not missing.exists()  # an explicit --model folder is never created or downloaded into


@pytest.mark.parametrize("script, hidden, flags", [
    ("llm_inference.py", "mlx", []), ("bench.py", "mlx", []),
    ("llm_inference.py", "tokenizers", []),
    ("llm_inference.py", "huggingface_hub", ["--model", "someone/model"]),  # imported when needed
    ("llm_inference.py", "mlx.core", []),  # not a package of requirements.txt: a broken MLX
], ids=["mlx", "mlx, bench.py", "tokenizers", "huggingface_hub", "inside MLX"])
def test_a_package_not_installed_is_one_line(tmp_path, script, hidden, flags):
    """Issue 32: outside the virtual environment (mlx not installed), a 7-line traceback ended in
    ModuleNotFoundError. Now one line names the package and the fix; a module missing inside a
    package keeps its traceback, which is for MLX's developers."""
    code = f"""import runpy, sys
class NotInstalled:  # as Python finds no module of that name
    def find_spec(self, name, *args):
        if name == {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.argv, sys.path[0] = [{str(SCRIPT.parent / script)!r}, *{flags!r}], {str(SCRIPT.parent)!r}
runpy.run_path(sys.argv[0], run_name="__main__")"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=cli_env(tmp_path / ".hf-home"), timeout=120)
    if hidden == "mlx.core":
        assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr
        assert proc.stderr.splitlines()[-1].startswith("ModuleNotFoundError: "), proc.stderr
    else:
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", (
            f"{script}: error: the package {hidden} is not installed here: activate the virtual "
            "environment (. .venv/bin/activate), or pip install -r requirements.txt\n"))


def test_a_link_to_no_weights_is_named(variant, tmp_path):
    """Issue 32: model.safetensors, a link to a file deleted (a blob gone from Hugging Face's
    cache), was reported as an unreadable model.safetensors.index.json, which the folder never
    had."""
    folder = variant(model_safetensors=None)
    (folder / "model.safetensors").symlink_to(tmp_path / "deleted-blob")
    with pytest.raises(cli.UserError, match=rf"^cannot read {re.escape(str(folder))}/model\."
                                            r"safetensors \(No such file or directory\); "):
        load_model(folder, mx.float32)


def test_top_probs_has_a_maximum_and_names_unused_ids(reference, capsys):
    """Issue 32: --top-probs 1000000 printed all 151,936 rows, those past the tokenizer's 151,669
    ids as ''. Now at most 1000 rows, and a row without a token shows as <unused id>."""
    assert cli.parse_args(["--top-probs", "1000"]).top_probs == 1000
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["--top-probs", "1001"])
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "llm_inference.py: error: argument --top-probs: must be an integer from 1 to 1000, got "
        "1001 (see --help)\n")
    tokenizer = reference.tokenizer
    unused = tokenizer.get_vocab_size(with_added_tokens=True)  # the first row past the tokens
    assert tokenizer.id_to_token(unused) is None and cli.piece(tokenizer, unused) == "<unused id>"
    assert cli.piece(tokenizer, unused - 1) == repr(tokenizer.id_to_token(unused - 1))


@pytest.mark.parametrize("filename", cli.NEEDED_FILES)
def test_needed_file_missing(variant, tmp_path, filename):
    folder = variant(**{filename.replace(".", "_"): None})
    line = assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, str(folder), f"lacks {filename}")
    assert "--model" in line
    assert not (folder / filename).exists()  # nothing was downloaded into an explicit folder


@pytest.mark.parametrize("filename", [*cli.NEEDED_FILES, "generation_config.json"])
def test_file_unreadable(variant, tmp_path, filename):
    """A file that exists but cannot be read. chmod 000 does not stop root (CI runs as root), and
    /proc/self/mem is Linux's; a directory in the file's place is refused by open() or read() with
    EISDIR on Linux and macOS alike, for root too, and is reported as unreadable, not as missing."""
    folder = variant(**{filename.replace(".", "_"): None})
    (folder / filename).mkdir()
    path = folder / filename
    fix = "delete or re-download it" if filename == "generation_config.json" else "re-download it"
    line = assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, *unreadable(path, fix))
    reason = line.split(f"cannot read {path} (", 1)[1].rsplit(f"); {fix}", 1)[0]
    assert reason.strip(), line
    assert "directory" in reason, line


def test_config_not_json(variant, tmp_path):
    folder = variant(config_json=b'{"model_type": "qwen3", ')
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, *unreadable(folder / "config.json"),
                          "line 1 column")  # json's reason: where the text stops being JSON


def test_config_not_qwen3(tiny_model, variant, tmp_path):
    folder = variant(config_json=tiny_config(tiny_model) | {"model_type": "llama"})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "not a Qwen3 config", "'llama'")


def test_config_mixture_of_experts_without_its_fields(tiny_model, variant, tmp_path):
    folder = variant(config_json=tiny_config(tiny_model) | {"model_type": "qwen3_moe", "num_experts": 8})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "lacks the required key",
                          "'num_experts_per_tok'")


# The end of Qwen3-2507's templates, which have no enable_thinking switch: Instruct never thinks, Thinking
# always opens <think> itself. Qwen3's hybrid template (tests/checkpoint.py's CHAT_TEMPLATE is modelled on
# it) tests `enable_thinking is defined and enable_thinking is false`.
INSTRUCT_2507_TAIL = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}"
THINKING_2507_TAIL = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"


def tokenizer_config(tiny_model, template):
    return json.loads((tiny_model / "tokenizer_config.json").read_text()) | {"chat_template": template}


@pytest.mark.parametrize("where", ["tokenizer_config.json", "tokenizer_config.json list", "chat_template.jinja"])
@pytest.mark.parametrize("tail", [INSTRUCT_2507_TAIL, THINKING_2507_TAIL], ids=["instruct", "thinking"])
def test_chat_refuses_a_non_hybrid_template(tiny_model, variant, tmp_path, where, tail):
    template = "{%- for message in messages %}{{- message.content }}{%- endfor %}" + tail
    if where == "chat_template.jinja":  # transformers >= 4.52 saves the template beside the config
        folder = variant(tokenizer_config_json=tokenizer_config(tiny_model, None))
        (folder / "chat_template.jinja").write_text(template)
    elif where.endswith("list"):  # the older form for several named templates
        folder = variant(tokenizer_config_json=tokenizer_config(
            tiny_model, [{"name": "default", "template": template}, {"name": "tool_use", "template": tail}]))
    else:
        folder = variant(tokenizer_config_json=tokenizer_config(tiny_model, template))
    with pytest.raises(cli.UserError, match="hybrid-thinking one that --chat writes .*; run it without --chat"):
        cli.check_chat_template(folder)


def test_a_non_hybrid_template_is_refused_with_chat_only(tiny_model, variant, tmp_path):
    template = "{%- for message in messages %}{{- message.content }}{%- endfor %}" + INSTRUCT_2507_TAIL
    folder = variant(tokenizer_config_json=tokenizer_config(tiny_model, template))
    assert_one_line_error(run_cli("--model", folder, "--chat", cwd=tmp_path), 1, "hybrid-thinking",
                          "without --chat")
    parse_success(run_cli("--model", folder, "--max-tokens", 2, cwd=tmp_path))  # plain completion works


def test_chat_accepts_the_hybrid_template_as_jinja_file(tiny_model, variant, reference, tmp_path):
    folder = variant(tokenizer_config_json=tokenizer_config(tiny_model, None))
    hybrid = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    (folder / "chat_template.jinja").write_text(hybrid)
    parse_success(run_cli("--model", folder, "--chat", "--prompt", "Hi", "--max-tokens", 2, cwd=tmp_path))


def test_chat_template_file_unreadable(variant, tmp_path):
    folder = variant(tokenizer_config_json=b"{oops")
    assert_one_line_error(run_cli("--model", folder, "--chat", cwd=tmp_path), 1,
                          *unreadable(folder / "tokenizer_config.json"), "line 1 column")


def test_config_and_weights_disagreeing_is_said_before_the_memory_they_would_need(tiny_model, variant, tmp_path):
    """A feed-forward so wide (in config.json only) that its weights would need 15 TB: the mismatch with the
    checkpoint is the problem to report, not the memory (whose advice, --quantize 4, would not help)."""
    folder = variant(config_json=tiny_config(tiny_model) | {"intermediate_size": 10**10})
    line = assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                                 "'model.layers.0.mlp.gate_proj.weight' has shape (128, 64)",
                                 "expected (10000000000, 64)")
    assert "GB" not in line


def test_weights_too_big_for_memory(tiny_model, monkeypatch):
    """Refused before any weight is read, in one line with what to try (here a machine of 10 MB: the
    tiny model's float32 weights are 39 MB; a model that big could not be built for the test)."""
    monkeypatch.setattr(cli, "memory_size", lambda: 10**7)
    with pytest.raises(cli.UserError) as error:
        load_model(tiny_model, mx.float32)
    needed = weight_bytes(li.load_config(tiny_model), mx.float32)
    assert str(error.value) == (f"the weights need {needed / 1e9:.1f} GB as float32, but this "
                                "machine has 0.0 GB of memory available; try --dtype bfloat16 "
                                "(half the bytes), --quantize 4, or a smaller model")


def test_config_missing_key(tiny_model, variant, tmp_path):
    config = tiny_config(tiny_model)
    del config["num_hidden_layers"]
    folder = variant(config_json=config)
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "lacks the required key 'num_hidden_layers'")


def test_config_value_not_a_number(tiny_model, variant, tmp_path):
    folder = variant(config_json=tiny_config(tiny_model) | {"hidden_size": "wide"})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "'hidden_size'", '"wide"')


# Each ran before (true as 1 layer of 2, 2.7 as 2, "64" as 64) or printed garbage (rope_theta 0 or NaN,
# rms_norm_eps -1). Counts must be JSON integers: 2.0 is refused too, as transformers' layers would be.
BAD_CONFIG_VALUES = [
    ("num_hidden_layers", True, "a positive integer", "true"),
    ("num_hidden_layers", 0, "a positive integer", "0"),
    ("num_hidden_layers", -1, "a positive integer", "-1"),
    ("num_hidden_layers", 2.7, "a positive integer", "2.7"),
    ("num_hidden_layers", 2.0, "a positive integer", "2.0"),
    ("hidden_size", "64", "a positive integer", '"64"'),
    ("vocab_size", None, "lacks the required key", "'vocab_size'"),
    ("max_position_embeddings", [40960], "a positive integer", "[40960]"),
    ("rope_theta", 0, "a positive number", "0"),
    ("rope_theta", float("nan"), "a positive number", "NaN"),
    ("rope_theta", float("inf"), "a positive number", "Infinity"),
    ("rope_theta", "1e6", "a positive number", '"1e6"'),
    ("rms_norm_eps", -1, "a positive number", "-1"),
    ("rms_norm_eps", False, "a positive number", "false"),
    ("tie_word_embeddings", "yes", "true or false", '"yes"'),
    ("tie_word_embeddings", 1, "true or false", "1"),
]


@pytest.mark.parametrize("key, value, expected, shown", BAD_CONFIG_VALUES,
                         ids=[f"{key}={value!r}" for key, value, _, _ in BAD_CONFIG_VALUES])
def test_config_value_of_the_wrong_type_or_range(tiny_model, variant, tmp_path, key, value, expected, shown):
    folder = variant(config_json=tiny_config(tiny_model) | {key: value})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, str(folder / "config.json"),
                          f"{key!r}", expected, shown)


def test_config_query_heads_not_a_multiple_of_kv_heads(tiny_model, variant, tmp_path):
    folder = variant(config_json=tiny_config(tiny_model) | {"num_key_value_heads": 3})  # 4 query heads
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "'num_attention_heads' (4)",
                          "a multiple of 'num_key_value_heads' (3)")


# Each gave a traceback before ("top_k": "x" even when greedy, "temperature": "hot" with --chat,
# "eos_token_id": {"a": 1} always), or ran degenerate ("temperature": 1e-45 printed token 0).
BAD_GENERATION_VALUES = [
    ("top_k", "x", "an integer >= 0", '"x"'),
    ("top_k", -1, "an integer >= 0", "-1"),
    ("top_k", 20.5, "an integer >= 0", "20.5"),
    ("top_k", True, "an integer >= 0", "true"),
    ("temperature", "hot", "0 (greedy) or at least 0.0001", '"hot"'),
    ("temperature", -0.5, "0 (greedy) or at least 0.0001", "-0.5"),
    ("temperature", 1e-45, "0 (greedy) or at least 0.0001", "1e-45"),
    ("temperature", float("nan"), "0 (greedy) or at least 0.0001", "NaN"),
    ("top_p", 0, "a number in (0, 1]", "0"),
    ("top_p", 1.5, "a number in (0, 1]", "1.5"),
    ("top_p", "0.9", "a number in (0, 1]", '"0.9"'),
    ("min_p", -0.1, "a number in [0, 1]", "-0.1"),
    ("min_p", 2, "a number in [0, 1]", "2"),
    ("eos_token_id", {"a": 1}, "a token id", '{"a": 1}'),
    ("eos_token_id", "151645", "a token id", '"151645"'),
    ("eos_token_id", [151645, -1], "a token id", "[151645, -1]"),
    ("eos_token_id", [151645, None], "a token id", "[151645, null]"),
]


@pytest.mark.parametrize("key, value, expected, shown", BAD_GENERATION_VALUES,
                         ids=[f"{key}={value!r}" for key, value, _, _ in BAD_GENERATION_VALUES])
def test_generation_config_value_of_the_wrong_type_or_range(tiny_model, variant, tmp_path, key, value, expected,
                                                             shown):
    generation_config = json.loads((tiny_model / "generation_config.json").read_text()) | {key: value}
    folder = variant(generation_config_json=generation_config)
    with pytest.raises(cli.UserError) as error:
        cli.load_generation_config(folder)
    message = str(error.value)
    assert message.startswith(f"{folder / 'generation_config.json'}: {key!r} should be {expected}")
    assert f"got {shown}" in message and message.endswith("; fix it or delete the file")
    if key == "top_k" and value == "x":  # through the command line: one line, exit status 1
        assert_one_line_error(run_cli("--model", folder, "--max-tokens", 2, cwd=tmp_path), 1, message)


def test_generation_config_temperature_not_a_number_in_chat(tiny_model, variant, tmp_path):
    """--chat is where the temperature is read (a traceback there before): refused at start-up too."""
    generation_config = json.loads((tiny_model / "generation_config.json").read_text()) | {"temperature": "hot"}
    folder = variant(generation_config_json=generation_config)
    assert_one_line_error(run_cli("--model", folder, "--chat", cwd=tmp_path), 1, "'temperature'", '"hot"')


@pytest.mark.parametrize("key, value", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000}),  # transformers 5's form
])
def test_config_rope_scaling(tiny_model, variant, tmp_path, key, value):
    folder = variant(config_json=tiny_config(tiny_model) | {key: value})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, "RoPE scaling")


@pytest.mark.parametrize("key, value, phrase", [
    ("attention_bias", True, "attention bias"), ("use_sliding_window", True, "sliding-window attention"),
    ("hidden_act", "gelu", "the activation 'gelu' (hidden_act), not SiLU")])  # it ran SiLU
def test_config_unsupported_variant(tiny_model, variant, tmp_path, key, value, phrase):
    folder = variant(config_json=tiny_config(tiny_model) | {key: value})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, phrase, "does not implement")


@pytest.mark.parametrize("keep", ["half", "header only", "4 bytes"])
def test_safetensors_truncated(tiny_model, variant, tmp_path, keep):
    data = (tiny_model / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    size = {"half": len(data) // 2, "header only": header_end, "4 bytes": 4}[keep]
    folder = variant(model_safetensors=data[:size])
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          *unreadable(folder / "model.safetensors"))


@pytest.mark.parametrize("field, value", [("data_offsets", "x"), ("shape", None), ("data_offsets", [0, "end"])])
def test_safetensors_header_entry_malformed(tiny_model, variant, tmp_path, field, value):
    data = (tiny_model / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:header_end])
    header["model.norm.weight"][field] = value
    raw = json.dumps(header).encode()
    folder = variant(model_safetensors=len(raw).to_bytes(8, "little") + raw + data[header_end:])
    # mx.load's message names the JSON type error, not the tensor.
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          *unreadable(folder / "model.safetensors"))


def test_safetensors_garbage(variant, tmp_path):
    folder = variant(model_safetensors=bytes(range(256)) * 64)
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          *unreadable(folder / "model.safetensors"))


def rewrite_weights(tiny_model, change):
    """model.safetensors bytes after change(dict of arrays) edits the tiny model's tensors."""
    tensors = mx.load(str(tiny_model / "model.safetensors"))
    change(tensors)
    path = tiny_model.parent / f"edited-{os.getpid()}-{time.monotonic_ns()}.safetensors"
    mx.save_safetensors(str(path), tensors, metadata={"format": "pt"})
    try:
        return path.read_bytes()
    finally:
        path.unlink()


def test_tensor_missing(tiny_model, variant, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = variant(model_safetensors=rewrite_weights(tiny_model, lambda t: t.pop(name)))
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, f"lacks the tensor {name!r}")


def test_tensor_wrong_shape(tiny_model, variant, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # (2 KV heads * 16, 64) = (32, 64)

    def transpose(tensors):
        tensors[name] = tensors[name].T

    folder = variant(model_safetensors=rewrite_weights(tiny_model, transpose))
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, repr(name), "(64, 32)", "(32, 64)")


@pytest.fixture(scope="session")
def sharded_model(checkpoints):
    """The tiny model's very weights (same seed), split into three shards with an index."""
    return checkpoints(TINY_CONFIG, shards=3, name="tiny-sharded")


def test_sharded_checkpoint_gives_the_same_text(sharded_model, greedy_24, tmp_path):
    assert not (sharded_model / "model.safetensors").exists()
    text, _, _, n_generated = parse_success(run_cli("--model", sharded_model, "--max-tokens", 24,
                                                    cwd=tmp_path))
    assert text == greedy_24 and n_generated == 24


@pytest.mark.parametrize("head", ["same", "different"])
def test_tied_checkpoint_storing_lm_head(checkpoints, tmp_path, head):
    """A tied config whose file also holds lm_head.weight: a copy changes nothing; a different matrix
    is used (as transformers 5 does, tests/test_hf_parity.py) and one line says so."""
    folder = checkpoints(TINY_CONFIG, tied_head=head)
    reference = Reference(folder, cli.pick_dtype("auto"))
    assert (reference.weights["lm_head"] is reference.weights["embed_tokens"]) == (head == "same")
    rc, out, err = run_cli("--model", folder, "--max-tokens", 12, cwd=tmp_path)
    notes = [line for line in stderr_lines(err) if "lm_head.weight" in line]
    if head == "same":
        assert notes == []
    else:  # said during the checks of the folder, before the model line
        assert notes == ["Note: config.json ties the LM head to the embeddings, but the checkpoint "
                         "stores a different lm_head.weight; using it, as transformers does"]
        assert stderr_lines(err)[0] == notes[0], err
        err = err.replace(notes[0] + "\n", "", 1)
    text, lines, _, _ = parse_success((rc, out, err))
    assert text == reference.text(PROMPT, 12)
    assert len(lines) == 3, lines


def shard_of(folder, name):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_shard_missing(sharded_model, tmp_path):
    folder = shutil.copytree(sharded_model, tmp_path / "m")
    (folder / "model-00002-of-00003.safetensors").unlink()
    line = assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1)
    assert line == (f"{ERROR_PREFIX}cannot read {folder / 'model-00002-of-00003.safetensors'} "
                    "(No such file or directory); re-download it"), line


@pytest.mark.parametrize("index", [b"{oops", b'{"metadata": {}}', b'{"weight_map": []}',
                                   b'{"weight_map": {"model.norm.weight": "../model.safetensors"}}'],
                         ids=["not JSON", "no weight_map", "weight_map a list", "path outside"])
def test_shard_index_invalid(sharded_model, tmp_path, index):
    folder = shutil.copytree(sharded_model, tmp_path / "m")
    path = folder / "model.safetensors.index.json"
    path.write_bytes(index)
    expected = ([*unreadable(path), "line 1 column"] if index == b"{oops" else
                [f"{path} is not a valid index", "; re-download it"])
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, *expected)


@pytest.mark.parametrize("outside", ["../x.safetensors", "absolute", "sub/../../x.safetensors"])
def test_shard_index_with_one_entry_outside_the_folder(sharded_model, tmp_path, outside):
    """One tensor of a valid index sent to a file outside the folder, a real shard there: refused,
    not read (a checkpoint may come from anyone)."""
    folder = shutil.copytree(sharded_model, tmp_path / "m")
    (folder / "sub").mkdir()  # so that sub/../../x.safetensors resolves, sorting after the shards
    name = "model.layers.1.mlp.up_proj.weight"
    shutil.copy(folder / shard_of(folder, name), tmp_path / "x.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = str(tmp_path / "x.safetensors") if outside == "absolute" else outside
    assert (folder / index["weight_map"][name]).resolve() == tmp_path / "x.safetensors"
    assert len(set(index["weight_map"].values())) == 4  # the three shards, still named, and it
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          f"{folder / 'model.safetensors.index.json'} is not a valid index")


def test_sharded_tensor_missing(sharded_model, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = shutil.copytree(sharded_model, tmp_path / "m")
    shard = folder / shard_of(folder, name)
    tensors = mx.load(str(shard))
    del tensors[name]
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          f"the sharded checkpoint {folder} lacks the tensor {name!r}")


def test_shard_truncated(sharded_model, tmp_path):
    folder = shutil.copytree(sharded_model, tmp_path / "m")
    shard = folder / shard_of(folder, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:-10])
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, *unreadable(shard))


@pytest.fixture(scope="session")
def converted_4bit(tiny_model, checkpoints):
    """The tiny model converted by mlx-lm to 4 bits, its weights in MLX's quantized format."""
    return checkpoints.converted(tiny_model, name="tiny-4bit", quantize=True, q_bits=4,
                                 q_group_size=64)


def test_mlx_quantized_folder_gives_the_quantize_text(tiny_model, converted_4bit, tmp_path):
    expected = Reference(tiny_model, cli.pick_dtype("auto"), 4).text(PROMPT, 24)
    for flags in ([], ["--quantize", "4"]):  # --quantize with the folder's own bits changes nothing
        text, lines, _, _ = parse_success(run_cli("--model", converted_4bit, "--max-tokens", 24, *flags,
                                                  cwd=tmp_path))
        assert lines[0].endswith(f", 4-bit weights, from {converted_4bit}")
        assert text == expected


def test_mixed_precision_folder_runs_and_says_its_bits(tiny_model, tmp_path):
    """mlx-lm's mixed_3_6 recipe: 3 bits, 6 for the head and some layers (config.json's "quantization"
    says 4 at the top, which no matrix uses). The CLI checks and loads it; its text is the folder's,
    read in this process, and the model line names the bits really used."""
    from mlx_lm import convert

    folder = tmp_path / "tiny-mixed"
    convert(hf_path=str(tiny_model), mlx_path=str(folder), quantize=True, quant_predicate="mixed_3_6",
            q_group_size=64)
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    dtype = cli.pick_dtype("auto")
    reference = Reference(tiny_model, dtype)
    li.use_quantization(None, cli.check_config(folder, li.Config.__annotations__))  # the folder's own bits, per matrix
    reference.weights = li.load_weights(folder, li.load_config(folder), dtype)
    text, lines, _, _ = parse_success(run_cli("--model", folder, "--max-tokens", 24, cwd=tmp_path))
    assert lines[0].endswith(f", 3/6-bit weights, from {folder}"), lines[0]
    assert text == reference.text(PROMPT, 24)
    assert text != Reference(tiny_model, dtype, 4).text(PROMPT, 24)  # not what 4 bits would say


def test_sharded_mlx_quantized_folder(tiny_model, converted_4bit, tmp_path):
    """mlx-community's larger models come in shards: the converted tensors split over two files."""
    folder = tmp_path / "sharded-4bit"
    folder.mkdir()
    for source in converted_4bit.iterdir():
        if not source.name.startswith("model.safetensors"):
            shutil.copyfile(source, folder / source.name)
    tensors = mx.load(str(converted_4bit / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        mx.save_safetensors(str(folder / shard), {name: tensors[name] for name in shard_names})
    index = {"weight_map": {name: shard for shard, shard_names in shards.items() for name in shard_names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = Reference(tiny_model, cli.pick_dtype("auto"), 4).text(PROMPT, 24)
    text, _, _, _ = parse_success(run_cli("--model", folder, "--max-tokens", 24, cwd=tmp_path))
    assert text == expected


def test_quantize_other_bits_than_the_folder(converted_4bit, tmp_path):
    assert_one_line_error(run_cli("--model", converted_4bit, "--quantize", "8", cwd=tmp_path), 1,
                          "already quantized to 4 bits", "--quantize")


@pytest.mark.parametrize("quantization, needles", [
    ({"quantization": {"group_size": 64, "bits": 7}}, ["7 bits"]),
    ({"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}}, ["mxfp4"]),
    ({"quantization": {"group_size": 100, "bits": 4}}, ["groups of 100"]),
    ({"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 64, "bits": 7}}},
     ["model.layers.0.mlp.up_proj", "7 bits"]),
    ({"quantization": "4bit"}, ["quantization"]),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["gptq"]),
    # mlx_lm.convert's copy without "quantization" beside it: it said "quantized with None"
    ({"quantization_config": {"group_size": 64, "bits": 4}}, ["(quant_method None)",
                                                              "but no 'quantization'"]),
], ids=["bits 7", "mxfp4", "group 100", "layer bits 7", "not a dict", "gptq", "no quant_method"])
def test_quantization_not_supported(converted_4bit, tmp_path, quantization, needles):
    folder = shutil.copytree(converted_4bit, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config | quantization))
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, *needles)


def test_quantized_tensor_wrong_shape(converted_4bit, tmp_path):
    """config.json says 8 bits, the tensors hold 4: the packed shape gives it away before loading."""
    folder = shutil.copytree(converted_4bit, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": 64, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    name = "model.embed_tokens.weight"  # (151936, 64): packed 4-bit (151936, 8), 8-bit (151936, 16)
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1, repr(name), "(151936, 8)",
                          "(151936, 16)")


def test_tokenizer_garbage(variant, tmp_path):
    folder = variant(tokenizer_json=b"not a tokenizer")
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          *unreadable(folder / "tokenizer.json"))


def test_generation_config_not_json(variant, tmp_path):
    folder = variant(generation_config_json=b"{oops")
    assert_one_line_error(run_cli("--model", folder, cwd=tmp_path), 1,
                          *unreadable(folder / "generation_config.json", "delete or re-download it"),
                          "line 1 column")


@pytest.mark.parametrize("prompt", ["", "  \n\t "], ids=["empty", "whitespace"])
def test_prompt_empty(tiny_model, tmp_path, prompt):
    assert_one_line_error(run_cli("--model", tiny_model, "--prompt", prompt, cwd=tmp_path), 1, "the prompt is empty")


def test_prompt_longer_than_context(tiny_model, variant, tmp_path):
    folder = variant(config_json=tiny_config(tiny_model) | {"max_position_embeddings": 16})
    assert_one_line_error(run_cli("--model", folder, "--max-tokens", 12, cwd=tmp_path), 1,
                          "the prompt has 5 tokens; with --max-tokens 12 that exceeds the model's "
                          "16-token context: shorten it or lower --max-tokens")


@pytest.mark.parametrize("stdin", [b"", b"\n"], ids=["empty", "newline only"])
def test_prompt_stdin_empty(tiny_model, tmp_path, stdin):
    assert_one_line_error(run_cli("--model", tiny_model, "--prompt", "-", cwd=tmp_path, stdin=stdin), 1,
                          "the prompt is empty")


def test_prompt_stdin_not_utf8(tiny_model, tmp_path):
    assert_one_line_error(run_cli("--model", tiny_model, "--prompt", "-", cwd=tmp_path, stdin=b"\xff\xfe\xfa"), 1,
                          "not valid UTF-8")


# ------------------------------------------------------------------------------------------------
# --draft-model: speculative decoding (section 22; the rule itself in tests/test_speculative.py)
# ------------------------------------------------------------------------------------------------

DRAFTED = re.compile(r" \| Draft: (\d+)/(\d+) accepted \(\d+%\), [\d.]+ tokens per target pass$")


def test_a_draft_model_leaves_the_text_as_it_is_and_reports_its_acceptance(
        tiny_model, converted_4bit, greedy_24, capsys):
    """The model's 4-bit copy, stored quantized by mlx-lm (and read as stored), drafts: the greedy
    text is the model's own, and the closing line counts the proposals it accepted."""
    assert li.main(["--model", str(tiny_model), "--draft-model", str(converted_4bit),
                    "--max-tokens", "24", "--num-draft-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == greedy_24 + "\n"
    last = stderr_lines(err)[-1]
    drafted = DRAFTED.search(last)
    assert drafted and STATS.search(last[:drafted.start()]), last
    assert 0 < int(drafted[1]) < int(drafted[2])  # some accepted, some rejected


@pytest.mark.parametrize("vocab_size", [151680, 152064])  # smaller, larger (Qwen2.5-7B's)
def test_a_draft_with_another_vocabulary_is_refused_before_any_weights_load(tiny_model, variant,
                                                                             monkeypatch,
                                                                             vocab_size):
    folder = variant("draft", config_json=tiny_config(tiny_model) | {"vocab_size": vocab_size})
    monkeypatch.setattr(li, "load_weights", lambda *args: pytest.fail("weights were loaded"))
    with pytest.raises(cli.UserError) as refused:
        li.main(["--model", str(tiny_model), "--draft-model", str(folder)])
    assert str(refused.value) == (f"--draft-model {folder} has {vocab_size} vocabulary entries, "
                                  "the model 151936: a draft needs the model's vocabulary")


def test_a_draft_with_another_tokenizer_is_refused(tiny_model, reference, variant):
    """Another tokenizer.json: its map of tokens to ids is compared with the model's. The same map
    passes; two tokens that trade ids do not."""
    folder = variant("draft", tokenizer_json=b"another file")
    args = cli.parse_args(["--draft-model", str(folder)])
    vocab = reference.tokenizer.get_vocab(True)
    for draft_vocab in (vocab, vocab | {"a": vocab["b"], "b": vocab["a"]}):
        draft_tokenizer = type("Tokenizer", (), {"get_vocab": lambda self, added: draft_vocab})()
        read = lambda where: reference.tokenizer if where == tiny_model else draft_tokenizer
        check = lambda: cli.check_draft(args, tiny_model, reference.config, li.load_config,
                                        li.layer_shapes, read)
        if draft_vocab is vocab:
            assert check()[0] == folder
        else:
            with pytest.raises(cli.UserError, match=r"has another tokenizer \(its tokenizer.json "
                                                    r"maps ids to other tokens\): a draft needs"):
                check()


def test_a_draft_folder_missing_or_a_file_names_draft_model(tiny_model, tmp_path):
    """Fix: the error said "point --model at a folder", of the --draft-model's folder."""
    for draft, what in ((tmp_path / "nowhere", "model folder {} not found"),
                        (tiny_model / "config.json", "{} is a file, not a model folder")):
        with pytest.raises(cli.UserError, match="^" + re.escape(what.format(draft) + "; point "
                                                               "--draft-model at a folder with")):
            li.main(["--model", str(tiny_model), "--draft-model", str(draft)])


def test_a_mixture_of_experts_draft_says_why_it_cannot_draft(tiny_model, variant):
    """Fix: it said "is not a Qwen3 config (model_type is 'qwen3_moe')", of a Qwen3 model."""
    from tests.checkpoint import TINY_MOE_CONFIG

    folder = variant("moe", config_json=tiny_config(tiny_model) | TINY_MOE_CONFIG)
    with pytest.raises(cli.UserError) as refused:
        li.main(["--model", str(tiny_model), "--draft-model", str(folder)])
    assert str(refused.value) == (f"{folder / 'config.json'} is a mixture of experts, which cannot "
                                  "be a draft (section 22 drafts with Part 1's dense blocks): use a "
                                  "dense Qwen3 as the draft")


def test_a_draft_larger_than_the_model_is_warned_about(tiny_model, reference, capsys):
    args = cli.parse_args(["--model", "x", "--draft-model", str(tiny_model)])
    smaller = reference.config._replace(num_hidden_layers=1)  # the model it drafts for
    assert cli.check_draft(args, tiny_model, smaller, li.load_config, li.layer_shapes,
                           li.load_tokenizer)[0] == tiny_model
    assert capsys.readouterr().err == (f"warning: --draft-model {tiny_model} has more weights than "
                                       "the model: drafting with it slows decoding down\n")


def test_a_draft_as_large_as_the_model_is_not_warned_about(tiny_model, reference, capsys):
    """The model's own copy (its folder again) has as many weights as the model: not more."""
    args = cli.parse_args(["--model", "x", "--draft-model", str(tiny_model)])
    assert cli.check_draft(args, tiny_model, reference.config, li.load_config, li.layer_shapes,
                           li.load_tokenizer)[0] == tiny_model
    assert capsys.readouterr().err == ""


def test_a_draft_is_refused_under_mlx_launch_and_with_flags_it_does_not_serve(
        tiny_model, reference, monkeypatch, capsys):
    for flag in (["--no-cache"], ["--trace"], ["--presence-penalty", "1"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--draft-model", str(tiny_model), *flag])
        assert capsys.readouterr().err.endswith("error: --draft-model does not apply with "
                                                "--no-cache, --trace or --presence-penalty "
                                                "(see --help)\n")
    group = type("Group", (), {"size": lambda self: 2, "rank": lambda self: 0})()
    monkeypatch.setattr(mx.distributed, "init", lambda *args, **kwargs: group)
    args = cli.parse_args(["--draft-model", str(tiny_model)])
    with pytest.raises(cli.SharedError, match="^--draft-model runs in one process only: drop it "
                                              "under mlx.launch$"):
        cli.check_draft(args, tiny_model, reference.config, li.load_config, li.layer_shapes,
                        li.load_tokenizer)


# ------------------------------------------------------------------------------------------------
# 3. The default model folder and its download
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def app(tmp_path):
    """A copy of the script alone in a folder, so its default model folder is app/Qwen3-0.6B."""
    folder = tmp_path / "app"
    folder.mkdir()
    copy_script(folder)
    return folder


def leftovers(app):
    """Anything a download left beside the script."""
    return sorted(p.name for p in app.iterdir() if p.name not in {path.name for path in PROGRAM})


def downloaded(folder, finished=True):
    """The files a download put in folder, after checking that all else there is huggingface_hub's
    hidden .cache folder (where it keeps what it knows of each file, and, in some versions, a file
    cut off, to resume it), with no partial file left in it once the download has finished."""
    names = sorted(p.name for p in folder.iterdir())
    assert ".cache" in names and (folder / ".cache").is_dir(), names
    assert not finished or list((folder / ".cache").rglob("*.incomplete")) == []
    return [name for name in names if name != ".cache"]


def online(hub):
    return dict(HF_HUB_OFFLINE=None, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_PROGRESS_BARS="1")


def test_default_folder_missing_no_download(app):
    model_dir = app / "Qwen3-0.6B"
    assert_one_line_error(run_cli("--no-download", cwd=app, script=app / SCRIPT.name), 1,
                          f"model folder {model_dir} not found", "--no-download", MANUAL_DOWNLOAD,
                          "--local-dir Qwen3-0.6B")  # relative to the current folder (app)
    assert not model_dir.exists()


def offline_line(what, repo=cli.HF_REPO, local_dir="Qwen3-0.6B"):
    """The error when HF_HUB_OFFLINE=1 keeps a model from downloading: no "run again" (it would fail
    alike), but how to download: the command prints into local_dir, or into the cache (None)."""
    files = f" {' '.join(cli.MODEL_FILES)}" if repo == cli.HF_REPO else ""
    into = f" --local-dir {local_dir}" if local_dir else ""
    return (f"{ERROR_PREFIX}{what}, and Hugging Face's offline mode is on (HF_HUB_OFFLINE): unset it to "
            f"download {repo}, or fetch it with: hf download {repo}{files}{into}")


def test_default_folder_missing_offline(app):
    line = assert_one_line_error(run_cli(cwd=app, script=app / SCRIPT.name, HF_HUB_OFFLINE="1"), 1)
    assert line == offline_line(f"model folder {app / 'Qwen3-0.6B'} not found"), line
    assert "run again" not in line
    assert leftovers(app) == []


def test_default_folder_missing_unreachable_hub(app):
    start = time.monotonic()
    result = run_cli(cwd=app, script=app / SCRIPT.name, HF_HUB_OFFLINE=None, HF_ENDPOINT="http://127.0.0.1:9")
    elapsed = time.monotonic() - start
    line = assert_one_line_error(result, 1, "could not download Qwen/Qwen3-0.6B", MANUAL_DOWNLOAD,
                                 "to try random weights meanwhile, see README.md's Troubleshooting")
    assert "resume" not in line  # nothing began: only a download cut off midway resumes
    assert leftovers(app) == []
    print(f"unreachable hub: failed after {elapsed:.2f} s")
    assert elapsed < 30, f"took {elapsed:.1f} s to give up on a closed port"


def test_default_folder_incomplete_offline(app, tiny_model):
    model_dir = app / "Qwen3-0.6B"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(tiny_model / name, model_dir / name)
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    line = assert_one_line_error(run_cli(cwd=app, script=app / SCRIPT.name, HF_HUB_OFFLINE="1"), 1)
    assert line == offline_line("Qwen3-0.6B lacks model.safetensors"), line  # ./Qwen3-0.6B, as found
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before  # untouched, nothing added
    assert leftovers(app) == ["Qwen3-0.6B"]


def test_default_folder_incomplete_no_download(app, tiny_model):
    model_dir = app / "Qwen3-0.6B"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model / name, model_dir / name)
    assert_one_line_error(run_cli("--no-download", cwd=app, script=app / SCRIPT.name), 1,
                          "lacks model.safetensors", "--no-download", MANUAL_DOWNLOAD)
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "tokenizer.json"]


class FakeHub:
    """Just enough of the Hugging Face Hub API, on 127.0.0.1, to serve a folder's files as a repo
    (by default Qwen/Qwen3-0.6B), plus a README.md and LICENSE like a real repo's, which the script
    should not fetch. missing: files answered 404. cut: files whose first download stops halfway
    (the connection drops), and which are unavailable (503) after that, as when the network goes."""

    COMMIT = "c1899de289a04d12100db370d81485cdf75e47ca"

    def __init__(self, folder, missing=(), repo=cli.HF_REPO, cut=()):
        self.repo = repo
        self.files = {path.name: path.read_bytes() for path in sorted(folder.iterdir())}
        self.files |= {"README.md": b"# A model\n", "LICENSE": b"Apache-2.0\n"}
        self.missing = set(missing)  # answered 404, as if the repo lacked them
        self.cut, self.was_cut = set(cut), set()
        self.requests = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path))
                prefix = f"/{hub.repo}/resolve/"
                if path == f"/api/models/{hub.repo}" or path.startswith(f"/api/models/{hub.repo}/revision/"):
                    siblings = [{"rfilename": n, "size": len(d)} for n, d in hub.files.items()]
                    self.send(200, json.dumps({"id": hub.repo, "sha": hub.COMMIT, "siblings": siblings}).encode(),
                              body, {"Content-Type": "application/json"})
                elif path.startswith(f"/api/models/{hub.repo}/tree/"):  # snapshot_download's listing
                    tree = [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                            for n, d in hub.files.items()]
                    self.send(200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
                elif path.startswith(prefix) and path.split("/", 5)[-1] in hub.files:
                    name = path.split("/", 5)[-1]
                    if name in hub.missing:
                        self.send(404, b"Entry not found", body, {"X-Error-Code": "EntryNotFound",
                                                                  "X-Repo-Commit": hub.COMMIT})
                        return
                    if body and name in hub.was_cut:
                        self.send(503, b"Service Unavailable", body, {})
                        return
                    data = hub.files[name]
                    self.send(200, data, body, {"X-Repo-Commit": hub.COMMIT,
                                                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                                "Content-Type": "application/octet-stream"},
                              cut=body and name in hub.cut)
                    if body and name in hub.cut:
                        hub.was_cut.add(name)
                else:
                    self.send(404, b"Repository not found", body, {"X-Error-Code": "RepoNotFound"})

            def send(self, code, data, body, headers, cut=False):
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data[:len(data) // 2] if cut else data)
                self.close_connection = self.close_connection or cut  # the rest never comes

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def fetched(hub):
    """The files downloaded from the hub, in order."""
    return [path.rsplit("/", 1)[-1] for method, path in hub.requests
            if method == "GET" and "/resolve/" in path]


def test_download_from_hub(app, tiny_model, greedy_24):
    model_dir = app / "Qwen3-0.6B"
    with FakeHub(tiny_model) as hub:
        rc, out, err = run_cli("--max-tokens", 24, cwd=app, script=app / SCRIPT.name, **online(hub))
    first, rest = err.split("\n", 1)
    total = sum(len(hub.files[name]) for name in cli.MODEL_FILES)
    assert first == f"Downloading {cli.HF_REPO} (5 files, {total / 1e9:.2f} GB) into {model_dir}/"
    text, lines, n_prompt, n_generated = parse_success((rc, out, rest))
    assert text == greedy_24 and (n_prompt, n_generated) == (5, 24)
    assert downloaded(model_dir) == sorted(cli.MODEL_FILES)
    for name in cli.MODEL_FILES:
        assert (model_dir / name).read_bytes() == (tiny_model / name).read_bytes(), name
    # config.json first, alone (into a temporary folder, checked), the weights last: until they
    # have arrived, the folder does not look complete.
    gets = fetched(hub)
    assert gets[0] == "config.json" and gets[-1] == "model.safetensors", gets
    assert sorted(gets) == sorted([*cli.MODEL_FILES, "config.json"]), gets  # no README.md
    # Every file from the commit model_info named, never from a branch that may move meanwhile.
    assert all(f"/resolve/{hub.COMMIT}/" in path for _, path in hub.requests if "/resolve/" in path)
    assert leftovers(app) == ["Qwen3-0.6B"]
    # Once there, the folder is used as it is: offline is fine. The header says where it is.
    text, lines, _, _ = parse_success(run_cli("--max-tokens", 24, cwd=app,
                                              script=app / SCRIPT.name))
    assert text == greedy_24 and lines[0].endswith(f", from {model_dir}"), lines[0]


@pytest.mark.parametrize("failure", ["missing", "cut"])
def test_download_failing_midway_never_looks_complete_and_resumes(app, tiny_model, greedy_24,
                                                                   failure):
    """The weights fail to arrive (the repo lacks them, or the connection drops halfway through):
    what did arrive stays, but the folder lacks model.safetensors, so it is not taken for a model;
    the next run fetches only the rest, and runs."""
    model_dir = app / "Qwen3-0.6B"
    with FakeHub(tiny_model, **{failure: {"model.safetensors"}}) as hub:
        rc, out, err = run_cli(cwd=app, script=app / SCRIPT.name, **online(hub))
    assert f"/{cli.HF_REPO}/resolve/{hub.COMMIT}/model.safetensors" in [path for _, path in hub.requests]
    lines = err.splitlines()
    assert lines[0].startswith(f"Downloading {cli.HF_REPO} (5 files, ")
    # Between the two: huggingface_hub's own warnings as it retries the cut-off file.
    assert len(lines) == 2 or failure == "cut", err
    assert_one_line_error((rc, out, lines[-1] + "\n"), 1,
                          f"model folder {model_dir} not found, and could not download "
                          f"{cli.HF_REPO} (", "); run again to resume, or fetch it with: "
                          f"{MANUAL_DOWNLOAD} {' '.join(cli.MODEL_FILES)} --local-dir Qwen3-0.6B")
    assert downloaded(model_dir, False) == sorted(set(cli.MODEL_FILES) - {"model.safetensors"})
    assert cli.missing_files(downloaded(model_dir, False)) == ["model.safetensors"]
    assert leftovers(app) == ["Qwen3-0.6B"]
    # Without downloads, the folder (./Qwen3-0.6B here) is reported incomplete, not used.
    assert_one_line_error(run_cli("--no-download", cwd=app, script=app / SCRIPT.name), 1,
                          f"{ERROR_PREFIX}Qwen3-0.6B lacks model.safetensors and --no-download")

    with FakeHub(tiny_model) as hub:  # the weights are there now
        rc, out, err = run_cli("--max-tokens", 24, cwd=app, script=app / SCRIPT.name, **online(hub))
    first, rest = err.split("\n", 1)
    assert first.startswith(f"Downloading {cli.HF_REPO} (5 files, ")
    text, _, _, n_generated = parse_success((rc, out, rest))
    assert text == greedy_24 and n_generated == 24
    # What had arrived is kept (config.json is fetched again, into a temporary folder, to check it).
    assert [name for name in fetched(hub) if name != "config.json"] == ["model.safetensors"]
    assert downloaded(model_dir) == sorted(cli.MODEL_FILES)
    for name in cli.MODEL_FILES:
        assert (model_dir / name).read_bytes() == (tiny_model / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------
# 4. --model with a Hugging Face repo id
# ------------------------------------------------------------------------------------------------

REPO = "someone/Qwen3-Tiny-Sharded"


def snapshot(home, repo, finished=True):
    """The folder a download of repo filled in Hugging Face's cache under HF_HOME `home`
    (hub/models--OWNER--NAME/snapshots/<commit>/) and the names in it, after checking that it is
    the snapshot of FakeHub.COMMIT, the only one, with no partial file (blobs/*.incomplete) left
    once the download has finished."""
    repo_dir = Path(home) / "hub" / f"models--{repo.replace('/', '--')}"
    assert [p.name for p in (repo_dir / "snapshots").iterdir()] == [FakeHub.COMMIT]
    assert not finished or list((repo_dir / "blobs").glob("*.incomplete")) == []
    folder = repo_dir / "snapshots" / FakeHub.COMMIT
    return folder, sorted(p.name for p in folder.iterdir())


def test_repo_id_is_downloaded_into_the_cache_then_reused(app, sharded_model, greedy_24, tmp_path):
    elsewhere = tmp_path / "elsewhere"  # the working folder
    elsewhere.mkdir()
    home = tmp_path / "hf-home"  # HF_HOME, outside the working folder and the script's
    with FakeHub(sharded_model, repo=REPO) as hub:
        rc, out, err = run_cli("--model", REPO, "--max-tokens", 24, cwd=elsewhere, script=app / SCRIPT.name,
                               HF_HOME=str(home), **online(hub))
    first, rest = err.split("\n", 1)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             cli.WEIGHTS_INDEX, *shards]
    total = sum(len(hub.files[name]) for name in files)
    assert first == (f"Downloading {REPO} (8 files, {total / 1e9:.2f} GB) into Hugging Face's cache "
                     f"({home / 'hub'})")
    text, lines, _, n_generated = parse_success((rc, out, rest))
    assert text == greedy_24 and n_generated == 24
    assert lines[0].startswith(f"Model: {REPO} (2 layers, "), lines[0]
    gets = fetched(hub)
    # config.json and the index first (together, in either order), into a temporary folder,
    # checked before anything else; then the small files (in any order), then the shards; in the
    # model folder the index comes last, after its shards: until then the folder lacks it.
    assert sorted(gets[:2]) == sorted(["config.json", cli.WEIGHTS_INDEX]), gets
    assert sorted(gets[2:-4]) == sorted(files[:4]), gets
    assert sorted(gets[-4:-1]) == shards and gets[-1] == cli.WEIGHTS_INDEX, gets
    assert sorted(gets) == sorted([*files, "config.json", cli.WEIGHTS_INDEX]), gets  # no README.md
    # Every file from the commit model_info named, never from a branch that may move meanwhile.
    assert all(f"/resolve/{hub.COMMIT}/" in path for _, path in hub.requests if "/resolve/" in path)
    folder, names = snapshot(home, REPO)
    assert names == sorted(files)
    for name in files:
        assert (folder / name).read_bytes() == hub.files[name], name
    # Nothing beside the script, nor in the working folder: all of it is in the cache.
    assert leftovers(app) == [] and list(elsewhere.iterdir()) == []
    # Afterwards the cache's copy is used as it is: offline, from anywhere (the script's folder
    # too), and online without a word to the hub.
    for cwd in (elsewhere, app):
        text, lines, _, _ = parse_success(run_cli("--model", REPO, "--max-tokens", 24, cwd=cwd,
                                                  script=app / SCRIPT.name, HF_HOME=str(home)))
        assert text == greedy_24 and lines[0].startswith(f"Model: {REPO} ("), lines[0]
    with FakeHub(sharded_model, repo=REPO) as hub:
        text, lines, _, _ = parse_success(run_cli("--model", REPO, "--max-tokens", 24, cwd=elsewhere,
                                                  script=app / SCRIPT.name, HF_HOME=str(home),
                                                  **online(hub)))
    assert text == greedy_24 and lines[0].startswith(f"Model: {REPO} ("), lines[0]
    assert hub.requests == []
    assert snapshot(home, REPO)[1] == sorted(files) and leftovers(app) == []


def test_repo_id_failing_midway_never_looks_complete_and_resumes(app, sharded_model, greedy_24, tmp_path):
    """A shard fails to arrive: the index, which comes last, has not either, so the cache's snapshot
    does not look complete; the next run fetches the rest, and runs."""
    home, shards = tmp_path / "hf-home", [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with FakeHub(sharded_model, repo=REPO, missing={shards[1]}) as hub:
        rc, out, err = run_cli("--model", REPO, cwd=app, script=app / SCRIPT.name, HF_HOME=str(home),
                               **online(hub))
    assert ("GET", f"/{REPO}/resolve/{hub.COMMIT}/{shards[0]}") in hub.requests
    first, rest = err.split("\n", 1)
    assert first.startswith(f"Downloading {REPO} (8 files, ")
    line = assert_one_line_error((rc, out, rest), 1)
    assert line.startswith(f"{ERROR_PREFIX}{REPO} is not in the Hugging Face cache, and could not "
                           f"download {REPO} ("), line
    assert line.endswith(f"); run again to resume, or fetch it with: hf download {REPO}"), line
    _, files = snapshot(home, REPO, finished=False)
    assert shards[0] in files and shards[1] not in files and cli.WEIGHTS_INDEX not in files, files
    assert cli.missing_files(files) == ["model.safetensors"]
    assert leftovers(app) == []

    with FakeHub(sharded_model, repo=REPO) as hub:
        rc, out, err = run_cli("--model", REPO, "--max-tokens", 24, cwd=app,
                               script=app / SCRIPT.name, HF_HOME=str(home), **online(hub))
    first, rest = err.split("\n", 1)
    assert first.startswith(f"Downloading {REPO} (8 files, ")
    text, _, _, n_generated = parse_success((rc, out, rest))
    assert text == greedy_24 and n_generated == 24
    # What had arrived is kept (the shards are fetched together, so the one after the missing one
    # may have come too); the index is fetched first, to be checked with config.json (which
    # huggingface_hub copies from the cache, where it arrived with the small files), and again
    # last, into the cache, after the shards that were missing.
    gets = fetched(hub)
    assert gets[0] == cli.WEIGHTS_INDEX, gets
    assert sorted(gets[1:-1]) == [shard for shard in shards if shard not in files], gets
    assert gets[-1] == cli.WEIGHTS_INDEX, gets
    folder, names = snapshot(home, REPO)
    assert names == sorted(hub.files.keys() - {"README.md", "LICENSE"})
    for name in names:
        assert (folder / name).read_bytes() == hub.files[name], name
    assert leftovers(app) == []


@pytest.mark.parametrize("offline", ["1", "true"])  # as huggingface_hub reads it: "true" too
def test_repo_id_offline(app, tmp_path, offline):
    home = tmp_path / "hf-home"
    line = assert_one_line_error(run_cli("--model", REPO, cwd=app, script=app / SCRIPT.name,
                                         HF_HOME=str(home), HF_HUB_OFFLINE=offline), 1)
    assert line == offline_line(f"{REPO} is not in the Hugging Face cache", REPO, None), line
    assert leftovers(app) == [] and list(home.glob("hub/models--*")) == []


@pytest.mark.parametrize("spelled", [REPO, f"{REPO}/", f"https://huggingface.co/{REPO}"],
                         ids=["id", "trailing slash", "address"])
def test_repo_id_no_download(app, spelled):
    result = run_cli("--model", spelled, "--no-download", cwd=app, script=app / SCRIPT.name)
    line = assert_one_line_error(result, 1)
    # The command fetches it into the cache, where the next run looks: no --local-dir.
    assert line == (f"{ERROR_PREFIX}{REPO} is not in the Hugging Face cache and --no-download was "
                    f"given; fetch it with: hf download {REPO}"), line
    assert leftovers(app) == []


def run_printed_command(command, cwd, tmp_path):
    """Run a printed `hf download ...` line with bash, with a fake `hf` that only records where it
    runs; returns the folder its --local-dir names, resolved from there."""
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "hf-log"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "hf").write_text('#!/bin/sh\npwd -P > "$HF_LOG"\nprintf "%s\\n" "$@" >> "$HF_LOG"\n')
    (bin_dir / "hf").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_LOG": str(log)}
    subprocess.run(["bash", "-c", command], cwd=cwd, env=env, check=True, timeout=30)
    where, *args = log.read_text().splitlines()
    assert args[:2] == ["download", args[1]] and args[-2] == "--local-dir", args
    return (Path(where) / args[-1]).resolve()


@pytest.mark.parametrize("where", ["the current folder", "next to the script"])
def test_the_printed_download_command_works_here_and_on_another_machine(tmp_path, where):
    """The command printed when the default model folder cannot be downloaded into holds no path of this
    machine but, when the folder is not under the current folder, a cd to the script's folder: run as
    printed, it fills the model folder here; run from the same place in a copy elsewhere (another
    machine), the copy's. (A repo id's command names no folder: it fills the cache, test_repo_id_no_download.)"""
    app = tmp_path / "my app"  # a space, as in a Mac's "Application Support": the paths are quoted
    app.mkdir()
    copy_script(app)
    cwd = app if where == "the current folder" else tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    model_dir = app / "Qwen3-0.6B"  # the default folder, next to the script (none in cwd)
    line = assert_one_line_error(run_cli("--no-download", cwd=cwd, script=app / SCRIPT.name),
                                 1, f"model folder {model_dir} not found")
    command = line.split("fetch it with: ", 1)[1]
    assert run_printed_command(command, cwd, tmp_path) == model_dir  # here
    cd = f"cd {shlex.quote(str(app))} && "
    download = f"{MANUAL_DOWNLOAD} {' '.join(cli.MODEL_FILES)} --local-dir Qwen3-0.6B"
    if where == "the current folder":
        assert command == download
    else:
        assert command == f"{cd}{download}"
        command = command.removeprefix(cd)  # elsewhere, the cd goes to that machine's script folder
    assert str(tmp_path) not in command
    other = shutil.copytree(app, tmp_path / "another machine" / "app")
    assert run_printed_command(command, other, tmp_path) == other / "Qwen3-0.6B"


def test_repo_id_not_found(app, tiny_model):
    with FakeHub(tiny_model) as hub:  # serves Qwen/Qwen3-0.6B only
        result = run_cli("--model", REPO, cwd=app, script=app / SCRIPT.name, **online(hub))
    assert_one_line_error(result, 1, f"could not download {REPO}", "RepositoryNotFound")
    assert leftovers(app) == []


def test_repo_id_of_a_bad_moe_config_is_refused_before_its_weights(app, tiny_model, variant):
    folder = variant(config_json=tiny_config(tiny_model) | {"model_type": "qwen3_moe"})
    with FakeHub(folder, repo=REPO) as hub:
        result = run_cli("--model", REPO, cwd=app, script=app / SCRIPT.name, **online(hub))
    assert_one_line_error(result, 1, f"{REPO}/config.json lacks the required key 'num_experts'")
    assert ("GET", f"/{REPO}/resolve/{hub.COMMIT}/config.json") in hub.requests
    assert not any(path.endswith(".safetensors") for _, path in hub.requests)
    assert leftovers(app) == []


def test_repo_id_without_safetensors(app, variant):
    folder = variant(model_safetensors=None)
    with FakeHub(folder, repo=REPO) as hub:
        result = run_cli("--model", REPO, cwd=app, script=app / SCRIPT.name, **online(hub))
    assert_one_line_error(result, 1, f"{REPO} has no model.safetensors")
    assert leftovers(app) == []


def test_existing_folder_named_like_a_repo_id_is_never_downloaded_into(tiny_model, tmp_path):
    folder = tmp_path / "someone" / "model"
    folder.mkdir(parents=True)
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    assert_one_line_error(run_cli("--model", "someone/model", cwd=tmp_path, HF_HUB_OFFLINE=None,
                                  HF_ENDPOINT="http://127.0.0.1:9"), 1,
                          "someone/model lacks model.safetensors, tokenizer.json", "point --model at a folder")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


CACHED = "someone/Name"  # a repo the tests below put into the cache by hand
CACHED_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # not FakeHub.COMMIT


def cache_by_hand(home, repo, folder, leave_out=()):
    """repo in Hugging Face's cache under HF_HOME `home`, laid out as `hf download` leaves it: each file
    of folder (but leave_out) a blob named by its sha256, linked from snapshots/CACHED_COMMIT/, and
    refs/main naming that commit. Returns the snapshot folder."""
    repo_dir = Path(home) / "hub" / f"models--{repo.replace('/', '--')}"
    folder_in_cache = repo_dir / "snapshots" / CACHED_COMMIT
    folder_in_cache.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for path in sorted(Path(folder).iterdir()):
        if path.name not in leave_out:
            data = path.read_bytes()
            blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (folder_in_cache / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(CACHED_COMMIT)
    return folder_in_cache


def tree(folder):
    """Every path under folder, with a file's bytes (a link's target): to see that nothing changed."""
    return {str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else
            p.read_bytes() if p.is_file() else None for p in sorted(Path(folder).rglob("*"))}


@pytest.mark.parametrize("hub_mode", ["offline", "online"])
def test_a_repo_id_in_the_cache_is_used_as_it_is(app, tiny_model, greedy_24, tmp_path, hub_mode):
    """Issue 25: a repo `hf download` (or mlx-lm, transformers) put into Hugging Face's cache runs
    from there: offline, and online without a word to the hub (which serves it too, so that a
    download would succeed and be seen); nothing is written, beside the script or in the cache."""
    home, work = tmp_path / "hf-home", tmp_path / "work"
    work.mkdir()
    cache_by_hand(home, CACHED, tiny_model)
    before = tree(home)
    with FakeHub(tiny_model, repo=CACHED) as hub:
        env = online(hub) if hub_mode == "online" else {"HF_HUB_OFFLINE": "1"}
        result = run_cli("--model", CACHED, "--max-tokens", 24, cwd=work, script=app / SCRIPT.name,
                         HF_HOME=str(home), **env)
    text, lines, _, n_generated = parse_success(result)  # the first line is the model's: no download
    assert lines[0].startswith(f"Model: {CACHED} (2 layers, "), lines[0]
    assert text == greedy_24 and n_generated == 24
    assert hub.requests == [] and fetched(hub) == []
    assert tree(home) == before and leftovers(app) == [] and list(work.iterdir()) == []


@pytest.mark.parametrize("cached", ["another repo", "all but the weights"])
def test_a_repo_id_not_in_the_cache_offline_is_one_line_naming_hf_hub_offline(app, tiny_model, tmp_path,
                                                                                cached):
    """Issue 25: offline, a repo the cache lacks (or has only part of: issue 32, said so) is one
    line that says HF_HUB_OFFLINE is why and how to fetch it, not "run again" (which would fail
    alike); the cache is left as it is, and nothing is written beside the script."""
    home, work = tmp_path / "hf-home", tmp_path / "work"
    work.mkdir()
    if cached == "another repo":
        cache_by_hand(home, "someone/Other", tiny_model)
    else:  # refs/main and a snapshot, without model.safetensors: not taken for a model
        cache_by_hand(home, CACHED, tiny_model, leave_out={"model.safetensors"})
    before = tree(home)
    line = assert_one_line_error(run_cli("--model", CACHED, cwd=work, script=app / SCRIPT.name,
                                         HF_HOME=str(home), HF_HUB_OFFLINE="1"), 1, "HF_HUB_OFFLINE")
    what = (f"{CACHED} is not in the Hugging Face cache" if cached == "another repo" else
            f"{CACHED}'s copy in the Hugging Face cache is incomplete (no model.safetensors)")
    assert line == offline_line(what, CACHED, None), line
    assert "run again" not in line
    assert tree(home) == before and leftovers(app) == [] and list(work.iterdir()) == []


@pytest.mark.parametrize("default_folder", [False, True], ids=["none", "one next to the script"])
def test_the_default_repo_id_is_read_from_the_cache(app, tiny_model, greedy_24, tmp_path,
                                                    default_folder):
    """Issue 32: --model Qwen/Qwen3-0.6B is read from Hugging Face's cache, as any repo id: also
    without a complete ./Qwen3-0.6B (it went there instead of the cache), and beside one (it ran
    that folder, and the header named only the repo). The header says where the weights are."""
    home, work = tmp_path / "hf-home", tmp_path / "work"
    work.mkdir()
    cache_by_hand(home, cli.HF_REPO, tiny_model)
    if default_folder:
        shutil.copytree(tiny_model, app / "Qwen3-0.6B")
    text, lines, _, n_generated = parse_success(run_cli(
        "--model", cli.HF_REPO, "--max-tokens", 24, cwd=work, script=app / SCRIPT.name,
        HF_HOME=str(home)))
    assert lines[0].startswith(f"Model: {cli.HF_REPO} (2 layers, "), lines[0]
    assert lines[0].endswith(", from the Hugging Face cache"), lines[0]
    assert text == greedy_24 and n_generated == 24


@pytest.mark.parametrize("spelled", ["relative", "absolute"])
def test_a_folder_given_through_a_link_is_named_after_the_link(tiny_model, tmp_path, spelled):
    """Issue 25: the model line names the folder the user gave, a link by its own name, not its
    target's (tiny-qwen3)."""
    link = tmp_path / "my-model"
    link.symlink_to(tiny_model, target_is_directory=True)
    assert tiny_model.name != link.name
    _, lines, _, _ = parse_success(run_cli("--model", "my-model" if spelled == "relative" else link,
                                           "--max-tokens", 2, cwd=tmp_path))
    assert lines[0].startswith("Model: my-model (2 layers, "), lines[0]


@pytest.mark.parametrize("text, repo", [
    ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B"),
    ("mlx-community/Qwen3-4B-4bit", "mlx-community/Qwen3-4B-4bit"),
    ("Qwen/Qwen3-1.7B/", "Qwen/Qwen3-1.7B"),  # as shells complete a folder's name
    ("https://huggingface.co/Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B"),  # pasted from a browser
    ("https://huggingface.co/Qwen/Qwen3-1.7B/tree/main", "Qwen/Qwen3-1.7B"),
    ("https://huggingface.co/Qwen", None),
    ("Qwen3-0.6B", None), ("./Qwen/Qwen3-1.7B", None), ("/models/Qwen3", None), ("a/b/c", None),
    ("../x", None), ("~/Qwen3", None)])
def test_repo_id_or_folder(text, repo):
    assert cli.repo_id(text) == repo


# ------------------------------------------------------------------------------------------------
# 5. Ctrl-C during generation
# ------------------------------------------------------------------------------------------------

# A test that interrupts a reply must not race the model, which may finish the reply before the
# signal arrives: it runs the script through this wrapper, whose reply number `reply` (1 for the
# first) stops after its first `after` tokens, each printed, says so on stderr and waits for SIGINT.
PAUSED = """import os, signal, sys, time
sys.path.insert(0, {root!r})
import cli  # noqa: E402 (first, as llm_inference.py imports it)
import llm_inference as li  # noqa: E402

# SIGINT raises KeyboardInterrupt, even where the test runner was started with it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
generate_long, replies = li.generate_long, 0


def generate_then_wait(*args, **kwargs):  # every reply's tokens come from generate_long
    global replies
    replies += 1
    for n, pair in enumerate(generate_long(*args, **kwargs), 1):
        yield pair
        if replies == {reply} and n == {after}:  # token n is printed: wait here for Ctrl-C
            sys.stderr.flush()
            os.write(2, {line!r}.encode() + b"\\n")  # one write: Ctrl-C comes once it is read
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.01)  # where SIGINT's KeyboardInterrupt is raised
            sys.exit("paused.py: no SIGINT within 120 s")
    if replies == {reply}:
        sys.exit("paused.py: the reply ended before the pause")


li.generate_long = generate_then_wait
cli.run(li.main)
"""
PAUSED_LINE = "(paused for SIGINT)"


def paused_script(folder, reply=1, after=1):
    """The script, in `folder`, with reply number `reply` waiting for SIGINT after `after` tokens
    (see PAUSED); it writes PAUSED_LINE to stderr when it starts waiting."""
    path = Path(folder) / "paused.py"
    path.write_text(PAUSED.format(root=str(SCRIPT.parent), reply=reply, after=after,
                                  line=PAUSED_LINE))
    return path


def read_until_paused(proc, timeout=120):
    """proc's stderr up to PAUSED_LINE, read from the pipe itself: bytes a buffered read took
    would never reach communicate(), which reads the pipe."""
    err, deadline = b"", time.monotonic() + timeout
    while f"{PAUSED_LINE}\n".encode() not in err:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([proc.stderr], [], [], left)[0], err.decode()
        chunk = os.read(proc.stderr.fileno(), 65536)
        assert chunk, f"ended before the pause: {err.decode()}"
        err += chunk
    return err


def test_ctrl_c_keeps_text_and_prints_stats(tiny_model, reference, tmp_path):
    max_tokens = 20000  # far more than the 8 tokens the reply pauses after; within the 40960 positions
    proc = subprocess.Popen(
        [sys.executable, str(paused_script(tmp_path, after=8)), "--model", str(tiny_model),
         "--max-tokens", str(max_tokens)],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=cli_env(tmp_path / ".hf-home"), start_new_session=False,
        # Python only turns SIGINT into KeyboardInterrupt when it starts with SIGINT at its default action; a
        # test runner started in the background (`cmd &` in a script) hands its children SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out, err = bytearray(), bytearray()

    def drain(stream, buffer):
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            buffer += chunk

    readers = [threading.Thread(target=drain, args=(proc.stdout, out)), threading.Thread(target=drain, args=(proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 60
        while PAUSED_LINE.encode() not in err and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # until the reply waits for the signal, its 8 tokens printed
        assert proc.poll() is None, f"finished before the interrupt (exit {proc.returncode}): {bytes(err).decode()}"
        assert PAUSED_LINE.encode() in err, "no pause within 60 s"
        before = bytes(out)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
    stdout, stderr = bytes(out).decode("utf-8"), bytes(err).decode("utf-8")
    assert "Traceback" not in stderr, stderr
    assert rc == 130, stderr
    assert stdout.startswith(before.decode("utf-8", errors="ignore")) and stdout.endswith("\n")
    last = stderr.splitlines()[-1]
    assert last.startswith("Interrupted. Prompt: 5 tokens, "), last
    stats = STATS.search(last)
    assert stats, last
    n_generated = int(stats[2])
    assert n_generated == 8  # the interrupted reply's tokens, each printed
    # What was printed is the greedy continuation, as far as it got.
    expected = reference.tokenizer.decode(reference.generate(PROMPT, n_generated), skip_special_tokens=True)
    assert expected.startswith(stdout[:-1]) and len(stdout[:-1]) > 0


def test_prompts_ctrl_c_leaves_the_finished_lines_whole(reference, capsys, monkeypatch,
                                                       tmp_path):
    """Ctrl-C (here raised after 11 tokens: prompt 1's 8, prompt 2's first 3) ends the run with
    exit code 130: prompt 1's line printed whole, nothing of prompt 2, the statistics, then
    "Interrupted."."""
    generate_batch = li.generate_batch

    def interrupted(*args, **kwargs):
        for n, pair in enumerate(generate_batch(*args, **kwargs), 1):
            if n == 12:
                raise KeyboardInterrupt
            yield pair

    monkeypatch.setattr(li, "generate_batch", interrupted)
    args = ["--model", str(reference.folder), "--prompts", prompts_file(tmp_path, BATCH_PROMPTS),
            "--batch-size", "1", "--max-tokens", "8"]
    with pytest.raises(SystemExit) as exited:
        cli.run(lambda: li.main(args))
    out, err = capsys.readouterr()
    assert exited.value.code == 130
    text = reference.text(BATCH_PROMPTS[0], 8)
    assert out == json.dumps({"prompt": BATCH_PROMPTS[0], "text": text, "tokens": 8,
                              "finish_reason": "length"}, ensure_ascii=False) + "\n"
    assert "Traceback" not in err and err.endswith("\n\nInterrupted.\n"), err
    assert re.match(r"Prompts: 1 of 3 printed \| Generated: 11 tokens, ", err.splitlines()[-3])


def test_closed_stdout_pipe_ends_quietly(tiny_model, tmp_path):
    """`python llm_inference.py | head -c 1`: when the reader goes away, exit 141 without a traceback."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--model", str(tiny_model), "--max-tokens", "2000"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(tmp_path / ".hf-home"))
    assert proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.stderr.read().decode("utf-8")
    assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_mlx_quantized_repo_id(app, tiny_model, converted_4bit):
    """An mlx-community-style repo (stored 4-bit) fetched by its id runs as the --quantize 4 text."""
    repo = "mlx-community/Qwen3-Tiny-4bit"
    with FakeHub(converted_4bit, repo=repo) as hub:
        rc, out, err = run_cli("--model", repo, "--max-tokens", 24, cwd=app, script=app / SCRIPT.name,
                               **online(hub))
    first, rest = err.split("\n", 1)
    assert first.startswith(f"Downloading {repo} (")
    text, lines, _, _ = parse_success((rc, out, rest))
    assert lines[0].endswith(", 4-bit weights, from the Hugging Face cache")
    assert text == Reference(tiny_model, cli.pick_dtype("auto"), 4).text(PROMPT, 24)


@pytest.mark.parametrize("flags", [[], ["--top-probs", "3"], ["--chat", "--prompt", "Hi"]])
def test_nan_logits_are_one_line_not_text(tiny_model, tmp_path, flags):
    """A NaN in the final norm's gains (what float16 overflow looks like on an M1/M2) made every
    logit NaN: the run printed token 0 ("!!!!!") and --top-probs a table of nan. Now the first
    token's logits are checked once, and the run ends in one line that says what to try."""
    folder = tmp_path / "overflowed"
    folder.mkdir()
    for path in tiny_model.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    tensors = mx.load(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * float("nan")
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    rc, out, err = run_cli("--model", folder, "--max-tokens", 5, *flags, cwd=tmp_path)
    lines = err.splitlines()
    assert rc == 1 and "Traceback" not in err and out.strip() == "", (out, err)
    assert lines[-1].startswith("llm_inference.py: error: the model computed NaN or infinite "
                                "logits"), err
    assert "--dtype bfloat16 or float32" in lines[-1]
    assert not re.search(r"\bnan\b", "\n".join(lines[:-1])), err  # the folder's path may say nan


# The columns a terminal gives a character, as wcwidth counts them: East Asian wide characters 2,
# combining marks 0.
WIDTH = lambda ch: (0 if unicodedata.category(ch) in ("Mn", "Me", "Cf") else
                    2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1)


@pytest.mark.parametrize("long_token", [[], [14343, 75360]], ids=["short", "long"])
def test_the_top_probs_table_lines_up_wide_and_combining_characters(tiny_model, capsys,
                                                                    long_token):
    """CJK characters take two columns of a terminal and Thai's combining vowel marks none: the
    table pads each token by the columns it takes, so the id column lines up. Issue 41: a token
    wider than the column ('ArgumentException', 19; bytes <0xF0><0x9F><0x98>, 18) shifted it."""
    tokenizer = li.load_tokenizer(tiny_model)
    ids = [107672, 47171, 93874, 145080, 12095] + long_token  # '领导人', 'ี่' (marks only), 'การ',
    logits = mx.full((tokenizer.get_vocab_size(),), -100.0)  # '🙂', ' Paris'
    logits[mx.array(ids)] = mx.arange(len(ids), 0, -1).astype(mx.float32)
    cli.print_top_probs(logits, tokenizer, len(ids), file=sys.stdout)
    rows = capsys.readouterr().out.splitlines()
    assert [int(row.split()[-2]) for row in rows[1:]] == ids
    # Each row up to its (right-aligned) id, in the columns a terminal gives it: the same for all,
    # the header's too.
    starts = {sum(map(WIDTH, row.rsplit("  ", 1)[0])) for row in rows}
    assert len(starts) == 1, rows


def test_the_trace_lines_up_the_logit_lens_after_wide_tokens(tiny_model, capsys):
    """Issue 41: --trace's lens probability came right after the token, so it moved with its
    width: after CJK (2 columns a character) or a piece of bytes (<0xF0><0x9F><0x98>, 18)."""
    tokenizer = li.load_tokenizer(tiny_model)
    printer = cli.TracePrinter(tokenizer, [12095])
    capsys.readouterr()
    x = mx.zeros((1, 64))
    for top in (12095, 107672, 75360):  # ' Paris', '领导人', <0xF0><0x9F><0x98>
        printer.block(0, x, 1.0, top, 0.5, 12095, 1)
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 3 and len({sum(map(WIDTH, row[:row.index(" 0.500, ")]))
                                   for row in rows}) == 1, rows


def test_a_seed_without_sampling_warns_like_top_k(tiny_model, capsys):
    """--seed with greedy decoding changed nothing and said nothing, while --top-k warned."""
    assert li.main(["--model", str(tiny_model), "--max-tokens", "2", "--seed", "3"]) == 0
    assert ("warning: --seed only matters when sampling; greedy decoding ignores it (add "
            "--temperature)") in capsys.readouterr().err
    assert li.main(["--model", str(tiny_model), "--max-tokens", "2", "--seed", "3",
                    "--temperature", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_num_draft_tokens_without_a_draft_warns_like_top_k(tiny_model, capsys):
    """--num-draft-tokens without --draft-model changed nothing and said nothing."""
    assert cli.parse_args(["--num-draft-tokens", "5"]).num_draft_tokens == 5
    assert capsys.readouterr().err == ("warning: --num-draft-tokens only matters with --draft-model; "
                                       "a run without one ignores it (add --draft-model)\n")
    for flags in (["--draft-model", str(tiny_model), "--num-draft-tokens", "5"], []):
        assert cli.parse_args(flags).num_draft_tokens == (5 if flags else cli.NUM_DRAFT_TOKENS)
        assert capsys.readouterr().err == ""


def test_the_lowest_temperature_and_min_p_0_are_accepted():
    """Bugs: the temperature floor itself refused (> instead of >=); --min-p 0 refused."""
    assert cli.parse_args(["--temperature", str(cli.MIN_TEMPERATURE)]).temperature == cli.MIN_TEMPERATURE
    assert cli.parse_args(["--min-p", "0"]).min_p == 0
    with pytest.raises(SystemExit):
        cli.parse_args(["--temperature", str(cli.MIN_TEMPERATURE / 2)])


def test_the_trace_numbers_blocks_from_0(tiny_model, capsys):
    """Bug: --trace numbered the blocks from 1."""
    config = li.load_config(tiny_model)
    weights, tokenizer = li.load_weights(tiny_model, config, mx.float32), li.load_tokenizer(tiny_model)
    li.trace(li.tokenize(tokenizer, "The capital of France is"), weights, config, tokenizer)
    blocks = [line.split()[1] for line in capsys.readouterr().out.splitlines()
              if line.startswith("block ") and " done:" in line]
    assert blocks == [str(i) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize("reference_ops", [False, True])
def test_reference_ops_runs_part_1_as_written(tiny_model, monkeypatch, capsys, reference_ops):
    """Bug: --reference-ops did not take effect (the fused kernels ran anyway)."""
    calls = []
    for name in ("rms_norm", "rope", "scaled_dot_product_attention"):
        kernel = getattr(mx.fast, name)
        monkeypatch.setattr(mx.fast, name, lambda *a, _k=kernel, _n=name, **kw:
                            calls.append(_n) or _k(*a, **kw))
    flags = ["--reference-ops"] if reference_ops else []
    assert li.main(["--model", str(tiny_model), "--max-tokens", "3", *flags]) == 0
    assert capsys.readouterr().out.strip()  # some text came out
    if reference_ops:
        assert calls == [] and li.rms_norm.__name__ == "rms_norm"
        assert li.silu_gate is not li.compiled_silu_gate
    else:
        assert set(calls) == {"rms_norm", "rope", "scaled_dot_product_attention"}


def test_the_printed_download_command_quotes_its_path(tmp_path, monkeypatch):
    """Bug: the --local-dir of the printed `hf download` command was not shell-quoted."""
    folder = tmp_path / "my models" / "Qwen3 0.6B"
    monkeypatch.chdir(tmp_path)
    words = shlex.split(cli.download_command("Qwen/Qwen3-0.6B", folder))
    assert words[-2:] == ["--local-dir", "my models/Qwen3 0.6B"]


# ------------------------------------------------------------------------------------------------
# Prefill progress, the rates without the time spent printing, --top-probs' sampled column, byte
# tokens, messages
# ------------------------------------------------------------------------------------------------

import io  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

from tests.checkpoint import byte_to_unicode  # noqa: E402

PROGRESS = re.compile(r"prefill: (\d+)/(\d+) tokens, (\d+) tok/s")
RATES = re.compile(r"Prompt: (\d+) tokens?, ([\d.]+) tok/s \| Generated: (\d+) tokens?, ([\d.]+) "
                   r"tok/s \| Prefill \+ decode: ([\d.]+) s \| ")
LONG_PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. In Spain it is"


class Terminal(io.StringIO):
    """A stand-in for stderr on a terminal."""

    def isatty(self):
        return True


class Clock:
    """time.perf_counter for cli (cli.time stands for the time module there), set by hand."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def slow_writes(stream, clock, seconds):
    """stream, whose writes of a progress line take `seconds` of the clock."""
    write = stream.write

    def slow(text):
        if "prefill:" in text:
            clock.now += seconds
        return write(text)

    stream.write = slow
    return stream


@pytest.mark.parametrize("terminal", [False, True], ids=["not a terminal", "terminal"])
def test_prefill_progress_shows_after_2_seconds_then_once_a_second(monkeypatch, capsys, terminal):
    """cli.Prefill.show(done, total), on a clock set by hand: nothing in a prefill's first 2
    seconds; then, on a terminal, each call rewrites one line (cleared by finish() for the reply),
    elsewhere a line at most once a second. The rate leaves out the time the earlier lines took
    to write (0.25 s each here), and start() begins afresh."""
    clock = Clock()
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    stream = slow_writes(Terminal() if terminal else io.StringIO(), clock, 0.25)
    monkeypatch.setattr(sys, "stderr", stream)
    assert cli.Prefill.PROGRESS_AFTER == 2
    prefill = cli.Prefill()
    prefill.start()
    for now, done in [(1.5, 1024), (2.5, 2048), (3.25, 3072), (3.5, 4096)]:
        clock.now = now
        prefill.show(done, 8192)
    prefill.finish()
    # Seconds of prefill at each call: 1.5; 2.5; 3.25 - 0.25 written = 3.0; then, on a terminal,
    # 3.5 - 0.5 = 3.0, elsewhere 3.5 - 0.25 = 3.25 (the call at 3.25 s, 0.75 s after the last
    # line, wrote none).
    if terminal:
        assert stream.getvalue() == ("\r\x1b[Kprefill: 2048/8192 tokens, 819 tok/s"  # each redrawn
                                     "\r\x1b[Kprefill: 3072/8192 tokens, 1024 tok/s"  # from a clear
                                     "\r\x1b[Kprefill: 4096/8192 tokens, 1365 tok/s\r\x1b[K")
    else:
        lines = stream.getvalue().split("\n")
        assert lines == ["prefill: 2048/8192 tokens, 819 tok/s",  # no terminal codes in a log
                         "prefill: 4096/8192 tokens, 1260 tok/s", ""], lines
    assert prefill.spent == pytest.approx(0.75 if terminal else 0.5)
    stream.seek(0)
    stream.truncate()
    prefill.start()  # the next prefill: its own 2 seconds, nothing to clear on a terminal
    clock.now += 1.9
    prefill.show(1024, 2000)
    prefill.finish()
    assert stream.getvalue() == "" and prefill.spent == 0


def test_a_long_prefill_shows_its_progress_on_stderr_only(tiny_model, reference, monkeypatch,
                                                          capsys):
    """main() passes cli.PREFILL.show to generate_long: once a prefill has taken PROGRESS_AFTER
    seconds (patched to 0 here), its progress goes to stderr, and stdout is the same. With the
    default 2 seconds, a prefill as short as this one prints no progress line."""
    pieces_of(monkeypatch, 4)
    n_prompt = len(reference.ids(LONG_PROMPT))  # 19: pieces of 4 tokens up to 16, then 3
    args = ["--model", str(tiny_model), "--prompt", LONG_PROMPT, "--max-tokens", "8"]
    assert li.main(args) == 0
    plain = capsys.readouterr()
    assert "prefill" not in plain.err, plain.err
    monkeypatch.setattr(cli.Prefill, "PROGRESS_AFTER", 0)
    assert li.main(args) == 0
    shown = capsys.readouterr()
    assert shown.out == plain.out and plain.out.strip()
    lines = shown.err.split("\n")
    progress = [PROGRESS.fullmatch(line) for line in lines if "prefill" in line]
    assert progress and all(progress), shown.err
    assert progress[0].group(1, 2) == ("4", str(n_prompt))  # the first piece's, then 1 a second
    done = [int(m[1]) for m in progress]
    assert done == sorted(set(done)) and all(d % 4 == 0 and d < n_prompt for d in done)
    assert all(int(m[2]) == n_prompt and int(m[3]) > 0 for m in progress)
    # Before the statistics line, and otherwise the same lines on stderr.
    rest = [line for line in lines if "prefill" not in line]
    scrub = lambda lines: [re.sub(r"[\d.]+ (tok/s|s|GB)\b", r"# \1", line) for line in lines]
    assert scrub(rest) == scrub(plain.err.split("\n"))
    statistics = next(i for i, line in enumerate(lines) if RATES.search(line))
    assert all(i < statistics for i, line in enumerate(lines) if "prefill" in line)


def timed_stream(monkeypatch):
    """Records what cli.stream returns, (interrupted, prefill seconds, decode seconds), and the
    seconds the call took in all."""
    seen, stream = {}, cli.stream

    def timed(*args, **kwargs):
        start = time.perf_counter()
        seen["result"] = stream(*args, **kwargs)
        seen["wall"] = time.perf_counter() - start
        return seen["result"]

    monkeypatch.setattr(cli, "stream", timed)
    return seen


def check_rates(err, seen, untimed):
    """The statistics line shows stream()'s seconds, and those leave out `untimed` seconds (slept
    while printing): together they fit in the call's time less those."""
    stats = RATES.search(err.splitlines()[-1])
    assert stats, err
    interrupted, prefill_s, decode_s = seen["result"]
    n_prompt, n = int(stats[1]), int(stats[3])
    assert not interrupted and n > 1
    assert stats[2] == f"{n_prompt / prefill_s:.1f}" and stats[4] == f"{(n - 1) / decode_s:.1f}"
    assert stats[5] == f"{prefill_s + decode_s:.2f}"
    assert 0 < prefill_s and 0 < decode_s and prefill_s + decode_s <= seen["wall"] - untimed, \
        (prefill_s, decode_s, seen["wall"])


def slow_progress_terminal(monkeypatch):
    """stderr as a terminal where each progress line takes 0.5 s to write, with a progress line
    for every 4-token piece of a prefill; returns the terminal."""
    pieces_of(monkeypatch, 4)
    monkeypatch.setattr(cli.Prefill, "PROGRESS_AFTER", 0)
    terminal = Terminal()
    write = terminal.write
    terminal.write = lambda text: (time.sleep(0.5) if "prefill:" in text else None, write(text))[1]
    monkeypatch.setattr(sys, "stderr", terminal)
    return terminal


def progress_lines(err):
    """The PROGRESS matches of a terminal's progress lines, each redrawn after a clear."""
    return [PROGRESS.fullmatch(part) for part in err.split("\r\x1b[K") if part.startswith("prefill")]


def test_the_prefill_rate_leaves_out_the_time_progress_takes(tiny_model, monkeypatch, capsys):
    """Each progress line takes 0.5 s to write here (a terminal: every piece writes one): the
    statistics' prefill rate, and the later progress lines' rates, are those of the computation
    alone."""
    terminal = slow_progress_terminal(monkeypatch)
    seen = timed_stream(monkeypatch)
    assert li.main(["--model", str(tiny_model), "--prompt", LONG_PROMPT, "--max-tokens", "4"]) == 0
    err = terminal.getvalue()
    progress = progress_lines(err)
    assert len(progress) >= 3 and all(progress), err  # one per piece
    check_rates(err, seen, 0.5 * len(progress))
    prefill_s = seen["result"][1]
    for m in progress[1:]:  # not slowed by the lines before: at least done / the whole prefill
        assert int(m[3]) >= int(m[1]) / prefill_s - 1, (m[0], prefill_s)


def test_a_chat_shows_prefill_progress_and_its_rate_leaves_it_out(tiny_model, monkeypatch):
    """chat_loop passes cli.PREFILL.show to each reply: progress on stderr (a terminal here, each
    line taking 0.5 s to write), and the turn's prefill rate without that time."""
    terminal = slow_progress_terminal(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Name a city in France.\n")))
    seen = timed_stream(monkeypatch)
    assert li.main(["--model", str(tiny_model), "--chat", "--max-tokens", "4", "--seed", "1"]) == 0
    err = terminal.getvalue()
    progress = progress_lines(err)
    assert len(progress) >= 3 and all(progress), err
    turn = re.search(r"Turn 1: 0 tokens reused from the cache, (\d+) prefilled at ([\d.]+) tok/s",
                     err)
    assert turn and int(turn[1]) == int(progress[0][2]), err
    _, prefill_s, decode_s = seen["result"]
    assert turn[2] == f"{int(turn[1]) / prefill_s:.1f}"
    assert prefill_s + decode_s <= seen["wall"] - 0.5 * len(progress), (prefill_s, seen["wall"])


def test_the_decode_rate_leaves_out_the_top_probs_table(tiny_model, monkeypatch, capsys):
    """--top-probs prints its table after the first token: the second it takes here is no part of
    the decode rate (nor of the prefill's)."""
    print_top_probs = cli.print_top_probs
    monkeypatch.setattr(cli, "print_top_probs",
                        lambda *args, **kwargs: (time.sleep(1), print_top_probs(*args, **kwargs)))
    seen = timed_stream(monkeypatch)
    assert li.main(["--model", str(tiny_model), "--max-tokens", "6", "--top-probs", "3"]) == 0
    err = capsys.readouterr().err
    assert "rank  token" in err
    check_rates(err, seen, 1.0)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def transformers_sampling(logits, temperature, top_k, top_p, min_p):
    """The distribution transformers' generate() draws from, written with numpy: its warpers in
    its order (temperature, top-k, top-p, min-p), each as transformers writes it."""
    scores = logits.astype(np.float64) / temperature
    if top_k > 0:  # TopKLogitsWarper: below the k-th largest score goes
        kth = np.sort(scores)[-min(top_k, scores.size)]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1:  # TopPLogitsWarper: ascending, the tokens whose cumulative mass <= 1 - top_p go
        order = np.argsort(scores, kind="stable")
        cumulative = np.cumsum(softmax(scores[order]))
        remove = cumulative <= 1 - top_p
        remove[-1] = False  # min_tokens_to_keep=1
        scores[order[remove]] = -np.inf
    if min_p > 0:  # MinPLogitsWarper: below min_p times the top probability goes
        probs = softmax(scores)
        scores = np.where(probs < min_p * probs.max(), -np.inf, scores)
    return softmax(scores)


SAMPLED_CASES = {  # name: (flags, (temperature, top-k, top-p, min-p); None: generation_config's)
    "top-k 2": (["--temperature", "0.7", "--top-k", "2", "--top-p", "1"], (0.7, 2, 1.0, 0.0)),
    "top-k 2, the file's top-p": (["--temperature", "0.7", "--top-k", "2"], (0.7, 2, None, 0.0)),
    "min-p": (["--temperature", "2", "--top-k", "0", "--top-p", "1", "--min-p", "0.1"],
              (2.0, 0, 1.0, 0.1)),
    "all four": (["--temperature", "5", "--top-k", "8", "--top-p", "0.8", "--min-p", "0.42"],
                 (5.0, 8, 0.8, 0.42)),
}


@pytest.mark.parametrize("case", [*SAMPLED_CASES, "greedy"])
def test_the_top_probs_table_shows_the_distribution_the_first_token_is_drawn_from(
        tiny_model, monkeypatch, capsys, case):
    """When sampling, a `sampled` column: the probabilities after the temperature, top-k, top-p
    and min-p, as transformers computes them from the same logits (0 for a token that cannot be
    drawn), and the first token is one of those that can. Greedy: no such column."""
    flags, settings = SAMPLED_CASES.get(case, ([], None))
    seen, print_top_probs = [], cli.print_top_probs

    def record(logits, *args, **kwargs):
        seen.append(np.array(logits.astype(mx.float32)))
        return print_top_probs(logits, *args, **kwargs)

    monkeypatch.setattr(cli, "print_top_probs", record)
    generate_long, first = li.generate_long, []
    monkeypatch.setattr(li, "generate_long", lambda *args, **kwargs: (
        first.append(token_id) or (token_id, logits) for token_id, logits in
        generate_long(*args, **kwargs)))
    n_rows = 10
    assert li.main(["--model", str(tiny_model), "--max-tokens", "1", "--seed", "5",
                    "--top-probs", str(n_rows), *flags]) == 0
    lines = stderr_lines(capsys.readouterr().err)
    header = "rank  token                   id  probability"
    if settings is None:
        assert header in lines and not any("sampled" in line for line in lines), lines
        return
    assert f"{header}  sampled" in lines, lines
    rows = lines[lines.index(f"{header}  sampled") + 1:][:n_rows]
    parsed = [re.fullmatch(r"\s*(\d+)  (.+?)\s+(\d+)  (\d\.\d{4})  +(\d\.\d{4})", row)
              for row in rows]
    assert all(parsed), rows
    temperature, top_k, top_p, min_p = settings
    if top_p is None:
        top_p = json.loads((tiny_model / "generation_config.json").read_text())["top_p"]
    (logits,) = seen
    expected = transformers_sampling(logits, temperature, top_k, top_p, min_p)
    probs = softmax(logits.astype(np.float64))
    ids = [int(m[3]) for m in parsed]
    assert ids == list(np.argsort(-probs, kind="stable")[:n_rows])
    for m, token_id in zip(parsed, ids):
        assert float(m[4]) == pytest.approx(probs[token_id], abs=1e-4), m[0]
        assert float(m[5]) == pytest.approx(expected[token_id], abs=1e-4), m[0]
        if expected[token_id] == 0:
            assert m[5] == "0.0000", m[0]
    cut = [bool(expected[i] == 0) for i in ids]
    assert any(cut) and not cut[0], cut  # the case cuts some rows, keeps the likeliest
    if top_k == 2:  # the third row cannot be drawn; the second can unless top-p cuts it
        assert parsed[2][5] == "0.0000" and cut[1] is (top_p < 1), rows
    assert expected[first[0]] > 0  # the token drawn could be


def expected_piece(tokenizer, token_id):
    """How a token should show, decoded independently of cli.py: its vocabulary entry's bytes
    (GPT-2's byte alphabet, tests/checkpoint.py's), whole characters in quotes as Python writes
    them, bytes that are no whole character as <0xNN>."""
    to_byte = {char: byte for byte, char in byte_to_unicode().items()}
    data = bytes(to_byte[char] for char in tokenizer.id_to_token(token_id))
    shown, text, i = "", "", 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                char = data[i:i + n].decode("utf-8")
                break
            except UnicodeDecodeError:
                char = None
        if char is None:
            shown += (repr(text) if text else "") + f"<0x{data[i]:02X}>"
            text, i = "", i + 1
        else:
            text, i = text + char, i + n
    return shown + (repr(text) if text or not shown else "")


def test_piece_shows_bytes_that_are_no_whole_character(reference):
    """Byte-level BPE has a token for each of the 256 bytes: the 128 ASCII ones are characters,
    shown as text in quotes; the others are pieces of characters, shown as <0xNN> (Qwen's id 239
    is the byte 0x91). A token of a space and such bytes shows both; whole characters, special
    tokens, CJK and emoji as text."""
    tokenizer = reference.tokenizer
    ids = [tokenizer.token_to_id(byte_to_unicode()[byte]) for byte in range(256)]
    assert None not in ids and len(set(ids)) == 256 and ids[0x91] == 239
    for byte, token_id in enumerate(ids):
        shown = cli.piece(tokenizer, token_id)
        assert shown == expected_piece(tokenizer, token_id), (byte, token_id, shown)
        assert shown == (repr(chr(byte)) if byte < 0x80 else f"<0x{byte:02X}>"), (byte, shown)
    assert cli.piece(tokenizer, 239) == "<0x91>"
    assert cli.piece(tokenizer, 636) == expected_piece(tokenizer, 636) == "' '<0xE2><0x80>"
    for token_id, text in [(12095, " Paris"), (107672, "领导人"), (145080, "🙂"),
                           (151645, "<|im_end|>"),
                           (tokenizer.token_to_id("'"), "'"), (tokenizer.token_to_id("Ċ"), "\n")]:
        assert cli.piece(tokenizer, token_id) == repr(text), token_id
        if token_id < 151643:  # not a special token
            assert expected_piece(tokenizer, token_id) == repr(text)


BYTES_PROMPT = "The 🦩 is ꙮ"  # 🦩 and ꙮ are split into byte tokens (one with a space)


def test_the_top_probs_table_and_the_trace_show_byte_tokens(reference, capsys):
    """In --top-probs' table and in all of --trace's token lines (the prompt's tokens, the lens
    after each block, the final pick and table), a byte that is no whole character is <0xNN>, not
    the � that decoding it alone gives."""
    tokenizer, config = reference.tokenizer, reference.config
    ids = [239, 12095, 125001, 636, 107672]  # <0x91> ' Paris' <0xEA><0x99> ' '<0xE2><0x80> 领导人
    logits = mx.full((config.vocab_size,), -100.0)
    logits[mx.array(ids)] = mx.array([5.0, 4.0, 3.0, 2.0, 1.0])
    cli.print_top_probs(logits, tokenizer, 5, file=sys.stdout)
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[1] for row in rows[:3]] == ["<0x91>", "'", "<0xEA><0x99>"]
    assert [re.fullmatch(r"\s*\d+  (.+?)\s+\d+  \d\.\d{4}", row)[1] for row in rows] == \
        [expected_piece(tokenizer, i) for i in ids]
    assert "\ufffd" not in "".join(rows)
    # The trace, its final logits made to pick the byte 0x91.
    prompt = reference.ids(BYTES_PROMPT)
    pieces = [expected_piece(tokenizer, i) for i in prompt]
    assert any(p.startswith("<0x") for p in pieces) and any("'<0x" in p for p in pieces), pieces
    li.trace(prompt, reference.weights, config, tokenizer, final=logits)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "        " + " ".join(pieces), lines[1]
    after = next(line for line in lines if line.startswith("after each block: "))
    assert "the rank there of <0x91>, the final pick" in after, after
    blocks = [line for line in lines if re.match(r"block +\d+ done: ", line)]
    assert len(blocks) == config.num_hidden_layers
    assert all(re.search(r", <0x91> #\d+$", line) for line in blocks), blocks
    assert lines[-5].split()[:2] == ["1", "<0x91>"] and lines[-6].startswith("rank  token")
    assert "\ufffd" not in "\n".join(lines)


@pytest.mark.parametrize("stdin", [b"", b"\n", b" \r\n"], ids=["empty", "newline", "blank line"])
def test_an_empty_prompt_on_stdin_says_to_pipe_some_text_in(tiny_model, monkeypatch, stdin):
    """--prompt - with nothing on stdin: the fix is to pipe text in, not --prompt's text (which
    it says for an empty --prompt)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    with pytest.raises(cli.UserError) as error:
        li.main(["--model", str(tiny_model), "--prompt", "-"])
    assert str(error.value) == "the prompt is empty; pipe some text in"
    with pytest.raises(cli.UserError) as error:
        li.main(["--model", str(tiny_model), "--prompt", stdin.decode()])
    assert str(error.value) == "the prompt is empty; pass some text with --prompt"


@pytest.mark.parametrize("flags", [[], ["--temperature", "0.7", "--top-k", "2", "--min-p", "0.1",
                                        "--seed", "3", "--presence-penalty", "1"]],
                         ids=["greedy", "sampling flags"])
def test_the_trace_header_has_no_sampling_settings(tiny_model, capsys, flags):
    """--trace draws no token: its Prompt: line names no sampling (not even greedy)."""
    assert li.main(["--model", str(tiny_model), "--trace", *flags]) == 0
    lines = stderr_lines(capsys.readouterr().err)
    assert [line for line in lines if line.startswith("Prompt: ")] == [
        f"Prompt: {PROMPT!r} (5 tokens)"], lines
