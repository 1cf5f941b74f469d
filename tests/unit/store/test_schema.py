"""The schema's table of keys (store/schema.py) against the code that names keys and the ACL
of each service: the table lists every key the store builds, and a service may write what
the table says it writes."""

from __future__ import annotations

import fnmatch
import importlib

from specserve.store import acl, schema
from specserve.store.schema import KEYS, Layout

SINGLE, CLUSTER = Layout(cluster=False), Layout(cluster=True)


def examples() -> dict[str, list[str]]:
    """Keys as the store builds them, by the pattern of the table they are instances of."""
    rid, shard = "acme:r1", CLUSTER.shard_of("acme:r1")
    both = (SINGLE, CLUSTER)
    return {
        "req:<id>": [at.req(rid) for at in both],
        "out:<id>": [at.out(rid) for at in both],
        "queue:<class>": [at.queue("interactive", shard) for at in both],
        "queued:<class>": [at.queued("batch", shard) for at in both],
        "requeued:<class>": [at.requeued("batch", shard) for at in both],
        "owned:<verifier id>": [at.owned("v1", shard) for at in both],
        "owners": [at.owners(shard) for at in both],
        "wake:<gateway>:<reader>": [at.gateway_wake("g1", 0, shard) for at in both],
        "verifier:<id>": [at.member("verifier", "v1") for at in both],
        "verifiers": [at.members("verifier") for at in both],
        "drafter:<id>": [at.member("drafter", "d1") for at in both],
        "drafters": [at.members("drafter") for at in both],
        "rollout": [schema.ROLLOUT_KEY],
        "result:<hash>": [schema.result_key("abc")],
        "session:<session id>": [schema.session_key("s1")],
        "stored:{<tenant>}:<minute>": schema.stored_keys("acme", 29_000_000)[:2],
        "apikey:<key id>": [schema.key_record("k1")],
        "apikeys": [schema.KEY_IDS],
        "quota:{<key id>}": [schema.quota_keys("k1")[0]],
        "streams:{<key id>}": [schema.quota_keys("k1")[1]],
        "audit": [schema.AUDIT_STREAM],
    }


def test_the_table_lists_every_key_the_store_builds_once():
    patterns = [key.pattern for key in KEYS]
    assert len(patterns) == len(set(patterns))
    assert set(patterns) == set(examples())


def test_each_key_names_its_type_owner_ttl_writers_and_module():
    for key in KEYS:
        assert key.type and key.owner and key.ttl and key.writers and key.holds, key.pattern
        importlib.import_module(f"specserve.store.{key.module}")
        assert key.tag in ("", "shard", "registry", "own"), key.pattern


def test_every_service_that_writes_a_key_may_write_it():
    built = examples()
    for key in KEYS:
        writers = [s for s in acl.SERVICES if s in key.writers]
        for service in writers:
            for name in built[key.pattern]:
                allowed = any(fnmatch.fnmatchcase(name, p) for p in acl.KEYS[service])
                assert allowed, f"{service} writes {name} ({key.pattern}) but its ACL denies it"


def test_keys_are_hash_tagged_as_the_table_says():
    built = examples()
    for key in KEYS:
        cluster_name = built[key.pattern][-1]
        tagged = "{" in cluster_name
        assert tagged == (key.tag != ""), key.pattern
