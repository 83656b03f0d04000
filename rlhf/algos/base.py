"""What the loop expects from an algorithm (:class:`Algorithm`, the one contract a new algorithm implements), and
the forward pass every log-likelihood method shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rlhf.algos.token_logps import selective_log_softmax
from rlhf.data import shared_prompt
from rlhf.data.collate import PACKED_ROWS, SEGMENT_IDS
from rlhf.data.loaders import Batches
from rlhf.errors import UserError
from rlhf.models.output_layer import answer, token_request
from rlhf.state import TrainState
from rlhf.validate import Range

# Allowed lengths for algorithms that tokenize prompt + completion (see rlhf.validate.limits).
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
    Allowed argument values are declared with :func:`rlhf.validate.limits` above the class.
    """

    columns: tuple[str, ...] = ()  # the columns each row must have (rlhf.data checks them): text, or typed (label)
    # The names of evaluate()'s metrics that every held-out evaluation reports, whatever the batch or option (one
    # that depends on them is left out): what a sweep's objective may name (rlhf.sweep), as eval/<name>.
    eval_metrics: tuple[str, ...] = ("loss",)
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
        """Refuse (:class:`~rlhf.errors.UserError`) this algorithm's options (``options``: its config node) in
        combination with the rest of the run's ``config`` (resolved), before anything is built
        (:func:`rlhf.config.check_config`); one option's range belongs in :func:`rlhf.validate.limits`. Default:
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


@dataclass
class CompletionStats:
    """Per-sequence statistics of the completion tokens of a batch (``B`` sequences, ``T`` positions)."""

    logps: Tensor  # [B] summed log-probability of the completion tokens (EOS included)
    num_tokens: Tensor  # [B] completion tokens per sequence
    greedy_match: Tensor  # [B] bool: argmax is the target at every completion position (= greedy decode matches)
    token_logps: Tensor  # [B, T-1] log-probability of each next completion token (0 elsewhere)
    mask: Tensor  # [B, T-1] bool, True on completion tokens
    every_token_logps: Tensor  # [B, T-1] log-probability of each next token, prompt and padding included


LOGITS_TO_KEEP = "logits_to_keep"  # a batch key: compute the output layer only at the last this many positions


def keep_completion_logits(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with :data:`LOGITS_TO_KEEP` set so that :func:`completion_stats` computes the output layer (and
    its log-softmax over the vocabulary) only from the position before the batch's earliest completion token on:
    the positions that score a completion token. The prompt's positions before it cost no ``[B, T, V]`` logits.
    Every model of transformers' ``*ForCausalLM`` takes ``logits_to_keep``. The forward pass's values are the same
    bit for bit; the output layer's gradient sums fewer rows (zeros) and may differ in the last bits."""
    mask = batch["completion_mask"]
    scored = mask[:, 1:].any(0)  # positions 1..T-1 that hold some sequence's completion token
    first = int(scored.float().argmax()) + 1 if bool(scored.any()) else mask.shape[1] - 1
    # a Python int: it stays on the host when the batch moves to the device, so reading it waits for nothing
    return {**batch, LOGITS_TO_KEEP: mask.shape[1] - first + 1}


def completion_stats(model: torch.nn.Module, batch: dict[str, Tensor]) -> CompletionStats:
    """One forward pass; log-probabilities of each sequence's completion given its prompt. With
    :data:`LOGITS_TO_KEEP` in the batch (:func:`keep_completion_logits`) only the last positions get logits; the
    statistics keep their ``[B, T-1]`` shape, 0 (and masked out) before them. A model whose output layer is tapped
    (:func:`rlhf.models.output_layer.tap_output_layer`) answers with the log-probabilities themselves, the logits
    never whole; any other computes logits and :func:`selective_log_softmax` reads them. A batch of pairs laid out
    around a shared prompt (:mod:`rlhf.data.shared_prompt`: ``B`` sequences) gives the statistics of its ``2B``
    answers, chosen first, as a plain batch of the pairs' ``2B`` sequences would."""
    keep = int(batch.get(LOGITS_TO_KEEP) or 0)
    extra = {"logits_to_keep": keep} if keep else {}
    shared = shared_prompt.BRANCH_IDS in batch
    packed = PACKED_ROWS in batch  # padding-free: position ids keep the rows apart (no mask, no cache)
    inputs = (shared_prompt.model_inputs(batch, model) if shared
              else {"position_ids": batch["position_ids"], "use_cache": False} if packed
              else {"attention_mask": batch["attention_mask"]})
    length = batch["input_ids"].shape[1]
    # A tapped output layer answers only if it sees the positions asked for (the last `keep`, or all)
    with token_request(batch["input_ids"][:, length - (keep or length) + 1:], with_argmax=True) as request:
        logits = model(input_ids=batch["input_ids"], **inputs, **extra).logits
    answered = answer(request, logits)
    if answered is not None:
        skipped = length - (keep or length)  # leading positions without logits
        every_token_logps, greedy_tokens = answered, request.argmax
    else:
        if logits.dim() != 3 or logits.shape[-1] == 1:  # a sequence-classification or value head: one scalar each
            raise UserError(f"this algorithm needs next-token logits, but the model outputs shape "
                            f"{list(logits.shape)}: it has another head. Fix: model.head=causal_lm")
        skipped = length - logits.shape[1]  # leading positions without logits
        every_token_logps, greedy_tokens = selective_log_softmax(logits, batch["input_ids"][:, skipped + 1:],
                                                                 with_argmax=True)  # positions 0..T-2
    labels = batch["input_ids"][:, skipped + 1:]
    mask = batch["completion_mask"][:, skipped + 1:].bool()
    token_logps = every_token_logps * mask
    hits = (greedy_tokens == labels) | ~mask
    if skipped:
        every_token_logps, token_logps = (torch.nn.functional.pad(x, (skipped, 0)) for x in (every_token_logps,
                                                                                             token_logps))
        mask, hits = (torch.nn.functional.pad(x, (skipped, 0), value=value) for x, value in ((mask, False),
                                                                                         (hits, True)))
    if shared:  # B pairs -> 2B answers; every_token_logps holds both branches in each row (nll_on_prompt reads it)
        token_logps, mask, hits = shared_prompt.split_branches(batch[shared_prompt.BRANCH_IDS], token_logps, mask,
                                                               hits)
        hits |= ~mask
        every_token_logps = torch.cat([every_token_logps, every_token_logps])
    if packed:  # per row of the packed sequence: sums over the positions whose next token is the row's
        rows, segments = batch[PACKED_ROWS], batch[SEGMENT_IDS][0, 1:]

        def per_row(values: Tensor) -> Tensor:
            return values.new_zeros(rows).index_add_(0, segments, values[0])

        return CompletionStats(per_row(token_logps), per_row(mask.long()), per_row((~hits).long()) == 0,
                               token_logps, mask, every_token_logps)
    greedy = hits.all(-1)
    return CompletionStats(token_logps.sum(-1), mask.sum(-1), greedy, token_logps, mask, every_token_logps)
