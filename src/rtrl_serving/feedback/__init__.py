"""``rtrl-feedback``: the users' late feedback on served interactions, made durable in the
events store before it is acknowledged.

A client (the agent's backend, an IDE plugin, a job that measures whether an edit stayed
in the codebase) posts feedback events naming an interaction id that the capture proxy
returned (``X-Rtrl-Interaction-Id``). The service is stateless: an event is durable only
once it is in a Parquet file of the events store, so requests are group-committed (the
events of every request waiting at that moment go into one file per feedback partition)
and each is answered 202 only after its file was written; a failed write answers 503 and
the client retries (event ids make that safe: the seal step deduplicates by them).

- :mod:`~rtrl_serving.feedback.events`: a request body to validated events, or every
  problem with the field that has it.
- :mod:`~rtrl_serving.feedback.tokens`: bearer tokens from a mounted Secret.
- :mod:`~rtrl_serving.feedback.commit`: the group commit to the store.
- :mod:`~rtrl_serving.feedback.app`: the HTTP service; :mod:`~rtrl_serving.feedback.cli`
  its flags.
"""
