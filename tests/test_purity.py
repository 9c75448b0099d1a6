"""`dloco` is the pure library: it never imports Ray or the actors package."""

import ast
import pathlib
import subprocess
import sys

import dloco

ROOT = pathlib.Path(dloco.__file__).parent


def test_no_ray_or_actors_imports_in_source():
    offenders = []
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("ray", "actors")]
    assert offenders == []


def test_importing_every_module_loads_no_ray():
    modules = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert len(modules) >= 10
    code = "import sys; " + "; ".join(f"import dloco.{m}" for m in modules) + "; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
