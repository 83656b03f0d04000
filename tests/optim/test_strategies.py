"""Every option of ``conf/optimizer`` under every strategy that splits the work over processes: the one-process
result, or a refusal before anything loads that says why. Never a run that silently applies another rule.

- ``hardware=cpu_ddp`` (2 processes x 1 micro-batch) trains as one process with 2 micro-batches accumulated, for
  every option: each process holds whole tensors and the same averaged gradients.
- ``hardware=fsdp`` and ``zero1``-``zero3`` hand the optimizer shards (FSDP2's DTensor rows, ZeRO's flat
  partitions). An option the config check refuses there (``rlhf.optim.support.sharding_refusal``) is refused by
  ``check_config`` with its reason; every other option trains as DDP does.

The 2-process runs share one launch (2 spawned processes, 1 thread each; each run about 1 s after the pair's start),
as tests/hardware/test_sharded.py does. The 8-bit options run with ``min_8bit_size=0``: the test model's matrices
(32 x 32) are below bitsandbytes' 4096 elements, which would keep their states in 32 bits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from rlhf import train
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.hardware import free_port
from rlhf.optim.support import sharding_refusal
from tests.conftest import FAST, ROOT, compose_config, fast_initial_model, installed

OPTIONS = sorted(path.stem for path in (ROOT / "conf" / "optimizer").glob("*.yaml"))
SHARDED = {"fsdp": ["hardware=fsdp"], "zero1": ["hardware=zero1"], "zero2": ["hardware=zero2"],
           "zero3": ["hardware=zero3", "hardware.param_persistence_threshold=0"]}  # 0: else every tensor stays whole
if not installed("deepspeed"):
    SHARDED = {"fsdp": SHARDED["fsdp"]}
COMMON = [*FAST, "algo=dpo", "algo.beta=3.0", "scheduler=constant", "train.max_steps=3", "train.global_batch_size=8",
          "train.eval_at_start=false", "train.max_grad_norm=0.5", "hardware.timeout_s=120"]


def _option(option: str) -> list[str]:
    """The option, with its 8-bit states 8-bit on the test model's small matrices."""
    node = yaml.safe_load((ROOT / "conf" / "optimizer" / f"{option}.yaml").read_text())
    return [f"optimizer={option}", *(["optimizer.min_8bit_size=0"] if "min_8bit_size" in node else [])]


def _refusal(option: str, strategy: str) -> str | None:
    target = yaml.safe_load((ROOT / "conf" / "optimizer" / f"{option}.yaml").read_text())["_target_"]
    from hydra.utils import get_object

    return sharding_refusal(target, get_object(target), zero=strategy != "fsdp")


ALLOWED = [(option, strategy) for option in OPTIONS for strategy in SHARDED if _refusal(option, strategy) is None]
REFUSED = [(option, strategy) for option in OPTIONS for strategy in SHARDED if _refusal(option, strategy) is not None]
# Refused options run anyway (the pair calls the loop without the config check), so that each refusal stays
# justified: red when a library learns to run there with DDP's result (then the refusal should go).
UNCHECKED = [(option, strategy) for option in ("adam8bit", "adafactor") for strategy in ("fsdp", "zero2")
             if strategy in SHARDED]
ROUNDING_SENSITIVE = {"soap"}  # see test_two_ddp_processes_train_as_one_process


