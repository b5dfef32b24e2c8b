"""Using a finished run: its model with weights (`trainer.load`), its task (for sampling), its config with
new overrides (for `python -m trainer eval`), and the checkpoint an eval reads.

Everything here reads what a run wrote: `model_config.json` and the exported weights
(`model.safetensors`, `model_ema.safetensors`, or their sharded index), `task_state.safetensors`,
`config.yaml` and `checkpoints/`. The `_target_`s in them go through the same trust model as a config's.

A run dir may come from anywhere, so it is read as a checkpoint is (trainer/checkpoint/store.py): only regular
files are opened (a FIFO never blocks, a symbolic link is not followed), each no larger than such a file
can be, JSON is depth-limited, config.yaml has no YAML anchors or aliases (a "billion laughs"), weights
are checked against the model before they are loaded, and a checkpoint is one of the run's own. Each
damaged or hostile file is one paragraph naming it and what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.checkpoint import snapshot, store, tensorfile
from trainer.errors import CheckpointError, ConfigError, UserError

# config.yaml, model_config.json, best.json: a trainer writes about 2 KB. The limit keeps OmegaConf, which
# takes ~0.1 ms a node, to seconds on whatever a file holds.
MAX_CONFIG_BYTES = 64 << 10
MAX_INDEX_BYTES = 16 << 20  # a sharded index: ~100 KB for the largest models


def _run_dir(run_dir: str | Path, export_alone: bool = False) -> Path:
    """`run_dir` checked as a run's dir; `export_alone`: an export without its run will do (model_config.json and
    export.json: an earlier export a fresh start set aside as RUN/export.prev, which trainer.load reads)."""
    from trainer.checkpoint.store import run_of_checkpoint

    path = Path(run_dir).expanduser()
    run = run_of_checkpoint(path)
    if run is not None:
        raise ConfigError(f"{path} is a checkpoint of the run {run}, not a run dir. Pass the run dir: `python -m "
                          f"trainer eval {run} checkpoint={path}` evaluates this checkpoint, `trainer.load({path})` "
                          f"builds its model with its weights, `sample {run} checkpoint={path}` samples from it, and "
                          f"resume={path} continues training from it.")
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist. Pass the directory a run wrote, e.g. outputs/2026-01-01/12-00-00.")
    if export_alone and all(os.path.lexists(path / f) for f in ("model_config.json", "export.json")):
        return path
    if not os.path.lexists(path / "config.yaml"):
        raise ConfigError(f"{path} is not a run dir (it has no config.yaml). Pass the directory a run wrote, e.g. "
                          "outputs/2026-01-01/12-00-00.")
    return path


def _reexport(run: Path) -> str:
    return (f"Rewrite the export: rerun the run's training command (in its run_info.json) with hydra.run.dir={run} "
            "resume=auto: a finished run writes a missing or damaged export again from its last checkpoint.")


def _restore_config(run: Path) -> str:
    return (f"Restore it from one of the run's checkpoints ({run / 'checkpoints'}/step_*/config.yaml holds the "
            "same config), or pass the directory of a run that trainer wrote.")


@contextlib.contextmanager
def _reading(path: Path, fix: str):
    """A run dir's file read by the checkpoint reader's rules (a regular file, never waiting on a FIFO or
    following a symbolic link, no larger than such a file can be); what breaks them is one paragraph."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing. {fix}") from None
    except tensorfile.NotRegularFile as e:
        raise CheckpointError(f"{path} is {e.strerror}: only regular files of a run dir are read. {fix}") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e}). {fix}") from None
    except ValueError as e:  # too large, or "... is not a valid safetensors file: <why>"
        raise CheckpointError(f"{e}. {fix}") from None


def _read(path: Path, max_size: int, fix: str) -> bytes:
    with _reading(path, fix):
        return bytes(tensorfile.map_file(path, follow_links=False, max_size=max_size))


def _tensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """A safetensors file of the run dir, its header checked against its size before anything is read."""
    from trainer.models.export import check_against_record

    with _reading(path, fix):
        buf, _, entries = tensorfile.map_safetensors(path, follow_links=False)
        check_against_record({path: buf})
    return {name: tensorfile.load(buf, entry) for name, entry in entries.items()}


def _why(err: CheckpointError) -> str:
    """A checkpoint reader's message, without its ending (this is a run dir's file, not a checkpoint's)."""
    return str(err).removesuffix("; it is not a valid trainer checkpoint.").removesuffix(".")


def _json_object(path: Path, max_size: int, fix: str) -> dict:
    raw = _read(path, max_size, fix)
    try:
        tree = snapshot.parse_tree(raw, path)
    except CheckpointError as e:
        raise CheckpointError(f"{_why(e)}. {fix}") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path} is a JSON {type(tree).__name__}, not a JSON object. {fix}")
    return tree


def config_yaml(run_dir: str | Path) -> DictConfig:
    """The run's config.yaml, checked like a checkpoint's (no anchors or aliases, depth- and size-limited) and
    a mapping."""
    path = _run_dir(run_dir)
    return checked_config(path / "config.yaml", _restore_config(path))


def checked_config(source: Path, fix: str) -> DictConfig:
    """A config.yaml (a run's or a checkpoint's) read by the checkpoint reader's rules, as a config."""
    from trainer.checkpoint.store import _check_config

    raw = _read(source, MAX_CONFIG_BYTES, fix)
    try:
        _check_config(raw, source)
    except CheckpointError as e:
        raise ConfigError(f"{_why(e)}. {fix}") from None
    return _parsed_config(raw, source, fix)


