"""One optimizer object of several update rules, each parameter group stepped by the rule its ``rule`` key names:
what the loop, Accelerate, the schedules (``LambdaLR`` scales every group) and checkpoints see as one optimizer.

:class:`MuonWithAdamW` is ``conf/optimizer/muon.yaml``: torch's ``torch.optim.Muon`` on the hidden matrices and
``torch.optim.AdamW`` on the rest (the split is :class:`rlhf.optim.partition.HiddenMatrices`)."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from rlhf.core.bf16 import cpu_has_bf16_matmul
from rlhf.core.errors import UserError


class PerRule(torch.optim.Optimizer):
    """Parameter groups stepped by several optimizers, held as one.

    ``rules`` maps a rule's name to a function that builds a torch optimizer from parameter groups (a
    ``functools.partial`` of its class). Each group's ``rule`` key names its rule; a group without one goes to the
    first rule. The groups and the state are this object's: each rule's optimizer holds the same group dictionaries
    (a schedule's change of ``lr`` reaches it) and the same state dictionary, so :meth:`state_dict` and
    :meth:`load_state_dict` save and restore every rule's state with torch's own code, and :meth:`zero_grad` clears
    every gradient."""

    def __init__(self, params, rules: dict[str, Callable[[list[dict]], torch.optim.Optimizer]]):
        if not rules:
            raise UserError("an optimizer of several rules needs at least one rule")
        super().__init__(params, {})
        first = next(iter(rules))
        for group in self.param_groups:
            group.setdefault("rule", first)
            if group["rule"] not in rules:
                raise UserError(f"a parameter group names the rule {group['rule']!r}, which this optimizer does not "
                                f"have (its rules: {', '.join(rules)}). Fix: optimizer.partition to a partition whose "
                                "rules the optimizer has")
        self.rules: dict[str, torch.optim.Optimizer] = {}
        for name, make in rules.items():
            mine = [group for group in self.param_groups if group["rule"] == name]
            if mine:  # torch refuses an optimizer without parameter groups
                self.rules[name] = make(mine)  # fills its defaults into these same dictionaries
        self._link()

    def _link(self) -> None:
        """Give each rule's optimizer this object's groups (in order) and state."""
        for name, optimizer in self.rules.items():
            optimizer.param_groups = [group for group in self.param_groups if group["rule"] == name]
            optimizer.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every rule on its groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.rules.values():
            optimizer.step()
        return loss

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Torch's ``load_state_dict`` (and unpickling) end here with new groups and state: the rules get them."""
        super().__setstate__(state)
        if "rules" in self.__dict__:
            self._link()


NS_DTYPES = ("auto", "bfloat16", "float32")


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's Newton-Schulz iteration (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) in ``dtype``:
    the update scaled to a spectral norm of at most 1 (by its Frobenius norm), then ``steps`` times
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the wide orientation; returned in the update's dtype. Its
    singular values end near 1 (the quintic's fixed points spread them over about 0.7-1.2, not exactly 1)."""
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.T if tall else x).to(update.dtype)


def _scaled_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """A matrix's learning rate as torch.optim.Muon scales it: ``original``/None: lr x sqrt(max(1, rows/cols))
    (Jordan's); ``match_rms_adamw``: lr x 0.2 sqrt(max(rows, cols)) (Liu et al. 2025, arXiv:2502.16982)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype``.

    torch runs it in bfloat16, as the method's authors do on GPUs. On a CPU without bf16 matrix units (AVX2: every
    bf16 product emulated) that is the slowest choice: a 576 x 1536 matrix times its transpose took 228 ms in bf16
    against 34 ms in float32 (1 thread, the 2-vCPU AMD EPYC of docs/reference/optimizers.md), and Muon's step on the
    embedded default 876 ms against 44 ms with the float32 iteration (benchmarks/optimizer_costs.py). ``auto`` keeps torch's own step (bfloat16) on a GPU and on a CPU with bf16 matrix
    units (:func:`rlhf.core.bf16.cpu_has_bf16_matmul`), and elsewhere takes the same step with the iteration in
    float32 (:func:`orthogonalize`: momentum, Nesterov, the scaled learning rate and decoupled weight decay as torch
    does them, the state under torch's key, so checkpoints of either load in the other)."""

    def __init__(self, params, ns_dtype: str = "auto", **kwargs):
        super().__init__(params, **kwargs)
        if ns_dtype not in NS_DTYPES:
            raise UserError(f"optimizer.ns_dtype={ns_dtype!r}: the dtype of Muon's Newton-Schulz iteration, one of "
                            f"{', '.join(NS_DTYPES)}. Fix: optimizer.ns_dtype=auto")
        self.ns_dtype = ns_dtype

    def iteration_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the iteration runs in for parameters on ``device``."""
        if self.ns_dtype != "auto":
            return getattr(torch, self.ns_dtype)
        return torch.bfloat16 if device.type != "cpu" or cpu_has_bf16_matmul() else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        first = next((p for group in self.param_groups for p in group["params"]), None)
        if first is None or self.iteration_dtype(first.device) == torch.bfloat16:
            return super().step(closure)  # torch's own step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - group["momentum"])
                update = param.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       torch.float32)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_scaled_lr(group["lr"], group["adjust_lr_fn"], param.shape))
        return loss


class MuonWithAdamW(PerRule):
    """Muon on the hidden matrices, AdamW on everything else: one optimizer (Jordan et al. 2024,
    https://kellerjordan.github.io/posts/muon/; torch's ``torch.optim.Muon``, which takes only 2-D tensors).

    The arguments are Muon's (``lr`` ... ``adjust_lr_fn``, torch's names); ``adamw`` holds the keyword arguments of
    the ``torch.optim.AdamW`` that updates the rest, at its own learning rate. Groups name their rule (``muon``,
    ``adamw``: :class:`rlhf.optim.partition.HiddenMatrices`); a group that names none is Muon's."""

    whole_matrices = True  # each update is computed from a whole matrix: a sharded strategy is refused before loading

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7, adjust_lr_fn: str | None = None,
                 ns_dtype: str = "auto", adamw: dict[str, Any] | None = None):
        muon = functools.partial(Muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                 ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        super().__init__(params, {"muon": muon, "adamw": functools.partial(torch.optim.AdamW, **(adamw or {}))})

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: ``adamw``'s fields against ``torch.optim.AdamW`` and the limits every optimizer
        shares (by name: ``lr`` > 0, ``betas`` in [0, 1) ...), a Newton-Schulz step count and ``adjust_lr_fn``."""
        from rlhf.core import limits
        from rlhf.optim import OPTIMIZER_LIMITS

        if not hasattr(torch.optim, "Muon"):
            raise UserError(f"{where}=muon steps the hidden matrices with torch.optim.Muon, which torch "
                            f"{torch.__version__} does not have (it came with torch 2.9). Fix: pip install -U torch "
                            "(2.9 or later), or optimizer=adamw")
        adamw = node.get("adamw") or {}
        if not isinstance(adamw, dict):
            raise UserError(f"{where}.adamw={adamw!r}: the AdamW rule's settings, a mapping (lr, betas, eps, "
                            "weight_decay). Fix: e.g. optimizer.adamw.lr=3e-4")
        valid = [k for k in inspect.signature(torch.optim.AdamW).parameters if k != "params"]
        for key in adamw:
            if key not in valid:
                near = difflib.get_close_matches(key, valid, n=1)
                hint = f"{where}.adamw.{near[0]}" if near else f"one of {', '.join(valid)}"
                raise UserError(f"{where}.adamw.{key}: torch.optim.AdamW has no argument {key!r}. Fix: {hint}")
        limits.check_limits(adamw, torch.optim.AdamW, f"{where}.adamw", OPTIMIZER_LIMITS)
        steps = node.get("ns_steps")
        if isinstance(steps, int) and not 1 <= steps < 100:
            raise UserError(f"{where}.ns_steps={steps}: Newton-Schulz iterations, a whole number in [1, 100) "
                            "(torch.optim.Muon). Fix: optimizer.ns_steps=5")
        if node.get("ns_dtype", "auto") not in NS_DTYPES:
            raise UserError(f"{where}.ns_dtype={node['ns_dtype']!r}: the dtype of Muon's Newton-Schulz iteration, one "
                            f"of {', '.join(NS_DTYPES)}. Fix: optimizer.ns_dtype=auto")
        choices = ("original", "match_rms_adamw")
        if node.get("adjust_lr_fn") not in (None, *choices):
            raise UserError(f"{where}.adjust_lr_fn={node['adjust_lr_fn']!r} is not one of torch.optim.Muon's "
                            f"{', '.join(choices)} or null. Fix: optimizer.adjust_lr_fn=match_rms_adamw")
