"""Progress bars (rich) for long work: rollouts, updates, evaluation."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)


def _bar(description: str) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, transient=False,
    )


class EpisodeProgress:
    """Episodes finished out of a total, with success count and generation rate."""

    def __init__(self, total: int, description: str, enabled: bool = True):
        self.enabled = enabled
        self.total = total
        self.description = description
        self.successes = 0
        self.tokens = 0
        self.progress: Progress | None = None

    def __enter__(self) -> "EpisodeProgress":
        if self.enabled:
            self.progress = _bar(self.description)
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=self.total, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def turn_done(self, live: int, tokens: int) -> None:
        self.tokens += tokens
        self._refresh(live)

    def episode_done(self, success: bool) -> None:
        self.successes += int(success)
        if self.progress:
            self.progress.advance(self.task)

    def _refresh(self, live: int) -> None:
        if not self.progress:
            return
        elapsed = self.progress.tasks[0].elapsed or 1e-9
        status = f"live {live}  success {self.successes}  {self.tokens / elapsed:.0f} tok/s"
        self.progress.update(self.task, status=status)


class StepProgress:
    """Training steps with the latest metrics shown beside the bar."""

    def __init__(self, total: int, description: str, enabled: bool = True, start: int = 0):
        self.enabled = enabled
        self.total = total
        self.start = start
        self.description = description
        self.progress: Progress | None = None

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            self.progress = _bar(self.description)
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=self.total, completed=self.start, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def step_done(self, status: str = "") -> None:
        if self.progress:
            self.progress.update(self.task, advance=1, status=status)
