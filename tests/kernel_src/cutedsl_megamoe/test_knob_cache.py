"""The knob cache: round trip, exact-key lookup (another drop or DSL version misses), ``off``, damaged
files, and atomic writes under concurrent writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

knob_cache = drop.knob_cache
G = drop.Geometry(2048, 768, 128, 8, "swiglu", None)
CTX = knob_cache.TuneContext("NVIDIA H200", world_size=1)


def _key(bucket: str = "decode", geometry: drop.Geometry = G, ctx: knob_cache.TuneContext = CTX) -> knob_cache.KnobKey:
    return knob_cache.KnobKey.make(drop.tuner.BF16, geometry, bucket, ctx)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "knobs.json"
    assert knob_cache.lookup(_key(), path) is None
    assert knob_cache.record(_key(), {"tile_m": 64}, path, ms=0.123, tokens=64) == path
    knob_cache.record(_key("prefill"), {"tile_m": 128}, path)
    hit = knob_cache.lookup(_key(), path)
    assert hit is not None and hit.knobs == {"tile_m": 64} and hit.ms == 0.123 and hit.tokens == 64
    assert knob_cache.lookup(_key("prefill"), path).knobs == {"tile_m": 128}
    key = hit.key
    record = drop.read_vendor()
    assert (key["drop_version"], key["dsl_version"]) == (record.version, record.dsl_version)
    assert key["device_name"] == "NVIDIA H200" and key["bucket"] == "decode" and key["activation"] == "swiglu"
    assert {"dtype", "world_size", "combine_dtype", "geometry", "kernel"} <= set(key)
    assert len(knob_cache.entries(path)) == 2
    knob_cache.record(_key(), {"tile_m": 128}, path)  # overwrite, keep the other entry
    assert knob_cache.lookup(_key(), path).knobs == {"tile_m": 128} and len(knob_cache.entries(path)) == 2


@pytest.mark.parametrize("field", ["version", "dsl_version"])
def test_another_drop_or_dsl_version_misses(tmp_path: Path, monkeypatch, field: str) -> None:
    path = tmp_path / "knobs.json"
    knob_cache.record(_key(), {"tile_m": 64}, path)
    record = drop.read_vendor()
    changed = type(record)(**{**record.__dict__, field: "other"})
    monkeypatch.setattr(knob_cache, "read_vendor", lambda: changed)
    assert knob_cache.lookup(_key(), path) is None


def test_every_key_field_counts(tmp_path: Path) -> None:
    path = tmp_path / "knobs.json"
    knob_cache.record(_key(), {"tile_m": 64}, path)
    others = [
        _key("mid"),
        _key(geometry=drop.Geometry(2048, 768, 64, 8, "swiglu", None)),
        _key(geometry=drop.Geometry(2048, 768, 128, 8, "geglu", None)),
        _key(ctx=knob_cache.TuneContext("NVIDIA H100 80GB HBM3")),
        _key(ctx=knob_cache.TuneContext("NVIDIA H200", world_size=8)),
        _key(ctx=knob_cache.TuneContext("NVIDIA H200", combine_dtype="float32")),
        _key(ctx=knob_cache.TuneContext("NVIDIA H200", dtype="float16")),
    ]
    assert len({k.digest() for k in others} | {_key().digest()}) == len(others) + 1
    assert all(knob_cache.lookup(k, path) is None for k in others)


def test_env_path_off_and_damaged_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(knob_cache.KNOB_CACHE_ENV, str(tmp_path / "env.json"))
    assert knob_cache.cache_path() == tmp_path / "env.json"
    knob_cache.record(_key(), {"tile_m": 64})
    assert knob_cache.lookup(_key()).knobs == {"tile_m": 64}
    monkeypatch.setenv(knob_cache.KNOB_CACHE_ENV, "off")
    assert knob_cache.cache_path() is None
    assert knob_cache.lookup(_key()) is None and knob_cache.record(_key(), {}) is None
    monkeypatch.delenv(knob_cache.KNOB_CACHE_ENV)
    assert knob_cache.cache_path() == Path.home() / ".cache" / "flashinfer" / "moe_ep" / "knobs.json"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert knob_cache.lookup(_key(), bad) is None and knob_cache.entries(bad) == []
    knob_cache.record(_key(), {"tile_m": 64}, bad)  # a damaged file is replaced by a whole one
    assert json.loads(bad.read_text())["format"] == knob_cache.FORMAT
    # a hand-edited entry whose stored key differs from its slot is a miss, not a wrong hit
    data = json.loads(bad.read_text())
    (slot,) = data["entries"]
    data["entries"][slot]["key"]["bucket"] = "prefill"
    bad.write_text(json.dumps(data))
    assert knob_cache.lookup(_key(), bad) is None


WRITER = """
import sys
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
kc = drop.knob_cache
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    ctx = kc.TuneContext(f"dev-{who}-{i}")
    kc.record(kc.KnobKey.make("moe_bf16_glu", drop.Geometry(256, 128, 16, 4, "swiglu", None), "decode", ctx),
              {"tile_m": 64, "i": i}, __import__("pathlib").Path(path))
"""


def test_two_concurrent_writers_leave_valid_json_with_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "knobs.json"
    n = 40
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n)], env=env, stderr=subprocess.PIPE)
        for who in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    data = json.loads(path.read_text())  # valid JSON
    names = {e["key"]["device_name"] for e in data["entries"].values()}
    assert names == {f"dev-{w}-{i}" for w in "ab" for i in range(n)}  # no lost update
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no stray temp files
