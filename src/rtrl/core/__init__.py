"""What both images share: the API types (``api``), the object store (``store``), the
interaction-shard format (``shards``) and the CLI argument helpers (``cliargs``).

The operator image ships ``rtrl`` (this core included); the trainer image ships ``rtrl`` too,
but its Job steps (``rtrl_trainer``) may import only this core and the pure planning helpers.
"""
