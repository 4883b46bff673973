"""``cli.clocks``: nvidia-smi lines parsed, samples summarized per time window, no sampler without nvidia-smi."""

from __future__ import annotations

import datetime

from flashinfer.moe_ep.cli import clocks


def _line(stamp: float, sm: int, power: float, reasons: str | None) -> str:
    text = datetime.datetime.fromtimestamp(stamp).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{text}, {sm}, 3201, {power}, 50" + ("" if reasons is None else f", {reasons}")


def test_lines_parse_with_and_without_the_reasons_field() -> None:
    got = clocks._parse_line(_line(1000.25, 1980, 650.5, "0x0000000000000004"), True)
    assert got is not None and abs(got[0] - 1000.25) < 1e-3 and got[1:] == (1980.0, 3201.0, 650.5, 50.0, 4)
    assert clocks._parse_line(_line(1000.0, 1410, 700.0, None), False)[5] == 0
    assert clocks._parse_line("2026/12/01 20:50:01.123, [N/A], 3201, 650, 50", False) is None
    assert clocks._parse_line(_line(1000.0, 1410, 700.0, None), True) is None  # a field missing


def test_window_summarizes_only_its_samples(monkeypatch) -> None:
    monkeypatch.setattr(clocks.time, "sleep", lambda s: None)
    sampler = clocks.ClockSampler(period_ms=10)
    samples = [(9.9, 345, 80, 1), (10.005, 345, 90, 1), (10.5, 1500, 700, 4), (10.9, 1410, 690, 4), (11.2, 1980, 90, 0)]
    for stamp, sm, power, reasons in samples:
        sampler.samples.append((stamp, sm, 3201.0, power, 50.0, reasons))
    win = sampler.window(10.0, 11.0)  # the sample in its first period (an idle clock still) left out
    assert win is not None and win.samples == 2
    assert (win.sm_mhz_median, win.sm_mhz_min, win.power_w_max, win.reasons) == (1455, 1410, 700, 4)
    assert win.power_capped and "1455 MHz" in win.describe()
    assert sampler.window(11.1, 11.3) is None  # one sample: too few
    calm = sampler.window(11.1, 11.3, min_samples=1)
    assert calm is not None and not calm.power_capped
    assert sampler.window(12.0, 13.0) is None


def test_no_nvidia_smi_means_no_samples(monkeypatch) -> None:
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    monkeypatch.setattr(clocks.time, "sleep", lambda s: None)
    with clocks.ClockSampler() as sampler:
        assert sampler.error == "nvidia-smi not found"
        assert sampler.window(0.0, 1e12) is None
