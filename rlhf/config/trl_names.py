"""TRL's names for the settings a user brings from its ``*Config`` classes, and this project's key for each.

:data:`TRL_NAMES` is the one table: the command-line check (:mod:`rlhf.config.command_line`) reads it when an override
names no key of ours (``learning_rate=1e-5``, ``algo.loss_type=ipo``, ``train.num_train_epochs=3``), and the
docs/coming_from_trl.md's table is checked against it by a test. TRL's ``loss_type`` is two things here, told apart
by :func:`loss_type_fix`: a preference algorithm's per-pair loss is an algorithm of its own (``algo=ipo``) or the
``algo/loss`` group; an online algorithm's aggregation of token losses is the ``algo/loss_type`` group.
"""

from __future__ import annotations

# TRL's name -> where it is here (a key, a group option, or what to do), in the words a message shows after "here: ".
TRL_NAMES: dict[str, str] = {
    "learning_rate": "optimizer.lr=<value>",
    "per_device_train_batch_size": "train.per_device_batch_size=<value>",
    "per_device_eval_batch_size": "train.eval_batch_size=<value>",
    "gradient_accumulation_steps": "train.grad_accumulation_steps=<value> (or train.global_batch_size=<value>)",
    "num_train_epochs": "train.num_epochs=<value> train.max_steps=null",
    "max_steps": "train.max_steps=<value>",
    "max_grad_norm": "train.max_grad_norm=<value>",
    "logging_steps": "train.log_every_steps=<value>",
    "eval_steps": "train.eval_every_steps=<value>",
    "save_steps": "train.save_every_steps=<value> (or train.save_every_minutes=<value>)",
    "save_total_limit": "train.keep_last=<value>",
    "weight_decay": "optimizer.weight_decay=<value>",
    "adam_beta1": "optimizer.betas=[<beta1>,<beta2>]",
    "adam_beta2": "optimizer.betas=[<beta1>,<beta2>]",
    "adam_epsilon": "optimizer.eps=<value>",
    "optim": "optimizer=<option> (adamw, adam8bit, paged_adamw8bit, lion, lion8bit, sgd, adafactor, ademamix, ademamix8bit, muon, schedule_free_adamw, soap, psgd_kron, prodigy, adam_mini, galore, apollo)",
    "lr_scheduler_type": "scheduler=<option> (constant, linear, cosine, step, exponential)",
    "warmup_steps": "scheduler.num_warmup_steps=<value>",
    "warmup_ratio": "scheduler.num_warmup_steps=<steps> (a count of optimizer steps, not a ratio)",
    "bf16": "hardware.mixed_precision=bf16 (TRL's false: hardware.mixed_precision=no, float32)",
    "fp16": "hardware.mixed_precision=bf16 (fp16 is refused: bf16 is the mixed precision here)",
    "torch_compile": "hardware.compile=true",
    "gradient_checkpointing": "model.gradient_checkpointing=true",
    "model_name_or_path": "model.name_or_path=<Hub id or folder>",
    "dataset_name": "data.path=<Hub id, file or folder>",
    "report_to": "logger=<option> (jsonl, wandb, tensorboard; several: logger=[wandb,tensorboard])",
    "run_name": "logger.wandb.name=<name> (with logger=wandb; the run's folder: hydra.run.dir=<folder>)",
    "logging_dir": "logger.tensorboard.folder=<folder> (with logger=tensorboard; inside the run's folder)",
    "use_peft": "peft=lora (or peft=qlora)",
    "load_in_4bit": "peft=qlora",
    "lora_r": "peft.r=<value> (with peft=lora)",
    "lora_alpha": "peft.alpha=<value> (with peft=lora)",
    "lora_dropout": "peft.dropout=<value> (with peft=lora)",
    "lora_target_modules": "peft.target_modules=[<names>] (with peft=lora)",
    "precompute_ref_log_probs": "algo/reference=precomputed",
    "rpo_alpha": "algo.nll_weight=<value>",
    "cpo_alpha": "algo.nll_weight=<value>",
    "simpo_gamma": "algo.loss.gamma=<value> (with algo=simpo)",
    "label_smoothing": "algo=cdpo algo.loss.label_smoothing=<value>",
    "packing": "algo.padding_free=true (each micro-batch's rows in one sequence, position ids restarting per row; TRL's packing also bin-packs the dataset's rows into sequences of max_length, which is not offered)",
    "scale_rewards": "algo/scale_rewards=<option> (group, batch, none)",
    "importance_sampling_level": "algo/importance_sampling_level=<option> (token, sequence)",
    "kl_coef": "algo.kl_controller.kl_coef=<value> (algo=ppo)",
    "chat_template_path": "model.chat_template=<template or file>",
    "eval_strategy": "train.eval_every_steps=<value> (0: only at the end; for TRL's no, also train.eval_at_start=false, which leaves the one at the end)",
    "use_vllm": "nothing: generation is transformers' generate (static cache: algo.cache_implementation=static)",
    # under algo.* here, at the top level of TRL's configs
    "beta": "algo.beta=<value>",
    "max_length": "algo.max_length=<value>",
    "max_prompt_length": "algo.max_prompt_length=<value>",
    "max_completion_length": "algo.max_completion_length=<value>",
    "num_generations": "algo.num_generations=<value>",
    "temperature": "algo.temperature=<value>",
    "completion_only_loss": "algo.completion_only_loss=<value>",
    "padding_free": "algo.padding_free=<value>",
    "reward_funcs": "algo/reward_funcs=<option> (conf/algo/reward_funcs/; a function of your own: docs/how-to/your-reward.md)",
    "reward_weights": "algo.reward_weights=[<weights>]",
}


def trl_fix(name: str) -> str | None:
    """``<name> is TRL's name; here: <key>`` for a TRL name, or None."""
    where = TRL_NAMES.get(name)
    return f"{name} is TRL's name; here: {where}" if where else None


def loss_type_fix(value: str, algorithms: list[str], losses: list[str], aggregations: list[str],
                  online: bool) -> str:
    """What TRL's ``loss_type=<value>`` is here: for an online algorithm (``online``) the ``algo/loss_type`` group
    (``aggregations``: grpo, bnpo, dr_grpo, dapo); for a preference algorithm, the algorithm of that name
    (``algorithms``: ``algo=ipo``, which brings its loss and defaults) or the loss alone (``losses``: ``algo/loss``)."""
    if online:
        if value in aggregations:
            return f"Fix: algo/loss_type={value} (a config group: a slash, not a dot)"
        return (f"TRL's GRPO loss_type is the algo/loss_type group here (the aggregation of the token losses: "
                f"{', '.join(aggregations)}). Fix: algo/loss_type=<one of them>")
    if value in algorithms:
        return (f"TRL's DPO loss_type is an algorithm here, with its loss and defaults (conf/algo/{value}.yaml). "
                f"Fix: algo={value} (or algo/loss={value}: the loss alone)" if value in losses else
                f"TRL's DPO loss_type is an algorithm here, with its loss and defaults (conf/algo/{value}.yaml). "
                f"Fix: algo={value}")
    if value in losses:
        return f"TRL's DPO loss_type is the algo/loss group here (the per-pair loss). Fix: algo/loss={value}"
    return (f"TRL's DPO loss_type is an algorithm here (algo=<name>) or the per-pair loss alone (algo/loss=<name>; "
            f"options: {', '.join(losses)})")
