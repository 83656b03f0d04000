"""Where CI runs the tests (RLHF_TESTS_REQUIRE_EXTRAS=1, set by .ci/run), a test that needs an optional dependency
runs, and fails if it is missing, instead of skipping: a skip would read as a pass."""

from __future__ import annotations

import importlib.util

from tests import conftest
from tests.conftest import ROOT


def test_a_missing_extra_skips_locally_and_runs_where_ci_requires_the_extras(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(conftest, "EXTRAS_REQUIRED", False)
    assert not conftest.installed("deepspeed")
    monkeypatch.setattr(conftest, "EXTRAS_REQUIRED", True)
    assert conftest.installed("deepspeed")  # the test runs, and its import of deepspeed fails it


def test_ci_requires_the_extras_it_installs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export RLHF_TESTS_REQUIRE_EXTRAS=1" in ci
    assert ci.index("RLHF_TESTS_REQUIRE_EXTRAS=1") < ci.index("pytest")
