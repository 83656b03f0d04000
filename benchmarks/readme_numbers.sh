#!/usr/bin/env bash
# Regenerate the measured numbers of the README and of the Results pages under docs/ (a few minutes on 2 CPU cores). Each part prints its table.
#   bash benchmarks/readme_numbers.sh [main] [optimizers] [dpo_search] [sft_dpo] [objectives] [reward] [hardware] [grpo] [rloo] [reinforce_pp] [ppo] [iterative_sft] [generation] [ddp_speed] [eval_cost] [frontier] [speed]
#   (default: all but speed, the 47-minute benchmark against TRL; the online ones run experiment=<part>_reverse over seeds 0-2)
# Outputs go to outputs/readme/. Results depend on the seed and the CPU; the main job is measured over seeds.
# EXTRA adds overrides to every run (outputs then go to outputs/readme-extra/, docs/ is left alone), e.g. the
# float32 figures on a CPU with bf16 instructions: EXTRA=hardware.mixed_precision=no bash benchmarks/readme_numbers.sh main
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
EXTRA=${EXTRA:-}
OUT=outputs/readme${EXTRA:+-extra}
parts=${*:-main optimizers dpo_search sft_dpo objectives reward hardware grpo rloo reinforce_pp ppo iterative_sft generation ddp_speed eval_cost frontier}
for part in $parts; do
  case $part in
    main)  # "What the main job shows": the README's main command over seeds 0-4
      rm -rf outputs/seeds/readme-main${EXTRA:+-extra}
      $PY scripts/seeds.py --seeds 0-4 --markdown --name readme-main${EXTRA:+-extra} -- algo=dpo optimizer=lion $EXTRA
      # the curves of the five seeds (mean and band): docs/results/main_job.png
      $PY scripts/compare_runs.py outputs/seeds/readme-main${EXTRA:+-extra} --seeds \
        --metrics eval/rewards/accuracies eval/exact_match --out $OUT/main >/dev/null
      if [ -z "$EXTRA" ]; then cp $OUT/main/report.png docs/results/main_job.png; fi ;;
    optimizers)  # "A fair optimizer comparison": each optimizer at its searched learning rate, 3 seeds (~5 min)
      rm -rf $OUT/optimizers
      /usr/bin/time -f "wall %e s" $PY train.py $EXTRA experiment=optimizer_comparison hydra.sweep.dir=$OUT/optimizers 2>&1 \
        | grep -E "^wall|points (failed|finished)" || true
      cat $OUT/optimizers/selection.md
      $PY scripts/compare_runs.py $OUT/optimizers/confirm --seeds --metrics eval/exact_match eval/rewards/accuracies \
        --out $OUT/optimizers/confirm 2>/dev/null
      if [ -z "$EXTRA" ]; then
        cp $OUT/optimizers/confirm/report.png docs/optimizer_comparison.png
        cp $OUT/optimizers/search/objective.png docs/optimizer_search.png
      fi ;;
    dpo_search)  # "Hyperparameter search": experiment=dpo_search (seed 0), then its best settings on the held-out rows
      rm -rf $OUT/dpo_search $OUT/dpo_search_final
      /usr/bin/time -f "search wall %e s" $PY train.py $EXTRA experiment=dpo_search hydra.sweep.dir=$OUT/dpo_search 2>&1 \
        | grep -E "wall|points (failed|finished)" || true
      cat $OUT/dpo_search/optimization_results.yaml
      best=$($PY -c "import yaml,sys; r=yaml.safe_load(open(sys.argv[1])); print(' '.join(f'{k}={v}' for k, v in r['best_params'].items()))" $OUT/dpo_search/optimization_results.yaml)
      $PY train.py $EXTRA -m algo=dpo $best data.validation_size=0.5 data.evaluate_on=held_out seed=1,2,3 train.max_steps=100 \
        train.save_every_steps=0 train.save_final=false hydra.sweep.dir=$OUT/dpo_search_final >/dev/null 2>&1
      $PY scripts/compare_runs.py $OUT/dpo_search_final --seeds --metrics eval/exact_match \
        --out $OUT/dpo_search_final 2>/dev/null ;;
    sft_dpo)  # "SFT, then DPO from the SFT model": SFT, plain DPO and DPO + NLL from it, seed 0
      rm -rf $OUT/sft $OUT/dpo $OUT/rpo
      $PY train.py $EXTRA algo=sft hydra.run.dir=$OUT/sft >/dev/null 2>&1
      $PY train.py $EXTRA algo=dpo model.name_or_path=$OUT/sft/final hydra.run.dir=$OUT/dpo >/dev/null 2>&1
      $PY train.py $EXTRA algo=dpo model.name_or_path=$OUT/sft/final algo.nll_weight=1.0 hydra.run.dir=$OUT/rpo >/dev/null 2>&1
      for run in sft dpo rpo; do
        $PY - "$OUT/$run" <<'PY'
