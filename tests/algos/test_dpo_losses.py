"""The DPO loss family (rlhf.algos.dpo_losses): each formula against values computed by hand with `math`, the
known values at initialization (policy = reference), BCO's state in checkpoints, and every variant's YAML trains."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from hydra.utils import instantiate
from safetensors.torch import load_file

from rlhf import train
from rlhf.algos import dpo_losses as L
from rlhf.algos.dpo import DPO
from rlhf.core.errors import UserError
from rlhf.hardware import free_port
from rlhf.ops.collectives import sum_over_every_process
from rlhf.run import checkpoint
from tests.algos import workers
from tests.conftest import CONF, FAST, compose_config

# Two pairs. Policy/reference log-probabilities (summed) and completion lengths.
PC, PR, RC, RR = [-2.0, -5.0], [-6.0, -3.0], [-3.0, -4.0], [-4.0, -4.5]
NC, NR = [2.0, 4.0], [3.0, 1.0]
RW = [p - r for p, r in zip(PC, RC)]  # chosen log-ratios: 1, -1
RL = [p - r for p, r in zip(PR, RR)]  # rejected log-ratios: -2, 1.5
H = [r_w - r_l for r_w, r_l in zip(RW, RL)]  # margins: 3, -2.5
BETA = 0.5


def pairs() -> L.PairLogps:
    t = torch.tensor
    return L.PairLogps(t(PC), t(PR), t(RC), t(RR), t(NC), t(NR))


def at_init(n: int = 3) -> L.PairLogps:
    logps = torch.tensor([-3.0, -7.0, -1.5][:n])
    return L.PairLogps(logps, logps - 1, logps, logps - 1, torch.full((n,), 2.0), torch.full((n,), 3.0))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return math.exp(logsig(x))


def log_odds(average_logp: float) -> float:
    """ORPO's log odds of a completion, log(P / (1 - P)) with P = exp(average log-probability)."""
    p = math.exp(average_logp)
    return math.log(p / (1 - p))


def pair_loss(name: str, pc: float, pr: float, rc: float, rr: float, nc: float, nr: float, beta: float) -> float:
    """One pair's loss written out from its paper / TRL's definition, in plain floats: policy and reference
    log-probabilities of the chosen and rejected answers, their token counts, beta; the options as CASES sets them
    (those of conf/algo/loss/ where both have the loss)."""
    r_w, r_l = pc - rc, pr - rr
    h = r_w - r_l
    z = beta * h
    hn = r_w / nc - r_l / nr
    return {
        "sigmoid": lambda: -logsig(z),
        "cdpo": lambda: -0.9 * logsig(z) - 0.1 * logsig(-z),
        "robust": lambda: (-0.9 * logsig(z) + 0.1 * logsig(-z)) / 0.8,
        "hinge": lambda: max(0.0, 1 - z),
        "ipo": lambda: (hn - 1 / (2 * beta)) ** 2,
        "ipo_summed": lambda: (h - 1 / (2 * beta)) ** 2,
        "exo_pair": lambda: sig(z) * (logsig(z) - math.log(1 - 1e-3)) + sig(-z) * (logsig(-z) - math.log(1e-3)),
        "nca_pair": lambda: -logsig(beta * r_w) - 0.5 * logsig(-beta * r_w) - 0.5 * logsig(-beta * r_l),
        "sppo_hard": lambda: (r_w - 1 / (2 * beta)) ** 2 + (r_l + 1 / (2 * beta)) ** 2,
        "apo_zero": lambda: 1 - sig(beta * r_w) + sig(beta * r_l),
        "apo_down": lambda: sig(beta * r_w) + 1 - sig(z),
        "discopop": lambda: -logsig(z) * (1 - sig(z / 0.05)) + math.exp(-z) * sig(z / 0.05),
        "sigmoid_norm": lambda: -logsig(beta * hn),
        "js": lambda: -logsig(beta * (h - (math.log1p(math.exp(r_w)) - math.log1p(math.exp(r_l))))),
        "bco_pair": lambda: -logsig(beta * r_w) - logsig(-beta * r_l),
        "forward_kl": lambda: -logsig(beta * (math.exp(-r_l) - math.exp(-r_w))),
        "alpha_0.5": lambda: -logsig(beta * (math.exp(-0.5 * r_l) - math.exp(-0.5 * r_w)) / 0.5),
        # TRL's coefficient a: f'(u) = (u^(a-1) - 1)/(a-1); the paper's (1 - u^-alpha)/alpha with alpha = 1 - a
        "alpha_0.2": lambda: -logsig(beta * (math.exp(-0.8 * r_l) - math.exp(-0.8 * r_w)) / 0.8),
        # reference-free, on the policy's average log-probabilities a = logp / |y| (the reference is not read)
        "simpo": lambda: -logsig(beta * (pc / nc - pr / nr) - 0.5),
        "simpo_smoothed": lambda: (-0.9 * logsig(beta * (pc / nc - pr / nr) - 1.0)
                                   - 0.1 * logsig(-(beta * (pc / nc - pr / nr) - 1.0))),
        "orpo": lambda: -beta * logsig(log_odds(pc / nc) - log_odds(pr / nr)),
    }[name]()


