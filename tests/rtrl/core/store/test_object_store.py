"""The object-store contract, run against both backends (``file://`` and moto S3 over HTTP),
plus what only one backend has: S3's retries through a fault-injecting proxy and error
hygiene, the local store's file modes and atomic rename."""

from __future__ import annotations

import hashlib
import io
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.store import (
    MANIFEST_NAME,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    join_key,
    open_store,
    parse_store_uri,
    split_uri,
)
from rtrl.core.store.local import LocalStore
from rtrl.core.store.s3 import S3Store
from rtrl_localkube.s3faults import FaultProxy

MiB = 1 << 20
StoreFactory = Any  # conftest.make_store: (**s3_options) -> ObjectStore


def _no_temp_files(root: Path) -> bool:
    return not any(p.name.startswith(".tmp-") for p in root.rglob("*"))


# --- the contract, on both backends --------------------------------------------------------


def test_put_get_overwrite(store: ObjectStore) -> None:
    store.put_bytes("a/b/c.json", b'{"x": 1}')
    assert store.get_bytes("a/b/c.json") == b'{"x": 1}'
    store.put_bytes("a/b/c.json", b"")
    assert store.get_bytes("a/b/c.json") == b""
    assert store.url("a/b/c.json") == store.uri + "a/b/c.json"
    assert store.uri.endswith("/")


def test_missing_key_is_object_not_found(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound) as info:
        store.get_bytes("nope/missing.bin")
    assert store.url("nope/missing.bin") in str(info.value)
    assert isinstance(info.value, KeyError)
    with pytest.raises(ObjectNotFound):
        store.get_file("nope/missing.bin", tmp_path / "out" / "missing.bin")
    assert not (tmp_path / "out" / "missing.bin").exists()
    with pytest.raises(ObjectNotFound):
        store.open_input("nope/missing.bin")


def test_exists_and_delete(store: ObjectStore) -> None:
    assert not store.exists("k/one")
    store.put_bytes("k/one", b"1")
    assert store.exists("k/one")
    assert not store.exists("k")  # a "directory" is not an object
    store.delete("k/one")
    assert not store.exists("k/one")
    store.delete("k/one")  # absent: fine
    store.delete("never/existed")


def test_list_is_sorted_recursive_and_prefix_is_a_string_prefix(store: ObjectStore) -> None:
    keys = ["b", "a/y/z", "a-b", "a/x", "ab/c", "a/x2"]
    for i, key in enumerate(keys):
        store.put_bytes(key, b"x" * i)
    listed = list(store.list())
    assert [o.key for o in listed] == sorted(keys)
    assert {o.key: o.size for o in listed} == {k: i for i, k in enumerate(keys)}
    assert [o.key for o in store.list("a/")] == ["a/x", "a/x2", "a/y/z"]
    assert [o.key for o in store.list("a/x")] == ["a/x", "a/x2"]
    assert [o.key for o in store.list("a")] == ["a-b", "a/x", "a/x2", "a/y/z", "ab/c"]
    assert list(store.list("zzz/")) == []


def test_list_paginates_lazily(make_store: StoreFactory) -> None:
    store = make_store(page_size=10)
    keys = [f"shards/part-{i:03d}.parquet" for i in range(35)]
    for key in keys:
        store.put_bytes(key, b"p")
    calls: list[dict[str, Any]] = []
    if isinstance(store, S3Store):
        store.client.meta.events.register(
            "before-parameter-build.s3.ListObjectsV2", lambda **kw: calls.append(kw["params"])
        )
    listing = store.list("shards/")
    assert next(listing).key == keys[0]
    if isinstance(store, S3Store):
        assert len(calls) == 1  # lazily: only the first page so far
    assert [keys[0]] + [o.key for o in listing] == keys
    if isinstance(store, S3Store):
        assert len(calls) == 4
        assert all(c["MaxKeys"] == 10 for c in calls)


