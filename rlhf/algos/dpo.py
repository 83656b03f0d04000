"""Direct Preference Optimization (Rafailov et al., 2023, arXiv:2305.18290).

With policy log-ratios against a frozen reference, ``h = (log pi(y_w|x) - log ref(y_w|x)) -
(log pi(y_l|x) - log ref(y_l|x))``, the sigmoid loss is ``-log sigmoid(beta * h)``. Log-probabilities are
summed over completion tokens (EOS included). Loss variants are the functions of :mod:`rlhf.algos.dpo_losses`,
chosen by the config group ``algo/loss`` (``conf/algo/loss/*.yaml``); they all take the pair's log-probabilities
(:class:`~rlhf.algos.dpo_losses.PairLogps`), ``beta`` and the loss's state, which this class saves in checkpoints.
The reference-free SimPO and ORPO are such losses too, on average log-probabilities, with ``algo/reference=none``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.algos.dpo_losses import Loss, LossState, PairLogps, sigmoid_loss
from rlhf.algos.regularized import ReferenceRegularized
from rlhf.algos.sft import nll_loss, require_packing
from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data import layout_masks, shared_prompt
from rlhf.data.collate import collate_packed, collate_sequences, require_completion
from rlhf.data.encoding import FORMAT_COLUMN, TEXT, TRUNCATED, encode_answers
from rlhf.models.reference import FrozenCopy, Reference
from rlhf.ops.collectives import processes, sum_over_every_process
from rlhf.ops.completion_logps import completion_stats, keep_completion_logits
from rlhf.ops.output_layer import check_when


def packing_lays_out_alone(values: dict[str, Any], where: str) -> None:
    """Refuse ``padding_free`` beside an NLL it cannot read (``nll_on_prompt``, which reads the chosen sequences'
    padded rows)."""
    if values.get("padding_free") is not True:
        return
    if values.get("nll_on_prompt") is True:
        raise UserError(f"{where}.padding_free=true does not take {where}.nll_on_prompt=true (that NLL reads the "
                        f"chosen sequences as padded rows). Fix: {where}.padding_free=false")


@limits(packing_lays_out_alone,
        nll_weight=Range(ge=0, meaning="weight of the NLL term on the chosen answer; 0 is plain DPO, 1 is RPO", fix=1.0))
class DPO(ReferenceRegularized):
    """DPO on ``prompt``/``chosen``/``rejected`` rows; chosen and rejected share one forward pass.

    Args:
        beta: strength of the implicit KL penalty (> 0); rewards are ``beta * log(pi/ref)``.
        loss: the per-pair loss, a function of (:class:`PairLogps`, beta, state) from :mod:`rlhf.algos.dpo_losses`.
        reference: a :class:`~rlhf.models.reference.Reference` strategy (the config group ``algo/reference``): it
            builds the frozen reference model from the initial policy and its tokenizer (``self.frozen["reference"]``,
            or none) and gives the reference log-probabilities of each batch.
        nll_weight: weight (>= 0) of an added NLL term on the chosen completion (RPO, Pang et al. 2024,
            arXiv:2404.19733; SimPO's and CPO's ``cpo_alpha``; 1 for ORPO); 0 is plain DPO. The NLL is the mean
            over the batch's chosen completion tokens.
        nll_on_prompt: the NLL term also covers the prompt tokens of the chosen sequences (TRL's ORPO).
        disable_dropout: turn every dropout off in policy and reference (as TRL does), attention dropout read from
            the model config included, so log-ratios start at 0.
        max_prompt_length: prompts longer than this many tokens keep their end (>= 1, < max_length, or null).
        max_length: sequences longer than this many tokens lose their end (>= 1, or null).
        completion_logits_only: compute the output layer only where it scores completion tokens (from the batch's
            earliest one on), for the policy and the reference alike (:func:`~rlhf.ops.completion_logps.keep_completion_logits`).
            On by default (measured faster: ``benchmarks/levers.py``); off by itself with ``nll_on_prompt``, which
            scores the prompt too.
        fused_output_layer: where the output layer computes the token log-probabilities itself, a tile of logits at a time,
            so that the ``[B, T, V]`` logits and their gradient never exist whole (policy and reference;
            :mod:`rlhf.ops.output_layer`): ``auto`` (on a GPU, where those are a step's largest tensors),
            ``true`` (also on a CPU, where it measured 0.91-1.11x: the backward pass computes the logits again),
            ``triton`` (the Triton kernel on a GPU: not yet chosen by ``auto``) or ``false``. Models that transform their logits after the output layer compute logits whatever this says.
        shared_prompt: lay each pair out as one sequence, chosen and rejected after one shared prompt
            (:mod:`rlhf.data.shared_prompt`; prefix sharing), so the prompt runs through the layers once, not twice
            (policy and reference): ``auto`` (where the model can take it: a family checked to, an attention that
            takes a custom mask, no sliding window shorter than ``max_length``; :func:`shared_prompt.unsupported`),
            ``true`` (required: a model that cannot take it is an error) or ``false`` (two sequences a pair). Off by
            itself with ``nll_on_prompt``. Log-probabilities equal the two sequences' to rounding. Where every model
            (policy and reference) runs ``flex_attention``, or with ``padding_free``, the micro-batch's pairs are
            packed into one row of their tokens, no padding (:func:`shared_prompt.collate_packed`), under one
            attention mask built once per batch for both models (:mod:`rlhf.data.layout_masks`: flex attention's
            block mask skips whole blocks of another pair or the other branch); elsewhere each pair is a padded row
            under a dense ``T x T`` mask (which takes sdpa off its causal kernel).
        padding_free: a micro-batch's ``2B`` sequences (chosen, then rejected) packed into one sequence without
            padding, position ids restarting in each (TRL's ``padding_free``; :func:`~rlhf.data.collate.collate_packed`),
            for policy and reference: no token is padding; with ``shared_prompt`` (``auto``: where the model can take
            it) the pairs are packed around their prompts instead. The same loss and metrics as padded pairs
            (tested). On a GPU, a model under ``sdpa`` or ``eager`` attention (which would keep the sequences apart
            by a mask of the packed length squared) is switched to ``flex_attention``, or refused at setup where it
            does not support it (:func:`~rlhf.data.layout_masks.attention_for_packing`); on a CPU (no backward pass
            for flex attention there) it keeps its attention, and one that does not keep packed rows apart is
            refused. Does not take ``nll_on_prompt``.

    The allowed values (``@limits`` above, and :class:`ReferenceRegularized`'s) are checked by
    :func:`rlhf.config.checks.check_config` before anything is built.
    """

    columns = ("prompt", "chosen", "rejected")
    tokenize_reads = ("max_prompt_length", "max_length")
    answer_metrics = ("exact_match",)  # the embedded task's one answer (Algorithm.answer_metrics)
    eval_metrics = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "exact_match")  # and nll_loss with nll_weight

    def __init__(
        self,
        beta: float = 0.1,
        loss: Loss = sigmoid_loss,
        reference: Reference | None = None,
        nll_weight: float = 0.0,
        nll_on_prompt: bool = False,
        disable_dropout: bool = True,
        max_prompt_length: int | None = 512,
        max_length: int | None = 1024,
        completion_logits_only: bool = True,
        fused_output_layer: bool | str = "auto",
        shared_prompt: bool | str = "auto",
        padding_free: bool = False,
    ) -> None:
        self.fused_output_layer = check_when(fused_output_layer)
        self.shared_prompt = check_when(shared_prompt, "algo.shared_prompt",
                                        "auto (pairs share their prompt where the model can take it)", ("auto",))
        self.padding_free = padding_free
        self.shares_prompt = shared_prompt is True and not nll_on_prompt  # auto: decided in setup() by the model
        self.packs = padding_free  # also where every model runs flex attention and pairs share prompts: setup()
        self.completion_logits_only = completion_logits_only and not nll_on_prompt  # that NLL scores the prompt
        self.beta, self.loss_fn, self.nll_weight, self.nll_on_prompt = beta, loss, nll_weight, nll_on_prompt
        self.reference = reference if reference is not None else FrozenCopy()
        self.disable_dropout = disable_dropout
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        self.pad_id = 0
        self.loss_state: LossState = {}  # what the loss keeps across steps (BCO's running mean); in checkpoints

    def tokenize(self, row: dict[str, str], tokenizer) -> dict[str, list[int]]:
        out = {TRUNCATED: 0}
        sides = encode_answers(tokenizer, row["prompt"], {side: row[side] for side in ("chosen", "rejected")},
                               row.get(FORMAT_COLUMN, TEXT), self.max_prompt_length, self.max_length)
        for side, encoded in sides.items():
            require_completion(encoded, row, side, self.max_length)
            out[f"{side}_input_ids"], out[f"{side}_completion_mask"] = encoded["input_ids"], encoded["completion_mask"]
            out[TRUNCATED] |= encoded[TRUNCATED]
        return out

    def setup(self, policy, tokenizer) -> None:
        super().setup(policy, tokenizer)
        models = [policy, *(m for m in self.frozen.values() if isinstance(m, torch.nn.Module))]
        if self.padding_free:
            for model in models:  # on a GPU, flex attention where sdpa would need an N x N mask (or refused)
                if (switch := layout_masks.attention_for_packing(model, on_gpu=layout_masks.computes_on_gpu())) is not None:
                    model.set_attn_implementation(switch)
                require_packing(model, warn=model is policy)
        self.shares_prompt = self._shares_prompt(models)
        self.packs = self.padding_free or (self.shares_prompt and all(
            shared_prompt.attention_of(m) == layout_masks.FLEX for m in models))

    def _shares_prompt(self, models: list[torch.nn.Module]) -> bool:
        """Whether pairs are laid out around one prompt (``shared_prompt``; refused where ``true`` and a model
        cannot take it)."""
        if self.shared_prompt is False or self.nll_on_prompt:
            return False
        if self.shared_prompt == "auto" and not auto_choices.pick("algo.shared_prompt", _device_type(models[0])):
            return False
        reasons = [reason for m in models if (reason := shared_prompt.unsupported(m, self.max_length))]
        if reasons and self.shared_prompt is True:
            raise UserError(f"algo.shared_prompt=true: this model cannot take pairs laid out around one prompt: "
                            f"{reasons[0]}. Fix: algo.shared_prompt=auto (on where it can) or false")
        return not reasons

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """The pairs' sequences (:meth:`sequences`) and the reference strategy's columns (precomputed
        log-probabilities)."""
        batch = {**self.sequences(rows), **self.reference.collate(rows)}
        return keep_completion_logits(batch) if self.completion_logits_only else batch

    def sequences(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Chosen sequences first, then rejected: ``[2B, T]`` for one concatenated forward pass (sequence ``k`` is
        row ``k % B``'s ``k // B``-th); with :attr:`shares_prompt`, ``[B, T]`` pairs each after its one prompt
        (:func:`rlhf.data.shared_prompt.collate`) or, with :attr:`packs`, those pairs packed into ``[1, N]``
        (:func:`rlhf.data.shared_prompt.collate_packed`); else with :attr:`packs` the ``2B`` sequences packed into
        ``[1, N]`` (:func:`rlhf.data.collate.collate_packed`): every way the statistics come out in the same ``2B``
        order."""
        if self.shares_prompt:
            pairs = ([r["chosen_input_ids"] for r in rows], [r["chosen_completion_mask"] for r in rows],
                     [r["rejected_input_ids"] for r in rows], [r["rejected_completion_mask"] for r in rows])
            return shared_prompt.collate_packed(*pairs) if self.packs else shared_prompt.collate(*pairs, self.pad_id)
        if not self.packs:
            return self._padded_sequences(rows)
        ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        return collate_packed(ids, [r["chosen_completion_mask"] for r in rows] +
                              [r["rejected_completion_mask"] for r in rows])

    def samples(self, batch: dict[str, Any]) -> int:
        return shared_prompt.scored_sequences(batch) // 2  # two answers a pair, however they are laid out

    def precompute(self, rows, strategy):
        """The reference strategy's columns (e.g. ``algo/reference=precomputed``'s log-probabilities), computed on
        padded pairs when training packs them (the reference model is built there, unchecked for packing; the
        values are the same to rounding)."""
        return self.reference.precompute(rows, strategy, self._padded_sequences if self.packs else self.sequences)

    def _padded_sequences(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        masks = [r["chosen_completion_mask"] for r in rows] + [r["rejected_completion_mask"] for r in rows]
        return collate_sequences(ids, masks, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"loss": {name: value.detach().cpu().clone() for name, value in self.loss_state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_state = {name: value.clone() for name, value in state.get("loss", {}).items()}
        super().load_state_dict(state)  # a resume: the policy holds the checkpoint's weights

    def loss(self, model, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """``training=False`` (held-out batches): the loss state is read but not updated. A training batch's pairs
        carry :func:`~rlhf.ops.collectives.sum_over_every_process` where several processes run (``PairLogps.global_sum``):
        a loss that reads the step's whole batch (BCO's running mean) sums over them."""
        policy = completion_stats(model, batch)
        ref_logps = self.reference_logps(batch, model, held_out=not training,
                                         policy_logps=None if training else policy.logps)  # zeros: reference=none
        n = policy.logps.shape[0] // 2  # pairs: chosen answers first
        # A training step's pairs are spread over the processes: a loss that reads the whole batch sums over them
        pairs = PairLogps(policy.logps[:n], policy.logps[n:], ref_logps[:n], ref_logps[n:],
                          policy.num_tokens[:n], policy.num_tokens[n:],
                          global_sum=sum_over_every_process if training and processes() > 1 else None)
        chosen_logratios, rejected_logratios = pairs.chosen_logratios, pairs.rejected_logratios
        state = self.loss_state if training else dict(self.loss_state)
        losses = self.loss_fn(pairs, self.beta, state)
        loss = losses.mean()
        if self.nll_weight:
            if self.nll_on_prompt:  # every token of the chosen sequences but the first, which nothing predicts
                tokens = batch["attention_mask"][:n, 1:].bool()
                nll = nll_loss(policy.every_token_logps[:n] * tokens, tokens)
            else:  # the chosen answers' summed log-probabilities over their tokens: any layout (padded, packed)
                nll = -policy.logps[:n].sum() / policy.num_tokens[:n].sum().clamp(min=1)
            loss = loss + self.nll_weight * nll
            nll_metric = {"nll_loss": nll.detach()}  # TRL's name (CPO, ORPO)
        else:
            nll_metric = {}
        chosen_rewards = self.beta * chosen_logratios.detach()
        rejected_rewards = self.beta * rejected_logratios.detach()
        # Metric names are TRL's, so runs can be compared with DPOTrainer's logs.
        metrics = {
            "loss": loss.detach(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": policy.logps[:n].detach().mean(),
            "logps/rejected": policy.logps[n:].detach().mean(),
            "exact_match": policy.greedy_match[:n].float().mean(),
            **nll_metric,
        }
        return loss, metrics

    def evaluate(self, model, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.loss(model, batch, training=False)[1]


def _device_type(model: torch.nn.Module) -> str:
    """Where ``model`` will compute (the strategy places the models after setup): ``cuda`` where the run computes on
    a GPU (:func:`~rlhf.data.layout_masks.computes_on_gpu`), else the device it is on."""
    return "cuda" if layout_masks.computes_on_gpu() else next(model.parameters()).device.type
