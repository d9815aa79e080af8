"""verl 0.9.1's Megatron engine on a host without CUDA (gloo, fp32): the adaptations, in one place.

megatron-core, Megatron-Bridge and mbridge assume CUDA and TransformerEngine. On a CPU-only host
``ensure_megatron_platform`` applies the adaptations named in ``PATCHES`` (name -> why), each idempotent and as
narrow as its reason; with a CUDA device it applies none and returns an empty tuple (nothing changes for a GPU run).
Most of them only turn a call that raises without CUDA into its CPU equivalent; the two that change a result that
would otherwise be returned are scoped: the ``device='cuda'`` / ``Tensor.type()`` mode runs only inside verl's
Megatron engine's own methods, and the Megatron-Bridge scatter fix only makes pieces contiguous (a no-op on
contiguous ones). The pinned versions are in ``VERSIONS``; ``check_versions`` refuses others.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# what ``scripts/setup.sh`` installs; every adaptation below is written against these
VERSIONS = {"megatron-core": "0.16.1", "megatron-bridge": "0.3.1", "mbridge": "0.15.1"}
BACKEND = "megatron"  # verl's engine name (``actor.strategy``)
_MARK = "_verl_prefix_megatron_cpu"

PATCHES: dict[str, str] = {
    "current_device": "megatron-core passes torch.cuda.current_device() as a device (~40 places: buffers, "
    "optimizer, schedules), which raises without CUDA: it returns the cpu device.",
    "module_cuda": "Megatron-Bridge's and mbridge's get_model move the built model with Module.cuda(), which raises "
    "without CUDA: a no-op (the parameters are built on the host).",
    "cuda_streams": "Megatron-Bridge wraps DDP construction in torch.cuda.Stream / current_stream / stream, and "
    "megatron-core's all-to-all MoE token dispatcher copies its splits on a side stream and waits on the event that "
    "stream records: the torch.cpu equivalents, with a stream whose record_event returns a torch.cpu.Event "
    "(torch.cpu.Stream's returns None).",
    "moe_host_splits": "megatron-core's all-to-all MoE token dispatcher turns its split sizes into numpy arrays with "
    "maybe_move_tensor_to_cpu, which converts CUDA tensors only: on the host they stayed tensors, which gloo's "
    "all_to_all_single refuses as split sizes; a host tensor asked for as numpy is converted too.",
    "moe_gating_gemm": "megatron-core 0.16.1's router gating (RouterGatingLinearFunction) tests "
    "`te_general_gemm is not None`, a name moe_utils binds only when TransformerEngine imports (NameError without "
    "it): the name is bound to None, so the gating runs its torch.mm branch.",
    "optimizer_state_load": "loading a distributed-optimizer checkpoint sets each parameter's main param and Adam "
    "state (_set_main_param_and_optimizer_states), one wrapper for two reasons. (1) The CPU engine keeps fp32 "
    "parameters, so the main params are views of the model's leaf parameters (bf16 ones on a GPU get separate fp32 "
    "copies); the load copies into them with grad mode on, which autograd refuses: that copy runs under "
    "torch.no_grad(). (2) Without TransformerEngine or apex torch's Adam keeps its iteration as a 'step' tensor in "
    "each parameter's state; the load sets it from the checkpoint's param groups (megatron-core's design) as one "
    "tensor shared by every parameter, which Adam then increments once per parameter per step, and copies the "
    "parameter state over it, whose 'step' is the template's (the fresh engine's 0, or a live engine's own count): "
    "Adam resumed at the wrong iteration (its bias correction off). Each parameter gets its own copy of the step "
    "just loaded, which the parameter-state copy keeps.",
    "optimizer_fresh_state_dict": "without TransformerEngine or apex the distributed optimizer wraps torch's Adam and "
    "reads the iteration from its per-parameter state (state_dict asserts exactly one step); verl's resume loads a "
    "checkpoint into a fresh engine, whose optimizer has no state before its first step, and the template state dict "
    "for that load raised: a fresh optimizer's template reads step 0 (the loaded checkpoint replaces it), every other "
    "call is megatron-core's.",
    "offload": "verl's Megatron engine moves its state with to(device): the device's name loads, 'cpu' offloads; on "
    "the host both are 'cpu', so to('cpu') took the load branch and param_offload / optimizer_offload moved nothing. "
    "Inside verl's engine context the direction is the context's (entering loads, leaving offloads: the same calls of "
    "verl's own load_megatron_model_to_gpu / offload_megatron_model_to_cpu and optimizer functions a GPU run makes, "
    "so the parameter and gradient buffers really are released to zero storage between passes and restored from "
    "their host copies); a call outside it offloads loaded parameters and loads offloaded ones. Their pinned host "
    "copies are plain ones (the cuda_as_cpu_mode drops pin_memory). Only the trained chunks (megatron-core's DDP, "
    "with buffers) move: a forward-only engine's chunks (the reference policy) hold their parameters themselves, and "
    "verl's offload of such a chunk on the host would free the very storage its copy shares.",
    "cuda_synchronize": "megatron-core's distributed checkpointing (verl's save_checkpoint) calls "
    "torch.cuda.synchronize() before it writes, which raises without CUDA: a no-op (CPU work is synchronous).",
    "cuda_as_cpu_mode": "megatron-core writes device='cuda' literally (optimizer, clip_grads, DDP buffers, schedules) "
    "and checks param.type() == 'torch.cuda.FloatTensor' (optimizer, distributed optimizer, clip_grads): inside "
    "verl's Megatron engine's methods only (and the weight generator get_per_tensor_param returns), a "
    "TorchFunctionMode maps device='cuda' / .cuda() / .to('cuda') to cpu and reports a cpu tensor's type() with its "
    "torch.cuda name.",
    "rng_tracker": "model_parallel_cuda_manual_seed keeps CUDA generator states per parallel group (the TP weight "
    "init and dropout fork them): a tracker of CPU generator states with the same seeds and names.",
    "recompute_rng": "activation recompute (megatron-core's CheckpointFunction / CheckpointWithoutOutput, "
    "recompute_granularity full or selective) saves and restores the CUDA generator's state around the recomputed "
    "forward (_get_cuda_rng_state / _set_cuda_rng_state call torch.cuda.random.get_rng_state, which raises without "
    "CUDA): on the host the tracker's states are CPU generator states and the device generator is the CPU one, so "
    "the two read and set torch's CPU generator state. megatron-core 0.16.1's CheckpointWithoutOutput (selective "
    "recompute of layer norms, MoE activations, MLA up-projections) sets its fp8 flag as `fp8 is not None`, true "
    "for its default False, and then calls TransformerEngine's FP8GlobalStateManager (a NameError without TE): "
    "the flag is what was passed.",
    "local_attention": "without TransformerEngine the layers use megatron-core's local DotProductAttention, which "
    "refuses THD (packed_seq_params) and wants a [b, 1, sq, sk] True=masked mask; verl passes THD cu_seqlens "
    "(use_remove_padding) or a [b, s] True=valid mask: both become a dense causal-per-sequence mask; no mask becomes "
    "megatron-core's default causal one built on the query's device (megatron-core builds it on 'cuda', which a "
    "recompute in backward, outside the device mode, cannot). MLA builds it "
    "with k_channels / v_channels (TE's signature), which the local one lacks: accepted, its keys and values one "
    "per head, as MLA expands them, and its context as wide as the values it is given (MLA's v_head_dim, or the "
    "query's where verl's MLA patch pads them); its matmuls already follow the tensors' widths and MLA passes its own "
    "softmax scale.",
    "bridge_import": "Megatron-Bridge 0.3.1 imports transformer_engine.pytorch at module level (its LoRA layers): it "
    "is imported with a transient stub in sys.modules, removed afterwards, so megatron-core never sees TE.",
    "te_flags": "without TransformerEngine megatron-core's extensions module binds its TE classes to MagicMocks, so "
    "modules importing them (multi_latent_attention among them) set HAVE_TE = True and then fail isinstance checks; "
    "the Megatron-Bridge modules that tried `import transformer_engine` under the import stub did the same (the "
    "DeepSeek bridges then build TE's block spec): every such HAVE_TE reads False.",
    "bridge_local_spec": "Megatron-Bridge's default layer spec is TransformerEngine's: the local spec.",
    "bridge_unmapped": "Megatron-Bridge 0.3.1 leaves None in its conversion task list for a model parameter its "
    "mapping table lacks (it logs 'No mapping found'), then reads task.megatron_module of every entry and raises: "
    "the None entries are dropped (such a parameter keeps its initial value, e.g. a Qwen3-MoE router's expert bias "
    "of zeros, which the HF checkpoint does not hold).",
    "bridge_tp_scatter": "Megatron-Bridge's loader splits row-parallel weights with torch.chunk(dim=1) and scatters "
    "the views over the TP group; gloo sends a non-contiguous view's raw storage, so TP >= 2 loads wrong weights "
    "silently (log-prob error ~3): the pieces are made contiguous first.",
    "mbridge_local_spec": "mbridge (verl's deprecated vanilla_mbridge) builds TransformerEngine's layer spec: the "
    "local spec, with the local spec's separate norm names mapped onto the TE-fused HF names mbridge's tables use.",
    "engine_config": "verl's McoreEngineConfig asserts dtype in (bfloat16, float16): float32 is accepted (CPU has no "
    "fast bf16; the exactness tests run fp32).",
    "sequence_parallel_norm": "megatron-core's torch norms (the local spec's, without TransformerEngine) assert "
    "sequence_parallel off, which verl turns on whenever TP > 1: a norm is built as it would be without it and its "
    "parameters marked ``sequence_parallel``, as TransformerEngine's norms mark theirs, so finalize_model_grads "
    "sums their gradients over the TP ranks that each saw a slice of the sequence.",
    "transformer_overrides": "verl sets attention_backend=flash (Megatron-Bridge) and mbridge sets sequence_parallel "
    "whenever TP > 1: attention_backend defaults to local (sequence_parallel stays as verl sets it). "
    "Megatron-Bridge's MoE providers turn on TransformerEngine's fused permutation and router kernels and grouped "
    "GEMM experts (the grouped_gemm CUDA package): off, so the experts run megatron-core's SequentialMLP; so is "
    "apex's persistent layer norm and apex's gradient-accumulation fusion (the DeepSeek providers set them; "
    "torch's norms and megatron-core's linear layers refuse them without apex).",
    "engine_registry": "verl registers its Megatron engine for cuda/npu only: it is registered for cpu too.",
}

_APPLIED: list[str] = []
_SCATTER = threading.local()  # the contiguous-scatter switch (tests turn it off for the negative control)
_MODE_DEPTH = threading.local()


def megatron_available() -> bool:
    """True when megatron-core imports (an optional dependency: ``scripts/setup.sh`` installs it)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def check_versions() -> None:
    """Refuse versions other than the pinned ones: every adaptation here is written against ``VERSIONS``."""
    from importlib.metadata import PackageNotFoundError, version

    for name, pinned in VERSIONS.items():
        try:
            found = version(name)
        except PackageNotFoundError as error:
            raise ImportError(
                f"verl's Megatron engine on CPU needs {name} {pinned}, an optional dependency: scripts/setup.sh "
                "installs it (docs/megatron.md)"
            ) from error
        if found != pinned:
            raise RuntimeError(
                f"the Megatron CPU platform is pinned to {name} {pinned} (found {found}); its adaptations "
                "(verl_prefix.backend.megatron.platform) are written against that version"
            )


