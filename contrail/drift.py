"""Forgetting beyond success: how far the policy moved, whether or not success changed.

Three measures per stage, pure functions the runner stores in a row's
``"drift"`` entry (`drift_row` builds it) and the report shows:

- `policy_kl`: the forward KL ``KL(p ‖ q)`` from the start model ``p`` to the
  current policy ``q`` on tokens sampled from ``p`` (the quantity "RL's Razor",
  Shenfeld et al. 2025, ties to forgetting), per test experience on its own
  prompts. With ``r = log q(x) − log p(x)`` at each sampled token, the
  standard estimators (Schulman 2020, "Approximating KL divergence") are
  ``k1 = −r`` (unbiased, noisy, may be negative), ``k2 = r²/2`` (biased, low
  variance) and ``k3 = e^r − 1 − r`` (unbiased, never negative). With both
  models at hand, ``exact`` is the full-vocabulary KL at the same positions.
  `kl_from_logprobs` needs only ``q``: ``log p`` of the sampled tokens is what
  the start model's sampler recorded (``Trajectory.logprobs`` of row 0, valid
  as ``p`` itself at temperature 1 and top-p 1).
- `parameter_change`: the share of parameters that moved beyond a tolerance
  between two state dicts (the previous stage's and this one's).
- `turnover`: the test tasks solved at row ``s − 1`` and failed at row ``s``
  (lost) and the reverse (gained), from per-task success rates.

Wiring in the runner (`DriftTracker` holds what is measured against): after row 0, `start_samples` keeps each test
experience's sampled token ids and masks, `score_samples` gives them the
start model's own log-probs (so row 0 is exactly 0 whatever the sampler), and
`save_samples` writes them as JSON, so a resumed run has them too; after each stage,
`kl_to_start(model, samples)` gives the per-experience KL, and
`parameter_change(previous_state, model.state_dict())` the share of moved
parameters; `drift_row(...)` is the row's ``"drift"`` value.

Shape of a row's ``"drift"`` entry (every key optional)::

    {"kl": {"babyai:easy": {"k1": .., "k2": .., "k3": .., "exact": .., "se_k1": .., "se_k3": .., "tokens": 812,
                            "sequences": 40}, ...},
     "params": {"changed": 1204, "total": 134515008, "fraction": 8.9e-06, "atol": 0.0, "rtol": 0.0}}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DriftTracker",
    "KLEstimate",
    "ParameterChange",
    "Samples",
    "Turnover",
    "drift_row",
    "kl_from_logprobs",
    "kl_to_start",
    "load_samples",
    "parameter_change",
    "policy_kl",
    "save_samples",
    "score_samples",
    "start_samples",
    "task_successes",
    "turnover",
]


@dataclass(frozen=True)
class KLEstimate:
    """Per-token ``KL(p ‖ q)`` estimates over ``tokens`` sampled tokens in ``sequences`` sequences.

    ``se_*`` are standard errors with sequences as the sampling unit (tokens of
    one sequence are not independent). ``exact`` is ``nan`` when only
    ``log p`` of the sampled tokens was known.
    """

    k1: float
    k2: float
    k3: float
    exact: float
    se_k1: float
    se_k3: float
    tokens: int
    sequences: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@torch.no_grad()
def policy_kl(model_p, model_q, sequences: Sequence[Sequence[int]] | torch.Tensor,
              masks: Sequence[Sequence[int]] | torch.Tensor, *, batch_size: int = 8, pad_id: int = 0,
              chunk_rows: int = 128) -> KLEstimate:
    """``KL(p ‖ q)`` per token on the positions ``masks`` marks, which must hold tokens sampled from ``p``.

    ``model_p``/``model_q`` are causal LMs called as ``model(input_ids=...,
    attention_mask=...)`` returning ``.logits``; ``sequences[i][t]`` is a token
    id and ``masks[i][t] == 1`` where it was sampled (position 0 is never
    scored: nothing predicts it). Sequences are right-padded in batches of
    ``batch_size``; log-softmaxes are taken in float64, ``chunk_rows``
    positions at a time (a full ``(batch, tokens, vocabulary)`` float64 copy
    of a large model's logits would not fit).
    """
    totals = _Totals()
    for ids, attention, scored in _batches(sequences, masks, batch_size, pad_id, _device(model_p)):
        logits_p = model_p(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logits_q = model_q(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logp, logq, exact = _token_terms(logits_p, logits_q, ids[:, 1:], chunk_rows)
        totals.add(logq - logp, scored, exact)
    return totals.estimate()


@torch.no_grad()
def kl_from_logprobs(model_q, sequences: Sequence[Sequence[int]] | torch.Tensor,
                     masks: Sequence[Sequence[int]] | torch.Tensor,
                     logprobs_p: Sequence[Sequence[float]] | torch.Tensor,
                     *, batch_size: int = 8, pad_id: int = 0, chunk_rows: int = 128) -> KLEstimate:
    """`policy_kl` when ``p`` is known only through ``logprobs_p[i][t] = log p(sequences[i][t])`` (where masked).

    The start model's sampler records exactly these, so the current policy
    alone is run; ``exact`` is ``nan``.
    """
    totals = _Totals()
    logp_rows = [torch.as_tensor(row, dtype=torch.float64) for row in logprobs_p]
    start = 0
    for ids, attention, scored in _batches(sequences, masks, batch_size, pad_id, _device(model_q)):
        rows = logp_rows[start:start + ids.shape[0]]
        start += ids.shape[0]
        logp = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
        for i, row in enumerate(rows):
            logp[i, :row.numel()] = row.to(ids.device)
        logits_q = model_q(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logq, _, _ = _token_terms(logits_q, None, ids[:, 1:], chunk_rows)
        totals.add(logq - logp[:, 1:], scored, None)
    return totals.estimate()


def _token_terms(logits_a: torch.Tensor, logits_b: torch.Tensor | None, targets: torch.Tensor, chunk_rows: int):
    """(log a(target), log b(target), KL(a ‖ b) over the vocabulary) per position, in float64 by chunks of rows.

    Without ``logits_b`` the last two are None.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    shape, vocab = targets.shape, logits_a.shape[-1]
    flat_a, flat_t = logits_a.reshape(-1, vocab), targets.reshape(-1, 1)
    flat_b = None if logits_b is None else logits_b.reshape(-1, vocab)
    picked_a, picked_b, exact = [], [], []
    for begin in range(0, flat_t.shape[0], chunk_rows):
        la = torch.log_softmax(flat_a[begin:begin + chunk_rows].double(), -1)
        picked_a.append(la.gather(-1, flat_t[begin:begin + chunk_rows]).squeeze(-1))
        if flat_b is not None:
            lb = torch.log_softmax(flat_b[begin:begin + chunk_rows].double(), -1)
            picked_b.append(lb.gather(-1, flat_t[begin:begin + chunk_rows]).squeeze(-1))
            exact.append((la.exp() * (la - lb)).sum(-1))
    empty = torch.zeros(shape, dtype=torch.float64, device=targets.device)
    a = torch.cat(picked_a).reshape(shape) if picked_a else empty
    if flat_b is None:
        return a, None, None
    b = torch.cat(picked_b).reshape(shape) if picked_b else empty
    return a, b, torch.cat(exact).reshape(shape) if exact else empty


@dataclass
class Samples:
    """Token ids the start model sampled (``masks`` 1 where sampled) with its log-probs there."""

    ids: list[list[int]]
    masks: list[list[int]]
    logprobs: list[list[float]]


def start_samples(trajectories: Mapping[str, Sequence[Any]], *,
                  per_experience: int | None = None) -> dict[str, Samples]:
    """Per test experience, the ``ids``/``mask``/``logprobs`` of its row-0 `Trajectory` objects.

    ``per_experience`` keeps the first episodes only (memory and time).
    Episodes that sampled nothing (an environment that failed at reset) are left out.
    """
    out = {}
    for name, episodes in trajectories.items():
        kept = [t for t in episodes if any(t.mask)][:per_experience]
        out[name] = Samples([list(t.ids) for t in kept], [list(t.mask) for t in kept],
                            [list(t.logprobs) for t in kept])
    return out


@torch.no_grad()
def score_samples(model, samples: Mapping[str, Samples], *, batch_size: int = 8,
                  pad_id: int = 0) -> dict[str, Samples]:
    """``samples`` with ``logprobs`` replaced by ``model``'s own (untempered) log-probs of the sampled tokens.

    The runner scores the start model's samples with the start model itself:
    `kl_to_start` then compares two forward passes of the same kind, so row 0
    is exactly 0 whatever the sampler (its temperature, top-p, numerics or
    engine). At temperature 1 and top-p 1 the result is ``KL(start ‖ policy)``;
    otherwise the tokens come from the tempered start distribution and the
    estimate is ``E_{x ~ tempered start}[log start(x) − log policy(x)]``.
    Position 0 is never scored (0.0), as in the sampler's own record.
    """
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        return {name: _scored(model, s, batch_size, pad_id) for name, s in samples.items()}
    finally:
        if was_training:
            model.train()


def _scored(model, samples: Samples, batch_size: int, pad_id: int) -> Samples:
    logprobs: list[list[float]] = []
    lengths = [len(row) for row in samples.ids]
    for ids, attention, scored in _batches(samples.ids, samples.masks, batch_size, pad_id, _device(model)):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        picked, _, _ = _token_terms(logits, None, ids[:, 1:], 128)
        picked = torch.where(scored, picked, torch.zeros_like(picked))
        for row in picked.cpu().tolist():
            length = lengths[len(logprobs)]
            logprobs.append([0.0] + row[:length - 1] if length else [])
    return Samples([list(r) for r in samples.ids], [list(m) for m in samples.masks], logprobs)


def save_samples(path: str | Path, samples: Mapping[str, Samples]) -> None:
    """Write samples as JSON (nothing loaded back runs code), atomically: a kill leaves the old file or none."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({name: asdict(s) for name, s in samples.items()}), encoding="utf-8")
    partial.replace(path)


def load_samples(path: str | Path) -> dict[str, Samples]:
    """Read what `save_samples` wrote."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {name: Samples(s["ids"], s["masks"], s["logprobs"]) for name, s in data.items()}


def kl_to_start(model, samples: Mapping[str, Samples], *, batch_size: int = 8,
                pad_id: int = 0) -> dict[str, KLEstimate]:
    """``KL(start ‖ model)`` per experience on the start model's own samples (`kl_from_logprobs`).

    The recorded log-probs are those of the start model's sampling
    distribution, so this is the KL to the start model itself when the
    evaluation samples at temperature 1 with top-p 1; otherwise it is the KL
    from that tempered distribution (load the start model and use `policy_kl`).
    """
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        return {name: kl_from_logprobs(model, s.ids, s.masks, s.logprobs, batch_size=batch_size, pad_id=pad_id)
                for name, s in samples.items() if s.ids}
    finally:
        if was_training:
            model.train()


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _batches(sequences, masks, batch_size: int, pad_id: int, device: torch.device):
    """(ids, attention mask, scored positions of ids[:, 1:]) per batch, right-padded."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    seqs = [torch.as_tensor(s, dtype=torch.long).flatten() for s in sequences]
    mask_rows = [torch.as_tensor(m).flatten().bool() for m in masks]
    if len(seqs) != len(mask_rows):
        raise ValueError(f"{len(seqs)} sequences but {len(mask_rows)} masks")
    for i, (s, m) in enumerate(zip(seqs, mask_rows)):
        if s.shape != m.shape:
            raise ValueError(f"sequence {i} has {s.numel()} tokens but its mask has {m.numel()}")
    for begin in range(0, len(seqs), batch_size):
        chunk, chunk_masks = seqs[begin:begin + batch_size], mask_rows[begin:begin + batch_size]
        width = max(s.numel() for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        scored = torch.zeros((len(chunk), width), dtype=torch.bool)
        for i, (s, m) in enumerate(zip(chunk, chunk_masks)):
            ids[i, :s.numel()], attention[i, :s.numel()], scored[i, :s.numel()] = s, 1, m
        yield ids.to(device), attention.to(device), scored[:, 1:].to(device)


class _Totals:
    """Per-sequence sums of the estimators' terms, for token means and sequence-clustered errors."""

    def __init__(self) -> None:
        self.k1: list[float] = []
        self.k2: list[float] = []
        self.k3: list[float] = []
        self.exact: list[float] = []
        self.counts: list[int] = []
        self.has_exact = True

    def add(self, ratio: torch.Tensor, scored: torch.Tensor, exact: torch.Tensor | None) -> None:
        weight = scored.double()
        ratio = torch.where(scored, ratio, torch.zeros_like(ratio))
        self.k1 += (-ratio * weight).sum(-1).tolist()
        self.k2 += (0.5 * ratio.pow(2) * weight).sum(-1).tolist()
        self.k3 += ((ratio.exp() - 1 - ratio) * weight).sum(-1).tolist()
        self.counts += scored.sum(-1).tolist()
        if exact is None:
            self.has_exact = False
        else:
            self.exact += (exact * weight).sum(-1).tolist()

    def estimate(self) -> KLEstimate:
        tokens = int(sum(self.counts))
        def mean(sums: list[float]) -> float:
            return sum(sums) / tokens if tokens else math.nan

        exact = mean(self.exact) if self.has_exact else math.nan
        return KLEstimate(mean(self.k1), mean(self.k2), mean(self.k3), exact, self._se(self.k1), self._se(self.k3),
                          tokens, sum(1 for n in self.counts if n))

    def _se(self, sums: list[float]) -> float:
        """Standard error of the ratio ``Σ sums / Σ counts`` over sequences (linearised)."""
        pairs = [(s, n) for s, n in zip(sums, self.counts) if n]
        m = len(pairs)
        if m < 2:
            return math.nan
        total = sum(n for _, n in pairs)
        ratio = sum(s for s, _ in pairs) / total
        spread = sum((s - ratio * n) ** 2 for s, n in pairs)
        return math.sqrt(spread * m / (m - 1)) / total


# --- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterChange:
    """How many scalar parameters moved beyond ``|a − b| > atol + rtol·|a|``, of ``total``."""

    changed: int
    total: int
    fraction: float
    atol: float
    rtol: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@torch.no_grad()
def parameter_change(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], *,
                     atol: float = 0.0, rtol: float = 0.0) -> ParameterChange:
    """The share of parameters that changed beyond the tolerance between two state dicts.

    Floating-point tensors only (buffers of integers are not parameters);
    a tensor stored under two names (tied embeddings) counts once. Both dicts
    must have the same names and shapes.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if set(before) != set(after):
        missing = sorted(set(before) ^ set(after))
        raise ValueError(f"the state dicts differ in their names: {', '.join(missing[:5])}")
    changed = total = 0
    seen: set[int] = set()
    for name, old in before.items():
        new = after[name]
        if old.shape != new.shape:
            raise ValueError(f"{name}: shape {tuple(old.shape)} before, {tuple(new.shape)} after")
        if not torch.is_floating_point(old) or new.data_ptr() in seen:
            continue
        seen.add(new.data_ptr())
        old64, new64 = old.detach().double().cpu(), new.detach().double().cpu()
        changed += int(((new64 - old64).abs() > atol + rtol * old64.abs()).sum())
        total += old.numel()
    return ParameterChange(changed, total, changed / total if total else math.nan, atol, rtol)


# --- correct-set turnover -------------------------------------------------------------------


@dataclass(frozen=True)
class Turnover:
    """Tasks solved before and failed after (``lost``), the reverse (``gained``), out of ``tasks`` in both."""

    lost: int
    gained: int
    kept: int
    never: int
    tasks: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def task_successes(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int, str], float]:
    """Per task ``(env, id, split)``: the success rate of its samples in trajectory records."""
    counts: dict[tuple[str, int, str], list[int]] = {}
    for record in records:
        task = record.get("task") or {}
        key = (str(task.get("env")), int(task.get("id", -1)), str(task.get("split")))
        counts.setdefault(key, [0, 0])
        counts[key][0] += bool(record.get("success"))
        counts[key][1] += 1
    return {key: wins / n for key, (wins, n) in counts.items()}


def turnover(before: Mapping[Any, float], after: Mapping[Any, float], *, threshold: float = 0.5) -> Turnover:
    """Correct-set turnover between two rows from per-task success rates.

    A task counts as solved at a row when its success rate is at least
    ``threshold`` (default: half its samples); only tasks present in both
    rows count.
    """
    common = [key for key in before if key in after]
    solved_before = {key for key in common if before[key] >= threshold}
    solved_after = {key for key in common if after[key] >= threshold}
    lost, gained = len(solved_before - solved_after), len(solved_after - solved_before)
    kept = len(solved_before & solved_after)
    return Turnover(lost, gained, kept, len(common) - lost - gained - kept, len(common))


def drift_row(kl: Mapping[str, KLEstimate] | None = None, params: ParameterChange | None = None) -> dict[str, Any]:
    """The ``"drift"`` entry of a results row (see the module docstring for its shape)."""
    out: dict[str, Any] = {}
    if kl is not None:
        out["kl"] = {name: estimate.to_dict() for name, estimate in kl.items()}
    if params is not None:
        out["params"] = params.to_dict()
    return out


# --- the runner's bookkeeping ------------------------------------------------------------------


class DriftTracker:
    """What each stage's ``"drift"`` entry is measured against: the start model's samples, the previous weights.

    ``previous`` is a CPU copy of ``model``'s trainable parameters as the last
    measured stage left them (at construction: the weights the model has
    then, the start model before stage 1 or a resumed run's checkpoint),
    replaced after every `measure`: one copy of the trainable weights is held.
    Frozen parameters cannot change and are not copied (LoRA: the adapter is
    what is compared). The start samples live in ``samples_path`` (JSON);
    when it is missing, `measure` gives no KL.
    """

    def __init__(self, model, samples_path: str | Path, *, pad_id: int = 0, batch_size: int = 8) -> None:
        self.model, self.path = model, Path(samples_path)
        self.pad_id, self.batch_size = pad_id, batch_size
        self.samples = load_samples(self.path) if self.path.is_file() else None
        self.previous = self._trainable()

    def keep_start_samples(self, trajectories: Mapping[str, Sequence[Any]]) -> None:
        """Keep the start model's row-0 episodes, scored by the model itself (`score_samples`), and save them."""
        self.samples = score_samples(self.model, start_samples(trajectories), batch_size=self.batch_size,
                                     pad_id=self.pad_id)
        save_samples(self.path, self.samples)

    def measure(self) -> dict[str, Any]:
        """The ``"drift"`` entry of the stage just trained; its weights become the next stage's baseline."""
        kl = None
        if self.samples:
            kl = kl_to_start(self.model, self.samples, batch_size=self.batch_size, pad_id=self.pad_id)
        current = self._trainable()
        params = parameter_change(self.previous, current)
        self.previous = current
        return drift_row(kl=kl, params=params)

    def _trainable(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters() if p.requires_grad}
