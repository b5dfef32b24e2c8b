"""What Accelerate and Lightning users reach for in their first week (issue 17): callbacks and early
stopping, optimizers as choices, activation checkpointing, epochs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import checkpoints, read_metrics, run_here, series, tiny_overrides, train_in_process


def test_early_stopping_stops_with_a_final_checkpoint_and_the_run_stays_finished(corpus, tmp_path, capsys):
    # mode=max on a falling loss: the first eval is the best, so the run stops `patience` evals later.
    stop = ("callbacks=early_stopping", "callbacks.early_stopping.mode=max", "callbacks.early_stopping.patience=2",
            "trainer.eval_every=2", "trainer.max_steps=40")
    events = train_in_process(corpus, tmp_path, *stop, "trainer.progress=off")
    assert "stopping at step 6: early stopping" in capsys.readouterr().out  # (said with no progress display too)
    assert [e["step"] for e in events if "val/loss" in e] == [2, 4, 6]
    assert events[-1]["step"] == 6 and checkpoints(tmp_path)[-1] == "step_00000006"
    assert json.loads((tmp_path / "export.json").read_text())["step"] == 6
    state = json.loads((tmp_path / "checkpoints" / "step_00000006" / "state.json").read_text())
    assert state["callbacks"]["early_stopping"]["bad_evals"] == 2
    capsys.readouterr()
    train_in_process(corpus, tmp_path, *stop, "resume=auto")  # stopped is finished: it does not train on
    assert "already finished: early stopping" in capsys.readouterr().out
    assert read_metrics(tmp_path)[-1]["step"] == 6


def test_early_stopping_that_no_eval_before_the_end_checks_is_said_once(corpus, tmp_path, capsys):
    """trainer.eval_every=0 (debug=smoke's): the callback could never stop the run, and nothing said so."""
    train_in_process(corpus, tmp_path / "never", "callbacks=early_stopping", "trainer.eval_every=0",
                     "trainer.max_steps=4")
    assert capsys.readouterr().out.count("warning: callbacks.early_stopping can never stop this run") == 1
    train_in_process(corpus, tmp_path / "checked", "callbacks=early_stopping", "trainer.eval_every=2",
                     "trainer.max_steps=4")
    assert "can never stop" not in capsys.readouterr().out


def test_early_stopping_resumed_on_another_metric_starts_its_best_over(corpus, tmp_path, capsys):
    """A resume with callbacks.early_stopping.monitor changed kept the old metric's best and count: "val/bpb has
    not improved on 3.40" where 3.40 was the best val/loss. Its best and count start over, and it says so."""
    watch = ("callbacks=early_stopping", "callbacks.early_stopping.mode=max", "callbacks.early_stopping.patience=9",
             "trainer.eval_every=2")
    train_in_process(corpus, tmp_path, *watch, "trainer.max_steps=4", "checkpoint.every_n_steps=4")
    capsys.readouterr()
    events = train_in_process(corpus, tmp_path, *watch, "trainer.max_steps=8", "resume=auto",
                              "callbacks.early_stopping.monitor=val/bpb")
    assert "resume: callbacks.early_stopping watches val/bpb (max) where the checkpoint's watched another metric" \
        in capsys.readouterr().out
    state = json.loads((tmp_path / "checkpoints" / "step_00000008" / "state.json").read_text())
    after = [e["val/bpb"] for e in events if "val/bpb" in e and e["step"] > 4]
    assert state["callbacks"]["early_stopping"]["best"] == pytest.approx(max(after))  # val/bpb's own, from step 6
    assert state["callbacks"]["early_stopping"]["bad_evals"] == (1 if after[1] <= after[0] else 0)


def test_a_monitor_that_no_eval_logs_is_one_paragraph(corpus, tmp_path):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"callbacks.early_stopping.monitor='val/acc' is not among.*The checkpoint "
                                          "of step 2 is saved"):
        train_in_process(corpus, tmp_path, "callbacks=early_stopping", "callbacks.early_stopping.monitor=val/acc",
                         "trainer.eval_every=2", "trainer.max_steps=4")
    assert checkpoints(tmp_path) == ["step_00000002"]  # (the training before the mistake showed, kept)


@pytest.mark.parametrize("optim", ["sgd", "adam", "adamw", "muon"])
def test_each_optimizer_learns_and_resumes_exactly(corpus, tmp_path, optim):
    lr = {"sgd": "0.5", "adam": "3e-3", "adamw": "3e-3", "muon": "0.02"}[optim]
    args = (f"optim={optim}", f"optim.lr={lr}", "trainer.max_steps=30", "trainer.log_every=5", "checkpoint.every_n_steps=15")
    loss = series(train_in_process(corpus, tmp_path / "a", *args), "train/loss")
    assert loss[-1] < loss[0] - 1.0, loss
    train_in_process(corpus, tmp_path / "a", *args, f"resume={tmp_path}/a/checkpoints/step_00000015")
    assert series(read_metrics(tmp_path / "a"), "train/loss") == loss  # bit-identical from step 15


