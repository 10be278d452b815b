"""What a benchmark record says about the run that made it."""

from __future__ import annotations

from lithos import bench


def test_the_record_names_the_kernel_build_variant(monkeypatch):
    """A build variant (LITHOS_KERNEL_DEFINES) is part of what was measured, so the record keeps it."""
    monkeypatch.setenv("LITHOS_KERNEL_DEFINES", "LITHOS_TWO_BUCKETS=1 LITHOS_MK_LANE_RING=3")
    assert bench.environment()["kernel_defines"] == ["LITHOS_TWO_BUCKETS=1", "LITHOS_MK_LANE_RING=3"]
    monkeypatch.delenv("LITHOS_KERNEL_DEFINES")
    assert bench.environment()["kernel_defines"] == []
