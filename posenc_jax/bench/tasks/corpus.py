"""The text task's corpora: the pinned standard-library corpus, a file or folder of text, or a hub corpus.

The default corpus is Python source code: 78 standard-library files pinned by their SHA-256, the
same text on every interpreter that has them (:func:`stdlib_corpus`); any text file or folder
works, and so do ``wikitext103`` and ``tinyshakespeare`` from the Hugging Face hub where there
is internet (:func:`load_hub_corpus`, extra ``data``).
"""

from __future__ import annotations

import hashlib
import pathlib
import platform
import sysconfig

__all__ = [
    "HUB_CORPORA",
    "STDLIB_CORPUS_SHA256",
    "load_hub_corpus",
    "read_corpus",
    "stdlib_corpus",
    "text_from_dataset",
]

# The default text corpus, pinned: 78 standard-library files whose bytes are the same in CPython
# 3.11.2 (Debian 12), 3.11.7, 3.12.1, 3.13.0 and 3.13.5 (Debian 13), with the split each goes to
# (test: the first byte of the SHA-256 of its path below 39, about 15%). Chosen among the files
# of those versions that are identical in all five, leaving out the codecs (``encodings/``:
# tables and near-copies of one another), the test suite and the packages that distributions
# ship apart (idlelib, tkinter, turtledemo, lib2to3). Later releases change some of them (Debian's
# 3.13.18: 16 files, 3.14.10: 31): there the corpus is refused, never silently another text.
# Each line: the SHA-256 of the file, its split, its path under the standard-library directory.
_STDLIB_FILES = """
981d4c398849f9ebcab72300d9c1fe288fd6d7f28957b3b3fa3a493a5836d95c train __future__.py
a8ce70b199497950f0f06def93115a6814daf1f961934457f59046909901487f train __hello__.py
3ad5d60627477a60939ee44fc1bb3a05dbe8fb52f0f75039b8f5d8f1a278b981 train _compression.py
cb14dd6f2e2439eb70b806cd49d19911363d424c2b6b9f4b73c9c08022d47030 train _markupbase.py
f9c6fe3dd9b51bd7d93f867356e9d362600c924febfd903ee1c6e298860dca92 train _py_abc.py
b9388bc1d6d12ed6be12da420ab1feca40f99c0e33ec315d92b1e01cb69b25bc train _sitebuiltins.py
91895a451d06e9f521a1171b31b9b19bc9740f35af00d4fa106338ab7167c9ac train _weakrefset.py
8a5ee63e1b79ba2733e7ff4290b6eefea60e7f3a1ccb6bb519535aaf92b44967 test  antigravity.py
a5971f88be14cd1417d59adf539ae48c5d818f95362a4e0eb00017e3690ab37b train asyncio/exceptions.py
80e4cc3ded4b138baba486519e7444801a23d6ac35f229d336a407a96af7e8d2 train asyncio/log.py
8f4a3e16eca845ebfba422550cbcee7340ec8166d2bff6b750a8ed0de6b9ae3c test  asyncio/mixins.py
1d1b49988c338b4ef06e30f9e92d9db2e00080c341f0a3f573bb8312deb8aff6 train asyncio/protocols.py
39d37295383641565f0c08bd992e2f661dc8051eb17e890b834fce96bde0910e train asyncio/threads.py
c0eac37debcc51b702b808f6b7ed3e417343f5ff5f57125dad600a27eb082328 train asyncio/trsock.py
e6fcffefa2521666bc2aed0f5caf8e862c1c1014ad12d2ab5fbce09c2df9c6f0 train asyncio/windows_utils.py
87ad5c8954dd56fbbca04517bf87477ff4dce575170c7dd1281d7ef1f4214ac8 train concurrent/__init__.py
5ed260be8d1f4fe92261b7810b4bb1e8539c42093d7493f677d076e1a87f459a train contextvars.py
d8730e360dd00ec046bdd85cae41fe83c907c6ae3716a964158fce8f31ab28b0 train curses/__init__.py
15a052812d9ae80124bb25b3f5b9ffae38e2b03073774e163abf3d773140cfb3 train curses/has_key.py
13ef404a30da1825a612ca3e453db88c305d45deef4441c4c9e2ef7ee0ef50c7 train curses/panel.py
4178321600c0a19ca04cfe8542ce44487f339d15d89a473b58cea63c0b230217 test  email/_encoded_words.py
2d81026aef17e4786b15d9ec0629304987e3f275a0fd0a421a81b4ed87234b2c test  email/contentmanager.py
fada56c25b6a457c6a62af43f9f929bbc29424103ce65f40f114adb4fdf3d39f train email/headerregistry.py
b82a944ccba03e7e7eec46232e50ffe4ce2c32f4b0e26662e6bde30d533584ae train email/mime/application.py
460be5b50cfcaab8e72a73f24f14ab062cedf1a40a775b8b0d80c13aed44bb5e train email/mime/image.py
77b454bd3ba3b5e3776be28ae3a0fd8de5d1e50d5b8ee10dd539c37c2bd68082 test  email/quoprimime.py
6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9 train heapq.py
089d0e4c21c88d6034648552e2fa0e440b27d91e11d9c40112d3ec6442690126 test  importlib/metadata/_collections.py
3ec636fb8aeb297e1155e442d681a9d65075a660bd78a37cf3f7fe6c3f6e3a80 train importlib/metadata/_functools.py
72faffdaff0145bc5c225e71e6575fa9d1e3848f188bcb3cca4e741bf9e6ea34 train importlib/metadata/_itertools.py
1c2b0592c66924b7933f734493f9e0ac079755146d4ebb7287d78e001a113f80 train importlib/metadata/_text.py
d0d57d118d64916f7e6edb04f8bd1a760a1abb879125899ef50a36d09ef54df4 train importlib/readers.py
8e687aeeb1db537d2717cb0352c5f126ff7d4095c6de6dc7f00d5103f3009c40 train importlib/simple.py
d5d41e2c29049515d295d81a6d40b4890fbec8d8482cfb401630f8ef2f77e4d5 train json/__init__.py
a5a42976033c7d63ee2740acceef949a3582dcb0e0442845f9717e1be771c68b train multiprocessing/__init__.py
9127a40ea0ff342cb414383b5e7c594a05be2dd835fe246bd3bb0dc036a32a90 train multiprocessing/dummy/__init__.py
d63dd1979fde9c133efe430ee870e6ba6de43c0a0513866ce3ce475791fe57ab train multiprocessing/dummy/connection.py
f6bb79bb99b9ae484935f0d68822e9603a1622dd0b6c4966c79db232a93ba614 train multiprocessing/heap.py
0588ad0e5a36718b4377dc2a2a97864a10986c25a33dc3bfed12595711b0cdab test  multiprocessing/popen_forkserver.py
97b5d25aa479516894489877e6a7921252ee35f51e118c2f1f91f32919e7caa8 test  multiprocessing/popen_spawn_posix.py
4999f8b9ae7b3e8a7f5de302612b4131498dc2e238a2c47f894905c1c63294fe test  multiprocessing/reduction.py
77ef522912474652490b7df523112858e51721e63dcf109b8567a35ce9b31b0d test  multiprocessing/sharedctypes.py
07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5 train optparse.py
e8ca09333701ba41244e20b8c2c37b7ed0499b88c4b2ca82cac51ef89ca9e647 test  pyclbr.py
f7fd87f8ac9dad7d1387e2401761ec05806c5108201a6d1ede6ab2f481f6df54 train sre_compile.py
87013dc0b349c2c044100f70a8daa9d713e60a527e26f6ab8ee1fc978a6d3234 train sre_constants.py
c4929134532306081918f185c99305c6f55213bc16b32f8c259bc60f7f81e810 train sre_parse.py
24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9 train string.py
60b6c83581093029312efb6670b11c540090b3f78bcf72264467b494f02f21a5 train stringprep.py
9c231f9497caf513a22dee8f790b07f969b0e45854a0bdd6dd84b492e08c2856 train struct.py
481d0cb3de511eae0b5713dad18542b07eafd9c013bb7690f7497bad49923a71 train this.py
71f67036895f4c5acab942618af0cbd3d814451ba61e967f358d0f341a5b8f51 test  tomllib/__init__.py
f864c6d9552a929c7032ace654ee05ef26ca75d21b027b801d77e65907138b74 train tomllib/_types.py
c2cc84a05b824df79840c98729a0e94ef8909b11c528a1b2c5a00aa436b97b25 train tracemalloc.py
ff6b9a100d32001715b40d61bc4d613623b139edb1fdc3566427b83c331caae3 test  unittest/__main__.py
905672317ab26c656c600defce25d477728068f597f00a7f94e22e8128c323b9 train unittest/_log.py
f8286e818ca56e10e03745bc056cdfd31147678f9a1dc8cb6b0fe96ef9a4362a test  unittest/signals.py
ed2da92bc9f97c53403ee2d3d12cc53b16a96e85d596ebc887b5a93458f3f6bc train unittest/suite.py
fdcc640c3505d16deab9c32eae7c3f5f67c3b5e81c563dc6698fa7fcf403854d train unittest/util.py
7e6c3b6d7a95f0d74f5968f51a87adae8a51bf42390cdfec98c7a99203e7bb76 train urllib/response.py
56f8d313fb74019e53eb9287400702fbce788b7fe30e097b0b6e06296f3f080c train weakref.py
c30e144025a63d267778d92f2f066fa592b476e789d888f79b96c059bf0bef60 test  wsgiref/__init__.py
ba66d30ce511a88eba9b809616c51e12bf89c67972102e7d976b18557f7a6387 train wsgiref/types.py
34296f728e7fe68cccb97a9f6edbf3bf3a686f44044c744fe85f207a92ed4811 test  xml/__init__.py
9bfacbbb64e239a75591a7260b3ed86748eeb4366e6c40f3542753e79bace9a7 train xml/dom/NodeFilter.py
b415a6f3d3663c3ac332ee4a0f4213eadad9281508dc97410e258a03633b063a train xml/dom/__init__.py
826b02a803930834b96b1086cbee7db1d21c684f65dd3073706dc7bb5ba1a3e8 train xml/dom/domreg.py
42974c4c67803dfe80b016ff8aeea0d1e5c751703ab3aec5be765f4e534367be train xml/dom/minicompat.py
614b88673d496a360e6b10efe8d733c7c0826fb214470ff12f24a1e597699870 train xml/dom/pulldom.py
91950edfb196c105d93886f8af7ea3c0a79e06a6b63be3e5a4ea09804e8672a6 train xml/etree/__init__.py
d0f57acab07fe4f9c116c3392d85946bac8e78608f409cea70005f16ea019b57 train xml/etree/cElementTree.py
b88497adc30d5d5eda7789c25a2206ee9270c932d584d7ac42680325651da45c train xml/parsers/__init__.py
64e1947747c2874117a7458bba1f07c86620cc0ed9a4a4116d262878e4a2aa09 train xml/parsers/expat.py
64c7aae49f1dd382a7b9012610307bfa1d43a14a5dc09a5c8da30903f6805c3d train xml/sax/handler.py
3fe2cdb6386e0c4d42d37c657bbecb78b69c57aedb1610dbd8bf4043944130ab train xml/sax/saxutils.py
87ad5c8954dd56fbbca04517bf87477ff4dce575170c7dd1281d7ef1f4214ac8 test  xmlrpc/__init__.py
ac7fb403e4371d07482ef2fda81dbcf6879484e9fc41d4be42c156d7e54c68a8 test  zoneinfo/__init__.py
67deaf0ba41aa4865e007297677207485a89b75629eea0ee5c472be8a3e83bf6 train zoneinfo/_common.py
"""

