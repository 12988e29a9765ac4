"""servebench: a serving benchmark for any OpenAI-compatible server (chapter 12).

Where the offline benchmark (chapter 06) asks how many tokens per second the engine can
produce, servebench asks what a user of the server sees: how long until the first token
(TTFT), how fast the rest follow (TPOT, ITL), how long a whole answer takes (E2E), and how
many requests per second the server sustains while keeping those within limits (goodput).

* ``datasets``: random, shared-prefix and JSON-lines prompts, all seeded;
* ``client``: one streaming request (SSE parsing, a timestamp per text chunk, usage), read
  with aiohttp (as SGLang's and vLLM's clients do), whose cost per token is small beside the
  server's;
* ``runner``: Poisson arrivals, a concurrency cap, warm-up, request-rate sweeps;
* ``metrics``: every number, from the recorded timelines, in one pure function (definitions
  there; Little's law ties throughput, latency and concurrency together);
* ``plots``: latency CDFs, curves against the request rate, comparisons;
* ``cli``: ``servebench`` and ``mini-infer bench serve``;
* ``peer``: servebench's figures beside SGLang's benchmark client on the same workload
  (``scripts/compare_servebench.sh``).
"""

from mini_infer.bench.serve.metrics import Distribution, Metrics, RequestRecord, compute_metrics

__all__ = ["Distribution", "Metrics", "RequestRecord", "compute_metrics"]
