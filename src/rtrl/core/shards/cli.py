"""``rtrl shards ...``: checking a shard set from the command line.

When a cycle stalls on "not enough good interactions", the first question is what is wrong
with the shards; ``rtrl shards validate s3://...`` answers it with the same validating
reader the stage step uses, as text for people or ``--json`` for scripts. Exit codes are
for CI and scripts: 0 all good, 1 something bad (or nothing found), 2 usage errors.
Token ids are checked against a vocabulary when one is given, as a number
(``--vocab-size``) or as the checkpoint the rows would train (``--checkpoint``, whose
``config.json`` is read as the stage and train steps read it); negative ids always fail.

The main ``rtrl`` CLI mounts this with :func:`add_shards_parser`; each leaf parser sets
``func`` to the function that runs it, returning the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys

from rtrl.core.cliargs import endpoint_url, positive_int
from rtrl.core.shards.layout import resolve_store
from rtrl.core.shards.reader import DEFAULT_BATCH_SIZE
from rtrl.core.shards.validate import validate
from rtrl.core.shards.vocabulary import VocabularyError, read_vocab_size
from rtrl.core.store import redact
from rtrl.core.store.base import ObjectStore, StoreError
from rtrl.core.store.local import LocalStore

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2


def _partition(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE (e.g. checkpoint=ckpt-41), not {text!r}"
        )
    return name, value


def add_shards_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``shards`` (with ``validate``) to the main CLI's subparsers and return it.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned.
    """
    shards = subparsers.add_parser(
        "shards",
        help="inspect interaction shards",
        description="Inspect interaction shards (Hive-partitioned Parquet).",
    )
    shards.set_defaults(func=lambda args: _missing_command(shards))
    commands = shards.add_subparsers(title="commands", metavar="COMMAND")
    check = commands.add_parser(
        "validate",
        help="check every file and row of a shard set",
        description=(
            "Read a shard set with the validating reader and report, per file and per "
            "reason, what would be quarantined. Exit 0 when everything is valid, 1 when "
            "anything is bad or no shard file is found, 2 for usage errors (a malformed URI, or "
            "one whose store cannot be read)."
        ),
    )
    check.add_argument(
        "uri", metavar="URI", help="s3://bucket/prefix/, file:///path/ or a local directory"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument(
        "--partition",
        action="append",
        type=_partition,
        default=[],
        metavar="NAME=VALUE",
        help="only files under this Hive partition (repeatable), e.g. checkpoint=ckpt-41",
    )
    vocabulary = check.add_mutually_exclusive_group()
    vocabulary.add_argument(
        "--vocab-size",
        type=positive_int,
        metavar="N",
        help="quarantine token ids >= N (the vocabulary of the model to train)",
    )
    vocabulary.add_argument(
        "--checkpoint",
        metavar="URI",
        help="take the vocabulary from this checkpoint's config.json (vocab_size), e.g. "
        "the serving checkpoint",
    )
    check.add_argument(
        "--endpoint-url",
        type=endpoint_url,
        metavar="URL",
        default=None,
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    check.add_argument(
        "--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help=argparse.SUPPRESS
    )
    check.set_defaults(func=run_validate)
    return shards


def _missing_command(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def run_validate(args: argparse.Namespace) -> int:
    """Run ``rtrl shards validate``; print the report; return the exit code. Every error
    is one line, with no URL's secret in it (a presigned URL pasted as the URI)."""
    partitions: dict[str, set[str]] = {}
    for name, value in args.partition:
        partitions.setdefault(name, set()).add(value)
    try:
        store = resolve_store(args.uri, endpoint_url=args.endpoint_url)
    except (ValueError, StoreError) as exc:
        # A URI no store understands, or a store that cannot be built (an endpoint from
        # $AWS_ENDPOINT_URL with credentials in it).
        return _usage(str(exc))
    if isinstance(store, LocalStore) and not store.root.is_dir():
        return _usage(f"{store.root} is not a directory")
    vocab_size = args.vocab_size
    if args.checkpoint is not None:
        try:
            vocab_size = read_vocab_size(_checkpoint_store(args.checkpoint, args.endpoint_url))
        except (ValueError, StoreError) as exc:
            # VocabularyError is a ValueError; so is a URI no store understands.
            return _usage(f"checkpoint {args.checkpoint}: {exc}")
    try:
        report = validate(
            store,
            batch_size=args.batch_size,
            partitions=partitions or None,
            vocab_size=vocab_size,
        )
    except StoreError as exc:
        # The store failed (no such bucket, no access, unreachable), not the shards: there
        # is no report to give, only the reason the URI cannot be read.
        return _usage(f"cannot read {args.uri}: {exc}")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return EXIT_OK if report.ok else EXIT_BAD


def _usage(message: str) -> int:
    print(f"rtrl shards validate: {redact(' '.join(message.split()))}", file=sys.stderr)
    return EXIT_USAGE


def _checkpoint_store(uri: str, endpoint_url: str | None) -> ObjectStore:
    """The checkpoint prefix as a store; ``ValueError`` for a URI that is none."""
    store = resolve_store(uri, endpoint_url=endpoint_url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise VocabularyError(f"{store.root} is not a directory")
    return store
