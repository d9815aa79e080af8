"""verl 0.9.1's TorchTitan engine on torchtitan 0.3.0, on CPU (gloo) as on CUDA: the adaptations, in one place.

verl 0.9.1 was written against a torchtitan older than the 0.3.0 this project installs (``scripts/setup.sh``
pins it), and torchtitan assumes an accelerator. Each adaptation below names its reason; all are idempotent
and applied by ``ensure_titan_platform`` when the ``prefix_torchtitan`` engine module is imported (so before
any engine is built, in every process that builds one), not in tests only:

- ``torchtitan.components.lr_scheduler`` moved to ``torchtitan.components.optimizer.lr_scheduler`` in 0.3.0;
  verl imports the old path. An alias module makes both resolve to the same module.
- torchtitan picks its device at import (``tools.utils.device_type``, "cuda" when no accelerator is found)
  and copies the name into the modules that import it. On the CPU platform every loaded torchtitan module's
  ``device_type`` / ``device_module`` become "cpu" and a device module with the memory calls torchtitan makes.
- verl builds torchtitan's ``TrainingConfig`` without a parameter dtype (torchtitan's default: bf16): an engine
  config with ``mixed_precision_param`` (``PrefixTorchtitanEngineConfig``) sets it, e.g. fp32 for exactness;
  verl's ``forward_step`` then runs without its hard-coded bf16 autocast.
- ``TrainingConfig(disable_cuda_graphs=True)`` on CPU: 0.3.0 validates CUDA-graph support and rejects EP and
  PP unless graphs are off (there are none on CPU).
- ``TrainingConfig(enable_cpu_offload=False)`` on CPU: verl asks torchtitan to offload a forward-only engine (the
  reference policy) to host memory, which on CPU is where the parameters already are, and FSDP's offload pins
  memory, which needs an accelerator ("Cannot access accelerator device").
- verl's weight sync to the rollout (``get_per_tensor_param``: TP/FSDP shards gathered, names mapped to HF by
  torchtitan's state-dict adapter) casts every gathered tensor to bf16 ("the wire speaks bf16"): with float32
  parameters the rollout then samples from rounded weights and its log-probs are not the actor's. An fp32
  engine's sync keeps fp32 (the casts read ``torch.bfloat16`` through the engine module's ``torch``, below).
- verl's ``spmd_backend: default`` is ``partial_dtensor`` in 0.3.0 (renamed); ``spmd_types`` fails at init with
  TP or FSDP > 1 on torch 2.13, so the prefix engine refuses it (``backend.titan.config``).
- verl looks the data-parallel mesh up as ``loss`` / ``fsdp`` / ``dp_replicate``; with TP or EP only there is
  no such dimension and torchtitan raises instead of returning None: the lookup tolerates its absence. With no
  data parallelism at all (TP=2 on two ranks) verl's engine then has no data-parallel group while the world is
  larger than one, and verl's worker skips its metric gather and fails on the ungathered lists ("'float' object
  is not iterable" in ``train_mini_batch``): the lookup returns the rank's own one-rank ``loss`` mesh, so every
  data-parallel collective runs over that rank alone, as verl's worker expects.
- ``create_block_mask`` defaults to device "cuda": on CPU the mask is built on the inputs' device.
- Flex attention has no CPU backward and varlen is CUDA-only: on CPU, ``FlexAttention`` computes a dense
  attention over the block mask materialised from its ``mask_mod`` (same keys kept, same scale, GQA expanded).
  On CUDA torchtitan's own flex/varlen kernels run untouched.
- verl's ``save_checkpoint`` points torchtitan's checkpointer at verl's folder and calls ``save(step)``, which
  torchtitan writes only every ``interval`` steps (500 by default): a verl checkpoint at step 2 held no model or
  optimizer (its resume then fails: "load_step=2 not found"). The checkpointer's interval is 1 when verl saves,
  so each save verl asks for is written (model, optimizer, LR schedule, torchtitan's train state).
- ``GroupedExperts`` (MoE) casts tokens and expert weights to bf16 whatever the parameter dtype, so each
  backward call rounds the expert weights' gradients to bf16 and gradient accumulation over micro-batches
  differs from one call at bf16 precision: with float32 parameters the experts compute in float32
  (``torch._grouped_mm`` runs fp32); with bf16 parameters torchtitan's own forward runs.
- verl registers its TorchTitan engine for cuda/npu only, and only when its import succeeds (it does not with
  0.3.0): ``titan.registry`` registers ``prefix_torchtitan`` for cuda and cpu as factories, and verl's own
  engine the same way only on request (``VERL_PREFIX_STOCK_TORCHTITAN=1`` or ``register_stock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

TORCHTITAN_VERSION = "0.3.0"
# verl's engine config default ("spmd_types") fails at init with TP or FSDP > 1 on torch 2.13; "default" is the
# pre-0.3.0 name of partial_dtensor.
SPMD_BACKEND_RENAMES = {"default": "partial_dtensor"}
# verl's own engine's backend name, and the attribute ``registry`` sets on its factory for it (``release_stock``)
STOCK_BACKEND = "torchtitan"
STOCK_FACTORY_MARK = "_verl_prefix_stock_factory"

# Per thread: the parameter dtype of the engine being built (verl builds torchtitan's TrainingConfig without one;
# torchtitan's default is bf16), and whether the running forward_step is of an fp32 engine (no autocast).
_ENGINE = threading.local()


def torchtitan_available() -> bool:
    """True when torchtitan imports (it is an optional dependency: ``scripts/setup.sh`` installs it)."""
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return False
    return True


def check_version() -> None:
    """Refuse a torchtitan other than the pinned one: every adaptation here is written against 0.3.0."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError as error:
        raise ImportError(
            f"the TorchTitan engines need torchtitan {TORCHTITAN_VERSION} and triton, which are optional: "
            "scripts/setup.sh installs them (docs/torchtitan.md)"
        ) from error
    if found != TORCHTITAN_VERSION:
        raise RuntimeError(
            f"prefix_torchtitan is pinned to torchtitan {TORCHTITAN_VERSION} (found {found}); its platform "
            "adaptations (verl_prefix.backend.titan.platform) are written against that version"
        )


