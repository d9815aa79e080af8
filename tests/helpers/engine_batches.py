"""The mini-batches the engine-against-engine tests share (TorchTitan's schedule test, the Megatron engine test):
two groups of four behind one system block, responses branching after a short stem, and under data parallelism a
second rank with one group and four singletons; the phase-C negative control; a Megatron train step with its
``main_grad``s and the comparison of two steps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from helpers.reuse import reduced

VOCAB = 128


def shared_system_batch(dp_rank: int, data_parallel: bool, even: bool = False, aligned: int = 1):
    """Two groups of four sharing an 8-token system block, responses branching after a 2-token stem (what the
    tree computes once); under data parallelism rank 1 holds one group and four singletons (lockstep fillers,
    dense rows). ``even``: every four-row micro-batch of a rank's rows packs to an even length (what verl's engine
    needs under torchtitan's TP x EP, which splits a packed sequence over two TP ranks). ``aligned``: every row's
    length a multiple of it (verl's Megatron engine under sequence parallelism then pads no row, whose padding its
    MoE routers would count)."""
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import grpo_batches

    shape = dict(
        response_len_range=(3, 7), vocab_size=VOCAB, use_kl=True, shared_system=8, response_stems=(2,),
        length_multiple=aligned,
    )  # fmt: skip
    if not data_parallel:
        for seed in range(7, 107):
            batch = grpo_batches.make_grpo_batch(num_groups=2, group_size=4, prompt_lens=[4, 2], seed=seed, **shape)
            lengths = batch["input_ids"].offsets().diff()
            if not even or all(int(lengths[i : i + 4].sum()) % 2 == 0 for i in range(0, len(batch), 4)):
                return batch
        raise AssertionError("no batch with even micro-batches")
    if dp_rank == 0:
        return grpo_batches.make_grpo_batch(
            num_groups=2, group_size=4, prompt_lens=[4, 2], seed=8, global_batch_size=16, **shape
        )
    group = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=4, prompt_lens=3, seed=9, global_batch_size=16, **shape
    )
    singles = grpo_batches.make_grpo_batch(
        num_groups=4, group_size=1, prompt_lens=2, response_len_range=(2, 4), vocab_size=VOCAB, seed=10, use_kl=True,
        global_batch_size=16, length_multiple=aligned,
    )  # fmt: skip
    return tu.concat_tensordict([group, singles])


@contextlib.contextmanager
def phase_c_skipped() -> Iterator[None]:
    """Negative control: phase C of every node (the tree's too, a chunk's seeded backward) does nothing."""
    from verl_prefix.schedule import executor

    saved = executor.prefix_backward, executor.seeded_backward
    executor.prefix_backward = executor.seeded_backward = lambda *args, **kwargs: None
    try:
        yield
    finally:
        executor.prefix_backward, executor.seeded_backward = saved


@contextlib.contextmanager
def titan_phase_c_not_crossing() -> Iterator[None]:
    """Negative control under torchtitan's pipeline stages: each stage's phase C seeded by its own leaves only, the
    gradient the next stage sends back for a node's output received (the sends stay matched) and dropped."""
    import torch

    from verl_prefix.backend.distributed.stages import StageHandoff

    roots = StageHandoff.roots
    StageHandoff.roots = lambda self: [(out, torch.zeros_like(grad)) for out, grad in roots(self)]
    try:
        yield
    finally:
        StageHandoff.roots = roots


def megatron_train_step(engine, loss_fn, batch) -> dict:
    """verl's train step with every parameter's ``main_grad`` read just before the optimizer step."""
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import main_grads

    grads: dict = {}
    step = engine.optimizer_step
    engine.optimizer_step = lambda: grads.update(main_grads(engine)) or step()
    try:
        out = verl_engine.run_train_step(engine, loss_fn, batch)
    finally:
        engine.__dict__.pop("optimizer_step", None)
    return {**out, "grads": grads}


