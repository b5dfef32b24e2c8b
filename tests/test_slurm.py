"""SLURM: node lists, the multi-node topology from SLURM's environment, and Hydra's submitit launcher."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess

import pytest
import yaml
from conftest import (
    ROOT,
    SHARED,
    assert_same_run,
    read_metrics,
    run_cli,
    run_here,
    run_main,
    start_cli,
    tiny_overrides,
)
from omegaconf import OmegaConf

from trainer.config.slurm import expand_hosts, first_host, topology
from trainer.entry.launcher import RendezvousFailed, launch_topology, rendezvous_failed
from trainer.errors import ConfigError


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node01", ["node01"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),  # no padding unless SLURM wrote it
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("a,b,c", ["a", "b", "c"]),
    ("gpu-a[1-2],cpu-b[07],login", ["gpu-a1", "gpu-a2", "cpu-b07", "login"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_node_lists_expand_like_scontrol_show_hostnames(nodelist, hosts):
    assert list(expand_hosts(nodelist)) == hosts
    assert first_host(nodelist) == hosts[0]


def test_the_first_host_of_a_huge_list_is_found_without_expanding_it():
    assert first_host("n[000000-999999],m[0-999999]") == "n000000"


@pytest.mark.parametrize("bad", ["node[01-03", "node]01[", "node[a-b]", "node[]", "", "node[[1]]"])
def test_malformed_node_lists_are_refused(bad):
    with pytest.raises(ValueError):
        first_host(bad)


SLURM_2 = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[07-08]"}


def test_topology_from_the_environment():
    assert topology({}) is None  # not under SLURM
    assert topology({**SLURM_2, "SLURM_JOB_ID": ""}) is None
    assert topology({**SLURM_2, "SLURM_NNODES": "1"}) is None  # one node: nothing to rendezvous with
    assert topology(SLURM_2) == (2, 1, "node07:29500")
    assert topology({**SLURM_2, "MASTER_PORT": "1234"}) == (2, 1, "node07:1234")
    assert topology({**SLURM_2, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}) == (2, 1, "10.0.0.5:1234")
    assert topology({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2",
                     "SLURM_NODELIST": "a,b,c"}) == (3, 2, "a:29500")
    with pytest.raises(ConfigError, match="SLURM_NODEID='2'"):
        topology({**SLURM_2, "SLURM_NODEID": "2"})


def _world(**keys):
    return OmegaConf.create({"_target_": "trainer.parallel.DDP", "nproc_per_node": 1, "nnodes": 1,
                             "node_rank": 0, "rdzv_endpoint": None, **keys})


def test_slurm_fills_the_topology_only_when_the_user_left_it_at_its_defaults(monkeypatch):
    for k in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(k)
    assert (launch_topology(_world()).nnodes, launch_topology(_world()).rdzv_endpoint) == (1, None)  # no SLURM

    for k, v in SLURM_2.items():
        monkeypatch.setenv(k, v)
    said = []
    w = launch_topology(_world(), say=lambda *a, **k: said.append(a[0]))
    assert (w.nnodes, w.node_rank, w.rdzv_endpoint) == (2, 1, "node07:29500")
    assert said == ["world.nnodes=2 world.node_rank=1 world.rdzv_endpoint=node07:29500 (from SLURM job 4242)"]

    # Any one of the three set by the user: the three are the user's, SLURM is not read.
    for given in ({"nnodes": 3, "rdzv_endpoint": "h:1"}, {"node_rank": 0, "nnodes": 2, "rdzv_endpoint": "h:1"},
                  {"rdzv_endpoint": "h:1"}):
        w = launch_topology(_world(**given))
        assert (w.nnodes, w.node_rank, w.rdzv_endpoint) == (given.get("nnodes", 1), given.get("node_rank", 0), "h:1")

    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[07-")
    with pytest.raises(ConfigError, match=r"SLURM job 4242.*world.rdzv_endpoint=HOST:PORT yourself"):
        launch_topology(_world())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_one_configured_by_hand_one_from_slurm_variables(corpus, tmp_path, reference,
                                                                                monkeypatch):
    """Two "nodes" of one process each on 127.0.0.1, sharing one run dir as the README says: node 0 is given
    world.nnodes / node_rank / rdzv_endpoint on its command line, node 1 reads them from faked SLURM variables
    alone. The run dir's lock is one per job (node 0's launcher holds it for the job; node 1 checks it is its
    job's: it used to refuse the dir). Global rank 0 (on either node) writes the metrics, which equal one
    process's."""
    port = str(_free_port())
    slurm = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "MASTER_PORT": port,
             "SLURM_NODEID": "1"}
    for key in os.environ:
        if key.startswith(("SLURM_", "MASTER_")):
            monkeypatch.delenv(key)
    by_hand = ["world.nnodes=2", "world.node_rank=0", f"world.rdzv_endpoint=127.0.0.1:{port}"]
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(start_cli(
            *tiny_overrides(corpus, *SHARED, "world=ddp", "world.nproc_per_node=1", "data.batch_size=4"),
            *(by_hand if rank == 0 else []), f"hydra.run.dir={tmp_path / 'shared'}", env=slurm if rank == 1 else {}))
            for rank in (0, 1)]
        done = [node.wait(timeout=240) for node in nodes]
    outs = [(r.stdout, r.stderr) for r in done]
    assert [r.returncode for r in done] == [0, 0], outs
    assert f"world.nnodes=2 world.node_rank=1 world.rdzv_endpoint=127.0.0.1:{port} (from SLURM job 777)" in outs[1][0]
    assert "from SLURM" not in outs[0][0]
    assert_same_run(tmp_path / "shared", reference)