def expected(name: str) -> list[float]:
    """Each loss of the two pairs above."""
    return [pair_loss(name, *values, BETA) for values in zip(PC, PR, RC, RR, NC, NR)]


CASES = {
    "sigmoid": lambda p, s: L.sigmoid_loss(p, BETA, s),
    "cdpo": lambda p, s: L.sigmoid_loss(p, BETA, s, label_smoothing=0.1),
    "robust": lambda p, s: L.robust_loss(p, BETA, s, label_smoothing=0.1),
    "hinge": lambda p, s: L.hinge_loss(p, BETA, s),
    "ipo": lambda p, s: L.ipo_loss(p, BETA, s),
    "ipo_summed": lambda p, s: L.ipo_loss(p, BETA, s, per_token=False),
    "exo_pair": lambda p, s: L.exo_pair_loss(p, BETA, s),
    "nca_pair": lambda p, s: L.nca_pair_loss(p, BETA, s),
    "sppo_hard": lambda p, s: L.sppo_hard_loss(p, BETA, s),
    "bco_pair": lambda p, s: L.bco_pair_loss(p, BETA, s),
    "apo_zero": lambda p, s: L.apo_zero_loss(p, BETA, s),
    "apo_down": lambda p, s: L.apo_down_loss(p, BETA, s),
    "discopop": lambda p, s: L.discopop_loss(p, BETA, s),
    "sigmoid_norm": lambda p, s: L.sigmoid_norm_loss(p, BETA, s),
    "js": lambda p, s: L.sigmoid_loss(p, BETA, s, divergence=L.js_divergence),
    "forward_kl": lambda p, s: L.sigmoid_loss(p, BETA, s, divergence=L.forward_kl),
    "alpha_0.5": lambda p, s: L.sigmoid_loss(p, BETA, s, divergence=lambda q: L.alpha_divergence(q, 0.5)),
    "alpha_0.2": lambda p, s: L.sigmoid_loss(p, BETA, s, divergence=lambda q: L.alpha_divergence(q, 0.2)),
    "simpo": lambda p, s: L.simpo_loss(p, BETA, s, gamma=0.5),
    "simpo_smoothed": lambda p, s: L.simpo_loss(p, BETA, s, gamma=1.0, label_smoothing=0.1),
    "orpo": lambda p, s: L.orpo_loss(p, BETA, s),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_hand_computed_values(name):
    assert CASES[name](pairs(), {}).tolist() == pytest.approx(expected(name), rel=1e-5)


def test_log1mexp_is_accurate_near_zero_and_far_below_it_and_finite_at_zero():
    xs = [-1e-9, -1e-3, -0.5, -math.log(2), -2.0, -40.0]
    got = L.log1mexp(torch.tensor(xs, dtype=torch.float64)).tolist()
    assert got == pytest.approx([math.log(-math.expm1(x)) for x in xs], rel=1e-12)
    assert math.isfinite(L.log1mexp(torch.tensor([0.0])).item())  # a completion of probability 1


def test_reference_free_losses_at_equal_average_logps_and_ignore_the_reference():
    """Chosen and rejected equally likely per token: SimPO is log(1 + e^gamma), ORPO's term beta log 2."""
    t = torch.tensor
    equal = L.PairLogps(t([-2.0, -6.0]), t([-3.0, -9.0]), t([5.0, -1.0]), t([0.0, 2.0]), t([2.0, 4.0]), t([3.0, 6.0]))
    assert L.simpo_loss(equal, 2.0, {}, gamma=0.5).tolist() == pytest.approx([math.log1p(math.exp(0.5))] * 2)
    assert L.orpo_loss(equal, 0.1, {}).tolist() == pytest.approx([0.1 * LOG2] * 2)
    assert torch.equal(L.simpo_loss(pairs(), BETA, {}), L.simpo_loss(at_ref(pairs()), BETA, {}))
    assert torch.equal(L.orpo_loss(pairs(), BETA, {}), L.orpo_loss(at_ref(pairs()), BETA, {}))


def at_ref(p: L.PairLogps) -> L.PairLogps:
    """The same pairs with another reference."""
    return L.PairLogps(p.policy_chosen, p.policy_rejected, p.ref_chosen + 3, p.ref_rejected - 1, p.chosen_tokens,
                       p.rejected_tokens)


def test_aot_sorts_across_the_batch():
    # aot_unpaired: sorted chosen log-ratios [-1, 1] against sorted rejected [-2, 1.5]: margins [1, -0.5].
    assert L.aot_unpaired_loss(pairs(), BETA, {}).tolist() == pytest.approx([-logsig(0.5), -logsig(-0.25)], rel=1e-5)
    # aot: policy log-odds [4, -2] sorted [-2, 4]; reference [1, 0.5] sorted [0.5, 1]: margins [-2.5, 3].
    assert L.aot_loss(pairs(), BETA, {}).tolist() == pytest.approx([-logsig(-1.25), -logsig(1.5)], rel=1e-5)


def test_bco_pair_uses_and_keeps_the_running_reward_mean():
    state: dict = {}
    first = L.bco_pair_loss(pairs(), BETA, state, running_mean=True)
    rewards = [BETA * x for x in RW + RL]
    delta = sum(rewards) / 4  # the first batch's mean, taken before use (as TRL does)
    assert first.tolist() == pytest.approx([-logsig(BETA * r_w - delta) - logsig(-(BETA * r_l - delta))
                                            for r_w, r_l in zip(RW, RL)], rel=1e-5)
    assert state["bco_reward_count"].item() == 4 and state["bco_reward_mean"].item() == pytest.approx(delta)
    L.bco_pair_loss(at_init(2), BETA, state, running_mean=True)  # rewards all 0: the mean of all 8 is half the first
    assert state["bco_reward_mean"].item() == pytest.approx(delta / 2) and state["bco_reward_count"].item() == 8


@pytest.mark.serial
def test_bcos_running_mean_on_two_processes_is_one_processs_mean_of_both_batches():
    """Each process holds part of a step's pairs (2 and 1, so that the mean of the processes' means differs from
    the mean of the rewards); both keep the running mean one process keeps over all of them, and each pair's loss
    is the one process's."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(workers.bco_two_steps, args=(free_port(), results), nprocs=2, join=True)
        results = dict(results)
    state: dict = {}
    whole = [L.bco_pair_loss(workers.bco_shard(step, None), BETA, state, running_mean=True).tolist()
             for step in range(2)]
    alone: dict = {}  # rank 0's mean of its own rewards: what each process kept before
    for step in range(2):
        L.bco_pair_loss(workers.bco_shard(step, 0), BETA, alone, running_mean=True)
    assert alone["bco_reward_mean"].item() != pytest.approx(state["bco_reward_mean"].item())  # the test can fail
    assert state["bco_reward_count"].item() == 12  # 2 steps x 3 pairs x (chosen, rejected)
    for rank, rows in ((0, slice(0, 2)), (1, slice(2, 3))):
        count, mean, losses = results[rank]
        assert count == 12 and mean == pytest.approx(state["bco_reward_mean"].item(), rel=1e-12)
        assert losses == [pytest.approx(step[rows], rel=1e-6) for step in whole]


def test_dpo_sums_a_training_batch_over_the_processes_but_not_a_held_out_one(monkeypatch):
    """``PairLogps.global_sum`` is the all-reduce on a training step of several processes, else None (one process's
    path unchanged; a held-out batch's metrics do not depend on the number of processes)."""
    from rlhf.algos import dpo
    from rlhf.embedded.tiny_model import TinySpec

    seen = []

    def spy(pairs, beta, state):
        seen.append(pairs.global_sum)
        return L.sigmoid_loss(pairs, beta, state)

    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(loss=spy)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize({"prompt": "abc=", "chosen": "cba", "rejected": "cab"}, policy.tokenizer)])
    algo.loss(policy.model, batch)
    monkeypatch.setattr(dpo, "processes", lambda: 2)
    algo.loss(policy.model, batch)
    algo.evaluate(policy.model, batch)
    assert seen == [None, sum_over_every_process, None]


