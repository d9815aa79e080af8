"""Router load-balancing (aux) loss for HF mixture-of-experts actors, exact under prefix reuse.

verl 0.9.1's FSDP engine never adds a router aux loss, so ``prefix_fsdp2`` offers one
(``moe_aux_loss_coef``) and computes it identically in dense and reuse mode.

HF's ``load_balancing_loss_func`` (Switch Transformer, used unchanged by Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, Qwen3.5-MoE, Qwen3-Next) is, for one forward call over the non-pad tokens ``T`` of a micro-batch
and its MoE layers ``L``::

    aux = E * sum_{k,e} f[k, e] * p[e]
    f[k, e] = #{(l, t): the k-th top expert of token t in layer l is e} / (|L| |T|)   (fp32, no grad)
    p[e]    = sum_{l, t} softmax(router_logits[l, t])[e] / (|L| |T|)

A micro-batch of B sequences sharing a prompt holds B copies of the prefix. Reuse computes the prefix
once, so its statistics are kept as sums (``RouterStats``: constant top-k counts, graph-attached
probability sums) and every suffix micro-batch combines ``B * prefix + suffix`` over
``B * (P - 1) + suffix tokens`` ("logical prefix-token accounting", ``logical_stats``). The prefix
probability sum is a boundary leaf like the prefix K/V: its grad accumulates over the micro-batches
and seeds phase C. Counting the prefix once instead trains the router toward another balance.

Router logits are taken from the modules HF itself records as ``router_logits`` (forward hooks),
not from ``output_router_logits``: with a prefix context HF's own aux computation would pair the
mask and the router rows wrongly, and phase A stops before the model returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Families whose causal LM adds transformers' Switch-style ``load_balancing_loss_func`` over the
# logits their ``*TopKRouter`` returns first, with ``num_experts`` / ``num_experts_per_tok``
# (checked against transformers 5.10.4 source).
SUPPORTED_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "qwen3_vl_moe_text",
)

# Router statistics other than per-micro-batch ones. No transformers 5.10.4 family computes them (HF's
# DeepSeek-V2/V3 define no aux loss at all); remote-code DeepSeek models declare them in the config.
_UNSUPPORTED_STATISTICS = {
    "seq_aux": "per-sequence router statistics (DeepSeek-style seq_aux)",
    "aux_loss_alpha": "an aux loss the model computes inside its own gate (DeepSeek remote code)",
}


def _text_config(model: nn.Module) -> object:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def in_model_aux_reason(model: nn.Module) -> str | None:
    """Why a model's own forward already adds a router loss over the tokens it sees, or None.

    Such a gate (remote-code DeepSeek ``MoEGate`` with ``aux_loss_alpha > 0``) computes its loss per
    forward call: reuse would count the prefix once per group, a silent change, so it must run dense.
    """
    config = _text_config(model)
    alpha = getattr(config, "aux_loss_alpha", 0.0)
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        return None
    # transformers' own classes never add a loss inside the gate; remote code (trust_remote_code) may
    if any(type(m).__module__.startswith("transformers_modules") for m in model.modules()):
        return "router_in_model_aux"
    return None


def stochastic_routing_reason(model: nn.Module) -> str | None:
    """Router jitter noise samples per forward: reuse would share one prefix sample across a group."""
    config = _text_config(model)
    for name in ("router_jitter_noise", "input_jitter_noise"):
        value = getattr(config, name, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            return "router_jitter"
    return None


@dataclass
class RouterStats:
    """Load-balancing statistics as sums, so that micro-batches and prefix copies can be combined.

    ``counts[k, e]``: (token, layer) pairs whose k-th choice is expert e (integer, no gradient).
    ``prob_sum[e]``: router probabilities summed over tokens and layers (carries the gradient).
    ``tokens``: tokens per layer; the denominators are ``tokens * layers``.
    ``z_sum[l]``: under a router z-loss (megatron-core's ``moe_z_loss_coeff``), each layer's squared log-sum-exp of the
    router logits summed over the tokens (carries the gradient); None without one.
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    tokens: int
    layers: int
    z_sum: torch.Tensor | None = None

    def boundary(self) -> list[torch.Tensor]:
        """The sums whose gradient crosses the phase-B boundary into phase C: the probability sum, the z sum."""
        return [self.prob_sum] if self.z_sum is None else [self.prob_sum, self.z_sum]

    def detached_leaf(self, requires_grad: bool) -> RouterStats:
        """The phase-B boundary: leaves that collect d(aux)/d(prefix probability sums) (and d(z)/d(z sums))."""
        z_sum = None if self.z_sum is None else self.z_sum.detach().requires_grad_(requires_grad)
        prob_sum = self.prob_sum.detach().requires_grad_(requires_grad)
        return RouterStats(self.counts, prob_sum, self.tokens, self.layers, z_sum)


def logical_stats(prefix: RouterStats, suffix: RouterStats, copies: int) -> RouterStats:
    """What a dense micro-batch of ``copies`` full sequences sees: the prefix counted once per row."""
    if prefix.layers != suffix.layers:
        raise ValueError(f"prefix has {prefix.layers} MoE layers of router statistics, suffix {suffix.layers}")
    if (prefix.z_sum is None) != (suffix.z_sum is None):
        raise ValueError("router z sums on one side of the prefix boundary only")
    return RouterStats(
        counts=prefix.counts * copies + suffix.counts,
        prob_sum=prefix.prob_sum * copies + suffix.prob_sum,
        tokens=prefix.tokens * copies + suffix.tokens,
        layers=suffix.layers,
        z_sum=None if suffix.z_sum is None else prefix.z_sum * copies + suffix.z_sum,
    )


def load_balancing_loss(stats: RouterStats, num_experts: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` from sums: fractions in fp32 as HF computes them, then E * f . p."""
    denominator = stats.tokens * stats.layers
    if denominator == 0:
        return stats.prob_sum.sum() * 0.0
    tokens_per_expert = stats.counts.float() / denominator
    router_prob_per_expert = stats.prob_sum / denominator
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def router_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """HF's aux softmax runs in the logits' dtype (fp32 under autocast); never below fp32."""
    return F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def valid_router_rows(
    logits: list[torch.Tensor | None], valid: torch.Tensor | None, model_name: str
) -> list[torch.Tensor]:
    """Each router's captured logits ``[tokens, E]`` of one call, kept to the tokens ``valid`` marks (row-major
    over the call's ``[B, S]``; None: all). A router that did not run, or a mask of another size, is an error."""
    missing = [i for i, lg in enumerate(logits) if lg is None]
    if missing:
        raise RuntimeError(f"{model_name}: routers {missing} did not run in this forward call")
    if valid is None:
        return list(logits)
    flat = valid.reshape(-1)
    rows = []
    for layer_logits in logits:
        if flat.numel() != layer_logits.shape[0]:
            raise RuntimeError(f"router logits have {layer_logits.shape[0]} rows but the token mask has {flat.numel()}")
        rows.append(layer_logits[flat.to(layer_logits.device)])
    return rows


class MoeRouters:
    """The router modules of an HF MoE causal LM, in forward order, and their load-balancing loss.

    Raises ``ValueError`` naming the model class for a model without MoE routers, a family whose
    router statistics differ from HF's Switch-style function, or per-sequence / in-gate statistics:
    never a silent change of what is counted.
    """

    def __init__(self, model: nn.Module) -> None:
        config = _text_config(model)
        name = type(model).__name__.removeprefix("FSDP")
        model_type = getattr(config, "model_type", None)
        for attr, what in _UNSUPPORTED_STATISTICS.items():
            value = getattr(config, attr, None)
            if value not in (None, False, 0, 0.0):
                raise ValueError(
                    f"moe_aux_loss_coef > 0 with {name}: its config sets {attr}={value!r}, {what}; "
                    "verl_prefix implements HF's per-micro-batch Switch-style statistics only. "
                    "Set moe_aux_loss_coef=0."
                )
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        if model_type not in SUPPORTED_MODEL_TYPES or recorder is None:
            has_moe = (
                recorder is not None
                or getattr(config, "num_experts", None)
                or getattr(config, "num_local_experts", None)
            )
            what = (
                f"model_type {model_type!r} has no router load-balancing loss verl_prefix knows to be HF's "
                f"Switch-style function (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
                if has_moe
                else "it is not a mixture-of-experts model (no MoE router)"
            )
            raise ValueError(f"moe_aux_loss_coef > 0 with {name}: {what}. Set moe_aux_loss_coef=0.")
        if getattr(recorder, "index", 0) != 0:
            raise ValueError(f"moe_aux_loss_coef > 0 with {name}: unexpected router-logit recorder {recorder!r}")
        # a recorder may name its layers too (Qwen3-VL-MoE's ``mlp.gate``): HF records only modules of that name
        layer = getattr(recorder, "layer_name", None)
        self.modules: list[nn.Module] = [
            m
            for path, m in model.named_modules()
            if isinstance(m, recorder.target_class) and (layer is None or path.endswith(layer))
        ]
        if not self.modules:
            raise ValueError(f"moe_aux_loss_coef > 0 with {name}: no {recorder.target_class.__name__} modules found")
        self.num_experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.model_name = name

    @contextmanager
    def capture(self, on_complete: Callable[[nn.Module], None] | None = None) -> Iterator[list[torch.Tensor | None]]:
        """Collect each router's logits ``[tokens, E]`` for one forward call, graph attached.

        Only the first call of each router counts (a checkpointed layer re-runs its forward in backward,
        and the hooks are gone by then anyway). ``on_complete(router)`` runs once every router has fired:
        phase A uses it to stop right after the last router when that is the last thing it needs.
        """
        captured: list[torch.Tensor | None] = [None] * len(self.modules)
        index = {id(m): i for i, m in enumerate(self.modules)}

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            i = index[id(module)]
            if captured[i] is not None:
                return
            logits = output[0] if isinstance(output, tuple) else output
            captured[i] = logits.reshape(-1, self.num_experts)
            if on_complete is not None and all(c is not None for c in captured):
                on_complete(module)

        handles = [m.register_forward_hook(hook) for m in self.modules]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def stats(self, logits: list[torch.Tensor | None], valid: torch.Tensor | None = None) -> RouterStats:
        """Sums over the tokens ``valid`` marks (row-major over the forward's ``[B, S]``; None: all)."""
        counts = None
        prob_sum = None
        tokens = 0
        for layer_logits in valid_router_rows(logits, valid, self.model_name):
            probs = router_probabilities(layer_logits)
            selected = torch.topk(probs, self.top_k, dim=-1).indices
            layer_counts = F.one_hot(selected, self.num_experts).sum(dim=0)
            counts = layer_counts if counts is None else counts + layer_counts
            layer_sum = probs.sum(dim=0)
            prob_sum = layer_sum if prob_sum is None else prob_sum + layer_sum
            tokens = layer_logits.shape[0]
        return RouterStats(counts=counts, prob_sum=prob_sum, tokens=tokens, layers=len(logits))

    def loss(self, stats: RouterStats) -> torch.Tensor:
        return load_balancing_loss(stats, self.num_experts)


def topk_choices(routers: MoeRouters, logits: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts as a sorted ``[tokens, k]`` index set (what routing used)."""
    return torch.topk(router_probabilities(logits), routers.top_k, dim=-1).indices.sort(dim=-1).values


def count_topk_flips(want: torch.Tensor, got: torch.Tensor) -> int:
    """Tokens whose top-k expert set differs between two runs (``[tokens, k]`` sorted index sets).

    In low precision a near-tie can pick another expert in reuse than in dense: a real, discrete
    difference that a comparison must report, not absorb into its tolerance.
    """
    if want.shape != got.shape:
        raise ValueError(f"top-k choices differ in shape: {tuple(want.shape)} vs {tuple(got.shape)}")
    return int((want != got).any(dim=-1).sum())