def test_put_file_get_file_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    store.put_file("files/src.bin", src)
    dest = tmp_path / "fresh" / "dir" / "dest.bin"
    store.get_file("files/src.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o644
    assert _no_temp_files(tmp_path)
    dest.write_bytes(b"old")
    store.get_file("files/src.bin", dest)  # replaces an existing file
    assert dest.read_bytes() == src.read_bytes()


def test_multipart_upload_and_download(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MiB))
    store.put_file("ckpt/model.safetensors", src)
    if isinstance(store, S3Store):
        head = store.client.head_object(
            Bucket=store.bucket, Key=f"{store.prefix}/ckpt/model.safetensors"
        )
        assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB parts
    assert [(o.key, o.size) for o in store.list("ckpt/")] == [("ckpt/model.safetensors", 12 * MiB)]
    dest = tmp_path / "down" / "model.safetensors"
    store.get_file("ckpt/model.safetensors", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()


def test_open_input_seek_tell_read(store: ObjectStore) -> None:
    data = bytes(range(256)) * 4000  # 1000 KiB: larger than the S3 reader's buffer
    store.put_bytes("blob", data)
    with store.open_input("blob") as f:
        assert f.seekable() and f.readable()
        assert f.read(10) == data[:10]
        assert f.tell() == 10
        assert f.seek(-100, io.SEEK_END) == len(data) - 100
        assert f.read() == data[-100:]
        assert f.read(5) == b""
        f.seek(500_000)
        buf = bytearray(300_000)
        n = f.readinto(buf)
        assert buf[:n] == data[500_000 : 500_000 + n] and n > 0
        f.seek(7)
        f.seek(3, io.SEEK_CUR)
        assert f.read(4) == data[10:14]
        f.seek(0)
        assert f.read() == data
        if isinstance(store, S3Store):
            assert f.size() == len(data)  # type: ignore[attr-defined]
    store.put_bytes("empty", b"")
    with store.open_input("empty") as f:
        assert f.read() == b""


def test_open_input_reads_parquet(store: ObjectStore, tmp_path: Path) -> None:
    n = 20_000
    table = pa.table(
        {
            "interaction_id": [f"i-{i}" for i in range(n)],
            "reward": pa.array([float(i) for i in range(n)], pa.float32()),
            "prompt_ids": pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int32())),
        }
    )
    path = tmp_path / "part-0.parquet"
    pq.write_table(table, path, row_group_size=5_000, compression="none")
    size = path.stat().st_size
    store.put_file("interactions/date=2025-01-01/part-0.parquet", path)

    ranges: list[str] = []
    if isinstance(store, S3Store):
        store.client.meta.events.register(
            "before-parameter-build.s3.GetObject",
            lambda **kw: ranges.append(kw["params"].get("Range")),
        )
    with store.open_input("interactions/date=2025-01-01/part-0.parquet") as f:
        parquet = pq.ParquetFile(f)
        assert parquet.metadata.num_rows == n
        assert parquet.metadata.num_row_groups == 4
        if isinstance(store, S3Store):
            # The footer came from ranged reads, not a download of the whole object.
            assert ranges and all(r is not None for r in ranges)
            fetched = sum(int(e) - int(s) + 1 for s, e in (r[6:].split("-") for r in ranges))
            assert fetched < size
        column = parquet.read_row_group(2, columns=["reward"])
        assert column.column("reward").to_pylist()[:2] == [10_000.0, 10_001.0]
        assert parquet.read().equals(table)


