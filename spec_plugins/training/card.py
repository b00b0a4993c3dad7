"""Model cards (README.md) of the shipped heads, from training.json and, when
available, the acceptance benchmark's results.json."""

from __future__ import annotations

import json
from pathlib import Path

from spec_tree_kernels.head_kinds import HeadKind

TITLES = {
    "eagle3": "EAGLE-3 draft head for SmolLM2-135M-Instruct",
    "eagle1": "EAGLE-1 draft head for SmolLM2-135M-Instruct",
}


def write_card(folder: Path, bench: dict | None = None) -> str:
    """Write ``folder``/README.md from its training.json and config.json (and
    the acceptance table from ``bench``, the benchmark's results); return it."""
    folder = Path(folder)
    info = json.loads((folder / "training.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    kind = HeadKind(info["kind"])
    lines = (
        header_lines(kind, info, cfg, folder.name)
        + architecture_lines(kind, cfg)
        + data_lines(kind, info)
        + training_lines(kind, info)
        + (acceptance_lines(kind, bench) if bench else [])
    )
    text = "\n".join(lines)
    (folder / "README.md").write_text(text)
    return text


def header_lines(kind: HeadKind, info: dict, cfg: dict, folder_name: str) -> list[str]:
    """Title, format (vLLM file, SGLang algorithm, architectures) and how to load it."""
    eagle3 = kind is HeadKind.EAGLE3
    return [
        f"# {TITLES[kind.value]}",
        "",
        f"Target: {info['target']}. Format: vLLM `{'llama_eagle3.py' if eagle3 else 'llama_eagle.py'}` / "
        f"SGLang {kind.sglang_algorithm} (`config.json` architectures "
        f"`{cfg['architectures'][0]}`), bf16 weights, embeddings"
        f"{'' if eagle3 else ' and LM head'} shared from the target.",
        "",
        "```python",
        "LLM(model=<smollm2 folder>, speculative_config={"
        f"\"method\": \"{kind.vllm_method}\", \"model\": \"{folder_name}\", "
        "\"num_speculative_tokens\": 5})",
        "```",
        "",
    ]


def architecture_lines(kind: HeadKind, cfg: dict) -> list[str]:
    lines = ["## Architecture", ""]
    if kind is HeadKind.EAGLE3:
        lines += [
            f"One Llama decoder layer (`midlayer`, q/k/v over [embed; hidden], 2x{cfg['hidden_size']}), "
            f"`fc` fusing target layers {cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']} "
            f"(inputs of those decoder layers), reduced draft vocabulary of {cfg['draft_vocab_size']} tokens "
            f"(`d2t`: target id = draft id + d2t).",
        ]
    else:
        lines += [
            "One Llama decoder layer without input_layernorm, `fc` over [embed(token); target final hidden], "
            "output fed to the target's LM head (full vocabulary) and to the next draft step.",
        ]
    return lines + [""]


def data_lines(kind: HeadKind, info: dict) -> list[str]:
    """Training data and the draft vocabulary's held-out coverage."""
    d, dv = info["data"], info["draft_vocab"]
    return [
        "## Data",
        "",
        f"Self-distilled: {d['source']}. {d['train_sequences']} training sequences "
        f"({d['train_tokens']} tokens, {d['train_answer_tokens']} answer tokens, answers <= {d['max_new_tokens']} "
        f"new tokens), {d['held_out_sequences']} held out"
        + (f"; by domain {d['sequences_by_domain']}, by kind {d['sequences_by_kind']}" if "sequences_by_domain" in d
           else "")
        + ". Training prompts: real Python functions (signatures, docstrings and bodies read from the standard "
        "library and pinned installed packages), topic requests (questions, explanations, writing), arithmetic, "
        "two-turn chats; deduplicated and sharing no 8-word sequence with any evaluation prompt (HumanEval, "
        "the project's chat set).",
        "",
        "## Draft vocabulary coverage",
        "",
        "Share of the held-out answers' tokens (target greedy outputs) that the N top-ranked tokens cover "
        "(ranked by training frequency, unseen tokens by ascending id): "
        + ", ".join(f"{k}: {v:.3f}" for k, v in dv["coverage_held_out_by_size"].items())
        + f". Chosen: {dv['size']} tokens, held-out coverage {dv['coverage_held_out']:.3f}"
        + (" (the EAGLE-1 head predicts over the full vocabulary; the subset is only used for its "
           "classification loss)." if kind is HeadKind.EAGLE1 else "."),
        "",
    ] + [f"- held-out {domain}: " + ", ".join(f"{k}: {v:.3f}" for k, v in cov.items())
         for domain, cov in dv.get("coverage_held_out_by_domain", {}).items() if domain != "all"] + [""]


def training_lines(kind: HeadKind, info: dict) -> list[str]:
    """How to reproduce, one line per training stage, totals, held-out agreement."""
    t = info["train"]
    lines = [
        "## Training",
        "",
        f"Reproduce: `python -m spec_plugins.training.train --head {kind.value} --recipe` (seeded; "
        f"{'the stages' if 'continued_from' in t else 'the stage'} below, data generated and cached first).",
        "",
    ]
    stages = [t]  # training_info nests each stage's record in the next one's continued_from
    while "continued_from" in stages[0]:
        stages.insert(0, stages[0]["continued_from"])
    for n, st in enumerate(stages, 1):
        lines.append(
            f"- stage {n}{' (continued from stage ' + str(n - 1) + ')' if n > 1 else ''}: "
            f"{st['steps']} steps ({st['epochs']} epochs) of <= {st['tokens_per_batch']} tokens, AdamW lr {st['lr']} "
            f"(warmup + cosine), training-time-test unroll {st['unroll']}, "
            f"{'soft labels (target distribution), ' if st.get('soft_labels') else ''}"
            f"{'classification weight ' + str(st.get('ce_weight')) + ', ' if kind is HeadKind.EAGLE1 and st.get('ce_weight') else ''}"
            f"seed {st['seed']}, {st['threads']} CPU thread(s), {st['minutes']} min, final loss (EMA) {st['final_loss_ema']}."
        )
    return lines + [
        "",
        f"{t['trainable_parameters'] / 1e6:.2f}M trainable parameters, "
        f"{t.get('steps_total', t['steps'])} steps and {t.get('minutes_total', t['minutes'])} min in all "
        "(on 2 shared CPU cores).",
        "",
        "Held-out top-1 agreement with the target by unrolled draft step: "
        + ", ".join(f"step {j}: {s['acc']:.3f}" for j, s in enumerate(info["held_out"])) + ".",
        "",
    ] + [f"- {domain}: " + ", ".join(f"{s['acc']:.3f}" for s in steps)
         for domain, steps in info.get("held_out_by_domain", {}).items() if domain != "all"] + [""]


def acceptance_lines(kind: HeadKind, bench: dict) -> list[str]:
    """The acceptance benchmark's rows of this head."""
    rows = [r for r in bench["rows"] if r["head"] == kind.value]
    domains = sorted({d for r in rows for d in r.get("tau_by_domain", {})})  # evaluation domains, per-prompt tau
    lines = [
        "## Acceptance (reference tree decoder, `python -m spec_plugins.acceptance_bench`)",
        "",
        f"{len(bench['prompts'])} evaluation prompts, <= {bench['max_new_tokens']} new tokens, greedy; "
        "tau = tokens emitted per verify step.",
        "",
        "| (num_steps, topk, T) | tau | acceptance by depth | lossless |" + "".join(f" tau {d} |" for d in domains),
        "|---|---|---|---|" + "---|" * len(domains),
    ]
    for r in rows:
        by_domain = r.get("tau_by_domain", {})
        lines.append(f"| ({r['num_steps']}, {r['topk']}, {r['num_draft_tokens']}) | {r['tau']:.2f} | "
                     f"{' '.join(f'{x:.2f}' for x in r['accept_by_depth'])} | {'yes' if r['lossless'] else 'no'} |"
                     + "".join(f" {by_domain[d]:.2f} |" if d in by_domain else " - |" for d in domains))
    return lines + [""]
