"""`--chat` end to end: a conversation over piped stdin, as a real subprocess.

Each reply is compared with what Qwen3's official chat template (rendered by transformers) plus greedy
decoding from scratch gives, turn by turn; earlier replies enter the rendering as the ids the model
generated. The tiny random model never writes <think>, so the thinking display is checked on
ReplyPrinter directly, with the terminal simulated.
"""

import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import mlx.core as mx
import pytest

import cli
import llm_inference as li
from tests.checkpoint import TINY_CONFIG
from tests.test_model import pieces_of
from tests.test_cli import (  # noqa: F401 (fixtures)
    ERROR_PREFIX,
    PAUSED_LINE,
    Reference,
    assert_one_line_error,
    cli_env,
    converted_4bit,
    paused_script,
    read_until_paused,
    run_cli,
    stderr_lines,
    variant,
)

TURN = re.compile(r"^(Interrupted\. )?Turn (\d+): (\d+) tokens reused from the cache, (\d+) prefilled "
                  r"at [\d.]+ tok/s \| Reply: (\d+) tokens?(, \d+ thinking)?(?:, [\d.]+ tok/s)?$")
GREEDY_WARNING = "warning: Qwen advises against greedy decoding"


def official_ids(hf_tokenizer, reference, system, history, message, think):
    """The official template's rendering of the conversation, tokenized, with each earlier reply
    spliced in as its generated ids (a placeholder marks where the template puts it)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for n, (user, _) in enumerate(history):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": f"@@{n}@@"}]
    messages.append({"role": "user", "content": message})
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=think)
    ids = []
    for n, (_, reply) in enumerate(history):
        before, text = text.split(f"@@{n}@@")
        ids += reference.ids(before) + reply
    return ids + reference.ids(text)


def greedy(reference, ids, max_tokens):
    """Greedy decoding from scratch (a fresh cache); the reply without its end-of-turn token."""
    out = [t for t, _ in li.generate(ids, reference.weights, reference.config, max_tokens,
                                     eos_ids=reference.eos_ids)]
    return [t for t in out if t not in reference.eos_ids]


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def turn_lines(err):
    return [TURN.match(line) for line in err.splitlines() if TURN.match(line)]


@pytest.mark.parametrize("think,system", [(True, None), (False, "Answer in French.")])
def test_a_piped_three_turn_chat_gives_the_official_templates_greedy_replies(
        tiny_model, reference, hf_tokenizer, tmp_path, think, system):
    messages = ["Hello!", "What is the capital of France?", "Thanks. And of Italy?"]
    flags = ["--no-think"] * (not think) + (["--system", system] if system is not None else [])
    rc, out, err = run_cli("--model", tiny_model, "--chat", "--temperature", 0, "--max-tokens", 12,
                           *flags, cwd=tmp_path, stdin="".join(m + "\n" for m in messages).encode())
    assert rc == 0 and "Traceback" not in err, err
    history, expected_out, turns, cached = [], "", turn_lines(err), []
    assert len(turns) == 3, err
    for n, message in enumerate(messages):
        ids = official_ids(hf_tokenizer, reference, system, history, message, think)
        reply = greedy(reference, ids, 12)
        assert 151668 not in reply  # no </think>: the template keeps the whole reply (the splice)
        # A reply cut off inside a character: its incomplete bytes (U+FFFD here) are never printed.
        text = reference.tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd")
        expected_out += text + "\n"
        reused, prefilled = int(turns[n][3]), int(turns[n][4])
        assert reused + prefilled == len(ids) and int(turns[n][5]) == len(reply)
        # Reused: what the cache held (the last prompt and reply; a reply's last token is not fed
        # back when it hit --max-tokens) as far as it agrees with this turn's rendering.
        assert reused == common_prefix(cached, ids)
        cached = ids + reply[:11]
        history.append((message, reply))
    assert out == expected_out
    assert GREEDY_WARNING in err.splitlines()[0]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tiny_model, reference, hf_tokenizer, tmp_path):
    first_message, second_message = "Tell me a long story.", "Shorter, please."
    script = paused_script(tmp_path)  # the first reply waits for Ctrl-C after its first token
    proc = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_model), "--chat",
                             "--temperature", "0", "--max-tokens", "40"], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(tmp_path / ".hf-home"))
    try:
        proc.stdin.write(f"{first_message}\n".encode())
        proc.stdin.flush()
        paused = read_until_paused(proc)  # the first reply is under way
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(f"{second_message}\n".encode(), timeout=300)
    finally:
        proc.kill()
    out, err = out.decode(), (paused + err).decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    first, second = turn_lines(err)
    assert first[1] and not second[1]  # "Interrupted. Turn 1: ...", then an ordinary turn 2
    n_partial = int(first[5])
    assert n_partial == 1  # the token printed before Ctrl-C
    # The partial reply stays in the history: turn 2 answers the conversation that includes it.
    ids = official_ids(hf_tokenizer, reference, None, [], first_message, True)
    partial = greedy(reference, ids, n_partial)
    ids = official_ids(hf_tokenizer, reference, None, [(first_message, partial)], second_message,
                       True)
    assert int(second[3]) + int(second[4]) == len(ids)
    reply = greedy(reference, ids, 40)  # the pause, not the length, makes Ctrl-C come first
    assert int(second[5]) == len(reply)
    tail = "\n" + reference.tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd") + "\n"
    assert out.endswith(tail)
    # Before it, what was printed of the partial reply (the interrupted token may not have been).
    assert reference.tokenizer.decode(partial, skip_special_tokens=True).startswith(out[:-len(tail)])


def test_reset_and_exit(tiny_model, reference, hf_tokenizer, tmp_path):
    rc, out, err = run_cli("--model", tiny_model, "--chat", "--temperature", 0, "--max-tokens", 6,
                           cwd=tmp_path, stdin=b"Hi\n/reset\nHello\n\n/exit\nNever answered\n")
    assert rc == 0, err
    assert "(conversation reset)" in err.splitlines()
    turns = turn_lines(err)
    assert [int(t[2]) for t in turns] == [1, 1]  # turn numbers: the reset started over
    replies = [greedy(reference, official_ids(hf_tokenizer, reference, None, [], m, True), 6)
               for m in ("Hi", "Hello")]  # the second without the first in its history
    texts = [reference.tokenizer.decode(r, skip_special_tokens=True).rstrip("\ufffd") for r in replies]
    assert out == "".join(text + "\n" for text in texts)


CHAT_LINE = ("Chat: {how}, up to {n} tokens per reply. /reset (or /clear) starts over; /exit "
             "(/quit, /bye, Ctrl-D) ends; /help shows this; Ctrl-C stops a reply; \"\"\" on a line of "
             "its own starts and ends a message of several lines, Ctrl-D inside one cancels it.")


def test_a_sampled_chat_draws_each_reply_with_the_next_seed(tiny_model, reference, hf_tokenizer,
                                                            tmp_path):
    """--seed 5: the first reply samples with seed 5, the second (after /reset, to the same
    message) with seed 6, so the two differ. --reference-ops: the in-process reference's own
    functions, so that no rounding difference can change a draw."""
    rc, out, err = run_cli("--model", tiny_model, "--chat", "--temperature", 1, "--top-k", 0,
                           "--top-p", 1, "--seed", 5, "--max-tokens", 8, "--reference-ops",
                           cwd=tmp_path, stdin=b"One\n/reset\nOne\n")
    assert rc == 0 and "Traceback" not in err, err
    how = "temperature 1.0, top-k off, top-p 1.0, seed 5"
    assert stderr_lines(err)[1] == CHAT_LINE.format(how=how, n=8)
    ids = official_ids(hf_tokenizer, reference, None, [], "One", True)
    replies = [[t for t, _ in li.generate(ids, reference.weights, reference.config, 8,
                                          li.Sampling(1.0, 0, 1.0, seed), reference.eos_ids)]
               for seed in (5, 6)]
    assert replies[0] != replies[1]
    texts = [reference.tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd")
             for reply in replies]
    assert out == "".join(text + "\n" for text in texts)


def test_a_conversation_outgrowing_the_context_forgets_its_oldest_turns(
        tiny_model, reference, hf_tokenizer, variant, tmp_path):
    config = json.loads((tiny_model / "config.json").read_text()) | {"max_position_embeddings": 80}
    folder = variant("short-context", config_json=config)
    messages = ["One", "Two", "Three", "Four", "x " * 100]
    rc, out, err = run_cli("--model", folder, "--chat", "--no-think", "--temperature", 0,
                           "--max-tokens", 10, cwd=tmp_path,
                           stdin="".join(m + "\n" for m in messages).encode())
    assert rc == 0, err
    lines = err.splitlines()
    assert any(line.startswith("(the conversation outgrew the 80-token context: forgot the oldest")
               for line in lines), err
    assert any(line.startswith("error: this message makes a") and "80-token context" in line
               for line in lines), err  # the last message alone is too long: skipped, no exit
    # Replay by the rule: before each turn, drop the oldest turns until prompt + 10 fit in 80.
    history, expected = [], ""
    for message in messages[:4]:
        while len(official_ids(hf_tokenizer, reference, None, history, message, False)) + 10 > 80:
            history.pop(0)
        reply = greedy(reference, official_ids(hf_tokenizer, reference, None, history, message,
                                               False), 10)
        expected += reference.tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd")
        expected += "\n"
        history.append((message, reply))
    assert out == expected
    assert [int(t[2]) for t in turn_lines(err)] == [1, 2, 3, 4]


def test_a_drafted_chat_replies_as_an_undrafted_one(tiny_model, converted_4bit, variant,
                                                    monkeypatch, capsys):
    """--draft-model in a chat: both caches live for the whole conversation. Over several turns, a
    /reset and make_room's dropping of the oldest turns, the greedy replies with the model's 4-bit
    copy drafting (it accepts some proposals, rejects others) are those without a draft."""
    config = json.loads((tiny_model / "config.json").read_text()) | {"max_position_embeddings": 35}
    folder = variant("short-context", config_json=config)
    runs = []
    for flags in ([], ["--draft-model", str(converted_4bit), "--num-draft-tokens", "2"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"One\n/reset\nTwo\nThree\n")))
        assert li.main(["--model", str(folder), "--chat", "--no-think", "--temperature", "0",
                        "--max-tokens", "6", *flags]) == 0
        runs.append(capsys.readouterr())
    assert runs[1].out == runs[0].out
    lines = runs[1].err.splitlines()
    assert "(conversation reset)" in lines
    assert any(line.startswith("(the conversation outgrew the 35-token context") for line in lines)
    turns = [[TURN.match(line.split(" | Draft: ")[0]) for line in run.err.splitlines()
              if line.startswith("Turn ")] for run in runs]
    # The same tokens reused from the cache, prefilled and replied, turn by turn.
    assert [t.group(2, 3, 4, 5) for t in turns[1]] == [t.group(2, 3, 4, 5) for t in turns[0]]
    counts = [re.search(r" \| Draft: (\d+)/(\d+) accepted", line) for line in lines
              if line.startswith("Turn ")]
    assert len(counts) == 3 and all(counts)
    assert 0 < sum(int(c[1]) for c in counts) < sum(int(c[2]) for c in counts)


def drafted_chat(folder, stdin, monkeypatch, capsys, *flags):
    """main()'s greedy chat of the tiny model in `folder` (6 tokens a reply) on these lines of
    stdin: (stdout, stderr, the matches of TURN without the draft's counts, those counts
    (accepted, proposed) per turn)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert li.main(["--model", str(folder), "--chat", "--no-think", "--temperature", "0",
                    "--max-tokens", "6", *flags]) == 0
    out, err = capsys.readouterr()
    lines = [line.split(" | Draft: ") for line in err.splitlines() if line.startswith("Turn ")]
    counts = [tuple(map(int, re.match(r"(\d+)/(\d+) accepted", line[1]).groups()))
              for line in lines if len(line) > 1]
    return out, err, [TURN.match(line[0]) for line in lines], counts


