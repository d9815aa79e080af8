"""Dormant-prefix memory policies: where a group's phase-A graph waits while its suffixes run (phase B).

``keep`` holds phase A's graph (every activation it saved for backward) on the device from A to C.
``recompute`` runs phase A without a graph (no_grad: only the K/V, and the MoE router-probability sums,
are kept as boundary tensors), then phase C re-runs the prefix forward with grad, checks that it gives
back the K/V phase B attended to, and backpropagates the accumulated dK/dV through it: one more prefix
forward, and only the K/V sit in memory during phase B. ``offload`` moves phase A's saved tensors to
host memory as autograd saves them (copies on a side stream, overlapped with compute) and prefetches
them back during the last suffix micro-batch's backward. ``auto`` (``choose_policy``) picks per group
the cheapest of these whose phase-B footprint fits a byte budget.

Forward-only passes (``infer_group``) keep only the K/V already: no policy applies there.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from verl_prefix.schedule.prefix_kv import PrefixKV

logger = logging.getLogger(__name__)

POLICIES = ("keep", "offload", "recompute")  # cheapest first: what ``auto`` tries in this order
KNOB_VALUES = ("keep", "recompute", "offload", "auto")
_MIB = 1024.0**2


def validate_policy(policy: object, budget_bytes: object = None) -> str:
    """The knob's value, or a ``ValueError`` a user can act on (``auto`` needs a budget)."""
    if policy not in KNOB_VALUES:
        raise ValueError(f"dormant_prefix={policy!r} is not supported; choose one of {KNOB_VALUES}")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1
    ):
        raise ValueError(
            f"dormant_prefix_budget_bytes must be a positive integer (bytes per device), got {budget_bytes!r}"
        )
    if policy == "auto" and budget_bytes is None:
        raise ValueError(
            "dormant_prefix=auto needs dormant_prefix_budget_bytes (bytes per device the prefix graph may hold)"
        )
    return policy


def refuse_offload_on(device: torch.device) -> None:
    """``offload`` moves saved tensors from the device to host memory; a CPU run has nowhere to move them."""
    if device.type == "cpu":
        raise ValueError(
            "dormant_prefix=offload moves phase A's saved tensors from the accelerator to pinned host memory; "
            "this run's device is the CPU, where they already are. Use keep or recompute."
        )


class DormantStats:
    """What ran per group and what it held, as ``prefix/`` metrics (per mini-batch, summed over groups)."""

    def __init__(self) -> None:
        self.policies: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.held_in_b: dict[str, int] = defaultdict(int)  # policy -> max bytes held for backward during B
        self.offloaded_bytes = 0
        self.recompute_max_diff = 0.0

    def note_group(self, policy: str, reason: str) -> None:
        self.policies[policy] += 1
        self.reasons[reason] += 1

    def note_held_in_b(self, policy: str, nbytes: int) -> None:
        self.held_in_b[policy] = max(self.held_in_b[policy], nbytes)

    def metrics(self) -> dict[str, float]:
        """``prefix/policy/<name>`` groups per policy, ``prefix/policy_reason/<why>``, and per policy the
        largest ``prefix/max_saved_for_backward_held_in_B_mib/<name>``: phase A's graph still held
        plus the suffix micro-batch's own (what a policy exists to shrink)."""
        out: dict[str, float] = {f"prefix/policy/{p}": float(n) for p, n in self.policies.items()}
        out.update({f"prefix/policy_reason/{r}": float(n) for r, n in self.reasons.items()})
        out.update({f"prefix/max_saved_for_backward_held_in_B_mib/{p}": b / _MIB for p, b in self.held_in_b.items()})
        if self.policies.get("offload"):
            out["prefix/offloaded_mib"] = self.offloaded_bytes / _MIB
        if self.policies.get("recompute"):
            out["prefix/max_recompute_kv_diff"] = self.recompute_max_diff
        return out


