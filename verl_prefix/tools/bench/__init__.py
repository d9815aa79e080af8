"""``verl-prefix bench``: dense ``fsdp2`` against ``prefix_fsdp2`` on identical GRPO batches, and the memory figures.

``presets`` holds the vocabulary (models, cells, presets); ``runner`` measures one cell after another
(``attention`` the phase-B attention memory, ``tables`` the markdown tables); ``capacity`` searches the longest
prefix that fits a budget, through ``capacity_probe`` and ``rss_probe`` in fresh processes; ``dormant_memory``
and ``sp_memory`` are the dormant-policy and Ulysses memory figures (``python -m``).
"""