def megatron_counted_step(engine, loss_fn, batch) -> dict:
    """A train step from zero expert counts and biases (a step moves the bias, lr or not): ``counts``, what
    ``finalize_model_grads`` moved each expert-biased router's bias by (all-reduced), and ``bias`` after."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function

    routers = [m for m in engine.module[0].modules() if getattr(m, "enable_expert_bias", False)]
    for router in routers:  # every step from the same state: no counts yet, the checkpoint's bias (zeros)
        router.local_tokens_per_expert.zero_()
        router.expert_bias.zero_()
    recorded: list = []
    stock = finalize.get_updated_expert_bias

    def record(tokens_per_expert, expert_bias, rate):
        updated = stock(tokens_per_expert, expert_bias, rate)  # all-reduces the counts in place
        recorded.append(tokens_per_expert.clone())
        return updated

    finalize.get_updated_expert_bias = record
    try:
        step = megatron_train_step(engine, loss_fn, batch)
    finally:
        finalize.get_updated_expert_bias = stock
    return {**step, "counts": recorded, "bias": [r.expert_bias.clone() for r in routers]}


def compare_steps(want: dict, got: dict) -> dict:
    """Two train steps' gradients (``grads``: the worst parameter's relative error, its name, how many), losses,
    grad norms, and the second one's reduced metrics."""
    errors = {n: ((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items() if g.norm() > 0}
    name = max(errors, key=errors.get)
    return {
        "worst": errors[name],
        "name": name,
        "grads": len(errors),
        "loss": (want["loss"], got["loss"]),
        "grad_norm": (want["grad_norm"], got["grad_norm"]),
        "metrics": reduced(got["metrics"]),
    }


@contextlib.contextmanager
def suffix_rope_late() -> Iterator[None]:
    """Negative control: every call that starts past position 0 (phase B, later chunks and nodes) is embedded one
    position late (a shift of every call alike would change nothing: RoPE is relative)."""
    from verl_prefix.backend.megatron import causal_lm

    saved = causal_lm.call_offset
    causal_lm.call_offset = lambda positions: (lambda o: o + 1 if o else o)(saved(positions))
    try:
        yield
    finally:
        causal_lm.call_offset = saved


# prefix_megatron's knob cases against one stock step: name -> (reuse knobs, dormant policy)
MEGATRON_CASES = {
    "one_level": (dict(), "keep"),
    "tree": (dict(tree=True, min_shared_tokens=4), "keep"),
    "chunked": (dict(prefix_chunk_tokens=4), "keep"),
    "merged": (dict(phase_b_attention="merged"), "keep"),
    "recompute": (dict(), "recompute"),
}


def inferred(result: dict) -> dict:
    """What a forward-only comparison reads of ``verl_engine.run_infer``'s result."""
    return {k: result[k] for k in ("response_log_probs", "response_entropy", "metrics")}


def megatron_cases(
    stock, prefix, loss_fn, batch, base, cases: dict, controls: dict[str, Callable], controlled=("one_level", "tree")
) -> dict:
    """prefix_megatron (its ``reuse_config`` from ``base``) against one stock step and forward-only pass on
    ``batch``, per case of ``cases`` (name -> (knobs, dormant policy)); in the ``controlled`` cases each negative
    control of ``controls`` (name -> a context manager factory) runs one more step, recorded as its worst error."""
    import dataclasses

    from verl_prefix.harness import verl_engine

    want = megatron_train_step(stock, loss_fn, batch)
    want_infer = inferred(verl_engine.run_infer(stock, batch))
    out: dict = {}
    for case, (knobs, dormant) in cases.items():
        prefix.reuse_config, prefix.dormant_prefix = dataclasses.replace(base, **knobs), dormant
        got = megatron_train_step(prefix, loss_fn, batch)
        out[case] = {**compare_steps(want, got), "infer": (want_infer, inferred(verl_engine.run_infer(prefix, batch)))}
        for control, context in controls.items() if case in controlled else ():
            with context():
                wrong = compare_steps(want, megatron_train_step(prefix, loss_fn, batch))
            out[case][control], out[case][f"{control}_name"] = wrong["worst"], wrong["name"]
    return out
