"""The attention of the batch layouts that put several sequences in one row, built once per batch.

Two layouts place tokens that must not see each other in one row: pairs around a shared prompt
(:mod:`rlhf.data.shared_prompt`: padded rows of one pair each, or the pairs packed into one row) and padding-free
batches (:func:`rlhf.data.collate.collate_packed`: a micro-batch's sequences packed into one row). One rule says
what a token sees (:func:`sees`): the keys before it (and itself) of its own pair or sequence, among them the shared
prefix (branch 0) and its own branch only; a padding position sees itself only, so that no row of the mask is empty.
A model takes the rule in the form its attention applies (:func:`model_inputs`):

- ``flex_attention``: a ``BlockMask`` (``torch.nn.attention.flex_attention``; Dong et al. 2024, "Flex Attention: A
  Programming Model for Generating Optimized Attention Kernels", arXiv:2412.05496): the rule evaluated per block of
  128 x 128, so that blocks no query sees (another pair, the other branch, padding) are skipped, not computed;
- ``sdpa`` (and this project's ``rlhf_sdpa``): a boolean ``[B, 1, T, T]`` mask; ``eager``: the same as an additive
  float mask (0 where seen, the dtype's minimum elsewhere);
- a padding-free batch under any other attention (flash attention's variable-length kernel, or ``sdpa``/``eager``
  on a CPU): no mask, position ids restarting in each sequence (transformers keeps the rows apart by them).

The mask is built at the first forward pass of a batch and kept in the batch (:data:`MASKS`, by form and device), so
that the policy's and the reference's forward passes of one batch share it. A model computing a padding-free batch on
a GPU under an attention that needs a ``T x T`` mask for it is switched to flex attention, or refused
(:func:`attention_for_packing`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.data.collate import SEGMENT_IDS
from rlhf.data.shared_prompt import (
    BRANCH_IDS,
    MASKED_ATTENTION,
    PADDING,
    PAIR_IDS,
    POSITION_IDS,
    attention_of,
)

MASKS = "layout_masks"  # a batch key: {(form, device): attention mask} built by model_inputs, shared by its passes
FLEX = "flex_attention"


def sees(query_branch: Tensor, key_branch: Tensor, query_document: Tensor, key_document: Tensor, query: Tensor,
         key: Tensor) -> Tensor:
    """Whether the token at position ``query`` attends to the one at ``key`` (broadcast elementwise): ``key`` not
    after ``query``, in the same document (pair or packed sequence), and in the shared prefix (branch 0) or the
    query's own branch; a padding query (:data:`~rlhf.data.shared_prompt.PADDING`) sees itself only."""
    visible = (key <= query) & (query_document == key_document) & ((key_branch == 0) | (key_branch == query_branch))
    return (visible & (query_branch != PADDING)) | (query == key)


def _layout(batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """``[B, T]`` branch and document ids of ``batch``: a padding-free batch's sequences are one branch each, a
    padded shared-prompt batch's rows one document each."""
    branch = batch.get(BRANCH_IDS)
    documents = batch.get(PAIR_IDS, batch.get(SEGMENT_IDS))
    if branch is None:
        branch = torch.ones_like(documents)
    if documents is None:
        documents = torch.zeros_like(branch)
    return branch, documents


def dense_mask(branch: Tensor, documents: Tensor, additive: bool = False) -> Tensor:
    """:func:`sees` as a ``[B, 1, T, T]`` (query, key) mask of ``[B, T]`` branch and document ids: boolean, or
    additive float (0 where seen, float32's minimum elsewhere) for ``additive``."""
    positions = torch.arange(branch.shape[1], device=branch.device)
    allowed = sees(branch[:, :, None], branch[:, None, :], documents[:, :, None], documents[:, None, :],
                   positions[:, None], positions[None, :])[:, None]
    if additive:  # eager adds the mask to its scores
        return torch.zeros(allowed.shape, device=branch.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed


def block_mask(branch: Tensor, documents: Tensor, compiled: bool | None = None):
    """:func:`sees` as flex attention's ``BlockMask`` for ``[B, T]`` branch and document ids. On a GPU the mask's
    construction is compiled (``create_block_mask(_compile=True)``, as torch's documentation recommends for long
    sequences): evaluated eagerly it materialises ``[B, T, T]`` tensors (the booleans alone are 0.5 GB at the 22,000
    tokens of 32 packed pairs of a few hundred tokens), compiled it evaluates block by block. On a CPU (tests, short
    rows) it is evaluated eagerly. ``compiled``: compile the construction (True) or not (False) whatever the device
    (the tests compile it on a CPU); ``None``: on a GPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return sees(branch[b, q], branch[b, kv], documents[b, q], documents[b, kv], q, kv)

    rows, length = branch.shape
    return create_block_mask(mask_mod, rows, None, length, length, device=branch.device,
                             _compile=branch.is_cuda if compiled is None else compiled)


def model_inputs(batch: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``attention_mask``, ``position_ids`` and ``use_cache`` for a forward pass of ``model`` on a batch of one of
    the module docstring's layouts, the mask in the form ``model``'s attention takes, built once per batch and
    device (kept in ``batch[MASKS]``)."""
    attention = attention_of(model)
    shared = BRANCH_IDS in batch
    if attention == FLEX:
        form = "block"
    elif shared:
        form = "additive" if attention == "eager" else "boolean"
    else:  # padding-free: position ids keep the rows apart (flash's variable-length kernel, transformers' masks)
        return {"position_ids": batch[POSITION_IDS], "use_cache": False}
    branch, documents = _layout(batch)
    masks = batch.setdefault(MASKS, {})
    key = (form, str(branch.device))
    if key not in masks:
        masks[key] = block_mask(branch, documents) if form == "block" else dense_mask(branch, documents,
                                                                                        form == "additive")
    return {"attention_mask": masks[key], "position_ids": batch[POSITION_IDS], "use_cache": False}


def attention_for_packing(model: Any, on_gpu: bool) -> str | None:
    """The attention implementation ``model`` is switched to for padding-free batches (None: it keeps its own).
    Flash and flex attention keep packed sequences apart without a ``T x T`` mask; ``sdpa`` and ``eager`` need one
    (transformers builds it from the position ids: memory and compute grow with the square of the packed length,
    and sdpa leaves its flash kernel). On a GPU such a model is switched to flex attention where it supports it, and
    refused where it does not; on a CPU, where flex attention has no backward pass, it keeps its attention."""
    attention = attention_of(model)
    if not on_gpu or attention not in MASKED_ATTENTION or attention == FLEX:
        return None
    if getattr(model, "_supports_flex_attn", False):
        return FLEX
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise UserError(f"algo.padding_free=true on a GPU: this model ({family}) runs {attention} attention, which keeps "
                    "packed sequences apart only by a mask of the packed length squared, and it does not support "
                    "flex attention. Fix: model.attn_implementation=flash_attention_2 (where the model and the GPU "
                    "support it) or algo.padding_free=false")



def computes_on_gpu() -> bool:
    """Whether this process's run computes on a GPU: the device its hardware strategy gave Accelerate (a
    ``hardware=cpu`` run on a machine with a GPU computes on the CPU), or, before any strategy started (a model set
    up outside a run), whether a GPU is there."""
    from accelerate.state import PartialState

    if PartialState._shared_state:  # noqa: SLF001  (initialised by the strategy's Accelerator)
        return PartialState().device.type == "cuda"
    return torch.cuda.is_available()