def test_weighted_sum_is_the_weighted_sum_and_needs_one_weight_per_loss():
    parts = [lambda p, b, s: L.sigmoid_loss(p, b, s), lambda p, b, s: L.hinge_loss(p, b, s)]
    total = L.weighted_sum(pairs(), BETA, {}, losses=parts, weights=[0.8, 0.2])
    want = [0.8 * a + 0.2 * b for a, b in zip(expected("sigmoid"), expected("hinge"))]
    assert total.tolist() == pytest.approx(want, rel=1e-5)
    with pytest.raises(UserError, match="one weight per loss"):
        L.weighted_sum(pairs(), BETA, {}, losses=parts, weights=[1.0])


LOG2 = math.log(2)
AT_INIT = {  # policy = reference: every log-ratio is 0
    "dpo": LOG2, "cdpo": LOG2, "robust": LOG2, "sigmoid_norm": LOG2, "aot": LOG2, "aot_unpaired": LOG2,
    "dpo_js_divergence": LOG2, "dpo_forward_kl": LOG2, "dpo_alpha_divergence": LOG2,
    "hinge": 1.0, "apo_zero": 1.0, "apo_down": 1.0, "nca_pair": 2 * LOG2, "bco_pair": 2 * LOG2,
    "ipo": (1 / (2 * 0.3)) ** 2, "sppo_hard": 2 * (0.5 / 0.3) ** 2, "discopop": (LOG2 + 1) / 2,
    "exo_pair": -LOG2 - 0.5 * math.log((1 - 1e-3) * 1e-3), "mpo": 0.8 * LOG2 + 0.2 * 2 * LOG2,
    # reference-free: no log-ratio is 0; with at_init's logps c (chosen over 2 tokens) and c - 1 (rejected over 3),
    # at the YAMLs' gamma 0.5 (SimPO) and ORPO's odds ratio (its NLL term is not part of algo.loss)
    "simpo": sum(-logsig(0.3 * (c / 2 - (c - 1) / 3) - 0.5) for c in (-3.0, -7.0, -1.5)) / 3,
    "orpo": sum(-0.3 * logsig(log_odds(c / 2) - log_odds((c - 1) / 3)) for c in (-3.0, -7.0, -1.5)) / 3,
}
REFERENCE_FREE = ("simpo", "orpo")
DPO_VARIANTS = sorted(p.stem for p in (CONF / "algo").glob("*.yaml")
                      if compose_config(f"algo={p.stem}").algo._target_ == "rlhf.algos.dpo.DPO")


