"""Section 20, tensor parallelism, in real processes: two (or three) CPU processes on this machine,
joined by MLX's ring backend over TCP loopback, as `mlx.launch -n 2 --backend ring` starts them.
Each process has its own memory and its own share of the model, so what works here works across
machines, only faster or slower.

A launch costs seconds (starting the Pythons, connecting them, reading the 11 MB tokenizer in
each), so one launch checks many things: DRIVER runs llm_inference.main() once per command line of
CASES in each process, as a user types them, and records what each process wrote to its stdout
and stderr; the same driver in one process alone gives the reference. The same two processes then
compare their forward pass with mlx-lm's own sharded Qwen3 (`model.shard()`), an independent
implementation, and their shares of the weights with the file's tensors.

The processes are started here as mlx.launch starts them (the environment variables MLX_RANK and
MLX_HOSTFILE; the same input to every process's stdin, never closed), so that each one's output,
exit code and time are seen on their own: mlx.launch merges the outputs, exits 0 whatever happened,
and terminates the other processes as soon as one fails, which would hide a hang. It also keeps the
CPU busy while they run (its threads poll the processes' stdin without waiting), which on this
2-core machine doubles the time of a launch. One chat goes through mlx.launch itself.

What the tests would catch: a process that keeps the whole model (the shares are checked against
the file, and block 0's shapes in --trace), a missing sum (the text and the logits), process 1
writing anything or reading stdin (its stdin here fails when read), a seed or prompt not shared, a
refused split or a failure that leaves a process waiting forever (every process must exit by
itself, in time).
"""

import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

import cli
import llm_inference as li
from tests.checkpoint import (TINY_CONFIG, TINY_MOE_CONFIG, write_checkpoint, load_model,
                              weight_bytes)
from tests.test_cli import LONG_PROMPT, SCRIPT, cli_env

PROMPT = "The capital of France is"
# Quantized, each process's columns of o_proj and down_proj must hold whole groups of 64: TINY's
# 4 heads x 16 cannot be split; 4 heads x 64 (and 256 feed-forward channels) can. Untied.
WIDE_CONFIG = TINY_CONFIG | {"hidden_size": 128, "head_dim": 64, "intermediate_size": 256,
                             "tie_word_embeddings": False}
CHAT_INPUT = "Hello there\nTell me more\n/reset\nHello there\n/exit\n"
CASES = {  # name: (command line, with {tiny} {wide} {stored} for the folders; process 0's stdin)
    "tied head": ("--model {tiny} --prompt '%s' --max-tokens 10 --top-probs 5" % PROMPT, ""),
    "untied head": ("--model {wide} --prompt 'Once upon a' --max-tokens 10", ""),
    "stored 4-bit": ("--model {stored} --prompt '%s' --max-tokens 10 --top-probs 5" % PROMPT, ""),
    "--quantize 4": ("--model {wide} --quantize 4 --prompt '%s' --max-tokens 10" % PROMPT, ""),
    "sampled": ("--model {tiny} --prompt '%s' --temperature 0.9 --seed 7 --max-tokens 10"
                % PROMPT, ""),
    "sampled, no seed": ("--model {tiny} --prompt '%s' --temperature 0.9 --max-tokens 10"
                         % PROMPT, ""),  # each process's own seed, unless process 0's is shared
    "trace": ("--model {tiny} --prompt '%s' --trace" % PROMPT, ""),
    "a long prompt": ("--model {tiny} --prompt '%s' --max-tokens 10" % LONG_PROMPT, ""),
    "chat": ("--model {tiny} --chat --seed 3 --max-tokens 8", CHAT_INPUT),
    "experts": ("--model {moe} --prompt '%s' --max-tokens 10 --top-probs 5" % PROMPT, ""),
}
RING_LOST = ("llm_inference.py: error: another process stopped ([ring] connection to a peer was "
             "lost); ending")

