"""Every function under omni_pd is at most MAX_LINES long (issue 46: modules with one job, no
function over ~80 lines), except the tables listed below. Read from the source with ast: a
function's lines run from its `def` to its last line, docstring and comments included; a nested
function counts on its own and inside the one that holds it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "omni_pd"
MAX_LINES = 80

# (file under omni_pd, qualified name) -> why it may be longer. Argument tables and config
# dictionaries read best whole.
ALLOWED: dict[tuple[str, str], str] = {
    ("entrypoints/cli.py", "build_parser"): "CLI argument table (omni-pd's subcommands and flags)",
    ("bench/serve.py", "add_arguments"): "CLI argument table (omni-pd bench serve's flags)",
    ("entrypoints/openai/metrics.py", "ServerMetrics.__init__"): "table of the server's Prometheus metrics",
    ("models/qwen3_omni/tiny_config.py", "tiny_config_dict"): "config dictionary (the tiny model's)",
    ("models/qwen3_omni/real_config.py", "real_config_dict"): "config dictionary (the real model's shapes)",
    (
        "models/qwen2_5_omni/real_config.py",
        "real_config_dict",
    ): "config dictionary (Qwen2.5-Omni-7B's shapes)",
}


def long_functions(source: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Qualified name -> length of every function in `source` longer than `max_lines`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                assert child.end_lineno is not None, "ast gives every node its end"
                lines = child.end_lineno - child.lineno + 1
                if lines > max_lines:
                    found[name] = lines
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _long_functions_under(root: Path) -> dict[tuple[str, str], int]:
    return {
        (path.relative_to(root).as_posix(), name): lines
        for path in sorted(root.rglob("*.py"))
        for name, lines in long_functions(path.read_text()).items()
    }


def test_no_function_over_max_lines_but_the_allowed_tables():
    over = {key: lines for key, lines in _long_functions_under(ROOT).items() if key not in ALLOWED}
    assert over == {}, f"split these functions (at most {MAX_LINES} lines each): {over}"


def test_every_allowed_table_is_still_long():
    """An entry whose function was split (or renamed, or moved) leaves the list."""
    found = _long_functions_under(ROOT)
    stale = sorted(key for key in ALLOWED if key not in found)
    assert stale == [], f"remove these from ALLOWED: no such function over {MAX_LINES} lines now: {stale}"


def test_negative_control_an_81_line_function_is_reported_an_80_line_one_is_not():
    def function(name: str, lines: int, indent: str = "") -> str:
        body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2))
        return f"{indent}def {name}():\n{body}{indent}    return 0\n"

    source = (
        function("fits", 80)
        + function("too_long", 81)
        + "class A:\n"
        + function("method", 81, indent="    ")
        + "async def outer():\n    pass\n"
    )
    assert long_functions(source) == {"too_long": 81, "A.method": 81}
    assert long_functions(function("f", 81), max_lines=81) == {}
