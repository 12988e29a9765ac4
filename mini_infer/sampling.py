"""Sampling: from one step's logits to one token per sequence (chapter 09).

Three pieces, in the order a step uses them:

* ``SamplingParams``: what a request asks for, with vLLM's names and defaults, validated when
  it is built so that a bad request fails at the door with a message naming the field.
* ``Sampler``: turns the logits of a batch (one row per sequence) into one token per row:
  penalties -> greedy rows take the argmax -> temperature -> top-k -> top-p -> min-p -> sample.
  The filters are public functions (``apply_penalties``, ``apply_top_k``, ``apply_top_p``,
  ``apply_min_p``) and ``probs_from_logits`` returns the distribution a row is sampled from, so
  that speculative decoding (chapter 10) can do rejection sampling on exactly that distribution.
* ``StopStringChecker``: watches the streamed, detokenized text for stop strings and holds back
  text that may be the start of one.

Invariants:

* **One host sync per step.** Nothing here waits for the device: per-row parameters travel
  host -> device through pinned memory without blocking, filters are batched tensor ops over
  per-row parameter tensors (no ``.item()``, no boolean-mask indexing, no Python loop over rows
  for the filters), and every decision that depends on a value (is any row greedy? does any row
  use top-k?) is taken from the ``SamplingParams`` on the host. The step's single sync is the
  engine reading the result: ``SamplerOutput.to_host()``.
* **A seeded row does not depend on the batch around it.** Sampling is the exponential race
  (``argmax(probs / q)`` with ``q ~ Exp(1)``, equivalent to the Gumbel-max trick). A seeded
  request owns its ``torch.Generator`` (``make_generator``), which draws that row's ``q`` of
  shape ``[V]`` and advances by exactly one such draw per sampled token. Unseeded rows share one
  draw from the sampler's own generator. So a seeded request alone and inside a busy batch
  produce the same tokens from the same logits (the model's logits themselves may differ in the
  last bits between batch shapes; that is the model's business, not the sampler's).

Ties are kept: top-k keeps every token tied with the k-th largest logit, top-p keeps every
token tied with the least likely token of the nucleus. That makes each filter a function of
the row's values alone, independent of how a sort happened to order equal entries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mini_infer.outputs import TokenLogprob

# vLLM's convention: temperatures this small are treated as 0 (greedy), because dividing the
# logits by them overflows float32 for no difference in the result.
_GREEDY_TEMPERATURE = 1e-5
_MAX_LOGPROBS = 20


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


def _fail(name: str, rule: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {rule}, got {value!r}")


def _number(name: str, value: object) -> float:
    # bool is an int in Python; temperature=True is a bug in the caller, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, "a number", value)
    x = float(value)
    if not math.isfinite(x):
        raise _fail(name, "a finite number", value)
    return x


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, "an int", value)
    return int(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value)
    return value


@dataclass(slots=True)
class SamplingParams:
    """What one request asks of the sampler (vLLM's names and defaults).

    After construction ``stop`` and ``stop_token_ids`` are always lists (empty when not given;
    ``stop`` also takes one string and ``stop_token_ids`` also takes None, as in vLLM).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below 1e-5) means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = -1  # -1 disables; larger than the vocabulary is clamped
    min_p: float = 0.0  # in [0, 1]; 0 disables
    seed: int | None = None  # a seeded request owns a generator (make_generator)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the chosen token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise _fail("max_tokens", ">= 1", self.max_tokens)
        self.temperature = _number("temperature", self.temperature)
        if self.temperature < 0:
            raise _fail("temperature", ">= 0", self.temperature)
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise _fail("top_p", "in (0, 1]", self.top_p)
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise _fail("top_k", "-1 (disabled) or >= 1", self.top_k)
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise _fail("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            # torch.Generator.manual_seed takes a 64-bit seed.
            if not 0 <= self.seed < 2**64:
                raise _fail("seed", "None or an int in [0, 2**64)", self.seed)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _flag("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= _MAX_LOGPROBS:
                raise _fail("logprobs", f"None or in [0, {_MAX_LOGPROBS}]", self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise _fail(name, "in [-2, 2]", value)
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", "> 0", self.repetition_penalty)

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise _fail("stop", "a str or a list of str", stop)
        if any(s == "" for s in stop):
            # An empty stop string would match before the first character: almost surely a bug.
            raise _fail("stop", "non-empty strings", stop)
        return list(stop)

    @staticmethod
    def _check_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (list, tuple)) and all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and int(i) >= 0 for i in ids
        ):
            return [int(i) for i in ids]
        raise _fail("stop_token_ids", "a list of ints >= 0", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# --------------------------------------------------------------------------------------------
# Moving per-row values to the device without a sync
# --------------------------------------------------------------------------------------------


def _to_device(values: Sequence[float] | Sequence[int] | Sequence[bool] | Sequence[Sequence[int]],
               dtype: torch.dtype, device: torch.device) -> Tensor:
    cpu = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # A copy from ordinary (pageable) host memory makes the host wait until the device has
        # finished everything queued before it: a host sync. Pinned memory copies asynchronously.
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A random generator on ``device``: seeded, or from fresh entropy when ``seed`` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


# --------------------------------------------------------------------------------------------
# Filters: each takes logits [N, V] and per-row parameters [N], returns new logits with the
# removed tokens at -inf (so they compose, and softmax gives them probability 0).
# --------------------------------------------------------------------------------------------


def apply_penalties(logits: Tensor, prompt_counts: Tensor, output_counts: Tensor,
                    repetition_penalty: Tensor, presence_penalty: Tensor,
                    frequency_penalty: Tensor) -> Tensor:
    """Repetition penalty on tokens seen in the prompt or output, then OpenAI's presence and
    frequency penalties on tokens of the output. Counts are ``[N, V]``, penalties ``[N]``."""
    seen = (prompt_counts > 0) | (output_counts > 0)
    r = repetition_penalty.unsqueeze(1)
    # Dividing a positive logit and multiplying a negative one both make the token less likely
    # (CTRL's rule); a plain division would make negative logits more likely.
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int | None = None) -> Tensor:
    """Keep each row's ``top_k`` largest logits (and any tied with the k-th). ``top_k < 1``
    disables the filter for that row; ``top_k`` above the vocabulary is clamped.

    ``max_k``, when given, must be at least every enabled row's ``top_k`` (the sampler knows it
    from the requests): the k-th largest value then comes from ``topk(max_k)`` instead of a sort
    of the whole row, which for a 151,936-token vocabulary and k = 50 is many times cheaper.
    """
    vocab = logits.shape[-1]
    disabled = (top_k < 1) | (top_k >= vocab)
    width = vocab if max_k is None else max(1, min(max_k, vocab))
    k = top_k.clamp(min=1, max=width)
    kth_largest = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth_largest = kth_largest.masked_fill(disabled.unsqueeze(1), -math.inf)
    return logits.masked_fill(logits < kth_largest, -math.inf)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    nucleus), plus any token tied with the least likely member. ``top_p >= 1`` keeps all."""
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


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens at least ``min_p`` times as likely as the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -math.inf)


def _temperatures(params_list: Sequence[SamplingParams]) -> list[float]:
    # Greedy rows divide by 1: their tokens come from the argmax, and their logprobs (if asked)
    # from the model's own distribution.
    return [1.0 if p.greedy else p.temperature for p in params_list]


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's argmax (its first maximum, as ``Tensor.argmax``), for logits of any dtype.

    ``Tensor.argmax`` over 151,936 columns runs at about one element per nanosecond on a CPU
    core, while ``amax`` is vectorised: so the row is cut into blocks of up to 128 columns, the
    first block holding the row's maximum is found from the block maxima, and only that block
    is searched. At 64 rows of bf16 Qwen2.5 logits: 4 ms, against 26 ms for casting to float32
    and taking the argmax. A vocabulary that no block width divides falls back to ``argmax``.
    """
    rows, vocab = logits.shape
    width = next((w for w in (128, 64, 32, 16) if vocab % w == 0 and vocab > w), 0)
    if not width:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // width, width)
    block = blocks.amax(dim=-1).argmax(dim=-1)  # the first block that holds the row's maximum
    within = blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)
    return block * width + within


