"""``mlxr launch`` (the mlx.launch command it runs) and the ``distributed:`` section's checks."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from mlxr_core.cli.main import main


def write(tmp_path: Path, distributed: str, extra: str = "") -> Path:
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: /models/m.gguf\n{extra}distributed:\n{distributed}")
    return config


def dry_run(capsys: pytest.CaptureFixture[str], config: Path, *flags: str) -> list[str]:
    assert main(["launch", "--config", str(config), "--dry-run", *flags]) == 0
    return shlex.split(capsys.readouterr().out)


def test_a_dry_run_prints_the_mlx_launch_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "  tensor_parallel: 2\n  port: 40100\n")
    command = dry_run(capsys, config, "--port", "9000")
    assert Path(command[0]).name == "mlx.launch"
    assert "--backend" not in command  # auto: mlx.launch picks NCCL with CUDA, else ring
    hosts = command.index("--hosts")
    assert command[hosts + 1 : hosts + 4] == ["127.0.0.1", "-n", "2"]
    assert command[command.index("--starting-port") + 1] == "40100"
    rank = command[command.index("--") + 1 :]
    assert rank == [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config.resolve()), "--port", "9000"]


def test_hosts_hostfile_and_backend_reach_mlx_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = dry_run(capsys, write(tmp_path, "  backend: RING\n  hosts: [10.0.0.1, 10.0.0.2]\n  tensor_parallel: 2\n"))
    assert command[command.index("--backend") + 1] == "ring"
    assert command[command.index("--hosts") + 1] == "10.0.0.1,10.0.0.2" and "-n" not in command
    command = dry_run(capsys, write(tmp_path, "  backend: mpi\n  hostfile: hosts.json\n  pipeline_parallel: 2\n"))
    assert command[command.index("--hostfile") + 1] == str(Path("hosts.json").resolve())


def test_ranks_on_this_machine_share_its_cores_for_openblas(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxr_core.cli.launch import thread_limits
    from mlxr_core.config.schema import DistributedConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert thread_limits(DistributedConfig(pipeline_parallel=2), {}) == {"OPENBLAS_NUM_THREADS": "4"}
    local = DistributedConfig(tensor_parallel=2, pipeline_parallel=2, hosts=["localhost"] * 4)
    assert thread_limits(local, {}) == {"OPENBLAS_NUM_THREADS": "2"}
    assert thread_limits(DistributedConfig(tensor_parallel=16), {}) == {"OPENBLAS_NUM_THREADS": "1"}
    assert thread_limits(DistributedConfig(pipeline_parallel=2), {"OPENBLAS_NUM_THREADS": "3"}) == {}
    remote = DistributedConfig(tensor_parallel=2, hosts=["10.0.0.1", "10.0.0.2"])
    assert thread_limits(remote, {}) == {}  # each rank has a machine of its own


@pytest.mark.parametrize(
    ("distributed", "extra", "key"),
    [
        ("  tensor_parallel: 1\n", "", "distributed.tensor_parallel"),  # one process: nothing to launch
        ("  tensor_parallel: 0\n", "", "distributed.tensor_parallel"),
        ("  backend: tcp\n  tensor_parallel: 2\n", "", "distributed.backend"),
        ("  hosts: [a]\n  hostfile: h.json\n  tensor_parallel: 2\n", "", "distributed.hostfile"),
        ("  hosts: [10.0.0.1]\n  tensor_parallel: 2\n", "", "distributed.hosts"),
        ("  step_timeout_s: 0\n", "", "distributed.step_timeout_s"),
    ],
)
def test_bad_values_exit_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], distributed: str, extra: str, key: str
) -> None:
    assert main(["launch", "--config", str(write(tmp_path, distributed, extra)), "--dry-run"]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize(
    ("distributed", "extra", "key", "words"),
    [
        ("  tensor_parallel: 2\n", "", "distributed.tensor_parallel", "mlxr launch"),
        ("  tensor_parallel: 2\n", "engine:\n  prefix_cache:\n    disk: {path: /tmp/p}\n", "engine.prefix_cache.disk", "null"),
        ("  backend: nccl\n  pipeline_parallel: 2\n", "", "distributed.pipeline_parallel", "send/recv"),
    ],
)
def test_serve_refuses_before_loading_what_cannot_run_across_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], distributed: str, extra: str, key: str, words: str
) -> None:
    config = write(tmp_path, distributed, extra)  # the model path does not exist: nothing loads
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert key in err and words in err, err


def test_launch_exits_non_zero_when_a_rank_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """mlx.launch itself exits 0 after a rank failed; ``mlxr launch`` reads its report of it."""
    from mlxr_core.cli import launch

    script = tmp_path / "mlx.launch"
    report = {"fails": "print('Node with rank 1 exited with code 3', file=sys.stderr)",
              "killed": "print('Node with rank 0 was killed', file=sys.stderr)", "fine": "print('ok')"}  # fmt: skip
    config = write(tmp_path, "  tensor_parallel: 2\n")
    for case, expected in (("fails", 3), ("killed", 1), ("fine", 0)):
        script.write_text(f"#!{sys.executable}\nimport sys\n{report[case]}\nsys.exit(0)\n")
        script.chmod(0o755)
        monkeypatch.setattr(launch, "_mlx_launch", lambda: str(script))
        assert main(["launch", "--config", str(config)]) == expected, case
    assert "rank 0 was killed" in capsys.readouterr().err