import sys
from rlhf.sweeps.results import Run
run = Run(sys.argv[1])
evals = [r for r in run.metrics if "eval/exact_match" in r]
first, last = evals[0], evals[-1]
keys = [k for k in ("eval/rewards/accuracies", "eval/exact_match", "eval/logps/chosen") if k in last]
print(f"{run.path.name:4s}", "  ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys))
PY
      done ;;
    objectives)  # "Preference objectives": each objective 100 steps from the warm start, seed 0, held-out exact match
      for name in dpo simpo orpo kto; do
        rm -rf $OUT/objective-$name
        $PY train.py $EXTRA algo=$name train.max_steps=100 train.eval_every_steps=100 train.save_every_steps=0 \
          train.save_final=false hydra.run.dir=$OUT/objective-$name >/dev/null 2>&1
        $PY - "$OUT/objective-$name" <<'PY'
import sys
from rlhf.sweeps.results import Run
run = Run(sys.argv[1])
evals = [r for r in run.metrics if "eval/exact_match" in r]
print(f"{run.path.name}: eval/exact_match {evals[0]['eval/exact_match']:.3f} -> {evals[-1]['eval/exact_match']:.3f}"
      + (f"; kl {evals[-1]['eval/kl']:.3f}" if "eval/kl" in evals[-1] else ""))
PY
      done ;;
    reward)  # "Reward models": algo=reward over seeds 0-2, one thread
      rm -rf outputs/seeds/readme-reward${EXTRA:+-extra}
      OMP_NUM_THREADS=1 $PY scripts/seeds.py --seeds 0-2 --markdown --metrics eval/accuracy eval/margin \
        --gate eval/accuracy=0.8 --name readme-reward${EXTRA:+-extra} -- algo=reward $EXTRA ;;
    hardware)  # "Hardware": the main job on 1 and on 2 CPU processes at the same global batch (32), seed 0
      rm -rf $OUT/hw-cpu $OUT/hw-cpu_ddp
      for hw in cpu cpu_ddp; do
        start=$SECONDS
        $PY train.py $EXTRA algo=dpo optimizer=lion hardware=$hw train.global_batch_size=32 train.per_device_batch_size=$([ $hw = cpu ] && echo 32 || echo 16) \
          hydra.run.dir=$OUT/hw-$hw >/dev/null 2>&1
        echo "$hw: $(grep -o 'hardware: .*' $OUT/hw-$hw/train.log | head -1)"
        echo "     $(grep -o 'global batch .*' $OUT/hw-$hw/train.log | head -1); $((SECONDS - start)) s in all"
        $PY scripts/check_run.py $OUT/hw-$hw --min eval/rewards/accuracies=0 --min-of-start eval/exact_match=-1 | sed 's/^/     /'
      done ;;
    grpo|rloo|reinforce_pp|ppo|iterative_sft)  # "Online RL": experiment=<algo>_reverse from the embedded SFT warm start, seeds 0-2
      for seed in 0 1 2; do
        rm -rf $OUT/$part-$seed
        start=$SECONDS
        $PY train.py $EXTRA experiment=${part}_reverse seed=$seed train.save_every_steps=0 \
          hydra.run.dir=$OUT/$part-$seed >/dev/null 2>&1
        $PY - "$OUT/$part-$seed" $((SECONDS - start)) <<'PY'
