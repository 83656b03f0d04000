import math

import pytest
import torch

from rlhf.algos.dpo import DPO
from rlhf.algos.dpo_losses import PairLogps, sigmoid_loss
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy


def _pairs(chosen, rejected):
    """Pairs whose reference log-probabilities are 0, so the log-ratios are the policy's; 1 token each."""
    zeros, ones = torch.zeros_like(chosen), torch.ones_like(chosen)
    return PairLogps(chosen, rejected, zeros, zeros, ones, ones)


def test_sigmoid_loss_matches_hand_computed_values():
    # beta 0.1, h = (c - r) logratio difference: h=10 -> -log(sigmoid(1)) = log(1 + e^-1)
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([-8.0, 0.0, 4.0])
    losses = sigmoid_loss(_pairs(chosen, rejected), 0.1, {})
    expected = [math.log(1 + math.exp(-1.0)), math.log(2.0), math.log(1 + math.exp(0.5))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)


def test_label_smoothing_mixes_both_directions():
    chosen, rejected = torch.tensor([1.0]), torch.tensor([-1.0])
    plain = sigmoid_loss(_pairs(chosen, rejected), 1.0, {})
    flipped = sigmoid_loss(_pairs(rejected, chosen), 1.0, {})
    smoothed = sigmoid_loss(_pairs(chosen, rejected), 1.0, {}, label_smoothing=0.25)
    assert smoothed.item() == pytest.approx(0.75 * plain.item() + 0.25 * flipped.item(), rel=1e-6)


def _batch(policy, algo):
    rows = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}, {"prompt": "hello=", "chosen": "olleh", "rejected": "hello"}]
    return algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])


def test_dpo_at_init_has_zero_rewards_and_log2_loss():
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(beta=0.1, reference=FrozenCopy())
    algo.setup(policy.model, policy.tokenizer)
    loss, metrics = algo.loss(policy.model, _batch(policy, algo))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["rewards/accuracies"].item() == 0.0  # ties do not count, as in TRL


def test_held_out_reference_values_are_the_untrained_policys_then_kept_and_equal_to_a_reference_pass(monkeypatch):
    """The evaluation at the start of a run with a copied reference runs no reference pass (the policy's values are
    the reference's, bit for bit); later evaluations read the kept values; a training batch or a checkpoint's state
    ends the first shortcut. Every value equals what a reference pass gives."""
    torch.manual_seed(0)
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(beta=0.1, reference=FrozenCopy())
    algo.setup(policy.model, policy.tokenizer)
    batch = _batch(policy, algo)
    passes = []
    forward = FrozenCopy.logps
    monkeypatch.setattr(FrozenCopy, "logps", lambda self, *a: passes.append(1) or forward(self, *a))

    def by_a_reference_pass():
        with torch.no_grad():
            return forward(algo.reference, batch, algo.ref_model, policy.model)

    assert torch.equal(by_a_reference_pass(), algo.reference_logps(batch, policy.model, held_out=True,
                                                                   policy_logps=by_a_reference_pass()))
    start = algo.evaluate(policy.model, _batch(policy, algo))
    assert start["rewards/chosen"].item() == 0.0 and start["rewards/margins"].item() == 0.0  # exactly: same values
    assert not passes
    algo.loss(policy.model, batch)  # a training batch: the policy trains from here on
    passes.clear()
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    later = algo.evaluate(policy.model, batch)  # kept from the first evaluation: no pass
    assert not passes
    fresh = DPO(beta=0.1, reference=FrozenCopy())
    fresh.frozen = {"reference": algo.ref_model}
    assert {k: v.item() for k, v in later.items()} == {k: v.item() for k, v in fresh.loss(policy.model, batch)[1].items()}
    assert later["rewards/margins"].item() != 0.0
    resumed = DPO(beta=0.1, reference=FrozenCopy())  # a resume: setup, then the checkpoint's state
    resumed.setup(policy.model, policy.tokenizer)
    resumed.load_state_dict({})
    passes.clear()
    resumed.evaluate(policy.model, batch)
    assert passes  # after a checkpoint's state: the reference runs


def test_dpo_rewards_are_beta_times_logratios_and_nll_term_is_weight_times_chosen_nll():
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(beta=0.5, reference=FrozenCopy())
    algo.setup(policy.model, policy.tokenizer)
    with torch.no_grad():  # move the policy away from the reference
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _batch(policy, algo)
    loss, metrics = algo.loss(policy.model, batch)
    from rlhf.ops.completion_logps import completion_stats

    pol, ref = completion_stats(policy.model, batch).logps, completion_stats(algo.ref_model, batch).logps
    chosen_rewards = 0.5 * (pol[:2] - ref[:2])
    rejected_rewards = 0.5 * (pol[2:] - ref[2:])
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
    assert metrics["rewards/margins"].item() == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), rel=1e-5)
    assert metrics["logps/rejected"].item() == pytest.approx(pol[2:].mean().item(), rel=1e-5)
    expected = sigmoid_loss(_pairs(pol[:2] - ref[:2], pol[2:] - ref[2:]), 0.5, {}).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)

    # RPO's term: nll_weight x the mean negative log-prob per completion token of the chosen rows only.
    stats = completion_stats(policy.model, batch)
    chosen_logps, chosen_mask = stats.token_logps[:2], stats.mask[:2].float()
    nll = -(chosen_logps * chosen_mask).sum() / chosen_mask.sum()
    assert nll.item() > 0
    for weight in (1.0, 2.5):
        algo.nll_weight = weight
        with_nll, _ = algo.loss(policy.model, batch)
        assert with_nll.item() - loss.item() == pytest.approx(weight * nll.item(), rel=1e-5)