def test_an_optimizer_chosen_at_a_recipe_s_learning_rate_is_told_so(capsys):
    """optim=muon on the lm recipe ran Muon at the recipe's AdamW rate (5e-3, merged over muon.yaml's 0.02) without
    a word."""
    from conftest import compose_cfg

    assert compose_cfg(["optim=muon"]).optim.lr == 5e-3
    assert "note: optim=muon runs at optim.lr=0.005 (recipe=lm's, tuned for its own optimizer), not at its own " \
           "default 0.02. Pass optim.lr=VALUE to choose" in capsys.readouterr().err
    for quiet in (["optim=muon", "optim.lr=0.02"], ["optim=adamw"], ["optim=muon", "optim.lr=5e-3"]):
        compose_cfg(quiet)  # (a rate given, or the recipe's own optimizer)
        assert "note:" not in capsys.readouterr().err, quiet


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(corpus):
    from conftest import compose_cfg
    from hydra.utils import instantiate

    from trainer.entry.run import build_optimizer

    model = instantiate(compose_cfg(["debug=smoke"]).model)
    opt = build_optimizer(compose_cfg(["debug=smoke", "optim=muon"]).optim, model)
    name = {id(p): n for n, p in model.named_parameters()}
    muon = {name[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert muon == {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.0.weight",
                    "blocks.0.mlp.2.weight"}  # not the embeddings nor the head tied to them, nor the norms
    # An untied output layer goes to AdamW too (it went to Muon): the one get_output_embeddings() names (a Hugging Face
    # model's, or one's own), wherever it was registered. Without one, nothing is guessed: every nn.Linear is Muon's.
    import torch.nn as nn

    from trainer.loop.optim import MuonAdamW

    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head, self.embed = nn.Linear(8, 16, bias=False), nn.Embedding(16, 8)
            self.hidden = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

        def get_output_embeddings(self):
            return self.lm_head

    for model, want in ((nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
                         {"0.weight", "2.weight", "4.weight"}), (HeadFirst(), {"hidden.0.weight", "hidden.1.weight"})):
        name = {id(p): n for n, p in model.named_parameters()}
        groups = MuonAdamW.param_groups(model)
        assert {name[id(p)] for g in groups if g["use_muon"] for p in g["params"]} == want
        assert sum(len(g["params"]) for g in groups) == len(name)  # (every parameter in one group)


def _forward_counts(model) -> list[int]:
    """Calls of a module inside each block: a block's forward, first run or recomputed, calls it once."""
    counts = [0]
    for block in model.blocks:
        block.ln1.register_forward_pre_hook(lambda *a: counts.__setitem__(0, counts[0] + 1))
    return counts


@pytest.mark.parametrize("world", [(), ("world=fsdp", "world.nproc_per_node=1")])
def test_activation_checkpointing_recomputes_each_block_and_changes_nothing_else(corpus, tmp_path, world):
    from conftest import compose_cfg

    from trainer import build

    losses, calls = [], []
    for ac in ("false", "true"):
        trainer = build(compose_cfg([*_tiny(corpus), *world, "trainer.max_steps=4", f"trainer.activation_checkpointing={ac}"]),
                        tmp_path / ac)
        counts = _forward_counts(trainer.raw_model)
        trainer.fit()
        trainer.backend.teardown()
        losses.append(series(read_metrics(tmp_path / ac), "train/loss"))
        calls.append(counts[0])
    assert losses[1] == losses[0]  # recomputation gives the same numbers
    assert calls[1] > calls[0]  # ...by running each block's forward again in backward


def test_activation_checkpointing_on_the_diffusion_unet_recomputes_its_blocks_and_a_model_without_any_is_refused(
        tmp_path):
    """The UNet declared no blocks, so activation checkpointing recomputed nothing and said nothing (the same
    memory): it now names ResBlock. A model that declares none is refused, naming how to declare them."""
    import torch.nn as nn

    import trainer
    from trainer.errors import ConfigError
    from trainer.recipes.diffusion.model import ResBlock, UNet

    calls = []
    model = trainer.Runtime("single", "fp32").build_model(lambda: UNet(channels=8, image_size=8), True)
    for m in model.modules():
        if isinstance(m, ResBlock):
            m.norm1.register_forward_pre_hook(lambda *a: calls.append(1))
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 7]), torch.tensor([1, 2])
    model(x, t, y).sum().backward()
    assert len(calls) == 2 * 5  # each of the 5 blocks' forward, then again in backward
    with pytest.raises(ConfigError, match=r"Sequential declares none: .*Add `_no_split_modules"):
        trainer.Runtime("single", "fp32").build_model(lambda: nn.Sequential(nn.Linear(2, 2)), True)