class HostOffload:
    """Saved-tensor store of ``offload``: pack copies a tensor to host memory (pinned, on a side stream
    where the device has streams), ``prefetch`` starts every copy back, unpack waits for its own.

    Parameters (and tensors not on ``device``) stay where they are: they outlive the graph anyway.
    With ``device`` = CPU, "host" is the CPU too: the copies are real and counted, which is how tests
    check the hook mechanics and exactness without an accelerator.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        accel = device.type in ("cuda", "npu", "xpu")
        self._module = torch.get_device_module(device.type) if accel else None
        self._stream = self._module.Stream(device=device) if accel else None
        self._pin = accel
        self.offloaded_bytes = 0
        self.restored_bytes = 0
        self._pending: list[dict] = []

    def _moves(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device and not isinstance(tensor, nn.Parameter) and tensor.numel() > 0

    def pack(self, tensor: torch.Tensor) -> object:
        if not self._moves(tensor):
            return tensor
        # same strides where the tensor is dense (backward kernels may sum in stride order)
        host = torch.empty_like(tensor, device="cpu", pin_memory=self._pin)
        entry = {"host": host, "device": None, "event": None}
        if self._stream is not None:
            self._stream.wait_stream(self._module.current_stream(self.device))
            with self._module.stream(self._stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)  # its memory is not reused before the copy ends
        else:
            host.copy_(tensor)
        self.offloaded_bytes += host.numel() * host.element_size()
        self._pending.append(entry)
        return entry

    def prefetch(self) -> None:
        """Start copying every saved tensor back (ahead of phase C)."""
        for entry in self._pending:
            self._fetch(entry)

    def _fetch(self, entry: dict) -> None:
        if entry["device"] is not None:
            return
        host = entry["host"]
        if self._stream is not None:
            self._stream.wait_stream(self._module.current_stream(self.device))
            with self._module.stream(self._stream):
                entry["device"] = host.to(self.device, non_blocking=True)
                entry["event"] = self._module.Event()
                entry["event"].record(self._stream)
        else:
            entry["device"] = host.clone(memory_format=torch.preserve_format)
        self.restored_bytes += host.numel() * host.element_size()

    def unpack(self, handle: object) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        self._fetch(handle)  # not prefetched (e.g. a backward before phase C): fetch now
        tensor = handle["device"]
        if handle["event"] is not None:
            current = self._module.current_stream(self.device)
            current.wait_event(handle["event"])
            tensor.record_stream(current)
        return tensor

    @contextmanager
    def saving(self) -> Iterator[HostOffload]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


def default_store(device: torch.device) -> HostOffload:
    """The production store: refuses a CPU device (nothing to move to)."""
    refuse_offload_on(device)
    return HostOffload(device)


def kv_difference(phase_a: PrefixKV, recomputed: PrefixKV) -> float:
    """Largest difference between the boundary tensors phase B used and those phase C recomputed,
    relative to the largest phase-A magnitude (one device sync per group). Router top-k counts must
    match exactly (they are integers): any difference there is reported as infinite."""
    if phase_a.router_stats is not None and not torch.equal(
        phase_a.router_stats.counts, recomputed.router_stats.counts
    ):
        return float("inf")
    diffs, scales = [], []
    for a, b in zip(phase_a.tensors(), recomputed.tensors()):
        if a.shape != b.shape:
            return float("inf")
        diffs.append((a.detach() - b.detach()).abs().max())
        scales.append(a.detach().abs().max())
    return (torch.stack(diffs).max() / torch.stack(scales).max().clamp_min(1e-30)).item()


def recompute_tolerance(dtype: torch.dtype) -> float:
    """A few rounding units of the K/V dtype: a deterministic kernel gives 0; a shifted position, a
    different mask or another prefix gives O(1)."""
    return 8 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


@dataclass
class Dormant:
    """One group's policy (never ``auto``: ``choose_policy`` resolves that) and how it runs.

    ``store_factory(device)`` builds ``offload``'s saved-tensor store (injectable for tests);
    ``check_recompute`` raises if phase C's recomputed K/V are not the ones phase B attended to.
    """

    policy: str = "keep"
    reason: str = "configured"
    stats: DormantStats | None = None
    store_factory: Callable[[torch.device], HostOffload] = default_store
    check_recompute: bool = True
    _store: HostOffload | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"a group's dormant policy must be one of {POLICIES}, got {self.policy!r}")

    def phase_a(self, device: torch.device) -> object:
        """The context phase A's prefix forward runs in under this policy."""
        if self.stats is not None:
            self.stats.note_group(self.policy, self.reason)
        if self.policy == "recompute":
            return torch.no_grad()
        if self.policy == "offload":
            self._store = self.store_factory(device)
            return self._store.saving()
        return nullcontext()

    def before_last_backward(self) -> None:
        """Prefetch offloaded tensors while the last suffix micro-batch's backward runs."""
        if self._store is not None:
            self._store.prefetch()

    def note_held_in_b(self, phase_a_bytes: int, micro_batch_bytes: int) -> None:
        if self.stats is not None:
            self.stats.note_held_in_b(self.policy, phase_a_bytes + micro_batch_bytes)

    def recompute_mismatch(self, prefix: PrefixKV, recomputed: PrefixKV) -> str | None:
        """The error when phase C's recomputed boundary tensors are not the ones phase B attended to, else None
        (the largest difference goes to the stats either way)."""
        diff = kv_difference(prefix, recomputed)
        if self.stats is not None:
            self.stats.recompute_max_diff = max(self.stats.recompute_max_diff, diff)
        tolerance = recompute_tolerance(prefix.keys[0].dtype)
        if diff <= tolerance:
            return None
        return (
            f"dormant_prefix=recompute: phase C's recomputed prefix K/V differ from phase A's by {diff:.3e} "
            f"(relative; tolerance {tolerance:.1e}): the prefix forward is not deterministic here, so the "
            "gradient would not be the one phase B's losses define. Use dormant_prefix=keep or offload."
        )

    def settle_recompute(self, mismatch: str | None) -> None:
        """Raise a recompute mismatch. Called on every recompute, mismatch or not, so that a data-parallel
        engine can agree first (``verl_prefix.backend.agreement.AgreedDormant``): a mismatch on one rank only (an
        MoE top-k flip, a nondeterministic kernel) must stop every rank before phase C's backward."""
        if mismatch is not None:
            raise RuntimeError(mismatch)

    def phase_c_prefix(self, prefix: PrefixKV, rerun: Callable[[], PrefixKV]) -> PrefixKV:
        """The graph-attached prefix phase C backpropagates through: phase A's own, or (``recompute``)
        ``rerun()`` under grad, checked against what phase B attended to."""
        if self._store is not None:
            if self.stats is not None:
                self.stats.offloaded_bytes += self._store.offloaded_bytes
            self._store = None  # the graph holds its entries; nothing else should
        if self.policy != "recompute":
            return prefix
        with torch.enable_grad():
            recomputed = rerun()
        if self.check_recompute:
            self.settle_recompute(self.recompute_mismatch(prefix, recomputed))
        return recomputed


