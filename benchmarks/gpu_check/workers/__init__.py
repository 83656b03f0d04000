"""The GPU check's processes: one function in a process of its own (:mod:`~gpu_check.workers.isolated`), the
long-lived side of a speed pair (:mod:`~gpu_check.workers.worker`), and a pair's turns between them
(:mod:`~gpu_check.workers.turns`)."""
