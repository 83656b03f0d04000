"""The ``auto`` speed options: one table says what each picks on a GPU and a CPU, the components read it, the
shipped configs leave each at ``auto``, and the start-up line names the choice with its evidence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf.core import auto_choices
from rlhf.hardware import compiling
from rlhf.models import generation
from rlhf.ops.output_layer import FusedOutputLayer
from rlhf.run.components import auto_keys
from tests.conftest import compose_config

# Where each key's default is set: a config that composes it (the algorithm that has the option).
COMPOSED_WITH = {"algo.fused_output_layer": ["algo=dpo"], "algo.shared_prompt": ["algo=dpo"],
                 "hardware.compile": [], "algo.generation": ["algo=grpo"]}


def test_every_table_entry_is_an_option_the_shipped_configs_leave_at_auto():
    assert set(COMPOSED_WITH) == set(auto_choices.CHOICES)
    for key, overrides in COMPOSED_WITH.items():
        section, name = key.split(".")
        assert compose_config(*overrides)[section][name] == "auto", key


def test_the_components_read_the_table(monkeypatch):
    assert compiling.resolve_compile("auto", uses_cuda=True) == auto_choices.pick("hardware.compile", "cuda")
    static = generation.Sampling()
    assert generation.uses_static_decoding(static, torch.device("cuda"), partitioned=False)
    layer = FusedOutputLayer(4, 8)
    assert layer.answers_on(torch.device("cuda")) and not layer.answers_on(torch.device("cpu"))
    # a measurement that reverses a GPU choice is a change of the table alone
    table = dict(auto_choices.CHOICES)
    table["hardware.compile"] = dataclasses.replace(table["hardware.compile"], gpu=False)
    table["algo.generation"] = dataclasses.replace(table["algo.generation"], gpu="transformers")
    table["algo.fused_output_layer"] = dataclasses.replace(table["algo.fused_output_layer"], gpu=False)
    monkeypatch.setattr(auto_choices, "CHOICES", table)
    assert not layer.answers_on(torch.device("cuda"))
    assert compiling.resolve_compile("auto", uses_cuda=True) is False
    assert not generation.uses_static_decoding(static, torch.device("cuda"), partitioned=False)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_start_up_line_names_each_choice_and_its_grounds(device):
    line = auto_choices.describe(["hardware.compile", "algo.fused_output_layer"], device)
    compile_value = auto_choices.pick("hardware.compile", device)
    assert f"hardware.compile={str(compile_value).lower()}" in line
    if device == "cuda":
        assert auto_choices.NOT_MEASURED in line or "docs/gpu/" in line
        assert auto_choices.CHOICES["algo.fused_output_layer"].evidence in line


def test_only_the_options_left_at_auto_are_named():
    class Algo:
        fused_output_layer, shared_prompt = "auto", False

    class Strategy:
        _compile_asked, compiles = "auto", True

    assert auto_keys(Algo(), Strategy()) == ["algo.fused_output_layer", "hardware.compile"]
    Strategy._compile_asked = "layers"
    assert auto_keys(Algo(), Strategy()) == ["algo.fused_output_layer"]
    Strategy._compile_asked, Strategy.compiles = "auto", False  # FSDP2, ZeRO: never compiled
    assert auto_keys(Algo(), Strategy()) == ["algo.fused_output_layer"]


def test_a_strategy_built_in_python_compiles_as_the_shipped_config_does():
    """A config file is a constructor call: DataParallel's own default for compile is the YAML's (auto), so a
    strategy built in Python (rlhf.launch.step_trainer, notebooks) is configured as hardware=auto's."""
    import inspect

    from rlhf.hardware import DataParallel

    default = inspect.signature(DataParallel).parameters["compile"].default
    assert default == compose_config().hardware.compile == "auto"
