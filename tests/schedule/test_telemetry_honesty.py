"""Telemetry that tells the truth: verl's own lifetime peak survives the per-phase resets, phases are
timed by device events with one synchronisation per mini-batch, and saved-for-backward bytes count what
autograd holds under non-reentrant activation checkpointing (no GPU here: the accelerator module is a fake)."""

from __future__ import annotations

import torch
from helpers.layouts import make_layout, token_weights
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Qwen3Config
from verl.plugin.platform.platform_cuda import PlatformCUDA

from verl_prefix.schedule.executor import train_group
from verl_prefix.schedule.grouping import plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter, SavedBytes

MIB = 1024**2


class FakeAccelerator:
    """Stands in for ``torch.cuda``: an allocator whose usage the test drives, events on a fake clock that
    can only be read after a synchronisation later than their record, and a count of synchronisations."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.clock_ms = 0.0
        self.syncs = 0
        self.records = 0
        self.synced_records = 0  # events recorded before the last synchronisation
        self.resets = 0

    def use(self, allocated_mib: float, reserved_mib: float | None = None) -> None:
        self.allocated = int(allocated_mib * MIB)
        self.reserved = int((reserved_mib if reserved_mib is not None else allocated_mib) * MIB)
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def synchronize(self, device=None) -> None:
        self.syncs += 1
        self.synced_records = self.records

    def current_device(self) -> int:
        return 0

    def Event(self, enable_timing: bool = False):  # noqa: N802 - torch.cuda.Event's spelling
        fake = self

        class Event:
            def record(self, stream=None) -> None:
                assert enable_timing
                fake.records += 1
                self.order, self.ms = fake.records, fake.clock_ms

            def elapsed_time(self, end) -> float:
                assert end.order <= fake.synced_records, "event read before a synchronisation"
                return end.ms - self.ms

        return Event()


def fake_cuda(monkeypatch) -> FakeAccelerator:
    fake = FakeAccelerator()
    monkeypatch.setattr(torch, "cuda", fake)
    return fake


def verl_reads_peaks() -> tuple[float, float]:
    """What verl 0.9.1 logs after an update (``engine_workers._postprocess_output``):
    ``get_torch_device().max_memory_allocated()``/``max_memory_reserved()`` on the CUDA platform, in MiB."""
    module = PlatformCUDA().device_module
    return module.max_memory_allocated() / MIB, module.max_memory_reserved() / MIB


# phase, MiB allocated at the phase's peak, MiB allocated at its end, fake device milliseconds
MINI_BATCH = [("A", 70, 40, 5.0), ("B", 90, 45, 7.0), ("B", 60, 45, 11.0), ("C", 50, 20, 13.0)]


def run_mini_batch(fake: FakeAccelerator, meter: PhaseMeter) -> dict[str, float]:
    for phase, peak_mib, end_mib, ms in MINI_BATCH:
        with meter.phase(phase):
            fake.use(peak_mib, reserved_mib=peak_mib + 8)
            fake.use(end_mib, reserved_mib=peak_mib + 8)
            fake.clock_ms += ms
    return meter.metrics(logical_tokens=10, physical_tokens=5)


def test_verl_lifetime_peak_survives_per_phase_resets(monkeypatch):
    fake = fake_cuda(monkeypatch)
    fake.use(120, reserved_mib=150)  # an earlier step's peak (e.g. the optimizer's first step)...
    fake.use(10)  # ...since freed
    metrics = run_mini_batch(fake, PhaseMeter(torch.device("cuda", 0)))
    assert fake.resets == len(MINI_BATCH)  # each phase's peak is its own
    fake.use(30)  # after the mini-batch (verl's optimizer step): below the lifetime peak
    assert verl_reads_peaks() == (120, 150)
    # a phase above the earlier peak raises the lifetime figure
    fake.use(200, reserved_mib=150)
    fake.use(10)
    run_mini_batch(fake, PhaseMeter(torch.device("cuda", 0)))
    assert verl_reads_peaks() == (200, 150)
    # per-phase peaks are still the phases' own
    assert {p: metrics[f"prefix/max_peak_device_mib/{p}"] for p in "ABC"} == {"A": 70, "B": 90, "C": 50}
    # a reset by anyone else (verl's reset_memory_stats, bench) starts a new lifetime, as it would without us
    torch.cuda.reset_peak_memory_stats()
    assert verl_reads_peaks() == (20, 58)  # what the last phase left allocated and reserved


def test_one_device_synchronisation_per_mini_batch_and_times_from_events(monkeypatch):
    fake = fake_cuda(monkeypatch)
    meter = PhaseMeter(torch.device("cuda", 0))
    for phase, peak_mib, _end_mib, ms in MINI_BATCH * 5:  # 20 phases
        with meter.phase(phase):
            fake.use(peak_mib)
            fake.clock_ms += ms
    assert fake.syncs == 0  # nothing waits for the device while the phases run
    metrics = meter.metrics(logical_tokens=10, physical_tokens=5)
    assert fake.syncs == 1
    assert fake.records == 2 * len(MINI_BATCH) * 5
    # the fake clock advanced only inside the phases and only events read it
    want = {"A": 5 * 5.0, "B": 5 * (7.0 + 11.0), "C": 5 * 13.0}
    for phase, ms in want.items():
        assert abs(metrics[f"prefix/time_s/{phase}"] - ms / 1000) < 1e-12
    assert abs(metrics["prefix/time_s/schedule"] - sum(want.values()) / 1000) < 1e-12
    # reading again (verl's dense fallback meter, a second reader) adds nothing and waits for nothing new
    assert meter.metrics(logical_tokens=10, physical_tokens=5)["prefix/time_s/A"] == metrics["prefix/time_s/A"]
    assert fake.syncs == 1


# -- saved for backward under non-reentrant activation checkpointing --------------------------------

LAYERS = 4


def qwen3(checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config).float().train()
    if checkpointing:  # as verl enables it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class LiveStorages(TorchDispatchMode):
    """Hook-free reference: every storage an op creates inside the block, weakly; ``held()`` is the bytes
    still alive, less the parameters' storages (views of weights are made inside the block too)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int, int]] = []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out

    def held(self, *excluding: torch.Tensor) -> int:
        skip = self.params | {t.untyped_storage().data_ptr() for t in excluding}
        alive = {ptr: n for ref, ptr, n in self.refs if not ref.expired() and ptr not in skip}
        return sum(alive.values())


