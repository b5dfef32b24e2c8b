"""The wandb logger, read back from the offline `.wandb` files it writes (no server, no network)."""

from __future__ import annotations

import functools
import html
import json
import re
import socket
import subprocess

import pytest
from conftest import compose_cfg, faulty, read_metrics, run_cli, run_here, tiny_overrides
from omegaconf import OmegaConf
from wandb_reader import config, history, media_path, records, run_id, run_ids, summary

from trainer.tracking.wandb_logger import WandbLogger, has_credentials

FAKE_KEY = "secret123" + "0" * 40  # a well-formed API key: wandb rejects malformed ones early


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture
def no_stdin(monkeypatch):
    """`run_cli` with stdin at EOF, as in a batch job: a login prompt would fail instead of waiting."""
    monkeypatch.setattr(subprocess, "run", functools.partial(subprocess.run, stdin=subprocess.DEVNULL))


@pytest.fixture
def own_service(monkeypatch):
    """The CLI starts its own wandb service instead of joining this process's (inherited $WANDB_SERVICE)."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


@pytest.fixture
def fresh_wandb():
    """wandb reads the environment once per process setup: start this test, and the next, with a fresh one."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def isolated_env(tmp_path, **extra: str) -> dict:
    """No ~/.netrc or ~/.config/wandb of the developer's: a fresh HOME."""
    return {"HOME": str(tmp_path / "home"), "NETRC": str(tmp_path / "home" / ".netrc"), **extra}


def test_logger_config_composes(tmp_path):
    from hydra.utils import instantiate

    for choice in ("logger=wandb", "logger=[wandb]", "logger=[none,wandb]"):
        cfg = compose_cfg([choice, "logger.wandb.tags=[a,b]"])
        assert OmegaConf.to_container(cfg.logger) == {"wandb": {
            "_target_": "trainer.tracking.wandb_logger.WandbLogger", "project": "trainer", "entity": None,
            "name": None, "group": None, "tags": ["a", "b"], "mode": None, "dir": None,
            "on_rollback": "new_run"}}
    logger = instantiate(cfg.logger.wandb, run_dir=str(tmp_path))
    assert isinstance(logger, WandbLogger) and logger.dir == tmp_path and logger.run is None


def test_help_does_not_import_wandb():
    proc = run_cli("--help", env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=60)
    assert proc.returncode == 0
    assert not re.search(r"\|\s+wandb\b", proc.stderr)


def test_wandb_run_mirrors_the_training_run(corpus, tmp_path, offline):
    from trainer import train

    cfg = compose_cfg(tiny_overrides(corpus, "logger=wandb", "trainer.eval_every=10", "task.sample_tokens=24"))
    final = train(cfg, tmp_path)

    # Every metrics.jsonl event, at its step, with its exact value (same-step events share a wandb row).
    expected: dict[int, dict] = {}
    for event in read_metrics(tmp_path):
        expected.setdefault(event.pop("step"), {}).update(event)
    rows = history(tmp_path)
    assert len({r["step"] for r in rows}) == len(rows)
    assert {r.pop("step"): {k: v for k, v in r.items() if k != "val/sample"} for r in rows} == expected

    assert config(tmp_path) == OmegaConf.to_container(cfg, resolve=True)
    assert {k: summary(tmp_path)[k] for k in final} == final

    # Eval samples: one HTML panel per eval, holding the text of samples.jsonl.
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [10, 20]
    logged = []
    for row in history(tmp_path):
        if "val/sample" in row:
            page = media_path(tmp_path, row["val/sample"]).read_text()
            logged.append({"step": row["step"], "key": "val/sample",
                           "text": html.unescape(re.fullmatch(r"<pre[^>]*>(.*)</pre>", page, re.S).group(1))})
    assert logged == samples

    # System info (wandb's own): the machine description is in the run.
    machine = [r.environment for r in records(tmp_path, "environment")]
    assert any(m.python for m in machine) and any(m.cpu_count >= 1 for m in machine)
    assert len(set(run_ids(tmp_path))) == 1


