"""examples/paci/train_gpt.slurm, submitted for real to a one-node Slurm cluster that the test
starts on loopback (MUNGE + slurmctld + slurmd in a temporary directory).

Needs Debian's slurmctld, slurmd, slurm-client and munge: `make cluster-test` installs them
(tools/install_slurm.sh) and sets PACI_REQUIRE_SLURM=1, so there a missing package fails the test
instead of skipping it.
"""

import json
import os
import shutil
import tempfile

import pytest
import run_cases
from launch_helpers import (
    CPU_CASE_EXTRA_FLAGS,
    CPU_CASE_VARIABLES,
    REFERENCE_CASE,
    REPO,
    reference_environment,
    script_environment,
)
from slurm_cluster import LoopbackSlurm, free_port, missing_commands

SLURM_SCRIPT = os.path.join(REPO, "examples", "paci", "train_gpt.slurm")


@pytest.fixture
def cluster():
    missing = missing_commands()
    if missing:
        message = (
            f"Slurm/MUNGE not installed ({', '.join(missing)}); make cluster-test installs them"
        )
        if os.environ.get("PACI_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # A short path: MUNGE's socket path must fit a Unix socket name (108 bytes).
    directory = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
    try:
        with LoopbackSlurm(os.path.join(directory, "cluster")) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_sbatch_script_trains_on_a_loopback_cluster(cluster):
    """One torchrun on the allocation's node, rendezvous on the first node's name; the 4-stage
    PACI run must finish and reproduce the reference case's losses."""
    output = os.path.join(cluster.directory, "run")
    job_log = os.path.join(cluster.directory, "job-%j.out")
    port = free_port()
    variables = {
        **CPU_CASE_VARIABLES, **reference_environment(), "NPROC_PER_NODE": "4",
        "RDZV_PORT": str(port), "OUT": output,
    }  # fmt: skip
    environment = {**script_environment(**variables), **cluster.environment}
    job_id, code = cluster.sbatch_wait(
        ["--nodes", "1", "--time", "10", f"--output={job_log}", SLURM_SCRIPT,
         *CPU_CASE_EXTRA_FLAGS],
        timeout=400, cwd=REPO, env=environment,
    )  # fmt: skip
    log = open(job_log.replace("%j", str(job_id))).read()
    assert code == 0, log[-5000:] + cluster.logs()
    assert cluster.job_state(job_id) == "COMPLETED 0:0"
    assert f"rendezvous {cluster.node}:{port}" in log
    summary = json.load(open(os.path.join(output, "summary.json")))
    assert summary["pipeline_stages"] == 4 and summary["iterations"] == 8
    golden = run_cases.golden_losses(REFERENCE_CASE)
    assert run_cases.relative_difference(summary["loss"], golden) <= 1e-5