def largest_layer_saves(ids: torch.Tensor) -> int:
    """What one decoder layer saves for backward without checkpointing (so what its recompute
    rematerialises), its input and position embeddings excluded: measured layer by layer, hook-free."""
    model = qwen3(checkpointing=False)
    hidden = torch.randn(*ids.shape, model.config.hidden_size, requires_grad=True)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
    most = 0
    for layer in model.model.layers:
        live = LiveStorages(model)
        with live:
            out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
        most = max(most, live.held(out))
        del out
    return most


def test_saved_bytes_count_checkpointed_layers_inputs_and_their_recompute():
    ids = torch.randint(0, 101, (2, 64))
    model = qwen3(checkpointing=True)
    live = LiveStorages(model)
    saved = SavedBytes(model)
    with saved.counting(), live:
        loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()
    held_after_forward = live.held(loss)
    recompute = largest_layer_saves(ids)
    # the checkpoint saves each layer's input through the ambient hook: 4 x 2 x 64 x 64 x 4 bytes of the
    # 290 KiB held; what is left uncounted is the closure's RoPE cos/sin (2 x 64 x 16 x 4 bytes)
    assert held_after_forward >= LAYERS * ids.numel() * 64 * 4
    assert abs(saved.bytes - held_after_forward) <= 0.03 * held_after_forward, (saved.bytes, held_after_forward)
    # backward rematerialises one layer at a time: the largest is what comes on top
    assert abs(saved.recompute_bytes - recompute) <= 0.03 * recompute, (saved.recompute_bytes, recompute)
    assert abs(saved.total - (held_after_forward + recompute)) <= 0.03 * (held_after_forward + recompute)
    loss.backward()


def meter_of_schedule(checkpointing: bool) -> PhaseMeter:
    model = qwen3(checkpointing)
    layout = make_layout([(48, [40, 40])])
    weights = token_weights(layout, torch.float32)
    plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
    meter = PhaseMeter(torch.device("cpu"), model=model)

    def loss_fn(rows, log_probs, entropy):
        return sum((lp * weights[i]).sum() for i, lp in zip(rows, log_probs))

    train_group(model, layout, plan.groups[0], loss_fn, ScheduleOptions(device=torch.device("cpu"), meter=meter))
    return meter


def test_schedule_phases_under_checkpointing_hold_at_least_one_layer():
    """Without checkpointing phase B holds what sits outside the layers plus every layer's saves; with it,
    the inputs plus the largest layer's recompute: at least 1/LAYERS of the plain figure, and less than
    all of it (checkpointing does save memory)."""
    plain, ckpt = meter_of_schedule(False), meter_of_schedule(True)
    for phase in ("A", "B"):
        assert plain.saved_mib[phase] / LAYERS <= ckpt.saved_mib[phase] < plain.saved_mib[phase], phase
    assert ckpt.peak_held_saved_mib >= ckpt.saved_mib["A"]