def test_a_draft_with_fewer_layers_reuses_the_chats_cache_as_no_draft_does(
        tiny_model, checkpoints, monkeypatch, capsys):
    """The draft's caches are made from its own config: with a 1-layer draft for the 2-layer
    model, turn 2 reuses the first turn's tokens from the cache as a chat without a draft does."""
    draft = checkpoints(TINY_CONFIG | {"num_hidden_layers": 1, "max_window_layers": 1},
                        name="tiny-qwen3-1-layer")
    runs = [drafted_chat(tiny_model, b"One\nTwo\n", monkeypatch, capsys, *flags)
            for flags in ([], ["--draft-model", str(draft)])]
    (plain, _, plain_turns, _), (out, _, turns, counts) = runs
    assert out == plain
    assert [t.group(2, 3, 4, 5) for t in turns] == [t.group(2, 3, 4, 5) for t in plain_turns]
    assert int(turns[1][3]) > 0 and len(counts) == 2  # turn 2 reused some; both were drafted


def test_a_chats_draft_rolls_back_with_the_model_after_reset_and_make_room(variant, tiny_model,
                                                                            monkeypatch, capsys):
    """/reset and make_room's dropping of the oldest turns roll the draft's cache back with the
    model's. The model's own copy drafting (greedy) then has every proposal accepted in every
    turn: a draft that still held the forgotten turns would propose other tokens."""
    config = json.loads((tiny_model / "config.json").read_text()) | {"max_position_embeddings": 35}
    folder = variant("short-context", config_json=config)
    _, err, turns, counts = drafted_chat(folder, b"One\n/reset\nTwo\nThree\n", monkeypatch,
                                         capsys, "--draft-model", str(folder))
    assert [int(t[2]) for t in turns] == [1, 1, 2]  # the reset started over
    assert "(the conversation outgrew the 35-token context: forgot the oldest 1 turn)" in err
    assert len(counts) == 3, counts
    assert all(accepted == proposed > 0 for accepted, proposed in counts), counts


