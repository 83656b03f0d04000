"""Policy-gradient losses (rlhf.algos.policy_losses) against values worked out by hand in plain Python below."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos import policy_losses as P


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    assert torch.allclose(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol), actual


# A ragged batch: sequence 0 has 3 tokens, sequence 1 has 1 (then padding, whose values must never count).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
LOSS = torch.tensor([[1.0, 2.0, 3.0], [10.0, 50.0, 70.0]])


def test_token_and_sequence_log_ratios():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]])
    old = torch.tensor([[-1.5, -1.0, -0.2], [-0.1, 0.0, 0.0]])
    close(P.token_log_ratio(logps, old, MASK), [[0.5, -1.0, -0.3], [-0.2, -9.0, -9.0]])
    seq = (0.5 - 1.0 - 0.3) / 3  # padding ignored
    close(P.sequence_log_ratio(logps, old, MASK), [[seq] * 3, [-0.2] * 3])
    # the sequence ratio is exp(mean token log-ratio), the geometric mean of the token ratios
    ratio = P.clipped_surrogate(P.sequence_log_ratio(logps, old, MASK), torch.zeros(2)).ratio
    assert ratio[0, 0].item() == pytest.approx(math.exp(seq))
    assert ratio[0, 0].item() == pytest.approx((math.exp(0.5) * math.exp(-1.0) * math.exp(-0.3)) ** (1 / 3))


def test_gspo_token_has_the_sequence_value_and_each_tokens_gradient():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, -0.2]])
    mask = torch.ones(1, 3)
    mixed = P.sequence_token_log_ratio(logps, old, mask)
    close(mixed, P.sequence_log_ratio(logps, old, mask).detach())
    mixed.sum().backward()
    close(logps.grad, [[1.0, 1.0, 1.0]])


def test_clipped_surrogate_by_hand():
    eps = 0.2
    ratios = [0.5, 0.9, 1.1, 1.5]
    log_ratio = torch.tensor([[math.log(r) for r in ratios]] * 2)
    adv = torch.tensor([2.0, -2.0])
    s = P.clipped_surrogate(log_ratio, adv, epsilon=eps)

    def by_hand(r: float, a: float) -> float:
        return -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)

    close(s.per_token_loss, [[by_hand(r, 2.0) for r in ratios], [by_hand(r, -2.0) for r in ratios]], atol=1e-5)
    # = [[-1, -1.8, -2.2, -2.4], [1.6, 1.8, 2.2, 3.0]]
    close(s.per_token_loss, [[-1.0, -1.8, -2.2, -2.4], [1.6, 1.8, 2.2, 3.0]], atol=1e-5)
    assert s.is_low_clipped.tolist() == [[False] * 4, [True, False, False, False]]
    assert s.is_high_clipped.tolist() == [[False, False, False, True], [False] * 4]
    metrics = s.clip_metrics(torch.ones(2, 4))
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 8)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 8)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 8)
    # masked: only the first two tokens of each row count
    half = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 2)
    assert s.clip_metrics(half)["clip_ratio/high_mean"].item() == 0.0
    assert s.clip_metrics(half)["clip_ratio/low_mean"].item() == pytest.approx(1 / 4)


def test_clip_higher_moves_only_the_upper_bound():
    ratios = [0.7, 1.25, 1.3]
    log_ratio = torch.tensor([[math.log(r) for r in ratios]])
    pos, neg = torch.tensor([1.0]), torch.tensor([-1.0])
    symmetric = P.clipped_surrogate(log_ratio, pos, epsilon=0.2)
    higher = P.clipped_surrogate(log_ratio, pos, epsilon=0.2, epsilon_high=0.28)
    close(symmetric.per_token_loss, [[-0.7, -1.2, -1.2]], atol=1e-6)
    close(higher.per_token_loss, [[-0.7, -1.25, -1.28]], atol=1e-6)  # 1.25 no longer clipped; 1.3 clipped at 1.28
    assert higher.is_high_clipped.tolist() == [[False, False, True]]
    # the lower side is unchanged: ratio 0.7 with a negative advantage is clipped at 0.8 either way
    low_sym = P.clipped_surrogate(log_ratio, neg, epsilon=0.2)
    low_higher = P.clipped_surrogate(log_ratio, neg, epsilon=0.2, epsilon_high=0.28)
    close(low_sym.per_token_loss[:, 0], [0.8], atol=1e-6)
    close(low_higher.per_token_loss[:, 0], [0.8], atol=1e-6)
    assert low_higher.is_low_clipped.tolist() == [[True, False, False]]


def test_per_token_advantages_are_accepted():
    s = P.clipped_surrogate(torch.zeros(1, 2), torch.tensor([[1.0, -3.0]]))
    close(s.per_token_loss, [[-1.0, 3.0]])


def test_the_aggregations_differ_on_a_ragged_batch_as_documented():
    # grpo: mean per sequence ((1+2+3)/3 = 2, 10/1 = 10), then over sequences: 6
    assert P.grpo_loss(LOSS, MASK).item() == pytest.approx((2 + 10) / 2)
    # bnpo: mean over the 4 tokens: (1+2+3+10)/4 = 4
    assert P.bnpo_loss(LOSS, MASK).item() == pytest.approx(16 / 4)
    # dapo: sum over tokens / the global normalizer the loop passes (here 8 tokens per micro-batch on average)
    assert P.dapo_loss(LOSS, MASK, num_tokens=8).item() == pytest.approx(16 / 8)
    assert P.dapo_loss(LOSS, MASK, num_tokens=torch.tensor(8.0)).item() == pytest.approx(16 / 8)
    assert P.dapo_loss(LOSS, MASK).item() == pytest.approx(P.bnpo_loss(LOSS, MASK).item())
    # dr_grpo: sum / (2 sequences × max_completion_length 5)
    assert P.dr_grpo_loss(LOSS, MASK, max_completion_length=5).item() == pytest.approx(16 / 10)


@pytest.mark.parametrize("registry, group", [(P.LOSS_TYPES, "loss_type"), (P.KL_ESTIMATORS, "kl_estimator"),
                                             (P.IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level")])
def test_each_trl_name_maps_to_the_function_its_config_option_names(registry, group):
    """TRL's option values (the registries) and the config group's options (conf/algo/<group>/<value>.yaml) are the
    same set of names, each naming the same function."""
    from pathlib import Path

    from hydra.utils import get_object
    from omegaconf import OmegaConf

    folder = Path(__file__).parents[2] / "conf" / "algo" / group
    options = {path.stem: get_object(OmegaConf.load(path)["_target_"]) for path in folder.glob("*.yaml")}
    assert options == registry


def test_dapo_over_micro_batches_weighs_every_token_the_same():
    # two micro-batches with 4 and 1 tokens, accumulated as the loop does (each loss / 2 micro-batches)
    second_mask, second_loss = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[6.0, 0.0, 0.0]])
    global_tokens, micro_batches = 5, 2
    normalizer = global_tokens / micro_batches
    accumulated = (P.dapo_loss(LOSS, MASK, normalizer) + P.dapo_loss(second_loss, second_mask, normalizer)) / 2
    assert accumulated.item() == pytest.approx((1 + 2 + 3 + 10 + 6) / 5)
    # bnpo's mean of micro-batch means weighs the lone token of the second micro-batch 4 times more
    bnpo = (P.bnpo_loss(LOSS, MASK) + P.bnpo_loss(second_loss, second_mask)) / 2
    assert bnpo.item() == pytest.approx((16 / 4 + 6) / 2)


def test_aggregation_gradients_weigh_tokens_as_documented():
    loss = LOSS.clone().requires_grad_(True)
    P.grpo_loss(loss, MASK).backward()
    close(loss.grad, [[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0]])  # a token of the short sequence weighs 3×
    loss.grad = None
    P.bnpo_loss(loss, MASK).backward()
    close(loss.grad, [[1 / 4] * 3, [1 / 4, 0, 0]])


def test_drop_truncated():
    close(P.drop_truncated(MASK, torch.tensor([True, False])), [[0, 0, 0], [1, 0, 0]])


def test_kl_estimators_by_hand():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # log(π_ref/π_θ) = -0.5 and 1.0
    close(P.kl_k1(logps, ref), [[0.5, -1.0]])
    close(P.kl_k2(logps, ref), [[0.125, 0.5]])
    close(P.kl_k3(logps, ref), [[0.1065306597, 0.7182818285]])  # e^-0.5 - 1 + 0.5, e - 2
    for estimator in (P.kl_k1, P.kl_k2, P.kl_k3):
        same = estimator(logps, logps)
        assert torch.equal(same, torch.zeros_like(same))


def test_kl_estimators_estimate_the_true_kl():
    # π_θ = [0.7, 0.2, 0.1], π_ref = [0.4, 0.4, 0.2]; the expectation under π_θ of k1 and k3 is KL(π_θ ‖ π_ref)
    p, q = [0.7, 0.2, 0.1], [0.4, 0.4, 0.2]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    logp, logq = torch.tensor(p).log(), torch.tensor(q).log()
    weights = torch.tensor(p)
    assert (weights * P.kl_k1(logp, logq)).sum().item() == pytest.approx(kl, abs=1e-6)
    assert (weights * P.kl_k3(logp, logq)).sum().item() == pytest.approx(kl, abs=1e-6)


@pytest.mark.parametrize("estimator, documented", [(P.kl_k1, "zero"), (P.kl_k2, "KL(pi||ref)"),
                                                   (P.kl_k3, "KL(ref||pi)")])
def test_each_kl_estimators_expected_gradient_as_a_loss_term_is_the_documented_one(estimator, documented):
    """Exact expectation over every outcome y of a categorical pi = softmax(theta): the gradient of
    E_{y ~ pi}[k(log pi_theta(y), log ref(y))] with the samples held fixed (what a loss term on sampled tokens
    gives) is 0 for k1, grad KL(pi||ref) for k2 and grad KL(ref||pi) for k3 (the module's KL section)."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.4, 0.1, 0.2, 0.3], dtype=torch.float64)
    logp = torch.log_softmax(theta, -1)
    sampling = logp.exp().detach()  # the outcomes' probabilities: not differentiated, as sampled tokens are not
    (got,) = torch.autograd.grad((sampling * estimator(logp, ref.log())).sum(), theta)

    def gradient(name: str) -> torch.Tensor:
        pi = torch.softmax(theta, -1)
        kl = {"KL(pi||ref)": (pi * (pi.log() - ref.log())).sum(), "KL(ref||pi)": (ref * (ref.log() - pi.log())).sum()}
        return torch.zeros_like(theta) if name == "zero" else torch.autograd.grad(kl[name], theta)[0]

    torch.testing.assert_close(got, gradient(documented), atol=1e-12, rtol=1e-10)
    for other in {"zero", "KL(pi||ref)", "KL(ref||pi)"} - {documented}:  # the three differ here: the test can tell
        assert (gradient(other) - got).abs().max() > 0.01


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.5, 3.0]])
    old = torch.tensor([[0.5, 0.5, 2.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    # token 0: clipped value 0.7: (1-2)^2 = 1 vs (0.7-2)^2 = 1.69 → clipped; token 1: inside; token 2: clip 2.2:
    # (3-0)^2 = 9 vs 2.2^2 = 4.84 → unclipped
    loss, clipped = P.clipped_value_loss(values, old, returns, cliprange_value=0.2)
    close(loss, [[0.5 * 1.69, 0.5 * 0.25, 0.5 * 9.0]], atol=1e-6)
    assert clipped.tolist() == [[True, False, False]]


def test_entropy_from_logits_by_hand_and_in_chunks():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]], [[0.0, 0.0], [5.0, 5.0]]])
    p = [0.75, 0.25]
    expected = [[math.log(2), -sum(x * math.log(x) for x in p)], [math.log(2), math.log(2)]]
    close(P.entropy_from_logits(logits), expected)
    close(P.entropy_from_logits(logits, chunk_rows=3), expected)
    assert P.entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    torch.manual_seed(0)
    big = torch.randn(3, 5, 11)
    reference = torch.distributions.Categorical(logits=big).entropy()
    close(P.entropy_from_logits(big, chunk_rows=4), reference, atol=1e-5)
