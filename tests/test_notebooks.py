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


COLAB_GITHUB = "colab.research.google.com/github/"


def test_no_colab_link_until_pyproject_sets_the_url():
    # While pyproject.toml has no Repository URL, nothing links to Colab (no placeholder link anywhere: README,
    # notebooks, docs); each notebook's first cell says how to run it on Colab by uploading it with a wheel.
    url = sync.repository_url()
    readme = (ROOT / "README.md").read_text()
    docs = {path: path.read_text() for path in (ROOT / "docs" / "site").rglob("*.md")}
    for stem in STEMS:
        notebook = _notebook(stem)
        first = _text(_cell(notebook, sync.BADGE_CELL_ID))
        if url is None:
            assert COLAB_GITHUB not in json.dumps(notebook), stem
            assert first.startswith("**Run on Colab:** upload this notebook") and "pip wheel --no-deps ." in first
            assert f"| [{sync.NOTEBOOKS[STEMS.index(stem)].title}](colabs/{stem}.ipynb) |" in readme
        else:
            assert first == sync.badge(stem, url)
            assert f"{sync.badge(stem, url)} [" in readme, f"the README lists {stem} with its badge"
    links = re.findall(rf"https://{re.escape(COLAB_GITHUB)}\S*", readme + "".join(docs.values()))
    if url is None:
        assert not links, links
    else:
        assert links and all(link.startswith(sync.colab_link("", url).rsplit("/", 2)[0]) for link in links), links
    assert "REPOSITORY_URL_NOT_SET" not in readme + "".join(docs.values())


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
        link = f"https://colab.research.google.com/github/example-owner/example-repo/blob/main/colabs/{stem}.ipynb"
        assert _text(_cell(after, sync.BADGE_CELL_ID)) == f"[![Open In Colab]({sync.BADGE_IMAGE})]({link})"
        install = _text(_cell(after, sync.INSTALL_CELL_ID))
        assert 'REPOSITORY = "git+https://github.com/example-owner/example-repo.git"\n' in install
        # Every other cell, saved outputs included, is untouched; so is the install cell but for its source.
        for old_cell, new_cell in zip(before["cells"], after["cells"], strict=True):
            if old_cell["id"] != sync.BADGE_CELL_ID:
                assert {**old_cell, "source": None} == {**new_cell, "source": None}
            if old_cell["id"] not in (sync.BADGE_CELL_ID, sync.INSTALL_CELL_ID):
                assert old_cell == new_cell
    readme = (root / "README.md").read_text()
    assert readme.count("colab.research.google.com/github/example-owner/example-repo/blob/main/colabs/") == 5
    assert "upload it (*File → Upload notebook*)" not in readme  # the badge replaces the upload instructions


def test_a_url_colab_cannot_open_is_refused(tmp_path):
    root = _with_url(tmp_path, "https://gitlab.com/example-owner/example-repo")
    with pytest.raises(ValueError, match="gitlab.com/example-owner/example-repo.*not a GitHub repository URL"):
        sync.out_of_step(root)


def _install_logic(url, environ, cwd, monkeypatch):
    """Runs the install cell up to its ``%pip`` line in folder ``cwd``; returns what it would install."""
    code = sync.install_cell(url)
    body, pip_line = code.rsplit("\n", 1)
    assert pip_line == '%pip install --quiet "posenc_jax[bench] @ {source}"'  # one non-editable install
    namespace = {}
    monkeypatch.chdir(cwd)
    for name in ("POSENC_JAX_SOURCE",):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    exec(body, namespace)
    return namespace["source"]


def test_install_cell_installs_from_source_then_repository_then_upload(tmp_path, monkeypatch):
    url = "https://github.com/example-owner/example-repo"
    empty = tmp_path / "empty"
    empty.mkdir()
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    wheel = uploads / "posenc_jax-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    # 1. POSENC_JAX_SOURCE (a checkout or a wheel; CI and the tests) comes first.
    assert _install_logic(None, {"POSENC_JAX_SOURCE": str(ROOT)}, uploads, monkeypatch) == ROOT.as_uri()
    assert _install_logic(url, {"POSENC_JAX_SOURCE": str(wheel)}, empty, monkeypatch) == wheel.as_uri()
    # 2. The repository, when pyproject.toml names one.
    assert _install_logic(url, {}, uploads, monkeypatch) == "git+https://github.com/example-owner/example-repo.git"
    # 3. A wheel or source archive uploaded to the kernel's folder: the newest.
    assert _install_logic(None, {}, uploads, monkeypatch) == wheel.as_uri()
    archive = uploads / "posenc_jax-0.2.0.tar.gz"
    archive.write_bytes(b"")
    os.utime(wheel, (1, 1))
    assert _install_logic(None, {}, uploads, monkeypatch) == archive.as_uri()


def _stop_line(url, environ, cwd, monkeypatch):
    """The install cell stops: the one line IPython shows for it (its ``_render_traceback_``)."""
    with pytest.raises(Exception) as stopped:  # the cell's own InstallStopped
        _install_logic(url, environ, cwd, monkeypatch)
    assert type(stopped.value).__name__ == "InstallStopped"
    (line,) = stopped.value._render_traceback_()
    assert "\n" not in line
    return line


def test_install_cell_without_anything_to_install_stops_with_one_line_saying_what_to_upload(tmp_path, monkeypatch):
    line = _stop_line(None, {}, tmp_path, monkeypatch)
    assert line == sync.NOTHING_TO_INSTALL
    assert "pip wheel --no-deps ." in line and "`posenc_jax-*.whl`" in line and "Files pane" in line
    line = _stop_line(None, {"POSENC_JAX_SOURCE": "/no/such/checkout"}, tmp_path, monkeypatch)
    assert line.startswith("POSENC_JAX_SOURCE='/no/such/checkout' does not exist: set it to a checkout or a wheel")


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


def test_install_cell_in_a_fresh_kernel_without_anything_to_install_shows_one_line(tmp_path):
    # What a Colab user sees who runs the notebook with nothing uploaded: one line, no traceback.
    import nbclient.exceptions
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(sync.install_cell(None))])
    empty = tmp_path / "nothing.txt"
    empty.write_text("")  # the kernel's folder holds this file only: no wheel
    with pytest.raises(nbclient.exceptions.CellExecutionError) as stopped:
        sync.execute(notebook, upload=empty)
    assert stopped.value.ename == "InstallStopped"
    assert stopped.value.evalue == sync.NOTHING_TO_INSTALL
    # What the notebook shows below the cell (nbclient quotes the cell, then the traceback): this line alone.
    assert stopped.value.traceback.rpartition("\n------------------\n")[2].strip() == sync.NOTHING_TO_INSTALL


@pytest.mark.long
def test_install_cell_installs_a_wheel_uploaded_beside_it_in_a_fresh_kernel(checkout_wheel):
    # A fresh kernel and environment whose folder holds only the wheel, no POSENC_JAX_SOURCE, no repository URL:
    # the install cell finds the wheel and installs it, and posenc_jax imports from the kernel's environment and
    # runs. (CI runs the whole quickstart this way: tools/sync_notebooks.py --install-uploaded.)
    printed = sync.install_uploaded(checkout_wheel, None)
    assert re.search(rf"installing posenc_jax from \S+/work/{re.escape(checkout_wheel.name)}\n", printed), printed
    assert "attention (1, 4, 2, 8)" in printed, printed
