"""Pipeline parallelism (`world.pp=N`): the model's blocks split into stages on N ranks, run by a schedule of
torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV).

A model says how its forward splits with `_pp_plan` (as it says how it splits over tensor-parallel ranks with
`_tp_plan`): the method that runs before the blocks and the modules it uses, the ModuleList of blocks, and the
method that runs after them with its modules, such that `forward(x) == after(blocks(before(x)))`. The lm GPT's:

    _pp_plan = {"embed": ["tok_emb", "pos_emb", "drop"], "blocks": "blocks", "logits": ["ln_f", "head"]}

Every rank builds the whole model (the same weights as one process), then keeps its stages' parts: the first
stage the embedding, the last the head, each stage an equal run of blocks. The other parts are replaced by
`Elsewhere` (no parameters), so the parameters keep the plain model's names, and checkpoints and exports are
keyed like one process's. A module whose weight is tied to a kept one (the GPT's embedding and head) stays on
both stages; its gradients are summed over the pipeline ranks after backward, so the copies stay equal.

Training runs through the schedule (`forward_backward`): the task's loss is called once with a stand-in model
that records the model's inputs, which go to the first stage; the last stage calls the task's loss again, per
microbatch, with a stand-in that returns the stage's output, on that microbatch's rows of the batch. The loss
is the framework's summed loss times the step's scale, so the schedule must not scale gradients again
(`scale_grads=False`: its default divides them by the number of microbatches). Eval and sampling call the
model as one process would: its `forward` runs the stages in turn and hands every rank the output (a
collective forward, as under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from trainer.errors import ConfigError
from trainer.parallel.layout import SINGLE_STAGE, stages_per_rank

HOW_TO = ("Give the model class a `_pp_plan`: {'embed': [modules the method `embed` uses], 'blocks': 'name of "
          "the ModuleList of blocks', 'logits': [modules the method `logits` uses]}, with forward(x) == "
          "logits(blocks(embed(x))) (see the module trainer.recipes.lm.model, recipes/lm/model.py in a clone), or run without world.pp.")


class Elsewhere(nn.Module):
    """A part of the model that lives on another pipeline stage."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage (world.pp): call the model "
                           "itself, which runs every stage.")


def plan_of(model: nn.Module) -> tuple[str, list[str], str, str, list[str]]:
    """(before method, its modules, blocks' path, after method, its modules) of the model's `_pp_plan`."""
    # A model may compute its plan (`pipeline_plan()`: a transformers model, whose own `_pp_plan` has another format).
    plan = model.pipeline_plan() if callable(getattr(model, "pipeline_plan", None)) else getattr(model, "_pp_plan", None)
    if not isinstance(plan, dict) or len(plan) != 3 or "blocks" not in plan:
        raise ConfigError(f"world.pp needs to know where {type(model).__name__} splits into stages, and it has no "
                          f"usable _pp_plan. {HOW_TO}")
    (before, first), (after, last) = [(k, v) for k, v in plan.items() if k != "blocks"]
    for method in (before, after):
        if not callable(getattr(model, method, None)):
            raise ConfigError(f"{type(model).__name__}._pp_plan names the method {method!r}, which the model lacks. "
                              f"{HOW_TO}")
    blocks = model.get_submodule(plan["blocks"]) if isinstance(plan["blocks"], str) else None
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}._pp_plan['blocks']={plan['blocks']!r} is not a ModuleList of the "
                          f"model. {HOW_TO}")
    return before, list(first), plan["blocks"], after, list(last)


def check_model(model: nn.Module, pp: int, schedule: str) -> None:
    """Config mistakes visible on the model (built on the meta device, before workers start)."""
    _, _, blocks, _, _ = plan_of(model)
    n, stages = len(model.get_submodule(blocks)), pp * stages_per_rank(schedule)
    if stages > n:
        more = "" if schedule in SINGLE_STAGE else f" ({pp} ranks x {stages // pp} stages each for {schedule})"
        raise ConfigError(f"world.pp={pp} makes {stages} pipeline stages{more}, but {type(model).__name__} has "
                          f"{'only one block' if n == 1 else f'only {n} blocks'} ({blocks}) to split between them: every stage needs at least one. Lower world.pp"
                          f"{'' if schedule in SINGLE_STAGE else ', use world.pp_schedule=1F1B'} or use a deeper model.")