DRIVER = r'''
"""llm_inference.main() on each case of the JSON file argv[1], in this process (one of a group, or
alone); writes what each case printed to argv[2]/rank<r>.json. In a group, then compares the
sharded forward pass with mlx-lm's sharded model, and this process's share with the file's."""
import io, json, os, shlex, sys, tempfile
from pathlib import Path

spec = json.loads(Path(sys.argv[1]).read_text())
sys.path.insert(0, spec["root"])
import cli  # noqa: E402
import llm_inference as li  # noqa: E402
import mlx.core as mx  # noqa: E402
from tests.checkpoint import load_model  # noqa: E402

tokenizers, load_tokenizer = {}, li.load_tokenizer  # 2 s each: one per file and process


def load_tokenizer_once(folder):
    text = Path(folder, "tokenizer.json").read_bytes()  # the same in most folders
    if text not in tokenizers:
        tokenizers[text] = load_tokenizer(folder)
    return tokenizers[text]


li.load_tokenizer = load_tokenizer_once
generate_long, tokens = li.generate_long, []  # every path to a token goes through generate_long


def generate_and_record(*args, **kwargs):
    for token_id, logits in generate_long(*args, **kwargs):
        tokens.append(token_id)
        yield token_id, logits


li.generate_long = generate_and_record
if mx.distributed.init().rank() == 1:  # a clock 10,000 times slower: its own prefill pieces would
    import time, types  # be of one token (section 14), process 0's hold the whole prompt

    li.time = types.SimpleNamespace(perf_counter=lambda: 10**4 * time.perf_counter())
AS_LOADED = dict(vars(li))
group = mx.distributed.init()
rank, n = group.rank(), group.size()


def restore():  # what main() or load_model() replaced (li.replace), back to Part 1 as written
    for name, value in AS_LOADED.items():
        if vars(li).get(name) is not value:
            setattr(li, name, value)


class NoInput(io.RawIOBase):  # the others' stdin: process 0 reads for all
    def readable(self):
        return True

    def readinto(self, buffer):
        raise AssertionError(f"process {rank} read its stdin")


STREAMS = sys.__stdout__, sys.__stderr__  # join() replaces sys.__stderr__ in process k > 0


def captured(function, *args):
    """function(*args), and what it wrote to this process's stdout and stderr: the descriptors
    themselves, so that any writer is caught (a file object bound at import, MLX's C++)."""
    saved, files = [os.dup(1), os.dup(2)], [tempfile.TemporaryFile() for _ in range(2)]
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    for fd, file in zip((1, 2), files):
        os.dup2(file.fileno(), fd)
    try:
        result = function(*args)
    except cli.UserError as e:
        result = f"error: {e}"
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            stream.flush()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__ = STREAMS
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    texts = []
    for file in files:
        file.seek(0)
        texts.append(file.read().decode())
    return result, *texts


results = {"cases": {}}
for name, (line, stdin) in spec["cases"].items():
    restore()
    if rank or stdin is not None:  # None: the real stdin, as mlx.launch gives it to process 0
        source = NoInput() if rank else io.BytesIO(stdin.encode())
        sys.stdin = io.TextIOWrapper(io.BufferedReader(source))
    else:
        sys.stdin = sys.__stdin__
    tokens.clear()
    code, out, err = captured(li.main, shlex.split(line))
    results["cases"][name] = {"code": code, "out": out, "err": err, "tokens": list(tokens)}

if n > 1:
    import importlib.util, types
    import mlx.nn as nn

    # mlx_lm's __init__ imports transformers and torch (7 s); its Qwen3 model needs neither.
    found = importlib.util.find_spec("mlx_lm")
    package = types.ModuleType("mlx_lm")
    package.__path__ = list(found.submodule_search_locations)
    sys.modules["mlx_lm"] = package
    from mlx_lm.models import qwen3, qwen3_moe

    def mlx_lm_model(folder, stored):
        """What mlx_lm.utils.load_model does for a Qwen3 folder (affine quantization only)."""
        config = json.loads((folder / "config.json").read_text())
        kind = {"qwen3": qwen3, "qwen3_moe": qwen3_moe}[config["model_type"]]
        model = kind.Model(kind.ModelArgs.from_dict(config))
        weights = model.sanitize(dict(stored))
        if "quantization" in config:
            how = config["quantization"]
            nn.quantize(model, group_size=how["group_size"], bits=how["bits"],
                        class_predicate=lambda path, _: f"{path}.scales" in weights)
        model.load_weights(list(weights.items()))
        return model

    SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
             "o_proj": 1, "down_proj": 1}
    results["logits"], results["shares"] = {}, {}
    for folder in map(Path, spec["oracle"]):
        stored = {}
        for file in sorted(folder.glob("*.safetensors")):
            stored |= mx.load(str(file))
        model = mlx_lm_model(folder, stored)
        model.shard(group)
        model.set_dtype(mx.float32)  # scales, biases, norms; the packed integers stay uint32
        for how in ("Part 1", "as main() runs it"):
            restore()
            config, weights, tokenizer, _ = load_model(folder, mx.float32, group=group)
            if how != "Part 1":
                li.use_fused_kernels()
                li.compile_model()
            ids = mx.array(li.tokenize(tokenizer, spec["prompt"]))
            ours = li.forward(ids, weights, config, li.make_cache(config), last_only=False)
            theirs = model(ids[None])[0]
            results["logits"][f"{folder.name}, {how}"] = {
                "diff": mx.abs(ours - theirs).max().item(), "scale": mx.abs(theirs).max().item(),
                "shape": list(ours.shape)}
        shares = {}  # each split matrix of block 0: this process's rows or columns of the file's
        for short, axis in SPLIT.items():
            w = weights["layers"][0][short]
            held = w.packed if isinstance(w, li.Quantized) else w
            expert = f"model.layers.0.mlp.experts.{{}}.{short}.weight"  # section 21: stacked
            experts = [stored[expert.format(e)] for e in range(64) if expert.format(e) in stored]
            whole = mx.stack(experts) if experts else next(
                t for name, t in stored.items() if name.startswith("model.layers.0.")
                and name.endswith(f".{short}.weight"))
            part = mx.split(whole, n, axis=axis - 2)[rank]  # rows -2, columns -1: stacks too
            shares[short] = [list(held.shape), list(whole.shape),
                             held.shape == part.shape and mx.array_equal(held, part).item()]
        head = weights["lm_head"]
        shares["lm_head"] = [list((head.packed if isinstance(head, li.Quantized) else head).shape),
                             list(stored.get("lm_head.weight",
                                             stored["model.embed_tokens.weight"]).shape), None]
        results["shares"][folder.name] = shares

Path(sys.argv[2], f"rank{rank}.json").write_text(json.dumps(results))
'''


