"""bench.py's flags: a bad value is one line on stderr and exit code 2, as in the CLI, before any model
loads (each of these gave a traceback, or for --chat-turns 0 ran the other benchmark). And its count of
the primitives in one decode step, ours against mlx-lm's."""

import subprocess
import sys

import mlx.core as mx
import pytest

import bench
import llm_inference as li
from tests.test_cli import SCRIPT, cli_env

BENCH = SCRIPT.parent / "bench.py"

BAD_VALUES = [
    (["--reps", "0"], "argument --reps: must be in [1, inf), got 0"),
    (["--decode-tokens", "0"], "argument --decode-tokens: must be in [1, inf), got 0"),
    (["--prompt-lengths", "-3"], "argument --prompt-lengths: must be in [1, inf), got -3"),
    (["--prompt-lengths", "128", "x"], "argument --prompt-lengths: expected an integer, got 'x'"),
    (["--cache-lengths", "0"], "argument --cache-lengths: must be in [1, inf), got 0"),
    (["--chat-turns", "0"], "argument --chat-turns: must be in [1, inf), got 0"),
    (["--model", ""], "argument --model: is empty"),
]


@pytest.mark.parametrize("flags, message", BAD_VALUES, ids=[" ".join(flags) for flags, _ in BAD_VALUES])
def test_bad_value_is_one_line(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(BENCH), *flags], cwd=tmp_path, capture_output=True, text=True,
                          env=cli_env(tmp_path / ".hf-home"), timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"bench.py: error: {message}"), proc.stderr


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (mx.bfloat16, None), (mx.float32, 8),
                                         (mx.float32, 4)], ids=["float32", "bfloat16", "8-bit", "4-bit"])
def test_a_decode_step_has_fewer_primitives_than_mlx_lms(tiny_model, dtype, bits, monkeypatch):
    """bench.py --primitives: the same matrix products in both runtimes, and fewer operations in all
    in ours (compiled, as the command line runs it)."""
    monkeypatch.setattr(li, "silu_gate", li.silu_gate)  # put back afterwards
    li.compile_model()
    config, weights, model = bench.load_pair(tiny_model, dtype, bits)
    counts = bench.primitives_per_step(weights, config, model)
    ours, theirs = counts["ours"], counts["mlx-lm"]
    product = "QuantizedMatmul" if bits else "Matmul"
    # 7 per layer and the LM head (on the CPU, attention's two products are Matmuls too).
    assert ours[product] == theirs[product] >= 7 * config.num_hidden_layers + 1
    assert ours["ArgReduce"] == theirs["ArgReduce"] == 1  # one greedy pick each
    assert 0 < sum(ours.values()) < sum(theirs.values()), (ours, theirs)