def test_ddp_training_logs_one_run_and_leaves_nothing_in_the_temp_dir(corpus, tmp_path, offline, scratch_tmpdir):
    """Under DDP, rank 0 logs; wandb's temp dirs (media, artifacts: removed as the interpreter exits) went with a
    worker's os._exit and stayed in the temp dir, two for every run. (A fresh interpreter: wandb, which this suite's
    processes have imported already, makes them as it is imported.)"""
    scratch = scratch_tmpdir
    r = run_cli(*tiny_overrides(corpus, "logger=wandb", "world=ddp", "world.nproc_per_node=2"),
                f"hydra.run.dir={tmp_path / 'run'}", fresh=True,
                env={"TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in history(tmp_path / "run") if "train/loss" in row] == list(range(1, 21))
    assert len(set(run_ids(tmp_path / "run"))) == 1
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_cli_without_credentials_logs_offline_and_says_how_to_sync(corpus, tmp_path, monkeypatch, no_stdin, own_service):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    proc = run_cli(*tiny_overrides(corpus, "logger=wandb", "trainer.max_steps=5"), f"hydra.run.dir={run_dir}",
                   env=isolated_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert [line for line in out.splitlines() if "wandb sync" in line] == [
        f"wandb: run {run_id(run_dir)} was logged offline (no W&B credentials: set WANDB_API_KEY "
        f"or run `wandb login`); upload it with: wandb sync {run_dir / 'wandb'}"]
    assert [r["step"] for r in history(run_dir)] == [1, 2, 3, 4, 5]


def test_unreachable_server_falls_back_offline_and_the_key_is_never_written(corpus, tmp_path, monkeypatch,
                                                                             fresh_wandb):
    from trainer import train

    with socket.socket() as s:  # a port nothing listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var, value in dict(WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=f"http://127.0.0.1:{port}",
                           WANDB_INIT_TIMEOUT="1").items():
        monkeypatch.setenv(var, value)
    train(compose_cfg(tiny_overrides(corpus, "logger=wandb", "trainer.max_steps=5")), tmp_path)

    assert [r["step"] for r in history(tmp_path)] == [1, 2, 3, 4, 5]
    assert len(set(run_ids(tmp_path))) == 1  # the offline run kept the id of the failed online one
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert [str(p) for p in files if FAKE_KEY.encode() in p.read_bytes()] == []


def test_resumed_logger_continues_the_same_run(tmp_path, offline):
    first = WandbLogger(run_dir=tmp_path, project="p")
    first.log_config({"lr": 1e-3, "auth": {"api_key": FAKE_KEY, "user": "me"}})
    first.log_metrics({"loss": 2.0}, step=1)
    state = first.state_dict()
    first.finish({"loss": 2.0})

    second = WandbLogger(run_dir=tmp_path, project="p")
    assert second.state_dict() != state
    second.load_state_dict(state)
    second.log_metrics({"loss": 1.0}, step=2)
    with pytest.raises(RuntimeError, match="before the first"):
        second.load_state_dict({"run_id": "someother"})
    second.finish({"loss": 1.0})

    assert run_ids(tmp_path) == [state["run_id"]] * 2
    assert [(r["step"], r["loss"]) for r in history(tmp_path)] == [(1, 2.0), (2, 1.0)]
    assert summary(tmp_path)["loss"] == 1.0
    assert config(tmp_path) == {"lr": 1e-3, "auth": {"api_key": "<redacted>", "user": "me"}}


def test_resumed_training_continues_the_same_wandb_run(corpus, tmp_path, offline):
    """Through `train`: the run id travels in the checkpoint, and the resumed job logs to it."""
    from trainer import train

    train(compose_cfg(tiny_overrides(corpus, "logger=wandb", "trainer.max_steps=4")), tmp_path)
    train(compose_cfg(tiny_overrides(corpus, "logger=wandb", "trainer.max_steps=6", "resume=auto")), tmp_path)
    ids = run_ids(tmp_path)
    assert len(ids) == 2 and len(set(ids)) == 1
    assert [r["step"] for r in history(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_copy_of_a_run_dir_continued_beside_it_logs_to_a_run_of_its_own(corpus, tmp_path, offline, capsys):
    """`cp -r RUN COPY` and both continued: the copy's checkpoint names the original's wandb run, and both branches'
    steps 5 and 6 went into that one run (wandb keeps a step's first row: one branch's were dropped). The copy's is a
    run of its own now; the original, and a run dir moved (its old path gone), go on in theirs."""
    import shutil

    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=4", "checkpoint.every_n_steps=2")
    run, copy, moved = tmp_path / "run", tmp_path / "copy", tmp_path / "moved"
    train(compose_cfg(tiny_overrides(corpus, *args)), run)
    first = run_id(run)
    shutil.copytree(run, copy, symlinks=True)  # (as cp -r: wandb's latest-run link stays a link)
    capsys.readouterr()
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=6", "optim.lr=1e-4", "resume=auto")), copy)
    assert f"wandb: this copy of the run dir {run}, resumed from step 4, logs to a new run" in capsys.readouterr().err
    found = runs_by_first_step(copy)
    assert len(found) == 2, [(r['id'], [x['step'] for x in r['rows']]) for r in found]
    old, new = found
    assert old["id"] == first and new["id"] != first and [r["step"] for r in new["rows"]] == [5, 6]
    assert new["notes"] == f"Continued from step 4 of run {first} in a copy of its run dir ({run}), where that run goes on."
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=6", "resume=auto")), run)
    assert set(run_ids(run)) == {first} and [r["step"] for r in history(run)] == [1, 2, 3, 4, 5, 6]
    shutil.move(run, moved)  # (a run dir moved: the same run goes on)
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=8", "resume=auto")), moved)
    assert set(run_ids(moved)) == {first}
    # Moved again, with a link left at the path it had (its record names that path, which leads to it still): the same
    # directory, no copy of it.
    shutil.move(moved, tmp_path / "elsewhere")
    moved.symlink_to(tmp_path / "elsewhere")
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=10", "resume=auto")), moved)
    assert set(run_ids(moved)) == {first}


def test_credentials_come_from_the_environment_or_netrc(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert not has_credentials("https://api.wandb.ai")
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    netrc.chmod(0o600)
    assert has_credentials("https://api.wandb.ai")
    assert not has_credentials("https://wandb.example.com")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert has_credentials("https://wandb.example.com")


def test_a_misspelt_mode_fails_with_the_valid_ones(tmp_path):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="logger.wandb.mode='ofline' is invalid.*online, offline, disabled"):
        WandbLogger(run_dir=tmp_path, mode="ofline")


@pytest.mark.parametrize(("key", "value", "says"), [
    ("project", ["p"], "logger.wandb.project=['p'] is invalid: expected a name"),
    ("group", {"a": 1}, "logger.wandb.group={'a': 1} is invalid"),
    ("entity", True, "logger.wandb.entity=True is invalid"),
    ("tags", [["a"]], "logger.wandb.tags holds ['a']: expected a list of words")])
def test_a_name_of_the_wrong_type_is_one_paragraph_before_the_run(tmp_path, key, value, says):
    """wandb.init's pydantic traceback, exit 1, after the run dir was made (tags=[[a]] became the tag "['a']")."""
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(says)):
        WandbLogger(run_dir=tmp_path, **{key: value})
    assert WandbLogger(run_dir=tmp_path, name=123).init_kwargs["name"] == "123"  # (a number is a name)


def test_a_wrong_wandb_name_leaves_no_run_dir(corpus, tmp_path, offline):
    from test_errors import assert_clean_error

    r = run_cli(*tiny_overrides(corpus, "logger=wandb", "logger.wandb.project=[p]"), f"hydra.run.dir={tmp_path / 'r'}")
    assert_clean_error(r, "logger.wandb.project=['p'] is invalid")
    assert not (tmp_path / "r").exists()


def test_your_own_loop_logs_to_the_trackers_log_with_names(tmp_path, offline):
    """`Runtime(log_with="wandb", run_dir=...)`: metrics.jsonl and the wandb run get the same metrics; an unknown
    tracker is one UserError naming the valid ones."""
    from trainer import Runtime
    from trainer.errors import UserError

    rt = Runtime(log_with="wandb", run_dir=tmp_path)
    rt.log({"loss": 2.0}, step=1)
    rt.log({"loss": 1.5}, step=2)
    rt.end()
    assert [(r["step"], r["loss"]) for r in history(tmp_path)] == [(1, 2.0), (2, 1.5)]
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 2.0), (2, 1.5)]
    with pytest.raises(UserError, match="log_with='mlflow'.*expected wandb or tensorboard"):
        Runtime(log_with="mlflow", run_dir=tmp_path / "other")


def test_a_restarted_loop_of_your_own_logs_to_the_same_wandb_run(tmp_path, offline, recwarn):
    """A Runtime loop restarted from its checkpoint logged to a new wandb run each time (the Trainer's resume
    continues its run: the id is in the checkpoint), and rt.log of the loss from the backward warned about its graph.
    A load of another run's checkpoint, or one after this process logged (an eval's), leaves the id alone."""
    import torch

    from trainer import Runtime

    def loop(run_dir, steps: int, load=None) -> None:
        rt = Runtime(log_with="wandb", run_dir=run_dir)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        start = rt.load_state(load or run_dir / "checkpoints") or 0
        for step in range(start + 1, steps + 1):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            rt.backward(loss)
            rt.step(opt)
            rt.log({"loss": loss}, step=step)
            if step % 2 == 0:
                rt.save_state(run_dir / "checkpoints", step)
        rt.end()

    loop(tmp_path / "a", 4)
    loop(tmp_path / "a", 6)
    ids = run_ids(tmp_path / "a")
    assert len(ids) == 2 and len(set(ids)) == 1
    assert [r["step"] for r in history(tmp_path / "a")] == [1, 2, 3, 4, 5, 6]
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]
    loop(tmp_path / "b", 6, load=tmp_path / "a" / "checkpoints" / "step_00000004")
    assert run_id(tmp_path / "b") != ids[0]


