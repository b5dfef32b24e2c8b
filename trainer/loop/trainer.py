"""The training loop. Components arrive built; the Trainer orders their calls and owns the run state."""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from trainer import noise
from trainer.checkpoint import rng
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.manager import CheckpointManager, Parts
from trainer.config.schema import TrainerConfig
from trainer.config.targets import compile_args
from trainer.data.sampling import Data, GlobalBatchSampler, eval_batches
from trainer.data.streaming import StreamLayout
from trainer.errors import CheckpointError, ConfigError, NonFiniteError, Preempted, UserError
from trainer.loop import watchdog
from trainer.loop.callbacks import Callbacks
from trainer.loop.custom_step import Schedules, TrainingStep
from trainer.loop.ema import EMA
from trainer.loop.metrics import Cost, Throughput
from trainer.loop.nonfinite import FIX, NonFiniteGuard
from trainer.loop.preemption import PreemptionFlag
from trainer.loop.runtime import Runtime
from trainer.models.finetune import after_load, frozen_keys
from trainer.parallel import unwrap
from trainer.redaction import redact_text
from trainer.task import EvalSums, Task, check_sample, check_sum_names, is_number, named_numbers, split_loss
from trainer.tracking.loggers import NullLogger
from trainer.tracking.progress import NullProgress, Progress

EVAL_STREAM = 1 << 48  # val sample i draws its noise (trainer.noise) as sample EVAL_STREAM + i of the stream


# A run's training before this attempt (Trainer.trained_before): steps, and its logged windows' seconds and targets.
NOTHING_TRAINED = {"steps": 0, "seconds": 0.0, "targets": 0.0}


