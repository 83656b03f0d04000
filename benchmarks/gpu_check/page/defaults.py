"""The GPU check page's section on the ``auto`` defaults: for each option of ``rlhf.core.auto_choices.CHOICES``, its
GPU choice and the evidence behind it, the path built for the GPU but not chosen yet (``untried``), the levers of
this run that change the option alone (its choice turned off, or the untried path turned on), their speed and memory
against the defaults, and what they say: keep the choice, or change it (the lever faster in every round), with the
line of ``rlhf/core/auto_choices.py`` to edit. A lever runs only where the preflight passed its path
(:func:`gpu_check.sections.preflight.lever_blocked`), so a lever's row stands on a correct path. The package's
defaults change only by that edit, with the page."""

from __future__ import annotations

from rlhf.core.auto_choices import CHOICES


def shown(value) -> str:
    """An option's value as the command line writes it (``true``, ``layers``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def changes_alone(row: dict, key: str) -> bool:
    """Whether the lever of ``row`` changes ``key`` and nothing else (one that also changes another option says
    nothing of this one)."""
    overrides = list(row.get("overrides", ()))
    return len(overrides) == 1 and overrides[0].split("=", 1)[0] == key


def verdict(row: dict) -> str:
    """What one lever row says of auto's GPU choice of the option it changes: the lever's value faster in every
    round (its slowest round's speed above the defaults'), slower in every round, or within the rounds' spread."""
    low, high = row.get("speed_range") or (row["speed"], row["speed"])
    if low > 1.0:
        return f"`{row['overrides'][0]}` is faster in every round: make it auto's GPU choice"
    if high < 1.0:
        return "auto's GPU choice is faster in every round: keep it"
    return "within the rounds' spread: no verdict"


def defaults_lines(levers: list[dict]) -> list[str]:
    """The page's lines: one row per auto option and lever that measured it alone (or none measured)."""
    lines = ["", "## The `auto` defaults on a GPU (`rlhf/core/auto_choices.py`)", "",
             "| option | GPU choice | its evidence before this run | built, not chosen | lever (this run) | "
             "× defaults' speed | × defaults' memory | verdict |", "|---|---|---|---|---|---:|---:|---|"]
    for key, choice in CHOICES.items():
        untried = getattr(choice, "untried", None)
        waiting = f"`{key}={shown(untried.value)}` ({untried.what})" if untried is not None else "-"
        start = f"| `{key}` | {shown(choice.gpu)} | {choice.evidence} | {waiting} |"
        measured = [r for r in levers if changes_alone(r, key)]
        if not measured:
            lines.append(f"{start} not measured in this run | | | |")
        for r in measured:
            lines.append(f"{start} {r['lever']} (`{r['overrides'][0]}`; {r['size']}, batch {r['batch']}, {r['case']}) "
                         f"| {r['speed']:.2f} | {r['memory']:.2f} | {verdict(r)} |")
    return lines
