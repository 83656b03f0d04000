"""Tensor operations that the algorithms and the models both use; may import ``rlhf.core`` and ``rlhf.data``.

- :mod:`~rlhf.ops.token_logps`: log-probabilities of chosen tokens without the whole log-softmax in memory.
- :mod:`~rlhf.ops.linear_logps_torch` and :mod:`~rlhf.ops.linear_logps_triton`: the output layer and that
  log-softmax in one, with torch operations (a CPU) and with a Triton kernel (a GPU).
- :mod:`~rlhf.ops.output_layer`: the output layer that answers with those log-probabilities (fused), and the request
  a forward pass carries to it.
- :mod:`~rlhf.ops.completion_logps`: the forward pass every log-likelihood method shares (``completion_stats``).
- :mod:`~rlhf.ops.collectives`: every sum, flag, maximum and gather over the processes of a run.

Here rather than in ``rlhf.models`` or ``rlhf.algos``, so that data flows one way: the models and their references
compute log-probabilities with these, the algorithms build losses on them, and neither package imports the other's
upward neighbour.
"""
