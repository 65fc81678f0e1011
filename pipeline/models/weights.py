"""Model weights, read a tensor at a time: the runner builds its own layout straight from them, so
no transformers model object is built and the host never holds a second copy of the weights.

- A local HF folder: `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), or
  PyTorch `*.bin` files. Safetensors are read with plain file reads (the header says where each
  tensor's bytes are), not memory-mapped: a mapping would count every byte of the checkpoint in the
  process's resident memory while it loads.
- A transformers model already in memory (tests, the Python API): its state dict, as it is.

Every missing file, truncated file and misshapen tensor is an error naming the file and tensor.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..shapes import TEXT_PARTS, config_get, text_config

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file: its header at open, each tensor's bytes read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                if n > size - 8:
                    raise ValueError(f"a header of {n} bytes in a {size}-byte file")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise ConfigError(f"model: {path} is missing") from None
        except (OSError, ValueError, struct.error) as e:
            raise ConfigError(f"model: {path}: not a readable safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.start = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                begin, end = info["data_offsets"]
                shape = list(info["shape"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"model: {path}: tensor {name!r} has a malformed header entry") from None
            if self.start + end > size:
                raise ConfigError(f"model: {path}: tensor {name!r} ends at byte {self.start + end}, past the end of "
                                  f"the {size}-byte file: the file is truncated")
            self.tensors[name] = (dtype, shape, begin, end)

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.tensors[name]
        out = torch.empty(shape, dtype=dtype)
        view = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
        if view is not None:
            with open(self.path, "rb") as f:
                f.seek(self.start + begin)
                if f.readinto(view) != end - begin:
                    raise ConfigError(f"model: {self.path}: tensor {name!r} is cut short: the file is truncated")
        return out


class CheckpointWeights:
    """The tensors of a HF folder by name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._where: dict[str, object] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"model: {index}: not a readable shard index ({e})") from None
            files = {}
            for name, file in weight_map.items():
                if file not in files:
                    if not (folder / file).is_file():
                        raise ConfigError(f"model: {index} lists {file}, which is missing from {folder}")
                    files[file] = SafetensorsFile(folder / file)
                if name not in files[file].tensors:
                    raise ConfigError(f"model: {index} puts {name!r} in {file}, which does not hold it")
                self._where[name] = files[file]
        elif sorted(folder.glob("*.safetensors")):
            for path in sorted(folder.glob("*.safetensors")):
                st = SafetensorsFile(path)
                self._where.update(dict.fromkeys(st.tensors, st))
        else:
            for path in sorted(folder.glob("*.bin")):
                try:
                    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                except Exception as e:  # noqa: BLE001 - a pickle can fail in many ways
                    raise ConfigError(f"model: {path}: not a readable PyTorch checkpoint ({e})") from None
                self._where.update(dict.fromkeys(sd, sd))
        if not self._where:
            raise ConfigError(f"model: {folder} has no *.safetensors or *.bin weights")

    def has(self, name: str) -> bool:
        return name in self._where

    def where(self, name: str) -> str:
        src = self._where.get(name)
        return str(src.path) if isinstance(src, SafetensorsFile) else str(self.folder)

    def get(self, name: str) -> torch.Tensor:
        src = self._where.get(name)
        if src is None:
            raise ConfigError(f"model: {self.folder}: tensor {name!r} is missing from the checkpoint")
        return src.read(name) if isinstance(src, SafetensorsFile) else src[name]


class ModuleWeights:
    """A transformers model's parameters by name (no copy)."""

    def __init__(self, module) -> None:
        self.sd = module.state_dict()

    def has(self, name: str) -> bool:
        return name in self.sd

    def where(self, name: str) -> str:
        return "the model in memory"

    def get(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise ConfigError(f"model: tensor {name!r} is missing from the model in memory")
        return self.sd[name]


class TextModelWeights:
    """The language model's tensors of a multimodal checkpoint (Gemma 3's) under the text model's
    own names: `model.layers.0...` reads `<prefix>layers.0...`; the vision tower is never read."""

    def __init__(self, inner, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        # A tied checkpoint may hold no lm_head at all; an untied one keeps it beside the model.
        self.lm_head = next((n for n in ("lm_head.weight", prefix.replace("model.", "", 1) + "lm_head.weight")
                             if inner.has(n)), "lm_head.weight")

    def _name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.lm_head
        return self.prefix + name[len("model."):] if name.startswith("model.") else name

    def has(self, name: str) -> bool:
        return self.inner.has(self._name(name))

    def where(self, name: str) -> str:
        return self.inner.where(self._name(name))

    def get(self, name: str) -> torch.Tensor:
        return self.inner.get(self._name(name))


def text_part(weights, config):
    """(weights, config) of the language model where config is a multimodal wrapper's (Gemma 3),
    else as given."""
    model_type = config_get(config, "model_type")
    prefixes = TEXT_PARTS.get(model_type)
    if not prefixes:
        return weights, config
    prefix = next((p for p in prefixes if weights.has(p + "embed_tokens.weight")), None)
    if prefix is None:
        raise ConfigError(f"model: a {model_type} checkpoint without its language model's tensors (looked for "
                          f"{' or '.join(p + 'embed_tokens.weight' for p in prefixes)})")
    return TextModelWeights(weights, prefix), text_config(config)


def eos_ids_of(*sources) -> tuple[int, ...]:
    """The EOS token ids named by configs, generation configs and tokenizers (objects or dicts;
    None skipped), each an id or a list of ids, merged and sorted."""
    ids: set[int] = set()
    for src in sources:
        e = src.get("eos_token_id") if isinstance(src, dict) else getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
    return tuple(sorted(ids))


@dataclass
class Checkpoint:
    """What the engine is built from: weights by name and the model's transformers config."""

    weights: object
    config: object
    # Token ids that end a generation (config, generation config, tokenizer).
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, model) -> "Checkpoint":
        """A Checkpoint as it is, or one of a transformers model in memory."""
        if isinstance(model, Checkpoint):
            return model
        return cls(ModuleWeights(model), model.config,
                   eos_ids_of(getattr(model, "generation_config", None), model.config, text_config(model.config)))


def save_safetensors_shards(tensors, folder: Path, shard_bytes: int = 2 << 30) -> None:
    """Write (name, tensor) pairs as model-0000k-of-0000n.safetensors shards of about shard_bytes
    and the index, holding at most one shard in memory."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0
    tmp_names = []

    def flush():
        nonlocal pending, size
        if pending:
            name = f".shard-{len(tmp_names):05d}.safetensors"
            save_file(pending, str(folder / name))
            tmp_names.append(name)
            shards.append(list(pending))
            pending, size = {}, 0

    for name, t in tensors:
        pending[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    n = len(tmp_names)
    weight_map = {}
    total = 0
    for k, (tmp, names) in enumerate(zip(tmp_names, shards)):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        (folder / tmp).rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
        total += (folder / final).stat().st_size
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
