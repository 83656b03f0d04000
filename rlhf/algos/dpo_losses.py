"""The per-pair losses of the reference-based DPO family, each a pure function chosen by ``algo.loss._target_``.

Every loss takes the same three arguments and returns one loss per pair, ``[B]``:

- ``pairs``: :class:`PairLogps`, the summed completion log-probabilities of policy and reference for the chosen
  and rejected completions, and the completion token counts;
- ``beta``: the KL strength of :class:`rlhf.algos.dpo.DPO`;
- ``state``: a :data:`LossState` dict that lives across steps (e.g. BCO's running reward mean). The algorithm
  saves it in every checkpoint (``DPO.state_dict``); most losses neither read nor write it.

Options of a loss (``label_smoothing``, ``tau``, ...) are keyword arguments after these three, set in the YAML
next to ``_target_`` (``_partial_: true``). Formulas follow TRL 1.16's ``DPOTrainer`` (``loss_type`` of the same
name) by default; where the paper differs, the paper's form is an option. ``h`` below is
``chosen_logratios - rejected_logratios``, a log-ratio being ``log pi(y|x) - log ref(y|x)`` summed over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits

LossState = dict[str, Tensor]
"""What a loss keeps across steps (tensors by name); saved in checkpoints by the algorithm."""


@dataclass(frozen=True)
class PairLogps:
    """Summed completion log-probabilities of ``B`` pairs (each ``[B]``) and the completion token counts."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    # Sums a tensor over every process of a training step, each holding its own pairs (a collective: every process
    # calls it, :func:`rlhf.ops.collectives.sum_over_every_process`), for a loss that reads the step's whole batch (BCO's
    # running mean). None: these pairs are all there is (one process; or a held-out batch, whose metrics do not
    # depend on the number of processes).
    global_sum: Callable[[Tensor], Tensor] | None = None

    @property
    def chosen_logratios(self) -> Tensor:
        return self.policy_chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> Tensor:
        return self.policy_rejected - self.ref_rejected

    @property
    def chosen_average(self) -> Tensor:
        """The policy's average log-probability per chosen completion token (reference-free objectives)."""
        return self.policy_chosen / self.chosen_tokens

    @property
    def rejected_average(self) -> Tensor:
        return self.policy_rejected / self.rejected_tokens

    def margins(self, per_token: bool = False) -> Tensor:
        """``h``: chosen minus rejected log-ratio; ``per_token``: each log-ratio divided by its token count."""
        if per_token:
            return self.chosen_logratios / self.chosen_tokens - self.rejected_logratios / self.rejected_tokens
        return self.chosen_logratios - self.rejected_logratios


Loss = Callable[[PairLogps, float, LossState], Tensor]

SMOOTHING = Range(ge=0, lt=0.5, meaning="probability that a preference label is flipped; 0 is plain DPO, 0.1 is "
                  "common for noisy labels", fix=0.1)


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


# ---- f-divergences (Wang et al. 2023, "Beyond Reverse KL", arXiv:2309.16240): the margin f'(u_w) - f'(u_l) of
# u = pi/ref, in place of DPO's h (which is reverse KL, f'(u) = log u + 1) ----

def _capped_exp(value: Tensor) -> Tensor:
    """``exp`` that saturates at the dtype's largest finite value instead of overflowing."""
    return torch.exp(value.clamp(max=math.log(torch.finfo(value.dtype).max)))


def reverse_kl(pairs: PairLogps) -> Tensor:
    """DPO's own regularizer: ``h`` (TRL's ``f_divergence_type="reverse_kl"``)."""
    return pairs.margins()


def forward_kl(pairs: PairLogps) -> Tensor:
    """Forward KL, ``f'(u) = 1 - 1/u``: ``exp(-r_l) - exp(-r_w)`` (TRL's ``"forward_kl"``)."""
    return _capped_exp(-pairs.rejected_logratios) - _capped_exp(-pairs.chosen_logratios)


def js_divergence(pairs: PairLogps) -> Tensor:
    """Jensen-Shannon, ``f'(u) = log(2u / (1 + u))``: ``log s(r_w) - log s(r_l)`` (TRL's ``"js_divergence"``)."""
    return F.logsigmoid(pairs.chosen_logratios) - F.logsigmoid(pairs.rejected_logratios)


