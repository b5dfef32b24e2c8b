"""Big-model inference: a model placed block by block on the GPUs, the CPU and disk, for a model larger than
any one of them (`trainer.load(PATH, device_map="auto", max_memory={"cpu": "2GB"}, offload_dir="/scratch")`).

The model is built with its parameters on the meta device (the buffers a constructor computes stay real), so
building it takes no memory. Its placement units are its repeated blocks (the classes in `_no_split_modules`,
the children of a ModuleList or Sequential whose children are all of one class) and the modules beside them
that hold no block (embeddings, final norm, head); a dict map's keys refine them. The units are placed in the
model's order on the GPUs by index, then the CPU, then disk, each filled up to its `max_memory` ("sequential";
"balanced" and "auto" first even out the GPUs). A unit that shares a tensor with an earlier one (a tied head)
goes where that one is.

Each tensor is then read from the safetensors files straight to its device, one tensor at a time, so the whole
model is never in memory. Files are read with `pread`, as everywhere in this framework (trainer/checkpoint/tensorfile.py:
a mapped file that shrinks under the reader kills the process with SIGBUS). A unit on disk is copied once into a
file of its own in `offload_dir` (its tensors 64-byte aligned, in the model's dtype), unlinked as soon as it is
created: the open descriptor keeps it, and nothing is left behind even if the process is killed. In a forward,
a disk unit's file is read whole with one `pread` into one of two buffers while the unit before it computes (a
background thread; `pread` releases the GIL); its tensors become views of that buffer for its forward and go
back to meta after it. So the CPU holds at most two disk units at once, and the placement keeps room for them.
Which unit comes next is learnt from the forward passes themselves (the model's order until then), so the
prefetch follows a generation loop from the last block back to the first.

Disk and CPU units compute on the CPU, GPU units on their GPU; forward pre-hooks move a unit's tensor inputs to
its device, and the model's outputs come back on its input's device. `model.device_map` is the placement
({unit: device}, as Hugging Face's `hf_device_map`); `print(model.device_map)` shows it with each unit's size.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import tempfile
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from trainer.errors import ConfigError, StorageError
from trainer.inference.placement import (
    ALIGN,
    CPU,
    DISK,
    STRATEGIES,
    _fill_order,
    _from_dict,
    _mb,
    _owner,
    budgets,
    check_map,
    device_name,
    plan,
    unit_sizes,
    units_of,
)


# -- building on the meta device ---------------------------------------------------------------------------------
@contextmanager
def params_on_meta():
    """Modules built inside have their parameters on the meta device (no memory); buffers stay real, so those a
    constructor computes (rotary frequencies) need no file."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":  # (a tied parameter is on meta already: keep it shared)
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    from trainer.parallel.materialize import SkipMetaInit

    nn.Module.register_parameter = on_meta
    try:
        with SkipMetaInit():  # (torch's fills of meta tensors import torch._dynamo: ~1 s and ~80 MB of RSS)
            yield
    finally:
        nn.Module.register_parameter = register


# -- streaming disk units ----------------------------------------------------------------------------------------
class _OnDisk:
    """A unit offloaded to a file: its tensors at aligned offsets, and where each goes in the modules."""

    def __init__(self, name: str, fd: int, nbytes: int, slots: list):
        self.name, self.fd, self.nbytes = name, fd, nbytes
        self.slots = slots  # [(offset, dtype, shape, [(module, attr, is_param, placeholder)])]

    def attach(self, buf: torch.Tensor) -> None:
        for offset, dtype, shape, refs in self.slots:
            t = buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            p = nn.Parameter(t, requires_grad=False)
            for module, attr, is_param, _ in refs:
                if is_param:
                    module._parameters[attr] = p
                else:
                    module._buffers[attr] = t

    def detach(self) -> None:
        for _, _, _, refs in self.slots:
            for module, attr, is_param, placeholder in refs:
                (module._parameters if is_param else module._buffers)[attr] = placeholder