def probs_from_logits(logits: Tensor, params_list: Sequence[SamplingParams]) -> Tensor:
    """The distribution each row is sampled from: float32 ``[N, V]`` after temperature, top-k,
    top-p and min-p; greedy rows are one-hot on the argmax. Penalties are not applied here (they
    need the tokens seen so far): apply ``apply_penalties`` to ``logits`` first if a row has any.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params_list):
        raise ValueError(f"logits must be [N, V] with N = len(params_list) = {len(params_list)}, "
                         f"got shape {tuple(logits.shape)}")
    device = logits.device
    raw = logits.to(torch.float32)
    scaled = raw / _to_device(_temperatures(params_list), torch.float32, device).unsqueeze(1)
    # The filters are skipped when no row uses them: a host-side decision from the params, so
    # the common case (plain temperature sampling) pays for no sort.
    if any(p.top_k != -1 for p in params_list):
        # Capped before the tensor is built: a top_k beyond int64 is simply "everything".
        top_ks = [min(p.top_k, 2**31 - 1) for p in params_list]
        enabled = [k for k in top_ks if 0 < k < scaled.shape[-1]]
        if enabled:
            scaled = apply_top_k(scaled, _to_device(top_ks, torch.long, device), max_k=max(enabled))
    if any(p.top_p < 1.0 for p in params_list):
        scaled = apply_top_p(scaled, _to_device([p.top_p for p in params_list], torch.float32, device))
    if any(p.min_p > 0.0 for p in params_list):
        scaled = apply_min_p(scaled, _to_device([p.min_p for p in params_list], torch.float32, device))
    probs = scaled.softmax(dim=-1)
    if any(p.greedy for p in params_list):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(raw).unsqueeze(1), 1.0)
        greedy = _to_device([p.greedy for p in params_list], torch.bool, device).unsqueeze(1)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _exponential_race(probs: Tensor, exponentials: Tensor) -> Tensor:
    # P(argmax_i p_i / q_i = j) = p_j when q_i ~ Exp(1): q_i / p_i ~ Exp(rate p_i), and the
    # smallest of independent exponentials is j with probability p_j / sum(p). Tokens with
    # p = 0 can never win, and a one-hot row always returns its hot token. The clamp guards
    # against an exponential draw of exactly 0 (0 / 0 would be NaN).
    return (probs / exponentials.clamp_min(torch.finfo(exponentials.dtype).tiny)).argmax(dim=-1)


def sample_from_probs(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token from each row of ``probs`` (``[..., V]``, rows need not be normalised):
    one draw of ``probs.shape`` exponentials from ``generator``. For speculative verification."""
    exponentials = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return _exponential_race(probs.to(torch.float32), exponentials)


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


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

    def to_host(self) -> SamplerOutput:
        """Copy everything to the CPU with a single host sync (the step's one)."""
        device = self.token_ids.device
        if device.type == "cpu":
            return self
        # On CUDA, queue every copy without waiting, then wait once. (Elsewhere, e.g. MPS,
        # a plain copy per tensor: correct, though each one waits.)
        non_blocking = device.type == "cuda"

        def copy(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=non_blocking)

        host = SamplerOutput(self.token_ids.to("cpu", non_blocking=non_blocking), copy(self.logprobs),
                             copy(self.top_token_ids), copy(self.top_logprobs), self.num_logprobs)
        if non_blocking:
            torch.cuda.current_stream(device).synchronize()
        return host

    def to_token_logprobs(self, token_ids: Sequence[int] | None = None) -> list[TokenLogprob | None]:
        """One ``TokenLogprob`` per row that asked for logprobs (None for the others), each with
        that row's own k alternatives. Pass the token ids already read, if any. Reading the
        logprobs costs a host sync of its own unless ``to_host()`` came first."""
        host = self.to_host()
        if host.logprobs is None or host.top_token_ids is None or host.top_logprobs is None:
            return [None] * len(self.num_logprobs)
        tokens = list(token_ids) if token_ids is not None else host.token_ids.tolist()
        chosen, top_ids, top_values = host.logprobs.tolist(), host.top_token_ids.tolist(), host.top_logprobs.tolist()
        return [
            None if k is None else TokenLogprob(tokens[i], chosen[i], dict(zip(top_ids[i][:k], top_values[i][:k], strict=True)))
            for i, k in enumerate(self.num_logprobs)
        ]


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """``[N, V]`` float32 counts of each token id per row, built with one host -> device copy."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id V, counted into a column that is dropped: no masking needed.
    padded = [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = _to_device(padded, torch.long, device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler:
    """Turns a batch of logits into one token per row, on the device, without a host sync.

    Unseeded rows draw from ``default_generator`` when the call passes one (the engine's, seeded
    by ``LLM(seed=...)``), else from a generator the sampler makes on the logits' device from its
    own ``seed``. Seeded rows bring their own (``make_generator(params.seed, device)``, kept by
    the request for its whole life, so that preemption or a different batch does not change its
    tokens).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The sampler's own generator for unseeded rows on ``device`` (made on first use)."""
        if device not in self._generators:
            self._generators[device] = make_generator(self.seed, device)
        return self._generators[device]

    def __call__(self, logits: Tensor, params_list: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 output_token_ids: Sequence[Sequence[int]] | None = None,
                 default_generator: torch.Generator | None = None) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[N, V]`` (any float dtype; cast to float32
        unless every row is plain greedy).

        ``generators[i]`` draws row i's randomness (required when ``params_list[i].seed`` is set;
        None means the shared generator: ``default_generator`` or the sampler's own).
        ``prompt_token_ids`` and ``output_token_ids`` (one list per row) are read only when some
        row has a penalty.
        """
        n = len(params_list)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [N, V] with N = len(params_list) = {n}, got {tuple(logits.shape)}")
        gens = list(generators) if generators is not None else [None] * n
        if len(gens) != n:
            raise ValueError(f"need one generator (or None) per row: {n} rows, {len(gens)} generators")
        for i, (p, g) in enumerate(zip(params_list, gens, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"row {i} has seed={p.seed} but no generator; use make_generator")
            if g is not None and g.device.type != logits.device.type:
                raise ValueError(f"row {i}: generator on {g.device}, logits on {logits.device}")
        device = logits.device
        shared = default_generator if default_generator is not None else self.generator_for(device)
        if shared.device.type != device.type:
            raise ValueError(f"default_generator on {shared.device}, logits on {device}")
        if all(p.greedy and not p.needs_penalties and p.logprobs is None for p in params_list):
            # The common greedy batch needs no float32 copy of the logits at all.
            return SamplerOutput(argmax_rows(logits), num_logprobs=[None] * n)
        logits = logits.to(torch.float32)

        if any(p.needs_penalties for p in params_list):
            logits = self._penalise(logits, params_list, prompt_token_ids, output_token_ids)

        if all(p.greedy for p in params_list):
            token_ids = argmax_rows(logits)
        else:
            probs = probs_from_logits(logits, params_list)
            token_ids = _exponential_race(probs, self._exponentials(probs.shape, params_list, gens, shared, device))

        output = SamplerOutput(token_ids, num_logprobs=[p.logprobs for p in params_list])
        asked = [p.logprobs for p in params_list if p.logprobs is not None]
        if asked:
            temperature = _to_device(_temperatures(params_list), torch.float32, device).unsqueeze(1)
            logprobs = (logits / temperature).log_softmax(dim=-1)
            output.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            top = logprobs.topk(min(max(asked), logprobs.shape[1]), dim=-1)
            output.top_token_ids, output.top_logprobs = top.indices, top.values
        return output

    def _penalise(self, logits: Tensor, params_list: Sequence[SamplingParams],
                  prompt_token_ids: Sequence[Sequence[int]] | None,
                  output_token_ids: Sequence[Sequence[int]] | None) -> Tensor:
        n, vocab = logits.shape
        if prompt_token_ids is None or output_token_ids is None or len(prompt_token_ids) != n \
                or len(output_token_ids) != n:
            raise ValueError("a row has a penalty: pass prompt_token_ids and output_token_ids, one list per row")
        # Rows without penalties contribute no ids, so their counts stay zero and cost nothing.
        # (A production engine keeps these counts on the device and updates them each step.)
        needs = [p.needs_penalties for p in params_list]
        prompt = [ids if need else () for ids, need in zip(prompt_token_ids, needs, strict=True)]
        output = [ids if need else () for ids, need in zip(output_token_ids, needs, strict=True)]
        return apply_penalties(
            logits,
            _token_counts(prompt, vocab, logits.device),
            _token_counts(output, vocab, logits.device),
            _to_device([p.repetition_penalty for p in params_list], torch.float32, logits.device),
            _to_device([p.presence_penalty for p in params_list], torch.float32, logits.device),
            _to_device([p.frequency_penalty for p in params_list], torch.float32, logits.device),
        )

    @staticmethod
    def _exponentials(shape: torch.Size, params_list: Sequence[SamplingParams],
                      gens: Sequence[torch.Generator | None], shared_generator: torch.Generator,
                      device: torch.device) -> Tensor:
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


# --------------------------------------------------------------------------------------------
# Stop strings over streamed text
# --------------------------------------------------------------------------------------------


class StopStringChecker:
    """Finds stop strings in text that arrives in pieces, and says what is safe to emit.

    The stop is the occurrence that is completed first as text arrives (smallest end; among
    those ending together, the longest). That is what checking after every character would
    find, so the answer does not depend on how the text was chunked. Text that might be the
    start of a stop string is held back until it is resolved: a stop string is never emitted
    (unless ``include_stop_str_in_output``, and then whole, in the last chunk).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str) or any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must be a list of non-empty str, got {stop!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None  # the stop string found (vLLM's stop_reason)
        self._held = ""

    def push(self, new_text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was completed)."""
        if self.stopped:
            raise RuntimeError("push() after a stop string was found: the request is finished")
        text = self._held + new_text
        # Only ``text`` can hold a completed stop string: emitted text never held the start of
        # one (see below), and a stop string inside the held text alone would have been found.
        found = [(start + len(s), start) for s in self.stop if (start := text.find(s)) >= 0]
        if found:
            end, start = min(found)  # first to complete; of those ending together, the longest
            self.stopped, self.matched, self._held = True, text[start:end], ""
            return text[:end] if self.include_stop_str_in_output else text[:start], True
        held = self._longest_suffix_starting_a_stop(text)
        self._held = text[len(text) - held:] if held else ""
        return text[:len(text) - held], False

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason (EOS, max_tokens)."""
        held, self._held = self._held, ""
        return held

    def _longest_suffix_starting_a_stop(self, text: str) -> int:
        # A stop string that may still complete must start inside this suffix: if it started
        # earlier, the text from its start would be a longer suffix that is a prefix of it.
        longest = min(len(text), max((len(s) for s in self.stop), default=1) - 1)
        for length in range(longest, 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0
