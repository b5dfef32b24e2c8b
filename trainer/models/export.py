"""The weights a finished run leaves in its run dir, in the layout Hugging Face tools read.

`model.safetensors` (keys = the plain model's state_dict), or above `checkpoint.max_shard_mb` the shards
`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`; `model_config.json` beside them
(`hydra.utils.instantiate(json.load(...))` rebuilds the model); `task_state.safetensors` when the task
is stateful (a data normaliser: what sampling from the weights needs besides them). A model with LoRA adapters
(trainer/models/lora.py) is exported merged (W + scale B A, keyed as the plain model: what `trainer.load` and
`from_pretrained` read), with the adapter alone in peft's layout in `adapter/` (`adapter_model.safetensors`,
`adapter_config.json`: `PeftModel.from_pretrained(base, RUN_DIR/adapter)`). Not beside the merged weights: there
transformers' `from_pretrained(RUN_DIR)` would find the adapter's config and apply it again on top of the merge.
Every file is written atomically.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from trainer.io import atomic_save_safetensors, atomic_write_json, free_name

ADAPTER_DIR = "adapter"
ADAPTER_FILES = (f"{ADAPTER_DIR}/adapter_model.safetensors", f"{ADAPTER_DIR}/adapter_config.json")


def listed_name(name: object) -> bool:
    """Whether `name` may be a file of an export, as export.json lists them: a plain name in the run dir, or one in
    its adapter/ dir (never a path out of the run dir, a hidden file, or another dir)."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    return (len(parts) == 1 or (len(parts) == 2 and parts[0] == ADAPTER_DIR)) and \
        all(part and not part.startswith(".") and "\\" not in part for part in parts)