# ------------------------------------------------------------------------------------------------
# Thinking, shown properly: ReplyPrinter with a simulated terminal
# ------------------------------------------------------------------------------------------------

class Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def printed(reference, monkeypatch, text, hide_think, tty, stop_after=None):
    """(stdout, stderr) of ReplyPrinter given the ids of `text` (then <|im_end|>)."""
    out, err = Stream(tty), Stream(tty)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("NO_COLOR", raising=False)
    printer = cli.ReplyPrinter(reference.tokenizer, li.text_stream, hide_think)
    for token_id in (reference.ids(text) + [151645])[:stop_after]:
        printer.add(token_id)
    printer.finish()
    return out.getvalue(), err.getvalue(), printer


REPLY = "<think>\nThe user asks about Paris.\n</think>\n\nParis is the capital."
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def test_on_a_terminal_the_reasoning_is_dimmed_and_the_answer_plain(reference, monkeypatch):
    out, err, printer = printed(reference, monkeypatch, REPLY, hide_think=False, tty=True)
    assert out == f"{DIM}<think>\nThe user asks about Paris.\n</think>{PLAIN}\n\nParis is the capital.\n"
    assert err == ""
    assert printer.n_thinking == len(reference.ids("\nThe user asks about Paris.\n"))


def test_hide_think_shows_a_progress_line_and_only_the_answer(reference, monkeypatch):
    out, err, printer = printed(reference, monkeypatch, REPLY, hide_think=True, tty=True)
    assert out == "Paris is the capital.\n"
    n = printer.n_thinking
    assert err == "".join(f"\rthinking… ({i} tokens)" for i in range(1, n + 1)) + "\r\x1b[K"


