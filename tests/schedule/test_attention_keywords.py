"""Every keyword HF hands an attention function is honoured by the prefix attention or refused (issue 20).

The walk: the keyword parameters of every function in transformers' ``ALL_ATTENTION_FUNCTIONS`` and of
every family's eager attention, the keywords every family passes at its ``attention_interface(...)`` call,
and the typed kwargs that flow into those calls through ``**kwargs`` (``TransformersKwargs``,
``FlashAttentionKwargs``) must each be declared in ``verl_prefix.schedule.attention.keywords`` as honoured,
without effect, or refused; a keyword transformers adds later fails here until someone decides. Then the
wrappers themselves: a refused or unknown keyword with a value stops the call naming it, one without a value
passes, and the value-dependent ones (dropout, is_causal) are refused exactly where they would change the
result; a sliding window is honoured (served banded where it is shorter than the call's keys).
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from functools import cache
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2 import modeling_gemma2
from transformers.utils.generic import TransformersKwargs

from verl_prefix.schedule.attention import keywords as AK
from verl_prefix.schedule.kv.contexts import CaptureContext, ServeContext

CPU = torch.device("cpu")
MODELS = Path(transformers.__file__).parent / "models"
DECLARED = AK.HONOURED.keys() | AK.NO_EFFECT.keys() | AK.REFUSED.keys()


# every attention function's first five parameters are filled by position: (module, query, key, value, mask)
POSITIONAL = 5


def parameter_names(fn) -> set[str]:
    """Named parameters after the five positional ones (``*args``/``**kwargs`` are where the others go)."""
    params = list(inspect.signature(fn).parameters.values())[POSITIONAL:]
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


# a file without an eager attention function or an ``...attention_interface(`` call has nothing to walk:
# a text search finds the candidates (a superset) and only they are parsed, once
CANDIDATE = re.compile(r"def\s+eager\w*attention|attention_interface\s*\(")


@cache
def family_sources() -> dict[str, ast.Module]:
    sources = {str(p.relative_to(MODELS)): p.read_text() for p in sorted(MODELS.rglob("modeling_*.py"))}
    return {path: ast.parse(text) for path, text in sources.items() if CANDIDATE.search(text)}


@cache
def eager_functions() -> dict[str, ast.FunctionDef]:
    """Each family's eager attention functions (``eager_attention_forward`` and its variants)."""
    found = {}
    for path, tree in family_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("eager") and "attention" in node.name:
                found[f"{path}:{node.name}"] = node
    return found


@cache
def call_site_keywords() -> dict[str, set[str]]:
    """keyword -> the files whose ``attention_interface(...)`` calls pass it by name."""
    found: dict[str, set[str]] = {}
    for path, tree in family_sources().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name.endswith("attention_interface"):
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        found.setdefault(keyword.arg, set()).add(path)
    return found


def test_the_walk_finds_what_it_should():
    """The walk is not vacuous: it sees flash attention's softcap/sinks, Gemma-2's and GPT-OSS's calls."""
    assert len(eager_functions()) > 100
    calls = call_site_keywords()
    assert "gemma2/modeling_gemma2.py" in calls["softcap"]
    assert "gpt_oss/modeling_gpt_oss.py" in calls["s_aux"]
    assert {"softcap", "s_aux", "sliding_window"} <= parameter_names(ALL_ATTENTION_FUNCTIONS["flash_attention_2"])


def test_every_attention_function_keyword_is_declared():
    unknown = {}
    for name in ALL_ATTENTION_FUNCTIONS:
        if name.startswith("verl_prefix_"):
            continue
        for keyword in parameter_names(ALL_ATTENTION_FUNCTIONS[name]) - DECLARED:
            unknown.setdefault(keyword, []).append(name)
    assert not unknown, f"attention function keywords neither honoured nor refused: {unknown}"


def test_every_family_eager_keyword_and_call_keyword_is_declared():
    unknown: dict[str, list[str]] = {}
    for where, node in eager_functions().items():
        for arg in node.args.args[POSITIONAL:] + node.args.kwonlyargs:
            if arg.arg not in DECLARED:
                unknown.setdefault(arg.arg, []).append(where)
    for keyword, files in call_site_keywords().items():
        if keyword not in DECLARED:
            unknown.setdefault(keyword, []).extend(sorted(files))
    assert not unknown, f"keywords the families use, neither honoured nor refused: {unknown}"


