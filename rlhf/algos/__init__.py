"""Algorithms. One file each: pure loss functions plus the small class that the loop drives. May import
``rlhf.models``, ``rlhf.data``, ``rlhf.ops`` and ``rlhf.core``; independent of ``rlhf.hardware`` and ``rlhf.optim``.

Every algorithm subclasses :class:`rlhf.algos.base.Algorithm`, whose docstring is the whole contract: the
required ``columns``, ``tokenize``, ``collate``, ``loss`` and ``evaluate``; and the optional ``setup``, ``frozen``
models, ``batch_source``, ``state_dict``/``load_state_dict``, ``tokenize_reads`` and ``samples``, with their defaults.
"""
