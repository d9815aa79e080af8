"""The capacity preset: its binary search over a coarse grid (against a brute-force scan, on monotone
fakes), a minuscule real run (fresh process per probe: the answer fits, the next grid point does not),
the table and plot, and config validity of the capacity and offload presets (which cannot run here)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_prefix.harness import verl_engine
from verl_prefix.tools.bench import capacity as Cap
from verl_prefix.tools.bench import presets as BP
from verl_prefix.tools.bench import runner as BR
from verl_prefix.tools.bench import tables as BT


@given(st.lists(st.integers(1, 10**5), min_size=1, max_size=12, unique=True), st.integers(0, 10**5 + 1))
def test_search_finds_what_a_scan_finds(points, threshold):
    grid = tuple(sorted(points))
    calls = []

    def fits(n):
        calls.append(n)
        return n <= threshold

    found = Cap.search(grid, fits)
    fitting = [n for n in grid if n <= threshold]
    assert found["longest"] == (fitting[-1] if fitting else None)
    over = [n for n in grid if n > threshold]
    assert found["first_over"] == (over[0] if over else None)
    assert len(calls) <= max(1, len(grid).bit_length())  # binary, not a scan
    assert [p for p, _ in found["probes"]] == calls


def test_search_probes_both_sides_of_the_answer():
    found = Cap.search((1, 2, 3, 4, 5, 6, 7, 8), lambda n: n <= 5)
    probed = dict(found["probes"])
    assert probed[5] is True and probed[6] is False and found["longest"] == 5


def test_engine_names_and_spec_validation():
    assert Cap.parse_engine("fsdp2:2") == {"stock": True, "rows": 2}
    assert Cap.parse_engine("recompute:512") == {"stock": False, "policy": "recompute", "chunk": 512}
    for bad in ("fsdp2", "fsdp2:0", "swap", "keep:x"):
        with pytest.raises(ValueError, match="engine"):
            Cap.parse_engine(bad)
    spec = BP.PRESETS["capacity"].capacity
    Cap.validate_spec(spec)
    with pytest.raises(ValueError, match="ascending"):
        Cap.validate_spec(dataclasses.replace(spec, grid=(64, 32)))


TINY = BP.ModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64)


def test_minuscule_capacity_run(tmp_path):
    """Real probes, each in a fresh process, on a 2-layer model. The budget is set from a first probe so
    that the boundary falls inside the grid: the search's answer was measured to fit, the next grid point
    was measured not to, and every probe agrees with the budget."""
    spec = Cap.CapacitySpec(
        model=TINY,
        group_size=2,
        suffix_len=4,
        budget_mib=1.0,
        grid=(32, 256, 2048),
        engines=("fsdp2:1", "recompute:32"),
        micro_batch_size=2,
        timeout_s=600,
    )
    model_dir = TINY.write(tmp_path / "model")
    unlimited = dataclasses.replace(spec, budget_mib=1e6)
    small = Cap.probe(unlimited, "fsdp2:1", 32, model_dir)
    large = Cap.probe(unlimited, "fsdp2:1", 2048, model_dir)
    assert "error" not in small and "error" not in large, (small, large)
    assert large["peak_above_mib"] > small["peak_above_mib"]
    assert small["fits"] and large["fits"] and not large.get("stopped_over_budget")
    # a budget between the two measured peaks: 32 fits, 2048 does not
    budget = (small["peak_above_mib"] + large["peak_above_mib"]) / 2
    spec = dataclasses.replace(spec, budget_mib=budget)
    result = Cap.run_capacity(spec, model_dir=model_dir, log=lambda _: None, jobs=2)
    assert list(result["engines"]) == list(spec.engines) and result["complete"]
    stopped = result["engines"]["fsdp2:1"]["measured"]["2048"]
    # the watchdog ended the over-budget probe at the budget: it never finished its update
    assert stopped["stopped_over_budget"] and not stopped["fits"] and "update_s" not in stopped
    # (the peak at the stop is below the whole update's; a fresh process's peak can differ by ~10% from the first)
    assert budget < stopped["peak_above_mib"] <= large["peak_above_mib"] * 1.25
    for engine, found in result["engines"].items():
        measured = {int(p): r for p, r in found["measured"].items()}
        assert all(r["fits"] == (r["peak_above_mib"] <= budget) for r in measured.values()), engine
        if found["longest"] is not None:
            assert measured[found["longest"]]["fits"]
        if found["first_over"] is not None:
            assert not measured[found["first_over"]]["fits"]
        fits_flags = [measured[p]["fits"] for p in sorted(measured)]
        assert fits_flags == sorted(fits_flags, reverse=True), engine  # monotone: fits, then over
    assert result["stock_best"] == "fsdp2:1"
    assert result["engines"]["fsdp2:1"]["longest"] in (32, 256)
    table = Cap.capacity_table(result)
    assert "| fsdp2:1 (best stock) |" in table and "| recompute:32 |" in table
    png = Cap.plot_capacity(result, tmp_path / "capacity.png")
    assert png.stat().st_size > 1000
    json.dumps(result)  # the result JSON is plain data


def test_capacity_result_through_run_bench(tmp_path, monkeypatch):
    """``run_bench`` dispatches a capacity preset to the search and writes the result JSON with the
    bench's header; ``markdown_table`` renders it."""
    spec = dataclasses.replace(BP.PRESETS["capacity"].capacity, grid=(16, 32, 64), engines=("fsdp2:1", "recompute"))
    fake = {16: 10.0, 32: 20.0, 64: 40.0}

    def probe(spec, engine, prefix_len, model_dir):
        peak = fake[prefix_len] / (2 if engine == "recompute" else 1)
        return {"peak_above_mib": peak, "fits": peak <= spec.budget_mib}

    monkeypatch.setattr(Cap, "probe", probe)
    preset = BP.Preset(cells=(), reps=1, capacity=dataclasses.replace(spec, budget_mib=25.0))
    out = tmp_path / "capacity.json"
    result = BR.run_bench(preset, out_json=out, log=lambda _: None)
    saved = json.loads(out.read_text())
    assert saved["capacity"]["engines"]["fsdp2:1"]["longest"] == 32
    assert saved["capacity"]["engines"]["fsdp2:1"]["first_over"] == 64
    assert saved["capacity"]["engines"]["recompute"]["longest"] == 64  # the grid's end: a lower bound
    assert saved["capacity"]["engines"]["recompute"]["first_over"] is None
    assert saved["complete"] and saved["machine"]
    assert "| recompute |" in BT.markdown_table(result)


