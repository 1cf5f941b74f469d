"""Settings: YAML, environment and errors that name the key."""

from __future__ import annotations

import pytest
import torch

from specserve.common.settings import ConfigError, DrafterSettings, VerifierSettings


def test_settings_yaml_env_and_errors(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("common: {log_level: DEBUG}\nverifier: {batch_size: 3, dtype: bfloat16}\n")
    s = VerifierSettings.load(path)
    assert (s.batch_size, s.dtype, s.log_level) == (3, "bfloat16", "DEBUG")
    monkeypatch.setenv("SPECSERVE_VERIFIER_BATCH_SIZE", "5")
    assert VerifierSettings.load(path).batch_size == 5
    monkeypatch.setenv("SPECSERVE_VERIFIER_BATCH_SIZE", "0")
    with pytest.raises(ConfigError, match="verifier.batch_size"):
        VerifierSettings.load(path)
    monkeypatch.delenv("SPECSERVE_VERIFIER_BATCH_SIZE")
    path.write_text("verifier: {bach_size: 3}\n")
    with pytest.raises(ConfigError, match="verifier.bach_size"):
        VerifierSettings.load(path)


def test_settings_refuse_a_device_this_build_cannot_run(tmp_path, monkeypatch):
    """A device torch cannot use here stops the service at start, naming the key; the same
    assertions hold on a machine with or without a GPU."""
    path = tmp_path / "c.yaml"
    path.write_text("verifier: {device: 'cuda:99'}\n")  # no machine shows 100 GPUs
    with pytest.raises(ConfigError, match=r"verifier\.device: .*cuda:99 cannot run here"):
        VerifierSettings.load(path)
    path.write_text("drafter: {device: gpu}\n")
    with pytest.raises(ConfigError, match=r"drafter\.device: .*pattern"):
        DrafterSettings.load(path)
    monkeypatch.setenv("SPECSERVE_DRAFTER_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert DrafterSettings.load(None).device == "cuda"
        assert VerifierSettings.load(None, device="cuda:0").device == "cuda:0"
    else:
        with pytest.raises(ConfigError, match=r"drafter\.device: .*cuda cannot run here.*torch"):
            DrafterSettings.load(None)
    assert VerifierSettings.load(None, device="cpu").device == "cpu"
