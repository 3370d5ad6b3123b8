"""The notebooks' badges and install cells, and the README's list of notebooks, from one URL.

The repository URL lives in one place: ``[project.urls] Repository`` in pyproject.toml. This
script writes it into every notebook's Open-in-Colab badge and install cell and into the README's
"Notebooks" section; ``tests/test_notebooks.py`` checks that they agree. While pyproject.toml has
no Repository URL there is no badge anywhere: the notebooks' first cell and the README say how to
run a notebook on Colab by uploading it with a posenc_jax wheel. The install cell installs the first
of: ``POSENC_JAX_SOURCE`` (a checkout, a wheel or a pip URL; the tests and CI set it), the
repository, a posenc_jax wheel or source archive uploaded to the runtime (the kernel's folder or
``/content``); with none of them it stops with one line saying what to upload and how.

    python tools/sync_notebooks.py                  # rewrite badges, install cells and the README section
    python tools/sync_notebooks.py --check          # exit 1, naming what is out of step, if anything is
    python tools/sync_notebooks.py --execute [STEM ...]   # run notebooks top to bottom, save their outputs
    python tools/sync_notebooks.py --install-uploaded WHEEL   # the quickstart with only a wheel beside it

``--execute`` runs each notebook in a fresh kernel of a fresh virtual environment (see
:func:`kernel_python`) whose install cell installs ``POSENC_JAX_SOURCE`` (default: this checkout),
and saves the outputs into the notebook. With ``--here --no-save`` the kernel runs in the calling
interpreter's own environment (CI's clean one, which has ipykernel and no posenc_jax) and nothing is
written. ``--install-uploaded`` runs the quickstart as a Colab user who uploaded it with a wheel
does (:func:`install_uploaded`): a fresh kernel in a folder holding only the wheel, no
``POSENC_JAX_SOURCE``, dependencies from the package index; every cell runs, and posenc_jax
imports from the kernel's environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tempfile
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLABS = ROOT / "colabs"
# What the install cell looks for in the kernel's folder and in /content (where Colab's Files pane uploads).
UPLOAD_PATTERNS = ("posenc_jax-*.whl", "posenc_jax-*.tar.gz")
BRANCH = "main"  # the branch the Colab badges open
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_CELL_ID = "colab-badge"
INSTALL_CELL_ID = "install"
README_START = "<!-- notebooks: written by tools/sync_notebooks.py from pyproject.toml; edit there -->"
README_END = "<!-- notebooks: end -->"


@dataclasses.dataclass(frozen=True)
class Notebook:
    stem: str  # colabs/<stem>.ipynb
    title: str
    shows: str  # what it shows, one sentence for the README


NOTEBOOKS = (
    Notebook(
        "quickstart",
        "Quickstart",
        "the functional API and the Flax NNX modules, encodings by name, a RoPE + ALiBi hybrid, and KV-cache "
        "decoding checked against the full forward pass",
    ),
    Notebook(
        "extrapolation",
        "Length extrapolation",
        "`posenc-bench extrapolate` sized to the device (the `colab-tpu` preset on all cores of a TPU, `smoke` on a "
        "CPU), its table and plots beside the published figures",
    ),
    Notebook(
        "blind_spot",
        "The blind spot of relative encodings",
        "the theorem on n identical tokens checked for every encoding, the fixes that break the tie, and a small "
        "probe run with its heat map",
    ),
    Notebook(
        "rope_scalings",
        "RoPE scalings",
        "a Hugging Face config loaded (`from_hf_config`), the per-dimension frequencies of PI, NTK, YaRN, Llama 3 and "
        "LongRoPE against the base, and YaRN applied at evaluation to a model trained short",
    ),
    Notebook(
        "bring_your_own_model",
        "Bring your own model",
        "an encoding added to your own Flax NNX and Linen attention, and a new encoding of your own through the "
        "registry",
    ),
)


def repository_url(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> str | None:
    """``[project.urls] Repository`` from pyproject.toml, or None while it is not set."""
    project = tomllib.loads(pyproject.read_text())["project"]
    url = project.get("urls", {}).get("Repository")
    if url is not None:
        github_path(url)  # refuse a URL the badges cannot use, here and now
    return url


def github_path(url: str) -> str:
    """``owner/name`` of a GitHub repository URL (Colab opens notebooks from GitHub)."""
    match = re.fullmatch(r"https://github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+?)(?:\.git)?/?", url)
    if not match:
        raise ValueError(
            f"[project.urls] Repository = {url!r} is not a GitHub repository URL (https://github.com/OWNER/NAME); "
            f"the Open-in-Colab badges need one"
        )
    return f"{match[1]}/{match[2]}"


def colab_link(stem: str, url: str) -> str:
    """Where the badge of ``colabs/<stem>.ipynb`` points."""
    return f"https://colab.research.google.com/github/{github_path(url)}/blob/{BRANCH}/colabs/{stem}.ipynb"


def badge(stem: str, url: str) -> str:
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_link(stem, url)})"


UPLOAD_HOWTO = (
    "build a wheel in a checkout of posenc_jax with `pip wheel --no-deps .` (or `python -m build`) and upload "
    "the `posenc_jax-*.whl` with Colab's Files pane (the folder icon on the left) into /content, or put it in "
    "the notebook's folder under Jupyter"
)


NOTHING_TO_INSTALL = (
    f"posenc_jax is not installed and there is nothing to install it from: {UPLOAD_HOWTO}, then run this cell again."
)


def _string_literal_lines(text: str, indent: int, width: int = 100) -> str:
    """``text`` as adjacent string literals, one a line, each line within ``width`` characters."""
    words, lines, line = text.split(" "), [], ""
    for word in words:
        if line and len(json.dumps(f"{line} {word} ", ensure_ascii=False)) + indent > width:
            lines.append(line + " ")
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "".join(" " * indent + json.dumps(part, ensure_ascii=False) + "\n" for part in lines)


def badge_cell(stem: str, url: str | None) -> str:
    """The notebook's first cell: its Open-in-Colab badge, or how to run it on Colab without one."""
    if url is not None:
        return badge(stem, url)
    return (
        f"**Run on Colab:** upload this notebook (*File → Upload notebook*), then {UPLOAD_HOWTO}; the first code "
        "cell installs the wheel."
    )


