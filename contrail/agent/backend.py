"""Generation backends: turn a batch of token-id prompts into sampled continuations.

A backend returns the sampled ids themselves (never text) and the sampler's
log-probability of each, so the rollout can keep token-in/token-out
bookkeeping. ``HFBackend`` runs a Hugging Face causal LM with its KV cache on
CPU or GPU; ``contrail.agent.vllm.VLLMBackend`` plugs in behind the same
methods. After an optimizer update the trainer calls ``sync_weights(model)``
on the backend (``needs_weight_sync`` says whether it holds its own copy of the
weights); ``prepare_update()`` before it lets a backend free memory.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from contrail.agent.attention import decoding_attention
from contrail.agent.buffer_pool import refill_released_pages, release_free_pages, select_rows
from contrail.agent.kv_cache import GrowingLayer, growing_cache
from contrail.agent.packed_linear import packed_linears
from contrail.agent.packed_linear import supported as packing_supported
from contrail.allocator import hand_back_freed_memory
from contrail.models import forward_accepts


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One sampled continuation: ids, their log-probs, and whether a stop id ended it."""

    ids: list[int]
    logprobs: list[float]
    stopped: bool


class Backend(Protocol):
    """What the rollout needs from a generator.

    ``seeds``, when given, holds one sampling seed per prompt: each
    continuation is then drawn from its own seeded stream, so it depends on
    its prompt, its seed and the weights only, never on the other prompts of
    the call (up to floating-point rounding, which a batch's shape can move).
    Without them a backend samples from its own generator.
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]: ...


def sync_after_update(backend, model) -> None:
    """Make ``backend`` sample from ``model``'s current weights (backends without ``sync_weights``: nothing)."""
    sync = getattr(backend, "sync_weights", None)
    if sync is not None:
        sync(model)


def prepare_update(backend) -> None:
    """Let ``backend`` free memory before an optimizer update (vLLM's sleep mode)."""
    prepare = getattr(backend, "prepare_update", None)
    if prepare is not None:
        prepare()


