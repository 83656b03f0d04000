"""The documentation site's generated pages: the configuration reference from conf/ (every option and field with
its comment, or the build fails) and the landing page from the README (its links made to work on the site)."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.conftest import ROOT, installed


def _module(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


reference = _module("config_reference", ROOT / "scripts" / "config_reference.py")


def test_every_option_and_field_of_conf_has_its_comment_and_a_row_in_the_reference():
    found = reference.options()
    assert reference.problems(found) == []
    page = reference.markdown(found)
    assert "### `algo=ipo`" in page and "### `eval=generate`" in page and "### `experiment=objective_frontier`" in page
    assert "| `beta` | `0.3` | KL strength, > 0;" in page  # conf/algo/dpo.yaml's field, default and comment
    assert "| `samples` | `4` | completions sampled per prompt" in page  # conf/eval/generate.yaml
    assert len([o for o in found if not o.preset]) > 100
    # committed, so that the README's link to it resolves in a clone (red: a field's comment changed, not regenerated)
    assert reference.OUT.read_text() == page, "docs/reference/config.md is stale: python scripts/config_reference.py"


def test_an_option_or_a_field_without_a_comment_is_named(tmp_path):
    """Red when the check reads only the options' opening comments, or only the fields."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    dpo = conf / "algo" / "dpo.yaml"
    dpo.write_text(dpo.read_text().replace("beta: 0.3                  # KL strength", "beta: 0.3"))
    lion = conf / "optimizer" / "lion.yaml"
    lion.write_text("\n".join(line for line in lion.read_text().splitlines() if not line.startswith("#")) + "\n")
    found = reference.problems(reference.options(conf))
    assert found == [f"{dpo}: field beta has no comment (add '# what it is' on its line)",
                     f"{lion}: no opening comment (say what the option is and how to choose it, in '# ...' lines at "
                     "the top)"]


def test_every_link_of_the_readme_names_a_file_a_clone_has():
    """A file the README links is committed, not made by a build (red: docs/reference/config.md ignored by git)."""
    import re
    import subprocess

    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.splitlines())
    links = {link.split("#")[0] for link in re.findall(r"\]\(([^)]+)\)", (ROOT / "README.md").read_text())
             if not link.startswith(("http://", "https://", "#"))}
    assert links and "docs/reference/config.md" in links
    assert sorted(link for link in links if link not in tracked) == []


@pytest.mark.skipif(not installed("mkdocs"), reason="the docs extra: pip install -e '.[docs]'")
def test_the_landing_page_is_the_readme_with_its_links_made_for_the_site():
    hooks = _module("docs_hooks", ROOT / "docs" / "hooks.py")
    text = "see [the page](docs/evaluation/x.md), [a script](benchmarks/bench.py), [web](https://a.b/c), [top](#two)"
    assert hooks.readme_as_index(text, None) == (
        "see [the page](evaluation/x.md), [a script], [web](https://a.b/c), [top](#two)")
    assert hooks.readme_as_index(text, "https://host/org/rlhf/") == (
        "see [the page](evaluation/x.md), [a script](https://host/org/rlhf/blob/main/benchmarks/bench.py), "
        "[web](https://a.b/c), [top](#two)")