def install_cell(url: str | None) -> str:
    """The install cell: a non-editable ``%pip install`` before anything imports jax, from the first source found."""
    repository = (
        "None  # no public repository: upload a wheel"
        if url is None
        else json.dumps(f"git+https://github.com/{github_path(url)}.git")
    )
    return (
        "# Installs posenc_jax (not editable) before anything imports jax, so the kernel needs no restart, from the\n"
        "# first of: POSENC_JAX_SOURCE (a checkout, a wheel or a pip URL), the project's repository, a posenc_jax\n"
        "# wheel or source archive uploaded to this runtime (this notebook's folder, or /content on Colab).\n"
        "import os\n"
        "import pathlib\n"
        "\n"
        f"REPOSITORY = {repository}\n"
        "\n"
        "\n"
        "class InstallStopped(Exception):\n"
        "    def _render_traceback_(self):  # IPython shows this one line instead of a traceback\n"
        "        return [str(self)]\n"
        "\n"
        "\n"
        'source = os.environ.get("POSENC_JAX_SOURCE") or REPOSITORY\n'
        "if not source:\n"
        '    folders = dict.fromkeys([pathlib.Path.cwd(), pathlib.Path("/content")])\n'
        f"    patterns = ({', '.join(json.dumps(p) for p in UPLOAD_PATTERNS)})\n"
        "    uploaded = [path for folder in folders for pattern in patterns for path in folder.glob(pattern)]\n"
        "    if not uploaded:\n"
        "        raise InstallStopped(\n"
        f"{_string_literal_lines(NOTHING_TO_INSTALL, 12)}"
        "        )\n"
        "    source = str(max(uploaded, key=lambda path: path.stat().st_mtime))  # the newest upload\n"
        '    print(f"installing posenc_jax from {source}")\n'
        'if "://" not in source:\n'
        "    if not os.path.exists(source):\n"
        "        raise InstallStopped(\n"
        '            f"POSENC_JAX_SOURCE={source!r} does not exist: set it to a checkout or a wheel of "\n'
        '            "posenc_jax, or to a pip URL such as git+https://..."\n'
        "        )\n"
        "    source = pathlib.Path(source).resolve().as_uri()\n"
        '%pip install --quiet "posenc_jax[bench] @ {source}"'
    )