def test_two_nodes_started_with_different_settings_stop_naming_them_before_training(corpus, tmp_path):
    """Each node's launcher composes its own command line: optim.lr=1e-3 on node 0 and 2e-3 on node 1 trained two
    different models in one DDP job, both exit 0, config.yaml recording node 0's (and a differing max_steps hung,
    a differing model was a DDP traceback). Every rank compares its config with rank 0's at the start."""
    port = str(_free_port())
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(start_cli(
            *tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=1", "world.nnodes=2", f"world.node_rank={rank}",
                            f"world.rdzv_endpoint=127.0.0.1:{port}", f"optim.lr={lr}"),
            f"hydra.run.dir={tmp_path / 'shared'}")) for rank, lr in ((0, "1e-3"), (1, "2e-3"))]
        done = [node.wait(timeout=240) for node in nodes]
    for r in done:
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "the nodes of this job were started with different settings (optim.lr: 0.001 on rank 0, 0.002 on " \
               "rank 1)" in r.stderr and "Nothing was trained" in r.stderr, r.stderr
    assert not (tmp_path / "shared" / "checkpoints").exists() and not (tmp_path / "shared" / "metrics.jsonl").exists()


def test_two_nodes_writing_two_run_dirs_stop_naming_both_before_training(corpus, tmp_path):
    """Global rank 0 writes the run, and the rendezvous ranks the nodes by host name, not world.node_rank: nodes given
    two run dirs (the default outputs/DATE/TIME of nodes started in different seconds, or a disk of each node's own)
    split the run, node 0 saying `done:` for a dir holding only its config. Now both refuse, naming both dirs."""
    port = str(_free_port())
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(start_cli(
            *tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=1", "world.nnodes=2", f"world.node_rank={rank}",
                            f"world.rdzv_endpoint=127.0.0.1:{port}"),
            f"hydra.run.dir={tmp_path / f'node{rank}'}")) for rank in (0, 1)]
        done = [node.wait(timeout=240) for node in nodes]
    for r in done:
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "the nodes of this job do not write one run dir" in r.stderr and "Nothing was trained" in r.stderr
        assert f"writes {tmp_path / 'node0'}, where node 0's launcher locked" in r.stderr, r.stderr
        assert f"writes {tmp_path / 'node1'}, which is another path" in r.stderr, r.stderr
    assert not (tmp_path / "node0" / "metrics.jsonl").exists() and not (tmp_path / "node1" / "metrics.jsonl").exists()


needs_submitit = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                    reason="needs hydra-submitit-launcher (pip install -e '.[slurm]')")


