"""What a checkpoint of a run holds, and how a run resumes: the checkpoint manager and the resume policy.

As torchtitan's `CheckpointManager` is handed its `states`, the manager is handed the stateful parts of a
run (the Trainer's run state, the scheduler, precision, non-finite guard, loggers, checkpointer, callbacks,
EMA, a stateful task) with the model, the optimizer and the strategy that knows their layout. It owns what
a checkpoint holds (`state`), saving (`save`, through the `Checkpointer` store of checkpoint.py), loading
with every check before anything is applied (`load`), and the resume policy (`resume`: which checkpoint, what
happens to the ones that cannot be read, what a changed setting means). The Trainer calls it and holds no
checkpoint-format code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trainer.checkpoint import snapshot
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.settings import changed_settings, flat, read_config, resumable
from trainer.errors import CheckpointError
from trainer.io import free_name


class Parts:
    """The models and optimizers of a checkpoint, with the strategy that knows their layout.

    One model named "model" with at most one optimizer (the Trainer's case, and a hand-written loop's usual one)
    keeps the format every checkpoint of this framework has: model tensors under the plain module's keys, the
    optimizer's state under "optimizer". Several (a GAN's generator and discriminator) put each model's tensors
    under "<name>." and each optimizer's state under "optimizer" -> its name."""

    def __init__(self, strategy, models: dict[str, torch.nn.Module],
                 optimizers: dict[str, tuple[str, torch.optim.Optimizer]],
                 left_out: dict[str, frozenset[str]] | None = None,
                 after_load: Callable[[torch.nn.Module], None] | None = None, config_hyperparameters: bool = True):
        self.strategy, self.models, self.optimizers = strategy, models, optimizers
        # The Trainer's optimizer hyperparameters (betas, weight decay) are its config's, which a resume may change;
        # a loop of one's own gets the checkpoint's back, as torch's load_state_dict gives them (OneCycleLR cycles
        # the momentum or beta1: the fresh scheduler's first value made the resumed run another one).
        self.config_hyperparameters = config_hyperparameters
        # What a model needs after its tensors are loaded (LoRA: the scale this run configured, not the checkpoint's;
        # trainer/models/finetune.py's after_load, which the loop passes).
        self.after_load = after_load
        self.one_model = list(models) == ["model"]  # model tensors under the module's own keys
        self.single = self.one_model and len(optimizers) <= 1  # and the optimizer's state under "optimizer"
        # Each model's keys a checkpoint leaves out: a LoRA run's frozen base weights, which a resume rebuilds
        # (trainer/models/finetune.py's frozen_keys, which the loop passes).
        self.left_out = {name: (left_out or {}).get(name, frozenset()) for name in models}

    def _key(self, name: str, key: str) -> str:
        return key if self.one_model else f"{name}.{key}"

    def model_state(self) -> dict[str, torch.Tensor]:
        return {self._key(name, k): v for name, m in self.models.items()
                for k, v in self.strategy.model_state_dict(m).items() if k not in self.left_out[name]}

    def saved_elsewhere(self, key: str) -> bool:
        """A checkpoint's model tensor this run rebuilds instead of loading (a frozen base weight that an older
        checkpoint kept)."""
        return any(key == self._key(name, k) for name, keys in self.left_out.items() for k in keys)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.one_model:
            self.strategy.load_model_state_dict(self.models["model"], state, strict=not self.left_out["model"])
        else:
            for name, m in self.models.items():
                prefix = f"{name}."
                self.strategy.load_model_state_dict(m, {k[len(prefix):]: v for k, v in state.items()
                                                        if k.startswith(prefix)}, strict=not self.left_out[name])
        for m in self.models.values() if self.after_load is not None else ():
            self.after_load(m)

    def _each(self, fn) -> Any:
        out = {name: fn(self.models[model], opt) for name, (model, opt) in self.optimizers.items()}
        return next(iter(out.values()), {"state": {}, "param_groups": []}) if self.single else out

    def optimizer_state(self) -> Any:
        return self._each(self.strategy.optimizer_state_dict)

    def optimizer_template(self, saved: Any) -> Any:
        """The live optimizers' state shape where the checkpoint has stepped state, an empty state elsewhere."""
        def template(model, opt, saved):
            if _stepped(saved):
                return self.strategy.optimizer_template(model, opt)
            if isinstance(saved, dict) and saved.get("param_groups"):  # no per-parameter state: the groups alone
                return {"state": {}, "param_groups": self.strategy.optimizer_groups(model, opt)}
            return {"state": {}, "param_groups": []}  # (an earlier version's save before the first step)

        if self.single:
            return self._each(lambda m, o: template(m, o, saved))
        saved = saved if isinstance(saved, dict) else {}
        return {name: template(self.models[model], opt, saved.get(name))
                for name, (model, opt) in self.optimizers.items()}

    def check_optimizer(self, state: Any, like: Any, where: str) -> None:
        if self.single:
            _check_optimizer(state, like, where)
        else:
            for name in self.optimizers:
                _check_optimizer(state[name], like[name], f"{where} (optimizer {name})")

    def load_optimizer_state(self, state: Any) -> None:
        """The optimizers' moments, step counts and learning rates from `state`; their other hyperparameters (betas,
        weight decay, ...) stay this run's config's where `config_hyperparameters`, else are the checkpoint's too.
        How the step is computed (fused, foreach: the strategy may choose it) stays this run's either way."""
        live = (lambda k: k not in ("params", "lr", "initial_lr")) if self.config_hyperparameters else \
            (lambda k: k in ("fused", "foreach", "capturable", "differentiable"))
        for name, (model, opt) in self.optimizers.items():
            hyper = [{k: v for k, v in g.items() if live(k)} for g in opt.param_groups]
            self.strategy.load_optimizer_state_dict(self.models[model], opt, state if self.single else state[name])
            for group, h in zip(opt.param_groups, hyper):
                group.update(h)

    def names_differ(self, saved_model_keys, live_model_keys, saved_optimizer: Any) -> str | None:
        """Where a checkpoint holds these models and optimizers under other names (rt.setup's `names=`): a sentence
        naming both sides, else None. The model tensors tell their names: one model named "model" keeps the
        module's own keys, several "<name>." before them."""
        live = {name: {k[len(self._key(name, "")):] for k in live_model_keys if k.startswith(self._key(name, ""))}
                for name in self.models}
        keys = set(saved_model_keys)
        saved_models = None
        if keys in live.values():
            saved_models = ["model"]
        else:
            groups: dict[str, set[str]] = {}
            for key in keys:
                head, _, rest = key.partition(".")
                groups.setdefault(head, set()).add(rest)
            if sorted(map(sorted, groups.values())) == sorted(map(sorted, live.values())):
                saved_models = sorted(groups)
        saved_opts = None
        if isinstance(saved_optimizer, dict) and "param_groups" not in saved_optimizer and not self.single:
            saved_opts = sorted(saved_optimizer)
        model_off = saved_models is not None and saved_models != sorted(live)
        opt_off = saved_opts is not None and saved_opts != sorted(self.optimizers)
        if not (model_off or opt_off):
            return None
        said = []
        if model_off:
            said.append(f"its models are named {', '.join(map(repr, saved_models))} where this script set up "
                        f"{', '.join(map(repr, self.models))}")
        if opt_off:
            said.append(f"its optimizers {', '.join(map(repr, saved_opts))} where this script set up "
                        f"{', '.join(map(repr, self.optimizers)) or 'none'}")
        return "; ".join(said)

    def fresh_optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for _, opt in self.optimizers.values() if not opt.state]


