"""One optimizer object of several update rules, each parameter group stepped by the rule its ``rule`` key names:
what the loop, Accelerate, the schedules (``LambdaLR`` scales every group) and checkpoints see as one optimizer.

:class:`MuonWithAdamW` is ``conf/optimizer/muon.yaml``: torch's ``torch.optim.Muon`` on the hidden matrices and
``torch.optim.AdamW`` on the rest (the split is :class:`rlhf.optim.partition.HiddenMatrices`)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

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


class MuonWithAdamW(PerRule):
    """Muon on the hidden matrices, AdamW on everything else: one optimizer (Jordan et al. 2024,
    https://kellerjordan.github.io/posts/muon/; torch's ``torch.optim.Muon``, which takes only 2-D tensors).

    The arguments are Muon's (``lr`` ... ``adjust_lr_fn``, torch's names); ``adamw`` holds the keyword arguments of
    the ``torch.optim.AdamW`` that updates the rest, at its own learning rate. Groups name their rule (``muon``,
    ``adamw``: :class:`rlhf.optim.partition.HiddenMatrices`); a group that names none is Muon's."""

    whole_matrices = True  # each update is computed from a whole matrix: a sharded strategy is refused before loading

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7, adjust_lr_fn: str | None = None,
                 adamw: dict[str, Any] | None = None):
        muon = functools.partial(torch.optim.Muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                 nesterov=nesterov, ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn)
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
        choices = ("original", "match_rms_adamw")
        if node.get("adjust_lr_fn") not in (None, *choices):
            raise UserError(f"{where}.adjust_lr_fn={node['adjust_lr_fn']!r} is not one of torch.optim.Muon's "
                            f"{', '.join(choices)} or null. Fix: optimizer.adjust_lr_fn=match_rms_adamw")
