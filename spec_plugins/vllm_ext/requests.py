"""Per request: may it be speculated? And what tree mode changes so that every
request vLLM serves without speculation is served the same with it.

A greedy request's tree is walked on the target's raw argmax; a sampled one's
(temperature > 0) by target-only rejection on the distribution
``sampling.node_probs`` computes at every node: temperature, min-p, top-k,
top-p, as vLLM's Sampler applies them. So a request is speculated only when
nothing else stands between the logits and its token: no penalties, bad words,
allowed tokens, min_tokens, logit_bias, thinking-token budget, structured
output or logits processor from a plugin that applies to it, and no logprobs
of any kind (their rows would come from the walk, not the sampler). Every other
request decodes one token per step through vLLM's own sampler, exactly as
without speculation, in the same batches.

Two things vLLM does differently once a speculative_config exists, undone for
tree engines (``install_request_support``):

* it builds only the min_tokens logits processor: no logit_bias, no min_p, no
  processors from the ``vllm.logits_processors`` entry point, so those would
  silently stop applying; the tree runner builds the full set, as vLLM does
  without speculation (``full_logitsprocs``);
* it rejects min_p and logit_bias requests ("not yet supported with
  speculative decoding"); tree engines accept them (``patch_spec_decode_validation``)
  and serve logit_bias ones without speculation (min_p does not move the
  argmax, so greedy min_p requests are speculated).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

TREE_MARK = "_spec_plugins_tree"  # set on a tree engine's SpeculativeConfig


# --------------------------------------------------------- the per-request rule


def params_allow_speculation(p) -> bool:
    """Sampling parameters under which the next token is the raw argmax
    (greedy) or a draw from ``sampling.node_probs`` (temperature, min-p,
    top-k, top-p), and no logprobs are returned."""
    if p is None:
        return False
    argmax_moves = (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.bad_words
                    or p.allowed_token_ids or p.min_tokens or p.logit_bias
                    or getattr(p, "logits_processors", None)
                    or getattr(p, "thinking_token_budget", None) is not None
                    or getattr(p, "structured_outputs", None) is not None)
    wants_logprobs = p.logprobs is not None or getattr(p, "logprob_token_ids", None) is not None
    return not (argmax_moves or wants_logprobs)


def may_speculate(params, row: int | None, logitsprocs) -> bool:
    """``params``: the request's SamplingParams; ``row``: its batch index now;
    ``logitsprocs``: the input batch's LogitsProcessors."""
    from vllm.sampling_params import SamplingType

    if not params_allow_speculation(params):
        return False
    sampled = params.sampling_type != SamplingType.GREEDY
    return not any(processor_applies(proc, row) for proc in custom_processors(logitsprocs, sampled))


def custom_processors(logitsprocs, sampled: bool = False) -> list:
    """Processors other than vLLM's builtins (whose parameters
    ``params_allow_speculation`` reads and ``sampling.node_probs`` applies)
    that can change a request's token: for a greedy request those that can
    move the argmax, for a sampled one every processor."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

    if logitsprocs is None:
        return []
    candidates = list(logitsprocs.non_argmax_invariant)
    if sampled:
        candidates += list(logitsprocs.argmax_invariant)
    return [p for p in candidates if type(p) not in BUILTIN_LOGITS_PROCESSORS]


def processor_applies(proc, row: int | None) -> bool:
    """An AdapterLogitsProcessor says which rows it processes (``req_info``);
    any other processor may touch any row, so it counts as applying to all."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    if isinstance(proc, AdapterLogitsProcessor):
        return row in proc.req_info
    return True


# ------------------------------------------------------------- runner startup


def full_logitsprocs(vllm_config, device, pin_memory: bool):
    """The processors vLLM builds without speculation: builtins (min_tokens,
    logit_bias, min_p) and the ``vllm.logits_processors`` entry points.
    (``model_config.logits_processors`` is refused at startup by config.py.)"""
    import itertools

    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs

    classes = itertools.chain(BUILTIN_LOGITS_PROCESSORS, _load_custom_logitsprocs(()))
    return LogitsProcessors(ctor(vllm_config, device, pin_memory) for ctor in classes)


def install_full_logitsprocs(runner) -> None:
    """Give the runner's input batch the full processor set (before any request)."""
    from vllm.utils.torch_utils import PIN_MEMORY

    batch = runner.input_batch
    batch.logitsprocs = full_logitsprocs(runner.vllm_config, runner.device, PIN_MEMORY)
    batch.sampling_metadata = batch._make_sampling_metadata()
    blanket = [type(p).__name__ for p in custom_processors(batch.logitsprocs) if processor_applies(p, None)]
    if blanket:
        logger.warning("spec-plugins: logits processor(s) %s may change any request's greedy token and do not say "
                       "which; no request is speculated while they are installed", blanket)


# ----------------------------------------------------- request validation


def mark_tree_engine(vllm_config) -> None:
    """Mark the engine's SpeculativeConfig (pickled with it to every process)
    and make vLLM's request validation accept min_p / logit_bias for it."""
    spec = vllm_config.speculative_config
    if spec is not None:
        object.__setattr__(spec, TREE_MARK, True)
    patch_spec_decode_validation()


@functools.lru_cache(maxsize=None)
def patch_spec_decode_validation() -> None:
    """SamplingParams._validate_spec_decode rejects min_p and logit_bias when a
    speculative_config exists; for tree engines (marked) it is skipped, since
    they serve such requests (logit_bias without speculation). Other engines
    in the process keep vLLM's check. Idempotent (lru_cache)."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if getattr(speculative_config, TREE_MARK, False):
            return None
        return original(self, speculative_config)

    SamplingParams._validate_spec_decode = _validate_spec_decode


# ------------------------------------------------------- logprobs in a grid


def spread_bonus_logprobs(bonus, counts, grid):
    """vLLM's Sampler logprobs for each request's last row (``bonus``: [B, K]
    LogprobsTensors or None), laid out as the [B * width] rows of the
    speculative output grid ([B, width] tokens, -1 padded): request b's row
    lands at its last emitted position, counts[b] - 1.

    Requests that ask for logprobs of any kind are never speculated, so that
    row is all they return and it is exactly what vLLM computes without
    speculation (top-k, logprob_token_ids, either mode). The other positions
    (path tokens of speculated requests, padding) are never read; they carry
    the grid token with logprob 0."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    if bonus is None or bonus.logprob_token_ids.dim() != 2:  # None, or logprobs=-1's placeholder: passed on
        return bonus
    batch, width = grid.shape
    cols = bonus.logprob_token_ids.shape[1]
    ids = grid.clamp(min=0).to(bonus.logprob_token_ids.dtype).reshape(-1, 1).repeat(1, cols)
    logprobs = bonus.logprobs.new_zeros(batch * width, cols)
    ranks = bonus.selected_token_ranks.new_zeros(batch * width)
    at = torch.arange(batch, device=grid.device) * width + torch.as_tensor(counts, device=grid.device) - 1
    ids[at], logprobs[at], ranks[at] = bonus.logprob_token_ids, bonus.logprobs, bonus.selected_token_ranks
    return LogprobsTensors(ids, logprobs, ranks)