def test_dpo_collate_puts_chosen_first_in_one_batch():
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(shared_prompt=False)
    algo.setup(policy.model, policy.tokenizer)
    batch = _batch(policy, algo)
    assert batch["input_ids"].shape[0] == 4
    eos = policy.tokenizer.eos_token_id
    assert batch["input_ids"][0].tolist()[:8] == list(b"abc=cba") + [eos]
    assert batch["input_ids"][2].tolist()[:8] == list(b"abc=cab") + [eos]


def test_orpo_is_the_nll_of_the_whole_chosen_sequence_minus_lambda_log_sigmoid_of_the_log_odds_ratio():
    """algo=orpo as TRL's ORPOTrainer: NLL over prompt and completion of the chosen rows (every token but the first;
    not the padding), plus the odds-ratio term on average log-probabilities; no reference model."""
    from hydra.utils import instantiate

    from rlhf.algos.dpo_losses import log1mexp
    from tests.conftest import compose_config

    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = instantiate(compose_config("algo=orpo").algo)
    algo.setup(policy.model, policy.tokenizer)
    assert algo.ref_model is None
    batch = _batch(policy, algo)
    loss, metrics = algo.loss(policy.model, batch)
    logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    tokens, completion = batch["attention_mask"][:, 1:].float(), batch["completion_mask"][:, 1:].float()
    nll = -(logps[:2] * tokens[:2]).sum() / tokens[:2].sum()  # both chosen sequences, prompts included
    average = (logps * completion).sum(-1) / completion.sum(-1)
    log_odds = average - log1mexp(average)
    odds_ratio = -0.1 * torch.nn.functional.logsigmoid(log_odds[:2] - log_odds[2:]).mean()
    assert metrics["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert loss.item() == pytest.approx((nll + odds_ratio).item(), rel=1e-5)
    algo.nll_on_prompt = False  # the completion tokens only, as RPO and SimPO's cpo_alpha
    only_completion = -(logps[:2] * completion[:2]).sum() / completion[:2].sum()
    assert algo.loss(policy.model, batch)[1]["nll_loss"].item() == pytest.approx(only_completion.item(), rel=1e-5)


# ---- padding-free pairs --------------------------------------------------------------------------------------------
def _dpo_step(padding_free: bool, reference, loss=sigmoid_loss, nll_weight=0.0):
    """Loss, metrics, gradients and sample count of one DPO step on three pairs of different lengths, the policy
    moved away from its reference (the same draw each call)."""
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(beta=0.5, reference=reference, loss=loss, nll_weight=nll_weight, padding_free=padding_free,
               shared_prompt=False)
    algo.setup(policy.model, policy.tokenizer)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    rows = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"},
            {"prompt": "hello=", "chosen": "olleh", "rejected": "hel"},
            {"prompt": "x=", "chosen": "x", "rejected": "xyzzy"}]
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])
    loss, metrics = algo.loss(policy.model, batch)
    loss.backward()
    return (float(loss.detach()), {k: float(v) for k, v in metrics.items()}, [p.grad for p in policy.model.parameters()],
            algo.samples(batch), batch["input_ids"].shape)


@pytest.mark.parametrize("case", ["copy", "none+simpo", "copy+rpo"])
def test_padding_free_pairs_give_the_loss_metrics_and_gradients_of_padded_ones(case):
    """The pairs' six answers packed into one sequence, for policy and reference: the same loss, every metric and
    gradient, and the same pair count as padded pairs (red when the packed rows see each other, when the chosen
    and rejected halves are split wrong, or when reference=none counts one sequence)."""
    from rlhf.algos.dpo_losses import simpo_loss
    from rlhf.models.reference import NoReference

    reference = (lambda: NoReference()) if case.startswith("none") else (lambda: FrozenCopy())
    options = {"loss": simpo_loss} if "simpo" in case else {"nll_weight": 1.0} if "rpo" in case else {}
    padded, packed = (_dpo_step(padding_free, reference(), **options) for padding_free in (False, True))
    assert packed[4][0] == 1 and padded[4][0] == 6  # one packed sequence against six padded ones
    assert packed[0] == pytest.approx(padded[0], abs=1e-6)
    assert packed[1].keys() == padded[1].keys()
    for name in padded[1]:
        assert packed[1][name] == pytest.approx(padded[1][name], abs=1e-5), name
    for a, b in zip(padded[2], packed[2]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert packed[3] == padded[3] == 3


def test_padding_free_refuses_the_nll_it_cannot_read_and_takes_shared_prompts():
    from rlhf.config.checks import check_config
    from rlhf.core.errors import UserError
    from tests.conftest import compose_config

    with pytest.raises(UserError, match="does not take algo.nll_on_prompt"):
        check_config(compose_config("algo=dpo", "algo.padding_free=true", "algo.nll_on_prompt=true"))
    check_config(compose_config("algo=dpo", "algo.padding_free=true", "algo.shared_prompt=true"))  # packed pairs
