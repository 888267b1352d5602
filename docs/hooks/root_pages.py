"""MkDocs hook: README.md and RESULTS.md (at the repository root, outside `docs/`) become the site's home page
and its results page, so every page links to them with the same relative paths that work on a code host.

Links are rewritten only in the site's copies: `docs/x.md` -> `x.md` in the two root pages, `../README.md` ->
`index.md` and `../RESULTS.md` -> `results.md` in the pages under `docs/`. Any other target is left as written,
so a broken link still fails `mkdocs build --strict`.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

# The repository's root pages and the site page each becomes.
ROOT_PAGES = {"README.md": "index.md", "RESULTS.md": "results.md"}
# A Markdown link or image target: `](target)` or `](target#anchor)`, relative targets only.
LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(#[^)\s]*)?\)")


def _root_target(target: str) -> str:
    """Where a link written in a root page points inside the site."""
    if target in ROOT_PAGES:
        return ROOT_PAGES[target]
    if target.startswith("docs/"):
        return target.removeprefix("docs/")
    return target


def _docs_target(target: str) -> str:
    """Where a link written in a page under docs/ points inside the site."""
    if target.startswith("../") and target.removeprefix("../") in ROOT_PAGES:
        return ROOT_PAGES[target.removeprefix("../")]
    return target


def _rewrite(markdown: str, where: object) -> str:
    """Apply a target mapping (`_root_target` or `_docs_target`) to every relative link in `markdown`."""
    return LINK.sub(lambda m: f"]({where(m.group(1))}{m.group(2) or ''})", markdown)  # type: ignore[operator]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the root pages to the site, their links rewritten for their place in it."""
    root = Path(config.config_file_path).parent
    for source, page in ROOT_PAGES.items():
        text = (root / source).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=_rewrite(text, _root_target)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point the docs pages' links to the root pages at the site's copies."""
    if page.file.src_uri in ROOT_PAGES.values():
        return markdown
    return _rewrite(markdown, _docs_target)