@needs_submitit
def test_a_submitit_sweep_rerun_reordered_with_a_new_point_in_front_continues_each_points_own_run(corpus, tmp_path):
    """Two ways a sweep rerun under submitit, where each job runs in a process of its own as on SLURM, took another
    point's run for its own:
    - each job's .hydra/ records are written into its numbered dir before the job runs, so the dir's records named
      the job's point whatever run the dir held: a rerun with the values reordered continued dir 0's run as dir 1's
      point and the other way round, said only in submitit's log. A run's config.yaml decides now.
    - the swept keys were read from sys.argv, which in a submitit job is submitit's own, so a swept key that a rerun
      may otherwise change (trainer.max_steps) was read as a longer run: max_steps=4 continued the 2-step run and
      the 2-step point found the 4-step run "already finished". They are read from the sweep's multirun.yaml.
    (The rerun has a new value in front, as well: its job 0 is a new point, and dir 0 holds another.)"""
    sweep = tmp_path / "sweep"
    args = (*tiny_overrides(corpus, "checkpoint.every_n_steps=2"), f"hydra.sweep.dir={sweep}", "resume=auto")
    assert run_here("-m", *args, "trainer.max_steps=2,4", cwd=tmp_path).returncode == 0
    r = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", *args, "trainer.max_steps=3,4,2",
                cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # Each point's run where the first sweep left it (the 2- and 4-step runs were finished), the new one in 0-2.
    for job, steps in (("0", 2), ("1", 4), ("0-2", 3)):
        assert yaml.safe_load((sweep / job / "config.yaml").read_text())["trainer"]["max_steps"] == steps
        assert [e["step"] for e in read_metrics(sweep / job) if "train/loss" in e] == list(range(1, steps + 1))
    # (job 2's own numbered dir, which Hydra made for it empty, is not left behind)
    assert sorted(d.name for d in sweep.iterdir() if d.is_dir() and not d.name.startswith(".")) == ["0", "0-2", "1"]
    # Each job was pickled by submitit and run in a process of its own, as on SLURM, to its export; its run_info.json
    # names the command that runs the point alone there (it named submitit's _submit.py and a pickle's dir).
    assert (sweep / "0-2" / "model.safetensors").exists()
    command = json.loads((sweep / "0-2" / "run_info.json").read_text())["command"]
    assert command[:3] == ["python", "-m", "trainer"] and "trainer.max_steps=3" in command, command
    assert command[-1] == f"hydra.run.dir={sweep / '0-2'}" and not any(a.endswith("_submit.py") or "/.submitit/" in a
                                                                       for a in command), command
    outs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(outs) == 3 and all("Job completed successfully" in p.read_text() for p in outs)
    logs = "".join(p.read_text() for p in outs)
    assert logs.count("the run is already finished") == 2 and "continues its run in" in logs, logs


def _results_wait_of_a_second() -> None:
    """submitit waits up to 15 s for the result file of a job that exited without one (a point that exits with its
    own code writes none) before it reports it; a second here, for the test's time (what follows is the same)."""
    import submitit.core.core

    submitit.core.core.Job._results_timeout_s = 1


