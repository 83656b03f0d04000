"""PPO on the shared policy-gradient base: the critic attached to the policy, the rollout's GAE wiring, the scores'
post-processing and its checkpointed statistics, and a short run through the loop."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf import train
from rlhf.algos.ppo import PPO
from rlhf.algos.reward_funcs import char_similarity
from rlhf.algos.reward_shaping import AdaptiveKLController, FixedKLController
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.models.value_head import attach_value_head, values_on
from tests.algos.test_grpo import GRPO_FAST, _policy, _source
from tests.algos.test_policy_gradient import varied_reward
from tests.conftest import FAST, compose_config

IDS = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 2]])


# --- the critic -----------------------------------------------------------------------------------------------------
def test_a_value_head_on_the_trunk_answers_only_when_asked():
    policy = _policy().model
    attach_value_head(policy, separate=False)
    assert "token_values" not in policy(input_ids=IDS)
    with values_on(policy):
        out = policy(input_ids=IDS)
    assert out["token_values"].shape == IDS.shape and out.logits.shape[:2] == IDS.shape
    assert "token_values" not in policy(input_ids=IDS)  # off again after the block
    assert {"value_head.score.weight", "value_head.score.bias"} <= set(policy.state_dict())
    out["token_values"].sum().backward()  # the value's gradient reaches the shared trunk
    assert policy.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_separate_critic_shares_no_parameter_with_the_policy():
    policy = _policy().model
    head = attach_value_head(policy, separate=True)
    policy_ids = {id(p) for name, p in policy.named_parameters() if not name.startswith("value_head.")}
    assert not policy_ids & {id(p) for p in head.parameters()}
    with values_on(policy):
        policy(input_ids=IDS)["token_values"].sum().backward()
    assert policy.model.layers[0].mlp.up_proj.weight.grad is None
    assert head.backbone.layers[0].mlp.up_proj.weight.grad is not None


def test_a_deep_copy_of_a_policy_with_a_critic_computes_with_its_own_weights():
    """eval=generate copies the initial policy when the objective holds no reference (PPO with kl_coef=0): the copy's
    forward must be its own. Red when the forward is a closure over the original (the copy then answered with the
    policy's changing weights: a KL of exactly 0 at every evaluation of a PPO run without a reference)."""
    import copy
    import inspect

    policy = _policy().model
    attach_value_head(policy, separate=False)
    frozen = copy.deepcopy(policy)
    before = frozen(input_ids=IDS).logits
    with torch.no_grad():
        policy.lm_head.weight.mul_(3)
    assert not torch.allclose(policy(input_ids=IDS).logits, before)
    torch.testing.assert_close(frozen(input_ids=IDS).logits, before)  # the copy did not move with the policy
    with values_on(frozen):
        assert frozen(input_ids=IDS)["token_values"].shape == IDS.shape
    assert "input_ids" in inspect.signature(policy.forward).parameters  # generate reads the forward's arguments


def test_a_ppo_run_without_a_reference_measures_its_kl_against_a_copy_without_the_critic(tmp_path):
    """PPO with kl_coef=0 and eval=generate: the evaluation's copy of the initial policy holds no critic, and the
    KL moves off 0 as the policy trains (it read exactly 0 at every evaluation while the copy's forward called the
    policy)."""
    import json

    cfg = compose_config(*FAST, *GRPO_FAST[1:], "algo=ppo", "algo.kl_controller.kl_coef=0", "eval=generate",
                         "eval.prompts=8", "train.max_steps=4", "train.eval_every_steps=4", "optimizer.lr=3e-3",
                         output_dir=tmp_path)
    train(cfg)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "eval/gen/kl" in line]
    assert evals[0]["eval/gen/kl"] == 0 and evals[-1]["eval/gen/kl"] > 0, evals