def test_every_dpo_variant_has_its_starting_value():
    assert set(DPO_VARIANTS) == set(AT_INIT), "add the new variant's value at initialization to AT_INIT"


@pytest.mark.parametrize("algo", DPO_VARIANTS)
def test_loss_at_initialization(algo):
    loss = instantiate(compose_config(f"algo={algo}").algo).loss_fn
    assert loss(at_init(), 0.3, {}).mean().item() == pytest.approx(AT_INIT[algo], rel=1e-6)


def running_bco(pairs, beta, state):
    return L.bco_pair_loss(pairs, beta, state, running_mean=True)


def test_dpo_saves_and_restores_the_loss_state():
    algo = DPO(loss=running_bco)
    algo.loss_state = {}
    algo.loss_fn(pairs(), algo.beta, algo.loss_state)
    saved = algo.state_dict()
    other = DPO(loss=running_bco)
    other.load_state_dict(saved)
    assert other.loss_state.keys() == {"bco_reward_mean", "bco_reward_count"}
    for key, value in algo.loss_state.items():
        assert torch.equal(other.loss_state[key], value)
    assert DPO().state_dict() == {"loss": {}}


def test_evaluation_reads_the_loss_state_but_only_training_updates_it():
    from rlhf.embedded.tiny_model import TinySpec

    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = DPO(loss=running_bco)
    algo.setup(policy.model, policy.tokenizer)
    rows = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}]
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])
    algo.evaluate(policy.model, batch)
    assert algo.loss_state == {}
    algo.loss(policy.model, batch)
    assert algo.loss_state["bco_reward_count"].item() == 2


