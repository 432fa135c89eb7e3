"""What a long command is doing while it does it, on stderr. On a terminal: each stage as a
spinner while it runs and a line with its time when it ends, and a bar with bytes/s and ETA for
the loop over tensors. Off a terminal (a pipe, a log file, CI), plain lines instead, since
nothing redraws there: a line when a stage starts and one when it ends, and for a loop one
every PLAIN_EVERY_S seconds. Silent when disabled (-q), so scripts read only results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

PLAIN_EVERY_S = 10.0  # off a terminal, a running loop says how far it is at most this often


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


class Stages:
    def __init__(self, enabled: bool):
        self.console = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)

    @property
    def plain(self) -> bool:
        """Lines rather than spinners and bars: stderr is not a terminal."""
        return self.console is not None and not self.console.is_terminal

    def say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)  # whole lines

    @contextmanager
    def __call__(self, what: str) -> Iterator[Callable[[str], None]]:
        """Run the block as the stage `what` ("planning"); the block may call the function it
        is given with what it found ("412 tensors, 1.2 GiB"), shown on the stage's line."""
        found: list[str] = []
        if self.console is None:
            yield found.append
            return
        start = time.perf_counter()
        if self.plain:
            self.say(f"{what}…")
            yield found.append
        else:
            with self.console.status(f"{what}…"):
                yield found.append
        detail = f": {', '.join(found)}" if found else ""
        self.console.print(f"[green]✓[/] {what}{detail} [dim]({time.perf_counter() - start:.1f} s)"
                           "[/]", highlight=False, soft_wrap=True)

    def bar(self, what: str, items: Iterable, total_bytes: int, count: int,
            nbytes: Callable[[object], int]) -> Iterator:
        """`items` unchanged, with a bar of `count` items and `total_bytes` (each item's size
        from `nbytes`), its rate and the time left."""
        if self.console is None:
            yield from items
            return
        if self.plain:
            yield from self._lines(what, items, total_bytes, count, nbytes)
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

    def _lines(self, what: str, items: Iterable, total_bytes: int, count: int,
               nbytes: Callable[[object], int]) -> Iterator:
        """The bar as plain lines: what it will do, how far it is now and then, what it did."""
        self.say(f"{what}: {count} tensors, {_mib(total_bytes)}…")
        start = said = time.perf_counter()
        done, size = 0, 0
        for done, item in enumerate(items, start=1):
            yield item
            size += nbytes(item)
            if (now := time.perf_counter()) - said >= PLAIN_EVERY_S:
                said = now
                self.say(f"{what}: {done}/{count} tensors, {_mib(size)} of "
                         f"{_mib(total_bytes)} ({now - start:.0f} s)")
        self.say(f"✓ {what}: {done}/{count} tensors, {_mib(size)} "
                 f"({time.perf_counter() - start:.1f} s)")


def step_lines(say: Callable[[str], None], what: str, total: int
               ) -> Callable[[int, float], None]:
    """A training loop's on_step(step, loss) off a terminal: says `what` starts, then how far
    it is at most every PLAIN_EVERY_S seconds, and a line when its last step is done."""
    say(f"{what}: {total} steps…")
    start = said = time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        nonlocal said
        now = time.perf_counter()
        if step + 1 >= total:
            say(f"✓ {what}: {total} steps, loss {loss:.3f} ({now - start:.1f} s)")
        elif now - said >= PLAIN_EVERY_S:
            said = now
            say(f"{what}: step {step + 1}/{total}, loss {loss:.3f} ({now - start:.0f} s)")

    return on_step