import sys
from rlhf.sweeps.results import Run
run = Run(sys.argv[1])
evals = [(r["step"], r["eval/reward"]) for r in run.metrics if "eval/reward" in r]
kept = [r["train/kept_fraction"] for r in run.metrics if "train/kept_fraction" in r]
print(f"{run.path.name}: eval/reward (greedy exact match, 512 held-out prompts) "
      + " -> ".join(f"{v:.3f} @{s}" for s, v in evals)
      + (f"; kept_fraction {kept[0]:.3f} -> {kept[-1]:.3f}" if kept else "") + f"; {sys.argv[2]} s")
PY
      done
      echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" ;;
    generation)  # "Online RL", Hardware: what sampling costs per step on 1 process and on 2 (DDP, FSDP2, ZeRO-3), 16 prompts x 8 per step
      for hw in cpu cpu_ddp fsdp zero3; do
        rm -rf $OUT/generation-$hw
        $PY train.py $EXTRA experiment=grpo_reverse hardware=$hw train.per_device_batch_size=$([ $hw = cpu ] && echo 16 || echo 8) train.max_steps=40 \
          train.eval_at_start=false train.save_every_steps=0 train.save_final=false \
          hydra.run.dir=$OUT/generation-$hw >/dev/null 2>&1
        $PY - "$OUT/generation-$hw" <<'PY'
import sys
from rlhf.sweeps.results import Run
run = Run(sys.argv[1])
windows = [r for r in run.metrics if "perf/generation_time_s" in r][1:]  # the first window holds the start-up
gen = sum(r["perf/generation_time_s"] for r in windows) / len(windows)
step = sum(r["perf/step_time_s"] for r in windows) / len(windows)
print(f"{run.path.name:22s} sampling {gen:.3f} s of a {step:.3f} s step ({gen / step:.0%}), steps 11-40")
PY
      done
      echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)" ;;
    frontier)  # "Which objective?": experiment=objective_frontier (7 objectives x 3 strengths x 2 seeds, 22.5 min), its
      # figure into docs/evaluation/, and the table of each point's reward and KL with their ranges over the seeds
      rm -rf $OUT/frontier
      /usr/bin/time -f "wall %e s" $PY train.py $EXTRA experiment=objective_frontier hydra.sweep.dir=$OUT/frontier 2>&1 \
        | grep -E "^wall|points (failed|finished)" || true
      $PY benchmarks/frontier_numbers.py $OUT/frontier --json $OUT/frontier/frontier.json
      if [ -z "$EXTRA" ]; then
        mkdir -p docs/evaluation && cp $OUT/frontier/confirm/frontier.png docs/evaluation/objective_frontier.png
      fi ;;
    speed)  # "Speed against TRL" (docs/results/speed.md): the whole CPU benchmark, its table and its bar chart
      # (docs/bench.md, docs/bench.png; ~47 minutes on 2 idle cores; not part of the default list)
      if [ -z "$EXTRA" ]; then $PY benchmarks/bench.py
      else ours=(); for o in $EXTRA; do ours+=(--ours "$o"); done; $PY benchmarks/bench.py "${ours[@]}" --out $OUT/speed; fi ;;
    eval_cost)  # "One evaluation for every objective": the main job's wall time without and with eval=generate
      # (its defaults: 64 prompts x 4 samples, greedy and the reference's greedy, at each of the 7 evaluations),
      # interleaved for ROUNDS rounds (default 2), seed 0
      rm -rf $OUT/eval_cost-*
      for round in $(seq 1 ${ROUNDS:-2}); do
        for ev in none generate; do
          $PY train.py $EXTRA algo=dpo optimizer=lion eval=$ev hydra.run.dir=$OUT/eval_cost-$ev-$round >/dev/null 2>&1
        done
      done
      $PY - $OUT/eval_cost-none-* $OUT/eval_cost-generate-* <<'PY'
