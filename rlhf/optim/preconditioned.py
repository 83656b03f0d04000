"""SOAP and PSGD-Kron, heavyball's implementations (https://github.com/HomebrewML/HeavyBall, 3.2), as the options
``optimizer=soap`` and ``optimizer=psgd_kron``: each a subclass that names its arguments (heavyball's constructors
take ``**kwargs``, so a misspelt field would pass the checks made before loading and fail only once the run has
built the model), and that changes four of the library's behaviours for this project's runs:

- **Compiling.** heavyball compiles its kernels with ``torch.compile`` (``heavyball.utils.compile_mode``, a module
  global, "max-autotune-no-cudagraphs"): on a CPU the first PSGD-Kron step spent 75 s autotuning. ``compile``:
  ``auto`` compiles where the parameters are on a GPU, ``true`` / ``false`` always / never. heavyball reads the
  global at every kernel call, so :meth:`step` sets it from this optimizer's setting for the step (None: eager, the
  library's own off switch) and puts the previous value back afterwards, so that nothing else in the process sees
  this optimizer's choice.
- **Resuming.** torch's ``Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's
  dtype (``torch/optim/optimizer.py``: ``_process_value_according_to_param_policy``): PSGD's float64 lower bounds
  would come back as float32, and a bfloat16 model's float32 moments and preconditioners as bfloat16, so a resumed
  run would drift from the uninterrupted one. The saved tensors are put back as saved (:meth:`_keep_saved_state`).
- **Gradients.** heavyball sets every ``p.grad`` to None inside ``step()`` unless its ``consume_grad`` flag
  (``heavyball.utils.StatefulOptimizer``) is false. It is false here: the gradients stay as they were for the loop,
  which zeroes them after the step as it does for every optimizer (``zero_grad``), and a gradient norm taken after
  the step sees them.
- **Loading code.** heavyball's ``state_dict()`` stores its preconditioner schedule (a function) as
  ``pickle.dumps(...)`` bytes under ``state_dict["heavyball"]["precond_schedule"]``, and its load hook calls
  ``pickle.loads`` on them: a checkpoint could run code when it is loaded, which this project's checkpoints never do
  (:mod:`rlhf.run.checkpoint` loads with ``weights_only=True``, and that returns the bytes untouched). The saved
  state holds no such entry (:meth:`_Heavyball._without_pickle`, a state-dict post-hook), and loading drops it
  before heavyball's hook runs (:meth:`_Heavyball._drop_pickle`, a load pre-hook put first): the schedule is the one
  the constructor built from the config, the same function the saved one was.

Randomness: both decide when to update the preconditioner by a running sum of the update probability
(``heavyball.utils.psgd_should_update``: deterministic, its count saved in the state dict's ``heavyball`` entry);
PSGD's preconditioner update draws its probe vectors from torch's global generator (``torch.randn_like``), whose
state every checkpoint saves and restores (:mod:`rlhf.run.checkpoint`). Both are bit-identical on resume (tested).
"""

from __future__ import annotations

from typing import Any

import heavyball
import torch

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits

LIBRARY_COMPILE_MODE = heavyball.utils.compile_mode  # heavyball's own default, "max-autotune-no-cudagraphs"
COMPILE_CHOICES = ("auto", True, False)


def _compiles(compile: bool | str, params: list[torch.Tensor]) -> bool:
    """Whether heavyball's kernels are compiled: ``auto`` where the first parameter is on a GPU."""
    if compile == "auto":
        return bool(params) and params[0].device.type == "cuda"
    return bool(compile)


def check_compile(node: dict[str, Any], where: str) -> None:
    """``compile`` is one of auto, true, false (before anything is built)."""
    value = node.get("compile", "auto")
    if not any(value is choice or value == choice and isinstance(choice, str) for choice in COMPILE_CHOICES):
        raise UserError(f"{where}.compile={value!r}: whether heavyball compiles its kernels with torch.compile, one "
                        "of auto (on a GPU only), true, false. Fix: optimizer.compile=auto")


PICKLED = ("precond_schedule",)  # entries of state_dict["heavyball"] that heavyball 3.2 pickles


