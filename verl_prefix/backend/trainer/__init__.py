"""Reuse under verl's trainers: the trainer modes and their balancing hooks (``modes``), groups kept whole
across ranks and mini-batches (``balance``, ``roots``), and the ``hf`` CPU rollout (``rollout_hf``)."""