def test_without_a_terminal_the_text_is_written_as_it_is(reference, monkeypatch):
    out, err, _ = printed(reference, monkeypatch, REPLY, hide_think=False, tty=False)
    assert out == REPLY + "\n" and err == ""
    out, err, _ = printed(reference, monkeypatch, REPLY, hide_think=True, tty=False)
    assert out == "Paris is the capital.\n" and err == ""  # no progress line, no colour codes


def test_a_reply_stopped_while_thinking_restores_the_colour(reference, monkeypatch):
    out, _, _ = printed(reference, monkeypatch, REPLY, hide_think=False, tty=True, stop_after=4)
    assert out.startswith(DIM) and out.endswith(PLAIN + "\n")
    out, err, _ = printed(reference, monkeypatch, REPLY, hide_think=True, tty=True, stop_after=4)
    assert out == "\n" and err.endswith("\r\x1b[K")  # the progress line is cleared


def test_no_color_turns_colours_off(reference, monkeypatch):
    monkeypatch.setattr(sys, "stdout", Stream(True))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not cli.ReplyPrinter(reference.tokenizer, li.text_stream, False).colour


# ------------------------------------------------------------------------------------------------
# Sampling settings
# ------------------------------------------------------------------------------------------------

SETTINGS = re.compile(r"temperature ([\d.]+), top-k (\d+), top-p ([\d.]+)(, min-p ([\d.]+))?, seed (\d+)")


@pytest.mark.parametrize("flags,expected", [
    (["--chat"], ("0.6", "0.95", "20", None)),  # generation_config.json (thinking mode)
    (["--chat", "--no-think"], ("0.7", "0.8", "20", None)),  # Qwen's model card, non-thinking
    (["--chat", "--no-think", "--top-k", "5", "--min-p", "0.05"], ("0.7", "0.8", "5", "0.05")),
    (["--temperature", "0.9"], ("0.9", "0.95", "20", None)),  # completion: generation_config.json
])
def test_sampling_defaults(tiny_model, tmp_path, flags, expected):
    rc, _, err = run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 2, "--seed", 3,
                         *flags, cwd=tmp_path)
    assert rc == 0, err
    settings = SETTINGS.search(stderr_lines(err)[1])
    assert (settings[1], settings[3], settings[2], settings[5]) == expected  # T, top-p, top-k, min-p


