"""Hugging Face checkpoints: `config.json` + safetensors (single file or sharded with an index) <-> `Decoder`.

Tensor names and layouts are in `rpegjax.models.hf_layout`. The value head lives in `model.safetensors`
next to the trunk: `transformers` loads such a checkpoint and reports the two value-head tensors as
unexpected (checked by the tests). Tensors are read with the safetensors numpy API (never pickle), one
at a time, so peak host memory is about one tensor beyond the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rpegjax.models.config import ModelConfig
from rpegjax.models.hf_layout import (
    CheckpointError,
    TensorLayout,
    abstract_split,
    check_tensor,
    convert_tensor,
    hf_config,
    hf_incompatibilities,
    hf_tensors_to_state,
    iter_hf_tensors,
    params_to_hf_tensors,
    state_from_values,
    tensor_layouts,
)
from rpegjax.models.json_files import read_json_object
from rpegjax.models.transformer import Decoder

__all__ = ["CONFIG_FILE", "INDEX_FILE", "WEIGHTS_FILE", "CheckpointError", "hf_tensors_to_state", "load_pretrained",
           "params_to_hf_tensors", "read_config", "save_pretrained", "tensor_layouts"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers that older transformers versions saved although they are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_VALUE_HEAD_NAMES = ("value_head.weight", "value_head.bias")
PathLike = str | os.PathLike


# ---- reading ------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    return read_json_object(path, CheckpointError)


def read_config(path: PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's config.json; CheckpointError when missing or unsupported."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing config.json in checkpoint directory {path}")
    try:
        return ModelConfig.from_hf_dict(_read_json(config_path), source=str(config_path))
    except CheckpointError:
        raise
    except (ValueError, TypeError) as error:  # a field of the wrong type or value: name the file too
        message = str(error)
        raise CheckpointError(message if message.startswith(str(config_path)) else f"{config_path}: {message}") from None


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it, from the index when the checkpoint is sharded."""
    index_path, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
        files = {}
        for name, shard in weight_map.items():
            shard_path = directory / shard
            if Path(shard).name != shard:
                raise CheckpointError(f"{index_path}: shard {shard!r} of tensor {name!r} is not a plain file name")
            if not shard_path.is_file():
                raise CheckpointError(f"{index_path}: tensor {name!r} is in shard {shard!r}, which does not exist")
            files[name] = shard_path
        return files
    if single.is_file():
        return {name: single for name in _open_safetensors(single, lambda handle: list(handle.keys()))}
    legacy = [p.name for p in directory.glob("*.bin")]
    hint = f" ({legacy} are pickle files, which we never load; convert them to safetensors)" if legacy else ""
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def _open_safetensors(path: Path, body: Callable):
    """Runs `body(handle)` on an open safetensors file, turning a corrupt or truncated file into CheckpointError."""
    try:
        with safe_open(str(path), framework="np") as handle:
            return body(handle)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({error})") from None


