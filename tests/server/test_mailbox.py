"""A request's updates on their way to its handler (server/mailbox.py): in order, one a step while the handler keeps
up, merged past MERGE_AFTER waiting, and an error after what the engine wrote before it."""
import asyncio

from prefixcache.server.mailbox import MERGE_AFTER, Mailbox
from prefixcache.server.update import Update


def read(box: Mailbox, n: int) -> list[Update]:
    async def take():
        return [await box.get() for _ in range(n)]
    return asyncio.run(take())


def test_an_error_comes_after_the_text_written_before_it():
    """A stream that fails at its third token still shows its first two (the client reads them, then the error)."""
    box = Mailbox()
    for text in ("Once", " upon"):
        box.put(Update(text, [0.0]))
    box.put(Update("", [0.0], error="internal engine error", status=500))
    box.put(Update(" late", [0.0]))  # nothing after the error
    got = read(box, 4)
    assert [u.text for u in got[:2]] == ["Once", " upon"] and all(u.error for u in got[2:])


def test_a_handler_that_does_not_read_holds_merge_after_updates_and_its_text_once():
    box = Mailbox()
    for i in range(3 * MERGE_AFTER):
        box.put(Update(f"{i} ", [float(i)]))
    assert len(box.waiting) == MERGE_AFTER
    got = read(box, MERGE_AFTER)
    assert "".join(u.text for u in got) == "".join(f"{i} " for i in range(3 * MERGE_AFTER))