@pytest.mark.parametrize(("option", "strategy"), REFUSED)
def test_an_option_that_cannot_run_sharded_is_refused_before_loading_with_its_reason(option, strategy):
    """Red when the refusal is not raised by the config check (a sharded run would apply another rule)."""
    cfg = compose_config(*COMMON, *_option(option), *SHARDED[strategy], output_dir="unused")
    with pytest.raises(UserError, match="hands the optimizer only this process's shard") as refused:
        check_config(cfg)
    assert _refusal(option, strategy) in str(refused.value) and "cpu_ddp or ddp" in str(refused.value)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _run_all(runs: dict[str, dict], env: dict[str, str]) -> dict[str, str]:
    """One rank: train every run in turn; return, per run, the error that stopped it (or "")."""
    os.environ.update(env)
    from rlhf.core.instantiate import build
    from rlhf.run import folder as run_folder
    from rlhf.run import loop

    logging.basicConfig(level=logging.WARNING)
    errors = {}
    for name, container in runs.items():
        cfg = OmegaConf.create(container)
        try:
            loop.train(cfg, build(cfg.hardware), run_folder.prepare(Path(cfg.output_dir), None))
            errors[name] = ""
        except Exception as error:  # a crash of one option is that option's failure, not the launch's
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Every option under cpu_ddp, and the allowed options under each sharded strategy, on one pair of processes."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    root = tmp_path_factory.mktemp("strategies")
    runs = {**{f"{option}-ddp": [*_option(option), "hardware=cpu_ddp"] for option in OPTIONS},
            **{f"{option}-{strategy}": [*_option(option), *SHARDED[strategy]]
               for option, strategy in ALLOWED + UNCHECKED}}
    containers = {name: OmegaConf.to_container(compose_config(
        *COMMON, *overrides, f"model.tiny.cache_dir={root / 'cache'}", output_dir=root / name), resolve=True)
        for name, overrides in runs.items()}
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "RLHF_CACHE": str(root / "cache")}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="optimizers", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=None))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        errors = elastic_launch(config, _run_all)(containers, env)
    return root, errors[0]


def _params(run: Path) -> list[torch.Tensor]:
    return [p.detach() for p in AutoModelForCausalLM.from_pretrained(run / "final").parameters()]


