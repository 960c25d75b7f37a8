"""CacheScope keys: every field encoded with its length, so no two scopes share a key however their labels split a
text; and the labels a scope may hold (cache/scope.py validate_labels)."""
import pytest

from prefixcache.cache.scope import MAX_LABEL_LENGTH, MAX_LABELS, CacheScope, validate_labels


def test_labels_that_join_alike_are_different_scopes_and_owners():
    splits = [("finance,legal",), ("finance", "legal"), ("a,b,c",), ("a", "b,c"), ("a,b", "c"), ("a", "b", "c"),
              ("a\x1fb",), ("a", "b"), ("1:a",), ("a",)]
    scopes = [CacheScope(tenant="acme", labels=labels) for labels in splits]
    assert len({s.key for s in scopes}) == len({s.owner for s in scopes}) == len(splits)
    assert CacheScope("acme", ("a", "b")).key == CacheScope("acme", ("b", "a", "a")).key  # a set of labels


@pytest.mark.parametrize("labels, problem", [
    ("finance", "a list of non-empty strings"), ([""], "a list of non-empty strings"), ([7], "non-empty strings"),
    ([f"l{i}" for i in range(MAX_LABELS + 1)], f"17 labels, at most {MAX_LABELS}"),
    (["x" * (MAX_LABEL_LENGTH + 1)], f"129 characters, at most {MAX_LABEL_LENGTH}"),
    (["fin\x00ance"], "non-printable"), (["finance\nlegal"], "non-printable"), (["tier\x1f2"], "non-printable"),
])
def test_labels_a_scope_cannot_hold_are_refused(labels, problem):
    with pytest.raises(ValueError, match=problem):
        validate_labels(labels)


def test_labels_within_the_limits_are_kept_distinct_and_sorted():
    most = [f"label {i}" for i in range(MAX_LABELS)] * 2
    assert validate_labels(most) == tuple(sorted(set(most)))
    assert validate_labels(["x" * MAX_LABEL_LENGTH, "finance,legal", "Ünïcode"]) == (
        "finance,legal", "x" * MAX_LABEL_LENGTH, "Ünïcode")
