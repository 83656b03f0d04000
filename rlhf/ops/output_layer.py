"""The output layer that can answer with token log-probabilities instead of logits.

A causal LM's forward pass ends with its output layer, ``logits = hidden @ W.T``: ``[B, T, V]`` values, and in
training as many again for their gradient. Where only the log-probability of one given token per position is
wanted (SFT, the DPO family, KTO, the online algorithms' completions), :func:`tap_output_layer` lets the output
layer compute that directly, a block at a time (:func:`rlhf.ops.token_logps.linear_log_softmax`: torch operations
over tiles of logits, or with ``algo.fused_output_layer=triton`` on a GPU a Triton kernel over blocks of rows, each one
matrix product over the whole vocabulary), so the logits never exist whole: on
a GPU they are the largest tensors of a step (``B x T x 152k`` at Qwen's vocabulary). A request may name the only
positions it needs (``rows``: those that score a completion token, :data:`rlhf.ops.completion_logps.SCORED_ROWS`):
the layer then gathers just their hidden states, and prompt and padding positions cost nothing. It
happens inside the output layer's own forward, so whatever a strategy hooks there (FSDP2's gathering of the sharded
weight, DeepSpeed ZeRO-3's) runs as for any other forward, and the model's own forward is unchanged otherwise.

:func:`completion_stats <rlhf.ops.completion_logps.completion_stats>` (and the online algorithms'
:func:`~rlhf.algos.policy_gradient.completion_logps`) ask with :func:`token_request`; a tapped layer
answers (and the model's output ``logits`` is then that ``[B, L]`` answer), an untapped one computes logits as
always and the caller does the log-softmax itself. A model that changes its logits after the output layer
(Gemma 2's soft-capping, Cohere's and Granite's logit scales) is not tapped: its output would not be the answer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.ops.linear_logps_torch import row_block
from rlhf.ops.token_logps import linear_log_softmax, tile_shape, triton_kernel

log = logging.getLogger(__name__)

# Config keys of models that transform the logits after the output layer (transformers' *ForCausalLM forward).
TRITON = "triton"  # algo.fused_output_layer: the Triton kernel on a GPU (not chosen by auto until a GPU measures it)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


@dataclass
class TokenRequest:
    """What :func:`completion_stats <rlhf.ops.completion_logps.completion_stats>` asks of the next output layer forward: the
    log-probabilities of ``index`` (``[B, L]``) at positions ``0 .. L-1`` of the layer's input, which must have
    ``L + 1`` positions (else the layer computes logits), and with them the greedy tokens or each position's entropy,
    all of ``softmax(logits / temperature)`` (an online algorithm's sampling temperature; 1 for every other use).
    ``rows`` (optional): the only positions whose answers are wanted, flat indices into ``[B, L]`` (``b * L + l``) on
    the layer's device; a tapped layer computes only those (the others answer 0, with no gradient).
    ``logps``, ``argmax`` and ``entropy`` are set when a tapped layer answered."""

    index: Tensor
    with_argmax: bool = False
    with_entropy: bool = False
    temperature: float = 1.0
    rows: Tensor | None = field(default=None, repr=False)
    logps: Tensor | None = None
    argmax: Tensor | None = field(default=None, repr=False)
    entropy: Tensor | None = field(default=None, repr=False)


_PENDING: list[TokenRequest] = []  # at most one: the request of the forward pass under way


@contextlib.contextmanager
def token_request(index: Tensor, with_argmax: bool = False, with_entropy: bool = False,
                  temperature: float = 1.0, rows: Tensor | None = None) -> Iterator[TokenRequest]:
    """Ask the output layer of the forward pass run inside this block for log-probabilities (see the module and
    :class:`TokenRequest`)."""
    request = TokenRequest(index, with_argmax, with_entropy, temperature, rows)
    _PENDING.append(request)
    try:
        yield request
    finally:
        _PENDING.remove(request)


class FusedOutputLayer(torch.nn.Linear):
    """An ``nn.Linear`` output layer (the class is swapped in place by :func:`tap_output_layer`: same parameters,
    same state-dict keys) that answers a pending :class:`TokenRequest` with log-probabilities: always
    (``fused=True``: with torch operations; ``"triton"``: with the Triton kernel on a GPU, torch operations
    elsewhere), or as :data:`rlhf.core.auto_choices.CHOICES` says for the device (``"auto"``). Without a request it is
    the plain layer."""

    fused: bool | str = "auto"
    answered = False  # set on the first answer, which is logged

    def _resolved(self, device: torch.device) -> bool | str:
        return auto_choices.pick("algo.fused_output_layer", device.type) if self.fused == "auto" else self.fused

    def answers_on(self, device: torch.device) -> bool:
        return self._resolved(device) is not False

    def kernel_on(self, device: torch.device) -> bool:
        """Whether it computes with the Triton kernel on ``device``: asked for (``triton``), on a GPU."""
        return self._resolved(device) == TRITON and device.type == "cuda"

    def forward(self, hidden: Tensor) -> Tensor:
        request = _PENDING[-1] if _PENDING else None
        if request is None or request.logps is not None or not self.answers_on(hidden.device) \
                or hidden.dim() != 3 or hidden.shape[:2] != (request.index.shape[0], request.index.shape[1] + 1):
            return super().forward(hidden)  # not asked, or not the positions asked for: logits
        triton = self.kernel_on(hidden.device)
        if triton and triton_kernel() is None:
            raise UserError("algo.fused_output_layer=triton: the triton package does not import here. Fix: pip "
                            "install triton (a CUDA build of torch brings it), or algo.fused_output_layer=true (the "
                            "same log-probabilities with torch operations)")
        if not self.answered:
            self.answered = True
            count = request.index.numel() if request.rows is None else request.rows.numel()
            rows, chunk = (row_block(count, self.out_features, hidden.device), self.out_features) if triton \
                else tile_shape(count, self.out_features, hidden.device)
            log.info("the output layer computes the token log-probabilities itself, %d rows x %d vocabulary entries "
                     "of logits at a time, with %s (algo.fused_output_layer=%s)", rows, chunk,
                     "a Triton kernel" if triton else "torch operations", str(self.fused).lower())
        request.logps, request.argmax, request.entropy = linear_log_softmax(
            hidden, self.weight, self.bias, request.index, with_argmax=request.with_argmax,
            with_entropy=request.with_entropy, temperature=request.temperature, rows=request.rows, triton=triton)
        return request.logps


def answer(request: TokenRequest, output: Tensor) -> Tensor | None:
    """The model's ``output`` (its ``logits``) as the answer to ``request``, or ``None`` where the layer computed
    logits. The model's output, not the layer's: a strategy may have wrapped it in a hook of its backward pass
    (ZeRO-3 gathers the layer's weight again there); it must hold the same values in the same memory."""
    if request.logps is None:
        return None
    if output.shape != request.logps.shape or output.data_ptr() != request.logps.data_ptr():
        raise UserError("the model changed what its output layer returned (a transform of its logits after the output "
                        "layer): its log-probabilities cannot be computed inside that layer. "
                        "Fix: algo.fused_output_layer=false")
    return output


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None


def answers(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``model``'s (unwrapped) output layer answers a :class:`TokenRequest` on ``device``."""
    layer = _output_layer(model)
    return isinstance(layer, FusedOutputLayer) and layer.answers_on(device)


def check_when(fused: Any, key: str = "algo.fused_output_layer",
               fix: str = "auto (on a GPU: the logits never whole), true (everywhere, torch operations), triton (the "
                          "Triton kernel on a GPU) or false (the output layer computes logits)",
               names: tuple[str, ...] = ("auto", TRITON)) -> bool | str:
    """``fused`` if it is true, false or one of ``names`` (``auto``, and for the output layer ``triton``); else a
    :class:`UserError` that names ``key`` and ``fix``."""
    if not (fused is True or fused is False or fused in names):
        shown = ", ".join([names[0], "true", "false", *names[1:]])
        raise UserError(f"{key}={fused!r} is not one of {shown}. Fix: {key}={fix}")
    return fused


def tap_output_layer(model: torch.nn.Module, fused: bool | str = "auto") -> bool:
    """Make ``model``'s output layer a :class:`FusedOutputLayer` (in place) where it can answer for the model:
    a plain ``nn.Linear`` (not one an adapter wraps, as LoRA on the output layer does) of a model that uses its
    logits as they come out. Returns whether it did; ``fused=False`` leaves the model as it is."""
    check_when(fused)
    layer = _output_layer(model)
    if fused is False or layer is None:
        return False
    if type(layer) not in (torch.nn.Linear, FusedOutputLayer):
        log.info("the output layer is a %s, not a plain linear layer: it computes logits (algo.fused_output_layer "
                 "has no effect)", type(layer).__name__)
        return False
    config = getattr(model, "config", None)
    transforms = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    if transforms:
        log.info("the model changes its logits after the output layer (%s): it computes logits "
                 "(algo.fused_output_layer has no effect)", ", ".join(transforms))
        return False
    layer.__class__ = FusedOutputLayer
    layer.fused = fused
    return True
