"""Check our DPO numbers against TRL's DPOTrainer on the same model and data (TRL is not a dependency).

    pip install trl            # in any environment that has rlhf installed
    python benchmarks/compare_with_trl.py [--rows 64] [--steps 100]

On the embedded default (the warm-started tiny model, the reverse task's held-out pairs), it evaluates the
initial policy with both implementations and prints the metrics side by side: ``logps/chosen`` and
``logps/rejected`` must agree (the same tokenization, TRL 1.16's: rlhf/data/encoding.py; log-probabilities
summed over completion tokens). Exits 1 if they differ by more than 1e-3 nats.
With ``--losses`` it checks every DPO loss variant that TRL also has (``conf/algo/<name>.yaml`` against the
``DPOConfig`` fields of :data:`TRL_LOSSES`): the first-step loss of both on the same held-out batch, with a
reference model that differs from the policy (the policy's weights plus seeded noise); exits 1 if any differs by
1e-4 or more. TRL runs in float32 here (``bf16=False``: its default bf16 autocast moves the reference's
log-probabilities by ~1e-3 nats). Measured with TRL 1.16.0 on 16 pairs: all 18 variants agree to 1.2e-7 or better.
It also checks the objectives that TRL has in other trainers (:data:`TRL_OTHERS`): ``algo=simpo`` against
``trl.experimental.cpo.CPOTrainer`` (``loss_type="simpo"``), ``algo=orpo`` against ``trl.experimental.orpo.ORPOTrainer``
and ``algo=kto`` against ``trl.KTOTrainer``, on the same token ids: CPO and ORPO put BOS before every prompt, so our
rows get it in their prompt text; KTO gets the pairs and unpairs them (all chosen rows, then all rejected ones, one
evaluation batch that is also its KL rotation's batch), ours the same unpaired rows in the same order.
With ``--steps N`` it also trains both for N DPO steps (AdamW, lr 1e-4, 32 pairs per step, no evaluation, no
checkpoints) and prints seconds per step and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import torch

from rlhf.algos.dpo import DPO
from rlhf.data.tasks import ReverseTask
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy


def ours(policy, rows) -> dict[str, float]:
    algo = DPO(beta=0.1, reference=FrozenCopy())
    model = copy.deepcopy(policy.model)
    algo.setup(model, policy.tokenizer)
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])
    with torch.no_grad():
        _, metrics = algo.loss(model.eval(), batch)
    return {k: float(v) for k, v in metrics.items()}


# conf/algo option -> the DPOConfig fields that give TRL 1.16 the same loss.
TRL_LOSSES = {
    "dpo": {"loss_type": ["sigmoid"]},
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "ipo": {"loss_type": ["ipo"]},
    "hinge": {"loss_type": ["hinge"]},
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    "nca_pair": {"loss_type": ["nca_pair"]},
    "bco_pair": {"loss_type": ["bco_pair"]},
    "sppo_hard": {"loss_type": ["sppo_hard"]},
    "aot": {"loss_type": ["aot"]},
    "aot_unpaired": {"loss_type": ["aot_unpaired"]},
    "apo_zero": {"loss_type": ["apo_zero"]},
    "apo_down": {"loss_type": ["apo_down"]},
    "discopop": {"loss_type": ["discopop"], "discopop_tau": 0.05},
    "sigmoid_norm": {"loss_type": ["sigmoid_norm"]},
    "dpo_js_divergence": {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
    "dpo_forward_kl": {"loss_type": ["sigmoid"], "f_divergence_type": "forward_kl"},
    "dpo_alpha_divergence": {"loss_type": ["sigmoid"], "f_divergence_type": "alpha_divergence",
                             "f_alpha_divergence_coef": 0.5},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
}


def perturbed(model, scale: float = 0.02):
    """A reference that differs from the policy: a copy with seeded noise on every weight."""
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return reference.eval()


def our_loss(option: str, policy, reference, rows) -> float:
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        algo = instantiate(compose("config", overrides=[f"algo={option}", "algo.beta=0.1"]).algo)
    model = copy.deepcopy(policy.model)
    algo.setup(model, policy.tokenizer)
    algo.frozen = {"reference": reference}
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])
    with torch.no_grad():
        return float(algo.loss(model.eval(), batch)[0])  # a training step's loss (its state updated), not evaluate


# conf/algo option -> (the TRL trainer, its config fields for the same loss, how our rows are made from TRL's pairs,
# whether policy and reference swap roles: KTO's KL estimate, floored at 0, is 0 with the noisy reference, and the
# comparison would not see it; with the noisy model as the policy it is about 2.5).
def _with_bos(policy, rows):
    """CPO and ORPO put BOS before every prompt (TRL's add_bos_token_if_needed); the same token ids for ours."""
    return [{**row, "prompt": policy.tokenizer.bos_token + row["prompt"]} for row in rows]


def _unpaired(policy, rows):
    """TRL's unpair_preference_dataset order on one map batch: every chosen row, then every rejected row."""
    return ([{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
            + [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in rows])


TRL_OTHERS = {
    "simpo": ("trl.experimental.cpo:CPO", {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
              _with_bos, False),
    "simpo_cpo_alpha": ("trl.experimental.cpo:CPO", {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5,
                                                     "cpo_alpha": 1.0}, _with_bos, False),
    "orpo": ("trl.experimental.orpo:ORPO", {"beta": 0.1}, _with_bos, False),
    "kto": ("trl:KTO", {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}, _unpaired, True),
}
OUR_OVERRIDES = {"simpo_cpo_alpha": ["algo=simpo", "algo.nll_weight=1.0"]}  # else algo=<option>


def our_other_loss(option: str, policy, model, reference, rows) -> float:
    """The first-step loss of ``algo=<option>`` with its own beta (the YAML's; TRL_OTHERS gives TRL the same)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        algo = instantiate(compose("config", overrides=OUR_OVERRIDES.get(option, [f"algo={option}"])).algo)
    model = copy.deepcopy(model)
    algo.setup(model, policy.tokenizer)
    if algo.frozen:  # reference-free objectives have none
        algo.frozen = {"reference": reference}
    ours = TRL_OTHERS[option][2](policy, rows)
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in ours])
    with torch.no_grad():
        return float(algo.loss(model.eval(), batch)[0])


def trl_other_loss(option: str, policy, model, reference, rows) -> float:
    import importlib

    from datasets import Dataset

    where, fields = TRL_OTHERS[option][:2]
    module, name = where.split(":")
    trl_module = importlib.import_module(module)
    config, trainer_class = getattr(trl_module, f"{name}Config"), getattr(trl_module, f"{name}Trainer")
    with tempfile.TemporaryDirectory() as out:
        args = config(output_dir=out, per_device_eval_batch_size=2 * len(rows), per_device_train_batch_size=2 * len(rows),
                      report_to=[], use_cpu=True, bf16=False, **fields)
        kwargs = {"ref_model": copy.deepcopy(reference)} if name == "KTO" else {}
        trainer = trainer_class(model=copy.deepcopy(model), args=args, processing_class=policy.tokenizer,
                                train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows), **kwargs)
        return trainer.evaluate()["eval_loss"]


def trl_loss(policy, reference, rows, fields: dict) -> float:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_eval_batch_size=len(rows), report_to=[], beta=0.1,
                         use_cpu=True, max_length=None, bf16=False, **fields)
        trainer = DPOTrainer(model=copy.deepcopy(policy.model), ref_model=copy.deepcopy(reference), args=args,
                             processing_class=policy.tokenizer, train_dataset=Dataset.from_list(rows),
                             eval_dataset=Dataset.from_list(rows))
        return trainer.evaluate()["eval_loss"]


def compare_losses(policy, rows, only: set[str] | None = None) -> bool:
    reference = perturbed(policy.model)
    print(f"{'algo=':<24}{'rlhf':>12}{'TRL':>12}{'|diff|':>12}")
    worst = 0.0
    for option, fields in TRL_LOSSES.items():
        if only and option not in only:
            continue
        a, b = our_loss(option, policy, reference, rows), trl_loss(policy, reference, rows, fields)
        worst = max(worst, abs(a - b))
        print(f"{option:<24}{a:>12.6f}{b:>12.6f}{abs(a - b):>12.2e}")
    for option in TRL_OTHERS:
        if only and option not in only:
            continue
        models = (reference, policy.model) if TRL_OTHERS[option][3] else (policy.model, reference)
        a, b = our_other_loss(option, policy, *models, rows), trl_other_loss(option, policy, *models, rows)
        worst = max(worst, abs(a - b))
        print(f"{option:<24}{a:>12.6f}{b:>12.6f}{abs(a - b):>12.2e}")
    print("losses agree" if worst < 1e-4 else "losses DIFFER")
    return worst < 1e-4


def trl_metrics(policy, rows) -> dict[str, float]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_eval_batch_size=len(rows), report_to=[], beta=0.1,
                         use_cpu=True, max_length=None, logging_steps=1)
        trainer = DPOTrainer(model=copy.deepcopy(policy.model), args=args, processing_class=policy.tokenizer,
                             train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows))
        result = trainer.evaluate()
    return {k.removeprefix("eval_"): v for k, v in result.items()}


def time_ours(steps: int) -> float:
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from rlhf import train

    conf = Path(__file__).resolve().parents[1] / "conf"
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[
            "hardware=cpu", f"train.max_steps={steps}", "train.eval_at_start=false", f"train.eval_every_steps={steps}",
            "train.save_final=false", f"train.log_every_steps={steps}", "scheduler=constant", "optimizer.weight_decay=0.0",
            f"output_dir={out}"])
        return train(cfg)["perf/step_time_s"]  # the loop's own timing of the steps, setup excluded


def time_trl(policy, steps: int, **overrides) -> float:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = ReverseTask().rows("train", ("prompt", "chosen", "rejected"))
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=32, learning_rate=1e-4, max_steps=steps,
                         lr_scheduler_type="constant", warmup_steps=0, report_to=[], beta=0.1, use_cpu=True,
                         max_length=None, logging_steps=steps, save_strategy="no", eval_strategy="no",
                         disable_tqdm=True, **overrides)
        trainer = DPOTrainer(model=copy.deepcopy(policy.model), args=args, processing_class=policy.tokenizer,
                             train_dataset=Dataset.from_list(rows))
        start = time.perf_counter()  # after the constructor, which tokenizes and builds the reference
        trainer.train()
        return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="held-out pairs to evaluate")
    parser.add_argument("--losses", action="store_true", help="compare every DPO loss variant TRL also has")
    parser.add_argument("--only", default="", help="with --losses: only these options, comma-separated")
    parser.add_argument("--steps", type=int, default=0, help="also time N training steps of each (0: skip)")
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        print("TRL is not installed: pip install trl", file=sys.stderr)
        return 2
    task = ReverseTask(num_eval=args.rows)
    rows = task.rows("eval", ("prompt", "chosen", "rejected"))
    policy = TinySpec(task=task).build()
    start = time.perf_counter()
    a = ours(policy, rows)
    b = trl_metrics(policy, rows)
    print(f"rlhf vs TRL {trl.__version__} on {len(rows)} held-out pairs, initial policy ({time.perf_counter() - start:.1f} s)")
    print(f"{'metric':<22}{'rlhf':>12}{'TRL':>12}{'|diff|':>12}")
    worst = 0.0
    for key in ["logps/chosen", "logps/rejected", "rewards/chosen", "rewards/margins", "loss"]:
        if key in b:
            diff = abs(a[key] - b[key])
            worst = max(worst, diff) if key.startswith("logps") else worst
            print(f"{key:<22}{a[key]:>12.5f}{b[key]:>12.5f}{diff:>12.2e}")
    print("agree" if worst < 1e-3 else "DIFFER")
    losses_agree = compare_losses(policy, rows, set(filter(None, args.only.split(",")))) if args.losses else True
    if args.steps:
        ours_s = time_ours(args.steps)
        same_s = time_trl(policy, args.steps, bf16=False, gradient_checkpointing=False)
        default_s = time_trl(policy, args.steps)
        print(f"seconds per DPO step over {args.steps} steps (training loop only; tokenizing and model setup excluded):")
        print(f"  rlhf (fp32)                                      {ours_s:.4f}")
        print(f"  TRL, fp32 and no gradient checkpointing (same)   {same_s:.4f}  ({same_s / ours_s:.2f}x rlhf)")
        print(f"  TRL, its defaults (bf16 autocast, checkpointing) {default_s:.4f}  ({default_s / ours_s:.2f}x rlhf)")
    return 0 if worst < 1e-3 and losses_agree else 1


if __name__ == "__main__":
    sys.exit(main())
