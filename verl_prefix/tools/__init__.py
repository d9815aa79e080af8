"""Tools around the product: the ``verl-prefix`` CLI, benchmarks, replay, reports, the demo, the CPU GRPO
loop and the tiny test models. Free to import the backend and the schedule; nothing imports them back.

Inside, ``cli`` sits on top and nothing imports it; the commands (``bench_runner``, ``replay``, ``report``,
...) share ``bench_presets`` (models, cells, presets) and ``measure`` (timing an update, peak RSS, device
peaks, machine info, the platform choice); ``testing`` is at the bottom. pyproject.toml's import-linter
contracts keep that order and keep the layer acyclic.
"""
