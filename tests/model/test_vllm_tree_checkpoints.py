"""Trees with every public EAGLE checkpoint layout vLLM's own EAGLE loads.

The tree drafter runs the head vLLM builds from ``speculative_config`` (its
model classes and weight loader), so layouts are vLLM's business; these tests
prove it end to end. Each checkpoint is made from a shipped, trained head by
renaming / adding tensors and changing the file format, so tokens are really
accepted, and each run is compared token for token with no speculation:

* EAGLE-3, SafeAILab layout: ``pytorch_model.bin`` with ``d2t`` and ``t2d``,
  llama3 ``rope_scaling``;
* EAGLE-1, SafeAILab layout: ``pytorch_model.bin`` with ``fc`` and the head's
  own ``embed_tokens``, yarn ``rope_scaling``;
* EAGLE-3 in the speculators format (``speculators_model_type``,
  ``transformer_layer_config``, ``layers.0.*`` names, safetensors).
"""

from __future__ import annotations

import json
import shutil

import pytest

from test_vllm_tree_e2e import assert_identical, engine_kwargs, run_engine, token_ids  # noqa: E402 (gated there)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402

PROMPTS = ["The three primary colors are", "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
           "Write one sentence about the moon."]
MAX_TOKENS = 32


def _copy_head(kind: str, folder):
    shutil.copytree(head_path(kind), folder)
    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    return cfg, weights


def _target_embedding() -> torch.Tensor:
    target = ensure_converted()
    for f in sorted(target.glob("*.safetensors")):
        sd = load_file(str(f))
        if "model.embed_tokens.weight" in sd:
            return sd["model.embed_tokens.weight"]
    raise AssertionError("target embedding not found")


def _rope(cfg: dict, **params) -> None:
    rope = {"rope_theta": cfg["rope_theta"], **params}
    cfg["rope_parameters"] = rope
    cfg["rope_scaling"] = dict(rope)


def eagle3_safeailab(folder):
    cfg, w = _copy_head("eagle3", folder)
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(w["d2t"].shape[0]) + w["d2t"]] = True
    w["t2d"] = t2d
    _rope(cfg, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=8192)
    torch.save(w, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(cfg))
    return "eagle3"


def eagle1_safeailab(folder):
    cfg, w = _copy_head("eagle1", folder)
    w["embed_tokens.weight"] = _target_embedding().to(w["fc.weight"].dtype)
    _rope(cfg, rope_type="yarn", factor=2.0, original_max_position_embeddings=8192)
    torch.save(w, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(cfg))
    return "eagle"


def eagle3_speculators(folder):
    cfg, w = _copy_head("eagle3", folder)
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    layer = {k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config", "spec_plugins",
                                                       "draft_vocab_size", "target_hidden_size")}
    spec = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["hidden_size"],
        "norm_before_residual": False,  # this head normalizes the hidden after taking the residual
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "speculators_config": {"algorithm": "eagle3",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7}],
                               "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": str(ensure_converted()),
                                            "architectures": ["LlamaForCausalLM"]}},
    }
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(spec))
    return "eagle3"


@pytest.fixture(scope="module")
def baseline():
    from vllm import SamplingParams

    (outs,), _, _ = run_engine(engine_kwargs(), (PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
    return token_ids(outs)


@pytest.mark.parametrize("make", [eagle3_safeailab, eagle1_safeailab, eagle3_speculators],
                         ids=lambda f: f.__name__)
def test_tree_with_public_checkpoint_layout(make, baseline, tmp_path):
    from vllm import SamplingParams

    folder = tmp_path / make.__name__
    method = make(folder)
    kwargs = engine_kwargs(speculative_config={"method": method, "model": str(folder)},
                           additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}})
    (outs,), _, spec = run_engine(kwargs, (PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
    assert_identical(baseline, token_ids(outs))
    assert spec["accepted"] > 0, f"{make.__name__}: the head vLLM loaded accepts nothing ({spec})"
