"""Which W&B mode a run gets: logger.wandb.mode, then WANDB_MODE, then online only when an API key is configured."""

from __future__ import annotations

import pytest

from rlhf.core.errors import UserError
from rlhf.telemetry import loggers as rlhf_logging
from rlhf.telemetry.loggers import Loggers, WandbLogger, wandb_mode


@pytest.fixture
def no_wandb_env(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key


@pytest.mark.parametrize(("configured", "env", "expected"), [
    (None, {}, "offline"),
    (None, {"WANDB_API_KEY": "k"}, "online"),
    (None, {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),  # the environment's mode beats the key
    (None, {"WANDB_MODE": "disabled"}, "disabled"),
    (None, {"WANDB_DISABLED": "true", "WANDB_API_KEY": "k"}, "disabled"),
    ("offline", {"WANDB_API_KEY": "k", "WANDB_MODE": "online"}, "offline"),  # the config beats both
    ("online", {"WANDB_MODE": "offline"}, "online"),
    ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
])
def test_mode_precedence(no_wandb_env, monkeypatch, configured, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert wandb_mode(configured) == expected


def test_a_netrc_key_means_online(no_wandb_env, tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_mode(None) == "online"


class _FakeRun:
    def __init__(self) -> None:
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        pass


def test_the_logger_starts_wandb_offline_when_wandb_mode_says_so_despite_a_key(no_wandb_env, monkeypatch, tmp_path):
    import wandb

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        return _FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-never-used-online")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = Loggers([WandbLogger(project="p")])  # as the loop builds logger=wandb: metrics.jsonl too
    logger.start(str(tmp_path / "run"), {"seed": 0})
    logger.log({"train/loss": 1.0}, step=1)
    logger.finish()
    assert calls[0]["mode"] == "offline"
    assert calls[0]["dir"] == str(tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip() == '{"step": 1, "train/loss": 1.0}'

    WandbLogger(project="p", mode="disabled").start(str(tmp_path / "run2"), {})
    assert calls[1]["mode"] == "disabled"
    assert rlhf_logging.wandb_mode("disabled") == "disabled"


def test_an_offline_wandb_run_keeps_the_api_key_out_of_its_files(no_wandb_env, monkeypatch, tmp_path):
    """A real (offline) W&B run with a key in the environment: it stays offline, and its files hold no key."""
    key = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B key
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_42")
    logger = WandbLogger(project="p")
    logger.start(str(tmp_path / "run"), {"seed": 0})
    logger.log({"train/loss": 1.0}, step=1)
    logger.finish()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)  # W&B wrote its offline run here
    for path in files:
        data = path.read_bytes()
        assert key.encode() not in data and b"hf_secret_token_42" not in data, path


def test_a_resumed_run_continues_the_same_wandb_run(no_wandb_env, monkeypatch, tmp_path):
    import wandb

    seen = []

    class Run:
        def log(self, *args, **kwargs): ...
        def finish(self): ...

    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.append(kwargs) or Run())
    WandbLogger(mode="offline").start(str(tmp_path), {})
    WandbLogger(mode="offline").start(str(tmp_path), {}, resume_step=10)  # resumed: the same id
    WandbLogger(mode="offline").start(str(tmp_path), {})  # a new run in the folder: a new id
    ids = [kwargs["id"] for kwargs in seen]
    assert ids[0] == ids[1] != ids[2] and all(kwargs["resume"] == "allow" for kwargs in seen)


def test_a_resumed_wandb_run_continues_its_id_or_rewinds_to_the_checkpoint_step(no_wandb_env, monkeypatch, tmp_path):
    """Default: the same W&B id, resume="allow". logger.wandb.rewind=true: W&B's rewind to the checkpoint's step
    (resume_from="<id>?_step=<N>", and no id/resume beside it), online only, refused otherwise with the fix."""
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or _FakeRun())
    run = str(tmp_path / "run")
    WandbLogger(project="p", mode="online").start(run, {})
    run_id = (tmp_path / "run" / "wandb_run_id.txt").read_text().strip()
    assert calls[0]["id"] == run_id and calls[0]["resume"] == "allow" and "resume_from" not in calls[0]
    WandbLogger(project="p", mode="online").start(run, {}, resume_step=20)
    assert calls[1]["id"] == run_id and calls[1]["resume"] == "allow" and "resume_from" not in calls[1]
    WandbLogger(project="p", mode="online", rewind=True).start(run, {}, resume_step=20)
    assert calls[2]["resume_from"] == f"{run_id}?_step=20" and "id" not in calls[2] and "resume" not in calls[2]
    WandbLogger(project="p", mode="online", rewind=True).start(str(tmp_path / "new"), {})  # a new run: nothing to rewind
    assert "resume_from" not in calls[3]
    with pytest.raises(UserError, match="logger.wandb.rewind=true needs W&B online"):
        WandbLogger(project="p", mode="offline", rewind=True).start(run, {}, resume_step=20)


def test_tables_go_to_a_jsonl_file_cut_back_on_resume_and_to_a_wandb_table(no_wandb_env, monkeypatch, tmp_path):
    """An algorithm's tables (GRPO's sampled completions): ``samples.jsonl``, cut back to the checkpoint's step when
    the run resumes (no step twice), and a W&B table with the same rows."""
    import json

    import wandb

    fake = _FakeRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: fake)
    logger = Loggers([WandbLogger(project="p", mode="offline")])
    logger.start(str(tmp_path), {})
    for step in (1, 50, 100):
        logger.log_table("samples", [{"prompt": "ab=", "completion": "ba", "reward": 1.0}, {"prompt": "c="}], step)
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 50, 50, 100, 100]
    step, logged = fake.logged[0]
    table = logged["samples"]
    assert step == 1 and table.columns == ["step", "prompt", "completion", "reward"]
    assert table.data == [[1, "ab=", "ba", 1.0], [1, "c=", None, None]]
    resumed = Loggers([])
    resumed.start(str(tmp_path), {}, resume_step=50)  # the checkpoint of step 50: the lines of step 100 go
    resumed.log_table("samples", [{"prompt": "x="}], 100)
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 50, 50, 100]
    Loggers([]).start(str(tmp_path), {})  # a new run in the folder starts the table anew at its first row
    fresh = Loggers([])
    fresh.start(str(tmp_path), {})
    fresh.log_table("samples", [{"prompt": "y="}], 1)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 1
