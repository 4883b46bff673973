import importlib.metadata as md

import pytest

from flashinfer.moe_ep.cli import doctor, main


def test_demo_runs_and_checks(capsys) -> None:
    assert main(["demo", "--tokens", "0", "1", "9", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend reference" in out and "all sizes match" in out
    assert out.count(" ok") >= 3


def test_demo_world_size_two(capsys) -> None:
    assert main(["demo", "--world-size", "2", "--tokens", "0", "5", "--iters", "1", "--routing", "skewed"]) == 0
    assert "world 2" in capsys.readouterr().out


def test_demo_refuses_huge_cpu_contract(capsys) -> None:
    assert main(["demo", "--contract", "deepseek-v3", "--device", "cpu"]) == 2
    assert "--experts" in capsys.readouterr().err


def test_demo_unknown_backend(capsys) -> None:
    assert main(["demo", "--backend", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_doctor_reports_backends(capsys) -> None:
    main(["doctor"])
    out = capsys.readouterr().out
    assert "torch" in out and "reference" in out and "can run" in out


def test_doctor_detects_upstream_flashinfer(monkeypatch) -> None:
    real = md.version

    def fake(name: str) -> str:
        if name == "flashinfer-python":
            return "0.7.2"
        return real(name)

    monkeypatch.setattr(doctor.md, "version", fake)
    problems = doctor.namespace_conflicts()
    assert any("flashinfer-python 0.7.2" in p and "uninstall" in p for p in problems)


def test_bad_subcommand() -> None:
    with pytest.raises(SystemExit):
        main(["nope"])


def test_tune_refuses_world_size_above_one(monkeypatch, capsys) -> None:
    """EP takes explicit knobs only: under torchrun, tune says so instead of recording unused winners."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["tune", "--contract", "tiny"]) == 2
    assert "explicit tile knobs only" in capsys.readouterr().err