def _parsed_config(raw: bytes, source: Path, fix: str) -> DictConfig:
    """A config.yaml's bytes (checked by the checkpoint reader's rules) as a config, upgraded to this version's
    module names."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.create(raw.decode())
    except UnicodeDecodeError:
        raise ConfigError(f"{source} is not UTF-8 text. {fix}") from None
    except yaml.MarkedYAMLError as e:  # what a scan alone does not see: a mapping left open
        where = f", line {e.problem_mark.line + 1} column {e.problem_mark.column + 1}" if e.problem_mark else ""
        raise ConfigError(f"{source} is not YAML ({e.problem or e.context}{where}). {fix}") from None
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(f"{source} is not a config ({_one_line(e)}). {fix}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{source} is a YAML {'list' if OmegaConf.is_list(cfg) else type(cfg).__name__}, not a "
                          f"mapping of config keys. {fix}")
    from trainer.checkpoint.settings import upgrade

    return OmegaConf.create(upgrade(OmegaConf.to_container(cfg)))  # a run dir from before trainer's modules moved


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # (a KeyError's str() is a repr)
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def redacted_keys(node: Any, prefix: str = "") -> list[str]:
    """The keys (dotted) of `node` whose recorded value is, or holds, the redaction mark: a secret the run never
    wrote down, so nothing read back from its files can rebuild what used it."""
    from trainer.redaction import REDACTED

    if isinstance(node, dict):
        return [k for key, v in node.items() for k in redacted_keys(v, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in redacted_keys(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if isinstance(node, str) and REDACTED in node else []


def refuse_redacted(node: Any, where: str, source: Path, how: str) -> None:
    """A ConfigError naming the keys of `node` (the `where` section of `source`) that hold a redacted secret,
    before anything is built with `<redacted>` in their place; `how` says how to give the value again."""
    from trainer.redaction import REDACTED

    keys = redacted_keys(node, f"{where}." if where else "")
    if keys:
        raise ConfigError(f"{source} records {', '.join(keys[:4])}{' and more' if len(keys) > 4 else ''} as "
                          f"{REDACTED}: the run never writes a secret down, so it cannot be rebuilt from the run dir "
                          f"alone. {how}")


def _instantiate_checked(node: dict, where: str, source: Path, fix: str) -> Any:
    """`node` built by Hydra once every `_target_` in it passed the trust model; a failure is one paragraph
    naming `source` (the file it came from). A secret the file holds redacted is refused, not passed on."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from trainer.config.targets import iter_targets, locate

    refuse_redacted(node, where, source, "Give the class its secret another way (an environment variable it reads "
                    "itself), or build the model yourself and load the run's weights into it "
                    f"(safetensors.torch.load_file({source.parent / 'model.safetensors'}))."
                    if where == "model" else "Pass it again (task.KEY=VALUE).")
    try:
        cfg = OmegaConf.create(node)
        for key, target in iter_targets(cfg, where):
            locate(key, target)  # the trust model: a run dir may come from elsewhere too
        return instantiate(cfg)
    except UserError:
        raise
    except Exception as e:  # whatever the class's constructor raises for what the file holds
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ else e
        if isinstance(cause, UserError):
            raise cause from None
        raise ConfigError(f"the {where} of {source} cannot be built ({type(cause).__name__}: {_one_line(cause)}). "
                          f"{fix}") from e


def in_stored_dtype(model: nn.Module, stored: dict[str, torch.dtype]) -> nn.Module:
    """`model` cast to the one floating dtype its stored weights share (`stored`: a state_dict key's dtype in the
    files), where its own tensors share another: a run trained with finetune.dtype=bf16 exports bf16 weights, which
    an fp32 model would compute with in fp32, and `from_pretrained` and an eval of the run in bf16. Mixed dtypes on
    either side are left as they are (load_state_dict casts each tensor)."""
    state = model.state_dict()
    live = {t.dtype for t in state.values() if t.is_floating_point()}
    kept = {dtype for key, dtype in stored.items() if dtype.is_floating_point and key in state}
    if len(live) == 1 and len(kept) == 1 and live != kept:
        model.to(next(iter(kept)))
    return model


def _mismatches(live: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], name: str) -> list[str]:
    problems = [f"{k}: missing from {name}" for k in live if k not in stored]
    problems += [f"{k}: {name} {tuple(stored[k].shape)} vs model {tuple(v.shape)}" for k, v in live.items()
                 if k in stored and stored[k].shape != v.shape]
    return problems + [f"{k}: not in the model" for k in stored if k not in live]


