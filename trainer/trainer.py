"""The training loop. Components arrive built; the Trainer orders their calls and owns the run state."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import checkpoint as ckpt
from .backend import Backend
from .config import TrainerConfig
from .data import GlobalBatchSampler, eval_loader, train_loader
from .ema import EMA
from .errors import CheckpointError, Preempted
from .loggers import NullLogger
from .metrics import Cost
from .nonfinite import NonFiniteGuard
from .preemption import PreemptionFlag
from .progress import NullProgress, Progress
from .rng import rng_state, set_rng_state
from .task import Task


class Trainer:
    """Owns the loop: data order, the optimizer step, eval, logging and checkpoint cadence, run state.

    Everything stateful is reachable from `state_dict()`; a checkpoint is that plus the model weights.
    """

    def __init__(self, *, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, precision, backend: Backend,
                 train_data, val_data, batch_size: int, shuffle: bool, num_workers: int,
                 config: TrainerConfig, loggers: NullLogger | None = None, run_dir: str | Path = ".",
                 ema: EMA | None = None, checkpointer: ckpt.Checkpointer | None = None, config_yaml: str = "",
                 cost: Cost | None = None, guard: NonFiniteGuard | None = None):
        self.model, self.task, self.optimizer, self.scheduler = model, task, optimizer, scheduler
        self.precision, self.backend, self.cfg = precision, backend, config
        self.train_data, self.val_data = train_data, val_data
        self.batch_size, self.shuffle, self.num_workers = batch_size, shuffle, num_workers
        self.loggers = loggers or NullLogger()
        self.run_dir = Path(run_dir)
        self.ema, self.checkpointer, self.config_yaml, self.cost = ema, checkpointer, config_yaml, cost
        self.raw_model = backend.unwrap(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.preemption = PreemptionFlag()
        # Run state (in checkpoints).
        self.step = 0  # optimizer steps done (skipped fp16/nonfinite steps included)
        self.samples_seen = 0  # position in the global sample stream
        self.skipped_steps = 0
        self.guard = guard or NonFiniteGuard.build(config, precision.name, optimizer, backend)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.cfg.grad_accum_steps * self.backend.world_size

    def sampler(self) -> GlobalBatchSampler:
        return GlobalBatchSampler(len(self.train_data), self.batch_size, self.cfg.grad_accum_steps,
                                  self.backend.rank, self.backend.world_size, self.cfg.seed, self.shuffle,
                                  start=self.samples_seen)

    # -- the optimizer step --------------------------------------------------------------------
    def sync_counts(self, batches: list[Any]) -> tuple[Any, bool]:
        """Targets in the global batch, and whether any rank was asked to stop.

        Both are reduced in host memory (gloo), which never waits for the GPU; only a task that counts
        its targets on the device (a tensor) gets a second, asynchronous reduction there.
        """
        n_local = sum(self.task.num_targets(b) for b in batches)
        be = self.backend
        if not be.distributed:
            return n_local, self.preemption.requested
        on_device = isinstance(n_local, torch.Tensor)
        host = be.all_reduce(torch.tensor([0.0 if on_device else float(n_local), float(self.preemption.requested)],
                                          dtype=torch.float64), on_host=True).tolist()
        n_global = be.all_reduce(n_local.to(torch.float64)).float() if on_device else host[0]
        return n_global, host[1] > 0

    def train_step(self, batches: list[Any], n_global) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches. Returns device tensors (no host sync)."""
        model, opt, be, k = self.model, self.optimizer, self.backend, len(batches)
        # Token-weighted normalisation: each micro-batch's summed loss is divided by the number of
        # targets in the whole global batch (all micro-steps, all ranks). So k micro-batches of b
        # equal one batch of k*b even when batches differ in length. DDP averages gradients over
        # ranks, hence the factor world_size.
        scale = be.world_size / n_global
        loss_sum = None
        for i, batch in enumerate(batches):
            # Gradients are all-reduced only in the last micro-step's backward; earlier ones accumulate.
            with be.no_sync(model, enabled=i < k - 1), self.precision.autocast():
                loss = self.task.loss(model, batch)
            self.precision.backward(loss * scale)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        # Clip the true gradients: fp16 gradients are unscaled first.
        self.precision.unscale_(opt)
        if self.cfg.grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:
            grad_norm = nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        # The update, unless the norm is NaN/inf (trainer.nonfinite; see trainer/nonfinite.py).
        stepped = self.guard.step(self.precision, opt, grad_norm, self.step + 1)
        opt.zero_grad(set_to_none=True)
        if stepped:
            # Only real updates advance the schedule and the EMA; a skipped step does not.
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.step + 1)
        else:
            self.skipped_steps += 1
        return {"loss_sum": loss_sum, "grad_norm": grad_norm}

    # -- eval ----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, prefix: str = "val") -> dict[str, float]:
        if self.val_data is None:
            return {}
        be = self.backend
        loader = eval_loader(self.val_data, self.cfg.eval_batch_size or self.batch_size, be.rank,
                             be.world_size, self.cfg.eval_samples, 0, be.device)
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=be.device)  # [loss sum, targets]
        for batch in loader:
            batch = be.to_device(batch)
            with self.precision.autocast():
                # The raw module: DDP's forward would expect a backward to follow.
                totals[0] += self.task.loss(self.raw_model, batch).double()
            totals[1] += self.task.num_targets(batch)
        self.model.train()
        loss_sum, count = be.all_reduce(totals).tolist()
        if count == 0:
            return {}
        loss = loss_sum / count
        extra = self.task.eval_metrics(loss) if hasattr(self.task, "eval_metrics") else {}
        return {f"{prefix}/loss": loss, **{f"{prefix}/{k}": v for k, v in extra.items()}}

    @torch.no_grad()
    def sample(self) -> str | None:
        if not (self.backend.is_main and hasattr(self.task, "sample")):
            return None
        self.model.eval()
        with self.precision.autocast():
            text = self.task.sample(self.raw_model, self.backend.device)
        self.model.train()
        return text

    def _eval_and_log(self, progress: Progress) -> dict[str, float]:
        self.guard.read(self.step)  # a run that hit a non-finite step stops before evaluating it
        metrics = self.evaluate()
        if self.ema is not None:
            with self.ema.swapped_in():
                metrics.update(self.evaluate(prefix="val_ema"))
        if metrics:
            self.loggers.log_metrics(metrics, self.step)
            progress.write(f"step {self.step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        text = self.sample()
        if text:
            self.loggers.log_text("val/sample", text, self.step)
            progress.write(f"--- sample at step {self.step} ---\n{text}\n---")
        return metrics

    # -- the loop ------------------------------------------------------------------------------
    def _log_due(self) -> bool:
        return self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps

    def _eval_due(self) -> bool:
        return self.cfg.eval_every > 0 and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.max_steps

    def fit(self) -> dict[str, float]:
        cfg, be = self.cfg, self.backend
        progress = Progress(cfg.max_steps, self.step, cfg.progress) if be.is_main else NullProgress()
        batches_iter = iter(train_loader(self.train_data, self.sampler(), self.num_workers, be.device, cfg.seed))
        self.preemption.install()
        self.model.train()
        window_start, window_targets, window_steps = time.perf_counter(), 0, 0
        train_time, train_targets, first_step = 0.0, 0.0, self.step
        metrics: dict[str, float] = {}
        try:
            while self.step < cfg.max_steps:
                batches = [be.to_device(next(batches_iter)) for _ in range(cfg.grad_accum_steps)]
                n_global, stop = self.sync_counts(batches)
                if stop:  # every rank agrees on this step boundary
                    path = self.save_checkpoint(wait=True)
                    signum = self.preemption.signum
                    cause = signal.Signals(signum).name if signum else "a signal to another rank"
                    raise Preempted(f"preempted by {cause} at step {self.step}; checkpoint saved to {path}. "
                                    "Rerun the same command with resume=auto to continue.")
                out = self.train_step(batches, n_global)
                self.step += 1
                self.samples_seen += self.global_batch
                window_targets += n_global
                window_steps += 1

                if self._log_due():
                    # The loop's host syncs happen here, every log_every steps (and at eval and checkpoints).
                    self.guard.read(self.step)
                    elapsed = time.perf_counter() - window_start
                    train_time, train_targets = train_time + elapsed, train_targets + float(window_targets)
                    metrics = {
                        "train/loss": float(be.all_reduce(out["loss_sum"]) / n_global),
                        "train/lr": self.scheduler.get_last_lr()[0],
                        "train/grad_norm": float(out["grad_norm"]),
                        "train/tokens_per_s": float(window_targets) / elapsed,
                        "train/samples_per_s": window_steps * self.global_batch / elapsed,
                        "train/step_time_ms": 1000 * elapsed / window_steps,
                        "train/skipped_steps": self.skipped_steps,
                        **(self.cost.metrics(float(window_targets) / elapsed) if self.cost else {}),
                    }
                    self.loggers.log_metrics(metrics, self.step)
                    progress.update(self.step, metrics)
                    window_start, window_targets, window_steps = time.perf_counter(), 0, 0
                evaluated = self._eval_and_log(progress) if self._eval_due() else None
                if self.checkpointer is not None and self.checkpointer.due(self.step) and self.step < cfg.max_steps:
                    self.save_checkpoint(evaluated)
                if evaluated is not None or self.checkpointer is not None and self.checkpointer.due(self.step):
                    window_start = time.perf_counter()  # eval and saving are not training throughput

            final = self._eval_and_log(progress)
            if self.checkpointer is not None and self.checkpointer.save_final:
                self.save_checkpoint(final, wait=True)
            if self.checkpointer is not None:
                self.checkpointer.close()  # surfaces a failed background save
        except BaseException:
            if self.checkpointer is not None:  # finish a save in flight, but keep the original error
                try:
                    self.checkpointer.close()
                except Exception:  # noqa: BLE001
                    pass
            raise
        finally:
            self.preemption.uninstall()
            progress.close()
        summary = self._summary(self.step - first_step, train_time, train_targets)
        if summary and be.is_main:
            print("summary: " + " ".join(f"{k.split('/')[1]}={v:.4g}" for k, v in summary.items()), flush=True)
        return {**metrics, **final, **summary}

    def _summary(self, steps: int, seconds: float, targets: float) -> dict[str, float]:
        """Whole-run throughput and cost (training time only: eval and checkpoints excluded)."""
        if steps == 0 or seconds == 0:
            return {}
        out = {"summary/steps": steps, "summary/train_time_s": seconds, "summary/tokens_per_s": targets / seconds}
        if self.cost:
            out.update({k.replace("train/", "summary/"): v for k, v in self.cost.metrics(targets / seconds).items()})
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything but the model weights. A collective under DDP (gathers each rank's RNG state)."""
        return {
            "trainer": {"step": self.step, "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                        "global_batch": self.global_batch, "world_size": self.backend.world_size,
                        "data_fingerprint": self.sampler().fingerprint()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "loggers": self.loggers.state_dict(),
            "rng": self.backend.gather_object(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = state["trainer"]
        self.step, self.samples_seen, self.skipped_steps = t["step"], t["samples_seen"], t["skipped_steps"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        if self.ema is not None and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        self.loggers.load_state_dict(state.get("loggers") or {})
        rngs = state["rng"]
        if self.backend.rank < len(rngs):  # same world size: continue each rank's own stream
            set_rng_state(rngs[self.backend.rank])
        if self.sampler().fingerprint() != t["data_fingerprint"]:
            raise CheckpointError(
                f"the data order after step {self.step} differs from the checkpoint's (fingerprint "
                f"{self.sampler().fingerprint()} vs {t['data_fingerprint']}): the dataset, trainer.seed or "
                "data.shuffle changed. Resume with the checkpoint's config (its config.yaml) or start fresh with resume=null."
            )

    def save_checkpoint(self, metrics: dict[str, float] | None = None, wait: bool = False) -> Path | None:
        """Save (in the background with checkpoint.async_save); `wait` before exiting the process."""
        if self.checkpointer is None:
            return None
        self.guard.read(self.step)  # never save the state after a non-finite step
        state = self.state_dict()  # on every rank: it gathers RNG states
        if self.backend.is_main:
            self.checkpointer.save(self.step, self.raw_model.state_dict(), state, self.config_yaml, metrics)
            if wait:
                self.checkpointer.wait()
        if wait:  # nobody exits (and gets the job torn down) while rank 0 is still writing
            self.backend.barrier()
        return self.checkpointer.dir / f"step_{self.step:08d}"

    def load_checkpoint(self, path: Path) -> None:
        model_state, state = ckpt.load(path)
        ckpt.load_model_state(self.raw_model, model_state, path)
        self.load_state_dict(state)