def runs_by_first_step(run_dir) -> list[dict]:
    """Each wandb.init under `run_dir`: {"id", "branch_point": (run id, step) it forked or rewound from, or None,
    "rows": its history rows}, ordered by its first step (two inits in one second have no order of their own)."""
    from wandb_reader import _decode, run_records

    runs = []
    for found in run_records(run_dir):
        run = next(r.run for r in found if r.WhichOneof("record_type") == "run")
        rows = [{"step": r.history.step.num, **_decode(r.history.item)} for r in found
                if r.WhichOneof("record_type") == "history"]
        runs.append({"id": run.run_id, "rows": rows, "notes": run.notes, "branch_point": (
            run.branch_point.run, int(run.branch_point.value)) if run.HasField("branch_point") else None})
    return sorted(runs, key=lambda run: run["rows"][0]["step"])


@pytest.mark.parametrize("on_rollback", ["new_run", "fork", "rewind"])
def test_a_rollback_logs_its_branch_where_wandb_keeps_it(corpus, tmp_path, offline, capsys, on_rollback):
    """resume=RUN/checkpoints/step_4 of a run that logged to step 6: the resumed job continued the same wandb run,
    where wandb ignores a step below the run's last (steps 5 and 6 of the new branch were dropped from the dashboard,
    the abandoned branch's shown instead). Now the new branch is a run of its own (or wandb's fork or rewind of the
    old one at step 4), and the abandoned branch stays whole in the old run."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=5",
            f"logger.wandb.on_rollback={on_rollback}")
    train(compose_cfg(tiny_overrides(corpus, *args)), tmp_path)
    first = run_id(tmp_path)
    capsys.readouterr()
    train(compose_cfg(tiny_overrides(corpus, *args, "optim.lr=1e-4",
                                     f"resume={tmp_path}/checkpoints/step_00000004")), tmp_path)
    old, new = runs_by_first_step(tmp_path)
    assert old["id"] == first and [r["step"] for r in old["rows"]] == [1, 2, 3, 4, 5, 6]
    assert (new["id"] == first) == (on_rollback == "rewind")
    assert new["branch_point"] == (None if on_rollback == "new_run" else (first, 4))
    if on_rollback == "new_run":  # (its Overview tab says where it comes from)
        assert new["notes"] == f"Rolled back to step 4 of run {first}, which keeps the branch this run left."
    # The new run's rows are the new branch's steps 5 and 6, with its loss (in metrics.jsonl too).
    assert [r["step"] for r in new["rows"]] == [5, 6]
    assert [r["train/loss"] for r in new["rows"]] == [e["train/loss"] for e in read_metrics(tmp_path)
                                                      if "train/loss" in e][-2:]
    err = capsys.readouterr().err
    assert "rollback to step 4" in err and first in err


def test_a_rollback_killed_before_its_first_checkpoint_resumes_into_its_own_run(corpus, tmp_path, offline):
    """The rollback's new run is in no checkpoint until its branch saves one: killed at step 6, before that, the
    resume loaded step 4's checkpoint and its id, the old run's, and logged the new branch there (where wandb drops
    steps below the run's last). The run dir records which run the last attempt from that checkpoint logged to.
    That attempt logged step 5 with the same settings: the resume does not log it twice."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=5")
    train(compose_cfg(tiny_overrides(corpus, *args, *faulty("raise", at_call=99))), tmp_path)
    first = run_id(tmp_path)
    # Dies in step 6, the first time only: the resume below is the very same command.
    rollback = tiny_overrides(corpus, *args, "optim.lr=1e-4", *faulty("raise", at_call=2), f"+task.once={tmp_path}/once")
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg([*rollback, f"resume={tmp_path}/checkpoints/step_00000004"]), tmp_path)
    train(compose_cfg([*rollback, "resume=auto"]), tmp_path)
    old, *branch = runs_by_first_step(tmp_path)
    assert old["id"] == first and [r["step"] for r in old["rows"]] == [1, 2, 3, 4, 5, 6]
    assert len(branch) == 2 and branch[0]["id"] == branch[1]["id"] != first  # killed, then resumed: one run
    assert [[r["step"] for r in run["rows"]] for run in branch] == [[5], [6]]
    losses = {r["step"]: r["train/loss"] for run in branch for r in run["rows"]}
    assert [losses[5], losses[6]] == [e["train/loss"] for e in read_metrics(tmp_path) if "train/loss" in e][-2:]