@needs_submitit
def test_a_failed_submitit_point_is_its_own_paragraph_and_exit_code(corpus, tmp_path):
    """A point that a submitit launcher ran and that failed was submitit's UncompletedJobError, printed by Hydra as a
    traceback with exit 1 (the point's own paragraph inside it; a NaN's exit 3 and a preemption's 75 lost)."""
    r = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
                *tiny_overrides(corpus, "trainer.max_steps=3"), "optim=sgd", "scheduler.warmup_steps=0",
                "optim.lr=1e9", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=300,
                preexec=_results_wait_of_a_second)
    assert r.returncode == 3, r.stdout + r.stderr  # (NonFiniteError's, as under the basic launcher)
    assert "Traceback" not in r.stderr and "UncompletedJobError" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: non-finite") and "(the point ran as submitit job" in r.stderr, r.stderr
    assert "(exit 3)" not in r.stderr


@needs_submitit
def test_a_submitit_launcher_misspelt_is_named_not_sent_to_install_it(tmp_path):
    from test_errors import assert_clean_error

    r = run_main("-m", "hydra/launcher=submitit_slrum", "debug=smoke", "optim.lr=1e-3,3e-4", cwd=tmp_path)
    assert_clean_error(r, "hydra/launcher=submitit_slrum is not an option", "Did you mean submitit_slurm?")
    assert "not installed" not in r.stderr


@needs_submitit
@pytest.mark.parametrize("given", ["+hydra.job.env_set.HF_TOKEN={value}", "task.sample_prompt={value}"])
def test_a_secret_on_a_submitit_sweeps_command_line_is_refused_before_submitit_pickles_it(tmp_path, monkeypatch, given):
    """submitit pickles each job's overrides and config into SWEEP/.submitit/ as they are: a secret on the command
    line (a secret key's value, or a value that is a secret of the environment) was kept there in clear, where
    multirun.yaml and the console redacted it. An interpolation of the environment is pickled as written: allowed."""
    from test_errors import assert_clean_error

    monkeypatch.setenv("MY_SECRET", "hunter2hunter2xyz")
    value = "hf_cmdline_secret_777" if "HF_TOKEN" in given else "hunter2hunter2xyz"
    r = run_main("-m", "hydra/launcher=submitit_local", "debug=smoke", given.format(value=value), "optim.lr=1e-3,3e-4",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert_clean_error(r, "on the command line of a submitit sweep", "Set it in the environment the jobs inherit")
    assert value not in r.stderr + r.stdout and not (tmp_path / "sweep").exists()
    from trainer.entry.cli import refuse_pickled_secrets

    refuse_pickled_secrets(["-m", "+hydra.job.env_set.HF_TOKEN=${oc.env:HF_TOKEN}", "optim.lr=1e-3,3e-4"])
    # One run uses no launcher: nothing is pickled, nothing refused.
    one = run_here("hydra/launcher=submitit_local", "debug=smoke", "trainer.max_steps=1", given.format(value=value),
                   f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr


def test_without_the_submitit_plugin_its_launchers_are_the_install_paragraph(tmp_path):
    """Without hydra-submitit-launcher, hydra/launcher=submitit_slurm was "not an option ... Available: basic", the
    one missing extra whose error did not name its install."""
    from test_errors import assert_clean_error

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['hydra_plugins.hydra_submitit_launcher'] = None\n")
    r = run_cli("-m", "hydra/launcher=submitit_slurm", "debug=smoke", "optim.lr=1e-3,3e-4",
                f"hydra.sweep.dir={tmp_path / 'sweep'}", env={"PYTHONPATH": f"{site}:{ROOT}"}, fresh=True, cwd=tmp_path)
    assert_clean_error(r, "hydra/launcher=submitit_slurm comes with the hydra-submitit-launcher package",
                       "pip install -e '.[slurm]'")
    assert not (tmp_path / "sweep").exists()


@needs_submitit
def test_a_slurm_sweep_where_there_is_no_slurm_is_one_paragraph_and_makes_no_sweep_dir(tmp_path, monkeypatch):
    """The README's submitit_slurm sweep on a machine without SLURM was submitit's `Could not detect "srun"`
    traceback, with the sweep dir made."""
    from test_errors import assert_clean_error

    monkeypatch.setenv("PATH", str(tmp_path))  # (no sbatch on it, whatever this machine has)
    r = run_main("-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}", "debug=smoke",
                 "optim.lr=1e-3,3e-4", cwd=tmp_path)
    assert_clean_error(r, "hydra/launcher=submitit_slurm submits each point with sbatch and srun, and this machine "
                       "has no sbatch or srun", "hydra/launcher=submitit_local")
    assert not (tmp_path / "sweep").exists()


@needs_submitit
def test_the_submitit_slurm_command_composes():
    """The options of the README's submitit_slurm command exist (nothing is submitted: --cfg hydra only prints)."""
    r = run_here("--cfg", "hydra", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                 "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=8",
                 "hydra.launcher.timeout_min=1440", "hydra.launcher.signal_delay_s=120",
                 "hydra.launcher.max_num_timeout=5", "world=ddp", "resume=auto")
    assert r.returncode == 0, r.stderr
    launcher = yaml.safe_load(r.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["partition"], launcher["nodes"], launcher["tasks_per_node"], launcher["signal_delay_s"]) == (
        "gpu", 2, 1, 120)


def test_the_sbatch_example_is_valid_bash_and_uses_the_cli():
    script = (ROOT / "examples" / "slurm" / "train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "examples" / "slurm" / "train.sbatch")]).returncode == 0
    assert "#SBATCH --requeue" in script and "srun python -m trainer" in script and "resume=auto" in script


# -- hostile or mistaken values: refused at once, in one paragraph naming the variable ----------------------
@pytest.fixture
def deadline():
    """A safety net, not the assertion: a parser that loops fails the test after 5 s instead of hanging it."""
    def expired(*_):
        raise TimeoutError("the SLURM variables were not read within 5 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("nodelist", [
    "node[1-99999999999999][5-1]",  # once spun at 100% CPU: a huge range times an empty one
    "node[5-1]",
    "node[01-03,9-7]",
    "node[1-99999999999999]",
    "rack[1-100000]-gpu[1-100000]",
    "node[" + "9" * 5000 + "]",
])
def test_reversed_or_absurd_node_ranges_are_refused_at_once(nodelist, deadline):
    with pytest.raises(ValueError):
        first_host(nodelist)
    with pytest.raises(ConfigError) as err:
        topology({**SLURM_2, "SLURM_JOB_NODELIST": nodelist})
    text = str(err.value)
    assert "SLURM_JOB_NODELIST=" in text and nodelist[:40] in text and "\n" not in text
    assert len(text) < 600  # the value is shortened, not printed whole


@pytest.mark.parametrize(("variable", "value"), [
    ("SLURM_NNODES", "99999999999999999999999"),
    ("SLURM_NNODES", "0"),
    ("SLURM_NNODES", "-2"),
    ("SLURM_NNODES", "two"),
    ("SLURM_NODEID", "2"),
    ("SLURM_NODEID", "-1"),
    ("SLURM_NODEID", "first"),
    ("MASTER_PORT", "99999"),
    ("MASTER_PORT", "0"),
    ("MASTER_PORT", "http"),
    ("MASTER_ADDR", "bad host"),
])
def test_implausible_node_counts_ids_and_ports_are_refused(variable, value):
    with pytest.raises(ConfigError) as err:
        topology({**SLURM_2, variable: value})
    text = str(err.value)
    assert f"{variable}={value!r}" in text and "SLURM job 4242" in text and "\n" not in text


@pytest.mark.parametrize(("key", "value"), [
    ("rdzv_endpoint", "127.0.0.1:99999"),
    ("rdzv_endpoint", "127.0.0.1:0"),
    ("rdzv_endpoint", "node0"),  # no port
    ("rdzv_endpoint", ":29500"),
    ("rdzv_endpoint", "node0:http"),
    ("nnodes", 99999999999999999999999),
    ("rdzv_timeout", 0),
])
def test_world_launch_keys_out_of_range_are_refused(key, value):
    from trainer.config.schema import _validate_world

    with pytest.raises(ConfigError, match=rf"world\.{key}=") as err:
        _validate_world(_world(**{key: value}))
    assert "\n" not in str(err.value)


def test_endpoints_that_torch_takes_are_accepted():
    from trainer.config.schema import _validate_world

    for endpoint in ("node0:29500", "10.0.0.5:1", "gpu-a07.cluster.local:65535", "[::1]:29500"):
        _validate_world(_world(nnodes=2, rdzv_endpoint=endpoint, rdzv_timeout=30))


@pytest.mark.parametrize(("overrides", "env"), [
    (["world.rdzv_endpoint=127.0.0.1:99999"], {}),
    ([], {**SLURM_2, "MASTER_PORT": "99999"}),
    ([], {**SLURM_2, "SLURM_JOB_NODELIST": "node[1-99999999999999][5-1]"}),
])
def test_a_bad_port_or_node_list_ends_before_the_run_dir_exists(corpus, tmp_path, overrides, env):
    run_dir = tmp_path / "x"
    r = run_main(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=2", *overrides),
                 f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "99999" in r.stderr
    assert not run_dir.exists()


def test_a_one_process_world_on_several_nodes_is_refused_before_the_run_dir_exists(corpus, tmp_path):
    """world=single in a two-node SLURM job trained a copy of the run on each node (and printed the nodes' topology
    as if it used it); world.nnodes=2 beside it did the same. What trains nothing there (--cfg job) still runs."""
    from trainer.config.schema import refuse_one_process_on_nodes

    run_dir = tmp_path / "x"
    r = run_main(*tiny_overrides(corpus, "world=single"), f"hydra.run.dir={run_dir}", cwd=tmp_path, env=SLURM_2)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "SLURM job 4242 runs it on 2 nodes: each node would train its own copy" in r.stderr
    assert "world=ddp" in r.stderr and not run_dir.exists()
    r = run_here(*tiny_overrides(corpus, "world=single"), "--cfg", "job", cwd=tmp_path, env=SLURM_2)
    assert r.returncode == 0 and "_target_: trainer.parallel.SingleDevice" in r.stdout, r.stderr
    with pytest.raises(ConfigError, match=r"world.nnodes=2: each node would train its own copy"):
        refuse_one_process_on_nodes(_world(_target_="trainer.parallel.SingleDevice", nnodes=2,
                                           rdzv_endpoint="node0:29500"))
    refuse_one_process_on_nodes(_world(nnodes=2, rdzv_endpoint="node0:29500"))  # DDP: across the nodes


# -- a node that never comes ----------------------------------------------------------------------------
def _alone(corpus, tmp_path, node_rank: int) -> tuple[subprocess.CompletedProcess, str]:
    """One node of a two-node job, started alone, with a 3 s rendezvous timeout."""
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {k: "" for k in os.environ if k.startswith(("SLURM_", "MASTER_"))}
    r = run_cli(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=1", "world.nnodes=2",
                                f"world.node_rank={node_rank}", f"world.rdzv_endpoint={endpoint}",
                                "world.rdzv_timeout=3"), f"hydra.run.dir={tmp_path / 'run'}", env=env, timeout=60)
    return r, endpoint


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_node_that_never_comes_ends_the_run_with_one_paragraph(corpus, tmp_path, node_rank):
    """Node 0 alone waits world.rdzv_timeout for node 1; node 1 alone waits as long for node 0's endpoint. Both
    then say which endpoint, how many nodes, and what to check, without torch's traceback or C++ log."""
    r, endpoint = _alone(corpus, tmp_path, node_rank)
    assert r.returncode == RendezvousFailed.exit_code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, r.stderr
    assert endpoint in error[0] and "2 nodes" in error[0] and "world.rdzv_timeout=3" in error[0], error[0]
    assert not (tmp_path / "run").exists()  # nothing trained: no run dir left (node 1's was an empty one Hydra made)


def test_node_0_with_a_rendezvous_host_it_cannot_resolve_says_so_at_once(corpus, tmp_path):
    """torch's store tried to reach such a host for about two minutes (world.rdzv_timeout aside), a c10d warning
    a try; node 0 now checks its own host first. (The subprocess's 60 s limit is under torch's two minutes.)"""
    env = {k: "" for k in os.environ if k.startswith(("SLURM_", "MASTER_"))}
    r = run_cli(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=1", "world.nnodes=2", "world.node_rank=0",
                                "world.rdzv_endpoint=nosuchhost.invalid:29500"), f"hydra.run.dir={tmp_path / 'run'}",
                env=env, timeout=60)
    assert r.returncode == RendezvousFailed.exit_code, r.stdout + r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "c10d" not in r.stderr, r.stderr
    assert "'nosuchhost.invalid'" in error[0] and "cannot be resolved on node 0" in error[0], error[0]
    assert not (tmp_path / "run").exists()  # (nothing was trained: the new run's dir held only its records)


def test_rendezvous_failures_are_explained():
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from trainer.config.schema import LaunchConfig

    w = LaunchConfig(nnodes=4, node_rank=0, rdzv_endpoint="node0:29500", rdzv_timeout=600)
    text = str(rendezvous_failed(w, RendezvousTimeoutError()))
    assert "node0:29500" in text and "4 nodes" in text and "600 s" in text and "\n" not in text
    refused = RendezvousConnectionError("The connection to the C10d store has failed.")
    refused.__cause__ = RuntimeError("The server socket has failed to listen on any local network address. "
                                     "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")
    text = str(rendezvous_failed(w, refused))
    assert "EADDRINUSE" in text and "node0:29500" in text and "\n" not in text
