"""``verl-prefix demo``: ``echo`` runs the CPU GRPO loop with verl's stock trainer, then with prefix reuse on
the same rollouts; ``agentic`` puts stock, one-level reuse and the tree side by side on agentic batches.

``read_wandb_run`` (reading an offline wandb run back) is public here, at ``verl_prefix.tools.demo``.
"""

from verl_prefix.tools.demo.echo import read_wandb_run

__all__ = ["read_wandb_run"]
