"""Every patch the vLLM plugin makes to vLLM's own code, in one place.

Applied by ``register()`` in every vLLM process; each is idempotent and a
no-op unless tree mode is requested (``additional_config["spec_tree"]`` or
``--speculative-algorithm EAGLE_TREE``). Everything else the tree needs is
installed through vLLM's own extension points, not patches: the worker class
(``parallel_config.worker_cls``), which builds our runner subclass and
overrides the CPU_ATTN backend path (``register_backend``).

=====================================  ============================================
patched (vllm 0.32 / 0.33)             why
=====================================  ============================================
EngineArgs.add_cli_args                add SGLang-named tree flags to the parser
EngineArgs.from_cli_args               flags -> speculative_config + additional_config
EngineArgs.create_engine_config        fill num_speculative_tokens, worker_cls,
                                       async_scheduling; refuse unsupported options
                                       before and after vLLM builds its config
VllmConfig.num_lookahead_tokens        the tree's own in tree mode
  (property)                           (``config.tree_lookahead_tokens``): vLLM sizes
                                       it for its chain drafter's writes past each
                                       request's verify rows; EAGLE trees keep branch
                                       KV in a scratch tensor (0), DDTree's DFlash
                                       block needs a tree-dependent count. Can go when
                                       vLLM asks the proposer for its lookahead.
SamplingParams._validate_spec_decode   skipped for tree engines (their
                                       SpeculativeConfig is marked by
                                       ``requests.mark_tree_engine``): vLLM rejects
                                       min_p / logit_bias requests once speculation
                                       is on; tree engines serve them (logit_bias
                                       without speculation). Other engines keep
                                       vLLM's check. Can go when vLLM asks the
                                       proposer which requests it can speculate.
=====================================  ============================================
"""

from __future__ import annotations

import functools

from . import cli_flags
from . import config as tree_config

_PATCHED_MARK = "_spec_plugins_tree_patch"


def _wrap(owner, name: str, make):
    current = owner.__dict__[name]
    if getattr(current, _PATCHED_MARK, False) or getattr(getattr(current, "__func__", None), _PATCHED_MARK, False):
        return
    if isinstance(current, property) and getattr(current.fget, _PATCHED_MARK, False):
        return
    replacement = make(current)
    inner = replacement.__func__ if isinstance(replacement, (classmethod, staticmethod)) else replacement
    inner = inner.fget if isinstance(inner, property) else inner
    setattr(inner, _PATCHED_MARK, True)
    setattr(owner, name, replacement)


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make_add_cli_args(original: staticmethod):
        fn = original.__func__

        @functools.wraps(fn)
        def add_cli_args(parser, *args, **kwargs):
            parser = fn(parser, *args, **kwargs)
            cli_flags.add_cli_flags(parser)
            return parser

        return staticmethod(add_cli_args)

    def make_from_cli_args(original: classmethod):
        fn = original.__func__

        @functools.wraps(fn)
        def from_cli_args(cls, args):
            engine_args = fn(cls, args)
            cli_flags.apply_cli_flags(engine_args, args)
            return engine_args

        return classmethod(from_cli_args)

    def make_create_engine_config(fn):
        @functools.wraps(fn)
        def create_engine_config(self, *args, **kwargs):
            settings = tree_config.prepare_engine_args(self)
            vllm_config = fn(self, *args, **kwargs)
            if settings is not None:
                tree_config.validate_vllm_config(vllm_config, settings)
            return vllm_config

        return create_engine_config

    def make_num_lookahead_tokens(prop: property):
        @functools.wraps(prop.fget)
        def num_lookahead_tokens(self):
            settings = tree_config.settings_from_vllm_config(self)
            if settings is not None:
                return tree_config.tree_lookahead_tokens(self, settings)
            return prop.fget(self)

        return property(num_lookahead_tokens)

    from vllm.config import VllmConfig

    _wrap(VllmConfig, "num_lookahead_tokens", make_num_lookahead_tokens)
    from .requests import patch_spec_decode_validation

    patch_spec_decode_validation()
    _wrap(EngineArgs, "add_cli_args", make_add_cli_args)
    _wrap(EngineArgs, "from_cli_args", make_from_cli_args)
    _wrap(EngineArgs, "create_engine_config", make_create_engine_config)
