"""Entry point: compose the config with Hydra, then run `rlhf.train(cfg)`. See README.md and `--help`."""

import contextlib
import gc
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # a stop signal during the imports waits, then counts once the handler is installed
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2))
    # The imports (torch, transformers, datasets, Hydra: about 600,000 objects that live as long as the process) run
    # without the cyclic garbage collector, which would otherwise walk them again and again as they are made; then
    # they are frozen out of every later collection. Measured: 5.3 s -> 4.4 s to the first step of `python train.py`
    # (benchmarks/startup_time.py).
    gc.disable()

import logging  # noqa: E402
import shlex  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from rlhf import train  # noqa: E402
from rlhf.config.checks import checked_by_callback  # noqa: E402
from rlhf.config.command_line import check_overrides  # noqa: E402
from rlhf.core.errors import UserError  # noqa: E402
from rlhf.launch.processes import hydra_overrides_for_this_rank, run  # noqa: E402
from rlhf.launch.slurm import log_to_the_run_folder_from_the_first_node_only  # noqa: E402
from rlhf.run.folder import remove_if_never_started, resume_overrides  # noqa: E402
from rlhf.run.signals import Stopped, hand_over, install  # noqa: E402
from rlhf.sweeps.points import FailedPoint, failed_points, in_a_sweep, objective_value, record_failure  # noqa: E402


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | FailedPoint | None:
    install()  # for the life of this process (a Slurm job enters here; `python train.py` did so before composing)
    log_to_the_run_folder_from_the_first_node_only()
    try:
        # A single run was checked by the config's Hydra callback in this process; a sweep's job is checked here.
        metrics = run(cfg) if checked_by_callback() else train(cfg)
    except Stopped as stopped:  # a signal: the checkpoint is written; one line, then a non-zero exit
        if stopped.signum == signal.SIGUSR2 and hand_over(signal.SIGUSR2):  # submitit requeues the job and exits
            return None
        logging.getLogger("rlhf").warning("%s", stopped.line(resume_command(stopped.run_dir)))
        sys.exit(stopped.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before training began, or a second one during it
        logging.getLogger("rlhf").error("aborted by Ctrl-C; complete checkpoints, if any, are in %s/checkpoints",
                                        cfg.output_dir)
        sys.exit(130)
    except UserError as error:  # a problem with the input: one message, no traceback, on a line of its own
        end_progress_bars()
        logging.getLogger("rlhf").error("error: %s", error)
        if in_a_sweep():  # recorded in the point's folder; the sweep goes on to its other points
            return record_failure(cfg.output_dir, error)
        remove_if_never_started(cfg.output_dir)  # a folder made for a run that stopped before training
        sys.exit(1)
    except Exception as error:
        if not in_a_sweep():
            raise
        logging.getLogger("rlhf").exception("the run failed")  # the point's own traceback, in its train.log
        return record_failure(cfg.output_dir, error)
    # The run is complete: a time-limit warning (Slurm's USR2) arriving now has nothing left to save, and must not
    # end the finished job as FAILED while it exits (measured: USR2 during exit kills the process).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    return objective_value(cfg, metrics)


def end_progress_bars() -> None:
    """Close the progress bars an error left open, and end their line: the message after them starts on a line of
    its own, in a terminal and in a log file alike (where a bar that cleared itself with a carriage return, as an
    evaluation's does, still leaves the line unended)."""
    from tqdm import tqdm

    bars = list(getattr(tqdm, "_instances", ()))
    with contextlib.suppress(OSError):  # a full disk under a redirected stderr: the message matters more
        for bar in bars:
            bar.close()
        if bars or not sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def resume_command(run_dir) -> str:
    """The command that continues this run: its folder and ``resume=auto`` (the run's recorded overrides are
    re-applied, :func:`rlhf.run.folder.resume_overrides`), or its overrides too where Hydra recorded none."""
    from hydra.core.hydra_config import HydraConfig

    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("resume=", "hydra.run.dir="))]
    if (Path(run_dir) / ".hydra" / "overrides.yaml").is_file():
        overrides = []
    return shlex.join(["python", "train.py", *overrides, f"hydra.run.dir={run_dir}", "resume=auto"])


if __name__ == "__main__":
    gc.freeze()  # the objects made by the imports: never garbage, never walked again
    gc.enable()
    install()  # stop signals are recorded from here on (and those that came during the imports are delivered now)
    # A module of the user's own (a reward function named by _target_) is importable from the folder they run in, as
    # with `python -m`; last on the path, so that it shadows no installed package. Spawned ranks inherit the path.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    check_overrides(sys.argv[1:])  # a mistyped group, key or option: the project's message, before Hydra's
    sys.argv += hydra_overrides_for_this_rank()  # under torchrun, only rank 0 writes .hydra/ and train.log
    sys.argv[1:] = resume_overrides(sys.argv[1:])  # hydra.run.dir=<run> resume=auto: the run's own overrides
    main()
    if failed_points():  # a sweep's points that failed were counted, and summed up in one line (rlhf.sweeps.points)
        sys.exit(1)
