"""Issue 51, item 2: SGLang's NEXTN (MTP) drafts under EAGLE_TREE.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1`` (see
test_plugin_registration.py). SGLang 0.5.23's NEXTN is its EAGLE: the alias
resolves to EAGLE (``speculative_hook._resolve_speculative_algorithm_alias``),
whose worker is ``EAGLEWorkerV2`` (EagleTreeWorker's base), and what makes
the draft an MTP head is keyed on the draft's config, not on the name (the
draft ModelConfig's ``_config_draft_model`` rewrite, ``init_lm_head``'s
shared embedding and head). So EAGLE_TREE serves an MTP draft as NEXTN does;
these tests check it through SGLang's own code:

* SGLang's CLI parsing and resolution give EAGLE_TREE the draft checkpoint,
  revision and tree settings they give NEXTN (path-less MTP targets too), and
  SGLang's draft ModelConfig (built as ``TpModelWorker._init_model_config``
  builds it) loads the same MTP architecture;
* a path-less target without an MTP form, and a draft NEXTN would run outside
  the EAGLE worker (a Gemma4 assistant: FROZEN_KV_MTP), are refused at
  startup naming why; NEXTN itself keeps working with our plugin installed;
* SGLang's ``EagleDraftWorker.init_lm_head`` shares the target's embedding
  and lm_head with the MTP draft under EAGLE_TREE exactly as under NEXTN;
* an MLA KV pool (DeepSeek / GLM-DSA MTP) is left to SGLang's own accepted-path
  move.

Test doubles: ``torchvision`` (``spec_plugins.sglang_ext._testing``);
``init_lm_head``'s ``self`` (a namespace with the fields it reads: the draft
and target models cannot be built without weights and a GPU; the draft
model records what SGLang hands it). Config-only checkpoints: nothing loads.
What only a GPU shows (not run here): the MTP draft model's forward and a
served request.
"""

from __future__ import annotations

import json
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.utils.hf_transformers_utils import get_config  # noqa: E402

from spec_plugins.sglang_ext import algorithm  # noqa: E402
from spec_plugins.sglang_ext.worker import EagleTreeWorker  # noqa: E402
# its fixtures: config-only checkpoints (a Llama target, EAGLE heads), and the user's knobs unset
from test_plugin_registration import ckpt, clean_env  # noqa: E402, F401
from test_plugin_worker import assert_left_to_sglangs_move  # noqa: E402

pytestmark = pytest.mark.sglang

_BASE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
    vocab_size=256, max_position_embeddings=512, torch_dtype="bfloat16", rms_norm_eps=1e-6,
)  # fmt: skip
# Tiny MTP targets and the draft architecture SGLang 0.5.23 loads for each.
# DeepSeek-V3: SGLang's _handle_eagle_family fills the draft path with the
# target's; MiMo: it stays unset (the draft ModelConfig falls back to it).
MTP_TARGETS = {
    "deepseek_v3": (dict(
        _BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", moe_intermediate_size=32,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_nextn_predict_layers=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.0,
    ), "DeepseekV3ForCausalLMNextN"),
    "mimo": (dict(_BASE, architectures=["MiMoForCausalLM"], model_type="qwen2", num_nextn_predict_layers=1), "MiMoMTP"),
}  # fmt: skip
TREE = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6")


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    paths = {}
    for name, (cfg, _) in MTP_TARGETS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = str(root / name)
    return paths


def parse_cli(model_path, algorithm_name, *extra):
    """SGLang's own CLI parsing (``prepare_server_args``), then its resolution.
    get_config's cache is cleared first: SGLang's draft ModelConfig rewrites
    the cached config object in place (as the draft worker does after the
    target's is built), which must not leak into the next resolution."""
    from sglang.srt.server_args import prepare_server_args

    get_config.cache_clear()
    argv = ["--model-path", model_path, "--speculative-algorithm", algorithm_name, "--skip-tokenizer-init",
            "--device", "cpu", "--attention-backend", "triton", *extra]  # fmt: skip
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def draft_model_config(server_args):
    """The draft's ModelConfig as SGLang's draft worker builds it
    (``TpModelWorker._init_model_config`` with is_draft_worker)."""
    view = resolved_view(server_args)
    return ModelConfig.from_server_args(
        server_args, model_path=view.speculative_draft_model_path,
        model_revision=view.speculative_draft_model_revision, is_draft_model=True,
    )  # fmt: skip