# ------------------------------------------------------------------------------------------------
# Starting processes as mlx.launch does
# ------------------------------------------------------------------------------------------------

def free_ports(n):
    """A first port p such that p ... p+n-1 are free now: the ring backend's process r listens on
    p + r (as mlx.launch --starting-port p gives it). Each launch gets its own, so that test runs
    side by side on this machine never meet."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        sockets = []
        try:
            for port in range(first, first + n):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class Process:
    """A process, with mlx.launch's environment for its rank in a group; its stdout and stderr
    read as they come (into .out, .err), its stdin left open, as mlx.launch leaves it."""

    def __init__(self, command, rank, env, cwd):  # rank None: not one of a group
        self.rank, self.out, self.err = rank, b"", b""
        rank = {} if rank is None else {"MLX_RANK": str(rank)}
        self.proc = subprocess.Popen(list(map(str, command)), cwd=cwd, env=env | rank,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.readers = [threading.Thread(target=self.read, args=(name,), daemon=True)
                        for name in ("out", "err")]
        self.ended = None  # time.monotonic() when its output ended: when it exited
        for reader in self.readers:
            reader.start()

    def read(self, name):
        stream = getattr(self.proc, f"std{name}")
        while data := stream.read1(65536):
            setattr(self, name, getattr(self, name) + data)
        self.ended = time.monotonic()  # the later of the two ends

    def wait(self, deadline):
        """The exit code; None if the process is still running at the deadline (then killed)."""
        try:
            code = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self.proc.wait()
        for reader in self.readers:
            reader.join()
        self.proc.stdin.close()
        return code

    def report(self):
        return (f"process {self.rank}, exit code {self.proc.returncode}:\n"
                f"stdout: {self.out.decode(errors='replace')[-2000:]}\n"
                f"stderr: {self.err.decode(errors='replace')[-4000:]}")


def start(commands, cwd):
    """One process per command (its rank is its place in the list), joined by the ring backend."""
    first = free_ports(len(commands))
    hostfile = Path(cwd) / f"hosts-{first}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(len(commands))]))
    env = cli_env(Path(cwd) / ".hf-home", MLX_HOSTFILE=str(hostfile))
    return [Process([sys.executable, *command], rank, env, cwd)
            for rank, command in enumerate(commands)]


def wait_all(processes, seconds):
    """Every process's exit code; fails, with what each printed, if any runs past `seconds`."""
    deadline = time.monotonic() + seconds
    codes = [p.wait(deadline) for p in processes]
    reports = "\n".join(p.report() for p in processes)
    assert None not in codes, f"still running after {seconds} s (killed):\n{reports}"
    return codes


def own_lines(err):
    """stderr's lines without the ring backend's own messages (from C++, about its sockets)."""
    return [line for line in err.decode().splitlines() if not line.startswith("[ring]")]


