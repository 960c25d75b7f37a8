"""Every engine option is a `prefixcache serve` flag with Config's default; a TOML file sets the same options."""
import argparse
from dataclasses import fields

import pytest

from prefixcache.cli import build_parser, main
from prefixcache.config import Config
from prefixcache.options import default, resolve, size
from prefixcache.server.config import SERVE_OPTIONS, ServeConfig
from prefixcache.server.state import load_engine


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _serve_parser() -> argparse.ArgumentParser:
    return next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))


def test_every_engine_option_is_a_flag():
    engine_flags = {a.dest for g in _serve_parser()._action_groups if g.title == "engine (Config)"
                    for a in g._group_actions}
    assert {f.name for f in fields(Config)} - engine_flags == {"shared_prefixes"}  # the server's --shared-prefixes
    # takes a file of strings instead of token ids
    assert resolve(_serve(), SERVE_OPTIONS) == ({}, {})  # nothing given: Config's defaults apply


def test_flags_override_the_file(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('kv_cache_bytes = 1073741824\nmin_cache_tokens = 512\nenable_prefix_cache = false\n'
                    'port = 9000\napi_keys = "keys.json"\n')
    args = _serve("--config", str(toml), "--min-cache-tokens", "64", "--kv-cache-bytes", "512MiB",
                  "--enable-prefix-cache", "--default-ttl", "300")
    engine, serve = resolve(args, SERVE_OPTIONS)
    assert engine == {"kv_cache_bytes": 512 * 2**20, "min_cache_tokens": 64, "enable_prefix_cache": True,
                      "default_ttl": 300.0}
    assert serve == {"port": 9000, "api_keys": "keys.json"}
    assert Config(**engine).kv_cache_bytes == 512 * 2**20


def test_bad_options_name_the_problem(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text("kv_cache_gb = 2\n")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kv_cache_gb'\].*kv_cache_bytes"):
        resolve(_serve("--config", str(toml)), SERVE_OPTIONS)
    with pytest.raises(argparse.ArgumentTypeError, match="not an integer or size"):
        size("two gigs")
    assert (size("2G"), size("1.5GiB"), size("4096"), size("64k")) == (2**31, 3 * 2**29, 4096, 65536)
    assert default("block_size") == Config().block_size


def test_serve_refuses_the_torch_path_unless_allowed(tiny_model, capsys):
    """A replica where our kernels do not run (here: --kernels off) would decode 4-5x slower: it does not start,
    and says why, unless --allow-torch-path."""
    engine, serve = resolve(_serve("--model", tiny_model, "--kernels", "off", "--allow-torch-path"), SERVE_OPTIONS)
    assert serve == {"allow_torch_path": True}
    assert load_engine(ServeConfig(Config(**engine), **serve)).exactness.mode != "kernel"
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--model", tiny_model, "--kernels", "off", "--port", "0"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "our kernels do not run here (off: kernels=off)" in err and "--allow-torch-path" in err
