"""What every online algorithm shares: prompts in, completions sampled from the policy, scored, and served to the
loop as micro-batches through the ``batch_source`` hook (:class:`rlhf.algos.base.Algorithm`).

- :class:`OnlineAlgorithm`: tokenizes prompt rows (left-padded batches, as ``generate`` needs), samples with the
  config's settings (``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, ``num_generations``), scores
  completions with the reward functions (:mod:`rlhf.algos.reward_funcs`), evaluates by greedy decoding, and keeps the rollout
  buffer as its checkpointed state. A subclass implements :meth:`OnlineAlgorithm.rollout` (what a rollout computes
  besides the samples: advantages, old and reference log-probabilities) and ``loss``.
- :class:`Rollouts`: the batch source. Per rollout it draws ``train.per_device_batch_size`` prompts from the
  training loader (resumable like any data position), calls ``algo.rollout(model, prompts)``, splits the scored
  samples into ``steps_per_generation`` micro-batches of whole groups and serves them ``num_iterations`` times.

Sampling is seeded per prompt batch (the run's seed, the epoch and the batch's index in the global order of the
training loader), not by a process's random stream: a run repeats exactly on CPU, a resumed run samples what the
uninterrupted one did, and N processes sample what one process with N accumulation steps samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf.algos import reward_funcs as reward_lib
from rlhf.algos.base import PROMPT_TOKENS, Algorithm
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.core.train_state import TrainState
from rlhf.data.encoding import FORMAT_COLUMN, PROMPT_CUT, TEXT, TRUNCATED, tokens
from rlhf.data.loaders import Batches
from rlhf.models.generation import Sampling, sample, stop_ids

TEMPERATURE = Range(gt=0, meaning="the sampling temperature of training completions; 1.0 samples the policy as it is",
                    fix=1.0)
TOP_P = Range(gt=0, le=1, meaning="nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1.0 "
              "is off", fix=1.0)
TOP_K = Range(ge=0, integer=True, meaning="sample among the k likeliest tokens; 0 is off", fix=0)
COMPLETION_TOKENS = Range(ge=1, integer=True, meaning="the most tokens a sampled completion may have", fix=256)
GENERATIONS = Range(ge=1, integer=True, meaning="completions sampled per prompt (a group)", fix=8)
ITERATIONS = Range(ge=1, integer=True, meaning="optimization passes over each rollout's samples", fix=1)
STEPS_PER_GENERATION = Range(ge=1, integer=True, meaning="micro-batches each rollout is split into", fix=1)


def generation_seed(seed: int, epoch: int, index: int) -> int:
    """The sampling seed of the prompt batch at ``index`` (in the loader's global order) of ``epoch``: a 63-bit
    number from a hash, so that neighbouring batches get unrelated streams."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def tokenize_prompt(row: dict[str, Any], tokenizer, max_prompt_length: int | None,
                    columns: Sequence[str] = ()) -> dict[str, Any]:
    """A prompt row tokenized for sampling: its tokens (the end kept when longer than ``max_prompt_length``), its
    text, the truncation flag and ``columns`` as they are. Plain text gets the tokenizer's special tokens (a Llama
    tokenizer's BOS, as the SFT warm start saw them); a prompt rendered by the chat template (the row's
    :data:`~rlhf.data.encoding.FORMAT_COLUMN`, or text that starts with BOS) carries its own, as TRL tokenizes it."""
    ids = tokens(tokenizer, row["prompt"], chat=row.get(FORMAT_COLUMN, TEXT) != TEXT)
    cut = max_prompt_length is not None and len(ids) > max_prompt_length
    if cut:
        ids = ids[-max_prompt_length:]
    return {"prompt_ids": ids, "prompt": row["prompt"], TRUNCATED: PROMPT_CUT if cut else 0,
            **{c: row[c] for c in columns if c in row}}


