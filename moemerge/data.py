"""Text in: what every `--data`-like argument means (finetune, inspect --data, route, build
--tune-on), read one way everywhere. docs/data.md is the user-facing statement of these rules.

A spec is one of
- a text file (.txt, .md, .text): one document, domain = the file's stem;
- a JSON Lines file (.jsonl, .json): one document per record (its `text_field`); when every
  record has `label_field` the file splits into one domain per label, when none has it the file
  is one domain named by its stem;
- a directory: every such file under it (recursively, in sorted order), each as above;
- a directory written by `datasets`' `save_to_disk`, or a hub dataset id `org/name` (needs the
  `datasets` package): its train split (or its only one) is the domain, a validation/test split
  its held-out part;
- `name=SPEC`: everything SPEC holds is the one domain `name`.
A file named `<domain>.<split>.<ext>` with split `train` belongs to `<domain>`; with split
`eval`, `valid`, `validation`, `test` or `heldout` it is that domain's held-out part (what
finetune evaluates on and inspect/--tune-on read), never trained on. Files that give the same
domain are one domain, their documents in order. Every problem is a RecipeError naming the
file (and line).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moemerge.errors import RecipeError
from moemerge.io import jsontext
from moemerge.io.resolve import looks_like_path

TEXT_SUFFIXES = (".txt", ".md", ".text")
RECORD_SUFFIXES = (".jsonl", ".json")
HELD_OUT_SPLITS = ("eval", "valid", "validation", "test", "heldout")
SAVED_DATASET = ("dataset_info.json", "dataset_dict.json")  # written by save_to_disk
SEP = "\n\n"  # between documents of a domain joined into one text
Split = Literal["file", "line", "paragraph"]


@dataclass
class Domain:
    """One named domain: documents to train on (or read) and a held-out part, if given."""

    name: str
    documents: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # the files / datasets it came from

    @property
    def eval_documents(self) -> list[str]:
        """What evaluation reads: the held-out part, or everything when none was given."""
        return self.held_out or self.documents


def read_domains(specs: Iterable[str], *, text_field: str = "text",
                 label_field: str = "domain", split: Split = "file",
                 what: str = "--data", near: Path | None = None) -> dict[str, Domain]:
    """{name: Domain} from the specs, in the order first seen. `split` cuts text files' documents
    further (per line or blank-line paragraph; route's prompts); `what` names the option in
    messages; a relative path that exists under `near` (a recipe's directory) is read there."""
    reader = _Reader(text_field, label_field, split, what, near)
    for spec in specs:
        reader.spec(str(spec))
    if not reader.domains:
        raise RecipeError(f"{what}: no data given")
    for domain in reader.domains.values():
        if not any(d.strip() for d in domain.documents + domain.held_out):
            raise RecipeError(f"{what}: {', '.join(domain.sources)}: domain {domain.name!r} "
                              "has no text (empty file?)")
    return reader.domains


def domain_texts(specs: Iterable[str], *, text_field: str = "text",
                 label_field: str = "domain", what: str = "--data") -> dict[str, str]:
    """{name: evaluation text}: each domain's held-out part (or all of it), documents joined."""
    domains = read_domains(specs, text_field=text_field, label_field=label_field, what=what)
    return {name: SEP.join(d.eval_documents) for name, d in domains.items()}


class _Reader:
    def __init__(self, text_field: str, label_field: str, split: Split, what: str,
                 near: Path | None):
        self.text_field, self.label_field, self.split, self.what, self.near = (
            text_field, label_field, split, what, near)
        self.domains: dict[str, Domain] = {}

    def add(self, name: str, docs: list[str], source: str, *, held_out: bool = False) -> None:
        domain = self.domains.setdefault(name, Domain(name))
        (domain.held_out if held_out else domain.documents).extend(docs)
        if source not in domain.sources:
            domain.sources.append(source)

    def spec(self, spec: str) -> None:
        name, sep, where = spec.partition("=")
        if sep and name and not self.local(spec).exists():  # `name=path` (unless a file is)
            self.source(where, label=name)
        else:
            self.source(spec, label=None)

    def local(self, ref: str) -> Path:
        """`ref` as a path: under `near` when it is relative and exists there."""
        path = Path(ref).expanduser()
        if self.near is not None and not path.is_absolute() and (self.near / path).exists():
            return self.near / path
        return path

    def looked(self, ref: str) -> str:
        """Where a relative `ref` was looked for, when that is more than one place."""
        path = Path(ref).expanduser()
        if self.near is None or path.is_absolute():
            return ""
        return (f" (looked for {self.near / path} next to the recipe and {Path.cwd() / path} "
                "in the working directory)")

    def source(self, ref: str, label: str | None) -> None:
        path = self.local(ref)
        if not path.exists():
            if "/" in ref and not looks_like_path(ref):  # org/name: a bare word is a typo
                self.dataset(ref, label, saved=False)
                return
            raise RecipeError(f"{self.what}: {ref}: no such file or directory{self.looked(ref)}")
        if path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET):
            self.dataset(str(path), label, saved=True)
            return
        if path.is_file():
            self.file(path, label, explicit=True)
            return
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and p.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES)
        if not files:
            raise RecipeError(f"{self.what}: {path}: no {', '.join(TEXT_SUFFIXES)}, "
                              f"{', '.join(RECORD_SUFFIXES)} files in this directory")
        for file in files:
            self.file(file, label, explicit=False)

    def file(self, path: Path, label: str | None, *, explicit: bool) -> None:
        stem, _, part = path.stem.rpartition(".")
        if not stem or part not in ("train", *HELD_OUT_SPLITS):
            stem, part = path.stem, "train"
        held = part in HELD_OUT_SPLITS
        if path.suffix in RECORD_SUFFIXES:
            records = _records(path, self.text_field, self.what)
            labelled = [r for _, r in records if self.label_field in r]
            if label is None and labelled:
                if len(labelled) != len(records):
                    number = next(n for n, r in records if self.label_field not in r)
                    raise RecipeError(f"{self.what}: {path}:{number}: no label field "
                                      f"{self.label_field!r} (--label-field) while other "
                                      "records have one")
                for _, record in records:
                    self.add(str(record[self.label_field]), [record[self.text_field]],
                             str(path), held_out=held)
                return
            self.add(label or stem, [r[self.text_field] for _, r in records], str(path),
                     held_out=held)
        elif path.suffix in TEXT_SUFFIXES or explicit:
            text = _read(path, self.what)
            if not text.strip():
                raise RecipeError(f"{self.what}: {path}: empty file")
            if self.split == "line":
                docs = [line for line in text.splitlines() if line.strip()]
            elif self.split == "paragraph":
                docs = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
            else:
                docs = [text]
            self.add(label or stem, docs, str(path), held_out=held)

    def dataset(self, ref: str, label: str | None, *, saved: bool) -> None:
        train, held = _dataset_documents(ref, self.text_field, saved=saved, what=self.what)
        name = label or Path(ref).name
        self.add(name, train, ref)
        self.add(name, held, ref, held_out=True)