def exported_weights(run_dir: Path, name: str = "model") -> dict[str, torch.Tensor]:
    """`<name>.safetensors`, or the shards its Hugging Face index lists."""
    run_dir = Path(run_dir)
    single, index = run_dir / f"{name}.safetensors", run_dir / f"{name}.safetensors.index.json"
    fix = _reexport(run_dir)
    if os.path.lexists(single):
        return _tensors(single, fix)
    if os.path.lexists(index):
        weight_map = _json_object(index, MAX_INDEX_BYTES, fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' is not a map of tensor names to shard file names. {fix}")
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or shard.startswith(".") or not shard.endswith(".safetensors"):
                raise CheckpointError(f"{index} names {snapshot.shown(shard)}, not a .safetensors file beside it: only "
                                      f"files inside the run dir are read. {fix}")
            out.update(_tensors(run_dir / shard, fix))
        return out
    raise CheckpointError(f"{run_dir} has no {name}.safetensors: the run did not finish its export. Resume it with "
                          f"resume=auto (a finished run writes a missing export), or evaluate a checkpoint.")


def has_ema(run_dir: str | Path) -> bool:
    """Whether the run's export has EMA weights: export.json's names, or for a run without one, the files."""
    run = Path(run_dir)
    try:
        names = json.loads(_read(run / "export.json", MAX_CONFIG_BYTES, ""))["names"]
        if isinstance(names, list):
            return "model_ema" in names
    except (CheckpointError, ValueError, KeyError, TypeError):
        pass
    return any(os.path.lexists(run / f) for f in ("model_ema.safetensors", "model_ema.safetensors.index.json"))


def model_of(path: Path) -> nn.Module:
    """The model `path/model_config.json` builds (its `_target_` through the trust model), without weights."""
    source, fix = path / "model_config.json", _reexport(path)
    # A run's export is complete once export.json, written last, records it: a run dir without one has no export yet,
    # even where the weights' files landed (a run killed half-way through writing it was loaded, its EMA said to be
    # off). A directory of the user's own (no run_info.json, no checkpoints/) has files and no record.
    run_made = (path / "run_info.json").is_file() or (path / "checkpoints").is_dir()
    if not os.path.lexists(path / "export.json") and (run_made or not os.path.lexists(source)):
        # (not a damaged export, which the advice below is for: none was written yet)
        from trainer.checkpoint.store import Checkpointer

        done = Checkpointer(path / "checkpoints").complete() if (path / "checkpoints").is_dir() else []
        where = f"; its newest checkpoint is {done[-1]}" if done else ""
        cut = " (its files without export.json, the record written last, are an export cut off)" if \
            os.path.lexists(source) else ""
        raise CheckpointError(f"{path} has no export yet{cut}: a run writes its final weights when it finishes, and this "
                              f"one stopped before that (or is still running){where}. Evaluate a checkpoint with "
                              f"python -m trainer eval {path}, or continue the run with its command and resume=auto "
                              "(the run's run_info.json holds it).")
    _say_if_the_export_is_older(path)
    node = _json_object(source, MAX_CONFIG_BYTES, fix)
    if node.get("_partial_"):
        raise CheckpointError(f"{source} has _partial_: {snapshot.shown(node['_partial_'])}, so it builds a function "
                              f"that makes a model, not the model. {fix}")
    model = _instantiate_checked(node, "model", source, fix)
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"{source} builds a {type(model).__module__}.{type(model).__qualname__}, not a "
                              f"torch.nn.Module. {fix}")
    return model


def _say_if_the_export_is_older(path: Path) -> None:
    """A note (stderr) when the run's export is of an earlier step than its newest checkpoint: a finished run extended
    (a larger trainer.max_steps) and stopped before it finished again. Its export is still the earlier finish's
    weights, which load and sample read, while `eval RUN` evaluates the newer checkpoint."""
    from trainer.checkpoint.store import Checkpointer, step_of

    try:
        exported = json.loads(_read(path / "export.json", MAX_CONFIG_BYTES, ""))["step"]
    except (CheckpointError, ValueError, KeyError, TypeError):
        return
    done = Checkpointer(path / "checkpoints").complete() if (path / "checkpoints").is_dir() else []
    newest = max((step_of(p) for p in done), default=-1)
    if isinstance(exported, int) and newest > exported:
        print(f"note: {path}'s export is of step {exported}, and the run has a checkpoint of step {newest} since: it "
              "was continued and has not finished again. These are the export's weights (step "
              f"{exported}); `python -m trainer eval {path}` evaluates the newest checkpoint, and the run's command "
              "with resume=auto finishes it and exports again.", file=sys.stderr, flush=True)


