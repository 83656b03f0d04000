"""The optimizer benchmark's performance-profile figure (:class:`rlhf.sweeps.bench.scores.Profile`): ``rho(tau)``,
the fraction of workloads on which an optimizer reached the target within ``tau`` times the fastest, as a step
curve per optimizer over ``tau`` from 1 to ``r_max`` on a log axis, each optimizer's score in its legend entry
(AlgoPerf's figure: https://github.com/mlcommons/algorithmic-efficiency/blob/main/docs/DOCUMENTATION.md).

Drawn as the report's other figures are (:mod:`rlhf.sweeps.plots`): the Agg backend, a marker of its own per line
and each line thinner than the one before, so that two optimizers with the same curve both show."""

from __future__ import annotations

from pathlib import Path

from rlhf.sweeps.bench.scores import Profile
from rlhf.sweeps.plots import line_style, pyplot

DPI = 110  # the saved figure's dots per inch, as the report's other figures


def profile_figure(profile: Profile, title: str):
    """:func:`profile_plot`'s figure (open: the caller closes it). Optimizers in the legend best score first."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5), layout="constrained")
    ranked = sorted(profile.optimizers, key=lambda name: -profile.scores[name])
    for index, name in enumerate(ranked):
        taus, rhos = profile.curves[name]
        axis.plot(taus, rhos, drawstyle="steps-post", label=f"{name} (score {profile.scores[name]:.3f})",
                  **line_style(index, len(ranked)))
    axis.set_xscale("log")
    axis.set_xlim(1.0, profile.r_max)
    axis.set_ylim(-0.03, 1.03)
    ticks = [tau for tau in (1, 1.5, 2, 3, 4, 6, 8, 16) if tau <= profile.r_max]
    axis.set_xticks(ticks, [f"{tau:g}" for tau in ticks])
    axis.minorticks_off()
    axis.set_xlabel("tau: time to target within this factor of the fastest optimizer's (log scale)")
    axis.set_ylabel(f"fraction of the {len(profile.workloads)} workloads")
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)
    figure.legend(loc="outside right upper", fontsize=8,
                  title=f"score: area / (r_max - 1), r_max = {profile.r_max:g}", title_fontsize=8)
    return figure


def profile_plot(profile: Profile, path: Path, title: str) -> None:
    """Write the performance profile (:func:`profile_figure`) to ``path`` (its suffix picks the format: png,
    pdf, svg)."""
    figure = profile_figure(profile, title)
    figure.savefig(path, dpi=DPI)
    pyplot().close(figure)
