"""moemerge.data: every --data form (docs/data.md) and every error, read once for all commands."""

import json

import pytest

from moemerge import data as data_module
from moemerge.data import domain_texts, read_domains
from moemerge.errors import RecipeError
from moemerge.io.resolve import looks_like_path


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return str(path)


def test_each_form_gives_named_domains(tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\nsome prose")
    (tmp_path / "code.txt").write_text("def f(): pass")
    labelled = _jsonl(tmp_path / "mixed.jsonl", [{"domain": "math", "text": "1 + 1"},
                                                 {"domain": "prose", "text": "Hello."}])
    plain = _jsonl(tmp_path / "qa.jsonl", [{"body": "Q?", "id": 1}, {"body": "A.", "id": 2}])
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "law.txt").write_text("statute")
    (tree / "skip.bin").write_bytes(b"\x00")
    domains = read_domains([str(tmp_path / "notes.md"), str(tmp_path / "code.txt"), labelled,
                            str(tree), f"other={tmp_path / 'code.txt'}"])
    assert {n: d.documents for n, d in domains.items()} == {
        "notes": ["# Notes\nsome prose"], "code": ["def f(): pass"], "math": ["1 + 1"],
        "prose": ["Hello."], "law": ["statute"], "other": ["def f(): pass"]}
    assert read_domains([plain], text_field="body")["qa"].documents == ["Q?", "A."]
    # name=path takes everything under it, labels included, as one domain
    assert list(read_domains([f"all={labelled}"])) == ["all"]
    assert list(read_domains([f"all={tree}"])) == ["all"]


def test_split_files_are_one_domain_and_its_held_out_part(tmp_path):
    """The toy data layout (code.train.txt / code.eval.txt): one domain, the eval file held out."""
    for domain in ("code", "math"):
        (tmp_path / f"{domain}.train.txt").write_text(f"{domain} train")
        (tmp_path / f"{domain}.eval.txt").write_text(f"{domain} eval")
    domains = read_domains([str(tmp_path)])
    assert list(domains) == ["code", "math"]
    assert domains["code"].documents == ["code train"]
    assert domains["code"].held_out == ["code eval"]
    assert domain_texts([str(tmp_path)]) == {"code": "code eval", "math": "math eval"}


def test_route_splits_text_but_not_records(tmp_path):
    (tmp_path / "p.txt").write_text("a\nb\n\nc\n")
    rec = _jsonl(tmp_path / "r.jsonl", [{"text": "x\ny"}])
    docs = read_domains([str(tmp_path / "p.txt"), rec], split="line")
    assert docs["p"].documents == ["a", "b", "c"] and docs["r"].documents == ["x\ny"]
    assert read_domains([str(tmp_path / "p.txt")], split="paragraph")["p"].documents == [
        "a\nb", "c"]


@pytest.mark.parametrize("setup, spec, message", [
    (None, "nope.txt", r"--data: .*nope.txt: no such file or directory"),
    (lambda p: (p / "e.txt").write_text(" \n"), "e.txt", r"e.txt: empty file"),
    (lambda p: (p / "e.jsonl").write_text("\n"), "e.jsonl", r"e.jsonl: empty file"),
    (lambda p: (p / "r.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n'), "r.jsonl",
     r"r.jsonl:2: no string field 'text' \(--text-field\)"),
    (lambda p: (p / "b.jsonl").write_text('{"text": "ok"}\n{oops\n'), "b.jsonl",
     r"b.jsonl:2: not valid JSON"),
    (lambda p: (p / "u.txt").write_bytes(b"fine\nstill fine\nbad \xff byte\n"), "u.txt",
     r"u.txt:3: not UTF-8 text \(byte 0xff at column 5\)"),
    (lambda p: (p / "l.jsonl").write_text('{"text": "a", "domain": "x"}\n{"text": "b"}\n'),
     "l.jsonl", r"l.jsonl:2: no label field 'domain' \(--label-field\)"),
    (lambda p: (p / "d").mkdir(), "d", r"d: no .txt, .md, .text, .jsonl, .json files"),
])
def test_errors_name_the_file_and_line(tmp_path, setup, spec, message):
    if setup:
        setup(tmp_path)
    with pytest.raises(RecipeError, match=message):
        read_domains([str(tmp_path / spec)])


def test_path_like_references_never_reach_the_hub(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data_module, "_dataset_documents",
                        lambda *a, **k: calls.append(a) or (["hub text"], []))
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    for ref in ("./org/name", "/org/name", "~/org/name", "a/b/c", "data/missing"):
        assert looks_like_path(ref)
        with pytest.raises(RecipeError, match=f"{ref}: no such file or directory"):
            read_domains([ref])
    assert calls == []
    assert read_domains(["org/name"])["name"].documents == ["hub text"]  # a hub id
    assert len(calls) == 1


def test_saved_datasets_keep_their_held_out_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["train row"]}),
        "test": datasets.Dataset.from_dict({"text": ["test row"]}),
    }).save_to_disk(tmp_path / "saved")
    domain = read_domains([f"math={tmp_path / 'saved'}"])["math"]
    assert (domain.documents, domain.held_out) == (["train row"], ["test row"])


def test_relative_paths_are_read_near_the_recipe(tmp_path, monkeypatch):
    """A recipe's `calibration.data` names files beside the recipe, whatever the working
    directory; a path that exists only where the command runs is still read there."""
    recipe_dir, elsewhere = tmp_path / "recipe", tmp_path / "cwd"
    (recipe_dir / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (recipe_dir / "data" / "code.txt").write_text("def f(): pass")
    (elsewhere / "notes.txt").write_text("plain text")
    monkeypatch.chdir(elsewhere)
    domains = read_domains(["data/code.txt", "prose=notes.txt"], near=recipe_dir)
    assert {n: d.documents for n, d in domains.items()} == {
        "code": ["def f(): pass"], "prose": ["plain text"]}
    assert domains["code"].sources == [str(recipe_dir / "data" / "code.txt")]
    with pytest.raises(RecipeError, match="data/code.txt: no such file"):
        read_domains(["data/code.txt"])  # without `near`: relative to the working directory


def test_a_directory_that_links_back_to_itself_is_read_once(tmp_path):
    """A data directory holding a symlink to its own parent: its files are read once each, and
    the walk ends (symlinked directories are not followed)."""
    (tmp_path / "d" / "a").mkdir(parents=True)
    (tmp_path / "d" / "a" / "x.txt").write_text("some calibration text\n")
    (tmp_path / "d" / "a" / "up").symlink_to("..")
    domains = read_domains([str(tmp_path / "d")], what="calibration.data")
    assert {name: len(d.documents) for name, d in domains.items()} == {"x": 1}