OWN_SAMPLING = {"temperature": 0.5, "top_p": 0.9, "top_k": 30, "min_p": 0.05}  # none of Qwen's values


@pytest.mark.parametrize("flags,own,expected", [
    (["--chat"], OWN_SAMPLING, ("0.5", "0.9", "30", "0.05")),  # thinking: the file's values win
    (["--chat", "--no-think"], OWN_SAMPLING, ("0.7", "0.8", "20", None)),  # the model card's
    (["--chat", "--temperature", "0.3", "--top-k", "4"], OWN_SAMPLING, ("0.3", "0.9", "4", "0.05")),
    (["--chat"], {"temperature": 0.5}, ("0.5", "0.95", "20", None)),  # the rest: the model card's
    (["--temperature", "0.9"], OWN_SAMPLING, ("0.9", "0.9", "30", "0.05")),  # completion: the file's
], ids=["chat", "no-think", "flags win", "file lacks keys", "completion"])
def test_which_sampling_defaults_win(tiny_model, variant, tmp_path, flags, own, expected):
    """A generation_config.json whose sampling differs from the model card's (Qwen3's file holds the
    thinking-mode values 0.6, 0.95, 20, so the file and the card agree there)."""
    generation_config = json.loads((tiny_model / "generation_config.json").read_text())
    for key in OWN_SAMPLING:
        generation_config.pop(key, None)
    folder = variant(generation_config_json=generation_config | own)
    rc, _, err = run_cli("--model", folder, "--prompt", "Hi", "--max-tokens", 2, "--seed", 3,
                         *flags, cwd=tmp_path)
    assert rc == 0, err
    settings = SETTINGS.search(stderr_lines(err)[1])
    assert (settings[1], settings[3], settings[2], settings[5]) == expected  # T, top-p, top-k, min-p


def test_completion_sampling_falls_back_on_transformers_defaults(variant, tmp_path, reference):
    """Without generation_config.json, top-k 50 and top-p 1.0 as transformers' generate() uses."""
    folder = variant("no-generation-config", generation_config_json=None)
    rc, out, err = run_cli("--model", folder, "--prompt", "Hi", "--max-tokens", 8, "--seed", 3,
                           "--temperature", "0.9", cwd=tmp_path)
    assert rc == 0, err
    assert "temperature 0.9, top-k 50, top-p 1.0, seed 3" in stderr_lines(err)[1]
    sampling = li.Sampling(temperature=0.9, top_k=50, top_p=1.0, seed=3)
    ids = [t for t, _ in li.generate(reference.ids("Hi"), reference.weights, reference.config, 8,
                                     sampling, {151643, 151645})]
    assert out == reference.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") + "\n"


def test_presence_penalty_reaches_the_sampler(tiny_model, reference, tmp_path):
    rc, out, err = run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 16,
                           "--presence-penalty", "2", cwd=tmp_path)
    assert rc == 0, err
    assert stderr_lines(err)[1].endswith("presence penalty 2.0, greedy")
    plain = reference.text("Hi", 16)  # before sample() is replaced
    li.use_extra_sampling(0.0, 2.0, reference.config.vocab_size)
    ids = [t for t, _ in li.generate(reference.ids("Hi"), reference.weights, reference.config, 16,
                                     li.Sampling(), reference.eos_ids)]
    assert out == reference.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") + "\n"
    assert out != plain + "\n"  # the penalty changed the reply


def test_greedy_chat_warns_in_one_line(tiny_model, tmp_path):
    rc, _, err = run_cli("--model", tiny_model, "--chat", "--prompt", "Hi", "--max-tokens", 2,
                         "--temperature", 0, cwd=tmp_path)
    assert rc == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [err.splitlines()[0]] and "endless repetition" in warnings[0]


@pytest.mark.parametrize("args,needle", [
    (["--hide-think"], "--hide-think"),
    (["--chat", "--trace"], "--trace needs a single message"),
    (["--chat", "--no-cache"], "--no-cache needs a single message"),
    (["--chat", "--top-probs", "3"], "--top-probs needs a single message"),
    (["--min-p", "1.5"], "--min-p"),
    (["--presence-penalty", "-1"], "--presence-penalty"),
])
def test_chat_flag_mistakes_are_one_line(tiny_model, tmp_path, args, needle):
    rc, out, err = run_cli("--model", tiny_model, *args, cwd=tmp_path)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and needle in err, err


