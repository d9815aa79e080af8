"""Alias kept for code written before the layout change: ``verl_prefix.demo.read_wandb_run``."""

from verl_prefix.tools.demo import read_wandb_run

__all__ = ["read_wandb_run"]
