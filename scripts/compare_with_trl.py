"""Check our DPO numbers against TRL's DPOTrainer on the same model and data (TRL is not a dependency).

    pip install trl            # in any environment that has rlhf installed
    python scripts/compare_with_trl.py [--rows 64]

On the embedded default (the warm-started tiny model, the reverse task's held-out pairs), it evaluates the
initial policy with both implementations and prints the metrics side by side: ``logps/chosen`` and
``logps/rejected`` must agree (same tokenization: prompt and completion tokenized separately, EOS appended,
log-probabilities summed over completion tokens). Exits 1 if they differ by more than 1e-3 nats.
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
from rlhf.models.reference import FrozenCopy
from rlhf.models.tiny import TinySpec


class _CPU:
    device = torch.device("cpu")


def ours(policy, rows) -> dict[str, float]:
    algo = DPO(beta=0.1, reference=FrozenCopy())
    model = copy.deepcopy(policy.model)
    algo.setup(model, policy.tokenizer, _CPU())
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])
    with torch.no_grad():
        _, metrics = algo.loss(model.eval(), batch)
    return {k: float(v) for k, v in metrics.items()}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="held-out pairs to evaluate")
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
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
