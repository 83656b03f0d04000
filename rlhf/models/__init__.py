"""Models: loading policies from the Hub or a folder, PEFT adapters and quantization, the reference strategies,
value heads, generation, attention. May import ``rlhf.ops``, ``rlhf.data`` and ``rlhf.core``; never the algorithms
(their log-probabilities come from :mod:`rlhf.ops.completion_logps`)."""

from rlhf.models.loading import Policy, load_policy

__all__ = ["Policy", "load_policy"]
