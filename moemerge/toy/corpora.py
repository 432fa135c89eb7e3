"""Domain text that every machine has, for training toy experts offline.

- `code`:  CPython stdlib sources with docstrings and comments stripped (`ast.unparse`).
- `prose`: stdlib docstrings (module, class, function) plus the pydoc topic texts.
- `math`:  worked arithmetic / algebra problems in English, generated from a seeded RNG.
- `cpp`:   C++ headers under torch/include, when torch is installed (not a default domain).

The held-out domains, which no default was chosen on (benchmarks/quality/heldout.py):
- `stubs`:    type stubs (.pyi) of the installed packages (numpy, torch...): signatures, no bodies.
- `markdown`: the long descriptions (READMEs) in the installed packages' METADATA files.
- `tests`:    the stdlib's own unit tests (Lib/test), which `code` leaves out.

Train and eval text come from disjoint documents: a document (a source file, a pydoc topic) goes
to eval when a stable hash of its name says so, so the split never depends on what else exists.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import random
import re
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from functools import cache
from pathlib import Path

DOMAINS = ("code", "prose", "math")
KNOWN_DOMAINS = ("code", "prose", "math", "cpp", "stubs", "markdown", "tests")
HELD_OUT_DOMAINS = ("stubs", "markdown", "tests")
SPLITS = ("train", "eval")
EVAL_PERCENT = 10  # share of documents held out for eval
MAX_DOC_CHARS = 20_000  # cap one document's share so a few huge files cannot dominate a domain
SEPARATOR = "\n\n\n"
_SKIP_DIRS = set(
    "test tests idlelib tkinter site-packages lib2to3 turtledemo ensurepip encodings".split()
)


def _is_eval(name: str) -> bool:
    return zlib.crc32(name.encode()) % 100 < EVAL_PERCENT


@cache
def stdlib_files() -> tuple[Path, ...]:
    """Sorted stdlib .py files outside tests, GUIs and vendored packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts))
    return tuple(sorted(files))


@cache
def stdlib_test_files() -> tuple[Path, ...]:
    """Sorted .py files of the stdlib's test package (Lib/test), its own data files left out."""
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    return tuple(sorted(p for p in root.rglob("test_*.py"))) if root.is_dir() else ()


def _site_packages() -> list[Path]:
    return sorted({Path(p) for p in sysconfig.get_paths().values()
                   if Path(p).name == "site-packages" and Path(p).is_dir()})


def _stub_files() -> list[str]:
    return sorted(str(p) for root in _site_packages() for p in root.rglob("*.pyi"))


def _metadata_files() -> list[str]:
    return sorted(str(p) for root in _site_packages() for p in root.glob("*.dist-info/METADATA"))


