"""The executor's signatures say what varies per call (issue 19): what is constant over a mini-batch lives on
one frozen ``ScheduleOptions``; every public executor function takes it and at most five other parameters."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from verl_prefix.schedule import executor
from verl_prefix.schedule.models import moe
from verl_prefix.schedule.options import ScheduleOptions

CPU = torch.device("cpu")
MAX_OTHER_PARAMETERS = 5
# public helpers that no mini-batch setting reaches, so they take no options (each still obeys the limit)
OPTION_FREE = {
    "suffix_positions": "position arithmetic of one row (trap 4)",
    "prefix_backward": "phase C is seeded by the leaves' gradients, configured by nothing",
    "seeded_backward": "phase C with the seeds given (the chunked prefix's per-chunk backward)",
    "unshard_cut_short": "the FSDP2 units phase C must unshard follow from the model and phase A, no setting",
    "join_path": "a path's K/V leaves as one prefix: concatenation, configured by nothing",
    "path_stats": "router statistics counted per row over a path: arithmetic, configured by nothing",
}


def executor_functions() -> dict[str, object]:
    """Every function defined in the executor, private ones included (``_chunked`` took the options too)."""
    return {
        name: fn for name, fn in inspect.getmembers(executor, inspect.isfunction) if fn.__module__ == executor.__name__
    }


def public_functions() -> dict[str, object]:
    return {name: fn for name, fn in executor_functions().items() if not name.startswith("_")}


def test_public_executor_functions_take_the_options_and_at_most_five_others():
    functions = public_functions()
    assert {"train_group", "infer_group", "prefix_forward", "suffix_forward"} <= set(functions)
    assert set(OPTION_FREE) <= set(functions), "an option-free helper was renamed: update OPTION_FREE"
    fields = {f.name for f in dataclasses.fields(ScheduleOptions)}
    for name, fn in executor_functions().items():
        parameters = inspect.signature(fn).parameters
        others = [p for p in parameters if p != "options"]
        if "options" in parameters:  # private helpers that take the options obey the same rule
            assert parameters["options"].annotation in ("ScheduleOptions", ScheduleOptions), name
            leaked = fields & set(others)
            assert not leaked, f"{name} takes {sorted(leaked)} besides the options that carry them"
        elif not name.startswith("_"):
            assert name in OPTION_FREE, f"{name} does not take the schedule options"
        else:
            continue
        assert len(others) <= MAX_OTHER_PARAMETERS, f"{name} takes {len(others)} parameters besides options: {others}"


def test_public_functions_carry_type_hints():
    for name, fn in public_functions().items():
        signature = inspect.signature(fn)
        assert signature.return_annotation is not inspect.Signature.empty, name
        for parameter in signature.parameters.values():
            assert parameter.annotation is not inspect.Parameter.empty, f"{name}({parameter.name})"


def test_options_are_frozen_with_the_schedules_defaults():
    options = ScheduleOptions(device=CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.early_exit = False  # type: ignore[misc]
    assert dataclasses.is_dataclass(ScheduleOptions) and ScheduleOptions.__dataclass_params__.frozen
    assert options.early_exit and not options.calculate_entropy
    assert options.phase_b_attention == "auto" and options.prefix_grad_dtype == torch.float32
    assert options.prefix_chunk_tokens is None and options.ulysses is None and options.meter is None
    assert options.routers is None and options.aux_fn is None
    assert options.backward is torch.Tensor.backward


def test_routers_and_aux_fn_go_together():
    with pytest.raises(ValueError, match="routers and aux_fn go together"):
        ScheduleOptions(device=CPU, aux_fn=lambda rows, stats: torch.zeros(()))
    with pytest.raises(ValueError, match="routers and aux_fn go together"):
        ScheduleOptions(device=CPU, routers=object.__new__(moe.MoeRouters))


def test_derived_options_for_fillers_and_forward_only():
    """Lockstep fillers are neither metered nor asked for entropy; forward-only passes always exit early
    and carry no aux loss. Everything else is the mini-batch's."""
    routers = object.__new__(moe.MoeRouters)
    options = ScheduleOptions(
        device=CPU,
        calculate_entropy=True,
        meter=object(),  # type: ignore[arg-type]
        early_exit=False,
        routers=routers,
        aux_fn=lambda rows, stats: torch.zeros(()),
        prefix_chunk_tokens=4,
    )
    fillers = options.for_fillers()
    assert fillers.meter is None and not fillers.calculate_entropy
    assert fillers.routers is routers and fillers.prefix_chunk_tokens == 4 and not fillers.early_exit
    forward = options.forward_only()
    assert forward.early_exit and forward.routers is None and forward.aux_fn is None
    assert forward.meter is options.meter and forward.calculate_entropy and forward.prefix_chunk_tokens == 4
    plain = ScheduleOptions(device=CPU)
    assert plain.forward_only() is plain
