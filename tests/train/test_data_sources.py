"""finetune's data sources through the real `datasets` library: a directory written by
`save_to_disk` (a Dataset, or a DatasetDict's train split), and its errors."""

import pytest

from moemerge.data import read_domains
from moemerge.errors import RecipeError

datasets = pytest.importorskip("datasets")


def collect_texts(specs: list[str], text_field: str) -> dict[str, list[str]]:
    return {n: d.documents for n, d in read_domains(specs, text_field=text_field).items()}


def test_saved_datasets_are_read_with_their_domain_labels(tmp_path):
    datasets.Dataset.from_dict({"text": ["def f(x):", "return x"], "n": [1, 2]}).save_to_disk(
        tmp_path / "code")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": ["Q: 2 + 2? A: 4."]}),
        "test": datasets.Dataset.from_dict({"body": ["held out"]}),
    }).save_to_disk(tmp_path / "split")
    (tmp_path / "notes.txt").write_text("plain text")
    texts = collect_texts([str(tmp_path / "code"), str(tmp_path / "notes.txt")], "text")
    assert texts == {"code": ["def f(x):", "return x"], "notes": ["plain text"]}
    assert collect_texts([f"math={tmp_path / 'split'}"], "body") == {"math": ["Q: 2 + 2? A: 4."]}


def test_saved_dataset_errors_name_the_source(tmp_path):
    datasets.Dataset.from_dict({"content": ["x"]}).save_to_disk(tmp_path / "d")
    with pytest.raises(RecipeError, match=r"no 'text' column \(--text-field\) among content"):
        collect_texts([str(tmp_path / "d")], "text")
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"text": ["x"]}),
                          "b": datasets.Dataset.from_dict({"text": ["y"]})}).save_to_disk(
        tmp_path / "two")
    with pytest.raises(RecipeError, match="no 'train' split among a, b"):
        collect_texts([str(tmp_path / "two")], "text")


class _CharTokenizer:
    """One token per character: enough to count blocks."""

    eos_token_id = 0

    def __call__(self, text, **_):
        return {"input_ids": [ord(c) for c in text]}


def test_held_out_files_are_evaluated_never_trained_on(tmp_path):
    from moemerge.data import read_domains
    from moemerge.token_blocks import make_blocks

    (tmp_path / "code.train.txt").write_text("t" * 79)  # 80 tokens with EOS: 8 blocks of 10
    (tmp_path / "code.eval.txt").write_text("e" * 19)  # 2 blocks
    (tmp_path / "prose.txt").write_text("p" * 99)  # 10 blocks, every 5th held out
    blocks = make_blocks(read_domains([str(tmp_path)]), _CharTokenizer(), 9, 0.2)
    assert blocks.domains == ["code", "prose"]
    code_eval = blocks.tokens[blocks.eval_ids][blocks.domain[blocks.eval_ids] == 0]
    code_train = blocks.tokens[blocks.train_ids][blocks.domain[blocks.train_ids] == 0]
    assert code_eval.shape[0] == 2 and (code_eval[:, :-1] == ord("e")).all()
    assert code_train.shape[0] == 8 and not (code_train == ord("e")).any()
    assert int((blocks.domain[blocks.eval_ids] == 1).sum()) == 2
