"""Sampling: from one step's logits to the tokens each sequence keeps (chapter 09).

Chapter 06's engine decoded greedily. This module gives it everything else a request can ask for
(``SamplingParams``, chapter 06, names the fields):

* Filters, public functions of logits ``[N, V]`` and per-row parameters: ``apply_penalties``,
  ``apply_top_k``, ``apply_top_p``, ``apply_min_p``. ``probs_from_logits`` applies temperature
  and the filters and returns the distribution a row is sampled from, which is also what
  speculative decoding (chapter 10) verifies guesses against.
* ``Sampler.__call__``: one token per row, on the device, without a host sync:
  penalties -> greedy rows take the argmax -> temperature -> top-k -> top-p -> min-p -> sample,
  plus logprobs when a row asks for them. Its stages are public for chapter 10's verification,
  which samples from the same distributions with another rule: ``Sampler.rows`` checks the
  arguments and applies the penalties, and the ``LogitRows`` it returns give the distributions
  (``probs``), the race's draws (``exponentials``) and the output with its logprobs (``output``,
  the one place they are computed).
* ``Sampler.restrict``: what a request does to its logits before anything else, per row: its
  ``logit_bias``, its stops forbidden while it has fewer than ``min_tokens`` tokens, and the mask
  of its grammar (``structured_outputs``), which constrained decoding (chapter 09b) plugs in
  through the ``TokenMask`` protocol defined here. Rows of requests that ask for none of these
  are not touched, and a batch without any such request is not even copied.
* ``Sampler.sample``: the engine's sample stage (chapter 06's ``TokenSampler``): ``restrict``,
  then each sequence's rows through ``__call__`` (``step_arguments``), one host sync, then
  ``greedy.accepted_prefix`` per sequence (greedy guesses are verified by comparison; sampled
  ones by chapter 10's ``SpeculativeDecoder``, through ``rows``).

Invariants:

* **One host sync per step.** Nothing here waits for the device: per-row parameters travel
  host -> device through pinned memory without blocking, filters are batched tensor ops over
  per-row parameter tensors (no ``.item()``, no boolean-mask indexing, no Python loop over rows
  for the filters), and every decision that depends on a value (is any row greedy? does any row
  use top-k?) is taken from the ``SamplingParams`` on the host. The step's single sync is
  reading the result: ``SamplerOutput.to_host()``.
* **A seeded row does not depend on the batch around it.** Sampling is the exponential race
  (``argmax(probs / q)`` with ``q ~ Exp(1)``, equivalent to the Gumbel-max trick). A seeded
  request owns its ``torch.Generator`` (``make_generator``), which draws that row's ``q`` of
  shape ``[V]`` and advances by exactly one such draw per sampled row. Unseeded rows share one
  draw from the sampler's own generator. So a seeded request alone and inside a busy batch
  produce the same tokens from the same logits (the model's logits themselves may differ in the
  last bits between batch shapes; that is the model's business, not the sampler's).

Ties are kept: top-k keeps every token tied with the k-th largest logit, top-p keeps every
token tied with the least likely token of the nucleus. That makes each filter a function of
the row's values alone, independent of how a sort happened to order equal entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from mini_infer.device import to_device
from mini_infer.greedy import SampledTokens, argmax_rows, keep_per_sequence
from mini_infer.model_runner import ForwardBatch
from mini_infer.outputs import TokenLogprob
from mini_infer.sampling_params import SamplingParams, make_generator
from mini_infer.sequence import Sequence as Seq

__all__ = [
    "LogitRows",
    "Sampler",
    "TokenMask",
    "SamplerOutput",
    "SamplingParams",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_p",
    "exponential_race",
    "make_generator",
    "probs_from_logits",
]


def apply_penalties(
    logits: Tensor,
    prompt_counts: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Repetition penalty on tokens seen in the prompt or output, then OpenAI's presence and
    frequency penalties on tokens of the output. Counts are ``[N, V]``, penalties ``[N]``."""
    # student: begin chapter 09: repetition penalty (CTRL's rule), then presence and frequency penalties
    seen = (prompt_counts > 0) | (output_counts > 0)
    r = repetition_penalty.unsqueeze(1)
    # Dividing a positive logit and multiplying a negative one both make the token less likely
    # (CTRL's rule); a plain division would make negative logits more likely.
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    # student: end


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int | None = None) -> Tensor:
    """Keep each row's ``top_k`` largest logits (and any tied with the k-th). ``top_k < 1``
    disables the filter for that row; ``top_k`` above the vocabulary is clamped.

    ``max_k``, when given, must be at least every enabled row's ``top_k`` (the sampler knows it
    from the requests): the k-th largest value then comes from ``topk(max_k)`` instead of a sort
    of the whole row, which for a 151,936-token vocabulary and k = 50 is many times cheaper.
    """
    # student: begin chapter 09: keep each row's top_k largest logits and their ties; top_k < 1 keeps all
    vocab = logits.shape[-1]
    disabled = (top_k < 1) | (top_k >= vocab)
    width = vocab if max_k is None else max(1, min(max_k, vocab))
    k = top_k.clamp(min=1, max=width)
    kth_largest = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth_largest = kth_largest.masked_fill(disabled.unsqueeze(1), -math.inf)
    return logits.masked_fill(logits < kth_largest, -math.inf)
    # student: end


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    nucleus), plus any token tied with the least likely member. ``top_p >= 1`` keeps all."""
    # student: begin chapter 09: keep the nucleus: the fewest most likely tokens whose mass reaches top_p
    probs = logits.softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    # A token belongs to the nucleus while the mass strictly before it is still below top_p; the
    # first token always does (mass 0 before it), so no row is ever left empty.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # clamp: a top_p that rounds to 0 in float32 (say 1e-300) still keeps the top token.
    in_nucleus = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_probs.gather(1, in_nucleus - 1)
    # top_p == 1 must keep everything, even if float32 rounding lets the cumsum reach 1 early.
    threshold = threshold.masked_fill(top_p.unsqueeze(1) >= 1, 0.0)
    return logits.masked_fill(probs < threshold, -math.inf)
    # student: end


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens at least ``min_p`` times as likely as the row's most likely token."""
    # student: begin chapter 09: keep tokens at least min_p times as likely as the row's most likely one
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -math.inf)
    # student: end


