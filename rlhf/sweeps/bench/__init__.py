"""The optimizer benchmark (``experiment=optimizer_bench``), run the AlgoPerf way: equal tuning budgets per
optimizer, several workloads, time to a target, intervals over seeds, performance profiles over workloads
(https://github.com/mlcommons/algorithmic-efficiency/blob/main/docs/DOCUMENTATION.md). Part of :mod:`rlhf.sweeps`:
may import ``rlhf.run`` and below; never ``rlhf.config`` or ``rlhf.launch``.

- :mod:`~rlhf.sweeps.bench.plan`: the workloads, each optimizer's search space, every job planned ahead.
- :mod:`~rlhf.sweeps.bench.runner`: the jobs launched and read back from their folders, the cost as it goes, a
  stopped benchmark continued.
- :mod:`~rlhf.sweeps.bench.scores`: the scores as pure functions: time to target, bootstrap intervals, the
  performance profile and its score, the geometric-mean speed-up over a baseline.
- :mod:`~rlhf.sweeps.bench.report`: the report folder (md, csv, png) and its manifest.
- :mod:`~rlhf.sweeps.bench.profile_plot`: the performance profile's figure.
"""
