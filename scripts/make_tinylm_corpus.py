"""Write the tiny language model's corpus: English prose from the docstrings of Python's standard library.

The text is the standard library's own documentation (Python Software Foundation License),
so it ships with surgery license-clean and needs no download. The corpus depends on the
Python version that makes it; the shipped file was made once and is what the checkpoint and
the figures were trained and measured on.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import re
from pathlib import Path

MODULES = (
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bz2",
    "calendar",
    "codecs",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "email.message",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "mimetypes",
    "multiprocessing",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "pydoc",
    "queue",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "subprocess",
    "sysconfig",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "tracemalloc",
    "typing",
    "unittest",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xmlrpc.client",
    "zipfile",
    "zipimport",
)
OUT = Path(__file__).resolve().parents[1] / "surgery" / "assets" / "tinylm_corpus.txt.gz"


def docstrings(module_name: str) -> list[str]:
    """The docstrings of a module and of its public classes, functions and methods, in order."""
    module = importlib.import_module(module_name)
    found = [inspect.getdoc(module) or ""]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        found.append(inspect.getdoc(member) or "")
        if inspect.isclass(member):
            found += [
                inspect.getdoc(m) or ""
                for n, m in sorted(vars(member).items())
                if not n.startswith("_") and callable(m)
            ]
    return found


def clean(text: str) -> str:
    """Prose only: ASCII, no doctest lines, single spaces."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith((">>>", "..."))]
    text = " ".join(lines).encode("ascii", "ignore").decode()
    return re.sub(r"\s+", " ", text).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    seen, paragraphs = set(), []
    for name in MODULES:
        for doc in docstrings(name):
            paragraph = clean(doc)
            if len(paragraph) >= 80 and paragraph not in seen:
                seen.add(paragraph)
                paragraphs.append(paragraph)
    text = "\n".join(paragraphs) + "\n"
    with gzip.open(args.out, "wt", encoding="ascii", compresslevel=9) as handle:
        handle.write(text)
    print(f"wrote {args.out}: {len(paragraphs)} paragraphs, {len(text):,} characters")


if __name__ == "__main__":
    main()
