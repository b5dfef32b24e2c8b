"""k. Big-model inference: `trainer.load(..., device_map=...)` against Accelerate's `dispatch_model` (through
`load_checkpoint_and_dispatch`, with device_map="auto" and with the same placement) and `disk_offload`, on one GPT at least 4x larger than the memory cap.

Every configuration runs in a process of its own (its peak RSS is its own: VmHWM, reset once the imports are done,
against the RSS at that point), in alternating rounds, and generates the same tokens from the same prompt
(`model.generate`, batch 1, a 4-token prompt, no KV cache: each token is a forward over the whole prefix, so each
token reads every disk-placed weight once; a short prompt keeps the CPU's compute per token small, as offloaded
inference is: a longer one makes both sides compute-bound). Reported: tokens/s (median of the rounds), the peak RSS above the process's RSS before
loading, the bytes read from the offload files per token, and whether the first forward's logits equal a full
load's bit for bit (fp32).

    full       trainer.load(RUN): the whole model in memory (the reference logits; its RSS is the model's size)
    cpu        trainer.load(RUN, device_map="auto"): every block in RAM, placed and read one tensor at a time
    acc_cpu    load_checkpoint_and_dispatch(meta model, RUN's index, device_map="auto"): what Accelerate places on
               this host, every block in RAM too. (Until 2026-11-28 this was accelerate.cpu_offload, a mode meant
               for a GPU, whose hooks set every weight on its module before each forward: 1.37x slower than
               dispatch_model's placement of the same blocks here, so the row measured that mode, not ours.)
    disk       trainer.load(RUN, max_memory={"cpu": CAP}, offload_dir=DIR): the blocks that do not fit on disk,
               streamed with a prefetch thread
    acc_disk   load_checkpoint_and_dispatch(meta model, RUN's index, device_map=disk's own map, offload_folder=DIR):
               Accelerate's dispatch_model with the same placement
    all_disk   trainer.load(RUN, device_map={"": "disk"}, offload_dir=DIR)
    acc_all    accelerate.disk_offload(meta model, DIR) on a folder prepared before (offload_state_dict)

Accelerate is a benchmark-only dependency (the bench extra); without it its rows say so. On a machine without a
GPU "CPU offload" moves nothing: the weights are already where they compute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import ROOT, Context, Item, alternate, median, met_cell, say

OURS = ("full", "cpu", "disk", "all_disk")
THEIRS = ("acc_cpu", "acc_disk", "acc_all")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _model_config(sizes: dict) -> dict:
    return {"_target_": "trainer.recipes.lm.model.GPT", "vocab_size": 256, "seq_len": sizes["seq_len"],
            "n_layer": sizes["n_layer"], "n_head": sizes["n_head"], "d_model": sizes["d_model"]}


def _build(config: dict, meta: bool):
    from trainer.recipes.lm.model import GPT

    kwargs = {k: v for k, v in config.items() if k != "_target_"}
    if not meta:
        return GPT(**kwargs)
    from accelerate import init_empty_weights

    with init_empty_weights():
        return GPT(**kwargs)


def prepare(run: Path, acc_dir: Path, sizes: dict) -> int:
    """A run dir in Hugging Face's sharded layout (an index and its shards), and
    Accelerate's offload folder of the same weights for disk_offload. Returns the model's bytes."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = _model_config(sizes)
    model = _build(config, meta=False)
    state = {k: v.clone() if k == "head.weight" else v for k, v in model.state_dict().items()}  # (as an export)
    run.mkdir(parents=True)
    shard, shards, size = {}, [], 0
    for k, v in state.items():
        if shard and size + v.nbytes > sizes["shard_mb"] * 2**20:
            shards.append(shard)
            shard, size = {}, 0
        shard[k], size = v, size + v.nbytes
    shards.append(shard)
    weight_map = {}
    for i, part in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(run / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.nbytes for v in state.values())
    (run / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (run / "model_config.json").write_text(json.dumps(config))
    (run / "config.yaml").write_text("model: {}\n")
    if importlib.util.find_spec("accelerate"):
        from accelerate.utils import offload_state_dict

        offload_state_dict(str(acc_dir), model.state_dict())
    return total


def worker(case: str, run: Path, offload: Path, acc_dir: Path, cap: int, prompt_len: int, tokens: int, threads: int,
           out: Path) -> dict:
    """One configuration in this process: load, warm up, generate; the first forward's logits go to `out`."""
    import torch
    from safetensors.torch import save_file

    import trainer

    torch.set_num_threads(threads)
    if case.startswith("acc_"):
        import accelerate  # noqa: F401  (its import is not the load's memory)
    config = json.loads((run / "model_config.json").read_text())
    prompt = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    torch.ones(64, 64) @ torch.ones(64, 64)  # the BLAS's buffers: not the load's memory either
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the RSS now
    before = _rss("VmRSS")
    t = time.perf_counter()
    streamed = None
    if case == "full":
        model = trainer.load(run)
    elif case == "cpu":
        model = trainer.load(run, device_map="auto")
    elif case == "disk":
        model = trainer.load(run, max_memory={"cpu": cap}, offload_dir=offload)
    elif case == "all_disk":
        model = trainer.load(run, device_map={"": "disk"}, offload_dir=offload)
    elif case == "acc_cpu":
        from accelerate import load_checkpoint_and_dispatch

        model = load_checkpoint_and_dispatch(_build(config, meta=True), str(run / "model.safetensors.index.json"),
                                             device_map="auto")
    elif case == "acc_disk":
        from accelerate import load_checkpoint_and_dispatch

        placement = json.loads((out.parent / "disk_map.json").read_text())
        model = load_checkpoint_and_dispatch(_build(config, meta=True), str(run / "model.safetensors.index.json"),
                                             device_map=placement, offload_folder=str(offload))
        streamed = sum(v for k, v in json.loads((out.parent / "disk_sizes.json").read_text()).items()
                       if placement[k] == "disk")
    elif case == "acc_all":
        from accelerate import disk_offload

        model = _build(config, meta=True)
        model.head.weight = model.tok_emb.weight
        model = disk_offload(model, str(acc_dir), execution_device=torch.device("cpu"))
        streamed = sum(json.loads((out.parent / "disk_sizes.json").read_text()).values())
    else:
        raise ValueError(case)
    model.eval()
    load_s = time.perf_counter() - t
    with torch.no_grad():
        logits = model(prompt)
        save_file({"logits": logits.contiguous()}, str(out))
        placed = getattr(model, "device_map", None)
        read0 = placed.bytes_read if placed is not None else 0
        t = time.perf_counter()
        model.generate(prompt, tokens, generator=torch.Generator().manual_seed(1))
        seconds = time.perf_counter() - t
    if placed is not None:
        per_token = (placed.bytes_read - read0) / tokens
        if case == "disk":
            (out.parent / "disk_map.json").write_text(json.dumps(dict(placed)))
            (out.parent / "disk_sizes.json").write_text(json.dumps(placed.sizes))
    else:
        per_token = streamed or 0
    return {"tokens_per_s": tokens / seconds, "load_s": load_s, "rss_before": before, "peak_rss": _rss("VmHWM"),
            "bytes_read_per_token": per_token}


def _run_case(case: str, tmp: Path, cap: int, sizes: dict, threads: int) -> dict:
    offload = Path(tempfile.mkdtemp(prefix=f"offload-{case}-", dir=tmp))
    out = tmp / f"logits_{case}.safetensors"
    r = subprocess.run([sys.executable, "-m", "benchmarks.device_map_bench", case, str(tmp / "run"), str(offload),
                        str(tmp / "acc_offload"), str(cap), str(sizes["prompt"]), str(sizes["tokens"]), str(threads),
                        str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    shutil.rmtree(offload, ignore_errors=True)
    if r.returncode:
        raise RuntimeError(f"device_map bench case {case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(ctx: Context, sizes: dict) -> dict:
    from safetensors.torch import load_file

    tmp = Path(tempfile.mkdtemp(prefix="bench-device-map-"))
    try:
        total = prepare(tmp / "run", tmp / "acc_offload", sizes)
        cap = total // sizes["model_over_cap"]
        have_accelerate = importlib.util.find_spec("accelerate") is not None
        # disk first: it writes the placement acc_disk then uses
        cases = ["disk", *[c for c in OURS if c != "disk"], *(THEIRS if have_accelerate else ())]
        say(f"device_map: model {total / 2**20:.0f} MiB, cap {cap / 2**20:.0f} MiB, cases {', '.join(cases)}")
        runs = alternate({c: (lambda c=c: _run_case(c, tmp, cap, sizes, ctx.threads)) for c in cases},
                         sizes["rounds"])
        ref = load_file(str(tmp / "logits_full.safetensors"))["logits"]
        equal = {c: bool((load_file(str(tmp / f"logits_{c}.safetensors"))["logits"] == ref).all()) for c in cases}
        res = {c: {"tokens_per_s": median([r["tokens_per_s"] for r in rs]),
                   "load_s": median([r["load_s"] for r in rs]),
                   "peak_above_start": median([r["peak_rss"] - r["rss_before"] for r in rs]),
                   "rss_before": median([r["rss_before"] for r in rs]),
                   "bytes_read_per_token": rs[0]["bytes_read_per_token"], "logits_equal": equal[c],
                   "rounds": rs} for c, rs in runs.items()}
        out = {"model_bytes": total, "cap_bytes": cap, "sizes": sizes, "cases": res,
               "accelerate": _version("accelerate") if have_accelerate else None}
        if have_accelerate:  # per round (the two ran one after the other), then the median
            out["ratios"] = {ours: median([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[ours], runs[theirs])])
                             for ours, theirs in (("cpu", "acc_cpu"), ("disk", "acc_disk"), ("all_disk", "acc_all"))}
            out["met"] = out["ratios"]["cpu"] >= 1 and min(out["ratios"]["disk"], out["ratios"]["all_disk"]) >= 2
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _version(pkg: str) -> str:
    from importlib import metadata

    return metadata.version(pkg)


def rows(r: dict) -> list[str]:
    c, mib = r["cases"], 2**20
    s = r["sizes"]
    what = (f"gpt {s['n_layer']}x{s['d_model']} fp32 ({r['model_bytes'] / mib:.0f} MiB), cap max_memory.cpu="
            f"{r['cap_bytes'] / mib:.0f} MiB, batch 1, {s['tokens']} tokens after {s['prompt']}")

    def ours(case: str) -> str:
        x = c[case]
        above = x["peak_above_start"] - r["cap_bytes"]
        over = f" (cap {'+' if above >= 0 else '-'}{abs(above) / mib:.0f})" if case in ("disk", "all_disk") else ""
        return (f"{x['tokens_per_s']:.2f} tok/s, peak RSS +{x['peak_above_start'] / mib:.0f} MiB{over}, "
                f"{x['bytes_read_per_token'] / mib:.1f} MiB read/token, logits {'bitwise' if x['logits_equal'] else '**differ**'}")

    out = [f"| k. device_map full load (reference), {what} | {ours('full')} | — | — | — | — |"]
    if r.get("accelerate") is None:
        out.append(f"| k. device_map cpu / disk / all disk, {what} | {ours('cpu')}; {ours('disk')}; {ours('all_disk')} "
                   "| Accelerate not installed (pip install -e '.[bench]') | — | — | — |")
        return out
    for label, case, theirs, target in (("'auto' on a CPU host (all blocks in RAM)", "cpu", "acc_cpu", 1.0),
                                        ("CPU + disk offload (same map)", "disk", "acc_disk", 2.0),
                                        ("all on disk", "all_disk", "acc_all", 2.0)):
        ratio = r["ratios"][case]
        how = {"acc_cpu": "dispatch_model (device_map='auto')", "acc_disk": "dispatch_model", "acc_all": "disk_offload"}
        out.append(f"| k. device_map {label}, {what} | {ours(case)} | Accelerate {r['accelerate']} {how[theirs]}: "
                   f"{ours(theirs)} | {ratio:.2f}x tokens/s | >= {target:g}x | {met_cell(ratio >= target)} |")
    return out


DEVICE_MAP = Item(measure, rows,
                  full={"n_layer": 16, "d_model": 512, "n_head": 8, "seq_len": 64, "shard_mb": 64, "prompt": 4, "tokens": 8,
                        "rounds": 5, "model_over_cap": 4},
                  quick={"n_layer": 4, "d_model": 64, "n_head": 2, "seq_len": 32, "shard_mb": 1, "prompt": 4, "tokens": 4,
                         "rounds": 1, "model_over_cap": 2})


if __name__ == "__main__":
    case, run, offload, acc_dir, cap, prompt, tokens, threads, out = sys.argv[1:]
    result = worker(case, Path(run), Path(offload), Path(acc_dir), int(cap), int(prompt), int(tokens), int(threads),
                    Path(out))
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # (Accelerate's hooks and our prefetch thread need no orderly teardown for a measurement)
