"""The GPU check page's section on the ``auto`` defaults: for each GPU choice of ``rlhf.core.auto_choices.CHOICES``,
the levers of this run that turn it off (:data:`TURNS_OFF`), their speed and memory against the defaults, and what
they say of the choice: kept (the default was faster), or to change (the lever was faster in every round), with the
line of ``rlhf/core/auto_choices.py`` to edit. The package's defaults change only by that edit, with the page."""

from __future__ import annotations

from rlhf.core.auto_choices import CHOICES

# The override that turns each auto option's GPU choice off: a lever with it measures the choice.
TURNS_OFF = {"algo.fused_output_layer": "algo.fused_output_layer=false", "algo.shared_prompt": "algo.shared_prompt=false",
             "hardware.compile": "hardware.compile=false", "algo.generation": "algo.generation=transformers"}


def verdict(row: dict) -> str:
    """What one lever row says of the default it turns off: faster in every round (its slowest round's speed above
    the defaults'), slower in every round, or within the rounds' spread."""
    low, high = row.get("speed_range") or (row["speed"], row["speed"])
    if low > 1.0:
        return "the default is slower: change its GPU choice"
    if high < 1.0:
        return "the default is faster: keep it"
    return "within the rounds' spread: no verdict"


def defaults_lines(levers: list[dict]) -> list[str]:
    """The page's lines: one row per auto option and lever that measured it (or none measured)."""
    lines = ["", "## The `auto` defaults on a GPU (`rlhf/core/auto_choices.py`)", "",
             "| option | GPU choice | its evidence before this run | lever (this run) | × defaults' speed | "
             "× defaults' memory | verdict |", "|---|---|---|---|---:|---:|---|"]
    for key, choice in CHOICES.items():
        # only a lever that changes this option alone measures it (one that also changes another says nothing of it)
        measured = [r for r in levers if list(r.get("overrides", ())) == [TURNS_OFF[key]]]
        shown = str(choice.gpu).lower() if isinstance(choice.gpu, bool) else str(choice.gpu)
        if not measured:
            lines.append(f"| `{key}` | {shown} | {choice.evidence} | not measured in this run | | | |")
        for r in measured:
            lines.append(f"| `{key}` | {shown} | {choice.evidence} | {r['lever']} ({r['size']}, batch {r['batch']}, "
                         f"{r['case']}) | {r['speed']:.2f} | {r['memory']:.2f} | {verdict(r)} |")
    return lines