def _stepped(state: Any) -> bool:
    return isinstance(state, dict) and bool(state.get("state"))


def _base_missing(loaded: ckpt.Loaded, where: str) -> str:
    """A LoRA checkpoint resumed without the pretrained weights its adapters were trained on: the frozen base would
    be this run's random initialisation, and the run would go on training and export it, with no word but a setting's
    change (finetune.weights: PATH -> None)."""
    import yaml

    try:
        weights = (yaml.safe_load(bytes(loaded.buffers["config.yaml"]).decode()) or {}).get("finetune", {}).get("weights")
    except (ValueError, AttributeError, yaml.YAMLError):
        weights = None
    given = f"finetune.weights={weights}" if isinstance(weights, str) else "the finetune.weights its config.yaml names"
    return (f"{where} holds LoRA adapters trained on pretrained weights that its checkpoints leave out (a resume reads "
            f"them from finetune.weights again), but this run has no finetune.weights: the frozen base would be a random "
            f"initialisation. Resume with {given}.")


class CheckpointManager:
    """`run` is the run state (`state_dict`, `load_state_dict`, `check_state`, `resize_notes`: the Trainer's, or
    a hand-written loop's through trainer.Runtime); `parts` the models and optimizers (`Parts`); `components` the
    other stateful parts, saved under their names."""

    def __init__(self, checkpointer, parts: Parts, run, components: dict[str, Any], every_component: bool = False):
        self.checkpointer, self.parts, self.strategy = checkpointer, parts, parts.strategy
        self.backend = parts.strategy.backend
        self.run, self.components = run, components
        # A loop of one's own: a checkpoint's component that nothing here takes is refused (a loader or registered
        # object made after load_state would start afresh). The Trainer's components follow its config, which a
        # resume may change (ema off, a callback dropped): there they are left behind.
        self.every_component = every_component
        checkpointer.writer = self.strategy.checkpoint_writer()

    def state(self) -> dict[str, Any]:
        """Everything but the model weights. A collective when distributed (gathers each rank's RNG state)."""
        return {"trainer": self.run.state_dict(),
                "optimizer": self.parts.optimizer_state(),
                "rng": self.backend.gather_object(rng_state()),
                **{name: c.state_dict() for name, c in self.components.items()}}

    def save(self, step: int, metrics: dict[str, float] | None = None, wait: bool = False) -> Path | None:
        """Save step `step` (in the background with checkpoint.async_save); `wait` before exiting the process."""
        self.checkpointer.consider(metrics, step)  # before the state is taken: it records the best
        model_state = self.parts.model_state()
        state = self.state()  # on every rank: it gathers RNG states
        path = self.checkpointer.save(step, model_state, state, metrics)
        if wait:  # nobody exits (and gets the job torn down) while a rank is still writing
            self.checkpointer.wait()
            self.backend.barrier()
        return path

    def finish_pending(self) -> None:
        """Wait for the save in flight, on every rank."""
        self.checkpointer.wait()
        self.backend.barrier()

    def load(self, path: Path, resume: bool = True) -> list[str]:
        """Load a checkpoint written under any strategy, world size and global batch. Every tensor and value is
        checked against the live objects first, and every rank agrees on the verdict; nothing is changed unless
        all fit on every rank. A component the checkpoint lacks (EMA or a callback turned on since) keeps its
        initial state. `resume=False` (an eval): the data order need not continue. Returns what a user should
        know about the load (components started fresh, a changed global batch)."""
        loaded = ckpt.read(path, self.backend)
        where = f"checkpoint {path}"
        fresh = self.parts.fresh_optimizers()
        error, checked = None, None
        try:
            checked = self._checked(loaded, where, resume)
        except CheckpointError as e:
            error = e
        except BaseException:
            for opt in fresh:  # the template initialised it; a fresh run must not start from that
                self.strategy.reset_optimizer(opt)
            raise
        if self.backend.distributed:  # one verdict for all ranks: a rank that loads while another falls back hangs
            verdicts = self.backend.gather_object(str(error) if error else None)
            first = next((f"{v} (rank {r})" if self.backend.world_size > 1 else v
                          for r, v in enumerate(verdicts) if v), None)
            error = CheckpointError(first) if first and error is None else error
        if error is not None:
            for opt in fresh:
                self.strategy.reset_optimizer(opt)
            raise error
        model_state, state, absent = checked
        self.parts.load_model_state(model_state)
        self.parts.load_optimizer_state(state["optimizer"])
        for name, c in self.components.items():
            if name in state:
                c.load_state_dict(state[name])
        notes = []
        if "ema" in absent:
            self.components["ema"].reset()  # an average of the weights from here on, starting at the checkpoint's
            notes.append(f"resume: {path.name} has no EMA state (ema.enabled was off): the EMA starts from its "
                         "weights now.")
        had_ema = isinstance(loaded.tree, dict) and bool(loaded.tree.get("ema"))
        if resume and had_ema and "ema" not in self.components:  # (said only by the settings' diff)
            notes.append(f"resume: {path.name} holds an EMA of the weights, which this run does not continue "
                         "(ema.enabled=false): it stays in that checkpoint until checkpoint.keep_last prunes it, and "
                         "the run's export has no model_ema.safetensors. ema.enabled=true continues it.")
        for name in absent.get("callbacks", []):
            notes.append(f"resume: {path.name} has no state for callbacks.{name} (it was not on): it starts from "
                         "its initial state.")
        if resume:
            notes += self.run.resize_notes(state["trainer"])
            self.run.load_state_dict(state["trainer"])
            self.checkpointer.repair_best_file()  # (a damaged best.json, eval checkpoint=best's pointer)
        else:
            self.run.step = state["trainer"]["step"]
            self.run.trained_on = state["trainer"].get("data_identity")  # (what an eval compares its data with)
        rngs = state["rng"]
        if self.backend.rank < len(rngs):  # same world size: continue each rank's own stream
            set_rng_state(rngs[self.backend.rank])
        return notes

    def _checked(self, loaded: ckpt.Loaded, where: str, resume: bool):
        """The checkpoint's model and run state, checked against the live objects and conformed to them, and the
        components it has no state for ({"ema": True, "callbacks": [names]}). Raises CheckpointError."""
        live_model = self.parts.model_state()
        loaded.model, loaded.tree = self.strategy.restrict_checkpoint(loaded.model, loaded.tree)
        for key in [k for k in loaded.model if k not in live_model and self.parts.saved_elsewhere(k)]:
            del loaded.model[key]  # this run rebuilds it (an older checkpoint of a LoRA run kept its base)
        tree = loaded.tree if isinstance(loaded.tree, dict) else {}
        if "finetune" in tree and "finetune" not in self.components and any(self.parts.left_out.values()):
            raise CheckpointError(_base_missing(loaded, where))
        renamed = self.parts.names_differ(loaded.model, live_model, tree.get("optimizer")) \
            if self.every_component else None
        if renamed:
            raise CheckpointError(f"{where} holds what this script set up under other names: {renamed}. Set them up "
                                  "under the names they were saved with, rt.setup(model, optimizer, names=[...]) as "
                                  "the script that saved it did (the defaults: 'model', 'optimizer', then 'model_1', "
                                  "'optimizer_1', ...).")
        problems = ckpt.model_mismatches(loaded, live_model)
        if problems:
            fix = ("Build the model as the script that saved it did (the same layers and sizes)" if self.every_component
                   else "Use the model config it was trained with (see its config.yaml)")  # (a loop of one's own: no config)
            raise CheckpointError(f"{where} does not match the model ({len(problems)} tensors): {ckpt.listed(problems)}. "
                                  f"{fix}.")
        live_rng = rng_state()
        saved_rng = tree.get("rng")
        if not (isinstance(saved_rng, list) and saved_rng and isinstance(saved_rng[0], dict) and "numpy" in saved_rng[0]):
            live_rng.pop("numpy", None)  # (a checkpoint of a process without numpy, or from before it was kept)
        elif "numpy" not in live_rng:
            from trainer.checkpoint.rng import numpy_state

            live_rng["numpy"] = numpy_state()  # (this process restores it: set_rng_state imports numpy)
        like = {"trainer": self.run.state_dict(), "rng": [live_rng],
                **{n: c.state_dict() for n, c in self.components.items()},
                **({"loggers": {}} if "loggers" in self.components else {})}  # (a rewound stream: any state)
        # State newer than some checkpoints (a component's OPTIONAL_STATE): absent there, it is not checked.
        for name, component in [("trainer", self.run), *self.components.items()]:
            saved = tree.get(name)
            for key in getattr(component, "OPTIONAL_STATE", ()):
                if isinstance(saved, dict) and key not in saved and isinstance(like.get(name), dict):
                    like[name].pop(key, None)
        absent: dict[str, Any] = {}
        # A loop of one's own keeps its trackers' and precision's state since 2026-11-28: a checkpoint from before
        # loads without them (the trackers start a run of their own, fp16's loss scale starts over).
        for name in ("loggers", "precision") if self.every_component else ():
            if name in like and name not in tree:
                del like[name]
        if "ema" in like and "ema" not in tree:
            absent["ema"] = True
            del like["ema"]
        if isinstance(tree.get("callbacks"), dict) and like.get("callbacks"):
            absent["callbacks"] = [n for n in like["callbacks"] if n not in tree["callbacks"]]
            like["callbacks"] = {n: v for n, v in like["callbacks"].items() if n in tree["callbacks"]}
        missing = [k for k in ("optimizer", *like) if k not in tree]
        untaken = sorted(k for k in tree if k not in like and k != "optimizer") if self.every_component else []
        if untaken:
            raise CheckpointError(f"{where} holds the state of {', '.join(map(repr, untaken))}, which nothing set up "
                                  "here takes: it would start afresh instead of where it was saved. Make each loader "
                                  "(rt.loader(..., name=...)) and register each object (rt.register(name, obj)) before "
                                  "rt.load_state, under the names they were saved with.")
        if missing:
            raise CheckpointError(f"{where} has no {', '.join(missing)} state: it was saved by another configuration.")
        model_state = {k: snapshot.assemble(k, loaded.model[k], v, where) for k, v in live_model.items()}
        like["optimizer"] = self.parts.optimizer_template(tree["optimizer"])
        try:
            # A loop's own objects (rt.register: a class of neither the framework's nor torch's) may keep their
            # whole state as data, a mapping whose saved keys all come back.
            own = frozenset(f"/{n}" for n, c in self.components.items() if self.every_component and
                            type(c).__module__.partition(".")[0] not in ("trainer", "torch"))
            state = snapshot.conform({k: tree[k] for k in like}, like, loaded.state, where, open_roots=own)
        except CheckpointError as e:
            if "'/optimizer/" in str(e) and "' lacks " in str(e):  # (its state's or settings' keys: another class's)
                muon = any(type(opt).__name__ == "MuonAdamW" for _, opt in self.parts.optimizers.values())
                raise CheckpointError(f"{e} The optimizer it was saved with kept other state or settings: another "
                                      "optimizer class (Adam's moments, SGD's momentum buffer), or the same one with "
                                      "other options (SGD without momentum keeps no buffer). Build the optimizer it was "
                                      "saved with, or start from the model's weights alone with a new optimizer: "
                                      "finetune.weights=CHECKPOINT on the command line; in a loop of one's own, "
                                      "model.load_state_dict(safetensors.torch.load_file(CHECKPOINT/model.safetensors)) "
                                      "before rt.setup (one file per model, named as rt.setup named it)."
                                      + (" With optim=muon: a checkpoint saved before 2026-11-28 kept Muon's state for "
                                         "the output layer of a Hugging Face model (get_output_embeddings()), which "
                                         "AdamW takes since; continue it with the version that saved it." if muon
                                         else "")) from None
            raise
        self.parts.check_optimizer(state["optimizer"], like["optimizer"], where)
        for name, c in self.components.items():
            if name in state and hasattr(c, "check_state"):  # values of the right kind but out of range
                c.check_state(state[name], f"{where}: {name}")
        if resume:
            self.run.check_state(state["trainer"], where)
            # (a loop of one's own numbers its checkpoints itself, by epoch or by update: its step bounds nothing)
            _check_schedule(state.get("scheduler"), None if self.every_component else state["trainer"]["step"], where)
        rngs = state["rng"]
        if self.backend.rank < len(rngs):
            _check_rng(rngs[self.backend.rank], where)
        return model_state, state, absent



