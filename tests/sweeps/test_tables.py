"""The report's text (rlhf.sweeps.tables): numbers rounded to what they can show, and the note above the table where
the compared runs did not run alike (their environment.json), from run folders written here."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import yaml

from rlhf.sweeps import report, tables
from rlhf.sweeps.results import find

LONG = 0.7294298980537985  # a float as Python prints it in full: 16 digits


def _row(name: str, values: dict, figures: dict) -> report.Row:
    return report.Row(name, values, report.FINISHED, figures, [])


def _report(rows: list[report.Row]) -> report.Report:
    keys = list(rows[0].values)
    return report.Report(rows, keys, {key: key for key in keys}, ["eval/exact_match"])


def test_the_table_rounds_values_and_figures_and_the_csv_keeps_them_exact():
    """A searched learning rate and a figure as long floats: the table shows 3 and 4 significant digits (red with
    ``rounded`` returning ``str(value)``: 0.0007294298980537985 in the table); tokens/s written out, not as an
    exponent; whole numbers and text as they are; the CSV exact."""
    rows = [_row("0", {"optimizer": "adamw", "lr": LONG / 1000, "seed": 0},
                 {"eval/exact_match end": LONG, "tokens/s": 12345.678}),
            _row("1", {"optimizer": "sgd", "lr": 0.01, "seed": 1}, {"eval/exact_match end": 0.5, "tokens/s": None})]
    made = _report(rows)
    header, cells = report.table(made)
    first = dict(zip(header, cells[0]))
    assert (first["lr"], first["eval/exact_match end"], first["tokens/s"]) == ("0.000729", "0.7294", "12346")
    assert (first["optimizer"], first["seed"]) == ("adamw", "0") and dict(zip(header, cells[1]))["lr"] == "0.01"
    assert "0.7294298980537985" not in report.markdown(made) and "0.7294298980537985" not in report.text(made)
    assert report.number(LONG, 0.012345) == "0.7294 ± 0.012"
    _, *written = list(csv.reader(io.StringIO("\n".join(",".join(map(str, r)) for r in report.csv_rows(made)))))
    assert float(written[0][1 + len(made.value_columns) + 1]) == LONG  # the CSV: repr, exact


def test_values_keep_the_digits_that_tell_them_apart():
    """Two learning rates equal to 3 significant digits show 4, so that their rows do not read alike (red with
    ``digits_apart`` returning ``least``: both 0.000123)."""
    rows = [_row(str(i), {"lr": lr}, {}) for i, lr in enumerate([0.00012341234, 0.00012349234, 0.1])]
    assert [shown["lr"] for shown in tables.shown_values(_report(rows))] == ["0.0001234", "0.0001235", "0.1"]
    assert tables.digits_apart([1.0, 2.0, "adamw", 3]) == 3 and tables.rounded(1e-5, 3) == "1e-05"


def _run(folder: Path, environment: dict | None, seed: int = 0, lr: float = 0.01) -> Path:
    """A finished run folder; ``environment``: its environment.json (None: a run older than the file)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"optimizer": {"lr": lr}, "seed": seed}))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/loss": 0.5}) + "\n")
    (folder / "summary.json").write_text(json.dumps({"final": {"step": 1, "eval/loss": 0.5}}))
    if environment is not None:
        (folder / "environment.json").write_text(json.dumps(
            {"threads_per_process": 2, "mixed_precision": "bf16", "machine": "Intel Xeon Platinum 8488C",
             "num_processes": 1, "torch": "2.13.0", **environment}))
    return folder


def test_runs_that_did_not_run_alike_are_named_in_a_note_above_the_table(tmp_path):
    """Thread counts and machines that differ: a note at the top of report.md and of the printed table, naming the
    runs of each value (red without the note in ``markdown``); what is the same (precision), runs without
    environment.json (older runs) and a torch version are not named."""
    _run(tmp_path / "0_seed=0", {"threads_per_process": 1})
    _run(tmp_path / "1_seed=1", {"torch": "2.12.0"}, seed=1)
    _run(tmp_path / "2_seed=2", None, seed=2)  # older than the file
    _run(tmp_path / "3_seed=3", {"threads_per_process": 1, "machine": "AMD EPYC 9R14"}, seed=3)
    made = report.build(find([tmp_path]))
    md = report.markdown(made)
    note, table = md.split("\n\n", 1)
    assert note.splitlines() == [
        "> **Not comparable bit for bit**: these runs did not run alike (their environment.json), which alone "
        "changes their numbers:",
        "> - threads_per_process: 1 (runs 0, 3); 2 (run 1)",
        "> - machine: Intel Xeon Platinum 8488C (runs 0, 1); AMD EPYC 9R14 (run 3)"]
    assert table.startswith("| run | seed |")
    printed = report.text(made)
    assert printed.startswith("Not comparable bit for bit") and "  - machine: Intel Xeon" in printed
    written = report.write(made, tmp_path / "report")
    assert written[0].read_text() == md  # report.md


def test_runs_alike_or_without_the_file_get_no_note(tmp_path):
    """Red where runs without environment.json count as a value of their own ("not recorded")."""
    _run(tmp_path / "alike" / "0_seed=0", {})
    _run(tmp_path / "alike" / "1_seed=1", {}, seed=1)
    _run(tmp_path / "alike" / "2_seed=2", None, seed=2)
    for folder in ("alike", "alike/2_seed=2"):
        made = report.build(find([tmp_path / folder]))
        assert report.markdown(made).startswith("| run |") and report.text(made).startswith("run")
    made = report.aggregate_seeds(report.build(find([tmp_path / "alike"])))
    assert tables.environment_note(tables.named_runs(made)) == []


def test_a_search_names_its_runs_by_stage_in_the_note_of_selection_md(tmp_path):
    """select_then_confirm's selection.md: the same note over both stages' runs, each named by stage and number
    (red without the note in ``search.write``)."""
    from rlhf.sweeps.search import Study, write

    _run(tmp_path / "search" / "0_optimizer.lr=0.01", {}, lr=0.01)
    _run(tmp_path / "search" / "1_optimizer.lr=0.1", {}, lr=0.1)
    _run(tmp_path / "confirm" / "0_optimizer.lr=0.01,seed=1", {"mixed_precision": "no"}, seed=1)
    study = Study.plan(None, "optimizer.lr=0.01,0.1", {"metric": "eval/loss", "direction": "minimize"})
    write(study, tmp_path)
    lines = (tmp_path / "selection.md").read_text().splitlines()
    assert lines[0].startswith("> **Not comparable bit for bit**")
    assert lines[1] == "> - mixed_precision: bf16 (runs search/0, search/1); no (run confirm/0)"
    assert lines[3].startswith("Objective: eval/loss (minimize).")


def test_thread_counts_are_named_only_where_they_change_the_numbers(tmp_path):
    """float32 on a CPU gives the same numbers at any thread count (docs/threads/2026-11-28-same-numbers.md): runs
    that differ only in threads there get no note; in bf16 on a CPU they do (red: threads named for float32 runs)."""
    for precision, changes in (("no", False), ("bf16", True)):
        _run(tmp_path / precision / "0_seed=0", {"mixed_precision": precision, "threads_change_numbers": changes})
        _run(tmp_path / precision / "1_seed=1", {"mixed_precision": precision, "threads_change_numbers": changes,
                                                 "threads_per_process": 1}, seed=1)
    assert tables.environment_note(tables.named_runs(report.build(find([tmp_path / "no"])))) == []
    assert tables.environment_note(tables.named_runs(report.build(find([tmp_path / "bf16"])))) == [
        "threads_per_process: 2 (run 0); 1 (run 1)"]