def alias_lr_scheduler() -> None:
    """``torchtitan.components.lr_scheduler`` -> ``torchtitan.components.optimizer.lr_scheduler`` (moved in 0.3.0)."""
    name = "torchtitan.components.lr_scheduler"
    if name in sys.modules:
        return
    sys.modules[name] = importlib.import_module("torchtitan.components.optimizer.lr_scheduler")


class TitanCPUDevice(types.ModuleType):
    """torchtitan's ``device_module`` on CPU: the CPU platform's stand-in for ``torch.cuda`` plus the memory
    calls torchtitan's metrics make at trainer build (properties, stats); host memory has no allocator
    statistics, so they read 0 (not measured)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        from verl_prefix.backend.platform_cpu import cpu_device_module

        return getattr(cpu_device_module(), name)

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import psutil

        return types.SimpleNamespace(name="cpu", total_memory=int(psutil.virtual_memory().total))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        keys = ("active_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms")
        return dict.fromkeys(keys, 0)


_TITAN_CPU_DEVICE = TitanCPUDevice("verl_prefix_titan_cpu_device")


def patch_cpu_device() -> None:
    """Point every loaded torchtitan module's ``device_type``/``device_module`` at the CPU."""
    import torchtitan.tools.utils  # noqa: F401  (the module that picks the device, before the rest)

    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if isinstance(getattr(module, "device_module", None), types.ModuleType):
            module.device_module = _TITAN_CPU_DEVICE


