"""Which trainable tensors get which update rule and learning rate: the optimizer's parameter groups as a component.

A partition is ``optimizer.partition`` in the config (a ``_target_`` node; absent: :class:`DecayMatrices`, the
grouping every optimizer has always had). Called with the model, it returns a :class:`Split`: named parts, each a
list of tensors, the rule that updates them (a key of :class:`rlhf.optim.rules.PerRule`'s rules, or none for a
one-rule optimizer) and what its group overrides (``weight_decay: 0``). The split gives the optimizer its parameter
groups, one per part in order, and says at start-up and in the run folder (``partition.json``) how many tensors and
parameters each part holds and at which learning rate, so that a result can publish which tensors got which rule
(Wen et al. 2025, "Fantastic Pretraining Optimizers and Where to Find Them", https://arxiv.org/abs/2509.02046).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.core.errors import UserError


@dataclass
class Part:
    """Tensors that one rule updates with one set of group settings."""

    name: str  # what the tensors are, for people: "hidden matrices"
    rule: str | None  # the rule's key in a PerRule optimizer; None: the optimizer's one rule
    overrides: dict[str, Any] = field(default_factory=dict)  # group settings over the rule's own (weight_decay: 0)
    names: list[str] = field(default_factory=list)  # the tensors' names in model.named_parameters()
    params: list[torch.nn.Parameter] = field(default_factory=list)

    def add(self, name: str, param: torch.nn.Parameter) -> None:
        self.names.append(name)
        self.params.append(param)

    def group(self) -> dict[str, Any]:
        """This part as an optimizer parameter group."""
        return {"params": self.params, **({"rule": self.rule} if self.rule is not None else {}), **self.overrides}


@dataclass
class Split:
    """A model's trainable tensors split into parts by a partition (``kind``: its class, for the record)."""

    kind: str
    parts: list[Part]
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments the model tells the optimizer (Adam-mini: dim, heads)

    def build(self, make_optimizer: Any) -> torch.optim.Optimizer:
        """The optimizer ``make_optimizer`` (a ``conf/optimizer`` partial) builds from this split's groups and the
        model's facts it needs (:attr:`options`)."""
        return make_optimizer(self.groups(), **self.options)

    def groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, one per part, in order (a part may be empty)."""
        return [part.group() for part in self.parts]

    def rows(self, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
        """One row per part: its name, rule, tensor and parameter counts and, given the optimizer the groups built
        (its groups in the same order), the learning rate and weight decay it starts with (before any schedule)."""
        groups = list(optimizer.param_groups) if optimizer is not None else []
        rows = []
        for i, part in enumerate(self.parts):
            row: dict[str, Any] = {"part": part.name, "rule": part.rule, "tensors": len(part.params),
                                   "parameters": sum(p.numel() for p in part.params)}
            if i < len(groups):
                group = groups[i]
                row["lr"] = float(group.get("initial_lr", group.get("lr", float("nan"))))
                row["weight_decay"] = float(group.get("weight_decay", 0.0))
                if group.get("adjust_lr_fn"):  # Muon: each matrix's lr is scaled by its shape
                    row["adjust_lr_fn"] = group["adjust_lr_fn"]
            row["names"] = list(part.names)
            rows.append(row)
        return rows

    def describe(self, optimizer: torch.optim.Optimizer | None = None) -> str:
        """The start-up line: each part's rule, tensors, parameters and learning rate."""
        pieces = []
        for row in self.rows(optimizer):
            rule = f"{row['rule']}: " if row["rule"] else ""
            lr = f", lr {row['lr']:g}" if "lr" in row else ""
            lr += f" ({row['adjust_lr_fn']})" if "adjust_lr_fn" in row else ""
            wd = f", weight_decay {row['weight_decay']:g}" if "weight_decay" in row else ""
            pieces.append(f"{rule}{row['part']} {row['tensors']} tensor(s), {row['parameters']:,} parameters{lr}{wd}")
        return f"optimizer partition ({self.kind}): " + "; ".join(pieces)

    def record(self, optimizer: torch.optim.Optimizer | None = None) -> str:
        """``partition.json``'s text: the partition's class and each part's row with its tensors' names."""
        return json.dumps({"partition": self.kind, "parts": self.rows(optimizer)}, indent=2) + "\n"


def _is_vector(name: str, param: torch.nn.Parameter) -> bool:
    """Biases, norms' scales and other vectors: no weight decay, and no matrix rule. A matrix with one row or one
    column (a linear layer to a single value: a reward model's score, a value head) is a vector too."""
    return (param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias")
            or (param.ndim == 2 and min(param.shape) == 1))