def test_commit_and_committed(store: ObjectStore, tmp_path: Path) -> None:
    files = {"config.json": tmp_path / "config.json", "weights/model.bin": tmp_path / "m.bin"}
    files["config.json"].write_text('{"model_type": "toy"}')
    files["weights/model.bin"].write_bytes(os.urandom(4096))
    assert store.committed("ckpt/c1/") is None
    manifest = store.commit("ckpt/c1/", files, {"parent": "c0"})
    got = store.committed("ckpt/c1/")
    assert got is not None and got == manifest
    assert got.metadata == {"parent": "c0"}
    for name, path in files.items():
        assert got.files[name] == {
            "size": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        assert store.get_bytes(join_key("ckpt/c1", name)) == path.read_bytes()
    doc = json.loads(store.get_bytes(f"ckpt/c1/{MANIFEST_NAME}"))
    assert doc["version"] == 1
    assert [o.key for o in store.list("ckpt/c1/")] == [
        "ckpt/c1/_MANIFEST.json",
        "ckpt/c1/config.json",
        "ckpt/c1/weights/model.bin",
    ]


def test_commit_takes_the_entries_a_writer_computed(store: ObjectStore, tmp_path: Path) -> None:
    """A writer that hashed its files while writing them (the stage step's rank files)
    passes their entries on; an entry whose size no longer matches is recomputed."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"abc")
    b.write_bytes(b"defg")
    known = {
        "a": {"size": 3, "sha256": "0" * 64},  # taken as given: the writer hashed it
        "b": {"size": 99, "sha256": "1" * 64},  # stale: recomputed
    }
    manifest = store.commit("p", {"a": a, "b": b}, {}, known)
    assert dict(manifest.files["a"]) == {"size": 3, "sha256": "0" * 64}
    assert dict(manifest.files["b"]) == {
        "size": 4,
        "sha256": hashlib.sha256(b"defg").hexdigest(),
    }


def test_interrupted_commit_is_not_committed_and_rerun_succeeds(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {name: tmp_path / name for name in ("a.bin", "b.bin", "c.bin")}
    for path in files.values():
        path.write_bytes(os.urandom(1000))
    real_put_file = store.put_file
    calls = []

    def flaky_put_file(key: str, path: Path) -> None:
        calls.append(key)
        if len(calls) == 2:
            raise ConnectionResetError("killed mid-upload")
        real_put_file(key, path)

    monkeypatch.setattr(store, "put_file", flaky_put_file)
    with pytest.raises(ConnectionResetError):
        store.commit("step/1", files)
    assert store.committed("step/1") is None
    assert [o.key for o in store.list("step/1/")] == ["step/1/a.bin"]  # partial, invisible

    # A missing local file in the middle of the set interrupts just the same.
    with pytest.raises(FileNotFoundError):
        store.commit("step/2", {**files, "b2.bin": tmp_path / "missing"})
    assert store.committed("step/2") is None

    manifest = store.commit("step/1", files)  # re-run: calls 3.. succeed
    assert store.committed("step/1") == manifest
    assert sorted(manifest.files) == ["a.bin", "b.bin", "c.bin"]


def test_recommit_hides_the_old_manifest_while_rewriting(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_bytes(b"old")
    new.write_bytes(b"new!")
    store.commit("result", {"x": old, "y": old})

    real_put_file = store.put_file

    def fail_on_y(key: str, path: Path) -> None:
        if key.endswith("/y"):
            raise OSError("crash")
        real_put_file(key, path)

    monkeypatch.setattr(store, "put_file", fail_on_y)
    with pytest.raises(OSError, match="crash"):
        store.commit("result", {"x": new, "y": new})
    # x is new and y old: no manifest may vouch for that mix.
    assert store.committed("result") is None


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../escape", "a/../../escape", "a//b", "a/./b", "dir/", "a\x00b"]
)
def test_invalid_keys_are_rejected(store: ObjectStore, key: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        store.put_bytes(key, b"x")
    with pytest.raises(StoreError):
        store.get_bytes(key)
    with pytest.raises(StoreError):
        store.delete(key)
    with pytest.raises(StoreError):
        list(store.list("../"))
    assert not (tmp_path / "escape").exists()


# --- S3: retries through a faulty endpoint, error hygiene -----------------------------------


def _is_put_object(method: str, path: str, headers: Any) -> bool:
    return method == "PUT" and "uploadId=" not in path and "partNumber=" not in path


def _is_upload_part(method: str, path: str, headers: Any) -> bool:
    return method == "PUT" and "partNumber=" in path


def _is_ranged_get(method: str, path: str, headers: Any) -> bool:
    return method == "GET" and "Range" in headers


def _is_list(method: str, path: str, headers: Any) -> bool:
    return method == "GET" and "list-type=2" in path


def _is_head(method: str, path: str, headers: Any) -> bool:
    return method == "HEAD"


def _put(store: S3Store, tmp_path: Path) -> None:
    store.put_bytes("obj", b"payload")
    assert store.get_bytes("obj") == b"payload"


def _multipart(store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "six.bin"
    src.write_bytes(os.urandom(6 * MiB))
    store.put_file("big", src)
    assert store.get_bytes("big") == src.read_bytes()


def _ranged_get(store: S3Store, tmp_path: Path) -> None:
    store.put_bytes("obj", b"0123456789")
    with store.open_input("obj") as f:
        f.seek(3)
        assert f.read(4) == b"3456"


def _list(store: S3Store, tmp_path: Path) -> None:
    store.put_bytes("l/one", b"1")
    assert [o.key for o in store.list("l/")] == ["l/one"]


def _exists(store: S3Store, tmp_path: Path) -> None:
    store.put_bytes("e", b"1")
    assert store.exists("e")


@pytest.mark.parametrize(
    "case",
    [
        (_is_put_object, _put, 503, "SlowDown"),
        (_is_put_object, _put, 500, "InternalError"),
        (_is_upload_part, _multipart, 503, "SlowDown"),
        (_is_ranged_get, _ranged_get, 503, "SlowDown"),
        (_is_list, _list, 503, "SlowDown"),
        (_is_head, _exists, 503, "SlowDown"),
    ],
    ids=["put-503", "put-500", "upload-part-503", "ranged-get-503", "list-503", "head-503"],
)
@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_s3_retries_transient_errors(
    make_store: StoreFactory,
    fault_proxy: tuple[FaultProxy, str],
    tmp_path: Path,
    case: tuple[Any, Any, int, str],
) -> None:
    matcher, operation, status, code = case
    proxy, endpoint = fault_proxy
    store = make_store(
        endpoint_url=endpoint, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB
    )
    assert isinstance(store, S3Store)
    proxy.fail(matcher, times=1, status=status, code=code)
    operation(store, tmp_path)
    statuses = [entry.status for entry in proxy.log]
    assert statuses.count(status) == 1, proxy.log
    failed = proxy.log[statuses.index(status)]
    # botocore sent the very same request again, and that one succeeded.
    after = proxy.log[statuses.index(status) + 1 :]
    assert any(e.request == failed.request and e.status < 300 for e in after), proxy.log


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_s3_persistent_failure_raises_store_error_without_secrets(
    make_store: StoreFactory, fault_proxy: tuple[FaultProxy, str], aws_env: dict[str, str]
) -> None:
    proxy, endpoint = fault_proxy
    store = make_store(endpoint_url=endpoint, max_attempts=2)
    proxy.fail(_is_put_object, times=-1)
    with pytest.raises(StoreError) as info:
        store.put_bytes("ckpt/c9/model.bin", b"x")
    message = str(info.value)
    assert store.url("ckpt/c9/model.bin") in message
    assert "SlowDown" in message and "503" in message and "1 retry" in message
    assert [e.status for e in proxy.log if e.method == "PUT"] == [503, 503]
    rendered = "".join(traceback.format_exception(info.value))
    secrets = [
        aws_env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    ]
    for secret in [*secrets, "Signature=", "Authorization"]:
        assert secret not in rendered


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_s3_missing_bucket_is_a_store_error(make_store: StoreFactory) -> None:
    store = make_store()
    assert isinstance(store, S3Store)
    ghost = S3Store("rtrl-no-such-bucket", "p", client=store.client)
    with pytest.raises(StoreError, match=r"s3://rtrl-no-such-bucket/p/x.*NoSuchBucket") as info:
        ghost.put_bytes("x", b"1")
    assert not isinstance(info.value, ObjectNotFound)
    with pytest.raises(StoreError, match="NoSuchBucket"):
        list(ghost.list())


def test_s3_client_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.example:9000")
    store = S3Store("bucket", "/a/b/", retry_mode="adaptive", max_attempts=4)
    config: Any = store.client.meta.config  # botocore-stubs lack most Config attributes
    assert store.uri == "s3://bucket/a/b/"
    assert store.endpoint_url == "http://minio.example:9000"
    assert store.client.meta.endpoint_url == "http://minio.example:9000"
    assert config.s3 == {"addressing_style": "path"}
    assert config.retries == {"mode": "adaptive", "total_max_attempts": 4}
    assert config.connect_timeout and config.read_timeout
    store.client.close()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    aws = S3Store("bucket", region="eu-west-1")
    assert aws.endpoint_url is None and aws.uri == "s3://bucket/"
    assert getattr(aws.client.meta.config, "s3", None) is None
    assert aws.client.meta.region_name == "eu-west-1"
    aws.client.close()


# --- local: modes, atomicity, temp files ----------------------------------------------------


def test_local_modes_atomicity_and_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "root")
    store.put_bytes("a/b.txt", b"one")
    src = tmp_path / "src"
    src.write_bytes(b"two")
    src.chmod(0o600)
    store.put_file("a/c.txt", src)
    for name in ("a/b.txt", "a/c.txt"):
        assert (tmp_path / "root" / name).stat().st_mode & 0o777 == 0o644
    (tmp_path / "root" / "a" / ".tmp-crashed").write_bytes(b"junk")
    assert [o.key for o in store.list()] == ["a/b.txt", "a/c.txt"]

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StoreError, match=r"file://.*/a/b.txt.*No space left"):
        store.put_bytes("a/b.txt", b"new")
    monkeypatch.undo()
    assert store.get_bytes("a/b.txt") == b"one"  # the old object, untouched
    assert sorted(p.name for p in (tmp_path / "root" / "a").iterdir()) == [
        ".tmp-crashed",
        "b.txt",
        "c.txt",
    ]


def test_local_store_requires_an_absolute_root() -> None:
    with pytest.raises(ValueError, match="absolute"):
        LocalStore(Path("relative/dir"))


# --- URIs ---------------------------------------------------------------------------------


def test_open_store_by_uri(tmp_path: Path) -> None:
    local = open_store(tmp_path.as_uri() + "/")
    assert isinstance(local, LocalStore) and local.root == tmp_path
    assert local.uri == tmp_path.as_uri() + "/"
    s3 = open_store("s3://my-bucket/ckpts/", endpoint_url="http://127.0.0.1:1", region="us-east-1")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("my-bucket", "ckpts")
    assert s3.uri == "s3://my-bucket/ckpts/"
    s3.client.close()


def test_parse_store_uri() -> None:
    assert parse_store_uri("s3://bkt") == parse_store_uri("s3://bkt/")
    parsed = parse_store_uri("s3://bkt/a/b/")
    assert (parsed.scheme, parsed.bucket, parsed.path) == ("s3", "bkt", "a/b")
    parsed = parse_store_uri("file:///var/lib/rtrl%20data/")
    assert (parsed.scheme, parsed.path) == ("file", "/var/lib/rtrl data")
    assert parse_store_uri("file://localhost/x").path == "/x"


@pytest.mark.parametrize(
    "uri",
    [
        "relative/path",
        "/abs/path",
        "file:relative",
        "file://host/path",
        "http://example.com/bucket",
        "gs://bucket/x",
        "s3://",
        "s3://Bad_Bucket/x",
        "s3://bkt/a/../b",
        "s3://bkt/x?versionId=1",
        "file:///a/../b",
    ],
)
def test_bad_uris_are_value_errors_naming_the_uri(uri: str) -> None:
    with pytest.raises(ValueError) as info:
        open_store(uri)
    assert repr(uri) in str(info.value)


def test_split_uri() -> None:
    assert split_uri("s3://bkt/ckpt/1/result.json") == ("s3://bkt/ckpt/1/", "result.json")
    assert split_uri("s3://bkt/top.json") == ("s3://bkt/", "top.json")
    assert split_uri("file:///data/my%20file.txt") == ("file:///data/", "my file.txt")
    for prefix_uri in ("s3://bkt/ckpt/", "s3://bkt", "file:///data/"):
        with pytest.raises(ValueError, match="prefix"):
            split_uri(prefix_uri)
