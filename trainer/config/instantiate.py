"""Config sections to objects: `hydra.utils.instantiate` with the section named in its error, and the sections
whose objects need more than that: the strategy (world without its launch keys), the (train, val) datasets
(checked for what the loaders can read) and the loggers. `trainer/entry/run.py` builds a whole run from these;
`trainer.Runtime` builds from them under `python -m trainer launch`. Torch is imported only when a section is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import LOADER_KEYS, strategy_options
from trainer.errors import ConfigError, DataError, TrainerExit, UserError, debug_enabled


def build_node(section: str, node: Any, *args, **kwargs) -> Any:
    """`hydra.utils.instantiate` with the config section named in the error instead of a traceback."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__ or e
        # Every line of the reason, as one paragraph: transformers' config validation puts it on the second line
        # ("Class validation error for validator ...:" then "ValueError: The hidden size (65) is not a multiple...").
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        detail = " ".join(lines).rstrip(".") if lines else type(cause).__name__
        if len(detail) > 1000:  # (a repr of a whole config, say: the start says what failed)
            detail = detail[:1000] + " ..."
        if isinstance(cause, TrainerExit):  # (a paragraph of its own already: a DataError, a full disk's)
            raise cause from None
        target = node.get("_target_", "?")
        at = raised_at(cause)
        if at is None:  # (from the call itself: a key the target does not take, a missing one)
            raise ConfigError(f"could not build '{section}' ({target}): {detail}. "
                              f"Check the keys under {section} (python -m trainer --cfg job).") from None
        # Raised inside the target's own code: its type and line, which a KeyError's bare "'paht'" lacked.
        raise ConfigError(f"could not build '{section}': {target} raised {type(cause).__name__}: {detail} (at {at}). "
                          f"The keys under {section} are what it was called with (python -m trainer --cfg job); "
                          "TRAINER_DEBUG=1 shows the traceback.") from (cause if debug_enabled() else None)


def raised_at(exc: BaseException) -> str | None:
    """`file:line, in function` of the innermost frame of `exc`'s traceback outside Python's library and installed
    packages (the code a config's `_target_` runs: a recipe's or the user's), or None where there is none."""
    import sysconfig
    import traceback

    library = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(library) and not f.filename.startswith("<")]
    if not frames:
        return None
    last = frames[-1]
    return f"{last.filename}:{last.lineno}, in {last.name}"


def build_strategy(world: DictConfig):
    """The strategy of `world._target_`, from world's keys but the launch keys."""
    return build_node("world", OmegaConf.create(strategy_options(world)))


def build_data(cfg: DictConfig) -> tuple[Any, Any]:
    """`data._target_` builds (train, val) datasets from every key of `data` except the loader keys."""
    from trainer.config.targets import locate, unused_nulls

    kwargs = {k: v for k, v in cfg.items() if k not in LOADER_KEYS}
    for key in unused_nulls(locate("data", cfg._target_), kwargs):
        del kwargs[key]  # (a null the target does not take: the data option's default for another target)
    splits = build_node("data", OmegaConf.create(kwargs))
    if not (isinstance(splits, tuple) and len(splits) == 2):
        raise DataError(f"data._target_={cfg._target_!r} must return a (train, val) pair of datasets; "
                        f"val may be None. It returned {type(splits).__name__}.")
    train, val = splits
    for name, split in (("training", train), ("val", val)):
        if split is not None:
            refuse_unsupported(name, split, cfg._target_)
    from trainer.data.streaming import is_stream, sized

    if is_stream(train):
        check_stream(train, cfg)
    if sized(train) == 0:
        raise DataError(f"the training split built by data._target_={cfg._target_!r} is empty.")
    return train, val


