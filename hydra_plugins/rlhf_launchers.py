"""The project's submitit launchers (``conf/launcher/submitit_local.yaml``, ``slurm.yaml``): Hydra's, with a point
whose process dies recorded as a failed point instead of ending the sweep (:mod:`rlhf.launch.sweep_launchers`).

Hydra builds a launcher only from a class of the ``hydra_plugins`` package, which it scans at start; this folder
joins that package when the repository root is on the path (``python train.py`` puts it there, and a submitit job
runs in the same working directory).
"""

from hydra_plugins.hydra_submitit_launcher import submitit_launcher

from rlhf.launch.sweep_launchers import DeadPointsFail


class LocalLauncher(DeadPointsFail, submitit_launcher.LocalLauncher):
    """``launcher=submitit_local``: each point in a process of its own on this machine."""


class SlurmLauncher(DeadPointsFail, submitit_launcher.SlurmLauncher):
    """``launcher=slurm``: each point in a Slurm job of its own."""
