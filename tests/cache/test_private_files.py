"""What the server loads and keeps on disk is this user's alone (issue 57, item 7): the user cache and the L2 folder
are made 0700 and refused when another user made them, may write them, or they are links; L2's start-up scan follows
no link; records and temporary files are 0600; and the kernel library loads only with the hash its build wrote."""
import os
import shutil
import stat

import pytest

from prefixcache import kernels
from prefixcache.cache.credentials import TIER_SECRET_ENV, tier_secret
from prefixcache.cache.disk import DiskTier
from prefixcache.files import cache_home, private_dir

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_folder_is_private_and_an_open_one_of_ours_is_closed(tmp_path):
    assert mode(private_dir(str(tmp_path / "a" / "b"))) == 0o700
    (tmp_path / "open").mkdir(mode=0o755)
    assert mode(private_dir(str(tmp_path / "open"))) == 0o700


@pytest.mark.parametrize("make, why", [
    (lambda p: os.symlink(p.parent, p), "a symbolic link"),
    (lambda p: p.write_text("x"), "not a folder"),
    (lambda p: (p.mkdir(), os.chmod(p, 0o777)), "writable by other users"),
    pytest.param(lambda p: (p.mkdir(), os.chown(p, 1, 1)), "owned by uid 1", marks=AS_ROOT),
])
def test_a_folder_another_user_could_have_made_or_written_is_refused(tmp_path, make, why):
    path = tmp_path / "cache"
    make(path)
    with pytest.raises(ValueError, match=why):
        private_dir(str(path))


@AS_ROOT
def test_the_user_cache_and_the_disk_tier_refuse_another_users_folder(tmp_path, monkeypatch):
    """Another local user pre-creates the folder (with a tier-secret and forged records of its choosing)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "tier-secret").write_text("a" * 64)
    os.chown(theirs, 1, 1)
    monkeypatch.setenv("PREFIXCACHE_HOME", str(theirs))
    monkeypatch.delenv(TIER_SECRET_ENV, raising=False)  # no secret given: the folder's would be read
    with pytest.raises(ValueError, match="owned by uid 1"):
        cache_home()
    with pytest.raises(ValueError, match="owned by uid 1"):
        DiskTier(str(theirs), 1 << 20)
    with pytest.raises(ValueError, match="owned by uid 1"):
        tier_secret("", str(theirs), l3=False)


def test_the_disk_tier_follows_no_link_at_start_and_keeps_records_private(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("not a block")
    root = tmp_path / "l2"
    root.mkdir()
    os.symlink(victim, root / "ab")  # an owner's folder that is a link elsewhere
    (root / "cd").mkdir()
    os.symlink(victim / "precious.txt", root / "cd" / "x.kv")  # a record that is a link
    disk = DiskTier(str(root), 1 << 20)
    assert (victim / "precious.txt").read_text() == "not a block"  # start-up deleted nothing through a link
    assert not os.path.lexists(root / "cd" / "x.kv") and disk.keys() == []
    disk.put("ef", "0123", b"kv bytes", None)
    assert mode(root) == 0o700 and mode(root / "ef") == 0o700 and mode(root / "ef" / "0123.kv") == 0o600
    assert disk.get("ef", "0123") == b"kv bytes"


def test_a_kernel_library_whose_bytes_changed_is_not_loaded(tmp_path, monkeypatch):
    built = kernels.loaded()
    if built.problem:
        pytest.skip(f"no kernel library here: {built.problem}")
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    copy = os.path.join(kernels.folder(), os.path.basename(os.path.dirname(built.path)))
    shutil.copytree(os.path.dirname(built.path), copy)
    assert kernels.find(kernels.compiler()) == os.path.join(copy, f"{kernels.LIBRARY}.so")
    with open(os.path.join(copy, f"{kernels.LIBRARY}.so"), "ab") as f:
        f.write(b"\0")  # another library put in its place
    lib = kernels._load()
    assert lib.path == "" and "its bytes are not those its build wrote" in lib.problem
    os.unlink(os.path.join(copy, f"{kernels.LIBRARY}.so.sha256"))
    assert kernels.find(kernels.compiler()) == ""  # without the hash its build wrote, there is no build