def _relative_difference(x: list[torch.Tensor], y: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """How far two runs from ``start`` ended apart, as a fraction of the first run's update."""
    apart = sum(((a - b) ** 2).sum() for a, b in zip(x, y, strict=True)).sqrt()
    moved = sum(((a - s) ** 2).sum() for a, s in zip(x, start, strict=True)).sqrt()
    return float(apart / moved)


@pytest.mark.serial
@pytest.mark.parametrize("option", OPTIONS)
def test_two_ddp_processes_train_as_one_process(option, pair, tmp_path):
    """Red when an optimizer's step depends on the process (a rank's own random draw, a sum over its own data).

    Every option but SOAP gives one process's parameters to 2e-6. SOAP does not, and cannot: after a few steps its statistics
    are of low rank, their eigenbases are arbitrary where eigenvalues repeat, and Adam's per-coordinate step depends
    on the basis, so rounding alone moves its result (one process with 1 micro-batch of 8 against 2 of 4: about
    half the update apart). It passes when DDP is no farther from one process than one process is from itself under
    that regrouping, with a margin of 2x."""
    root, errors = pair
    assert errors[f"{option}-ddp"] == ""
    train(compose_config(*COMMON, *_option(option), "hardware=cpu", output_dir=tmp_path / "one"))
    one, ddp = _params(tmp_path / "one"), _params(root / f"{option}-ddp")
    if option not in ROUNDING_SENSITIVE:
        for a, b in zip(one, ddp, strict=True):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
        return
    train(compose_config(*COMMON, *_option(option), "hardware=cpu", "train.per_device_batch_size=8",
                         output_dir=tmp_path / "regrouped"))
    start = list(fast_initial_model().parameters())
    rounding = _relative_difference(one, _params(tmp_path / "regrouped"), start)
    distributed = _relative_difference(one, ddp, start)
    assert rounding > 1e-3 and distributed <= 2 * rounding, (
        f"optimizer={option}: DDP ended {distributed:.2e} of the update from one process, whose own regrouping of "
        f"the same batch moves it by {rounding:.2e}")


@pytest.mark.serial
@pytest.mark.parametrize(("option", "strategy"), ALLOWED)
def test_an_option_that_runs_sharded_trains_as_ddp(option, strategy, pair):
    """Red when a sharded strategy changes what the optimizer does (a shard-shaped rule, a state of another size)."""
    root, errors = pair
    assert errors[f"{option}-{strategy}"] == ""
    for a, b in zip(_params(root / f"{option}-ddp"), _params(root / f"{option}-{strategy}"), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.serial
@pytest.mark.parametrize(("option", "strategy"), UNCHECKED)
def test_a_refused_option_run_anyway_fails_or_differs_from_ddp(option, strategy, pair):
    """What the refusal prevents, measured: under FSDP2 the run raises on the DTensor shards; under ZeRO it runs and
    ends away from DDP's parameters (red when a library learns to run there as DDP does: then the refusal goes)."""
    root, errors = pair
    error = errors[f"{option}-{strategy}"]
    if strategy == "fsdp":  # bitsandbytes' kernel and Adafactor's in-place ops meet FSDP2's DTensor shards
        assert "DTensor" in error, error or "it ran"
        return
    assert error == "", error  # ZeRO runs them, on flat partitions: another rule
    ddp, sharded = _params(root / f"{option}-ddp"), _params(root / f"{option}-{strategy}")
    assert not all(torch.allclose(b, a, atol=1e-6, rtol=1e-5) for a, b in zip(ddp, sharded, strict=True)), (
        f"optimizer={option} under hardware={strategy} trained as DDP: its refusal (rlhf/optim/support.py) can go")


@pytest.mark.parametrize(("target", "only_under_zero"), [
    ("bitsandbytes.optim.AdamW8bit", False), ("bitsandbytes.optim.adam.Adam8bit", False),
    ("bitsandbytes.optim.PagedLion8bit", False), ("heavyball.SOAP", False), ("torch.optim.Muon", False),
    ("prodigyopt.Prodigy", False), ("adam_mini.Adam_mini", False), ("apollo_torch.APOLLOAdamW", False),
    ("schedulefree.AdamWScheduleFree", True)])
def test_a_library_class_in_a_users_own_option_is_refused_as_the_shipped_option_is(target, only_under_zero):
    """Red when the refusal reads the YAML's name only (another bitsandbytes class, the same class by another path)."""
    from hydra.utils import get_object

    assert sharding_refusal(target, get_object(target), zero=True)
    assert (sharding_refusal(target, get_object(target), zero=False) is None) == only_under_zero


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "torch.optim.SGD", "lion_pytorch.Lion"])
def test_element_wise_optimizers_run_sharded(target):
    from hydra.utils import get_object

    assert sharding_refusal(target, get_object(target)) is None


def test_an_option_refused_under_zero_only_is_pointed_to_fsdp():
    cfg = compose_config(*COMMON, "optimizer=schedule_free_adamw", "hardware=zero2", output_dir="unused")
    with pytest.raises(UserError, match=r"Fix: hardware=fsdp \(it steps the model's own parameters\), cpu_ddp or ddp"):
        check_config(cfg)


def test_a_rule_inside_an_optimizer_of_several_rules_is_refused_as_it_would_be_alone():
    """Red when only the outer _target_ is read: a PerRule whose rule is torch's Muon would run on FSDP2's shards."""
    from rlhf.config.optimizer_hardware import check_optimizer_with_hardware

    container = {"optimizer": {"_target_": "rlhf.optim.rules.PerRule", "rules": {
                     "muon": {"_target_": "torch.optim.Muon", "_partial_": True},
                     "adamw": {"_target_": "torch.optim.AdamW", "_partial_": True}}},
                 "hardware": {"_target_": "rlhf.hardware.fsdp.FSDP2"}}
    with pytest.raises(UserError, match=r"optimizer=Muon orthogonalizes each matrix whole.*hardware=fsdp"):
        check_optimizer_with_hardware(container)
    container["optimizer"]["rules"].pop("muon")
    check_optimizer_with_hardware(container)  # AdamW alone runs sharded