# The SHA-256 of the pinned corpus as the model sees it (:attr:`~posenc_jax.bench.tasks.TextTask.sha256`), which the
# presets hold in ``text_corpus_sha256``.
STDLIB_CORPUS_SHA256 = "a76a9fbf1a5ff478946f90e71ca84bfcd28e734247e4fe7b053365b8c19d14cf"


def _pinned_files() -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in _STDLIB_FILES.strip().splitlines()]


def stdlib_corpus(root: str | pathlib.Path | None = None) -> tuple[str, str, list[str]]:
    """The default text corpus: 78 pinned standard-library ``.py`` files, the same text everywhere.

    The files, their split and the SHA-256 of each are fixed in this module (``_STDLIB_FILES``):
    Python source chosen among the files identical in CPython 3.11.2, 3.11.7, 3.12.1, 3.13.0 and
    3.13.5, about 434,000 characters, 15% of them in the test split. They are read from the
    standard library of the running interpreter (``sysconfig.get_paths()["stdlib"]``) or from
    ``root``, and refused if any differs from its pinned hash: every machine trains and tests on
    the same text, or on none. Each split is its files in path order, one blank line apart (the
    model reads them as ASCII: :class:`TextTask` turns any other character into ``?``).

    Returns:
      ``(train_text, test_text, test_paths)``.

    Raises:
      ValueError: naming the files that are missing or differ, and the fix.

    Example:
      >>> train, test, paths = stdlib_corpus()
      >>> paths[:2], len(test) > 65_536
      (['antigravity.py', 'asyncio/mixins.py'], True)
    """
    here = root is None
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if here else root)
    texts: dict[str, list[str]] = {"train": [], "test": []}
    test_paths, missing, changed = [], [], []
    for sha256, split, path in _pinned_files():
        try:
            data = (root / path).read_bytes()
        except OSError:
            missing.append(path)
            continue
        if hashlib.sha256(data).hexdigest() != sha256:
            changed.append(path)
            continue
        texts[split].append(data.decode("utf-8", errors="replace"))
        if split == "test":
            test_paths.append(path)
    if missing or changed:
        where = f"{root} (Python {platform.python_version()})" if here else str(root)
        bad = missing + changed
        names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(
            f"the pinned text corpus needs {len(_pinned_files())} standard-library files as CPython 3.11 to 3.13.5 "
            f"ship them, but in {where} {len(missing)} are missing and {len(changed)} differ ({names}); run the "
            "text task under such an interpreter, or pass a corpus of your own: --corpus PATH"
        )
    return "\n\n".join(texts["train"]), "\n\n".join(texts["test"]), test_paths