class Streamer:
    """Reads disk units into two buffers: the one computing and the one prefetched on a background thread."""

    def __init__(self, units: list[_OnDisk]):
        self.units = units
        self.next = {u.name: units[(i + 1) % len(units)] for i, u in enumerate(units)}  # learnt as forwards run
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-prefetch")
        self.pending = None  # (unit, slot, future)
        self.active: _OnDisk | None = None
        self.last: _OnDisk | None = None
        self.bytes_read = 0

    def _read(self, unit: _OnDisk, slot: int) -> None:
        if self.buffers[slot] is None:
            self.buffers[slot] = torch.empty(max(u.nbytes for u in self.units), dtype=torch.uint8)
        view, got = memoryview(self.buffers[slot].numpy())[:unit.nbytes], 0
        while got < unit.nbytes:
            n = os.preadv(unit.fd, [view[got:]], got)
            if n == 0:
                raise StorageError(f"the offload file of {unit.name!r} came back short: its disk failed or was "
                                   "unmounted. Load the model again.")
            got += n
        self.bytes_read += unit.nbytes  # (never at once on two threads: the main one reads after result())

    def before(self, unit: _OnDisk) -> None:
        if self.active is not None:  # a forward that raised never ran the hook after it
            self.active.detach()
        if self.last is not None and self.last is not unit:
            self.next[self.last.name] = unit
        slot = 0
        if self.pending is not None:
            ahead, ahead_slot, done = self.pending
            self.pending = None
            done.result()  # (a wrong guess finishes too: then its buffer is free again)
            if ahead is unit:
                slot = ahead_slot
            else:
                self._read(unit, slot)
        else:
            self._read(unit, slot)
        unit.attach(self.buffers[slot])
        self.active = unit
        following = self.next[unit.name]
        if following is not unit:
            self.pending = (following, 1 - slot, self.pool.submit(self._read, following, 1 - slot))

    def after(self, unit: _OnDisk) -> None:
        unit.detach()
        self.active, self.last = None, unit

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for u in self.units:
            os.close(u.fd)


# -- the placed model --------------------------------------------------------------------------------------------
class DeviceMap(dict):
    """{unit: device} of a model placed by `trainer.load(..., device_map=...)` (its `model.device_map`);
    `print(model.device_map)` shows it, consecutive units on one device on one line, with their sizes."""

    def __init__(self, placement: dict[str, str], sizes: dict[str, int], streamer: Streamer | None,
                 main_device: torch.device):
        super().__init__(placement)
        self.sizes, self._streamer, self.main_device = sizes, streamer, main_device  # (inputs go to main_device)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the offload files by forwards so far."""
        return self._streamer.bytes_read if self._streamer else 0

    def __str__(self) -> str:
        rows, run = [], []
        for unit, device in [*self.items(), (None, None)]:
            if run and (device != run[0][1]):
                names = run[0][0] if len(run) == 1 else f"{run[0][0]} .. {run[-1][0]} ({len(run)} units)"
                rows.append((names or "(the whole model)", run[0][1], _mb(sum(self.sizes[u] for u, _ in run))))
                run = []
            if unit is not None:
                run.append((unit, device))
        width = max(len(r[0]) for r in rows)
        totals = {}
        for u, d in self.items():
            totals[d] = totals.get(d, 0) + self.sizes[u]
        lines = [f"{name.ljust(width)}  {dev:<7} {size:>12}" for name, dev, size in rows]
        return "\n".join([*lines, "total: " + ", ".join(f"{d} {_mb(n)}" for d, n in totals.items())])


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors in obj (nested tuples, lists, dicts) on `device`; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move(o, device) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _move(v, device)
        return out
    return obj


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return next((d for d in map(_first_device, items) if d is not None), None)


