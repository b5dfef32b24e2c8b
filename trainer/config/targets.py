"""`_target_`s: each one judged before it is imported (Hydra's instantiate policy and this framework's trust
model), imported, and its keys checked against its signature; and Hydra's own hooks (callbacks, log handlers,
environment settings) kept to what cannot run code. Run by `prepare` (trainer/config/compose.py) on every config,
before any process starts or any file is written."""

from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.config.schema import LAUNCH_KEYS, LOADER_KEYS, _check, launch_config
from trainer.errors import ConfigError, suggest


def iter_targets(node: Any, path: str = ""):
    """(key path, _target_) for every node of the config that will be instantiated, lists included."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path or "<root>", node._target_
        for k in node.keys():
            if OmegaConf.is_missing(node, k):
                continue
            yield from iter_targets(node[k], f"{path}.{k}" if path else str(k))
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            yield from iter_targets(v, f"{path}[{i}]")


def locate(key: str, target: Any, field: str = "_target_") -> Any:
    """Import a `_target_` that Hydra's instantiate policy and the config trust model allow (`refusal`);
    a ConfigError otherwise. The name is judged before anything is imported, then what it resolves to."""
    from hydra._internal.utils import _locate
    from hydra.errors import InstantiationException

    try:
        from hydra._internal.target_policy import _authorize_target_name
    except ImportError:  # Hydra without a target policy
        _authorize_target_name = None
    if not isinstance(target, str):
        raise ConfigError(f"{key}.{field}={target!r} is invalid: expected a dotted path such as mypkg.MyClass.")
    if _authorize_target_name is not None:
        try:
            _authorize_target_name(target, target, key)
        except InstantiationException:
            raise ConfigError(
                f"{key}.{field}={target!r} is refused: Hydra's instantiate blocklist forbids it because it "
                "can run commands or change files. Point _target_ at a model, dataset or loss class."
            ) from None
    trusted = allowed(target)
    if not trusted:
        refuse_if_untrusted(key, field, target, target)
    try:
        obj = _locate(target)
    except (ImportError, AttributeError, ValueError) as e:
        from trainer.checkpoint.settings import new_path

        if (moved := new_path(target)) is not None:
            raise ConfigError(f"{key}.{field}={target!r} moved to {moved!r} when trainer's modules became packages. "
                              f"Write {key}.{field}={moved}.") from None
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # A module that exists and raised while importing (a NameError in it): Hydra's message holds that error
        # above its last line, "Are you sure that module ... is installed?", which alone blamed the install.
        raised = [ln for ln in lines if re.match(r"\w+(Error|Exception)\(", ln) and
                  not ln.startswith(("ModuleNotFoundError", "ImportError"))]
        if raised:
            raise ConfigError(f"{key}.{field}={target!r}: its module raised while being imported ({raised[0]}). Fix "
                              "that module (python -c 'import MODULE' shows where).") from None
        reason = lines[-1] if lines else type(e).__name__
        raise ConfigError(
            f"{key}.{field}={target!r} cannot be imported ({reason}). Check the spelling, and that its "
            "module is importable (installed, or on PYTHONPATH)."
        ) from None
    if not trusted:
        for origin in origins(obj):
            if not allowed(origin):
                refuse_if_untrusted(key, field, target, origin)
    return obj


def check_targets(cfg: DictConfig) -> None:
    """Every `_target_` must pass the instantiate policy and import; the strategy must take world's options.

    Checked once in the parent, before any worker starts, so a typo or a refused target is one
    clear message instead of a traceback per rank. Imports the targets (and so torch).
    """
    found = [(key, locate(key, target)) for key, target in iter_targets(cfg)]  # the trust model first, for all
    for key, obj in found:
        node = OmegaConf.select(cfg, key) if key != "<root>" else cfg
        # The keys a target's call takes (a typo here would otherwise surface as a TypeError in every worker).
        extra = LOADER_KEYS if key == "data" else LAUNCH_KEYS if key == "world" else ()
        if isinstance(node, DictConfig):
            special = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
            parts = [k for k in node if isinstance(node[k], DictConfig)] if key in ("optim", "scheduler") else []
            keys = {k: node[k] for k in node if k not in special and k not in parts}
            if key in ("data", "optim"):  # (their builders leave these out of the call: a null is no value, and Hydra
                # cannot remove a null key, so an optimizer of one's own without `foreach` could not be used at all)
                keys = {k: v for k, v in keys.items() if k not in unused_nulls(obj, keys)}
            check_keywords(key, obj, keys, extra_ok=extra)
            if key in ("world", "task", "model", "data", "optim", "scheduler"):  # (else first used inside the
                check_scalar_types(key, obj, keys)  # workers, or at the first eval after the whole run has trained)
            for part in parts:  # optim.generator: {lr: ...}: the base target's keys, for one part (per_part)
                if "_target_" not in node[part]:
                    own = {k: node[part][k] for k in node[part] if k not in special}
                    check_keywords(f"{key}.{part}", obj, own)
                    check_scalar_types(f"{key}.{part}", obj, own)
    strategy = locate("world", cfg.world._target_)
    if cfg.trainer.compile:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        _check(cfg.trainer.compile_backend in backends, "trainer.compile_backend", cfg.trainer.compile_backend,
               f"one of torch.compile's backends: {', '.join(backends)}", "inductor is the usual one.")
        if cfg.trainer.compile_mode is not None or cfg.trainer.compile_options:
            import typing

            import torch._inductor
            import torch._inductor.config as inductor

            modes = list(torch._inductor.list_mode_options())
            _check(cfg.trainer.compile_mode in (None, *modes), "trainer.compile_mode", cfg.trainer.compile_mode,
                   f"one of torch.compile's modes: {', '.join(modes)}")
            names = torch._inductor.list_options()
            for name, value in (compile_args(cfg.trainer)["options"] or {}).items():
                if name not in names:
                    raise ConfigError(f"trainer.compile_options.{name} is not an option of inductor.{suggest(name, names)} "
                                      "torch._inductor.list_options() lists them (a dotted one, triton.cudagraphs, is "
                                      "written trainer.compile_options.triton.cudagraphs=...).")
                kind = inductor.get_type(name)
                if typing.get_origin(kind) is None and isinstance(kind, type) and not isinstance(value, kind):
                    _check(False, f"trainer.compile_options.{name}", value, f"a {kind.__name__} (inductor's type for it)")
    procs = launch_config(cfg.world)
    if procs.device.startswith("cuda"):
        from trainer.parallel.backend import usable_device

        usable_device(procs.device)
    if not getattr(strategy, "distributed", True):
        _check(procs.nproc_per_node in (1, "auto") and procs.nnodes == 1, "world.nproc_per_node",
               procs.nproc_per_node, f"1 with world._target_={cfg.world._target_}",
               "Use world=ddp (or world=fsdp) to run several processes.")


def compile_args(t: Any) -> dict[str, Any]:
    """torch.compile's keyword arguments from `trainer.compile_*` (a TrainerConfig or its DictConfig). Options are
    inductor's dotted names: a nested key is one of them (triton: {cudagraphs: true} is triton.cudagraphs) unless
    the path so far already names one whose value is a dict (post_grad_fusion_options: {...}); an int given to a
    float option is a float (Hydra reads 50 as an int, inductor checks the type). Torch is loaded where it is called."""
    if not t.compile_options:
        return {"backend": t.compile_backend, "mode": t.compile_mode, "options": None}
    import torch._inductor.config as inductor

    names = inductor.get_config_copy()
    options: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and name not in names:
                walk(value, f"{name}.")
                continue
            if name in options:
                raise ConfigError(f"trainer.compile_options sets {name} twice (nested and dotted): keep one.")
            if name in names and inductor.get_type(name) is float and type(value) is int:
                value = float(value)
            options[name] = value

    walk(OmegaConf.to_container(OmegaConf.create(dict(t.compile_options))), "")
    return {"backend": t.compile_backend, "mode": t.compile_mode, "options": options}


def call_refused(fn: Any, *args, **kwargs) -> TypeError | None:
    """Why a call of `fn` with these arguments would fail on its signature alone (None: it would not, or `fn` has no
    signature to read): code of one's own checked before the run reaches that call."""
    import inspect

    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        return e
    except ValueError:
        pass
    return None