# --- the rollout ----------------------------------------------------------------------------------------------------
def test_the_advantages_are_gae_of_the_score_at_the_end_against_the_critics_values():
    """With no KL, gamma = lambda = 1 and no whitening, GAE gives each token ``score - V_t``; returns are the score."""
    algo = PPO(kl_controller=FixedKLController(0.0), num_generations=2, max_completion_length=4, lam=1.0,
               whiten_advantages=False, reward_funcs={"similarity": char_similarity})
    source, _ = _source(algo)
    assert algo.frozen == {}  # a fixed coefficient of 0 holds no reference
    batch = source.next()
    mask = batch["completion_mask"][:, int(batch["prompt_length"]):].bool()
    expected = (batch["rewards"].unsqueeze(1) - batch["old_values"])[mask]
    torch.testing.assert_close(batch["advantages"][mask], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch["returns"][mask], batch["rewards"].unsqueeze(1).expand_as(mask)[mask])
    loss, metrics = algo.loss(source.model, batch)
    assert {"loss/policy", "loss/value", "val/clipfrac", "kl_coef", "values/mean"} <= set(metrics)
    assert float(metrics["loss"]) == pytest.approx(float(metrics["loss/policy"]) + 0.1 * float(metrics["loss/value"]))


def test_the_second_epoch_value_loss_is_the_hand_computed_one_and_the_critic_moves():
    """num_ppo_epochs=2: after one SGD step, the critic's parameters have changed, and the second pass's value loss
    and clip fraction equal a hand computation of 1/2 max((V - R)^2, (clip(V, V_old +- c) - R)^2) from an independent
    forward pass. Red if returns and old values swap roles, or the critic gets no gradient."""
    cliprange = 0.2
    algo = PPO(kl_controller=FixedKLController(0.0), num_generations=2, max_completion_length=4, num_ppo_epochs=2,
               cliprange_value=cliprange, reward_funcs={"varied": varied_reward})
    source, _ = _source(algo)
    model = source.model
    critic = {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("value_head.")}
    first = source.next()
    loss, _ = algo.loss(model, first)
    loss.backward()
    # The value head's gradient is vf_coef times that of the value loss alone (at the first pass the values are the
    # rollout's: the clip is inactive, 1/2 (V - R)^2): red if the value term's sign or weight in the loss is wrong.
    head = model.get_submodule("value_head.score")
    prompt = int(first["prompt_length"])
    with values_on(model):
        values = model(input_ids=first["input_ids"], attention_mask=first["attention_mask"])["token_values"]
    first_mask = first["attention_mask"][:, prompt:].bool()
    alone = (0.5 * (values[:, prompt - 1:-1] - first["returns"]) ** 2)[first_mask].mean()
    (want_grad,) = torch.autograd.grad(alone, head.weight)
    torch.testing.assert_close(head.weight.grad, 0.1 * want_grad, atol=1e-7, rtol=1e-5)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.zero_grad()
    moved = {name: float((p.detach() - critic[name]).abs().max()) for name, p in model.named_parameters()
             if name in critic}
    assert critic and all(change > 0 for change in moved.values()), moved
    second = source.next()
    _, metrics = algo.loss(model, second)
    prompt = int(second["prompt_length"])
    mask = second["attention_mask"][:, prompt:].bool()
    with torch.no_grad(), values_on(model):
        values = model(input_ids=second["input_ids"], attention_mask=second["attention_mask"])["token_values"]
    values = values[:, prompt - 1:-1]
    old, returns = second["old_values"], second["returns"]

    def value_loss(old, returns):
        clipped = torch.maximum(torch.minimum(values, old + cliprange), old - cliprange)
        return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), \
            (clipped - returns) ** 2 > (values - returns) ** 2

    per_token, clipped = value_loss(old, returns)
    assert float(metrics["loss/value"]) == pytest.approx(float(per_token[mask].mean()), rel=1e-5, abs=1e-7)
    assert float(metrics["val/clipfrac"]) == pytest.approx(float(clipped[mask].float().mean()))
    assert 0 < float(metrics["val/clipfrac"]) < 1  # the step moved some values past the clip and not others
    swapped, _ = value_loss(returns, old)
    assert abs(float(swapped[mask].mean()) - float(per_token[mask].mean())) > 1e-3  # the test can tell the roles


def test_score_scaling_normalization_and_clipping_use_every_score_seen():
    algo = PPO(score_norm=True, score_clip=1.0)
    first = algo.shape_scores(torch.tensor([0.0, 2.0]), None)
    assert first.tolist() == pytest.approx([-1 / 2**0.5, 1 / 2**0.5], abs=1e-6)  # mean 1, sample std sqrt 2
    second = algo.shape_scores(torch.tensor([10.0, 0.0]), None)  # seen: 0, 2, 10, 0: mean 3, std sqrt(68/3)
    std = (68 / 3) ** 0.5
    assert second.tolist() == pytest.approx([min(7 / std, 1.0), -3 / std], abs=1e-6)
    scaling = PPO(score_scaling=True)
    assert scaling.shape_scores(torch.tensor([1.0, 3.0]), None).tolist() == pytest.approx([1 / 2**0.5, 3 / 2**0.5])


