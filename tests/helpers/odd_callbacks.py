"""Callbacks with the mistakes a user makes, and an optimizer of a user's own (tests/test_callbacks_and_optimizers.py)."""

import torch


class RaisesAtFitEnd:
    def on_fit_end(self, trainer, metrics):
        raise RuntimeError("a callback's bug at the end of fit")


class StateWithoutLoad:
    n = 0

    def on_step_end(self, trainer):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}


class StateOfAnObject:
    def on_step_end(self, trainer):
        pass

    def state_dict(self):
        return {"obj": object()}

    def load_state_dict(self, state):
        pass


class PlainSGD(torch.optim.SGD):
    """An optimizer of a user's own that takes no `foreach` (optim=sgd's config sets it null)."""

    def __init__(self, params, lr=0.1, weight_decay=0.0):
        super().__init__(params, lr=lr, weight_decay=weight_decay)


def not_a_module(**settings):
    """A model factory returning a plain object (a user's class that forgot nn.Module)."""
    return object()


class TaskWithoutNumTargets:
    def __init__(self, **settings):
        pass

    def loss(self, model, batch):
        return model(batch[0]).sum()


class LazyLayer(torch.nn.Module):
    """A model that builds a layer in its first forward (a size known only from the data)."""

    def __init__(self, vocab_size: int = 256, d_model: int = 16, **settings):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.vocab_size, self.head = vocab_size, None

    def forward(self, idx):
        if self.head is None:
            self.head = torch.nn.Linear(self.embed.embedding_dim, self.vocab_size)
        return self.head(self.embed(idx))


class EvalEndWithoutMetrics:
    def on_eval_end(self, trainer):
        pass


def _language_modeling():
    from trainer.recipes.lm.task import LanguageModeling

    return LanguageModeling


class OldSetup(_language_modeling()):
    """A task whose setup has the signature before run_dir."""

    def setup(self, train, val):
        pass


class Ragged(torch.utils.data.Dataset):
    """Token sequences of three lengths (inputs and next-token targets): no batch of them stacks as they are."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.arange(i % 3 + 4) % 7
        return ids[:-1], ids[1:]


def ragged(**settings):
    """data._target_: Ragged train and val splits (the data node's keys, a path, taken and unused)."""
    return Ragged(), Ragged()


def pad(samples):
    """A collate_fn: Ragged's pairs padded to the longest with 0."""
    from torch.nn.utils.rnn import pad_sequence

    xs, ys = zip(*samples)
    return pad_sequence(xs, batch_first=True), pad_sequence(ys, batch_first=True)
