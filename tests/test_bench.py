"""bench.py's flags: a bad value is one line on stderr and exit code 2, as in the CLI, before any model
loads (each of these gave a traceback, or for --chat-turns 0 ran the other benchmark)."""

import subprocess
import sys

import pytest

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
