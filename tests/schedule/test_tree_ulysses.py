"""The tree schedule under Ulysses with the MoE router aux loss on (gloo ranks, plain HF, no FSDP), fp64.

Through the engine the tree under SP is compared with verl's stock engine (``tests/backend/
test_tree_ulysses_engine.py``), which has no router loss; here each rank's slice of the tree's update, summed over
the group and divided by its size (FSDP's average over the SP ranks), must be the tree's update without SP, which
``test_tree_schedule``/``test_tree_loss_engine`` check against one-level reuse and the dense path. Two tries: groups
sharing a system block (depth 3, a group ending on an inner node) and tree rollouts with per-turn samples (loss on
shared stems, built ``own_last`` as the engine builds it with the aux on). Each node's router statistics are summed
over the slices and count once per row below it; the aux values must match too. The control, statistics of each
rank's slice only, fails."""

from __future__ import annotations

import pytest
import torch
from helpers.ranks import run_ranks


def _compare(model: torch.nn.Module, sp, layout) -> dict:
    """The tree's update on ``layout`` without SP and, summed over the ranks and divided by their number, with
    it; the aux values each micro-batch computed in both runs."""
    import torch.distributed as dist
    from helpers.layouts import token_weights
    from test_schedule_hf import weighted_loss, worst_relative

    from verl_prefix.schedule.grouping import plan_batch
    from verl_prefix.schedule.models import moe
    from verl_prefix.schedule.options import ScheduleOptions
    from verl_prefix.schedule.tree import schedule as tree_schedule
    from verl_prefix.schedule.tree.trie import build_trie, trie_stats

    routers = moe.MoeRouters(model)
    weights = token_weights(layout, torch.float64)
    plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2, own_last=True)
    auxes: dict[str, list[float]] = {"whole": [], "sliced": []}

    def run(kind: str, ulysses) -> dict[str, torch.Tensor]:
        def aux_fn(rows, router_stats):
            aux = routers.loss(router_stats)
            auxes[kind].append(aux.item())
            return 0.5 * router_stats.tokens / 100 * aux

        model.zero_grad()
        options = ScheduleOptions(
            device=torch.device("cpu"), calculate_entropy=True, routers=routers, aux_fn=aux_fn, ulysses=ulysses
        )
        tree_schedule.train_tree(model, layout, roots, weighted_loss(weights), options)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = run("whole", None), run("sliced", sp)
    for grad in got.values():
        dist.all_reduce(grad)
        grad /= sp.size
    stats = trie_stats(roots)
    return {
        "worst": worst_relative(got, want),
        "auxes": (auxes["whole"], auxes["sliced"]),
        "depth": stats.depth,
        "loss_nodes": stats.loss_nodes,
        "gates": min(got[n].norm().item() for n in got if n.endswith("mlp.gate.weight")),
    }


def _body(rank: int) -> dict:
    import torch.distributed as dist
    from helpers.precision import promote_fp32_upcasts
    from test_moe import tiny_moe
    from test_tree_loss import shared_loss_layout
    from test_tree_schedule import shared_system_layout

    from verl_prefix.schedule.ulysses import Ulysses

    model = tiny_moe(torch.float64, num_hidden_layers=2)
    sp = Ulysses(dist.group.WORLD)
    with promote_fp32_upcasts():
        out = {
            "system": _compare(model, sp, shared_system_layout(responses=(3, 5))),
            "shared_loss": _compare(model, sp, shared_loss_layout()),
        }
        out["all_to_all_bytes"] = sp.all_to_all_bytes
        # the control: every node's (and tail's) router statistics of this rank's slice only, not the sequence's
        whole = Ulysses.sum_stats
        Ulysses.sum_stats = lambda self, stats: stats
        try:
            out["control"] = _compare(model, sp, shared_system_layout(responses=(3, 5)))
        finally:
            Ulysses.sum_stats = whole
    return out


def test_tree_with_the_moe_aux_loss_under_sp_matches_the_tree_without():
    results = run_ranks(_body, world=2, timeout=300)
    for rank in range(2):
        r = results[rank]
        assert r["all_to_all_bytes"] > 0
        for name in ("system", "shared_loss"):
            case = r[name]
            assert case["worst"] < 1e-10, (rank, name, case)
            whole, sliced = case["auxes"]
            assert len(whole) > 0 and sliced == pytest.approx(whole, rel=1e-12)
            assert case["depth"] >= 2 and case["gates"] > 0, case
        assert r["shared_loss"]["loss_nodes"] >= 4
        assert r["control"]["worst"] > 1e-6, r["control"]


pytestmark = pytest.mark.timeout(600)
