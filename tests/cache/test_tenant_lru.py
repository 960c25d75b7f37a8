"""TenantLru (what is kept per scope beside the KV): a tenant's label sets and salts share its bound, the server's
bound is taken from the largest holder, and purges are an owner's."""
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tenant_lru import TenantLru
from prefixcache.engine.drafter import MAX_SCOPES, TENANT_SCOPES, Drafter


def test_a_tenant_flooding_label_sets_keeps_its_bound_and_takes_nothing_of_anothers():
    lru = TenantLru(per_tenant=3, total=7)
    b = [CacheScope(tenant="b", salt=s) for s in "12"]
    for s in b:
        lru.put(s, s.salt)
    for i in range(50):
        lru.put(CacheScope(tenant="a", labels=(f"group-{i}",)), i)
    assert lru.held() == {"a": 3, "b": 2} and [lru.get(s) for s in b] == ["1", "2"]
    assert lru.get(CacheScope(tenant="a", labels=("group-49",))) == 49  # the newest kept
    assert lru.get(CacheScope(tenant="a", labels=("group-0",))) is None
    for t in "cd":
        for s in "123":
            lru.put(CacheScope(tenant=t, salt=s), s)
    assert len(lru.items) == 7 and lru.held()["b"] == 2  # the largest holders gave up their oldest
    lru.purge(("b", ()))
    assert "b" not in lru.held() and lru.setdefault(b[0], lambda: "new") == "new"


def test_answer_tables_are_bounded_over_a_tenants_label_sets():
    drafter = Drafter("answers", 4)
    for i in range(TENANT_SCOPES + 10):
        drafter.record(CacheScope(tenant="a", labels=(f"g{i}",)), [1, 2, 3, 4, 5, 6], 2)
    assert drafter.tables.held() == {"a": TENANT_SCOPES} and TENANT_SCOPES < MAX_SCOPES