def test_a_rollback_killed_before_its_wandb_file_held_a_row_resumes_its_run_from_the_checkpoint(corpus, tmp_path,
                                                                                                 offline, capsys):
    """wandb writes its file in 32 KiB blocks, so a process killed early leaves the rollback's run holding no row:
    the resume took that for a run that had lost steps 1-4 and logged them into the branch's run, which starts after
    step 4 (they are the old run's), saying the run had lost them."""
    from trainer import train
    from trainer.tracking.wandb_files import history_step, records

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=5")
    train(compose_cfg(tiny_overrides(corpus, *args)), tmp_path)
    first = run_id(tmp_path)
    rollback = tiny_overrides(corpus, *args, "optim.lr=1e-4", *faulty("raise", at_call=2), f"+task.once={tmp_path}/once")
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg([*rollback, f"resume={tmp_path}/checkpoints/step_00000004"]), tmp_path)
    import wandb

    wandb.teardown()  # (its service writes a finished run's file after finish returns: read it once that is done;
    # under a loaded machine the read came first and found no record)
    (branch,) = [p for p in tmp_path.glob("wandb/*run-*/run-*.wandb") if first not in p.name]
    cut = next(end for end, record in records(branch) if record.WhichOneof("record_type") == "run")
    branch.write_bytes(branch.read_bytes()[:cut])  # (what a kill leaves: the run's record, no row yet)
    capsys.readouterr()
    train(compose_cfg([*rollback, "resume=auto"]), tmp_path)
    assert [history_step(r) for f in sorted(tmp_path.glob(f"wandb/*run-*/{branch.name}")) for _, r in records(f)
            if history_step(r) is not None] == [5, 6]
    assert "did not hold" not in capsys.readouterr().err