def _temperatures(params_list: Sequence[SamplingParams]) -> list[float]:
    # Greedy rows divide by 1: their tokens come from the argmax, and their logprobs (if asked)
    # from the model's own distribution.
    return [1.0 if p.greedy else p.temperature for p in params_list]


def probs_from_logits(logits: Tensor, params_list: Sequence[SamplingParams]) -> Tensor:
    """The distribution each row is sampled from: float32 ``[N, V]`` after temperature, top-k,
    top-p and min-p; greedy rows are one-hot on the argmax. Penalties are not applied here (they
    need the tokens seen so far): apply ``apply_penalties`` to ``logits`` first if a row has any.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params_list):
        raise ValueError(
            f"logits must be [N, V] with N = len(params_list) = {len(params_list)}, got shape {tuple(logits.shape)}"
        )
    device = logits.device
    raw = logits.to(torch.float32)
    scaled = raw / to_device(_temperatures(params_list), torch.float32, device).unsqueeze(1)
    # The filters are skipped when no row uses them: a host-side decision from the params, so
    # the common case (plain temperature sampling) pays for no sort.
    if any(p.top_k != -1 for p in params_list):
        # Capped before the tensor is built: a top_k beyond int64 is simply "everything".
        top_ks = [min(p.top_k, 2**31 - 1) for p in params_list]
        enabled = [k for k in top_ks if 0 < k < scaled.shape[-1]]
        if enabled:
            scaled = apply_top_k(scaled, to_device(top_ks, torch.long, device), max_k=max(enabled))
    if any(p.top_p < 1.0 for p in params_list):
        scaled = apply_top_p(scaled, to_device([p.top_p for p in params_list], torch.float32, device))
    if any(p.min_p > 0.0 for p in params_list):
        scaled = apply_min_p(scaled, to_device([p.min_p for p in params_list], torch.float32, device))
    probs = scaled.softmax(dim=-1)
    if any(p.greedy for p in params_list):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(raw).unsqueeze(1), 1.0)
        greedy = to_device([p.greedy for p in params_list], torch.bool, device).unsqueeze(1)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def exponential_race(probs: Tensor, exponentials: Tensor) -> Tensor:
    """One token per row of ``probs``, given ``exponentials`` of the same shape drawn from Exp(1)."""
    # student: begin chapter 09: one token per row: the argmax of probs / exponentials
    # P(argmax_i p_i / q_i = j) = p_j when q_i ~ Exp(1): q_i / p_i ~ Exp(rate p_i), and the
    # smallest of independent exponentials is j with probability p_j / sum(p). Tokens with
    # p = 0 can never win, and a one-hot row always returns its hot token. The clamp guards
    # against an exponential draw of exactly 0 (0 / 0 would be NaN).
    return (probs / exponentials.clamp_min(torch.finfo(exponentials.dtype).tiny)).argmax(dim=-1)
    # student: end


@dataclass(slots=True)
class SamplerOutput:
    """One step's tokens, on the device until ``to_host``.

    ``logprobs`` and the top alternatives are present when any row asked for logprobs. They are
    computed from log_softmax(penalised logits / temperature): the distribution after
    penalties and temperature but before top-k/top-p/min-p (so alternatives outside the
    filters keep finite values); greedy rows use temperature 1. ``top_token_ids`` and
    ``top_logprobs`` have K = min(largest ``logprobs`` asked in the batch, V) columns, sorted
    from most likely; a row that asked for k keeps the first k.
    """

    token_ids: Tensor  # [N] long
    logprobs: Tensor | None = None  # [N] float32: log-probability of each chosen token
    top_token_ids: Tensor | None = None  # [N, K] long
    top_logprobs: Tensor | None = None  # [N, K] float32
    num_logprobs: list[int | None] = field(default_factory=list)  # each row's params.logprobs
    accepted: Tensor | None = None  # [N] bool: the row's guessed token was kept (chapter 10's verification)

    def to_host(self) -> SamplerOutput:
        """Copy everything to the CPU with a single host sync (the step's one)."""
        device = self.token_ids.device
        if device.type == "cpu":
            return self
        # On CUDA, queue every copy without waiting, then wait once. (Elsewhere, e.g. MPS,
        # a plain copy per tensor: correct, though each one waits.)
        non_blocking = device.type == "cuda"
        host = replace(self)
        for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "accepted"):
            if (tensor := getattr(self, name)) is not None:
                setattr(host, name, tensor.to("cpu", non_blocking=non_blocking))
        if non_blocking:
            torch.cuda.current_stream(device).synchronize()
        return host

    def to_token_logprobs(self) -> list[TokenLogprob | None]:
        """One ``TokenLogprob`` per row that asked for logprobs (None for the others), each with
        that row's own k alternatives. Reading the logprobs costs a host sync of its own unless
        ``to_host()`` came first."""
        host = self.to_host()
        if host.logprobs is None or host.top_token_ids is None or host.top_logprobs is None:
            return [None] * len(self.num_logprobs)
        tokens = host.token_ids.tolist()
        chosen, top_ids, top_values = host.logprobs.tolist(), host.top_token_ids.tolist(), host.top_logprobs.tolist()
        return [
            None
            if k is None
            else TokenLogprob(tokens[i], chosen[i], dict(zip(top_ids[i][:k], top_values[i][:k], strict=True)))
            for i, k in enumerate(self.num_logprobs)
        ]


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """``[N, V]`` float32 counts of each token id per row, built with one host -> device copy."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id V, counted into a column that is dropped: no masking needed.
    padded = [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = to_device(padded, torch.long, device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


# ``Sampler.__call__``'s arguments for one step's rows: logits, params, generators, token histories.
RowArguments = tuple[
    Tensor, list[SamplingParams], list[torch.Generator | None], list[list[int]] | None, list[list[int]] | None
]


@dataclass(slots=True)
class LogitRows:
    """Logit rows on their way to tokens (``Sampler.rows``): restricted and penalised, with each
    row's params and generator. What a row is sampled from is ``probs()``; the race's draws are
    ``exponentials()``; ``output`` adds the logprobs of the chosen tokens, when a row asks."""

    logits: Tensor  # [N, V] float32, penalised (the model's own when every row is plain greedy)
    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # a seeded row's own; None: ``shared``
    shared: torch.Generator

    def probs(self) -> Tensor:
        return probs_from_logits(self.logits, self.params)

    def exponentials(self) -> Tensor:
        return Sampler.exponentials(self.logits.shape, self.params, self.generators, self.shared, self.logits.device)

    def output(self, token_ids: Tensor, accepted: Tensor | None = None) -> SamplerOutput:
        """The chosen tokens, with their logprobs and the top alternatives when a row asks (see
        ``SamplerOutput``): the one place logprobs are computed."""
        out = SamplerOutput(token_ids, num_logprobs=[p.logprobs for p in self.params], accepted=accepted)
        asked = [p.logprobs for p in self.params if p.logprobs is not None]
        if asked:
            temperature = to_device(_temperatures(self.params), torch.float32, self.logits.device).unsqueeze(1)
            logprobs = (self.logits / temperature).log_softmax(dim=-1)
            out.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            top = logprobs.topk(min(max(asked), logprobs.shape[1]), dim=-1)
            out.top_token_ids, out.top_logprobs = top.indices, top.values
        return out


def _penalised(
    logits: Tensor,
    params_list: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> Tensor:
    """``logits`` (float32) with each row's penalties applied."""
    # Rows without penalties contribute no ids, so their counts stay zero and cost nothing.
    # (A production engine keeps these counts on the device and updates them each step.)
    vocab, device = logits.shape[1], logits.device
    needs = [p.needs_penalties for p in params_list]
    prompt = [ids if need else () for ids, need in zip(prompt_token_ids, needs, strict=True)]
    output = [ids if need else () for ids, need in zip(output_token_ids, needs, strict=True)]
    return apply_penalties(
        logits,
        _token_counts(prompt, vocab, device),
        _token_counts(output, vocab, device),
        to_device([p.repetition_penalty for p in params_list], torch.float32, device),
        to_device([p.presence_penalty for p in params_list], torch.float32, device),
        to_device([p.frequency_penalty for p in params_list], torch.float32, device),
    )