def row_uniforms(seeds: list[int], steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``steps`` uniform numbers for each seed, shape ``(len(seeds), steps)``: row ``r`` is seed ``r``'s stream.

    A row's numbers depend on its seed only, so a prompt sampled with them
    gets the same continuation whatever else shares its batch, and two
    models given the same seed see the same numbers token by token (common
    random numbers: their samples differ where the models do, not where the
    draws did).
    """
    generator = torch.Generator()
    rows = [torch.rand(steps, generator=generator.manual_seed(seed)) for seed in seeds]
    return torch.stack(rows).to(device) if rows else torch.empty((0, steps), device=device)


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask logits outside the smallest set whose probability reaches ``top_p`` (nucleus)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(ids, log-probs under the sampling distribution)``.

    ``uniform`` (one number in [0, 1) per row, shape ``(rows, 1)``) replaces
    the draw from ``generator`` (see `draw`).
    """
    logits = logits.float()
    if params.temperature == 0:
        logprobs = logits.log_softmax(-1)
        ids = logits.argmax(-1)
    else:
        logits = logits / params.temperature
        if params.top_p < 1:
            logits = _filter_top_p(logits, params.top_p)
        logprobs = logits.log_softmax(-1)
        ids = draw(logprobs.exp(), generator, uniform)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One id per row, drawn with probability ``probs`` by inverting the cumulative distribution.

    One uniform number per row (from ``generator``, or ``uniform`` when
    given): ``torch.multinomial`` draws an exponential per vocabulary entry
    instead, a quarter of a CPU decode step at batch 64 over SmolLM2's
    49k-token vocabulary. One number per token also couples two models'
    samples: fed the same numbers, a model whose distribution moved a little
    mostly picks the same ids (`row_uniforms`). ``right=True`` never lands
    on a zero-probability id (a flat stretch of the distribution).
    """
    cdf = probs.cumsum(-1)
    if uniform is None:
        uniform = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    uniform = uniform.to(device=cdf.device, dtype=cdf.dtype)
    ids = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)  # rounding can leave the last cumulative value below the draw


@contextlib.contextmanager
def cast_once(model, enabled: bool = True) -> Iterator[None]:
    """Within an autocast block, each frozen fp32 weight of ``model`` is cast once, not at every forward.

    Autocast caches the cast copy of a weight only when the weight requires
    grad. Frozen weights (a LoRA run's base model, into which the adapter is
    merged while sampling) were cast again at every decode step: a copy of
    the whole model per generated token. Under ``no_grad`` marking them as
    requiring grad records nothing; they are unmarked on exit.
    """
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32] if enabled else []
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)


@dataclass
class _Session:
    """The KV cache of a batch of rows; kept across turns (see `_Parts`) so a next turn only prefills what is new.

    ``known[r]`` are the ids row ``r`` of the cache holds (real tokens only);
    ``attention`` marks real positions (left padding and the slots of rows
    that had already stopped are holes, masked out); ``next_position`` is
    each row's next position id.
    """

    cache: object
    attention: torch.Tensor
    next_position: torch.Tensor
    known: list[list[int]]

    def take(self, index: torch.Tensor) -> _Session:
        """A new session of rows ``index``, leaving this one as it is (its cache is copied, not changed)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for layer in cache.layers:
            layer.keys, layer.values = select_rows(layer.keys, index), select_rows(layer.values, index)
        return _Session(cache, self.attention[index], self.next_position[index],
                        [list(self.known[i]) for i in index.tolist()])

    def rows(self, start: int, end: int, length: int) -> _Session:
        """Rows ``start``..``end - 1`` over their first ``length`` positions, sharing this session's cache buffers:
        extending them writes into this session's cache (`GrowingLayer.rows`)."""
        cache = copy.copy(self.cache)
        cache.layers = [layer.rows(start, end, length) for layer in self.cache.layers]
        return _Session(cache, self.attention[start:end, :length], self.next_position[start:end],
                        self.known[start:end])


@dataclass
class _Parts:
    """A turn's kept cache still in the pieces its decode left (parked rows, the rows decoding to the end).

    A next turn reads the rows it extends straight from the pieces
    (`sources`), copying them once into its own cache (`_assembled`); after
    an episode's last turn the rollout drops the cache, and joining it then
    copied the whole cache for nothing, at the turn's memory peak.
    ``known[r]`` are row ``r``'s ids (sampled ids fed included), rows in the
    pieces' order; each piece's own ``known`` is set to its share.
    """

    pieces: list[_Session]
    known: list[list[int]]

    def __post_init__(self) -> None:
        start = 0
        for piece in self.pieces:
            end = start + len(piece.known)
            piece.known = self.known[start:end]
            start = end

    def match(self, prompts: list[list[int]]) -> list[int] | None:
        """For each prompt, the row whose cached ids it strictly extends; None if any has none."""
        rows, taken = [], set()
        for prompt in prompts:
            row = next((r for r, ids in enumerate(self.known) if r not in taken
                        and len(ids) < len(prompt) and prompt[: len(ids)] == ids), None)
            if row is None:
                return None
            rows.append(row)
            taken.add(row)
        return rows

    def sources(self, rows: list[int]) -> list[tuple[_Session, int]]:
        """Where each of ``rows`` (indices into ``known``) lies: ``(piece, row of the piece)``."""
        located = [(piece, row) for piece in self.pieces for row in range(len(piece.known))]
        return [located[row] for row in rows]


# Below this many shared ids, a separate batch-1 forward for the shared prefix costs more than it saves.
MIN_SHARED_PREFIX = 16
# Prompts sharing this many leading ids (an environment's instructions, not just the chat template's
# header) are prefilled as one cluster; every further cluster adds a forward and some padding.
CLUSTER_PREFIX = 64
# A turn's rows that have stopped leave the decode batch once they are this share of it and at least
# MIN_PARKED rows, while MIN_STEPS_LEFT or more steps may follow (`_worth_parking`).
PARK_SHARE = 0.25
MIN_PARKED = 4
MIN_STEPS_LEFT = 4
# What one more prefill bucket costs, in padded tokens (see `_length_buckets`).
BUCKET_OVERHEAD = 32
# A turn's new parts are prefilled in at most MAX_BUCKETS buckets, split only where that forwards a share
# of MIN_BUCKET_SAVING fewer tokens or more. With 6 buckets against 3, a batch of 64 BabyAI evaluation episodes
# (the quickstart's warm-started SmolLM2, bf16) took 40-44 s against 50-56 on a 2-core AVX512-BF16 EPYC:
# its observations run from one line to a room's description. More buckets saved nothing more, and a
# lower threshold (0.1, 0) no more either.
MAX_BUCKETS = 6
MIN_BUCKET_SAVING = 0.25


class HFBackend:
    """Batched sampling from a transformers causal LM with a KV cache kept across turns.

    Prompts are left-padded into one batch; rows that hit a stop id leave
    the decode batch once enough of them have (``park_stopped``), the others
    decoding on until every row is done or the token limit is reached.
    When the next call's prompts extend the previous call's (the next turn
    of the same episodes), the cache is kept: only the new tokens (template
    closing and observation) are prefilled, so a turn costs
    what it adds, not the whole history. Finished episodes' rows are dropped.
    A fresh batch prefills each distinct prompt once, after the prefix they
    all share (``share_prefix``: a group's identical prompts, an
    environment's instructions); a turn's new parts of very different lengths
    are prefilled in up to ``max_buckets`` buckets of similar lengths.
    On a CPU in bf16 its linear layers multiply with weights packed for
    oneDNN once per call (``pack_weights``, `contrail.agent.packed_linear`).
    Sampling uses its own seeded ``torch.Generator``: the same seed and
    prompts give the same samples. Given per-prompt ``seeds``, each row draws from its own stream
    instead (`row_uniforms`), and its continuation no longer depends on the rest of the batch.
    """

    def __init__(self, model, stop_ids: set[int] | frozenset[int], pad_id: int, seed: int = 0,
                 max_batch_size: int = 64, reuse_cache: bool = True, autocast_bf16: bool = False,
                 share_prefix: bool = True, decode_attention: bool = True, park_stopped: bool = True,
                 max_buckets: int = MAX_BUCKETS, pack_weights: bool = True):
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be at least 1, got {max_buckets}")
        self.model = model
        self.max_buckets = max_buckets  # a turn's new parts are prefilled in at most this many length buckets
        self.park_stopped = park_stopped  # stopped rows leave the decode batch (see `_decode`)
        self.share_prefix = share_prefix  # prefill shared prompt prefixes once (see `_prefill`)
        self.decode_attention = decode_attention  # CPU decode steps attend directly (`contrail.agent.attention`)
        self.pack_weights = pack_weights  # CPU bf16 linears on weights packed per call (`packed_linear`)
        self.stop_ids = frozenset(stop_ids)
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.reuse_cache = reuse_cache
        # bf16 matrix products on fp32 weights (a training model): 4x faster on CPUs with
        # AVX512-BF16, and what GPUs train with; weights are cast once per call (autocast cache,
        # frozen ones included: `cast_once`).
        self.autocast_bf16 = autocast_bf16
        self.generator = torch.Generator(device=self._device())
        self.generator.manual_seed(seed)
        self._session: _Parts | None = None  # the last turn's cache, for a next turn to extend
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept both.
        self._cache_arg = "cache" if forward_accepts(model, "cache") else "past_key_values"
        self._keep_arg = "logits_to_keep" if forward_accepts(model, "logits_to_keep") else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reseed(self, seed: int) -> None:
        """Restart sampling from ``seed`` (same prompts then give the same samples)."""
        self.generator.manual_seed(seed)

    def generator_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_generator_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def reset_cache(self) -> None:
        """Forget the kept KV cache (e.g. after the weights changed)."""
        self._session = None

    needs_weight_sync = False  # it samples from the training model itself

    # A GRPO step alternates two phases that allocate differently: sampling's KV caches come from the buffer
    # pool (`contrail.agent.buffer_pool`), the update's activations from malloc's heap. Where freed memory is
    # kept (`contrail.allocator`), each would hold the other's freed pages through its own peak: bench (b)'s
    # step on the quickstart's 6 x 8 peaked at 5.1 GB, 3.4 GB with the pages handed back (README).

    def sync_weights(self, model=None) -> None:
        """Nothing to copy (the backend runs the model itself); the kept KV cache is stale, so drop it, hand
        the heap's freed pages (the update's activations) back, and back the pool's again with them at once."""
        self.reset_cache()
        hand_back_freed_memory()
        refill_released_pages()

    def prepare_update(self) -> None:
        """Drop the KV cache and hand its pool's pages back: the update allocates from the heap, not the pool."""
        self.reset_cache()
        release_free_pages()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt (``seeds``: one stream per prompt, see `Backend`)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        if len(prompts) <= self.max_batch_size:
            return self._generate_batch(prompts, params, seeds)
        # Too many for one batch: chunks of similar lengths, without a kept cache.
        self._session = None
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        by_index: dict[int, Generation] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            chunk_seeds = [seeds[i] for i in chunk] if seeds is not None else None
            for index, generation in zip(chunk, self._generate_batch([prompts[i] for i in chunk], params,
                                                                     chunk_seeds)):
                by_index[index] = generation
            self._session = None
        return [by_index[i] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        seeds: list[int] | None = None) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        autocast = torch.autocast(self._device().type, dtype=torch.bfloat16, enabled=self.autocast_bf16)
        try:
            decoding = decoding_attention(self.model) if self.decode_attention else contextlib.nullcontext()
            packing = packed_linears(self.model, enabled=self.pack_weights
                                     and packing_supported(self.model, self.autocast_bf16))
            with autocast, cast_once(self.model, enabled=self.autocast_bf16), decoding, packing:
                kept, self._session = self._session, None
                rows = kept.match(prompts) if (self.reuse_cache and kept) else None
                if rows is None:
                    kept = None  # not extended: its memory is free before the prefill
                    session, logits, order = self._prefill(prompts)
                else:
                    sources, kept = kept.sources(rows), None
                    session, logits, order = self._extend(sources, prompts)  # empties ``sources``: pieces freed
                generations = self._decode(session, prompts, logits, params, seeds, order)
        finally:
            if was_training:
                self.model.train()
        return generations

    def _forward(self, input_ids, attention, positions, cache=None):
        kwargs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "use_cache": True}
        # A fresh batch gets a cache that appends in place (`contrail.agent.kv_cache`), not by concatenation.
        kwargs[self._cache_arg] = cache if cache is not None else growing_cache()
        if self._keep_arg:
            kwargs[self._keep_arg] = 1  # only the last position's logits are needed
        out = self.model(**kwargs)
        return _cache_of(out), out.logits[:, -1]

    def _prefill(self, prompts: list[list[int]]) -> tuple[_Session, torch.Tensor, list[int]]:
        """Prefill a fresh batch, computing what prompts share only once; returns `_extend`'s triple.

        A step's episodes come in groups of identical prompts, and every
        prompt of an environment opens with the same instructions. So the
        distinct prompts are prefilled once each (their rows copied out
        afterwards), in clusters of prompts that share a long prefix (one
        environment's): a cluster's shared prefix is prefilled once, at batch
        size 1, then each prompt's rest. The clusters' caches are joined
        left-padded, as a plain batch is. The cache then holds what a
        row-by-row prefill would (up to floating-point rounding). One cluster
        of distinct prompts (an evaluation batch) is returned in the order
        its buckets left it, uncopied.
        """
        distinct, row_of = _distinct(prompts)
        clusters = _prefix_clusters(distinct) if self.share_prefix else [list(range(len(distinct)))]
        parts = [self._prefill_cluster([distinct[i] for i in cluster]) for cluster in clusters]
        if len(parts) == 1 and len(distinct) == len(prompts):  # no repeats: distinct index == prompt index
            session, logits, order = parts[0]
            return session, logits, [clusters[0][row] for row in order]
        place = {clusters[c][d]: (c, row) for c, (_, _, order) in enumerate(parts) for row, d in enumerate(order)}
        session, logits = _assembled_with_logits([part[:2] for part in parts], [place[d] for d in row_of])
        return session, logits, list(range(len(prompts)))

    def _prefill_cluster(self, prompts: list[list[int]]) -> tuple[_Session, torch.Tensor, list[int]]:
        """Prefill ``prompts``, their shared prefix once when it is long enough to pay for its own forward."""
        head = min(_common_prefix_length(prompts), min(len(p) for p in prompts) - 1)  # each keeps a token
        if not self.share_prefix or len(prompts) < 2 or head < MIN_SHARED_PREFIX:
            return (*self._prefill_rows(prompts), list(range(len(prompts))))
        session, _ = self._prefill_rows([prompts[0][:head]])
        return self._extend([(session, 0)] * len(prompts), prompts)

    def _prefill_rows(self, prompts: list[list[int]]) -> tuple[_Session, torch.Tensor]:
        device = self._device()
        input_ids, attention = _left_padded(prompts, self.pad_id)
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache, logits = self._forward(input_ids, attention, positions)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        return _Session(cache, attention, lengths, [list(p) for p in prompts]), logits

    def _extend(self, sources: list[tuple[_Session, int]], prompts: list[list[int]]
                ) -> tuple[_Session, torch.Tensor, list[int]]:
        """Prefill only each prompt's new tokens, after the cached row it extends (``sources[i]``: session, row).

        Returns the extended session, its rows' next-token logits, and for
        each of its rows the index of the prompt it holds: rows come bucket
        by bucket. New parts of very different lengths (a one-line
        observation beside a room description) are prefilled in a few
        buckets of similar lengths, so short rows are not padded to the
        longest. Every row is first copied once from where it lies into one
        cache (`_assembled`), each bucket's rows ending where that bucket's
        new tokens begin; each bucket's forward then writes its new tokens
        into that cache in place (`GrowingLayer.rows`). Joining the buckets'
        caches afterwards was a second copy of the whole cache, into fresh
        memory: without it the quickstart's evaluation row took 0.94x the
        time on a 2-core EPYC (165 against 156 s, alternating). When
        all rows are one session's, in order, with room to spare, the
        session is extended where it lies, no copy at all. ``sources`` is
        emptied once read, and the sessions it points into are let go layer
        by layer as they are copied.
        """
        new_lengths = [len(p) - len(session.known[row]) for p, (session, row) in zip(prompts, sources)]
        buckets = _length_buckets(new_lengths, self.max_buckets) if self.share_prefix else [list(range(len(prompts)))]
        if len(buckets) == 1 and (session := _in_place(sources, max(new_lengths))) is not None:
            sources.clear()
            return (*self._extend_rows(session, prompts), list(range(len(prompts))))
        order = [i for bucket in buckets for i in bucket]
        rooms = [max(new_lengths[i] for i in bucket) for bucket in buckets]
        widths = [_width([sources[i] for i in bucket]) for bucket in buckets]  # each bucket's history, padded
        total = max(width + room for width, room in zip(widths, rooms))  # every row's width once extended
        ends = [total - room for room in rooms]  # where each bucket's history ends and its new tokens begin
        row_ends = [end for bucket, end in zip(buckets, ends) for _ in bucket]
        ordered = [sources[i] for i in order]
        sources.clear()
        joint = _assembled(ordered, room=min(rooms), release=_distinct_sessions(ordered), ends=row_ends)
        del ordered  # the sessions' last references: their memory is already let go layer by layer
        parts, first = [], 0
        for bucket, end in zip(buckets, ends):
            part = joint.rows(first, first + len(bucket), end)
            parts.append(self._extend_rows(part, [prompts[i] for i in bucket]))
            first += len(bucket)
        return (*_joined_in_place(joint, parts), order)

    def _extend_rows(self, session: _Session, prompts: list[list[int]]) -> tuple[_Session, torch.Tensor]:
        """`_extend` in one batch: row ``i`` of ``session`` extended to ``prompts[i]``, new tokens left-padded."""
        device = self._device()
        new = [p[len(known):] for p, known in zip(prompts, session.known)]
        input_ids, block = _left_padded(new, self.pad_id)
        input_ids, block = input_ids.to(device), block.to(device)
        positions = session.next_position[:, None] + (block.cumsum(-1) - 1).clamp(min=0)
        attention = torch.cat([session.attention, block], dim=1)
        cache, logits = self._forward(input_ids, attention, positions, session.cache)
        lengths = session.next_position + block.sum(-1)
        return _Session(cache, attention, lengths, [list(p) for p in prompts]), logits

    def _decode(self, session: _Session, prompts, logits, params: SamplingParams,
                seeds: list[int] | None = None, order: list[int] | None = None) -> list[Generation]:
        """Sample up to ``params.max_new_tokens`` ids for every row of ``session``, from ``logits`` on.

        Row ``r`` of ``session`` holds prompt ``order[r]`` (prompt ``r``
        without ``order``); the generations come back in prompt order.

        Rows that have stopped leave the batch once there are enough of them
        (`_worth_parking`): their caches are set aside as they are and the
        other rows decode on without them, so a turn's last steps run over the
        few rows still writing, not over the whole batch. The parts are kept
        as they are (`_Parts`), joined only if a next turn extends them (its
        rows in any order: the next turn matches prompts to rows by their
        ids). A row's samples never depend on which rows share its step.
        """
        device = self._device()
        count, limit = len(prompts), params.max_new_tokens
        sampling = params.temperature > 0
        uniforms = row_uniforms(seeds, limit, device) if seeds is not None and sampling else None
        sampled = torch.full((count, limit), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((count, limit), device=device)
        fed = torch.zeros(count, dtype=torch.long, device=device)  # sampled ids now in each prompt's cache
        # the prompt each row of the decode batch samples for
        rows = torch.tensor(order, device=device) if order is not None else torch.arange(count, device=device)
        done = torch.zeros(count, dtype=torch.bool, device=device)
        parked: list[tuple[torch.Tensor, _Session]] = []
        stop = torch.tensor(sorted(self.stop_ids), device=device)
        cache, attention, position = session.cache, session.attention, session.next_position
        steps = 0
        for step in range(limit):
            uniform = self._uniform(uniforms, rows, step, count) if sampling else None
            ids, lps = sample_next(logits, params, self.generator, uniform)
            ids = torch.where(done, torch.full_like(ids, self.pad_id), ids)
            sampled[rows, step], logprobs[rows, step] = ids, lps
            steps = step + 1
            real = ~done  # this step's token is a real sample for rows not yet done
            done = done | torch.isin(ids, stop)
            # After the last step nothing reads the logits: the next turn prefills these ids if it continues.
            if bool(done.all()) or steps == limit:
                break
            if self.park_stopped and _worth_parking(done, limit - steps):
                # A just-stopped row leaves before its stop id is fed: the next turn prefills it (`fed` says so).
                stopped, going = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
                in_flight = _Session(cache, attention, position, [prompts[r] for r in rows.tolist()])
                parked.append((rows[stopped], in_flight.take(stopped)))
                cache.batch_select_indices(going)
                attention, position, rows, ids, real = (t[going] for t in (attention, position, rows, ids, real))
                logits, done = logits[going], done[going]
            attention = torch.cat([attention, real.long()[:, None]], dim=1)
            cache, logits = self._forward(ids[:, None], attention, position[:, None], cache)
            position = position + real.long()
            fed[rows] += real.long()
        generations = self._unpack(sampled[:, :steps].tolist(), logprobs[:, :steps].tolist())
        if self.reuse_cache:
            parts = parked + [(rows, _Session(cache, attention, position, [prompts[r] for r in rows.tolist()]))]
            held = torch.cat([part_rows for part_rows, _ in parts]).tolist()  # the prompt each kept row holds
            self._session = _Parts([part for _, part in parts], [list(prompts[r]) + generations[r].ids[:n]
                                                                  for r, n in zip(held, fed[held].tolist())])
        else:
            self._session = None
        return generations

    def _uniform(self, uniforms: torch.Tensor | None, rows: torch.Tensor, step: int, count: int) -> torch.Tensor:
        """One uniform number per row of the decode batch: its prompt's seeded stream, or the backend's own.

        The backend's generator draws one number for every prompt of the call
        at every step, parked rows included, so the numbers a row gets never
        depend on which rows are still decoding.
        """
        if uniforms is not None:
            return uniforms[rows, step:step + 1]
        return torch.rand((count, 1), generator=self.generator, device=rows.device)[rows]

    def _unpack(self, rows: list[list[int]], logprob_rows: list[list[float]]) -> list[Generation]:
        generations = []
        for ids, lps in zip(rows, logprob_rows):
            end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), None)
            keep = end if end is not None else len(ids)
            generations.append(Generation(ids[:keep], lps[:keep], stopped=end is not None))
        return generations


