"""The notebooks in colabs/: in step with pyproject.toml's one repository URL, saved from a real run,
and runnable top to bottom in a fresh kernel whose install cell installs this checkout."""

import fcntl
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "tools" / "sync_notebooks.py")
sync = sys.modules["sync_notebooks"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sync)

STEMS = [notebook.stem for notebook in sync.NOTEBOOKS]


def _notebook(stem, root=ROOT):
    return json.loads((root / "colabs" / f"{stem}.ipynb").read_text())


def _cell(notebook, cell_id):
    return next(cell for cell in notebook["cells"] if cell.get("id") == cell_id)


def _text(cell):
    return "".join(cell["source"])


def _printed(cell):
    """What a code cell printed (stream outputs, saved as a list of lines or as one string)."""
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def test_every_notebook_in_colabs_is_listed():
    assert sorted(p.stem for p in (ROOT / "colabs").glob("*.ipynb")) == sorted(STEMS)


def test_notebooks_and_readme_agree_with_pyproject():
    changed = sync.out_of_step()
    assert not changed, f"run python tools/sync_notebooks.py: {[str(p.relative_to(ROOT)) for p in changed]}"


def test_the_url_is_a_placeholder_until_pyproject_sets_it():
    url = sync.repository_url()
    readme = (ROOT / "README.md").read_text()
    for stem in STEMS:
        notebook = _notebook(stem)
        text = json.dumps(notebook)
        if url is None:
            # One greppable placeholder, once in the badge and once in the install cell, nowhere else.
            assert text.count(sync.PLACEHOLDER) == 2, stem
            assert sync.PLACEHOLDER in _text(_cell(notebook, sync.BADGE_CELL_ID))
            assert sync.PLACEHOLDER in _text(_cell(notebook, sync.INSTALL_CELL_ID))
        else:
            assert sync.PLACEHOLDER not in text
            assert sync.github_path(url) in _text(_cell(notebook, sync.BADGE_CELL_ID))
        assert f"{sync.badge(stem, url)} [" in readme, f"the README lists {stem} with its badge"
    assert (sync.PLACEHOLDER in readme) == (url is None)


def _with_url(tmp_path, url):
    """A copy of the files the script writes, with pyproject.toml's Repository set to ``url``."""
    (tmp_path / "colabs").mkdir()
    for stem in STEMS:
        shutil.copy(ROOT / "colabs" / f"{stem}.ipynb", tmp_path / "colabs")
    shutil.copy(ROOT / "README.md", tmp_path)
    pyproject = (ROOT / "pyproject.toml").read_text()
    if "Repository" in tomllib.loads(pyproject)["project"].get("urls", {}):
        pyproject = re.sub(r"(?m)^Repository\s*=.*$", f'Repository = "{url}"', pyproject)
    else:
        pyproject += f'\n[project.urls]\nRepository = "{url}"\n'
    assert tomllib.loads(pyproject)["project"]["urls"]["Repository"] == url
    (tmp_path / "pyproject.toml").write_text(pyproject)
    return tmp_path


def test_setting_the_url_rewrites_every_badge_install_cell_and_the_readme(tmp_path):
    root = _with_url(tmp_path, "https://github.com/example-owner/example-repo")
    changed = sync.out_of_step(root)
    assert set(changed) == {root / "README.md", *(root / "colabs" / f"{stem}.ipynb" for stem in STEMS)}
    for path, text in changed.items():
        path.write_text(text)
    assert sync.out_of_step(root) == {}
    for stem in STEMS:
        before, after = _notebook(stem), _notebook(stem, root)
        assert sync.PLACEHOLDER not in json.dumps(after)
        link = f"https://colab.research.google.com/github/example-owner/example-repo/blob/main/colabs/{stem}.ipynb"
        assert _text(_cell(after, sync.BADGE_CELL_ID)) == f"[![Open In Colab]({sync.BADGE_IMAGE})]({link})"
        assert '"POSENC_JAX_SOURCE", "git+https://github.com/example-owner/example-repo.git"' in _text(
            _cell(after, sync.INSTALL_CELL_ID)
        )
        # Every other cell, saved outputs included, is untouched; so is the install cell but for its source.
        for old_cell, new_cell in zip(before["cells"], after["cells"], strict=True):
            if old_cell["id"] != sync.BADGE_CELL_ID:
                assert {**old_cell, "source": None} == {**new_cell, "source": None}
            if old_cell["id"] not in (sync.BADGE_CELL_ID, sync.INSTALL_CELL_ID):
                assert old_cell == new_cell
    readme = (root / "README.md").read_text()
    assert sync.PLACEHOLDER not in readme and readme.count("github/example-owner/example-repo/blob/main") == 5


