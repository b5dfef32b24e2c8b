"""l. Data larger than memory: a text corpus of several GB, streamed (`data=text_stream`), trains with flat RSS, and
the data loader's own throughput stands next to the training step's, so that data never becomes the bottleneck
without anyone noticing.

The corpus is generated under /tmp (the Python standard library's sources, repeated, in `files` files; the free
disk is checked first and the corpus removed at the end). Then, each in a process of its own:

    loader      the framework's loader alone (trainer.data.sampling.Data over TextStream, as the Trainer builds it for
                data=text_stream; 1 thread, batch x seq_len of the lm recipe), read over the WHOLE corpus once:
                samples/s and tokens/s per window of `window_mib` (median over the windows), and the RSS sampled
                every `rss_every` batches (at the first batch, the peak, at the end)
    workers     the same loader with data.num_workers=2 for `worker_batches` batches, one stream (every worker
                reads the whole stream and keeps its own batches) and by_file (each worker reads its own files)
    train       `python -m trainer recipe=lm data=text_stream data.path=CORPUS` (gpt_small 8x256 fp32, 1 thread):
                train/tokens_per_s per log window (the first left out), and the process tree's RSS polled while it
                runs (at its first log line, the peak, the last sample); `rounds` runs alternating with
    train_small the same run on a corpus of one small file: the RSS a run has whatever the corpus size

The loader's tokens/s over the step's is the headroom: how many times faster than the step consumes them the
loader makes batches (the step's time spent waiting for data, with num_workers=0, is the inverse).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from .harness import COMMON, ROOT, Context, Item, alternate, cli_env, compose, median, no_checkpoints, say

MIB = 2**20


# -- the corpus ----------------------------------------------------------------------------------------------
def generate(root: Path, total: int, files: int) -> list[Path]:
    """`files` text files of total//files bytes each: the standard library's sources, repeated (real text, so the
    tokens are what a byte-level LM reads; the loader's speed does not depend on what the bytes are)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    base = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))
    root.mkdir(parents=True)
    per, out = total // files, []
    for i in range(files):
        path = root / f"part-{i:04d}.txt"
        with open(path, "wb") as f:
            left = per
            while left > 0:
                left -= f.write(base[:left])
        out.append(path)
    return out


