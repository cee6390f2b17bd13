import pytest

from keras_autovm.budget import parse_budget


@pytest.mark.parametrize("value, expected", [
    (1024, 1024),
    ("16GiB", 16 * 2**30),
    ("512MiB", 512 * 2**20),
    ("512 mib", 512 * 2**20),
    ("2.5GB", 2_500_000_000),
    ("100", 100),
    ("1KiB", 1024),
])
def test_absolute_budgets(value, expected):
    assert parse_budget(value) == expected


def test_relative_budgets_use_device_memory():
    assert parse_budget(None, device_bytes=8 * 2**30) == 8 * 2**30
    assert parse_budget(0.5, device_bytes=8 * 2**30) == 4 * 2**30
    assert parse_budget(1.0, device_bytes=1000) == 1000


@pytest.mark.parametrize("value", ["16 gigs", "GiB", "-1GiB", "1e3MiB", "", "0.1B"])
def test_malformed_strings_name_the_argument_and_value(value):
    with pytest.raises(ValueError, match=r"budget.*Received: budget='" + value[:2]):
        parse_budget(value)


@pytest.mark.parametrize("value", [0, -5, True, [1], 1.5, 0.0, -0.5])
def test_bad_values(value):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(value, device_bytes=100)


def test_relative_budget_without_gpu_says_so():
    with pytest.raises(ValueError, match="no GPU"):
        parse_budget(None)
    with pytest.raises(ValueError, match="no GPU"):
        parse_budget(0.5)
