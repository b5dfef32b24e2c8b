"""Where each part of a model goes for big-model inference (trainer/inference/device_map.py): sizes and device
names as a user writes them (`max_memory={"cpu": "2GB"}`), the budgets, the placement units (the model's repeated
blocks and the modules beside them) and the plan that fills the GPUs by index, then the CPU, then disk."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from trainer.errors import ConfigError

STRATEGIES = ("auto", "balanced", "sequential")
CPU, DISK = "cpu", "disk"
ALIGN = 64  # each offloaded tensor starts on a cache line, as an allocation does
UNLIMITED = 1 << 62
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# -- sizes and devices ------------------------------------------------------------------------------------------
def parse_size(value: Any, where: str) -> int:
    """Bytes from 2000000000, "2GB" (10^9), "2GiB" (2^30), "1.5 TB", ... (as Accelerate reads them)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m and m.group(2).lower() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{where}={value!r} is not a size: write a number of bytes (2000000000) or a number with a "
                      "unit: 2GB (10^9 bytes), 2GiB (2^30), 500MB, 1.5TiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, "
                      "TiB).")


def device_name(key: Any, where: str) -> str:
    """'cuda:N', 'cpu' or 'disk' for what a map or max_memory may say: a GPU index (0 or "0"), cuda, cuda:N, cpu,
    disk."""
    if isinstance(key, torch.device):
        key = str(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return f"cuda:{key}"
    if isinstance(key, str):
        k = key.strip().lower()
        if k.isdigit():
            return f"cuda:{int(k)}"
        if k in (CPU, DISK):
            return k
        if k == "cuda":
            return "cuda:0"
        if re.fullmatch(r"cuda:\d+", k):
            return f"cuda:{int(k[5:])}"
    raise ConfigError(f"{where}: {key!r} is not a device. Write a GPU index (0, 1, ...), cuda:N, cpu or disk.")


def _fill_order(device: str) -> tuple[int, int]:
    return (0, int(device[5:])) if device.startswith("cuda:") else (1 if device == CPU else 2, 0)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budgets(max_memory: Mapping | None, offload_dir: str | os.PathLike | None) -> dict[str, int]:
    """{device: bytes it may hold} in fill order. Without max_memory: 90% of each GPU's free memory and of the
    available RAM. Disk: what max_memory says, else unlimited with an offload_dir and nothing without one."""
    if max_memory is None:
        out = {f"cuda:{i}": int(torch.cuda.mem_get_info(i)[0] * 0.9)
               for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)}
        out[CPU] = int(_available_ram() * 0.9)
    elif not isinstance(max_memory, Mapping):
        raise ConfigError(f"max_memory={max_memory!r} is not a mapping of devices to sizes: write e.g. "
                          "{'cpu': '2GB', 0: '10GiB', 'disk': '100GB'} (on the command line max_memory.cpu=2GB).")
    else:
        out = {}
        for key, value in max_memory.items():
            out[device_name(key, f"max_memory's key {key!r}")] = parse_size(value, f"max_memory.{key}")
    out.setdefault(DISK, UNLIMITED if offload_dir is not None else 0)
    return dict(sorted(out.items(), key=lambda kv: _fill_order(kv[0])))


def _mb(n: int, up: bool = False) -> str:
    """`n` bytes in MiB (GiB from 1 GiB); `up`: rounded up, for an amount asked for (1.04 MiB needed is "1.1 MiB",
    never the "1.0 MiB" the user may have given already)."""
    import math

    unit, digits = (2**20, 1) if n < 2**30 else (2**30, 2)
    value = math.ceil(n / unit * 10**digits) / 10**digits if up else n / unit
    return f"{value:,.{digits}f} {'MiB' if unit == 2**20 else 'GiB'}"


