"""The converted tokenizer.json must tokenize exactly like Qwen3.

These test the fixture builder (tests/checkpoint.py), not llm_inference.py: the other tests rely on
its tokenizer being Qwen3's. They are not counted among the tests of the script."""

import inspect
import json
import random
import unicodedata

import pytest
import tiktoken
from tokenizers import Tokenizer

from tests.checkpoint import (
    FIRST_ADDED_TOKEN_ID,
    QWEN3_ADDED_TOKENS,
    QWEN_SPLIT_REGEX,
    load_qwen_ranks,
    write_tokenizer_json,
)

ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "我喜欢吃北京烤鸭。今天天气很好！",
    "日本語のテキストとカタカナ、ひらがな。",
    "Emoji: 😀🎉👩‍👩‍👧‍👦🇫🇷 and a thumbs up 👍🏽",
    "line one\nline two\r\nline three\n\n\n",
    "\ttabs\tand   multiple   spaces   ",
    "def add(a, b):\n    return a + b  # comment\n",
    'json = {"key": [1, 2.5, null], "nested": {"x": "y"}}',
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "numbers 1234567890 and 3.14159e-10",
    "don't can't I'LL we've THEY'RE",
    "mixed<|im_start|>special<|im_end|> tokens <think>inside</think>",
    "\u00e9 composed vs e\u0301 decomposed",  # NFC turns the second into the first
]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    write_tokenizer_json(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture(scope="session")
def reference():
    """tiktoken with Qwen's ranks, regex and added tokens: the ground truth."""
    specials = {
        content: FIRST_ADDED_TOKEN_ID + offset
        for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return tiktoken.Encoding(
        "qwen3",
        pat_str=QWEN_SPLIT_REGEX,
        mergeable_ranks=load_qwen_ranks(),
        special_tokens=specials,
    )


def reference_encode(reference, tokenizer, text):
    """Qwen's encoding: NFC-normalise, then tiktoken with special tokens allowed.

    We normalise with the HF tokenizer's own NFC normaliser rather than
    Python's ``unicodedata``: the two use different Unicode versions and
    disagree on a few recently added combining marks (e.g. U+0C3C), which
    says nothing about the BPE conversion tested here.
    """
    normalized = tokenizer.normalizer.normalize_str(text)
    return reference.encode(normalized, allowed_special="all")


def test_known_encoding(tokenizer):
    assert tokenizer.encode("The capital of France is").ids == [785, 6722, 315, 9625, 374]


def test_vocab_size(tokenizer):
    assert tokenizer.get_vocab_size() == 151_669  # 151,643 BPE ranks + 26 added


@pytest.mark.parametrize(
    "content, token_id",
    [
        ("<|endoftext|>", 151643),
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<tool_call>", 151657),
        ("<|fim_prefix|>", 151659),
        ("<think>", 151667),
        ("</think>", 151668),
    ],
)
def test_special_token_ids(tokenizer, content, token_id):
    assert tokenizer.token_to_id(content) == token_id
    assert tokenizer.encode(content).ids == [token_id]


def test_added_tokens_match_qwen3(tokenizer_path):
    added = json.loads(tokenizer_path.read_text())["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == [
        (FIRST_ADDED_TOKEN_ID + offset, content, special)
        for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    ]


def test_chat_markup(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi!<|im_end|>\n").ids
    assert ids[:3] == [151644, 872, 198]  # <|im_start|> "user" "\n"
    assert 151645 in ids


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>Hi<|im_end|><think>").ids
    # <think> is an added token but not a special one in Qwen3.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hi<think>"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_matches_tiktoken_handpicked(tokenizer, reference, text):
    assert tokenizer.normalizer.normalize_str(text) == unicodedata.normalize("NFC", text)
    assert tokenizer.encode(text).ids == reference_encode(reference, tokenizer, text)


def varied_corpus() -> list[str]:
    """Source code, prose and random Unicode: several thousand strings."""
    import email, json as json_module, textwrap, unittest  # any stdlib text will do

    texts = []
    for module in (email, json_module, textwrap, unittest):
        texts += inspect.getsource(module).split("\n\n")
    for module in (textwrap, json_module.decoder, unittest.case):
        texts.append(inspect.getsource(module))  # whole files: long inputs

    rng = random.Random(0)
    alphabets = [
        (0x20, 0x7E),  # ASCII
        (0xA0, 0x24F),  # Latin-1 and Latin Extended
        (0x370, 0x4FF),  # Greek, Cyrillic
        (0x590, 0x6FF),  # Hebrew, Arabic
        (0x900, 0xE7F),  # Indic scripts, Thai
        (0x3040, 0x30FF),  # Hiragana, Katakana
        (0x4E00, 0x9FFF),  # CJK
        (0xAC00, 0xD7A3),  # Hangul
        (0x1F300, 0x1FAFF),  # Emoji
    ]
    whitespace = [" ", "  ", "\n", "\r\n", "\t", "\n\n", " \n"]
    for _ in range(2000):
        pieces = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.2:
                pieces.append(rng.choice(whitespace))
            else:
                low, high = rng.choice(alphabets)
                pieces.append(chr(rng.randint(low, high)))
        texts.append("".join(pieces))
    return texts


def test_matches_tiktoken_on_varied_corpus(tokenizer, reference):
    texts = varied_corpus()
    assert len(texts) > 2000
    mismatches = [
        text
        for text, encoding in zip(texts, tokenizer.encode_batch(texts))
        if encoding.ids != reference_encode(reference, tokenizer, text)
    ]
    assert mismatches == []


def test_round_trip_on_varied_corpus(tokenizer):
    texts = [tokenizer.normalizer.normalize_str(text) for text in varied_corpus()]
    decoded = tokenizer.decode_batch([e.ids for e in tokenizer.encode_batch(texts)])
    assert decoded == texts


def test_conversion_is_cached(tokenizer_path, tmp_path):
    copy = tmp_path / "tokenizer.json"
    write_tokenizer_json(copy)
    assert copy.read_bytes() == tokenizer_path.read_bytes()
