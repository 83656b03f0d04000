"""One held-out evaluation for every objective: generate, score, measure the KL (``eval=generate``).

A DPO run evaluates teacher-forced (preference accuracy), an online run by greedy generation: numbers that mean
different things. :class:`GenerationEval` puts every objective on one axis, the reward a policy earns for its
divergence from the reference (the reward-KL frontier of Rafailov et al. 2023, "Direct Preference Optimization",
Figure 2). At each evaluation of the run, on the first ``prompts`` distinct prompts of the held-out split:

- ``samples`` completions per prompt sampled from the policy at ``temperature`` (``top_k``/``top_p`` off, and none
  of the model's own generation defaults, such as a repetition penalty: the policy's distribution as it is), scored
  by the reward functions (the same callables as online RL: the options of ``conf/algo/reward_funcs/``, placed under
  ``eval`` with ``algo/reward_funcs@eval=<option>``): ``eval/gen/reward`` (the weighted sum),
  ``eval/gen/rewards/<name>``, and ``eval/gen/length`` (completion tokens, EOS included);
- ``eval/gen/kl``: KL(policy || reference) per sequence, estimated from the policy's own samples at temperature 1
  (the samples above when ``temperature`` is 1, else as many more): the mean over samples of
  ``log pi(y|x) - log pi_ref(y|x)``, each the sum of the completion's token log-ratios, an unbiased estimate of
  the KL between the distributions of completions of at most ``max_new_tokens`` tokens (those cut there count as
  they are: a lower bound of the KL of unbounded completions); ``eval/gen/kl_stderr`` is its standard error (the
  samples' standard deviation over the square root of their number);
- with ``greedy``: the greedy completion per prompt, scored (``eval/gen/greedy_reward``), and with ``win_rate``
  its win rate against the reference's greedy completion of the same prompt (``eval/gen/win_rate``: by the
  weighted reward, or by ``judge(prompts, completions, reference_completions) -> [1, 0 or 0.5 per prompt]``;
  ties count half).

The reference is the algorithm's reference model (``algo.frozen["reference"]``, scored through its strategy's
``logps``); with a LoRA policy's adapter references (``algo/reference=adapter``: the adapter off; ``ref_adapter``:
the reference adapter active) the policy itself, switched for the length of the reference's forward passes and
generation (the strategy's ``as_reference``), with no copy. An objective without a reference (SFT, SimPO's
``reference=none``, GRPO with ``beta=0``, a reference that only scores its own precomputed rows) gets a frozen copy
of the initial policy built for the evaluation alone, held in :attr:`GenerationEval.frozen` (placed by the hardware
strategy and counted by the memory preflight like the algorithm's frozen models).

Sampling reuses :func:`rlhf.models.generation.sample` (what online algorithms' rollouts use) and scoring
:func:`rlhf.algos.reward_funcs.score`. Prompts are dealt to processes in batches of ``batch_size``, each batch
sampled with a seed of its own (``seed`` and the batch's index), so that one process and several draw the same
completions; every process runs as many batches (an idle one repeats a batch with weight 0: a sharded model's
forward passes are collectives), and the sums meet in :mod:`rlhf.ops.collectives`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel, send_to_device
from torch import Tensor

from rlhf.algos import reward_funcs as reward_lib
from rlhf.algos.online import collate_prompts, generation_seed, tokenize_prompt
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data.encoding import CHAT, FORMAT_COLUMN
from rlhf.models.generation import Sampling, sample, stop_ids
from rlhf.models.value_head import without_value_head
from rlhf.ops.collectives import sum_over_processes
from rlhf.ops.completion_logps import completion_stats

EVAL_REFERENCE = "eval_reference"  # the name of the evaluation's own frozen copy of the initial policy


class NoGenerationEval:
    """``eval=none``: the algorithm's own evaluation only."""

    def __init__(self) -> None:
        self.frozen: dict[str, torch.nn.Module] = {}  # no model of its own

    @staticmethod
    def produced(options: Mapping[str, Any]) -> tuple[str, ...]:
        return ()

    def setup(self, policy: torch.nn.Module, tokenizer: Any, algo: Any, rows: Any) -> None:
        pass

    def __call__(self, model: torch.nn.Module, accelerator: Any) -> dict[str, float]:
        return {}


