"""A random DFlash drafter for SmolLM2-135M (TEST CODE ONLY), in the format our
trained drafter ships in: architectures DFlashDraftModel, dflash_config
{mask_token_id 16, target_layer_ids [1, 14, 26]}, block_size 8 (7 mask
rows), mask_embedding.pt. Random weights: vLLM's DFlash drafts from it but
the target accepts ~nothing (the oracle, ``oracle_drafter.BlockLogitsOracle``,
gives acceptance)."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK_SIZE = 8  # the drafter's block: the bonus token + 7 mask rows
MASK_ROWS = BLOCK_SIZE - 1


def make_random_dflash_drafter(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    if (out / "mask_embedding.pt").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    H, inter, kv, hd = 576, 1536, 192, 64
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": inter, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": hd,
           "num_hidden_layers": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
           "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": False,
           "attention_bias": False, "block_size": BLOCK_SIZE, "num_target_layers": 30, "target_hidden_size": H,
           "torch_dtype": "float32", "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 14, 26]}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)

    def mat(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).float()

    w = {"fc.weight": mat(H, 3 * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(2):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                  p + "self_attn.q_proj.weight": mat(H, H), p + "self_attn.k_proj.weight": mat(kv, H),
                  p + "self_attn.v_proj.weight": mat(kv, H), p + "self_attn.o_proj.weight": mat(H, H),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": mat(inter, H), p + "mlp.up_proj.weight": mat(inter, H),
                  p + "mlp.down_proj.weight": mat(H, inter)})
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    torch.save(mat(H), out / "mask_embedding.pt")
    return out