# ------------------------------------------------------------------------------------------------
# The models, and one launch for the cases
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tiny_model, checkpoints, tmp_path_factory):
    """tiny: GQA (4 query heads, 2 key/value heads), tied head. wide: untied, quantizable.
    stored: wide stored in 4 bits by mlx-lm's converter. moe: a mixture of experts (section 21),
    in tests/test_moe.py's folder."""
    from mlx_lm.utils import load_model, quantize_model, save_model, save_config

    wide = write_checkpoint(tmp_path_factory.mktemp("wide") / "wide", WIDE_CONFIG, seed=2)
    stored = wide.parent / "wide-4bit"
    # What mlx_lm.convert(quantize=True, q_bits=4, q_group_size=64) does: the same files, byte
    # for byte, but for the tokenizer, which convert spends 7 of its 9 s reading and rewriting
    # through transformers; the original's is copied instead.
    model, config = quantize_model(*load_model(wide, lazy=True), 64, 4)
    save_model(stored, model)
    save_config(config, config_path=stored / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(wide / name, stored)
    moe = checkpoints(TINY_MOE_CONFIG, seed=3, name="8-experts-top-2")
    return {"tiny": tiny_model, "wide": wide, "stored": stored, "moe": moe}


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """{"one": what one process alone printed per case, "two": [process 0's, process 1's], with
    the logit comparisons and the shares}. Both runs at once. The chat's messages reach both
    processes' stdin, left open, as mlx.launch passes them on; the other case with stdin, `--prompt
    -`, reads to the end of the input, which mlx.launch never gives: process 0 gets it directly."""
    tmp = tmp_path_factory.mktemp("driver")
    cases = {name: (f"{line.format(**folders)} --dtype float32", stdin)
             for name, (line, stdin) in CASES.items()}
    spec = {"root": str(SCRIPT.parent), "prompt": PROMPT, "cases": cases}
    (tmp / "one.json").write_text(json.dumps(spec))
    cases["chat"] = (cases["chat"][0], None)  # the real stdin
    (tmp / "two.json").write_text(json.dumps(spec | {"oracle": list(map(str, folders.values()))}))
    (tmp / "driver.py").write_text(DRIVER)
    for name in ("one", "two"):
        (tmp / name).mkdir()
    alone = Process([sys.executable, tmp / "driver.py", tmp / "one.json", tmp / "one"], None,
                    cli_env(tmp / ".hf-home"), tmp)
    group = start([[tmp / "driver.py", tmp / "two.json", tmp / "two"]] * 2, tmp)
    for p in group:
        p.proc.stdin.write(CHAT_INPUT.encode())
        p.proc.stdin.flush()
    assert wait_all([*group, alone], 300) == [0, 0, 0], "\n".join(p.report() for p in group)
    for p in (*group, alone):  # outside the cases: nothing
        assert p.out == p.err == b"", p.report()
    read = lambda path: json.loads(path.read_text())
    return {"one": read(tmp / "one" / "rank0.json")["cases"],
            "two": [read(tmp / "two" / f"rank{r}.json") for r in (0, 1)]}


def timings_removed(err):
    """stderr without what differs from run to run (rates, seconds, gigabytes)."""
    return re.sub(r"\d+(\.\d+)? (tok/s|s|GB)\b", r"# \2", err)


def as_one_process(err):
    """Process 0's stderr as one process alone prints it: the header says how many there are."""
    lines = err.splitlines(keepends=True)
    assert lines[0].startswith("Model: ") and " on cpu x 2 processes, " in lines[0], lines[0]
    return timings_removed(err.replace(" on cpu x 2 processes, ", " on cpu, ", 1))


# ------------------------------------------------------------------------------------------------
# Two processes print what one prints
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [name for name in CASES
                                  if name not in ("sampled, no seed", "trace", "chat")])
def test_two_processes_write_what_one_writes(runs, case):
    """Greedy text in float32 on a tied and an untied head, float, stored 4-bit and quantized at
    load; sampling with a seed; the header and the --top-probs table on stderr. A prompt long
    enough for prefill pieces, each process timing them on its own clock (process 1's far
    slower): both cut it alike (section 20 gives process 0's count to all)."""
    one, two = runs["one"][case], runs["two"][0]["cases"][case]
    assert one["code"] == two["code"] == 0, (one, two)
    assert len(set(one["out"].split())) > 3 or len(one["out"]) > 20, one["out"]  # not degenerate
    assert two["out"] == one["out"]
    assert as_one_process(two["err"]) == timings_removed(one["err"])
    if "--top-probs" in CASES[case][0]:
        assert len(re.findall(r"(?m)^ +[1-5]  .* 0\.\d{4}$", two["err"])) == 5, two["err"]