def test_every_kwarg_that_flows_into_attention_is_declared():
    flowing = set(TransformersKwargs.__annotations__) | set(FlashAttentionKwargs.__annotations__)
    assert {"position_ids", "cu_seq_lens_q", "output_attentions"} <= flowing
    assert not flowing - DECLARED, f"typed kwargs neither honoured nor refused: {flowing - DECLARED}"


def test_declared_sets_do_not_overlap():
    assert not AK.HONOURED.keys() & AK.NO_EFFECT.keys()
    assert not AK.HONOURED.keys() & AK.REFUSED.keys()
    assert not AK.NO_EFFECT.keys() & AK.REFUSED.keys()


def test_families_that_pass_softcap_or_sinks_apply_them_in_eager():
    """What reuse's scored maths rely on under eager (explicit merged): a family that passes ``softcap`` takes
    it in its eager function, one that passes ``s_aux`` applies its sinks there (transformers' sdpa takes
    neither, which ``attention.keywords.DENSE_IGNORES`` records)."""
    calls = call_site_keywords()
    eager = eager_functions()
    for keyword, marker in (("softcap", "softcap"), ("s_aux", "sinks")):
        for path in calls[keyword]:
            sources = [ast.unparse(node) for where, node in eager.items() if where.startswith(path + ":")]
            assert sources and all(marker in source for source in sources), (keyword, path)
    sdpa = parameter_names(ALL_ATTENTION_FUNCTIONS["sdpa"])
    assert not {"softcap", "s_aux"} & sdpa and set(AK.DENSE_IGNORES["sdpa"]) == {"softcap", "s_aux"}
    for kind in ("flash_attention_2", "flash_attention_3"):
        assert {"softcap", "s_aux"} <= parameter_names(ALL_ATTENTION_FUNCTIONS[kind])


# -- the wrappers ------------------------------------------------------------------------------------------


def attention_module(is_causal: bool = True) -> torch.nn.Module:
    module = torch.nn.Module()
    module.layer_idx, module.num_key_value_groups, module.is_causal = 0, 1, is_causal
    return module


def serve_call(implementation: str = "verl_prefix_flash", module=None, rows: int = 2, width: int = 3, **kwargs):
    gen = torch.Generator().manual_seed(0)
    prefix = type("P", (), {"length": 4})()
    prefix.keys, prefix.values = [torch.randn(1, 2, 4, 8, generator=gen)], [torch.randn(1, 2, 4, 8, generator=gen)]
    q, k, v = (torch.randn(rows, 2, width, 8, generator=gen) for _ in range(3))
    ctx = ServeContext(prefix, width, CPU, "auto")
    fn = ALL_ATTENTION_FUNCTIONS[implementation]
    kwargs.setdefault("scaling", 0.3)  # HF always passes it (Llama's eager function requires it)
    return fn(module or attention_module(), q, k, v, None, prefix_ctx=ctx, **kwargs)[0]


def capture_call(implementation: str = "verl_prefix_flash", length: int = 5, **kwargs):
    q = torch.randn(1, 2, length, 8, generator=torch.Generator().manual_seed(1))
    ctx = CaptureContext(1, early_exit=False)
    kwargs.setdefault("scaling", 0.3)
    return ALL_ATTENTION_FUNCTIONS[implementation](attention_module(), q, q, q, None, prefix_ctx=ctx, **kwargs)[0]


@pytest.mark.parametrize("implementation", ["verl_prefix_flash", "verl_prefix_sdpa", "verl_prefix_eager"])
def test_refused_and_unknown_keywords_with_a_value_stop_the_call(implementation):
    for name in [*AK.REFUSED, "a_keyword_from_the_future"]:
        serve_call(implementation, **{name: None})  # the feature is off: nothing to refuse
        capture_call(implementation, **{name: None})
        for call in (serve_call, capture_call):
            with pytest.raises(AK.AttentionKeywordRefused, match=rf"attention keyword {name}=") as caught:
                call(implementation, **{name: torch.tensor([0, 3])})
            assert caught.value.name == name


