"""`python -m benchmarks`: run the items, write the report (see benchmarks/__init__.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchmarks

from .harness import DEFAULT, QUICK_DEFAULT, THREADS, Context, OtherJobs, meta, quick_corpus, say
from .quality import write_curve
from .report import table, write_report


def report_path(out: str | None, quick: bool, only: str, items, curve: str | None) -> Path:
    """`--out`, or BENCHMARKS.md for a full run; a --quick or --only run's table (tiny sizes, or a few rows) would
    replace the committed report, so it goes into the temp dir unless --out says otherwise."""
    if out is not None or curve or not (quick or {s.strip() for s in only.split(",") if s.strip()} != set(items)):
        return Path(out or "BENCHMARKS.md")
    path = Path(tempfile.gettempdir()) / "trainer-bench" / "BENCHMARKS.md"
    path.parent.mkdir(exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    items = benchmarks.ITEMS
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=benchmarks.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and a small text corpus: seconds, not minutes")
    p.add_argument("--out", default=None,
                   help="markdown report to write (default: BENCHMARKS.md for a full run; a --quick or --only run, "
                        "whose table would replace the committed one, writes into the temp dir); the raw data goes "
                        "beside it, as .json")
    p.add_argument("--only", default=",".join(items), help=f"comma-separated subset of {','.join(items)}")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads of the in-process items (default: 1)")
    p.add_argument("--curve", metavar="RUN_DIR", help="only (re)write the quality-per-second section from a run dir")
    args = p.parse_args(argv)
    if args.out is not None and Path(args.out).suffix == ".json":
        # (the report and its raw data would be one file: the markdown, written second, replaced the data)
        p.error(f"--out {args.out}: --out names the markdown report, and the raw data goes beside it with the suffix "
                f".json, so this path would hold both. Pass a .md path, e.g. --out {Path(args.out).with_suffix('.md')}.")
    out = report_path(args.out, args.quick, args.only, items, args.curve)
    if args.curve:
        write_curve(out, Path(args.curve))
        print(f"wrote the quality-per-second section of {out} from {args.curve}")
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(items)
    if unknown:
        p.error(f"unknown item(s) {', '.join(sorted(unknown))}; choose from {', '.join(items)}")

    import torch

    torch.set_num_threads(args.threads)
    ctx = Context(quick=args.quick,
                  data=tuple(quick_corpus() if args.quick else []),  # full runs use the recipe's own corpus (stdlib)
                  threads=args.threads, default_model=tuple(QUICK_DEFAULT if args.quick else DEFAULT))
    sizes: dict[str, Any] = {"default_model": ctx.default_model}
    for item in items.values():
        sizes.update(item.quick if args.quick else item.full)
    start = time.perf_counter()
    res: dict[str, Any] = {"meta": {**meta(args.quick), "sizes": sizes}}
    for name in only:
        item = items[name]
        load = os.getloadavg()[0]
        say(f"{name} (load average {load:.2f})")
        t, others = time.perf_counter(), OtherJobs()
        res[name] = {**item.measure(ctx, item.quick if args.quick else item.full), "load_avg_at_start": load}
        res[name].update(wall_s=time.perf_counter() - t, other_jobs_cores=others.cores())
        say(f"{name} done in {res[name]['wall_s']:.0f} s")
    res["meta"].update(load_avg_end=os.getloadavg()[0], wall_s=time.perf_counter() - start)
    raw = write_report(out, res, items)
    print("\n".join(table(res, items)))
    say(f"wrote {out} and {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