def collate_prompts(rows: list[dict[str, Any]], pad_id: int, columns: Sequence[str] = ()) -> dict[str, Any]:
    """Left-padded prompts (``input_ids``, ``attention_mask``, ``[B, P]``, as ``generate`` needs), their texts
    (``prompts``) and ``columns`` (lists)."""
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in rows])
    mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "prompts": [r["prompt"] for r in rows],
            **{c: [r[c] for r in rows] for c in columns if c in rows[0]}}


@limits(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, max_completion_length=COMPLETION_TOKENS,
        max_prompt_length=PROMPT_TOKENS, num_generations=GENERATIONS, num_iterations=ITERATIONS,
        steps_per_generation=STEPS_PER_GENERATION,
        log_completions_every_steps=Range(ge=0, integer=True, meaning="steps between samples.jsonl entries; 0 is "
                                          "never", fix=50),
        num_completions_to_print=Range(ge=0, integer=True, meaning="completions written each time", fix=4))
class OnlineAlgorithm(Algorithm):
    """An algorithm that learns from completions it samples. ``__init__`` takes what every online algorithm has (the
    sampling settings, ``reward_funcs`` (name -> function), ``reward_weights``, ``reward_columns``,
    ``num_generations``, ``num_iterations``, ``steps_per_generation``, ``seed``, the completion logging; documented
    in :class:`rlhf.algos.grpo.GRPO`); a subclass takes its own options and passes the rest on (``**kwargs``), and
    implements :meth:`rollout` and ``loss``. Evaluation decodes greedily and reports ``reward`` (the weighted reward), ``rewards/<name>/mean`` and
    ``completions/mean_length``."""

    columns = ("prompt",)
    tokenize_reads = ("max_prompt_length", "reward_columns")
    eval_metrics = ("reward", "completions/mean_length")
    objective = ("eval/reward", "maximize")

    def __init__(self, num_generations: int = 8, num_iterations: int = 1, steps_per_generation: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_completion_length: int = 16,
                 max_prompt_length: int | None = 512, seed: int = 0, reward_funcs: Mapping[str, Callable] | None = None,
                 reward_weights: Sequence[float] | None = None, reward_columns: Sequence[str] = (),
                 log_completions: bool = True, log_completions_every_steps: int = 50,
                 num_completions_to_print: int = 4, cache_implementation: str | None = None,
                 gather_for_generation: bool = True, generation: str = "auto") -> None:
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.cache_implementation = cache_implementation  # generate()'s KV cache: None (transformers' dynamic one)
        self.gather_for_generation = gather_for_generation  # FSDP2/ZeRO-3: the whole model gathered for a rollout
        self.generation = generation  # the decoder: auto, transformers (generate), static or static_compiled (rlhf.models.decoding)
        Sampling(generation=generation)  # refuses an unknown decoder now, not at the first rollout
        self.max_completion_length, self.max_prompt_length = max_completion_length, max_prompt_length
        self.num_generations, self.num_iterations = num_generations, num_iterations
        self.steps_per_generation, self.seed = steps_per_generation, seed
        self.reward_funcs, self.reward_weights = reward_lib.functions_and_weights(reward_funcs, reward_weights, "algo")
        self.reward_columns = tuple(reward_columns)
        self.optional_columns = self.reward_columns
        self.pad_id, self.eos_ids, self.tokenizer = 0, (), None
        self.buffer: dict[str, Any] = {}  # the rollout being served (checkpointed): see Rollouts
        self.log_completions = log_completions
        self.log_completions_every_steps, self.num_completions_to_print = (log_completions_every_steps,
                                                                           num_completions_to_print)
        self.last_completions: list[dict[str, Any]] = []  # the latest rollout's texts and rewards (not checkpointed)
        self.generation_s = 0.0  # seconds spent sampling training completions since timings() (not checkpointed)

    @classmethod
    def check_run(cls, options: dict[str, Any], config: dict[str, Any]) -> None:
        """A rollout (``train.per_device_batch_size`` prompts) must split into ``steps_per_generation`` micro-batches
        of whole groups."""
        parts, prompts = options.get("steps_per_generation"), (config.get("train") or {}).get("per_device_batch_size")
        if isinstance(parts, int) and isinstance(prompts, int) and parts >= 1 and prompts % parts:
            raise UserError(split_error(prompts, options.get("num_generations"), parts))

    # ---- data ----------------------------------------------------------------------------------------------------
    def tokenize(self, row: dict[str, Any], tokenizer) -> dict[str, Any]:
        """The prompt's tokens (:func:`tokenize_prompt`), its text and the reward columns as they are."""
        return tokenize_prompt(row, tokenizer, self.max_prompt_length, self.reward_columns)

    def setup(self, policy, tokenizer) -> None:
        self.pad_id, self.eos_ids, self.tokenizer = tokenizer.pad_token_id, stop_ids(tokenizer, policy), tokenizer

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-padded prompts and their columns (:func:`collate_prompts`)."""
        return collate_prompts(rows, self.pad_id, self.reward_columns)

    def micro_batch_shape(self, batch: dict[str, Any]) -> tuple[int, int]:
        """A rollout of ``batch``'s prompts trains on ``num_generations`` completions per prompt, split into
        ``steps_per_generation`` micro-batches, each prompt followed by up to ``max_completion_length`` tokens."""
        prompts, prompt_tokens = batch["input_ids"].shape
        return (max(1, prompts * self.num_generations // self.steps_per_generation),
                int(prompt_tokens) + self.max_completion_length)

    # ---- the hook --------------------------------------------------------------------------------------------------
    def batch_source(self, loader, state: TrainState, accelerator, model=None) -> Rollouts:
        if model is None:
            raise ValueError("an online algorithm's batch_source needs the policy (model=) to sample with")
        return Rollouts(self, Batches(loader, state, accelerator), state, accelerator, model)

    def collect(self, model: torch.nn.Module, next_prompts: Callable[[], tuple[dict[str, Any], int]]
                ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One rollout's samples and metrics: :meth:`rollout` on the next prompt batch. An algorithm that filters
        (DAPO's dynamic sampling) calls ``next_prompts()`` (a batch and its seed) as often as it needs."""
        return self.rollout(model, *next_prompts())

    def rollout(self, model: torch.nn.Module, prompts: dict[str, Any], seed: int) -> tuple[dict[str, Tensor],
                                                                                             dict[str, Tensor]]:
        """Sample ``num_generations`` completions per prompt of ``prompts`` (a collated batch) with ``seed``, score
        them, and return ``(samples, metrics)``: per-completion tensors with leading dimension ``B·G`` in groups
        (see :meth:`sample`, plus what ``loss`` needs) and the rollout's scalar metrics (logged with ``loss``'s)."""
        raise NotImplementedError

    def timings(self) -> dict[str, float]:
        """``generation``: the seconds :meth:`sample` took for training rollouts (``model.generate`` and the
        decoding of its output), since the last call."""
        seconds, self.generation_s = self.generation_s, 0.0
        return {"generation": seconds}

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = state.get("buffer", {})

    # ---- sampling and scoring ----------------------------------------------------------------------------------------
    def sample(self, model: torch.nn.Module, prompts: dict[str, Any], num_generations: int,
               seed: int | None) -> dict[str, Any]:
        """``num_generations`` completions per prompt with this algorithm's sampling settings (greedy when ``seed``
        is None: one each): :func:`rlhf.models.generation.sample`. A training rollout's time counts in
        :meth:`timings`."""
        started = time.perf_counter()
        sampled = sample(model, prompts["input_ids"], prompts["attention_mask"], num_generations, seed,
                         self.sampling())
        if seed is not None:  # a training rollout's (greedy evaluation is not training time); decoding its output
            self.generation_s += time.perf_counter() - started  # has waited for the device
        return sampled

    def sampling(self) -> Sampling:
        """This algorithm's sampling settings (after :meth:`setup`: the tokenizer's ids)."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        max_new_tokens=self.max_completion_length, pad_id=self.pad_id, eos_ids=self.eos_ids,
                        tokenizer=self.tokenizer, cache_implementation=self.cache_implementation,
                        gather=self.gather_for_generation, generation=self.generation)

    def score(self, prompts: dict[str, Any], sampled: dict[str, Any], num_generations: int, keep: bool = True
              ) -> tuple[Tensor, Tensor]:
        """``(reward [N], per_function [N, F])`` of the sampled completions (:meth:`sample`'s output) by
        :func:`rlhf.algos.reward_funcs.score`, on the samples' device (a GPU's: the advantages and the loss combine them
        with the log-probabilities there); ``keep``: they are the latest rollout's, which :meth:`tables` logs."""
        completions = sampled["completions"]
        texts = [p for p in prompts["prompts"] for _ in range(num_generations)]
        columns = {c: [v for v in prompts[c] for _ in range(num_generations)] for c in self.reward_columns
                   if c in prompts}
        reward, per_function = reward_lib.score(self.reward_funcs, self.reward_weights, texts, completions, columns)
        if keep:  # read on the CPU, where they were scored
            self.last_completions = [
                {"prompt": p, "completion": c, "reward": float(r),
                 **{f"rewards/{name}": float(v) for name, v in zip(self.reward_funcs, values)}}
                for p, c, r, values in zip(texts, completions, reward.tolist(), per_function.tolist())]
            self.watch_rewards(per_function, num_generations)
        device = sampled["completion_ids"].device
        return reward.to(device), per_function.to(device)

    def watch_rewards(self, per_function: Tensor, num_generations: int) -> None:
        """A training rollout's values of each reward function (``[N, F]``, on the CPU, in groups of
        ``num_generations``) before they become advantages: for a check that warns (GRPO's of lightly weighted
        rewards); nothing here."""

    def tables(self, step: int) -> dict[str, list[dict[str, Any]]]:
        """``{"samples": rows}``: the first ``num_completions_to_print`` completions of the latest rollout (this
        process's) with their prompts and rewards, at the first step and every ``log_completions_every_steps``
        (with ``log_completions``); the loggers write them to ``samples.jsonl`` and to a W&B table."""
        every = self.log_completions_every_steps
        if not self.log_completions or not every or (step % every and step != 1):
            return {}
        return {"samples": self.last_completions[:self.num_completions_to_print]}

    def reward_metrics(self, reward: Tensor, per_function: Tensor, sampled: dict[str, Any]) -> dict[str, Tensor]:
        """TRL's names: ``reward``, ``reward_std``, ``rewards/<name>/mean``, ``completions/mean_length``,
        ``completions/clipped_ratio``."""
        lengths = sampled["completion_mask"].sum(-1).float()
        metrics = {"reward": reward.mean(), "reward_std": reward.std() if reward.numel() > 1 else reward.new_zeros(()),
                   "completions/mean_length": lengths.mean(),
                   "completions/clipped_ratio": sampled["truncated"].float().mean()}
        for column, name in enumerate(self.reward_funcs):
            metrics[f"rewards/{name}/mean"] = per_function[:, column].nanmean()
        return metrics

    def evaluate(self, model, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Greedy completions of the held-out prompts, scored: ``reward`` (the weighted reward that trains),
        ``rewards/<name>/mean`` and ``completions/mean_length``."""
        sampled = self.sample(model, batch, 1, seed=None)
        reward, per_function = self.score(batch, sampled, 1, keep=False)
        metrics = self.reward_metrics(reward, per_function, sampled)
        return {k: v for k, v in metrics.items() if k not in ("reward_std", "completions/clipped_ratio")}


class Rollouts:
    """The batch source of an online algorithm (see the module docstring). The buffer lives in ``algo.buffer`` (so
    that it is checkpointed with the algorithm's state): ``micro_batches`` (a list of per-completion tensor dicts
    with their ``metrics``) and ``served`` (how many micro-batches of it the loop has taken)."""

    def __init__(self, algo: OnlineAlgorithm, prompts: Batches, state: TrainState, accelerator, model) -> None:
        self.algo, self.prompts, self.state, self.accelerator, self.model = algo, prompts, state, accelerator, model
        # The weights a rollout samples with: a context the loop sets to the optimizer's evaluation weights (the
        # averaged ones of schedule-free AdamW, rlhf.run.optimizer_modes); by default the parameters as they are.
        self.sampling_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def _next_prompts(self) -> tuple[dict[str, Any], int]:
        """The next prompt batch and its sampling seed (from its position in the loader's global order)."""
        batch = self.prompts.next()
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        index = (self.state.batch_in_epoch - 1) * processes + rank
        return batch, generation_seed(self.algo.seed, self.state.epoch, index)

    def next(self) -> dict[str, Any]:
        algo, buffer = self.algo, self.algo.buffer
        total = algo.steps_per_generation * algo.num_iterations
        if not buffer or buffer["served"] >= total:
            with self.sampling_weights():
                samples, metrics = algo.collect(self.model, self._next_prompts)
            buffer = algo.buffer = {"micro_batches": split_groups(samples, algo.steps_per_generation,
                                                                  algo.num_generations),
                                    "metrics": metrics, "served": 0}
        micro = buffer["micro_batches"][buffer["served"] % algo.steps_per_generation]
        buffer["served"] += 1
        return {**training_batch(micro), "rollout_metrics": buffer["metrics"]}


def split_groups(samples: dict[str, Tensor], parts: int, num_generations: int) -> list[dict[str, Tensor]]:
    """``samples`` (per-completion tensors, leading dimension ``N``, whole groups) as ``parts`` equal slices of whole
    groups, in order."""
    n = next(iter(samples.values())).shape[0]
    size = n // parts
    if size * parts != n or size % num_generations:
        raise UserError(split_error(n // num_generations, num_generations, parts))
    return [{k: v[i * size:(i + 1) * size] for k, v in samples.items()} for i in range(parts)]


def split_error(prompts: int, num_generations: Any, parts: int) -> str:
    """Why a rollout of ``prompts`` prompts does not split into ``parts`` micro-batches, and the fix."""
    fits = [n for n in range(parts, 0, -1) if prompts % n == 0][0]
    return (f"a rollout of train.per_device_batch_size={prompts} prompts x algo.num_generations={num_generations} "
            f"completions does not split into algo.steps_per_generation={parts} micro-batches of whole groups. Fix: a "
            f"train.per_device_batch_size that is a multiple of {parts} (e.g. {prompts + (-prompts) % parts}), or "
            f"algo.steps_per_generation={fits}")


def training_batch(samples: dict[str, Tensor]) -> dict[str, Tensor]:
    """Samples as the sequences a forward pass takes: ``input_ids = prompt + completion``, ``attention_mask`` and
    ``completion_mask`` (``[N, P + C]``), and every other per-completion tensor as it is."""
    prompt_ids, completion_ids = samples["prompt_ids"], samples["completion_ids"]
    out = {k: v for k, v in samples.items() if k not in ("prompt_ids", "prompt_mask", "completion_ids")}
    out["input_ids"] = torch.cat([prompt_ids, completion_ids], 1)
    out["attention_mask"] = torch.cat([samples["prompt_mask"], samples["completion_mask"]], 1)
    out["completion_mask"] = torch.cat([torch.zeros_like(samples["prompt_mask"]), samples["completion_mask"]], 1)
    out["prompt_length"] = torch.tensor(prompt_ids.shape[1])
    return out


def concat_samples(parts: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Samples of several rollouts as one: prompts left-padded and completions right-padded to common widths."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if key in ("prompt_ids", "prompt_mask"):
            fill = pad_id if key == "prompt_ids" else 0
            width = max(v.shape[1] for v in values)
            values = [torch.cat([v.new_full((v.shape[0], width - v.shape[1]), fill), v], 1) for v in values]
        elif values[0].dim() == 2:
            fill = pad_id if key == "completion_ids" else 0
            width = max(v.shape[1] for v in values)
            values = [torch.cat([v, v.new_full((v.shape[0], width - v.shape[1]), fill)], 1) for v in values]
        out[key] = torch.cat(values, 0)
    return out


