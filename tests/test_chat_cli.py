"""`--chat` end to end: a conversation over piped stdin, as a real subprocess.

Each reply is compared with what Qwen3's official chat template (rendered by transformers) plus greedy
decoding from scratch gives, turn by turn; earlier replies enter the rendering as the ids the model
generated. The tiny random model never writes <think>, so the thinking display is checked on
ReplyPrinter directly, with the terminal simulated.
"""

import io
import re
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from transformers import AutoTokenizer

import llm_inference as li
from tests.test_cli import (  # noqa: F401 (fixtures)
    SCRIPT,
    Reference,
    assert_one_line_error,
    cli_env,
    reference,
    run_cli,
    tiny_model,
    variant,
)

TURN = re.compile(r"^(Interrupted\. )?Turn (\d+): (\d+) tokens reused from the cache, (\d+) prefilled "
                  r"at [\d.]+ tok/s \| Reply: (\d+) tokens(, \d+ thinking)?, [\d.]+ tok/s$")
GREEDY_WARNING = "warning: Qwen advises against greedy decoding"


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


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