FORMULA = {"dpo": "sigmoid", "dpo_js_divergence": "js", "dpo_forward_kl": "forward_kl",
           "dpo_alpha_divergence": "alpha_0.5"}  # pair_loss's name of a variant's loss, where it has another


def held_out_loss(variant: str, pc, pr, rc, rr, nc, nr, beta: float, nll: float) -> float:
    """``algo=<variant>``'s loss of one batch of pairs with its YAML's options, in plain floats (lists of the
    pairs' values as :func:`pair_loss` takes them, ``nll``: the NLL term where the variant adds one)."""
    if variant in ("aot", "aot_unpaired"):  # sorted across the batch
        if variant == "aot":  # policy log-odds against reference log-odds
            ours, theirs = sorted(a - b for a, b in zip(pc, pr)), sorted(a - b for a, b in zip(rc, rr))
        else:  # chosen log-ratios against rejected log-ratios
            ours, theirs = sorted(a - b for a, b in zip(pc, rc)), sorted(a - b for a, b in zip(pr, rr))
        return sum(-logsig(beta * (a - b)) for a, b in zip(ours, theirs)) / len(pc)
    pairs = list(zip(pc, pr, rc, rr, nc, nr))
    if variant == "mpo":  # 0.8 sigmoid + 0.2 bco_pair, and the NLL at weight 1
        return sum(0.8 * pair_loss("sigmoid", *v, beta) + 0.2 * pair_loss("bco_pair", *v, beta)
                   for v in pairs) / len(pairs) + nll
    loss = sum(pair_loss(FORMULA.get(variant, variant), *v, beta) for v in pairs) / len(pairs)
    return loss + nll if variant == "orpo" else loss  # ORPO's NLL at weight 1