def dense_masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, scale: float | None
) -> torch.Tensor:
    """Attention of ``[B, N, Lq, H]`` queries over ``[B, Nkv, Lk, H]`` keys with a boolean ``keep`` mask
    (``[B or 1, 1, Lq, Lk]``); K/V heads repeat over their query groups; softmax in at least fp32, as flex
    computes it. Rows with no key give zeros."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1).to(q.dtype)
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.matmul(probs, v)


def _cpu_flex_forward(
    self: Any,
    q_BLNH: torch.Tensor,
    k_BLNH: torch.Tensor,
    v_BLNH: torch.Tensor,
    *,
    attention_masks: Any,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    out_transform: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``FlexAttention.forward`` on CPU: attention over the block mask materialised from its ``mask_mod``."""
    if score_mod is not None or out_transform is not None:
        raise NotImplementedError("CPU flex attention stand-in: score_mod / out_transform are not served")
    from torch.nn.attention.flex_attention import create_mask

    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    keep = create_mask(attention_masks.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return dense_masked_attention(q, k, v, keep, scale=scale).transpose(1, 2)


def patch_cpu_attention() -> None:
    """Flex attention has no CPU backward: ``FlexAttention`` attends densely over the materialised mask."""
    from torchtitan.models.common.attention import FlexAttention

    if getattr(FlexAttention.forward, "_verl_prefix_cpu", False):
        return
    _cpu_flex_forward._verl_prefix_cpu = True  # type: ignore[attr-defined]
    FlexAttention.forward = _cpu_flex_forward


def engine_autocast(engine_config: Any, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast verl's TorchTitan ``forward_step`` runs in: bf16, or none with fp32 parameters."""
    if getattr(engine_config, "mixed_precision_param", None) == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


class _TorchWithEngineAutocast(types.ModuleType):
    """``torch`` as verl's TorchTitan engine module sees it: everything is torch's, except that ``autocast`` is
    a no-op inside the ``forward_step`` of an engine whose parameters are fp32, and ``bfloat16`` (the weight
    sync's wire dtype) is fp32 while an fp32 engine's weights are being gathered for the rollout."""

    def __getattr__(self, name: str) -> Any:
        if name == "bfloat16":
            wire = getattr(_ENGINE, "wire_dtype", None)
            if wire is not None:
                return wire
        return getattr(torch, name)

    @staticmethod
    def autocast(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ENGINE, "autocast_off", False):
            return contextlib.nullcontext()
        return torch.autocast(*args, **kwargs)


def full_precision_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's weight generator with its bf16 casts at fp32: each step of the generator runs with the wire dtype
    set, in the thread that iterates it (the rollout's update loop)."""
    items = iter(weights)
    while True:
        _ENGINE.wire_dtype = torch.float32
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            _ENGINE.wire_dtype = None
        yield item


def _data_parallel_mesh(self: Any) -> Any:
    """verl's lookup (``loss`` / ``fsdp`` / ``dp_replicate``), tolerating a dimension the mesh was built without;
    with no data parallelism at all (TP / EP only), this rank's one-rank ``loss`` mesh (below)."""
    for name in ("loss", "fsdp", "dp_replicate"):
        try:
            mesh = self.parallel_dims.get_optional_mesh(name)
        except (KeyError, ValueError):
            mesh = None
        if mesh is not None:
            return mesh
    try:
        return self.parallel_dims.get_optional_mesh("loss", include_singleton_axes=True)
    except (KeyError, ValueError):
        return None


def _patch_verl_engine_module(impl: types.ModuleType, cpu: bool) -> None:
    """verl's engine module: spmd-backend rename, CUDA graphs off on CPU, the parameter dtype and autocast of
    the engine config, block masks on the inputs' device, a tolerant data-parallel mesh lookup."""
    if getattr(impl, "_verl_prefix_titan", False):
        return
    parallelism_cls, training_cls = impl.ParallelismConfig, impl.TrainingConfig

    def parallelism_config(**kwargs: Any) -> Any:
        backend = kwargs.get("spmd_backend")
        kwargs["spmd_backend"] = SPMD_BACKEND_RENAMES.get(backend, backend)
        return parallelism_cls(**kwargs)

    def training_config(**kwargs: Any) -> Any:
        if cpu:
            kwargs.setdefault("disable_cuda_graphs", True)
            if kwargs.get("enable_cpu_offload"):  # the parameters are in host memory; pinning needs an accelerator
                logger.info("CPU platform: torchtitan's CPU offload is off (the parameters are in host memory)")
                kwargs["enable_cpu_offload"] = False
        dtype = getattr(_ENGINE, "param_dtype", None)
        if dtype is not None:
            kwargs.setdefault("mixed_precision_param", dtype)
        return training_cls(**kwargs)

    impl.ParallelismConfig = parallelism_config
    impl.TrainingConfig = training_config

    utils = importlib.import_module("verl.workers.engine.torchtitan.utils")
    original_masks = utils.get_attention_masks
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod

    def get_attention_masks(input_batch: torch.Tensor, positions: torch.Tensor, attn_type: str) -> Any:
        if attn_type in ("flex", "flex_flash") and input_batch.device.type == "cpu":
            document = getattr(utils, "_get_document_mask_mod")(positions=positions)  # noqa: B009 - verl's own
            mask_mod = and_masks(get_causal_mask_mod(), document)
            length = input_batch.shape[1]
            return create_block_mask(mask_mod, input_batch.shape[0], None, length, length, device="cpu")
        return original_masks(input_batch, positions, attn_type)

    impl.get_attention_masks = get_attention_masks

    engine_cls = impl.TorchTitanEngine
    engine_cls._get_data_parallel_mesh = _data_parallel_mesh
    original_init = engine_cls.__init__

    def init(self: Any, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        _ENGINE.param_dtype = getattr(engine_config, "mixed_precision_param", None)
        try:
            original_init(self, model_config, engine_config, *args, **kwargs)
        finally:
            _ENGINE.param_dtype = None

    engine_cls.__init__ = init

    original_params = engine_cls.get_per_tensor_param

    def get_per_tensor_param(self: Any, **kwargs: Any) -> Any:
        weights, peft_config = original_params(self, **kwargs)
        if getattr(self.engine_config, "mixed_precision_param", None) == "float32":
            weights = full_precision_weights(weights)
        return weights, peft_config

    engine_cls.get_per_tensor_param = get_per_tensor_param

    original_save = engine_cls.save_checkpoint

    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        self.checkpointer.interval = 1  # every save verl asks for is written (torchtitan's interval is 500 steps)
        original_save(self, *args, **kwargs)

    engine_cls.save_checkpoint = save_checkpoint

    impl.torch = _TorchWithEngineAutocast("torch")
    head_cls = impl.TorchTitanEngineWithLMHead
    original_step = head_cls.forward_step

    def forward_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _ENGINE.autocast_off = getattr(self.engine_config, "mixed_precision_param", None) == "float32"
        try:
            return original_step(self, *args, **kwargs)
        finally:
            _ENGINE.autocast_off = False

    head_cls.forward_step = forward_step
    impl._verl_prefix_titan = True


def _fp32_grouped_experts(self: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over grouped tokens in the weights' dtype (fp32 here), as torchtitan's in bf16."""
    from torch.distributed.tensor import DTensor

    weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)]
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

    def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offsets)

    w1, w2, w3 = weights
    x = x_RD.to(w1.dtype)
    hidden = torch.nn.functional.silu(grouped(x, w1)) * grouped(x, w3)
    return grouped(hidden, w2).type_as(x_RD)


def patch_grouped_experts() -> None:
    """fp32 expert compute for fp32 parameters (module docstring); torchtitan's forward otherwise."""
    from torchtitan.models.common.moe import GroupedExperts

    if getattr(GroupedExperts, "_verl_prefix_fp32", False):
        return
    original = GroupedExperts.forward

    def forward(self: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if self.w1_EFD.dtype == torch.float32:
            return _fp32_grouped_experts(self, x_RD, num_tokens_per_expert_E)
        return original(self, x_RD, num_tokens_per_expert_E)

    GroupedExperts.forward = forward
    GroupedExperts._verl_prefix_fp32 = True


def release_stock() -> None:
    """Drop the ``torchtitan`` factories on the devices verl's own module registers (cuda, npu) right before that
    module is imported: its decorator refuses a key that is already there. The CPU factory stays. Ours are the
    factories ``registry`` marked with ``STOCK_FACTORY_MARK`` (the registry sits above this module)."""
    from verl_prefix.backend.registry import unregister

    # nothing of ours left: the entry goes, and verl's decorator recreates it as it would
    unregister(STOCK_BACKEND, ("cuda", "npu"), lambda entry: getattr(entry, STOCK_FACTORY_MARK, False))


def ensure_titan_platform() -> types.ModuleType:
    """Apply every adaptation (idempotent) and return verl's TorchTitan engine module."""
    from verl_prefix.backend.platform_cpu import cpu_platform_requested

    check_version()
    alias_lr_scheduler()
    cpu = cpu_platform_requested()
    if cpu:
        patch_cpu_device()
    name = "verl.workers.engine.torchtitan.transformer_impl"
    if name not in sys.modules:
        release_stock()
    impl = importlib.import_module(name)
    if cpu:
        patch_cpu_device()  # the modules verl's engine pulled in
        patch_cpu_attention()
    _patch_verl_engine_module(impl, cpu)
    patch_grouped_experts()
    return impl


def replace_config(config: Any, **changes: Any) -> Any:
    """A copy of a (frozen or not) verl config dataclass with ``changes``; the caller's object stays untouched."""
    clone = dataclasses.replace(config) if dataclasses.is_dataclass(config) else config
    for key, value in changes.items():
        object.__setattr__(clone, key, value)
    return clone
