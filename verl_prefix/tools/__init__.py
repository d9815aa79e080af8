"""Tools around the product: the ``verl-prefix`` CLI, benchmarks, replay, reports, the demo, the CPU GRPO
loop and the tiny test models. Free to import the backend and the schedule; nothing imports them back."""
