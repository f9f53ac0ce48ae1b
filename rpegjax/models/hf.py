"""Hugging Face checkpoints: `config.json` + safetensors (single file or sharded with an index) <-> `Decoder`.

Tensor names and layouts are in `rpegjax.models.hf_layout`. The value head lives in `model.safetensors`
next to the trunk: `transformers` loads such a checkpoint and reports the two value-head tensors as
unexpected (checked by the tests). Tensors are read with our safetensors reader (never pickle).

Loading is sharded: given a mesh and rules, each parameter is created with its target sharding
(`jax.make_array_from_callback`) and each process reads from the files only the windows of each tensor
that its own devices hold, so a process's peak memory is about its share of the model (plus, for windows
that keep some columns of a tensor, one block of rows being read), no device ever holds a whole model, and
no weight is compared across processes.

Export (`save_pretrained`) streams: tensors are fetched to host one at a time and written as they come, so
the host holds one tensor (in our layout and in the HF layout) at a time. A tensor whose shards this process
holds is assembled on host from its shards; one spread over several processes is first replicated over its
mesh (every device then holds that one tensor, never the whole model), and process 0 writes the files.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rpegjax.distributed.collectives import barrier, lowest_process, spanning_mesh
from rpegjax.models.config import ModelConfig
from rpegjax.models.hf_layout import (
    CheckpointError,
    TensorLayout,
    abstract_split,
    check_tensor,
    hf_config,
    hf_incompatibilities,
    hf_tensors_to_state,
    iter_hf_tensors,
    params_to_hf_tensors,
    tensor_layouts,
)
from rpegjax.models.json_files import read_json_object
from rpegjax.models.safetensors_file import (
    SafetensorsError,
    SafetensorsFile,
    write_safetensors,
)
from rpegjax.models.tokenizer import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from rpegjax.models.transformer import Decoder
from rpegjax.sharding.rules import ShardingRules, param_shardings

__all__ = ["CONFIG_FILE", "INDEX_FILE", "WEIGHTS_FILE", "CheckpointError", "hf_tensors_to_state", "load_pretrained",
           "params_to_hf_tensors", "read_config", "save_pretrained", "tensor_layouts"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What `save_pretrained(tokenizer_dir=...)` copies: the files of the tokenizers transformers loads for our models.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE, "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
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
        return dict.fromkeys(_open_safetensors(single).keys(), single)
    legacy = [p.name for p in directory.glob("*.bin")]
    hint = f" ({legacy} are pickle files, which we never load; convert them to safetensors)" if legacy else ""
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def _open_safetensors(path: Path) -> SafetensorsFile:
    """The header of a safetensors file; a corrupt or truncated file is a CheckpointError."""
    try:
        return SafetensorsFile(path)
    except (SafetensorsError, OSError) as error:
        raise _corrupt(path, error) from None


def _corrupt(path: Path, error: Exception) -> CheckpointError:
    detail = str(error).removeprefix(f"{path}: ")
    return CheckpointError(f"{path}: corrupt or truncated safetensors file ({detail})")


def load_pretrained(
    path: PathLike, *, param_dtype: str | None = None, dtype: str | None = None, value_head: bool = False,
    mesh: Mesh | None = None, rules: ShardingRules | None = None,
) -> tuple[Decoder, ModelConfig]:
    """Loads a local HF checkpoint directory (config.json + model.safetensors, or shards + index).

    `param_dtype`/`dtype` override the storage/compute dtypes (default: the checkpoint's `dtype`; `dtype`
    follows `param_dtype` when only that is given). With `value_head=True` the value head is read when
    the checkpoint has one and starts at zero otherwise (a fresh critic on a pretrained trunk); with
    `value_head=False` value-head tensors are skipped.

    With `mesh`, every parameter is created sharded as `rules` (default `ShardingRules.fsdp_tp()`) place it
    on `mesh`, and this process reads only the windows of each tensor that its devices of `mesh` hold: call
    it in every process of a multi-process run with the same arguments. Without, parameters land on this
    process's first device. Raises CheckpointError naming the file and tensor on any mismatch; every name,
    shape and dtype is checked before any data is read.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    if rules is not None and mesh is None:
        raise ValueError("load_pretrained: sharding rules were given without a mesh")
    cfg = read_config(directory)
    cfg = cfg.replace(param_dtype=param_dtype or cfg.param_dtype, dtype=dtype or param_dtype or cfg.dtype,
                      value_head=value_head)
    files = _tensor_files(directory)
    to_read = _select_tensors(directory, files, cfg)
    opened = {file: _open_safetensors(file) for file in dict.fromkeys(files[name] for name in to_read)}
    for name, layout in to_read.items():  # in config order, so that errors are deterministic
        file = opened[files[name]]
        if name not in file:
            raise CheckpointError(f"{file.path}: index lists tensor {name!r} in this shard but it is not there")
        check_tensor(file.shape(name), file.dtype_code(name), layout, str(file.path))

    graphdef, abstract = abstract_split(cfg)
    shapes = {key: variable.get_value() for key, variable in nnx.to_flat_state(abstract)}
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        shardings = {key: device for key in shapes}
    else:
        placed = param_shardings(abstract, mesh, rules or ShardingRules.fsdp_tp())
        shardings = {key: variable.get_value() for key, variable in nnx.to_flat_state(placed)}
    tied_copy = to_read.pop("lm_head.weight") if cfg.tie_word_embeddings and "lm_head.weight" in to_read else None
    values, experts = {}, {}
    for name, layout in to_read.items():
        if layout.expert is not None:  # read below, all experts of one parameter together
            experts.setdefault(layout.path, []).append((opened[files[name]], layout))
            continue
        copy = None if tied_copy is None or layout.path != ("embed",) else (opened[files[tied_copy.name]], tied_copy)
        values[layout.path] = _read_placed(opened[files[name]], layout, shapes[layout.path], shardings[layout.path],
                                           copy=copy)
    for key, sources in experts.items():
        values[key] = _read_placed_experts(sources, shapes[key], shardings[key])
    filled = []
    for key, variable in nnx.to_flat_state(abstract):
        spec = shapes[key]
        value = values.get(key)
        if value is None:  # only a new value head: zero
            value = _placed(spec, shardings[key],
                            lambda window, spec=spec: np.zeros([s.stop - s.start for s in window], spec.dtype))
        filled.append((key, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(filled)), cfg


_TIED_LM_HEAD_PATH = ("<tied lm_head copy>",)


def _concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A device's index (slices that may be open) as explicit [start, stop) windows."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _placed(spec: jax.ShapeDtypeStruct, sharding, read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """The array of `spec` created with `sharding` from `read(window)`, the block of one device's [start, stop)
    windows, called once per distinct window this process's devices hold (replicas share it)."""
    blocks: dict[tuple, np.ndarray] = {}
    for index in sharding.addressable_devices_indices_map(spec.shape).values():
        window = _concrete(index, spec.shape)
        key = tuple((s.start, s.stop) for s in window)
        if key not in blocks:
            blocks[key] = read(window)
    return jax.make_array_from_callback(
        spec.shape, sharding, lambda index: blocks[tuple((s.start, s.stop) for s in _concrete(index, spec.shape))])


def _read_placed(file: SafetensorsFile, layout: TensorLayout, spec: jax.ShapeDtypeStruct, sharding,
                 *, copy: tuple[SafetensorsFile, TensorLayout] | None = None) -> jax.Array:
    """The parameter of `layout` created with `sharding`, reading only the windows this process's devices hold
    (`_placed`). `copy`: a tensor that must equal this one where it is read (a tied checkpoint's lm_head.weight)."""
    dtype = np.dtype(spec.dtype)

    def read(window: tuple[slice, ...]) -> np.ndarray:
        hf_window, finish = layout.window(window)
        try:
            block = finish(file.read(layout.name, hf_window)).astype(dtype, order="C")
            if copy is not None:
                copy_file, copy_layout = copy
                copy_window, copy_finish = copy_layout.window(window)
                if not np.array_equal(copy_finish(copy_file.read(copy_layout.name, copy_window)).astype(dtype), block):
                    raise CheckpointError(f"{copy_file.path}: tie_word_embeddings is true but lm_head.weight differs "
                                          "from embed_tokens")
        except (SafetensorsError, OSError) as error:
            raise _corrupt(file.path, error) from None
        return block

    return _placed(spec, sharding, read)


def _read_placed_experts(sources: list[tuple[SafetensorsFile, TensorLayout]], spec: jax.ShapeDtypeStruct,
                         sharding) -> jax.Array:
    """A stacked expert parameter [x, ...] created with `sharding` from its per-expert tensors (`sources`, in
    expert order), reading for each device's window only its experts' windows (`_placed`)."""
    dtype = np.dtype(spec.dtype)

    def read(window: tuple[slice, ...]) -> np.ndarray:
        parts = []
        for file, layout in sources[window[0].start:window[0].stop]:
            hf_window, finish = layout.window(window[1:])
            try:
                parts.append(finish(file.read(layout.name, hf_window)).astype(dtype, order="C"))
            except (SafetensorsError, OSError) as error:
                raise _corrupt(file.path, error) from None
        return np.stack(parts)

    return _placed(spec, sharding, read)


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


# ---- writing ------------------------------------------------------------------------------------------------
_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "attention_bias", "qk_norm", "value_head", "num_experts",
                 "num_experts_per_token", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers", "shared_expert_intermediate_size", "shared_expert_gate", "router_scoring",
                 "router_correction_bias", "router_groups", "router_topk_groups", "routed_scaling_factor")


