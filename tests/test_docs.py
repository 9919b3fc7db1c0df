"""The documentation holds together: docs/README.md indexes every page and every study, every relative
link in the README and docs/ names a file that exists, every test they cite by name exists, and the
README stays one sitting long."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.name != "README.md")


def test_the_docs_index_names_every_page_and_study_with_a_line_on_what_it_answers():
    index = (DOCS / "README.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| \[[^\]]+\]\(([^)]+)\) \| (.+) \|$", index, re.M)}
    for page in pages():
        name = page.relative_to(DOCS).as_posix()
        assert name in rows, f"docs/README.md does not index {name}"
        assert len(rows[name].split()) >= 5, f"docs/README.md's line on {name} says too little: {rows[name]!r}"


def test_every_relative_link_in_the_readme_and_docs_names_a_file_that_exists():
    broken = []
    for doc in [ROOT / "README.md", ROOT / "tests" / "README.md", DOCS / "README.md", *pages()]:
        for target in LINK.findall(doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_readme_is_read_in_one_sitting():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md is {len(lines)} lines (at most 200: topic pages go in docs/)"
    assert "## Where the code is" in lines and "## Two commands" in lines


TEST_NAME = re.compile(r"(?<![\w/.-])(test_\w+)(\.py)?")
"""A test file (test_x.py) or a test function (test_x, or the name in tests/test_x.py::test_x) cited in prose."""


def test_every_test_the_readme_and_docs_cite_exists():
    """A page that cites a test by name points a reader at it: the file, or a ``def test_...`` in tests/,
    must exist under that name (a name broken across two lines reads as a name that does not)."""
    tests = ROOT / "tests"
    files = {p.name for p in tests.glob("test_*.py")}
    defined = {name for p in tests.glob("*.py")
               for name in re.findall(r"^\s*(?:async\s+)?def (test_\w+)", p.read_text(), re.M)}
    missing = []
    for doc in [ROOT / "README.md", tests / "README.md", DOCS / "README.md", *pages()]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for name, py in TEST_NAME.findall(line):
                if (name + ".py" not in files) if py else (name not in defined and name + ".py" not in files):
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {name}{py}")
    assert not missing, "tests cited that do not exist:\n" + "\n".join(missing)