class TokenMask(Protocol):
    """What constrained decoding (chapter 09b's ``structured_output.StructuredOutputs``) gives the
    sampler: for every logit row of a request with ``structured_outputs``, the tokens its grammar
    allows next."""

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError, when a request is added, for a grammar that cannot be compiled."""
        ...

    def apply(self, logits: Tensor, batch: ForwardBatch, seqs: Sequence[Seq]) -> None:
        """Set to -inf, in place, every token that a row's grammar forbids; other rows unchanged."""
        ...


class Sampler:
    """Turns a batch of logits into tokens, on the device, with one host sync per engine step.

    Unseeded rows draw from a generator the sampler makes on the logits' device from its own
    ``seed`` (``LLM(seed=...)``). Seeded rows
    bring their own (``make_generator(params.seed, device)``, kept by the request for its whole
    life, so that preemption or a different batch does not change its tokens).

    ``eos_token_ids`` are the tokens that ``min_tokens`` forbids (with each request's own stop
    token ids); ``mask`` serves requests with ``structured_outputs`` (chapter 09b), which are
    refused without one.
    """

    def __init__(
        self, seed: int | None = None, *, eos_token_ids: Iterable[int] = (), mask: TokenMask | None = None
    ) -> None:
        self.seed = seed
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.mask = mask
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The sampler's own generator for unseeded rows on ``device`` (made on first use)."""
        if device not in self._generators:
            self._generators[device] = make_generator(self.seed, device)
        return self._generators[device]

    def check(self, params: SamplingParams) -> None:
        """Every valid ``SamplingParams`` can be served (chapter 06's ``TokenSampler`` asks), a
        grammar only with a ``mask`` and when it compiles."""
        if params.structured_outputs is not None:
            if self.mask is None:
                raise ValueError(
                    "structured_outputs needs constrained decoding (chapter 09b): give the Sampler "
                    "mask=structured_output.StructuredOutputs(...), as build_engine does"
                )
            self.mask.check(params)

    # ----------------------------------------------------------------- the engine's stage
    def sample(self, logits: Tensor, batch: ForwardBatch, seqs: list[Seq]) -> list[SampledTokens]:
        """Each input's kept tokens (and logprobs when asked) from ``logits`` ``[rows, V]``."""
        out = self(*self.step_arguments(logits, batch, seqs))
        return per_sequence(out.to_host(), batch)  # the step's one host sync

    def step_arguments(self, logits: Tensor, batch: ForwardBatch, seqs: Sequence[Seq]) -> RowArguments:
        """``__call__``'s (and ``rows``') arguments for the logit rows of ``batch``: the logits
        after ``restrict``, each row's params and generator, and the token histories when a row
        has a penalty."""
        rows = [seq for seq, row_range in zip(seqs, batch.rows_of, strict=True) for _ in row_range]
        penalties = any(s.params.needs_penalties for s in rows)
        return (
            self.restrict(logits, batch, seqs),
            [s.params for s in rows],
            [s.generator for s in rows],
            [s.prompt_token_ids for s in rows] if penalties else None,
            [s.output_token_ids for s in rows] if penalties else None,
        )

    @torch.inference_mode()  # the model's logits are inference tensors, changed in place here
    def restrict(self, logits: Tensor, batch: ForwardBatch, seqs: Sequence[Seq]) -> Tensor:
        """The logits with each request's ``logit_bias`` added, its stops forbidden on rows before
        ``min_tokens``, and its grammar's mask applied (``TokenMask``): float32 when a bias or
        ``min_tokens`` is applied (in place otherwise). Row ``j`` of a sequence with guesses
        (chapter 10) predicts its output token ``num_output_tokens + j``. No request asking for
        any of it: the logits themselves, untouched."""
        if not any(seq.params.changes_logits for seq in seqs):
            return logits
        rows, columns, values = [], [], []
        for seq, row_range in zip(seqs, batch.rows_of, strict=True):
            params = seq.params
            for j, row in enumerate(row_range):
                for token, bias in (params.logit_bias or {}).items():
                    rows.append(row)
                    columns.append(token)
                    values.append(bias)
                if seq.num_output_tokens + j < params.min_tokens:
                    stops = {*self.eos_token_ids, *params.stop_token_ids}
                    rows += [row] * len(stops)
                    columns += stops
                    values += [-math.inf] * len(stops)
        if rows:
            logits = logits.to(torch.float32)
            device = logits.device
            index = (to_device(rows, torch.long, device), to_device(columns, torch.long, device))
            # A forbidden token stays forbidden whatever its bias: -inf + bias is -inf.
            logits.index_put_(index, to_device(values, torch.float32, device), accumulate=True)
        if self.mask is not None and any(seq.params.structured_outputs is not None for seq in seqs):
            self.mask.apply(logits, batch, seqs)
        return logits

    # ----------------------------------------------------------------- one token per row
    def __call__(
        self,
        logits: Tensor,
        params_list: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[N, V]`` (any float dtype; cast to float32
        unless every row is plain greedy); the arguments are those of ``rows``."""
        rows = self.rows(logits, params_list, generators, prompt_token_ids, output_token_ids)
        if all(p.greedy for p in rows.params):
            return rows.output(argmax_rows(rows.logits))
        return rows.output(exponential_race(rows.probs(), rows.exponentials()))

    def rows(
        self,
        logits: Tensor,
        params_list: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> LogitRows:
        """The rows of ``logits`` ``[N, V]`` with their penalties applied, ready to be sampled.

        ``generators[i]`` draws row i's randomness (required when ``params_list[i].seed`` is set;
        None means the sampler's own, ``generator_for``).
        ``prompt_token_ids`` and ``output_token_ids`` (one list per row) are required, and read,
        only when some row has a penalty.
        """
        n = len(params_list)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [N, V] with N = len(params_list) = {n}, got {tuple(logits.shape)}")
        gens: list[torch.Generator | None] = list(generators) if generators is not None else [None] * n
        if len(gens) != n:
            raise ValueError(f"need one generator (or None) per row: {n} rows, {len(gens)} generators")
        for i, (p, g) in enumerate(zip(params_list, gens, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"row {i} has seed={p.seed} but no generator; use make_generator")
            if g is not None and g.device.type != logits.device.type:
                raise ValueError(f"row {i}: generator on {g.device}, logits on {logits.device}")
        shared = self.generator_for(logits.device)
        if all(p.greedy and not p.needs_penalties and p.logprobs is None for p in params_list):
            # The common greedy batch needs no float32 copy of the logits at all.
            return LogitRows(logits, list(params_list), gens, shared)
        logits = logits.to(torch.float32)
        if any(p.needs_penalties for p in params_list):
            if (
                prompt_token_ids is None
                or output_token_ids is None
                or not len(prompt_token_ids) == len(output_token_ids) == n
            ):
                raise ValueError("a row has a penalty: pass prompt_token_ids and output_token_ids, one list per row")
            logits = _penalised(logits, params_list, prompt_token_ids, output_token_ids)
        return LogitRows(logits, list(params_list), gens, shared)

    @staticmethod
    def exponentials(
        shape: torch.Size,
        params_list: Sequence[SamplingParams],
        gens: Sequence[torch.Generator | None],
        shared_generator: torch.Generator,
        device: torch.device,
    ) -> Tensor:
        """The Exp(1) draws of the race, ``[N, V]``: a seeded row's from its own generator."""
        # student: begin chapter 09: the Exp(1) draws of the race, a seeded row's from its own generator
        n, vocab = shape
        own_generator = [g is not None and not p.greedy for p, g in zip(params_list, gens, strict=True)]
        if any(g is None and not p.greedy for p, g in zip(params_list, gens, strict=True)):
            # One draw for the whole batch serves every unseeded row.
            exponentials = torch.empty(n, vocab, device=device).exponential_(generator=shared_generator)
        else:
            # Greedy rows are one-hot, so any positive value leaves their argmax alone.
            exponentials = torch.ones(n, vocab, device=device)
        for i, g in enumerate(gens):
            if own_generator[i]:
                # A fresh [V] tensor rather than drawing into row i in place: the same draw, of
                # the same shape, whatever the batch looks like. Greedy rows draw nothing.
                exponentials[i] = torch.empty(vocab, device=device).exponential_(generator=g)
        return exponentials
        # student: end


def per_sequence(host: SamplerOutput, batch: ForwardBatch) -> list[SampledTokens]:
    """Each input's kept tokens from a host ``SamplerOutput`` (one entry per logit row)."""
    tokens = host.token_ids.tolist()
    kept = keep_per_sequence(batch, tokens, None if host.accepted is None else host.accepted.tolist())
    if host.logprobs is not None:
        # Requests with logprobs are never speculated (chapter 10): one row, one token each.
        per_row = host.to_token_logprobs()
        for sampled, rows in zip(kept, batch.rows_of):
            if rows and (logprob := per_row[rows.start]) is not None:
                sampled.logprobs = [logprob]
    return kept
