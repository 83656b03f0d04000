#!/usr/bin/env bash
# CI: `python train.py -m launcher=slurm ...` against a real single-node Slurm cluster started here (root, Debian).
#
#   bash scripts/ci_slurm.sh          # about 2 minutes on 2 CPUs; exit status 1 with the reason on any failure
#
# Starts Slurm with accounting (slurmdbd + MariaDB, so that sacct works: scripts/slurm/start.sh), then runs three
# sweeps at once, one per hardware option (a job's CPUs and GPUs are derived from the hardware, once per -m run):
#   optimizers: optimizer=sgd,adam8bit,lion, one process each (3 jobs, 1 CPU each)
#   cpu_ddp:    hardware=cpu_ddp, two processes started by the job itself (1 job, 2 CPUs)
#   search:     a 2-trial Optuna search of the learning rate (hydra/sweeper=search, the [search] extra; 2 jobs at once)
#   select:     select_then_confirm: 2 learning rates scored on validation rows, then the better one on the held-out
#               rows with another seed (2 jobs, then 1)
# Each is a ~20-step run of the embedded default with a small eval. Then it checks that every Slurm job ended
# COMPLETED (sacct) and that every run folder has metrics.jsonl up to the last step, summary.json and final/ (a
# Slurm job is COMPLETED even when the run inside failed: Hydra hands the error to the sweep, whose exit status is
# checked too), prints a table and the timings. Last, the requeue test: a run under a short time limit gets USR2
# mid-training, checkpoints, is requeued by submitit and resumes, and must end bit-identical (parameters and
# metrics) to an uninterrupted run of the same command; and the same on 2 processes (hardware=cpu_ddp), where Slurm's
# USR2 reaches the job's process and both ranks at once, against the cpu_ddp sweep job. And a warning while a job is
# still starting: USR2 1 s after it is RUNNING, every CPU busy, must requeue it (tests/launch/test_submitit_job.py).
# Then it stops the cluster. Every final state is read from sacct once the accounting has recorded it (it lags the
# jobs; rlhf/launch/slurm_accounting.py), and sacct lags on purpose here (scripts/slurm/lagging/sacct) so that the
# checks are seen to wait.
#   SLURM_CI_SACCT_LAG_S  seconds sacct hides each job's recorded end from every reader (default 3; 0: none)
#   SLURM_CI_DIR  where the sweeps go (default outputs/ci-slurm; emptied first)
#   RLHF_CACHE    the tiny model's warm-start cache, inherited by the jobs (default .ci-cache, as .ci/run)
#   SLURM_CI_KEEP=1  leave the cluster running at the end (it is stopped by default, even one that was running)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export RLHF_CACHE=${RLHF_CACHE:-$PWD/.ci-cache}
OUT=${SLURM_CI_DIR:-outputs/ci-slurm}
PY=.venv/bin/python
STEPS=20
RUN=(train.max_steps=$STEPS train.per_device_batch_size=8 train.eval_batch_size=32 data.max_train_rows=1000
     data.task.num_eval=32 train.eval_at_start=false train.eval_every_steps=0 train.log_every_steps=10)
# Jobs take well under a minute. No requeue in these sweeps: a job that hits the limit is a failure here (the
# requeue test below gives its job a short limit on purpose).
LAUNCH=(launcher=slurm hydra.launcher.timeout_min=5 hydra.launcher.signal_delay_s=30 hydra.launcher.max_num_timeout=0)

