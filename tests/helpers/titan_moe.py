"""torchtitan's MoE load-balancing state as its optimizer pre-hook reads it: the tokens routed to each expert and
the expert bias it moves, captured around a verl train step (shared by the TorchTitan engine and schedule tests)."""

from __future__ import annotations

from typing import Any


def expert_counts(engine: Any) -> list:
    """Each MoE layer's routed-token counts as torchtitan's bias pre-hook reads them: under TP x EP each TP
    rank counted its slice of the sequence, and the hook sums them over TP first (as here)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from verl_prefix.backend.titan.moe import moe_layers

    local = [m.tokens_per_expert_E.detach() for m in moe_layers(engine.module[0])]
    counts = [(c.to_local() if isinstance(c, DTensor) else c).clone() for c in local]
    dims = engine.parallel_dims
    if dims.tp > 1 and dims.ep > 1:
        for c in counts:
            dist.all_reduce(c, group=dims.get_mesh("tp").get_group())
    return counts


def expert_bias(engine: Any) -> list:
    """Each MoE layer's expert bias (empty where torchtitan's load balancing is off)."""
    from torch.distributed.tensor import DTensor

    from verl_prefix.backend.titan.moe import moe_layers

    bias = [m.expert_bias_E.detach() for m in moe_layers(engine.module[0]) if m.expert_bias_E is not None]
    return [(b.to_local() if isinstance(b, DTensor) else b).clone() for b in bias]


def counted_train_step(engine: Any, loss_fn: Any, batch: Any, **kwargs: Any) -> dict:
    """verl's train step with the routing counts read just before the optimizer step (``routed``) and the bias
    after it (``bias``); the expert bias zeroed first, so that every step routes from the same bias."""
    from verl_prefix.backend.titan.moe import moe_layers
    from verl_prefix.harness import verl_engine

    for m in moe_layers(engine.module[0]):
        if m.expert_bias_E is not None:
            m.expert_bias_E.zero_()
    counts: dict = {}
    step = engine.optimizer_step
    engine.optimizer_step = lambda: counts.update(routed=expert_counts(engine)) or step()
    try:
        out = verl_engine.run_train_step(engine, loss_fn, batch, **kwargs)
    finally:
        engine.__dict__.pop("optimizer_step", None)
    return {**out, **counts, "bias": expert_bias(engine)}