def test_a_rewind_killed_before_its_first_checkpoint_rewinds_again(corpus, tmp_path, offline):
    """on_rollback=rewind cuts the run at the checkpoint on the server, but its files from before the cut still
    held the branch left (to step 6): the resume of the killed rewind took those for the run's and logged nothing
    up to step 6 (the steps of the old learning rate stayed), or, synced, left steps missing after the cut."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=5",
            "logger.wandb.on_rollback=rewind")
    train(compose_cfg(tiny_overrides(corpus, *args)), tmp_path)
    first = run_id(tmp_path)
    rollback = tiny_overrides(corpus, *args, "optim.lr=1e-4", *faulty("raise", at_call=2), f"+task.once={tmp_path}/once")
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg([*rollback, f"resume={tmp_path}/checkpoints/step_00000004"]), tmp_path)
    train(compose_cfg([*rollback, "resume=auto"]), tmp_path)
    *_, resumed = runs_by_first_step(tmp_path)
    assert resumed["id"] == first and resumed["branch_point"] == (first, 4)  # (wandb's resume_from, again)
    assert [r["step"] for r in resumed["rows"]] == [5, 6]
    assert [r["train/loss"] for r in resumed["rows"]] == [e["train/loss"] for e in read_metrics(tmp_path)
                                                          if "train/loss" in e][-2:]


def test_the_record_of_the_last_attempt_is_the_run_dirs_own_when_runs_share_a_wandb_dir(corpus, tmp_path, offline):
    """Runs sharing logger.wandb.dir shared the record of which run the last attempt logged to, and with which
    settings: another run in between overwrote it, and a resume with another learning rate kept the crashed
    attempt's rows past the checkpoint."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=4", f"logger.wandb.dir={tmp_path}/w")
    crash = (*faulty("raise", at_call=6), f"+task.once={tmp_path}/once")
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg(tiny_overrides(corpus, *args, *crash)), tmp_path / "a")
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=2")), tmp_path / "b")
    train(compose_cfg(tiny_overrides(corpus, *args, *crash, "optim.lr=1e-4", "resume=auto")), tmp_path / "a")
    ids = {p.stem.removeprefix("run-") for p in (tmp_path / "w").glob("wandb/*run-*/run-*.wandb")}
    assert len(ids) == 3  # a's first run, b's, and the run a's resume logs to


