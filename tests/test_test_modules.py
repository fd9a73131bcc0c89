"""pytest imports tests/ and e2e/ modules by basename (rootdir-relative, no packages): two modules
with one basename break the collection of the whole suite ("import file mismatch"), as a
merge once did. Every test module's basename is unique."""

from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_basenames(paths) -> list[str]:
    names = Counter(Path(p).name for p in paths)
    return sorted(n for n, c in names.items() if c > 1)


def test_no_two_test_modules_share_a_basename():
    modules = [p for d in ("tests", "e2e") for p in (REPO / d).glob("test_*.py")]
    assert len(modules) > 50
    assert shared_basenames(modules) == []


def test_negative_control_a_shared_basename_is_found():
    assert shared_basenames(["tests/test_a.py", "e2e/test_b.py", "e2e/test_a.py"]) == ["test_a.py"]
