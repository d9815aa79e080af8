"""verl's fused linear-cross-entropy under reuse (``actor_rollout_ref.model.use_fused_kernels``).

With fused kernels verl computes each token's log-prob and entropy from the final hidden states and the LM head's
weight in chunks, never materialising the ``[tokens, vocab]`` logits (``FusedLinearForPPO`` for the ``torch`` and
``liger`` backends, ``linear_cross_entropy`` for ``triton``; ``fused_kernel_options.impl_backend``). The schedule
does the same wherever it computes log-probs (phase B, forward-only passes, a trie node carrying loss):

- ``fused_head`` makes the LM head, for one model call, compute verl's kernel from its input (the final hidden
  states, already sliced to the kept positions) and its weight, and return the log-probs and entropies packed as
  its output: no logits exist. The kernel runs inside the head's own call, so FSDP2's hooks gather the weight for
  it whether verl shards the head as its own unit (untied embeddings) or as part of the root (tied); and because
  the packed values are what the model returns, FSDP2 gathers the weight again before their backward. (verl 0.9.1's
  own fused forward reads ``lm_head.weight`` outside any FSDP hook and fails with untied embeddings:
  ``aten.mm.default got mixed torch.Tensor and DTensor``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# ``fused_kernel_options.impl_backend`` values verl accepts
FUSED_BACKENDS = ("torch", "liger", "triton")


def fused_backend(model: nn.Module) -> str | None:
    """The fused-kernel backend verl patched ``model`` with (``_verl_fused_kernels_backend``), or None."""
    backend = getattr(model, "_verl_fused_kernels_backend", None)
    return backend if backend in FUSED_BACKENDS else None


class FusedCall:
    """What one model call under ``fused_head`` computed: its LM head's fused log-probs and entropies."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)

    def outputs(self, out: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_probs, entropy)``, each shaped as the positions the head scored (``[B, S]``). The model must have
        returned the head's output as its logits untouched: the gradient reaches the kernel through them (where
        FSDP2 gathers the head's weight again before its backward)."""
        logits = getattr(out, "logits", None)
        if self.packed is None or logits is not self.packed:
            raise ValueError(
                "verl's fused kernels under reuse need the model to return its LM head's output as its logits; this "
                "model transforms them (logit softcapping or scaling, which verl's fused kernels do not apply "
                "either): set actor_rollout_ref.model.use_fused_kernels=false"
            )
        log_probs, entropy = self.packed[..., 0], self.packed[..., 1]
        return log_probs.to(self.dtypes[0]), entropy.to(self.dtypes[1])  # exact: packed in the wider of the two


@contextmanager
def fused_head(model: nn.Module, labels: torch.Tensor, temperature: float, backend: str) -> Iterator[FusedCall]:
    """For one model call: the LM head computes, instead of logits, verl's fused log-probs and entropies of
    ``labels`` (shaped as the positions the head is called with) from its input hidden states and its weight, packed
    as its output ``[..., 2]``. It runs inside the head's own call, so FSDP2's hooks gather the weight for it and,
    since the packed values are the model's output, again before their backward."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"fused_kernel_options.impl_backend must be one of {FUSED_BACKENDS}, got {backend!r}")
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings for verl's fused kernels to read")
    call = FusedCall()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1).to(torch.int64)
        if targets.numel() < flat.shape[0]:  # a head scoring more positions than labelled (no logits_to_keep): the
            # labels are those of the last positions, the earlier ones' values are placeholders the caller drops
            targets = torch.cat([targets.new_zeros(flat.shape[0] - targets.numel()), targets])
        log_probs, entropy = _kernel(flat, head.weight, targets, temperature, backend)
        call.dtypes = (log_probs.dtype, entropy.dtype)  # verl's: fp32 log-probs, entropy in the hidden states' dtype
        wide = torch.promote_types(log_probs.dtype, entropy.dtype)
        shape = hidden.shape[:-1]
        call.packed = torch.stack([log_probs.to(wide).view(shape), entropy.to(wide).view(shape)], dim=-1)
        return call.packed

    head.forward = forward  # the instance's own: nn.Module.__call__ still runs every hook around it
    try:
        yield call
    finally:
        del head.forward


def _kernel(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's fused log-probs and entropy (``[N]`` each) of ``labels`` from ``[N, H]`` hidden states."""
    if backend == "triton":
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(hidden, weight, labels, temperature, "none")
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    return FusedLinearForPPO(impl_backend=backend).forward(hidden, weight, labels, temperature)


def scalar_temperature(temperature: torch.Tensor) -> float:
    """The one temperature of a batch's rows (verl's fused kernels take a scalar; so does its stock engine)."""
    values = torch.unique(temperature.detach().to(torch.float32).cpu())
    if values.numel() != 1:
        raise ValueError(
            "use_fused_kernels does not serve per-sample temperatures (verl's fused kernels take one temperature, "
            f"got {values.tolist()}); set actor_rollout_ref.model.use_fused_kernels=false"
        )
    return float(values[0])
