"""What the loop expects from an algorithm (:class:`Algorithm`, the one contract a new algorithm implements). The
forward pass every log-likelihood method shares (:func:`completion_stats`) lives in :mod:`rlhf.ops.completion_logps`,
beside the reference strategies' use of it, and is importable from here too."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.core.limits import Range
from rlhf.core.train_state import TrainState
from rlhf.data.collate import PACKED_ROWS
from rlhf.data.loaders import Batches

# The forward pass every log-likelihood method shares, here for an algorithm's author to find beside the contract.
from rlhf.ops.completion_logps import (  # noqa: F401
    LOGITS_TO_KEEP,
    CompletionStats,
    completion_stats,
    keep_completion_logits,
)

# Allowed lengths for algorithms that tokenize prompt + completion (see rlhf.core.limits.limits).
PROMPT_TOKENS = Range(ge=1, integer=True, meaning="tokens a prompt keeps; null for no limit", fix=512)
SEQUENCE_TOKENS = Range(ge=1, integer=True, meaning="tokens of prompt + completion; null for no limit", fix=1024)


def prompt_leaves_room(values: dict[str, Any], where: str) -> None:
    """Refuse ``max_prompt_length >= max_length``: a prompt that long leaves no completion token to learn from."""
    prompt, total = values.get("max_prompt_length"), values.get("max_length")
    if isinstance(prompt, int) and isinstance(total, int) and prompt >= total:
        raise UserError(f"{where}.max_prompt_length={prompt} must be < {where}.max_length={total}: a prompt that long "
                        f"leaves no room for the completion, so nothing is learned from it. Fix: "
                        f"{where}.max_prompt_length={max(1, total // 2)} (or a larger {where}.max_length)")


class Algorithm:
    """The contract between the loop and an algorithm: what a new algorithm's author implements. Subclass it.

    The loop never asks which algorithm it runs. It calls, in this order:

    1. ``tokenize(row, tokenizer)`` on every row of the data (the columns named by ``columns``, and those of
       ``optional_columns`` that the data has; :mod:`rlhf.data.formats`), then
       ``setup(policy, tokenizer)`` with the initial policy, before the hardware strategy wraps it;
    2. for each model in ``frozen`` (built by ``setup``; the policy is never among them):
       ``strategy.prepare_frozen(model, name=name)``, which puts it where it runs (the device, the autocast of
       mixed precision; FSDP2 and ZeRO-3 shard it like the policy) and is stored back under the same name;
    3. ``precompute(rows, strategy)`` with the tokenized splits, returned with any columns computed once before
       training (reference log-probabilities); then ``batch_source(loader, state, accelerator, model=policy)`` once,
       with the policy as the strategy wrapped it (an online algorithm samples with it: unwrapped for ``generate``,
       :mod:`rlhf.algos.online`); then every micro-batch comes from its ``next()`` (an online source generates and
       scores a rollout when its buffer is used up, then serves it in micro-batches; a batch may hold non-tensor
       values, e.g. prompt texts, beside its tensors);
    4. ``loss(model, batch)`` per micro-batch and ``evaluate(model, batch)`` per held-out batch (``collate``
       makes both kinds of batch from tokenized rows); after each optimizer step, ``tables(step)`` (rows the
       loggers write, e.g. sampled completions); at each log step ``timings()`` (seconds spent in phases of its
       own, logged as ``perf/<phase>_time_s``); before training, ``micro_batch_shape`` for the memory preflight;
    5. ``state_dict()`` into every checkpoint, ``load_state_dict(state)`` when a run resumes from one.

    Required: ``columns``, ``tokenize``, ``collate``, ``loss``, ``evaluate``. The rest have defaults here: among
    them ``tokenize_reads`` (what keys the tokenized data kept across runs) and ``samples`` (``perf/samples_per_s``).
    Allowed argument values are declared with :func:`rlhf.core.limits.limits` above the class.
    """

    columns: tuple[str, ...] = ()  # the columns each row must have (rlhf.data checks them): text, or typed (label)
    # The names of evaluate()'s metrics that every held-out evaluation reports, whatever the batch or option (one
    # that depends on them is left out; answer_metrics only on the embedded task): what a sweep's objective may name
    # (rlhf.sweeps.points), as eval/<name>.
    eval_metrics: tuple[str, ...] = ("loss",)
    # Metrics that count a completion right only when it is *the* answer (exact_match: the greedy tokens are the
    # chosen/target completion's): read on data with one checkable answer per prompt (the embedded task), left out of
    # the logs on data of one's own, where a paraphrase counts as wrong (rlhf.run.components).
    answer_metrics: tuple[str, ...] = ()
    # The default objective of a run (conf/config.yaml's objective, when not set): (metric, minimize or maximize).
    objective: tuple[str, str] = ("eval/loss", "minimize")
    optional_columns: tuple[str, ...] = ()  # typed columns passed on where the data has them (a reward's margin)
    # The attributes that ``tokenize`` reads: the algorithm's part of the key of the tokenized data kept across runs
    # (rlhf.data.token_cache), declared by the class that defines ``tokenize`` (a subclass that overrides it declares
    # its own). None: every attribute, so that a change of any setting tokenizes again.
    tokenize_reads: tuple[str, ...] | None = None

    @property
    def frozen(self) -> dict[str, torch.nn.Module]:
        """Models this algorithm uses but never trains (a reference, a reward model), by name; set in ``setup``.
        Default: none."""
        return self.__dict__.setdefault("_frozen", {})

    @frozen.setter
    def frozen(self, models: dict[str, torch.nn.Module]) -> None:
        self.__dict__["_frozen"] = dict(models)

    @classmethod
    def check_run(cls, options: dict[str, Any], config: dict[str, Any]) -> None:
        """Refuse (:class:`~rlhf.core.errors.UserError`) this algorithm's options (``options``: its config node) in
        combination with the rest of the run's ``config`` (resolved), before anything is built
        (:func:`rlhf.config.checks.check_config`); one option's range belongs in :func:`rlhf.core.limits.limits`. Default:
        nothing to check."""

    def tokenize(self, row: dict[str, str], tokenizer) -> dict[str, list[int]]:
        """One text row to token lists (run once per row, before training; the result is cached)."""
        raise NotImplementedError

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Tokenized rows to one padded batch of tensors."""
        raise NotImplementedError

    def setup(self, policy: torch.nn.Module, tokenizer) -> None:
        """Anything built from the initial policy before training: a reference copy goes into ``self.frozen``.
        Default: nothing."""

    def precompute(self, rows, strategy) -> Any:
        """The tokenized splits (a ``DatasetDict``, ``"train"`` and ``"eval"``) with any columns computed once before
        training, with the frozen models prepared and the hardware ``strategy`` started (every process calls it);
        ``collate`` then finds them in each row. Default: the rows unchanged."""
        return rows

    def batch_source(self, loader, state: TrainState, accelerator, model: torch.nn.Module | None = None
                     ) -> BatchSource:
        """Where training micro-batches come from. Default: the training split's batches, epoch after epoch,
        resumable mid-epoch (:class:`rlhf.data.loaders.Batches`); ``model`` unused. An online algorithm returns its
        own object whose ``next()`` samples with ``model`` (the trained policy, as the strategy wrapped it) from the
        loader's prompts, scores, and serves the result (:class:`rlhf.algos.online.Rollouts`); whatever it must
        carry across a checkpoint (the buffer being served) is in the algorithm's ``state_dict``."""
        return Batches(loader, state, accelerator)

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The scalar to minimize on one micro-batch, and the metrics to log (scalar tensors, averaged)."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Metrics of one held-out batch (scalar tensors; averaged over the split, weighted by rows)."""
        raise NotImplementedError

    def samples(self, batch: dict[str, Any]) -> int:
        """The examples in a training micro-batch ``batch`` (rows of the data, as ``train.per_device_batch_size``
        counts them: a pair for DPO; a completion for an online algorithm), for ``perf/samples_per_s``. Default:
        ``batch["input_ids"]``'s rows (the rows it packs, for a padding-free batch)."""
        return int(batch.get(PACKED_ROWS, batch["input_ids"].shape[0]))

    def micro_batch_shape(self, batch: dict[str, Any]) -> tuple[int, int]:
        """``(sequences, tokens)`` of the training micro-batch made from ``batch`` (what ``collate`` made of a
        micro-batch of rows), for the memory preflight. Default: ``batch["input_ids"]``'s shape."""
        sequences, tokens = batch["input_ids"].shape
        return int(sequences), int(tokens)

    def tables(self, step: int) -> dict[str, list[dict[str, Any]]]:
        """Rows to log after optimizer step ``step`` (main process), by table name: e.g. an online algorithm's
        sampled completions with their rewards. The loggers write each table to ``<name>.jsonl`` in the run folder
        (and W&B to a table). Default: none."""
        return {}

    def timings(self) -> dict[str, float]:
        """Seconds this algorithm spent in phases of its own since the last call, by name (the loop logs each as
        ``perf/<name>_time_s``, per optimizer step of the log window, the slowest process's), then starts over:
        e.g. an online algorithm's sampling (``generation``). Evaluation's share is not counted. Default: none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What this algorithm carries between steps (e.g. a running baseline), saved in each rank's checkpoint
        and read back with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts. Default:
        nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (an empty dict for a checkpoint that has none)."""


class BatchSource(Protocol):
    """What :meth:`Algorithm.batch_source` returns: the next training micro-batch, forever."""

    def next(self) -> dict[str, Tensor]: ...
