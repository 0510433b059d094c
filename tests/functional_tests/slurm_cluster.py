"""A one-node Slurm cluster on loopback, started from a temporary directory for a test.

MUNGE (authentication), slurmctld (controller) and slurmd (the node) run as the current user with
every file, socket and port of their own, so nothing system-wide is touched and several
clusters can coexist. The node is this host under its own name, so `scontrol show hostnames`
gives a name that resolves, as on a real cluster.

    with LoopbackSlurm(directory) as cluster:
        job = cluster.sbatch(["--nodes", "1", "script.sh"], cwd=REPO)
"""

import os
import shutil
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")


def missing_commands() -> list[str]:
    """The Slurm and MUNGE programs this harness needs that are not installed."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [name for name in DAEMONS if shutil.which(name, path=path) is None]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlurmError(RuntimeError):
    pass


class LoopbackSlurm:
    def __init__(self, directory: str, cpus: int | None = None):
        self.directory = os.path.abspath(directory)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.config = os.path.join(self.directory, "slurm.conf")
        self.munge_socket = os.path.join(self.directory, "munge", "munge.socket")
        self.processes: list[subprocess.Popen] = []
        self.environment = {
            **os.environ,
            "SLURM_CONF": self.config,
            "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
        }

    def __enter__(self) -> "LoopbackSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def start(self, timeout: float = 60.0) -> None:
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(self.path(sub), mode=0o700, exist_ok=True)
        self._start_munge()
        self._write_config()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.config])
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.config, "-N", self.node])
        self._wait_for_idle_node(timeout)

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.path("log", f"{name}.out"), "w")
        process = subprocess.Popen(
            command, env=self.environment, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes.append(process)

    def _start_munge(self) -> None:
        key = self.path("munge", "munge.key")
        with open(key, "wb") as out:
            out.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--key-file={key}",
                f"--socket={self.munge_socket}", f"--pid-file={self.path('munge', 'munged.pid')}",
                f"--log-file={self.path('log', 'munged.log')}",
                f"--seed-file={self.path('munge', 'munged.seed')}",
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmError("munged did not create its socket:\n" + self.logs())
            time.sleep(0.1)

    def _write_config(self) -> None:
        user = _user_name()
        settings = {
            "ClusterName": "loopback",
            "SlurmctldHost": f"{self.node}(127.0.0.1)",
            "SlurmctldPort": free_port(),
            "SlurmdPort": free_port(),
            "SlurmUser": user,
            "SlurmdUser": user,
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "StateSaveLocation": self.path("state"),
            "SlurmdSpoolDir": self.path("spool"),
            "SlurmctldPidFile": self.path("slurmctld.pid"),
            "SlurmdPidFile": self.path("slurmd.pid"),
            "SlurmctldLogFile": self.path("log", "slurmctld.log"),
            "SlurmdLogFile": self.path("log", "slurmd.log"),
            # No cgroups in a container: track and launch processes the plain Linux way.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "SchedulerType": "sched/builtin",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "SlurmdTimeout": 60,
            "InactiveLimit": 0,
            "KillWait": 5,
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines.append(f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=60 State=UP")
        with open(self.config, "w") as out:
            out.write("\n".join(lines) + "\n")

    def _check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                raise SlurmError(
                    f"{process.args[0]} exited with code {process.returncode}:\n" + self.logs()
                )

    def _wait_for_idle_node(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            probe = self.run(["sinfo", "--noheader", "--Node", "--format=%T"], check=False)
            state = probe.stdout.strip()
            if probe.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.5)
        raise SlurmError(f"node not idle after {timeout:.0f} s (state {state!r}):\n" + self.logs())

    def run(self, command: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.environment)
        completed = subprocess.run(command, capture_output=True, text=True, **kwargs)
        if check and completed.returncode != 0:
            raise SlurmError(
                f"{' '.join(command)} failed ({completed.returncode}):\n"
                f"{completed.stdout}{completed.stderr}"
            )
        return completed

    def sbatch_wait(self, arguments: list[str], timeout: float, **kwargs):
        """Submit a batch job, wait for it to end; return (job id, sbatch's exit code)."""
        completed = self.run(
            ["sbatch", "--parsable", "--wait", *arguments], check=False, timeout=timeout, **kwargs
        )
        job_id = completed.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch did not submit: {completed.stdout}{completed.stderr}")
        return int(job_id), completed.returncode

    def job_state(self, job_id: int) -> str:
        """The job's final state and exit code as scontrol reports them, e.g. 'COMPLETED 0:0'."""
        text = self.run(["scontrol", "show", "job", str(job_id)]).stdout
        fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
        return f"{fields.get('JobState')} {fields.get('ExitCode')}"

    def _cancel_jobs(self, timeout: float = 20.0) -> None:
        """Cancel what still runs (a test that timed out) so no job outlives the cluster."""
        try:
            self.run(["scancel", "--full", "--user", _user_name()], check=False, timeout=10)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "--noheader"], check=False, timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    return
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def logs(self) -> str:
        parts = []
        for name in sorted(os.listdir(self.path("log"))):
            text = open(self.path("log", name), errors="replace").read()
            parts.append(f"--- {name}\n{text[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        if self.processes:
            self._cancel_jobs()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
