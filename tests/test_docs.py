"""Runs every ```python block of README.md and docs/*.md.

Each block runs in a fresh namespace under the active Keras backend, on the
CPU. A block preceded by the line `<!-- no-test -->` is skipped: it needs a
GPU, or it is a fragment (the text says which).
"""

import os
import re
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_MARK = "<!-- no-test -->"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _blocks():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    found = []
    for path in files:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            before = text[: match.start()].rstrip().splitlines()
            if before and before[-1].strip() == SKIP_MARK:
                continue
            line = text.count("\n", 0, match.start()) + 2  # First code line.
            name = f"{path.relative_to(ROOT)}:{line}"
            found.append(pytest.param(name, match.group(1), id=name))
    return found


BLOCKS = _blocks()


def test_docs_have_examples():
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]


@pytest.mark.parametrize("name, source", BLOCKS)
def test_doc_example_runs(name, source, tmp_path, monkeypatch):
    # Examples that save files write them into a scratch directory.
    monkeypatch.chdir(tmp_path)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    code = compile(source, name, "exec")
    exec(code, {"__name__": "__doc_example__"})


def test_readme_commands_exist():
    """The README's two commands name files that exist."""
    text = (ROOT / "README.md").read_text()
    for path in ("requirements.txt", "recipes/small_cnn.py", "tests/run.sh"):
        assert path in text, path
        assert (ROOT / path).is_file(), path
    assert os.access(ROOT / "tests" / "run.sh", os.R_OK)


def _anchors(path):
    """GitHub's heading anchors of a Markdown file."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen, anchors = {}, set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_links_resolve():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for path in files:
        for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in link:
                continue
            target, _, anchor = link.partition("#")
            target = (path.parent / target).resolve() if target else path
            assert target.is_file(), f"{path.name}: {link}"
            if anchor:
                assert anchor in _anchors(target), f"{path.name}: {link}"


def test_no_merge_conflict_left_in_the_docs():
    # docs/api.md once carried both sides of a merge (plan signature).
    marker = re.compile(r"^(<{7}|={7}|>{7})( |$)", re.M)
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    left = [str(p.relative_to(ROOT)) for p in files if marker.search(p.read_text())]
    assert not left
