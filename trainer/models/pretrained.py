"""Starting from pretrained weights (`finetune.weights=PATH`): which files, checked against the model, read shard
by shard.

PATH is a safetensors file, a directory with `model.safetensors` or Hugging Face's sharded
`model.safetensors.index.json` (a download of a Hub model, `save_pretrained`'s output), or a finished run dir
(its export is the same layout). Pickled weights (`.bin`, `.pt`, ...) are refused: loading them runs code.

The files' headers are read and matched to the model before any tensor is (in preflight, against the model
built on the meta device, so a mismatch stops the run before any worker starts): every key of the model's
`state_dict` must be in the files with its shape, and every key of the files in the model. A tied weight is
satisfied by either of its names (Hugging Face saves one), a model's `_keys_to_ignore_on_load_unexpected` /
`_missing` patterns are honoured, and files saved from the base model of a task model (GPT-2's Hub weights
have no `transformer.` prefix) are matched through `base_model_prefix`.

Each rank then reads only its part of each tensor: under FSDP or tensor parallelism a parameter is a DTensor,
whose local shard is a box of the whole tensor (`compute_local_shape_and_global_offset`); the rows of that box
are one byte range of the file, read with `pread` (trainer/checkpoint/tensorfile.py: never mapped, so a file truncated
while it is read is an error, not a SIGBUS), and the box is cut from them. So no rank ever holds the whole model,
nor a whole tensor of a split layer. The main rank hashes the files it read through the same file descriptors
(sha256), and the run records them in run_info.json.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from trainer.checkpoint import tensorfile
from trainer.errors import CheckpointError, ConfigError

PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONVERT = ("Convert it once where you trust its source: python -c \"import torch, safetensors.torch as s; "
           "s.save_file(torch.load('IN', weights_only=True), 'model.safetensors')\" (a state_dict of tensors; "
           "Hugging Face models: from_pretrained(...).save_pretrained(DIR) writes safetensors).")


@dataclass
class Weights:
    """The files of a pretrained model, their tensors' entries, and which file holds each key."""

    path: Path
    files: list[Path]
    readers: dict[Path, tensorfile.FileReader] = field(default_factory=dict)
    entries: dict[str, tuple[Path, tensorfile.Entry]] = field(default_factory=dict)

    def close(self) -> None:
        for reader in self.readers.values():
            reader._file.close()
        self.readers.clear()

    def record(self, is_main: bool) -> dict | None:
        """{"path", "files": {name: {"bytes", "sha256"}}} for run_info.json (the main rank hashes; None elsewhere)."""
        if not is_main:
            return None
        digests = tensorfile.sha256_all({str(p): r for p, r in self.readers.items()})
        return {"path": str(self.path), "files": {p.name: {"bytes": self.readers[p].size, "sha256": digests[str(p)]}
                                                  for p in self.files}}


def _refuse_pickle(path: Path, label: str = "finetune.weights=") -> None:
    raise CheckpointError(f"{label}{path} is a pickle file ({path.suffix}): loading it would run whatever "
                          f"code it holds, so the framework never unpickles. {CONVERT}")


