"""The trainer mode's _balance_batch on a KVBatchMeta: shuffled groups and verl's padding samples."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta

from verl_prefix.backend.trainer import modes as trainer_module
from verl_prefix.backend.trainer.modes import PrefixPPOTrainer


def make_trainer(dp_size: int, mini_batch_prompts: int, n: int, prefix_reuse: dict | None = None) -> PrefixPPOTrainer:
    trainer = PrefixPPOTrainer.__new__(PrefixPPOTrainer)  # the Ray-free part of the trainer only
    actor = {"ppo_mini_batch_size": mini_batch_prompts, **({"prefix_reuse": prefix_reuse} if prefix_reuse else {})}
    trainer.config = OmegaConf.create(
        {"actor_rollout_ref": {"actor": actor, "rollout": {"n": n}}, "trainer": {"critic_warmup": 0}}
    )
    trainer.use_critic = False
    trainer.global_steps = 1
    trainer.tokenizer = SimpleNamespace(eos_token_id=3)
    ranks = [r for r in range(dp_size) for _ in range(2)]  # two workers per dp rank (e.g. tp=2)
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": ranks})
    return trainer


def make_batch(groups: list[tuple[str, int, list[int]]], shuffle_seed: int | None = None):
    keys, tags, uids = [], [], []
    for uid, prompt_len, responses in groups:
        for i, s in enumerate(responses):
            keys.append(f"{uid}_{i}_0")
            tags.append({"prompt_len": prompt_len, "response_len": s, "seq_len": prompt_len + s})
            uids.append(uid)
    if shuffle_seed is not None:
        perm = list(range(len(keys)))
        random.Random(shuffle_seed).shuffle(perm)
        keys, tags, uids = [keys[i] for i in perm], [tags[i] for i in perm], [uids[i] for i in perm]
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train"), dict(zip(keys, uids))


def fake_store(monkeypatch, uid_of: dict, prompt_of: dict | None = None):
    def kv_batch_get(keys, partition_id, select_fields):
        assert select_fields == (["uid", "prompts"] if prompt_of is not None else ["uid"])
        out = {"uid": np.array([uid_of[k] for k in keys], dtype=object)}
        if prompt_of is not None:  # jagged, as TransferQueue hands it back
            rows = [prompt_of.get(k, torch.tensor([1, 2])) for k in keys]
            out["prompts"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        return out

    def upsample(batch, multiple, eos_token_id):
        missing = -len(batch) % multiple
        pad = [f"pad_{i}_0" for i in range(missing)]
        uid_of.update({k: "pad" for k in pad})
        tags = [{"prompt_len": 2, "response_len": 1, "seq_len": 3, "is_padding": True} for _ in pad]
        return KVBatchMeta(keys=batch.keys + pad, tags=batch.tags + tags, partition_id=batch.partition_id)

    monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)
    monkeypatch.setattr(trainer_module, "upsample_batch_to_divisible_size", upsample)


def rank_blocks(batch, uid_of, dp_size):
    size = len(batch) // dp_size
    return [[uid_of[k] for k in batch.keys[r * size : (r + 1) * size]] for r in range(dp_size)]


def test_shuffled_groups_land_whole_on_one_rank(monkeypatch):
    groups = [(f"u{g}", 100 + 37 * g, [10 + 5 * ((g + i) % 4) for i in range(4)]) for g in range(8)]
    batch, uid_of = make_batch(groups, shuffle_seed=0)
    fake_store(monkeypatch, uid_of)
    metrics: dict = {}
    out = make_trainer(dp_size=2, mini_batch_prompts=4, n=4)._balance_batch(batch, metrics)
    assert len(out) == 32
    for block in rank_blocks(out, uid_of, 2):
        for mini_batch in (block[:8], block[8:]):  # 2 mini-batches of 8 per rank
            assert all(mini_batch.count(u) == 4 for u in set(mini_batch))
    assert metrics["actor/prefix/balance/split_groups"] == 0.0
    assert metrics["actor/prefix/balance/groups"] == 8.0


def test_padding_samples_fill_a_batch_whose_groups_do_not_divide_the_ranks(monkeypatch):
    groups = [(f"u{g}", 50 + g, [7, 9, 11, 13]) for g in range(3)]  # 12 samples, 2 ranks x mini-batch 8
    batch, uid_of = make_batch(groups)
    fake_store(monkeypatch, uid_of)
    metrics: dict = {}
    out = make_trainer(dp_size=2, mini_batch_prompts=4, n=4)._balance_batch(batch, metrics)
    assert len(out) == 16
    blocks = rank_blocks(out, uid_of, 2)
    assert sorted(block.count("pad") for block in blocks) == [0, 4]
    for block in blocks:
        assert all(block.count(u) == 4 for u in set(block) if u != "pad")
    assert metrics["actor/prefix/balance/split_groups"] == 0.0


def test_with_the_tree_groups_sharing_a_system_prompt_land_on_one_rank(monkeypatch):
    # 8 groups, two system prompts alternating: by length alone each rank would hold both
    groups = [(f"u{g}", 40 + 6 + g, [10 + i for i in range(4)]) for g in range(8)]
    batch, uid_of = make_batch(groups)
    gen = torch.Generator().manual_seed(0)
    systems = [torch.randint(10, 100, (40,), generator=gen) for _ in range(2)]
    prompts = {f"u{g}": torch.cat([systems[g % 2], torch.randint(10, 100, (6 + g,), generator=gen)]) for g in range(8)}
    prompt_of = {k: prompts[u] for k, u in uid_of.items()}
    fake_store(monkeypatch, uid_of, prompt_of)
    metrics: dict = {}
    tree = {"tree": True, "min_shared_tokens": 32}
    out = make_trainer(dp_size=2, mini_batch_prompts=8, n=4, prefix_reuse=tree)._balance_batch(batch, metrics)
    systems_per_rank = [{int(u[1:]) % 2 for u in block} for block in rank_blocks(out, uid_of, 2)]
    assert sorted(map(sorted, systems_per_rank)) == [[0], [1]]
    assert metrics["actor/prefix/balance/shared_roots"] == 2.0
    assert metrics["actor/prefix/balance/shared_root_slots"] == 2.0


# -- every trainer mode: selecting a prefix engine is enough -------------------------------------------------------


def _stock_trainer(cls, strategy: str, dp_size: int = 2, mini_batch_prompts: int = 4, n: int = 4):
    """A verl trainer of ``cls`` (Ray-free part only), its actor on ``strategy``."""
    trainer = cls.__new__(cls)
    template = make_trainer(dp_size, mini_batch_prompts, n)
    trainer.__dict__.update(template.__dict__)
    trainer.config.actor_rollout_ref.actor.strategy = strategy
    return trainer


def _v1_modes():
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    return {
        "sync": PPOTrainerSync,
        "colocate_async": PPOTrainerColocateAsync,
        "separate_async": PPOTrainerSeparateAsync,
    }


def test_every_v1_trainer_mode_keeps_groups_whole_for_a_prefix_engine(monkeypatch):
    """sync, colocate_async and separate_async run one ``_balance_batch`` (their base class's): with
    ``strategy=prefix_fsdp2`` (or ``prefix_torchtitan``) it packs whole groups, reported with split_groups."""
    groups = [(f"u{g}", 100 + 37 * g, [10 + 5 * ((g + i) % 4) for i in range(4)]) for g in range(8)]
    for mode, cls in _v1_modes().items():
        for strategy in ("prefix_fsdp2", "prefix_torchtitan"):
            batch, uid_of = make_batch(groups, shuffle_seed=1)
            fake_store(monkeypatch, uid_of)
            metrics: dict = {}
            out = _stock_trainer(cls, strategy)._balance_batch(batch, metrics)
            for block in rank_blocks(out, uid_of, 2):
                for mini_batch in (block[:8], block[8:]):
                    assert all(mini_batch.count(u) == 4 for u in set(mini_batch)), (mode, strategy)
            assert metrics["actor/prefix/split_groups"] == 0.0, mode


def test_a_stock_engine_gets_verls_own_balancing_unchanged(monkeypatch):
    """Without a prefix engine the wrapper calls verl's method: verl's length balancing (which splits groups) and
    its metrics, none of ours."""
    from verl.trainer.ppo.v1 import trainer_base

    groups = [(f"u{g}", 100 + 37 * g, [10 + 5 * ((g + i) % 4) for i in range(4)]) for g in range(8)]
    batch, uid_of = make_batch(groups, shuffle_seed=1)
    fake_store(monkeypatch, uid_of)
    monkeypatch.setattr(trainer_base, "upsample_batch_to_divisible_size", lambda b, m, eos: b)
    metrics: dict = {}
    out = _stock_trainer(_v1_modes()["sync"], "fsdp2")._balance_batch(batch, metrics)
    assert not any(k.startswith("actor/prefix") for k in metrics)
    assert any(k.startswith("global_seqlen") for k in metrics)
    split = [u for block in rank_blocks(out, uid_of, 2) for u in set(block) if block.count(u) != 4]
    assert split, "verl's own balancing splits these groups (the wrapper must not have changed it)"


def test_a_stock_twin_can_ask_for_whole_groups(monkeypatch):
    """``+trainer.v1.keep_groups_for_stock_engine=true``: a stock engine's run balanced like a reuse run, so an A/B
    twin trains on the same mini-batches."""
    groups = [(f"u{g}", 100 + 37 * g, [10 + 5 * ((g + i) % 4) for i in range(4)]) for g in range(8)]
    batch, uid_of = make_batch(groups, shuffle_seed=1)
    fake_store(monkeypatch, uid_of)
    trainer = _stock_trainer(_v1_modes()["sync"], "fsdp2")
    trainer.config.trainer.v1 = {"keep_groups_for_stock_engine": True}
    metrics: dict = {}
    out = trainer._balance_batch(batch, metrics)
    for block in rank_blocks(out, uid_of, 2):
        assert all(block.count(u) == 4 for u in set(block))
    assert metrics["actor/prefix/split_groups"] == 0.0


def test_prefix_sync_with_a_stock_engine_refuses_to_start():
    from omegaconf import OmegaConf

    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "fsdp2"}}, "trainer": {"v1": {}}})
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.strategy=prefix_fsdp2"):
        PrefixPPOTrainer(config)


def test_legacy_trainer_keeps_groups_whole_for_a_prefix_engine():
    """``trainer.use_v1=false`` (verl's ``RayPPOTrainer``, a ``DataProto`` balanced in place): whole groups per
    rank with a prefix engine; verl's own balancing without one."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    gen = torch.Generator().manual_seed(0)
    uids, prompts_len, response_len = [], [], []
    for g in range(8):
        for i in range(4):
            uids.append(f"u{g}")
            prompts_len.append(5 + 3 * g)
            response_len.append(1 + (g * 7 + i * 3) % 9)
    order = torch.randperm(len(uids), generator=gen).tolist()
    uids = [uids[i] for i in order]
    prompts_len = [prompts_len[i] for i in order]
    response_len = [response_len[i] for i in order]
    width_p, width_r = max(prompts_len), max(response_len)

    def batch():
        mask = torch.zeros(len(uids), width_p + width_r, dtype=torch.long)
        for row, (p, r) in enumerate(zip(prompts_len, response_len)):
            mask[row, width_p - p : width_p + r] = 1
        tensors = {
            "attention_mask": mask,
            "prompts": torch.randint(3, 100, (len(uids), width_p), generator=gen),
            "responses": torch.randint(3, 100, (len(uids), width_r), generator=gen),
        }
        return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(uids, dtype=object)})

    def run(strategy: str) -> tuple[list[list[str]], dict]:
        trainer = RayPPOTrainer.__new__(RayPPOTrainer)
        trainer.config = OmegaConf.create(
            {"actor_rollout_ref": {"actor": {"strategy": strategy, "ppo_mini_batch_size": 4}, "rollout": {"n": 4}}}
        )
        trainer.actor_rollout_wg = SimpleNamespace()
        trainer._get_dp_size = lambda worker_group, role: 2
        data, metrics = batch(), {}
        trainer._balance_batch(data, metrics)
        got = [str(u) for u in data.non_tensor_batch["uid"]]
        return [got[:16], got[16:]], metrics

    blocks, metrics = run("prefix_fsdp2")
    for block in blocks:
        for mini_batch in (block[:8], block[8:]):
            assert all(mini_batch.count(u) == 4 for u in set(mini_batch))
    assert metrics["actor/prefix/split_groups"] == 0.0
    blocks, metrics = run("fsdp2")
    assert not any(k.startswith("actor/prefix") for k in metrics)
    assert any(block.count(u) != 4 for block in blocks for u in set(block))
