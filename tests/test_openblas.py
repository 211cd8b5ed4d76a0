"""OpenBLAS on Linux CPUs: llm_inference.py loads it before MLX when it is installed (its first lines),
the command line hints at installing it when it is missing, `--dtype auto` stays float32 on the CPU,
and the text and logits agree with and without it.

The facts of the machine come from elsewhere: whether MLX is the Linux CPU wheel from the installed
package metadata, whether OpenBLAS is installed from the linker cache (ctypes.util.find_library), and
whether it was loaded from the process's memory map. LLM_INFERENCE_BLAS=0 stands in for a machine
without it, so each test checks both cases on a machine that has it, and the bare case on one that
does not.
"""

import ctypes.util
import importlib.metadata
import json
import subprocess
import sys

import numpy as np
import pytest

import cli
import llm_inference as li
from tests.test_cli import PROMPT, SCRIPT, cli_env, parse_success, run_cli

CPU_WHEEL = any(importlib.metadata.distributions(name="mlx-cpu"))  # MLX's Linux CPU-only build
INSTALLED = CPU_WHEEL and ctypes.util.find_library("openblas") is not None
SWITCHES = {"default": None, "off": "0"}  # LLM_INFERENCE_BLAS
# The libraries a process has mapped (Linux); macOS has no /proc, and nothing to load there.
MAPS = "(open('/proc/self/maps') if sys.platform == 'linux' else [])"


def in_subprocess(code, tmp_path, blas, *args, first=""):
    """Run `first`, `import llm_inference`, then `code` in a fresh Python; returns its stdout as JSON."""
    program = (f"import json, sys\n{first}\nsys.path.insert(0, {str(SCRIPT.parent)!r})\n"
               f"import llm_inference as li\nimport cli\n{code}")
    proc = subprocess.run([sys.executable, "-c", program, *args], cwd=tmp_path, capture_output=True, timeout=120,
                          env=cli_env(tmp_path / ".hf-home", LLM_INFERENCE_BLAS=SWITCHES[blas]))
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


@pytest.mark.parametrize("blas", SWITCHES)
def test_openblas_is_loaded_exactly_when_installed_and_not_switched_off(tmp_path, blas):
    maps = f"[line.split()[-1] for line in {MAPS} if 'openblas' in line]"
    state = in_subprocess(f"print(json.dumps(dict(flag=cli.OPENBLAS, cpu_wheel=cli.MLX_CPU_WHEEL, "
                          f"mapped={maps}, auto=str(cli.pick_dtype('auto')))))", tmp_path, blas)
    expected = INSTALLED and blas == "default"
    assert state["cpu_wheel"] == CPU_WHEEL
    assert state["flag"] == expected
    assert bool(state["mapped"]) == expected, state["mapped"]
    # On the CPU float32 is the faster dtype with either BLAS (docs/platforms.md): auto does not change.
    assert state["auto"] == ("mlx.core.float32" if CPU_WHEEL else "mlx.core.bfloat16")


def test_loading_after_mlx_does_not_count(tmp_path):
    # Once MLX is loaded, its products are bound to the bundled BLAS: the flag must not claim OpenBLAS.
    code = f"print(json.dumps([cli.OPENBLAS, [line for line in {MAPS} if 'openblas' in line]]))"
    assert in_subprocess(code, tmp_path, "default", first="import mlx.core") == [False, []]


@pytest.mark.parametrize("blas", SWITCHES)
def test_hint_and_auto_dtype_on_the_command_line(tiny_model, tmp_path, blas):
    rc, out, err = run_cli("--model", tiny_model, "--max-tokens", 2, cwd=tmp_path,
                           LLM_INFERENCE_BLAS=SWITCHES[blas])
    parse_success((rc, out, err))
    lines = err.splitlines()
    used = INSTALLED and blas == "default"
    device, dtype = ("cpu", "float32") if CPU_WHEEL else ("gpu", "bfloat16")  # either BLAS
    assert lines[0].startswith("Model: tiny-qwen3 "), lines[0]
    assert lines[0].endswith(f" on {device}, {dtype}, from {tiny_model}"), lines[0]
    hints = [line for line in lines if "OpenBLAS" in line]
    if CPU_WHEEL and not used:  # once, right under the model line, naming the install command
        assert hints == [lines[1]] == [cli.OPENBLAS_HINT]
        assert "sudo apt-get install libopenblas0-pthread" in lines[1]
    else:
        assert hints == []
    assert lines[1 + len(hints)].startswith("Prompt: 'The capital")


def test_same_text_and_logits_with_and_without_openblas(tiny_model, tmp_path):
    # float32 both times, so only the BLAS differs: logits within float32 rounding, greedy text identical.
    code = (f"import mlx.core as mx\nfolder = {str(tiny_model)!r}\nconfig = li.load_config(folder)\n"
            "weights = li.load_weights(folder, config, mx.float32)\n"
            "ids = mx.array(li.tokenize(li.load_tokenizer(folder), " + repr(PROMPT * 8) + "))\n"
            "logits = li.forward(ids, weights, config, li.make_cache(config), last_only=False)\n"
            "mx.save(sys.argv[-1], logits)\nprint(json.dumps(cli.OPENBLAS))")
    assert [in_subprocess(code, tmp_path, blas, f"{blas}.npy") for blas in SWITCHES] == [INSTALLED, False]
    on, off = (np.load(tmp_path / f"{blas}.npy") for blas in SWITCHES)  # (40, 151936)
    assert on.shape == off.shape and on.shape[0] > 1
    np.testing.assert_allclose(on, off, atol=1e-4 * np.abs(off).max(), rtol=0)

    texts = {blas: parse_success(run_cli("--model", tiny_model, "--max-tokens", 24, "--dtype", "float32",
                                         cwd=tmp_path, LLM_INFERENCE_BLAS=SWITCHES[blas]))[0]
             for blas in SWITCHES}
    assert texts["default"] == texts["off"]


def test_a_library_that_fails_to_load_is_no_error(tmp_path):
    # What a machine without OpenBLAS sees, on any machine: opening it raises OSError.
    first = "import ctypes\ndef absent(*args, **kwargs): raise OSError('not found')\nctypes.CDLL = absent"
    code = "import mlx.core as mx\nprint(json.dumps([cli.OPENBLAS, (mx.ones((2, 3)) @ mx.ones((3, 2))).tolist()]))"
    assert in_subprocess(code, tmp_path, "default", first=first) == [False, [[3.0, 3.0], [3.0, 3.0]]]