def test_a_url_colab_cannot_open_is_refused(tmp_path):
    root = _with_url(tmp_path, "https://gitlab.com/example-owner/example-repo")
    with pytest.raises(ValueError, match="gitlab.com/example-owner/example-repo.*not a GitHub repository URL"):
        sync.out_of_step(root)


def _install_logic(url, environ):
    """Runs the install cell up to its ``%pip`` line; returns what it would install."""
    code = sync.install_cell(url)
    body, pip_line = code.rsplit("\n", 1)
    assert pip_line == '%pip install --quiet "posenc_jax[bench] @ {source}"'  # one non-editable install
    namespace = {}
    old = os.environ.copy()
    try:
        os.environ.clear()
        os.environ.update(environ)
        exec(body, namespace)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return namespace["source"]


def test_install_cell_honours_posenc_jax_source_and_refuses_the_placeholder(tmp_path):
    with pytest.raises(RuntimeError, match="cannot install posenc_jax from 'REPOSITORY_URL_NOT_SET'.*POSENC_JAX"):
        _install_logic(None, {})
    assert _install_logic(None, {"POSENC_JAX_SOURCE": str(ROOT)}) == ROOT.as_uri()
    wheel = tmp_path / "posenc_jax-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert _install_logic(None, {"POSENC_JAX_SOURCE": str(wheel)}) == wheel.as_uri()
    with pytest.raises(RuntimeError, match="cannot install posenc_jax from '/no/such/checkout'"):
        _install_logic(None, {"POSENC_JAX_SOURCE": "/no/such/checkout"})
    url = "https://github.com/example-owner/example-repo"
    assert _install_logic(url, {}) == "git+https://github.com/example-owner/example-repo.git"


def test_a_tiny_run_is_never_saved(monkeypatch):
    monkeypatch.setenv("POSENC_JAX_TINY", "1")
    with pytest.raises(SystemExit, match="unset it to save outputs, or add --no-save"):
        sync.main(["--execute", "quickstart"])


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_is_saved_from_one_real_run(stem):
    notebook = _notebook(stem)
    cells = notebook["cells"]
    assert cells[0]["id"] == sync.BADGE_CELL_ID and cells[0]["cell_type"] == "markdown"
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code[0]["id"] == sync.INSTALL_CELL_ID and code[1]["id"] == "device"
    assert sum(_text(c).count("%pip") for c in code) == 1, "one install cell, and nothing else installs"
    imports = [line for line in _text(code[0]).splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import os", "import pathlib"], "nothing imports jax before the install"
    # Every cell ran, top to bottom, in one kernel, without an error.
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert "CPU" in _printed(_cell(notebook, "device"))
    assert "POSENC_JAX_TINY" not in _printed(_cell(notebook, "device")), "saved from the tests' tiny size"
    prose = [" ".join(_text(c).split()) for c in cells if c["cell_type"] == "markdown"]
    assert any("saved outputs below come from" in text and "on a CPU" in text for text in prose)
    if stem != "bring_your_own_model":  # the others draw plots; they are kept in the notebook
        assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.fixture(scope="session")
def checkout_wheel(tmp_path_factory, worker_id):
    """A wheel of this checkout, built once for all the suite's workers (the install cell takes a wheel as it
    takes a checkout, and building the checkout is most of its time); CI's own step installs the checkout."""
    if worker_id == "master":  # one process: its own folder
        folder = tmp_path_factory.mktemp("checkout-wheel")
    else:  # the workers' shared folder, this run's
        folder = tmp_path_factory.getbasetemp().parent / "checkout-wheel"
        folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker builds it; the others wait, then find it
        if not list(folder.glob("posenc_jax-*.whl")):
            command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(folder)]
            subprocess.run([*command, str(ROOT)], check=True, capture_output=True)
    (wheel,) = folder.glob("posenc_jax-*.whl")
    return wheel


@pytest.mark.long
@pytest.mark.parametrize("stem", STEMS)
def test_notebook_runs_top_to_bottom_in_a_fresh_kernel(stem, monkeypatch, checkout_wheel):
    # A fresh environment and kernel whose install cell installs POSENC_JAX_SOURCE (a wheel of this checkout
    # unless set); a cell that raises fails here with its traceback (nbclient's CellExecutionError). At the
    # notebooks' tiny size (POSENC_JAX_TINY): every cell runs, in seconds; the saved outputs are the real run.
    monkeypatch.setenv("POSENC_JAX_TINY", "1")
    if "POSENC_JAX_SOURCE" not in os.environ:
        monkeypatch.setenv("POSENC_JAX_SOURCE", str(checkout_wheel))
    executed = sync.execute(ROOT / "colabs" / f"{stem}.ipynb")
    code = [c for c in executed["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code)
    device = _printed(_cell(executed, "device"))
    assert "CPU" in device or "GPU" in device or "TPU" in device
