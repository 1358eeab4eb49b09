"""Experiences and streams: what a continual run trains on and tests on.

An `Experience` is one environment at one difficulty (``textcraft:easy``)
with its train and test tasks and its training budget. A `Stream` is the
ordered experiences to train plus the experiences to test, held-out ones
included (train on one environment, test on all five).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from contrail import envs
from contrail.envs.base import Env, Task
from contrail.evaluation import select_tasks


@dataclass
class Experience:
    """One environment at one difficulty, with its train/test tasks and budget.

    ``steps`` is the number of GRPO steps a strategy spends on it in a
    sequential plan (``None``: the strategy's default).
    """

    name: str
    env: str
    difficulty: str | None
    train_tasks: list[Task]
    test_tasks: list[Task]
    steps: int | None = None
    env_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(
        cls,
        spec: str,
        train_tasks: int | None = None,
        test_tasks: int | None = None,
        steps: int | None = None,
        seed: int = 0,
        env_options: dict[str, Any] | None = None,
    ) -> "Experience":
        """Build from ``"env:difficulty"``; ``train_tasks``/``test_tasks`` cap the task lists
        with a deterministic spread sample (``None`` keeps them all)."""
        name, difficulty = envs.parse_spec(spec)
        options = dict(env_options or {})
        env = envs.make(name, **options)
        try:
            train = select_tasks(env.tasks("train", difficulty), train_tasks, seed)
            test = select_tasks(env.tasks("test", difficulty), test_tasks, seed)
        finally:
            env.close()
        label = f"{name}:{difficulty}" if difficulty else name
        return cls(label, name, difficulty, train, test, steps, options)

    def make_env(self) -> Env:
        return envs.make(self.env, **self.env_options)


def env_factory(experiences: Sequence[Experience]) -> Callable[[Task], Env]:
    """A ``task -> fresh Env`` function honouring each experience's environment options."""
    options: dict[str, dict[str, Any]] = {}
    for experience in experiences:
        known = options.setdefault(experience.env, experience.env_options)
        if known != experience.env_options:
            raise ValueError(
                f"experiences of {experience.env!r} disagree on environment options "
                f"({known} vs {experience.env_options}); use one set of options per environment"
            )
    return lambda task: envs.make(task.env, **options.get(task.env, {}))


@dataclass
class Stream:
    """Ordered experiences to train, and the experiences to test after every stage.

    ``test`` defaults to the training experiences; add held-out experiences to
    measure transfer to environments never trained on.
    """

    train: list[Experience]
    test: list[Experience] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.test:
            self.test = list(self.train)
        names = [e.name for e in self.test]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise ValueError(f"test experiences must be unique, repeated: {sorted(duplicates)}")

    @classmethod
    def from_specs(
        cls,
        train: Sequence[str],
        test: Sequence[str] | None = None,
        train_tasks: int | None = None,
        test_tasks: int | None = None,
        steps: int | None = None,
        seed: int = 0,
        env_options: dict[str, dict[str, Any]] | None = None,
    ) -> "Stream":
        """Build a stream from spec strings; experiences named in both lists are shared."""
        env_options = env_options or {}
        built: dict[str, Experience] = {}

        def get(spec: str) -> Experience:
            if spec not in built:
                name = spec.partition(":")[0]
                built[spec] = Experience.from_spec(
                    spec, train_tasks, test_tasks, steps, seed, env_options.get(name)
                )
            return built[spec]

        train_list = [get(spec) for spec in train]
        test_list = [get(spec) for spec in (test or train)]
        return cls(train_list, test_list)

    @property
    def experiences(self) -> list[Experience]:
        """Every distinct experience of the stream (train first, then held-out)."""
        seen: dict[str, Experience] = {}
        for experience in self.train + self.test:
            seen.setdefault(experience.name, experience)
        return list(seen.values())

    def trained_at(self, stage_experiences: Sequence[Sequence[str]]) -> list[int | None]:
        """For each test experience, the 1-based stage where it is first trained, or None."""
        first: dict[str, int] = {}
        for stage, names in enumerate(stage_experiences, start=1):
            for name in names:
                first.setdefault(name, stage)
        return [first.get(e.name) for e in self.test]