def host_device() -> str:
    """``"cuda"`` (or ``"npu"``, verl's MindSpeed hosts) when this process sees an accelerator, else ``"cpu"``: what
    ``ensure_megatron_platform`` adapts to (only ``"cpu"`` is adapted)."""
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def _note(name: str) -> None:
    if name not in _APPLIED:
        _APPLIED.append(name)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaAsCpuMode(TorchFunctionMode):
    """``device='cuda'`` factories, ``.cuda()`` and ``.to('cuda')`` run on cpu; a cpu tensor's ``type()`` reads
    ``torch.cuda.*`` (megatron-core's optimizers check it). Everything else passes through unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # verl's offload pins its host copies: no pinned allocator without CUDA
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """The ``cuda_as_cpu_mode`` for the block (re-entrant: nested blocks share the outer mode)."""
    depth = getattr(_MODE_DEPTH, "value", 0)
    if depth:
        _MODE_DEPTH.value = depth + 1
        try:
            yield
        finally:
            _MODE_DEPTH.value = depth
        return
    _MODE_DEPTH.value = 1
    try:
        with CudaAsCpuMode():
            yield
    finally:
        _MODE_DEPTH.value = 0


def _in_mode_generator(items: Any) -> Iterator[Any]:
    """A generator whose every step runs in the mode, in the thread that iterates it (the rollout's sync loop)."""
    iterator = iter(items)
    while True:
        with cuda_as_cpu():
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def _in_mode(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cuda_as_cpu():
            result = function(*args, **kwargs)
        if inspect.isgenerator(result):
            return _in_mode_generator(result)
        if isinstance(result, tuple) and result and inspect.isgenerator(result[0]):  # get_per_tensor_param
            return (_in_mode_generator(result[0]), *result[1:])
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def patch_current_device() -> None:
    """``torch.cuda.current_device()`` -> the cpu device (it raises without CUDA)."""
    if getattr(torch.cuda.current_device, _MARK, False):
        return

    def current_device() -> torch.device:
        return torch.device("cpu")

    setattr(current_device, _MARK, True)
    torch.cuda.current_device = current_device
    _note("current_device")


def patch_module_cuda() -> None:
    """``Module.cuda()`` returns the module unmoved (it raises without CUDA)."""
    if getattr(torch.nn.Module.cuda, _MARK, False):
        return

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        return self

    setattr(cuda, _MARK, True)
    torch.nn.Module.cuda = cuda
    _note("module_cuda")


class HostStream(torch.cpu.Stream):
    """``torch.cpu.Stream`` whose ``record_event`` returns an event (megatron-core's MoE dispatcher waits on it)."""

    def record_event(self, event: torch.cpu.Event | None = None) -> torch.cpu.Event:
        event = event if event is not None else torch.cpu.Event()
        event.record(self)
        return event


def patch_cuda_streams() -> None:
    """``torch.cuda`` streams -> ``torch.cpu``'s (no-op streams)."""
    if getattr(torch.cuda, _MARK, False):
        return
    torch.cuda.Stream = HostStream
    torch.cuda.current_stream = torch.cpu.current_stream
    torch.cuda.default_stream = torch.cpu.current_stream
    torch.cuda.stream = torch.cpu.stream
    setattr(torch.cuda, _MARK, True)
    _note("cuda_streams")


def patch_moe_gating_gemm() -> None:
    """``moe_utils.te_general_gemm`` bound to None without TransformerEngine (``PATCHES['moe_gating_gemm']``)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
        _note("moe_gating_gemm")


def patch_moe_host_splits() -> None:
    """``maybe_move_tensor_to_cpu(as_numpy=True)`` converts host tensors too (``PATCHES['moe_host_splits']``)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    stock = moe_utils.maybe_move_tensor_to_cpu
    if getattr(stock, _MARK, False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return stock(tensor, as_numpy=as_numpy, record_stream=record_stream)

    setattr(maybe_move_tensor_to_cpu, _MARK, True)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _note("moe_host_splits")


def patch_cuda_synchronize() -> None:
    """``torch.cuda.synchronize()`` a no-op (``PATCHES['cuda_synchronize']``)."""
    if getattr(torch.cuda.synchronize, _MARK, False):
        return

    def synchronize(device: Any = None) -> None:
        return None

    setattr(synchronize, _MARK, True)
    torch.cuda.synchronize = synchronize
    _note("cuda_synchronize")


def patch_rng_tracker() -> None:
    """megatron-core's RNG tracker keeps CPU generator states (``PATCHES['rng_tracker']``)."""
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.initialize_rng_tracker, _MARK, False):
        return

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron-core's tracker over ``torch.Generator`` states: ``add`` seeds a named state, ``fork`` runs a
        block on it and keeps where it left off, the global CPU generator restored after."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    def initialize_rng_tracker(
        use_te_rng_tracker: bool = False,
        inference_rng_tracker: bool = False,
        use_cudagraphable_rng: bool = False,
        force_reset: bool = False,
    ) -> None:
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    setattr(initialize_rng_tracker, _MARK, True)
    mrandom.initialize_rng_tracker = initialize_rng_tracker
    _note("rng_tracker")


def patch_recompute_rng() -> None:
    """megatron-core's recompute saves and restores the CPU generator (``PATCHES['recompute_rng']``)."""
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom._get_cuda_rng_state, _MARK, False):
        return

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    setattr(get_state, _MARK, True)
    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = get_state, set_state
    stock_init = mrandom.CheckpointWithoutOutput.__init__

    @functools.wraps(stock_init)
    def init(self: Any, fp8: Any = False) -> None:
        stock_init(self, fp8)
        self.fp8 = bool(fp8)

    mrandom.CheckpointWithoutOutput.__init__ = init
    _note("recompute_rng")


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Which packed sequence each of ``total`` THD tokens belongs to (-1 for trailing padding past the last)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if ids.numel() < total:
        ids = torch.cat([ids, ids.new_full((total - ids.numel(),), -1)])
    return ids[:total]


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, t, t]`` True=masked: a token sees the earlier tokens of its own sequence only."""
    ids = sequence_ids(cu_seqlens, total).to(device)
    later = torch.ones(total, total, dtype=torch.bool, device=device).triu(1)
    return (later | (ids[:, None] != ids[None, :])).view(1, 1, total, total)


def padded_causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """verl's BSHD ``[b, s]`` True=valid mask -> megatron-core's ``[b, 1, s, s]`` True=masked causal mask."""
    b, s = valid.shape
    later = torch.ones(s, s, dtype=torch.bool, device=valid.device).triu(1)
    return later.view(1, 1, s, s) | ~valid.bool().view(b, 1, 1, s)


def patch_local_attention() -> None:
    """megatron-core's local ``DotProductAttention`` takes verl's THD and ``[b, s]`` masks (``PATCHES``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if getattr(DotProductAttention.forward, _MARK, False):
        return
    stock = DotProductAttention.forward

    def forward(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        # the context is heads x the values' width (MLA's v_head_dim, or q's where verl's MLA patch pads it)
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value.shape[-1]
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            mask = packed_causal_mask(cu, query.size(0), query.device)
            # THD is [t, heads, dim]: one batch row of t tokens; the stock output [t, 1, h*d] drops that row
            out = stock(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type,
                        attention_bias, None)  # fmt: skip
            return out.squeeze(1)
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = padded_causal_mask(attention_mask)
        if attention_mask is None and query.size(0) > 1:  # megatron-core's default causal mask, on this device
            sq, sk = query.size(0), key.size(0)
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1).view(1, 1, sq, sk)
        return stock(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    stock_init = DotProductAttention.__init__

    def __init__(
        self: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any
    ) -> None:
        stock_init(self, *args, **kw)
        if v_channels is not None:  # MLA: its keys and values come one per head
            self.num_query_groups_per_partition = self.num_attention_heads_per_partition

    setattr(forward, _MARK, True)
    DotProductAttention.forward = forward
    DotProductAttention.__init__ = __init__
    _note("local_attention")


class _AnyAttribute(type):
    """A stub class whose every attribute is another stub class (what a module-level ``te.X`` reference needs)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (), {})


def import_megatron_bridge() -> types.ModuleType:
    """Import Megatron-Bridge with a transient ``transformer_engine`` stub (``PATCHES['bridge_import']``)."""
    if "megatron.bridge" in sys.modules and "megatron.bridge.models.gpt_provider" in sys.modules:
        return sys.modules["megatron.bridge"]
    # megatron-core decides HAVE_TE at import: import its layer modules first, while TE is truly absent
    for name in (
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.transformer_layer",
        "megatron.core.extensions.transformer_engine",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    names = ("transformer_engine", "transformer_engine.pytorch")
    saved = {name: sys.modules.get(name) for name in names}
    stub = _StubModule("transformer_engine")
    stub.__path__ = []  # type: ignore[attr-defined]
    stub.pytorch = _StubModule("transformer_engine.pytorch")  # type: ignore[attr-defined]
    sys.modules.update({"transformer_engine": stub, "transformer_engine.pytorch": stub.pytorch})
    try:
        bridge = importlib.import_module("megatron.bridge")
        importlib.import_module("megatron.bridge.models.gpt_provider")
        importlib.import_module("megatron.bridge.models.conversion.param_mapping")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    _note("bridge_import")
    return bridge


def patch_sequence_parallel_norm() -> None:
    """megatron-core's torch norms under sequence parallelism (``PATCHES['sequence_parallel_norm']``)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm.__new__, _MARK, False):
        return
    stock = WrappedTorchNorm.__new__

    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return stock(cls, config, *args, **kwargs)
        norm = stock(cls, _without_sequence_parallel(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # summed over the TP ranks by finalize_model_grads
        return norm

    def _without_sequence_parallel(config: Any) -> Any:
        plain = copy.copy(config)  # a shallow copy: __post_init__'s checks already ran on the original
        object.__setattr__(plain, "sequence_parallel", False)
        return plain

    setattr(__new__, _MARK, True)
    WrappedTorchNorm.__new__ = staticmethod(__new__)
    _note("sequence_parallel_norm")


def patch_te_flags() -> None:
    """``HAVE_TE`` reads False in every megatron module that set it without TransformerEngine (``PATCHES``)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    with contextlib.suppress(ImportError):
        importlib.import_module("megatron.core.transformer.multi_latent_attention")
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "HAVE_TE", False) is True:
            module.HAVE_TE = False
    _note("te_flags")


def patch_bridge_unmapped() -> None:
    """Megatron-Bridge's conversion tasks without the None entries of unmapped parameters (``PATCHES``)."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    stock = MegatronModelBridge.build_conversion_tasks
    if getattr(stock, _MARK, False):
        return

    def build_conversion_tasks(self: Any, *args: Any, **kwargs: Any) -> list:
        return [task for task in stock(self, *args, **kwargs) if task is not None]

    setattr(build_conversion_tasks, _MARK, True)
    MegatronModelBridge.build_conversion_tasks = build_conversion_tasks
    _note("bridge_unmapped")


def patch_bridge_local_spec() -> None:
    """Megatron-Bridge's default (TransformerEngine) layer spec -> the local spec."""
    from megatron.bridge.models import gpt_provider

    if getattr(gpt_provider.transformer_engine_layer_spec, _MARK, False):
        return

    def local_spec(config: Any) -> Any:
        return gpt_provider.local_layer_spec(config)

    setattr(local_spec, _MARK, True)
    gpt_provider.transformer_engine_layer_spec = local_spec  # what default_layer_spec calls
    _note("bridge_local_spec")


@contextlib.contextmanager
def contiguous_tp_scatter(enabled: bool) -> Iterator[None]:
    """The ``bridge_tp_scatter`` fix on (``True``, the platform's setting) or off for the block: the off switch
    exists for the regression test's negative control."""
    before = getattr(_SCATTER, "enabled", True)
    _SCATTER.enabled = enabled
    try:
        yield
    finally:
        _SCATTER.enabled = before


def patch_bridge_tp_scatter() -> None:
    """Megatron-Bridge scatters contiguous pieces over the TP group (``PATCHES['bridge_tp_scatter']``)."""
    from megatron.bridge.models.conversion import param_mapping

    mapping = param_mapping.MegatronParamMapping
    if getattr(mapping.scatter_to_tp_ranks, _MARK, False):
        return
    stock = mapping.scatter_to_tp_ranks

    def scatter_to_tp_ranks(
        self: Any,
        splits: list[torch.Tensor] | None,
        output_shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        src_rank: int = 0,
    ) -> torch.Tensor:
        if splits and getattr(_SCATTER, "enabled", True):
            splits = [piece.contiguous() for piece in splits]
        return stock(self, splits, output_shape, dtype, device, src_rank)

    setattr(scatter_to_tp_ranks, _MARK, True)
    mapping.scatter_to_tp_ranks = scatter_to_tp_ranks
    _note("bridge_tp_scatter")


# the local spec names each norm on its own; mbridge's HF tables know TransformerEngine's fused names
_MBRIDGE_NORM_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def patch_mbridge_local_spec() -> None:
    """mbridge builds the local layer spec and maps its norm names (``PATCHES['mbridge_local_spec']``)."""
    from mbridge.core import bridge as mbridge_bridge
    from mbridge.core import llm_bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(llm_bridge.LLMBridge._get_transformer_layer_spec, _MARK, False):
        return
    takes_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters

    def _get_transformer_layer_spec(self: Any, vp_stage: int | None = None) -> Any:
        if self.config.normalization != "RMSNorm":
            raise NotImplementedError(f"mbridge's local spec on CPU: RMSNorm only (got {self.config.normalization})")
        self.has_vp_stage = takes_vp_stage
        extra = {"vp_stage": vp_stage} if takes_vp_stage else {}
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)

    stock_mapping = mbridge_bridge.Bridge._weight_name_mapping_mcore_to_hf

    def _weight_name_mapping_mcore_to_hf(self: Any, name: str) -> Any:
        for local, fused in _MBRIDGE_NORM_NAMES.items():
            if name.endswith(local):
                name = name[: -len(local)] + fused
        return stock_mapping(self, name)

    setattr(_get_transformer_layer_spec, _MARK, True)
    llm_bridge.LLMBridge._get_transformer_layer_spec = _get_transformer_layer_spec
    mbridge_bridge.Bridge._weight_name_mapping_mcore_to_hf = _weight_name_mapping_mcore_to_hf
    _note("mbridge_local_spec")


def patch_engine_config() -> None:
    """verl's ``McoreEngineConfig`` takes float32 (``PATCHES['engine_config']``)."""
    from verl.workers.config import McoreEngineConfig

    if getattr(McoreEngineConfig.__post_init__, _MARK, False):
        return
    stock = McoreEngineConfig.__post_init__

    def __post_init__(self: Any) -> None:
        fp32 = self.dtype in ("float32", "fp32")
        if fp32:  # the frozen field, validated as bf16 and set back
            object.__setattr__(self, "dtype", "bfloat16")
        try:
            stock(self)
        finally:
            if fp32:
                object.__setattr__(self, "dtype", "float32")

    setattr(__post_init__, _MARK, True)
    McoreEngineConfig.__post_init__ = __post_init__
    _note("engine_config")


def patch_optimizer_state_load() -> None:
    """The distributed optimizer's parameter-state load (``_set_main_param_and_optimizer_states``, which verl's
    checkpoint load calls per parameter) keeps the Adam step its ``load_state_dict`` just set from the checkpoint's
    param groups, and copies into the main params under ``torch.no_grad()`` (``PATCHES['optimizer_state_load']``)."""
    from megatron.core.optimizer import distrib_optimizer

    stock = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(stock, _MARK, False):
        return

    @functools.wraps(stock)
    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if "step" in tensors and not distrib_optimizer.HAVE_APEX_OR_TE:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if state.get("step") is not None:  # its own tensor, copied onto itself: the loaded step stays
                step = state["step"] = state["step"].detach().clone()
                tensors = {**tensors, "step": step}
        with torch.no_grad():  # fp32 main params on CPU are views of the model's leaf parameters
            return stock(self, model_param, tensors)

    setattr(set_states, _MARK, True)
    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    _note("optimizer_state_load")


def patch_optimizer_fresh_state_dict() -> None:
    """A fresh distributed optimizer's ``state_dict`` (the template verl's resume loads into) reads step 0 where
    megatron-core's torch-optimizer path finds no step (``PATCHES['optimizer_fresh_state_dict']``)."""
    from megatron.core.optimizer import distrib_optimizer

    stock = distrib_optimizer.DistributedOptimizer.state_dict
    if getattr(stock, _MARK, False):
        return

    @functools.wraps(stock)
    def state_dict(self: Any) -> dict:
        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(inner, torch.optim.Optimizer) or len(inner.state):
            return stock(self)
        inner_state_dict = inner.state_dict

        def fresh() -> dict:  # what megatron-core reads the step from; its "state" is not kept in the result
            return {**inner_state_dict(), "state": {0: {"step": torch.tensor(0.0)}}}

        inner.state_dict = fresh
        try:
            return stock(self)
        finally:
            del inner.state_dict

    setattr(state_dict, _MARK, True)
    distrib_optimizer.DistributedOptimizer.state_dict = state_dict
    _note("optimizer_fresh_state_dict")


# transformer-config switches for kernels of TransformerEngine, apex or the grouped_gemm CUDA package
_TE_APEX_KERNELS = (
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",
    "persist_layer_norm",
    "gradient_accumulation_fusion",
)


def patch_transformer_overrides() -> None:
    """verl's transformer-config overrides on CPU: local attention by default, no TE/apex kernels."""
    import verl.utils.megatron_utils as megatron_utils

    if getattr(megatron_utils.mapping_string_to_attn_backend, _MARK, False):
        return
    stock = megatron_utils.mapping_string_to_attn_backend

    def mapping_string_to_attn_backend(args: dict) -> dict:
        args = dict(args)
        args.setdefault("attention_backend", "local")
        for kernel in _TE_APEX_KERNELS:
            args[kernel] = False
        return stock(args)

    setattr(mapping_string_to_attn_backend, _MARK, True)
    megatron_utils.mapping_string_to_attn_backend = mapping_string_to_attn_backend  # verl imports it per call
    _note("transformer_overrides")


def run_methods_in_mode(cls: type) -> type:
    """Every method of ``cls`` (inherited ones included, ``__init__`` too) runs in the ``cuda_as_cpu_mode``; for verl's
    Megatron engine classes, and for a subclass defining methods of its own (a prefix engine); idempotent."""
    if cls.__dict__.get(_MARK, False):
        return cls
    for name in dir(cls):
        if name.startswith("__") and name != "__init__":
            continue
        attr = inspect.getattr_static(cls, name)
        if inspect.isfunction(attr) and not getattr(attr, _MARK, False):
            setattr(cls, name, _in_mode(attr))
    setattr(cls, _MARK, True)
    return cls


_DIRECTION = threading.local()  # "load" / "offload" while verl's engine context enters / leaves


def ddp_chunks(engine: Any) -> list[Any]:
    """The engine's model chunks under megatron-core's DDP (the trained ones, with parameter and gradient buffers);
    a forward-only engine's chunks (the reference policy) have none."""
    from megatron.core.distributed import DistributedDataParallel

    return [chunk for chunk in engine.module if isinstance(chunk, DistributedDataParallel)]


def offloaded(engine: Any) -> bool:
    """Whether the engine's parameter buffers are released (verl's offload resizes their storage to zero)."""
    return any(
        buffer.param_data.storage().size() == 0
        for chunk in ddp_chunks(engine)
        for buffers in (chunk.buffers, chunk.expert_parallel_buffers)
        for buffer in buffers
    )


def patch_offload(impl: types.ModuleType) -> None:
    """verl's Megatron offload moves state on the host (``PATCHES['offload']``)."""
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx

    if getattr(impl.MegatronEngine.to, _MARK + "_offload", False):
        return
    stock_enter, stock_exit = BaseEngineCtx.__enter__, BaseEngineCtx.__exit__

    def enter(self: Any) -> Any:
        _DIRECTION.value = "load"
        try:
            return stock_enter(self)
        finally:
            _DIRECTION.value = None

    def exit_(self: Any, *exc: Any) -> Any:
        _DIRECTION.value = "offload"
        try:
            return stock_exit(self, *exc)
        finally:
            _DIRECTION.value = None

    def to(self: Any, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        BaseEngine.to(self, device=device, model=model, optimizer=optimizer, grad=grad)
        assert device == "cpu", f"prefix_megatron's CPU platform: device {device!r} on a host without CUDA"
        optimizer = optimizer and self.optimizer is not None
        # a forward-only engine's chunks hold their parameters themselves: on the host there is nowhere to move them
        # (verl's offload of such a chunk would free the storage its "host copy" shares)
        chunks = ddp_chunks(self) if model else []
        if not chunks and not optimizer:
            return
        direction = getattr(_DIRECTION, "value", None) or ("load" if offloaded(self) else "offload")
        with cuda_as_cpu():
            if direction == "load":
                if chunks:
                    impl.load_megatron_model_to_gpu(chunks, load_grad=grad)
                if optimizer:
                    impl.load_megatron_optimizer(self.optimizer)
            else:
                if chunks:
                    impl.offload_megatron_model_to_cpu(chunks)
                if optimizer:
                    impl.offload_megatron_optimizer(self.optimizer)

    setattr(to, _MARK + "_offload", True)
    BaseEngineCtx.__enter__, BaseEngineCtx.__exit__ = enter, exit_
    impl.MegatronEngine.to = to
    _note("offload")


def patch_engine_methods(impl: types.ModuleType) -> None:
    """verl's Megatron engine classes run their methods in the ``cuda_as_cpu_mode``."""
    for cls in (impl.MegatronEngine, impl.MegatronEngineWithLMHead, impl.MegatronEngineWithValueHead):
        run_methods_in_mode(cls)
    _note("cuda_as_cpu_mode")


def register_cpu_engine(impl: types.ModuleType) -> None:
    """verl's Megatron engine for device cpu (verl registers it for cuda/npu)."""
    from verl_prefix.backend.registry import register_class

    for model_type, cls in (
        ("language_model", impl.MegatronEngineWithLMHead),
        ("value_model", impl.MegatronEngineWithValueHead),
    ):
        register_class(cls, BACKEND, ["cpu"], model_type)
    _note("engine_registry")


def ensure_megatron_platform(device: str | None = None) -> tuple[str, ...]:
    """Adapt megatron-core and verl's Megatron engine to this host (idempotent); returns the ``PATCHES`` names
    applied in this process. ``device`` (default: ``host_device()``) other than ``"cpu"`` applies nothing: a GPU
    run keeps every library as installed."""
    if (device or host_device()) != "cpu":
        return ()
    check_versions()
    patch_current_device()
    patch_module_cuda()
    patch_cuda_streams()
    patch_cuda_synchronize()
    patch_moe_gating_gemm()
    patch_moe_host_splits()
    patch_rng_tracker()
    patch_recompute_rng()
    patch_local_attention()
    patch_sequence_parallel_norm()
    import_megatron_bridge()
    patch_te_flags()
    patch_bridge_local_spec()
    patch_bridge_unmapped()
    patch_bridge_tp_scatter()
    patch_mbridge_local_spec()
    patch_engine_config()
    patch_transformer_overrides()
    patch_optimizer_state_load()
    patch_optimizer_fresh_state_dict()
    impl = importlib.import_module("verl.workers.engine.megatron.transformer_impl")
    patch_offload(impl)
    patch_engine_methods(impl)
    register_cpu_engine(impl)
    return tuple(_APPLIED)


def applied_patches() -> tuple[str, ...]:
    """The ``PATCHES`` names applied in this process so far (none with CUDA)."""
    return tuple(_APPLIED)
