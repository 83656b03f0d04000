"""Hydra plugins of rlhf (Hydra loads plugins from the ``hydra_plugins`` namespace package only)."""