def estimate_prefix_graph_bytes(model: nn.Module, prefix_len: int, dtype: torch.dtype | None = None) -> int:
    """A model-shape estimate of the activations phase A saves for backward (``keep``'s dormant graph,
    parameters excluded: they are held anyway), in bytes, for a phase A with early exit.

    Per prefix token, a Llama-style decoder layer (RMSNorms, q/k/v/o, RoPE, SwiGLU MLP) saves about
    ``4 hidden + 3 q_dim + 3 kv_dim + 4 intermediate`` values, ``2 (q_dim + kv_dim)`` more with q/k norms
    (Qwen3); early exit leaves the last layer at ``2 (hidden + q_dim + kv_dim)``. An MoE layer saves its
    router logits and each token's ``top_k`` expert MLP inputs instead of a dense MLP's (rougher: not
    fitted). Eager attention adds ``heads * P * P`` probabilities per full layer. With gradient
    checkpointing each layer keeps only its input (``hidden``). ``tests/schedule/test_dormant_policies.py``
    checks it within 25% of the counted saved activations of its tiny dense models.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if dtype is None:
        dtype = next(model.parameters()).dtype
    size = torch.finfo(dtype).bits // 8
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    layers = int(text.num_hidden_layers)
    if getattr(model, "is_gradient_checkpointing", False):
        return layers * prefix_len * hidden * size
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if experts:
        top_k = int(text.num_experts_per_tok)
        inter = int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
        mlp = experts + top_k * (hidden + 4 * inter)
    else:
        mlp = 4 * int(text.intermediate_size)
    qk_norm = 2 * (q_dim + kv_dim) if any(name.endswith("q_norm") for name, _ in model.named_modules()) else 0
    full = 4 * hidden + 3 * q_dim + 3 * kv_dim + mlp + qk_norm
    last = 2 * (hidden + q_dim + kv_dim) + qk_norm // 2
    quadratic = 0
    if (getattr(text, "_attn_implementation", None) or "eager") == "eager":
        quadratic = heads * prefix_len * prefix_len
    return ((layers - 1) * (full * prefix_len + quadratic) + last * prefix_len) * size


def choose_policy(estimate_bytes: int, budget_bytes: int, device: torch.device) -> tuple[str, str]:
    """``auto``: the cheapest policy whose phase-B footprint of the dormant graph fits ``budget_bytes``.

    keep holds the whole estimate; offload (accelerators only) and recompute hold none of it, offload
    costing copies overlapped with compute, recompute one more prefix forward. Returns (policy, reason).
    """
    if estimate_bytes <= budget_bytes:
        return "keep", "fits_budget"
    if device.type != "cpu":
        return "offload", "over_budget"
    return "recompute", "over_budget_cpu"
