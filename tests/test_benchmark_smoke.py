"""`python -m trainer.benchmark --quick` runs every item and writes the table and a parseable JSON block.

No timing is asserted: on a shared CPU any threshold would be flaky. `make bench` is where numbers count.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow  # starts several `python -m trainer` processes, DDP included


def test_quick_benchmark_writes_table_and_json(tmp_path):
    out = tmp_path / "BENCH.md"
    r = run_cli("--quick", "--out", str(out), module="trainer.benchmark", timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()

    for row in ("a. loop overhead, gpt_tiny", "a. loop overhead, gpt_small", "b. bf16 vs fp32", "c. DDP 2 proc",
                "c. the same scaling for a hand-written DDP loop",
                "d. safetensors save_file", "d. safetensors load_file + touch", "e. start-up to first step",
                "e. `python -m trainer --help`", "e. `python -m trainer --cfg job`"):
        assert re.search(rf"^\| {re.escape(row)}.*\|$", text, flags=re.M), row

    res = json.loads(re.search(r"```json\n(.*?)\n```", text, flags=re.S).group(1))
    assert set(res) == {"meta", "loop_tiny", "loop_default", "bf16_vs_fp32", "ddp", "checkpoint", "startup"}
    assert res["meta"]["quick"] is True
    for key in ("loop_tiny", "loop_default"):
        assert {"trainer_ms_per_step", "plain_ms_per_step", "overhead_ms_per_step", "throughput_ratio",
                "per_round_ms", "target", "met"} <= set(res[key])
        assert res[key]["metrics_lines_written"] > 0  # the Trainer really logged to metrics.jsonl
    assert {"bf16_tokens_per_s", "fp32_tokens_per_s", "ratio"} <= set(res["bf16_vs_fp32"])
    assert {"single_tokens_per_s", "ddp_tokens_per_s", "ratio", "met", "plain_ratio", "ddp_vs_plain_ddp"} <= set(res["ddp"])
    assert {"bytes", "api", "ms", "format_save_ratio", "format_load_ratio"} <= set(res["checkpoint"])
    assert {"safetensors_save", "raw_write", "safetensors_load", "raw_read"} <= set(res["checkpoint"]["ms"])
    s = res["startup"]
    assert {"import_torch_s", "first_step_s", "first_step_minus_import_torch_s", "help_s", "cfg_job_s",
            "first_step_minus_import_torch_dynamo_s"} <= set(s)
    assert isinstance(s["help_imports_torch"], bool) and isinstance(s["cfg_job_imports_torch"], bool)
    # Every figure is a finite positive number.
    for key in ("loop_tiny", "loop_default"):
        assert res[key]["trainer_ms_per_step"] > 0 and res[key]["plain_ms_per_step"] > 0
    assert res["ddp"]["ddp_tokens_per_s"] > 0 and res["startup"]["first_step_s"] > 0
