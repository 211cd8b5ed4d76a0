"""Multi-turn chat (Part 2, section 18) and the sampling filters (sections 10 and 17).

A conversation's token ids are checked against Qwen3's official chat template, rendered by transformers
(the template is in tests/checkpoint.py) and against renderings written out by hand from its rules; the
cache reused across turns is checked against recomputing the whole conversation from scratch. The
filters are checked against transformers' own logits warpers.
"""

import functools
import io
import sys

import numpy as np
import mlx.core as mx
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import cli
import llm_inference as li
from tests.test_model import pieces_of

THINK, END_THINK, IM_END = 151667, 151668, 151645


@pytest.fixture(scope="module")
def model(tiny_model):  # tests/conftest.py: TINY_CONFIG, seed 0
    folder = tiny_model
    config = li.load_config(folder)
    return folder, config, li.load_weights(folder, config, mx.float32), li.load_tokenizer(folder)


def make_chat(model, system=None, think=True):
    _, config, weights, tokenizer = model
    return li.Chat(weights, config, tokenizer, system, think)


def ids(model, text):
    return model[3].encode(text).ids


# ------------------------------------------------------------------------------------------------
# What the model sees: the template's token sequence
# ------------------------------------------------------------------------------------------------

REASONED = "<think>\nThe user says hi.\n</think>\n\nHello! How can I help?"


@pytest.mark.parametrize("system", [None, "Be brief.", ""])
@pytest.mark.parametrize("think", [True, False])
def test_prompt_ids_follow_the_rules_of_qwen3s_template(model, system, think):
    chat = make_chat(model, system, think)
    # Two earlier turns: a reply with reasoning, and one stopped (Ctrl-C) while still thinking.
    chat.turns = [("Hi", ids(model, REASONED)), ("Why?", ids(model, "<think>\nLet me see"))]
    expected = ("" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n") + (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"  # reasoning and newlines gone
        "<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nLet me see<|im_end|>\n"  # no </think>: kept whole
        "<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n") + ("" if think else "<think>\n\n</think>\n\n")
    assert chat.prompt_ids("And now?") == ids(model, expected)


