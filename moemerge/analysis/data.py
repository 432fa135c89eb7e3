"""Per-domain evaluation text for `moemerge inspect --data`: {domain: text} from the CLI's specs.

A spec is one of
- `name=path`: the domain `name` is the file's text (a .jsonl file: its records' text fields);
- a directory: every `*.txt` / `*.jsonl` file in it is a domain named by the file's stem;
- a `.jsonl` file: one domain per value of `label_field`, its records' `text_field` joined.
Records and files are joined with a blank line. Every problem names the file (RecipeError, exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from moemerge.errors import RecipeError

_SEP = "\n\n"  # between records of a domain: a document boundary the tokenizer sees as such


def _records(path: Path, text_field: str) -> list[dict]:
    """The JSON objects of a JSONL file (blank lines skipped), each checked for `text_field`."""
    records = []
    for number, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise RecipeError(f"{path}:{number}: the JSON is nested too deeply") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise RecipeError(f"{path}:{number}: no string field {text_field!r} in this record")
        records.append(record)
    return records


def _read(path: Path) -> str:
    if not path.is_file():
        raise RecipeError(f"--data: {path}: file not found")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"--data: {path}: cannot read it as UTF-8 text: {exc}") from None


def _file_text(path: Path, text_field: str) -> str:
    if path.suffix == ".jsonl":
        return _SEP.join(r[text_field] for r in _records(path, text_field))
    return _read(path)


def _labelled(path: Path, label_field: str, text_field: str) -> dict[str, str]:
    groups: dict[str, list[str]] = {}
    for number, record in enumerate(_records(path, text_field), 1):
        if label_field not in record:
            raise RecipeError(f"{path}: record {number} has no label field {label_field!r} "
                              "(choose it with --label-field)")
        groups.setdefault(str(record[label_field]), []).append(record[text_field])
    return {label: _SEP.join(texts) for label, texts in groups.items()}


def load_domain_texts(
    specs: Iterable[str], *, label_field: str = "domain", text_field: str = "text"
) -> dict[str, str]:
    """{domain: text} from `--data` values, in the order given; a domain may appear once."""
    texts: dict[str, tuple[str, Path]] = {}  # domain -> (text, where it came from)

    def add(domain: str, text: str, source: Path) -> None:
        if domain in texts:
            raise RecipeError(f"--data: domain {domain!r} given twice ({texts[domain][1]}, "
                              f"{source})")
        if not text.strip():
            raise RecipeError(f"--data: {source}: domain {domain!r} has no text")
        texts[domain] = (text, source)

    for spec in specs:
        name, sep, where = spec.partition("=")
        if sep and name and not Path(spec).exists():  # `name=path` (unless a file has that name)
            path = Path(where)
            add(name, _file_text(path, text_field), path)
            continue
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl"))
            if not files:
                raise RecipeError(f"--data: {path}: no *.txt or *.jsonl files in this directory")
            for file in files:
                add(file.stem, _file_text(file, text_field), file)
        elif path.suffix == ".jsonl":
            for domain, text in _labelled(path, label_field, text_field).items():
                add(domain, text, path)
        elif path.exists():
            raise RecipeError(f"--data: {path}: give NAME={path}, a directory of *.txt files, "
                              "or a .jsonl file with a label field")
        else:
            raise RecipeError(f"--data: {path}: file not found")
    if not texts:
        raise RecipeError("--data: no domains given")
    return {domain: text for domain, (text, _) in texts.items()}
