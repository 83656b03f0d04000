"""Module paths from before the layer packages still import, as the same objects, with a warning naming the new
path: a `_target_` in a user's own YAML keeps working."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from hydra.utils import get_object

from rlhf import old_paths

# Every `_target_` the package's own YAML named before the move (conf/ at the commit before it), and the public
# entry points' old homes.
OLD_TARGETS = [
    "rlhf.config.CheckBeforeRun", "rlhf.sweep.SweepSummary", "rlhf.logging.JsonlLogger",
    "rlhf.logging.TensorBoardLogger", "rlhf.logging.WandbLogger", "rlhf.rewards.exact_match",
    "rlhf.rewards.char_similarity", "rlhf.rewards.RewardModel", "rlhf.models.tiny.TinySpec", "rlhf.launch.train",
    "rlhf.step_trainer.StepTrainer", "rlhf.optim.linear_with_warmup", "rlhf.optim.cosine_with_warmup",
    "rlhf.optim.constant_with_warmup", "rlhf.config.build", "rlhf.models.output_layer.tap_output_layer",
]


def test_every_old_module_path_is_the_new_module_and_says_so():
    """In a fresh process (the warning comes once per old path and process): each old path imports as the very
    module object of the new one, with a FutureWarning naming the new path."""
    code = ("import importlib, json, sys, warnings\nimport rlhf\nfrom rlhf.old_paths import MOVED\nbad = []\n"
            "for old, new in MOVED.items():\n"
            "    with warnings.catch_warnings(record=True) as seen:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    if module is not importlib.import_module(new) or not any(\n"
            "            new in str(w.message) and w.category is FutureWarning for w in seen):\n"
            "        bad.append(old)\n"
            "    if module.__spec__.name != new:\n"
            "        bad.append(old + ' spec')\n"
            "print(json.dumps(bad))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("target", OLD_TARGETS)
def test_an_old_target_resolves_to_the_object_it_named(target):
    found = get_object(target)
    assert callable(found)
    assert getattr(importlib.import_module(found.__module__), found.__name__) is found
    assert found.__module__ not in old_paths.MOVED, f"{target} resolved to an object defined under an old name"


def test_a_name_the_old_module_never_had_is_an_attribute_error():
    import rlhf.config

    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        rlhf.config.nonsense  # noqa: B018
