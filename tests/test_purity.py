"""`dloco` is the pure library: it never imports Ray or the actors package."""

import ast
import pathlib
import subprocess
import sys

import dloco

ROOT = pathlib.Path(dloco.__file__).parent


def test_no_ray_or_actors_imports_in_source():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("ray", "actors")]
    assert offenders == []


def test_importing_every_module_loads_no_ray():
    dotted = (".".join(p.relative_to(ROOT.parent).with_suffix("").parts) for p in ROOT.rglob("*.py"))
    modules = sorted(m.removesuffix(".__init__") for m in dotted)  # subpackages too (dloco.config, ...)
    assert len(modules) >= 10
    code = "import sys; " + "; ".join(f"import {m}" for m in modules) + "; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_modules_are_split_before_they_outgrow_one_reading_and_never_squeezed_to_fit():
    """A module of the library or the actors past ~500 lines is split along its seams; no code
    switches the formatter off (ruff's skip and off comments) to fit a number or a layout of its own."""
    long, skips = {}, []
    for root in (ROOT, ROOT.parent / "actors"):
        for path in root.rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > 500:
                long[str(path.relative_to(ROOT.parent))] = n
    for root in (ROOT, ROOT.parent / "actors", ROOT.parent / "tests", ROOT.parent / "benchmarks"):
        for path in root.rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if ("fmt: " + "skip") in line or ("fmt: " + "off") in line:
                    skips.append(f"{path.relative_to(ROOT.parent)}:{i}")
    assert long == {} and skips == []