def _check_schedule(state: Any, step: int | None, where: str) -> None:
    """The schedule's position is a step the run has reached (a negative one would run the LR backwards)."""
    position = state.get("last_epoch") if isinstance(state, dict) else None
    if isinstance(position, int) and not 0 <= position <= (position if step is None else step):
        raise CheckpointError(f"{where}: scheduler.last_epoch={position} is not a position "
                              f"{'within step ' + str(step) if step is not None else 'a schedule reaches'}.")


def _check_rng(state: dict, where: str) -> None:
    """Python and torch accept this rank's RNG state (tried on throwaway generators, so a refusal changes nothing)."""
    import random

    try:
        random.Random().setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            from trainer.checkpoint.rng import set_numpy_state

            set_numpy_state(state["numpy"], np.random.RandomState())
    except (ValueError, TypeError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{where}: the RNG state of this rank cannot be restored ({e}).") from None


def set_abandoned_branch_aside(checkpointer, source: Path, step: int, loggers, run_dir: Path | None,
                               config_text: str | None, say, also: tuple[str, ...] = ()) -> tuple[int, str] | None:
    """A rollback to `source` (step `step`; the main rank's): the checkpoints the dir holds after it are the branch it
    abandons (`Checkpointer.branch_from`: the new branch's saves of the same steps replaced them), set aside with
    what else that branch left (`also`: its export, already set aside) and its records: its events where some are
    after `step` (metrics.prev.jsonl, tensorboard.prev/: the whole history, which the rewind then cuts at `step`)
    and, given `config_text`, a config.yaml that differs from it (config.prev.yaml), with one attempt number. The
    caller holds `one_attempt` over the run dir.

    Going back to a branch set aside (`source` in checkpoints.prev-N/, which left the run's line after step A < `step`):
    returns (A, ".prev-N"), the events to take from that branch's own copy (metrics.prev-N.jsonl) in (A, step], for
    the caller's `loggers.take_branch`; else None (the caller rewinds the events to `step`)."""
    from trainer.io import free_name
    from trainer.tracking.loggers import last_step

    after = checkpointer.branch_point(source) if checkpointer.dir is not None else step
    branch = None
    if after < step and run_dir is not None and source.parent.name.startswith(checkpointer.dir.name + "."):
        branch = (after, source.parent.name[len(checkpointer.dir.name):])
    moved_to, moved, left = checkpointer.branch_from(source) if checkpointer.dir is not None else (None, [], [])
    if moved and branch is not None:  # (back to a branch set aside: this dir's steps may be named like its own)
        say(f"resume: {source} is of a branch set aside, which left the run's line after step {after}: this dir's "
            f"later checkpoints, {', '.join(moved)}, are the branch this job leaves, kept in {moved_to} (out of "
            "resume=auto's and checkpoint.keep_last's way).")
    elif moved:
        say(f"resume: {source.name} is older than {', '.join(moved)}, written before this rollback: they are kept in "
            f"{moved_to} (out of resume=auto's and checkpoint.keep_last's way).")
    if left:
        say(f"resume: {', '.join(left)}, written before this rollback, could not be moved aside: they stay in place, "
            "where no save of this run replaces or prunes them.")
    taken = getattr(checkpointer, "taken_back", [])
    if taken:
        say(f"resume: {', '.join(taken)} of the branch resumed are back in {checkpointer.dir}, the run's line again "
            f"(resume=auto continues from {source.name} if this job stops before it saves).")
    if not (moved or left or also) or run_dir is None:
        return branch
    metrics, earlier, kept = run_dir / "metrics.jsonl", run_dir / "config.yaml", []
    if metrics.is_file() and (last_step(metrics) or 0) > min(step, after):
        kept += loggers.keep_copy()
    if config_text is not None and earlier.is_file() and not earlier.is_symlink() and earlier.read_text() != config_text:
        kept.append(free_name(earlier, ".prev", before_suffix=True))
        earlier.replace(kept[-1])
    if kept:
        say(f"resume: the abandoned branch's events (after step {min(step, after)} too) and settings are kept in "
            f"{', '.join(str(p) for p in kept)}.")
    return branch


def _check_optimizer(state: dict, like: dict, where: str) -> None:
    """The checkpoint's optimizer holds the same parameters, in the same groups, as the live one."""
    if not state["param_groups"] or not like["param_groups"]:
        return  # saved before the first step by an earlier version, or groups this strategy does not load
    # Each group as a set: the state is keyed by parameter name, and loaded by name. A pipeline stage lists its
    # parameters in its stages' order (Interleaved1F1B's rank 0 holds blocks 0 and 2, ZBVZeroBubble's the first and
    # last), which a one-process run lists in the model's: the same groups.
    groups = [sorted(g["params"]) for g in state["param_groups"]]
    if groups != [sorted(g["params"]) for g in like["param_groups"]]:
        raise CheckpointError(f"{where}: the optimizer's parameter groups differ from this run's "
                              "(another model or optim config). Resume with the checkpoint's config.yaml.")



# -- the resume policy -----------------------------------------------------------------------------------
def resume_candidates(resume: str | None, checkpointer: ckpt.Checkpointer, restarted: bool) -> tuple[list[Path], bool]:
    """The checkpoints to try, newest first, and whether falling back past a bad one is allowed.
    An elastic restart always resumes from the newest good one."""
    if resume is None and not restarted:
        return [], False
    # (a restart of a job started with resume=PATH too, once the run has checkpoints of its own: PATH again would roll
    # back the first attempt's progress)
    if resume in (None, "auto") or (restarted and checkpointer.complete()):  # (unreadable ones first: tried, named)
        return [*reversed(checkpointer.unreadable()), *reversed(checkpointer.complete())], True
    path = Path(resume).expanduser()
    # The job that went back to this branch took its checkpoints back into the run's line (branch_from): the same
    # command, requeued, finds it there.
    path = ckpt.taken_back(path) or path
    if path.is_dir() and not (path / ckpt.MANIFEST).exists():  # a run dir or its checkpoints/ dir
        inner = ckpt.Checkpointer(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
        found = inner.complete()
        if not found:
            raise CheckpointError(f"resume={resume!r}: no complete checkpoint (step_*/manifest.json) under {path}.")
        path = found[-1]
    return [path], False


def resume(trainer, cfg: DictConfig, say) -> Path | None:
    """Load the checkpoint `cfg.resume` names into `trainer`: with `auto`, the most recently written one that
    loads (each one skipped is named, with why, and stays on disk); an explicit path must load, or the run stops
    with the reason. A resume never starts over silently: when `auto` finds checkpoints and none can continue
    this run, it stops (exit 2) naming the settings that differ and the two ways out. Says which settings
    differ from the checkpoint's config (they apply from here on). A fresh start in a run dir with checkpoints
    sets them aside (checkpoints.prev/) rather than pruning them."""
    restarted = trainer.backend.info.restart_count > 0
    candidates, fallback = resume_candidates(cfg.get("resume"), trainer.checkpointer, restarted)
    candidates = trainer.backend.broadcast_object(candidates)  # one list for every rank
    skipped: list[tuple[Path, CheckpointError]] = []
    for path in candidates:
        try:
            notes = trainer.checkpoints.load(path)
        except CheckpointError as e:
            if not fallback:
                raise CheckpointError(f"{e}{_differences(path, cfg)}") from None
            skipped.append((path, e))  # (said once the outcome is known: a failed fallback says it all in its error)
            continue
        for line in _skipped_lines(skipped):
            say(line)
        # What was skipped is moved out of the checkpoints' namespace, so that no later run prunes it or tries it
        # again; where that fails it stays in place, and this run does not prune it.
        # (Not one that could not be read now, for a reason that may pass: the next run tries it again.)
        trainer.checkpointer.fell_back = bool(skipped)
        lasting = [p for p, e in skipped if ckpt.AGAIN not in str(e)]
        moved = trainer.backend.broadcast_object(_set_aside(lasting) if trainer.backend.is_main else None)
        trainer.checkpointer.protected.update(p.name for p, e in skipped if ckpt.AGAIN in str(e))
        trainer.checkpointer.protected.update(name for name, to in moved if to is None)
        # Callbacks whose settings changed since the checkpoint (early stopping on another metric: its best and count
        # were the old metric's) start those over; every rank alike.
        changed = trainer.backend.broadcast_object([k for k, _, _ in changed_settings(path, cfg)]
                                                   if trainer.backend.is_main else None)
        restarted_callbacks = trainer.callbacks.settings_changed(changed) if hasattr(trainer, "callbacks") else []
        if trainer.backend.is_main:
            kept = [f"resume: the skipped {name} is kept as {to} (resume=auto and checkpoint.keep_last leave it alone)."
                    for name, to in moved if to is not None]
            for line in [*kept, *notes, *resume_notes(path, cfg, trainer.checkpointer), *restarted_callbacks]:
                say(line)
        return path
    if skipped:
        newest, why = skipped[0]
        differences = _differences(newest, cfg)
        raise CheckpointError(
            f"resume=auto: none of the {len(skipped)} checkpoints in {trainer.checkpointer.dir} can continue this "
            f"run. The newest, {newest.name}: {why}{_older_reasons(skipped)}{differences} Nothing in the run dir was "
            "changed."
            + ("" if differences else " To start over anyway, pass resume=null (the checkpoints are then kept in "
               "checkpoints.prev/), or give this job a run dir of its own."))
    # resume=null in a run dir that has checkpoints: start fresh, and keep the earlier attempt's. Rank 0 decides for
    # all: a rank that looked after rank 0 had moved them would skip the broadcast and leave rank 0 waiting in it.
    directory = trainer.checkpointer.dir
    linked = os.readlink(directory) if trainer.backend.is_main and directory.is_symlink() else None
    aside = trainer.backend.broadcast_object(
        (ckpt.set_aside(directory) if trainer.checkpointer.complete() or trainer.checkpointer.unreadable() else None)
        if trainer.backend.is_main else None)
    if aside is not None:
        say(f"starting fresh (resume={cfg.get('resume')}): the earlier checkpoints of this run dir are kept in "
            f"{aside}.")
    if aside is not None and linked is not None:  # (the run moved off the disk the link chose, without a word)
        say(f"note: {directory} was a link to {linked}, set aside with those checkpoints: this run's go to a new "
            f"checkpoints/ in {directory.parent}, on its disk. To keep them on the other disk, stop this run, link "
            f"{directory} to a new directory there, and run it again.")
    elif cfg.get("resume") == "auto":
        say(f"resume=auto: no complete checkpoint in {trainer.checkpointer.dir}; starting fresh.")
    return None


def _reason(path: Path, error: CheckpointError) -> str:
    """Why `path` could not be loaded, without its own name: two checkpoints refused for one cause compare equal."""
    return str(error).replace(str(path), "").replace(path.name, "")


def _skipped_lines(skipped: list[tuple[Path, CheckpointError]]) -> list[str]:
    """A warning per checkpoint resume=auto passed over, newest first. A reason is given in full once: a model
    change makes every checkpoint refuse with the same list of tensors, which is read once, not once per step."""
    lines = []
    for i, (path, e) in enumerate(skipped):
        same = next((p for p, earlier in skipped[:i] if _reason(p, earlier) == _reason(path, e)), None)
        lines.append(f"warning: skipping checkpoint {path} too, for the same reason as {same.name}. It stays on disk."
                     if same else f"warning: skipping checkpoint {path}: {e} It stays on disk.")
    return lines


def _older_reasons(skipped: list[tuple[Path, CheckpointError]]) -> str:
    """The error's account of the checkpoints older than the newest: the same cause in one clause, others in full."""
    (newest, first), *older = skipped
    if not older:
        return ""
    if all(_reason(p, e) == _reason(newest, first) for p, e in older):
        return (f" The older {len(older)} ({', '.join(p.name for p, _ in older)}) fail the same way." if len(older) > 1
                else f" The older one, {older[0][0].name}, fails the same way.")
    return "".join(f" {p.name}: {e}" for p, e in older)


def _set_aside(paths) -> list[tuple[str, str | None]]:
    """Each checkpoint in `paths` renamed to `step_N.unreadable` (or `-2`, ...): [(name, new name or None)]."""
    moved = []
    for path in paths:
        target = free_name(path, ".unreadable")
        try:
            os.replace(path, target)
            moved.append((path.name, target.name))
        except OSError:
            moved.append((path.name, None))
    return moved


def _differences(path: Path, cfg: DictConfig) -> str:
    """The settings that differ between the checkpoint's config and this run's, and the two ways out; "" when
    none differ (then the checkpoint itself is at fault, and its error says so)."""
    changed = [c for c in changed_settings(path, cfg) if not resumable(c[0])]  # (those a resume may change)
    if not changed:
        return ""
    # A config group whose _target_ changed (world=single -> world=ddp) is one choice, not a list of its keys
    # (whose null values would not even parse back): said, and given back, as the option that has that _target_.
    before = flat(read_config(path / "config.yaml") or {})
    now = flat(OmegaConf.to_container(cfg, resolve=True))
    groups = {k.partition(".")[0]: (_option_of(k.partition(".")[0], before, now), a, b) for k, a, b in changed
              if k.partition(".")[2] == "_target_"}
    groups = {g: found for g, found in groups.items() if found[0] is not None}
    rest = [c for c in changed if c[0].partition(".")[0] not in groups]
    back_items = [" ".join([f"{g}={option}", *keys]) for g, ((option, keys), _, _) in groups.items()]
    back_items += [f"{k}={_shown(v)}" for k, v, _ in rest]
    listed_items = [f"{g}: {_shown(a)} -> {_shown(b)} (it ran with {' '.join([f'{g}={option}', *keys])})"
                    for g, ((option, keys), a, b) in groups.items()]
    listed_items += [f"{k}: {_shown(a)} -> {_shown(b)}" for k, a, b in rest]
    back, listed = " ".join(back_items[:8]), "; ".join(listed_items[:8])
    more = f" (and {len(listed_items) - 8} more)" if len(listed_items) > 8 else ""
    return (f" Settings that differ from its config.yaml: {listed}{more}. Either continue the run with the "
            f"checkpoint's settings (rerun with {back}{' ...' if more else ''}, or without the overrides that changed "
            "them), or start a new run in a directory of its own (another hydra.run.dir, or none for a new "
            "timestamped one).")


def _option_of(group: str, before: dict[str, Any], now: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The option of config group `group` (conf/GROUP/NAME.yaml) that the checkpoint's settings (`before`,
    flattened) ran with, and the `GROUP.KEY=VALUE` overrides that take it to them: of the options with their
    `_target_`, the one that needs the fewest (world=ddp world.nproc_per_node=2). A key every option of the group
    has (world's launch keys) and the option leaves unset keeps this run's value (`now`, flattened: debug=smoke's
    world.threads=1). None when no option has the `_target_`: then the keys are listed one by one."""
    from importlib.resources import files

    import yaml

    folder = files("trainer.conf") / group
    if not folder.is_dir():
        return None
    ran = {k.partition(".")[2]: v for k, v in before.items() if k.partition(".")[0] == group}
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            try:
                option = yaml.safe_load(entry.read_text())
            except yaml.YAMLError:
                continue
            if not (isinstance(option, dict) and option.get("_target_") == ran.get("_target_")):
                continue
            defaults = flat(option)
            shared = {k: now[f"{group}.{k}"] for k in _SHARED.get(group, ()) if f"{group}.{k}" in now}
            defaults = {**shared, **defaults}
            keys = [f"{'' if k in defaults else '+'}{group}.{k}={_shown(v)}" for k, v in ran.items()
                    if defaults.get(k, _ABSENT) != v]
            keys += [f"~{group}.{k}" for k in defaults if k not in ran and "." not in k]
            found.append((len(keys), entry.name[: -len(".yaml")], keys))
    if not found:
        return None
    _, name, keys = min(found)
    return name, keys


_ABSENT = object()
# The keys every option of a group has, set or not in its file: world's launch keys (config.schema.LAUNCH_KEYS, a
# package above this one; tests/test_units.py holds the two equal).
_SHARED = {"world": ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts", "rdzv_timeout",
                     "hang_timeout", "device", "threads")}


def _shown(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def resume_notes(path: Path, cfg: DictConfig, checkpointer: ckpt.Checkpointer) -> list[str]:
    """What a user should know after a resume: the settings that changed, and newer checkpoints left behind."""
    notes = []
    changed = changed_settings(path, cfg)
    # A section whose option changed (world: single -> ddp) has keys only one side has: said as one count, not
    # each as `None -> 25`.
    swapped = {k.rpartition(".")[0] for k, _, _ in changed if k.endswith("._target_")}
    one_sided = [k for k, a, b in changed if k.rpartition(".")[0] in swapped and not k.endswith("._target_")
                 and (a is None or b is None)]
    shown = [f"{k}: {a!r} -> {b!r}" for k, a, b in changed if k not in one_sided]
    for section in sorted(swapped):
        n = sum(k.rpartition(".")[0] == section for k in one_sided)
        if n:
            shown.append(f"{section}: {n} setting{'s' if n > 1 else ''} only one of the two options has")
    if changed:
        notes.append("resume: these settings differ from the checkpoint's and apply from here on (optimizer and "
                     "schedule settings included: the schedule keeps its position and takes the new shape): "
                     + "; ".join(shown))
    if checkpointer.reranked is not None and checkpointer.best_metric is not None:
        metric, mode, name = checkpointer.reranked
        notes.append(f"resume: the best checkpoint was ranked by {metric} ({mode}) and this run ranks by "
                     f"checkpoint.best_metric={checkpointer.best_metric} ({checkpointer.best_mode}): the best is ranked "
                     f"anew from this run's next eval. {name}, the best by {metric}, stays on disk (and in best.json, "
                     "for eval checkpoint=best) until a best by the new metric replaces it.")
    return notes
