"""Settings: flag > EDGETP_* environment > TOML file > defaults, and one clear line per mistake."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edgetp.config import ConfigError, Settings, load_settings

NO_FILE = Path("/nonexistent/edgetp.toml")


def load(flags=None, env=None, path=None):
    return load_settings(flags or {}, env or {}, path, default_path=NO_FILE)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "edgetp.toml"
    p.write_text(text)
    return p


def test_defaults_apply_when_nothing_is_given():
    s = load(env={"XDG_CACHE_HOME": "/xdg"})
    assert (s.model, s.host, s.data_port, s.http_port, s.sync, s.ctx) == ("smollm2", "0.0.0.0", 7710, 7711, "f32", 2048)
    assert s.priority == 0 and s.no_root is False and s.threads is None and s.peers == ()
    assert s.node_id  # derived from the host name
    assert s.cache_dir == Path("/xdg/edgetp")


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path):
    p = write(tmp_path, 'data_port = 1001\nhttp_port = 2001\npriority = 3\nmodel = "file.gguf"\n')
    env = {"EDGETP_DATA_PORT": "1002", "EDGETP_HTTP_PORT": "2002"}
    s = load(flags={"data_port": 1003, "http_port": None}, env=env, path=p)
    assert s.data_port == 1003      # flag
    assert s.http_port == 2002      # env (the flag was not given)
    assert s.priority == 3          # file
    assert s.model == "file.gguf"   # file
    assert s.ctx == 2048            # default


def test_environment_strings_become_typed_values():
    env = {"EDGETP_NO_ROOT": "yes", "EDGETP_INTERFACES": "127.0.0.1, 10.0.0.2", "EDGETP_THREADS": "2",
           "EDGETP_PEERS": "10.0.0.5:7710,[fe80::1]:7710", "EDGETP_KEY_FILE": "/k", "EDGETP_CACHE_DIR": "/c"}
    s = load(env=env)
    assert s.no_root is True and s.threads == 2
    assert s.interfaces == ("127.0.0.1", "10.0.0.2")
    assert s.peer_addresses == (("10.0.0.5", 7710), ("fe80::1", 7710))
    assert s.key_file == Path("/k") and s.cache_dir == Path("/c")


def test_unrelated_environment_variables_are_ignored():
    s = load(env={"PATH": "/bin", "EDGETP_LINK_MODE": "async", "EDGETP_PRIORITY": "5"})
    assert s.priority == 5


def test_the_default_config_file_is_read_when_it_exists(tmp_path):
    p = write(tmp_path, "priority = 9\n")
    assert load_settings({}, {}, None, default_path=p).priority == 9


def test_an_explicit_config_file_that_is_missing_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.toml: config file does not exist"):
        load(path=tmp_path / "missing.toml")


def test_an_unknown_key_in_the_file_names_the_file_and_the_key(tmp_path):
    p = write(tmp_path, "data_prot = 1\n")
    with pytest.raises(ConfigError) as e:
        load(path=p)
    msg = str(e.value)
    assert str(p) in msg and "'data_prot'" in msg and "\n" not in msg


def test_a_bad_type_in_the_file_names_the_file_and_the_key(tmp_path):
    p = write(tmp_path, 'data_port = "7710"\n')
    with pytest.raises(ConfigError, match=rf"^{tmp_path}.*edgetp\.toml: data_port: expected an integer"):
        load(path=p)


def test_a_boolean_is_not_accepted_as_an_integer(tmp_path):
    with pytest.raises(ConfigError, match="priority: expected an integer"):
        load(path=write(tmp_path, "priority = true\n"))


def test_invalid_toml_names_the_file(tmp_path):
    p = write(tmp_path, "data_port = = 1\n")
    with pytest.raises(ConfigError, match=r"edgetp\.toml: not valid TOML"):
        load(path=p)


def test_an_unknown_environment_setting_names_the_variable():
    with pytest.raises(ConfigError, match=r"^EDGETP_DATAPORT: unknown setting 'dataport'"):
        load(env={"EDGETP_DATAPORT": "1"})


@pytest.mark.parametrize("name, text, why", [
    ("EDGETP_DATA_PORT", "seventy", "expected an integer"),
    ("EDGETP_DATA_PORT", "70000", "expected a port"),
    ("EDGETP_NO_ROOT", "maybe", "expected one of 1/0/true"),
    ("EDGETP_SYNC", "f16", "expected one of f32, q8_0"),
    ("EDGETP_CTX", "0", "expected a positive integer"),
    ("EDGETP_PEERS", "10.0.0.1", "expected HOST:PORT"),
    ("EDGETP_NODE_ID", "a.b", "expected 1-63"),
])
def test_a_bad_environment_value_names_the_variable_and_the_key(name, text, why):
    key = name.removeprefix("EDGETP_").lower()
    with pytest.raises(ConfigError, match=rf"^{name}: {key}: {why}"):
        load(env={name: text})


def test_an_unknown_flag_is_an_error():
    with pytest.raises(ConfigError, match=r"^--bogus: unknown setting 'bogus'"):
        load(flags={"bogus": 1})


def test_a_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--threads: threads: expected a positive integer"):
        load(flags={"threads": -1})


def test_a_bad_list_in_the_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="interfaces: expected a list of strings"):
        load(path=write(tmp_path, 'interfaces = "127.0.0.1"\n'))


def test_settings_are_frozen_and_change_through_replace_which_rechecks():
    s = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.priority = 1  # type: ignore[misc]
    t = dataclasses.replace(s, peers=("h:1",))
    assert t.peer_addresses == (("h", 1),) and s.peer_addresses == ()
    with pytest.raises(ConfigError, match="^Settings: sync"):
        dataclasses.replace(s, sync="bf16")


def test_the_example_config_in_systemd_loads():
    example = Path(__file__).resolve().parent.parent / "systemd" / "edgetp.toml"
    s = load(path=example)
    assert isinstance(s, Settings)


def test_memory_cap_and_slice_cache_size_come_from_file_or_environment(tmp_path):
    s = load()
    assert s.max_memory_mb is None and s.slice_cache_mb == 4096  # no cap; 4 GiB of slices
    p = write(tmp_path, "max_memory_mb = 900\nslice_cache_mb = 512\n")
    assert (load(path=p).max_memory_mb, load(path=p).slice_cache_mb) == (900, 512)
    s = load(env={"EDGETP_MAX_MEMORY_MB": "700", "EDGETP_SLICE_CACHE_MB": "64"}, path=p)
    assert (s.max_memory_mb, s.slice_cache_mb) == (700, 64)


@pytest.mark.parametrize("text", ["max_memory_mb = 0", "max_memory_mb = -5", 'max_memory_mb = "1G"',
                                  "slice_cache_mb = 0", "slice_cache_mb = 1.5"])
def test_a_memory_cap_or_cache_size_that_is_not_a_positive_integer_is_refused(tmp_path, text):
    key = text.split()[0]
    with pytest.raises(ConfigError, match=rf"edgetp.toml: {key}: expected"):
        load(path=write(tmp_path, text + "\n"))


def test_heartbeat_timing_comes_from_file_or_environment_and_must_leave_room_to_lose_a_peer(tmp_path):
    conf = tmp_path / "edgetp.toml"
    conf.write_text("heartbeat_s = 2\nheartbeat_timeout_s = 10.5\n")
    s = load_settings({}, {"EDGETP_SETTLE_S": "0.5"}, conf)
    assert (s.heartbeat_s, s.heartbeat_timeout_s, s.settle_s) == (2.0, 10.5, 0.5)
    with pytest.raises(ConfigError, match="heartbeat_s .* must be below heartbeat_timeout_s"):
        load_settings({}, {"EDGETP_HEARTBEAT_S": "12"}, conf)
    for bad in ("0", "-1", "soon", "7200"):
        with pytest.raises(ConfigError, match="EDGETP_SETTLE_S"):
            load_settings({}, {"EDGETP_SETTLE_S": bad}, conf)


def test_the_kernel_switches_the_client_token_and_the_test_knob_are_not_refused_as_unknown_settings(tmp_path):
    env = {"EDGETP_INT8": "0", "EDGETP_ISA": "avx2", "EDGETP_API_KEY": "x" * 20,
           "EDGETP_TEST_CHILD_TIMEOUT": "3600"}  # the arm64 bed sets it for every process it runs
    assert load_settings({}, env, default_path=tmp_path / "none.toml").api_tokens == ()


def test_api_tokens_are_a_list_of_long_printable_words(tmp_path):
    s = load_settings({}, {"EDGETP_API_TOKENS": "tok-aaaaaaaaaaaaaaaa, tok-bbbbbbbbbbbbbbbb"},
                      default_path=tmp_path / "none.toml")
    assert s.api_tokens == ("tok-aaaaaaaaaaaaaaaa", "tok-bbbbbbbbbbbbbbbb")
    with pytest.raises(ConfigError, match="16 or more"):
        load_settings({}, {"EDGETP_API_TOKENS": "short"}, default_path=tmp_path / "none.toml")


# one valid value per setting, as TOML writes it and as an environment variable spells it
EVERY = {"model": ('"m.gguf"', "m.gguf"), "key_file": ('"/k"', "/k"), "host": ('"10.0.0.1"', "10.0.0.1"),
         "data_port": ("1001", "1001"), "http_port": ("2001", "2001"), "interfaces": ('["10.0.0.1"]', "10.0.0.1"),
         "priority": ("3", "3"), "no_root": ("true", "yes"), "threads": ("2", "2"), "cache_dir": ('"/c"', "/c"),
         "node_id": ('"pi-1"', "pi-1"), "peers": ('["10.0.0.2:7711"]', "10.0.0.2:7711"), "sync": ('"q8_0"', "q8_0"),
         "sync_pieces": ("3", "3"), "ctx": ("512", "512"), "slots": ("8", "8"), "kv_type": ('"q8_0"', "q8_0"),
         "parallel": ('"pp"', "pp"), "experts": ('"place"', "place"),
         "api_tokens": ('["0123456789abcdef"]', "0123456789abcdef"), "max_memory_mb": ("1024", "1024"),
         "slice_cache_mb": ("100", "100"), "heartbeat_s": ("0.5", "0.5"), "heartbeat_timeout_s": ("9.5", "9.5"),
         "settle_s": ("2", "2")}


@pytest.mark.parametrize("key", sorted(EVERY))
def test_every_setting_reads_the_same_from_the_file_and_from_the_environment(tmp_path, key):
    toml, text = EVERY[key]
    from_file = load(path=write(tmp_path, f"{key} = {toml}\n"))
    from_env = load(env={f"EDGETP_{key.upper()}": text})
    assert getattr(from_env, key) == getattr(from_file, key) != getattr(load(), key)


def test_every_setting_is_covered_by_the_table_above():
    assert set(EVERY) == {f.name for f in dataclasses.fields(Settings) if f.init}


def test_a_config_file_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "edgetp.toml"
    p.write_bytes(b"\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"edgetp\.toml: not valid TOML: not UTF-8"):
        load(path=p)