def load(run_dir: str | Path, ema: bool = False, device: str | torch.device = "cpu", *,
         checkpoint: str | Path | None = None, device_map: str | dict | None = None, max_memory: dict | None = None,
         offload_dir: str | Path | None = None) -> nn.Module:
    """The model of a finished run, built from its `model_config.json`, with its final weights (the EMA's with
    `ema=True`), in eval mode. `model = trainer.load("outputs/2026-01-01/12-00-00")`.

    `checkpoint` ("latest", "best", a checkpoint's name, step_00000400, or its path) takes that checkpoint's weights
    instead, from a run finished or not (Lightning's load_from_checkpoint): `trainer.load(RUN_DIR,
    checkpoint="best")`. A checkpoint's own path (RUN_DIR/checkpoints/step_N) may be passed as `run_dir`.

    With `device_map` ("auto", "balanced", "sequential" or {module: device}), `max_memory` ({"cpu": "2GB", 0:
    "10GiB", "disk": ...}) or `offload_dir`, the model is placed block by block on the GPUs, the CPU and disk
    and never held whole (trainer/inference/device_map.py); `max_memory` or `offload_dir` alone mean
    device_map="auto". `run_dir` may also be a Hugging Face model directory (config.json and safetensors weights)."""
    from trainer.checkpoint.store import MANIFEST, step_of
    from trainer.parallel.backend import usable_device

    if not isinstance(ema, bool):  # (ema="false" loaded the EMA's weights: a string is true)
        raise ConfigError(f"trainer.load(ema={ema!r}): expected True (the EMA's weights) or False (the raw ones).")
    device = usable_device(device, named="trainer.load(device={!r})")  # (before anything is read: no CUDA here, ...)
    for name, value in (("run_dir", run_dir), ("offload_dir", offload_dir)):  # (None, 5: a bare TypeError)
        if (value is not None or name == "run_dir") and (not isinstance(value, str | os.PathLike) or not str(value)):
            raise ConfigError(f"trainer.load({name}={value!r}): expected a path (a str or a pathlib.Path)"
                              + (": a run dir, a checkpoint of one, or a Hugging Face model directory." if name ==
                                 "run_dir" else ", where the weights that do not fit go."))
    given = Path(run_dir).expanduser()
    # A checkpoint's own dir: a run dir has no manifest; a run's step_N without one is a save that was cut off,
    # which the reader names as such.
    own = checkpoint is None and (os.path.lexists(given / MANIFEST) or (step_of(given) >= 0 and given.parent.name ==
                                                                         "checkpoints"))
    if own or checkpoint is not None:
        if device_map is not None or max_memory is not None or offload_dir is not None:
            raise ConfigError("trainer.load reads a checkpoint whole; device_map, max_memory and offload_dir place a "
                              "run's export (its final weights). Leave out one or the other.")
        if not (own or isinstance(checkpoint, (str, os.PathLike))):
            raise ConfigError(f"trainer.load(checkpoint={checkpoint!r}): expected 'latest', 'best' or the path of a "
                              "step_* checkpoint directory.")
        path = given if own else checkpoint_of(run_dir, os.fspath(checkpoint))
        try:
            return checkpoint_model(path, ema).to(device).eval()
        except CheckpointError as e:  # (the checkpoint's: a setting's error names no other checkpoint)
            if own or os.fspath(checkpoint) != "latest" or not path.exists():
                raise
            raise type(e)(f"{e}{older_checkpoints(path)}") from None
    if device_map is not None or max_memory is not None or offload_dir is not None:
        from trainer.inference.device_map import load as load_dispatched

        return load_dispatched(run_dir, device_map="auto" if device_map is None else device_map,
                               max_memory=max_memory, offload_dir=offload_dir, ema=ema)
    given = Path(run_dir).expanduser()
    if not (given / "config.yaml").exists() and (given / "config.json").is_file():
        # A Hugging Face model directory (save_pretrained's, or rt.save_model's): the device-map loader reads those;
        # everything on `device` is the whole model there, as from_pretrained would give it.
        from trainer.inference.device_map import load as load_dispatched

        return load_dispatched(given, device_map={"": str(torch.device(device))}, max_memory=None, offload_dir=None,
                               ema=ema)
    path = _run_dir(run_dir, export_alone=True)
    source, fix = path / "model_config.json", _reexport(path)
    model = model_of(path)
    if ema and not has_ema(path):
        raise ConfigError(f"{path} has no EMA weights in its final export (ema.enabled was off when it finished); "
                          "load it with ema=False (sample: ema=false).")
    name = "model_ema" if ema else "model"
    weights = exported_weights(path, name)
    in_stored_dtype(model, {k: v.dtype for k, v in weights.items()})
    problems = _mismatches(model.state_dict(), weights, f"{name}.safetensors")
    # (a model of one's own is built by its code as it is now: a changed class was called a damaged export)
    code = (f"the code of {type(model).__module__}.{type(model).__qualname__}, which builds it, changed since the run "
            "(put back the code it trained with: its run_info.json records the git commit), or ")
    if problems:
        raise CheckpointError(f"the weights of {path} ({name}.safetensors) do not fit the model {source} builds: "
                              f"{store.listed(problems)}. Either {code}the two files do not come from the same run or "
                              f"one was edited. {fix}")
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(f"the weights of {path} ({name}.safetensors) do not fit the model {source} builds "
                              f"({_one_line(e)}). Either {code}the files were damaged. {fix}") from None
    return model.to(device).eval()


