"""Did reuse run? An exactness test through the engine must say so, or a silent fallback to dense (which is
exact by construction) would pass as "exact". One helper for every test that compares prefix_fsdp2 with
stock/HF, and its opposite for tests whose point is a fallback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_prefix.harness.verl_engine import reduce_step_metrics


def reduced(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One float per key: verl's per-micro-batch lists (raw engine output) are reduced as verl does;
    already-reduced metrics (``reduced_metrics``, a trainer step's, a bench or replay row's) pass through."""
    if any(isinstance(v, list) for v in metrics.values()):
        return reduce_step_metrics(dict(metrics))
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def assert_reuse_ran(metrics: Mapping[str, Any], *, groups: float | None = None, namespace: str = "prefix/") -> None:
    """``prefix/groups`` > 0 (== ``groups`` when given) and 0 < ``physical_tokens`` < ``logical_tokens``.

    ``namespace`` is where the engine's keys live: ``prefix/`` from the engine, ``actor/prefix/`` from a
    trainer step, ``actor/prefix/old_log_prob/`` for the old log-prob pass.
    """
    m = reduced(metrics)
    keys = [namespace + k for k in ("groups", "logical_tokens", "physical_tokens")]
    missing = [k for k in keys if k not in m]
    assert not missing, f"no reuse metrics {missing}: did prefix_fsdp2 run at all? keys: {sorted(m)[:20]}"
    n_groups, logical, physical = (m[k] for k in keys)
    assert n_groups > 0, f"{keys[0]} = {n_groups}: every sample ran dense, the comparison proves nothing"
    if groups is not None:
        assert n_groups == groups, f"{keys[0]} = {n_groups}, expected {groups}"
    assert 0 < physical < logical, f"physical {physical} vs logical {logical} tokens: nothing was reused"


def assert_no_reuse(metrics: Mapping[str, Any], *, namespace: str = "prefix/") -> None:
    """The opposite, for tests of a fallback: no group reused, and the schedule computed every logical token."""
    m = reduced(metrics)
    assert m[namespace + "groups"] == 0, f"{namespace}groups = {m[namespace + 'groups']} on a fallback path"
    assert m[namespace + "physical_tokens"] == m[namespace + "logical_tokens"] > 0


def assert_infer_matches(dense: Mapping[str, Any], prefix: Mapping[str, Any], tol: float, *, groups: int) -> None:
    """A forward-only pass under reuse returns the stock engine's per-token log-probs and entropies (nested or
    padded, as the engine returns them) within ``tol``, and reuse ran with ``groups`` groups."""
    import torch

    for key in ("response_log_probs", "response_entropy"):
        want, got = dense[key], prefix[key]
        want = want.values() if want.is_nested else want
        got = got.values() if got.is_nested else got
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert_reuse_ran(prefix["metrics"], groups=groups)
