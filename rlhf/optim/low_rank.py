"""Low-rank optimizers from ``apollo-torch`` (extra ``rlhf[optimizers]``): GaLore and APOLLO, with the partition that
tells them which tensors to project.

- GaLore (Zhao et al. 2024, https://arxiv.org/abs/2403.03507): each hidden matrix's gradient is projected onto its
  top-``rank`` singular vectors (an SVD, refreshed every ``update_proj_gap`` steps); Adam runs in that subspace and
  the update is projected back, so between two refreshes every update of the matrix lies in one rank-``rank``
  subspace.
- APOLLO (Zhu et al. 2024, https://arxiv.org/abs/2412.05270): the gradient is projected with a random Gaussian matrix
  (``proj: random``), Adam's moments are kept in rank ``rank``, and the raw gradient is scaled channel by channel
  (``scale_type: channel``) or as a whole (``tensor``: APOLLO-Mini) by how much Adam changed the low-rank gradient's
  norm.

Both libraries' optimizers step a parameter group with a ``rank`` key as low-rank (with its ``proj``, ``proj_type``,
``update_proj_gap``, ``scale``, ``scale_type``), and any other group as plain AdamW. :class:`LowRankMatrices` and
:class:`ApolloMatrices` make those groups: the hidden layers' 2-D weights low-rank; the input embedding, the output
layer (matrices too, told apart by role), tensors of more than two dimensions and the vectors (biases, norms, 1-D)
plain, the vectors without weight decay.

The libraries keep each matrix's projection in a Python object in the optimizer's state (``state["projector"]``),
which ``torch.load(weights_only=True)`` cannot read back and the memory count does not see. :class:`GaLoreAdamW` and
:class:`APOLLOAdamW` keep it as tensors instead: between steps the state holds ``projection`` (the projection matrix)
and, for APOLLO, ``seed`` (the seed its next random projection is drawn from: the library seeds each matrix's
projection with the parameter's position in the optimizer, 1, 2, ..., draws it from a private ``torch.Generator``,
never the global one, and derives the next seed at each refresh), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import inspect
from typing import Any

import apollo_torch
import torch

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.optim.partition import Part, Split, by_role, partition_name

PROJ_TYPES = ("std", "reverse_std", "left", "right")  # the projections both libraries implement ("full": GaLore's only)
SCALE_TYPES = ("channel", "tensor")  # APOLLO: one scaling factor per channel, or one per matrix (APOLLO-Mini)
PROJS = ("random", "svd")  # APOLLO's projection: a seeded Gaussian matrix, or GaLore's SVD


def matrix_rank(shape: torch.Size | tuple[int, ...], rank: int, max_rank_fraction: float) -> int:
    """The rank a matrix of ``shape`` is projected to: ``rank``, at most ``max_rank_fraction`` of its smaller side
    (at least 1), so that its moments are always smaller than Adam's."""
    return max(1, min(int(rank), int(max_rank_fraction * min(shape))))


