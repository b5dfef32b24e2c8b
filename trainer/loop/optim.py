"""Optimizers beyond a single torch.optim class: `optim=muon`.

torch.optim.Muon takes 2-D parameters only, and its authors use it for the hidden weight matrices alone:
embeddings, the output head and every norm and bias go to AdamW. `MuonAdamW` is that split as one
optimizer object (the Trainer, its checkpoints and LR schedules see one): it owns a torch.optim.Muon and
a torch.optim.AdamW that share its parameter groups and its state, so `state_dict`, `load_state_dict`
and the schedule's learning rates work as for any optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def output_layer(model: nn.Module) -> nn.Module | None:
    """The layer the model names as its output with `get_output_embeddings()` (Hugging Face's convention, which a
    model of one's own may follow), else None. (Not guessed: the last nn.Linear registered is a UNet's conditioning
    projection, and a guess that moved a layer between Muon and AdamW would leave earlier checkpoints unable to
    resume.)"""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return out if isinstance(out, nn.Module) and isinstance(getattr(out, "weight", None), torch.Tensor) else None


class MuonAdamW(torch.optim.Optimizer):
    """Muon (`lr`, `momentum`, `weight_decay`, ...) on the weights of the hidden nn.Linear layers: not the output
    layer the model names (`output_layer`) nor one tied to an embedding. AdamW (`adamw_lr`, `betas`, `eps`, the same `weight_decay`,
    none on 1-D parameters) on the rest, as Muon's authors prescribe: an output head orthogonalised trains worse."""

    @staticmethod
    def param_groups(model: nn.Module) -> list[dict[str, Any]]:
        """The split: hidden weight matrices for Muon; other matrices, then 1-D parameters, for AdamW."""
        embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        head = output_layer(model)
        if head is not None:
            embedded.add(id(head.weight))
        hidden = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad
                  and id(m.weight) not in embedded]
        taken = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
        groups = [{"params": hidden, "use_muon": True},
                  {"params": [p for p in rest if p.dim() >= 2], "use_muon": False},
                  {"params": [p for p in rest if p.dim() < 2], "use_muon": False, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.1, adamw_lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, fused: bool | None = None):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "use_muon": False})
        for g in self.param_groups:
            if not g["use_muon"] and g["lr"] == lr:
                g["lr"] = adamw_lr  # the schedule scales each group's own base LR
        self._muon_kwargs = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                             "weight_decay": weight_decay}
        self._adamw_kwargs = {"lr": adamw_lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                              "fused": fused}
        self._link()

    def _link(self) -> None:
        """The inner optimizers over this one's group dicts and state (again after load_state_dict made new ones)."""
        muon = [g for g in self.param_groups if g["use_muon"]]
        adamw = [g for g in self.param_groups if not g["use_muon"]]
        self._inner = []
        if muon:
            self._inner.append(torch.optim.Muon(muon, **self._muon_kwargs))
        if adamw:
            self._inner.append(torch.optim.AdamW(adamw, **self._adamw_kwargs))
        for opt in self._inner:
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()