def check_stream(train: Any, cfg: DictConfig) -> None:
    """The settings an iterable training split cannot honour, refused while the data is built: shuffling (a stream
    is read in its own order), and epochs of a stream without __len__ (an epoch is a number of samples) or read in
    parts by several readers (whose parts wrap each on its own)."""
    from trainer.data.streaming import reads_parts, sized

    where = f"the training split built by data._target_={cfg._target_!r} is a stream ({type(train).__name__})"
    if cfg.get("shuffle", True):
        raise DataError(f"data.shuffle=true, but {where}: it is read in its own order, which the framework cannot "
                        "shuffle. Set data.shuffle=false, and shuffle inside the dataset if the order matters (per "
                        "pass: its set_epoch(n) is called before pass n; see README, Streaming data).")
    # The data node's siblings, where it is part of a run's config (build_data(cfg.data)); absent otherwise.
    epochs = [k for k in ("trainer.max_epochs", "trainer.eval_every_epochs", "checkpoint.every_n_epochs")
              if _sibling(cfg, k) is not None]
    from trainer.config.schema import nproc_per_node

    per_node = _sibling(cfg, "world.nproc_per_node") or 1
    try:  # ("auto", ddp's and fsdp's default: the GPUs of this node, else 1)
        per_node = nproc_per_node(per_node)
    except (ValueError, TypeError, UserError):
        per_node = 1
    processes = per_node * (_sibling(cfg, "world.nnodes") or 1)
    readers = max(1, cfg.get("num_workers", 0) or 0) * processes
    if epochs and reads_parts(train) and readers > 1:
        # Each reader starts its own part over when it ends, and the readers take turns: after __len__ samples a
        # small part was read several times and a large one not to its end (ids of a 6-sample part trained 3
        # times, the last 10 of a 30-sample part never, reported as "1.00 passes").
        raise DataError(f"{epochs[0]} is set, but {where} read in parts (read_part) by up to {readers} readers (data-"
                        "parallel processes x data.num_workers), each starting its own part over when it ends: "
                        "__len__ samples are then not one pass over the data unless every part is the same size. "
                        "Set trainer.max_steps (and trainer.eval_every, checkpoint.every_n_steps) instead, or read it "
                        "with one reader (data.num_workers=0 or 1, one process).")
    if sized(train) is None:
        if epochs:
            raise DataError(f"{epochs[0]} is set, but {where} without __len__, so it has no epochs. Set "
                            "trainer.max_steps (and trainer.eval_every, checkpoint.every_n_steps) instead: the stream "
                            "then starts over whenever it ends. Or give the dataset __len__ (the samples in one pass).")


def _sibling(node: DictConfig, key: str) -> Any:
    """`key` of the config that `node` is part of (None when it is not part of one, or has no such key)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(node, f"..{key}", default=None)
    except OmegaConfBaseException:
        return None


def refuse_unsupported(name: str, split: Any, target: str) -> None:
    """A DataError for a split the loaders cannot read: a map-style dataset needs __len__ and __getitem__ (samples are
    drawn by index from one global sample stream), an IterableDataset is read as a stream (trainer/data/streaming.py), a
    val stream needs __len__ (each eval reads its first trainer.eval_samples, every rank its share), and a DataLoader
    is refused. Raised while the datasets are built, before any worker starts (the CLI then removes the run dir it
    had begun)."""
    from torch.utils.data import DataLoader, IterableDataset

    where = f"the {name} split built by data._target_={target!r}"
    why = ("the loaders draw samples by index from one global sample stream (the same global batches on any number "
           "of processes, exact resume), so a split must be a map-style dataset, with __len__ and __getitem__, or an "
           "IterableDataset (a stream)")
    if isinstance(split, IterableDataset):
        from trainer.data.streaming import sized

        if name == "val" and sized(split) is None:
            raise DataError(f"{where} is an IterableDataset ({type(split).__name__}) without __len__: every eval reads "
                            "a val stream from its start, each rank its share of the first trainer.eval_samples, "
                            "which needs its length. Give it __len__, or return the val samples as a list (they are "
                            "read whole at every eval anyway).")
        return
    if isinstance(split, DataLoader):
        raise DataError(f"{where} is a DataLoader: return its dataset instead ({type(split.dataset).__name__}); "
                        f"batching, shuffling and workers come from data.batch_size, data.shuffle and "
                        f"data.num_workers, and {why}.")
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(split, m)
               and not (m == "__getitem__" and hasattr(split, "__getitems__"))]  # (a whole batch at once is enough)
    if missing:
        raise DataError(f"{where} ({type(split).__name__}) has no {' or '.join(missing)}: {why}. Return a torch "
                        "Dataset or a list of samples.")


def build_loggers(cfg: DictConfig, run_dir: Path, is_main: bool):
    """The main process's loggers: the JSONL file and every `logger` section; a NullLogger elsewhere."""
    from trainer.tracking.loggers import JsonlLogger, LoggerGroup, NullLogger

    if not is_main:
        return NullLogger()
    loggers = [JsonlLogger(run_dir)]
    for name, node in (cfg or {}).items():
        if node is not None:
            loggers.append(build_logger(name, node, run_dir))
    return LoggerGroup(loggers)


def build_logger(name: str, node: DictConfig, run_dir: Path):
    """The `logger.NAME` section's logger. One of one's own must subclass NullLogger: the run calls every method of
    it (a resume's `rewind`, a rollback's `take_branch`, ...), and a class without one failed there, mid-run."""
    from trainer.tracking.loggers import NullLogger

    logger = build_node(f"logger.{name}", node, run_dir=str(run_dir))
    if not isinstance(logger, NullLogger):
        raise ConfigError(f"logger.{name} ({node.get('_target_', '?')}) built a {type(logger).__name__}, which is not a "
                          "trainer.tracking.loggers.NullLogger: subclass it and override what your logger keeps "
                          "(log_metrics, log_text, log_image, log_config, finish; rewind for a resume; state_dict and "
                          "load_state_dict for what it must keep across one), so that every call the run makes on a "
                          "logger has a method (README: A logger of your own).")
    return logger
