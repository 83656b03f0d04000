"""The embedded default's model: a tiny Llama built from a config, with its cached SFT warm start.

Its own package because the warm start trains with the SFT algorithm (``rlhf.algos``) and the project's warmup
schedule (``rlhf.optim``), above the models layer. May import ``rlhf.algos``, ``rlhf.models``, ``rlhf.optim``,
``rlhf.data``, ``rlhf.ops``, ``rlhf.core``. The embedded default's other parts sit where the layers below need them:
the byte tokenizer in :mod:`rlhf.models.tokenizer`, the generated task in :mod:`rlhf.data.tasks`.
"""