@pytest.mark.parametrize("implementation", ["verl_prefix_flash", "verl_prefix_sdpa", "verl_prefix_eager"])
def test_keywords_without_effect_change_nothing(implementation):
    plain = serve_call(implementation)
    flags = {"use_cache": True, "output_attentions": True, "deterministic": True, "num_items_in_batch": 7}
    torch.testing.assert_close(serve_call(implementation, **flags), plain, rtol=0, atol=0)
    position_ids = torch.arange(4, 7).expand(2, -1)
    torch.testing.assert_close(serve_call(implementation, position_ids=position_ids), plain, rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["verl_prefix_flash", "verl_prefix_sdpa", "verl_prefix_eager"])
def test_value_dependent_keywords_are_refused_exactly_where_they_matter(implementation):
    plain = serve_call(implementation)
    # dropout: 0 is served, any other rate refused (one prefix sample would be shared by the group)
    torch.testing.assert_close(serve_call(implementation, dropout=0.0), plain, rtol=0, atol=0)
    with pytest.raises(AK.AttentionKeywordRefused, match="dropout=0.1"):
        serve_call(implementation, dropout=0.1)
    with pytest.raises(AK.AttentionKeywordRefused, match="dropout=0.1"):
        capture_call(implementation, dropout=0.1)
    # causal only, whether the call or the module says so
    torch.testing.assert_close(serve_call(implementation, is_causal=True), plain, rtol=0, atol=0)
    with pytest.raises(AK.AttentionKeywordRefused, match="is_causal=False.*bidirectional"):
        serve_call(implementation, is_causal=False)
    with pytest.raises(AK.AttentionKeywordRefused, match="is_causal=None.*bidirectional"):
        serve_call(implementation, module=attention_module(is_causal=False))
    # a window covering the 4 prefix + 3 suffix keys changes nothing; a shorter one is honoured (served banded,
    # tests/schedule/test_sliding_windows.py checks its values); a window of no keys is refused
    torch.testing.assert_close(serve_call(implementation, sliding_window=7), plain, rtol=0, atol=0)
    assert (serve_call(implementation, sliding_window=6) - plain).abs().max() > 1e-3
    with pytest.raises(AK.AttentionKeywordRefused, match="sliding_window=0.*positive number of keys"):
        serve_call(implementation, sliding_window=0)
    plain_capture = capture_call(implementation, length=5)
    torch.testing.assert_close(capture_call(implementation, length=5, sliding_window=5), plain_capture, rtol=0, atol=0)
    assert (capture_call(implementation, length=5, sliding_window=4) - plain_capture).abs().max() > 1e-3


def test_softcap_and_sinks_change_the_result_where_dense_applies_them(caplog):
    """flash and eager apply softcap and sinks, so reuse does; transformers' sdpa ignores both (dense computes
    without them), so reuse under sdpa does too and says so once."""
    sinks = torch.tensor([0.5, -1.0])
    plain = serve_call()
    assert (serve_call(softcap=0.5) - plain).abs().max() > 1e-2
    assert (serve_call(s_aux=sinks) - plain).abs().max() > 1e-2
    # eager: the family's own eager function gets the keywords (Gemma-2's caps, Llama's has no softcap)
    gemma2_attention = type("Gemma2Attention", (torch.nn.Module,), {"__module__": modeling_gemma2.__name__})()
    gemma2_attention.layer_idx, gemma2_attention.num_key_value_groups, gemma2_attention.head_dim = 0, 1, 8
    plain = serve_call("verl_prefix_eager", module=gemma2_attention)
    assert (serve_call("verl_prefix_eager", module=gemma2_attention, softcap=0.5) - plain).abs().max() > 1e-2
    AK.LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger=AK.__name__):
        plain = serve_call("verl_prefix_sdpa")
        torch.testing.assert_close(serve_call("verl_prefix_sdpa", softcap=0.5, s_aux=sinks), plain, rtol=0, atol=0)
        serve_call("verl_prefix_sdpa", softcap=0.5)
    logged = [r.getMessage() for r in caplog.records if r.name == AK.__name__]
    assert len(logged) == 2 and all("transformers' sdpa attention ignores" in m for m in logged)
