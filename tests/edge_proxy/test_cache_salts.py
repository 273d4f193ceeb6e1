"""Cache salts are always keyed: with the replica secret, the same on every proxy of a
region; without one (replica stubs only), a random key per process. Nobody who knows
a tenant's name can compute its salt."""

import hashlib

from edge_proxy.auth import KeyStore, cache_salt

ENTRIES = [{"key": "sk-a", "tenant": "acme"}]


def test_salts_follow_the_replica_secret():
    a, b = KeyStore(ENTRIES, salt_secret="s3cret"), KeyStore(ENTRIES, salt_secret="s3cret")
    assert a.check("sk-a").cache_salt == b.check("sk-a").cache_salt == cache_salt("acme", "s3cret")


def test_without_a_secret_salts_are_keyed_at_random():
    a, b = KeyStore(ENTRIES), KeyStore(ENTRIES, anonymous=True)
    unkeyed = {cache_salt("acme", ""), hashlib.blake2b(b"acme", digest_size=12).hexdigest()}
    assert a.check("sk-a").cache_salt not in unkeyed
    assert a.check("sk-a").cache_salt != b.check("sk-a").cache_salt
    assert b.check(None).cache_salt != cache_salt("anonymous", "")