def test_chat_with_a_reset(runs):
    one, two = runs["one"]["chat"], runs["two"][0]["cases"]["chat"]
    assert one["code"] == two["code"] == 0, (one, two)
    assert two["out"] == one["out"] and len(one["out"].splitlines()) == 3, one["out"]
    assert as_one_process(two["err"]) == timings_removed(one["err"])
    assert "(conversation reset)" in two["err"]


def test_trace_shows_half_the_heads_and_the_same_lens(runs):
    """--trace: the lens after each block and the final table as one process prints them; block 0's
    queries, keys, values and attention hold half the heads (the rest are the other process's);
    what the sums give back (x + attention, the feed-forward) is whole."""
    one, two = runs["one"]["trace"]["out"], runs["two"][0]["cases"]["trace"]["out"]
    assert runs["two"][0]["cases"]["trace"]["code"] == 0
    halved = lambda line: re.sub(r"\(1, (\d+), ", lambda m: f"(1, {int(m[1]) // 2}, ", line)
    lines_one, lines_two = one.splitlines(), two.splitlines()
    assert len(lines_two) == len(lines_one), two
    split_steps = 0
    for a, b in zip(lines_one, lines_two):
        if re.match(r"  (queries_keys_values|attend) ", a):
            assert b == halved(a) != a  # e.g. (1, 4, 5, 16) -> (1, 2, 5, 16)
            split_steps += 1
        else:
            assert b == a
    assert split_steps == 2
    assert sum(line.startswith("block ") and " done: " in line for line in lines_two) == 2
    assert re.search(r"(?m)^ +5  .* 0\.\d{4}$", two)  # the final top-5 table


def test_process_1_prints_nothing_and_reads_no_input(runs):
    """Process 1 runs every case (its stdin fails if read: the driver would have failed) and
    prints nothing: its output would double process 0's under mlx.launch."""
    for case in CASES:
        written = {key: runs["two"][1]["cases"][case][key] for key in ("code", "out", "err")}
        assert written == {"code": 0, "out": "", "err": ""}, case


def test_both_processes_pick_the_same_tokens(runs):
    """Each process picks each token itself: they stay in step only if they pick the same, also
    when sampling with a seed of their own (process 0's is shared)."""
    for case in CASES:
        picked = [runs["two"][rank]["cases"][case]["tokens"] for rank in (0, 1)]
        assert picked[0] == picked[1] and (picked[0] or case == "trace"), case


def test_logits_match_mlx_lms_sharded_model(runs, folders):
    """Every position's logits within 1e-4 of mlx-lm's model.shard() in the same two processes, on
    each process, for Part 1 as written and with main()'s replacements (fused kernels, compiled
    silu_gate): float tied and untied, and stored 4-bit."""
    for rank, result in enumerate(runs["two"]):
        logits = result["logits"]
        assert len(logits) == 2 * len(folders)
        for name, r in logits.items():
            assert r["scale"] > 1 and r["diff"] < 1e-4, (rank, name, r)


def test_each_process_holds_its_own_share(runs, folders):
    """Block 0's split matrices on each process are exactly its rows (q, k, v, gate, up) or columns
    (o, down) of the file's tensors: half of each, a different half on each process; the LM head
    whole."""
    for folder in folders.values():
        for rank, result in enumerate(runs["two"]):
            shares = result["shares"][folder.name]
            for short, (held, whole, exact) in shares.items():
                if short == "lm_head":
                    assert held == whole, (folder.name, rank)
                    continue
                axis = -2 if short in li.SPLIT_ROWS else -1  # of a matrix, or of stacked experts
                assert held[axis] * 2 == whole[axis] and exact, (folder.name, rank, short)


# ------------------------------------------------------------------------------------------------
# mlx.launch itself
# ------------------------------------------------------------------------------------------------

def test_chat_through_mlx_launch(folders, runs, tmp_path):
    """The README's command line: mlx.launch copies the piped messages to both processes and
    never closes their stdin (the input ends with /exit); only process 0 writes."""
    line, _ = CASES["chat"]
    command = [Path(sys.executable).parent / "mlx.launch", "-n", 2, "--backend", "ring",
               "--starting-port", free_ports(2), sys.executable, SCRIPT,
               *line.format(**folders).split(), "--dtype", "float32"]
    launch = Process(command, None, cli_env(tmp_path / ".hf-home"), tmp_path)
    launch.proc.stdin.write(CHAT_INPUT.encode())
    launch.proc.stdin.flush()  # and left open: a pipe that ends would make mlx.launch spin
    assert wait_all([launch], 120) == [0]
    one, err = runs["one"]["chat"], launch.err.decode()
    assert launch.out.decode() == one["out"], launch.report()
    assert "[WARN]" not in err and "Traceback" not in err, err  # mlx.launch: a process failed
    assert as_one_process(err) == timings_removed(one["err"])