def _readme(path: str) -> str:
    """The long description of a METADATA file: what follows its header block."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return text.partition("\n\n")[2].strip()


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return None  # a few stdlib files are deliberately broken or not utf-8


def _has_docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", None)
    return bool(
        isinstance(body, list)
        and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def strip_docstrings(tree: ast.Module) -> str:
    """Source of `tree` without docstrings; comments are already gone after parsing."""
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES) and _has_docstring(node):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def docstrings(tree: ast.Module) -> list[str]:
    """Module, class and function docstrings, cleaned of indentation, in source order."""
    found = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, _DOC_NODES))
    return [d.strip() for d in found if d and d.strip()]


def _code_doc(path: Path) -> str:
    tree = _parse(path)
    return strip_docstrings(tree) if tree else ""


def _prose_doc(key: str) -> str:
    if key.startswith("pydoc:"):
        from pydoc_data.topics import topics

        return topics[key.removeprefix("pydoc:")].strip()
    tree = _parse(Path(key))
    return "\n\n".join(docstrings(tree)) if tree else ""


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _cpp_doc(path: str) -> str:
    text = _COMMENTS.sub("", Path(path).read_text(encoding="utf-8", errors="replace"))
    return re.sub(r"\n\s*\n+", "\n", text).strip()


def _cpp_files() -> list[str]:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return []
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    return sorted(str(p) for p in include.rglob("*.h")) if include.is_dir() else []


def _documents(domain: str) -> tuple[list[str], Callable[[str], str]]:
    """Sorted document keys of a domain and the function that turns a key into text."""
    if domain == "code":
        return [str(p) for p in stdlib_files()], lambda k: _code_doc(Path(k))
    if domain == "prose":
        from pydoc_data.topics import topics

        keys = [str(p) for p in stdlib_files()] + [f"pydoc:{t}" for t in sorted(topics)]
        return keys, _prose_doc
    if domain == "cpp":
        return _cpp_files(), _cpp_doc
    if domain == "stubs":
        return _stub_files(), lambda k: Path(k).read_text(encoding="utf-8", errors="replace")
    if domain == "markdown":
        return _metadata_files(), _readme
    if domain == "tests":
        return [str(p) for p in stdlib_test_files()], lambda k: _code_doc(Path(k))
    raise AssertionError(domain)


def _sampled_docs(domain: str, split: str, seed: int) -> Iterator[str]:
    keys, load = _documents(domain)
    pool = [k for k in keys if _is_eval(k) == (split == "eval")]
    random.Random(f"{domain}:{split}:{seed}").shuffle(pool)
    for key in pool:
        text = load(key)[:MAX_DOC_CHARS]
        if text.strip():
            yield text


# ---- math: worked problems -------------------------------------------------------------------


def _arith(r: random.Random) -> str:
    a, b = r.randint(2, 99), r.randint(2, 99)
    op = r.choice("+-*")
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Q: What is {a} {op} {b}? A: {a} {op} {b} = {c}."


def _linear(r: random.Random) -> str:
    a, x, b = r.randint(2, 12), r.randint(-10, 20), r.randint(1, 40)
    c = a * x + b
    return (
        f"Q: Solve {a}x + {b} = {c}. A: Subtract {b} from both sides: {a}x = {c - b}. "
        f"Divide by {a}: x = {x}."
    )


def _fraction(r: random.Random) -> str:
    p, q = Fraction(r.randint(1, 9), r.randint(2, 10)), Fraction(r.randint(1, 9), r.randint(2, 10))
    d = math.lcm(p.denominator, q.denominator)
    n1, n2 = p.numerator * d // p.denominator, q.numerator * d // q.denominator
    return (
        f"Q: What is {p} + {q}? A: The common denominator is {d}. {p} = {n1}/{d} and "
        f"{q} = {n2}/{d}, so {p} + {q} = {n1 + n2}/{d}"
        + ("." if (p + q).denominator == d else f" = {p + q}.")
    )


def _percent(r: random.Random) -> str:
    p = r.choice((5, 10, 20, 25, 50, 75))
    n = r.randint(1, 20) * (100 // math.gcd(p, 100))  # so that p % of n is a whole number
    return f"Q: What is {p}% of {n}? A: {p}% of {n} = {p} / 100 * {n} = {p * n // 100}."


def _word(r: random.Random) -> str:
    who, thing = r.choice(("Sam", "Ana", "Lee", "Mia")), r.choice(("apples", "books", "coins"))
    a, b = r.randint(2, 50), r.randint(2, 50)
    return (
        f"Q: {who} has {a} {thing} and gets {b} more. How many {thing} does {who} have? "
        f"A: {a} + {b} = {a + b}. {who} has {a + b} {thing}."
    )


_PROBLEMS = (_arith, _arith, _linear, _fraction, _percent, _word)


def math_problems(rng: random.Random, per_doc: int = 8) -> Iterator[str]:
    """Endless documents of `per_doc` worked problems, one per line."""
    while True:
        yield "\n".join(rng.choice(_PROBLEMS)(rng) for _ in range(per_doc))


def domain_text(domain: str, n_chars: int, seed: int = 0, split: str = "train") -> str:
    """About `n_chars` (at most) of `domain` text from the `split` documents; deterministic."""
    if domain not in KNOWN_DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(KNOWN_DOMAINS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if domain == "math":
        docs: Iterator[str] = math_problems(random.Random(f"math:{split}:{seed}"))
    else:
        docs = _sampled_docs(domain, split, seed)
    parts, total = [], 0
    for doc in docs:
        if total >= n_chars:
            break
        parts.append(doc)
        total += len(doc) + len(SEPARATOR)
    if not parts:
        raise ValueError(f"no {split} text found for domain {domain!r} on this machine")
    return SEPARATOR.join(parts)[:n_chars]


def domain_texts(domain: str, n_train: int, n_eval: int, seed: int = 0) -> tuple[str, str]:
    """(train, eval) text of `domain`, drawn from disjoint documents."""
    return domain_text(domain, n_train, seed, "train"), domain_text(domain, n_eval, seed, "eval")
