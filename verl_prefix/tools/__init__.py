"""Tools around the product: the ``verl-prefix`` CLI, benchmarks, replay, reports, the demo and the CPU GRPO
loop. Free to import the harness, the backend and the schedule; nothing imports them back.

Inside, ``cli`` sits on top and nothing imports it; a concern with several modules has a folder (``bench``,
``report``, ``smoke``, ``demo``, ``cpu_loop``); the commands share ``measure`` (timing an update, peak RSS,
device peaks, machine info, the platform choice) and the FLOP models (``flops``, ``tree_flops``) at the bottom.
pyproject.toml's import-linter contracts keep that order and keep the layer acyclic.
"""