RESOLVED_FIELDS = (
    "speculative_draft_model_path", "speculative_draft_model_revision", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "max_running_requests",
)  # fmt: skip


@pytest.mark.parametrize("target", sorted(MTP_TARGETS))
@pytest.mark.parametrize("tree", [TREE, ()], ids=["tree", "sglang-defaults"])
def test_eagle_tree_resolves_an_mtp_target_as_nextn_does(mtp, target, tree):
    """No --speculative-draft-model-path: the draft is the target's MTP layer,
    resolved for EAGLE_TREE exactly as for NEXTN (SGLang fills or leaves the
    path, chooses the defaults, and loads the same MTP architecture)."""
    resolved = {}
    for name in ("NEXTN", "EAGLE_TREE"):
        server_args = parse_cli(mtp[target], name, *tree)
        view = resolved_view(server_args)
        resolved[name] = {field: getattr(view, field) for field in RESOLVED_FIELDS}
        # our resolution leaves SGLang's cached target config as it was: the target is not loaded as its MTP form
        assert get_config(mtp[target], trust_remote_code=False).architectures == MTP_TARGETS[target][0]["architectures"]
        draft = draft_model_config(server_args)
        resolved[name]["draft architectures"] = draft.hf_config.architectures
        resolved[name]["draft layers"] = draft.num_nextn_predict_layers
        algo = SpeculativeAlgorithm.from_string(view.speculative_algorithm)
        resolved[name]["worker"] = algo.create_worker(server_args)
        if name == "EAGLE_TREE":
            assert getattr(server_args, algorithm.VARIANT_RECORD) == "EAGLE"  # not an EAGLE-3 head
    assert resolved["NEXTN"]["worker"] is EAGLEWorkerV2  # NEXTN is EAGLE, with our plugin installed too
    assert resolved["EAGLE_TREE"]["worker"] is EagleTreeWorker and issubclass(EagleTreeWorker, EAGLEWorkerV2)
    for entry in resolved.values():
        del entry["worker"]
    assert resolved["EAGLE_TREE"] == resolved["NEXTN"]
    assert resolved["NEXTN"]["draft architectures"] == [MTP_TARGETS[target][1]]
    if tree:
        assert (resolved["NEXTN"]["speculative_eagle_topk"], resolved["NEXTN"]["speculative_num_draft_tokens"]) == (2, 6)


def test_an_explicit_draft_path_to_the_mtp_target_resolves_as_nextn(mtp):
    """--speculative-draft-model-path naming the target (how an MTP draft was
    given to EAGLE_TREE before): the same resolution as NEXTN's."""
    argv = ("--speculative-draft-model-path", mtp["mimo"], *TREE)
    nextn, tree = (resolved_view(parse_cli(mtp["mimo"], name, *argv)) for name in ("NEXTN", "EAGLE_TREE"))
    assert {f: getattr(tree, f) for f in RESOLVED_FIELDS} == {f: getattr(nextn, f) for f in RESOLVED_FIELDS}


def test_sglang_draft_architecture_is_sglangs_rewrite_on_a_copy(mtp):
    """Our reading of SGLang's rewrite (``sglang_draft_architecture``) is the
    draft ModelConfig's, and leaves the config it was handed alone."""
    get_config.cache_clear()
    target = get_config(mtp["deepseek_v3"], trust_remote_code=False)
    assert algorithm.sglang_draft_architecture(target) == "DeepseekV3ForCausalLMNextN"
    assert target.architectures == ["DeepseekV3ForCausalLM"]


def test_path_less_target_without_an_mtp_form_is_refused(ckpt):
    """A Llama target has no MTP layer SGLang knows: without a draft path
    NEXTN would load the whole target as its draft; EAGLE_TREE refuses."""
    with pytest.raises(
        ValueError,
        match=r"EAGLE_TREE needs --speculative-draft-model-path \(the EAGLE / EAGLE-3 head\): without it the draft "
        r"is the target's own MTP \(NextN\) layer, as for --speculative-algorithm NEXTN, and SGLang 0.5.23 has no "
        r"MTP form of --model-path '.*target''s architecture 'LlamaForCausalLM' "
        r"\(ModelConfig._config_draft_model keeps it\)",
    ):
        parse_cli(ckpt["target"], "EAGLE_TREE", *TREE)


