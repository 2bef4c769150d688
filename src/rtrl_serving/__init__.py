"""The serving side of rtrl, shipped as the ``rtrl-serving`` image
(``images/serving/Dockerfile``): what runs beside the inference engine and its users.

- :mod:`rtrl_serving.capture`: ``rtrl-capture``, the sidecar proxy in front of the engine's
  OpenAI API that records every generation as an event.
- :mod:`rtrl_serving.feedback`: ``rtrl-feedback``, the service that takes the users' late
  feedback and makes it durable before acknowledging it.
- :mod:`rtrl_serving.spool`: the local spool with group commit that both ship from.

What they write is the contract of :mod:`rtrl.core.events`; the seal step
(``rtrl-job seal``) joins it into interaction shards.
"""
