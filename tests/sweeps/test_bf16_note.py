"""rlhf/sweeps/bf16_note.py: a report whose runs compare learning rates where bf16 hides their updates says so above
its table, from run folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlhf.sweeps import report
from rlhf.sweeps.bf16_note import bf16_note
from rlhf.sweeps.results import find
from rlhf.sweeps.tables import named_runs
from rlhf.telemetry.bf16_updates import METRIC


def _run(folder: Path, lr: float, steps_to_visible: float | None, max_steps: int = 300) -> Path:
    """A finished run of ``max_steps`` steps at ``optimizer.lr``, with its bf16 figure (None: a float32 run)."""
    (folder / ".hydra").mkdir(parents=True)
    train = {"max_steps": max_steps, "log_every_steps": 100, "eval_every_steps": 0}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": train, "optimizer": {"lr": lr}}))
    lines = [{"step": 0, "eval/loss": 0.7}, *([{"step": 2, METRIC: steps_to_visible}] if steps_to_visible else []),
             *({"step": s, "train/loss": 0.6} for s in (100, 200, 300)), {"step": max_steps, "eval/loss": 0.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    final = {"eval/loss": 0.5, **({METRIC: steps_to_visible} if steps_to_visible else {})}
    (folder / "summary.json").write_text(json.dumps({"final": final, "train": train}))
    return folder


def test_learning_rates_compared_where_bf16_hides_the_updates_are_named_with_the_fix(tmp_path):
    """lr 5e-7 needs 126 steps, lr 6e-7 90, of 300: both fewer than 4 changes of a typical weight's bf16 value over
    the run; lr 1e-6 needs 63 (about 5 changes over the run) and lr 1e-4 0.63 (seen at once): not named (red
    without the note)."""
    _run(tmp_path / "0_optimizer.lr=5e-07", 5e-7, 126.0)
    _run(tmp_path / "1_optimizer.lr=6e-07", 6e-7, 90.0)
    _run(tmp_path / "2_optimizer.lr=1e-06", 1e-6, 63.0)
    _run(tmp_path / "3_optimizer.lr=0.0001", 1e-4, 0.63)
    made = report.build(find([tmp_path]))
    md = report.markdown(made)
    note = md.split("\n\n", 1)[0].splitlines()
    assert note[0].startswith("> **Learning rates compared where bf16 hides updates**: these runs compare learning "
                              "rates (optimizer.lr) in a regime where bf16 hides updates from the forward pass")
    assert "Fix: hardware.mixed_precision=no" in note[0]
    assert note[1:] == ["> - run 0 (optimizer.lr=5e-07): a typical weight needs 126 steps before its bf16 value "
                        "changes; the run has 300",
                        "> - run 1 (optimizer.lr=6e-07): a typical weight needs 90 steps before its bf16 value "
                        "changes; the run has 300"]
    assert "Learning rates compared where bf16 hides updates: these runs" in report.text(made)


def test_no_note_where_the_learning_rates_are_the_same_or_the_updates_show(tmp_path):
    same = [_run(tmp_path / "same" / f"{seed}_seed={seed}", 5e-7, 126.0) for seed in (0, 1)]
    assert bf16_note(named_runs(report.build(find(same)))) == ("", [])  # one learning rate: nothing compared
    seen = [_run(tmp_path / "seen" / "0_a", 1e-4, 0.6), _run(tmp_path / "seen" / "1_b", 1e-3, 0.06),
            _run(tmp_path / "seen" / "2_c", 1e-5, None)]  # float32: no figure
    assert bf16_note(named_runs(report.build(find(seen)))) == ("", [])
    assert "bf16" not in report.markdown(report.build(find(seen)))
