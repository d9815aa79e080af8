"""A real GRPO loop on CPU: verl's trainer step and actor workers, HF ``generate`` standing in for rollout.

``loop`` runs it (``run_cpu_grpo``, in a ``local_cluster``; ``compare_runs`` compares two runs step by step);
``workers`` holds its Ray worker processes, a run's own or shared by a series of runs (``worker_hosts``).
The public names are here, at ``verl_prefix.tools.cpu_loop`` (``docs/cpu.md``).
"""

from verl_prefix.tools.cpu_loop.loop import compare_runs, cpu_grpo_config, local_cluster, run_cpu_grpo

__all__ = ["compare_runs", "cpu_grpo_config", "local_cluster", "run_cpu_grpo"]
