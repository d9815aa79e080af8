"""True-fp64 test mode: HF computes RMSNorm and eager softmax in fp32 even in fp64 models (DESIGN.md
trap 9), which turns 1e-16 reordering noise into 1e-7 "errors". Promote those ops for the duration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
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


@contextmanager
def promote_fp32_upcasts() -> Iterator[None]:
    original_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - torch's own signature
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return original_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    saved = [(cls, cls.forward) for cls in _NORMS + _GEMMA_NORMS]
    try:
        torch.nn.functional.softmax = softmax
        for cls, forward in saved:
            cls._fp32_forward = forward
            cls.forward = gemma_norm_in_input_dtype if cls in _GEMMA_NORMS else rms_norm_in_input_dtype
        yield
    finally:
        torch.nn.functional.softmax = original_softmax
        for cls, forward in saved:
            cls.forward = forward
            del cls._fp32_forward
