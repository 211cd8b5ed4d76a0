"""Section 22, speculative decoding: a draft model proposes, the target checks.

Greedy, the tokens are the target's own, whatever the draft. Sampled, each token is distributed as
the target's draw (a chi-square test of the acceptance rule on a tiny vocabulary), each proposal is
checked against its own positions' p and q, and a draft that is the target passes every proposal.
After rejections, both caches hold what a run that never saw the rejected tokens holds. The command
line's flags are checked in tests/test_cli.py and tests/test_chat_cli.py.
"""

import itertools

import mlx.core as mx
import pytest

import llm_inference as li
from tests.checkpoint import QWEN3_0_6B_CONFIG, TINY_CONFIG, random_weights

PROMPT = [785, 315, 374, 13, 576]  # ids below the small vocabulary's 1024
SMALL = QWEN3_0_6B_CONFIG | TINY_CONFIG | {"vocab_size": 1024}  # a forward pass in about a ms


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(config, the target's weights, {draft: weights}): a tiny random Qwen3 with a 1024-token
    vocabulary in float32, and drafts that agree with it always (itself), sometimes (its 4-bit
    copy) and almost never (another random model of its shape)."""
    folders = {}
    for seed in (0, 1):
        folders[seed] = tmp_path_factory.mktemp(f"small-{seed}")
        mx.save_safetensors(str(folders[seed] / "model.safetensors"), random_weights(SMALL, seed))
    config = li.Config(**{name: SMALL[name] for name in li.Config.__annotations__})
    target = li.load_weights(folders[0], config, mx.float32)
    drafts = {"itself": target, "another": li.load_weights(folders[1], config, mx.float32)}
    li.use_quantization(4)
    drafts["4-bit"] = li.load_weights(folders[0], config, mx.float32)
    return config, target, drafts


PLAIN = {"make_cache": li.make_cache, "generate_long": li.generate_long}  # as imported


def speculative(config, draft, k, min_p=0.0):
    """From now on li.generate_long drafts with `draft` (of config's shape); returns its rounds:
    (accepted, proposed) per target pass."""
    li.replace(linear=li.quantized_linear, embed=li.quantized_embed, **PLAIN)  # serve both
    return li.use_speculative((draft, config), k, min_p)


def test_greedy_the_tokens_are_the_targets_whatever_the_draft(models):
    config, target, drafts = models
    plain = [t for t, _ in li.generate(PROMPT, target, config, 10)]
    accepted = {}
    for name, draft in drafts.items():
        for k in (1, 2, 4, 8):
            rounds = speculative(config, draft, k)
            assert [t for t, _ in li.generate_long(PROMPT, target, config, 10)] == plain, (name, k)
            accepted[name, k] = sum(n for n, _ in rounds) / sum(k for _, k in rounds)
    assert all(accepted["itself", k] == 1 for k in (1, 2, 4, 8))
    assert 0 < accepted["4-bit", 1] < 1 and accepted["another", 1] < 0.2, accepted


def test_sampled_a_draft_that_is_the_target_passes_every_proposal(models):
    """Drafted by the target itself, q equals p, so min(1, p(d) / q(d)) = 1 and every proposal
    passes. A round that compared a proposal with another position's p or q, or drew it from
    another distribution than q, would reject some."""
    config, target, drafts = models
    rounds = speculative(config, drafts["itself"], 4)
    sampling = li.Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=3)
    tokens = [t for t, _ in li.generate_long(PROMPT, target, config, 21, sampling)]
    assert len(tokens) == 21 and len(rounds) == 4  # the first token, then 5 a round
    assert all(n == k == 4 for n, k in rounds), rounds


def test_sampled_each_proposal_is_checked_against_its_own_positions(models, monkeypatch):
    """In each round, verify() gets for proposal i the target's p and the draft's q at i's
    position: what fresh passes of each model over the tokens so far give (and p's last row, after
    the last proposal)."""
    config, target, drafts = models
    rounds, verify, calls = speculative(config, drafts["another"], 3), li.verify, []

    def spy(p, q, proposals, *keys):
        calls.append((p, q, proposals))
        return verify(p, q, proposals, *keys)
    monkeypatch.setattr(li, "verify", spy)
    sampling = li.Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=3)
    tokens = [t for t, _ in li.generate_long(PROMPT, target, config, 12, sampling)]
    start = len(PROMPT) + 1  # the first token comes from the prefill
    for (p, q, proposals), (n, k) in zip(calls, rounds):
        ids = mx.array(PROMPT + tokens[: start - len(PROMPT)] + proposals.tolist())
        for weights, probs, rows in ((target, p, k + 1), (drafts["another"], q, k)):
            logits = li.forward(ids, weights, config, PLAIN["make_cache"](config), last_only=False)
            fresh = li.distribution(logits[start - 1 : start - 1 + rows], sampling)
            assert mx.allclose(probs, fresh, atol=1e-5).item()
        start += n + 1
    assert len(calls) == len(rounds) > 2


def test_sampled_with_min_p_each_token_is_one_the_targets_min_p_keeps(models):
    """--min-p with a draft: sample() draws the first token and the proposals with min-p (section
    17, as main() sets it up), and p and q in verify() must filter by it too. Then every token out,
    a passed proposal or a draw from the residual or from p, is one that the target's logits at its
    position keep after min-p."""
    config, target, drafts = models
    sampling, min_p = li.Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=4), 0.2
    rounds = speculative(config, drafts["4-bit"], 3, min_p)
    li.use_extra_sampling(min_p, 0.0, config.vocab_size)
    out = list(li.generate_long(PROMPT, target, config, 60, sampling))
    kept = [mx.isfinite(li.filter_min_p(li.filter_logits(logits, sampling), min_p))[token].item()
            for token, logits in out]
    assert len(out) == 60 and all(kept), kept.count(False)
    assert 0 < sum(n for n, _ in rounds) < 3 * len(rounds)  # proposals accepted, and rejected


def test_after_rejections_both_caches_hold_what_a_plain_run_holds(models):
    """Every position a cache holds equals a fresh prefill's of the tokens the run yielded: the
    rejected proposals left nothing behind, in the target's cache or the draft's."""
    config, target, drafts = models
    rounds = speculative(config, drafts["4-bit"], 4)
    cache = li.make_cache(config)  # the target's layers, then the draft's
    out = [t for t, _ in li.generate_long(PROMPT, target, config, 16, cache=cache)]
    n = config.num_hidden_layers
    for weights, layers in ((target, cache[:n]), (drafts["4-bit"], cache[n:])):
        held = layers[0].offset
        assert held >= len(PROMPT) + 14  # all but the last token or two
        fresh = li.make_cache(config)[:n]
        li.forward(mx.array((PROMPT + out)[:held]), weights, config, fresh)
        for ours, theirs in zip(layers, fresh):
            assert ours.offset == held
            for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert mx.allclose(a[..., :held, :], b[..., :held, :], atol=1e-4).item()
    assert 0 < sum(n for n, _ in rounds) < 4 * len(rounds)  # proposals accepted, and rejected


def test_max_tokens_bounds_the_tokens_as_in_generate(models):
    """A drafted run yields as many tokens as generate() does: none for max_tokens 0 (at most 5
    are taken here, as with no end token a drafted run could go on for ever), one for 1."""
    config, target, drafts = models
    speculative(config, drafts["itself"], 2)
    for max_tokens in (0, 1, 4):
        plain = [t for t, _ in li.generate(PROMPT, target, config, max_tokens)]
        drafted = [t for t, _ in itertools.islice(
            li.generate_long(PROMPT, target, config, max_tokens), 5)]
        assert drafted == plain and len(plain) == max_tokens, max_tokens


def chi_square(counts, expected):
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected) if e > 0)


def test_sampled_after_every_proposal_passed_the_extra_token_is_drawn_from_p():
    """One round with k = 1, 20,000 times at once, on an 8-token vocabulary: when the proposal
    passes, the extra token, drawn after it, follows p's row there, not the residual max(0, p - q)
    a rejection draws from. Chi-square over the rounds that passed, 7 degrees of freedom: 24.3 is
    the 0.1% level (about 6 here, about 8,000 from the residual)."""
    sampling = li.Sampling(temperature=1.0, top_k=0, top_p=1.0)
    logits = mx.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0],  # p, at the proposal
                       [-1.0, 0.0, 1.0, 2.0, 0.5, 1.5, -0.5, -2.0],  # p, after it
                       [1.5, 2.0, 1.0, 0.0, 0.5, -0.5, -1.0, -2.0]])  # q, at the proposal
    probs = li.distribution(logits, sampling)  # (3, 8)
    p, q = probs[:2], probs[2:]
    n = 20000
    proposals = mx.random.categorical(mx.log(q), shape=(n, 1), key=mx.random.key(1))  # (n, 1)
    passed, extra = li.verify(mx.broadcast_to(p, (n, 2, 8)), mx.broadcast_to(q, (n, 1, 8)),
                              proposals, *mx.random.split(mx.random.key(2)))
    passed = passed[:, 0]
    counts = [(passed & (extra[:, 1] == token)).sum().item() for token in range(8)]
    expected = [passed.sum().item() * x for x in p[1].tolist()]
    assert chi_square(counts, expected) < 24.3, (counts, expected)
    assert 0.2 < passed.mean().item() < 0.9  # enough rounds passed, and not all


def test_sampled_each_token_is_distributed_as_the_targets_draw():
    """One round with k = 1, 20,000 times at once, on an 8-token vocabulary: the first token out
    (the proposal if it passed, else the residual's draw) follows p, the target's distribution after
    temperature, top-k and min-p, and is never a token they removed. Chi-square, 4 degrees of
    freedom (5 tokens left): 18.5 is the 0.1% level."""
    sampling = li.Sampling(temperature=0.8, top_k=7, top_p=1.0)
    target = mx.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    draft = mx.array([-1.0, 0.0, 1.0, 1.5, 0.5, 2.0, -0.5, -3.0])
    p, q = li.distribution(mx.stack([target, draft]), sampling, 0.05)  # (2, 8): two rows
    n = 20000
    proposals = mx.random.categorical(mx.log(q), shape=(n, 1), key=mx.random.key(1))  # (n, 1)
    p_rounds = mx.broadcast_to(mx.stack([p, p]), (n, 2, 8))  # row 2: after the proposal
    passed, extra = li.verify(p_rounds, mx.broadcast_to(q[None], (n, 1, 8)), proposals,
                              *mx.random.split(mx.random.key(2)))
    first = mx.where(passed[:, 0], proposals[:, 0], extra[:, 0])
    counts = [(first == token).sum().item() for token in range(8)]
    expected = [n * x for x in p.tolist()]
    removed = [token for token in range(8) if expected[token] == 0]
    assert removed == [5, 6, 7] and all(counts[token] == 0 for token in removed)  # min-p, top-k
    assert chi_square(counts, expected) < 18.5, (counts, expected)
    assert 0.2 < passed.mean().item() < 0.8  # both ways out were taken
