"""The defaults of ``conf/`` that differ from TRL 1.16's, and why: one table, :data:`DEFAULTS`.

Read by the start-up warning for a model other than the embedded one (:func:`warning`: the rows tuned on the embedded
tiny model that the run leaves at their default), by the table of docs/coming_from_trl.md (:func:`markdown_table`; a
test keeps the page equal to it), and by a test that each row's value is what ``conf/`` composes to.

TRL's values are its documented defaults in version 1.16: each trainer's config class, whose page lists the values it
changes from transformers' ``TrainingArguments`` (e.g. ``learning_rate`` 1e-6 instead of 5e-5 for ``DPOConfig``):
huggingface.co/docs/trl/v1.16.0/en/sft_trainer (SFTConfig), .../dpo_trainer (DPOConfig), .../reward_trainer
(RewardConfig), .../grpo_trainer (GRPOConfig), .../rloo_trainer (RLOOConfig), .../kto_trainer (KTOConfig),
.../orpo_trainer (ORPOConfig), .../cpo_trainer (CPOConfig). What no config class changes is ``TrainingArguments``'
own default (huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments: ``warmup_steps``
0, ``lr_scheduler_type`` linear, ``weight_decay`` 0.0, ``per_device_train_batch_size`` 8, ``seed`` 42, ...).
TRL 1.16 has no PPO, REINFORCE++ or iterative SFT trainer: for those algorithms only ``TrainingArguments``' values
apply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.core import limits as validate

# Every TRL trainer's value: the one its config class takes from transformers' TrainingArguments unchanged.
EVERY = "TrainingArguments"
NO_SUCH_SETTING = "(no such setting)"  # TRL 1.16's config has nothing of the kind
_TRAINERS = ("SFTConfig", "DPOConfig", "CPOConfig", "ORPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig",
             "RLOOConfig")
PAGE = "docs/coming_from_trl.md"

_ADAM_LIKE = ("optimizer=adamw", "optimizer=adam8bit", "optimizer=paged_adamw8bit", "optimizer=adafactor")
_PREFERENCE = ("algo=dpo", "algo=ipo", "algo=cdpo", "algo=hinge", "algo=robust", "algo=aot", "algo=aot_unpaired",
               "algo=apo_down", "algo=apo_zero", "algo=bco_pair", "algo=discopop", "algo=exo_pair", "algo=nca_pair",
               "algo=sppo_hard", "algo=sigmoid_norm", "algo=mpo", "algo=dpo_forward_kl", "algo=dpo_js_divergence",
               "algo=dpo_alpha_divergence")
_MODELS = ("model=tiny", "model=smollm2-135m", "model=gpt2", "model=pythia-160m", "model=qwen2.5-0.5b",
           "model=llama-3.2-1b")


def _each(options: Sequence[str], value: Any) -> dict[str, Any]:
    return dict.fromkeys(options, value)


@dataclass(frozen=True)
class Default:
    """One default that differs from TRL's. ``key``: a config key (``algo.beta``) or group (``scheduler``: ``group``);
    ``ours``: the command-line option that composes it (``""``: the defaults alone) -> the value it composes to;
    ``trl``: TRL's config class (:data:`EVERY`: every trainer's) -> its default; ``tuned``: tuned on the embedded
    tiny model, so named at start-up when the model is another (:func:`warning`)."""

    key: str
    ours: dict[str, Any]
    trl: dict[str, Any]
    why: str
    tuned: bool = False
    trl_name: str = field(default="")  # TRL's name where it is not the key's last part
    group: bool = False  # ``key`` is a config group (``scheduler=cosine``), not a key
    trl_optimizer: str = ""  # TRL's value is for this optimizer (a part of ``optimizer._target_``, lowercase: "adam"
    # for TRL's AdamW); with another, the row is named as tuned, without TRL's value as the fix


DEFAULTS: tuple[Default, ...] = (
    # --- tuned on the embedded tiny model: named at start-up for another model ------------------------------------
    Default("algo.beta", _each(_PREFERENCE, 0.3), {"DPOConfig": 0.1},
            "measured on the embedded task: beta 0.1 left exact match at 0.90-0.95 over seeds, 0.3 at 0.96 "
            "(docs/results/main-job.md)", tuned=True),
    Default("optimizer.lr", {**_each(_ADAM_LIKE, 1e-4), "optimizer=lion": 3e-5, "optimizer=sgd": 3e-2},
            {"SFTConfig": 2e-5, "DPOConfig": 1e-6, "CPOConfig": 1e-6, "ORPOConfig": 1e-6, "KTOConfig": 1e-6,
             "GRPOConfig": 1e-6, "RLOOConfig": 1e-6, "RewardConfig": 1e-4},
            "chosen on the embedded model, ~0.8M parameters from a short warm start (the search: "
            "docs/results/optimizer-comparison.md); on a pretrained model it is far too large: a DPO run of "
            "model=smollm2-135m reached a training loss of 6.6e-11 in 15 steps", tuned=True,
            trl_name="learning_rate", trl_optimizer="adam"),
    Default("scheduler.num_warmup_steps", _each(("", "scheduler=linear", "scheduler=constant"), 10), {EVERY: 0},
            "10 of the embedded model's 300 steps; a warmup as long as the run never reaches the peak learning rate "
            "(a start-up warning says so)", tuned=True, trl_name="warmup_steps"),
    Default("algo.max_completion_length", _each(("algo=grpo", "algo=rloo"), 16),
            {"GRPOConfig": 512, "RLOOConfig": 512},
            "the embedded task's answers are a few characters; a real model's completions would be cut at 16 tokens",
            tuned=True),
    # --- other differences -----------------------------------------------------------------------------------------
    Default("algo.beta", {"algo=simpo": 2.0}, {"CPOConfig": 0.1},
            "the SimPO paper's scale (2.0-2.5); TRL's 0.1 is CPO's"),
    Default("algo.nll_weight", {"algo=simpo": 0.0}, {"CPOConfig": 1.0},
            "the SimPO paper's loss has no NLL term; TRL's cpo_alpha=1.0 is CPO-SimPO", trl_name="cpo_alpha"),
    Default("algo.max_prompt_length",
            _each(("algo=sft", "algo=dpo", "algo=reward", "algo=kto", "algo=grpo", "algo=rloo"), 512),
            {EVERY: NO_SUCH_SETTING},
            "a long prompt keeps its end, leaving room for the completion within max_length; TRL 1.16 limits "
            "prompt + completion only (null here: no prompt limit either)"),
    Default("algo.disable_dropout", _each(("algo=grpo", "algo=rloo"), True),
            {"GRPOConfig": False, "RLOOConfig": False},
            "no dropout, as TRL's DPO, KTO and reward trainers: the sampled and the trained log-probabilities are "
            "those of one function"),
    Default("algo.num_generations", {"algo=rloo": 8}, {"RLOOConfig": 2},
            "GRPO's group of 8: each completion's baseline is the mean of 7 others, not of 1"),
    Default("algo/loss_type", {"algo=grpo": "grpo"}, {"GRPOConfig": "dapo"},
            "the GRPO paper's aggregation: the mean over each completion's tokens, then over completions; "
            "algo/loss_type=dapo is TRL's",
            trl_name="loss_type", group=True),
    Default("scheduler", {"": "cosine"}, {EVERY: "linear"},
            "a cosine decay to 0 after the warmup; scheduler=linear is TRL's", trl_name="lr_scheduler_type",
            group=True),
    Default("optimizer.weight_decay", {"": 0.01, "optimizer=paged_adamw8bit": 0.01, "optimizer=lion": 0.1},
            {EVERY: 0.0},
            "torch's AdamW default (0.01); Lion's 10x that, as its paper advises with its smaller learning rate"),
    Default("train.per_device_batch_size", {"": 32}, {EVERY: 8},
            "sized for the embedded model on a CPU; the memory preflight refuses a batch that does not fit before the "
            "first step", trl_name="per_device_train_batch_size"),
    Default("train.eval_batch_size", {"": 64}, {EVERY: 8}, "sized for the embedded model on a CPU",
            trl_name="per_device_eval_batch_size"),
    Default("train.max_steps", {"": 300}, {EVERY: -1},
            "a run's length in optimizer steps whatever the data's size; TRL's -1 trains num_train_epochs=3 "
            "(train.num_epochs=3 train.max_steps=null)"),
    Default("train.eval_every_steps", {"": 50}, {EVERY: "no"},
            "held-out curves by default (and once before training: train.eval_at_start); TRL evaluates only when "
            "asked", trl_name="eval_strategy"),
    Default("train.save_every_steps", {"": 0}, {EVERY: 500},
            "checkpoints by the clock instead: every 30 minutes (train.save_every_minutes) and on a stop signal",
            trl_name="save_steps"),
    Default("train.keep_last", {"": 2}, {EVERY: None}, "the two newest checkpoints kept; TRL keeps all",
            trl_name="save_total_limit"),
    Default("model.gradient_checkpointing", _each(_MODELS, False), _each(_TRAINERS, True),
            "about a third less compute; the memory preflight names it among the fixes when a run would not fit"),
    Default("hardware.mixed_precision", {"": "auto"}, _each(_TRAINERS, True),
            "bf16 where the hardware has bf16 matrix units, else float32 (a CPU without them computes bf16 slower)",
            trl_name="bf16"),
    Default("seed", {"": 0}, {EVERY: 42}, "any fixed seed: a run on a CPU repeats exactly"),
)


# --- the run's algorithm and model -----------------------------------------------------------------------------
_TRL_CONFIG = {"rlhf.algos.sft.SFT": "SFTConfig", "rlhf.algos.dpo.DPO": "DPOConfig",
               "rlhf.algos.reward.Reward": "RewardConfig", "rlhf.algos.grpo.GRPO": "GRPOConfig",
               "rlhf.algos.rloo.RLOO": "RLOOConfig", "rlhf.algos.kto.KTO": "KTOConfig"}
_TRL_LOSS = {"rlhf.algos.dpo_losses.orpo_loss": "ORPOConfig", "rlhf.algos.dpo_losses.simpo_loss": "CPOConfig"}


def trl_config(algo: Any) -> str | None:
    """The TRL config class of the algorithm ``algo`` (its config node): ``DPOConfig`` for DPO and its variants,
    ``ORPOConfig`` and ``CPOConfig`` for ORPO and SimPO (DPO here, with their losses); None where TRL 1.16 has none."""
    if not isinstance(algo, Mapping):
        return None
    loss = algo.get("loss")
    loss_target = loss.get("_target_") if isinstance(loss, Mapping) else None
    return _TRL_LOSS.get(str(loss_target)) or _TRL_CONFIG.get(str(algo.get("_target_")))


def embedded_model(model: Any) -> bool:
    """Whether ``model`` (the ``model`` node) is the embedded tiny model: built from its spec (``model=tiny``), or a
    folder a run of it saved (``model.name_or_path=<run>/final``: the byte tokenizer's vocabulary in config.json)."""
    if not isinstance(model, Mapping):
        return False
    path = model.get("name_or_path")
    if path is None:
        return model.get("tiny") is not None and model.get("packaged") is None
    from rlhf.models.tokenizer import VOCAB_SIZE

    try:
        config = json.loads((Path(os.path.expanduser(str(path))) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("vocab_size") == VOCAB_SIZE


# --- what the user set -----------------------------------------------------------------------------------------
def user_keys(overrides: Sequence[str], folder: Path | None = None) -> set[str]:
    """The keys a command line's Hydra overrides set (``algo.beta=0.1``, ``+algo.beta=0.1``, a sweep's value), and
    those the experiment it names sets (``experiment=dpo_rpo``: its file's keys, ``train.max_steps`` ...)."""
    keys: set[str] = set()
    for override in overrides:
        key, equals, value = str(override).partition("=")
        if not equals:
            continue
        key = key.lstrip("+~").split("@")[0]
        keys.add(key)
        if key == "experiment" and value not in ("", "null"):
            keys |= _experiment_keys(value, folder or validate.conf_dir())
    return keys


def _experiment_keys(name: str, folder: Path | None) -> set[str]:
    """The dotted keys ``conf/experiment/<name>.yaml`` sets (a ``# @package _global_`` file: from the root)."""
    path = folder / "experiment" / f"{name}.yaml" if folder is not None else None
    if path is None or not path.is_file():
        return set()
    content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(content, dict):
        return set()
    content.pop("defaults", None)

    def leaves(node: Any, prefix: str) -> set[str]:
        if isinstance(node, dict) and node:
            return set().union(*(leaves(v, f"{prefix}{k}.") for k, v in node.items()))
        return {prefix[:-1]}

    return leaves(content, "")


def hydra_context() -> tuple[list[str] | None, str | None]:
    """(the overrides of this Hydra job, the ``model`` option it chose), or (None, None) outside Hydra
    (``rlhf.train(cfg)`` called from Python, where what the user set cannot be told from the defaults)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None, None
        hydra = HydraConfig.get()
        return [str(o) for o in hydra.overrides.task], hydra.runtime.choices.get("model")
    except Exception:  # not under Hydra
        return None, None


# --- the start-up warning --------------------------------------------------------------------------------------
_ABSENT = object()


@dataclass(frozen=True)
class Left:
    """A row tuned on the embedded model that a run leaves at its default: the run's value, TRL's, and TRL's config
    class that has it (None: every trainer's)."""

    row: Default
    value: Any
    trl: Any
    config: str | None
    comparable: bool = True  # TRL's value applies to the run's optimizer (Default.trl_optimizer)


def left_at_default(cfg: Any, overrides: Sequence[str] | None = None, folder: Path | None = None) -> list[Left]:
    """The rows tuned on the embedded model whose key the run leaves at the default of ``conf/`` (not in
    ``overrides``, nor set by the experiment they name; ``overrides`` None, when unknown: a value equal to the
    default counts as the default), where that default differs from TRL's for the run's algorithm."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    config = trl_config(OmegaConf.to_container(cfg.algo, resolve=False) if "algo" in cfg else None)
    chosen = user_keys(overrides, folder) if overrides is not None else set()
    found = []
    for row in DEFAULTS:
        if not row.tuned or row.group or row.key in chosen:
            continue
        own = config is not None and config in row.trl
        trl = row.trl[config] if own else row.trl.get(EVERY, _ABSENT)
        value = OmegaConf.select(cfg, row.key, default=_ABSENT)
        if trl is _ABSENT or value is _ABSENT or value not in row.ours.values() or value == trl:
            continue
        target = str(OmegaConf.select(cfg, "optimizer._target_", default="")).lower()
        found.append(Left(row, value, trl, config if own else None,
                          comparable=not row.trl_optimizer or row.trl_optimizer in target))
    return found


def warning(cfg: Any, overrides: Sequence[str] | None = None, model: str | None = None,
            folder: Path | None = None) -> str | None:
    """The start-up line for a run of a model other than the embedded one that leaves defaults tuned on the embedded
    model where they differ from TRL's (:func:`left_at_default`), naming each with TRL's value; None otherwise.
    ``model``: the ``model`` option chosen (for the line), where known."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    node = OmegaConf.select(cfg, "model", default=None)
    node = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
    if node is None or embedded_model(node):
        return None
    found = left_at_default(cfg, overrides, folder)
    if not found:
        return None
    named = (str(node["name_or_path"]) if node.get("name_or_path") is not None else
             f"model={model}" if model else "this model")
    listed = ", ".join(f"{x.row.key}={show(x.value)} (TRL{f' {x.config}' if x.config else ''}: {show(x.trl)}"
                       + ("" if x.comparable else f", for {x.row.trl_optimizer.capitalize()}W: pick one for this "
                          "optimizer") + ")" for x in found)
    fix = " ".join(f"{x.row.key}={show(x.trl)}" for x in found if x.comparable)
    fix = f", e.g. TRL's: {fix}" if fix else ""
    return (f"defaults tuned on the embedded tiny model, not for {named}: {listed}. Set them on the command line"
            f"{fix} ({PAGE} lists every default that differs from TRL's, and why)")


def show(value: Any) -> str:
    """A value as the command line takes it: ``1e-4``, ``0.3``, ``null``, ``true``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value != 0 and abs(value) < 1e-3:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return str(value)


# --- the documentation's table ---------------------------------------------------------------------------------
def markdown_table() -> str:
    """The table of docs/coming_from_trl.md: a line for each value of each row of :data:`DEFAULTS`."""
    lines = ["| here (default) | with | TRL 1.16 | named at start-up | why |", "|---|---|---|---|---|"]
    for row in DEFAULTS:
        ours: dict[Any, list[str]] = {}
        for option, value in row.ours.items():
            ours.setdefault(_hashable(value), []).append(option)
        trl: dict[Any, list[str]] = {}
        for config, value in row.trl.items():
            trl.setdefault(_hashable(value), []).append(config)
        name = row.trl_name or row.key.rsplit(".", 1)[-1].rsplit("/", 1)[-1]
        theirs = "; ".join(_trl_value(value, configs) for value, configs in trl.items())
        for value, options in ours.items():
            lines.append(f"| `{row.key}={show(value)}` | {_options(options)} | `{name}` {theirs} | "
                         f"{'yes' if row.tuned else 'no'} | {row.why} |")
    return "\n".join(lines)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _trl_value(value: Any, configs: list[str]) -> str:
    shown = value if value == NO_SUCH_SETTING else repr(value) if not isinstance(value, float) else show(value)
    if configs == [EVERY] or sorted(configs) == sorted(_TRAINERS):
        return f"{shown} (every trainer)" if value != NO_SUCH_SETTING else shown
    return f"{shown} ({', '.join(c.removesuffix('Config') for c in configs)})"


def _options(options: list[str]) -> str:
    """``algo=dpo, ipo, cdpo`` for options of one group; ``the defaults`` for ``""``."""
    groups: dict[str, list[str]] = {}
    for option in options:
        group, _, name = option.partition("=")
        groups.setdefault(group, []).append(name)
    return "; ".join(f"{group}={', '.join(names)}" if group else "the defaults" for group, names in groups.items())