def test_in_a_terminal_line_editing_ctrl_c_and_ctrl_d(tiny_model, reference, hf_tokenizer, tmp_path):
    """The chat on a pseudo-terminal, as a person types it: readline's Ctrl-A edits the line, Ctrl-C
    stops a reply and returns to the prompt, Ctrl-D ends with exit code 0."""
    master, slave = pty.openpty()

    def own_terminal():  # a new session whose controlling terminal is the pty: ^C sends SIGINT
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    script = paused_script(tmp_path, reply=2)  # the second reply waits for Ctrl-C
    proc = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_model), "--chat",
                             "--temperature", "0", "--max-tokens", "40"], cwd=tmp_path,
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
                            env=cli_env(tmp_path / ".hf-home", TERM="xterm"))
    os.close(slave)
    seen = b""

    def read_until(pattern, timeout=120):
        nonlocal seen
        deadline = time.monotonic() + timeout
        while not re.search(pattern, seen) and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:  # the process has gone
                    break
        return re.search(pattern, seen)

    try:
        assert read_until(rb">>> "), seen
        os.write(master, b"ello\x01H\r")  # type "ello", jump to the start (Ctrl-A), add "H"
        assert read_until(rb"Turn 1: .*\r\n>>> "), seen
        reply = greedy(reference, official_ids(hf_tokenizer, reference, None, [], "Hello", True), 40)
        text = reference.tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd")
        assert text.replace("\n", "\r\n").encode() in seen  # the reply to "Hello", streamed
        start = len(seen)
        os.write(master, b"Go on\r")
        # The second reply has started: its first token is printed, and it waits for Ctrl-C.
        assert read_until(rb"Go on\r\n(?s:.*)" + re.escape(PAUSED_LINE.encode())), seen[start:]
        os.write(master, b"\x03")  # Ctrl-C
        assert read_until(rb"Interrupted\. Turn 2: .*\r\n>>> "), seen[start:]
        os.write(master, b"\x04")  # Ctrl-D at the prompt
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    assert b"Traceback" not in seen


def test_a_line_that_is_not_utf8_is_skipped_in_one_line(tiny_model, tmp_path):
    rc, out, err = run_cli("--model", tiny_model, "--chat", "--max-tokens", 3, cwd=tmp_path,
                           stdin=b"caf\xe9\nHi\n")
    assert rc == 0, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not valid UTF-8" in errors[0]
    assert [int(t[2]) for t in turn_lines(err)] == [1]  # "Hi" was answered


class TerminalStdin(io.TextIOWrapper):
    """A stdin that says it is a terminal: input() then reads it as a file, decoded as the
    terminal's is."""

    def isatty(self):
        return True


def test_on_a_terminal_a_line_that_is_not_utf8_is_skipped_in_one_line(reference, monkeypatch, capsys):
    """Fix: where the terminal's stdin decodes strictly (an en_US.UTF-8 locale), input() raised
    UnicodeDecodeError for bytes that are not UTF-8, and the chat ended with a traceback."""

    chat = li.Chat(reference.weights, reference.config, reference.tokenizer)
    monkeypatch.setattr(sys, "stdin", TerminalStdin(io.BytesIO(b"caf\xe9\nHi\n"), errors="strict"))
    cli.chat_loop(chat, li.text_stream, 2, li.Sampling(), reference.eos_ids, hide_think=False)
    # After the prompt `>>> `: a terminal would have echoed the typed line and its newline.
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "not valid UTF-8" in errors[0]
    assert [user for user, _ in chat.turns] == ["Hi"]


def test_filters_given_without_sampling_are_said_to_be_ignored(tiny_model, tmp_path):
    rc, _, err = run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 2, "--top-k", 5,
                         "--min-p", "0.1", cwd=tmp_path)
    assert rc == 0
    assert err.splitlines()[0] == ("warning: --top-k, --min-p only matter when sampling; greedy "
                                   "decoding ignores them (add --temperature)")
    rc, _, err = run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 2, "--top-k", 5,
                         "--temperature", "0.5", cwd=tmp_path)
    assert rc == 0 and "warning" not in err
    rc, _, err = run_cli("--model", tiny_model, "--prompt", "Hi", "--max-tokens", 2, "--top-p", "0.5",
                         cwd=tmp_path)
    assert rc == 0
    assert err.splitlines()[0] == ("warning: --top-p only matters when sampling; greedy decoding ignores it "
                                   "(add --temperature)")