@limits(
    rank=Range(ge=1, integer=True, meaning="rank of each hidden matrix's projected gradient", fix=8),
    max_rank_fraction=Range(gt=0, le=1, meaning="the largest rank as a fraction of a matrix's smaller side", fix=0.25),
    update_proj_gap=Range(ge=1, integer=True, meaning="optimizer steps between two refreshes of a projection", fix=200),
    scale=Range(gt=0, meaning="factor of the low-rank matrices' update", fix=1.0),
)
class LowRankMatrices:
    """GaLore's partition: the hidden layers' 2-D weights (LoRA's A and B too) in low-rank groups, one per rank
    (:func:`matrix_rank` of each matrix), carrying the library's group keys; the input embedding, the output layer
    (by role, tied or not), tensors of more than two dimensions in a plain group with the optimizer's weight decay;
    biases, norms and vectors in a plain group without."""

    def __init__(self, rank: int = 8, max_rank_fraction: float = 0.25, update_proj_gap: int = 200,
                 scale: float = 1.0, proj_type: str = "std") -> None:
        self.rank, self.max_rank_fraction = rank, max_rank_fraction
        self.update_proj_gap, self.scale, self.proj_type = update_proj_gap, scale, proj_type

    def keys(self, rank: int) -> dict[str, Any]:
        """The group keys of a low-rank group of ``rank``, named as the library reads them."""
        return {"rank": rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale, "proj_type": self.proj_type}

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer.partition") -> None:
        """Before anything is built: the projection's type is one the library implements."""
        if node.get("proj_type", "std") not in PROJ_TYPES:
            raise UserError(f"{where}.proj_type={node['proj_type']!r} is not one of {', '.join(PROJ_TYPES)} "
                            f"(std: the smaller side projected). Fix: {where}.proj_type=std")

    def __call__(self, model: torch.nn.Module) -> Split:
        low_rank: dict[int, Part] = {}
        outer = Part("embeddings, output layer and >2-D tensors", None)
        vectors = Part("biases, norms and vectors", None, {"weight_decay": 0.0})
        tensors = by_role(model)
        for name, param, role in tensors:
            if role == "vector":
                vectors.add(name, param)
            elif role == "outer":
                outer.add(name, param)
            else:
                rank = matrix_rank(param.shape, self.rank, self.max_rank_fraction)
                if rank not in low_rank:
                    low_rank[rank] = Part(f"hidden matrices in rank {rank}", None, self.keys(rank))
                low_rank[rank].add(name, param)
        if not low_rank:
            raise UserError(f"{type(self).__name__} projects the hidden layers' matrices to low rank, and this model "
                            f"has none that train ({len(tensors)} trainable tensor(s): embeddings, the output layer, "
                            "norms, biases or vectors only). Fix: train the hidden layers (peft=none, or a LoRA on the "
                            "attention/MLP projections), or optimizer=adamw.")
        parts = [low_rank[rank] for rank in sorted(low_rank, reverse=True)]
        return Split(partition_name(self), [*parts, outer, vectors])


@limits(
    rank=Range(ge=1, integer=True, meaning="rank of each hidden matrix's projected gradient (1: APOLLO-Mini)", fix=128),
    max_rank_fraction=Range(gt=0, le=1, meaning="the largest rank as a fraction of a matrix's smaller side", fix=0.25),
    update_proj_gap=Range(ge=1, integer=True, meaning="optimizer steps between two refreshes of a projection", fix=200),
    scale=Range(gt=0, meaning="the update of the low-rank matrices is multiplied by sqrt(scale)", fix=1.0),
)
class ApolloMatrices(LowRankMatrices):
    """APOLLO's partition: :class:`LowRankMatrices` with APOLLO's group keys, the projection (``proj``) and the
    granularity of the gradient's scaling (``scale_type``)."""

    def __init__(self, rank: int = 128, max_rank_fraction: float = 0.25, update_proj_gap: int = 200,
                 scale: float = 1.0, proj_type: str = "std", proj: str = "random",
                 scale_type: str = "channel") -> None:
        super().__init__(rank, max_rank_fraction, update_proj_gap, scale, proj_type)
        self.proj, self.scale_type = proj, scale_type

    def keys(self, rank: int) -> dict[str, Any]:
        return {**super().keys(rank), "proj": self.proj, "scale_type": self.scale_type}

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer.partition") -> None:
        """Before anything is built: the projection and the scaling are ones APOLLO implements."""
        LowRankMatrices.check_options(node, where)
        for key, choices, fix in (("proj", PROJS, "random"), ("scale_type", SCALE_TYPES, "channel")):
            if node.get(key, fix) not in choices:
                raise UserError(f"{where}.{key}={node[key]!r} is not one of APOLLO's {', '.join(choices)}. "
                                f"Fix: {where}.{key}={fix}")


def _only_in(partition: type, other: type) -> list[str]:
    """The constructor arguments of ``partition`` that ``other`` does not take (APOLLO's ``proj``, ``scale_type``)."""
    mine, theirs = (inspect.signature(c.__init__).parameters for c in (partition, other))
    return [name for name in mine if name not in theirs]