@limits(alpha=Range(gt=0, lt=1, meaning="TRL's f_alpha_divergence_coef: 0 is forward KL, 1 reverse KL", fix=0.5))
def alpha_divergence(pairs: PairLogps, alpha: float = 0.5) -> Tensor:
    """alpha-divergence, ``f'(u) = (u^(alpha-1) - 1) / (alpha - 1)`` (TRL's ``"alpha_divergence"`` with
    ``f_alpha_divergence_coef=alpha``, default 0.5). The paper's alpha is ``1 - alpha``; at 0.5 they agree."""
    return (_capped_exp((alpha - 1) * pairs.chosen_logratios)
            - _capped_exp((alpha - 1) * pairs.rejected_logratios)) / (alpha - 1)


# ---- the losses ----

@limits(label_smoothing=SMOOTHING)
def sigmoid_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 0.0,
                 divergence: Callable[[PairLogps], Tensor] | None = None) -> Tensor:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): ``-log sigmoid(beta h)``. ``label_smoothing`` > 0 gives
    conservative DPO (cDPO, Mitchell 2023): the label is flipped with that probability (TRL 1.16's ``"sigmoid"``
    has no label smoothing). ``divergence``: an f-divergence margin in place of ``h`` (:func:`js_divergence`,
    :func:`alpha_divergence`, :func:`forward_kl`; f-DPO, Wang et al. 2023). TRL: ``loss_type="sigmoid"``."""
    margins = pairs.margins() if divergence is None else divergence(pairs)
    return _smoothed_sigmoid(beta * margins, label_smoothing)


@limits(label_smoothing=SMOOTHING)
def robust_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 0.0) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), unbiased under label noise of rate ``eps``:
    ``((1 - eps) (-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps)``. TRL: ``"robust"``."""
    logits = beta * pairs.margins()
    return (-F.logsigmoid(logits) * (1 - label_smoothing) + F.logsigmoid(-logits) * label_smoothing) / (
        1 - 2 * label_smoothing)


def hinge_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """SLiC's calibration hinge (Zhao et al. 2023, arXiv:2305.10425) on the log-ratio margin:
    ``max(0, 1 - beta h)``, i.e. margin ``1/beta``. TRL: ``"hinge"`` (the paper's hinge is on the policy's own
    log-probabilities, without a reference)."""
    return torch.relu(1 - beta * pairs.margins())


def ipo_loss(pairs: PairLogps, beta: float, state: LossState, per_token: bool = True) -> Tensor:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): ``(h - 1/(2 beta))^2``, ``beta`` being the paper's tau.
    ``per_token=true`` (TRL's ``"ipo"``): each log-ratio divided by its completion length; ``false``: the
    paper's summed log-ratios."""
    return (pairs.margins(per_token) - 1 / (2 * beta)) ** 2


@limits(label_smoothing=Range(gt=0, lt=0.5, meaning="EXO's epsilon, TRL's label_smoothing (which must be > 0 there)",
                              fix=1e-3))
def exo_pair_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 1e-3) -> Tensor:
    """EXO, pairwise (Ji et al. 2024, arXiv:2402.00856, eq. 16): the reverse KL between the model's preference
    ``sigmoid(beta h)`` and the smoothed label ``1 - eps``:
    ``s(bh) (log s(bh) - log(1 - eps)) + s(-bh) (log s(-bh) - log eps)``. TRL: ``"exo_pair"``."""
    logits = beta * pairs.margins()
    return (logits.sigmoid() * (F.logsigmoid(logits) - math.log(1 - label_smoothing))
            + (-logits).sigmoid() * (F.logsigmoid(-logits) - math.log(label_smoothing)))


