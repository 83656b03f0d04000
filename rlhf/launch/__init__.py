"""The ways in: ``rlhf.train`` (one Hydra job: start the processes of a run, :mod:`~rlhf.launch.processes`),
``rlhf.StepTrainer`` (the ``step()`` API, :mod:`~rlhf.launch.step_trainer`), the Slurm resolvers
(:mod:`~rlhf.launch.slurm`), the submitit launchers' dead points (:mod:`~rlhf.launch.sweep_launchers`) and what their
jobs run first (:mod:`~rlhf.launch.submitit_job`). The top layer: may import everything; nothing in the package imports
it but ``rlhf/__init__.py``.
"""

from rlhf import old_paths as _old_paths


def __getattr__(name: str):
    """``rlhf.launch.<name>`` for the names of the module ``rlhf.launch`` was (now :mod:`rlhf.launch.processes`)."""
    return _old_paths.attribute(__name__, name)
