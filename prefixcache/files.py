"""The user cache (cache_home) and every folder the server loads code and data from, or keeps KV in: this user's
alone.

What lies under them is trusted (a kernel library it loads, a GGUF index, a tokenizer, probe verdicts, KV records
whose layer-0 values give the text away), so a folder another local user could have made, linked or written is
refused rather than used: created 0700, and when it exists, a symbolic link, something else than a folder, another
user's, or one others may write is a ValueError naming it. A folder of ours that others may read is made 0700.
"""
import os
import stat


def private_dir(path: str) -> str:
    """`path`, a folder only this user may enter (its missing parents are created as os.makedirs does)."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    problem = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"owned by uid {st.st_uid}, not by this process's user ({os.geteuid()})"
               if st.st_uid != os.geteuid() else f"writable by other users (mode {mode:o})" if mode & 0o022 else "")
    if problem:
        raise ValueError(f"{path} is {problem}: refused, since what it holds is loaded and trusted; use a folder "
                         "of this user's own")
    if mode & 0o077:
        os.chmod(path, 0o700)
    return path


def cache_home() -> str:
    """The user cache ($PREFIXCACHE_HOME, else ~/.cache/prefixcache), a private folder: built kernels, probe results,
    GGUF indexes and tokenizers, shipped models' files."""
    return private_dir(os.environ.get("PREFIXCACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache",
                                                                       "prefixcache")))