def split_blocks(n: int, stages: int) -> list[range]:
    """Consecutive runs of blocks, one per stage, as equal as they can be (the earlier stages get one more)."""
    size, extra = divmod(n, stages)
    out, start = [], 0
    for s in range(stages):
        out.append(range(start, start + size + (s < extra)))
        start = out[-1].stop
    return out


class StageModule(nn.Module):
    """One stage's forward: the model's `before` method on the first stage, its run of blocks, the `after` method
    on the last. Its parameters are exactly the stage's (the zero-bubble schedules compute weight gradients from
    them); the model itself is held outside the module tree."""

    def __init__(self, model: nn.Module, plan, blocks: range, first: bool, last: bool):
        super().__init__()
        before, before_modules, path, after, after_modules = plan
        self.__dict__["model"] = model  # not a submodule: its other parameters belong to other stages
        self.before, self.after, self.first, self.last = before, after, first, last
        self.blocks = nn.ModuleList(model.get_submodule(path)[i] for i in blocks)
        self.parts = nn.ModuleList([*(model.get_submodule(m) for m in before_modules if first),
                                    *(model.get_submodule(m) for m in after_modules if last)])

    def forward(self, *args, **kwargs):
        h = getattr(self.model, self.before)(*args, **kwargs) if self.first else args[0]
        # A model whose blocks need more than the hidden states (a transformers decoder layer: the mask and the
        # rotary embeddings) runs each through its `pipeline_block(block, h)`.
        run = getattr(self.model, "pipeline_block", None)
        for block in self.blocks:
            h = block(h) if run is None else run(block, h)
        return getattr(self.model, self.after)(h) if self.last else h


class _Captured(Exception):
    pass


class _StandIn:
    """Stands in for the model in a call of the task's loss; anything else the loss reads of the model
    (`model.training`, its config) is the model's."""

    def __init__(self, model: nn.Module):
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _Recorder(_StandIn):
    """In a first call of the task's loss: records the model's inputs, then stops it."""

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        raise _Captured


class _Replay(_StandIn):
    """On the last stage: the task's loss gets the stage's output as the model's."""

    def __init__(self, model: nn.Module, output):
        super().__init__(model)
        self.output = output

    def __call__(self, *args, **kwargs):
        return self.output