def save_pretrained(model: Decoder, config: ModelConfig, path: PathLike, *, max_shard_bytes: int | None = None,
                    tokenizer_dir: PathLike | None = None) -> Path:
    """Writes `path/` as a HF checkpoint that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Tensors are stored in `config.param_dtype`; `config` must describe `model`'s shapes. With
    `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files (a tensor larger
    than the limit gets a file of its own) plus an index. `tokenizer_dir`: a directory whose tokenizer files
    (`TOKENIZER_FILES`, those present) are copied alongside. Everything is written to a temporary sibling
    directory first and renamed into place, so a crash never leaves a half-written checkpoint at `path`.

    The parameters may be sharded, across processes too: then every process must call this (each tensor is
    replicated over its mesh in turn, a collective: every device holds one whole tensor at a time) and
    process 0 writes `path`; every process returns once it is in place. Host memory: one tensor at a time
    (in our layout and in the HF layout). A model whose arrays this process holds entirely is written by
    this process alone, as in a single-process run.
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
    if tokenizer_dir is not None and not Path(tokenizer_dir, TOKENIZER_FILE).is_file():
        raise CheckpointError(f"save_pretrained: tokenizer_dir {tokenizer_dir} has no {TOKENIZER_FILE}")
    target = Path(path)
    hf_cfg = hf_config(config)
    dtype = np.dtype(jnp.dtype(config.jnp_param_dtype))
    layouts = tensor_layouts(hf_cfg)
    sizes = [(layout.name, math.prod(layout.hf_shape) * dtype.itemsize) for layout in layouts]
    shards = _plan_shards(sizes, max_shard_bytes)
    hf_shapes = {layout.name: layout.hf_shape for layout in layouts}
    to_host = _host_fetcher()
    # parameters spread over processes: a collective export that process 0 writes; otherwise each process
    # holds a whole model and writes it alone (several writers of one path: the last rename wins, all equal)
    # (over process groups, the processes holding the parameters, the first of them writing)
    mesh = spanning_mesh(nnx.state(model, nnx.Param))
    collective = mesh is not None
    if collective and jax.process_index() != lowest_process(mesh):  # take part in every fetch, then wait
        for names in shards:
            for _ in iter_hf_tensors(model, hf_cfg, dtype, set(names), to_host):
                pass
        barrier(f"save_pretrained {target}", mesh)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint should be as readable as any directory
        _write_json(staging / CONFIG_FILE, hf_cfg.to_hf_dict())
        if config.bos_token_id is not None or config.eos_token_id is not None:
            _write_json(staging / GENERATION_CONFIG_FILE, {
                "_from_model_config": True, "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if Path(tokenizer_dir, name).is_file():
                    shutil.copyfile(Path(tokenizer_dir, name), staging / name)
        weight_map = {}
        for number, names in enumerate(shards, start=1):
            file = WEIGHTS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(staging / file, [(name, dtype, hf_shapes[name]) for name in names],
                              iter_hf_tensors(model, hf_cfg, dtype, set(names), to_host), metadata={"format": "pt"})
            weight_map.update({name: file for name in names})
        if len(shards) > 1:
            total = sum(size for _, size in sizes)
            _write_json(staging / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _replace_directory(staging, target)
        _fsync(target.parent)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if collective:
        barrier(f"save_pretrained {target}", mesh)
    return target


def _host_fetcher() -> Callable[[jax.Array], np.ndarray]:
    """Fetches one parameter to host: assembled from this process's shards when it holds them all, else first
    replicated over its mesh (one compiled program per mesh, shape and dtype)."""
    replicate: dict[Mesh, Callable] = {}

    def to_host(array: jax.Array) -> np.ndarray:
        if not isinstance(array, jax.Array) or array.is_fully_addressable:
            return np.asarray(jax.device_get(array))
        mesh = array.sharding.mesh
        if mesh not in replicate:
            replicate[mesh] = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
        return np.asarray(replicate[mesh](array).addressable_data(0))

    return to_host


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
