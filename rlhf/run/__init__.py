"""One run in one or more processes: the loop and everything it keeps. May import every layer below it
(``rlhf.telemetry``, ``rlhf.algos``, ``rlhf.hardware``, ``rlhf.optim``, ``rlhf.models``, ``rlhf.data``,
``rlhf.ops``, ``rlhf.core``); never ``rlhf.sweeps``, ``rlhf.config`` or ``rlhf.launch``.

- :mod:`~rlhf.run.loop`: the one training loop, top to bottom (``train_step``, evaluation, logging, checkpoints).
- :mod:`~rlhf.run.components`: the run's components built from the config (model, data, algorithm, strategy,
  optimizer, schedule) and the memory preflight: :class:`BuiltRun`.
- :mod:`~rlhf.run.train_settings`: the ``train:`` block as an object.
- :mod:`~rlhf.run.checkpoint`, :mod:`~rlhf.run.resume_check`: checkpoints and what a resume may change.
- :mod:`~rlhf.run.folder`: the run folder (lock, attempts, final model, what an earlier run left).
- :mod:`~rlhf.run.signals`, :mod:`~rlhf.run.nonfinite`: stopping on a signal, skipping or stopping on a non-finite
  step.
"""
