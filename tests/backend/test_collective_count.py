"""How many blocking collectives a mini-batch issues before its first phase-A forward: at most two on the
default path (the driver's one exchange: an object all-gather is two collectives on the wire, the sizes and
the bytes), where the stock engine issues one (its loss-token all-reduce). Each is a network round trip per
mini-batch on a multi-node cluster.

Counted on two gloo ranks by wrapping every collective of ``torch.distributed`` (the functions the package and
verl call, and those ``all_gather_object`` calls inside) and noting the count when the meter enters phase A for
the first time. The stock ``fsdp2`` engine is counted the same way up to its first model forward, so the
counter is shown to see collectives at all."""

from __future__ import annotations

import pytest
from helpers.ranks import run_ranks

# the c10d functions a collective goes through (FSDP2's own all-gathers run inside the model forward: after A)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather_object",
    "reduce",
)
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object")
# cases: (reuse config overrides, Ulysses degree, dormant policy)
CASES = {
    "default": ({}, 1, "keep"),
    "tree": ({"tree": True}, 1, "keep"),
    "ulysses": ({}, 2, "keep"),
    "dormant_auto": ({}, 1, "auto"),
    "tree_dormant_auto": ({"tree": True}, 1, "auto"),
}
# how many collectives each case may issue before its first phase A (the tree under dormant_prefix=auto agrees on
# each node's policy once the padded trie is known: one all-reduce more)
LIMITS = {"tree_dormant_auto": 3}


class Counter:
    """Counts ``torch.distributed`` collectives; ``at_a``: the count when phase A first starts."""

    def __init__(self) -> None:
        self.count = 0
        self.at_a: int | None = None
        self.at_forward: int | None = None

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            original = getattr(c10d, name)

            def wrapped(*args, _original=original, _name=name, **kwargs):
                # an object collective counts as the collectives it issues (all_gather_object: two all_gathers)
                self.count += _name not in OBJECT_COLLECTIVES
                return _original(*args, **kwargs)

            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def watch(self, model) -> None:
        """Note the count at the first phase A, and at the first forward of the model (for the stock engine)."""
        from verl_prefix.schedule.telemetry import PhaseMeter

        phase = PhaseMeter.phase

        def noting(meter, name, *args, **kwargs):
            if name == "A" and self.at_a is None:
                self.at_a = self.count
            return phase(meter, name, *args, **kwargs)

        PhaseMeter.phase = noting

        def first_forward(module, args, kwargs):
            if self.at_forward is None:
                self.at_forward = self.count

        model.register_forward_pre_hook(first_forward, with_kwargs=True)


def _body(rank: int, model_dir: str, case: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import grpo_batches, verl_engine

    overrides, sp, dormant = CASES.get(case, ({}, 1, "keep"))
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[9, 6], response_len_range=(1, 6), vocab_size=128, seed=11 + rank
    )
    kwargs = dict(micro_batch_size_per_gpu=2, use_remove_padding=sp > 1)
    if sp > 1:
        kwargs["overrides"] = [f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"]
    backend = "fsdp2" if case == "stock" else "prefix_fsdp2"
    engine, loss, _ = verl_engine.build_verl_engine(model_dir, backend=backend, **kwargs)
    if backend == "prefix_fsdp2":
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=4, min_shared_tokens=4, **overrides)
        engine.dormant_prefix = dormant
        if dormant == "auto":
            engine.dormant_prefix_budget_bytes = 2**40
    return _count(engine, loss, batch)


def _count(engine, loss, batch, model=None) -> dict:
    """The engine's collectives before its first phase A (and before its model's first forward), on a first
    and a later mini-batch."""
    from verl_prefix.harness import verl_engine

    counter = Counter()
    counter.install()
    counter.watch(model if model is not None else engine.module)
    counts = []
    for _ in range(2):  # the first mini-batch and a later one
        counter.count, counter.at_a, counter.at_forward = 0, None, None
        metrics = verl_engine.run_train_step(engine, loss, batch)["reduced_metrics"]
        counts.append({"at_a": counter.at_a, "at_forward": counter.at_forward, "total": counter.count})
    return {"counts": counts, "groups": metrics.get("prefix/groups", 0.0)}


def _titan_body(rank: int, model_dir: str, layout: str) -> dict:
    """prefix_torchtitan at TP=2 (one data-parallel rank: nothing to agree) or FSDP=2, one-level reuse."""
    import functools

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import grpo_batches, verl_engine
    from verl_prefix.harness import titan as TT

    knobs = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4"]
    actor = verl_engine.compose_ppo_config([f"actor_rollout_ref.actor.{k}" for k in knobs]).actor_rollout_ref.actor
    loss = functools.partial(ppo_loss, config=omega_conf_to_dataclass(actor))
    parallel = dict(tensor_parallel_size=2) if layout == "tp2" else dict(data_parallel_shard_size=2)
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    engine = TT.build_titan_engine(model_dir, backend="prefix_torchtitan", prefix_reuse=reuse, **parallel)
    seed = 11 + (rank if layout == "fsdp2" else 0)  # TP ranks hold the same mini-batch
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[9, 6], response_len_range=(1, 6), vocab_size=128, seed=seed
    )
    return _count(engine, loss, batch, model=engine.module[0])


@pytest.mark.parametrize("case", list(CASES))
def test_at_most_two_collectives_before_phase_a(tiny_model, case):
    results = run_ranks(_body, str(tiny_model("qwen3")), case, world=2)
    print(f"before phase A [{case}]:", [[c["at_a"] for c in results[r]["counts"]] for r in range(2)])
    for rank in range(2):
        assert results[rank]["groups"] > 0, "reuse ran"
        for counts in results[rank]["counts"]:
            assert counts["at_a"] is not None, counts
            assert counts["at_a"] <= LIMITS.get(case, 2), (case, rank, counts)


def test_the_counter_sees_the_stock_engines_collective(tiny_model):
    """The stock engine's loss-token all-reduce comes before its first forward: the counter sees it."""
    results = run_ranks(_body, str(tiny_model("qwen3")), "stock", world=2)
    for rank in range(2):
        for counts in results[rank]["counts"]:
            assert counts["at_forward"] is not None and counts["at_forward"] >= 1, counts


pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
def test_torchtitan_at_most_two_collectives_before_phase_a(tiny_model, layout):
    """TP=2: the two ranks are one data-parallel rank, nothing to exchange; FSDP=2: the one exchange."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh)")
    pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh)")
    results = run_ranks(_titan_body, str(tiny_model("qwen3")), layout, world=2)
    print(f"before phase A [torchtitan {layout}]:", [[c["at_a"] for c in results[r]["counts"]] for r in range(2)])
    for rank in range(2):
        assert results[rank]["groups"] > 0, "reuse ran"
        for counts in results[rank]["counts"]:
            assert counts["at_a"] is not None and counts["at_a"] <= 2, (layout, rank, counts)