@limits(prompts=Range(ge=1, integer=True, meaning="held-out prompts evaluated (the first distinct ones)", fix=64),
        samples=Range(ge=1, integer=True, meaning="completions sampled per prompt", fix=4),
        temperature=Range(gt=0, meaning="the temperature the scored samples are drawn at; the KL is measured at 1",
                          fix=1.0),
        max_new_tokens=Range(ge=1, integer=True, meaning="the most tokens a completion may have", fix=16),
        max_prompt_length=Range(ge=1, integer=True, meaning="tokens a prompt keeps (its end); null for no limit",
                                fix=512),
        batch_size=Range(ge=1, integer=True, meaning="prompts per generation batch", fix=16),
        seed=Range(ge=0, integer=True, meaning="the sampling seed of the evaluation", fix=0))
class GenerationEval:
    """Generate, score, measure the KL: see the module docstring.

    Args:
        prompts: held-out prompts evaluated (the first distinct ones of the split; fewer when it has fewer).
        samples: completions sampled per prompt, for ``eval/gen/reward``, ``length`` and ``kl``.
        temperature: the temperature of those samples (the KL's own samples are drawn at 1 when it is not 1).
        greedy: also the greedy completion per prompt (``eval/gen/greedy_reward``).
        win_rate: the greedy completion against the reference's (``eval/gen/win_rate``; needs ``greedy``).
        max_new_tokens: the most tokens a completion may have.
        max_prompt_length: tokens a prompt keeps (its end).
        batch_size: prompts per generation batch.
        seed: the sampling seed (the same at every evaluation: the policy changes, the draws do not).
        reward_funcs: name -> ``fn(prompts, completions, **columns) -> list[float]`` (default: the embedded task's
            exact match).
        reward_weights: one weight per function (None: all 1).
        reward_columns: the held-out rows' columns passed to the functions.
        judge: ``judge(prompts, completions, reference_completions) -> list[float]``, 1 where the first wins, 0
            where the reference wins, 0.5 for a tie; None: the weighted reward decides.
    """

    def __init__(self, prompts: int = 64, samples: int = 4, temperature: float = 1.0, greedy: bool = True,
                 win_rate: bool = True, max_new_tokens: int = 16, max_prompt_length: int | None = 512,
                 batch_size: int = 16, seed: int = 0, reward_funcs: Mapping[str, Callable] | None = None,
                 reward_weights: Sequence[float] | None = None, reward_columns: Sequence[str] = (),
                 judge: Callable | None = None) -> None:
        if win_rate and not greedy:
            raise UserError("eval.win_rate=true compares greedy completions, but eval.greedy=false. Fix: "
                            "eval.greedy=true (or eval.win_rate=false)")
        self.num_prompts, self.samples, self.temperature = prompts, samples, temperature
        self.greedy, self.win_rate, self.max_new_tokens = greedy, win_rate, max_new_tokens
        self.max_prompt_length, self.batch_size, self.seed = max_prompt_length, batch_size, seed
        self.reward_funcs, self.reward_weights = reward_lib.functions_and_weights(reward_funcs, reward_weights, "eval")
        self.reward_columns, self.judge = tuple(reward_columns), judge
        self.frozen: dict[str, torch.nn.Module] = {}
        self.rows: list[dict[str, Any]] = []
        self.algo: Any = None
        self.settings: Sampling | None = None
        self.last: dict[str, list] = {}  # this process's latest completions and rewards (tests, tables)

    @staticmethod
    def produced(options: Mapping[str, Any]) -> tuple[str, ...]:
        """The metrics every evaluation reports (``eval/gen/...``), from the ``eval:`` options as configured (the
        sweeps' objective check reads them before anything is built)."""
        greedy, win_rate = options.get("greedy", True), options.get("win_rate", True)
        names = ["reward", *(f"rewards/{name}" for name in options.get("reward_funcs") or {"exact_match": None}),
                 "length", "kl", "kl_stderr", *(["greedy_reward"] if greedy else []),
                 *(["win_rate"] if greedy and win_rate else [])]
        return tuple(f"eval/gen/{name}" for name in names)

    # ---- before training ---------------------------------------------------------------------------------------
    def setup(self, policy: torch.nn.Module, tokenizer: Any, algo: Any, rows: Any) -> None:
        """Before the hardware strategy wraps ``policy`` (the initial one): the prompts of the held-out ``rows``
        tokenized, the sampling settings, and a frozen copy of ``policy`` in :attr:`frozen` when the algorithm's
        reference cannot score and generate (see the module docstring)."""
        can_generate = getattr(policy, "can_generate", None)
        if callable(can_generate) and not can_generate():
            raise UserError(f"eval=generate samples completions from the policy, but this policy "
                            f"({type(policy).__name__}) has no language-model head to generate with (algo=reward "
                            "trains a scorer). Fix: eval=none")
        if "prompt" not in rows.column_names:
            raise UserError(f"eval=generate samples completions of the held-out rows' prompts, but these rows have "
                            f"the columns {rows.column_names}. Fix: data with a prompt column (prompt/completion, "
                            "prompt/chosen/rejected, prompt-only), or eval=none")
        seen: dict[str, dict[str, Any]] = {}
        for row in rows:
            if len(seen) == self.num_prompts:
                break
            prompt = row["prompt"]
            if not isinstance(prompt, str):  # conversational: the chat template's text, ready for the answer
                prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            if prompt not in seen:
                rendered = {FORMAT_COLUMN: CHAT} if prompt is not row["prompt"] else {}
                seen[prompt] = tokenize_prompt({**row, "prompt": prompt, **rendered}, tokenizer,
                                               self.max_prompt_length, self.reward_columns)
        self.rows = list(seen.values())
        # A sharded model that fits only sharded generates sharded here too (the online algorithm's own setting)
        self.settings = Sampling(temperature=self.temperature, top_p=1.0, top_k=0, max_new_tokens=self.max_new_tokens,
                                 pad_id=tokenizer.pad_token_id, eos_ids=stop_ids(tokenizer, policy),
                                 tokenizer=tokenizer,
                                 cache_implementation=getattr(algo, "cache_implementation", None),
                                 gather=getattr(algo, "gather_for_generation", True),
                                 generation=getattr(algo, "generation", "auto"))
        self.algo = algo
        strategy = getattr(algo, "reference", None)
        has_model = isinstance(getattr(algo, "frozen", {}).get("reference"), torch.nn.Module)
        if needs_own_copy(strategy, has_model):
            initial = without_value_head(copy.deepcopy(policy))  # PPO's critic is no part of the reference
            self.frozen = {EVAL_REFERENCE: initial.eval().requires_grad_(False)}

    # ---- at each evaluation --------------------------------------------------------------------------------------
    def reference(self, policy: torch.nn.Module) -> tuple[contextlib.AbstractContextManager[torch.nn.Module],
                                                          Callable[[dict[str, Tensor], torch.nn.Module], Tensor]]:
        """A block within which the reference model generates (the win rate's completions): its own frozen model,
        or ``policy`` itself with its adapter off or swapped (``algo/reference=adapter``, ``ref_adapter``: no copy);
        and how the reference scores a batch."""
        if EVAL_REFERENCE in self.frozen:
            model = self.frozen[EVAL_REFERENCE]
            return contextlib.nullcontext(model), lambda batch, policy: completion_stats(model, batch).logps
        strategy = self.algo.reference
        model = self.algo.frozen.get("reference")
        if model is None:  # an adapter strategy: the policy is the reference within its block
            return strategy.as_reference(policy), lambda batch, policy: strategy.logps(batch, None, policy)
        return contextlib.nullcontext(model), lambda batch, policy: strategy.logps(batch, model, policy)

    def __call__(self, model: torch.nn.Module, accelerator: Any) -> dict[str, float]:
        """The metrics of the module docstring (keys ``eval/gen/...``), summed over every process. Leaves the
        random number generators as it found them."""
        devices = [accelerator.device] if accelerator.device.type == "cuda" else []
        training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                return self._evaluate(model, accelerator)
        finally:
            model.train(training)

    def _evaluate(self, model: torch.nn.Module, accelerator: Any) -> dict[str, float]:
        batches = [self.rows[i:i + self.batch_size] for i in range(0, len(self.rows), self.batch_size)]
        processes, rank = accelerator.num_processes, accelerator.process_index
        rounds = math.ceil(len(batches) / processes)
        sums: dict[str, Tensor | float] = {}
        self.last = {"prompts": [], "completions": [], "rewards": [], "greedy": [], "reference": []}
        for turn in range(rounds):
            index = turn * processes + rank
            weight = 1.0 if index < len(batches) else 0.0  # an idle process repeats batch 0, counted 0
            index = index if weight else 0
            batch = send_to_device(collate_prompts(batches[index], self.settings.pad_id, self.reward_columns),
                                   accelerator.device)
            for key, value in self._batch(model, batch, index, keep=bool(weight)).items():
                sums[key] = sums.get(key, 0.0) + value * weight
        totals = sum_over_processes(sums, accelerator)
        return self._metrics(totals)

    def _batch(self, model: torch.nn.Module, batch: dict[str, Any], index: int, keep: bool) -> dict[str, Tensor]:
        """The sums of one prompt batch's metrics (and their counts)."""
        policy = extract_model_from_parallel(model)
        as_reference, ref_logps = self.reference(model)
        settings = self.settings
        sampled = sample(model, batch["input_ids"], batch["attention_mask"], self.samples,
                         generation_seed(self.seed, 0, index), settings)
        reward, per_function = self._score(batch, sampled, self.samples)
        lengths = sampled["completion_mask"].sum(-1).double()
        sums = {"reward": reward.double().sum(), "samples": float(reward.numel()), "length": lengths.sum()}
        for column, name in enumerate(self.reward_funcs):
            values = per_function[:, column].double()
            known = ~values.isnan()
            sums[f"rewards/{name}"], sums[f"rewards/{name}:n"] = values[known].sum(), known.sum().double()
        kl_samples = sampled if self.temperature == 1.0 else sample(
            model, batch["input_ids"], batch["attention_mask"], self.samples, generation_seed(self.seed, 1, index),
            Sampling(**{**settings.__dict__, "temperature": 1.0}))
        scored = scoring_batch(kl_samples)
        log_ratio = (completion_stats(model, scored).logps.double() - ref_logps(scored, policy).double())
        sums.update({"kl": log_ratio.sum(), "kl_sq": (log_ratio ** 2).sum(), "kl_n": float(log_ratio.numel())})
        if keep:
            self.last["prompts"] += [p for p in batch["prompts"] for _ in range(self.samples)]
            self.last["completions"] += sampled["completions"]
            self.last["rewards"] += reward.tolist()
        if self.greedy:
            greedy = sample(model, batch["input_ids"], batch["attention_mask"], 1, None, settings)
            greedy_reward, _ = self._score(batch, greedy, 1)
            sums.update({"greedy_reward": greedy_reward.double().sum(), "prompts": float(greedy_reward.numel())})
            if keep:
                self.last["greedy"] += greedy["completions"]
            if self.win_rate:
                with as_reference as ref_model:  # a frozen copy is whole: no gathering; the policy as it is
                    gather = settings.gather if ref_model is model else False
                    theirs = sample(ref_model, batch["input_ids"], batch["attention_mask"], 1, None,
                                    Sampling(**{**settings.__dict__, "gather": gather}))
                if self.judge is not None:
                    wins = torch.tensor([float(w) for w in self.judge(batch["prompts"], greedy["completions"],
                                                                      theirs["completions"])], dtype=torch.float64)
                else:
                    their_reward, _ = self._score(batch, theirs, 1)
                    wins = (greedy_reward > their_reward).double() + 0.5 * (greedy_reward == their_reward).double()
                sums["wins"] = wins.sum()
                if keep:
                    self.last["reference"] += theirs["completions"]
        return sums

    def _score(self, batch: dict[str, Any], sampled: dict[str, Any], per_prompt: int) -> tuple[Tensor, Tensor]:
        texts = [p for p in batch["prompts"] for _ in range(per_prompt)]
        columns = {c: [v for v in batch[c] for _ in range(per_prompt)] for c in self.reward_columns if c in batch}
        return reward_lib.score(self.reward_funcs, self.reward_weights, texts, sampled["completions"], columns,
                                sampled["completion_ids"].device)

    def _metrics(self, totals: dict[str, float]) -> dict[str, float]:
        n = totals["samples"]
        out = {"eval/gen/reward": totals["reward"] / n, "eval/gen/length": totals["length"] / n}
        for name in self.reward_funcs:
            count = totals[f"rewards/{name}:n"]
            out[f"eval/gen/rewards/{name}"] = totals[f"rewards/{name}"] / count if count else float("nan")
        kl_n = totals["kl_n"]
        mean = totals["kl"] / kl_n
        variance = max(0.0, totals["kl_sq"] / kl_n - mean ** 2) * kl_n / max(1.0, kl_n - 1)
        out.update({"eval/gen/kl": mean, "eval/gen/kl_stderr": math.sqrt(variance / kl_n)})
        if self.greedy:
            out["eval/gen/greedy_reward"] = totals["greedy_reward"] / totals["prompts"]
            if self.win_rate:
                out["eval/gen/win_rate"] = totals["wins"] / totals["prompts"]
        return out


