"""MkDocs hooks (mkdocs.yml `hooks:`): the documentation site also carries the repository's
Markdown that docs/ links to (the README, benchmarks/README.md and the result files), under
`repo/`, and every relative link is checked, whichever tree it points into.

A link from a page to another Markdown file of the site is rewritten relative to where the two
pages are served; a link to another file of the repository (a .py module, a recipe) becomes
its path in code type, since the site does not serve it; a link to nothing is a warning, which
`mkdocs build --strict` (.ci/run) turns into a failure. A repository page that no page links to
is a warning too: every page is reachable from the index."""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
CARRIED = ("README.md", "benchmarks/README.md", "benchmarks/*/README.md",
           "benchmarks/results/*.md", "benchmarks/results/*.png")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
log = logging.getLogger("mkdocs.plugins.moemerge")
_linked: set[str] = set()
_carried: dict[Path, str] = {}  # repository path -> site uri


def on_files(files, config):
    for pattern in CARRIED:
        for path in sorted(ROOT.glob(pattern)):
            uri = "repo/" + path.relative_to(ROOT).as_posix()
            _carried[path.resolve()] = uri
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def _site_uri(path: Path, docs: Path) -> str | None:
    if path in _carried:
        return _carried[path]
    if path.is_relative_to(docs) and path.suffix == ".md":
        return path.relative_to(docs).as_posix()
    return None


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    source = Path(page.file.abs_src_path).resolve()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match[0]
        file_part, _, anchor = target.partition("#")
        resolved = (source.parent / file_part).resolve()
        uri = _site_uri(resolved, docs)
        if uri is not None:
            _linked.add(uri)
            relative = posixpath.relpath(uri, here or ".")
            return f"{bang}[{text}]({relative}{'#' + anchor if anchor else ''})"
        if resolved.exists() and resolved.is_relative_to(ROOT):
            shown = resolved.relative_to(ROOT).as_posix()
            plain = text.strip("`")
            return f"`{shown}`" if plain in (shown, resolved.name, file_part) else \
                f"{text} (`{shown}`)"
        log.warning(f"{page.file.src_uri}: the link to {target!r} leads to nothing "
                    f"({os.path.relpath(resolved, ROOT)})")
        return match[0]

    return LINK.sub(rewrite, markdown)


def on_post_build(config):
    for uri in sorted(set(_carried.values()) - _linked):
        log.warning(f"{uri}: no page links to it, so it cannot be reached from the index")