def test_the_running_statistics_and_the_kl_coefficient_are_checkpointed():
    algo = PPO(kl_controller=AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=10), score_scaling=True,
               num_generations=2, max_completion_length=4)
    source, _ = _source(algo)
    with torch.no_grad():
        for parameter in source.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # the policy has left the reference: KL > 0
    source.next()
    state = algo.state_dict()
    assert algo.kl_controller.value != 0.2 and algo.score_moments.count == 4
    fresh = PPO(kl_controller=AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=10), score_scaling=True)
    fresh.load_state_dict(state)
    assert fresh.kl_controller.value == algo.kl_controller.value == fresh.beta
    assert (fresh.score_moments.count, fresh.score_moments.mean, fresh.score_moments.m2) == \
        (algo.score_moments.count, algo.score_moments.mean, algo.score_moments.m2)


def test_grpo_names_of_ppo_options_are_refused_with_trls_ppo_name():
    with pytest.raises(UserError, match="algo.num_ppo_epochs"):
        PPO(num_iterations=2)
    check_config(compose_config("algo=ppo", "algo/kl_controller=adaptive", "algo.num_ppo_epochs=2"))
    with pytest.raises(UserError, match="algo.lam"):
        check_config(compose_config("algo=ppo", "algo.lam=2"))


# --- a run ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("separate", [False, True])
def test_a_short_run_trains_policy_and_critic_and_saves_a_loadable_policy(separate, tmp_path):
    overrides = [*FAST, *GRPO_FAST, "algo=ppo", "algo/reward_funcs=similarity", "train.eval_at_start=false",
                 f"algo.separate_critic={str(separate).lower()}", "algo.num_ppo_epochs=2"]
    metrics = train(compose_config(*overrides, output_dir=tmp_path))
    assert {"train/loss/value", "train/reward", "eval/reward"} <= set(metrics)
    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert "value_head.score.weight" in saved
    assert any(k.startswith("value_head.backbone.") for k in saved) == separate
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # the policy loads; the critic's keys are left out


# --- sharded parameters -----------------------------------------------------------------------------------------------
@pytest.mark.serial
def test_ppo_under_fsdp2_trains_what_ddp_trains(tmp_path):
    """The critic under FSDP2: its score is a sharding unit of its own, gathered for its forward and again for its
    backward (as part of the root it was freed before the backward: "setStorage ... out of bounds"). A separate
    critic is refused there with the options that run it."""
    from tests.algos.test_grpo import SHARDED_RUN, _train_py

    ppo = ["algo=ppo", *(a for a in SHARDED_RUN if not a.startswith(("algo=", "algo.dynamic_sampling")))]
    _train_py(tmp_path / "ddp", *ppo, "hardware=cpu_ddp")
    _train_py(tmp_path / "fsdp", *ppo, "hardware=fsdp")
    ddp, fsdp = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("ddp", "fsdp"))
    assert "value_head.score.weight" in fsdp
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], atol=1e-6, rtol=1e-5)
    with pytest.raises(AssertionError, match="algo.separate_critic=false"):
        _train_py(tmp_path / "separate", *ppo, "hardware=fsdp", "algo.separate_critic=true")


@pytest.mark.slow
def test_ppo_learns_on_the_embedded_task(tmp_path):
    """From the embedded SFT warm start, the held-out greedy exact match rises. PPO's critic starts untrained, so it
    needs more steps than the others' gates: measured for this run (60 steps of 16 prompts x 8, defaults, constant
    lr; the command in tests/algos/test_policy_gradient.py with algo=ppo train.max_steps=60), seeds 0-4, 2-core AMD
    EPYC (no AVX-512), torch 2.13.0+cpu, 2026-11-27: 0.551 -> 0.598-0.637, a rise of 0.047 at the least (at 30
    steps -0.020 to +0.086: no gate there; at 30 steps with lr 3e-4 it fell); the gate asks for 0.02 (margin
    0.027)."""
    from tests.algos.test_grpo import LEARNS, held_out_reward_before_and_after

    before, after = held_out_reward_before_and_after(tmp_path, "algo=ppo", *(o for o in LEARNS if o != "algo=grpo"))
    assert after >= before + 0.02, (before, after)