def checkpoint_model(path: Path, ema: bool | None = False, task: Any = None) -> nn.Module:
    """The model the checkpoint's config.yaml builds, with the checkpoint's weights (its EMA's with `ema`; None: its
    EMA's where it has them), whatever the strategy and world size that wrote it: every file's sha256 is verified
    and every tensor checked against the model before anything is loaded. `task`: a stateful task (a data
    normaliser) that takes the checkpoint's state of it too (`sample RUN checkpoint=...`)."""
    where, source = f"checkpoint {path}", path / "config.yaml"
    fix = f"Load another checkpoint of the run ({path.parent}), or the run's export (trainer.load(RUN_DIR))."
    if not path.is_dir():  # (the reader's own message would speak of resume=, which trainer.load does not take)
        raise ConfigError(f"{path} is not a directory. Pass a run dir, or the path of one of its step_* checkpoints "
                          "(RUN_DIR/checkpoints/step_N).")
    loaded = store.read(path)  # (config.yaml among the files it verifies and checks)
    cfg = _parsed_config(bytes(loaded.buffers["config.yaml"]), source, fix)
    node = cfg.get("model")
    if not isinstance(node, DictConfig):  # (rt.save_state's: a loop of one's own records no config of its model)
        raise ConfigError(f"{source} has no model section to build the model from: a checkpoint of a loop of one's own "
                          "(rt.save_state) records none. Build the model as the script does and load the checkpoint "
                          "with rt.load_state, or read its weights with safetensors.torch.load_file (model.safetensors "
                          "of a one-process run).")

    def build() -> nn.Module:
        model = _instantiate_checked(OmegaConf.to_container(node, resolve=True), "model", source, fix)
        if not isinstance(model, nn.Module):
            raise CheckpointError(f"{source} builds a {type(model).__module__}.{type(model).__qualname__}, not a "
                                  f"torch.nn.Module. {fix}")
        return model

    lora = OmegaConf.select(cfg, "finetune.lora.rank", default=None)
    if lora:
        from trainer.checkpoint.store import run_of_checkpoint

        run = run_of_checkpoint(path)
        if run is not None:
            anchor_weights(cfg, run)
    model = _lora_base(build, cfg, loaded, where) if lora else build()
    from trainer.models.finetune import after_load, frozen_keys

    frozen = frozen_keys(model)  # (a LoRA run's base, rebuilt above: its checkpoints leave it out)
    live = {k: v for k, v in in_stored_dtype(model, {k: chunks[0].data.dtype for k, chunks in loaded.model.items()
                                                     if chunks}).state_dict().items() if k not in frozen}
    problems = store.model_mismatches(loaded, live)
    if problems:
        raise CheckpointError(f"{where} does not fit the model its config.yaml builds: {store.listed(problems)}. The two "
                              f"were edited apart. {fix}")
    model.load_state_dict({k: snapshot.assemble(k, loaded.model[k], v, where) for k, v in live.items()},
                          strict=not frozen)
    after_load(model)  # (a LoRA adapter's scale: its config's, as the run's export merged it)
    saved = loaded.tree.get("ema")
    if ema is None:
        ema = isinstance(saved, dict) and isinstance(saved.get("shadow"), dict) and bool(saved["shadow"])
    if task is not None and hasattr(task, "load_state_dict") and isinstance(loaded.tree.get("task"), dict):
        try:
            # (as stored, as the export's task_state.safetensors is read: an unfit task has no state_dict to follow)
            task.load_state_dict(snapshot.conform(loaded.tree["task"], {}, loaded.state, f"{where} (task)"))
        except UserError:
            raise
        except Exception as e:  # the task's own check of what it is given
            raise CheckpointError(f"{where}: its task state does not fit the task ({type(task).__name__}: "
                                  f"{_one_line(e)}). {fix}") from e
    if ema:
        if not (isinstance(saved, dict) and isinstance(saved.get("shadow"), dict) and saved["shadow"]):
            raise ConfigError(f"{path} has no EMA weights (ema.enabled was off when it was saved); load it with "
                              "ema=False (sample: ema=false).")
        params = dict(model.named_parameters())
        strangers = [k for k in saved["shadow"] if k not in params]
        if strangers:
            raise CheckpointError(f"{where}: its EMA averages {store.listed(strangers)}, which the model its config.yaml "
                                  f"builds does not have. {fix}")
        like = {k: torch.empty(params[k].shape, dtype=torch.float32) for k in saved["shadow"]}
        with torch.no_grad():  # (EMA keeps fp32 averages: cast to each parameter's dtype as the export does)
            for k, average in snapshot.conform(saved["shadow"], like, loaded.state, f"{where} (ema)").items():
                params[k].copy_(average)
    return _merged(model, build, cfg) if lora else model


def _lora_base(build, cfg: DictConfig, loaded, where: str) -> nn.Module:
    """A LoRA run's model with its frozen base as the run built it (its checkpoints leave the base out): from
    finetune.weights, checked by sha256 against the files the run started from, or drawn from trainer.seed as one
    process draws it (the caller's random generators are left as they were by that draw)."""
    from trainer.checkpoint.rng import kept
    from trainer.models import finetune
    from trainer.parallel import seed_everything
    from trainer.parallel.materialize import built_whole

    seed = OmegaConf.select(cfg, "trainer.seed", default=0)
    node = OmegaConf.to_container(cfg.finetune, resolve=True)
    with kept():
        model = built_whole(finetune.factory(build, node), seed, seed_everything)
        record = finetune.start(model, node, seed, is_main=True)
    saved = loaded.tree.get("finetune")
    if record is not None and isinstance(saved, dict) and isinstance(saved.get("sha256"), dict):
        finetune.Source(record).check_state(saved, where)
    return model


def _merged(model: nn.Module, build, cfg: DictConfig) -> nn.Module:
    """A LoRA model as the run's export has it: the plain model, each adapter merged into its layer's weight."""
    from trainer.models import finetune
    from trainer.models.lora import merge

    merged, _, _ = merge({k: v.detach() for k, v in model.state_dict().items()})
    dtype = finetune.settings(cfg.finetune).dtype
    plain = build() if dtype is None else build().to(finetune.DTYPES[dtype])
    plain.load_state_dict(merged)
    return plain


def load_task(run_dir: str | Path, overrides: dict[str, Any] | None = None, cfg: DictConfig | None = None) -> Any:
    """The run's task, built from its config.yaml (or `cfg`, an eval's config of the run: config_of) with
    `overrides` of its keys (`{"sample_tokens": 200}`), with its exported state (a data normaliser) if it has one."""
    path = _run_dir(run_dir)
    source = path / "config.yaml"
    task_node = OmegaConf.to_container(config_yaml(path), resolve=False).get("task") if cfg is None else \
        (OmegaConf.to_container(cfg.task, resolve=True) if isinstance(cfg.get("task"), DictConfig) else None)
    if not isinstance(task_node, dict) or "_target_" not in task_node:
        raise ConfigError(f"{source} has no task with a _target_. {_restore_config(path)}")
    if overrides:
        from trainer.config.targets import check_keywords, check_scalar_types, locate

        target = locate("task._target_", task_node["_target_"])
        check_keywords("task", target, overrides)  # a typo is named
        check_scalar_types("task", target, overrides)  # (task.num_samples=abc reached the sampling loop)
        task_node.update(overrides)
    task = _instantiate_checked(task_node, "task", source, "Check the values of its keys (and of the task.KEY=VALUE "
                                "you passed) against the task's class.")
    from trainer.models.export import listed_files

    state_file, fix = path / "task_state.safetensors", _reexport(path)
    if hasattr(task, "load_state_dict") and not os.path.lexists(state_file) and \
            state_file.name in (listed_files(path) or ()):
        # (the task's state, a data normaliser, is part of the export: without it the task refused to work, as a
        # RuntimeError from inside its sampling)
        raise CheckpointError(f"{state_file} is missing, and the run's export lists it (its task's state, e.g. a data "
                              f"normaliser, which sampling and eval need). {fix}")
    if hasattr(task, "load_state_dict") and os.path.lexists(state_file):
        try:
            task.load_state_dict(_tensors(state_file, fix))
        except UserError:
            raise
        except Exception as e:  # the task's own check of what it is given
            raise CheckpointError(f"{state_file} does not fit the task ({type(task).__name__}: {_one_line(e)}). "
                                  f"{fix}") from e
    return task