class _Noisy(torch.nn.Module):
    """Blocks that draw trainer.noise in their forward (a VAE's reparameterisation): `_no_split_modules` names them."""

    _no_split_modules = ["_NoisyBlock"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_NoisyBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _NoisyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        from trainer import noise

        h = self.lin(x)
        return torch.tanh(h + noise.randn_like(h))


def test_activation_checkpointing_recomputes_trainer_noise_draws_as_the_forward_drew_them():
    """A block's recomputation in backward drew other trainer.noise than its forward (torch restores its own
    generators there; the framework's draw counter it did not): the backward differentiated another function, and
    the gradients differed from the run without checkpointing (grad_norm 5.55 against 5.73)."""
    import trainer
    from trainer import noise

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (False, True):
        model = trainer.Runtime("single", "fp32").build_model(_Noisy, recompute)
        with noise.for_samples(torch.arange(6), seed=3):
            model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # (the same operations on the same numbers)


def _tiny(corpus):
    from conftest import tiny_overrides

    return tiny_overrides(corpus)


def test_max_epochs_derives_the_steps_and_evals_every_epoch(small_corpus, tmp_path):
    from trainer.recipes.lm.data import text_file

    train, _ = text_file(str(small_corpus), seq_len=32)
    per_epoch = math.ceil(len(train) / 4)
    assert len(train) % 4  # (a last, partial batch in each epoch)
    events = train_in_process(small_corpus, tmp_path, "trainer.max_epochs=2", "trainer.eval_every_epochs=1",
                              "trainer.log_every=50")
    assert events[-1]["step"] == 2 * per_epoch
    assert [e["step"] for e in events if "val/loss" in e] == [per_epoch, 2 * per_epoch]
    assert torch.tensor(series(events, "train/loss")).isfinite().all()


def test_max_epochs_resumed_at_a_larger_global_batch_reads_the_samples_its_epochs_planned(small_corpus, tmp_path,
                                                                                           capsys):
    """One epoch at batch 4 (29 steps, 116 samples), then max_epochs=2 resumed at batch 16. The steps were counted
    at the new batch alone (2 x 8 = 16 < 29), so the resume called the run already finished and the second epoch
    was never trained. Now the 232 samples two epochs planned at batch 4 are read: 116 left, 8 steps of 16; and
    the cosine schedule spans the 37 steps."""
    from trainer.loop.schedule import WarmupCosine

    common = ("trainer.log_every=1", "trainer.eval_every=0", "checkpoint.every_n_steps=0", "scheduler.warmup_steps=5",
              "optim.lr=2e-3")
    train_in_process(small_corpus, tmp_path, "trainer.max_epochs=1", "data.batch_size=4", *common)
    capsys.readouterr()
    events = train_in_process(small_corpus, tmp_path, "trainer.max_epochs=2", "data.batch_size=16", *common,
                              "checkpoint.every_n_steps=3", "checkpoint.keep_last=10", "resume=auto")
    said = capsys.readouterr().out
    assert "resumed from" in said and "already finished" not in said
    assert "run ends at step 37 (not 16)" in said, said
    steps = [e["step"] for e in events if "train/loss" in e]
    assert steps == list(range(1, 38))  # 29 at batch 4, then 8 at batch 16: 116 + 128 >= 2 x 115 samples
    lr = next(e for e in events if e.get("step") == 37 and "train/lr" in e)["train/lr"]
    assert lr == pytest.approx(2e-3 * WarmupCosine(37, 5, 0.1)(36), rel=1e-6)  # the rate the last step used

    # Interrupted after step 33 and resumed again at batch 16: the plan is still the first batch's (the checkpoint's
    # own batch is 16 now), so the run ends at step 37 again, not at 16 ("already finished").
    import shutil

    from trainer.checkpoint.store import step_of

    for ckpt in (tmp_path / "checkpoints").iterdir():
        if step_of(ckpt) > 33:
            shutil.rmtree(ckpt)
    (tmp_path / "export.json").unlink()  # (the export of step 37 was never written: that run stopped at 33)
    capsys.readouterr()
    events = train_in_process(small_corpus, tmp_path, "trainer.max_epochs=2", "data.batch_size=16", *common,
                              "resume=auto")
    said = capsys.readouterr().out
    assert "at step 33" in said and "run ends at step 37 (not 16)" in said, said
    assert [e["step"] for e in events if "train/loss" in e] == list(range(1, 38))
    # Once more: finished, and the advice is about the setting that decides the length.
    train_in_process(small_corpus, tmp_path, "trainer.max_epochs=2", "data.batch_size=16", *common, "resume=auto")
    assert "already finished: step 37 >= trainer.max_steps=37 (trainer.max_epochs=2). Raise trainer.max_epochs to " \
           "train further." in capsys.readouterr().out


def test_epoch_periods_resumed_at_another_global_batch_fall_at_the_ends_of_epochs(small_corpus, tmp_path):
    """One epoch at batch 4 (29 steps, 116 samples an epoch), then three in all at batch 16, an eval and a
    checkpoint every epoch. Counted in steps of the new batch (8 an epoch), they fell mid-epoch at steps 32 and 40;
    the second epoch ends at sample 232, which step 37 reaches (116 + 8 x 16 = 244)."""
    common = ("trainer.log_every=50", "trainer.eval_every_epochs=1", "checkpoint.every_n_epochs=1",
              "checkpoint.keep_last=10")
    train_in_process(small_corpus, tmp_path, "trainer.max_epochs=1", "data.batch_size=4", *common)
    events = train_in_process(small_corpus, tmp_path, "trainer.max_epochs=3", "data.batch_size=16", *common,
                              "resume=auto")
    assert [e["step"] for e in events if "val/loss" in e] == [29, 37, 44]  # the last: the run's end (348 samples)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == \
        ["step_00000029", "step_00000037", "step_00000044"]


def test_a_max_steps_beside_max_epochs_is_named_as_unused_not_dropped_silently():
    """`trainer.max_epochs=1 trainer.max_steps=100` ran the epoch's 90,468 steps without a word about the 100."""
    from trainer.config.schema import CheckpointConfig, TrainerConfig
    from trainer.entry.run import epochs_to_steps

    for max_steps, note in ((100, "trainer.max_steps=100 is not used"), (None, None), (10, None)):
        said: list[str] = []
        t = TrainerConfig(max_steps=max_steps, max_epochs=1)
        epochs_to_steps(t, CheckpointConfig(), samples=90, global_batch=9, say=said.append)
        assert t.max_steps == 10 and len(said) == 1
        assert (note in said[0]) if note else "not used" not in said[0]
    # The same for the eval and checkpoint periods (every_n_epochs replaced every_n_steps without a word).
    said = []
    t, c = TrainerConfig(max_epochs=2, eval_every=7, eval_every_epochs=1), CheckpointConfig(every_n_steps=5,
                                                                                           every_n_epochs=1)
    epochs_to_steps(t, c, samples=90, global_batch=9, say=said.append)
    assert (t.eval_every, c.every_n_steps) == (10, 10)
    assert "trainer.eval_every=7 is not used: trainer.eval_every_epochs=1 decides (every 10 steps)" in said[1]
    assert "checkpoint.every_n_steps=5 is not used: checkpoint.every_n_epochs=1 decides" in said[2]


def test_a_part_that_names_its_own_optimizer_inherits_only_the_settings_that_class_takes():
    """`+optim.discriminator._target_=torch.optim.SGD` under the gan recipe's Adam gave SGD Adam's `betas`: a
    TypeError traceback, and no command line that does what the README says."""
    from omegaconf import OmegaConf

    from trainer.config.schema import per_part

    node = OmegaConf.create({"_target_": "torch.optim.Adam", "lr": 2e-4, "betas": [0.5, 0.999], "weight_decay": 0.0,
                             "generator": {"lr": 1e-3}, "discriminator": {"_target_": "torch.optim.SGD", "momentum": 0.9}})
    parts = per_part(node)
    assert OmegaConf.to_container(parts["generator"]) == {"_target_": "torch.optim.Adam", "lr": 1e-3,
                                                          "betas": [0.5, 0.999], "weight_decay": 0.0}
    assert OmegaConf.to_container(parts["discriminator"]) == {"_target_": "torch.optim.SGD", "lr": 2e-4,
                                                              "weight_decay": 0.0, "momentum": 0.9}


def test_a_part_given_a_setting_its_own_optimizer_does_not_take_is_one_paragraph(tmp_path):
    from test_errors import assert_clean_error

    r = run_here("recipe=gan", "debug=smoke", "+optim.discriminator._target_=torch.optim.Adagrad",
                 "+optim.discriminator.momentum=0.9", f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(r, "optim.discriminator.momentum is not an option of optim.discriminator._target_=Adagrad")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("recipe", "setting", "says"), [
    # (a TypeError traceback from the schedule's function, its run dir left; and silently ignored on gan)
    ("diffusion", "+scheduler.generator.warmup_steps=5", "it has one optimizer, optim, whose schedule is scheduler's"),
    ("gan", "+scheduler.critic.warmup_steps=5", "its optimizers are optim.generator, optim.discriminator"),
])
def test_a_schedule_part_of_no_optimizer_is_one_paragraph(tmp_path, recipe, setting, says):
    from test_errors import assert_clean_error

    r = run_here(f"recipe={recipe}", "debug=smoke", setting, f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(r, f"scheduler.{setting.split('.')[1]} names no optimizer of this run", says)
    assert not (tmp_path / "run").exists()


def test_a_warmup_longer_than_the_run_is_named_when_it_trains_and_not_when_it_is_evaluated(corpus, tmp_path):
    from conftest import run_main, tiny_overrides

    run = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "scheduler.warmup_steps=6"), f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    assert "warning: scheduler.warmup_steps=6 is not shorter than the run (4 steps)" in r.stdout
    r = run_here("recipe=gan", "debug=smoke", "trainer.max_steps=2", "+scheduler.generator.warmup_steps=3",
                 f"hydra.run.dir={tmp_path / 'gan'}")  # (a part's own warmup was not looked at)
    assert r.returncode == 0 and "warning: scheduler.generator.warmup_steps=3 is not shorter than the run (2 steps)" \
        in r.stdout and "never reaches optim.generator.lr" in r.stdout, r.stdout + r.stderr
    r = run_main("eval", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "is not shorter than the run" not in r.stdout + r.stderr  # (an eval repeated it: it builds the same Trainer)


def test_a_callbacks_mistakes_never_cost_the_trained_run(corpus, tmp_path):
    """From a sweep of the extension points: a callback whose on_fit_end raised ran before the final save (all the
    steps trained, no checkpoint, no export); a state a checkpoint cannot hold was found at the final save (the
    run lost); a callback with state_dict but no load_state_dict started over at every resume, silently."""
    from test_errors import assert_clean_error

    run = tmp_path / "fit_end"
    with pytest.raises(RuntimeError, match="a callback's bug at the end of fit"):
        run_here_raising(corpus, run, "+callbacks.odd._target_=odd_callbacks.RaisesAtFitEnd")
    assert (run / "checkpoints" / "step_00000002").is_dir()  # (the final checkpoint: resume=auto exports it)
    for name, needle in (("StateWithoutLoad", "has state_dict but no load_state_dict"),
                         ("StateOfAnObject", "cannot checkpoint a value of type object at '/callbacks/odd/obj'")):
        r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), f"+callbacks.odd._target_=odd_callbacks.{name}",
                     f"hydra.run.dir={tmp_path / name}")
        assert_clean_error(r, needle)
        assert not (tmp_path / name).exists()  # (refused before the first step)


