"""The GPU's clocks and power while something is timed, read by ``nvidia-smi`` in the background.

A timing is only comparable to a ceiling measured at the same clocks: a kernel that draws more power
than the card's limit runs at a lower SM clock than a short matrix product measured before it.
``ClockSampler`` runs ``nvidia-smi --query-gpu ... --loop-ms P`` for as long as it is open and keeps every
sample with nvidia-smi's own timestamp; ``window(t0, t1)`` summarizes the samples taken between two
``time.time()`` readings. Without ``nvidia-smi`` (or when it fails) the sampler is empty and every
window is ``None``: callers print ``-``.
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: nvidia-smi fields after the timestamp; the last one only on drivers that name it (older: throttle)
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
REASONS_FIELD = "clocks_event_reasons.active"
#: NVML clock-event reasons that mean power: 0x4 software power cap, 0x80 hardware power brake
POWER_REASONS = 0x4 | 0x80


@dataclass(frozen=True)
class ClockWindow:
    """What the samples of one time window say (``samples`` of them)."""

    samples: int
    sm_mhz_median: float
    sm_mhz_min: float
    power_w_median: float
    power_w_max: float
    temp_c_max: float
    #: OR of the clock-event reason bit masks (0x4 power cap, 0x20/0x40 thermal, ...; nvidia-smi -q names them)
    reasons: int

    @property
    def power_capped(self) -> bool:
        """Whether the power limit held the clock down in any sample."""
        return bool(self.reasons & POWER_REASONS)

    def describe(self) -> str:
        return (
            f"SM {self.sm_mhz_median:.0f} MHz (min {self.sm_mhz_min:.0f}), {self.power_w_median:.0f} W "
            f"(max {self.power_w_max:.0f}), {self.temp_c_max:.0f} C, reasons {self.reasons:#x}, n={self.samples}"
        )


def _parse_line(line: str, with_reasons: bool) -> tuple[float, float, float, float, float, int] | None:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 1 + len(FIELDS) + with_reasons:
        return None
    try:
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        sm, mem, power, temp = (float(p) for p in parts[1:5])
        reasons = int(parts[5], 16) if with_reasons else 0
    except ValueError:  # "[N/A]", "[Not Supported]", a partial line
        return None
    return stamp, sm, mem, power, temp, reasons


class ClockSampler:
    """Background ``nvidia-smi`` sampling of one GPU (``gpu``: an nvidia-smi ``--id``: index or PCI bus
    id) every ``period_ms``. Use as a context manager; ``window(t0, t1)`` at any time."""

    def __init__(self, gpu: str | int = 0, period_ms: int = 20) -> None:
        self.gpu = str(gpu)
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float, float, float, int]] = []
        self.error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _command(self, with_reasons: bool) -> list[str]:
        fields = ",".join(("timestamp", *FIELDS, *((REASONS_FIELD,) if with_reasons else ())))
        return ["nvidia-smi", f"--id={self.gpu}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]

    def __enter__(self) -> ClockSampler:
        if shutil.which("nvidia-smi") is None:
            self.error = "nvidia-smi not found"
            return self
        with_reasons = True
        probe = subprocess.run(self._command(True), capture_output=True, text=True)
        if probe.returncode != 0 or _parse_line(probe.stdout.strip(), True) is None:
            with_reasons = False  # a driver without the field: sample the rest
            probe = subprocess.run(self._command(False), capture_output=True, text=True)
            if probe.returncode != 0 or _parse_line(probe.stdout.strip(), False) is None:
                self.error = f"nvidia-smi query failed: {(probe.stderr or probe.stdout).strip()[:200]}"
                return self
        self._proc = subprocess.Popen(
            [*self._command(with_reasons), f"--loop-ms={self.period_ms}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )

        def read(proc: subprocess.Popen[str] = self._proc) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sample = _parse_line(line, with_reasons)
                if sample is not None:
                    with self._lock:
                        self.samples.append(sample)

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        time.sleep(2 * self.period_ms / 1e3)  # the first samples before anything is timed
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def window(self, t0: float, t1: float, min_samples: int = 2) -> ClockWindow | None:
        """The samples stamped within [t0 + one period, t1] (``time.time()`` values); None if fewer than
        ``min_samples``. The first period is left out: a sample taken just after a load starts can still
        show the idle clock (seen on the H200: 345 MHz at the start of a 15 ms matmul burst). The samples
        of a window that just closed may still be in nvidia-smi's pipe: wait two periods first."""
        time.sleep(2 * self.period_ms / 1e3)
        start = t0 + self.period_ms / 1e3
        with self._lock:
            got = [s for s in self.samples if start <= s[0] <= t1]
        if len(got) < max(1, min_samples):
            return None
        sm = [s[1] for s in got]
        power = [s[3] for s in got]
        reasons = 0
        for s in got:
            reasons |= s[5]
        return ClockWindow(
            samples=len(got),
            sm_mhz_median=statistics.median(sm),
            sm_mhz_min=min(sm),
            power_w_median=statistics.median(power),
            power_w_max=max(power),
            temp_c_max=max(s[4] for s in got),
            reasons=reasons,
        )


def timed_window(clocks: ClockSampler | None, fn: Callable[[], Any]) -> tuple[Any, ClockWindow | None]:
    """``fn()`` and what ``clocks`` sampled while it ran (None without a sampler, or without samples)."""
    t0 = time.time()
    result = fn()
    t1 = time.time()
    return result, (clocks.window(t0, t1) if clocks is not None else None)


def nvidia_smi_id(device_index: int = 0) -> str:
    """The nvidia-smi ``--id`` of torch's CUDA device ``device_index`` (its PCI bus id when torch knows it)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return str(device_index)
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


__all__ = ["ClockSampler", "ClockWindow", "nvidia_smi_id", "timed_window"]
