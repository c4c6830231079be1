"""The shipped price catalog and its loader: values from DESIGN.md, validation, overrides."""

from __future__ import annotations

import pytest

from callbacks.analysis.prices import (
    DEFAULT_CATALOG,
    Instance,
    get_instance,
    load_catalog,
    price_for,
    with_overrides,
)

# name: (provider, region, gpus, on-demand, spot, date) as DESIGN.md lists them
EXPECTED = {
    "a2-highgpu-1g": ("gcp", "us-central1", 1, 3.673, 1.293, "2025-03"),
    "a3-highgpu-1g": ("gcp", "us-central1", 1, 11.06, 4.42, "2025-03"),
    "a3-highgpu-8g": ("gcp", "us-central1", 8, 88.49, 35.40, "2025-03"),
    "p4d.24xlarge": ("aws", "us-east-1", 8, 21.96, None, "2025-06"),
    "p5.48xlarge": ("aws", "us-east-1", 8, 55.04, None, "2025-06"),
    "cpu-local": ("local", "local", 0, 0.0, 0.0, "2025-06"),
}


def test_default_catalog_has_every_entry_with_source_and_date():
    catalog = load_catalog()
    assert DEFAULT_CATALOG.name == "prices.yaml" and DEFAULT_CATALOG.parent.name == "analysis"
    assert set(catalog) == set(EXPECTED)
    for name, (provider, region, gpus, on_demand, spot, date) in EXPECTED.items():
        inst = catalog[name]
        assert (inst.name, inst.provider, inst.region, inst.gpus) == (name, provider, region, gpus)
        assert inst.on_demand_usd_per_h == on_demand
        assert inst.spot_usd_per_h == spot
        assert inst.date == date
        assert inst.source.strip()
    assert catalog["a2-highgpu-1g"].gpu == "A100 40GB"
    assert catalog["a3-highgpu-8g"].gpu.startswith("H100")
    assert catalog["cpu-local"].gpu is None and catalog["cpu-local"].devices_per_instance == 1
    assert catalog["a3-highgpu-8g"].devices_per_instance == 8
    assert "on-demand only" in catalog["p5.48xlarge"].source


# name: (spot interruption rate, per hours, words its source must contain)
INTERRUPTION = {
    "a2-highgpu-1g": (0.15, 24.0, "5-15% per day per project"),
    "a3-highgpu-1g": (0.15, 24.0, "5-15% per day per project"),
    "a3-highgpu-8g": (0.15, 24.0, "5-15% per day per project"),
    "p4d.24xlarge": (0.2, 720.0, "assumption"),
    "p5.48xlarge": (0.2, 720.0, "assumption"),
    "cpu-local": (0.0, 1.0, "your own machine"),
}


def test_default_catalog_has_a_sourced_spot_interruption_rate_per_row():
    catalog = load_catalog()
    assert set(INTERRUPTION) == set(EXPECTED)
    for name, (rate, period_h, words) in INTERRUPTION.items():
        inst = catalog[name]
        assert (inst.spot_interruption_rate, inst.spot_interruption_period_h) == (rate, period_h), name
        assert words in inst.spot_interruption_source, name
    assert "Spot Instance Advisor" in catalog["p5.48xlarge"].spot_interruption_source
    assert "preemptible" in catalog["a3-highgpu-1g"].spot_interruption_source


def test_price_for_markets():
    catalog = load_catalog()
    assert price_for(catalog["a3-highgpu-1g"], "on_demand") == 11.06
    assert price_for(catalog["a3-highgpu-1g"], "spot") == 4.42
    with pytest.raises(ValueError, match=r"lacks a spot price for instance 'p5\.48xlarge'"):
        price_for(catalog["p5.48xlarge"], "spot")
    with pytest.raises(ValueError, match=r"market='reserved'"):
        price_for(catalog["p5.48xlarge"], "reserved")


def test_unknown_instance_names_it_and_lists_the_known():
    catalog = load_catalog()
    with pytest.raises(KeyError) as err:
        get_instance(catalog, "a9-megagpu")
    message = err.value.args[0]
    assert "'a9-megagpu'" in message
    for name in EXPECTED:
        assert name in message