@torch.no_grad()
def evaluate_dispatched(run_dir: str | Path, cfg: DictConfig, task_keys: dict[str, Any], placement: dict[str, Any],
                        show_map: bool = False, data_given: bool = False) -> dict[str, float]:
    """`python -m trainer eval RUN_DIR device_map=...`: the val metrics of the run's exported weights (and its EMA's)
    on one process, the model placed by `placement` (trainer.load's keywords), in the weights' dtype. The same sums
    as the Trainer's eval on one rank: the loss over targets, the task's extra sums and eval_metrics, and its
    whole-set score when it predicts."""
    import json

    from trainer import noise
    from trainer.checkpoint import rng
    from trainer.config.compose import prepare
    from trainer.config.instantiate import build_data
    from trainer.data.sampling import eval_batches
    from trainer.loop.trainer import EVAL_STREAM
    from trainer.parallel import seed_everything
    from trainer.task import EvalSums

    path = _run_dir(run_dir)
    cfg = prepare(cfg)
    if not data_given:
        refuse_relative_data_elsewhere(path, cfg)
    with rng.kept():
        seed_everything(cfg.trainer.seed)  # (as training builds its data: a dataset drawn with torch.randn was another
        train, val = build_data(cfg.data)  # at every call, and so were the metrics)
    if not data_given:  # (the run's own data settings must read the run's data, as eval without device_map checks)
        own = getattr(train, "fingerprint", None)
        newest = store.newest_complete(path)
        if newest is not None and isinstance(own, str):
            refuse_other_data(_state_of(newest).get("trainer", {}).get("data_identity"), own, newest)
    task = load_task(path, task_keys, cfg)  # (checked against the data this eval reads: its data.seq_len)
    metrics: dict[str, float] = {}
    for prefix, ema in (("val", False), ("val_ema", True)):
        if ema and not has_ema(path):
            continue
        model = load(path, ema=ema, **placement)
        device = model.device_map.main_device
        if show_map:
            print(f"{prefix}:\n{model.device_map}", file=sys.stderr)
        batch_size = cfg.trainer.eval_batch_size or cfg.data.batch_size
        acc = EvalSums(task, device)  # the Trainer's eval sums, on one process
        for batch, _, indices in eval_batches(val, batch_size, 0, 1, cfg.trainer.eval_samples, device):
            with noise.for_samples(EVAL_STREAM + torch.tensor(indices), cfg.trainer.seed):
                acc.add(batch, indices, acc.forward(model, batch))
        loss_sum, count = acc.totals.tolist()
        if count == 0:
            continue
        scored = task.score({n: torch.cat(r) for n, r in acc.rows.items()}) if acc.rows else {}
        metrics.update(acc.metrics(loss_sum, count, {n: float(v) for n, v in acc.sums.items()},
                                   {k: float(v) for k, v in scored.items()}, prefix))
        del model
    print(json.dumps({"run_dir": str(path), "weights": "export", **metrics}), flush=True)
    return metrics


# -- python -m trainer eval RUN_DIR ------------------------------------------------------------------------
def config_of(run_dir: str | Path, overrides: list[str]) -> DictConfig:
    """The run's config.yaml with `overrides` applied: `key=value`, or `group=option` for a group whose options
    live in the package's conf/ (world=ddp, precision=bf16, ...). Loggers are off (an eval logs nothing)."""
    from dataclasses import asdict
    from importlib.resources import files

    from omegaconf.errors import OmegaConfBaseException

    from trainer.config.compose import did_you_mean, yaml_value
    from trainer.config.schema import LaunchConfig, hf_size_twin
    from trainer.errors import suggest

    path = _run_dir(run_dir)
    cfg = config_yaml(path)
    anchor_weights(cfg, path)  # (before the overrides: a finetune.weights given here wins)
    conf = files("trainer.conf")
    _relink_task(cfg, conf)
    OmegaConf.set_struct(cfg, True)  # a key that is not there is a typo, not a new key
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise ConfigError(f"{override!r} is not an override: write KEY=VALUE (e.g. world=ddp, trainer.eval_samples=null).")
        option = conf / key / f"{value}.yaml"
        if "." not in key and option.is_file():
            node = OmegaConf.create(yaml.safe_load(option.read_text()) or {})
            if "defaults" in node:
                raise ConfigError(f"{key}={value} selects a config with its own defaults; set its keys one by one.")
            with open_dict(cfg):  # (world's launch keys default as in a fresh config)
                cfg[key] = OmegaConf.merge(asdict(LaunchConfig()), node) if key == "world" else node
            continue
        if "." not in key and (conf / key).is_dir():  # a group, and no such option
            options = sorted(p.name[:-5] for p in (conf / key).iterdir() if p.name.endswith(".yaml"))
            raise ConfigError(f"the override {override}: {value!r} is not an option of config group '{key}'. "
                              f"Available: {', '.join(options)}.{suggest(value, options)}")
        try:
            OmegaConf.update(cfg, key, yaml_value(override))
            if key.startswith("model.") and (twin := hf_size_twin(cfg.model, key[len("model."):])):
                OmegaConf.update(cfg, f"model.{twin}", yaml_value(override))
        except OmegaConfBaseException:
            # The mistake is the override's, not the run's: name it, and the key it probably means.
            raise ConfigError(f"the override {override} names no key of this run's config ({path / 'config.yaml'}, "
                              f"what it trained with).{did_you_mean(key, value, cfg)} An eval changes keys the run "
                              "has; `python -m trainer --cfg job` lists them.") from None
    with open_dict(cfg):
        cfg.logger = {}
    refuse_redacted(OmegaConf.to_container(cfg, resolve=False), "", path / "config.yaml",
                    "Pass each again on the command line (KEY=VALUE after the run dir), e.g. from an environment "
                    "variable: KEY=\"$MY_TOKEN\".")
    return cfg


