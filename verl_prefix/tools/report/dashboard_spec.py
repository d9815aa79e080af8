"""The dashboard panels, defined once for both dashboards (wandb workspace and offline HTML page).

Every key is one verl's trainer logs: ``timing_s/<stage>`` from its ``marked_timer`` blocks, the engine's
``prefix/...`` metrics as ``actor/prefix/...`` (verl prefixes the update's metrics with ``actor/``) and the
forward-only passes' as ``actor/prefix/old_log_prob/...`` and ``actor/prefix/ref_log_prob/...`` (logged by the
``prefix_sync`` trainer mode). The first section is a quick check of a run: reuse happened (reuse factor above 1),
nothing fell back (no sample ran dense) and what the FLOP model says it saved, per pass.
Fallback reasons are open-ended, so that panel matches its keys with a pattern instead of a list (word characters,
and ``:``, ``.``, ``-`` for ``unknown_structure:<name>``, ``schedule.models.known_structures.unknown_reason``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from verl_prefix.schedule.telemetry import PHASES

ACTOR = "actor/prefix/"
OLD_LOG_PROB = "actor/prefix/old_log_prob/"
REF_LOG_PROB = "actor/prefix/ref_log_prob/"
# the three passes that run the schedule, with their legend labels
PASSES = ((ACTOR, "update"), (OLD_LOG_PROB, "old log-prob"), (REF_LOG_PROB, "ref log-prob"))
PHASE_LABELS = {
    "A": "A prefix forward",
    "B": "B suffix micro-batches",
    "C": "C prefix backward",
    "dense": "dense rows",
    "lockstep": "lockstep fillers",
}


@dataclass(frozen=True)
class Panel:
    """One chart: a line per (run, key) against the training step.

    ``keys`` are exact metric names with their legend labels; ``pattern`` (a regex) adds every logged key
    it matches, labelled by what follows ``pattern_label_after``.
    """

    id: str
    title: str
    unit: str
    keys: tuple[tuple[str, str], ...] = ()
    pattern: str | None = None
    pattern_label_after: str = ""
    note: str = ""

    def metric_keys(self) -> list[str]:
        """The exact keys this panel plots (not those its pattern adds)."""
        return [key for key, _ in self.keys]

    def matches(self, key: str) -> bool:
        """Whether ``key`` belongs on this panel (an exact key or a pattern match)."""
        return key in dict(self.keys) or (self.pattern is not None and re.fullmatch(self.pattern, key) is not None)

    def label(self, key: str) -> str:
        """The legend label of ``key``."""
        labels = dict(self.keys)
        return labels[key] if key in labels else key.removeprefix(self.pattern_label_after)


@dataclass(frozen=True)
class Section:
    """A titled group of panels (a wandb workspace section; a heading on the HTML page)."""

    name: str
    panels: tuple[Panel, ...]


# forward-only passes have no backward: no phase C
FORWARD_ONLY_PHASES = tuple(phase for phase in PHASES if phase != "C")


def _per_phase(head: str, kind: str) -> tuple[tuple[str, str], ...]:
    phases = PHASES if head == ACTOR else FORWARD_ONLY_PHASES
    return tuple((f"{head}{kind}/{phase}", PHASE_LABELS[phase]) for phase in phases)


def _panel_id(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _panel(title: str, unit: str, keys: tuple[tuple[str, str], ...], **kwargs: str) -> Panel:
    return Panel(id=_panel_id(title), title=title, unit=unit, keys=keys, **kwargs)


def _per_pass(name: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{head}{name}", label) for head, label in PASSES)


def _fallbacks(head: str, what: str) -> Panel:
    return _panel(
        f"{what} fallbacks by reason",
        "samples per rank and mini-batch",
        (),
        pattern=re.escape(head) + r"fallback_[\w:.-]+",
        pattern_label_after=f"{head}fallback_",
        note="none logged: every sample reused",
    )


def _forward_only(head: str, what: str) -> Section:
    return Section(
        f"{what[0].upper()}{what[1:]} pass (forward only)",
        (
            _panel(f"{what} phase time", "s", _per_phase(head, "time_s")),
            _panel(f"{what} process RSS", "MiB", _per_phase(head, "max_rss_mib")),
            _panel(
                f"{what} tokens",
                "tokens",
                ((f"{head}logical_tokens", "logical"), (f"{head}physical_tokens", "physical")),
            ),
            _panel(
                f"{what} time, measured vs dense estimate",
                "s",
                ((f"{head}time_s/schedule", "measured"), (f"{head}est_dense_time_s", "dense, FLOP-model estimate")),
            ),
        ),
    )


# the quick check's panels, with what a healthy run shows; the HTML page also sums each up per run
QUICK_CHECK = Section(
    "Quick check: did reuse run, and what did it save",
    (
        _panel("reuse factor (want > 1)", "x logical / physical tokens", _per_pass("reuse_factor")),
        _panel(
            "samples run dense (want 0)",
            "samples per rank and mini-batch",
            _per_pass("dense_samples"),
            note="not logged: runs from before prefix/dense_samples, see the fallback panels",
        ),
        _panel("FLOPs saved, dense / schedule (FLOP model)", "x", _per_pass("flops_saved_ratio")),
        _panel(
            "update time, measured vs dense estimate",
            "s per mini-batch",
            ((f"{ACTOR}time_s/schedule", "measured"), (f"{ACTOR}est_dense_time_s", "dense, FLOP-model estimate")),
        ),
    ),
)


SECTIONS: tuple[Section, ...] = (
    QUICK_CHECK,
    Section(
        "Update time: dense vs prefix",
        (
            _panel("update_actor time", "s", (("timing_s/update_actor", "update_actor"),)),
            _panel("old log-prob time", "s", (("timing_s/old_log_prob", "old_log_prob"),)),
            _panel("ref log-prob time", "s", (("timing_s/ref", "ref"),), note="logged with a reference policy only"),
            _panel("step time", "s", (("timing_s/step", "step"),)),
        ),
    ),
    Section(
        "Per-phase time (update)",
        (
            _panel("phase time, mean over ranks", "s", _per_phase(ACTOR, "time_s")),
            _panel("phase time, slowest rank", "s", _per_phase(ACTOR, "max_time_s")),
            _panel(
                "schedule and optimizer time",
                "s",
                ((f"{ACTOR}time_s/schedule", "schedule"), (f"{ACTOR}time_s/optimizer", "optimizer")),
            ),
        ),
    ),
    Section(
        "Per-phase memory (update)",
        (
            _panel("saved for backward", "MiB", _per_phase(ACTOR, "max_saved_for_backward_mib")),
            _panel("process RSS", "MiB", _per_phase(ACTOR, "max_rss_mib")),
            _panel(
                "device allocator peak",
                "MiB",
                _per_phase(ACTOR, "max_peak_device_mib"),
                note="logged on CUDA/NPU only",
            ),
            _panel(
                "largest phase peak beside verl's perf/*",
                "GiB",
                (
                    (f"{ACTOR}max_rss_gb", "process RSS, largest phase"),
                    (f"{ACTOR}max_memory_allocated_gb", "device allocator, largest phase"),
                    ("actor/perf/max_memory_allocated_gb", "verl: device allocator, lifetime"),
                    ("actor/perf/cpu_memory_used_gb", "verl: machine memory used"),
                ),
            ),
            _panel(
                "held at once and prefix K/V",
                "MiB",
                (
                    (f"{ACTOR}max_saved_for_backward_held_mib", "saved for backward, held at once"),
                    (f"{ACTOR}max_prefix_kv_mib", "one group's prefix K/V"),
                ),
            ),
        ),
    ),
    Section(
        "Tokens and reuse",
        (
            _panel(
                "logical vs physical tokens",
                "tokens",
                ((f"{ACTOR}logical_tokens", "logical (dense computes)"), (f"{ACTOR}physical_tokens", "physical")),
            ),
            _panel("reuse factor", "x", ((f"{ACTOR}reuse_factor", "logical / physical"),)),
            _panel("logical tokens per second", "tokens/s", ((f"{ACTOR}logical_tokens_per_s", "update"),)),
            _panel("groups reused", "groups", _per_pass("groups")),
            _panel(
                "rank balance (prefix_sync)",
                "x mean",
                ((f"{ACTOR}balance/max_rank_workload_over_mean", "busiest rank's workload / mean"),),
            ),
        ),
    ),
    Section(
        "Fallbacks (samples run dense, by reason)",
        (
            _fallbacks(ACTOR, "update"),
            _fallbacks(OLD_LOG_PROB, "old log-prob"),
            _fallbacks(REF_LOG_PROB, "ref log-prob"),
        ),
    ),
    _forward_only(OLD_LOG_PROB, "old log-prob"),
    _forward_only(REF_LOG_PROB, "ref log-prob"),
)


def all_panels() -> list[Panel]:
    """Every panel of every section, in page order."""
    return [panel for section in SECTIONS for panel in section.panels]


__all__ = [
    "ACTOR",
    "OLD_LOG_PROB",
    "PASSES",
    "PHASE_LABELS",
    "QUICK_CHECK",
    "REF_LOG_PROB",
    "SECTIONS",
    "Panel",
    "Section",
    "all_panels",
]
