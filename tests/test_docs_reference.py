"""The API reference's sources and the README's install claims, checked without building the site (CI builds it:
``mkdocs build --strict``, whose hook fails on a public name without an entry)."""

import ast
import pathlib
import re
import tomllib

import posenc_jax.functional

ROOT = pathlib.Path(__file__).resolve().parents[1]
FUNCTIONAL_PAGE = ROOT / "docs" / "site" / "api" / "functional.md"


def _sections(page: str) -> list[tuple[str, list[str]]]:
    """Each ``## `` section of an API page and the names of its ``::: posenc_jax.functional.NAME`` entries."""
    sections = []
    for line in page.splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        match = re.fullmatch(r"::: posenc_jax\.functional\.(\w+)\s*", line)
        if match:
            assert sections, f"{line!r} comes before the first section of api/functional.md"
            sections[-1][1].append(match[1])
    return sections


def test_functional_reference_has_every_exported_name_once_in_a_section():
    sections = _sections(FUNCTIONAL_PAGE.read_text())
    listed = [name for _, names in sections for name in names]
    exported = posenc_jax.functional.__all__
    missing = sorted(set(exported) - set(listed))
    extra = sorted(set(listed) - set(exported))
    twice = sorted({name for name in listed if listed.count(name) > 1})
    assert not missing, f"add these names of posenc_jax.functional to a section of {FUNCTIONAL_PAGE}: {missing}"
    assert not extra, f"{FUNCTIONAL_PAGE} lists names posenc_jax.functional does not export: {extra}"
    assert not twice, f"{FUNCTIONAL_PAGE} lists these names more than once: {twice}"


def test_functional_reference_reads_attention_first_and_the_contract_last():
    sections = dict(_sections(FUNCTIONAL_PAGE.read_text()))
    titles = list(sections)
    assert titles[0] == "Attention and masks" and sections[titles[0]][0] == "dot_product_attention"
    assert {"causal_mask", "key_padding_mask", "segment_mask", "combine_masks"} <= set(sections[titles[0]])
    assert titles[-2:] == ["The modules", "Adding an encoding"]
    assert {"register_encoding", "EncodingConfig", "AttentionContext"} <= set(sections["Adding an encoding"])
    # An encoding family's section holds its hook, its config and its functions.
    assert sections["RoPE"][:2] == ["RoPE", "RotaryTable"] and "apply_rope" in sections["RoPE"]
    assert set(sections["T5 relative bias"]) == {"T5Bias", "T5Config", "t5_bias", "t5_relative_bucket"}


def _imported_top_level_packages(package: pathlib.Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_readme_names_what_pip_install_brings_and_nothing_else():
    readme = (ROOT / "README.md").read_text()
    (claim,) = re.findall(r"^pip install -e \.\s+# the library: (.*)$", readme, flags=re.M)
    named = {name.strip() for name in claim.split(",")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in project["dependencies"]}
    assert named == declared, f"README's `pip install -e .` names {sorted(named)}; pyproject.toml {sorted(declared)}"
    # chex checks shapes in the tests (the dev extra); the library itself never imports it.
    assert "chex" not in _imported_top_level_packages(ROOT / "posenc_jax")
    assert any(requirement.startswith("chex") for requirement in project["optional-dependencies"]["dev"])
