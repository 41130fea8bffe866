"""CPU pressure for admission (libs/podbay/pressure.py)."""

from __future__ import annotations

from pathlib import Path

from podbay.pressure import cpu_pressure, cpu_saturated, parse_some, parse_some_avg10

SAMPLE = ("some avg10=77.50 avg60=71.52 avg300=64.50 total=935647000\n"
          "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def test_parse() -> None:
    assert parse_some_avg10(SAMPLE) == 77.5
    assert parse_some(SAMPLE, "avg60") == 71.52
    assert parse_some_avg10("full avg10=3.00\n") is None
    assert parse_some_avg10("some avg10=x\n") is None


def test_cpu_pressure_from_a_file(tmp_path: Path) -> None:
    f = tmp_path / "cpu"
    f.write_text(SAMPLE)
    assert cpu_pressure(f) == (77.5, 71.52)
    assert cpu_pressure(tmp_path / "absent") is None  # no PSI: no figure


def test_saturated_needs_both_figures_above_the_threshold() -> None:
    assert cpu_saturated((95.0, 92.0), 90.0)
    assert not cpu_saturated((95.0, 60.0), 90.0)  # a burst, not sustained
    assert not cpu_saturated((95.0, 95.0), 0.0)  # 0: not considered
    assert not cpu_saturated(None, 90.0)