def _read(path: Path, what: str) -> str:
    """The file's text; non-UTF-8 bytes are an error naming the line and column."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(f"{what}: {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise RecipeError(f"{what}: {path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                          f"at column {column}); convert the file to UTF-8") from None


def _records(path: Path, text_field: str, what: str) -> list[tuple[int, dict]]:
    """(line number, JSON object) of each non-blank line, each with a string `text_field`."""
    records = []
    for number, line in enumerate(_read(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = jsontext.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{what}: {path}:{number}: not valid JSON: {exc.msg}") from None
        except jsontext.HugeNumber as exc:
            raise RecipeError(f"{what}: {path}:{number}: {exc}") from None
        except RecursionError:
            raise RecipeError(f"{what}: {path}:{number}: the JSON is nested too deeply") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise RecipeError(f"{what}: {path}:{number}: no string field {text_field!r} "
                              "(--text-field) in this record")
        records.append((number, record))
    if not records:
        raise RecipeError(f"{what}: {path}: empty file (no records)")
    return records


def _dataset_documents(ref: str, text_field: str, *, saved: bool,
                       what: str) -> tuple[list[str], list[str]]:
    """(train, held-out) `text_field` values of a saved dataset directory or a hub dataset."""
    kind = "a saved dataset" if saved else "not a local file or directory; a hub dataset"
    if importlib.util.find_spec("datasets") is None:
        raise RecipeError(f"{what}: {ref}: {kind}: loading it needs the 'datasets' package "
                          "(pip install datasets)")
    import datasets

    try:
        rows = datasets.load_from_disk(ref) if saved else datasets.load_dataset(ref)
        held = None
        if isinstance(rows, datasets.DatasetDict):  # the train split, or the only one
            if "train" not in rows and len(rows) != 1:
                raise ValueError(f"no 'train' split among {', '.join(rows)}")
            held = next((rows[s] for s in ("validation", "test") if s in rows), None)
            rows = rows["train"] if "train" in rows else next(iter(rows.values()))
        for part in (rows, held) if held is not None else (rows,):
            if text_field not in part.column_names:
                raise ValueError(f"no {text_field!r} column (--text-field) among "
                                 f"{', '.join(part.column_names)}")
        return ([str(t) for t in rows[text_field]],
                [str(t) for t in held[text_field]] if held is not None else [])
    except Exception as exc:  # any failure to load is this source's fault
        raise RecipeError(f"{what}: {ref}: cannot load it with datasets: {exc}") from None