def unused_nulls(target: Any, node: dict) -> set[str]:
    """The keys of `node` set to null that `target` does not take: a data config's `cache_dir: null` under your own
    `data._target_` (Hydra cannot remove a null key: ~data.cache_dir says it does not exist). They are left out
    of the call rather than refused: null says nothing to pass."""
    import inspect

    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set()
    return {k for k, v in node.items() if v is None and not str(k).startswith("_") and k not in params}


_SCALARS = {"bool": ("a bool (true or false)", lambda v: isinstance(v, bool)),
            "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
            "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))}


def check_scalar_types(section: str, target: Any, node: dict) -> None:
    """Each key whose parameter `target` annotates as bool, int or float (or one of them | None) must hold one: a
    string there ("maybe") was truthy (world.cpu_offload=maybe trained with offloading on), reached torch inside
    every worker as a traceback, or (task.num_samples=abc) failed at the first eval, after the run had trained."""
    import inspect

    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    for k, value in node.items():
        if k not in params:
            continue
        annotation = params[k].annotation
        kinds = [t.strip() for t in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
                                     ).split("|")]
        scalars = [t for t in kinds if t in _SCALARS]
        if not scalars or not set(kinds) <= {*_SCALARS, "None"}:  # (a list, a str, a mix: not judged here)
            continue
        if value is None and "None" in kinds:
            continue
        if not any(_SCALARS[t][1](value) for t in scalars):
            expected = " or ".join([_SCALARS[t][0] for t in scalars] + (["null"] if "None" in kinds else []))
            raise ConfigError(f"{section}.{k}={value!r} is invalid: expected {expected}.")


