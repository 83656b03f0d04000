"""The core every layer shares; imports nothing else of rlhf.

- :mod:`~rlhf.core.errors`: :class:`UserError`, the one error a user is shown (a message naming the key and the fix).
- :mod:`~rlhf.core.limits`: what a config value may be (:class:`Range`, ``@limits`` beside the component that takes
  it) and the whole-run checks that need no other layer (top-level keys, the run folder, float16 on a CPU).
- :mod:`~rlhf.core.instantiate`: :func:`build`, a component from its config node.
- :mod:`~rlhf.core.train_state`: :class:`TrainState`, where a run is and what it carries from step to step.
- :mod:`~rlhf.core.file_io`: files written with the umask's permissions; write failures as :class:`OSError`.
- :mod:`~rlhf.core.hub`: the Hugging Face Hub asked in seconds (offline mode, reachability, the cache).
"""

VERSION = "0.1.0"  # the package's version (pyproject.toml's); rlhf.__version__
