"""The GPU check: everything that needs a GPU, in two device calls, each written as a dated page
(``docs/gpu/<date>-<device>.md``); run by ``bash benchmarks/gpu_check.sh`` (``python benchmarks/gpu_check``, or
``python -m gpu_check`` with ``benchmarks/`` on the path). Its parts, top to bottom:

- :mod:`gpu_check.main`: the coordinator: its arguments, the sections in order, the page written;
- :mod:`gpu_check.page`: the dated page and the summary (``markdown``), and what the levers say of each ``auto``
  default (``defaults``);
- :mod:`gpu_check.sections`: what is measured: the preflight of the GPU paths (``preflight``, running the
  ``probes``), the correctness rows (``correctness``), the output layer's kernels (``kernels``), a speed pair, a
  lever, the profile and the memory records (``speed``), and the timed sections that loop over the plan within the
  budget (``timed``);
- :mod:`gpu_check.workers`: the processes: one function in a process of its own (``isolated``), the long-lived side
  of a speed pair (``worker``) and the turns of a pair between them (``turns``);
- :mod:`gpu_check.plan` (what runs, in which order, its time estimate, the goals), :mod:`gpu_check.state` (the
  report, the budget, the device calls, the call's settings) and :mod:`gpu_check.recompiles` (torch's recompile
  limit, watched in every section).

A module imports only from the layers below its own (:data:`LAYERS`; ``|`` separates modules of one layer, which do
not import each other), so the check has no import circle; ``tests/test_gpu_check_layers.py`` reads every import of
the package and holds it to this. Besides the package, its modules import ``bench`` (``benchmarks/bench.py``) and
``rlhf``.
"""

LAYERS = (
    "main",
    "page.markdown",
    "page.defaults",
    "sections.timed",
    "sections.speed | sections.correctness",
    "sections.preflight | sections.kernels",
    "sections.probes",
    "workers.turns | workers.worker",
    "workers.isolated",
    "plan | state | recompiles",
)