def run_here_raising(corpus, run, *extra):
    from trainer import compose, train

    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", *extra)), run)


def test_an_optimizer_of_ones_own_without_a_key_the_config_leaves_null(corpus, tmp_path):
    """optim=sgd sets `foreach: null`; an optimizer class of a user's own without that parameter was refused
    ("Remove the key with ~optim.foreach"), and Hydra refuses removing a null key: it could not be used at all. A
    null the class does not take is left out of the call, as data's are."""
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), "optim=sgd", "optim._target_=odd_callbacks.PlainSGD",
                 "~optim.momentum", "~optim.nesterov", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("extra, needle", [
    (["+callbacks.odd._target_=odd_callbacks.EvalEndWithoutMetrics"],
     "callbacks.odd.on_eval_end (EvalEndWithoutMetrics) must take (trainer, metrics)"),
    (["scheduler._target_=torch.optim.lr_scheduler.StepLR", "+scheduler.step_size=3", "~scheduler.warmup_steps",
      "~scheduler.min_lr_ratio"], "is called as f(optimizer, total_steps=N) with its keys given, and it cannot be"),
], ids=["hook_signature", "torch_scheduler"])
def test_a_hook_or_a_schedule_of_ones_own_that_cannot_be_called_is_one_paragraph_before_the_first_step(
        corpus, tmp_path, extra, needle):
    """A hook without its metrics argument was a TypeError at the first eval (the steps so far unsaved); a torch
    scheduler given as scheduler._target_ a TypeError about total_steps from inside the build."""
    from test_errors import assert_clean_error

    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), *extra, f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(r, needle)
    assert not (tmp_path / "run").exists()
