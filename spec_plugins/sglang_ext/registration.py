"""Registration of EAGLE_TREE with SGLang: the algorithm (worker factory and
spec class), its argument-resolution hook, the ``spec_tree`` /
``spec_tree_triton`` attention backends and ``engine_patches``' AROUND hooks.
Called once per process by the plugin entry point (``sglang_ext.register``)."""

from __future__ import annotations

from . import engine_patches
from .config import ALGORITHM_NAME, BACKEND_TORCH, BACKEND_TRITON




def _worker_factory(server_args):
    from .worker import EagleTreeWorker

    return EagleTreeWorker


def _create_torch_backend(runner):
    from .attention import TreeVerifyTorchNativeBackend

    return TreeVerifyTorchNativeBackend(runner)


def _create_triton_backend(runner):
    from .attention import make_triton_tree_backend

    return make_triton_tree_backend(runner)


def register_all() -> None:
    """Register EAGLE_TREE, its resolution hook, our attention backends and
    the AROUND hooks with SGLang. Each step skips what is already there."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from .algorithm import handle_speculative_decoding_hook, make_spec_class

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(ALGORITHM_NAME, supports_overlap=True, spec_class=make_spec_class())(
            _worker_factory
        )
    step = "handle_speculative_decoding"
    if handle_speculative_decoding_hook not in resolution_hooks._HOOKS.get(step, ()):
        resolution_hooks.register_resolution_hook(step)(handle_speculative_decoding_hook)
    for name, factory in ((BACKEND_TORCH, _create_torch_backend), (BACKEND_TRITON, _create_triton_backend)):
        attention_registry.register_attention_backend(name)(factory)
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    for target, hook in engine_patches.registry_hooks():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)
    # Engine.__init__ loads the plugins just before it builds its ServerArgs
    engine_patches.install_engine_keyword()
