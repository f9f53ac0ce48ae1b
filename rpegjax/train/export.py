"""A trained policy out of a run: a Hugging Face directory (weights, config, tokenizer files) that
`transformers` and `--model` load, and the policy of any checkpoint of a run restored into the job's own
components (`load_run`), for `scripts/export_hf.py`, `evaluate.py` and `generate.py`."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
from typing import Any

import jax
from flax import nnx

from rpegjax.distributed import DistributedConfig
from rpegjax.models.hf import TOKENIZER_FILE, save_pretrained
from rpegjax.models.lora import merge_adapters
from rpegjax.models.peft import save_peft_adapter
from rpegjax.models.tokenizer import BUILTIN_CHARACTERS, BUILTIN_SPECIAL_TOKENS, CharTokenizer
from rpegjax.models.transformer import Decoder
from rpegjax.train.build import Components, build
from rpegjax.train.checkpoint import Checkpointer, CheckpointError
from rpegjax.train.config import ModelSection, RunConfig, WarmStartSection


def policy_model(parts: Components, params: Any) -> Decoder:
    """The policy `Decoder` with `params` (a learner's whole actor parameters, any layout): with LoRA the base
    model carrying the adapters."""
    return parts.learner.placement.merge(params)


def merged_model(model: Decoder) -> Decoder:
    """`model` as a plain model: with LoRA adapters the base model whose kernels are W + s A B."""
    if model.lora is None:
        return model
    return nnx.merge(nnx.graphdef(model.without_lora()), merge_adapters(nnx.state(model), model.lora.scale))


def _byte_level_symbol(character: str) -> str:
    """GPT-2's printable stand-in for a byte (byte-level BPE vocabularies spell a space "Ġ", a newline "Ċ")."""
    code = ord(character)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return character
    return chr(256 + [b for b in range(256) if b not in printable].index(code))


def write_char_tokenizer(directory: pathlib.Path) -> None:
    """The built-in character tokenizer as `tokenizer.json` + `tokenizer_config.json`, with the same ids
    (`<pad>`=0, `<eos>`=1, `<bos>`=2, then newline and printable ASCII). It is written as a byte-level BPE
    without merges (one token per character, spelled as GPT-2 spells bytes): `transformers` reads a Qwen2
    checkpoint's tokenizer as such a BPE whatever the file declares, and then encodes as `CharTokenizer` does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(BUILTIN_SPECIAL_TOKENS)}
    vocab.update({_byte_level_symbol(c): len(BUILTIN_SPECIAL_TOKENS) + i for i, c in enumerate(BUILTIN_CHARACTERS)})
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BUILTIN_SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    pad, eos, bos = BUILTIN_SPECIAL_TOKENS
    config = {"tokenizer_class": "Qwen2Tokenizer", "pad_token": pad, "eos_token": eos, "bos_token": bos,
              "model_max_length": 4096, "clean_up_tokenization_spaces": False, "add_prefix_space": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _tokenizer_dir(parts: Components, scratch: pathlib.Path) -> pathlib.Path:
    """A directory holding the run's tokenizer files: the checkpoint's own, or the built-in character
    tokenizer written into `scratch`."""
    if isinstance(parts.tokenizer, CharTokenizer):
        write_char_tokenizer(scratch)
        return scratch
    source = pathlib.Path(parts.cfg.model.path)
    if not (source / TOKENIZER_FILE).is_file():
        raise CheckpointError(f"{source}: no {TOKENIZER_FILE} to copy into the exported model")
    return source


def export_policy(parts: Components, params: Any, path: str | pathlib.Path) -> pathlib.Path:
    """Writes the policy with `params` as a Hugging Face directory at `path` (replacing one there): weights in
    the model's parameter dtype, config.json, generation_config.json and the tokenizer's files, by
    `rpegjax.models.hf.save_pretrained` (written into a temporary sibling and renamed into place, so `path` never
    holds half a model). `params` may be sharded over several processes: then every process calls this, the
    tensors are assembled one at a time (never the whole model on one device) and the first process holding them
    writes (over process groups: the first training process; the generation processes take no part). A policy with
    LoRA adapters is written merged (W + s A B): a plain model; `export_adapter` writes the adapters alone."""
    with tempfile.TemporaryDirectory(prefix="rpegjax-tokenizer-") as scratch:
        return save_pretrained(merged_model(policy_model(parts, params)), parts.model_cfg, path,
                               tokenizer_dir=_tokenizer_dir(parts, pathlib.Path(scratch)))


def export_adapter(parts: Components, params: Any, path: str | pathlib.Path) -> pathlib.Path:
    """Writes the LoRA adapters of the policy with `params` as a PEFT adapter directory at `path`
    (`rpegjax.models.peft`), recording the run's base model (`model.path`; unset for the built-in model)."""
    return save_peft_adapter(policy_model(parts, params), path, base_model=parts.cfg.model.path)


def run_config(run_dir: str | pathlib.Path) -> RunConfig:
    """A run's config.json, laid out to rebuild its model on this machine: one colocated mesh over the devices
    here, no plan, no warm start (the checkpoint's weights replace the initial ones), this process alone, and
    no custom reward terms (exporting, sampling and held-out accuracy, which is the task verifier's, need none;
    so the user's reward modules need not be importable here)."""
    cfg = RunConfig.from_file(pathlib.Path(run_dir) / "config.json")
    graph = dataclasses.replace(cfg.graph, mesh="data=-1", rollout_devices=0, plan=None, generate_microbatches=1)
    return cfg.replace(graph=graph, warm_start=dataclasses.replace(cfg.warm_start, steps=0),
                       data=dataclasses.replace(cfg.data, reward=()), distributed=DistributedConfig())


def restore_policy(parts: Components, run_dir: str | pathlib.Path, step: int | None = None) -> tuple[Any, int]:
    """The policy's parameters in checkpoint `step` of the run (default: the latest complete one), and the step."""
    checkpoints = Checkpointer(pathlib.Path(run_dir) / "checkpoints", asynchronous=False)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            raise CheckpointError(f"{checkpoints.directory}: no complete checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointError(f"{checkpoints.directory}: no checkpoint of step {step}; there are {steps}")
        state = parts.learner.init_state()
        # the older versions a checkpoint keeps: generation copies of the policy, or with LoRA its adapters
        version = state.params if parts.cfg.lora.enabled else parts.learner.actor_params(state.params)
        versions = checkpoints.metadata(step)["history_versions"]
        arrays, _ = checkpoints.restore({"state": state, "history": {str(v): version for v in versions}}, step)
    finally:
        checkpoints.close()
    return parts.learner.actor_params(arrays["state"].params), step


def load_run(run_dir: str | pathlib.Path, step: int | None = None, *, overrides: dict[str, Any] | None = None,
             log=print) -> tuple[Components, Any, int]:
    """The job's components rebuilt from a run directory (its config.json, with `overrides`: section name ->
    dataclass fields to replace) and the policy parameters of its checkpoint `step` (default: the latest)."""
    parts = build(_with_changes(run_config(run_dir), overrides), log=log)
    params, step = restore_policy(parts, run_dir, step)
    return parts, params, step


def _with_changes(cfg: RunConfig, changes: dict[str, dict[str, Any]] | None) -> RunConfig:
    for section, fields in (changes or {}).items():
        cfg = cfg.replace(**{section: dataclasses.replace(getattr(cfg, section), **fields)})
    return cfg


def is_run_directory(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "checkpoints").is_dir()


def load_policy(source: str | pathlib.Path, *, step: int | None = None,
                changes: dict[str, dict[str, Any]] | None = None, log=print) -> tuple[Components, Any, str]:
    """The job's components and a policy's parameters from `source`: a run directory (its config.json and
    checkpoint `step`, default the latest) or a Hugging Face model directory (built as `--model DIR` would be).
    `changes` maps config sections to fields to replace (e.g. `{"data": {"task": "countdown"}}`). Returns
    (components, parameters in the sampler's layout, a description of what was loaded)."""
    path = pathlib.Path(source)
    if is_run_directory(path):
        if changes:
            log(f"{path}: rebuilt with {changes}")
        parts, params, step = load_run(path, step, overrides=changes, log=log)
        what = f"{path} at step {step}"
    elif (path / "config.json").is_file():
        if step is not None:
            raise ValueError(f"{path}: a Hugging Face directory has no steps (--step is for run directories)")
        cfg = RunConfig(model=ModelSection(path=str(path)), warm_start=WarmStartSection(steps=0))
        parts = build(_with_changes(cfg, changes), log=log)
        params, what = parts.learner.actor_params(parts.learner.params), str(path)
    else:
        raise ValueError(f"{path}: neither a run directory (config.json and checkpoints/) nor a Hugging Face model "
                         "directory (config.json and *.safetensors)")
    return parts, generation_params(parts, params), what


def generation_params(parts: Components, params: Any) -> Any:
    """`params` laid out as the sampler reads them (with LoRA, merged when the sampler decodes the base model)."""
    if parts.learner.placement.lora is not None and parts.sampler.lora is None:
        params = nnx.state(merged_model(policy_model(parts, params)))
    sharding = parts.sampler.params_sharding
    return params if sharding is None else jax.device_put(params, sharding)