def _distinct(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order, and for each prompt the index of its distinct one."""
    first: dict[tuple[int, ...], int] = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    distinct = [list(key) for key in first]
    return distinct, row_of


def _prefix_clusters(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of ``prompts`` in clusters whose members share at least `CLUSTER_PREFIX` leading ids.

    Sorted prompts put those sharing a prefix side by side, so one pass
    groups them (each cluster's members share the prefix of its first).
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    clusters: list[list[int]] = []
    for index in order:
        if clusters and _common_prefix_length([prompts[clusters[-1][0]], prompts[index]]) >= CLUSTER_PREFIX:
            clusters[-1].append(index)
        else:
            clusters.append([index])
    return clusters


def _length_buckets(lengths: list[int], max_buckets: int = MAX_BUCKETS,
                    min_saving: float = MIN_BUCKET_SAVING) -> list[list[int]]:
    """Indices of ``lengths`` in at most ``max_buckets`` groups of similar lengths (one group unless that saves).

    Each group is padded to its longest and counted `BUCKET_OVERHEAD` more
    (a forward and a copy of its rows' cache). The groups are runs of the
    sorted lengths; the split forwarding the fewest tokens is found by
    dynamic programming, and taken only when it cuts one group's total by
    ``min_saving`` or more.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ranked = [lengths[i] for i in order]
    n = len(ranked)
    padded = lambda begin, end: (end - begin) * ranked[end - 1] + BUCKET_OVERHEAD  # noqa: E731 - rows begin..end-1
    # fewest[end]: (tokens, bounds) of the best split of ranked[:end] into g groups (fewer where end < g),
    # for g = 1, 2, ... max_buckets in turn; best: the best split of all n rows so far
    fewest = [(padded(0, end), [end]) if end else (0, []) for end in range(n + 1)]
    best = fewest[n]
    for _ in range(2, max_buckets + 1):
        fewest = [fewest[0]] + [min((fewest[begin][0] + padded(begin, end), fewest[begin][1] + [end])
                                    for begin in range(1, end)) if end > 1 else fewest[end]
                                for end in range(1, n + 1)]
        best = min(best, fewest[n])
    if best[0] > (1 - min_saving) * padded(0, n):
        return [list(range(n))]
    bounds = [0, *best[1]]
    return [order[begin:end] for begin, end in zip(bounds, bounds[1:])]


def _assembled(sources: list[tuple[_Session, int]], room: int = 0, release: list[_Session] = (),
               ends: list[int] | None = None) -> _Session:
    """One session of the rows ``sources`` names (``(session, row)``, in order, repeats allowed).

    Every layer's rows are copied once, left-padded to the widest source (or
    to end at ``ends[i]``, the session then as wide as the largest), into
    a buffer with room for ``room`` more positions (`GrowingLayer.assemble`).
    The sessions in ``release`` are read for the last time: each of their
    layers is let go as soon as it is copied, so the new cache never sits
    beside the whole of the old one (a turn's peak memory), and the old
    layers' memory is there for the next layers' buffers. They are unusable afterwards.
    """
    sessions = _distinct_sessions(sources)
    ends = ends or [_width(sources)] * len(sources)
    width = max(ends)
    cache = copy.copy(sessions[0].cache)
    cache.layers = []
    for number in range(len(sessions[0].cache.layers)):
        layer = GrowingLayer()
        layer.assemble([(session.cache.layers[number], row) for session, row in sources], width, room, ends)
        cache.layers.append(layer)
        for session in release:
            session.cache.layers[number] = None  # its last reference: the memory is free for the next layer
    attention = torch.stack([_right_pad(_left_pad(session.attention[row], end, dim=-1), width)
                             for (session, row), end in zip(sources, ends)])
    positions = torch.stack([session.next_position[row] for session, row in sources])
    known = [list(session.known[row]) for session, row in sources]
    return _Session(cache, attention, positions, known)


def _width(sources: list[tuple[_Session, int]]) -> int:
    """The widest of the sessions ``sources`` reads from, in positions."""
    return max(session.attention.shape[1] for session in _distinct_sessions(sources))


def _joined_in_place(joint: _Session, parts: list[tuple[_Session, torch.Tensor]]) -> tuple[_Session, torch.Tensor]:
    """``joint`` extended by ``parts``: its consecutive row ranges (`_Session.rows`), each extended in place,
    with their logits. Nothing is copied but the small masks and positions."""
    for part, _ in parts:
        if not all(layer.writes_into(whole) for layer, whole in zip(part.cache.layers, joint.cache.layers)):
            raise RuntimeError("a prefill bucket's cache left the joint buffer: its new tokens would be lost")
    for layer in joint.cache.layers:
        layer.filled(parts[0][0].attention.shape[1])  # the buckets filled every row up to the same width
    session = _Session(joint.cache, torch.cat([part.attention for part, _ in parts]),
                       torch.cat([part.next_position for part, _ in parts]),
                       [known for part, _ in parts for known in part.known])
    return session, torch.cat([logits for _, logits in parts])


def _in_place(sources: list[tuple[_Session, int]], room: int) -> _Session | None:
    """The session itself when ``sources`` are all its rows in order and every layer's buffer has room for
    ``room`` more positions (a next turn then appends in place, no copy); else None."""
    session = sources[0][0]
    if len(sources) != len(session.known) or any(s is not session or r != i for i, (s, r) in enumerate(sources)):
        return None
    if all(isinstance(layer, GrowingLayer) and layer.spare() >= room for layer in session.cache.layers):
        return session
    return None


def _assembled_with_logits(parts: list[tuple[_Session, torch.Tensor]],
                           places: list[tuple[int, int]]) -> tuple[_Session, torch.Tensor]:
    """`_assembled` from ``parts`` (sessions with their next-token logits): row ``i`` is part ``places[i][0]``'s
    row ``places[i][1]``."""
    sources = [(parts[part][0], row) for part, row in places]
    session = _assembled(sources, release=_distinct_sessions(sources))  # the parts are this join's alone
    return session, torch.stack([parts[part][1][row] for part, row in places])


def _distinct_sessions(sources: list[tuple[_Session, int]]) -> list[_Session]:
    """The sessions ``sources`` reads from, each once, in order of first use."""
    return list({id(session): session for session, _ in sources}.values())


def _worth_parking(done: torch.Tensor, steps_left: int) -> bool:
    """Whether the decode batch's stopped rows (``done``) should leave it before the next step.

    Moving them out copies the batch's caches once; it pays when enough
    rows stop decoding pad tokens for enough further steps.
    """
    stopped = int(done.sum())
    return steps_left >= MIN_STEPS_LEFT and stopped >= max(MIN_PARKED, PARK_SHARE * done.numel())


def _right_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` (last dimension the positions) with zeros after it up to ``width`` positions."""
    return torch.nn.functional.pad(mask, (0, width - mask.shape[-1]))


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _common_prefix_length(sequences: list[list[int]]) -> int:
    """How many leading ids every sequence shares."""
    shortest = min(len(s) for s in sequences)
    for position in range(shortest):
        token = sequences[0][position]
        if any(s[position] != token for s in sequences):
            return position
    return shortest


def _left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention)`` with every sequence right-aligned (left padding)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
            attention[row, width - len(sequence):] = 1
    return ids, attention