def load_pretrained(
    path: PathLike, *, param_dtype: str | None = None, dtype: str | None = None, value_head: bool = False
) -> tuple[Decoder, ModelConfig]:
    """Loads a local HF checkpoint directory (config.json + model.safetensors, or shards + index).

    `param_dtype`/`dtype` override the storage/compute dtypes (default: the checkpoint's `dtype`; `dtype`
    follows `param_dtype` when only that is given). With `value_head=True` the value head is read when
    the checkpoint has one and starts at zero otherwise (a fresh critic on a pretrained trunk); with
    `value_head=False` value-head tensors are skipped. Raises CheckpointError naming the file and tensor
    on any mismatch; tensor names are all checked first, and each file's shapes and dtypes before its data.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    cfg = read_config(directory)
    cfg = cfg.replace(param_dtype=param_dtype or cfg.param_dtype, dtype=dtype or param_dtype or cfg.dtype,
                      value_head=value_head)
    files = _tensor_files(directory)
    to_read = _select_tensors(directory, files, cfg)
    by_file: dict[Path, list[str]] = {}
    for name in to_read:  # in config order, so that errors are deterministic
        by_file.setdefault(files[name], []).append(name)
    values: dict[tuple, jax.Array] = {}
    for file, names in by_file.items():
        _open_safetensors(file, lambda handle: _read_tensors(handle, file, [to_read[n] for n in names], cfg, values))
    tied_copy = values.pop(_TIED_LM_HEAD_PATH, None)
    if tied_copy is not None and not bool(jnp.array_equal(tied_copy, values[("embed",)])):
        raise CheckpointError(
            f"{files['lm_head.weight']}: tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
    graphdef, _ = abstract_split(cfg)
    return nnx.merge(graphdef, state_from_values(cfg, values)), cfg


_TIED_LM_HEAD_PATH = ("<tied lm_head copy>",)


def _select_tensors(directory: Path, files: Mapping[str, Path], cfg: ModelConfig) -> dict[str, TensorLayout]:
    """The tensors to read (name -> layout, in config order) after checking for missing and unexpected ones.

    Skipped: recomputed buffers, value-head tensors when `cfg.value_head` is off. A tied checkpoint may
    carry a copy of the embedding as lm_head.weight (read only to check it is a copy).
    """
    layouts = {layout.name: layout for layout in tensor_layouts(cfg)}
    skipped = {name for name in files if name.endswith(_IGNORED_SUFFIXES)}
    if not cfg.value_head:
        skipped |= set(_VALUE_HEAD_NAMES)
    elif not any(name in files for name in _VALUE_HEAD_NAMES):
        layouts = {name: layout for name, layout in layouts.items() if name not in _VALUE_HEAD_NAMES}  # zero head
    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        layouts["lm_head.weight"] = dataclasses.replace(layouts["model.embed_tokens.weight"], name="lm_head.weight",
                                                        path=_TIED_LM_HEAD_PATH)
    missing = [name for name in layouts if name not in files]
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(files) - skipped - set(layouts))
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    return layouts


def _read_tensors(handle, file: Path, layouts: list[TensorLayout], cfg: ModelConfig, into: dict) -> None:
    """Checks every listed tensor's name, shape and dtype in the open file, then reads and converts them one by one."""
    present = set(handle.keys())
    for layout in layouts:
        if layout.name not in present:
            raise CheckpointError(f"{file}: index lists tensor {layout.name!r} in this shard but it is not there")
        view = handle.get_slice(layout.name)
        check_tensor(tuple(view.get_shape()), view.get_dtype(), layout, str(file))
    for layout in layouts:
        into[layout.path] = convert_tensor(handle.get_tensor(layout.name), layout, cfg, str(file))


# ---- writing ------------------------------------------------------------------------------------------------
_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "attention_bias", "qk_norm", "value_head")


def save_pretrained(model: Decoder, config: ModelConfig, path: PathLike, *, max_shard_bytes: int | None = None) -> Path:
    """Writes `path/` as a HF checkpoint that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Tensors are stored in `config.param_dtype`; `config` must describe `model`'s shapes. With
    `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files (a tensor larger
    than the limit gets a file of its own) plus an index. Everything is written to a temporary sibling
    directory first and renamed into place, so a crash never leaves a half-written checkpoint at `path`.
    """
    for name in _SHAPE_FIELDS:
        wanted, actual = getattr(config, name), getattr(model.cfg, name)
        if wanted != actual:
            raise ValueError(f"save_pretrained: config.{name}={wanted!r} but the model has {actual!r}")
    problems = hf_incompatibilities(config)
    if problems:
        raise CheckpointError(f"save_pretrained: transformers cannot represent this model: {'; '.join(problems)}")
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes < 1):
        raise ValueError(f"save_pretrained: max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    hf_cfg = hf_config(config)
    dtype = np.dtype(jnp.dtype(config.jnp_param_dtype))
    layouts = tensor_layouts(hf_cfg)
    sizes = [(layout.name, math.prod(layout.hf_shape) * dtype.itemsize) for layout in layouts]
    shards = _plan_shards(sizes, max_shard_bytes)

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint should be as readable as any directory
        _write_json(staging / CONFIG_FILE, hf_cfg.to_hf_dict())
        if config.bos_token_id is not None or config.eos_token_id is not None:
            _write_json(staging / GENERATION_CONFIG_FILE, {
                "_from_model_config": True, "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
        weight_map = {}
        for number, names in enumerate(shards, start=1):
            file = WEIGHTS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = dict(iter_hf_tensors(model, hf_cfg, dtype, set(names)))
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            _fsync(staging / file)
            weight_map.update({name: file for name in names})
        if len(shards) > 1:
            total = sum(size for _, size in sizes)
            _write_json(staging / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _replace_directory(staging, target)
        _fsync(target.parent)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy in file order: a new shard starts when the next tensor would exceed the limit."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if max_shard_bytes is not None and shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync(path: Path) -> None:
    """Flushes a file, or a directory's entries, to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _replace_directory(staging: Path, target: Path) -> None:
    """Renames `staging` to `target`; an existing `target` is moved aside first and removed only afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    if not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory")
    previous = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, previous / target.name)
    os.replace(staging, target)
    shutil.rmtree(previous, ignore_errors=True)
