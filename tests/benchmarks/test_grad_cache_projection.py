"""benchmarks/dry_run.py's `largest chunk` column: the largest power-of-two grad_cache chunk size that fits a GPU
budget, projected from a preset's measured figures (no training)."""

from __future__ import annotations

from benchmarks import dry_run


def _record(gpu_gb: float, act_mb: float, rows_measured: int = 4, real_rows: int = 512, views: int = 3) -> dict:
    phase = {
        "rows_measured": rows_measured,
        "aux_rows_measured": 0,
        "real_rows": real_rows,
        "views": views,
        "activation_mb_measured": act_mb,
        "projected_gpu_gb_real_batch_bf16": gpu_gb,
    }
    return {"phases": {"main": phase}}


def test_the_whole_batch_fits_or_the_largest_power_of_two_chunk_or_nothing():
    # 12 measured rows used 120 MB in fp32: 5 MB per row in bf16; 1,536 real rows = 7.5 GB of activations
    rec = _record(gpu_gb=10.0, act_mb=120.0, rows_measured=4, real_rows=512, views=3)
    assert dry_run.largest_chunk(rec, 24) == "full"
    # 2.5 GB fixed + 5 MB per row: 3 GB leaves 0.5 GB = 102 rows -> 64
    assert dry_run.largest_chunk(rec, 3) == "64"
    assert dry_run.largest_chunk(rec, 2) == "–"  # the fixed part alone does not fit


def test_the_binding_phase_decides():
    rec = _record(gpu_gb=10.0, act_mb=120.0)
    rec["phases"]["prefix"] = dict(rec["phases"]["main"], projected_gpu_gb_real_batch_bf16=4.0)
    assert dry_run.largest_chunk(rec, 3) == "64"  # main binds (the prefix phase alone would allow a larger chunk)
