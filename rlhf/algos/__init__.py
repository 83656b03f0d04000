"""Algorithms. One file each: pure loss functions plus the small class that the loop drives.

An algorithm object provides (see :class:`rlhf.algos.base.Algorithm`):

- ``columns``: the text columns it needs (``prompt``/``completion``, ``prompt``/``chosen``/``rejected``...);
- ``tokenize(row, tokenizer)`` and ``collate(rows)``: from text rows to tensors;
- ``setup(policy, accelerator)``: anything built from the policy before training (e.g. a reference model);
- ``loss(model, batch) -> (loss, metrics)`` and ``evaluate(model, batch) -> metrics``.
"""
