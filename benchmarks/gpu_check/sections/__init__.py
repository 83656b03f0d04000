"""What the GPU check measures: the preflight of the GPU paths (:mod:`~gpu_check.sections.preflight`, running
:mod:`~gpu_check.sections.probes`), the correctness rows (:mod:`~gpu_check.sections.correctness`), the output
layer's kernels (:mod:`~gpu_check.sections.kernels`), a speed pair, a lever, the profile and the memory records
(:mod:`~gpu_check.sections.speed`), and the timed sections over the plan (:mod:`~gpu_check.sections.timed`)."""