def files_of(path: str | os.PathLike, label: str = "finetune.weights=", name: str = "model") -> list[Path]:
    """The safetensors files PATH names (a file, a model directory, a finished run dir), in order. `label` starts
    the messages (what named PATH); `name` is the weights' file name in a directory (model_ema for a run's EMA)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{label}{path} does not exist. Give a .safetensors file, a directory with "
                          "model.safetensors or model.safetensors.index.json (a Hugging Face model), or a finished "
                          "run dir.")
    if p.is_file():
        if p.suffix in PICKLED:
            _refuse_pickle(p, label)
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{label}{path} is not a .safetensors file. Give a safetensors file, or "
                                  "the directory of a model or of a finished run.")
        return [p]
    if (p / "manifest.json").is_file() and (p / "state.json").is_file():  # a checkpoint: its files verified first
        from trainer.checkpoint.store import verify

        model_files = sorted(f for f in verify(p)["files"] if f.startswith("model"))
        whole = (f"or from its weights written whole: python -c \"import trainer, safetensors.torch as st; "
                 f"st.save_model(trainer.load('{path}'), 'w.safetensors')\" then finetune.weights=w.safetensors.")
        if name == "model" and model_files == ["model.safetensors"]:  # (one file: the whole weights, of any world)
            if _adapters_only(p / "model.safetensors"):
                raise ConfigError(f"{label}{path} is a checkpoint of a LoRA run: its model file holds the adapters "
                                  f"alone (the base is that run's own finetune.weights). Continue that run with "
                                  f"resume={path}, start from the run's export (finetune.weights=RUN_DIR, the "
                                  f"adapters merged into the base, once the run finished), {whole}")
            return [p / "model.safetensors"]
        shown = ", ".join(model_files[:3]) + (", ..." if len(model_files) > 3 else "")
        raise ConfigError(f"{label}{path} is a checkpoint whose weights are split over its ranks' files ({shown}): "
                          f"continue that run with resume={path}, or start from the run's export "
                          f"(finetune.weights=RUN_DIR, the directory above checkpoints/, once the run finished), {whole}")
    if (p / f"{name}.safetensors").is_file():
        return [p / f"{name}.safetensors"]
    index = p / f"{name}.safetensors.index.json"
    if index.is_file():
        return _shards(index, label)
    pickled = sorted(q.name for q in p.iterdir() if q.suffix in PICKLED)
    if pickled:
        _refuse_pickle(p / pickled[0], label)
    if (p / "config.yaml").is_file():
        raise CheckpointError(f"{label}{path} is a run dir without an export (no {name}.safetensors): the "
                              "run has not finished. Resume it with resume=auto (a finished run writes its export), "
                              "or pass one of its checkpoints as resume=PATH.")
    raise ConfigError(f"{label}{path} has no {name}.safetensors or {name}.safetensors.index.json. Give a "
                      ".safetensors file, a Hugging Face model directory, or a finished run dir.")


def _adapters_only(path: Path) -> bool:
    """Whether a safetensors file holds LoRA adapters alone (a LoRA run's checkpoint: its base is not saved there)."""
    reader, _, entries = tensorfile.map_safetensors(path, follow_links=True)
    reader._file.close()
    return bool(entries) and all(".lora_" in key for key in entries)


def _shards(index: Path, label: str = "finetune.weights=") -> list[Path]:
    import json

    try:
        weight_map = json.loads(tensorfile.map_file(index, max_size=16 << 20)).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index ({e}).") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' is not a map of tensor names to shard file names.")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"{index} names {name!r}, not a file beside it: only files in {index.parent} are "
                                  "read.")
        if Path(name).suffix in PICKLED:
            _refuse_pickle(index.parent / name, label)
    return [index.parent / n for n in names]


def open_weights(path: str | os.PathLike, label: str = "finetune.weights=", name: str = "model") -> Weights:
    """PATH's files opened, each header checked against its file's size, and every tensor's entry by key."""
    weights = Weights(Path(path).expanduser(), files_of(path, label, name))
    try:
        for f in weights.files:
            reader, _, entries = tensorfile.map_safetensors(f, follow_links=True)
            weights.readers[f] = reader
            for key, entry in entries.items():
                weights.entries[key] = (f, entry)
    except FileNotFoundError as e:
        weights.close()
        raise CheckpointError(f"{e.filename} is missing (named by {path}).") from None
    except (OSError, ValueError) as e:
        weights.close()
        raise CheckpointError(f"cannot read the weights of {label}{path}: {e}.") from None
    from trainer.models.export import check_against_record

    try:
        check_against_record(weights.readers)  # a finished run's export: the files it recorded, byte for byte
    except BaseException:
        weights.close()
        raise
    return weights


# -- matching a Hugging Face model's config ------------------------------------------------------------------
# Keys of a config.json that do not change what the pretrained weights compute: records, the tokenizer's ids, the
# output switches, the length positions are laid out for (a learned table's shape is matched with the weights),
# and the regularisation a fine-tuning run chooses for itself (the dropouts).
FREE_CONFIG_KEYS = {"architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "max_position_embeddings",
                    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "output_attentions",
                    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
                    "chunk_size_feed_forward"}