def test_every_dpo_variant_trains_two_steps(fast_config, tmp_path):
    """`python train.py algo=<each>` on FAST settings, in one process, two steps: the held-out loss the run logs is
    the variant's formula (pair_loss, the paper's / TRL's) on log-probabilities computed here, each held-out pair
    through the final policy and the reference (algo/reference=copy: the initial policy; none for SimPO and ORPO).
    The policy trains far enough from its reference that swapped answers (or a flipped sign) or a reference equal
    to the policy would give another loss."""
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM

    from rlhf.models.tokenizer import byte_tokenizer
    from tests.conftest import fast_initial_model
    from tests.independent_logps import answer_lengths, answer_logps, sequence_nll

    overrides = ["train.max_steps=2", "data.task.num_train=8", "data.task.num_eval=8", "train.eval_at_start=false",
                 "optimizer.lr=1e-2", "scheduler=constant", "scheduler.num_warmup_steps=0"]
    cfg = fast_config(*overrides)
    rows = instantiate(cfg.data.task).rows("eval", ["prompt", "chosen", "rejected"])
    assert len(rows) <= cfg.train.eval_batch_size  # one held-out batch (AOT sorts across it)
    prompts, chosen, rejected = ([r[k] for r in rows] for k in ("prompt", "chosen", "rejected"))
    tokenizer = byte_tokenizer()
    nc, nr = (answer_lengths(tokenizer, prompts, a) for a in (chosen, rejected))
    initial = fast_initial_model()
    rc, rr = (answer_logps(initial, tokenizer, prompts, a) for a in (chosen, rejected))
    for algo in DPO_VARIANTS:
        cfg = fast_config(f"algo={algo}", *overrides)
        metrics = train(cfg)
        assert math.isfinite(metrics["train/loss"]), algo
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
        pc, pr = (answer_logps(trained, tokenizer, prompts, a) for a in (chosen, rejected))
        # the NLL term's tokens: every token of the chosen sequences but the first, or the chosen answers'
        nll = sequence_nll(trained, tokenizer, prompts, chosen) if cfg.algo.nll_on_prompt else -sum(pc) / sum(nc)
        beta = cfg.algo.beta  # SimPO's and ORPO's formulas do not read the reference's values
        expected = held_out_loss(algo, pc, pr, rc, rr, nc, nr, beta, nll)
        assert metrics["eval/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5), algo
        swapped = held_out_loss(algo, pr, pc, rr, rc, nr, nc, beta, nll)  # the NLL term stays the chosen one's
        apart = [abs(swapped - expected)]
        if algo not in REFERENCE_FREE:
            apart.append(abs(held_out_loss(algo, rc, rr, rc, rr, nc, nr, beta, nll) - expected))
        assert min(apart) > 5e-4, f"{algo}: a broken loss would be within {apart} of the right one"  # 50x the tolerance


def test_bco_resumed_from_a_checkpoint_equals_the_uninterrupted_run(fast_config, tmp_path):
    """The running reward mean is in each rank's checkpoint; without it the resumed steps would differ."""
    common = ["algo=bco_pair", "algo.loss.running_mean=true", "train.max_steps=4", "train.save_every_steps=2", "train.eval_at_start=false",
              "data.task.num_train=16", "data.task.num_eval=8"]
    train(fast_config(*common))
    folder = tmp_path / "run" / checkpoint.FOLDER / f"{checkpoint.PREFIX}{2:08d}"
    saved = torch.load(folder / "rank_0.pt", weights_only=True)["algo"]["loss"]
    assert saved["bco_reward_count"].item() == 2 * 4 * 2  # 2 steps x 4 pairs x (chosen, rejected)
    train(compose_config(*FAST, *common, f"resume={folder}", output_dir=tmp_path / "resumed"))
    whole, resumed = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("run", "resumed"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("variant", REFERENCE_FREE)
def test_a_reference_free_variant_is_dpo_without_reference_and_builds_no_second_model(variant):
    named = compose_config(f"algo={variant}").algo
    chosen = compose_config("algo=dpo", f"algo/loss={variant}", "algo/reference=none").algo
    assert named.loss == chosen.loss and named.reference == chosen.reference
    from rlhf.embedded.tiny_model import TinySpec

    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = instantiate(named)
    algo.setup(policy.model, policy.tokenizer)
    assert algo.frozen == {}


@pytest.mark.parametrize("variant", [v for v in DPO_VARIANTS if v not in REFERENCE_FREE])
def test_a_variant_is_dpo_with_its_own_loss_option(variant):
    """algo=<variant> takes beta, lengths, dropout and the reference from algo=dpo and its loss from algo/loss."""
    named, chosen = compose_config(f"algo={variant}").algo, compose_config("algo=dpo", f"algo/loss={variant if variant != 'dpo' else 'sigmoid'}").algo
    assert named.loss == chosen.loss and named.reference == chosen.reference and named.beta == chosen.beta
