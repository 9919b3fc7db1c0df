"""The documentation holds together: docs/README.md indexes every page and every study, every relative
link in the README and docs/ names a file that exists, and the README stays one sitting long."""

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