def _unpickled(stats: dict[str, Any]) -> dict[str, Any]:
    """heavyball's ``state_dict["heavyball"]`` entry without what its load hook would unpickle: ``precond_schedule``,
    and any other ``bytes`` value (a pickle a later heavyball might add)."""
    return {key: value for key, value in stats.items() if key not in PICKLED and not isinstance(value, bytes)}


def _restore(loaded: Any, saved: Any) -> Any:
    """``loaded`` (torch's cast copy of a state entry) with each tensor replaced by the ``saved`` one as it was
    saved (its dtype), on the loaded one's device; dictionaries and lists changed in place."""
    if isinstance(loaded, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(device=loaded.device, copy=True)
    if isinstance(loaded, dict) and isinstance(saved, dict):
        for key in loaded:
            if key in saved:
                loaded[key] = _restore(loaded[key], saved[key])
        return loaded
    if isinstance(loaded, list) and isinstance(saved, (list, tuple)) and len(loaded) == len(saved):
        loaded[:] = [_restore(x, y) for x, y in zip(loaded, saved)]
        return loaded
    if isinstance(loaded, tuple) and isinstance(saved, (list, tuple)) and len(loaded) == len(saved):
        return tuple(_restore(x, y) for x, y in zip(loaded, saved))
    return loaded


class _Heavyball:
    """What both options add to their heavyball class (a mixin before it): the compile setting and the saved state
    restored as saved."""

    compile: bool | str

    def _setup(self, compile: bool | str) -> None:
        self.compile = compile
        self.register_state_dict_post_hook(_Heavyball._without_pickle)  # after heavyball's, which adds the entry
        self.register_load_state_dict_pre_hook(_Heavyball._drop_pickle, prepend=True)  # before heavyball's loads it
        self.register_load_state_dict_pre_hook(_Heavyball._remember_saved_state)
        self.register_load_state_dict_post_hook(_Heavyball._keep_saved_state)

    @staticmethod
    def _without_pickle(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict without heavyball's pickled entries (``precond_schedule``; any other ``bytes`` value)."""
        state_dict["heavyball"] = _unpickled(state_dict.get("heavyball", {}))
        return state_dict

    @staticmethod
    def _drop_pickle(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state dict to load with heavyball's pickled entries left out (a copy: the caller's stays as it was), so
        that heavyball's own load hook, which runs after this one, never calls ``pickle.loads``."""
        state_dict = dict(state_dict)
        state_dict["heavyball"] = _unpickled(state_dict.get("heavyball", {}))
        return state_dict

    @staticmethod
    def _remember_saved_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        optimizer._saved = (ids, state_dict["state"])  # torch casts copies; the dict's own tensors stay as saved

    @staticmethod
    def _keep_saved_state(optimizer: torch.optim.Optimizer) -> None:
        """After torch's load: each state tensor as saved (dtype and bits), on the device torch put it on. torch
        maps the saved ids to the parameters in group order; the same here."""
        ids, saved = optimizer.__dict__.pop("_saved", ([], {}))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, param in zip(ids, params):
            if i in saved and param in optimizer.state:
                optimizer.state[param] = _restore(optimizer.state[param], saved[i])

    def step(self, closure=None):
        """heavyball's step, its kernels compiled or eager as :attr:`compile` says (``heavyball.utils.compile_mode``
        set for the step, as the library reads it at each kernel call, and its previous value put back after)."""
        params = [p for group in self.param_groups for p in group["params"]]
        previous = heavyball.utils.compile_mode
        heavyball.utils.compile_mode = LIBRARY_COMPILE_MODE if _compiles(self.compile, params) else None
        try:
            return super().step(closure)
        finally:
            heavyball.utils.compile_mode = previous


@limits(shampoo_beta=Range(ge=0, lt=1, meaning="decay of the gradient's row and column statistics (Shampoo's "
                           "factors)", fix=0.95),
        precondition_frequency=Range(ge=1, integer=True, meaning="optimizer steps between two updates of the "
                                     "eigenbases", fix=10),
        max_precond_dim=Range(ge=1, integer=True, meaning="largest dimension given a preconditioner; a larger one "
                              "(the vocabulary) is left unrotated", fix=2048),
        warmup_steps=Range(ge=0, integer=True, meaning="optimizer steps of heavyball's own linear warmup", fix=0))
class SOAP(_Heavyball, heavyball.SOAP):
    """SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", https://arxiv.org/abs/2409.11321):
    Adam run in the eigenbasis of Shampoo's preconditioner. For each matrix ``G`` (m x n) it keeps the running
    statistics ``L = E[G G^T]`` and ``R = E[G^T G]`` (decay ``shampoo_beta``), and every ``precondition_frequency``
    steps their eigenbases ``Q_L``, ``Q_R`` (heavyball: one QR power step from the previous ones); the gradient is
    rotated into them, ``Q_L^T G Q_R``, Adam's moments are kept there, and the update is rotated back. A dimension
    above ``max_precond_dim`` is not rotated; vectors get plain Adam (``precondition_1d`` false). State per
    m x n matrix: 2 m n (Adam's moments) + 2 (m^2 + n^2) floats."""

    whole_matrices = "rotates each matrix's gradient into the eigenbases of its row and column statistics"

    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float = 0.95,
                 eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10,
                 max_precond_dim: int = 2048, precondition_1d: bool = False, warmup_steps: int = 0,
                 compile: bool | str = "auto"):
        super().__init__(params, lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                         weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                         max_precond_dim=max_precond_dim, precondition_1d=precondition_1d, warmup_steps=warmup_steps,
                         consume_grad=False)
        self._setup(compile)

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: ``compile``'s value."""
        check_compile(node, where)


@limits(beta=Range(ge=0, lt=1, meaning="momentum of the gradient that is preconditioned", fix=0.9),
        preconditioner_update_probability=Range(gt=0, le=1, meaning="share of steps that update the preconditioner",
                                                fix="null", null="heavyball's schedule: 1 for 1000 steps, then "
                                                "decaying to 0.03"),
        precond_lr=Range(gt=0, lt=1, meaning="step size of the preconditioner's own update", fix=0.1),
        max_size_triangular=Range(ge=1, integer=True, meaning="largest dimension given a dense (triangular) factor; "
                                  "a larger one gets a diagonal", fix=2048),
        warmup_steps=Range(ge=0, integer=True, meaning="optimizer steps of heavyball's own linear warmup", fix=0))
class PSGDKron(_Heavyball, heavyball.PSGDKron):
    """PSGD with a Kronecker-factored preconditioner (Li 2015/2018, "Preconditioned Stochastic Gradient Descent",
    https://arxiv.org/abs/1512.04202, and https://arxiv.org/abs/1809.10232): for each matrix it keeps triangular
    factors ``Q_1``, ``Q_2`` (a diagonal for a dimension above ``max_size_triangular``) of a preconditioner
    ``P = (Q_2^T Q_2) kron (Q_1^T Q_1)``, fitted so that ``P`` whitens the gradient: on a random subset of steps
    (``preconditioner_update_probability``) each ``Q`` takes a step of ``precond_lr`` on Li's criterion
    ``E[h^T P h + v^T P^{-1} v]`` with probe vectors ``v`` drawn from torch's generator. The update is ``P``
    applied to the gradient's momentum (``beta``), clipped by heavyball's trust region."""

    whole_matrices = "fits a Kronecker-factored preconditioner to each whole matrix's gradients"

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9, weight_decay: float = 0.0,
                 preconditioner_update_probability: float | None = None, max_size_triangular: int = 2048,
                 precond_lr: float = 0.1, warmup_steps: int = 0, compile: bool | str = "auto"):
        extra = {} if preconditioner_update_probability is None else {
            "preconditioner_update_probability": float(preconditioner_update_probability)}
        super().__init__(params, lr=lr, beta=beta, weight_decay=weight_decay, max_size_triangular=max_size_triangular,
                         precond_lr=precond_lr, warmup_steps=warmup_steps, consume_grad=False, **extra)
        self._setup(compile)

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: ``compile``'s value."""
        check_compile(node, where)