def _contiguous(x: Any) -> Any:
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def _rows(batch: Any, rows: torch.Tensor, n: int) -> Any:
    """The rows `rows` of every tensor of `batch` with `n` rows (the rest as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch[rows.to(batch.device)] if batch.dim() and batch.shape[0] == n else batch
    if isinstance(batch, dict):
        return {k: _rows(v, rows, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rows(v, rows, n) for v in batch)
    return batch


class Pipeline:
    """This rank's stages of the model, their schedule, and what pipeline parallelism adds to a step: the sum of
    tied weights' gradients over the stages, the gradient norm over every stage, and the whole model's state
    for checkpoints and exports. Built by the strategy in `setup` (once the mesh exists)."""

    def __init__(self, pp: int, schedule: str, microbatches: int, mesh, backend):
        self.pp, self.schedule_name, self.microbatches = pp, schedule, microbatches
        self.mesh, self.backend = mesh, backend
        self.group = mesh["pp"].get_group()
        self.pp_rank = mesh.get_local_rank("pp")
        self.ranks = mesh["pp"].mesh.tolist()  # the global rank of each pipeline rank of this rank's line
        self.num_stages = pp * stages_per_rank(schedule)
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        style = "v" if schedule in ("ZBVZeroBubble", "DualPipeV") else "loop"
        self.stage_rank = generate_stage_to_rank_mapping(pp, self.num_stages, style=style)
        self.my_stages = [s for s in range(self.num_stages) if self.stage_rank[s] == self.pp_rank]
        self.model: nn.Module | None = None
        self._schedule = None
        self._loss: Callable | None = None  # the current call's loss on the last stage (the schedule's loss_fn)
        self._sum_names: list[str] | None = None

    # -- splitting ------------------------------------------------------------------------------------------
    def split(self, model: nn.Module) -> None:
        """Keep this rank's stages of the whole `model`, in place; its forward becomes the pipelined one."""
        plan = plan_of(model)
        before, before_modules, path, after, after_modules = plan
        check_model(model, self.pp, self.schedule_name)
        blocks = model.get_submodule(path)
        runs = split_blocks(len(blocks), self.num_stages)
        self.stage_of_key = self._owners(model, plan, runs)
        # Tied weights (the embedding and the head): one tensor under several names, possibly on several ranks.
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.tied = [names for names in aliases.values() if len(names) > 1]
        if callable(getattr(model, "flops_per_token", None)):  # the whole model's, for MFU (before it is cut)
            flops = model.flops_per_token()
            model.flops_per_token = lambda: flops
        keep = {i for s in self.my_stages for i in runs[s]}
        kept = [*(before_modules if 0 in self.my_stages else []),
                *(after_modules if self.num_stages - 1 in self.my_stages else []),
                *(f"{path}.{i}" for i in sorted(keep))]
        used = {id(p) for m in kept for p in model.get_submodule(m).parameters()}
        for i in range(len(blocks)):
            if i not in keep:
                blocks[i] = Elsewhere()
        for name in before_modules + after_modules:
            if name in kept:
                continue
            module = model.get_submodule(name)
            if any(id(p) in used for p in module.parameters()):
                continue  # its weight is tied to a part of this stage (the head's to the embedding): it stays
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, Elsewhere())
        self.model = model
        self.held_keys = set(model.state_dict())  # this rank's stages' keys (a tied weight's on every stage holding it)
        self._params = dict(model.named_parameters(remove_duplicate=False))  # this rank's, by every name
        # This rank's tied parameters that a lower pipeline rank also holds: the clipping norm counts them there.
        self._copies = set()
        for names in self.tied:
            held = next((self._params[n] for n in names if n in self._params), None)
            if held is not None and min(self.stage_of_key[n] for n in names) < self.pp_rank:
                self._copies.add(id(held))
        self._tied_shapes: dict[str, torch.Tensor] = {}
        self.stages = [StageModule(model, plan, runs[s], s == 0, s == self.num_stages - 1) for s in self.my_stages]
        self.full_keys = list(self.stage_of_key)
        # The model's own forward, for eval and sampling, runs every stage (a collective of the pipeline ranks).
        model.forward = self.forward

    def _owners(self, model: nn.Module, plan, runs: list[range]) -> dict[str, int]:
        """The first pipeline rank holding each state_dict key of the whole model (the one that writes it)."""
        _, before_modules, path, _, after_modules = plan
        stage_of_block = {i: s for s, run in enumerate(runs) for i in run}
        owners = {}
        for key in model.state_dict(keep_vars=True):
            if key.startswith(path + "."):
                stage = stage_of_block[int(key[len(path) + 1:].split(".")[0])]
            elif any(key.startswith(m + ".") for m in before_modules):
                stage = 0
            elif any(key.startswith(m + ".") for m in after_modules):
                stage = self.num_stages - 1
            else:
                raise ConfigError(f"{type(model).__name__}'s {key!r} is in none of the parts its _pp_plan names, so "
                                  f"no pipeline stage would hold it. {HOW_TO}")
            owners[key] = self.stage_rank[stage]
        return owners

    # -- the training step ----------------------------------------------------------------------------------
    def _build_schedule(self):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [PipelineStage(m, s, self.num_stages, self.backend.device, group=self.group)
                  for m, s in zip(self.stages, self.my_stages)]
        cls = get_schedule_class(self.schedule_name)
        # scale_grads=False: the loss is already the framework's (summed, divided by the global target count).
        return cls(stages[0] if self.schedule_name in SINGLE_STAGE else stages, n_microbatches=self.microbatches,
                   loss_fn=lambda output, rows: self._loss(output, rows), scale_grads=False)

    def forward_backward(self, batch: Any, loss_fn: Callable, scale, autocast: Callable, mean: bool = False):
        """One micro-batch's forward and backward through the schedule, on every pipeline rank. Returns the
        loss (summed over the microbatches, or their mean with `mean`: a loss that is each microbatch's mean)
        and the task's other sums (every rank gets the last stage's)."""
        from trainer import noise
        from trainer.task import split_loss

        if self._schedule is None:
            self._schedule = self._build_schedule()
        recorder = _Recorder(self.model)
        with autocast():
            try:
                loss_fn(recorder, batch)
            except _Captured:
                pass
            else:
                raise TypeError("world.pp: the task's loss never called the model; the pipeline splits the model's "
                                "forward, so the loss must call model(...) once.")
        # Contiguous: the stages check their inputs' strides against the shapes they inferred (torch 2.11 does),
        # and a batch of windows sliced from one buffer (x = w[:-1]) has its rows a token apart too many.
        args = tuple(_contiguous(a) for a in recorder.args)
        kwargs = {k: _contiguous(v) for k, v in recorder.kwargs.items()}
        n = next(t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        if n % self.microbatches:  # (the Trainer checks data.batch_size before it starts; a loop of one's own here)
            from trainer.errors import UserError

            raise UserError(f"world.microbatches={self.microbatches} does not divide this batch's {n} rows: the "
                            "pipeline cuts each batch into that many equal microbatches (torch's would be uneven, "
                            "and a stage's rows would not match its targets'). Use a batch size that is a multiple "
                            f"of {self.microbatches}, or set world.microbatches to a divisor of it.")
        losses, sums = [], []

        def last_stage_loss(output, rows):
            with noise.rows(rows), autocast():  # the microbatch's rows of the batch, and of its samples' noise
                loss, extra = split_loss(loss_fn(_Replay(self.model, output), _rows(batch, rows, n)))
            losses.append(loss.detach() / per if mean else loss.detach())
            sums.append({k: torch.as_tensor(v).detach().double() for k, v in extra.items()})
            return loss * (scale / per if mean else scale)

        per = self.microbatches  # (the pieces each micro-batch is cut into)
        self._loss = last_stage_loss
        rows = torch.arange(n, device=self.backend.device)
        with autocast():
            if any(s == 0 for s in self.my_stages):
                self._schedule.step(*args, target=rows, **kwargs)
            else:
                self._schedule.step(target=rows)
        self._loss = None
        # The schedule's first step also calls the loss once to infer the gradients' shapes (on a throwaway
        # forward): only the last `microbatches` calls are the step's.
        return self._from_last_stage(losses[-self.microbatches:], sums[-self.microbatches:])

    def _from_last_stage(self, losses: list[torch.Tensor], sums: list[dict]) -> tuple[torch.Tensor, dict]:
        """The micro-batch's loss and sums, summed over its microbatches on the last stage, on every rank."""
        holder = self.ranks[self.stage_rank[self.num_stages - 1]]
        if self._sum_names is None:  # the task's sums' names, once (only the last stage has seen them)
            names = sorted(sums[0]) if sums else None
            self._sum_names = self.backend.gather_object(names, group=self.group)[self.stage_rank[self.num_stages - 1]]
        names = self._sum_names
        device = self.backend.device
        if losses:
            values = torch.stack([torch.stack(losses).double().sum(),
                                  *(sum(s[k].to(device) for s in sums) for k in names)])
        else:
            values = None
        # (shape and dtype known on every rank: one broadcast of the values)
        values = self.backend.broadcast_tensor(values, holder, self.group,
                                               like=torch.empty(1 + len(names), dtype=torch.float64))
        dtype = losses[0].dtype if losses else torch.float32
        return values[0].to(dtype), {k: v for k, v in zip(names, values[1:])}

    def reduce_tied(self) -> None:
        """Sum each tied weight's gradient over the pipeline ranks that hold a copy (zeros from the others): the
        whole model's gradient of that weight, on every copy, so the copies stay equal."""
        if not self.tied:
            return
        params = self._params
        for names in self.tied:
            held = next((params[n] for n in names if n in params), None)
            holders = {self.stage_of_key[n] for n in names}
            if len(holders) < 2:
                continue
            grad = held.grad if held is not None and held.grad is not None else None
            shape_of = self._tied_like(names)
            summed = self.backend.all_reduce(grad if grad is not None else torch.zeros_like(shape_of),
                                             group=self.group)
            if held is not None:
                held.grad = summed if grad is None else grad.copy_(summed)

    def _tied_like(self, names: list[str]) -> torch.Tensor:
        """Zeros shaped like a tied weight, for a pipeline rank that holds no copy (its shape asked once)."""
        key = names[0]
        if key not in self._tied_shapes:
            held = next((self._params[n] for n in names if n in self._params), None)
            meta = self.backend.gather_object(None if held is None else (tuple(held.shape), held.dtype),
                                              group=self.group)
            shape, dtype = next(m for m in meta if m is not None)
            self._tied_shapes[key] = torch.zeros(shape, dtype=dtype, device=self.backend.device)
        return self._tied_shapes[key]

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None, local_norm: Callable) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (every stage's; a tied weight counted once), clipped to
        `max_norm`. `local_norm(params, None)` measures a list of this rank's parameters (over its meshes)."""
        mine = [p for p in params if id(p) not in self._copies]
        square = local_norm(mine, None).double() ** 2 if mine else torch.zeros((), dtype=torch.float64)
        total = self.backend.all_reduce(square.to(self.backend.device), group=self.group).sqrt().float()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            from torch.distributed.tensor import DTensor

            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    # -- eval and sampling -----------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The whole model's forward, run stage by stage: each rank runs its stages and hands the activation on;
        every pipeline rank returns the last stage's output. Every pipeline rank must call it (a collective)."""
        h = None
        for s in range(self.num_stages):
            owner = self.stage_rank[s]
            if owner == self.pp_rank:
                h = self.stages[self.my_stages.index(s)](*args, **kwargs) if s == 0 else \
                    self.stages[self.my_stages.index(s)](h)
            if s + 1 == self.num_stages or self.stage_rank[s + 1] != owner:
                h = self.backend.broadcast_tensor(h if owner == self.pp_rank else None, self.ranks[owner], self.group)
        return h

    # -- checkpoints and exports -------------------------------------------------------------------------------
    def writer(self):
        """What this rank writes of a checkpoint: the tensors of the pipeline rank that owns them (a tied
        weight's by the first stage holding it; the state not tied to a parameter by the first pipeline rank),
        from the first rank of the stage's data- and tensor-parallel group; every stage's state tree merged."""
        from trainer.checkpoint.snapshot import Writer

        stage = self.mesh.mesh[self.pp_rank]  # this stage's ranks (its dp x tp group)
        root = int(stage.flatten()[0])
        return Writer(main=self.backend.rank == root, root=root, owns=self._owns, merge=merge_trees)

    def _owns(self, path: str) -> bool:
        for part in path.split("/"):  # a model key, or a state path naming one (/optimizer/state/KEY/exp_avg)
            if part in self.stage_of_key:
                return self.stage_of_key[part] == self.pp_rank
        return self.pp_rank == 0

    def restrict(self, model: dict, tree: Any) -> tuple[dict, Any]:
        """A checkpoint's model tensors and state tree (of the whole model: any layout wrote it) cut to what this
        rank's stages hold: the other stages' parameters, and their optimizer and EMA state, left out."""
        other = set(self.stage_of_key) - self.held_keys

        def cut(node):
            if isinstance(node, dict):
                return {k: cut(v) for k, v in node.items() if k not in other}
            if isinstance(node, list):
                if node and all(isinstance(v, str) for v in node) and any(v in self.stage_of_key for v in node):
                    return [v for v in node if v not in other]  # a parameter group's names
                return [cut(v) for v in node]
            return node

        return {k: v for k, v in model.items() if k not in other}, cut(tree)

    def full_state_dict(self, state: dict[str, torch.Tensor], whole: Callable) -> dict[str, torch.Tensor]:
        """Whole CPU tensors of every stage's `state` on the main rank ({} elsewhere), in the whole model's key
        order: each tensor from the first pipeline rank holding it (`whole` gathers a rank's own DTensor)."""
        out = {}
        for key in self.full_keys:
            owner = self.stage_of_key[key]
            mine = whole(state[key]) if owner == self.pp_rank else None
            t = mine if owner == 0 else self.backend.broadcast_tensor(mine, self.ranks[owner], self.group)
            if self.backend.is_main:
                out[key] = t.detach().to("cpu", copy=True).contiguous()
        return out


def merge_trees(trees: list[Any]) -> Any:
    """One state tree from the pipeline ranks' (in rank order): dicts united (a tensor's reference is the same
    on every rank; other values too: step counts, RNG states gathered from all), lists merged item by item,
    and a parameter group's names united in order."""
    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v) if k in a else v
            return out
        if isinstance(a, list) and isinstance(b, list):
            if all(isinstance(v, str) for v in a + b):
                return a + [v for v in b if v not in a]
            if len(a) == len(b):
                return [merge(x, y) for x, y in zip(a, b)]
        return a

    out = trees[0]
    for t in trees[1:]:
        out = merge(out, t)
    return out
