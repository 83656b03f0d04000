"""Expert iteration by hand with the step() API: generate, keep what the reward accepts, train on it, repeat.

    python scripts/iterative_sft.py                        # the embedded task from its SFT warm start, seed 0
    python scripts/iterative_sft.py --seed 1 --rounds 12   # another seed, more rounds
    python scripts/iterative_sft.py -- optimizer.lr=3e-4   # any config overrides after --

Each round samples ``--samples`` completions for each of ``--prompts`` training prompts of the embedded task
(``model.generate``, left padding, temperature sampling with ``top_k=0, top_p=1.0``), keeps those whose exact-match
reward is 1 (:meth:`rlhf.data.tasks.ReverseTask.reward`), and trains on them with ``trainer.step(texts=prompts,
texts_labels=completions)``, ``--batch`` kept rows per optimizer step. The held-out exact match is printed before
and after (the loop's evaluation: greedy decoding is right at every answer position, EOS included).
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch
from hydra.utils import instantiate

from rlhf import StepTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's sampling and the prompts drawn")
    parser.add_argument("--rounds", type=int, default=12, help="generate-filter-train rounds")
    parser.add_argument("--prompts", type=int, default=128, help="training prompts per round")
    parser.add_argument("--samples", type=int, default=4, help="completions sampled per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--batch", type=int, default=32, help="kept rows per optimizer step")
    parser.add_argument("--run-dir", default=None, help="a run folder for metrics.jsonl and final/ (default: none)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. optimizer.lr=3e-4")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    overrides = ["algo=sft", "hardware=cpu", f"seed={args.seed}", "scheduler=constant",
                 "scheduler.num_warmup_steps=0", "optimizer.lr=1e-4", f"train.per_device_batch_size={args.batch}",
                 *args.overrides]
    start = time.perf_counter()
    with StepTrainer(overrides, run_dir=args.run_dir) as trainer:
        task = instantiate(trainer.cfg.data.task)
        words, rng = task.words("train"), random.Random(args.seed)
        before = trainer.evaluate()["eval/exact_match"]
        print(f"held-out exact match before: {before:.3f}")
        for round_ in range(1, args.rounds + 1):
            prompts = [task.prompt(w) for w in rng.sample(words, args.prompts)]
            completions = trainer.generate(prompts, max_new_tokens=task.max_chars + 1, temperature=args.temperature,
                                           top_k=0, top_p=1.0, num_return_sequences=args.samples)
            repeated = [p for p in prompts for _ in range(args.samples)]
            rewards = task.reward(repeated, completions)
            kept = [(p, c) for p, c, r in zip(repeated, completions, rewards) if r == 1.0]
            losses = []
            for i in range(0, len(kept), args.batch):  # a short last chunk is still one step
                chunk = kept[i:i + args.batch]
                stats = trainer.step(texts=[p for p, _ in chunk], texts_labels=[c for _, c in chunk])
                losses.append(stats["train/loss"])
            loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
            print(f"round {round_}: sampled reward {sum(rewards) / len(rewards):.3f}, kept {len(kept)}, "
                  f"{len(losses)} step(s), train/loss {loss}")
        after = trainer.evaluate()["eval/exact_match"]
        print(f"held-out exact match after:  {after:.3f}  (before {before:.3f}; {trainer.global_step} steps, "
              f"{time.perf_counter() - start:.0f} s, {torch.get_num_threads()} thread(s))")
        if args.run_dir:
            print(f"model saved to {trainer.save()}")


if __name__ == "__main__":
    main()
