"""``rtrl-capture``: the OpenAI-API proxy sidecar in front of the inference engine that
records every generation as an event (docs/writing-shards.md, "Capture").

- :mod:`~rtrl_serving.capture.config`: flags and their environment fallbacks.
- :mod:`~rtrl_serving.capture.proxy`: the aiohttp proxy, what it captures and passes on.
- :mod:`~rtrl_serving.capture.rewrite`: what it adds to a request; :mod:`.strip`: what it
  takes out of the response again; :mod:`.collect`: the tokens it gathers on the way.
- :mod:`~rtrl_serving.capture.engine`: which checkpoint the engine serves;
  :mod:`.sampling`: which sampling parameters it used.
- :mod:`~rtrl_serving.capture.toolcheck`: tool calls against the request's schemas.
- :mod:`~rtrl_serving.capture.events`: the generation events; :mod:`.metrics`: /metrics.
"""
