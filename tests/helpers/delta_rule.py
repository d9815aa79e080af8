"""True-fp64 mode for Qwen3.5's and Qwen3-Next's gated delta-nets (DESIGN.md trap 9 for linear attention).

transformers runs the gated delta rule in fp32 whatever the model's dtype, and its RMSNorms upcast to
fp32: an fp64 model then differs from itself by fp32 rounding between a whole-sequence forward and a
prefix-then-suffix one (chunk boundaries move). ``fp64_delta_net`` swaps in the rule computed token by token
in the input dtype (the recurrence the chunked kernel evaluates, with the same ``initial_state`` contract)
and norms in the input dtype, so an fp64 comparison measures the schedule, not fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as Q
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as QM
from transformers.models.qwen3_next import modeling_qwen3_next as QN

from verl_prefix.schedule.models import recurrent


def delta_rule_in_dtype(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, S, H, d]`` inputs, ``g``/``beta`` ``[B, S, H]``: per token, decay the state by ``exp(g)``, write
    ``beta * (v - S^T k)`` along ``k``, read ``S^T q``; queries scaled by ``d_k ** -0.5``."""
    dtype = torch.promote_types(query.dtype, g.dtype)
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query, key, value, g, beta = (
        x.as_subclass(torch.Tensor).transpose(1, 2).to(dtype) for x in (query, key, value, g, beta)
    )
    batch, heads, length, d_k = key.shape
    query = query * d_k**-0.5
    state = (
        torch.zeros(batch, heads, d_k, value.shape[-1], dtype=dtype, device=query.device)
        if initial_state is None
        else initial_state.to(dtype)
    )
    outputs = []
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * key[:, :, t, :, None]).sum(-2)
        delta = (value[:, :, t] - read) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * query[:, :, t, :, None]).sum(-2))
    out = torch.stack(outputs, dim=2).transpose(1, 2).contiguous().to(query.dtype)
    return out, (state if output_final_state else None)


class _KeepFp64(torch.Tensor):
    """A tensor whose ``.float()`` keeps fp64: the decay gate ``g = -A_log.float().exp() * softplus(a.float()
    + dt_bias)`` then computes in fp64 (its ``A_log`` gradient is otherwise rounded to fp32 once per backward,
    which a prefix-then-suffix run does once per micro-batch)."""

    def float(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self if self.dtype == torch.float64 else super().float(*args, **kwargs)


class _KeepFp64Parameter(torch.nn.Parameter):
    float = _KeepFp64.float


def _keep_fp64_output(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out.as_subclass(_KeepFp64)


def _gate_in_fp64(module: torch.nn.Module, args: tuple) -> None:
    # set per call: FSDP2 registers its unsharded parameter object for the forward
    if type(module.A_log) is torch.nn.Parameter:
        module.A_log.__class__ = _KeepFp64Parameter


def _gate_restored(module: torch.nn.Module, args: tuple, out: object) -> None:
    if type(module.A_log) is _KeepFp64Parameter:
        module.A_log.__class__ = torch.nn.Parameter


def _norm(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_norm(self: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


_FAMILIES = (  # (gated delta-net, norm, gated norm, the family's own torch rules)
    (Q.Qwen3_5GatedDeltaNet, Q.Qwen3_5RMSNorm, Q.Qwen3_5RMSNormGated, Q),
    (QM.Qwen3_5MoeGatedDeltaNet, QM.Qwen3_5MoeRMSNorm, QM.Qwen3_5MoeRMSNormGated, QM),
    (QN.Qwen3NextGatedDeltaNet, QN.Qwen3NextRMSNorm, QN.Qwen3NextRMSNormGated, QN),
)


@contextmanager
def fp64_delta_net(model: torch.nn.Module) -> Iterator[None]:
    """Every gated delta-net of ``model`` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) runs ``delta_rule_in_dtype`` with its decay
    gate in fp64 and every norm of those families computes in its input dtype, for the duration; the schedule
    serves the layers with that rule (a plain torch function: autograd gives the initial state's gradient)."""
    nets = tuple(f[0] for f in _FAMILIES)
    layers = [(m, next(f[3] for f in _FAMILIES if isinstance(m, f[0]))) for m in model.modules() if isinstance(m, nets)]
    saved = [(cls, cls.forward) for f in _FAMILIES for cls in f[1:3]]
    kernels = recurrent.SERVED_KERNELS
    hooks = []
    try:
        recurrent.SERVED_KERNELS = (*kernels, delta_rule_in_dtype)
        for f in _FAMILIES:
            f[1].forward = _norm
            f[2].forward = _gated_norm
        for layer, _ in layers:
            layer.chunk_gated_delta_rule = delta_rule_in_dtype
            layer.recurrent_gated_delta_rule = delta_rule_in_dtype
            hooks.append(layer.register_forward_pre_hook(_gate_in_fp64))
            hooks.append(layer.register_forward_hook(_gate_restored))
            # the decay gate's input: Qwen3.5's own projection, Qwen3-Next's fused one (``a`` is split from it)
            gate_input = layer.in_proj_a if hasattr(layer, "in_proj_a") else layer.in_proj_ba
            hooks.append(gate_input.register_forward_hook(_keep_fp64_output))
        yield
    finally:
        recurrent.SERVED_KERNELS = kernels
        for cls, forward in saved:
            cls.forward = forward
        for hook in hooks:
            hook.remove()
        for layer, family in layers:
            layer.chunk_gated_delta_rule = family.torch_chunk_gated_delta_rule
            layer.recurrent_gated_delta_rule = family.torch_recurrent_gated_delta_rule
