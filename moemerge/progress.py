"""What a long command is doing while it does it, on stderr: each stage as a spinner while it
runs and a line with its time when it ends, and a bar with bytes/s and ETA for the loop over
tensors. Silent when disabled (-q, or stderr is not a terminal), so scripts read only results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class Stages:
    def __init__(self, enabled: bool):
        self.console = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)

    @contextmanager
    def __call__(self, what: str) -> Iterator[Callable[[str], None]]:
        """Run the block as the stage `what` ("planning"); the block may call the function it
        is given with what it found ("412 tensors, 1.2 GiB"), shown on the stage's line."""
        found: list[str] = []
        if self.console is None:
            yield found.append
            return
        start = time.perf_counter()
        with self.console.status(f"{what}…"):
            yield found.append
        detail = f": {', '.join(found)}" if found else ""
        self.console.print(f"[green]✓[/] {what}{detail} [dim]({time.perf_counter() - start:.1f} s)"
                           "[/]", highlight=False)

    def bar(self, what: str, items: Iterable, total_bytes: int, count: int,
            nbytes: Callable[[object], int]) -> Iterator:
        """`items` unchanged, with a bar of `count` items and `total_bytes` (each item's size
        from `nbytes`), its rate and the time left."""
        if self.console is None:
            yield from items
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        # the time left while it runs, the time it took once done
        columns = (TextColumn(f"[bold]{what}"), BarColumn(bar_width=20),
                   TextColumn(f"{{task.fields[done]}}/{count} tensors"),
                   DownloadColumn(binary_units=True), TransferSpeedColumn(),
                   TimeRemainingColumn(elapsed_when_finished=True))
        with Progress(*columns, console=self.console) as progress:
            task = progress.add_task(what, total=total_bytes, done=0)
            for done, item in enumerate(items, start=1):
                yield item
                progress.update(task, advance=nbytes(item), done=done)
