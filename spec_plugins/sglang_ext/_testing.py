"""Test support: import SGLang's worker and attention modules on a CPU box.

SGLang 0.5.23's speculative and attention modules import ``torchvision``
(multimodal preprocessing, e.g. ``srt/multimodal/internvl_utils.py``,
``srt/configs/deepseek_ocr.py``) at module load. PyPI has no torchvision
build for the CPU-only torch these test environments use (its wheels link
CUDA torch and fail to load), and nothing on the tree path calls it. So the
tests install an inert stand-in for ``torchvision`` when the real one cannot
be imported; any use of it returns further stand-ins and computes nothing.
This is the only module faked; say so in every test that relies on it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision",)


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {"__init__": lambda self, *a, **k: None})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = _StubMeta(name, (), {"__init__": lambda self, *a, **k: None, "__module__": self.__name__})
        else:
            value = _StubModule(f"{self.__name__}.{name}")
            value.__path__ = []
            sys.modules[value.__name__] = value
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = "<spec_plugins test stub>"
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install_import_stubs() -> list[str]:
    """Stub the modules in ``STUBBED`` that do not import; returns their names."""
    stubbed = []
    for name in STUBBED:
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - missing, or a build that cannot load here
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            stubbed.append(name)
    if stubbed and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    return stubbed


# ------------------------------------------------------- shared test helpers

_TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-5,
}


def write_tiny_checkpoint_configs(root) -> dict:
    """config.json-only checkpoints (no weights: nothing is loaded) for a
    Llama target, an EAGLE-3 head and an EAGLE-1 head; returns their paths."""
    import json
    import os

    heads = {
        "target": _TARGET_CONFIG,
        "eagle3_head": dict(_TARGET_CONFIG, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                            draft_vocab_size=256),
        "eagle_head": dict(_TARGET_CONFIG, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1),
    }
    paths = {}
    for name, config in heads.items():
        path = os.path.join(str(root), name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        paths[name] = path
    return paths


# Beyond ``sglang==0.5.23 --no-deps`` and the cross-check tests' packages,
# importing SGLang's worker, attention and server-args modules needs these
# (ci/setup_sglang_venv.sh installs them; torchvision is stubbed, see above).
EXTRA_TEST_PACKAGES = (
    "transformers==5.19.0", "einops", "dill", "compressed-tensors==0.18.0", "gguf", "openai==2.8.0",
    "partial_json_parser", "uvicorn", "fastapi", "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1", "setproctitle",
    "uvloop",
)  # fmt: skip


def register_with_sglang() -> None:
    """What SGLang's load_plugins does for this plugin: register, apply hooks."""
    install_import_stubs()
    try:
        import sglang.srt.speculative.eagle_worker_v2  # noqa: F401 - the heaviest import chain
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{err}: SGLang's worker modules need {' '.join(EXTRA_TEST_PACKAGES)} in this venv "
            "(ci/setup_sglang_venv.sh)"
        ) from err
    from sglang.srt.plugins.hook_registry import HookRegistry

    import spec_plugins.sglang_ext as ext

    from . import engine_patches

    ext.register()
    HookRegistry.apply_hooks()
    engine_patches.ensure_hooks_applied()


def resolved_server_args(**kwargs):
    """A real ``ServerArgs`` run through SGLang's resolution pipeline
    (skip_tokenizer_init: the tiny checkpoints have no tokenizer)."""
    from sglang.srt.server_args import ServerArgs

    kwargs.setdefault("skip_tokenizer_init", True)
    kwargs.setdefault("device", "cpu")
    server_args = ServerArgs(**kwargs)
    server_args.resolve_once()
    return server_args


def publish(server_args) -> None:
    """Make ``server_args`` the process's runtime config (``get_spec()`` etc.),
    as SGLang's scheduler does."""
    from sglang.srt.runtime_context import get_context

    get_context().set_server_args(server_args)


def random_parent_list(gen, bs: int, topk: int, steps: int):
    """A valid SGLang ``parent_list``: group 0 is the root (-1); step 1's groups
    are the root's children (pool 0..K-1); a later step's groups are K distinct
    survivors among the previous step's K*K candidates."""
    import torch

    if steps == 1:
        return torch.empty(bs, 0, dtype=torch.int64)
    cols = [torch.full((bs, 1), -1, dtype=torch.int64), torch.arange(topk).repeat(bs, 1)]
    for step in range(2, steps):
        start = topk + (step - 2) * topk * topk
        cols.append(torch.stack([torch.randperm(topk * topk, generator=gen)[:topk] for _ in range(bs)]) + start)
    return torch.cat(cols, dim=1)