def check_keywords(section: str, target: Any, node: dict, extra_ok: tuple[str, ...] = ()) -> None:
    """Every key of `node` (but `_target_`, `_partial_`) must be a parameter of `target`'s signature."""
    import inspect

    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = []
    for k in node:
        if k in names and isinstance(node[k], str):
            # A string where the signature wants a list would be taken apart into characters ("baseline" ->
            # ['b', 'a', ...]) without a word: refuse it.
            annotation = str(params[k].annotation)
            if any(t in annotation for t in ("list", "tuple", "Sequence")) and "str |" not in annotation \
                    and not annotation.startswith("str"):
                raise ConfigError(f"{section}.{k}={node[k]!r} is invalid: expected a list, e.g. {section}.{k}=[{node[k]}].")
        if k.startswith("_") or k in extra_ok or k in names:
            continue
        unknown.append(str(k))
    if not unknown:
        return
    # Every key it does not take at once (a new optimizer class under the old one's betas and fused: two keys).
    takes = ", ".join(dict.fromkeys([n for n in names if n not in ("self", "params", "run_dir")] + list(extra_ok)))
    cls = getattr(target, "__qualname__", target)
    if len(unknown) == 1:
        k = unknown[0]
        raise ConfigError(f"{section}.{k} is not an option of {section}._target_={cls}.{suggest(k, [*names, *extra_ok])} "
                          f"It takes: {takes or '(nothing)'}. Remove the key with ~{section}.{k}.")
    raise ConfigError(f"{', '.join(f'{section}.{k}' for k in unknown)} are not options of {section}._target_={cls}. It "
                      f"takes: {takes or '(nothing)'}. Remove the keys with {' '.join(f'~{section}.{k}' for k in unknown)}.")


# -- the config trust model ------------------------------------------------------------------------------
# A config is data, but `_target_` makes it call Python, and configs come from elsewhere: a shared
# --config-dir, a colleague's recipe, an interpolation of the environment. So a config may name model,
# dataset, loss, optimizer, schedule and logger classes and functions from any module, but not the families
# below: what deserialises (unpickling runs code), runs commands or code, writes files at a path the config
# chooses, or opens connections. A name is refused when it, or any dotted prefix of it, is listed, and so is
# a target whose definition (`origins`) is: a re-export (`from os import system as run`) is judged by what
# it is. This guards against the known ways in; it is not a sandbox: an allowed class still does whatever its
# code does with the arguments the config gives it. A user allows a name on purpose with the environment
# variable TRAINER_ALLOW_TARGETS (the environment, so that a config cannot allow itself).
ALLOW_TARGETS_ENV = "TRAINER_ALLOW_TARGETS"

REFUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "deserialises data, and unpickling runs code": (
        "pickle", "_pickle", "cPickle", "pickletools", "copyreg", "dill", "cloudpickle", "joblib", "marshal",
        "shelve", "dbm", "jsonpickle", "yaml", "ruamel", "torch.load", "torch.serialization", "torch.jit.load",
        "torch.jit._serialization", "torch.package", "torch.export.load", "torch.hub", "torch.utils.model_zoo",
        "numpy.load", "numpy.lib.npyio", "numpy.lib._npyio_impl", "numpy.lib.format", "numpy.lib._format_impl",
        "pandas.read_pickle", "pandas.io.pickle",
    ),
    "runs commands, other programs or code": (
        "_sitebuiltins", "os", "posix", "nt", "posixpath", "ntpath", "genericpath", "subprocess",
        "_posixsubprocess", "pty", "tty", "termios", "fcntl", "resource", "signal", "_signal", "sys", "atexit",
        "faulthandler", "ctypes", "_ctypes", "cffi", "multiprocessing", "_multiprocessing", "_posixshmem",
        "concurrent", "asyncio", "_thread", "importlib", "_imp", "_frozen_importlib",
        "_frozen_importlib_external", "zipimport", "pkgutil", "runpy", "code", "codeop", "pdb", "bdb", "trace",
        "profile", "cProfile", "timeit", "doctest", "unittest", "pytest", "_pytest", "pydoc", "inspect", "gc",
        "site", "compileall", "py_compile", "zipapp", "venv", "ensurepip", "pip", "setuptools", "distutils",
        "_distutils_hack", "pkg_resources", "antigravity", "this", "webbrowser", "hydra",
        "torch.utils.cpp_extension", "torch.ops.load_library", "torch._ops._Ops.load_library",
        "torch.classes.load_library", "torch._classes._Classes.load_library", "torch.multiprocessing",
        "torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
        "torch.distributed.elastic", "torch.distributed.rpc", "numpy.f2py", "numpy.distutils", "numpy.ctypeslib",
        "trainer.entry.cli", "trainer.entry.commands", "trainer.entry.launcher", "trainer.entry.worker", "trainer.__main__",
    ),
    "writes files at a path the config chooses": (
        "io", "_io", "pathlib", "shutil", "tempfile", "fileinput", "tarfile", "zipfile", "gzip", "bz2", "lzma",
        "sqlite3", "_sqlite3", "mailbox", "wave", "aifc", "sunau", "mmap", "readline", "logging.FileHandler",
        "logging.basicConfig", "logging.handlers", "logging.config", "omegaconf", "torch.save", "torch.from_file",
        "torch.UntypedStorage.from_file", "torch.TypedStorage.from_file", "torch.storage", "torch.jit.save",
        "torch.export.save", "torch.onnx", "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt",
        "numpy.fromfile", "numpy.memmap", "numpy.ndarray.tofile", "numpy.ndarray.dump",
        "safetensors.torch.save_file", "safetensors.torch.save_model", "safetensors.numpy.save_file", "h5py",
        "pandas.HDFStore", "pandas.io.pytables", "pandas.ExcelWriter", "trainer.io", "trainer.models.export",
        "trainer.checkpoint.store", "trainer.entry.run",
    ),
    "opens network connections": (
        "socket", "_socket", "socketserver", "ssl", "_ssl", "select", "selectors", "http", "urllib", "urllib3",
        "requests", "httpx", "aiohttp", "ftplib", "smtplib", "poplib", "imaplib", "nntplib", "telnetlib", "xmlrpc",
        "wsgiref",
    ),
}
_REFUSED = {name: why for why, names in REFUSED_TARGETS.items() for name in names}
# Of `builtins`, only plain types and pure functions: open, exec, eval, compile, __import__, getattr, input,
# breakpoint, ... are refused.
SAFE_BUILTINS = frozenset({"bool", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range", "set",
                           "slice", "str", "tuple", "abs", "divmod", "enumerate", "len", "max", "min", "pow",
                           "reversed", "round", "sorted", "sum", "zip"})
