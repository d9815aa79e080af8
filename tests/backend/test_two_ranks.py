"""Two data-parallel ranks (gloo, FSDP2 sharded over both) whose mini-batches have different group
structure: reuse must keep collectives in lockstep and still give the stock engine's gradients."""

from __future__ import annotations

import pytest
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_no_reuse, assert_reuse_ran

VOCAB = 128


def _rank_batch(rank: int):
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import grpo_batches

    if rank == 0:  # two groups of four
        return grpo_batches.make_grpo_batch(
            num_groups=2,
            group_size=4,
            prompt_lens=[9, 5],
            response_len_range=(1, 6),
            vocab_size=VOCAB,
            seed=11,
            global_batch_size=16,
        )
    # one group of four plus four singletons with a short prompt: one reuse group and two dense chunks
    group = grpo_batches.make_grpo_batch(
        num_groups=1,
        group_size=4,
        prompt_lens=12,
        response_len_range=(1, 6),
        vocab_size=VOCAB,
        seed=12,
        global_batch_size=16,
    )
    singles = grpo_batches.make_grpo_batch(
        num_groups=4,
        group_size=1,
        prompt_lens=3,
        response_len_range=(2, 4),
        vocab_size=VOCAB,
        seed=13,
        global_batch_size=16,
    )
    return tu.concat_tensordict([group, singles])


def _body(rank: int, model_dir: str, mixed_fallback: bool) -> dict:
    from helpers.precision import promote_fp32_upcasts
    from verl.utils import tensordict_utils as tu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine

    batch = _rank_batch(rank)
    if mixed_fallback and rank == 1:  # only this rank's batch asks for something reuse does not cover
        tu.assign_non_tensor(batch, calculate_sum_pi_squared=True)
    kwargs = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=False, entropy_coeff=0.01)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=4)
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
        got_infer = verl_engine.run_infer(prefix, batch)
        want_infer = verl_engine.run_infer(dense, batch)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    lp = (got_infer["response_log_probs"].values() - want_infer["response_log_probs"].values()).abs().max()
    return {
        "worst": worst,
        "infer": lp.item(),
        "metrics": got["reduced_metrics"],
        "infer_metrics": verl_engine.reduce_step_metrics(got_infer["metrics"]),
    }


@pytest.mark.parametrize(
    "mixed_fallback, tied",
    [(False, False), (False, True), (True, False)],
    ids=["reuse", "reuse-tied-embeddings", "one-rank-falls-back"],
)
def test_two_ranks_with_different_group_structure(tiny_model, mixed_fallback, tied):
    """``tied``: the LM head is the embedding matrix, sharded over both ranks; its gradient sums the head's
    (phase B) and the embedding's (phases A and B) contributions, reduce-scattered once."""
    model_dir = tiny_model("qwen3", tie_word_embeddings=True) if tied else tiny_model("qwen3")
    results = run_two_ranks(_body, str(model_dir), mixed_fallback)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10
        assert results[rank]["infer"] < 1e-10
    if mixed_fallback:  # both ranks ran dense, each saying why
        assert results[1]["metrics"]["prefix/fallback_sum_pi_squared"] == 8.0
        assert results[0]["metrics"]["prefix/fallback_peer_fallback"] == 8.0
        for rank in range(2):
            assert_no_reuse(results[rank]["metrics"])
    else:
        assert results[1]["metrics"]["prefix/fallback_short_prefix"] == 4.0
        for rank, groups in ((0, 2), (1, 1)):  # rank 1: one group reused, four singletons dense
            assert_reuse_ran(results[rank]["metrics"], groups=groups)
            assert_reuse_ran(results[rank]["infer_metrics"], groups=groups)
        # rank 0 fills in for rank 1's two dense chunks, rank 1 for rank 0's second group: both are counted
        for rank in range(2):
            assert results[rank]["metrics"]["prefix/time_s/lockstep"] > 0, rank


pytestmark = pytest.mark.timeout(600)