class Trainer:
    """Owns the loop: data order, the optimizer step, eval, logging and checkpoint cadence, run state.

    Checkpoints are the CheckpointManager's (`self.checkpoints`, trainer/checkpoint/manager.py), handed the
    Trainer's own run state (`state_dict`, `check_state`) and each stateful component (scheduler, precision,
    non-finite guard, loggers, EMA, and whatever the recipe adds through `components`); the loop only says when.
    """

    def __init__(self, *, runtime: Runtime, model: nn.Module, task: Task,
                 optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer],
                 scheduler: torch.optim.lr_scheduler.LRScheduler | dict[str, Any], data: Data,
                 config: TrainerConfig, loggers: NullLogger | None = None, checkpointer=None,
                 ema: EMA | None = None, guard: NonFiniteGuard | None = None, cost: Cost | None = None,
                 components: dict[str, Any] | None = None, preemption: PreemptionFlag | None = None,
                 callbacks: Callbacks | None = None):
        # The runtime (trainer/loop/runtime.py) holds the process, the strategy and the precision, and takes the step's
        # calls (accumulate, backward, clip, step): the same ones a hand-written loop makes.
        self.rt, self.model, self.task = runtime, model, task
        self.precision, self.strategy, self.backend, self.cfg = runtime.precision, runtime.strategy, runtime.backend, config
        precision, strategy = self.precision, self.strategy
        # trainer.compile: the task's loss is compiled too, with the compiled model inside it (dynamo inlines it), as
        # nanoGPT's model computes its own loss: one graph from the batch to the loss, so inductor fuses the loss into
        # the model's last layer (under DDP dynamo breaks the graph at DDP's forward: the loss is a graph of its own,
        # fused still). With the model alone compiled, the lm recipe's fp32 cross-entropy ran eagerly over the whole
        # [tokens, vocab] logits, cast, written and read back in both directions (BENCHMARKS.md, GPU).
        self.loss_fn = task.loss if hasattr(task, "loss") else None
        if config.compile and self.loss_fn is not None and strategy.pipeline is None:
            self.loss_fn = torch.compile(self.loss_fn, **compile_args(config))
        # One optimizer, or one per model part (a task's own training_step; trainer/loop/custom_step.py), by name.
        self.optimizers = optimizer if isinstance(optimizer, dict) else {"optimizer": optimizer}
        self.schedulers = scheduler if isinstance(scheduler, dict) else {"optimizer": scheduler}
        self.optimizer = next(iter(self.optimizers.values()))
        self.scheduler = scheduler if not isinstance(scheduler, dict) else Schedules(scheduler)
        self.data = data
        self.loggers = loggers or NullLogger()
        self.checkpointer = checkpointer or ckpt.NullCheckpointer()
        self.ema, self.cost = ema, cost
        self.raw_model = unwrap(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.guard = guard or NonFiniteGuard.build(config, precision, self.optimizer, self.backend)
        self.preemption = preemption or PreemptionFlag()
        self.callbacks = callbacks or Callbacks()
        self.components = {"scheduler": self.scheduler, "precision": precision, "nonfinite": self.guard,
                           "loggers": self.loggers, "checkpointer": self.checkpointer, "callbacks": self.callbacks,
                           **({"ema": ema} if ema is not None else {}), **(components or {})}
        parts = Parts(strategy, {"model": model}, {name: ("model", opt) for name, opt in self.optimizers.items()},
                      {"model": frozen_keys(model)}, after_load=after_load)
        self.checkpoints = CheckpointManager(self.checkpointer, parts, self, self.components)
        self._check_user_states()
        # Run state (in checkpoints).
        self.step = 0  # optimizer steps done (skipped fp16/nonfinite steps included)
        self.trained_on: str | None = None  # an eval's checkpoint's training-set fingerprint (checkpoint/manager.py)
        self.samples_seen = 0  # position in the global sample stream
        self.skipped_steps = 0
        # The training the run did before this attempt (from its checkpoint): the summary is of the whole run, as the
        # wandb run it lands in is (a resumed run's summary said steps=4 of 8). Steps, seconds and targets.
        self.trained_before = dict(NOTHING_TRAINED)
        self._meter, self._fit_from = None, 0  # this attempt's (fit's)
        self.stop_reason: str | None = None  # set by request_stop (early stopping): the run ends at this step
        self.saved_step: int | None = None  # the step of the last save_checkpoint (in flight or complete)
        # The global batch trainer.max_epochs counted its steps at: this run's, or the first attempt's (a resume at
        # another batch reads the samples those epochs planned: trainer/entry/run.py's epochs_after_resume).
        self.epoch_batch: int | None = None
        # trainer.eval_every_epochs / checkpoint.every_n_epochs in samples, after such a resume: {"eval": n,
        # "checkpoint": n}. Each is due at the step whose samples reach the next multiple (without a resume at
        # another batch, the step count's multiples are the same steps).
        self.sample_periods: dict[str, int] = {}

    def request_stop(self, reason: str) -> None:
        """End the run after the current step, as if it were the last (a callback's way to stop training)."""
        self.stop_reason = reason

    @property
    def finished(self) -> bool:
        return self.step >= self.cfg.max_steps or self.stop_reason is not None

    @property
    def global_batch(self) -> int:
        return self.data.batch_size * self.cfg.grad_accum_steps * self.strategy.dp_size

    def sampler(self) -> GlobalBatchSampler | StreamLayout:
        """This rank's place in the training stream at the run's position (a stream's: trainer/data/streaming.py)."""
        return self.data.sampler(self.cfg.grad_accum_steps, self.strategy.dp_rank, self.strategy.dp_size,
                                 self.cfg.seed, start=self.samples_seen)

    # -- the optimizer step --------------------------------------------------------------------
    def sync_counts(self, batches: list[Any]) -> tuple[Any, bool]:
        """Targets in the global batch, and whether any rank was asked to stop.

        Both are reduced in host memory (gloo), which never waits for the GPU; only a task that counts
        its targets on the device (a tensor) gets a second, asynchronous reduction there. Ranks that
        share a batch (tensor-parallel peers) count it once."""
        n_local = sum(self.task.num_targets(b) for b in batches)
        be = self.backend
        if not be.distributed:
            return n_local, self.preemption.requested
        replicas = be.world_size // self.strategy.dp_size
        on_device = isinstance(n_local, torch.Tensor)
        host = be.all_reduce(torch.tensor([0.0 if on_device else float(n_local), float(self.preemption.requested)],
                                          dtype=torch.float64), on_host=True).tolist()
        if on_device:
            return be.all_reduce(n_local.to(torch.float64)).float() / replicas, host[1] > 0
        return host[0] / replicas, host[1] > 0

    def train_step(self, batches: list[Any], n_global) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches. Returns device tensors (no host sync)."""
        if hasattr(self.task, "training_step"):
            return self._task_step(batches, n_global)
        rt, model, opt = self.rt, self.model, self.optimizer
        # Token-weighted normalisation: each micro-batch's summed loss is divided by the number of
        # targets in the whole global batch (all micro-steps, all ranks). So k micro-batches of b
        # equal one batch of k*b even when batches differ in length. Data-parallel ranks average their
        # gradients, hence the factor dp_size.
        if not isinstance(n_global, torch.Tensor) and n_global <= 0:  # (a ZeroDivisionError traceback)
            why = getattr(self.task, "no_targets", None)  # (a task of the framework's own says what its count read)
            raise UserError(f"task.num_targets of {type(self.task).__name__} (task._target_) counted {n_global:g} "
                            f"targets in step {self.step + 1}'s whole batch: the Trainer divides the summed loss by that "
                            "count. " + (why or "Return how many terms task.loss sums over (tokens, samples), at least "
                                         "one a batch."))
        scale = self.strategy.dp_size / n_global
        b, dp = self.data.batch_size, self.strategy.dp_size
        loss_sum, sums = None, {}
        for i, batch in enumerate(batches):
            # Where this micro-batch sits in the global sample stream: a task's per-sample noise
            # (trainer.noise) depends on it alone, not on how the global batch is split.
            first = self.samples_seen + (i * dp + self.strategy.dp_rank) * b
            # Gradients are synced only in the last micro-step's backward; earlier ones accumulate.
            with rt.micro_step(model, ends_step=i == len(batches) - 1), \
                    noise.for_samples(torch.arange(first, first + b), self.cfg.seed):
                loss, extra = rt.forward_backward(model, batch, self.loss_fn, scale=scale, mean=False)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            for name, value in extra.items():  # additive sums (accuracy counts, ...): summed like the loss
                sums[name] = sums.get(name, 0) + torch.as_tensor(value).detach().double()
        # The true gradients (averaged where the wrapper did not, fp16's unscaled), clipped over every mesh.
        grad_norm = rt.clip_grad_norm_(model, self.cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses (logged as train/lr)
        # The update, unless the norm is NaN/inf (trainer.nonfinite; see trainer/loop/nonfinite.py).
        applied = False
        if self.guard.allows(grad_norm, self.step + 1, loss_sum):
            with self.guard.skip_on_device(opt):
                applied = rt.step(opt, zero_grad=False)  # False when fp16's loss scaler skipped an overflowed step
        self.guard.record(applied, self.step + 1)
        opt.zero_grad(set_to_none=True)
        if applied:
            # Only real updates advance the schedule and the EMA; a skipped step does not.
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.step + 1)
        else:
            self.skipped_steps += 1
        return {"loss_sum": loss_sum, "grad_norm": grad_norm, "sums": sums, "lr": lr}

    def _task_step(self, batches: list[Any], n_global) -> dict[str, Any]:
        """The task's own step (trainer/loop/custom_step.py): it steps its optimizers; the rest is the Trainer's."""
        step = TrainingStep(self, batches, n_global)
        lr = self.scheduler.get_last_lr()[0]  # (the first optimizer's, before its schedule steps)
        # Each part's rate too (as Lightning's LearningRateMonitor logs every optimizer's): train/lr_discriminator.
        part_lrs = {f"train/lr_{name}": s.get_last_lr()[0] for name, s in self.scheduler.schedulers.items()} \
            if isinstance(self.scheduler, Schedules) else {}
        loss, sums = split_loss(self.task.training_step(step))
        self.guard.record(bool(step.applied) and all(step.applied.values()), self.step + 1)  # (a part's NaN counts)
        self.model.zero_grad(set_to_none=True)  # what one part's loss left on another's parameters
        # A step where one part's update was skipped (fp16's overflow in the discriminator's) still changed the
        # others: the EMA follows them, and only a step that changed nothing counts as skipped (it counted as
        # skipped, the EMA missed the generator's update, and a run of such steps said its weights did not change).
        if any(step.applied.values()):
            if self.ema is not None:
                self.ema.update(self.step + 1)
        else:
            self.skipped_steps += 1
        return {"loss_sum": loss.detach(), "grad_norm": step.grad_norm(),
                "sums": {k: torch.as_tensor(v).detach().double() for k, v in sums.items()}, "lr": lr,
                "part_lrs": part_lrs}

    # -- eval ----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, prefix: str = "val") -> dict[str, float]:
        if self.data.val is None:
            return {}
        st, be = self.strategy, self.backend
        # Under FSDP or tensor parallelism a forward is a collective: every rank runs as many batches.
        batches = eval_batches(self.data.val, self.cfg.eval_batch_size or self.data.batch_size, st.dp_rank, st.dp_size,
                               self.cfg.eval_samples, be.device, lockstep=st.collective_forward)
        self.model.eval()
        acc = EvalSums(self.task, be.device)
        for batch, counted, indices in batches:
            batch = be.to_device(batch)
            # The raw module: DDP's forward would expect a backward to follow. Noise by val sample: the same
            # at every eval and on any number of ranks.
            with self.precision.autocast(), noise.for_samples(EVAL_STREAM + torch.tensor(indices), self.cfg.seed):
                outputs = acc.forward(self.raw_model, batch)
            if counted:  # (a rank's repeated lockstep batches under FSDP are run, not counted)
                acc.add(batch, indices, outputs)
            watchdog.beat()
        self.model.train()
        # Every rank reduces the same names (a rank without val samples has none of its own).
        names = sorted(set().union(*be.gather_object(sorted(acc.sums)))) if be.distributed else sorted(acc.sums)
        values = torch.stack([acc.totals[0], acc.totals[1], *(torch.as_tensor(acc.sums.get(n, 0.0),
                                                                               dtype=torch.float64, device=be.device)
                                                               for n in names)])
        loss_sum, count, *reduced = be.all_reduce(values, group=st.dp_group).tolist()
        if count == 0:
            return {}
        if not math.isfinite(loss_sum / count) and self.cfg.nonfinite == "stop":
            raise NonFiniteError(f"{prefix}/loss is {loss_sum / count} at step {self.step}: the model's outputs are no "
                                 f"longer finite. {FIX} Earlier checkpoints are intact.")
        scored = self._whole_set_metrics(acc.rows, acc.owned) if acc.predicts else None
        return acc.metrics(loss_sum, count, dict(zip(names, reduced)), scored, prefix)

    def _whole_set_metrics(self, rows: dict[str, list[torch.Tensor]], owned: list[int]) -> dict[str, float]:
        """`task.score(outputs)` over every val sample's `task.predict` rows, gathered from all ranks in sample order,
        each sample once (a rank's repeated lockstep batches are not among its rows). Computed on the main rank;
        every rank gets its result (early stopping and the best checkpoint read it)."""
        outputs = {name: self.backend.gather_samples(owned, torch.cat(parts)) for name, parts in sorted(rows.items())}
        return self._from_main(lambda: named_numbers(self.task.score(outputs), "score", self.task))

    def _from_main(self, compute: Callable[[], Any]) -> Any:
        """What the main rank computes alone (a task's score, its sample's metrics), on every rank; a refusal of what
        the task returned there is raised on every rank, where the others waited in the broadcast for ever."""
        result = None
        if self.backend.is_main:
            try:
                result = compute()
            except ConfigError as e:
                if not self.backend.distributed:
                    raise
                result = e
        result = self.backend.broadcast_object(result)
        if isinstance(result, ConfigError):
            raise result
        return result

    @torch.no_grad()
    def sample(self) -> dict[str, Any]:
        """The task's samples, from the EMA weights when EMA is on: a dict of named artefacts (text, images
        as tensors, numbers as metrics; a plain string is {"sample": text}). Computed on the main rank (on
        every rank when a forward is a collective); {} on the others."""
        if not hasattr(self.task, "sample") or not (self.backend.is_main or self.strategy.collective_forward):
            return {}
        self.model.eval()
        with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext(), self.precision.autocast():
            out = self.task.sample(self.raw_model, self.backend.device)
        self.model.train()
        if not self.backend.is_main or not out:
            return {}
        return dict(out) if isinstance(out, dict) else {"sample": out}

    def _eval_and_log(self, progress: Progress) -> dict[str, float]:
        self.guard.read(self.step)  # a run that hit a non-finite step stops before evaluating it
        prefix = "val_ema" if self.ema is not None else "val"
        try:
            with rng.kept():  # (an eval's samples draw tokens; a loader's iterator draws a seed)
                metrics = self.evaluate()
                if self.ema is not None:
                    with self.ema.swapped_in():
                        metrics.update(self.evaluate(prefix="val_ema"))
                samples = self.sample()
            # The main rank alone samples: every rank's early stopping and best checkpoint read these too (a rank
            # without them stopped for a monitor "not among the metrics" while the others trained on: a hang).
            numbers = self._from_main(lambda: {
                f"{prefix}/{name}": float(value) for name, value in check_sample(samples, self.task).items()
                if is_number(value)}) if hasattr(self.task, "sample") else {}
            twice = sorted(set(numbers) & set(metrics))  # (on every rank: the numbers are the main rank's, sent)
            if twice:  # (it replaced the eval's own, val/loss or a metric, in the logs and in what best_metric ranks)
                raise ConfigError(f"{type(self.task).__name__}.sample returned a metric {twice[0].split('/', 1)[1]!r}, "
                                  f"which the eval logs itself as {twice[0]}: name it otherwise.")
        except ConfigError as e:  # what a task's method returned, refused at its first eval: the steps so far are kept
            if getattr(e, "this_rank_only", False) and self.backend.distributed:
                raise  # (found by this rank alone, while the others wait in the eval's collectives: no save)
            raise self._saved_before(e) from None
        metrics.update(numbers)
        for name, value in samples.items():
            if is_number(value):
                continue  # (a metric: above)
            key = f"val/{name}"
            if isinstance(value, str):
                self.loggers.log_text(key, value, self.step)
                progress.write(f"--- {name} at step {self.step} ---\n{printable(redact_text(value))}\n---")
            else:  # (an image: check_sample took nothing else)
                self.loggers.log_image(key, value, self.step)
        if metrics:
            self.loggers.log_metrics(metrics, self.step)
            progress.write(f"step {self.step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            try:
                self.callbacks.on_eval_end(self, metrics)
            except ConfigError as e:  # (a monitor the evals lack)
                raise self._saved_before(e) from None
        return metrics

    # -- the loop ------------------------------------------------------------------------------
    def _log_due(self) -> bool:
        return self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps

    def _eval_due(self) -> bool:
        if "eval" in self.sample_periods:
            return self._reached(self.sample_periods["eval"]) and self.step < self.cfg.max_steps
        return self.cfg.eval_every > 0 and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.max_steps

    def _checkpoint_due(self) -> bool:
        if "checkpoint" in self.sample_periods:
            return self._reached(self.sample_periods["checkpoint"])
        return self.checkpointer.due(self.step)

    def _reached(self, period: int) -> bool:
        """Whether this step's samples reached the next multiple of `period` samples."""
        return self.samples_seen // period > (self.samples_seen - self.global_batch) // period

    def _train_metrics(self, out: dict[str, Any], n_global, meter: Throughput) -> dict[str, float]:
        """The log step's metrics: the loop's host syncs happen here, every log_every steps."""
        self.guard.read(self.step)
        rates = meter.window(self.global_batch)
        names = sorted(out["sums"])
        sums = torch.stack([out["loss_sum"].double(), *(out["sums"][n].to(out["loss_sum"].device) for n in names)])
        loss, *others = (self.backend.all_reduce(sums, group=self.strategy.dp_group) / n_global).tolist()
        unit = self.target_unit
        return {
            "train/loss": loss,
            **{f"train/{n}": v for n, v in zip(names, others)},
            "train/lr": out["lr"],  # the rate the step used (Lightning's LearningRateMonitor's), not the next one
            **out.get("part_lrs", {}),
            "train/grad_norm": float(out["grad_norm"]),
            **({} if unit == "samples" else {f"train/{unit}_per_s": rates["targets_per_s"]}),
            "train/samples_per_s": rates["samples_per_s"],
            "train/step_time_ms": rates["step_time_ms"],
            "train/skipped_steps": self.skipped_steps,
            **(self.cost.metrics(rates[self._flops_rate]) if self.cost else {}),
        }

    @property
    def _flops_rate(self) -> str:
        """Which throughput MFU counts the model's FLOPs per: targets (a token), or samples (task.flops_unit)."""
        return "samples_per_s" if getattr(self.task, "flops_unit", None) == "samples" else "targets_per_s"

    @property
    def target_unit(self) -> str:
        """What the task's num_targets counts ("tokens", "samples", ...; trainer/task.py)."""
        return getattr(self.task, "target_unit", "targets")

    def _preempted(self, first_step: int) -> None:
        """Every rank agreed at this step boundary: save (unless no step was taken), then stop with exit code 75."""
        if self.step == first_step:
            raise Preempted(f"stopped by {self._cause()} before the first step of this attempt (step {self.step}); "
                            "nothing new to save. Rerun the same command with resume=auto to continue.")
        if self.saved_step == self.step:  # the periodic save of this very step is in flight: finish it
            self.checkpoints.finish_pending()
            path = self.checkpointer.dir / f"step_{self.step:08d}"
        else:
            path = self.save_checkpoint(wait=True)
        raise Preempted(f"preempted by {self._cause()} at step {self.step}; checkpoint saved to {path}. "
                        "Rerun the same command with resume=auto to continue.")

    def note_late_stop(self, when: str) -> None:
        """A stop signal that came after the loop, while the export was written (which a signal does not cut short):
        the run is complete, so it ends as one, saying so. (It exited 75, "rerun to finish", and a scheduler requeued
        a finished job, whose rerun found nothing to do.)"""
        if self.preemption.requested and self.backend.is_main:
            print(f"note: {self._cause()} came {when}; the export was completed, so the run is finished.", flush=True)

    def _cause(self) -> str:
        signum = self.preemption.signum
        return signal.Signals(signum).name if signum else "a signal to another rank"

    def _check_no_parameters_appeared(self) -> None:
        """After this process's first step: parameters the model made in its forward (a layer built lazily there)
        are in no optimizer, so they never trained, while the export kept their random weights (and trainer.load
        then called the files another run's)."""
        known = {id(p) for p in self.params}
        born = [n for n, p in unwrap(self.model).named_parameters() if p.requires_grad and id(p) not in known]
        if born:
            raise UserError(f"the model made parameters in its forward ({', '.join(born[:4])}"
                            f"{', ...' if len(born) > 4 else ''}): they are in no optimizer, so they would never "
                            f"train. Build every layer in the model's __init__ (a size known only from the data: "
                            "pass it as a model setting). Nothing was saved.")

    def _check_user_states(self) -> None:
        """The task's and the callbacks' state_dict() as a checkpoint takes it, before the first step: one that holds
        what a checkpoint cannot (an object, a numpy array) was found at the first save, the final one where a run
        saves none before, and the whole run was lost."""
        from trainer.checkpoint.snapshot import flatten

        for name in ("task", "callbacks"):
            component = self.components.get(name)
            if component is not None and callable(getattr(component, "state_dict", None)):
                flatten(component.state_dict(), {}, False, f"/{name}")

    def fit(self) -> dict[str, float]:
        cfg, be = self.cfg, self.backend
        progress = Progress(cfg.max_steps, self.step, cfg.progress, self.target_unit) if be.is_main else NullProgress()
        batches_iter = iter(self.data.loader(self.sampler(), be.device, cfg.seed))
        installed_here = not self.preemption.installed
        self.preemption.install()
        self.model.train()
        meter, metrics, first_step = Throughput(), {}, self.step
        self._meter, self._fit_from = meter, first_step
        skipped_before = self.skipped_steps
        if self.cfg.compile and be.is_main:
            how = {k: v for k, v in compile_args(self.cfg).items() if v is not None}
            progress.write(f"compiling the model ({', '.join(f'{k}={v}' for k, v in how.items())}): the first steps "
                           "take longer.")
        try:
            evaluated_at, final, deferred, stop = None, {}, False, False
            while not self.finished:
                # A stop is taken here, before a step's batches are drawn: a dataset's random draws in this process
                # (an augmentation, data.num_workers=0) then stay the checkpoint's, and the resume is exact. (Stopped
                # after drawing them, the checkpoint kept generators past them: the resumed run drew other numbers.)
                # The ranks agree on a stop at the step's count (sync_counts), so one asked after its draws takes
                # that step first; one process alone reads its own flag.
                if stop or (not be.distributed and self.preemption.requested):
                    self._preempted(first_step)
                batches = [be.to_device(next(batches_iter)) for _ in range(cfg.grad_accum_steps)]
                n_global, stop = self.sync_counts(batches)
                if stop and self.step == first_step:  # (before this attempt trained anything: nothing to save, and
                    self._preempted(first_step)       # the draws it drops are in no checkpoint)
                out = self.train_step(batches, n_global)
                watchdog.beat()  # progress, for the hang watchdog (world.hang_timeout)
                if self.step == first_step:
                    self._check_no_parameters_appeared()
                    check_sum_names(out["sums"])
                self.step += 1
                self.samples_seen += self.global_batch
                meter.add(n_global)
                logged = self._log_due()
                if logged:
                    metrics = self._train_metrics(out, n_global, meter)
                    self.loggers.log_metrics(metrics, self.step)
                progress.update(self.step, metrics if logged else None)
                self.callbacks.on_step_end(self)
                evaluated = self._eval_and_log(progress) if self._eval_due() else None
                if evaluated is not None:
                    evaluated_at, final = self.step, evaluated
                # A checkpoint when one is due, and at every eval that beats the best (checkpoint.best_metric).
                # (at the last step the final save is this one, unless checkpoint.save_final=false)
                better = self._improves(evaluated)  # (first: a best_metric the evals lack is said, the step saved)
                saving = (self._checkpoint_due() or better) and not (
                    self.finished and self.checkpointer.save_final)
                # (checkpoint.save_final=false: a checkpoint due at the last step waits for the final eval after the
                # loop, so that it is ranked with it: saved without, a better last eval named no best)
                deferred = saving and self.finished and evaluated is None
                if saving and not deferred:
                    self.save_checkpoint(evaluated)
                if evaluated is not None or saving:
                    meter.restart()  # eval and saving are not training throughput

            if self.stop_reason and be.is_main:
                progress.write(f"stopping at step {self.step}: {self.stop_reason}", always=True)
            if evaluated_at != self.step:  # (a stop requested at an eval: that eval is the final one)
                final = self._eval_and_log(progress)
            if self.checkpointer.save_final:
                self._improves(final)  # (a best_metric the evals lack: said once the final checkpoint is saved)
                self.save_checkpoint(final, wait=True)
            elif deferred or self._improves(final):  # (the final eval is ranked as every eval is: saved if it beats)
                self.save_checkpoint(final, wait=True)
            self.checkpointer.close()  # surfaces a failed background save
            # After the final save, as Lightning's: a hook that raised there lost the whole run (no checkpoint).
            self.callbacks.on_fit_end(self, final)
        except BaseException:
            try:  # finish a save in flight, but keep the original error
                self.checkpointer.close()
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            if installed_here:
                self.preemption.uninstall()
            progress.close()
            # The loader's workers end with the fit (the process may go on: trainer.train from Python, a notebook),
            # not whenever the garbage collector reaches the objects that hold them.
            close = getattr(batches_iter, "close", None)
            if callable(close):
                close()
        summary = self._summary()
        if summary and be.is_main:
            print(summary_line(summary), flush=True)
        trained = self.step - first_step
        if trained and self.skipped_steps - skipped_before == trained and be.is_main:
            # (fp16's scaler skips a step whose gradients overflowed; a run of nothing but those exported its initial
            # weights with exit 0 and no word)
            print(f"warning: every one of this run's {trained} steps was skipped (its gradients were not finite: "
                  "under fp16, the loss scale overflowed them), so the weights did not change. Under fp16 lower "
                  "precision.init_scale, or train in bf16 or fp32.", flush=True)
        return {**metrics, **final, **summary}

    def trained(self) -> dict[str, Any]:
        """The run's training so far, over every attempt: steps, and their seconds and targets (up to the last step)."""
        meter, before = self._meter, self.trained_before
        if meter is None:
            return dict(before)
        seconds, targets = meter.totals()
        return {"steps": before["steps"] + self.step - self._fit_from, "seconds": before["seconds"] + seconds,
                "targets": before["targets"] + targets}

    def count_from_here(self) -> None:
        """A run started from another run's checkpoint: its summary counts its own training, not that run's."""
        self.trained_before = dict(NOTHING_TRAINED)

    def _summary(self) -> dict[str, float]:
        """Whole-run throughput and cost (training time only: eval and checkpoints excluded), over every attempt of
        the run up to the checkpoint each resumed from."""
        trained = self.trained()
        if self.step == self._fit_from or trained["seconds"] == 0:
            return {}
        rate = trained["targets"] / trained["seconds"]
        out = {"summary/steps": trained["steps"], "summary/train_time_s": trained["seconds"],
               f"summary/{self.target_unit}_per_s": rate}
        if self._flops_rate == "samples_per_s":  # (per sample: the steps' global batches over the same seconds)
            rate = trained["steps"] * self.global_batch / trained["seconds"]
            out["summary/samples_per_s"] = rate
        if self.skipped_steps:  # (fp16's overflowed steps, or nonfinite=skip's: counted in the steps, not applied)
            out["summary/skipped_steps"] = int(self.skipped_steps)
        if self.cost:
            out.update({k.replace("train/", "summary/"): v for k, v in self.cost.metrics(rate).items()})
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    # Keys of the run state a checkpoint written before them lacks (then they are not checked).
    OPTIONAL_STATE = ("data_identity", "epoch_batch", "trained")

    def state_dict(self) -> dict[str, Any]:
        """The run state: where the loop is, and what the data order depends on."""
        return {"step": self.step, "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                "global_batch": self.global_batch, "epoch_batch": self.epoch_batch or self.global_batch,
                "world_size": self.backend.world_size,
                "data_fingerprint": self.data.fingerprint(self.sampler()), "data_identity": self.data.identity(),
                "stop_reason": self.stop_reason, "trained": self.trained(),
                **self.data.position_state(self.sampler(), self.backend.gather_object)}  # a stream's readers

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.step, self.samples_seen, self.skipped_steps = state["step"], state["samples_seen"], state["skipped_steps"]
        self.stop_reason = state.get("stop_reason")
        if "trained" in state:
            self.trained_before = {k: state["trained"][k] for k in NOTHING_TRAINED}
        self.epoch_batch = state.get("epoch_batch", state["global_batch"])  # (written before it: the checkpoint's)
        note = self.data.load_position(state)  # a stream's readers continue where they stopped
        if note and self.backend.is_main:
            print(note, flush=True)

    def check_state(self, state: dict[str, Any], where: str = "the checkpoint") -> None:
        """Counts that are counts, and the same sample stream from the checkpoint's position on. The stream is
        the same whatever the global batch (data.batch_size x accumulation x data-parallel ranks): a resume with
        another global batch continues it at the same sample, with batches of the new size."""
        for key in ("step", "samples_seen", "skipped_steps", "global_batch", *(("epoch_batch",) if "epoch_batch" in state
                                                                            else ())):
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
                raise CheckpointError(f"{where}: trainer.{key}={value!r} is not a count.")
        for key in ("global_batch", "epoch_batch"):
            if state.get(key, 1) < 1:
                raise CheckpointError(f"{where}: trainer.{key}={state[key]!r} is not a batch size.")
        trained = state.get("trained", NOTHING_TRAINED)
        if not (isinstance(trained, dict) and all(
                isinstance(trained.get(k), (int, float)) and not isinstance(trained[k], bool)
                and math.isfinite(trained[k]) and 0 <= trained[k] < 2**62 for k in NOTHING_TRAINED)):
            raise CheckpointError(f"{where}: trainer.trained={trained!r} is not the run's training so far (steps, "
                                  "seconds and targets, each a number >= 0).")
        self.data.check_position(state, self.sampler(), where)  # the same data, continued where it stopped

    def resize_notes(self, state: dict[str, Any]) -> list[str]:
        """What a resume from run state `state` changes about the batches (the sample stream stays)."""
        if state["global_batch"] == self.global_batch:
            return []
        return [f"resume: the global batch changes from {state['global_batch']} to {self.global_batch} samples "
                f"(data.batch_size x trainer.grad_accum_steps x data-parallel ranks); the sample stream continues at "
                f"sample {state['samples_seen']}, with batches of the new size."]

    def _improves(self, evaluated: dict[str, float] | None) -> bool:
        """Whether this eval beats the best checkpoint. A best_metric that the evals do not have is a ConfigError,
        raised once this step's checkpoint is saved (without a best): the training so far is kept for a resume."""
        try:
            return self.checkpointer.improves(evaluated)
        except ConfigError as e:
            raise self._saved_before(e) from None

    def _saved_before(self, error: ConfigError) -> ConfigError:
        """A setting found wrong only at an eval (a metric the evals lack): the training so far is saved first, and
        the error says so, where stopping at once lost every step (with eval_every=0, the whole run)."""
        if self.checkpointer.save_final or self.checkpointer.every_n_steps:
            if self.saved_step == self.step:  # (this step's is saved, or being saved: finished, not saved twice)
                self.checkpoints.finish_pending()
            else:
                self.save_checkpoint(None, wait=True)
            return ConfigError(f"{error} The checkpoint of step {self.step} is saved: fix it and rerun with "
                               "resume=auto to continue.")
        return error

    def save_checkpoint(self, metrics: dict[str, float] | None = None, wait: bool = False) -> Path | None:
        """Save (in the background with checkpoint.async_save); `wait` before exiting the process."""
        self.guard.read(self.step)  # never save the state after a non-finite step
        path = self.checkpoints.save(self.step, metrics, wait)
        self.saved_step = self.step
        watchdog.beat()
        self.callbacks.on_save(self, path)
        return path

    def load_checkpoint(self, path: Path, resume: bool = True) -> list[str]:
        """Load a checkpoint (see CheckpointManager.load); returns what a user should know about the load."""
        return self.checkpoints.load(path, resume)


def printable(text: str) -> str:
    """`text` with control characters (a generated sample may hold any byte) shown as escapes, not sent to
    the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def summary_line(summary: dict[str, float]) -> str:
    """`summary: steps=10001 train_time_s=...`: counts as they are (`.4g` made 10001 steps "1e+04"), the rest to
    4 significant digits."""
    return "summary: " + " ".join(f"{k.split('/')[1]}={v if isinstance(v, int) else f'{v:.4g}'}"
                                  for k, v in summary.items())
