"""Alias kept for code written before the layout change: ``from verl_prefix.cpu_loop import run_cpu_grpo``."""

from verl_prefix.tools.cpu_loop import compare_runs, local_cluster, run_cpu_grpo

__all__ = ["compare_runs", "local_cluster", "run_cpu_grpo"]
