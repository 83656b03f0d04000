"""What the algorithms regularized toward a frozen reference model share (DPO and its loss family, KTO): building
the reference from the ``algo/reference`` strategy, turning dropout off, and the reference's log-probabilities."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.algos.base import PROMPT_TOKENS, SEQUENCE_TOKENS, Algorithm, prompt_leaves_room
from rlhf.models.reference import disable_dropout
from rlhf.validate import Range, limits


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

    def setup(self, policy, tokenizer) -> None:
        self.pad_id = tokenizer.pad_token_id
        if self.disable_dropout:
            disable_dropout(policy)  # before the reference is made: a copy inherits it
        reference = self.reference(policy, tokenizer)
        if self.disable_dropout:  # again: a strategy may add modules to the policy (a second adapter)
            for model in (policy, reference) if reference is not None else (policy,):
                disable_dropout(model)
        # The loop puts it where it runs (prepare_frozen); none for a reference-free objective.
        self.frozen = {"reference": reference} if reference is not None else {}

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.frozen.get("reference")

    def reference_logps(self, batch: dict[str, Tensor], policy: torch.nn.Module) -> Tensor:
        """``[B]``: the reference's summed completion log-probability of each of ``batch``'s sequences, without
        gradient, as the ``algo/reference`` strategy gives it: a forward pass of the reference model, the batch's
        precomputed column, or zeros (``none``: the log-ratios are then the log-probabilities)."""
        with torch.no_grad():
            return self.reference.logps(batch, self.ref_model, policy)