@pytest.mark.parametrize("flag", ["--seed", "--top-k", "--min-p"])
def test_a_seed_or_filter_of_0_without_sampling_is_said_to_be_ignored_too(flag, capsys):
    """Bug: the greedy warning tested each flag's value for truth, not for being given: --seed 0,
    --top-k 0 and --min-p 0 went unmentioned."""
    cli.parse_args([flag, "0"])
    assert capsys.readouterr().err == (f"warning: {flag} only matters when sampling; greedy "
                                       "decoding ignores it (add --temperature)\n")


def test_a_one_token_reply_is_counted_in_the_singular(tiny_model, tmp_path):
    rc, _, err = run_cli("--model", tiny_model, "--chat", "--max-tokens", 1, cwd=tmp_path, stdin=b"Hi\n")
    assert rc == 0, err
    (turn,) = [line for line in err.splitlines() if line.startswith("Turn 1: ")]
    assert turn.endswith(" | Reply: 1 token"), turn  # no "1 tokens, 0.0 tok/s"


def test_ctrl_c_before_a_reply_begins_leaves_the_chat_as_it_was(tiny_model, reference, monkeypatch,
                                                                  capsys):
    """Ctrl-C while the conversation is being tokenized: no turn, no statistics, the chat goes on."""
    chat = li.Chat(reference.weights, reference.config, reference.tokenizer)
    calls = 0

    def prompt_ids(message):
        nonlocal calls
        calls += 1
        if calls == 2:  # make_room calls it once; the second call is Chat.reply's own
            raise KeyboardInterrupt
        return li.Chat.prompt_ids(chat, message)

    monkeypatch.setattr(chat, "prompt_ids", prompt_ids)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hi\nHello\n")))
    cli.chat_loop(chat, li.text_stream, 4, li.Sampling(), reference.eos_ids, hide_think=False)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Interrupted."
    assert [int(t[2]) for t in turn_lines("\n".join(err))] == [1]  # "Hello" was answered
    assert [message for message, _ in chat.turns] == ["Hello"]


def test_ctrl_c_in_a_prefill_drops_the_message_and_counts_what_was_prefilled(
        reference, monkeypatch, capsys):
    """Issue 41: Ctrl-C in a chat's prefill said "<all> prefilled at 0.0 tok/s", and kept the
    message in the history (the next turn prefilled it whole). Now the stop line counts the tokens
    prefilled, the message is dropped, and the cache keeps them: sent again, the prefill resumes."""
    pieces_of(monkeypatch, 4)
    message = "Tell me everything about the capital of France, its people and its rivers."
    chat = li.Chat(reference.weights, reference.config, reference.tokenizer)
    reused = []  # the interrupted turn's tokens reused from the cache

    def show(done, total):  # Ctrl-C once, when the second 4-token piece of the message is in
        if done == 8 and chat.turns and not reused:
            reused.append(chat.reused)
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.PREFILL, "show", show)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f"Hi\n{message}\n{message}\n"
                                                                  .encode())))
    cli.chat_loop(chat, li.text_stream, 4, li.Sampling(), reference.eos_ids, hide_think=False)
    err = capsys.readouterr().err.splitlines()
    assert [m for m, _ in chat.turns] == ["Hi", message]  # the message once: sent again
    reply = chat.turns.pop()[1]
    ids = chat.prompt_ids(message)  # what turn 2 renders, as the interrupted turn did
    (stop,) = [line for line in err if line.startswith("Interrupted.")]
    assert re.fullmatch(rf"Interrupted\. 8 of {len(ids) - reused[0]} tokens prefilled, [\d.]+ "
                        r"tok/s \| The message is left out of the conversation", stop), err
    # Turn 2 (not 3) answers the message, its prefill resuming where Ctrl-C stopped it, with the
    # reply of a fresh cache.
    first, second = turn_lines("\n".join(err))
    assert [int(first[2]), int(second[2])] == [1, 2] and not second[1]
    assert [int(second[3]), int(second[3]) + int(second[4])] == [reused[0] + 8, len(ids)]
    assert reply == greedy(reference, ids, 4)


