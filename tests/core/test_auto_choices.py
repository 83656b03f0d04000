"""The ``auto`` speed options: one table says what each picks on a GPU and a CPU, every GPU choice stands on a page
of a GPU run, the paths not yet measured there are never picked, the components read it, the shipped configs leave
each at ``auto``, and the start-up line names the choice with its evidence and the paths it could turn on."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from rlhf.core import auto_choices
from rlhf.data.loaders import loader_workers
from rlhf.hardware import compiling
from rlhf.models import generation
from rlhf.ops.output_layer import TRITON, FusedOutputLayer
from rlhf.run.components import auto_keys
from rlhf.run.nonfinite import verdicts_for
from tests.conftest import compose_config

# Where each key's default is set: a config that composes it (the algorithm that has the option).
ROOT = Path(__file__).resolve().parents[2]
COMPOSED_WITH = {"algo.fused_output_layer": ["algo=dpo"], "algo.shared_prompt": ["algo=dpo"],
                 "hardware.compile": [], "algo.generation": ["algo=grpo"], "train.nonfinite_on_device": [],
                 "data.num_workers": []}


def test_every_table_entry_is_an_option_the_shipped_configs_leave_at_auto():
    assert set(COMPOSED_WITH) == set(auto_choices.CHOICES)
    for key, overrides in COMPOSED_WITH.items():
        section, name = key.split(".")
        assert compose_config(*overrides)[section][name] == auto_choices.CHOICES[key].auto_value, key


def test_every_gpu_choice_stands_on_a_page_of_a_gpu_run():
    """No entry whose GPU path nobody measured is chosen: each GPU choice's evidence names a page under docs/gpu/
    that exists, and a path built but not measured (``untried``) is not the one picked."""
    for key, choice in auto_choices.CHOICES.items():
        assert auto_choices.NOT_MEASURED not in choice.evidence, key
        pages = re.findall(r"docs/gpu/[\w.-]+\.md", choice.evidence)
        assert pages, f"{key}: its GPU choice names no page of a GPU run: {choice.evidence!r}"
        for page in pages:
            assert (ROOT / page).is_file(), f"{key}: {page} does not exist"
        if choice.untried is not None:
            assert auto_choices.pick(key, "cuda") != choice.untried.value, key
            assert auto_choices.pick(key, "cpu") != choice.untried.value, key


def test_the_paths_not_measured_on_a_gpu_are_not_what_a_gpu_run_gets():
    """What a GPU run at defaults runs: no compiled layers, transformers' generate, the output layer's
    log-probabilities with torch operations (the Triton kernel only when asked for)."""
    cuda = torch.device("cuda")
    assert compiling.resolve_compile("auto", uses_cuda=True) is False
    assert not generation.uses_static_decoding(generation.Sampling(), cuda, partitioned=False)
    layer = FusedOutputLayer(4, 8)
    assert layer.answers_on(cuda) and not layer.kernel_on(cuda)
    layer.fused = TRITON
    assert layer.answers_on(cuda) and layer.kernel_on(cuda) and not layer.kernel_on(torch.device("cpu"))
    assert generation.uses_static_decoding(generation.Sampling(generation="static"), cuda, partitioned=False)
    assert loader_workers(None, cuda=True) == 0

    class Settings:
        nonfinite_on_device = None

    class Strategy:
        def uses_cuda(self):
            return True

    assert verdicts_for(Settings(), Strategy(), optimizer=None) is None  # read every step on a GPU at defaults
    assert compiling.resolve_compile("layers", uses_cuda=True) == "layers"


def test_the_components_read_the_table(monkeypatch):
    static = generation.Sampling()
    layer = FusedOutputLayer(4, 8)
    # a measurement that turns a GPU path on is a change of the table alone
    table = dict(auto_choices.CHOICES)
    table["hardware.compile"] = dataclasses.replace(table["hardware.compile"], gpu="layers")
    table["algo.generation"] = dataclasses.replace(table["algo.generation"], gpu="static")
    table["algo.fused_output_layer"] = dataclasses.replace(table["algo.fused_output_layer"], gpu=TRITON)
    monkeypatch.setattr(auto_choices, "CHOICES", table)
    assert layer.answers_on(torch.device("cuda")) and layer.kernel_on(torch.device("cuda"))
    assert not layer.answers_on(torch.device("cpu"))
    assert compiling.resolve_compile("auto", uses_cuda=True) == "layers"
    assert generation.uses_static_decoding(static, torch.device("cuda"), partitioned=False)
    table["algo.fused_output_layer"] = dataclasses.replace(table["algo.fused_output_layer"], gpu=False)
    assert not layer.answers_on(torch.device("cuda"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_start_up_line_names_each_choice_and_its_grounds(device):
    line = auto_choices.describe(["hardware.compile", "algo.fused_output_layer"], device)
    compile_value = auto_choices.pick("hardware.compile", device)
    assert f"hardware.compile={str(compile_value).lower()}" in line
    if device == "cuda":
        assert "docs/gpu/" in line
        assert auto_choices.CHOICES["algo.fused_output_layer"].evidence in line
        # the paths built but not chosen, with the override that turns each on
        assert "hardware.compile=layers" in line and "algo.fused_output_layer=triton" in line
        assert "algo.generation=static" not in line  # not one of the keys asked about
    else:
        assert "not chosen" not in line


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