# Hydra's own launcher and sweeper (hydra/launcher=basic) and its logging-only callbacks.
KEPT_TARGETS = ("hydra._internal.core_plugins", "hydra.experimental.callbacks.LogJobReturnCallback",
                "hydra.experimental.callbacks.LogComposeTimeCallback")


def refusal(name: str) -> str | None:
    """What calling the dotted `name` would do that a config may not ask for; None when it may be a target."""
    parts = name.split(".")
    if parts[0] in ("builtins", "__builtin__"):
        if len(parts) == 2 and parts[1] in SAFE_BUILTINS:
            return None
        return "is a Python builtin that is not a plain type (open, exec, eval, compile, __import__, getattr, ...)"
    if _kept(name):
        return None
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return next((_REFUSED[p] for p in prefixes if p in _REFUSED), None)


def _kept(name: str) -> bool:
    return any(name == k or name.startswith(k + ".") for k in KEPT_TARGETS)


def allowed(name: str) -> bool:
    """Whether TRAINER_ALLOW_TARGETS (comma-separated dotted names or modules) allows `name` on purpose."""
    entries = [e.strip() for e in os.environ.get(ALLOW_TARGETS_ENV, "").split(",") if e.strip()]
    return any(name == e or name.startswith(e + ".") for e in entries)


def origins(obj: Any) -> list[str]:
    """The dotted names `obj` is defined under (a function's module, a class's module, a bound method's
    owner), so that an alias re-exported by another module is judged by what it is."""
    import functools
    import types

    if isinstance(obj, types.ModuleType):
        return [obj.__name__]
    if isinstance(obj, functools.partial):
        return origins(obj.func)
    names = []
    name, owner = getattr(obj, "__name__", None), getattr(obj, "__self__", None)
    if isinstance(owner, types.ModuleType):  # C functions (posix.system) and functions bound to a module
        names.append(f"{owner.__name__}.{name}")
    elif owner is not None and isinstance(name, str):  # bound methods: of a class, or of an instance
        cls = owner if isinstance(owner, type) else type(owner)
        names.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    if getattr(obj, "__func__", None) is not None:
        names += origins(obj.__func__)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        names.append(f"{module}.{qualname}")
    elif not names:  # an instance: judged by its class
        names.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return names


def refuse_if_untrusted(key: str, field: str, target: str, name: str) -> None:
    why = refusal(name)
    if why is None:
        return
    what = "" if name == target else f" (it is {name})"
    raise ConfigError(
        f"{key}.{field}={target!r} is refused{what}: it {why}, which the config trust model's blocklist keeps "
        f"configs from doing. Point {field} at a model, dataset or loss class, or, if you trust this config, "
        f"allow it on purpose in the environment: {ALLOW_TARGETS_ENV}={target} (comma-separated dotted names or "
        "modules)."
    )


# What Hydra builds from its own `hydra` node before the job starts.
# The files Hydra's own logging options write: the job log in the run dir, and hydra/hydra_logging=hydra_debug's.
HYDRA_LOG_FILES = ("${hydra.runtime.output_dir}/${hydra.job.name}.log", "hydra-${hydra.job.name}.log")
LOG_HANDLERS = ("logging.StreamHandler", "logging.NullHandler")
LOG_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
# hydra.job.env_set may not set what decides which code runs: the allow switches, and the search paths of
# programs, shared libraries, Python modules, compilers and compiled-kernel caches.
ENV_SET_REFUSED = frozenset({ALLOW_TARGETS_ENV, "HYDRA_INSTANTIATE_ALLOWLIST_OVERRIDE", "PATH", "BASH_ENV", "ENV",
                             "CC", "CXX"})
ENV_SET_REFUSED_PREFIXES = ("LD_", "DYLD_", "PYTHON", "TORCHINDUCTOR_", "TRITON_")


