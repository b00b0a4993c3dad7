"""Tiny Llama targets and EAGLE heads for fast decoder tests (no files, no network).

``engineered_pair`` follows ENVIRONMENT.md: a target whose attention/MLP
outputs are scaled down and whose embeddings use only the first half of the
dimensions, so its next token is mostly the bigram argmax(W_lm . embed(tok));
an EAGLE-1 head with fc = [I | 0] and zeroed o_proj/down_proj outputs
embed(tok), so its draft is that same bigram: drafts get accepted and
rejected, exercising both paths.
"""

from __future__ import annotations

import torch


def tiny_target(seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 4, engineered: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        if engineered:
            emb = model.model.embed_tokens.weight
            emb[:, hidden // 2 :] = 0
            emb[2] = 0  # never predict EOS strongly
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.005)
                layer.mlp.down_proj.weight.mul_(0.005)
    return model


def tiny_head(target, kind: str, seed: int = 1, engineered: bool = False, draft_vocab: int | None = None):
    from spec_plugins.heads import EagleHead, HeadConfig

    c = target.config
    aux = [1, 2, 3][: min(3, c.num_hidden_layers)]
    cfg = HeadConfig.from_target(c, kind, aux_layer_ids=aux)
    if kind == "eagle3":
        cfg.draft_vocab_size = draft_vocab or c.vocab_size
    torch.manual_seed(seed)
    head = EagleHead(cfg).to(torch.float64)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        if kind == "eagle3" and cfg.draft_vocab_size < c.vocab_size:
            ids = torch.sort(torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(seed))
                             [: cfg.draft_vocab_size]).values
            head.d2t.copy_(ids - torch.arange(len(ids)))
        if engineered:
            assert kind == "eagle1"
            H = c.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :H] = torch.eye(H, dtype=torch.float64)
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
    head.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head.eval()
