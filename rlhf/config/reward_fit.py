"""Reward functions against the data they would score, before anything loads: a reward made for one task's prompts
(its ``fits_prompt``) on data whose prompts it refuses measures nothing, so the run is refused with the fix."""

from __future__ import annotations

from typing import Any

from hydra.utils import get_object

from rlhf.config.signatures import signature_of
from rlhf.core.errors import UserError
from rlhf.data import paths
from rlhf.data.tasks import ReverseTask


def check_rewards_fit_the_data(container: dict) -> None:
    """Refuse reward functions that fit only other prompts (``fits_prompt``: the embedded task's score a completion
    against the prompt reversed, none configured meaning its exact match; the sums task's read the sum asked) on data
    whose first prompt they refuse: data of one's own (``data.path``), or another generated task (``data.task``)
    wherever they would train or evaluate with a weight: an online algorithm's ``algo.reward_funcs`` and
    ``eval=generate``'s ``eval.reward_funcs``. A local file's first prompt is asked (the embedded task's prompts
    written to a file pass); data that cannot be read cheaply (a Hub dataset) is taken for one's own."""
    data = container.get("data")
    if not isinstance(data, dict) or (data.get("path") is None and not isinstance(data.get("task"), dict)):
        return
    found_prompt: list = []  # the data's first prompt, read once and only where a reward would be asked about it

    def first_prompt() -> tuple[Any, str] | None:
        if not found_prompt:
            found_prompt.append(_first_prompt(data))
        return found_prompt[0]

    for where, node, fix in (
            ("algo", container.get("algo"), "algo/reward_funcs=<your option>"),
            ("eval", container.get("eval"), "algo/reward_funcs@eval=<your option>, or eval=none")):
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
            continue
        found = signature_of(get_object(node["_target_"]))
        if "reward_funcs" not in node and (found is None or "reward_funcs" not in found[0].parameters):
            continue
        functions = node.get("reward_funcs") or {"exact_match": {"_target_": "rlhf.algos.reward_funcs.exact_match"}}
        if not isinstance(functions, dict):
            continue
        weights = node.get("reward_weights") if node.get("reward_funcs") else None
        weights = weights if isinstance(weights, list) and len(weights) == len(functions) else [1.0] * len(functions)
        task, embedded = [], True
        for (name, function), weight in zip(functions.items(), weights):
            target = function.get("_target_") if isinstance(function, dict) else None
            fits = getattr(get_object(target), "fits_prompt", None) if isinstance(target, str) else None
            if fits is None or weight == 0:
                continue
            asked = first_prompt()
            if asked is None:  # a task that cannot be built: the data check names it
                return
            prompt, what = asked
            if not (prompt is not None and _fits(fits, prompt)):
                task.append(name)
                embedded = embedded and fits is ReverseTask.is_prompt
        if task:
            doing = "the algorithm trains on" if where == "algo" else "eval=generate scores its samples with"
            kind = ("the embedded task's reward (the prompt reversed)" if embedded else
                    "a reward for another task's prompts (its fits_prompt refuses this data's first prompt)")
            raise UserError(
                f"{where}.reward_funcs: {doing} {', '.join(task)}, {kind}, but {what}, where it measures nothing. "
                f"Fix: a reward for "
                f"this data as an option of conf/algo/reward_funcs/ (or of your own config folder) and {fix} "
                "(docs/how-to/your-reward.md)")


def _fits(fits, prompt) -> bool:
    """``fits(prompt)``; a reward that reads text only does not fit a conversation's messages."""
    try:
        return bool(fits(prompt))
    except (AttributeError, TypeError):
        return False


def _first_prompt(data: dict) -> tuple[Any, str] | None:
    """The data's first prompt (a file's first row; a generated task's first held-out row) and what the data is,
    for the message; ``None`` where a task cannot be built."""
    if data.get("path") is not None:
        first = paths.first_row(str(data["path"])) or {}
        what = f"data.path={data['path']} is data of one's own"
    else:
        node = data["task"]
        if not isinstance(node.get("_target_"), str):
            return None
        try:  # a generated task's first held-out prompt (milliseconds: a few hundred rows)
            task = get_object(node["_target_"])(**{k: v for k, v in node.items() if k != "_target_"})
            first = task.rows("eval", ("prompt",))[0] if hasattr(task, "rows") else task.load(("prompt",))["eval"][0]
        except Exception:
            return None
        what = f"data.task ({node['_target_'].rsplit('.', 1)[-1]}) asks other questions"
    prompt = first.get("prompt")
    return (prompt if isinstance(prompt, (str, list)) else None), what