def check_hydra_hooks(cfg: DictConfig) -> None:
    """The trust model for Hydra's own hooks, in `cfg` composed with `return_hydra_config=True`: every
    `_target_` under `hydra` (callbacks, launcher, sweeper); the handlers, filters and formatters of
    hydra.job_logging and hydra.hydra_logging (handlers: StreamHandler and NullHandler on sys.stdout or
    sys.stderr, and FileHandlers for Hydra's own logs, `HYDRA_LOG_FILES`; any other handler writes files or
    opens connections before training starts); hydra.job.name (a plain file name: it names the log);
    hydra.job.env_set; hydra.output_subdir."""
    raw = OmegaConf.to_container(cfg.hydra, resolve=False)

    def value(keys: tuple, v: Any) -> Any:  # an interpolation, resolved where it can be before the run
        if not (isinstance(v, str) and "${" in v):
            return v
        try:
            node = cfg.hydra
            for k in keys:
                node = node[k]
            return node
        except Exception:  # noqa: BLE001 - e.g. ${hydra.runtime.output_dir}: not known until Hydra runs
            return v

    for keys, node in _walk(raw):
        if isinstance(node, dict) and "_target_" in node:
            target = value((*keys, "_target_"), node["_target_"])
            if not (isinstance(target, str) and _kept(target)):  # Hydra's own: Hydra builds them itself
                locate(_path(("hydra", *keys)), target)
    for section in ("job_logging", "hydra_logging"):
        logging_cfg = raw.get(section)
        if not isinstance(logging_cfg, dict):
            continue
        for kind in ("handlers", "filters", "formatters"):
            for name, spec in (logging_cfg.get(kind) or {}).items():
                if not isinstance(spec, dict):
                    continue
                keys = (section, kind, name)
                key = _path(("hydra", *keys))
                if "()" in spec:
                    locate(key, value((*keys, "()"), spec["()"]), field="()")
                cls = value((*keys, "class"), spec.get("class"))
                if cls is None:
                    continue
                if kind != "handlers":
                    locate(key, cls, field="class")
                elif not (cls in LOG_HANDLERS or allowed(cls)
                          or (cls == "logging.FileHandler" and spec.get("filename") in HYDRA_LOG_FILES)):
                    raise ConfigError(
                        f"{key}.class={cls!r} is refused: a logging handler other than {' or '.join(LOG_HANDLERS)} "
                        "writes files or opens connections where the config says, before training starts (Hydra's "
                        f"own logs, {' and '.join(HYDRA_LOG_FILES)}, are kept). Remove it, or, if you trust this config, allow it "
                        f"on purpose in the environment: {ALLOW_TARGETS_ENV}={cls}."
                    )
        for keys, v in _walk(logging_cfg, (section,)):
            v = value(keys, v)
            if isinstance(v, str) and v.startswith("ext://") and v not in LOG_STREAMS and not allowed(v[6:]):
                raise ConfigError(
                    f"{_path(('hydra', *keys))}={v!r} is refused: ext:// hands the logging config any object by "
                    f"its import path; only {' and '.join(LOG_STREAMS)} are kept. Remove it, or, if you trust "
                    f"this config, allow it on purpose in the environment: {ALLOW_TARGETS_ENV}={v[6:]}."
                )
    job = raw.get("job") or {}
    name = value(("job", "name"), job.get("name"))
    if isinstance(name, str) and ("/" in name or "\\" in name or name in ("", ".", "..")):
        raise ConfigError(f"hydra.job.name={name!r} is refused: Hydra writes its log to <run dir>/<job name>.log, "
                          "so the job name must be a plain file name, not a path.")
    for var in job.get("env_set") or {}:
        if var in ENV_SET_REFUSED or str(var).startswith(ENV_SET_REFUSED_PREFIXES):
            raise ConfigError(
                f"hydra.job.env_set.{var} is refused: a config may not set {var}, which decides what code runs "
                "(the allow switches, or where programs, libraries or modules are found). Set it in the "
                "environment of the command instead."
            )
    subdir = raw.get("output_subdir")
    if isinstance(subdir, str) and (os.path.isabs(subdir) or ".." in subdir.replace("\\", "/").split("/")):
        raise ConfigError(f"hydra.output_subdir={subdir!r} is refused: Hydra writes config.yaml, hydra.yaml and "
                          "overrides.yaml there, which must stay inside the run dir. Use a relative name such as .hydra.")


def _walk(tree: Any, keys: tuple = ()):
    """(keys, node) for every dict, list and value of a plain tree, the tree itself first."""
    yield keys, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        yield from _walk(v, (*keys, k))


def _path(keys: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")
