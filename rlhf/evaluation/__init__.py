"""Evaluations that every algorithm can run beside its own: the same axis for every objective. May import every
layer below ``rlhf.run`` except ``rlhf.telemetry`` (one layer, independent packages).

- :mod:`~rlhf.evaluation.generated`: completions sampled from the policy on held-out prompts, scored by reward
  functions; the KL to the reference estimated from them; the win rate against the reference's own completions
  (``conf/eval/``: ``eval=generate``).
"""