import statistics
import sys
from rlhf.sweeps.report import log_lines, wall_time_s
from rlhf.sweeps.results import Run
seconds = {"none": [], "generate": []}
for folder in sys.argv[1:]:
    run = Run(folder)
    option = run.path.name.removeprefix("eval_cost-").rsplit("-", 1)[0]
    seconds[option].append(wall_time_s(run, log_lines(run)))
    final = run.final or {}
    print(f"{run.path.name:22s} {seconds[option][-1]:.1f} s; eval/gen/reward {final.get('eval/gen/reward', float('nan')):.4f}, "
          f"eval/gen/kl {final.get('eval/gen/kl', float('nan')):.3f}")
none, generate = statistics.median(seconds["none"]), statistics.median(seconds["generate"])
print(f"median wall time: {none:.1f} s without, {generate:.1f} s with eval=generate: "
      f"the evaluation takes {(generate - none) / generate:.0%} of the run")
print("\n| step | greedy reward | win rate | sampled reward | length | KL (nats) |\n|---:|---:|---:|---:|---:|---:|")
for line in Run(sorted(f for f in sys.argv[1:] if "generate" in f)[0]).metrics:  # what it shows, over training
    if "eval/gen/kl" in line:
        print(f"| {line['step']} | {line['eval/gen/greedy_reward']:.3f} | {line['eval/gen/win_rate']:.3f} | "
              f"{line['eval/gen/reward']:.3f} | {line['eval/gen/length']:.1f} | {line['eval/gen/kl']:.2f} "
              f"± {line['eval/gen/kl_stderr']:.2f} |")
PY
      echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)" ;;
    ddp_speed)  # "Speed": steady-state samples/s of the main job on 1 process x 2 threads and 2 processes x 1 thread,
      # interleaved for ROUNDS rounds (default 3: a slow minute falls on both), each round's means, then the medians
      rm -rf $OUT/ddp_speed-*
      for round in $(seq 1 ${ROUNDS:-3}); do
        for hw in cpu cpu_ddp; do
          $PY train.py $EXTRA algo=dpo optimizer=lion hardware=$hw train.global_batch_size=32 \
            train.per_device_batch_size=$([ $hw = cpu ] && echo 32 || echo 16) train.max_steps=150 train.eval_at_start=false \
            train.eval_every_steps=0 train.save_every_steps=0 train.save_final=false hydra.run.dir=$OUT/ddp_speed-$hw-$round >/dev/null 2>&1
        done
      done
      $PY - $OUT/ddp_speed-cpu-* $OUT/ddp_speed-cpu_ddp-* <<'PY'
import statistics
import sys
from rlhf.sweeps.results import Run
means = {"cpu": [], "cpu_ddp": []}
for folder in sys.argv[1:]:
    run = Run(folder)
    rates = [r["perf/samples_per_s"] for r in run.metrics if "perf/samples_per_s" in r][1:]  # the first window: start-up
    hw = run.path.name.removeprefix("ddp_speed-").rsplit("-", 1)[0]
    means[hw].append(sum(rates) / len(rates))
    print(f"{run.path.name:22s} samples/s over steps 11-150: mean {means[hw][-1]:.0f}, {min(rates):.0f}-{max(rates):.0f}")
one, two = statistics.median(means["cpu"]), statistics.median(means["cpu_ddp"])
print(f"median of the rounds' means: 1 process x 2 threads {one:.0f}, 2 processes x 1 thread {two:.0f}: {two / one:.2f}x")
PY
      echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)" ;;
    *) echo "unknown part: $part (main, optimizers, dpo_search, sft_dpo, objectives, reward, hardware, grpo, rloo, reinforce_pp, ppo, iterative_sft, generation, ddp_speed)" >&2; exit 2 ;;
  esac
done
