"""docs/: CONFIG.md is what scripts/gen_config_docs.py generates from dloco/config/, so it cannot go stale."""

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

from dloco import config

ROOT = Path(__file__).resolve().parents[1]


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_md_is_up_to_date():
    committed = (ROOT / "docs" / "CONFIG.md").read_text()
    assert generator().render() == committed, (
        "docs/CONFIG.md is stale: dloco/config/ changed. Regenerate it with "
        "`python scripts/gen_config_docs.py` and commit the result."
    )


def test_config_md_lists_every_field_and_preset():
    text = generator().render()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f"`{prefix}{f.name}`" in text, f"{prefix}{f.name} missing"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(config.RunConfig, "")
    assert "`learners.groups[].resources`" in text
    for name in config.PRESETS:
        assert f"### `{name}`" in text
    assert re.search(r"\| `sync\.overlap` \| `int` \| `\d+` \| τ \|", text)


def test_docs_exist_and_link_what_they_cite():
    for name in ("ARCHITECTURE.md", "CLUSTER.md", "SECURITY.md", "SYMBOLS.md", "CONFIG.md"):
        assert (ROOT / "docs" / name).is_file(), name
    cluster = (ROOT / "docs" / "CLUSTER.md").read_text()
    for cited in re.findall(r"cluster_configs/[\w.]+\.yaml", cluster):
        assert (ROOT / cited).is_file(), f"docs/CLUSTER.md cites {cited}, which does not exist"
    symbols = (ROOT / "docs" / "SYMBOLS.md").read_text()
    configured = symbols.split("## Configured", 1)[1].split("\n## ", 1)[0]
    keys = [row.split("|")[2] for row in configured.splitlines() if row.startswith("| ") and "`" in row]
    assert len(keys) >= 9
    for dotted in (re.search(r"`([a-z_]+\.[a-z_]+)`", k).group(1) for k in keys):
        section, key = dotted.split(".")
        cls = type(getattr(config.RunConfig(), section))
        assert key in {f.name for f in dataclasses.fields(cls)}, f"docs/SYMBOLS.md names {dotted}, not a config key"


def test_algorithm_md_has_every_section_the_code_cites():
    text = (ROOT / "docs" / "ALGORITHM.md").read_text()
    headings = set(re.findall(r"^## (\d+)\. ", text, flags=re.M))
    cited = set()
    for path in [
        *ROOT.glob("dloco/**/*.py"),
        *ROOT.glob("actors/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("docs/*.md"),
    ]:
        cited |= set(re.findall(r"§(\d+)", path.read_text()))
    assert cited and cited <= headings, f"cited sections {sorted(cited - headings)} are not in docs/ALGORITHM.md"


def test_nothing_points_outside_the_repository():
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("dloco/**/*.py"), *ROOT.glob("actors/*.py")]:
        text = path.read_text()
        outside = ("../" + "shared", "shared" + "/docs")  # spelled apart so this file does not match itself
        assert not any(o in text for o in outside), f"{path.name} points outside the repository"


def test_readme_states_the_default_run_that_dloco_train_loads():
    """README's table of what `dloco train` runs with no arguments is what `config.load()` gives."""
    import yaml

    readme = (ROOT / "README.md").read_text()
    section = readme.split("### What the default run does", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_.]+)` \| `([^`]+)` \|", section, flags=re.M)
    assert len(rows) >= 12
    loaded = config.load().to_dict()
    for dotted, value in rows:
        node = loaded
        for part in dotted.split("."):
            node = node[part]
        assert node == yaml.safe_load(value), f"README says {dotted} = {value}, dloco train loads {node!r}"
