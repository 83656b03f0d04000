"""Log-probabilities and the papers' losses computed apart from the package, for tests that check what an algorithm
or a whole run computed against what it should have.

Each sequence is built here from a row's text (the prompt's tokens, then the answer's and EOS, as the tokenizer gives
them) and goes through the model alone: no padding, no shared prompt, no batch layout of the package's. Its
log-probabilities are the log-softmax of the logits gathered at the next token, summed over the answer's tokens (EOS
included). The losses are the papers' formulas in plain floats.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch


def answer_sequence(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """The token ids of ``prompt + answer`` followed by EOS, and where the answer starts (the prompt's length)."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + answer)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[: len(prompt_ids)] == prompt_ids, "the prompt's tokens are not a prefix of the whole sequence's"
    return ids, len(prompt_ids)


@torch.no_grad()
def next_token_logps(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """``[T - 1]``: the log-probability ``model`` gives each token of ``ids`` after the ones before it."""
    tokens = torch.tensor([list(ids)])
    logits = model(input_ids=tokens).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]


def answer_logp(model: torch.nn.Module, tokenizer, prompt: str, answer: str) -> float:
    """The summed log-probability of ``answer`` (EOS included) after ``prompt``."""
    ids, start = answer_sequence(tokenizer, prompt, answer)
    return next_token_logps(model, ids)[start - 1:].sum().item()


def answer_logps(model: torch.nn.Module, tokenizer, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
    """:func:`answer_logp` of each ``(prompt, answer)``, the model in eval mode (on one thread: a tiny model's
    forward passes one at a time are many times slower on two threads of a busy machine)."""
    model.eval()
    with one_thread():
        return [answer_logp(model, tokenizer, p, a) for p, a in zip(prompts, answers, strict=True)]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, torch computes on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sequence_nll(model: torch.nn.Module, tokenizer, prompts: Sequence[str], answers: Sequence[str]) -> float:
    """The mean negative log-probability of every token of the ``prompt + answer`` sequences but their first (the
    prompt's tokens too), the model in eval mode."""
    model.eval()
    with one_thread():
        logps = [next_token_logps(model, answer_sequence(tokenizer, p, a)[0]) for p, a in zip(prompts, answers)]
    return -sum(t.sum().item() for t in logps) / sum(len(t) for t in logps)


def answer_lengths(tokenizer, prompts: Sequence[str], answers: Sequence[str]) -> list[int]:
    """The answers' token counts, EOS included."""
    return [len(ids) - start for ids, start in (answer_sequence(tokenizer, p, a) for p, a in zip(prompts, answers))]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


def dpo_losses(policy_chosen: Sequence[float], policy_rejected: Sequence[float], ref_chosen: Sequence[float],
               ref_rejected: Sequence[float], beta: float) -> list[float]:
    """DPO's loss of each pair (Rafailov et al. 2023, arXiv:2305.18290, eq. 7):
    ``-log sigmoid(beta ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))``."""
    return [-log_sigmoid(beta * ((pw - rw) - (pl - rl)))
            for pw, pl, rw, rl in zip(policy_chosen, policy_rejected, ref_chosen, ref_rejected, strict=True)]


def kto_losses(logratios: Sequence[float], desirable: Sequence[bool], mismatched_logratios: Sequence[float],
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> list[float]:
    """KTO's loss of each row (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7 as ``lambda_y - v(x, y)``):
    ``w_D (1 - sigmoid(beta (r - z)))`` for a desirable row, ``w_U (1 - sigmoid(beta (z - r)))`` for an undesirable
    one, ``r = log pi(y|x) - log ref(y|x)``, the reference point ``z`` estimated as the mean log-ratio of mismatched
    (prompt, completion) pairs, floored at 0."""
    z = max(0.0, sum(mismatched_logratios) / len(mismatched_logratios))
    return [desirable_weight * (1 - sigmoid(beta * (r - z))) if good else
            undesirable_weight * (1 - sigmoid(beta * (z - r)))
            for r, good in zip(logratios, desirable, strict=True)]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