def test_ctrl_c_waits_for_the_queued_step(reference, monkeypatch, capsys):
    """generate() queues step n+1 before yielding token n: after Ctrl-C, stream() (which main and the chat
    loop both read replies through) waits for it (mx.synchronize) before anything else happens."""
    events = []
    monkeypatch.setattr(li.mx, "synchronize", lambda *stream: events.append("synchronize"))
    tokens = li.generate(reference.ids("The capital of France is"), reference.weights, reference.config, 50)

    def interrupted_after_two():
        for n, (token_id, logits) in enumerate(tokens):
            events.append(token_id)
            if n == 1:
                raise KeyboardInterrupt
            yield token_id, logits

    interrupted, _, _ = cli.stream(interrupted_after_two(), cli.ReplyPrinter(reference.tokenizer, li.text_stream, False))
    assert interrupted
    assert len(events) == 3 and events[2] == "synchronize"  # two tokens, then the wait


@pytest.mark.parametrize("max_tokens", [8, 16, 40])
def test_chat_max_tokens_leaving_no_room_for_a_message_is_refused_at_start(tiny_model, variant, tmp_path,
                                                                           max_tokens):
    """Before: every message was refused ("shorten it") and the chat ended with exit code 0."""
    config = json.loads((tiny_model / "config.json").read_text()) | {"max_position_embeddings": 16}
    folder = variant("short-context", config_json=config)
    result = run_cli("--model", folder, "--chat", "--max-tokens", max_tokens, cwd=tmp_path, stdin=b"Hi\n")
    assert_one_line_error(result, 1)
    assert result[2] == (f"{ERROR_PREFIX}the chat format takes 8 tokens, and a message at least one; with "
                         f"--max-tokens {max_tokens} that exceeds the model's 16-token context: lower --max-tokens\n")


def test_a_chats_default_max_tokens_is_at_most_half_the_context(checkpoints, monkeypatch, capsys):
    """Bug: the default --max-tokens was capped at half the context for a completion only: with
    --chat, 8192 tokens per reply in a 1000-token context, and the chat refused at start."""
    folder = checkpoints(TINY_CONFIG | {"max_position_embeddings": 1000})
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"/exit\n")))
    assert li.main(["--model", str(folder), "--chat"]) == 0
    assert "up to 500 tokens per reply" in capsys.readouterr().err


def test_the_chat_format_counts_the_system_message(checkpoints, monkeypatch):
    """Bug: --chat's start-up check of --max-tokens counted the format without --system."""
    folder = checkpoints(TINY_CONFIG | {"max_position_embeddings": 80})
    tokenizer = li.load_tokenizer(folder)
    system = "You are a helpful assistant who answers briefly."
    n_format = len(li.tokenize(tokenizer, li.chat_prompt("", system, True)))
    assert n_format > len(li.tokenize(tokenizer, li.chat_prompt("", None, True))) + 5
    fits = 80 - n_format - 1  # one token left for a message
    flags = ["--model", str(folder), "--chat", "--system", system, "--temperature", "0.6"]
    with pytest.raises(cli.UserError, match="and --system takes"):
        li.main([*flags, "--max-tokens", str(fits + 1)])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"/exit\n")))
    assert li.main([*flags, "--max-tokens", str(fits)]) == 0


def test_chat_max_tokens_leaving_room_for_a_short_message_runs(tiny_model, variant, tmp_path):
    config = json.loads((tiny_model / "config.json").read_text()) | {"max_position_embeddings": 16}
    folder = variant("short-context", config_json=config)
    # The chat format takes 8 tokens, "Hi" 1 more: 7 are left for the reply (8 leave none for any text).
    rc, out, err = run_cli("--model", folder, "--chat", "--max-tokens", 7, cwd=tmp_path, stdin=b"Hi\n")
    assert rc == 0 and [int(t[2]) for t in turn_lines(err)] == [1], err


def test_on_a_terminal_with_stdout_redirected_the_prompts_go_to_stderr(reference, monkeypatch,
                                                                        capsys):
    """Fix: `--chat > replies.txt` typed on a terminal wrote input()'s `>>> ` into replies.txt, and
    the person typing saw no prompt."""

    chat = li.Chat(reference.weights, reference.config, reference.tokenizer)
    monkeypatch.setattr(sys, "stdin", TerminalStdin(io.BytesIO(b'Hi\n"""\nTwo\nlines\n"""\n')))
    cli.chat_loop(chat, li.text_stream, 2, li.Sampling(), reference.eos_ids, hide_think=False)
    out, err = capsys.readouterr()
    assert ">>>" not in out and "..." not in out
    assert err.count(">>> ") == 3 and err.count("... ") == 3
