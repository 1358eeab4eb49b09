"""Batched multi-turn rollouts: many episodes advance together, token-in/token-out.

Each turn, every live episode's token history goes into one batched
generation; then every environment steps on its own output. Histories only
grow: the ids a backend sampled are kept as they are (mask 1), and the
template's closing and the next observation's user turn are appended as ids
(mask 0). Nothing is ever decoded and re-encoded, so the ids trained on are
the ids that were sampled.

An episode ends when its environment says done (the environment's base class
also ends it at the turn limit: ``RolloutConfig.max_turns`` when set, else the
environment's own ``turn_limit(task)``), when a turn's ids would overflow
``max_episode_tokens`` (truncated), or when its environment raises -- in its
constructor, ``reset``, ``step`` or ``close`` -- (that episode fails with the
error recorded; the other episodes go on).
"""

from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from contrail.agent.backend import Backend, SamplingParams
from contrail.agent.chat import ChatFormat
from contrail.agent.vllm import VLLMConfig
from contrail.envs.base import Env, Step, Task
from contrail.seeds import derive_seed

MAX_STEP_THREADS = 64  # concurrent remote steps per turn (one HTTP request each)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Limits and sampling for one batch of episodes (keyword arguments only).

    Every value is checked here; a bad one is a ValueError whose message
    starts with the field's name.
    """

    max_new_tokens: int = 128          # per turn
    max_episode_tokens: int = 4096     # prompt + every turn + every observation
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int | None = None       # overrides the environments' own turn limits when set
    backend: str = "hf"                # what samples: "hf" (the model itself) or "vllm" (a colocated engine)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the engine's settings, used with backend: vllm

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.vllm, VLLMConfig):
            raise ValueError(f"vllm must be a VLLMConfig (a mapping of its settings), got {self.vllm!r}")
        for name in ("max_new_tokens", "max_episode_tokens"):
            _check_int(name, getattr(self, name))
        if self.max_turns is not None:
            _check_int("max_turns", self.max_turns)
        if self.max_episode_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_episode_tokens ({self.max_episode_tokens}) must exceed max_new_tokens "
                f"({self.max_new_tokens}) so at least one turn fits"
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p)


BACKENDS = ("hf", "vllm")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def per_turn_rate(trajectories: list["Trajectory"], count: str, empty: float = 0.0) -> float:
    """Episodes' ``count`` (``"invalid_actions"``, ``"cut_turns"``) over all their turns, pooled: a long
    episode weighs by its turns. ``empty`` when they played no turn."""
    turns = sum(t.turns for t in trajectories)
    return sum(getattr(t, count) for t in trajectories) / turns if turns else empty


@dataclass
class Trajectory:
    """One finished episode, ready for training and for reading.

    ``ids``, ``mask`` and ``logprobs`` are aligned: ``mask[i] == 1`` exactly
    where ``ids[i]`` was sampled by the policy, and ``logprobs[i]`` is the
    sampler's log-probability there (0.0 elsewhere). ``messages`` is the same
    conversation as text, for people; an assistant message the environment
    answered also carries ``"valid"`` (the step's own verdict on the action),
    and one cut off at ``max_new_tokens`` before its end-of-turn id carries
    ``"cut": True``. ``cut_turns`` counts those: a policy that stops ending its
    turns shows there first (TRL's ``clipped_ratio``, per turn).
    """

    task: Task
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, Any]]
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    generated_tokens: int = 0
    invalid_actions: int = 0
    cut_turns: int = 0
    truncated: bool = False
    error: str | None = None
    sample: int = 0

    @property
    def invalid_rate(self) -> float:
        return self.invalid_actions / self.turns if self.turns else 0.0

    @property
    def cut_rate(self) -> float:
        return self.cut_turns / self.turns if self.turns else 0.0

    def to_record(self) -> dict[str, Any]:
        """A JSON-able summary: the conversation text and the outcome (no ids)."""
        return {
            "task": self.task.to_dict(), "sample": self.sample, "reward": self.reward,
            "success": self.success, "turns": self.turns, "generated_tokens": self.generated_tokens,
            "invalid_actions": self.invalid_actions, "cut_turns": self.cut_turns, "truncated": self.truncated,
            "error": self.error,
            "messages": self.messages,
        }


@dataclass
class Episode:
    """One started episode: its environment and its trajectory so far (`start_episodes`; `play` ends it).

    ``env`` is None when it could not be built. Right after the start,
    ``trajectory.ids`` is the opening prompt (the environment's instructions
    and first observation), so callers can group episodes by its length
    before playing them (`contrail.evaluation`).
    """

    env: Env | None
    trajectory: Trajectory
    done: bool = False
    seed: int | None = None  # its sampling seed, when the rollout was given per-episode seeds

    def extend(self, ids: list[int], mask_value: int, logprobs: list[float] | None = None) -> None:
        traj = self.trajectory
        traj.ids.extend(ids)
        traj.mask.extend([mask_value] * len(ids))
        traj.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


EnvFactory = Callable[[Task], Env]


def start_episodes(
    tasks: list[Task], make_env: EnvFactory, chat: ChatFormat, config: RolloutConfig = RolloutConfig(),
    samples: list[int] | None = None, seeds: list[int] | None = None,
) -> list[Episode]:
    """Build and reset one environment per task and record each opening prompt; a failure fails that episode only.

    Constructors run here in order (they are cheap: engines start at reset);
    the resets of ``concurrent_steps`` environments run in a thread pool.
    ``samples`` and ``seeds`` are as in `rollout`. Nothing is generated:
    `play` does that.
    """
    if seeds is not None and len(seeds) != len(tasks):
        raise ValueError(f"rollout: {len(seeds)} seeds for {len(tasks)} tasks")
    samples = samples if samples is not None else [0] * len(tasks)
    episodes = [_open(task, sample, make_env) for task, sample in zip(tasks, samples)]
    for episode, seed in zip(episodes, seeds or []):
        episode.seed = seed
    openings: list[str | BaseException | None] = [None] * len(episodes)
    concurrent = [i for i, e in enumerate(episodes) if getattr(e.env, "concurrent_steps", False)]
    if len(concurrent) > 1:
        with ThreadPoolExecutor(max_workers=min(MAX_STEP_THREADS, len(concurrent))) as pool:
            futures = {i: pool.submit(_first_observation, episodes[i], config) for i in concurrent}
            for i, future in futures.items():
                openings[i] = future.result()
    for i, episode in enumerate(episodes):
        if episode.env is not None:
            opening = openings[i] if openings[i] is not None else _first_observation(episode, config)
            _begin(episode, opening, chat, config)
    return episodes


def _open(task: Task, sample: int, make_env: EnvFactory) -> Episode:
    trajectory = Trajectory(task=task, ids=[], mask=[], logprobs=[], messages=[], sample=sample)
    episode = Episode(env=None, trajectory=trajectory)
    try:  # a broken environment fails this episode, not the batch
        episode.env = make_env(task)
    except Exception as error:
        _fail(episode, error)
    return episode


def _first_observation(episode: Episode, config: RolloutConfig) -> str | BaseException:
    try:
        return _reset(episode.env, episode.trajectory.task, config.max_turns)
    except Exception as error:
        return error


def _begin(episode: Episode, opening: str | BaseException, chat: ChatFormat, config: RolloutConfig) -> None:
    """Record the prompt and the first observation (or the reset's failure)."""
    trajectory = episode.trajectory
    try:
        if isinstance(opening, BaseException):
            raise opening
        messages = episode.env.prompt_messages() + [{"role": "user", "content": opening}]
    except Exception as error:
        _fail(episode, error)
        return
    trajectory.messages.extend(messages)
    episode.extend(chat.prompt_ids(messages), 0)
    if len(trajectory.ids) + config.max_new_tokens > config.max_episode_tokens:
        trajectory.truncated = True
        episode.done = True


def _reset(env: Env, task: Task, max_turns: int | None) -> str:
    """Start the episode; the rollout's ``max_turns`` overrides the environment's own limit.

    The environment counts the turns and ends the episode at the limit. Without
    an override the plain ``reset(task)`` is called, the call every wrapper of
    ``reset`` (a test's spy, a user's subclass) understands.
    """
    if max_turns is None:
        return env.reset(task)
    return env.reset(task, turn_limit=max_turns)


def _fail(episode: Episode, error: BaseException) -> None:
    episode.trajectory.error = f"{type(error).__name__}: {error}"
    episode.trajectory.reward = 0.0
    episode.trajectory.success = False
    episode.done = True
    # formatted from the error itself: a pool thread's exception is recorded after its except block ended
    text = "".join(traceback.format_exception(error, limit=3))
    episode.trajectory.messages.append({"role": "error", "content": text})


def _record_turn(episode: Episode, generation, chat: ChatFormat) -> str:
    """Append the sampled ids and the template's closing; return the turn's text."""
    traj = episode.trajectory
    episode.extend(generation.ids, 1, generation.logprobs)
    traj.generated_tokens += len(generation.ids)
    traj.turns += 1
    text = chat.tokenizer.decode([t for t in generation.ids if t not in chat.stop_ids], skip_special_tokens=False)
    traj.messages.append({"role": "assistant", "content": text})
    if not generation.stopped:  # ran into max_new_tokens: the template closes the turn, not the model
        traj.cut_turns += 1
        traj.messages[-1]["cut"] = True
    episode.extend(chat.close_after(generation.ids), 0)
    return text


def _env_step(env: Env, text: str) -> Step | BaseException:
    """``env.step(text)``, or the exception it raised (kept with its traceback)."""
    try:
        return env.step(text)
    except Exception as error:
        return error


def _apply_step(episode: Episode, step: Step | BaseException, chat: ChatFormat, config: RolloutConfig) -> None:
    """Record the environment's answer and append the next observation's ids."""
    traj = episode.trajectory
    if isinstance(step, BaseException):
        _fail(episode, step)
        return
    # The environment's verdict, kept on the turn it judges: diagnostics read it instead of guessing.
    traj.messages[-1]["valid"] = bool(step.valid)
    traj.invalid_actions += 0 if step.valid else 1
    traj.reward = float(step.reward)
    traj.success = bool(step.success)
    if step.done:  # solved, failed, or the turn limit (the environment counts the turns)
        episode.done = True
        return
    observation_ids = chat.user_turn_ids(step.observation)
    if len(traj.ids) + len(observation_ids) + config.max_new_tokens > config.max_episode_tokens:
        traj.truncated = True  # the next turn could not fit: stop before overflowing
        episode.done = True
        return
    traj.messages.append({"role": "user", "content": step.observation})
    episode.extend(observation_ids, 0)


def _step_all(live: list[Episode], generations, chat: ChatFormat, config: RolloutConfig) -> None:
    """Advance every live episode by its generation.

    Environments that declare ``concurrent_steps = True`` (remote servers,
    whose latency would otherwise add up over the batch) step in a thread
    pool; tokenizing stays on this thread (a fast tokenizer is not safe to
    share across threads).
    """
    texts = [_record_turn(episode, generation, chat) for episode, generation in zip(live, generations)]
    concurrent = [i for i, e in enumerate(live) if getattr(e.env, "concurrent_steps", False)]
    steps: list[Step | BaseException | None] = [None] * len(live)
    if len(concurrent) > 1:
        with ThreadPoolExecutor(max_workers=min(MAX_STEP_THREADS, len(concurrent))) as pool:
            futures = {i: pool.submit(_env_step, live[i].env, texts[i]) for i in concurrent}
            for i, future in futures.items():
                steps[i] = future.result()
    for i, episode in enumerate(live):
        step = steps[i] if steps[i] is not None else _env_step(episode.env, texts[i])
        _apply_step(episode, step, chat, config)


def rollout(
    backend: Backend,
    chat: ChatFormat,
    tasks: list[Task],
    make_env: EnvFactory,
    config: RolloutConfig = RolloutConfig(),
    samples: list[int] | None = None,
    on_turn: Callable[[int, int], None] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
    seeds: list[int] | None = None,
) -> list[Trajectory]:
    """Play one episode per entry of ``tasks`` (repeat a task for several samples): `start_episodes`, then `play`.

    ``make_env(task)`` builds a fresh environment per episode; an exception
    there fails that episode (error recorded), like one from the environment
    itself. ``on_turn(live, generated_tokens)`` is called after each batched turn and
    ``on_episode(trajectory)`` when an episode finishes (progress bars).
    ``seeds`` (one per episode) makes each episode sample from its own
    streams, turn ``t`` of episode ``i`` from ``derive_seed(seeds[i], "turn", t)``:
    an episode then plays the same whatever other episodes share its batch
    (scripted actors, which read the environment, take no seeds).
    Returns trajectories in the order of ``tasks``.
    """
    episodes = start_episodes(tasks, make_env, chat, config, samples=samples, seeds=seeds)
    return play(backend, chat, episodes, config, on_turn=on_turn, on_episode=on_episode)


def play(
    backend: Backend,
    chat: ChatFormat,
    episodes: list[Episode],
    config: RolloutConfig = RolloutConfig(),
    on_turn: Callable[[int, int], None] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Play started ``episodes`` (`start_episodes`) to their ends, all live ones in one generation per turn.

    ``on_turn`` and ``on_episode`` are as in `rollout`. Returns the
    trajectories in the order of ``episodes``, which must have been started
    with seeds for all or for none.
    """
    seeded = any(e.seed is not None for e in episodes)
    if seeded and any(e.seed is None for e in episodes):
        raise ValueError("play: some episodes were started with seeds and some without")
    reset_cache = getattr(backend, "reset_cache", None)
    if reset_cache:
        reset_cache()  # a kept KV cache belongs to other episodes (and maybe older weights)
    _finish_done(episodes, on_episode)  # failed to start or over the token limit at once
    params = config.sampling()
    while True:
        live = [e for e in episodes if not e.done]
        if not live:
            break
        prompts = [e.trajectory.ids for e in live]
        if getattr(backend, "reads_envs", False):  # scripted actors (expert, random) look at the state
            generations = backend.generate(prompts, params, envs=[e.env for e in live])
        elif seeded:
            turn_seeds = [derive_seed(e.seed, "turn", e.trajectory.turns) for e in live]
            generations = backend.generate(prompts, params, seeds=turn_seeds)
        else:
            generations = backend.generate(prompts, params)
        _step_all(live, generations, chat, config)
        _finish_done(live, on_episode)
        if on_turn:
            on_turn(len(live), sum(len(g.ids) for g in generations))
    if reset_cache:
        reset_cache()  # free the cache's memory
    return [e.trajectory for e in episodes]


def close_unfinished(episodes: list[Episode]) -> None:
    """Close the environments of ``episodes`` that have not ended (a caller interrupted before `play` ended them)."""
    for episode in episodes:
        if not episode.done:
            _close(episode)


def _finish_done(episodes: list[Episode], on_episode: Callable[[Trajectory], None] | None) -> None:
    """Close every episode of ``episodes`` that has ended, and report it."""
    for episode in episodes:
        if episode.done:
            _close(episode)
            if on_episode:
                on_episode(episode.trajectory)


def _close(episode: Episode) -> None:
    if episode.env is None:
        return
    try:
        episode.env.close()
    except Exception as error:  # closing must never take the run down
        episode.trajectory.error = episode.trajectory.error or f"close failed: {error}"