# -- placement units ---------------------------------------------------------------------------------------------
def _blocks(model: nn.Module) -> set[int]:
    """ids of the model's repeated blocks."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    out = set()
    for m in model.modules():
        if type(m).__name__ in names:
            out.add(id(m))
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.children())
            if len(kids) > 1 and len({type(k) for k in kids}) == 1:
                out.update(id(k) for k in kids)
    return out


def units_of(model: nn.Module, keys: tuple[str, ...] = ()) -> list[str]:
    """The placement units, in the model's order: each repeated block, each module beside them that holds no
    block, split further where a key of a dict map names a module inside one. "" is the whole model."""
    blocks = _blocks(model)

    def walk(prefix: str, module: nn.Module):
        finer = any(k.startswith(prefix + ".") if prefix else k != "" for k in keys)
        holds_block = any(id(m) in blocks for n, m in module.named_modules() if n)
        if not finer and (id(module) in blocks or not holds_block) or not any(True for _ in module.children()):
            yield prefix
            return
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)

    return list(walk("", model))


def _owner(key: str, units: list[str]) -> str | None:
    """The unit holding a state_dict key (the longest unit name it starts with)."""
    best = None
    for u in units:
        if (u == "" or key.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def unit_sizes(model: nn.Module, units: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """({unit: bytes of its state_dict tensors}, {unit: the earlier unit it shares a tensor with}); a shared
    tensor counts once, at its first holder."""
    sizes, ties, first = dict.fromkeys(units, 0), {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        u = _owner(key, units)
        if id(t) in first:
            if u is not None and first[id(t)] not in (None, u):
                ties.setdefault(u, first[id(t)])
            continue
        first[id(t)] = u
        if u is not None:
            sizes[u] += t.numel() * t.element_size()
    return sizes, ties


# -- placement ---------------------------------------------------------------------------------------------------
def plan(units: list[str], sizes: dict[str, int], ties: dict[str, str], caps: dict[str, int],
         strategy: str = "auto") -> dict[str, str]:
    """{unit: device}: the units in order on the devices of `caps` in order (GPUs, cpu, disk), each up to its cap.
    "balanced"/"auto" first lower each GPU but the last to an even share. When units go to disk, the CPU keeps room
    for two of them (the one computing, the one prefetched). Raises ConfigError when they do not fit."""
    gpus = [d for d in caps if d.startswith("cuda:")]
    caps = dict(caps)
    if strategy != "sequential" and len(gpus) > 1:
        share = math.ceil(sum(sizes.values()) / len(gpus)) + max(sizes.values(), default=0)
        for d in gpus[:-1]:
            caps[d] = min(caps[d], share)
    order, reserve = list(caps), 0
    while True:
        free = dict(caps)
        if CPU in free:
            free[CPU] -= reserve
        placed: dict[str, str] = {}
        i = 0
        for u in units:
            if u in ties and placed[ties[u]] != DISK:  # a tied head stays beside its embedding
                placed[u] = placed[ties[u]]
                free[placed[u]] -= sizes[u]
                continue
            while i < len(order) and sizes[u] > max(free[order[i]], 0):
                i += 1
            if i == len(order):
                raise _does_not_fit(units, sizes, caps, reserve, u)
            placed[u] = order[i]
            free[order[i]] -= sizes[u]
        need = 2 * max((sizes[u] for u in units if placed[u] == DISK), default=0)
        if need <= reserve:
            if reserve > caps.get(CPU, 0):
                raise _does_not_fit(units, sizes, caps, reserve, None)
            return placed
        reserve = need


def _does_not_fit(units, sizes, caps, reserve, unit) -> ConfigError:
    total, largest = sum(sizes.values()), max(sizes.values(), default=0)
    held = ", ".join(f"{d} {_mb(c) if c < UNLIMITED else 'unlimited'}" for d, c in caps.items())
    where = f"{unit!r} ({_mb(sizes[unit])}) is the first unit that fits nowhere" if unit is not None else \
        f"the CPU has less than the {_mb(reserve, up=True)} it needs for two disk units in flight"
    if caps.get(DISK, 0) > 0:  # offload_dir given: the disk is not what is short
        advice = (f"Raise max_memory.cpu to at least {_mb(2 * largest, up=True)}: disk offload (offload_dir is given) keeps two "
                  "units in flight on the CPU.")
    else:
        advice = (f"Raise max_memory for a device, or give offload_dir=DIR (a directory with room) for disk offload, "
                  f"which needs at least {_mb(2 * largest, up=True)} on the CPU (two units in flight) and max_memory.disk unset "
                  "or large enough.")
    return ConfigError(f"the model ({_mb(total)} in {len(units)} units, the largest {_mb(largest)}) does not fit "
                       f"max_memory ({held}): {where}. {advice}")


def check_map(model: nn.Module, device_map: Mapping) -> dict[str, str]:
    """A dict map's keys checked against the model's modules, its values as device names."""
    from trainer.errors import suggest

    modules = dict(model.named_modules())
    out = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or key not in modules:
            names = [n for n in modules if n]
            raise ConfigError(f"device_map names {key!r}, which is not a module of {type(model).__name__}.{suggest(str(key), names)} "
                              f"Its modules start {', '.join(names[:6])}, ...; '' is the whole model.")
        out[key] = device_name(value, f"device_map[{key!r}]")
    return out


def _from_dict(units: list[str], mapping: dict[str, str]) -> dict[str, str]:
    placed, missing = {}, []
    for u in units:
        key = max((k for k in mapping if k == "" or u == k or u.startswith(k + ".")), key=len, default=None)
        if key is None:
            missing.append(u)
        else:
            placed[u] = mapping[key]
    if missing:
        raise ConfigError(f"device_map places no device for {', '.join(missing[:6])}"
                          f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''}: give each module a device "
                          "(or a module that holds it; '' for the whole model).")
    return placed