def test_a_draft_nextn_runs_outside_the_eagle_worker_is_refused(ckpt, tmp_path):
    """SGLang runs a Gemma4 assistant draft given to NEXTN / EAGLE as
    FROZEN_KV_MTP (FrozenKVMTPWorkerV2), not in the EAGLE worker."""
    (tmp_path / "config.json").write_text(
        json.dumps({
            "architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
            # the fields transformers' Gemma4AssistantConfig checks (it serves no layer here)
            "text_config": {"model_type": "gemma4_text", "num_attention_heads": 4, "hidden_size_per_layer_input": 0,
                            "enable_moe_block": False, "use_double_wide_mlp": False, "vocab_size_per_layer_input": 0},
        })  # fmt: skip
    )
    assert resolved_view(parse_cli(ckpt["target"], "NEXTN", "--speculative-draft-model-path", str(tmp_path)))\
        .speculative_algorithm == "FROZEN_KV_MTP"  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"EAGLE_TREE: --speculative-draft-model-path '.*' is a draft SGLang 0.5.23 runs as "
        r"--speculative-algorithm FROZEN_KV_MTP \(speculative_hook._resolve_speculative_algorithm_alias\), .*"
        r"not the EAGLE worker \(EAGLEWorkerV2\) EAGLE_TREE extends; use --speculative-algorithm NEXTN",
    ):
        parse_cli(ckpt["target"], "EAGLE_TREE", "--speculative-draft-model-path", str(tmp_path), *TREE)


# ----------------------------------------------------- the worker's MTP pieces


class RecordingDraftModel:
    """Stands in for an MTP draft model (DeepseekV3ForCausalLMNextN, MiMoMTP):
    records what SGLang binds into it."""

    hot_token_id = None

    def __init__(self):
        self.calls = []

    def set_embed_and_head(self, embed, head):
        self.calls.append(("set_embed_and_head", embed, head))

    def set_embed(self, embed):
        self.calls.append(("set_embed", embed))

    def set_lm_head_from_target(self, lm_head):
        self.calls.append(("set_lm_head_from_target", lm_head))


def test_init_lm_head_shares_the_targets_embedding_and_head_as_for_nextn(ckpt):
    """SGLang's ``EagleDraftWorker.init_lm_head`` (the MTP draft's embedding and
    lm_head are the target's) does the same under EAGLE_TREE's spec class as
    under NEXTN's (SpeculativeAlgorithm.EAGLE): it branches on is_eagle3()."""
    embed, head, target_lm_head = torch.randn(8, 4), torch.randn(8, 4), object()
    # EAGLE_TREE's spec class answers from the published head variant (an MTP target: EAGLE)
    _testing.publish(_testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend="triton",
    ))  # fmt: skip
    calls = {}
    for name in ("NEXTN", "EAGLE_TREE"):
        draft_model = RecordingDraftModel()
        worker = types.SimpleNamespace(
            speculative_algorithm=SpeculativeAlgorithm.from_string(name),
            hot_token_id=None,
            draft_runner=types.SimpleNamespace(model=draft_model),
            target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(
                model=types.SimpleNamespace(lm_head=target_lm_head))),
            _resolve_shared_embed_and_head=lambda: (embed, head),
        )  # fmt: skip
        EagleDraftWorker.init_lm_head(worker)
        calls[name] = draft_model.calls
    assert calls["NEXTN"] == [("set_embed_and_head", embed, head), ("set_lm_head_from_target", target_lm_head)]
    assert calls["EAGLE_TREE"] == calls["NEXTN"]


def test_an_mla_kv_pool_is_left_to_sglangs_move():
    """DeepSeek / GLM-DSA MTP keep latent (MLA) KV: our accepted-path move handles
    plain MHA pools only, so SGLang's own move serves this pool."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(
        size=16, page_size=1, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8, layer_num=1, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    assert_left_to_sglangs_move(pool)
