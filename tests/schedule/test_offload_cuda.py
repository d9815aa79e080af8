"""``dormant_prefix=offload`` on a real accelerator: the CUDA side of ``HostOffload`` (pinned host memory, the
side stream, events), which the CPU stand-in cannot reach. Skipped without a GPU; ``bench/gpu_check.sh``
runs this file with ``tests/backend/test_cuda.py`` on a lent one.

The residency claims are the CPU tests' (``test_dormant_policies.py::test_offload_residency``), read from the
same store log, plus the allocator's own view: the per-phase peaks of device memory (``PhaseMeter`` on CUDA)
must fall, against ``keep``, by about the bytes the store moved in phase B and by most of them in phase C.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import offload as O
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran
from helpers.schedule_runs import train_reuse
from test_dormant_policies import deep_model
from test_schedule_hf import dense_grads, weighted_loss, worst_relative

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule import dormant as D
from verl_prefix.schedule.telemetry import PhaseMeter

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs a CUDA GPU and VERL_PLATFORM=nvidia (the suite defaults verl to its CPU platform)",
)

LAYOUT = [(513, [16, 9, 4, 12])]  # P=512: the graph is tens of MiB, far above the allocator's rounding


def _run(model, layout, weights, policy, chunk):
    cuda = torch.device("cuda", torch.cuda.current_device())
    meter = PhaseMeter(cuda)
    O.RecordingStore.instances.clear()
    grads, plan = train_reuse(
        model,
        layout,
        weighted_loss([w.to(cuda) for w in weights]),
        rows=2,
        calculate_entropy=True,
        dormant=lambda: D.Dormant(policy, store_factory=O.RecordingStore),
        device=cuda,
        meter=meter,
        prefix_chunk_tokens=chunk,
    )
    assert len(plan.groups) == 1 and not plan.dense_rows  # reuse ran
    stores = list(O.RecordingStore.instances)
    return {n: g.cpu() for n, g in grads.items()}, meter, stores


@pytest.mark.parametrize("chunk", [None, 128], ids=["whole", "chunks-of-128"])
def test_offload_on_cuda(chunk):
    """fp64: exact against dense HF (on the CPU) at 1e-10; (a) no parameter bytes moved, (b) no storage
    twice, (c) nothing of the graph left in phase B and at most two layers (plus cos/sin) in phase C by the
    store's log; the allocator's phase-B peak is below keep's by at least 80% of the bytes moved, its
    phase-C peak below keep's by at least half of them."""
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    cpu_model = deep_model(torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(cpu_model, layout, weights, with_entropy=True)
        model = deep_model(torch.float64).cuda()
        keep_grads, keep_meter, _ = _run(model, layout, weights, "keep", chunk)
        got, meter, stores = _run(model, layout, weights, "offload", chunk)
    assert worst_relative(got, want) < 1e-10 and worst_relative(keep_grads, want) < 1e-10
    (store,) = stores
    found = O.claims(store, model)
    assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0
    assert 0 < found["resident_in_c"] <= found["bound_in_c"]
    moved_mib = store.offloaded_bytes / 2**20
    saved_b = keep_meter.peak_device_mib["B"] - meter.peak_device_mib["B"]
    saved_c = keep_meter.peak_device_mib["C"] - meter.peak_device_mib["C"]
    print(
        f"offload on CUDA (chunk={chunk}): moved {moved_mib:.1f} MiB, store peak in C "
        f"{found['resident_in_c'] / 2**20:.1f} MiB; allocator peak keep/offload B "
        f"{keep_meter.peak_device_mib['B']:.1f}/{meter.peak_device_mib['B']:.1f} MiB, C "
        f"{keep_meter.peak_device_mib['C']:.1f}/{meter.peak_device_mib['C']:.1f} MiB"
    )
    assert saved_b >= 0.8 * moved_mib
    assert saved_c >= 0.5 * moved_mib if chunk is None else saved_c >= 0


def test_offload_under_fsdp2_on_cuda(tiny_model):
    """Through the engine on CUDA (FSDP2 unshards into ``nn.Parameter``s; ``linear`` saves ``weight.t()``):
    no parameter bytes move, and the update matches the stock engine at fp64 1e-10 with reuse running."""
    model_dir = tiny_model("qwen3", num_layers=4)
    batch = grpo_batches.make_grpo_batch(
        num_groups=3, group_size=4, prompt_lens=[9, 5, 12], response_len_range=(1, 7), vocab_size=128, seed=3
    )
    stock, s_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    prefix.dormant_prefix = "offload"
    prefix.offload_store_factory = O.RecordingStore  # the real CUDA store, with its log on
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(stock, s_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    assert_reuse_ran(got["metrics"], groups=3)
    assert worst_relative(got["grads"], want["grads"]) < 1e-10
    assert len(O.RecordingStore.instances) == 3
    for store in O.RecordingStore.instances:
        assert store.device.type == "cuda"
        found = O.claims(store, prefix.module)
        assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0


def test_offload_pinned_slabs_on_cuda():
    """Issue 27 item 3 on the device: the store copies into slabs page-locked with ``cudaHostRegister`` (pinned,
    so the side stream's copies are asynchronous), none of them through torch's caching host allocator (its
    allocated bytes do not move); the pool peaks within 1.25x the offloaded bytes plus one slab, and ``release``
    unpins and frees all of it. Exact against dense HF at fp64 1e-10."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    pool = D.PinnedPool(pin=True, slab_bytes=2**22)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    host_before = stats()["allocated_bytes.current"] if stats is not None else None
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        want = dense_grads(deep_model(torch.float64), layout, weights, with_entropy=True)
        got, _ = train_reuse(
            deep_model(torch.float64).cuda(),
            layout,
            weighted_loss([w.to(cuda) for w in weights]),
            rows=2,
            calculate_entropy=True,
            dormant=lambda: D.Dormant("offload", store_factory=lambda device: O.RecordingStore(device, pool=pool)),
            device=cuda,
        )
    assert worst_relative({n: g.cpu() for n, g in got.items()}, want) < 1e-10
    (store,) = O.RecordingStore.instances
    assert store.offloaded_bytes <= pool.peak_bytes <= 1.25 * store.offloaded_bytes + pool.slab_bytes
    assert pool.free_slabs and all(slab.is_pinned() for slab in pool.free_slabs)
    if host_before is not None:
        assert stats()["allocated_bytes.current"] == host_before, stats()
    print(
        f"offload pinned slabs: moved {store.offloaded_bytes / 2**20:.1f} MiB, pool peak {pool.peak_bytes / 2**20:.1f}"
    )
    assert pool.release() > 0 and pool.held_bytes == 0