fail() { echo "ci_slurm: FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
T0=$(now)
stop() {
  if [[ ${SLURM_CI_KEEP:-0} == 1 ]]; then echo "ci_slurm: SLURM_CI_KEEP=1: the cluster keeps running (scripts/slurm/stop.sh)"; return; fi
  local t; t=$(now); bash scripts/slurm/stop.sh --quiet; echo "ci_slurm: cluster stopped in $(since "$t") s"
}
trap stop EXIT

# While sweep $1 runs: release requeued jobs (Slurm holds them 121 s, Reason=BeginTime) and, once the first
# attempt has logged step 10, send USR2 through Slurm to the running job (once). Slurm's own USR2 comes 30-90 s into
# an attempt, after these short runs may have ended: scancel --signal=USR2 is the same signal, delivered the same way
# (to every process of the job step: the job's own process and the ranks it started).
# A job released in the same second as its requeue fails to start ("Job credential revoked": Slurm compares the
# times in whole seconds): release it 3 s after it is first seen held.
watch_and_signal() {
  local sweep=$1 folder=$2 signalled=0 metrics id
  local -A held=()
  while kill -0 "$sweep" 2>/dev/null; do
    for id in $(squeue -h -o "%i %r" | awk '$2 == "BeginTime" {print $1}'); do
      [[ -n ${held[$id]:-} ]] || held[$id]=$SECONDS
      if (( SECONDS - held[$id] >= 3 )); then
        scontrol update JobId="$id" StartTime=now && echo "released requeued job $id" && unset "held[$id]"
      fi
    done
    metrics=$(ls "$folder"/*/metrics.jsonl 2>/dev/null | head -n 1 || true)
    if [[ $signalled == 0 && -n $metrics ]] && grep -q '"step": [1-9][0-9], "train/' "$metrics"; then
      id=$(squeue -h -t RUNNING -o %i | head -n 1)
      [[ -n $id ]] && scancel --signal=USR2 "$id" && signalled=1 && echo "sent USR2 to running job $id"
    fi
    sleep 0.5
  done
}

# The requeued run in sweep folder $1 against the uninterrupted run folder $2: resumed at least once, REQUEUED then
# COMPLETED in sacct, parameters and metrics.jsonl (perf/* aside) bit-identical.
check_requeued() {
  $PY - "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from rlhf.launch.slurm_accounting import AccountingLag, final_states

sweep, reference = Path(sys.argv[1]), Path(sys.argv[2])
(run,) = [p.parent.parent for p in sweep.glob("*/.hydra/hydra.yaml")]
log = (run / "train.log").read_text()
resumed = [line.split("resumed from ")[1].split(":")[0] for line in log.splitlines() if "resumed from " in line]
errors = []
if not resumed:
    errors.append("the job was never resumed (no 'resumed from' in train.log): no USR2, or no checkpoint")
job = next(p.name.split("_")[0] for p in (sweep / ".submitit").iterdir() if p.is_dir())
try:  # once the accounting has recorded the job's end (it lags the job: rlhf/launch/slurm_accounting.py)
    sacct = ["|".join(r.values()) for r in final_states([job])[job]]
except (AccountingLag, RuntimeError) as error:
    errors.append(str(error))
    sacct = []
if sacct and (not any("REQUEUED" in line for line in sacct) or sacct[-1].split("|")[1] != "COMPLETED"):
    errors.append(f"sacct does not show a requeue then COMPLETED: {sacct}")
a, b = load_file(run / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
    errors.append("the requeued run's final parameters differ from the uninterrupted run's")
def metrics(folder):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]
if metrics(run) != metrics(reference):
    errors.append("the requeued run's metrics.jsonl differs from the uninterrupted run's (perf/* aside)")
print(f"attempts: {len(resumed) + 1} (resumed from {', '.join(Path(r).name for r in resumed)}); sacct: {' '.join(sacct)}")
same = not [e for e in errors if "differ" in e]
print(f"final eval/loss {json.loads((run / 'summary.json').read_text())['final']['eval/loss']:.6f}; "
      f"parameters and metrics bit-identical to the uninterrupted run: {same}")
for e in errors:
    print("FAIL", e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
}

[[ $(id -u) == 0 ]] || fail "needs root (installs Slurm with apt and starts its daemons)"
[[ -x $PY ]] || fail "no $PY: run scripts/setup.sh first"
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== start Slurm, and warm the tiny model's cache meanwhile"
# The jobs would each train the warm start if the cache were cold; build it once, here, while Slurm starts.
$PY - launcher=slurm "${RUN[@]}" >"$OUT/warm_start.log" 2>&1 <<'EOF' &
import os, sys
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
with initialize_config_dir(config_dir=os.path.abspath("conf"), version_base="1.3"):
    cfg = compose("config", overrides=[*sys.argv[1:], "output_dir=unused"])
instantiate(cfg.model.tiny).build()
EOF
warm=$!
T=$(now)
bash scripts/slurm/start.sh 2>"$OUT/slurm_start.log" || { tail -n 30 "$OUT/slurm_start.log" >&2; fail "Slurm did not start"; }
T_START=$(since "$T")
wait $warm || { tail -n 20 "$OUT/warm_start.log" >&2; fail "building the tiny model failed"; }
echo "cluster ready in $T_START s; $(sinfo -h -o '%P %D node(s) %c CPUs %T')"

# Slurm's accounting lags a job's end (slurmdbd stores it after slurmctld has ended the job: seconds on a loaded
# machine). From here on every reader of sacct (these checks, the test below, submitit's watcher in the sweeps) reads
# it through scripts/slurm/lagging/sacct, which hides each recorded end for SLURM_CI_SACCT_LAG_S seconds: the checks
# are seen to wait for the record (rlhf/launch/slurm_accounting.py) on every run, not only on a slow machine.
LAG_S=${SLURM_CI_SACCT_LAG_S:-3}
if [[ $LAG_S != 0 ]]; then
  export PATH="$PWD/scripts/slurm/lagging:$PATH" SACCT_LAG_S=$LAG_S SACCT_LAG_DIR="$(realpath -m "$OUT")/sacct-lag"
  echo "sacct lags $LAG_S s on purpose (scripts/slurm/lagging/sacct; SLURM_CI_SACCT_LAG_S=0: none)"
fi

echo "== sweeps: optimizer=sgd,adam8bit,lion (1 process each), hardware=cpu_ddp (2 processes), a 2-trial Optuna search, select_then_confirm"
T=$(now)
timeout 900 $PY train.py -m "${LAUNCH[@]}" optimizer=sgd,adam8bit,lion "${RUN[@]}" \
  hydra.sweep.dir="$OUT/optimizers" >"$OUT/optimizers.log" 2>&1 &
sweep_a=$!
timeout 900 $PY train.py -m "${LAUNCH[@]}" hardware=cpu_ddp "${RUN[@]}" \
  hydra.sweep.dir="$OUT/cpu_ddp" >"$OUT/cpu_ddp.log" 2>&1 &
sweep_b=$!
timeout 900 $PY train.py -m "${LAUNCH[@]}" hydra/sweeper=search hydra.sweeper.n_trials=2 hydra.sweeper.n_jobs=2 \
  'optimizer.lr=tag(log, interval(1e-5, 1e-3))' "${RUN[@]}" hydra.sweep.dir="$OUT/search" >"$OUT/search.log" 2>&1 &
sweep_c=$!
timeout 900 $PY train.py -m "${LAUNCH[@]}" hydra/sweeper=select_then_confirm data.validation_size=0.5 \
  "hydra.sweeper.search='optimizer.lr=1e-4,3e-4'" "hydra.sweeper.confirm_on.seed='1'" "${RUN[@]}" \
  hydra.sweep.dir="$OUT/select" >"$OUT/select.log" 2>&1 &
sweep_d=$!
status=0
wait $sweep_a || { status=$?; tail -n 15 "$OUT/optimizers.log" >&2; echo "ci_slurm: sweep optimizers exited $status" >&2; }
wait $sweep_b || { status=$?; tail -n 15 "$OUT/cpu_ddp.log" >&2; echo "ci_slurm: sweep cpu_ddp exited $status" >&2; }
wait $sweep_c || { status=$?; tail -n 15 "$OUT/search.log" >&2; echo "ci_slurm: sweep search exited $status" >&2; }
wait $sweep_d || { status=$?; tail -n 15 "$OUT/select.log" >&2; echo "ci_slurm: sweep select exited $status" >&2; }
T_SWEEP=$(since "$T")
[[ $status == 0 ]] || fail "a sweep failed (exit $status; 124: timed out): see $OUT/*.log and $OUT/*/.submitit/"

# The launcher returns once each job has written its result; Slurm still needs a moment to end the job.
for _ in $(seq 1 60); do [[ -z $(squeue -h -o %i) ]] && break; sleep 0.5; done
[[ -z $(squeue -h -o %i) ]] || fail "jobs still in the queue after the sweeps: $(squeue -h -o '%i %T' | tr '\n' ' ')"

echo "== checks"
$PY - "$OUT" "$STEPS" <<'EOF' || fail "see above"
import json, sys
from pathlib import Path
import yaml
from rlhf.launch.slurm_accounting import AccountingLag, final_states

out, steps = Path(sys.argv[1]), int(sys.argv[2])
# Every job the two sweeps submitted (submitit keeps a folder per job, and one per array with its sbatch script).
ids = {p.name.split("_")[0] for p in out.glob("*/.submitit/*") if p.is_dir()}
if not ids:
    sys.exit("no job was submitted (no .submitit/<job> folder)")
try:  # once the accounting has recorded every job's end (it lags the jobs: rlhf/launch/slurm_accounting.py)
    records = [r for group in final_states(ids, fields=("JobID", "State", "Start", "End", "Elapsed", "AllocCPUS"),
                                           every_attempt=False).values() for r in group]
except (AccountingLag, RuntimeError) as error:
    sys.exit(str(error))
(out / "sacct.txt").write_text("".join("|".join(r.values()) + "\n" for r in records))
jobs = {r["JobID"]: (r["State"], r["Elapsed"], r["AllocCPUS"], r["Start"][-8:], r["End"][-8:]) for r in records}
errors = [f"Slurm job {job} ended {v[0]}" for job, v in jobs.items() if v[0] != "COMPLETED"]
rows = []
for sweep, expected in (("optimizers", 3), ("cpu_ddp", 1), ("search", 2), ("select/search", 2), ("select/confirm", 1)):
    runs = sorted(p.parent.parent for p in (out / sweep).glob("*/.hydra/hydra.yaml"))
    if len(runs) != expected:
        errors.append(f"{sweep}: {len(runs)} run folder(s), expected {expected}")
    for run in runs:
        hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        job = str(hydra["job"]["id"])
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
        last = max((r["step"] for r in lines), default=None)
        final = json.loads((run / "summary.json").read_text())["final"] if (run / "summary.json").exists() else {}
        log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
        processes = config["hardware"]["num_processes"] or 1
        name = f"{sweep}/{run.name.split('_', 1)[0]}"
        for ok, what in ((last == steps, f"metrics.jsonl ends at step {last}, not {steps}"),
                         (bool(final), "no summary.json"),
                         ((run / "final" / "config.json").exists(), "no final/ model"),
                         (f"hardware: {processes} process(es)" in log, f"train.log does not show {processes} process(es)"),
                         (job in jobs, f"Slurm job {job} not in sacct")):
            if not ok:
                errors.append(f"{name}: {what}")
        state, elapsed, cpus, start, end = jobs.get(job, ("?",) * 5)
        rows.append((job, state, start, end, elapsed, cpus, str(processes), hydra["runtime"]["choices"]["optimizer"],
                     f"{final.get('eval/loss', float('nan')):.4f}", str(last), name))
# The search: Optuna's best value is the lowest final eval/loss of its trials (the default objective, minimized).
results = out / "search" / "optimization_results.yaml"
losses = [json.loads((p.parent.parent / "summary.json").read_text())["final"]["eval/loss"]
          for p in (out / "search").glob("*/.hydra/hydra.yaml") if (p.parent.parent / "summary.json").exists()]
best = yaml.safe_load(results.read_text())["best_value"] if results.exists() else None
if best is None or not losses or best != min(losses):
    errors.append(f"search: optimization_results.yaml best_value {best} is not the lowest final eval/loss {losses}")
# select_then_confirm: the better learning rate on the validation rows, run again on the held-out rows with seed 1.
selection = json.loads((out / "select" / "selection.json").read_text()) if (out / "select" / "selection.json").exists() else None
if selection is None:
    errors.append("select: no selection.json")
else:
    group = selection["compared"]["all"]
    scored = [p for p in group["search"] if p["value"] is not None]
    confirm = group["confirm"]
    if len(scored) != 2 or group["chosen"] != min(scored, key=lambda p: p["value"])["overrides"]:
        errors.append(f"select: chosen {group['chosen']} is not the lower eval/loss of {scored}")
    elif len(confirm) != 1 or confirm[0]["value"] != json.loads(
            (out / "select" / confirm[0]["folder"] / "summary.json").read_text())["final"]["eval/loss"]:
        errors.append(f"select: the confirm run {confirm} does not hold its run's final eval/loss")
    else:
        config = yaml.safe_load((out / "select" / confirm[0]["folder"] / ".hydra" / "config.yaml").read_text())
        if (config["data"]["evaluate_on"], config["seed"]) != ("held_out", 1):
            errors.append(f"select: the confirm run scored {config['data']['evaluate_on']} with seed {config['seed']}")
head = ("job", "state", "start", "end", "elapsed", "cpus", "procs", "optimizer", "eval/loss", "step", "run folder")
widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
for r in [head, *rows]:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
for e in errors:
    print("FAIL", e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
echo "== requeue: a 2-minute time limit; USR2 mid-run -> checkpoint -> requeue -> resume, vs an uninterrupted run"
# ~20 s of training on 1 CPU under a 2-minute limit with USR2 30 s before it. Slurm's timer is coarse: it sends USR2 up
# to a minute early (with a 1-minute limit it came 5-30 s into an attempt here, once before Python had started, which
# kills the job: keep signal_delay_s well inside the limit). A requeued job is held 121 s (Reason=BeginTime): released
# at once here.
REQ=(train.max_steps=60 train.eval_every_steps=30 train.log_every_steps=10 train.save_every_steps=0)
T=$(now)
# hardware=cpu at the precision the sweep's default (hardware=auto) has on this machine: bf16 on a CPU with bf16 units.
OMP_NUM_THREADS=1 timeout 600 $PY train.py hardware=cpu hardware.mixed_precision=auto "${REQ[@]}" \
  hydra.run.dir="$OUT/requeue_reference" \
  >"$OUT/requeue_reference.log" 2>&1 &
reference=$!
timeout 900 $PY train.py -m launcher=slurm hydra.launcher.timeout_min=2 hydra.launcher.signal_delay_s=30 \
  hydra.launcher.max_num_timeout=8 "${REQ[@]}" hydra.sweep.dir="$OUT/requeue" >"$OUT/requeue.log" 2>&1 &
sweep=$!
watch_and_signal $sweep "$OUT/requeue"
wait $sweep || { tail -n 15 "$OUT/requeue.log" >&2; fail "the requeue sweep failed: see $OUT/requeue.log"; }
wait $reference || { tail -n 15 "$OUT/requeue_reference.log" >&2; fail "the uninterrupted reference run failed"; }
T_REQUEUE=$(since "$T")
check_requeued "$OUT/requeue" "$OUT/requeue_reference" || fail "see above"

echo "== requeue on 2 processes (hardware=cpu_ddp): USR2 reaches the job's process and both ranks at once"
# The cpu_ddp sweep job above is the uninterrupted reference: the same settings, plus a 0.5 s sleep in each
# training micro-batch (tests.slow_loss, which changes no number) so that USR2 surely lands mid-run.
T=$(now)
timeout 900 $PY train.py -m launcher=slurm hydra.launcher.timeout_min=5 hydra.launcher.signal_delay_s=30 \
  hydra.launcher.max_num_timeout=3 hardware=cpu_ddp "${RUN[@]}" algo._target_=tests.slow_loss.SlowDPOFrom \
  +algo.call=0 +algo.seconds=0.5 hydra.sweep.dir="$OUT/requeue_ddp" >"$OUT/requeue_ddp.log" 2>&1 &
sweep=$!
watch_and_signal $sweep "$OUT/requeue_ddp"
wait $sweep || { tail -n 15 "$OUT/requeue_ddp.log" >&2; fail "the 2-process requeue sweep failed: see $OUT/requeue_ddp.log"; }
T_REQUEUE_DDP=$(since "$T")
check_requeued "$OUT/requeue_ddp" "$(dirname "$(dirname "$(ls "$OUT"/cpu_ddp/*/.hydra/hydra.yaml)")")" || fail "see above"

echo "== a preemption warning 1 s after a job starts, every CPU busy: requeued, then as an uninterrupted run"
T=$(now)
RLHF_TESTS_REQUIRE_SLURM=1 $PY -m pytest -q -p no:cacheprovider \
  tests/launch/test_submitit_job.py::test_a_slurm_preemption_warning_one_second_after_the_job_starts_requeues_it \
  >"$OUT/warning_at_start.log" 2>&1 || { tail -n 40 "$OUT/warning_at_start.log" >&2; fail "a warning at the start of a job: see $OUT/warning_at_start.log"; }
T_WARNING=$(since "$T")

echo "== ok: cluster start $T_START s, sweeps $T_SWEEP s, requeue $T_REQUEUE s, 2-process requeue $T_REQUEUE_DDP s, warning at start $T_WARNING s, total $(since "$T0") s (before stopping the cluster)"
