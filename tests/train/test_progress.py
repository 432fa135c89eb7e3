"""finetune's progress bar: no 'loss nan 0 tok/s' before the first step reports."""

import io

from rich.console import Console

from moemerge.train.report import progress_bar, step_stats


def test_step_stats_show_dashes_until_the_first_step():
    assert step_stats(None, None) == "loss –  – tok/s"
    assert step_stats(2.5, 1234.4) == "loss 2.5000  1,234 tok/s"
    assert step_stats(0.0, 0.0) == "loss 0.0000  0 tok/s"  # real zeros stay numbers


def test_bar_before_and_after_the_first_step():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with progress_bar(console, total=10, start=0):
        pass  # no step reported
    assert "loss –  – tok/s" in buffer.getvalue() and "nan" not in buffer.getvalue()

    buffer.seek(0), buffer.truncate()
    with progress_bar(console, total=10, start=0) as update:
        update({"type": "train", "step": 1, "loss": 2.5, "tokens_per_s": 1234.0})
    last_frame = buffer.getvalue().rsplit("loss ", 1)[1]
    assert last_frame.startswith("2.5000  1,234 tok/s"), buffer.getvalue()
