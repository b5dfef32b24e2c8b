"""What a user coming from Accelerate still trips on in the second week (issue 32): an inline config node that
hides a group option, Accelerate's and torchrun's flags, epochs and schedules, figures that cannot be, and
datasets the framework does not take yet."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_main

CONF = str(ROOT / "tests" / "conf")


# -- 32.2: a group option on the command line that an inline node would hide ------------------------------
def test_the_readme_recipe_leaves_precision_to_the_command_line(tmp_path):
    from test_readme import blocks

    from trainer.composition import load

    (_, recipe), = blocks("yaml")
    where = tmp_path / re.search(r"^# (conf/\S+\.yaml)", recipe, re.M).group(1)
    where.parent.mkdir(parents=True)
    where.write_text(recipe)
    name = where.stem
    targets = {}
    for choice in ("fp32", "bf16", "fp16"):
        cfg = load([f"recipe={name}", f"precision={choice}"], config_dir=str(tmp_path / "conf"), targets=False)
        targets[choice] = cfg.precision._target_
    assert targets == {"fp32": "trainer.precision.FP32", "bf16": "trainer.precision.BF16",
                       "fp16": "trainer.precision.FP16"}
    assert load([f"recipe={name}"], config_dir=str(tmp_path / "conf"), targets=False).precision._target_ == \
        "trainer.precision.FP32"  # the recipe's own choice


def test_a_group_option_an_inline_node_hides_is_one_paragraph(tmp_path):
    from trainer.composition import load
    from trainer.errors import ConfigError

    # tests/conf/recipe/classify.yaml sets `precision: {_target_: trainer.precision.FP32}` inline.
    with pytest.raises(ConfigError, match=r"precision=bf16 .*override /precision"):
        load(["recipe=classify", "precision=bf16"], config_dir=CONF)
    r = run_main("--config-dir", CONF, "recipe=classify", "precision=fp16", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: precision=fp16"), r.stderr
    assert "init_scale" not in r.stderr and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "outputs").exists()
    # What the inline node says itself, and an option equal to it, are no conflict.
    assert load(["recipe=classify", "precision=fp32"], config_dir=CONF).precision._target_ == "trainer.precision.FP32"
    assert load(["debug=smoke", "precision=bf16"]).precision._target_ == "trainer.precision.BF16"
    assert load(["precision=bf16", "precision._target_=trainer.precision.FP32"]).precision._target_ == \
        "trainer.precision.FP32"  # a _target_ set on purpose after the option