# -- the RSS of a process and its children -----------------------------------------------------------------------
def _field(path: str, field: str) -> int:
    try:
        with open(path) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def memory(pid: int) -> int:
    """Resident bytes of `pid`: its RSS alone, or with children (loader workers) the sum of the tree's PSS (forked
    workers share torch's pages with their parent: a sum of RSS would count those pages once per process)."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += _children(tree[-1])
    if len(tree) == 1:
        return _field(f"/proc/{pid}/status", "VmRSS")
    return sum(_field(f"/proc/{p}/smaps_rollup", "Pss") for p in tree)


# -- the loader alone, in its own process ----------------------------------------------------------------------
def loader(pattern: str, seq_len: int, batch: int, workers: int, by_file: bool, max_batches: int, window: int,
           rss_every: int) -> dict:
    """The Trainer's loader over data=text_stream's dataset: throughput per window of `window` samples and RSS."""
    import torch

    from trainer.data.sampling import Data
    from trainer.recipes.lm.data import text_stream

    torch.set_num_threads(1)
    train, _ = text_stream(pattern, seq_len, by_file=by_file)
    data = Data(train, None, batch, False, workers)
    total = len(train) // batch if max_batches <= 0 else max_batches
    batches = data.loader(data.sampler(1, 0, 1, 0), torch.device("cpu"), 0)
    next(batches)  # the first batch: workers started, first blocks read
    rss = [memory(os.getpid())]
    rates, t, done = [], time.perf_counter(), 0
    per_window = max(1, window // batch)
    for i in range(1, total):
        x, _ = next(batches)
        done += x.numel()
        if i % rss_every == 0:
            rss.append(memory(os.getpid()))
        if i % per_window == 0:
            now = time.perf_counter()
            rates.append(done / (now - t))
            t, done = now, 0
    rss.append(memory(os.getpid()))
    if not rates:  # fewer batches than one window (--quick)
        rates.append(done / max(time.perf_counter() - t, 1e-9))
    return {"tokens_per_s": median(rates), "samples_per_s": median(rates) / seq_len, "windows": len(rates),
            "per_window_tokens_per_s": rates, "batches": total, "bytes_read": total * batch * seq_len,
            "rss_start": rss[0], "rss_peak": max(rss), "rss_end": rss[-1], "rss_samples": len(rss)}


def _loader_case(pattern: str, sizes: dict, workers: int, by_file: bool, max_batches: int) -> dict:
    args = [pattern, sizes["seq_len"], sizes["batch"], workers, int(by_file), max_batches, sizes["window_mib"] * MIB
            // sizes["seq_len"], sizes["rss_every"]]
    r = subprocess.run([sys.executable, "-m", "benchmarks.data_bench", "loader", *map(str, args)], cwd=ROOT,
                       env=cli_env(), capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"data bench loader (workers={workers}, by_file={by_file}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- a training run, its RSS polled from outside ---------------------------------------------------------------
def train(pattern: str, sizes: dict, poll_s: float) -> dict:
    """`python -m trainer` on the stream: train/tokens_per_s per log window (the first left out) and the RSS of the
    process tree, from its first log line to its end."""
    run = Path(tempfile.mkdtemp(prefix="bench-data-run-"))
    log = run.parent / f"{run.name}.log"  # not a pipe: a full pipe would stop the run
    # fp32: bf16 is emulated, ~100x slower, on CPUs without avx512_bf16 (precision=auto would pick fp32 there).
    base = [*(a for a in COMMON if not a.startswith("precision=")), "precision=fp32", "model=gpt_small",
            f"data.batch_size={sizes['batch']}", f"data.seq_len={sizes['seq_len']}",
            "data=text_stream", f"data.path={pattern}", f"trainer.max_steps={sizes['train_steps']}",
            f"trainer.log_every={sizes['log_every']}", "trainer.eval_every=0", "world.threads=1",
            "world.device=cpu"]
    args = [*base, *no_checkpoints(compose(base)), f"hydra.run.dir={run}"]
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=ROOT,
                                    env={**cli_env(), "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT)
        metrics, rss = run / "metrics.jsonl", []
        while proc.poll() is None:
            if metrics.exists() and metrics.stat().st_size > 0:  # from the first log step on
                now = memory(proc.pid)
                if now:  # (0: it has just exited)
                    rss.append(now)
            time.sleep(poll_s)  # a sampling period, not a synchronisation
        if proc.returncode:
            raise RuntimeError(f"data bench training run failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        rates = [e["train/tokens_per_s"] for e in events if "train/tokens_per_s" in e][1:]
        return {"tokens_per_s": median(rates), "windows": len(rates), "rss_start": rss[0] if rss else 0,
                "rss_peak": max(rss, default=0), "rss_end": rss[-1] if rss else 0, "rss_samples": len(rss)}
    finally:
        shutil.rmtree(run, ignore_errors=True)
        log.unlink(missing_ok=True)


def measure(ctx: Context, sizes: dict) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-", dir="/tmp"))
    try:
        want = int(sizes["corpus_gib"] * 2**30)
        free = shutil.disk_usage(tmp).free
        total = min(want, free // 3)  # leave the disk two thirds of what was free
        if total < want:
            say(f"data: {free / 2**30:.1f} GiB free under /tmp: a corpus of {total / 2**30:.2f} GiB, not "
                f"{want / 2**30:.2f}")
        t = time.perf_counter()
        files = generate(tmp / "corpus", total, sizes["files"])
        gen_s = time.perf_counter() - t
        small = generate(tmp / "small", sizes["small_mib"] * MIB, 1)
        pattern = str(tmp / "corpus" / "*.txt")
        say(f"data: {len(files)} files, {total / 2**30:.2f} GiB in {gen_s:.0f} s under {tmp}; the loader reads all")
        whole = _loader_case(pattern, sizes, 0, False, 0)
        say(f"data: loader {whole['tokens_per_s'] / 1e6:.1f} M tokens/s over the corpus; RSS "
            f"{whole['rss_start'] / MIB:.0f} -> {whole['rss_peak'] / MIB:.0f} MiB")
        workers = {name: _loader_case(pattern, sizes, 2, by_file, sizes["worker_batches"])
                   for name, by_file in (("one_stream", False), ("by_file", True))}
        runs = alternate({"train": lambda: train(pattern, sizes, sizes["poll_s"]),
                          "train_small": lambda: train(str(small[0]), sizes, sizes["poll_s"])}, sizes["rounds"])
        step = median([r["tokens_per_s"] for r in runs["train"]])
        peak = {k: median([r["rss_peak"] for r in v]) for k, v in runs.items()}
        return {"corpus_bytes": total, "files": len(files), "generate_s": gen_s, "free_disk_bytes": free,
                "sizes": sizes, "loader": whole, "workers": workers, "runs": runs,
                "train_tokens_per_s": step, "loader_over_step": whole["tokens_per_s"] / step,
                "train_rss": {k: {f: median([r[f] for r in v]) for f in ("rss_start", "rss_peak", "rss_end")}
                              for k, v in runs.items()},
                "train_peak_over_small": peak["train"] - peak["train_small"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rows(r: dict) -> list[str]:
    s, ld, tr = r["sizes"], r["loader"], r["train_rss"]["train"]
    what = f"{r['corpus_bytes'] / 2**30:.1f} GiB of text in {r['files']} files, batch {s['batch']}x{s['seq_len']}"

    def mib(x: float) -> str:
        return f"{x / MIB:,.0f}"

    w = r["workers"]
    return [
        f"| l. data: the loader alone over the whole corpus (data=text_stream, 1 thread), {what} | "
        f"{ld['tokens_per_s'] / 1e6:.2f} M tokens/s ({ld['samples_per_s']:,.0f} samples/s); RSS {mib(ld['rss_start'])} "
        f"/ {mib(ld['rss_peak'])} / {mib(ld['rss_end'])} MiB (first batch / peak / end) | the training step "
        f"(gpt_small fp32, 1 thread): {r['train_tokens_per_s']:,.0f} tokens/s | loader {r['loader_over_step']:,.0f}x "
        "the step's tokens/s | — | — |",
        f"| l. data: a training run streaming that corpus (`python -m trainer data=text_stream`), RSS of the process | "
        f"{mib(tr['rss_start'])} / {mib(tr['rss_peak'])} / {mib(tr['rss_end'])} MiB (first log step / peak / end) | "
        f"the same run on one {s['small_mib']} MiB file: peak {mib(r['train_rss']['train_small']['rss_peak'])} MiB | "
        f"{r['train_peak_over_small'] / MIB:+.0f} MiB peak | — | — |",
        f"| l. data: the loader with data.num_workers=2 (peak PSS of the process and its workers) | one stream "
        f"{w['one_stream']['tokens_per_s'] / 1e6:.2f} M tokens/s ({mib(w['one_stream']['rss_peak'])} MiB); "
        f"data.by_file=true {w['by_file']['tokens_per_s'] / 1e6:.2f} M tokens/s ({mib(w['by_file']['rss_peak'])} MiB) "
        f"| num_workers=0 {ld['tokens_per_s'] / 1e6:.2f} M tokens/s | — | — | — |",
    ]


DATA = Item(measure, rows,
            full={"corpus_gib": 4, "files": 16, "seq_len": 256, "batch": 8, "window_mib": 128, "rss_every": 2000,
                  "worker_batches": 20000, "train_steps": 160, "log_every": 20, "rounds": 3, "small_mib": 1,
                  "poll_s": 0.2},
            quick={"corpus_gib": 1 / 256, "files": 2, "seq_len": 32, "batch": 4, "window_mib": 1, "rss_every": 100,
                   "worker_batches": 200, "train_steps": 6, "log_every": 2, "rounds": 1, "small_mib": 1,
                   "poll_s": 0.05})


if __name__ == "__main__":
    if sys.argv[1] == "loader":
        pattern, seq_len, batch, workers, by_file, max_batches, window, rss_every = sys.argv[2:]
        result = loader(pattern, int(seq_len), int(batch), int(workers), bool(int(by_file)), int(max_batches),
                        int(window), int(rss_every))
        print(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # (loader workers need no orderly teardown for a measurement)
