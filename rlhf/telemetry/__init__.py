"""What a run reports about itself; may import everything below ``rlhf.run`` (the hardware strategies for
memory and peak FLOP/s, the models for quantized sizes), never the run, the sweeps or the launch.

- :mod:`~rlhf.telemetry.loggers`: the loggers a run writes to (``conf/logger/``: JSONL, TensorBoard, W&B), the log
  file.
- :mod:`~rlhf.telemetry.metrics`: the log window's means and the held-out evaluation, over every process.
- :mod:`~rlhf.telemetry.mfu`: model FLOPs per token and of the machine, ``perf/mfu``.
- :mod:`~rlhf.telemetry.load`: the CPUs other work keeps busy beside the run, ``perf/busy_cpus_other``.
- :mod:`~rlhf.telemetry.profiling`: ``train.profile_steps`` (torch's profiler) and ``train.profile_memory``.
- :mod:`~rlhf.telemetry.memory_preflight`: what a process will hold, predicted before the first step; its peak.
- :mod:`~rlhf.telemetry.bf16_updates`: in bf16, the steps before the forward pass sees a typical weight's update,
  ``train/bf16_steps_to_visible`` (warned where the run is too short for it).
"""
