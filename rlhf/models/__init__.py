"""Models: loading policies from the Hub or a folder, the embedded tiny model, reference models."""

from rlhf.models.loading import Policy, load_policy

__all__ = ["Policy", "load_policy"]
