"""`specserve doctor` on a healthy cluster, a missing Redis, and certificates near expiry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import cluster_config
from specserve.common.tls import dev_tls_config, make_dev_certs
from specserve.tools.local_cluster import free_port


def doctor(config, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.tools.cli", "--config", str(config), "doctor", *flags],
        capture_output=True,
        text=True,
        timeout=180,
    )


def lines(out: str) -> dict[str, str]:
    """check name -> level"""
    return {line[6:34].strip(): line[:4].strip() for line in out.splitlines() if line[4:6] == "  "}


@pytest.mark.cluster
def test_a_healthy_cluster_passes(tiny_cluster):
    run = doctor(
        tiny_cluster.config_path,
        "--gateway",
        tiny_cluster.procs["gateway"].address,
        "--scheduler",
        tiny_cluster.procs["scheduler"].address,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = lines(run.stdout)
    assert found["config"] == "ok" and found["target model"] == "ok"
    assert found["health gateway"] == "ok" and found["health scheduler"] == "ok"
    verifier = tiny_cluster.procs["verifier"].address
    drafter = tiny_cluster.procs["drafter"].address
    assert found[f"health verifier {verifier}"[:28]] == "ok"
    assert "stable pool, " in run.stdout  # what each verifier serves (its Status)
    assert found["rollout"] == "ok"
    assert found[f"health drafter {drafter}"[:28]] == "ok"
    assert found["redis"] == "warn"  # the tests' Redis keeps nothing on disk: said, with why
    assert "appendonly=no" in run.stdout


@pytest.mark.cluster
def test_the_health_probe_of_a_verifier_says_what_it_serves(tiny_cluster):
    port = str(tiny_cluster.procs["verifier"].port)
    run = subprocess.run(
        [sys.executable, "-m", "specserve.tools.cli", "--config", str(tiny_cluster.config_path)]
        + ["health", "verifier", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    model = tiny_cluster.config["verifier"]["model"]["path"].rstrip("/").rsplit("/", 1)[-1]
    assert "SERVING; stable pool, " + model + ":" in run.stdout
    assert "sha256 " in run.stdout and "config " in run.stdout


def test_no_redis_and_expiring_certificates_are_reported(tmp_path, tiny_model_dir):
    config = cluster_config(tiny_model_dir, common={"insecure": False})
    config["common"]["redis_url"] = f"redis://127.0.0.1:{free_port()}/0"
    for section, values in dev_tls_config(make_dev_certs(tmp_path / "soon", days=10)).items():
        config[section].update(values)
    expired = make_dev_certs(tmp_path / "old", days=0)
    config["drafter"]["tls_cert_file"] = str(expired["drafter"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = doctor(path)
    assert run.returncode == 1
    found = lines(run.stdout)
    assert found["redis"] == "fail" and "unreachable" in run.stdout
    assert found["certificate gateway.pem"] == "warn" and "expires in 9 days" in run.stdout
    assert found["certificate drafter.pem"] == "fail"


def test_a_target_that_does_not_split_over_the_ranks_is_reported(tmp_path, tiny_model_dir):
    """verifier.tensor_parallel over the tiny model (4 heads, 2 KV heads): 3 ranks cannot
    split it, and the doctor says so with the numbers; 2 can."""
    found = {}
    for ranks in (2, 3):
        config = tmp_path / f"tp{ranks}.yaml"
        settings = cluster_config(tiny_model_dir, verifier={"tensor_parallel": ranks})
        config.write_text(yaml.safe_dump(settings))
        found[ranks] = doctor(config).stdout
    assert "fail  tensor parallel" in found[3]
    assert "3 does not divide the model's attention heads (4)" in found[3]
    assert "ok    tensor parallel" in found[2] and "splits over 2 ranks (gloo)" in found[2]