# ------------------------------------------------------------------------------------------------
# Failures: every process ends, by itself, in seconds, with one line that says why
# ------------------------------------------------------------------------------------------------

class Group:
    """What load_model asks of an mx.distributed group before splitting: its size and rank."""

    def __init__(self, size):
        self.n = size

    def size(self):
        return self.n

    def rank(self):
        return 0


def test_quantization_groups_are_never_cut(folders):
    """Quantized, each process's columns of o_proj and down_proj must hold whole groups: TINY's
    64 o_proj columns cannot give 2 processes 64 each; float, they can."""
    tiny, stored = folders["tiny"], folders["stored"]
    message = "cannot be split over {} processes (whole heads and quantization groups): use {}"
    with pytest.raises(cli.UserError) as refused:
        load_model(tiny, mx.float32, bits=4, group=Group(2))
    assert str(refused.value) == f"{tiny} {message.format(2, 1)}"
    with pytest.raises(cli.UserError) as refused:  # 2 key/value heads; groups of 64 allow 2
        load_model(stored, mx.float32, group=Group(4))
    assert str(refused.value) == f"{stored} {message.format(4, '1, 2')}"
    config = li.load_config(tiny)
    assert li.can_split(config, 2) and not li.can_split(config, 2, 64)
    assert li.can_split(li.load_config(stored), 2, 64) and not li.can_split(config, 3)


def test_quantize_on_a_stored_folder_keeps_the_stored_groups_whole(tiny_model):
    """Bug: --quantize on a folder stored quantized at those bits (check_config allows it) had
    the split checked for --quantize's groups of 64 only: stored groups of 128 were then cut."""
    config = li.load_config(tiny_model)._replace(head_dim=32)  # 4 x 32 o_proj columns: 64 each
    refused = "cannot be split over 2 processes"
    cli.check_split(tiny_model, config, 2, 4, {}, li.can_split)  # groups of 64: whole
    for bits in (None, 4):
        with pytest.raises(cli.SharedError, match=refused):
            cli.check_split(tiny_model, config, 2, bits, {"group_size": 128, "bits": 4},
                            li.can_split)