def partition_name(partition: object) -> str:
    return f"{type(partition).__module__}.{type(partition).__qualname__}"


class DecayMatrices:
    """Every trainable tensor under the optimizer's one rule, in two groups: matrices with the optimizer's weight
    decay, and biases, norms and 1-D tensors without (``weight_decay: 0``). The default partition: what every
    optimizer of ``conf/optimizer`` has been given since the first release, group for group."""

    def __init__(self) -> None:
        """No settings: a field given in the config is refused by name (rlhf.config.checks)."""

    def __call__(self, model: torch.nn.Module) -> Split:
        decay = Part("matrices", None)
        no_decay = Part("biases, norms and 1-D tensors", None, {"weight_decay": 0.0})
        for name, param in model.named_parameters():
            if not param.requires_grad:  # frozen tensors get no optimizer state
                continue
            (no_decay if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).add(name, param)
        return Split(partition_name(self), [decay, no_decay] if no_decay.params else [decay])


def embedding_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the input embedding's and output layer's weights (one id when they are tied), found by role
    (``get_input_embeddings`` / ``get_output_embeddings``), not by shape: both are matrices."""
    found = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            found.add(id(weight))
    return found


def by_role(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, str]]:
    """The model's trainable tensors, each once (a tied tensor is one tensor), with their role: ``vector`` (biases,
    norms, 1-D, a matrix with one row or column), ``outer`` (the input embedding and the output layer, found by role,
    and tensors of more than two dimensions) or ``hidden`` (the hidden layers' 2-D weights, LoRA's A and B too): the
    split every rule for whole matrices starts from (Muon's, GaLore's, APOLLO's)."""
    roles, seen, found = embedding_ids(model), set(), []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        role = "vector" if _is_vector(name, param) else "outer" if id(param) in roles or param.ndim != 2 else "hidden"
        found.append((name, param, role))
    return found


class HiddenMatrices:
    """Muon's partition (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/: "Muon is an optimizer for
    the hidden layers"): the 2-D weights of the hidden layers go to the rule ``muon``; the input embedding and the
    output layer (matrices too, told apart by role: tied or not), tensors of more than two dimensions, and the
    vectors (biases, norms, 1-D, a matrix with one row or column) go to ``adamw``, the vectors without weight decay.

    LoRA's A and B matrices (``peft=lora``) are hidden matrices here, so ``optimizer=muon peft=lora`` fine-tunes
    the adapters with Muon: the question the 2026 comparison of Muon under full and LoRA fine-tuning asks
    (arXiv 2605.10468); B starts at zero, A's first gradient is then zero and Newton-Schulz leaves it at zero."""

    def __init__(self) -> None:
        """No settings: a field given in the config is refused by name (rlhf.config.checks)."""

    def __call__(self, model: torch.nn.Module) -> Split:
        hidden = Part("hidden matrices", "muon")
        outer = Part("embeddings, output layer and >2-D tensors", "adamw")
        vectors = Part("biases, norms and vectors", "adamw", {"weight_decay": 0.0})
        tensors = by_role(model)
        for name, param, role in tensors:
            {"vector": vectors, "outer": outer, "hidden": hidden}[role].add(name, param)
        if not hidden.params:
            trainable = len(tensors)
            raise UserError(f"optimizer=muon updates the hidden layers' matrices, and this model has none that train "
                            f"({trainable} trainable tensor(s): embeddings, the output layer, norms, biases or vectors "
                            "only). Fix: train the hidden layers (peft=none, or a LoRA on the attention/MLP "
                            "projections), or optimizer=adamw.")
        return Split(partition_name(self), [hidden, outer, vectors])


def from_config(node: Any) -> tuple[Any, Any]:
    """``(partition, make_optimizer)`` from a ``conf/optimizer`` node: its ``partition`` (a ``_target_`` node;
    absent: :class:`DecayMatrices`) built, and the optimizer's partial built from the rest. Call
    ``make_optimizer(partition(model).groups())``."""
    from omegaconf import OmegaConf

    from rlhf.core.instantiate import build

    rest = OmegaConf.create(OmegaConf.to_container(node, resolve=True)) if not isinstance(node, dict) else dict(node)
    spec = rest.pop("partition", None)
    partition = build(spec) if spec is not None else DecayMatrices()
    return partition, build(rest, _convert_="all")  # plain lists (betas): checkpoints load weights-only
