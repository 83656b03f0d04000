"""Loading a model: a run folder named instead of its final/ says so; remote code stays off unless asked."""

from __future__ import annotations

import pytest

from rlhf.core import hub
from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models import loading
from rlhf.models.loading import load_policy


@pytest.fixture
def saved_tiny(tmp_path):
    """A run folder as a finished run leaves it, with the model in final/."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    policy.model.save_pretrained(run / "final")
    policy.tokenizer.save_pretrained(run / "final")
    return run


def test_a_run_folder_names_its_final_model(saved_tiny):
    with pytest.raises(UserError) as error:
        load_policy(str(saved_tiny))
    assert str(error.value) == (f"model.name_or_path={saved_tiny} is a run folder; its model is in {saved_tiny}/final. "
                                f"Fix: model.name_or_path={saved_tiny}/final")
    assert load_policy(str(saved_tiny / "final")).model.config.hidden_size == 16


def test_a_run_folder_without_final_says_why(tmp_path):
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    with pytest.raises(UserError, match=r"is a run folder; its model is in .*/run/final \(not there: the run has not "
                                        r"finished, or ran with train.save_final=false\)"):
        load_policy(str(tmp_path / "run") + "/")


def test_remote_code_is_off_unless_asked_and_passed_as_given(monkeypatch):
    """Hub ids reach transformers with trust_remote_code=False by default, and as set when set."""
    seen = []

    def capture(name, **kwargs):
        seen.append(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(hub, "cache_only", lambda *args: False)  # as if online
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", capture)
    for asked in ({}, {"trust_remote_code": True}):
        with pytest.raises(UserError, match="could not load it"):
            load_policy("someone/some-model", **asked)
    assert [kwargs["trust_remote_code"] for kwargs in seen] == [False, True]
    assert all("local_files_only" not in kwargs for kwargs in seen)