def readme_section(url: str | None) -> str:
    """The README's "Notebooks" section (between the markers)."""
    opening = "an Open-in-Colab badge" if url is not None else "how to run it on Colab"
    lines = [
        README_START,
        "## Notebooks",
        "",
        textwrap.fill(
            f"Each notebook in `colabs/` opens with {opening}, one install cell (a non-editable "
            "`%pip install` of posenc_jax) and a device cell that reports the TPU, GPU or CPU and sizes the work "
            "to it. The saved outputs come from a run on a CPU, so the plots are there without running anything; "
            "`python -m pytest -m slow tests/test_notebooks.py` runs every notebook top to bottom in a fresh kernel "
            "(the test suite's slow tier). The tests set `POSENC_JAX_TINY=1`, which the device cells of the "
            "heavier notebooks read to shrink the work further (fewer encodings, scalings, normalisers, steps or "
            "lengths; numbers that mean nothing), so every cell runs in seconds; the saved outputs are from the CPU "
            "size, and `tools/sync_notebooks.py` refuses to save a tiny run.",
            90,
            break_on_hyphens=False,
        ),
        "",
        "| notebook | what it shows |",
        "|---|---|",
    ]
    for notebook in NOTEBOOKS:
        link = f"[{notebook.title}](colabs/{notebook.stem}.ipynb)"
        if url is not None:
            link = f"{badge(notebook.stem, url)} {link}"
        lines.append(f"| {link} | {notebook.shows} |")
    lines.append("")
    if url is None:
        lines += [
            textwrap.fill(
                f"To run one on Colab, upload it (*File → Upload notebook*), then {UPLOAD_HOWTO}. Its install "
                "cell installs the wheel it finds there, and without one stops with a line saying what to upload. "
                "Setting `[project.urls] Repository` in pyproject.toml and running `python tools/sync_notebooks.py` "
                "puts an Open-in-Colab badge on every notebook and in this list, and the install cells then "
                "install from the repository.",
                90,
                break_on_hyphens=False,
            ),
            "",
        ]
    lines.append(README_END)
    return "\n".join(lines)


def _source_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def synced_notebook(notebook: dict, stem: str, url: str | None) -> dict:
    """``notebook`` (nbformat JSON) with its badge and install cells written from ``url``.

    The badge cell and the install cell are found by their ids."""
    cells = {cell.get("id"): cell for cell in notebook["cells"]}
    missing = [i for i in (BADGE_CELL_ID, INSTALL_CELL_ID) if i not in cells]
    if missing:
        raise ValueError(f"colabs/{stem}.ipynb has no cell with id {missing}; add them (see tools/sync_notebooks.py)")
    first_code = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    if first_code is not cells[INSTALL_CELL_ID]:
        raise ValueError(f"colabs/{stem}.ipynb: the install cell must be the first code cell")
    notebook = json.loads(json.dumps(notebook))  # a copy
    cells = {cell.get("id"): cell for cell in notebook["cells"]}
    cells[BADGE_CELL_ID]["source"] = _source_lines(badge_cell(stem, url))
    # The install cell keeps no outputs (see save_executed), so a new URL leaves nothing stale behind.
    cells[INSTALL_CELL_ID]["source"] = _source_lines(install_cell(url))
    return notebook


def synced_readme(readme: str, url: str | None) -> str:
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no notebooks section between {README_START!r} and {README_END!r}")
    return readme[:start] + readme_section(url) + readme[end + len(README_END) :]


def _lines(value):
    return value.splitlines(keepends=True) if isinstance(value, str) else value


def dumps(notebook: dict) -> str:
    """Notebook JSON as Jupyter writes it: indent 1, keys sorted, sources and texts as lists of lines."""
    notebook = json.loads(json.dumps(notebook))
    for cell in notebook["cells"]:
        cell["source"] = _lines(cell["source"])
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = _lines(output["text"])
            data = output.get("data", {})
            for mime in data:
                if mime.startswith("text/"):
                    data[mime] = _lines(data[mime])
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def out_of_step(root: pathlib.Path = ROOT) -> dict[pathlib.Path, str]:
    """Each file whose text differs from what pyproject.toml's URL makes of it, with that text."""
    url = repository_url(root / "pyproject.toml")
    changed = {}
    for notebook in NOTEBOOKS:
        path = root / "colabs" / f"{notebook.stem}.ipynb"
        text = path.read_text()
        new = dumps(synced_notebook(json.loads(text), notebook.stem, url))
        if new != text:
            changed[path] = new
    readme = root / "README.md"
    new = synced_readme(readme.read_text(), url)
    if new != readme.read_text():
        changed[readme] = new
    return changed


# Running notebooks in a fresh kernel.


