"""The documentation read off the code is current (scripts/generate_docs.py --check), and the
README stays a five-minute read. The site itself is built with `mkdocs build --strict` in
.ci/run (a broken link, a page outside the nav or unreachable fails it)."""

import re
import subprocess
import sys
from pathlib import Path

from moemerge.merge.registry import METHOD_NAMES
from moemerge.recipe.kinds import KINDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_generated_pages_and_tables_are_current():
    done = subprocess.run([sys.executable, "scripts/generate_docs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"run python scripts/generate_docs.py:\n{done.stdout}{done.stderr}"


def test_the_check_fails_on_a_stale_table(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import generate_docs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stale = README.replace("| `moemerge build` |", "| `moemerge built` |")
    assert stale != README and generate_docs.with_blocks(stale) == README


def test_the_readme_is_short_and_says_what_the_code_has():
    assert len(README.splitlines()) <= 250
    assert f"{len(METHOD_NAMES)} methods" in README
    for kind in KINDS:  # every kind in the support table, every method in the methods table
        shown = "moe" if kind.name == "token_routed" else kind.tag.replace("moe:", "moe, ")
        assert f"| `{shown}` |" in README
    assert all(f"| `{name}` |" in README for name in METHOD_NAMES)
    assert "TESTS_PARAGRAPH" not in README


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    listed = set(re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.M))
    assert pages == listed