def _check_gpus(placement: dict[str, str]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for unit, device in placement.items():
        if device.startswith("cuda:") and int(device[5:]) >= count:
            raise ConfigError(f"the device map puts {unit!r} on {device}, but this machine has "
                              f"{count or 'no'} GPU{'s' if count != 1 else ''}: give max_memory without that GPU "
                              "(max_memory.cpu=...), or a map of the devices it has.")


def offload_scratch(offload_dir: str | os.PathLike) -> Path:
    """A fresh directory inside offload_dir; a missing or read-only offload_dir is one paragraph."""
    p = Path(offload_dir).expanduser()
    fix = "Give a directory on a disk with room for the offloaded blocks (create it first: mkdir -p DIR)."
    if not p.is_dir():
        raise ConfigError(f"offload_dir={offload_dir} {'is not a directory' if p.exists() else 'does not exist'}. "
                          f"{fix}")
    try:
        return Path(tempfile.mkdtemp(prefix="trainer-offload-", dir=p))
    except OSError as e:  # (a read-only place, or one such as /proc where no directory can be made)
        raise ConfigError(f"offload_dir={offload_dir}: could not make a directory in it ({e.strerror or e}). "
                          f"{fix}") from None


def _write(fd: int, data: torch.Tensor, offset: int) -> None:
    view, done = memoryview(data.reshape(-1).view(torch.uint8).numpy()), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _names_a_device(name) -> bool:
    """Whether `name` is a device a map can name (cpu, disk, cuda, cuda:N, a GPU index, a torch.device), whether or
    not this machine has it."""
    try:
        device_name(name, "device_map")
    except ConfigError:
        return False
    return True


@torch.no_grad()
def dispatch(model: nn.Module, read, device_map: str | Mapping, caps: dict[str, int],
             offload_dir: str | os.PathLike | None, copy=None) -> nn.Module:
    """Place `model` (built under params_on_meta) by `device_map` within `caps` (budgets()), its tensors read
    with `read(key) -> CPU tensor` (a state_dict key), and hook it up. `copy(key, dtype, fd, offset) -> bool`, if
    given, copies a tensor's bytes into an offload file without reading them into memory when the file holds
    them in `dtype`. Returns the model, in eval mode, with `model.device_map`."""
    model.eval()
    if not isinstance(device_map, Mapping) and device_map not in STRATEGIES and _names_a_device(device_map):
        device_map = {"": device_map}  # (transformers' device_map="cpu" or 0: the whole model there)
    if isinstance(device_map, Mapping):
        mapping = check_map(model, device_map)
        _check_gpus(mapping)  # (before a module it leaves out is named: a GPU this machine lacks comes first)
        units = units_of(model, tuple(mapping))
        placement = _from_dict(units, mapping)
    else:
        if device_map not in STRATEGIES:
            raise ConfigError(f"device_map={device_map!r} is not a strategy, a device or a map: write auto, "
                              "balanced, sequential, a device (cpu, cuda:0, disk: the whole model there), or "
                              "{module: device} ({'blocks.0': 'cpu', '': 'disk'}).")
        mapping = {}
        units = units_of(model)
        sizes, ties = unit_sizes(model, units)
        placement = plan(units, sizes, ties, caps, device_map)
    _check_gpus(placement)
    # Where each tensor lives: on the device of a unit that holds it and is not on disk, else in a disk file. A
    # weight tied between a unit on disk and one elsewhere (a dict map's embedding on disk, its head not) stays
    # with the other, read once; `sizes` becomes the bytes each unit holds so, which the map reports.
    state = model.state_dict(keep_vars=True)
    holders: dict[int, list[str]] = {}
    for key, t in state.items():
        holders.setdefault(id(t), []).append(key)
    sizes = dict.fromkeys(units, 0)
    for keys in holders.values():
        owners = [_owner(k, units) for k in keys]
        resident = [o for o in owners if o is None or placement[o] != DISK]
        for o in (resident[:1] if resident else dict.fromkeys(owners)):  # (each disk unit streams its own copy)
            if o is not None:
                sizes[o] += state[keys[0]].numel() * state[keys[0]].element_size()
    disk_units = [u for u in units if placement[u] == DISK and sizes[u]]
    if disk_units and offload_dir is None:
        raise ConfigError(f"the device map puts {len(disk_units)} units on disk ({', '.join(disk_units[:3])}"
                          f"{', ...' if len(disk_units) > 3 else ''}): give offload_dir=DIR, a directory for their "
                          "files, or raise max_memory.")
    main = next((torch.device(d) for d in sorted(set(placement.values()), key=_fill_order)
                 if d.startswith("cuda:")), torch.device(CPU))

    def runs_on(unit: str | None) -> torch.device:
        if unit is None:  # a tensor of a module that was split: where a dict map puts it, else the main device
            return main
        device = placement[unit]
        return torch.device(CPU if device == DISK else device)

    def refs(keys: list[str]) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
        out = []
        for key in keys:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner)
            is_param = attr in module._parameters
            out.append((module, attr, is_param, (module._parameters if is_param else module._buffers)[attr]))
        return out

    streamed: dict[str, list[list[str]]] = {}
    for keys in holders.values():
        owners = [_owner(k, units) for k in keys]
        resident = [o for o in owners if o is None or placement[o] != DISK]
        if not resident:  # each disk unit that holds it streams it for its own modules
            for o in dict.fromkeys(owners):
                streamed.setdefault(o, []).append([k for k, ok in zip(keys, owners) if ok == o])
            continue
        owner = resident[0]
        if owner is None and mapping:
            key = max((k for k in mapping if k == "" or keys[0].startswith(k + ".")), key=len, default=None)
            owner_device = torch.device(CPU if key is None or mapping[key] == DISK else mapping[key])
        else:
            owner_device = runs_on(owner)
        meta = state[keys[0]]
        t = read(keys[0]).to(dtype=meta.dtype).to(owner_device)
        p = nn.Parameter(t, requires_grad=False)
        for module, attr, is_param, _ in refs(keys):
            if is_param:
                module._parameters[attr] = p
            else:
                module._buffers[attr] = t
    # Buffers no file holds (computed by the constructor) go where their unit computes.
    for name, module in model.named_modules():
        for attr, b in module._buffers.items():
            if b is not None and f"{name}.{attr}".lstrip(".") not in state:
                module._buffers[attr] = b.to(runs_on(_owner(f"{name}.{attr}".lstrip("."), units)))

    streamer = None
    if streamed:
        scratch = offload_scratch(offload_dir)
        on_disk = []
        try:
            for unit in units:
                if unit not in streamed:
                    continue
                path = scratch / f"{unit or 'model'}.bin"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                path.unlink()  # the descriptor keeps the file until it is closed: nothing is left behind
                slots, offset = [], 0
                for keys in streamed[unit]:
                    meta = state[keys[0]]
                    try:
                        if copy is None or not copy(keys[0], meta.dtype, fd, offset):
                            _write(fd, read(keys[0]).to(dtype=meta.dtype).contiguous(), offset)
                    except OSError as e:
                        os.close(fd)
                        raise StorageError(f"writing the offloaded blocks to offload_dir={offload_dir} failed "
                                           f"({e.strerror or e}): give a directory with more room.") from None
                    slots.append((offset, meta.dtype, tuple(meta.shape), refs(keys)))
                    offset += -(-meta.numel() * meta.element_size() // ALIGN) * ALIGN
                os.ftruncate(fd, offset)  # (the last tensor's padding too: a block is read whole, padding included)
                on_disk.append(_OnDisk(unit, fd, offset, slots))
        except BaseException:
            for u in on_disk:
                os.close(u.fd)
            raise
        finally:
            scratch.rmdir()
        streamer = Streamer(on_disk)
        for u in on_disk:
            module = model.get_submodule(u.name)
            module.register_forward_pre_hook(lambda m, a, u=u: streamer.before(u))
            module.register_forward_hook(lambda m, a, o, u=u: streamer.after(u))
        weakref.finalize(model, streamer.close)

    devices = {runs_on(u) for u in units}
    if len(devices) > 1:  # activations follow the units; the outputs come back where the inputs were
        for u in units:
            device = runs_on(u)
            model.get_submodule(u).register_forward_pre_hook(
                lambda m, a, k, d=device: (_move(a, d), _move(k, d)), with_kwargs=True)
        came_from: list[torch.device | None] = []
        model.register_forward_pre_hook(lambda m, a, k: came_from.append(_first_device((a, k))), with_kwargs=True)

        def outputs_back(m, a, out):
            origin = came_from.pop() if came_from else None
            return _move(out, origin) if origin is not None else out

        model.register_forward_hook(outputs_back)
    model.device_map = DeviceMap(placement, sizes, streamer, main)
    return model


# -- the command line: python -m trainer sample|eval RUN_DIR device_map=auto max_memory.cpu=2GB offload_dir=DIR --
def cli_options(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(trainer.load's placement keywords, the other arguments) from `device_map=auto|balanced|sequential|{YAML
    map}`, `device_map.MODULE=DEVICE`, `max_memory.DEVICE=SIZE` (or `max_memory={YAML map}`), `offload_dir=DIR`
    and `show_map=true`. Empty when none is given."""
    from trainer.config.compose import flag_value, path_value, yaml_value

    out: dict[str, Any] = {}
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        head, dot, sub = key.partition(".")
        if not sep or head not in ("device_map", "max_memory", "offload_dir", "show_map"):
            rest.append(arg)
        elif head == "offload_dir" and not dot:
            out["offload_dir"] = path_value("offload_dir", value)
        elif head == "show_map" and not dot:
            out["show_map"] = flag_value("show_map", arg.partition("=")[2])
        elif dot and sub:  # one entry of a map (a module name keeps its dots)
            entries = out.setdefault(head, {})
            if not isinstance(entries, dict):
                raise ConfigError(f"{arg}: {head} was given as {entries!r} already; give the map or its entries.")
            entries[sub] = value if head == "max_memory" else yaml_value(arg)
        else:
            out[head] = yaml_value(arg)
            if out[head] is None:  # (`device_map=` or `=null`: a placement of nothing, a traceback at the load)
                raise ConfigError(f"{arg} is empty: give {head} a value ("
                                  + ("auto, a device such as cpu or cuda:0, or a map MODULE: DEVICE" if head == "device_map"
                                     else "a map DEVICE: SIZE, e.g. 'max_memory={cpu: 2GB}'")
                                  + f"), or leave {head} out.")
    if list(out) == ["show_map"]:  # the map of the default placement, or nothing asked
        out = {"show_map": True, "device_map": "auto"} if out["show_map"] else {}
    return out, rest


# -- trainer.load(..., device_map=...) ---------------------------------------------------------------------------
LABEL = "trainer.load path "


def _build_hf(path: Path) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(f"{path} is a Hugging Face model directory (config.json): building it needs transformers. "
                          "Install the hf extra: pip install -e '.[hf]'.") from None
    config = AutoConfig.from_pretrained(path)
    return AutoModelForCausalLM.from_config(config)


def load(path: str | os.PathLike, device_map: str | Mapping = "auto", max_memory: Mapping | None = None,
         offload_dir: str | os.PathLike | None = None, ema: bool = False) -> nn.Module:
    """The model of a finished run (or an export of one, or a Hugging Face model directory) placed by
    `device_map` within `max_memory`, disk units in `offload_dir`. See the module's docstring."""
    from trainer.inference import finished
    from trainer.models import pretrained

    p = Path(path).expanduser()
    caps = budgets(max_memory, offload_dir)  # (a size or device that does not parse stops here, before any work)
    if offload_dir is not None:
        offload_scratch(offload_dir).rmdir()
    if (p / "model_config.json").is_file():
        if ema and not finished.has_ema(p):
            raise ConfigError(f"{p} has no EMA weights (it was trained without ema.enabled); load it with ema=False.")
        with params_on_meta():
            model = finished.model_of(p)
    elif (p / "config.json").is_file():
        with params_on_meta():
            model = _build_hf(p)
    elif (p / "config.yaml").is_file():
        finished.model_of(p)  # its one-paragraph error: the run has no model_config.json
        raise AssertionError("unreachable")
    else:
        raise ConfigError(f"{p} is neither a finished run dir (model_config.json) nor a Hugging Face model directory "
                          "(config.json beside model.safetensors or its index). Pass one of those.")
    name = "model_ema" if ema else "model"
    weights = pretrained.open_weights(p, LABEL, name)
    finished.in_stored_dtype(model, {k: e.dtype for k, (_, e) in weights.entries.items()})
    try:
        keys = pretrained.match(model, weights, label=LABEL,
                                fix=f"They do not come from the model {p} describes, or one was edited.")

        def read(key: str) -> torch.Tensor:
            if key not in keys:  # a key the model lets the files lack (_keys_to_ignore_on_load_missing)
                raise ConfigError(f"{p} has no weights for {key}, which the model needs to be placed: load it "
                                  "without device_map.")
            file, entry = weights.entries[keys[key]]
            return weights.readers[file].tensor(entry)

        def copy(key: str, dtype: torch.dtype, fd: int, offset: int) -> bool:
            """The tensor's bytes from its file into an offload file, by the kernel (no copy in this process's
            memory), when the file holds it in `dtype`."""
            file, entry = weights.entries[keys[key]]
            if entry.dtype != dtype or not hasattr(os, "copy_file_range"):
                return False
            source, done, n = weights.readers[file]._file.fileno(), 0, entry.end - entry.begin
            try:
                while done < n:
                    step = os.copy_file_range(source, fd, n - done, entry.begin + done, offset + done)
                    if step == 0:
                        raise StorageError(f"{file} is shorter than when it was opened (truncated or replaced while "
                                           "it was read).")
                    done += step
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL) and done == 0:
                    return False  # (a kernel or file system that cannot: read and write instead)
                raise
            return True

        return dispatch(model, read, device_map, caps, offload_dir, copy)
    finally:
        weights.close()