def kernel_python(where: pathlib.Path) -> pathlib.Path:
    """A fresh virtual environment under ``where`` for a notebook kernel; returns its python.

    It sees this interpreter's installed packages (jax, ipykernel, pip, ...) through a folder of
    links, less posenc_jax itself, so the notebook's own install cell is what puts posenc_jax
    into it, non-editable, as on Colab; nothing is downloaded but the package's build backend.
    """
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    shared = where / "shared-packages"
    shared.mkdir()
    for packages in site.getsitepackages():
        for entry in sorted(pathlib.Path(packages).iterdir()):
            name = entry.name.lower()
            hidden = name.startswith(("posenc_jax", "__editable__", "__pycache__")) or name.endswith(".pth")
            if not hidden and not (shared / entry.name).exists():
                (shared / entry.name).symlink_to(entry)
    (pathlib.Path(purelib) / "shared_packages.pth").write_text(f"{shared}\n")
    return python


def execute(
    path: pathlib.Path | dict,
    *,
    source: str | None = None,
    python: pathlib.Path | None = None,
    timeout: int = 900,
    upload: pathlib.Path | None = None,
    environ: dict[str, str] | None = None,
) -> dict:
    """Runs ``path`` top to bottom in a fresh kernel; returns the executed notebook.

    Args:
      path: the notebook, or a notebook already read (nbformat).
      source: what the install cell installs (``POSENC_JAX_SOURCE``); default this checkout.
      python: the kernel's interpreter, in an environment without posenc_jax and with ipykernel
        (a fresh virtual environment); default a new one from :func:`kernel_python`.
      timeout: seconds allowed for one cell.
      upload: a file to put in the kernel's folder, as a user uploads a wheel to a Colab runtime; the
        kernel then has no ``POSENC_JAX_SOURCE``, so the install cell installs what it finds there.
      environ: variables to set for the kernel, beside this process's own.

    Returns:
      The executed notebook (nbformat). A cell that raises raises ``nbclient``'s ``CellExecutionError``
      here, with the cell and the traceback.
    """
    import nbformat
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    if upload is not None and source is not None:
        raise ValueError("give source= (POSENC_JAX_SOURCE) or upload= (a file for the kernel's folder), not both")
    notebook = nbformat.read(path, as_version=4) if isinstance(path, pathlib.Path) else nbformat.from_dict(path)
    name = path.name if isinstance(path, pathlib.Path) else "the notebook"
    with tempfile.TemporaryDirectory(prefix="posenc-notebook-") as tmp:
        tmp = pathlib.Path(tmp)
        python = kernel_python(tmp) if python is None else pathlib.Path(python)
        spec = tmp / "kernels" / "posenc-notebook"
        spec.mkdir(parents=True)
        argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "posenc", "language": "python"}))
        work = tmp / "work"  # not the checkout, so `import posenc_jax` finds only what the install cell installed
        work.mkdir()
        # The kernel's environment as if activated: its own scripts (posenc-bench) first on PATH.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POSENC_JAX_SOURCE")}
        env["VIRTUAL_ENV"] = str(python.parent.parent)
        env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
        if upload is None:
            env["POSENC_JAX_SOURCE"] = source or os.environ.get("POSENC_JAX_SOURCE") or str(ROOT)
        else:
            shutil.copy(upload, work / pathlib.Path(upload).name)  # the folder holds this file alone
        env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        env.update(environ or {})
        km = KernelManager(
            kernel_name="posenc-notebook", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)])
        )
        client = NotebookClient(
            notebook, km=km, timeout=timeout, resources={"metadata": {"path": str(work)}}, record_timing=False
        )
        try:
            client.execute(env=env)
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)  # the client leaves a kernel it was handed running
        installed = pathlib.Path(
            subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        if not (installed / "posenc_jax" / "__init__.py").exists():
            raise RuntimeError(f"{name}: its install cell did not install posenc_jax into the kernel's environment")
    return notebook


# What the kernel runs after the notebook in install_uploaded: posenc_jax imports from the kernel's own
# environment (not from a checkout) and computes.
AFTER_UPLOADED_INSTALL = """\
import sys

import jax.numpy as jnp
import posenc_jax
from posenc_jax.functional import RoPE, dot_product_attention

assert posenc_jax.__file__.startswith(sys.prefix), (posenc_jax.__file__, sys.prefix)
x = jnp.ones((1, 4, 2, 8))
pos = jnp.arange(4)
out = dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[RoPE()], causal=True)
print("import posenc_jax", posenc_jax.__version__, "from", posenc_jax.__file__, "; attention", out.shape)"""


def install_uploaded(
    wheel: pathlib.Path, stem: str | None = "quickstart", *, python: pathlib.Path | None = None, timeout: int = 900
) -> str:
    """Runs ``colabs/<stem>.ipynb`` as a Colab user who uploaded it with ``wheel`` does; returns what it printed.

    A fresh kernel (of ``python``'s environment, default a new one from :func:`kernel_python`) in a folder
    holding only ``wheel``, no ``POSENC_JAX_SOURCE``, and the install cell without a repository URL (as it
    is while pyproject.toml names none; when it names one, the cell installs from the repository first and
    this path is the fallback): the install cell finds the wheel and installs it with its dependencies from
    the package index pip is configured with; every cell of the notebook then runs, at the tests' size
    (``POSENC_JAX_TINY=1``), and a last cell checks that posenc_jax imports from the kernel's environment.
    With ``stem=None`` the notebook is the install cell alone, then that check.
    """
    import nbformat

    if stem is None:
        notebook = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        notebook["cells"].append({"cell_type": "code", "id": INSTALL_CELL_ID, "metadata": {}, "outputs": []})
        notebook["cells"][0]["execution_count"] = None
    else:
        notebook = json.loads((COLABS / f"{stem}.ipynb").read_text())
    next(cell for cell in notebook["cells"] if cell.get("id") == INSTALL_CELL_ID)["source"] = install_cell(None)
    notebook = nbformat.reads(json.dumps(notebook), as_version=4)  # sources as strings, as nbformat.read gives them
    notebook.cells.append(nbformat.v4.new_code_cell(AFTER_UPLOADED_INSTALL))
    executed = execute(notebook, python=python, timeout=timeout, upload=wheel, environ={"POSENC_JAX_TINY": "1"})
    outputs = [output for cell in executed["cells"] for output in cell.get("outputs", [])]
    printed = "".join(output.get("text", "") for output in outputs if output["output_type"] == "stream")
    if "import posenc_jax" not in printed:
        raise RuntimeError(f"colabs/{stem}.ipynb ran, but the kernel did not import posenc_jax: {printed!r}")
    return printed


def save_executed(path: pathlib.Path, notebook: dict) -> None:
    """Writes an executed notebook; the install cell's pip log (machine-specific) is not kept."""
    notebook = json.loads(json.dumps(notebook))
    for cell in notebook["cells"]:
        if cell.get("id") == INSTALL_CELL_ID:
            cell["outputs"] = []
        cell.get("metadata", {}).pop("execution", None)
    path.write_text(dumps(notebook))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any file is out of step, change nothing")
    parser.add_argument(
        "--execute",
        nargs="*",
        metavar="STEM",
        help="run these notebooks (default all) top to bottom and save their outputs",
    )
    parser.add_argument(
        "--here",
        action="store_true",
        help="with --execute: the kernel runs in this interpreter's environment (a fresh one, without posenc_jax)",
    )
    parser.add_argument("--no-save", action="store_true", help="with --execute: run only, keep the saved outputs")
    parser.add_argument(
        "--install-uploaded",
        metavar="WHEEL",
        type=pathlib.Path,
        help="run the quickstart in a fresh kernel whose folder holds only this wheel (installed by its install cell)",
    )
    args = parser.parse_args(argv)
    if args.execute is not None and os.environ.get("POSENC_JAX_TINY") == "1" and not args.no_save:
        raise SystemExit(
            "POSENC_JAX_TINY=1 runs the notebooks at the test suite's size, whose numbers mean nothing: "
            "unset it to save outputs, or add --no-save"
        )
    if args.install_uploaded is not None:
        printed = install_uploaded(args.install_uploaded, python=pathlib.Path(sys.executable) if args.here else None)
        print(printed.strip().splitlines()[-1], flush=True)
        return 0
    changed = {} if args.no_save else out_of_step()
    if args.check:
        for path in changed:
            print(f"{path.relative_to(ROOT)} is out of step with pyproject.toml: run python tools/sync_notebooks.py")
        return 1 if changed else 0
    for path, text in changed.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    if args.execute is not None:
        stems = args.execute or [n.stem for n in NOTEBOOKS]
        unknown = sorted(set(stems) - {n.stem for n in NOTEBOOKS})
        if unknown:
            raise SystemExit(f"unknown notebooks {unknown}; notebooks: {', '.join(n.stem for n in NOTEBOOKS)}")
        for stem in stems:
            path = COLABS / f"{stem}.ipynb"
            print(f"running {path.relative_to(ROOT)} ...", flush=True)
            executed = execute(path, python=pathlib.Path(sys.executable) if args.here else None)
            if args.no_save:
                print(f"{path.relative_to(ROOT)} ran top to bottom", flush=True)
            else:
                save_executed(path, executed)
                print(f"saved the outputs of {path.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
