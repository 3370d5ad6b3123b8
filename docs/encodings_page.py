"""MkDocs hooks: the encodings page from the registry, sectioned API pages, and checks of the built site.

An API page may group its entries under ``## `` section headings (``api/functional.md`` does: the
attention, then one section per encoding family, the contract for adding an encoding last). An
entry (``::: posenc_jax.functional.RoPE``) under such a heading is rendered one level down, under its
short name, so that each section holds its entries in the page's table of contents, and the section
opens with a list of its entries and their one-line summaries (``section_markdown``).

The checks (``on_post_build``): every public name has its API entry, no Sphinx role
(``:func:`name```) is left literal in a page, and every cross-reference link points to an
anchor that its page has.
"""

from __future__ import annotations

import functools
import html
import importlib
import inspect
import pathlib
import posixpath
import re

import griffe
from griffe_extensions import ROLES, rewrite_roles  # docs/ is on sys.path while MkDocs loads this hook

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The modules whose ``__all__`` the API pages cover; the build fails if a name lacks its entry.
API_PAGES = {
    "api/functional/index.html": ["posenc_jax.functional"],
    "api/nn/index.html": ["posenc_jax.nn"],
    "api/hf/index.html": ["posenc_jax.hf"],
    "api/training/index.html": ["posenc_jax.training", "posenc_jax.generation"],
    "api/checkpoint/index.html": ["posenc_jax.checkpoint"],
    "api/linen/index.html": ["posenc_jax.linen"],
    "api/reference/index.html": ["posenc_jax.reference"],
    "api/tasks/index.html": ["posenc_jax.bench.tasks"],
    "api/bench/index.html": [
        "posenc_jax.bench",
        "posenc_jax.bench.results",
        "posenc_jax.bench.stats",
        "posenc_jax.bench.baselines",
        "posenc_jax.bench.ngram",
    ],
}
# A Sphinx role left as text: ``:func:`name``` in a code block, ``:func:<code>name</code>`` after Markdown, or
# ``func:<code>name</code>`` where a Returns or Raises entry's first colon was taken for its type's.
LITERAL_ROLE = re.compile(rf"(?<![\w-])(?::?py)?:?(?:{ROLES}):(?:`[^`\n]*`?|<code>.*?</code>)")
# Packages whose modules' own ``__all__`` names not exported by the package go on the helpers page.
HELPER_PACKAGES = ("posenc_jax.functional", "posenc_jax.nn")


def _helper_names() -> list[str]:
    """``module.name`` of every name in a module's ``__all__`` that its package does not export."""
    import pkgutil

    names = []
    for package_name in HELPER_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package_name}.{info.name}")
            names += [f"{module.__name__}.{n}" for n in getattr(module, "__all__", []) if n not in package.__all__]
    return names


@functools.cache
def _griffe_modules() -> griffe.ModulesCollection:
    return griffe.load("posenc_jax", search_paths=[str(ROOT)]).modules_collection


def _definition_markdown(module) -> list[str]:
    """The module's docstring as a Markdown block quote, its Sphinx roles cross-references."""
    text = rewrite_roles(inspect.cleandoc(module.__doc__ or "").strip(), _griffe_modules()[module.__name__])
    text = re.sub(r"(\S)::\n\n", r"\1:\n\n", text)  # reStructuredText's "text::" before a literal block
    return [f"> {line}".rstrip() for line in text.splitlines()]


def _encodings_markdown() -> str:
    from posenc_jax.functional import encoding_info, encoding_names
    from posenc_jax.functional.core.registry import _entry

    parts = []
    for name in encoding_names():
        info = encoding_info(name)
        config_type = _entry(name).config_type
        module = inspect.getmodule(config_type)
        if name.startswith("rope-") and config_type.__name__ == "RoPE":  # a RoPE scaling: defined there
            module = importlib.import_module("posenc_jax.functional.encodings.rope_scaling")
        source = info.source
        arxiv = f" [arXiv:{source.arxiv}](https://arxiv.org/abs/{source.arxiv})" if source.arxiv else ""
        settings = ", ".join(f"`{s}`" + (" (required)" if s in info.required else "") for s in info.settings)
        parts += [
            f"## `{name}`",
            "",
            info.description,
            "",
            "| | |",
            "|---|---|",
            f"| acts on | `{info.acts_on}` |",
            f"| hooks | {', '.join(f'`{h}`' for h in info.hooks) or 'none'} |",
            f"| forms | {', '.join(info.forms)} |",
            f"| KV cache | {'exact' if info.kv_cache else 'no'} |",
            f"| length-dependent | {'yes' if info.length_dependent else 'no'} |",
            f"| config | `{config_type.__module__}.{config_type.__qualname__}` |",
            f"| settings | {settings or 'none'} |",
            f"| source | {source.authors.replace(' and ', ', ')} ({source.year}), *{source.title}*.{arxiv} |",
            "",
            "**Definition** (from `" + module.__name__ + "`):",
            "",
            *_definition_markdown(module),
            "",
            "**BibTeX**:",
            "",
            "```bibtex",
            source.bibtex,
            "```",
            "",
        ]
    return "\n".join(parts)