def test_what_counts_as_other_settings_for_the_rows_a_run_holds():
    """Rounding-only and where-it-goes settings keep the rows; what changes the numbers, or the steps that have
    rows (wandb cannot put a row below a run's last), does not."""
    from trainer.tracking.wandb_logger import settings_digest

    base = {"trainer": {"max_steps": 8, "log_every": 1, "eval_every": 0, "peak_tflops": None, "progress": "bar"},
            "world": {"nproc_per_node": 1, "threads": 1, "max_restarts": 0}, "optim": {"lr": 1e-3, "fused": True},
            "data": {"batch_size": 4, "num_workers": 0}, "logger": {"wandb": {"project": "p"}}, "resume": None}

    def changed(section, key, value):
        return settings_digest({**base, section: {**base[section], key: value}}) != settings_digest(base)

    assert not any(changed(*c) for c in [("trainer", "peak_tflops", 100.0), ("trainer", "progress", "off"),
                                          ("world", "threads", 2), ("world", "max_restarts", 3),
                                          ("optim", "fused", False), ("data", "num_workers", 2),
                                          ("logger", "wandb", {"project": "q"})])
    assert all(changed(*c) for c in [("optim", "lr", 1e-4), ("trainer", "max_steps", 16), ("trainer", "log_every", 5),
                                     ("trainer", "eval_every", 2), ("data", "batch_size", 8),
                                     ("world", "nproc_per_node", 2)])