def check_config(model: nn.Module, path: str | os.PathLike, label: str = "finetune.weights=") -> None:
    """A directory's config.json (a Hub download, save_pretrained's output, a finished run of a Hugging Face model)
    against the config of the model this run builds: a setting the shapes do not show (rope_theta, rms_norm_eps,
    tied embeddings, the activation) that differs makes the weights load and compute another function than the
    one they were trained in. Refused, naming each setting and the overrides that give the directory's."""
    config = getattr(model, "config", None)
    source = Path(path).expanduser() / "config.json"
    if not (hasattr(config, "to_dict") and hasattr(type(config), "from_dict") and source.is_file()):
        return
    import json

    try:
        raw = json.loads(source.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{label}{path}: its config.json cannot be read ({e}). Restore it from where the "
                              "weights came from, or give the .safetensors file itself (no config is then compared)."
                              ) from None
    ours = config.to_dict()
    if raw.get("model_type", ours.get("model_type")) != ours.get("model_type"):
        named = ", ".join(raw.get("architectures") or []) or f"model_type {raw['model_type']!r}"
        raise CheckpointError(f"{label}{path} holds a {named} (its config.json), and this run builds a "
                              f"{type(model).__name__}: set model.architecture to the class the weights were saved "
                              f"from, e.g. model.architecture={(raw.get('architectures') or ['...'])[0]}.")
    try:
        theirs = type(config).from_dict(raw).to_dict()  # (transformers' own reading: older files' keys converted)
    except Exception as e:  # noqa: BLE001 - the config class's own validation of a file from elsewhere
        raise CheckpointError(f"{label}{path}: its config.json is not a valid {type(config).__name__} "
                              f"({type(e).__name__}: {' '.join(str(e).split())}). Restore it from where the weights came from.") from None
    differ = {k: (v, ours[k]) for k, v in theirs.items()
              if k in ours and v != ours[k] and k not in FREE_CONFIG_KEYS and not k.startswith("_")
              and "dropout" not in k and not k.endswith("pdrop")}
    if differ:
        import shlex

        listed = "; ".join(f"{k} {_as_override(there)} there, {_as_override(here)} here"
                           for k, (there, here) in differ.items())
        fix = " ".join(shlex.quote(f"++model.{k}={_as_override(there)}") for k, (there, _) in differ.items())
        raise CheckpointError(
            f"{label}{path}: its config.json describes another model than this run builds ({listed}). Built with "
            "other settings than they were trained with, the weights compute another function, even where every "
            f"shape fits. Give the model the directory's settings: {fix} (`++` sets a key whether or not the "
            f"model's config lists it){_other_names(type(config), differ)}.")


def _other_names(config_class, keys) -> str:
    """Where a setting has another name in the config class (GPT2Config's max_position_embeddings is n_positions):
    the advice's `++model.n_positions=64` was refused as a second value of a setting the run's config gives under
    the other name."""
    aliases = getattr(config_class, "attribute_map", {}) or {}
    named = [f"model.{alias} for model.{key}" for key in keys for alias, canonical in aliases.items() if canonical == key]
    return f"; where your model config names a setting otherwise, set that key instead ({', '.join(named)})" \
        if named else ""


def _as_override(value) -> str:
    """`value` as a Hydra override writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_as_override(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_as_override(v) for v in value) + "]"
    return str(value)


# -- matching keys -------------------------------------------------------------------------------------------
def expected_keys(model: nn.Module, skip: set[str]) -> dict[str, tuple[int, ...]]:
    """{key: whole shape} of the model's state_dict that weights must provide (the keys in `skip`, a LoRA adapter's,
    are the run's own)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in skip}


def _ignored(model: nn.Module, attr: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(model, attr, None) or [])]


FIX_MODEL = "They come from another architecture or size: set model=... (and its keys) to the model the weights were saved from."


