"""Tests for callbacks.analysis.comm_model: the ring all-reduce formula against hand-computed values."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from callbacks.analysis.comm_model import (
    CompressionRow,
    LinkModel,
    bytes_per_element,
    bytes_sent_per_worker,
    calibrate,
    compression_table,
    gbps_to_bytes_per_s,
    measure_allreduce,
    ring_allreduce_time,
)

SIX_GB = 6e9
LINK_100G = 12.5e9  # 100 Gbit/s in bytes/s


def test_gbps_to_bytes_per_s():
    assert gbps_to_bytes_per_s(100) == 12.5e9
    assert gbps_to_bytes_per_s(400) == 50e9
    assert gbps_to_bytes_per_s(8) == 1e9


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        (1, 0.0),
        # 2*1/2 * 6e9 / 12.5e9 = 0.48
        (2, 0.480),
        # 2*3/4 * 0.48 = 0.72
        (4, 0.720),
        # 2*7/8 * 0.48 = 0.84
        (8, 0.840),
    ],
)
def test_ring_allreduce_design_doc_example(workers, expected):
    assert ring_allreduce_time(SIX_GB, workers, LINK_100G) == pytest.approx(expected, abs=1e-12)


def test_ring_allreduce_approaches_twice_size_over_bandwidth():
    # 2(N-1)/N -> 2: 2 * 6e9 / 12.5e9 = 0.96 s
    t = ring_allreduce_time(SIX_GB, 10**6, LINK_100G)
    assert t == pytest.approx(0.96, abs=1e-5)
    assert t < 0.96


def test_ring_allreduce_with_latency_by_hand():
    # S = 1e9 B, B = 1e10 B/s, a = 5 us, N = 4:
    # bandwidth term 2*3/4 * 1e9/1e10 = 0.15 s; latency term 2*3*5e-6 = 3e-5 s -> 0.15003 s
    assert ring_allreduce_time(1e9, 4, 1e10, 5e-6) == pytest.approx(0.15003, abs=1e-12)
    # zero bytes: only latency, 2*(16-1)*1e-3 = 0.03 s
    assert ring_allreduce_time(0.0, 16, 1e10, 1e-3) == pytest.approx(0.03, abs=1e-15)
    # a single worker pays nothing, latency included
    assert ring_allreduce_time(1e9, 1, 1e10, 1.0) == 0.0


def test_bytes_sent_per_worker():
    assert bytes_sent_per_worker(SIX_GB, 1) == 0.0
    assert bytes_sent_per_worker(SIX_GB, 2) == 6e9
    assert bytes_sent_per_worker(SIX_GB, 8) == pytest.approx(10.5e9, rel=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"workers": 0}, "workers=0"),
        ({"workers": 2.5}, "workers=2.5"),
        ({"workers": True}, "workers=True"),
        ({"size_bytes": -1.0}, "size_bytes=-1.0"),
        ({"bandwidth_bytes_per_s": 0.0}, "bandwidth_bytes_per_s=0.0"),
        ({"bandwidth_bytes_per_s": -3.0}, "bandwidth_bytes_per_s=-3.0"),
        ({"latency_s": -1e-6}, "latency_s=-1e-06"),
        ({"latency_s": float("nan")}, "latency_s=nan"),
    ],
)
def test_ring_allreduce_rejects_bad_values(kwargs, named):
    args = {"size_bytes": 1e6, "workers": 4, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0} | kwargs
    with pytest.raises(ValueError, match=re.escape(f"`{named}`")):
        ring_allreduce_time(**args)


def test_gbps_rejects_non_positive():
    with pytest.raises(ValueError, match=re.escape("`gbps=0`")):
        gbps_to_bytes_per_s(0)


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("fp32", 4),
        ("float32", 4),
        ("FP32", 4),
        ("torch.float32", 4),
        ("fp16", 2),
        ("float16", 2),
        ("bf16", 2),
        ("bfloat16", 2),
        ("fp64", 8),
    ],
)
def test_bytes_per_element(name, size):
    assert bytes_per_element(name) == size


def test_bytes_per_element_rejects_unknown():
    with pytest.raises(ValueError, match=re.escape("`dtype_name='int3'`")):
        bytes_per_element("int3")


def test_link_model_predict_and_validation():
    link = LinkModel(LINK_100G, 5e-6)
    # 0.48 + 2*1*5e-6
    assert link.predict(SIX_GB, 2) == pytest.approx(0.48001, abs=1e-12)
    # 0.84 + 2*7*5e-6
    assert link.predict(SIX_GB, 8) == pytest.approx(0.84007, abs=1e-12)
    assert math.isnan(link.r_squared)
    with pytest.raises(ValueError, match=re.escape("`bandwidth_bytes_per_s=0`")):
        LinkModel(0, 0.0)
    with pytest.raises(ValueError, match=re.escape("`latency_s=-1`")):
        LinkModel(1e9, -1)


def test_calibrate_recovers_bandwidth_and_latency_exactly():
    bandwidth, latency, n = 2.5e9, 20e-6, 4
    sizes = [1e3, 1e5, 1e6, 1e7, 1e8]
    times = [ring_allreduce_time(s, n, bandwidth, latency) for s in sizes]
    link = calibrate(sizes, times, n)
    assert link.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-9)
    assert link.latency_s == pytest.approx(latency, rel=1e-9)
    assert link.r_squared == pytest.approx(1.0, abs=1e-12)
    assert link.workers == 4


def test_calibrate_recovers_from_noisy_timings():
    rng = np.random.default_rng(0)
    bandwidth, latency, n = 10e9, 50e-6, 8
    sizes = np.geomspace(1e4, 1e9, 12)
    times = np.array([ring_allreduce_time(s, n, bandwidth, latency) for s in sizes])
    noisy = times * (1 + 0.01 * rng.standard_normal(times.size))
    # relative weighting: both parameters come back
    link = calibrate(sizes, noisy, n, relative=True)
    assert link.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.02)
    assert link.latency_s == pytest.approx(latency, rel=0.02)
    assert link.r_squared > 0.999
    # plain least squares: bandwidth is still right, the largest sizes dominate
    plain = calibrate(sizes, noisy, n)
    assert plain.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.02)
    assert plain.r_squared > 0.999


def test_calibrate_relative_needs_positive_times():
    with pytest.raises(ValueError, match=re.escape("relative=True needs every time > 0")):
        calibrate([1e6, 2e6], [0.0, 1.0], 2, relative=True)


def test_calibrate_latency_free_link_gives_zero_latency():
    # times follow bandwidth only; nnls must not report a negative latency
    sizes = [1e6, 2e6, 4e6]
    times = [ring_allreduce_time(s, 2, 1e9) for s in sizes]
    link = calibrate(sizes, times, 2)
    assert link.latency_s == pytest.approx(0.0, abs=1e-15)
    assert link.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-9)


@pytest.mark.parametrize(
    ("sizes", "times", "workers", "match"),
    [
        ([1e6, 2e6], [1.0], 2, "2 values but `times_s` has 1"),
        ([1e6, 1e6], [1.0, 1.1], 2, "1 distinct value"),
        ([1e6, 2e6], [1.0, -1.0], 2, "`times_s` holds -1.0"),
        ([1e6, 2e6], [1.0, 2.0], 1, "`workers=1`"),
        ([1e6, 2e6], [0.0, 0.0], 2, "zero cost"),
    ],
)
def test_calibrate_rejects_bad_input(sizes, times, workers, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        calibrate(sizes, times, workers)


def test_compression_table_by_hand():
    # 1.5e9 fp32 params = 6e9 B at 12.5e9 B/s, no latency
    rows = compression_table(1.5e9, 4, LINK_100G, 0.0, [1, 2, 8])
    assert [r.workers for r in rows] == [1, 2, 8]
    one, two, eight = rows
    assert isinstance(eight, CompressionRow)
    assert one.time_s == 0.0 and one.fp16_saving_frac == 0.0 and one.powersgd_saving_frac == 0.0
    assert two.size_bytes == 6e9
    assert two.bytes_sent_per_worker == 6e9
    assert two.time_s == pytest.approx(0.48, abs=1e-12)
    # fp16: 3e9 B -> half the time
    assert two.fp16_size_bytes == 3e9
    assert two.fp16_time_s == pytest.approx(0.24, abs=1e-12)
    assert two.fp16_saving_s == pytest.approx(0.24, abs=1e-12)
    assert two.fp16_saving_frac == pytest.approx(0.5, abs=1e-12)
    # PowerSGD at 1%: 6e7 B -> 0.0048 s at N=2, 0.0084 s at N=8
    assert two.powersgd_size_bytes == pytest.approx(6e7, rel=1e-15)
    assert two.powersgd_time_s == pytest.approx(0.0048, abs=1e-12)
    assert eight.time_s == pytest.approx(0.84, abs=1e-12)
    assert eight.powersgd_time_s == pytest.approx(0.0084, abs=1e-12)
    assert eight.powersgd_saving_s == pytest.approx(0.8316, abs=1e-12)
    assert eight.powersgd_saving_frac == pytest.approx(0.99, abs=1e-12)


def test_compression_table_with_latency_and_ratio():
    # 1e8 params bf16 = 2e8 B at 1e9 B/s, a = 1 ms, N = 4, PowerSGD at 10%:
    # uncompressed 1.5 * 0.2 + 6e-3 = 0.306; fp16 same bytes -> 0.306 (no saving);
    # PowerSGD 1.5 * 0.02 + 6e-3 = 0.036
    (row,) = compression_table(1e8, 2, 1e9, 1e-3, [4], powersgd_ratio=0.1)
    assert row.time_s == pytest.approx(0.306, abs=1e-12)
    assert row.fp16_time_s == pytest.approx(0.306, abs=1e-12)
    assert row.fp16_saving_s == pytest.approx(0.0, abs=1e-12)
    assert row.powersgd_time_s == pytest.approx(0.036, abs=1e-12)
    d = row.as_dict()
    assert d["workers"] == 4
    assert d["powersgd_saving_s"] == pytest.approx(0.27, abs=1e-12)
    assert d["powersgd_saving_frac"] == pytest.approx(0.27 / 0.306, abs=1e-12)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 4, 1e9, 0.0, [2]), "`params=-1`"),
        ((1e6, 0, 1e9, 0.0, [2]), "`bytes_per_param=0`"),
        ((1e6, 4, 1e9, 0.0, [2, 0]), "`workers=0`"),
        ((1e6, 4, 1e9, 0.0, []), "`workers_list` is empty"),
    ],
)
def test_compression_table_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        compression_table(*args)


def test_compression_table_rejects_ratio_above_one():
    with pytest.raises(ValueError, match=re.escape("`powersgd_ratio=1.5`")):
        compression_table(1e6, 4, 1e9, 0.0, [2], powersgd_ratio=1.5)


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_measure_allreduce_single_process_gloo(single_process_group):
    result = measure_allreduce([4, 4096, 10_001, 1 << 20], repeats=3, warmup=1)
    # sizes rounded down to whole float32 elements
    assert [size for size, _ in result] == [4, 4096, 10_000, 1 << 20]
    for _, seconds in result:
        assert 0.0 < seconds < 1.0


def test_measure_allreduce_rejects_bad_input(single_process_group):
    with pytest.raises(ValueError, match=re.escape("holds 2")):
        measure_allreduce([2])
    with pytest.raises(ValueError, match=re.escape("`repeats=0`")):
        measure_allreduce([1024], repeats=0)
    with pytest.raises(ValueError, match=re.escape("`warmup=-1`")):
        measure_allreduce([1024], warmup=-1)


def test_measure_allreduce_needs_process_group(monkeypatch):
    import torch.distributed as dist

    # whatever another test left behind in this process, the check runs: no process group here
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape("initialized torch.distributed process group")):
        measure_allreduce([1024])


def test_topk_allgather_and_breakeven_by_hand():
    from callbacks.analysis.comm_model import topk_allgather_time, topk_breakeven_ratio

    # 1e9 params, 1 %, N=8, 12.5 GB/s: C = 80 MB, T = 7 x 80e6 / 12.5e9 = 44.8 ms; N=1: nothing to send
    assert topk_allgather_time(1e9, 0.01, 8, 12.5e9) == pytest.approx(0.0448)
    assert topk_allgather_time(1e9, 0.01, 1, 12.5e9) == 0.0
    # with 5 us latency per hop: + 7 x 5 us
    assert topk_allgather_time(1e9, 0.01, 8, 12.5e9, 5e-6) == pytest.approx(0.0448 + 35e-6)
    # r* = b / (4N) + a B / (8 P): fp32, no latency: 1/8 at N=8, 1/64 at N=64; fp16: half that
    assert topk_breakeven_ratio(1e9, 4, 8, 12.5e9) == pytest.approx(0.125)
    assert topk_breakeven_ratio(1e9, 4, 64, 12.5e9) == pytest.approx(1 / 64)
    assert topk_breakeven_ratio(1e9, 2, 8, 12.5e9) == pytest.approx(1 / 16)
    # a small model on a fast link: latency dominates and top-k (one latency term per hop, not two) wins
    assert topk_breakeven_ratio(1e5, 4, 8, 12.5e9, 5e-6) == pytest.approx(min(1.0, 0.125 + 5e-6 * 12.5e9 / 8e5))
    (row,) = compression_table(1e9, 4, 12.5e9, 0.0, [8], topk_ratio=0.01)
    assert (row.topk_size_bytes, row.topk_time_s) == pytest.approx((8e7, 0.0448))
    assert row.as_dict()["topk_saving_s"] == pytest.approx(0.56 - 0.0448)