# Corpora on the Hugging Face hub, loaded through the optional `datasets` package (extra "data").
HUB_CORPORA = {
    "wikitext103": {"path": "Salesforce/wikitext", "name": "wikitext-103-raw-v1"},
    "tinyshakespeare": {"path": "karpathy/tiny_shakespeare", "name": None},
}


def text_from_dataset(dataset, field: str = "text") -> tuple[str, str]:
    """``(train_text, test_text)`` from a ``datasets.DatasetDict`` with ``train`` and ``test``
    (or ``validation``) splits, joining the ``field`` of every record with newlines."""
    test_split = "test" if "test" in dataset else "validation"
    if "train" not in dataset or test_split not in dataset:
        raise ValueError(f"the dataset needs a train and a test (or validation) split, got {list(dataset)}")
    return "\n".join(dataset["train"][field]), "\n".join(dataset[test_split][field])


def load_hub_corpus(name: str, **load_kwargs) -> tuple[str, str]:
    """WikiText-103 (raw) or Tiny Shakespeare from the Hugging Face hub, as train/test text.

    Needs ``pip install -e ".[data]"`` and internet; ``load_kwargs`` go to
    ``datasets.load_dataset`` (e.g. ``cache_dir``).
    """
    if name not in HUB_CORPORA:
        raise ValueError(f"unknown hub corpus {name!r}; known: {', '.join(HUB_CORPORA)}")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--corpus {name} needs the datasets package: pip install -e '.[data]'") from None
    spec = HUB_CORPORA[name]
    try:
        dataset = datasets.load_dataset(spec["path"], spec["name"], **load_kwargs)
    except OSError as error:  # what datasets raises offline: ConnectionError, or a hub file not found
        raise ValueError(
            f"--corpus {name}: could not load {name} ({spec['path']}) from the Hugging Face hub "
            f"({type(error).__name__}: {error}); check the network, or download the text where there is one "
            f"and pass the file or folder instead: --corpus PATH"
        ) from None
    return text_from_dataset(dataset)


