"""The trainer mode's _balance_batch on a KVBatchMeta: shuffled groups and verl's padding samples."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta

from verl_prefix.backend import trainer as trainer_module
from verl_prefix.backend.trainer import PrefixPPOTrainer


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
