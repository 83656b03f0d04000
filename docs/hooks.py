"""MkDocs hooks (``mkdocs.yml``: ``hooks``): the pages generated from the repository when the site is built.

- ``reference/config.md`` from ``conf/`` (``scripts/config_reference.py``): the build fails on an option or a field
  without a comment, naming each.
- ``index.md``, the landing page, is the README itself (not a second copy): its links into ``docs/`` are made
  relative to the site, and links to the repository's other files point at them on the source host
  (``repo_url`` in ``mkdocs.yml``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def on_pre_build(config, **kwargs) -> None:
    reference = _config_reference()
    found = reference.options()
    missing = reference.problems(found)
    if missing:
        raise PluginError("conf/ has options or fields without a comment (scripts/config_reference.py):\n"
                          + "\n".join(missing))
    reference.OUT.parent.mkdir(parents=True, exist_ok=True)
    text = reference.markdown(found)
    if not reference.OUT.is_file() or reference.OUT.read_text() != text:
        reference.OUT.write_text(text)


def readme_as_index(text: str, repo_url: str | None) -> str:
    """The README with links into docs/ made relative to the site and other repository links made absolute."""
    def link(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            return match.group(0)
        if target.startswith("docs/"):
            return f"{match.group(1)}({target.removeprefix('docs/')})"
        if repo_url:
            return f"{match.group(1)}({repo_url.rstrip('/')}/blob/main/{target})"
        return match.group(1)  # no source host named: the text without the link
    return re.sub(r"(\[[^\]]*\])\(([^)\s]+)\)", link, text)


def on_files(files, config, **kwargs):
    text = readme_as_index((ROOT / "README.md").read_text(), config.get("repo_url"))
    files.append(File.generated(config, "index.md", content=text))
    return files