def test_a_reply_made_without_thinking_loses_the_empty_think_block(model):
    chat = make_chat(model, think=False)
    chat.turns = [("Hi", ids(model, "Hello!"))]  # generated after "<think>\n\n</think>\n\n"
    assert chat.prompt_ids("Bye") == ids(model, (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"))


@pytest.mark.parametrize("think", [True, False])
def test_prompt_ids_decode_to_the_official_template(model, hf_tokenizer, think):
    chat = make_chat(model, "You are terse.", think)
    replies = [REASONED, "<think>\n\n</think>\n\nSure.", "Plain answer.\n", "<think>\nhalf a tho"]
    messages = [{"role": "system", "content": "You are terse."}]
    for n, reply in enumerate(replies):
        chat.turns.append((f"Question {n}", ids(model, reply)))
        messages += [{"role": "user", "content": f"Question {n}"},
                     {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": "Last one"})
    official = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=think)
    got = chat.prompt_ids("Last one")
    assert model[3].decode(got, skip_special_tokens=False) == official
    assert got == ids(model, official)  # these replies re-tokenize to the same ids


# ------------------------------------------------------------------------------------------------
# The cache across turns: rolled back, reused, and exactly what recomputing from scratch gives
# ------------------------------------------------------------------------------------------------

def from_scratch(model, prompt_ids):
    """The next token's logits with a fresh cache: the whole conversation computed again."""
    _, config, weights, _ = model
    return li.forward(mx.array(prompt_ids), weights, config, li.make_cache(config))


def run_turn(chat, message, max_tokens, stop_after=None):
    """Greedy reply; stop_after=n closes the generator after n tokens, as the chat loop does on Ctrl-C."""
    replies, got = chat.reply(message, max_tokens, eos_ids={IM_END}), []
    for token_id, _ in replies:
        got.append(token_id)
        if len(got) == stop_after:
            replies.close()
    return got


@pytest.mark.parametrize("think", [True, False])
def test_turns_reuse_the_cache_and_match_recomputing_everything(model, think):
    _, config, weights, _ = model
    chat = make_chat(model, "Be brief.", think)
    previous = None  # the last turn's (prompt, reply)
    for n, (message, stop) in enumerate([("One", None), ("Two", 3), ("Three", None)]):
        prompt = chat.prompt_ids(message)
        expected = [t for t, _ in li.generate(prompt, weights, config, 12, eos_ids={IM_END})]
        reply = run_turn(chat, message, 12, stop)
        assert reply == expected[:stop]  # greedy: the same tokens as from scratch
        assert chat.reused + chat.prefilled == len(prompt)
        if previous is None:
            assert chat.reused == 0
        elif think:  # the random model writes no </think>, so no history is rewritten: all the
            # cache is reused, except a reply's last token when it hit max_tokens (not fed back).
            assert chat.reused == len(previous[0]) + len(previous[1]) - (len(previous[1]) == 12)
        else:  # the empty think block (4 tokens) of the last generation prompt is rolled back
            assert chat.reused == len(previous[0]) - 4
        previous = prompt, [t for t in reply if t != IM_END]
    # After three turns with roll-backs, the next token's logits equal a from-scratch pass.
    prompt = chat.prompt_ids("Four")
    _, logits = next(chat.reply("Four", 1))
    assert mx.allclose(logits, from_scratch(model, prompt), atol=1e-4, rtol=1e-4)


def test_a_rewritten_history_rolls_the_cache_back_to_where_it_differs(model):
    """As when the template drops a reply's reasoning: the cache holds the reply as generated, the
    new rendering differs from its start on, and only the part after the shared prefix is computed."""
    chat = make_chat(model)
    generated_prompt = chat.prompt_ids("One")
    run_turn(chat, "One", 8)
    chat.turns[-1] = ("One", ids(model, REASONED))  # now the history holds another reply
    prompt = chat.prompt_ids("Two")
    _, logits = next(chat.reply("Two", 1))
    assert chat.reused == len(generated_prompt)  # up to "<|im_start|>assistant\n" of the reply
    assert mx.allclose(logits, from_scratch(model, prompt), atol=1e-4, rtol=1e-4)


def an_end_id(model, message, at=3):
    """The random model never writes <|im_end|>: an id that its greedy reply to `message` does write,
    first at position >= `at`, stands in for it. Returns (that id, the reply before it)."""
    chat = make_chat(model)
    reply = run_turn(chat, message, 16)
    n = next(n for n in range(at, len(reply)) if reply[n] not in reply[:n])
    return reply[n], reply[:n]


def test_a_reply_ended_by_the_end_id_keeps_it_out_of_the_history(model):
    """The end-of-turn id that stops a reply is not part of it: the next rendering closes the reply
    with exactly one <|im_end|> (the template's), and the cache, which holds the end id fed back,
    rolls back over it."""
    end, before_end = an_end_id(model, "One")
    chat = make_chat(model)
    first_prompt = chat.prompt_ids("One")
    got = [t for t, _ in chat.reply("One", 16, eos_ids={end})]
    assert got == before_end + [end]  # generate() yields the end id, then stops
    assert chat.turns == [("One", before_end)]  # the stored reply: without it
    prompt = chat.prompt_ids("Two")
    after = prompt[len(first_prompt) + len(before_end):]
    assert prompt[:len(first_prompt)] == first_prompt
    assert prompt[len(first_prompt):][:len(before_end)] == before_end
    assert after == ids(model, "<|im_end|>\n") + ids(model, li.chat_prompt("Two"))
    assert end not in after and after.count(IM_END) == 2  # the reply's end, then the message's
    _, logits = next(chat.reply("Two", 1, eos_ids={end}))
    assert chat.reused == len(first_prompt) + len(before_end)  # not the end id's position
    assert mx.allclose(logits, from_scratch(model, prompt), atol=1e-4, rtol=1e-4)


def test_reset_then_the_same_first_message_gives_the_same_reply(model, monkeypatch, capsys):
    """/reset, then the very first message again: the same greedy reply, and all of the prompt but its
    last token (fed again for its logits) comes from the cache, which still holds the first turn."""
    end, before_end = an_end_id(model, "One")
    chat = make_chat(model)
    n_prompt = len(chat.prompt_ids("One"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"One\n/reset\nOne\n")))
    cli.chat_loop(chat, li.text_stream, 16, li.Sampling(), {end}, hide_think=False)
    out, err = capsys.readouterr()
    # The printer shows the end id, an ordinary token here (<|im_end|>, being special, shows nothing).
    text = model[3].decode(before_end + [end], skip_special_tokens=True).rstrip("\ufffd")
    assert out == f"{text}\n{text}\n"
    assert chat.turns == [("One", before_end)]
    turns = [line.split(" | ")[0] for line in err.splitlines() if line.startswith("Turn ")]
    assert [t.split(" prefilled")[0] for t in turns] == [
        f"Turn 1: 0 tokens reused from the cache, {n_prompt}",
        f"Turn 1: {n_prompt - 1} tokens reused from the cache, 1"]
    assert "(conversation reset)" in err.splitlines()


def short_context_chat(model, context=80):
    folder, config, weights, tokenizer = model
    chat = li.Chat(weights, config._replace(max_position_embeddings=context), tokenizer)
    chat.turns = [("One", ids(model, "The first answer.")), ("Two", ids(model, "The second answer."))]
    return chat


def test_a_message_refused_as_too_long_leaves_the_conversation_as_it_was(model, capsys):
    chat = short_context_chat(model)
    before = [(message, list(reply)) for message, reply in chat.turns]
    with pytest.raises(cli.UserError, match="exceeds the model's 80-token context: shorten it"):
        cli.make_room(chat, "x " * 100, 10)
    assert chat.turns == before  # not one turn dropped on the way to the refusal
    assert capsys.readouterr().err == ""  # nor said to be
    cli.make_room(chat, "Three", 10)  # the next message goes on from the whole conversation
    assert chat.turns == before


def test_a_message_that_needs_room_drops_only_the_oldest_turns(model, capsys):
    chat = short_context_chat(model)
    need = len(chat.prompt_ids("Three"))
    cli.make_room(chat, "Three", 80 - need + 1)  # one token too many: the oldest turn goes
    assert [message for message, _ in chat.turns] == ["Two"]
    assert "forgot the oldest 1 turn)" in capsys.readouterr().err


def test_make_room_drops_the_last_turn_too(model):
    """Bug: make_room stopped before dropping the last remaining turn (dropped < len(turns) - 1)."""
    _, config, _, tokenizer = model
    config = config._replace(max_position_embeddings=80)
    chat = li.Chat(None, config, tokenizer)
    chat.turns = [("One", li.tokenize(tokenizer, "A reply of a few tokens."))]
    alone = len(li.Chat(None, config, tokenizer).prompt_ids("Two"))
    cli.make_room(chat, "Two", 80 - alone)  # fits only without the one earlier turn
    assert chat.turns == []


def test_a_conversation_that_fits_exactly_keeps_every_turn(model, capsys):
    """The prompt and a whole reply filling the context to its last position fit: nothing is dropped;
    one token more drops the oldest turn."""
    chat = short_context_chat(model)
    before = list(chat.turns)
    need = len(chat.prompt_ids("Three"))
    cli.make_room(chat, "Three", 80 - need)
    assert chat.turns == before and capsys.readouterr().err == ""
    cli.make_room(chat, "Three", 80 - need + 1)
    assert chat.turns == before[1:] and "forgot the oldest 1 turn)" in capsys.readouterr().err


def test_a_message_alone_that_fits_exactly_is_not_refused(model, capsys):
    chat = short_context_chat(model)
    chat.turns = []
    need = len(chat.prompt_ids("x " * 20))
    cli.make_room(chat, "x " * 20, 80 - need)  # fits: no error
    assert chat.turns == [] and capsys.readouterr().err == ""
    with pytest.raises(cli.UserError, match=f"makes a {need}-token prompt; with --max-tokens "
                                           f"{80 - need + 1} that exceeds the model's 80-token"):
        cli.make_room(chat, "x " * 20, 80 - need + 1)


def test_ctrl_c_while_making_room_leaves_the_conversation_as_it_was(model, monkeypatch):
    chat = short_context_chat(model)
    before = list(chat.turns)
    renderings = []

    def interrupted(message):  # the first rendering is too long; Ctrl-C lands in the second
        renderings.append(len(chat.turns))
        if len(renderings) == 2:
            raise KeyboardInterrupt
        return li.Chat.prompt_ids(chat, message)

    monkeypatch.setattr(chat, "prompt_ids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.make_room(chat, "Three", 70)
    assert renderings == [2, 1]  # interrupted after dropping the oldest turn ...
    assert chat.turns == before  # ... which is back


def test_ctrl_c_inside_a_step_leaves_a_usable_cache(model, monkeypatch):
    """Ctrl-C can land while a step runs through the layers: some layers' caches then hold one more
    position than others. The next turn must still see exactly the conversation."""
    chat = make_chat(model)
    block, calls = li.transformer_block, 0

    def interrupted_block(*args):
        nonlocal calls
        calls += 1
        if calls == 2 * config.num_hidden_layers + 2:  # prefill, a decode step, then in the next
            raise KeyboardInterrupt  # one at layer 1, when layer 0 has stored its new position
        return block(*args)

    config = model[1]
    pieces_of(monkeypatch, 1024)  # the prompt in one pass
    monkeypatch.setattr(li, "transformer_block", interrupted_block)
    with pytest.raises(KeyboardInterrupt):
        run_turn(chat, "One", 8)
    monkeypatch.setattr(li, "transformer_block", block)
    offsets = {c.offset for c in chat.cache}
    assert len(offsets) == 2  # the layers disagree, as described
    assert len(chat.turns) == 1  # the partial reply stays in the history
    prompt = chat.prompt_ids("Two")
    _, logits = next(chat.reply("Two", 1))
    assert mx.allclose(logits, from_scratch(model, prompt), atol=1e-4, rtol=1e-4)


def test_ctrl_c_in_a_prefill_leaves_a_usable_cache(model, monkeypatch):
    """Issue 32: Ctrl-C in a turn's prefill, before any reply, can land when only layer 0 has
    recorded the new positions. The history then keeps only what every layer holds (the least of
    their offsets; with the most, 24 positions were reused instead of 12, and the logits were off
    by 9.2): the next turn still gives the logits of a fresh computation."""
    chat = make_chat(model)
    run_turn(chat, "One", 4)
    block, calls = li.transformer_block, 0

    def interrupted_block(*args):
        nonlocal calls
        calls += 1
        if calls == 2:  # the next turn's first pass, at layer 1
            raise KeyboardInterrupt
        return block(*args)

    monkeypatch.setattr(li, "transformer_block", interrupted_block)
    with pytest.raises(KeyboardInterrupt):
        run_turn(chat, "Two", 4)
    monkeypatch.setattr(li, "transformer_block", block)
    assert chat.turns[-1] == ("Two", []) and len({c.offset for c in chat.cache}) == 2
    prompt = chat.prompt_ids("Three")
    _, logits = next(chat.reply("Three", 1))
    assert mx.allclose(logits, from_scratch(model, prompt), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# The chat loop's input and seeds: commands, multi-line messages, Windows text, a seed per reply
# ------------------------------------------------------------------------------------------------

def recorded(replies, got):
    """Chat.reply's (token id, logits) pairs, passed on, their ids appended to `got`."""
    try:
        for token_id, logits in replies:
            got.append(token_id)
            yield token_id, logits
    finally:  # stream() closes it on Ctrl-C: Chat.reply then files the partial reply
        replies.close()


def talk(chat, monkeypatch, data, max_tokens=2, sampling=li.Sampling()):
    """chat_loop with `data` piped on stdin. Returns what it sent to the model: a (message, ids of
    its reply) pair for each call of chat.reply."""
    sent = []

    def reply(message, *args):
        sent.append((message, []))
        return recorded(li.Chat.reply(chat, message, *args), sent[-1][1])

    monkeypatch.setattr(chat, "reply", reply)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli.chat_loop(chat, li.text_stream, max_tokens, sampling, {IM_END}, hide_think=False) == 0  # end of input, /exit
    return sent


@pytest.mark.parametrize("seed", [3, 2**64 - 1])  # 2**64 - 1: the second reply wraps around to 0
def test_each_reply_draws_with_its_own_seed_and_the_conversation_repeats(model, monkeypatch,
                                                                         capsys, seed):
    """The same message twice, with /reset between: reply n (from 0, /reset or not) samples with
    seed + n, so the two replies differ (no filter, temperature 1: every token is a fresh draw),
    and the same input with the same seed gives the same conversation again."""
    _, config, weights, _ = model
    sampling = li.Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    prompt = make_chat(model).prompt_ids("One")
    expected = [[t for t, _ in li.generate(prompt, weights, config, 12,
                                           sampling._replace(seed=s), {IM_END})]
                for s in (seed, (seed + 1) % 2**64)]
    assert expected[0] != expected[1]  # the seeds do make a difference here
    chat = make_chat(model)
    sent = talk(chat, monkeypatch, b"One\n/reset\nOne\n", 12, sampling)
    assert sent == [("One", expected[0]), ("One", expected[1])]
    assert chat.replies == 2 and chat.turns == [("One", expected[1])]
    out = capsys.readouterr().out
    again = make_chat(model)
    assert talk(again, monkeypatch, b"One\n/reset\nOne\n", 12, sampling) == sent
    assert capsys.readouterr().out == out and again.turns == chat.turns


def test_commands_ignore_case_have_aliases_and_never_reach_the_model(model, monkeypatch, capsys):
    """Only a line that is one /word is a command: /usr/bin, say, is a message."""
    assert all(word in cli.CHAT_HELP for word in ("/reset", "/exit", '"""'))
    chat = make_chat(model)
    chat.turns = [("Hi", ids(model, "Hello!"))]
    data = b"/help\n/?\n/foo\n/RESET\n/Clear\n/usr/bin\n/Quit\nNever answered\n"
    sent = talk(chat, monkeypatch, data)
    assert [message for message, _ in sent] == ["/usr/bin"]
    assert chat.turns == sent  # /RESET forgot "Hi"
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("Turn ")]
    assert err == [cli.CHAT_HELP, cli.CHAT_HELP, f"unknown command /foo: {cli.CHAT_HELP}",
                   "(conversation reset)", "(conversation reset)"]
    assert sys.stdin.buffer.read() == b"Never answered\n"  # /Quit ended the chat there


@pytest.mark.parametrize("command", ["/exit", "/Quit", "/BYE", "  /bye  "])
def test_each_way_to_say_exit_ends_the_chat(model, monkeypatch, capsys, command):
    sent = talk(make_chat(model), monkeypatch, f"{command}\nNever answered\n".encode())
    assert sent == [] and sys.stdin.buffer.read() == b"Never answered\n"
    assert capsys.readouterr() == ("", "")


def test_lines_between_two_triple_quote_lines_are_one_message(model, monkeypatch):
    message = "First line,\n  an indented one,\n\nafter an empty one."
    data = b'"""\n' + message.encode() + b'\n"""\nNext\n'
    chat = make_chat(model)
    sent = talk(chat, monkeypatch, data)
    assert [message for message, _ in sent] == [message, "Next"]  # then one line is one again
    # The model saw the lines joined with "\n" as the first user message.
    first = ids(model, li.chat_prompt(message))
    assert chat.cached_ids[:len(first)] == first
    assert model[3].decode(first, skip_special_tokens=False) == li.chat_prompt(message)


def test_ctrl_d_inside_triple_quotes_cancels_the_message(model, monkeypatch, capsys):
    """Issue 41: \"\"\", a line, then Ctrl-D sent the unfinished message. Now it is cancelled, in
    one line, and on a terminal the chat goes on (the next Ctrl-D ends it); /help says so."""
    assert talk(make_chat(model), monkeypatch, b'"""\nUnfinished\n') == []  # piped input's end
    lines = iter(['"""', "Unfinished", None, "Next", None])  # a terminal: Ctrl-D reads as None
    monkeypatch.setattr(cli, "read_line", lambda interactive, prompt: next(lines))
    assert [message for message, _ in talk(make_chat(model), monkeypatch, b"")] == ["Next"]
    assert [line for line in capsys.readouterr().err.splitlines()
            if not line.startswith("Turn ")] == ["(message cancelled)"] * 2
    assert "Ctrl-D inside one cancels it" in cli.CHAT_HELP


def test_piped_text_with_a_bom_and_crlf_gives_the_same_messages_as_plain_text(model, monkeypatch,
                                                                               capsys):
    unix = b'One\n"""\nTwo\nlines\n"""\n/RESET\nThree\n'
    windows = b"\xef\xbb\xbf" + unix.replace(b"\n", b"\r\n")  # as Notepad saves it
    conversations = []
    for data in (unix, windows):
        sent = talk(make_chat(model), monkeypatch, data)
        conversations.append((sent, capsys.readouterr().out))
    assert [message for message, _ in conversations[0][0]] == ["One", "Two\nlines", "Three"]
    assert conversations[1] == conversations[0]


def test_a_multi_line_message_with_a_line_that_is_not_utf8_is_skipped_whole(model, monkeypatch,
                                                                             capsys):
    """One error, and none of the message's lines sent on their own (bugs-chat.md)."""
    sent = talk(make_chat(model), monkeypatch, b'"""\nOne\ncaf\xe9\nTwo\n"""\nHi\n')
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not valid UTF-8" in errors[0]
    assert [message for message, _ in sent] == ["Hi"]


# ------------------------------------------------------------------------------------------------
# Sampling filters against transformers' warpers
# ------------------------------------------------------------------------------------------------

def kept_by_transformers(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    scores = torch.tensor(np.array(logits), dtype=torch.float32)[None]
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


def kept_by_us(logits, min_p=0.0, **sampling):
    filtered = li.filter_logits(logits, li.Sampling(**sampling))
    filtered = np.array(li.filter_min_p(filtered, min_p) if min_p else filtered)
    return set(np.nonzero(np.isfinite(filtered))[0].tolist())


def bfloat16_logits(seed, n=4096):
    """Logits as a bfloat16 model gives them: 8 bits of mantissa, so many are exactly equal."""
    return mx.random.normal((n,), key=mx.random.key(seed)).astype(mx.bfloat16).astype(mx.float32) * 3


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k", [1, 20, 50])
def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does(seed, top_k):
    logits = bfloat16_logits(seed)
    values = np.sort(np.array(logits))[::-1]
    kept = kept_by_us(logits, temperature=0.7, top_k=top_k)
    assert kept == kept_by_transformers(logits, 0.7, top_k=top_k)
    assert len(kept) == int(np.sum(values >= values[top_k - 1]))


def test_top_k_ties_are_really_exercised():
    """The cases above include ties at the k-th logit: more than k tokens are kept."""
    sizes = [len(kept_by_us(bfloat16_logits(seed), temperature=1.0, top_k=20)) for seed in range(6)]
    assert any(size > 20 for size in sizes), sizes


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_min_p_keeps_the_tokens_transformers_keeps(seed, min_p, temperature):
    logits = bfloat16_logits(seed)
    assert kept_by_us(logits, temperature=temperature, min_p=min_p) == \
        kept_by_transformers(logits, temperature, min_p=min_p)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_k,top_p,min_p", [(20, 0.95, 0.0), (0, 0.8, 0.0), (20, 0.8, 0.05),
                                               (50, 0.5, 0.1), (0, 0.9, 0.2)])
def test_the_filters_chained_keep_what_transformers_keeps(seed, top_k, top_p, min_p):
    # Distinct float32 logits: with ties at the top-p boundary, transformers' choice depends on its
    # sort order (we keep all tied tokens: the rule in filter_logits).
    logits = mx.random.normal((4096,), key=mx.random.key(100 + seed)) * 2
    assert kept_by_us(logits, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p) == \
        kept_by_transformers(logits, 0.7, top_k, top_p, min_p)


def unambiguous_for_top_p(logits, temperature, top_k, top_p, margin=1e-4):
    """Whether transformers' top-p choice after top-k does not depend on its sort order: the cut
    (cumulative mass 1 - top_p, least likely first) falls in no group of tied tokens, nor within
    `margin` of a boundary between tokens (rounding)."""
    x = np.array(logits, np.float64) / temperature
    kept = np.sort(x[x >= np.sort(x)[::-1][top_k - 1]])  # after top-k (ties kept), least likely first
    q = np.exp(kept - kept.max())
    q /= q.sum()
    mass, cut = np.cumsum(q), 1 - top_p
    _, starts, counts = np.unique(kept, return_index=True, return_counts=True)
    return all(cut < mass[s] - margin or cut > mass[s + n - 1] + margin for s, n in zip(starts, counts))


@functools.cache
def top_k_top_p_cases():
    """(seed, top_k, top_p, kept by us, by transformers, how many top-k keeps, what transformers keeps
    if top-k had kept exactly k tokens) for bfloat16 logits whose k-th largest value is tied, at top-p
    values whose cut falls in no tie."""
    cases = []
    for seed in range(12):
        logits = bfloat16_logits(seed)
        values = np.array(logits)
        for top_k in (20, 50):
            n_top_k = int(np.sum(values >= np.sort(values)[::-1][top_k - 1]))
            if n_top_k == top_k:  # no tie at the top-k bar
                continue
            exactly_k = values.copy()
            exactly_k[np.argsort(-values, kind="stable")[top_k:]] = -1e9  # the ties beyond k dropped
            for top_p in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999):
                if unambiguous_for_top_p(logits, 0.7, top_k, top_p):
                    cases.append((seed, top_k, top_p,
                                  kept_by_us(logits, temperature=0.7, top_k=top_k, top_p=top_p),
                                  kept_by_transformers(logits, 0.7, top_k, top_p), n_top_k,
                                  kept_by_transformers(mx.array(exactly_k), 0.7, top_k, top_p)))
    return cases


def test_top_k_and_top_p_with_ties_at_the_top_k_bar_keep_what_transformers_keeps():
    """Top-p after top-k measures the mass over every token top-k keeps, the tokens tied with the k-th
    included (transformers renormalises over them): the cut moves with them."""
    for seed, top_k, top_p, ours, theirs, _, _ in top_k_top_p_cases():
        assert ours == theirs, (seed, top_k, top_p)


def test_top_k_and_top_p_ties_are_really_exercised():
    cases = top_k_top_p_cases()
    assert len(cases) > 30
    # Cases where top-p cuts inside what top-k keeps, at a place that the tied tokens move ...
    moved = [c for c in cases if len(c[4]) < c[5] and c[4] != c[6]]
    # ... and cases where top-p keeps all of it, the tokens tied at the top-k bar included.
    whole = [c for c in cases if len(c[4]) == c[5]]
    assert len(moved) >= 5 and len(whole) >= 3, (len(moved), len(whole))


def test_top_p_zero_keeps_the_likeliest_token_alone():
    """transformers keeps at least one token (min_tokens_to_keep); so do we: top_p 0 is greedy."""
    logits = mx.random.normal((4096,), key=mx.random.key(7)) * 2
    assert kept_by_us(logits, temperature=0.8, top_p=0.0) == {int(mx.argmax(logits))}
    assert kept_by_us(logits, temperature=0.8, top_k=20, top_p=0.0) == {int(mx.argmax(logits))}


def test_top_p_keeps_tokens_tied_with_the_last_one_kept():
    logits = mx.log(mx.array([0.4, 0.2, 0.2, 0.1, 0.1]))
    # 0.4 < 0.5 so the next token stays; the other 0.2 is equally likely, so it stays with it.
    assert kept_by_us(logits, temperature=1.0, top_p=0.5) == {0, 1, 2}


def test_presence_penalty_lowers_each_picked_token_once():
    logits = mx.array([2.0, 1.5, 1.0, 0.0])
    new_reply = li.use_extra_sampling(0.0, 0.8, 4)  # greedy, remembering what it picked
    sample = li.sample
    picked = [li.sample(logits, li.Sampling(), mx.random.key(0)).item() for _ in range(4)]
    # 2.0 - 0.8 < 1.5, then 1.5 - 0.8 < 1.2, then both penalised once, however often picked.
    assert picked == [0, 1, 0, 0]
    new_reply()  # before the next reply: it starts afresh, the same sampler
    assert li.sample is sample
    assert [li.sample(logits, li.Sampling(), mx.random.key(0)).item() for _ in range(2)] == [0, 1]


def penalised_from_scratch(model, prompt, penalty, n, seen=()):
    """Greedy with a presence penalty, recomputing everything at each step: the tokens counted are the
    reply's so far (plus `seen`, to show what counting others would change)."""
    _, config, _, _ = model
    expected, counted = [], np.zeros(config.vocab_size, np.float32)
    counted[list(seen)] = 1
    for _ in range(n):
        logits = np.array(from_scratch(model, prompt + expected)) - penalty * counted
        expected.append(int(np.argmax(logits)))
        counted[expected[-1]] = 1
    return expected


def test_the_presence_penalty_spares_the_prompts_tokens(model):
    """A prompt ending where the model repeats one of its tokens next: that token is not yet in the
    reply, so it is not penalised, and the reply goes on as the reference loop's."""
    _, config, weights, tokenizer = model
    start = tokenizer.encode("The capital of France is").ids
    plain = [t for t, _ in li.generate(start, weights, config, 40)]
    j = next(j for j in range(len(plain)) if plain[j] in start + plain[:j])  # the first repeat
    prompt = start + plain[:j]  # it ends where the greedy reply would repeat a prompt token
    li.use_extra_sampling(0.0, 2.0, config.vocab_size)
    got = [t for t, _ in li.generate(prompt, weights, config, 16)]
    assert got[0] == plain[j] and got[0] in prompt
    assert got == penalised_from_scratch(model, prompt, 2.0, 16)
    # Counting the prompt's tokens would change the reply from its first token on.
    assert penalised_from_scratch(model, prompt, 2.0, 1, seen=prompt)[0] != got[0]


def test_each_chat_reply_has_its_own_presence_penalty(model, monkeypatch):
    """In a chat, the earlier replies are part of the prompt: the penalty of the next reply counts
    only its own tokens (chat_loop calls new_reply before each, which starts the sampler afresh).
    The same message twice: the second reply says a token of the first (40 tokens each)."""
    _, config, _, _ = model
    chat = make_chat(model)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"One\nOne\n")))
    new_reply = li.use_extra_sampling(0.0, 2.0, config.vocab_size)
    assert cli.chat_loop(chat, li.text_stream, 40, li.Sampling(), {IM_END}, hide_think=False, new_reply=new_reply) == 0
    expected = make_chat(model)
    for message in ("One", "One"):
        reply = penalised_from_scratch(model, expected.prompt_ids(message), 2.0, 40)
        expected.turns.append((message, reply))
    assert chat.turns == expected.turns
    # Had the second reply's penalty counted the first reply, the second reply would differ.
    first_reply = expected.turns[0][1]
    expected.turns.pop()
    assert penalised_from_scratch(model, expected.prompt_ids("One"), 2.0, 40,
                                  seen=first_reply) != chat.turns[1][1]


def test_generate_applies_the_presence_penalty_to_the_reply_so_far(model):
    """Against a plain loop that recomputes everything and penalises the tokens seen so far."""
    _, config, weights, tokenizer = model
    prompt = tokenizer.encode("The capital of France is").ids
    penalty = 2.0
    plain = [t for t, _ in li.generate(prompt, weights, config, 16)]  # before sample is replaced
    li.use_extra_sampling(0.0, penalty, config.vocab_size)
    got = [t for t, _ in li.generate(prompt, weights, config, 16)]
    expected, seen = [], np.zeros(config.vocab_size, np.float32)
    for _ in range(16):
        logits = np.array(from_scratch(model, prompt + expected)) - penalty * seen
        expected.append(int(np.argmax(logits)))
        seen[expected[-1]] = 1
    assert got == expected
    assert plain != got  # the random model repeats itself without the penalty