def needs_own_copy(strategy: Any, has_model: bool) -> bool:
    """Whether the evaluation holds a frozen copy of the initial policy, given the algorithm's reference strategy and
    whether the algorithm holds that strategy's model: not where the strategy switches the policy's own adapter
    (``as_reference``), nor where its model scores any sequence (``scores_any_batch``); ``scripts/memory.py``
    counts the copy the same way."""
    if callable(getattr(strategy, "as_reference", None)):
        return False
    return not has_model or not getattr(strategy, "scores_any_batch", True)


def scoring_batch(sampled: dict[str, Any]) -> dict[str, Tensor]:
    """The sampled sequences laid out for :func:`~rlhf.ops.completion_logps.completion_stats`: each prompt without
    its left padding, then its completion up to and including EOS, right-padded (``input_ids``,
    ``attention_mask``, ``completion_mask``): the positions the policy saw when it sampled them."""
    rows, marks = [], []
    for ids, mask, completion, kept in zip(sampled["prompt_ids"].tolist(), sampled["prompt_mask"].tolist(),
                                           sampled["completion_ids"].tolist(), sampled["completion_mask"].tolist()):
        prompt = [t for t, m in zip(ids, mask) if m]
        answer = completion[:sum(kept)]
        rows.append(prompt + answer)
        marks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(r) for r in rows)
    device = sampled["prompt_ids"].device

    def pad(values: list[int], value: int) -> list[int]:
        return values + [value] * (width - len(values))

    return {"input_ids": torch.tensor([pad(r, 0) for r in rows], device=device),
            "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in rows], device=device),
            "completion_mask": torch.tensor([pad(m, 0) for m in marks], device=device)}