def test_overrides():
    inst = get_instance(load_catalog(), "p5.48xlarge")
    spot = with_overrides(inst, spot=22.0)
    assert (spot.on_demand_usd_per_h, spot.spot_usd_per_h) == (55.04, 22.0)
    assert "spot price overridden" in spot.source
    both = with_overrides(inst, on_demand=50.0, spot=20.0)
    assert (both.on_demand_usd_per_h, both.spot_usd_per_h) == (50.0, 20.0)
    assert with_overrides(inst) is inst
    assert inst.spot_usd_per_h is None  # the catalog row is untouched
    with pytest.raises(ValueError, match=r"'p5\.48xlarge'.*spot_usd_per_h=-1\.0"):
        with_overrides(inst, spot=-1.0)
    with pytest.raises(ValueError, match=r"'p5\.48xlarge'.*on_demand_usd_per_h=-3\.0"):
        with_overrides(inst, on_demand=-3.0)


ROW = {"provider": "gcp", "region": "r", "gpu": "H100", "gpus": 1, "source": "s", "date": "2025-01"}


def _write(tmp_path, text):
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    return path


def test_user_catalog(tmp_path):
    path = _write(
        tmp_path,
        "mybox:\n  provider: lab\n  gpu: L4\n  gpus: 2\n  on_demand_usd_per_h: 1.5\n"
        "  spot_usd_per_h: 0.5\n  source: invoice\n  date: '2025-05'\n",
    )
    catalog = load_catalog(path)
    assert catalog == {
        "mybox": Instance("mybox", "lab", "", "L4", 2, 1.5, 0.5, "invoice", "2025-05"),
    }
    assert catalog["mybox"].spot_interruption_rate is None  # optional: recipes.plan then asks for one
    assert load_catalog(str(path)) == catalog


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("  on_demand_usd_per_h: -2.0\n", r"'box'.*on_demand_usd_per_h=-2\.0"),
        ("  spot_usd_per_h: 1.0\n", r"'box'.*on_demand_usd_per_h is missing"),
        ("  on_demand_usd_per_h: 2.0\n  spot_usd_per_h: -0.5\n", r"'box'.*spot_usd_per_h=-0\.5"),
        ("  on_demand_usd_per_h: cheap\n", r"'box'.*on_demand_usd_per_h='cheap' is not a number"),
        ("  on_demand_usd_per_h: 2.0\n  spot_interruption_rate: 1.5\n  spot_interruption_period_h: 1\n"
         "  spot_interruption_source: s\n", r"'box'.*spot_interruption_rate=1\.5 must be a probability in \[0, 1\)"),
        ("  on_demand_usd_per_h: 2.0\n  spot_interruption_rate: 0.1\n  spot_interruption_source: s\n",
         r"'box'.*spot_interruption_period_h=None must be a positive number of hours"),
        ("  on_demand_usd_per_h: 2.0\n  spot_interruption_rate: 0.1\n  spot_interruption_period_h: 24\n",
         r"'box'.*spot_interruption_source is missing: say where the rate comes from"),
        ("  on_demand_usd_per_h: true\n", r"'box'.*on_demand_usd_per_h=True is not a number"),
        ("  on_demand_usd_per_h: '2.0'\n", r"'box'.*on_demand_usd_per_h='2\.0' is not a number"),
        ("  on_demand_usd_per_h: .nan\n", r"'box'.*on_demand_usd_per_h=nan must be a finite price >= 0"),
        ("  on_demand_usd_per_h: .inf\n", r"'box'.*on_demand_usd_per_h=inf must be a finite price >= 0"),
        ("  on_demand_usd_per_h: 2.0\n  provider: null\n", r"'box'.*provider is missing"),
    ],
)
def test_invalid_rows_name_instance_and_field(tmp_path, body, named):
    head = "box:\n" + "".join(f"  {k}: {v}\n" for k, v in ROW.items() if k != "gpus") + "  gpus: 1\n"
    with pytest.raises(ValueError, match=named):
        load_catalog(_write(tmp_path, head + body))


def test_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_catalog(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="non-empty mapping"):
        load_catalog(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_catalog(_write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ValueError, match=r"'box'.*gpus=-1"):
        Instance("box", "gcp", "r", None, -1, 1.0, None, "s", "d")