def nca_pair_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """NCA, pairwise (Chen et al. 2024, arXiv:2402.05369): with rewards ``r = beta x log-ratio``,
    ``-log s(r_w) - 0.5 log s(-r_w) - 0.5 log s(-r_l)``. TRL: ``"nca_pair"``."""
    chosen, rejected = beta * pairs.chosen_logratios, beta * pairs.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def bco_pair_loss(pairs: PairLogps, beta: float, state: LossState, running_mean: bool = False) -> Tensor:
    """BCO, pairwise (Jung et al. 2024, arXiv:2404.04656): each completion classified on its own reward
    ``beta x log-ratio``: ``-log s(r_w - delta) - log s(-(r_l - delta))``. ``running_mean=false`` (TRL 1.16's
    ``"bco_pair"``): ``delta = 0``. ``true`` (the paper; older TRL): ``delta`` is the running mean of all training
    rewards (``state["bco_reward_mean"]``, with ``"bco_reward_count"``; saved in checkpoints), updated with this
    batch before use.

    The batch is the step's whole batch over every process: with ``pairs.global_sum`` (a training step of several
    processes, :class:`rlhf.algos.dpo.DPO`) the count and sum of the rewards are summed over the processes (one
    all-reduce of two numbers), so every process keeps the same mean, the one a single process would keep over
    all of their rewards; the objective does not depend on the number of processes (older TRL averaged each
    process's batch mean, the same for equal batches). A held-out batch updates a copy of the state with its own
    rewards only."""
    chosen, rejected = beta * pairs.chosen_logratios, beta * pairs.rejected_logratios
    if not running_mean:
        return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    rewards = torch.cat([chosen, rejected]).detach().double()
    batch = torch.stack([torch.tensor(float(rewards.numel()), dtype=torch.float64, device=rewards.device),
                         rewards.sum()])  # [count, sum], on the rewards' device (where a GPU's collective wants it)
    batch_count, batch_sum = (pairs.global_sum(batch) if pairs.global_sum is not None else batch).cpu()
    count = state.get("bco_reward_count", torch.zeros((), dtype=torch.float64))
    mean = state.get("bco_reward_mean", torch.zeros((), dtype=torch.float64))
    total = count + batch_count
    mean = mean + (batch_sum / batch_count - mean) * batch_count / total
    state["bco_reward_count"], state["bco_reward_mean"] = total, mean
    delta = mean.to(chosen.dtype).to(chosen.device)
    return -F.logsigmoid(chosen - delta) - F.logsigmoid(-(rejected - delta))


def sppo_hard_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """SPPO with hard labels (Wu et al. 2024, arXiv:2405.00675): the chosen log-ratio pushed to ``1/(2 beta)``,
    the rejected one to ``-1/(2 beta)``: ``(r_w - 1/(2 beta))^2 + (r_l + 1/(2 beta))^2``. TRL: ``"sppo_hard"``."""
    return (pairs.chosen_logratios - 0.5 / beta) ** 2 + (pairs.rejected_logratios + 0.5 / beta) ** 2


@limits(label_smoothing=SMOOTHING)
def aot_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 0.0) -> Tensor:
    """AOT, paired (Melnyk et al. 2024, arXiv:2406.05882): the sorted policy log-odds ``log pi_w - log pi_l``
    against the sorted reference log-odds, across the batch, in DPO's sigmoid loss. TRL: ``"aot"``."""
    policy, _ = torch.sort(pairs.policy_chosen - pairs.policy_rejected)
    reference, _ = torch.sort(pairs.ref_chosen - pairs.ref_rejected)
    return _smoothed_sigmoid(beta * (policy - reference), label_smoothing)


@limits(label_smoothing=SMOOTHING)
def aot_unpaired_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 0.0) -> Tensor:
    """AOT, unpaired (Melnyk et al. 2024, arXiv:2406.05882): the sorted chosen log-ratios against the sorted
    rejected ones, across the batch, in DPO's sigmoid loss. TRL 1.16: ``"aot_unpaired"`` (formerly ``"aot_pair"``)."""
    chosen, _ = torch.sort(pairs.chosen_logratios)
    rejected, _ = torch.sort(pairs.rejected_logratios)
    return _smoothed_sigmoid(beta * (chosen - rejected), label_smoothing)


def apo_zero_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266), for chosen answers better than the policy's:
    ``1 - s(beta r_w) + s(beta r_l)``. TRL: ``"apo_zero"``."""
    return 1 - torch.sigmoid(beta * pairs.chosen_logratios) + torch.sigmoid(beta * pairs.rejected_logratios)


def apo_down_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266), for chosen answers worse than the policy's:
    ``s(beta r_w) + 1 - s(beta h)``. TRL: ``"apo_down"``."""
    return torch.sigmoid(beta * pairs.chosen_logratios) + 1 - torch.sigmoid(beta * pairs.margins())


