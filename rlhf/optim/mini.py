"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More", https://arxiv.org/abs/2406.16793)
from the authors' ``adam-mini`` package (https://github.com/zyushun/Adam-mini; extra ``rlhf[optimizers]``):
``conf/optimizer/adam_mini.yaml``.

Adam keeps one second moment ``v`` per parameter; Adam-mini keeps one per block, the mean of the squared gradient
over the block, where a block is what the Hessian of a transformer is near block-diagonal in (the paper's Section
2): one row per token for the embedding and the output layer, one head for the query and key matrices, one output
neuron (a row) for the value, attention-output and MLP matrices, Adam's own ``v`` for biases, and one value for
each other tensor (the norms). Its state is then the first moment plus a few values per matrix: about half of
AdamW's.

The package picks a tensor's block by keywords in its name. Here :class:`AdamMiniBlocks` (the partition,
``optimizer.partition``) picks it, from the tensor's role, name and shape, refuses a matrix it cannot place, and
hands the package one parameter group per block rule; :class:`AdamMini` names each group with a keyword the
package dispatches on, so the package applies exactly the rule the start-up line and ``partition.json`` show.
"""

from __future__ import annotations

from typing import Any

import adam_mini
import torch

from rlhf.core.errors import UserError
from rlhf.optim.partition import Part, Split, embedding_ids, partition_name

# A rule's name (a part's ``rule``) -> a keyword of adam-mini 1.1.1 that sends a group to that rule in its step().
PACKAGE_KEYWORD = {"per_row": "embed", "per_head": "q_proj", "per_entry": "bias", "per_tensor": "norm"}

# adam-mini 1.1.1's name keywords (Adam_mini.__init__), for the matrices not found by role; tested against it.
QUERY_KEY_NAMES = ("k_proj", "q_proj", "wq", "wk", "query", "key")
PER_ROW_NAMES = ("v_proj", "wv", "value", "o_proj", "wo", "attn.proj", "feed_forward", "linear", "mlp")
CONFIG_FIELDS = ("hidden_size", "num_attention_heads")


def _dims(model: torch.nn.Module) -> dict[str, int]:
    """``dim``, ``n_heads`` and ``n_kv_heads`` from ``model.config``, with the head width Adam-mini assumes
    (hidden_size / heads) checked against the model's own ``head_dim``."""
    config = getattr(model, "config", None)
    missing = [name for name in CONFIG_FIELDS if not isinstance(getattr(config, name, None), int)]
    if missing:
        raise UserError(f"optimizer=adam_mini keeps one second moment per attention head, so it needs the model's "
                        f"config.hidden_size, config.num_attention_heads (and config.num_key_value_heads under "
                        f"grouped-query attention); this model ({type(model).__name__}) has no "
                        f"{', '.join('config.' + name for name in missing)}. Fix: a transformer model whose config has "
                        "them (Llama, Qwen, GPT-NeoX style), or optimizer=adamw")
    dim, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or dim // heads
    if dim % heads or head_dim != dim // heads or heads % kv_heads:
        raise UserError(f"optimizer=adam_mini: this model's heads are {head_dim} wide ({heads} query and {kv_heads} "
                        f"key/value heads, hidden_size {dim}), and adam-mini's per-head blocks assume hidden_size / "
                        "num_attention_heads, with the query heads a multiple of the key/value heads. Fix: "
                        "optimizer=adamw for this model")
    return {"dim": dim, "n_heads": heads, "n_kv_heads": kv_heads}