@given(st.integers(1, 4), st.integers(0, 6))
def test_parallel_search_matches_serial_and_reports_each_engine(jobs, threshold):
    """``jobs`` engines searched at once give the serial answer, in the spec's engine order; each finished
    engine is handed over as it completes (``complete`` only with the last)."""
    engines = ("fsdp2:1", "fsdp2:2", "keep", "recompute:2")
    spec = dataclasses.replace(BP.PRESETS["capacity_smoke"].capacity, grid=(1, 2, 3, 4, 5), engines=engines)

    def probe(spec, engine, prefix_len, model_dir):
        peak = prefix_len * (1 + engines.index(engine))  # each engine its own boundary
        return {"peak_above_mib": float(peak), "fits": peak <= threshold}

    snapshots = []
    kwargs = {"probe_fn": probe, "model_dir": "unused", "log": lambda _: None}
    serial = Cap.run_capacity(spec, **kwargs)
    parallel = Cap.run_capacity(spec, **kwargs, jobs=jobs, on_engine_done=snapshots.append)
    assert parallel == serial and list(parallel["engines"]) == list(engines)
    assert [len(s["engines"]) for s in snapshots] == [1, 2, 3, 4]
    assert [s["complete"] for s in snapshots] == [False, False, False, True]
    with pytest.raises(ValueError, match="jobs"):
        Cap.run_capacity(spec, **kwargs, jobs=0)


@given(st.lists(st.booleans(), min_size=5, max_size=5), st.sampled_from([1, 3, 5]))
def test_repeated_probes_decide_by_majority(outcomes, repeats):
    """With ``repeats`` probes per grid point the verdict is their majority, decided as soon as it is
    certain (the rest are not run); the reported peak is the median of the probes run."""
    spec = dataclasses.replace(
        BP.PRESETS["capacity_smoke"].capacity, grid=(7,), engines=("keep",), budget_mib=2.0, repeats=repeats
    )
    calls = []

    def probe(spec, engine, prefix_len, model_dir):
        calls.append(outcomes[len(calls)])
        return {"fits": calls[-1], "peak_above_mib": 1.0 if calls[-1] else 3.0}

    result = Cap.run_capacity(spec, probe_fn=probe, model_dir="unused", log=lambda _: None)
    verdict = result["engines"]["keep"]["measured"]["7"]
    majority = sum(outcomes[:repeats]) * 2 > repeats
    assert verdict["fits"] == majority and result["engines"]["keep"]["longest"] == (7 if majority else None)
    assert len(calls) <= repeats and calls == outcomes[: len(calls)]
    decided_at = next(k for k in range(1, repeats + 1) if max(sum(calls[:k]), k - sum(calls[:k])) > repeats // 2)
    assert len(calls) == decided_at
    assert (verdict["peak_above_mib"] <= spec.budget_mib) == majority
    if len(calls) > 1:
        assert len(verdict["peaks_mib"]) == len(calls) == len(verdict["probes"])


def test_capacity_presets_search_the_issue_setting():
    """``capacity`` is issue 11's cell: the 29M model, G=8, suffix 128, 2 GiB above the loaded model, the
    stock engine at micro-batch 1 (its best) among the engines; ``capacity_smoke`` the same search on 1M."""
    spec = BP.PRESETS["capacity"].capacity
    assert (spec.model.hidden_size, spec.model.num_layers, spec.group_size, spec.suffix_len) == (512, 6, 8, 128)
    assert spec.budget_mib == 2048 and "fsdp2:1" in spec.engines and spec.repeats >= 3
    assert spec.model.max_position_embeddings >= spec.grid[-1] + spec.suffix_len + 1
    Cap.validate_spec(BP.PRESETS["capacity_smoke"].capacity)


def test_gpu_capacity_and_offload_presets_are_valid_configs():
    """They need CUDA; here: their engine configs compose and validate (the offload knob included)."""
    Cap.validate_spec(BP.PRESETS["gpu_capacity"].capacity)
    cell = BP.PRESETS["gpu_offload"].cells[0]
    # build_verl_engine adds mixed_precision first (the preset's _BF16 then overrides it)
    base = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    config = verl_engine.compose_ppo_config([base, *cell.overrides])
    from verl.utils.config import omega_conf_to_dataclass

    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor.fsdp_config)
    assert engine_config.dormant_prefix == "offload"
    with pytest.raises(BP.BenchError, match="needs a CUDA GPU"):
        BP.resolve_preset("gpu_capacity")
