"""The README stays short and true: at most 250 lines, a link to every docs page (each of which is in
mkdocs.yml's nav), its Python quick starts run (on a tiny model with a draft head standing in for
the real one, the server's against `eejax serve` on 127.0.0.1), and its shell commands parse with
the `eejax` command's own parser (every command, flag and choice as `--help` lists it); docs/cli.md
is what the parsers generate."""

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import jax
import pytest

import eejax
from eejax.cli import build_parser
from eejax.cli.reference import render
from eejax.engine.engine import Engine
from eejax.models import draft_head
from tests.helpers import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def run(code: str) -> str:
    """What `code` prints (stdout only: the server's loggers keep the real streams)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    return out.getvalue()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def drafted(tiny_model):
    """The tiny model with an untrained draft head: what the quick starts' smollm2-135m-eagle stands for."""
    draft = draft_head.init_draft(tiny_model.config, jax.random.PRNGKey(0), params=tiny_model.params)
    return tiny_model.with_params({**tiny_model.params, "draft": draft})


def test_the_readme_is_short_and_links_every_docs_page():
    assert len(README.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#]+)\)", README))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - {"docs/index.md"}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"
    assert all((ROOT / link).exists() for link in linked), linked
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f" {Path(page).name}" in nav for page in pages | {"docs/index.md"})


def test_the_python_quick_start_runs(drafted, monkeypatch):
    (quick_start,) = [b for b in blocks("python") if "eejax.load" in b]
    monkeypatch.setattr(eejax, "load", lambda name, **kw: drafted)
    assert run(quick_start).strip()  # its assert: drafting gives full depth's tokens


def test_the_server_quick_start_runs_against_eejax_serve(drafted):
    pytest.importorskip("openai")
    (client_code,) = [b for b in blocks("python") if "OpenAI(" in b]
    (serve_command,) = [c for b in blocks("bash") for c in commands(b) if c.startswith("eejax serve")]
    name = shlex.split(serve_command)[shlex.split(serve_command).index("--model") + 1]
    engine = Engine(drafted, max_slots=2, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    with serve_in_thread(engine, name=name) as url:
        assert '"http://127.0.0.1:8000/v1"' in client_code
        assert run(client_code.replace("http://127.0.0.1:8000/v1", url + "/v1")).strip()


def test_the_shell_commands_parse_as_the_cli_has_them():
    parser = build_parser()
    seen = 0
    for block in blocks("bash"):
        for command in commands(block):
            words = shlex.split(command)
            if words[0] == "eejax":
                parser.parse_args(words[1:])  # an unknown command, flag or choice exits with status 2
                seen += 1
            else:
                assert (ROOT / words[0]).is_file(), command
    assert seen >= 4


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="argparse lays usage out per Python version; made on 3.11")
def test_the_cli_page_is_what_the_parsers_generate():
    """docs/cli.md lists every command and flag `--help` does: `python -m eejax.cli.reference > docs/cli.md`."""
    assert (ROOT / "docs" / "cli.md").read_text() == render(build_parser()), (
        "run: python -m eejax.cli.reference > docs/cli.md"
    )


REFERENCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/results/ holds the dated log
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
LAB_NOTEBOOK = re.compile(r"\b(tried|not kept|this VM)\b", re.I)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


@pytest.mark.parametrize("page", REFERENCES, ids=lambda p: p.name)
def test_reference_pages_are_references_not_lab_notebooks(page):
    """No commit hashes, no "tried" / "not kept" / "this VM", at most 5 dates a page: dated
    measurements go to docs/results/, and a reference links them."""
    text = page.read_text()
    assert not COMMIT.findall(text), COMMIT.findall(text)
    assert not LAB_NOTEBOOK.findall(text), LAB_NOTEBOOK.findall(text)
    assert len(DATE.findall(text)) <= 5, DATE.findall(text)