def halves(config):
    """config as each of 2 processes runs it, written out here (not split_config's)."""
    return config._replace(num_attention_heads=config.num_attention_heads // 2,
                           num_key_value_heads=config.num_key_value_heads // 2,
                           intermediate_size=config.intermediate_size // 2)


def test_each_process_checks_the_memory_of_its_own_share(tiny_model, monkeypatch):
    """Bug: split_config kept the whole intermediate_size, so each process's memory check (main's
    check_fit, on split_config's config) counted the whole feed-forward: a split model that fits
    was refused."""
    config = li.load_config(tiny_model)
    needed = weight_bytes(halves(config), mx.float32)  # this process's share, byte for byte
    monkeypatch.setattr(cli, "gpu_working_set", lambda: None)
    monkeypatch.setattr(cli, "memory_size", lambda: needed - 1)
    with pytest.raises(cli.UserError, match="the weights need"):
        load_model(tiny_model, mx.float32, group=Group(2))
    monkeypatch.setattr(cli, "memory_size", lambda: needed)
    shares, _, _, _ = load_model(tiny_model, mx.float32, group=Group(2))
    assert shares == halves(config)


def test_each_process_holds_only_its_share_once_loaded(checkpoints):
    """Bug: use_tensor_parallelism without mx.eval of each share: every whole matrix stayed held
    (the shares, not yet computed, refer to it) until the first forward pass, doubling what a
    process holds of the split matrices. Here they are 72% of the weights (the embedding table,
    151936 x 64, is not split)."""
    folder = checkpoints(TINY_CONFIG | {"intermediate_size": 32768, "num_hidden_layers": 4})
    config = li.load_config(folder)
    whole, share = weight_bytes(config, mx.float32), weight_bytes(halves(config), mx.float32)
    assert whole - share > 0.35 * whole
    gc.collect()
    before = mx.get_active_memory()
    _, weights, _, _ = load_model(folder, mx.float32, group=Group(2))
    gc.collect()
    held = mx.get_active_memory() - before
    assert abs(held - share) < 0.1 * (whole - share), (held, share, whole)
    del weights


REFUSALS = {  # name: (processes, flags, exit code, process 0's line after "llm_inference.py: ")
    "a split": (3, ["--max-tokens", 4], 1, "error: {tiny} cannot be split over 3 processes (whole "
                "heads and quantization groups): use 1, 2"),
    "a bad flag": (2, ["--max-tokens", 0], 2, "error: argument --max-tokens: must be an integer >= "
                   "1, got 0 (see --help)"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refusal_every_process_meets_is_said_once(folders, tmp_path, refusal):
    """A split that cannot be made (3 processes, 2 key/value heads) or a bad flag: every process
    exits by itself, without waiting for the others; process 0 says why in one line that names
    what works, the others say nothing (under mlx.launch, their lines would repeat it)."""
    n, flags, code, line = REFUSALS[refusal]
    processes = start([[SCRIPT, "--model", folders["tiny"], *flags]] * n, tmp_path)
    assert wait_all(processes, 60) == [code] * n, "\n".join(p.report() for p in processes)
    first, *others = processes
    assert first.err.decode() == f"llm_inference.py: {line.format(**folders)}\n", first.report()
    for p in processes:
        assert p.out == b"" and (p.err == b"" or p is first), p.report()


def test_a_folder_missing_on_one_process(folders, tmp_path):
    """The model folder exists for process 0 only (another machine without it): process 1 names
    the folder, process 0 says that another process stopped; both exit 1 within seconds."""
    missing = tmp_path / "not-copied-here"
    commands = [[SCRIPT, "--model", folder, "--max-tokens", 4]
                for folder in (folders["tiny"], missing)]
    processes = start(commands, tmp_path)
    assert wait_all(processes, 60) == [1, 1], "\n".join(p.report() for p in processes)
    first, second = processes
    assert second.err.decode().startswith(f"llm_inference.py: error (process 1): model folder "
                                          f"{missing} not found; "), second.report()
    assert len(second.err.decode().splitlines()) == 1 and second.out == b""
    assert own_lines(first.err) == [RING_LOST], first.report()
    assert abs(first.ended - second.ended) < 30  # process 0 noticed at its first sum


# The script, with both processes waiting, after the first layer of their first prefill piece
# (PROMPT's 5 tokens make one), until the file "go" exists in the working folder. Every step of a
# prefill is a synchronous mx.eval(), so nothing is pending then: not a sum half made, nor a step
# queued (in the decode loop, a step is queued before each token is shown).
PAUSED_IN_PREFILL = """import os, sys, time
sys.path.insert(0, {root!r})
import cli  # noqa: E402 (first, as llm_inference.py imports it)
import llm_inference as li  # noqa: E402

show = cli.PREFILL.show


def show_then_wait(done, total):
    open(f"paused-{{li.mx.distributed.init().rank()}}", "w").close()
    while not os.path.exists("go"):
        time.sleep(0.01)
    cli.PREFILL.show = show
    show(done, total)


cli.PREFILL.show = show_then_wait
cli.run(li.main)
"""


@pytest.mark.parametrize("killed", [1, 0])
def test_a_process_killed_mid_prefill_ends_the_other(folders, tmp_path, killed):
    """SIGKILL to one process while both wait between two layers of a prefill: the other, let go,
    fails its next sum and exits 1 by itself, with one line of ours after MLX's own (process 0)
    or nothing (process 1), and no traceback.

    The kill lands where no step is pending. Killed while the reply streamed (a race with a
    5,000-token reply, as this test was until issue 32), the other could hang inside MLX on a
    busy machine: the ring backend failed a sum of a queued step while the next was being
    queued, and mx.async_eval() waited forever (MLX's eval_impl synchronizes the open streams when
    a primitive throws). No Python code runs then: the script cannot end itself, and mlx.launch
    ends it when the other process dies."""
    script = tmp_path / "paused.py"
    script.write_text(PAUSED_IN_PREFILL.format(root=str(SCRIPT.parent)))
    long_prompt = " ".join([PROMPT] * 10)  # over SHORT_PROMPT tokens: prefilled in pieces
    command = [script, "--model", folders["tiny"], "--prompt", long_prompt, "--max-tokens", 4]
    processes = start([command] * 2, tmp_path)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"paused-{r}").exists() for r in (0, 1)) and \
            all(p.proc.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(p.proc.poll() is None for p in processes), "\n".join(p.report() for p in processes)
    os.kill(processes[killed].proc.pid, signal.SIGKILL)
    processes[killed].proc.wait()
    (tmp_path / "go").touch()
    survivor = processes[1 - killed]
    assert wait_all(processes, 60)[1 - killed] == 1, survivor.report()
    assert "Traceback" not in survivor.err.decode(), survivor.report()
    if survivor.rank == 0:
        assert own_lines(survivor.err)[-1] == RING_LOST, survivor.report()
        assert sum(line.startswith("llm_inference.py") for line in own_lines(survivor.err)) == 1
    else:  # nothing at all: MLX's own lines about the lost peer go nowhere too
        assert survivor.err == survivor.out == b"", survivor.report()


# ------------------------------------------------------------------------------------------------
# Ctrl-C under mlx.launch, on a terminal
# ------------------------------------------------------------------------------------------------

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import pty  # noqa: E402
import termios  # noqa: E402


def ctrl_c_under_mlx_launch(script, model, cwd, seconds=60, after=20):
    """`mlx.launch -n 2 --backend ring -- python script --model model --max-tokens 20000` on a
    terminal of its own (a pseudo-terminal, which it has as controlling terminal, as a shell
    gives it), then Ctrl-C once the reply streams: SIGINT to its process group, as the terminal
    sends it. Returns what the terminal received, as text (newlines as the terminal writes them,
    \\r\\n), up to when every process on it ended: by itself, or killed `seconds` after the start
    or `after` seconds after the Ctrl-C (MLX's hang, told at
    test_a_process_killed_mid_prefill_ends_the_other, which mlx.launch, its output loop ended by
    the Ctrl-C, would wait for without end)."""
    master, slave = pty.openpty()

    def own_terminal():  # in the child: a new session, the pty its controlling terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a shell starts it (not SIG_IGN)

    command = [Path(sys.executable).parent / "mlx.launch", "-n", 2, "--backend", "ring",
               "--starting-port", free_ports(2), "--", sys.executable, script, "--model", model,
               "--max-tokens", 20000]
    launch = subprocess.Popen(list(map(str, command)), cwd=cwd, stdin=slave, stdout=slave,
                              stderr=slave, env=cli_env(Path(cwd) / ".hf-home"),
                              start_new_session=True, preexec_fn=own_terminal)
    os.close(slave)
    received = bytearray()

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process on the terminal closed it
                return
            if not data:
                return
            received.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    text = lambda: received.decode("utf-8", errors="replace")
    deadline = time.monotonic() + seconds
    try:
        header = f"Prompt: '{PROMPT}' (5 tokens), greedy\r\n"
        while (header not in text() or len(text().split(header, 1)[1]) < 20) and \
                launch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the reply is under way
        assert launch.poll() is None and header in text(), f"no reply streaming:\n{text()}"
        os.killpg(launch.pid, signal.SIGINT)  # Ctrl-C: to every process of the foreground group
        deadline = min(deadline, time.monotonic() + after)
        while reader.is_alive() and time.monotonic() < deadline:
            reader.join(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)  # what is left of it (a hung process 1)
        launch.wait()
        reader.join(10)
        os.close(master)
    return text()


def test_ctrl_c_under_mlx_launch_keeps_the_statistics_line(tiny_model, tmp_path):
    """mlx.launch stops passing the processes' output on once it gets Ctrl-C, and Ctrl-C reaches
    every process of the group: process 0 stops, finishes the step the others share and writes
    its statistics line to the terminal itself (/dev/tty); the others ignore it, and end when
    process 0 has exited. The line reaches the terminal, and process 0 exits 130 (mlx.launch says
    so). 40960 positions: room for far more tokens than stream before the Ctrl-C."""
    assert li.load_config(tiny_model).max_position_embeddings >= 20005
    started = time.monotonic()
    received = ctrl_c_under_mlx_launch(SCRIPT, tiny_model, tmp_path)
    lines = received.split("\r\n")
    stats = [line for line in lines if "Interrupted. Prompt: 5 tokens" in line]
    assert len(stats) == 1, received
    # The reply's text, cut off by the Ctrl-C, may precede it on its line.
    assert re.search(r"Interrupted\. Prompt: 5 tokens(, [\d.]+ tok/s)? \| Generated: \d+ tokens?"
                     r"(, [\d.]+ tok/s)? \| Prefill \+ decode: [\d.]+ s \| Peak memory: "
                     r"[\d.]+ GB$", stats[0]), stats[0]
    assert re.search(r"\[WARN\] Node with rank 0 exited with code 130\b", received), received
    assert "Node with rank 1 exited with code 130" not in received, received  # it ignored Ctrl-C
    assert time.monotonic() - started < 60