def test_a_resume_logs_again_the_steps_a_killed_process_took_with_it(corpus, tmp_path, offline, capsys):
    """kill -9 (the OOM killer, a lost node) takes the records wandb's service had not written yet with it: the
    run's .wandb file ends steps before the process died (here after step 2, of 6). The resume from step 6's
    checkpoint logged from step 7 on, so steps 3-6 were in no file a sync uploads, though metrics.jsonl had them."""
    from trainer import train
    from trainer.tracking.wandb_files import history_step, records

    args = ("logger=wandb", "checkpoint.every_n_steps=4")
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=6")), tmp_path)
    (path,) = tmp_path.glob("wandb/*run-*/run-*.wandb")
    # What a kill -9 leaves: the records up to step 2's row, and half of the next (a torn write).
    cut = next(end for end, record in records(path) if history_step(record) == 2)
    path.write_bytes(path.read_bytes()[:cut + 9])
    assert [r["step"] for r in history(tmp_path, killed=(path,))] == [1, 2]
    capsys.readouterr()
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=8", "resume=auto")), tmp_path)
    assert {p.name for p in tmp_path.glob("wandb/*run-*/run-*.wandb")} == {path.name}  # (one run)
    rows = history(tmp_path, killed=(path,))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    logged = {e["step"]: e["train/loss"] for e in read_metrics(tmp_path) if "train/loss" in e}
    assert {r["step"]: r["train/loss"] for r in rows} == logged
    assert "did not hold steps 3 to 6 (up to the checkpoint's)" in capsys.readouterr().err


@pytest.mark.parametrize(("starting_step", "logged_again", "logged_after"), [(4, [4, 5, 6], [7, 8, 9]), (9, [], [9])])
def test_online_the_server_says_which_steps_a_resumed_run_holds(tmp_path, starting_step, logged_again, logged_after):
    """Online, what the run holds is the server's word: a resumed run's next step (wandb's `starting_step`). Those
    steps up to the checkpoint's it lacks are logged again, and none it holds (wandb would drop them, warning)."""
    logger = WandbLogger(run_dir=tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1 / s}) + "\n"
                                                    for s in range(1, 7)))
    logger.load_state_dict({"run_id": "abcdefgh"})
    logger.rewind(6)  # (the resume from step 6's checkpoint, the run dir's metrics.jsonl cut there)

    class ServerRun:
        logged: list[int] = []

        def log(self, row, step):
            assert row == ({"train/loss": 1 / step} if step <= 6 else {"x": 0.0})
            self.logged.append(step)

    run = ServerRun()
    run.starting_step, logger.run, logger.offline = starting_step, run, False
    logger._log_what_the_run_lost("online")
    assert run.logged == logged_again
    run.logged.clear()
    for step in (7, 8, 9):
        logger.log_metrics({"x": 0.0}, step)
    assert run.logged == logged_after


def test_online_a_resume_does_not_log_again_what_an_offline_attempt_holds_for_wandb_sync(tmp_path, offline):
    """An attempt without a connection logged steps 1-5 offline (`wandb sync` uploads them later); the next attempt,
    online, found the server without the run: what the offline files hold is not logged a second time."""
    first = WandbLogger(run_dir=tmp_path, mode="offline")
    first.load_state_dict({"run_id": "abcdefgh"})
    for step in range(1, 6):
        first.log_metrics({"train/loss": 1 / step}, step)
    first.finish({})
    history(tmp_path)  # (waits until wandb's service has written the file out)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1 / s}) + "\n"
                                                    for s in range(1, 7)))
    logger = WandbLogger(run_dir=tmp_path)
    logger.load_state_dict({"run_id": "abcdefgh"})
    logger.rewind(6)

    class ServerRun:
        starting_step, logged = 0, []

        def log(self, row, step):
            self.logged.append(step)

    logger.run, logger.offline = ServerRun(), False
    logger._log_what_the_run_lost("online")
    assert logger.run.logged == [6]