def export_model(tensors: dict[str, torch.Tensor], run_dir: Path, name: str, model_config: dict | None,
                 max_shard_mb: float, base: str | None = None) -> list[str]:
    """Write `tensors` (whole, on the CPU) as `<name>.safetensors` or as shards with an index, and `model_config`
    as model_config.json (None: no such file; rt.save_model does not know how the model was built). `base`: the
    weights a LoRA run's adapters were trained on (its adapter_config.json names them: peft would apply the adapter
    to any base without a word). Returns the names of the files written."""
    from trainer.models.lora import adapters_in, merge

    # What an earlier export of this name left (a single file, or shards and their index): removed once this one is
    # written, so that no reader (trainer.load, from_pretrained) prefers an older file to it.
    stale = _weight_files(run_dir, name)
    if name == "model":  # (and an adapter beside the weights, where exports before adapter/ put it: if theirs)
        stale |= {run_dir / f for f in ADAPTER_FILES} | {run_dir / n for n in listed_files(run_dir) or ()
                                                          if n in {Path(f).name for f in ADAPTER_FILES}}
    adapter_files = []
    if adapters_in(tensors):
        tensors, adapter, adapter_config = merge(tensors, base)
        if name == "model":
            (run_dir / ADAPTER_DIR).mkdir(exist_ok=True)
            atomic_save_safetensors(run_dir / ADAPTER_FILES[0], adapter, metadata={"format": "pt"})
            atomic_write_json(run_dir / ADAPTER_FILES[1], adapter_config)
            adapter_files = list(ADAPTER_FILES)
    limit = int(max_shard_mb * 2**20)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        atomic_save_safetensors(run_dir / f"{name}.safetensors", tensors, metadata={"format": "pt"})
        written = [f"{name}.safetensors"]
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"{name}-{i:05d}-of-{len(shards):05d}.safetensors"
            atomic_save_safetensors(run_dir / fname, shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        atomic_write_json(run_dir / f"{name}.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
        written = [*sorted(set(weight_map.values())), f"{name}.safetensors.index.json"]
    for old in stale - {run_dir / f for f in [*written, *adapter_files]}:
        old.unlink(missing_ok=True)
    if not adapter_files and (run_dir / ADAPTER_DIR).is_dir() and not any((run_dir / ADAPTER_DIR).iterdir()):
        (run_dir / ADAPTER_DIR).rmdir()
    if model_config is None:
        return [*written, *adapter_files]
    atomic_write_json(run_dir / "model_config.json", json.loads(json.dumps(model_config)))
    return [*written, "model_config.json", *adapter_files]


def write_hf_config(model, directory: Path) -> list[str]:
    """A Hugging Face model's config.json beside its weights, so that `from_pretrained(directory)` loads them:
    written by transformers' own `save_pretrained` (which validates the config) into a scratch dir, then renamed into
    place. [] for a model without such a config."""
    import os
    import tempfile

    config = getattr(model, "config", None)
    if not hasattr(config, "save_pretrained"):
        return []
    # The model's class, as transformers' own save_pretrained records it (vLLM and TGI pick the class by it): the
    # first of transformers' in the class's bases (FSDP's fully_shard gives the root a class of its own over it).
    cls = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)
    if cls is not None and getattr(config, "architectures", None) != [cls.__name__]:
        import copy

        config = copy.deepcopy(config)
        config.architectures = [cls.__name__]
    with tempfile.TemporaryDirectory(dir=directory, prefix=".config-") as tmp:
        config.save_pretrained(tmp)
        os.replace(Path(tmp) / "config.json", Path(directory) / "config.json")
    return ["config.json"]


def is_peft_model(model) -> bool:
    """A model peft wrapped (get_peft_model), told without importing peft: by its class's bases, since FSDP's
    fully_shard gives the root a class of its own (FSDPPeftModel, in torch's module) over peft's."""
    return hasattr(model, "peft_config") and any(c.__module__.split(".")[0] == "peft" for c in type(model).__mro__)


def write_peft_adapter(model, tensors: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """A peft model's adapter in peft's layout under `directory`/adapter/ (what `model.save_pretrained` writes:
    adapter_model.safetensors and adapter_config.json), taken from `tensors`, its full state. The base model's
    config.json is not written beside the whole state: its keys are peft's (`base_model.model.*.base_layer`), and
    `from_pretrained(directory)` would have loaded none of them, giving a randomly initialised model with no error."""
    import os
    import tempfile

    from peft import get_peft_model_state_dict

    written = []
    stale = directory / "config.json"  # (an earlier save's, of the base model: from_pretrained would read it)
    if stale.is_file():
        os.replace(stale, free_name(stale, ".prev"))
    (directory / ADAPTER_DIR).mkdir(exist_ok=True)
    for adapter, config in model.peft_config.items():
        where = Path(ADAPTER_DIR) if adapter == "default" else Path(ADAPTER_DIR) / adapter  # (as peft lays them out)
        (directory / where).mkdir(exist_ok=True)
        state = get_peft_model_state_dict(model, state_dict=tensors, adapter_name=adapter)
        atomic_save_safetensors(directory / where / "adapter_model.safetensors",
                                {k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"})
        with tempfile.TemporaryDirectory(dir=directory, prefix=".adapter-") as tmp:
            config.save_pretrained(tmp)
            os.replace(Path(tmp) / "adapter_config.json", directory / where / "adapter_config.json")
        written += [str(where / "adapter_model.safetensors"), str(where / "adapter_config.json")]
    return written


def listed_files(run_dir: Path) -> set[str] | None:
    """The files the run dir's export.json lists; None without a readable one (a directory of the user's own)."""
    try:
        files = json.loads((run_dir / "export.json").read_text())["files"]
        return {n for n in files if listed_name(n)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _weight_files(run_dir: Path, name: str) -> set[Path]:
    """Where an export of `name` puts its weights: the whole file, or the shards and their index."""
    return {*run_dir.glob(f"{name}-*-of-*.safetensors"), run_dir / f"{name}.safetensors",
            run_dir / f"{name}.safetensors.index.json"}


def remove_export(run_dir: Path, name: str) -> None:
    """An earlier export of `name` (whole or sharded), where this export has none: no reader may take it for this one."""
    for old in _weight_files(run_dir, name):
        old.unlink(missing_ok=True)


def file_digests(run_dir: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": digest}} of files in `run_dir`: what export.json says the export is."""
    import hashlib

    out = {}
    for name in names:
        h = hashlib.sha256()
        with open(run_dir / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        out[name] = {"bytes": (run_dir / name).stat().st_size, "sha256": h.hexdigest()}
    return out


def export_intact(run_dir: Path, files: dict) -> bool:
    """Every file export.json lists is there, a regular file of its size and sha256."""
    import os

    try:
        for name, want in files.items():
            path = run_dir / name
            if not listed_name(name) or not path.is_file() or os.path.islink(path) or \
                    ("/" in name and os.path.islink(path.parent)):  # (an adapter/ dir that is a link)
                return False
            if path.stat().st_size != want["bytes"]:
                return False
        return file_digests(run_dir, list(files)) == files
    except (OSError, TypeError, KeyError, AttributeError):
        return False


def export_task_state(state: dict, run_dir: Path) -> str:
    """A stateful task's `state_dict()` (tensors, by name) as `task_state.safetensors`."""
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"task.state_dict() must map names to tensors to be exported; {', '.join(bad)} are not.")
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    atomic_save_safetensors(run_dir / "task_state.safetensors", tensors, metadata={"format": "pt"})
    return "task_state.safetensors"


_EXPORTED = ("model.safetensors", "model_ema.safetensors", "model.safetensors.index.json",
             "model_ema.safetensors.index.json", "model_config.json", "task_state.safetensors",
             "adapter_model.safetensors", "adapter_config.json", *ADAPTER_FILES)


def set_aside(run_dir: Path) -> Path | None:
    """An earlier attempt's export moved into `export.prev/` (then `export.prev-2/`, ...), where a fresh start in the
    same run dir would overwrite it: export.json and the files it lists, and the files an export writes (those
    alone of an export cut short). Returns the directory, or None when there was nothing to move."""
    import os

    names = {n for n in _EXPORTED if (run_dir / n).is_file()}
    names |= {p.name for p in run_dir.glob("model*-of-*.safetensors")}
    listed = listed_files(run_dir)
    names |= {"export.json", *(listed or ())}  # (one that lists nothing readable is kept too: a damaged one, or yours)
    present = sorted(n for n in names if (run_dir / n).is_file() and not (run_dir / n).is_symlink()
                     and not ("/" in n and (run_dir / n).parent.is_symlink()))
    if not present:
        return None
    target = free_name(run_dir / "export", ".prev")
    target.mkdir()
    for name in present:
        (target / name).parent.mkdir(exist_ok=True)
        os.replace(run_dir / name, target / name)
    with contextlib.suppress(OSError):  # (an adapter/ dir now empty; one holding files of the user's own stays)
        (run_dir / ADAPTER_DIR).rmdir()
    return target


def check_against_record(readers: dict[Path, object]) -> None:
    """Each file (a tensorfile.FileReader) that its directory's export.json lists is the one the run wrote: its
    sha256 is the recorded one. Files export.json does not list, and directories without one (a Hugging Face
    model, a run from before the record), are not checked. Raises CheckpointError naming the file."""
    from trainer.checkpoint import tensorfile
    from trainer.errors import CheckpointError

    listed: dict[Path, str] = {}
    for path in readers:
        record = path.parent / "export.json"
        try:
            data = tensorfile.map_file(record, follow_links=False, max_size=16 << 20)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise CheckpointError(f"{record} cannot be read ({e.strerror or e}), so {path} cannot be checked against "
                                  f"it. {_REWRITE.format(run_dir=path.parent)}") from None
        # A damaged record is not the absence of one: the weights it lists would load unchecked.
        try:
            record_ = json.loads(data)
            if isinstance(record_, dict) and "files" not in record_:
                continue  # (a record from before the digests, {"step", "names"}: nothing to check against)
            entry = record_["files"].get(path.name)
            want = entry["sha256"] if entry is not None else None
            if not (want is None or isinstance(want, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise CheckpointError(f"{record} is damaged (not the record of its export the run wrote), so {path} "
                                  f"cannot be checked against it. {_REWRITE.format(run_dir=path.parent)}") from None
        if want is not None:
            listed[path] = want
    if not listed:
        return
    try:
        digests = tensorfile.sha256_all({str(p): readers[p] for p in listed})
    except OSError as e:  # shrank or failed while it was read
        raise CheckpointError(f"{e.strerror or e}; read the weights again once nothing writes to them.") from None
    for path, want in listed.items():
        if digests[str(path)] != want:
            raise CheckpointError(
                f"{path} is not the file its run wrote: its sha256 differs from the one {path.parent / 'export.json'} "
                f"records (damaged, or changed since). {_REWRITE.format(run_dir=path.parent)}")


_REWRITE = ("Rewrite the export: rerun the run's training command with hydra.run.dir={run_dir} resume=auto (it writes "
            "a damaged export again from the last checkpoint), or load one of its checkpoints.")