def _corpus_file_text(file: pathlib.Path, given: pathlib.Path) -> str:
    """The text of one file of the corpus ``given`` (``--corpus``), read as UTF-8 strictly: a byte
    that is not UTF-8, or a NUL (UTF-16 text, a binary file), is a ValueError naming the file and
    the offset of the first such byte, never characters made up in its place."""
    name = f"--corpus {file}" if file == given else f"--corpus {given}: {file}"
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(
            f"{name} cannot be read ({error.strerror or error}); check the file and its permissions"
        ) from None
    try:
        text = data.decode("utf-8")
        bad = None
    except UnicodeDecodeError as error:
        bad = error.start
    nul = data.find(b"\0")
    if nul >= 0 and (bad is None or nul < bad):
        bad = nul
    if bad is None:
        return text
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or data.count(b"\0") * 4 >= len(data):
        why, fix = "UTF-16, by its byte-order mark or its NUL bytes", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"
    elif data[bad] == 0:
        why, fix = "a NUL byte, which text does not hold: a binary file?", "remove it"
    else:
        why, fix = "another encoding, such as Latin-1, or not text", "convert it to UTF-8 (iconv -f LATIN1 -t UTF-8)"
    raise ValueError(
        f"{name} is not UTF-8 text: byte {bad} is 0x{data[bad]:02x} ({why}); {fix}, or pass another --corpus"
    )


def read_corpus(path) -> tuple[str, str]:
    if str(path) in HUB_CORPORA:
        return load_hub_corpus(str(path))
    path = pathlib.Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        texts = [_corpus_file_text(p, path) for p in files]
        if not any(texts):
            raise ValueError(
                f"--corpus {path} holds no text (none of its {len(files)} files holds any); pass a folder of text files"
            )
        cut = max(1, int(len(texts) * 0.9)) if len(texts) > 1 else 1
        if len(texts) > 1:
            return "\n\n".join(texts[:cut]), "\n\n".join(texts[cut:])
        text = texts[0]
    elif path.is_file():
        text = _corpus_file_text(path, path)
        if not text:
            raise ValueError(f"--corpus {path} is empty; pass a file that holds text")
    else:
        raise ValueError(f"--corpus {path} is neither a file nor a folder")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]
