"""Tests for callbacks.analysis.scaling: laws against hand-computed values, fits on synthetic data."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from callbacks.analysis.scaling import (
    AmdahlFit,
    GustafsonFit,
    USLFit,
    amdahl_speedup,
    compare_fits,
    fit_amdahl,
    fit_gustafson,
    fit_usl,
    gustafson_speedup,
    karp_flatt,
    speedup_from_throughput,
    usl_peak,
    usl_speedup,
)

N = np.array([1, 2, 4, 8, 16, 32, 64])


def _noisy(values: np.ndarray, seed: int, rel: float = 0.01) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return values * (1 + rel * rng.standard_normal(values.shape))


# --- the laws, by hand -------------------------------------------------------------------


def test_amdahl_design_doc_values():
    # s = 0.25: 1/(0.25 + 0.75/N)
    got = amdahl_speedup(np.array([2, 4, 8, 16, 64]), 0.25)
    assert np.round(got, 2).tolist() == [1.60, 2.29, 2.91, 3.37, 3.82]
    assert amdahl_speedup(2, 0.25) == pytest.approx(1.6, abs=1e-12)
    assert isinstance(amdahl_speedup(2, 0.25), float)
    # 1/(0.25 + 0.75/16) = 1/0.296875
    assert amdahl_speedup(16, 0.25) == pytest.approx(1 / 0.296875, rel=1e-12)
    assert amdahl_speedup(1, 0.3) == 1.0
    assert amdahl_speedup(10**9, 0.25) == pytest.approx(4.0, rel=1e-8)
    assert amdahl_speedup(64, 0.0) == 64.0


def test_gustafson_by_hand():
    # s = 0.1: N - 0.1 (N - 1)
    got = gustafson_speedup(np.array([1, 2, 8, 64]), 0.1)
    np.testing.assert_allclose(got, [1.0, 1.9, 7.3, 57.7], rtol=0, atol=1e-12)
    assert gustafson_speedup(8, 1.0) == 1.0


def test_usl_by_hand():
    # a = 0.05, b = 0.001, N = 8: 8 / (1 + 0.05*7 + 0.001*8*7) = 8 / 1.406
    assert usl_speedup(8, 0.05, 0.001) == pytest.approx(8 / 1.406, rel=1e-12)
    assert usl_speedup(8, 0.05, 0.001) == pytest.approx(5.68990, abs=1e-5)
    assert usl_speedup(1, 0.5, 0.5) == 1.0
    # a = b = 0 is linear
    np.testing.assert_allclose(usl_speedup(np.array([1, 4, 32]), 0.0, 0.0), [1, 4, 32])
    # b = 0 is Amdahl with s = a
    np.testing.assert_allclose(usl_speedup(N, 0.25, 0.0), amdahl_speedup(N, 0.25), rtol=1e-12)


def test_usl_peak_by_hand():
    peak_n, peak_c = usl_peak(0.05, 0.001)
    assert peak_n == pytest.approx(math.sqrt(0.95 / 0.001), rel=1e-12)
    assert peak_n == pytest.approx(30.8221, abs=1e-4)
    # C(N*) = N*/(1 + a(N*-1) + b N*(N*-1))
    expected = peak_n / (1 + 0.05 * (peak_n - 1) + 0.001 * peak_n * (peak_n - 1))
    assert peak_c == pytest.approx(expected, rel=1e-12)
    assert peak_c == pytest.approx(9.03798, abs=1e-5)


def test_usl_peak_edge_cases():
    assert usl_peak(0.1, 0.0) == (math.inf, pytest.approx(10.0))
    assert usl_peak(0.0, 0.0) == (math.inf, math.inf)
    assert usl_peak(1.0, 0.01) == (1.0, 1.0)
    assert usl_peak(2.0, 0.0) == (1.0, 1.0)
    # sqrt((1-0.5)/1) < 1: one device is best
    assert usl_peak(0.5, 1.0) == (1.0, 1.0)


def test_karp_flatt():
    c = amdahl_speedup(N, 0.1)
    e = karp_flatt(N, c)
    assert math.isnan(e[0])
    np.testing.assert_allclose(e[1:], 0.1, rtol=0, atol=1e-12)
    # by hand: N = 4, C = 3 -> (1/3 - 1/4)/(3/4) = 1/9
    assert karp_flatt(4, 3.0) == pytest.approx(1 / 9, rel=1e-12)
    assert math.isnan(karp_flatt(1, 1.0))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: amdahl_speedup(4, 1.5), "`s=1.5`"),
        (lambda: amdahl_speedup(0, 0.1), "`n` holds 0.0"),
        (lambda: gustafson_speedup(4, -0.1), "`s=-0.1`"),
        (lambda: usl_speedup(4, -0.1, 0.0), "`a=-0.1`"),
        (lambda: usl_speedup(4, 0.1, -1.0), "`b=-1.0`"),
        (lambda: karp_flatt([2, 4], [1.5]), "shape"),
        (lambda: karp_flatt([0.5], [1.0]), "`n` holds 0.5"),
        (lambda: karp_flatt([2], [0.0]), "`speedup` holds 0.0"),
    ],
)
def test_laws_reject_bad_values(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


# --- fits ---------------------------------------------------------------------------------


def test_fit_amdahl_exact_data():
    fit = fit_amdahl(N, amdahl_speedup(N, 0.25))
    assert isinstance(fit, AmdahlFit)
    assert fit.serial_fraction == pytest.approx(0.25, abs=1e-12)
    assert fit.ceiling == pytest.approx(4.0, rel=1e-12)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(fit.residuals, 0.0, atol=1e-12)
    assert math.isnan(fit.karp_flatt[0])
    np.testing.assert_allclose(fit.karp_flatt[1:], 0.25, atol=1e-12)
    assert fit.predict(128) == pytest.approx(1 / (0.25 + 0.75 / 128), rel=1e-12)


def test_fit_amdahl_noisy_recovers_serial_fraction():
    for seed in range(5):
        fit = fit_amdahl(N, _noisy(np.asarray(amdahl_speedup(N, 0.1)), seed))
        assert abs(fit.serial_fraction - 0.1) < 0.02, seed
        assert fit.r_squared > 0.98


def test_fit_amdahl_clips_superlinear_to_zero():
    fit = fit_amdahl([1, 2, 4], [1.0, 2.2, 4.5])
    assert fit.serial_fraction == 0.0
    assert fit.ceiling == math.inf


def test_fit_gustafson_recovers_s():
    exact = fit_gustafson(N, gustafson_speedup(N, 0.3))
    assert isinstance(exact, GustafsonFit)
    assert exact.serial_fraction == pytest.approx(0.3, abs=1e-12)
    assert exact.r_squared == pytest.approx(1.0, abs=1e-12)
    noisy = fit_gustafson(N, _noisy(np.asarray(gustafson_speedup(N, 0.3)), 7))
    assert abs(noisy.serial_fraction - 0.3) < 0.02
    # by hand, one point: N = 5, C = 4 -> s = (5-4)/(5-1) = 0.25
    assert fit_gustafson([5], [4.0]).serial_fraction == pytest.approx(0.25, abs=1e-12)


def test_fit_usl_exact_data():
    fit = fit_usl(N, usl_speedup(N, 0.05, 0.001))
    assert isinstance(fit, USLFit)
    assert fit.a == pytest.approx(0.05, rel=1e-9)
    assert fit.b == pytest.approx(0.001, rel=1e-9)
    assert fit.peak_n == pytest.approx(math.sqrt(0.95 / 0.001), rel=1e-9)
    assert fit.peak_speedup == pytest.approx(9.03798, abs=1e-5)
    assert fit.best_integer_n == 31
    assert fit.r_squared == pytest.approx(1.0, abs=1e-12)


def test_fit_usl_noisy_recovers_parameters():
    a, b = 0.03, 0.0008
    for seed in range(5):
        fit = fit_usl(N, _noisy(np.asarray(usl_speedup(N, a, b)), seed))
        assert fit.a == pytest.approx(a, rel=0.2), seed
        assert fit.b == pytest.approx(b, rel=0.2), seed
        assert fit.r_squared > 0.98


def test_fit_usl_linear_data_has_no_peak():
    fit = fit_usl([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0])
    assert fit.a == 0.0 and fit.b == 0.0
    assert fit.peak_n == math.inf
    assert fit.best_integer_n == math.inf


@pytest.mark.parametrize("fit", [fit_amdahl, fit_gustafson, fit_usl])
@pytest.mark.parametrize(
    ("n", "speedup", "match"),
    [
        ([1, 2, 4], [1.0, 1.8], "`n` has 3 values but `speedup` has 2"),
        ([1, 2.5], [1.0, 1.8], "`n` holds 2.5"),
        ([0, 2], [1.0, 1.8], "`n` holds 0.0"),
        ([1, 2], [1.0, -1.8], "`speedup` holds -1.8"),
        ([1, 2], [1.0, float("nan")], "`speedup` holds nan"),
        ([1, 1], [1.0, 1.0], "no value > 1"),
        ([], [], "empty"),
    ],
)
def test_fits_reject_bad_input(fit, n, speedup, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        fit(n, speedup)


def test_speedup_from_throughput():
    c = speedup_from_throughput([1, 2, 4, 1], [100.0, 180.0, 320.0, 110.0])
    # base = mean of N=1 runs = 105
    np.testing.assert_allclose(c, [100 / 105, 180 / 105, 320 / 105, 110 / 105], rtol=1e-12)
    with pytest.raises(ValueError, match=re.escape("[2, 4] has no N=1 measurement")):
        speedup_from_throughput([2, 4], [180.0, 320.0])
    with pytest.raises(ValueError, match=re.escape("`throughput` holds 0.0")):
        speedup_from_throughput([1, 2], [100.0, 0.0])
    with pytest.raises(ValueError, match=re.escape("`devices` has 2 values but `throughput` has 1")):
        speedup_from_throughput([1, 2], [100.0])


# --- comparison ---------------------------------------------------------------------------


def test_compare_fits_picks_usl_for_data_with_a_peak():
    # peak at sqrt(0.98/0.0005) = 44.3; 64 devices are slower than 32
    c = _noisy(np.asarray(usl_speedup(N, 0.02, 0.0005)), 3)
    result = compare_fits(N, c)
    assert result.best == "usl"
    assert result.best_fit is result.usl
    assert result.r_squared["usl"] > 0.99
    assert result.r_squared["usl"] > result.r_squared["amdahl"] + 0.05
    assert result.r_squared["usl"] > result.r_squared["gustafson"] + 0.05
    assert result.usl.peak_n == pytest.approx(math.sqrt(0.98 / 0.0005), rel=0.2)
    assert result.distinct_n == 7
    assert result.informative_n == 6
    assert result.underdetermined is False
    assert result.note == ""


def test_compare_fits_prefers_simpler_law_on_a_tie():
    # Amdahl data: USL fits it exactly with b = 0, a = s; equal R² -> Amdahl
    result = compare_fits(N, amdahl_speedup(N, 0.2))
    assert result.best == "amdahl"
    assert result.usl.a == pytest.approx(0.2, rel=1e-9)
    assert result.usl.b == pytest.approx(0.0, abs=1e-12)


def test_compare_fits_is_honest_with_two_device_counts():
    result = compare_fits([1, 2, 4], [1.0, 1.8, 2.9])
    assert result.informative_n == 2
    assert result.underdetermined is True
    assert "USL's two parameters can pass through both" in result.note
    # two equations, two unknowns: USL interpolates
    assert result.r_squared["usl"] == pytest.approx(1.0, abs=1e-12)


def test_compare_fits_is_honest_with_one_device_count():
    result = compare_fits([1, 8], [1.0, 5.0])
    assert result.informative_n == 1
    assert result.underdetermined is True
    assert "not determined" in result.note
    # Amdahl fits one point exactly: (1/5 - 1/8)/(1 - 1/8) = 0.075/0.875
    assert result.amdahl.serial_fraction == pytest.approx(0.075 / 0.875, rel=1e-12)
    assert result.r_squared["amdahl"] == pytest.approx(1.0, abs=1e-12)
