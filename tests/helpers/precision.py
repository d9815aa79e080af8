"""True-fp64 test mode: HF computes RMSNorm and eager softmax in fp32 even in fp64 models (DESIGN.md
trap 9), which turns 1e-16 reordering noise into 1e-7 "errors". Promote those ops for the duration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

_NORMS = [
    modeling_llama.LlamaRMSNorm,
    modeling_mistral.MistralRMSNorm,
    modeling_phi3.Phi3RMSNorm,
    modeling_qwen2.Qwen2RMSNorm,
    modeling_qwen3.Qwen3RMSNorm,
    modeling_qwen3_moe.Qwen3MoeRMSNorm,
    modeling_gpt_oss.GptOssRMSNorm,
    modeling_deepseek_v3.DeepseekV3RMSNorm,
]
# Gemma-2 and Gemma-3 scale by (1 + weight) and round through fp32 as well
_GEMMA_NORMS = [modeling_gemma2.Gemma2RMSNorm, modeling_gemma3.Gemma3RMSNorm]


def rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float64:
        return self._fp32_forward(hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def gemma_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float64:
        return self._fp32_forward(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def gemma4_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma-4's RMSNorm (a plain weight, optionally none) without its fp32 round trip for fp64 inputs."""
    if x.dtype != torch.float64:
        return self._fp32_forward(x)
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
    return normed * self.weight if self.with_scale else normed


def router_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's router computes its logits in fp32; an fp64 model's in fp64."""
    if hidden_states.dtype != torch.float64:
        return self._fp32_forward(hidden_states)
    return torch.nn.functional.linear(hidden_states.view(-1, self.config.hidden_size), self.weight)


# other modules whose forward casts to fp32: (class, the forward that keeps fp64)
_ROUTERS = [
    (modeling_deepseek_v3.DeepseekV3TopkRouter, router_in_input_dtype),
    (modeling_gemma4.Gemma4RMSNorm, gemma4_norm_in_input_dtype),
]


@contextmanager
def promote_fp32_upcasts() -> Iterator[None]:
    original_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - torch's own signature
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return original_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    promoted = {cls: rms_norm_in_input_dtype for cls in _NORMS}
    promoted.update({cls: gemma_norm_in_input_dtype for cls in _GEMMA_NORMS})
    promoted.update(dict(_ROUTERS))
    saved = [(cls, cls.forward) for cls in promoted]
    try:
        torch.nn.functional.softmax = softmax
        for cls, forward in saved:
            cls._fp32_forward = forward
            cls.forward = promoted[cls]
        yield
    finally:
        torch.nn.functional.softmax = original_softmax
        for cls, forward in saved:
            cls.forward = forward
            del cls._fp32_forward


@contextmanager
def fp64_throughout() -> Iterator[None]:
    """True fp64 for any family (the coverage matrix): no fp64 tensor is cast down to fp32 (``.to``, ``.type``,
    ``.float()``; an integer tensor's ``.float()`` gives fp64), and softmax asked for fp32 on fp64 scores stays
    fp64. Dense and reuse both run under it, so the comparison sees fp64 reordering noise only, whatever norm or
    router a family hand-writes."""
    original_to, original_float, original_softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax
    original_type = torch.Tensor.type

    def keep(self: torch.Tensor, dtype: object) -> object:
        return torch.float64 if self.dtype == torch.float64 and dtype == torch.float32 else dtype

    def to(self, *args, **kwargs):
        args = tuple(keep(self, a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = keep(self, kwargs["dtype"])
        return original_to(self, *args, **kwargs)

    def float_(self, *args, **kwargs):  # integer positions too, or RoPE would multiply fp64 by fp32
        if self.dtype == torch.float64:
            return self
        if not self.is_floating_point():
            return original_to(self, torch.float64)
        return original_float(self, *args, **kwargs)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - torch's own signature
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return original_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    def type_(self, dtype=None, *args, **kwargs):
        if isinstance(dtype, torch.dtype):
            dtype = keep(self, dtype)
        return original_type(self, dtype, *args, **kwargs)

    try:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to, float_, softmax
        torch.Tensor.type = type_
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = original_to, original_float, original_softmax
        torch.Tensor.type = original_type
