"""What the algorithms regularized toward a frozen reference model share (DPO and its loss family, KTO): building
the reference from the ``algo/reference`` strategy, turning dropout off, and the reference's log-probabilities.

Held-out batches cost one forward pass, not two, after the first evaluation: the reference is frozen, so its
log-probabilities of a held-out batch are kept (in memory, by the batch's tokens) and read back at every later
evaluation of the same batch. At the first evaluation of a run whose reference is a copy of the initial policy
(``algo/reference=copy``, :attr:`~rlhf.models.reference.Reference.copies_policy`), before any training step, they
are the policy's own: the same weights compute the same values, bit for bit (tested), so that evaluation needs no
reference pass either. Every process keeps its own batches' values, yet all take the same way (a forward pass, or
none): under FSDP2 and ZeRO-3 the reference's forward pass is a collective, so where any process misses (one-row
KTO batches hit on their own mismatched pair), every process runs it (one all-reduce of a flag per held-out batch).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from rlhf.algos.base import PROMPT_TOKENS, SEQUENCE_TOKENS, Algorithm, prompt_leaves_room
from rlhf.core.limits import Range, limits
from rlhf.models.reference import disable_dropout
from rlhf.ops.collectives import flag_on_any_process
from rlhf.ops.output_layer import tap_output_layer


@limits(
    prompt_leaves_room,
    beta=Range(gt=0, meaning="the KL penalty's strength; 0.1-0.5 is common", fix=0.1),
    max_prompt_length=PROMPT_TOKENS,
    max_length=SEQUENCE_TOKENS,
)
class ReferenceRegularized(Algorithm):
    """An :class:`Algorithm` with a frozen reference; its subclasses inherit the allowed values of ``beta``,
    ``max_prompt_length`` and ``max_length`` declared here. A subclass sets, in its ``__init__``:

    - ``reference``: a :class:`~rlhf.models.reference.Reference` strategy (the config group ``algo/reference``);
    - ``disable_dropout``: turn every dropout off in policy and reference (as TRL does), so log-ratios start at 0.
    """

    reference: Any
    disable_dropout: bool = True
    pad_id: int = 0
    HELD_OUT_BATCHES_KEPT = 100_000  # held-out batches whose reference values are kept (a [B] tensor each)
    _copy_of_policy: torch.nn.Module | None = None  # see setup()

    fused_output_layer: bool | str = False  # tap the policy's output layer (rlhf.ops.output_layer): DPO and KTO set it

    def setup(self, policy, tokenizer) -> None:
        self.pad_id = tokenizer.pad_token_id
        tap_output_layer(policy, self.fused_output_layer)  # before the reference is made: a copy inherits it
        if self.disable_dropout:
            disable_dropout(policy)  # before the reference is made: a copy inherits it
        reference = self.reference(policy, tokenizer)
        if reference is not None:  # one loaded on its own (algo/reference=model) answers as the policy does
            tap_output_layer(reference, self.fused_output_layer)
        if self.disable_dropout:  # again: a strategy may add modules to the policy (a second adapter)
            for model in (policy, reference) if reference is not None else (policy,):
                disable_dropout(model)
        # The loop puts it where it runs (prepare_frozen); none for a reference-free objective.
        self.frozen = {"reference": reference} if reference is not None else {}
        self._held_out_reference: dict[bytes, Tensor] = {}
        # The reference model that computes what the untrained policy computes, until a training batch (or a
        # checkpoint's state) says the policy moved. Placing it (prepare_frozen) keeps the object, but for ZeRO.
        self._copy_of_policy = reference if getattr(self.reference, "copies_policy", False) else None

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.frozen.get("reference")

    def reference_logps(self, batch: dict[str, Tensor], policy: torch.nn.Module, held_out: bool = False,
                        policy_logps: Tensor | None = None) -> Tensor:
        """``[B]``: the reference's summed completion log-probability of each of ``batch``'s sequences, without
        gradient, as the ``algo/reference`` strategy gives it: a forward pass of the reference model, the batch's
        precomputed column, or zeros (``none``: the log-ratios are then the log-probabilities).

        ``held_out``: an evaluation batch, whose values are kept and read back at the next evaluation (a training
        batch marks the policy as trained). ``policy_logps``: the policy's values of the same batch, which are the
        reference's while the policy is the untrained copy's twin (see the module's docstring)."""
        model = self.ref_model
        if not held_out:
            self._copy_of_policy = None  # the policy trains from here on
        if not held_out or model is None:  # no forward pass to save (precomputed, none), or training
            with torch.no_grad():
                return self.reference.logps(batch, model, policy)
        kept = self.__dict__.setdefault("_held_out_reference", {})
        key = _tokens_key(batch)
        # Taken on every process alike (set up, then cleared by a training batch or a resume on each).
        untrained_twin = policy_logps is not None and model is self._copy_of_policy
        if not untrained_twin and flag_on_any_process(key not in kept, batch["input_ids"].device):
            # A forward pass: under FSDP2 or ZeRO-3 a collective, so every process runs it when any one misses
            # (a process may hit where another misses: its batch was seen before, e.g. KTO's one-row held-out
            # batch, whose mismatched pair is itself). A process that would have hit computes the same values.
            with torch.no_grad():
                values = self.reference.logps(batch, model, policy)
        elif key in kept:
            return kept[key]
        else:
            values = policy_logps.detach()
        if len(kept) < self.HELD_OUT_BATCHES_KEPT:
            kept[key] = values
        return values

    def forget_untrained_policy(self) -> None:
        """The policy is no longer the one the reference was copied from (a checkpoint's weights were loaded)."""
        self._copy_of_policy = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forget_untrained_policy()  # a resume: the policy holds the checkpoint's weights


def _tokens_key(batch: dict[str, Tensor]) -> bytes:
    """What a batch's reference values depend on besides the frozen model: its token ids, attention and completion
    masks, the logits kept and a shared prompt's layout (a digest of their bytes and shapes)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("input_ids", "attention_mask", "completion_mask", "logits_to_keep", "branch_ids", "position_ids"):
        value = batch.get(name)
        if isinstance(value, Tensor):
            digest.update(f"{name}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()
