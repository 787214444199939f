"""Clusters: the handover to submitit adds resume=auto to the requeued job; a multi-node launch reads its rendezvous from
SLURM's variables (exact argv for 2 nodes x 8 GPUs); the sbatch template is valid bash."""

import re
import signal
import subprocess

import pytest
from conftest import REPO, compose_cfg

from qlora_recipes.integrations import cluster
from qlora_recipes.run import dist

SBATCH = REPO / "launch" / "slurm" / "multinode.sbatch"


def test_hand_over_requeues_through_submitit_with_resume_auto(tmp_path, monkeypatch):
    """submitit's own handler, as a submitit job has it on USR2: our handover makes it pickle Hydra's
    launcher job with resume=auto in place of the job's resume override, then requeue (the exit code the local controller restarts)."""
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher
    from submitit.core.job_environment import SignalHandler
    from submitit.core.utils import DelayedSubmission, JobPaths
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, LocalJobEnvironment

    for key, value in {"SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_GLOBALID": "0"}.items():
        monkeypatch.setenv(key, value)
    paths = JobPaths(tmp_path, job_id="77")
    job = DelayedSubmission(LocalLauncher(submitit_folder=str(tmp_path)), ["peft.r=8", "resume=none"], "k", 0, "j", {})
    job.set_timeout(60, 3)
    handler = SignalHandler(LocalJobEnvironment(), paths, job).checkpoint_and_try_requeue
    assert cluster.submitit_handler(handler) is handler
    assert cluster.submitit_handler(signal.default_int_handler) is None  # not a submitit job
    with pytest.raises(SystemExit) as requeued:
        cluster.hand_over(handler, "SIGTERM")
    assert requeued.value.code == LOCAL_REQUEUE_RETURN_CODE  # the local controller starts the task again
    assert DelayedSubmission.load(paths.submitted_pickle).args[0] == ["peft.r=8", "resume=auto"]


@pytest.mark.parametrize(
    "nodelist,first",
    [("gpu-[07-08]", "gpu-07"), ("node[3,5-6],login1", "node3"), ("a100x1", "a100x1"), ("h[001-016]", "h001")],
)
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert cluster.first_host(nodelist) == first


SLURM_NODE_1 = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[07-08]"}


@pytest.fixture
def second_node_of_a_slurm_job(monkeypatch, tmp_path):
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_NODE_1.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs" / "slurm" / "4242-llama3.1-405b-8xa100"


def test_multinode_torchrun_command_from_slurm(second_node_of_a_slurm_job):
    """2 nodes x 8 GPUs, node 1 of job 4242: torchrun meets node 0 (the allocation's first host);
    both nodes name the same run dir, the same again after a requeue (same job id)."""
    recipe = "llama3.1-405b-8xa100"
    cfg = compose_cfg(f"recipe={recipe}", "hardware.nodes=2", "dist.launcher=torchrun")
    cmd = dist.launch_command(cfg, recipe, ["hardware.nodes=2", "dist.launcher=torchrun"], python="python")
    assert cmd == [
        "python", "-m", "torch.distributed.run", "--nproc_per_node", "8",
        "--nnodes", "2", "--node_rank", "1", "--master_addr", "gpu-07", "--master_port", "29500",
        "-m", "qlora_recipes", "train", f"recipe={recipe}", "hardware.nodes=2", "dist.launcher=torchrun",
        f"hydra.run.dir={second_node_of_a_slurm_job}",
    ]  # fmt: skip


def test_multinode_accelerate_command_from_slurm(second_node_of_a_slurm_job, monkeypatch):
    recipe = "llama3.1-405b-8xa100"
    monkeypatch.setenv("MASTER_PORT", "31337")  # an exported port wins over the default
    cfg = compose_cfg(f"recipe={recipe}", "hardware.nodes=2")
    cmd = dist.launch_command(cfg, recipe, ["hardware.nodes=2"], python="python")
    config = str(cfg.dist.accelerate_config)
    assert cmd == [
        "python", "-m", "accelerate.commands.launch", "--config_file", config,
        "--num_processes", "16", "--num_machines", "2",
        "--machine_rank", "1", "--main_process_ip", "gpu-07", "--main_process_port", "31337",
        "--fsdp_offload_params", "true" if cfg.dist.offload_params else "false",
        "-m", "qlora_recipes", "train", f"recipe={recipe}", "hardware.nodes=2",
        f"hydra.run.dir={second_node_of_a_slurm_job}",
    ]  # fmt: skip


def test_sbatch_template_is_valid_bash_and_launches_per_node():
    text = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    assert "#SBATCH --requeue" in text and "#SBATCH --ntasks-per-node=1" in text
    assert re.search(r"srun .*\$QLORA launch \"\$RECIPE\" \"hardware.nodes=\$SLURM_NNODES\" resume=auto", text)
    assert 'RUN_DIR="$PWD/runs/slurm/${SLURM_JOB_ID}-${RECIPE}"' in text  # = cluster.slurm_run_dir