@limits(tau=Range(gt=0, meaning="temperature of DiscoPOP's mix of logistic and exponential losses", fix=0.05))
def discopop_loss(pairs: PairLogps, beta: float, state: LossState, tau: float = 0.05) -> Tensor:
    """DiscoPOP, log-ratio modulated loss (Chan et al. 2024, arXiv:2406.08414): with ``z = beta h`` and
    ``m = s(z / tau)``, ``(1 - m) (-log s(z)) + m exp(-z)``. TRL: ``"discopop"`` (``discopop_tau`` 0.05)."""
    logits = beta * pairs.margins()
    modulation = torch.sigmoid(logits / tau)
    return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation


@limits(label_smoothing=SMOOTHING)
def sigmoid_norm_loss(pairs: PairLogps, beta: float, state: LossState, label_smoothing: float = 0.0) -> Tensor:
    """Length-normalized DPO (Tulu 3, Lambert et al. 2024, arXiv:2411.15124): DPO's sigmoid loss on log-ratios
    divided by their completion lengths. TRL: ``"sigmoid_norm"``."""
    return _smoothed_sigmoid(beta * pairs.margins(per_token=True), label_smoothing)


# ---- reference-free losses: the policy's average log-probabilities per completion token (run with
# algo/reference=none; a reference, if any, is not read) ----

@limits(gamma=Range(ge=0, meaning="SimPO's target reward margin (TRL's simpo_gamma)", fix=0.5),
        label_smoothing=SMOOTHING)
def simpo_loss(pairs: PairLogps, beta: float, state: LossState, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> Tensor:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6): with the average log-probabilities ``a = log pi(y|x) / |y|``,
    ``-log s(beta (a_w - a_l) - gamma)``; ``label_smoothing`` > 0 mixes in the flipped label as cDPO does. No
    reference. TRL: ``CPOTrainer`` with ``loss_type="simpo"`` (``simpo_gamma``); TRL's ``cpo_alpha`` NLL term is
    ``algo.nll_weight``."""
    return _smoothed_sigmoid(beta * (pairs.chosen_average - pairs.rejected_average) - gamma, label_smoothing)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate near 0 and far below it (Maechler 2012); ``x`` is capped just
    below 0 so that a certain completion (``x = 0``) gives a large negative number, not ``-inf``."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(pairs: PairLogps, beta: float, state: LossState) -> Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, arXiv:2403.07691, eqs. 4-7), ``beta`` being the paper's lambda:
    ``-beta log s(log odds(y_w) - log odds(y_l))`` with ``odds(y) = P / (1 - P)``, ``log P`` the average
    log-probability per completion token. No reference. ORPO's NLL term is ``algo.nll_weight`` (1 for ORPO) with
    ``algo.nll_on_prompt``. TRL: ``ORPOTrainer`` (``beta`` is lambda there too)."""
    chosen, rejected = pairs.chosen_average, pairs.rejected_average
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds)


def _one_weight_per_loss(values, where: str) -> None:
    losses, weights = values.get("losses") or (), values.get("weights") or ()
    if not losses or len(losses) != len(weights):
        raise UserError(f"{where}.losses has {len(losses)} losses and {where}.weights {len(weights)} weights: give "
                        f"one weight per loss. Fix: {where}.weights=[{','.join(['1.0'] * max(len(losses), 1))}]")


@limits(_one_weight_per_loss, weights=Range(ge=0, each=True, meaning="one weight per loss in algo.loss.losses", fix=[1.0]))
def weighted_sum(pairs: PairLogps, beta: float, state: LossState, losses: Sequence[Loss] = (),
                 weights: Sequence[float] = ()) -> Tensor:
    """Several losses at once, ``sum_i weights[i] x losses[i]`` (MPO, Wang et al. 2024, arXiv:2411.10442; TRL's
    list ``loss_type`` with ``loss_weights``). All share one ``state``. TRL's ``"sft"`` term is
    ``algo.nll_weight`` here."""
    _one_weight_per_loss({"losses": losses, "weights": weights}, "algo.loss")
    return sum(weight * loss(pairs, beta, state) for loss, weight in zip(losses, weights))
