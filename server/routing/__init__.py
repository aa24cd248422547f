"""Routing: serve a request on the device or on an OpenAI-compatible upstream (docs/routing.md).

- policy.py: the pure decision (rule table), tested table by table;
- breaker.py: the upstream's circuit breaker (cooldowns), with a clock seam;
- upstream.py: the pooled httpx client, the SSE parser (httpx-sse), what is forwarded, failures and errors;
- relay.py: an upstream reply as the worker's events;
- embeddings.py: an embeddings request as one POST to the upstream, its answer bounded, checked and turned
  into the worker's answer (vectors and usage);
- router.py: the route step (plan, start, fallback) that the shared flow (api/common/flow.py) calls instead
  of worker.submit;
- metrics.py: routing on /metrics.
"""