@pytest.mark.parametrize("settings", ["same", "other"])
def test_a_resume_after_a_crash_keeps_what_the_run_logged_past_the_checkpoint_only_with_the_same_settings(
        corpus, tmp_path, offline, capsys, settings):
    """A crash in step 6 after step 5 was logged, the last checkpoint step 4's: the resume continued the same wandb
    run, where wandb keeps a step's first value, so with another learning rate step 5 showed the crashed attempt's
    loss, not this one's (metrics.jsonl and TensorBoard had this one's). With the same settings the crashed
    attempt's step 5 is this one's too, and is not logged twice; with others this attempt logs to a run of its own,
    as a rollback does."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=6", "checkpoint.every_n_steps=4",
            *faulty("raise", at_call=6), f"+task.once={tmp_path}/once")  # (dies the first time only)
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg(tiny_overrides(corpus, *args)), tmp_path)
    first = run_id(tmp_path)
    assert [r["step"] for r in history(tmp_path)] == [1, 2, 3, 4, 5]
    capsys.readouterr()
    other = ("optim.lr=1e-4",) if settings == "other" else ()
    train(compose_cfg(tiny_overrides(corpus, *args, *other, "resume=auto")), tmp_path)
    runs = runs_by_first_step(tmp_path)
    losses = [e["train/loss"] for e in read_metrics(tmp_path) if "train/loss" in e]
    err = capsys.readouterr().err
    if settings == "same":
        assert [[r["step"] for r in run["rows"]] for run in runs] == [[1, 2, 3, 4, 5], [6]]
        assert {run["id"] for run in runs} == {first}
        assert [r["train/loss"] for run in runs for r in run["rows"]] == losses
        assert "other settings" not in err and "did not hold" not in err
    else:
        old, new = runs
        assert old["id"] == first and [r["step"] for r in old["rows"]] == [1, 2, 3, 4, 5]
        assert new["id"] != first and [r["train/loss"] for r in new["rows"]] == losses[-2:]
        assert [r["step"] for r in new["rows"]] == [5, 6]
        assert new["notes"] == f"Rolled back to step 4 of run {first}, which keeps the branch this run left."
        assert f"run {first} holds step 5 of an attempt with other settings" in err


def test_a_run_started_from_another_runs_checkpoint_logs_to_a_wandb_run_of_its_own(corpus, tmp_path, offline, capsys):
    """resume=OTHER_RUN/checkpoints/step_N into a new run dir (other settings: another run) took the other run's
    wandb id from the checkpoint and logged into that run, which holds the other run's record."""
    from trainer import train

    args = ("logger=wandb", "trainer.max_steps=4", "checkpoint.every_n_steps=2")
    train(compose_cfg(tiny_overrides(corpus, *args)), tmp_path / "a")
    capsys.readouterr()
    train(compose_cfg(tiny_overrides(corpus, *args, "trainer.max_steps=6", "optim.lr=1e-4",
                                     f"resume={tmp_path}/a/checkpoints/step_00000004")), tmp_path / "b")
    assert run_id(tmp_path / "b") != run_id(tmp_path / "a")
    assert [r["step"] for r in history(tmp_path / "b")] == [5, 6]
    assert f"starts from a checkpoint of wandb run {run_id(tmp_path / 'a')}" in capsys.readouterr().err
    # Through the command line, whose new run dir holds this job's config.yaml (the same settings as a's, but for
    # the ones a resume may change) before the run starts: it counted as a's run.
    r = run_here(*tiny_overrides(corpus, *args, "trainer.max_steps=6"), f"hydra.run.dir={tmp_path / 'c'}",
                 f"resume={tmp_path}/a/checkpoints/step_00000004")
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_id(tmp_path / "c") not in (run_id(tmp_path / "a"), run_id(tmp_path / "b"))