class AdamMiniBlocks:
    """Adam-mini's partition: which second-moment block each trainable tensor gets (the rule of its part).

    - ``per_row``: the input embedding and the output layer (found by role, tied or not: one value per token) and
      the matrices named as values, attention outputs and MLP layers (one per output neuron), and LoRA's A and B
      matrices (one per row: the paper does not treat adapters; a row is the finest block it uses for a matrix);
    - ``per_head``: the query and key matrices, one value per head (their rows must divide into heads of
      hidden_size / num_attention_heads);
    - ``per_entry``: biases, with Adam's own ``v``;
    - ``per_tensor``: norms and other vectors (a matrix with one row or column: a reward head), one value each.

    A matrix that is none of these (a fused QKV projection, a name adam-mini does not know) is refused: the package
    would give it one value for the whole matrix, a rule the paper does not propose for it."""

    def __init__(self) -> None:
        """No settings: a field given in the config is refused by name (rlhf.config.checks)."""

    def __call__(self, model: torch.nn.Module) -> Split:
        dims = _dims(model)
        head_rows = dims["dim"] // dims["n_heads"]
        roles = embedding_ids(model)
        parts = {"per_row": Part("embeddings, output layer (per token); values, attention outputs, MLPs, LoRA "
                                 "(per row)", "per_row"),
                 "per_head": Part("queries and keys (per head)", "per_head"),
                 "per_entry": Part("biases (per entry, as Adam)", "per_entry", {"weight_decay": 0.0}),
                 "per_tensor": Part("norms and vectors (per tensor)", "per_tensor", {"weight_decay": 0.0})}
        unplaced, seen = [], set()
        for name, param in model.named_parameters():
            if not param.requires_grad or id(param) in seen:  # a tied tensor is one tensor
                continue
            seen.add(id(param))
            lower = name.lower()
            if lower.endswith(".bias") or lower.endswith("_bias"):
                rule = "per_entry"
            elif param.ndim < 2 or "norm" in lower or (param.ndim == 2 and min(param.shape) == 1):
                rule = "per_tensor"
            elif param.ndim != 2:
                rule = None
            elif id(param) in roles or "lora_" in lower:
                rule = "per_row"
            elif any(key in lower for key in QUERY_KEY_NAMES):
                rule = "per_head" if param.shape[0] % head_rows == 0 else None
            elif any(key in lower for key in PER_ROW_NAMES):
                rule = "per_row"
            else:
                rule = None
            if rule is None:
                unplaced.append(f"{name} {tuple(param.shape)}")
            else:
                parts[rule].add(name, param)
        if unplaced:
            raise UserError(f"optimizer=adam_mini cannot tell which block {len(unplaced)} tensor(s) belong to: "
                            f"{', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''}. It places the "
                            "embedding and output layer by role, query/key matrices by the names "
                            f"{', '.join(QUERY_KEY_NAMES)} (rows a multiple of the head width {head_rows}), and "
                            f"other matrices by {', '.join(PER_ROW_NAMES)}; the package would give an unknown matrix "
                            "one second moment for all of it. Fix: optimizer=adamw for this model, or freeze those "
                            "tensors (peft=lora)")
        return Split(partition_name(self), [part for part in parts.values() if part.params], options=dims)


class AdamMini(adam_mini.Adam_mini):
    """``adam_mini.Adam_mini`` built from :class:`AdamMiniBlocks`' groups, one group per block rule (the groups'
    ``rule``), so that ``param_groups`` pair one to one with the partition's parts. ``dim``, ``n_heads`` and
    ``n_kv_heads`` come from the partition (``Split.options``: the model's config), not from the YAML.

    One process's result under ``cpu_ddp``/``ddp``: every process holds whole tensors and the same averaged
    gradients, so the package's all-gather over the GPUs it counts (for sharded tensors) is turned off."""

    # Read by rlhf.config.checks: refused under hardware=fsdp and zero1-3.
    whole_matrices = ("keeps one second moment per row, head or tensor of each whole matrix, found by its shape, "
                      "and reduces a norm's statistics across GPUs with its own CUDA-only code")

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, dim: int | None = None, n_heads: int | None = None,
                 n_kv_heads: int | None = None):
        groups = list(params)
        if (dim is None or n_heads is None
                or not all(isinstance(group, dict) and group.get("rule") in PACKAGE_KEYWORD for group in groups)):
            raise UserError("optimizer=adam_mini is built from its partition's blocks and the model's dimensions. "
                            "Fix: optimizer.partition._target_=rlhf.optim.mini.AdamMiniBlocks (as in "
                            "conf/optimizer/adam_mini.yaml)")
        named = [(PACKAGE_KEYWORD[group["rule"]], param) for group in groups for param in group["params"]]
        super().__init__(named, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, dim=dim,
                         n_heads=n_heads, n_kv_heads=n_kv_heads, verbose=False)
        self.world_size = 1  # whole tensors in every process (sharded strategies are refused): nothing to gather
        self.check_block_name = False  # the package's name census only prints, and only when verbose
        self.param_groups = []
        for group in groups:
            rule = group["rule"]
            self.add_param_group({**group, "name": PACKAGE_KEYWORD[rule],
                                  "weight_decay": group.get("weight_decay", weight_decay)})

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: the model's dimensions come from the partition, never the YAML."""
        given = [key for key in ("dim", "n_heads", "n_kv_heads") if node.get(key) is not None]
        if given:
            raise UserError(f"{where}.{given[0]}: Adam-mini's dimensions are read from the model's config by its "
                            "partition (rlhf.optim.mini.AdamMiniBlocks), so a value here could contradict the "
                            f"model. Fix: remove {where}.{given[0]}")
        partition = node.get("partition")
        target = partition.get("_target_") if isinstance(partition, dict) else None
        if target != f"{AdamMiniBlocks.__module__}.{AdamMiniBlocks.__qualname__}":
            raise UserError(f"{where}.partition._target_={target}: Adam-mini's parameter groups are its block "
                            "rules. Fix: optimizer.partition._target_=rlhf.optim.mini.AdamMiniBlocks")