def match(model: nn.Module, weights: Weights, skip: set[str] = frozenset(), label: str = "finetune.weights=",
          fix: str = FIX_MODEL) -> dict[str, str]:
    """{model key: file key} for every key of the model; a CheckpointError listing every missing and unexpected key
    and every shape that differs."""
    from trainer.parallel.materialize import tied_parameters

    want = expected_keys(model, skip)
    have = {k: e.shape for k, (_, e) in weights.entries.items()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [lambda k: k]
    if prefix:  # files of the base model (no prefix), or of a task model loaded into its base
        candidates += [lambda k: k.removeprefix(prefix + "."), lambda k: f"{prefix}.{k}"]
    tied = [g for g in tied_parameters(model) if all(n in want for n in g)]
    skip_missing, skip_unexpected = (_ignored(model, "_keys_to_ignore_on_load_missing"),
                                     _ignored(model, "_keys_to_ignore_on_load_unexpected"))
    best = None
    for rename in candidates:
        mapping = {k: rename(k) for k in want if rename(k) in have}
        for group in tied:  # one name of a tied weight is enough (Hugging Face saves one)
            present = next((mapping[n] for n in group if n in mapping), None)
            if present is not None:
                mapping.update({n: present for n in group if n not in mapping})
        missing = [k for k in want if k not in mapping and not any(p.search(k) for p in skip_missing)]
        used = set(mapping.values())
        unexpected = [k for k in have if k not in used and not any(p.search(k) for p in skip_unexpected)]
        shapes = [f"{k} {tuple(have[f])} in the file vs {want[k]} in the model" for k, f in mapping.items()
                  if tuple(have[f]) != want[k]]
        problems = (missing, unexpected, shapes)
        if best is None or sum(map(len, problems)) < sum(map(len, best[1])):
            best = (mapping, problems)
    mapping, (missing, unexpected, shapes) = best
    if missing or unexpected or shapes:
        def listed(keys: list[str], n: int = 6) -> str:
            return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")

        parts = ([f"missing from the files ({len(missing)}): {listed(missing)}"] if missing else []) + \
                ([f"not in the model ({len(unexpected)}): {listed(unexpected)}"] if unexpected else []) + \
                ([f"shapes that differ ({len(shapes)}): {listed(shapes, 4)}"] if shapes else [])
        raise CheckpointError(
            f"the weights of {label}{weights.path} do not fit the model ({type(model).__name__}): "
            f"{'; '.join(parts)}. {fix}")
    return mapping


# -- reading each rank's part ---------------------------------------------------------------------------------
def _box(target: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of the part of the whole tensor this rank holds."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        return compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(target.shape), (0,) * target.dim()


def read_part(reader: tensorfile.FileReader, entry: tensorfile.Entry, shape, offset) -> torch.Tensor:
    """The box `shape` at `offset` of a tensor in a file. A box of whole rows (dim 0 split: FSDP, colwise) is one
    byte range. A box narrower than the rows (a rowwise split) is cut from its rows read a block at a time, each
    block no larger than the box (or one row), so a rank never holds a whole tensor of a split layer."""
    if not entry.shape:
        return reader.tensor(entry)
    size = entry.dtype.itemsize
    row = math.prod(entry.shape[1:]) * size
    lo, n = offset[0], shape[0]
    if n == 0 or row == 0 or math.prod(shape) == 0:
        return torch.empty(shape, dtype=entry.dtype)

    def rows(first: int, count: int) -> torch.Tensor:
        start = entry.begin + (lo + first) * row
        return reader.read(start, start + count * row).view(entry.dtype).reshape(count, *entry.shape[1:])

    if tuple(shape[1:]) == tuple(entry.shape[1:]):
        return rows(0, n)
    cut = (slice(None), *(slice(o, o + s) for o, s in zip(offset[1:], shape[1:])))
    out = torch.empty(shape, dtype=entry.dtype)
    per = max(1, math.prod(shape) * size // row)  # rows per block: the box's bytes
    for first in range(0, n, per):
        count = min(per, n - first)
        out[first:first + count] = rows(first, count)[cut]
    return out


@torch.no_grad()
def load_into(model: nn.Module, weights: Weights, mapping: dict[str, str]) -> None:
    """Copy each rank's part of every mapped tensor into the model's own (cast to its dtype)."""
    from torch.distributed.tensor import DTensor

    for key, target in model.state_dict(keep_vars=True).items():
        if key not in mapping:
            continue
        path, entry = weights.entries[mapping[key]]
        shape, offset = _box(target)
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(read_part(weights.readers[path], entry, shape, offset).reshape(local.shape))