def _relink_task(cfg: DictConfig, conf) -> None:
    """The task keys its recipe takes from other settings (lm: `seq_len: ${oc.select:model.seq_len,null}`, checked
    against the data's at start), as references again: config.yaml holds them resolved, so an eval's data.seq_len=64
    kept the run's 32 there, passed the check, and crashed in the model's forward with a traceback. (A recipe of the
    package's, found by its task's _target_; `task.KEY=...` given on the command line still wins.)"""
    target = OmegaConf.select(cfg, "task._target_", default=None)
    if not isinstance(target, str):
        return
    for recipe in (conf / "recipe").iterdir():
        try:
            task = (yaml.safe_load(recipe.read_text()) or {}).get("task") if recipe.name.endswith(".yaml") else None
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(task, dict) and task.get("_target_") == target:
            for key, value in task.items():
                if isinstance(value, str) and value.startswith("${") and key in cfg.task:
                    cfg.task[key] = value
            return


def refuse_other_data(saved: str | None, now: str | None, checkpoint) -> None:
    """`check_eval_data`'s refusal: the training set's fingerprint `now` is not the one `checkpoint` recorded."""
    if not (isinstance(saved, str) and now is not None and saved != now):
        return
    raise CheckpointError(
        f"eval: the data read with the run's own data settings is not what {checkpoint} was trained on (its training "
        f"set's fingerprint {now[:16]} vs {saved[:16]}): a relative data path is read from the current directory "
        f"({Path.cwd()}), not the one the run trained in, or the file changed since. Pass the run's data by absolute "
        "path (data.path=/ABSOLUTE/PATH, and the like), or run the eval from the directory the run trained in; any "
        "data=/data.* override of yours evaluates what it names (a changed file at the same path: data.path=PATH).")


