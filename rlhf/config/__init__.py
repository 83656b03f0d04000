"""What the user typed, checked before anything runs: the command line's overrides before Hydra composes them,
the composed config against every component's signature and limits, TRL's names. May import every layer below
(it knows each group's components); only ``rlhf.launch`` and ``train.py`` import it.

- :mod:`~rlhf.config.command_line`: overrides checked before composition (a mistyped group or key, TRL's names).
- :mod:`~rlhf.config.checks`: :func:`check_config` on the composed config; :class:`CheckBeforeRun`, the Hydra
  callback that runs it before the run folder exists.
- :mod:`~rlhf.config.trl_names`: TRL's argument names and ours.
- :mod:`~rlhf.config.tuned_defaults`: the defaults that differ from TRL's, and the start-up warning for those tuned
  on the embedded model left on another model.
"""

from rlhf import old_paths as _old_paths


def __getattr__(name: str):
    """``rlhf.config.<name>`` for the names of the module ``rlhf.config`` was (now :mod:`rlhf.config.checks`)."""
    return _old_paths.attribute(__name__, name)