def _summary(identifier: str) -> str:
    """The first sentence of the docstring of the object ``identifier`` names, its Sphinx roles links."""
    obj = _griffe_modules()[identifier]
    text = obj.docstring.value if obj.docstring is not None else ""
    if not text:  # an instance (``softmax_weights = Softmax()``): its class's docstring
        module_name, _, name = identifier.rpartition(".")
        value = getattr(importlib.import_module(module_name), name)
        if type(value).__module__.startswith("posenc_jax."):
            text = inspect.getdoc(type(value)) or ""
    paragraph = inspect.cleandoc(text).split("\n\n")[0].replace("\n", " ").strip()
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", paragraph, maxsplit=1)[0]  # its first sentence
    return rewrite_roles(first, obj.parent if obj.parent is not None else obj)


SECTION_ENTRY = re.compile(r"^::: (posenc_jax(?:\.\w+)+)\s*$")


def section_markdown(markdown: str) -> str:
    """``markdown`` with the entries under each ``## `` heading one level down and listed at the section's start.

    An entry with options of its own (indented lines after it), and an entry that is a whole module
    (``::: posenc_jax.hf`` below the hf page's tables), are left as they are.
    """
    lines = markdown.split("\n")
    sections = []  # [index of the "## " line, [(index, identifier), ...]]
    for i, line in enumerate(lines):
        if line.startswith("## "):
            sections.append((i, []))
        match = SECTION_ENTRY.match(line)
        own_options = i + 1 < len(lines) and lines[i + 1].startswith(" ")
        if match and sections and not own_options and not _griffe_modules()[match[1]].is_module:
            sections[-1][1].append((i, match[1]))
    replace = {}
    for start, entries in sections:
        if not entries:
            continue
        replace[start] = [f"{lines[start]} {{ .api-section }}"]  # set apart by docs/site/css/api.css
        listing = []
        for _, ident in entries:
            summary = _summary(ident)
            listing.append(f"- [`{ident.rpartition('.')[2]}`][{ident}]" + (f": {summary}" if summary else ""))
        for n, (i, ident) in enumerate(entries):
            entry = [f"::: {ident}", "    options:", "      heading_level: 3", "      show_root_full_path: false"]
            replace[i] = ([*listing, ""] if n == 0 else []) + entry
    out = []
    for i, line in enumerate(lines):
        out += replace.get(i, [line])
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("api/"):
        markdown = section_markdown(markdown)
    if page.file.src_uri == "encodings.md":
        return markdown.replace("<!-- encodings -->", _encodings_markdown())
    if page.file.src_uri == "api/helpers.md":
        return markdown.replace("<!-- helpers -->", "\n\n".join(f"::: {name}" for name in _helper_names()))
    return markdown


def on_post_build(config):
    site = pathlib.Path(config["site_dir"])
    missing = []
    for page, modules in API_PAGES.items():
        text = html.unescape((site / page).read_text())
        for module_name in modules:
            module = importlib.import_module(module_name)
            for name in module.__all__:
                if f'id="{module_name}.{name}"' not in text:
                    missing.append(f"{module_name}.{name} (on {page})")
    helpers = html.unescape((site / "api/helpers/index.html").read_text())
    missing += [f"{name} (on api/helpers/index.html)" for name in _helper_names() if f'id="{name}"' not in helpers]
    if missing:
        raise SystemExit(
            f"public names without an API entry: {', '.join(missing)}; add `::: module.name` for each to its page's "
            "source (docs/site/api/<page>.md), under the section it belongs to"
        )
    pages = {path.relative_to(site).as_posix(): path.read_text() for path in sorted(site.rglob("*.html"))}
    roles = [f"{page}: {m[0]}" for page, text in pages.items() for m in LITERAL_ROLE.finditer(html.unescape(text))]
    if roles:
        raise SystemExit(f"Sphinx roles left literal ({len(roles)}):\n" + "\n".join(roles))
    broken = _broken_links(pages)
    if broken:
        raise SystemExit(f"cross-reference links to no anchor ({len(broken)}):\n" + "\n".join(broken))


def _broken_links(pages: dict[str, str]) -> list[str]:
    """``page: href`` of each autorefs link whose target page lacks the anchor (or does not exist)."""
    ids = {page: {html.unescape(i) for i in re.findall(r'\sid="([^"]+)"', text)} for page, text in pages.items()}
    broken = []
    for page, text in pages.items():
        for href in re.findall(r'<a class="autorefs autorefs-internal"[^>]*\shref="([^"]+)"', text):
            path, _, anchor = html.unescape(href).partition("#")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) if path else page
            if not target.endswith(".html"):
                target = posixpath.join(target, "index.html")
            if target not in ids or (anchor and anchor not in ids[target]):
                broken.append(f"{page}: {href}")
    return broken
