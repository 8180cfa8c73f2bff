import pytest

from zipmoe.errors import UsageError
from zipmoe.units import format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("24G", 24 << 30), ("24GiB", 24 << 30), ("24gb", 24 << 30), ("512M", 512 << 20),
     ("1.5T", int(1.5 * (1 << 40))), ("4096", 4096), ("0", 0), ("8 G", 8 << 30), ("100K", 102400)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12X", "-5G", "1.5", "G", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_size():
    assert format_size(1536 << 20) == "1.50 GiB"
    assert format_size(100) == "100 B"