class _ProjectionsAsTensors:
    """A low-rank optimizer whose projections are tensors in its state between steps (see the module's docstring):
    each step rebuilds the library's projector objects from them and takes them apart again afterwards."""

    partition: type = LowRankMatrices  # the partition whose groups this optimizer reads: this class, no other

    def _projector(self, group: dict[str, Any], state: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _low_rank(self):
        for group in self.param_groups:
            if "rank" in group:
                for param in group["params"]:
                    yield group, self.state[param]

    @torch.no_grad()
    def step(self, closure=None):
        """The library's step, with each matrix's projection restored before it and stored as tensors after."""
        for group, state in self._low_rank():
            projector = self._projector(group, state)
            projector.ortho_matrix = state.pop("projection", None)  # None: the library draws it at its first step
            state["projector"] = projector
        try:
            return super().step(closure)
        finally:
            for _group, state in self._low_rank():
                projector = state.pop("projector", None)
                if projector is not None and projector.ortho_matrix is not None:
                    state["projection"] = projector.ortho_matrix
                    if hasattr(projector, "seed"):  # APOLLO: the seed of the next random projection
                        state["seed"] = projector.seed

    @classmethod
    def _check_partition(cls, node: dict[str, Any], where: str) -> None:
        from hydra.utils import get_object

        spec = node.get("partition")
        target = spec.get("_target_") if isinstance(spec, dict) else None
        found = get_object(target) if isinstance(target, str) else None
        name = f"{cls.partition.__module__}.{cls.partition.__qualname__}"
        if inspect.isclass(found) and issubclass(found, LowRankMatrices):
            extra, missing = _only_in(found, cls.partition), _only_in(cls.partition, found)
            if not extra and not missing:  # its own partition, or one that groups other tensors with its keys
                return
            reason = "; ".join([*([f"it adds {', '.join(extra)}, which {cls.__name__} ignores"] if extra else []),
                                *([f"it lacks {', '.join(missing)}, which {cls.__name__} needs"] if missing else [])])
            raise UserError(f"{where}.partition={target}: {cls.__name__} takes the parameter groups of {name} and no "
                            f"other partition's ({reason}). Fix: {where}.partition._target_={name}")
        raise UserError(f"{where}: {cls.__name__} projects only the parameter groups that carry a rank, which "
                        f"{name} makes; with {where}.partition={target or 'absent'} no group has one and every "
                        f"tensor would get plain AdamW. Fix: {where}.partition._target_={name}")


class GaLoreAdamW(_ProjectionsAsTensors, apollo_torch.GaLoreAdamW):
    """GaLore's AdamW (``apollo_torch.GaLoreAdamW``, the GaLore authors' code) on :class:`LowRankMatrices`' groups,
    its SVD projections kept as tensors in the state."""

    whole_matrices = "projects each hidden matrix's gradient onto its top singular vectors (an SVD of the whole matrix)"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias)

    def _projector(self, group: dict[str, Any], state: dict[str, Any]) -> Any:
        from apollo_torch.svd_projector import GaLoreProjector

        return GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                               proj_type=group["proj_type"])

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: the partition makes groups with a rank."""
        GaLoreAdamW._check_partition(node, where)


class APOLLOAdamW(_ProjectionsAsTensors, apollo_torch.APOLLOAdamW):
    """APOLLO's AdamW (``apollo_torch.APOLLOAdamW``, the APOLLO authors' code) on :class:`ApolloMatrices`' groups, its
    projections and their seeds kept as tensors and integers in the state."""

    partition = ApolloMatrices
    whole_matrices = ("projects each hidden matrix's gradient with a random matrix sized to the whole matrix and "
                      "scales it by the norms of its whole rows or columns")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True, scale_front: bool = False,
                 disable_nl: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
                         scale_front=scale_front, disable_nl=disable_nl)

    def _projector(self, group: dict[str, Any], state: dict[str, Any]) -> Any:
        return self._initialize_projector(group, state)  # seeded with state["seed"]

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: the partition makes groups with APOLLO's keys."""
        APOLLOAdamW._check_partition(node, where)