def _state_of(checkpoint: Path) -> dict:
    """A checkpoint's state.json (its trainer's counters and data record), or {} where it cannot be read."""
    try:
        state = json.loads((checkpoint / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def anchor_weights(cfg: DictConfig, run_dir: str | Path) -> None:
    """A relative finetune.weights (a LoRA run's base, which its checkpoints leave out) made absolute where the run
    read it (run_info.json's cwd), so that eval, sample and trainer.load of its checkpoints work from any directory:
    from another, "finetune.weights=../base does not exist. Give a .safetensors file", a path the user never typed."""
    import json

    weights = OmegaConf.select(cfg, "finetune.weights", default=None)
    if not isinstance(weights, str) or not weights or os.path.isabs(os.path.expanduser(weights)):
        return
    try:
        trained_in = json.loads((Path(run_dir) / "run_info.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(trained_in, str) and (Path(trained_in) / weights).exists():
        with open_dict(cfg):
            cfg.finetune.weights = str(Path(trained_in) / weights)


def refuse_relative_data_elsewhere(run_dir: str | Path, cfg: DictConfig) -> None:
    """An eval of the run's own data settings started in another directory than the run: a relative path among
    them (data.path=corpus.txt, data.val_path=...) would be read from here, another file or none. Refused, naming
    the file the run read (its run_info.json records where it ran)."""
    import glob
    import json

    from trainer.checkpoint.settings import flat

    try:
        trained_in = json.loads((Path(run_dir) / "run_info.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(trained_in, str) or Path(trained_in).resolve() == Path.cwd().resolve():
        return
    found = []  # (every one: the advice followed for the first alone read the others from here, unchecked)
    for key, value in flat(OmegaConf.to_container(cfg.get("data") or {}, resolve=True)).items():
        if not isinstance(value, str) or not value or os.path.isabs(value) or "://" in value:
            continue
        there = Path(trained_in) / value
        if there.exists() or (any(c in value for c in "*?[") and glob.glob(str(there))):
            found.append((key, value, there))
    if found:
        given = " and ".join(f"data.{key}={value}" for key, value, _ in found)
        read = ", ".join(str(there) for _, _, there in found)
        raise ConfigError(f"{given} {'is a relative path' if len(found) == 1 else 'are relative paths'}: the run read "
                          f"{read}, and this eval, started in {Path.cwd()}, would read them from here instead. Pass "
                          f"{' '.join(f'data.{key}={there}' for key, _, there in found)}, or run the eval from "
                          f"{trained_in}.")


def older_checkpoints(refused: Path) -> str:
    """The run's other complete checkpoints, for a read of `latest` that could not use it (`eval`, trainer.load;
    resume=auto falls back to them by itself, a reader reads what it is told, so it names them)."""
    from trainer.checkpoint.store import Checkpointer

    others = [p for p in Checkpointer(refused.parent).complete() if p != refused]
    if not others:
        return ""
    return (f" The run's other complete checkpoints: {', '.join(p.name for p in others[-3:])}; pass one as "
            f"checkpoint={others[-1]}.")


def checkpoint_of(run_dir: str | Path, which: str = "latest") -> Path:
    """`latest` (the most recently written complete checkpoint: the final one for a finished run), `best`
    (what checkpoints/best.json names), or a checkpoint's path. `latest` and `best` are the run's own
    checkpoints: a `step_*` name inside its checkpoints/, never a symbolic link to one elsewhere."""
    from trainer.checkpoint.store import Checkpointer, step_of

    path = _run_dir(run_dir)
    checkpoints = path / "checkpoints"
    if which == "latest":
        links = sorted(p for p in checkpoints.iterdir() if step_of(p) >= 0 and p.is_symlink()) \
            if checkpoints.is_dir() else []
        for link in links:
            print(f"note: {link} is a symbolic link (to {os.readlink(link)}), not a checkpoint this run wrote: "
                  "skipped (pass checkpoint=PATH to evaluate the checkpoint it points to).", file=sys.stderr)
        found = [p for p in Checkpointer(checkpoints).complete() if not p.is_symlink()]
        if not found:
            export = (f" Its final export is there: `python -m trainer eval {path} device_map=auto` evaluates it "
                      "(checkpoint.save_final=false keeps no checkpoint)." if (path / "export.json").is_file() else "")
            raise CheckpointError(f"{path} has no complete checkpoint (checkpoints/step_*/manifest.json) to "
                                  f"evaluate.{export}")
        # A later step without a readable manifest (a save cut off, a copy made half-way) is passed over, as
        # resume=auto passes over it; said, so that a number is never read as the later step's.
        passed = sorted((p for p in checkpoints.iterdir() if step_of(p) > step_of(found[-1]) and not p.is_symlink()
                         and p not in found), key=step_of)
        if passed:  # (one complete now was completed after the listing, by a run still saving: not damaged)
            passed = [p for p in passed if p not in Checkpointer(checkpoints).complete()]
        for p in passed:
            print(f"note: {p} has no readable manifest.json (a save cut off, or a copy made half-way): skipped; "
                  f"evaluating {found[-1].name}.", file=sys.stderr)
        # A run finished with checkpoint.save_final=false: its final weights are in the export alone.
        try:
            exported = json.loads(_read(path / "export.json", MAX_CONFIG_BYTES, "")).get("step")
        except (OSError, ValueError, AttributeError, UserError):  # (no export, or one that cannot be read)
            exported = None
        if isinstance(exported, int) and exported > step_of(found[-1]) and not passed:
            print(f"note: the run's newest checkpoint is {found[-1].name}, before its final step {exported} "
                  "(checkpoint.save_final=false): evaluating that checkpoint. The final weights are in the export: "
                  f"`python -m trainer eval {path} device_map=auto` evaluates them.", file=sys.stderr)
        return found[-1]
    if which == "best":
        best = checkpoints / "best.json"
        if not os.path.lexists(best):
            metric = OmegaConf.select(config_yaml(path), "checkpoint.best_metric", default=None)
            why = (f"no eval has ranked a checkpoint by checkpoint.best_metric={metric} yet (it was set after the "
                   "run's last eval, the run stopped before its first one, or the metric was NaN at every eval, which "
                   "is never the best); an eval after it that gives a number writes it" if metric else
                   "it was trained without checkpoint.best_metric")
            raise ConfigError(f"{path} has no checkpoints/best.json: {why}. Use checkpoint=latest or a checkpoint's "
                              "path.")
        fix = "Use checkpoint=latest or a checkpoint's path."
        name = _json_object(best, MAX_CONFIG_BYTES, fix).get("checkpoint")
        if not isinstance(name, str) or Path(name).name != name or step_of(Path(name)) < 0:
            raise CheckpointError(f"{best} names {snapshot.shown(name)} as the best checkpoint: not a step_NNNNNNNN "
                                  f"checkpoint inside {checkpoints}, so not one this run wrote. {fix}")
        if (checkpoints / name).is_symlink():
            raise CheckpointError(f"{checkpoints / name}, the best checkpoint by {best}, is a symbolic link (to "
                                  f"{os.readlink(checkpoints / name)}), not a checkpoint this run wrote. {fix}")
        return checkpoints / name
    path = Path(which).expanduser()
    if not path.is_dir() and not os.path.lexists(path) and Path(which).name == which and step_of(path) >= 0 and \
            (checkpoints / which).is_dir():
        return checkpoints / which  # (a checkpoint's name, as the run lists them: step_00000400)
    if not path.is_dir():  # (the reader's own message would speak of resume=, which eval does not take)
        raise ConfigError(f"checkpoint={which} is not a directory. Pass checkpoint=latest (the default), "
                          "checkpoint=best, the name of one of the run's checkpoints (step_NNNNNNNN, in "
                          f"{checkpoints}), or the path of a step_* checkpoint directory.")
    return path
