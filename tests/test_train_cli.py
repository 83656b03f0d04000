"""`train.py` as a user runs it: help, printed config, multirun folders, and one-line errors."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import FAST, ROOT


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _help_groups(text: str) -> dict[str, list[str]]:
    """The "== Config groups" section of --help as {group: options}; a nested group "a/b: x" is option "b/x" of "a"."""
    assert "== Config groups" in text and "== Composed config" in text, text
    section = text.split("== Config groups", 1)[1].split("\n", 1)[1].split("== Composed config", 1)[0]
    groups: dict[str, list[str]] = {}
    for line in filter(None, (line.strip() for line in section.splitlines())):
        name, _, options = line.partition(": ")
        group, _, sub = name.partition("/")
        groups.setdefault(group, []).extend(f"{sub}/{o}" if sub else o for o in options.split(", "))
    return {group: sorted(options) for group, options in groups.items()}


def test_help_lists_every_config_group_and_its_options():
    out = run("--help")
    assert out.returncode == 0, out.stderr[-2000:]
    tree = {d.name: sorted(str(f.relative_to(d).with_suffix("")) for f in d.rglob("*.yaml"))
            for d in (ROOT / "conf").iterdir() if d.is_dir() and d.name != "hydra"}
    assert _help_groups(out.stdout) == tree


def test_cfg_job_prints_the_composed_config():
    out = run("--cfg", "job", "algo=dpo", "optimizer=lion")
    assert out.returncode == 0
    assert "_target_: rlhf.algos.dpo.DPO" in out.stdout and "_target_: lion_pytorch.Lion" in out.stdout


def test_multirun_gives_one_run_folder_per_job(tmp_path):
    out = run("-m", "algo=dpo", "optimizer=sgd,adam8bit,lion", *FAST, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name[:2] for p in runs] == ["0_", "1_", "2_"]
    for folder, optimizer in zip(runs, ("sgd", "adam8bit", "lion")):
        assert f"optimizer={optimizer}" in (folder / ".hydra" / "overrides.yaml").read_text()
    for folder in runs:
        assert (folder / "final" / "config.json").exists()
        assert (folder / ".hydra" / "config.yaml").exists()
        assert json.loads((folder / "summary.json").read_text())["final"]["train/loss"] > 0
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(tmp_path), "--csv"],
                         capture_output=True, text=True, check=True).stdout
    table = list(csv.reader(io.StringIO(out)))
    # The effective values that differ (from each run's resolved config): the optimizer's class and its settings.
    assert table[0][:2] == ["run", "optimizer"] and "lr" in table[0]
    assert any(column.startswith("eval/") for column in table[0])
    assert [row[1].lower() for row in table[1:]] == ["sgd", "adam8bit", "lion"]


@pytest.mark.parametrize(("override", "message"), [
    ("optimizer=nonexistent", "optimizer=nonexistent: conf/optimizer/ has no option 'nonexistent' (options: "),
    ("algo.beta=abc", "algo.beta='abc' is a str, but DPO expects float"),
    ("model.name_or_path=/no/such/run/final", "model.name_or_path=/no/such/run/final: no such folder"),
    ("data.path=no_such_file.jsonl", "data.path=no_such_file.jsonl: no such file"),
])
def test_bad_input_stops_with_one_clear_message(override, message, tmp_path):
    """Each is found by the config check, before anything heavy loads and before the run folder is made."""
    out = run(*FAST, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1
    assert message in out.stderr + out.stdout
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_a_run_that_stops_before_training_leaves_no_folder_but_never_removes_an_old_one(tmp_path):
    """A bad row is found once the data is read, after Hydra made the run folder: that folder (and the dated one
    made with it) goes; a folder that existed before the run stays as it was. Two runs, about 15 s."""
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(8)]
    rows[5]["chosen"] = ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run(*FAST, "algo=dpo", f"data.path={path}", f"hydra.run.dir={tmp_path / 'outputs' / 'day' / 'run'}")
    assert out.returncode == 1 and "row 6 (counting from 1), column 'chosen' is empty" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    out = run(*FAST, "algo=dpo", f"data.path={path}", f"hydra.run.dir={old}")
    assert out.returncode == 1 and (old / "notes.txt").read_text() == "mine" and (old / "train.log").exists()


def test_dataset_without_the_needed_columns_names_them(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": "a"}) for i in range(10)))
    out = run(*FAST, "algo=dpo", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "has columns ['question', 'answer'], but this algorithm needs prompt/chosen/rejected" in out.stderr


def test_a_default_run_imports_no_library_it_does_not_use(tmp_path):
    """Start-up time: the default run (DPO, AdamW, cosine schedule, one process) never imports peft, bitsandbytes,
    DeepSpeed or transformers' Trainer helpers (together about 1.1 s of every run's start here), which only LoRA,
    8-bit optimizers and ZeRO need. The run is train.py's own, in a process that lists its modules at exit; it
    saves no final model (transformers' save_pretrained looks for DeepSpeed, which imports it where installed).
    The imports ran without the garbage collector, which is on again for the run, their objects frozen out of it."""
    listing = tmp_path / "modules.txt"
    code = ("import atexit, gc, runpy, sys; "
            f"atexit.register(lambda: open({str(listing)!r}, 'w').write('\\n'.join(["
            "f'gc {gc.isenabled()} {gc.get_freeze_count()}', *sys.modules]))); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "train.py"), *FAST, "train.max_steps=1",
                          "train.save_final=false", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    gc_line, *modules = listing.read_text().splitlines()
    enabled, frozen = gc_line.split()[1:]
    assert enabled == "True" and int(frozen) > 100_000, gc_line  # about 600,000 objects made by the imports
    imported = set(modules)
    assert {"torch", "accelerate", "transformers.models.llama.modeling_llama", "rlhf.run.loop"} <= imported
    unused = {"peft", "bitsandbytes", "deepspeed", "transformers.trainer_utils", "transformers.optimization"}
    assert not unused & imported


# ---- a reward function of the user's own, outside the repository ----------------------------------------------------
def test_a_reward_function_and_its_yaml_from_the_users_own_folder_run_and_its_error_names_it(tmp_path):
    """The documented recipe: my_rewards.py and conf/algo/reward_funcs/mine.yaml in the folder train.py runs in,
    ``hydra.searchpath=[file://conf] algo/reward_funcs=mine algo/scale_rewards=none``. The function is found (red
    before: "cannot import it") and called; it raises in the first training step, and the message names it, its
    signature and its line, on a line of its own after the training progress bar (red before: on the bar's line),
    without a traceback."""
    (tmp_path / "my_rewards.py").write_text(  # held-out batches (8) score, a training rollout (4 x 8) raises
        "def boom(prompts, completions, **kwargs):\n    return [1 / 0] if len(completions) > 8 else [0.0] * len(completions)\n")
    (tmp_path / "conf" / "algo" / "reward_funcs").mkdir(parents=True)
    (tmp_path / "conf" / "algo" / "reward_funcs" / "mine.yaml").write_text(
        "# @package algo\nreward_funcs:\n  mine: {_target_: my_rewards.boom, _partial_: true}\nreward_weights: null\n")
    out = run(*FAST, "algo=grpo", "hydra.searchpath=[file://conf]", "algo/reward_funcs=mine", "algo/scale_rewards=none",
              f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    line = next(line for line in out.stderr.splitlines() if "error: " in line)
    assert line.startswith("[") and "[rlhf][ERROR] - error: reward function algo.reward_funcs.mine, " \
        f"my_rewards.boom(prompts, completions, **kwargs), raised ZeroDivisionError at {tmp_path / 'my_rewards.py'}:2: " \
        "division by zero. It is called as fn(prompts=[...], completions=[...])" in line, line
    assert "No checkpoint was lost" in line and "Traceback" not in out.stderr


def test_a_module_that_is_nowhere_says_where_modules_of_ones_own_are_found(tmp_path):
    from rlhf.config.checks import check_config
    from rlhf.core.errors import UserError
    from tests.conftest import compose_config

    cfg = compose_config("algo=grpo", output_dir=tmp_path)
    cfg.algo.reward_funcs.exact_match._target_ = "not_a_module_here.score"
    with pytest.raises(UserError, match=r"algo.reward_funcs.exact_match._target_=not_a_module_here.score: no module "
                                        r"named 'not_a_module_here'. A module of your own .* is importable from the "
                                        r"folder you run train.py in .*PYTHONPATH"):
        check_config(cfg)


def test_a_run_prints_no_warning_the_project_causes(tmp_path):
    """LoRA (peft reads transformers' deprecated is_gradient_checkpointing: a FutureWarning at every run, red
    before) with an 8-bit reference (bitsandbytes logs its float16 cast at every matmul: hundreds of lines, red
    before): no warning, the cast notice at most once."""
    out = run(*FAST, "peft=lora", "algo/reference=int8", "train.max_steps=2", f"output_dir={tmp_path / 'run'}",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("MatMul8bitLt: inputs will be cast") <= 1
    lines = [line for line in out.stderr.splitlines() if "Warning" in line and "MatMul8bitLt" not in line]
    assert not lines, lines
