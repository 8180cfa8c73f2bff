"""Hostile containers: valid checksums, wrong metadata or absurd sizes.

Each file here is a packed synth Mixtral whose index was edited and whose checksums were made
valid again (``rewrite_index``), so only what the edit says is wrong. Every command that opens
a container (verify, unpack, chat) must refuse it with one line on stderr, a non-zero exit, no
traceback, and nothing written outside the output folder. The checks come from the reader
(``ContainerReader`` runs ``codecs.metadata.check_metadata`` and the limits of
docs/format.md 4.1), so the runtime refuses exactly as verify does.
"""

from __future__ import annotations

import json
import os
import re
import struct

import pytest

from test_cli_pack import assert_one_line_error, run
from test_container_helpers import read_index, rewrite_index
from test_runtime_fixtures import container
from zipmoe.codecs import format as fmt
from zipmoe.codecs.reader import ContainerReader
from zipmoe.errors import ContainerError

_EXP = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    return src, path.read_bytes()


def _expert(doc: dict, layer: int, expert: int, w: str) -> dict:
    for e in doc["tensors"]:
        m = _EXP.search(e["name"])
        if m and (int(m.group(1)), int(m.group(2)), m.group(3)) == (layer, expert, w):
            return e
    raise AssertionError(f"no expert tensor {layer}/{expert}/{w}")


def _dense(doc: dict, suffix: str) -> dict:
    return next(e for e in doc["tensors"] if e["name"].endswith(suffix))


def wrong_expert(doc):
    _expert(doc, 0, 2, "w1")["expert"] = 1


def wrong_layer(doc):
    _expert(doc, 1, 0, "w2")["layer"] = 0


def wrong_proj(doc):
    _expert(doc, 0, 1, "w3")["proj"] = "gate"


def wrong_role(doc):
    e = _expert(doc, 0, 3, "w2")
    e.update(role="dense", expert=None, proj=None)


def expert_marked_dense_elsewhere(doc):
    e = _dense(doc, "layers.0.self_attn.q_proj.weight")
    e.update(role="expert", expert=0, proj="up")


def same_name_twice(doc):
    a, b = _expert(doc, 0, 1, "w1"), _expert(doc, 0, 1, "w3")
    b["name"] = a["name"]
    b["proj"] = "gate"


def synonym_names(doc):
    # w3 and up_proj mean the same projection: the entry would silently replace expert 1's up.
    e = _expert(doc, 0, 1, "w1")
    e["name"] = e["name"].replace(".w1.", ".up_proj.")
    e["proj"] = "up"


def missing_expert(doc):
    doc["tensors"] = [e for e in doc["tensors"] if not ((m := _EXP.search(e["name"])) and m.group(1, 2) == ("1", "3"))]


def missing_projection(doc):
    doc["tensors"].remove(_expert(doc, 1, 2, "w3"))


def wrong_fused_index(doc):
    _expert(doc, 0, 0, "w1")["fused_index"] = 0


def dense_shape_unlike_source(doc):
    e = _dense(doc, "layers.0.self_attn.q_proj.weight")
    e["shape"] = list(reversed(e["shape"])) if e["shape"][0] != e["shape"][1] else [e["shape"][0] * 2, e["shape"][1] // 2]


def huge_embedded_file(doc):
    next(f for f in doc["files"] if f["name"] == "config.json")["raw_length"] = 16 << 40


def huge_tensor(doc):
    """A dense tensor claiming 2^42 elements, its chunks' raw lengths stretched to match (so the
    index is consistent): only the codec's ratio bound says the few stored bytes cannot hold it."""
    e = _dense(doc, "model.norm.weight")
    n = 1 << 42
    e["shape"] = e["source_shape"] = [n]
    e["nbytes"] = n * fmt.DTYPE_SIZES[e["dtype"]]
    total = n if e["dtype"] == "BF16" else e["nbytes"]
    for kind in ("exp", "sm", "data"):
        cs = [c for c in e["chunks"] if c["kind"] == kind]
        if cs:
            cs[-1]["raw_length"] = total - cs[-1]["raw_offset"]
            cs[-1]["codec"] = "zstd"


HOSTILE = {
    wrong_expert: "index says expert 1, its name and shape say 2",
    wrong_layer: "index says layer 0, its name and shape say 1",
    wrong_proj: "index says proj 'gate', its name and shape say 'up'",
    wrong_role: "index says role 'dense', its name and shape say 'expert'",
    # (a packed dense extent is not aligned, which an expert's must be: refused for that first)
    expert_marked_dense_elsewhere: "tensor model.layers.0.self_attn.q_proj.weight",
    same_name_twice: "appears 2 times in the index",
    synonym_names: "are both layer 0 expert 1 up",
    missing_expert: "layer 1 has no expert 3",
    missing_projection: "layer 1 expert 2 and expert 0 differ",
    wrong_fused_index: "index says fused_index 0, its name and shape say none",
    dense_shape_unlike_source: "its name and shape say",
    huge_embedded_file: "embedded file config.json: claims 17592186044416 bytes",
    huge_tensor: "more than codec",
}


def _commands(bad, out_dir):
    return [["verify", bad], ["unpack", bad, "-o", out_dir],
            ["chat", bad, "--prompt", "hi", "--greedy", "--max-new-tokens", "1", "--budget", "64M",
             "--workers", "1", "--threads", "1"]]


def _one_line(cmd, code: int, err: str, *needles: str) -> None:
    """``assert_one_line_error``, except that chat may say "loading FILE …" before its error."""
    if cmd[0] == "chat" and err.startswith("loading "):
        err = err[err.index("zipmoe: error: "):] if "zipmoe: error: " in err else err
    assert_one_line_error(code, err, *needles)


def _refused_everywhere(capsys, tmp_path, data: bytes, needle: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    bad = work / "bad.zmoe"
    bad.write_bytes(data)
    before = sorted(os.listdir(work))
    for cmd in _commands(bad, work / "unpacked"):
        code, out, err = run(capsys, *cmd)
        _one_line(cmd, code, err, needle)
        assert sorted(os.listdir(work)) == before, cmd  # nothing written, not even a temp folder
    assert bad.read_bytes() == data


@pytest.mark.parametrize("edit", list(HOSTILE), ids=[f.__name__ for f in HOSTILE])
def test_hostile_metadata_is_refused_by_every_command(mixtral, capsys, tmp_path, edit):
    _, data = mixtral
    hostile = rewrite_index(data, edit)
    with pytest.raises(ContainerError):
        ContainerReader(_write(tmp_path / "x.zmoe", hostile))
    _refused_everywhere(capsys, tmp_path, hostile, HOSTILE[edit])


def _write(p, data):
    p.write_bytes(data)
    return p


def test_unedited_rewrite_is_accepted(mixtral, tmp_path, capsys):
    """The helper itself changes nothing: a rewrite without an edit verifies (so the refusals
    above are the edits' doing)."""
    _, data = mixtral
    p = _write(tmp_path / "same.zmoe", rewrite_index(data))
    code, _, err = run(capsys, "verify", p)
    assert code == 0, err


def test_deeply_nested_index(mixtral, capsys, tmp_path):
    _, data = mixtral
    deep = b'{"format":"zmoe","meta":' + b"[" * 100_000 + b"]" * 100_000 + b',"tensors":[]}'
    _refused_everywhere(capsys, tmp_path, rewrite_index(data, raw_index=deep), "nested deeper than 64 levels")
    meta_deep = read_index(data)
    m = meta_deep["meta"]
    for _ in range(80):  # deep enough to break the limit, not the JSON parser
        m["x"] = {}
        m = m["x"]
    p = _write(tmp_path / "m.zmoe", rewrite_index(data, lambda d: meta_deep))
    with pytest.raises(ContainerError, match="nested deeper than 64"):
        ContainerReader(p)


    def unknown_key(doc):  # readers ignore unknown keys, but not how deep they go
        v = []
        for _ in range(200):
            v = [v]
        doc["future_key"] = v

    p = _write(tmp_path / "k.zmoe", rewrite_index(data, unknown_key))
    with pytest.raises(ContainerError, match="future_key is nested deeper than 64"):
        ContainerReader(p)


def test_index_larger_than_the_limit_is_refused_before_reading(tmp_path, capsys):
    """A header claiming a 1.5 GiB index (the file is that large, sparse) is refused from the
    header alone: nothing of that size is read or allocated."""
    from zipmoe.codecs.checksum import checksum

    p = tmp_path / "big.zmoe"
    ilen = 3 << 29
    body = struct.pack("<8sHHIQQQQQ", fmt.MAGIC, 1, 1, 64, 4096, 4096, ilen, 0, 0)
    with open(p, "wb") as f:
        f.write(body + struct.pack("<Q", checksum(body)))
        f.truncate(4096 + ilen)
    for cmd in _commands(p, tmp_path / "unpacked"):
        code, _, err = run(capsys, *cmd)
        _one_line(cmd, code, err, "its index claims 1610612736 bytes")
    assert not (tmp_path / "unpacked").exists()


def test_dense_shape_against_the_model_is_checked_before_decoding(mixtral, capsys, tmp_path, monkeypatch):
    """A dense tensor whose shape (and source shape: the file is self-consistent) is not the
    model's: chat refuses naming it, without decoding it first."""
    _, data = mixtral

    def transpose(doc):
        e = _dense(doc, "layers.0.self_attn.o_proj.weight")
        a, b = e["shape"]
        e["shape"] = e["source_shape"] = [b, a] if a != b else [a * 2, b // 2]

    p = _write(tmp_path / "t.zmoe", rewrite_index(data, transpose))
    code, _, err = run(capsys, "verify", p)
    assert code == 0, err  # nothing in the file contradicts itself
    decoded = []
    orig = ContainerReader.decode_entry
    monkeypatch.setattr(ContainerReader, "decode_entry",
                        lambda self, e, *a, **k: decoded.append(e.name) or orig(self, e, *a, **k))
    code, _, err = run(capsys, "chat", p, "--prompt", "hi", "--greedy", "--max-new-tokens", "1", "--budget", "64M",
                       "--workers", "1", "--threads", "1")
    _one_line(["chat"], code, err, "layers.0.self_attn.o_proj.weight has shape", "the model expects")
    assert decoded == []


# ------------------------------------------------- element types of the 1.1 tensor columns
# Every column of a 1.1 index with one value of a wrong type (random mutations of an index found
# `dtype` lists and dicts reaching a set() of the column: "internal error: TypeError: unhashable
# type"). Each is refused when the file is opened, naming the entry and the field.

_WRONG = [[1, 2], {"a": 1}]
_STR_COLS = ("name", "dtype", "role")
_NULLABLE_STR_COLS = ("proj",)
_INT_COLS = ("nbytes", "source_index", "extent_offset", "extent_length", "chunk_count")
_NULLABLE_INT_COLS = ("layer", "expert", "fused_index")
_SHAPE_COLS = ("shape", "source_shape")
WRONG_TYPES = (
    [("dtype", v) for v in ([1, 2], {"a": 1}, 7, None, True, 1.5, "")]
    + [(c, v) for c in _STR_COLS if c != "dtype" for v in _WRONG + [7, None]]
    + [(c, v) for c in _NULLABLE_STR_COLS for v in _WRONG + [7]]
    + [(c, v) for c in _INT_COLS for v in _WRONG + ["8", None, True, 1.5, -1, 1 << 70]]
    + [(c, v) for c in _NULLABLE_INT_COLS for v in _WRONG + ["8", True, 1.5, -1]]
    + [(c, v) for c in _SHAPE_COLS for v in [{"a": 1}, "16", 16, None, [[16]], ["16"], [16, None], [-1], [True]]]
)


def _raw_doc(data: bytes) -> dict:
    ioff, ilen = struct.unpack_from("<QQ", data, 24)
    return json.loads(data[ioff:ioff + ilen])


def _with_column_value(data: bytes, col: str, i: int, value) -> bytes:
    """The container with value ``i`` of the 1.1 tensor column ``col`` replaced (the chunk table
    and every checksum valid)."""
    doc = _raw_doc(data)
    doc["tensors"][col][i] = value
    return rewrite_index(data, raw_index=json.dumps(doc).encode())


@pytest.mark.parametrize("col,value", WRONG_TYPES, ids=[f"{c}={json.dumps(v)}" for c, v in WRONG_TYPES])
def test_a_column_value_of_the_wrong_type_names_entry_and_field(mixtral, tmp_path, col, value):
    _, data = mixtral
    assert struct.unpack_from("<H", data, 10)[0] == 1  # a 1.1 file: tensors as columns
    names = _raw_doc(data)["tensors"]["name"]
    i = len(names) // 2
    p = _write(tmp_path / "t.zmoe", _with_column_value(data, col, i, value))
    who = f"tensor number {i}" if col == "name" else f"tensor {names[i]}"
    with pytest.raises(ContainerError) as exc:
        ContainerReader(p)
    msg = str(exc.value)
    assert "\n" not in msg and "invalid index" in msg
    assert f"{who}: field {col!r} must be" in msg, msg


@pytest.mark.parametrize("col,value", [("dtype", [1, 2]), ("dtype", {"a": 1}), ("role", ["expert"]),
                                       ("shape", {"a": 1}), ("chunk_count", [1])])
def test_wrong_column_types_are_one_line_for_every_command(mixtral, capsys, tmp_path, col, value):
    _, data = mixtral
    _refused_everywhere(capsys, tmp_path, _with_column_value(data, col, 0, value), f"field {col!r} must be")


def test_a_long_shape_of_huge_dimensions_is_refused_quickly(mixtral, tmp_path):
    """nbytes against product(shape): a shape of a hundred thousand dimensions near 2^62 would
    make a number of millions of digits; the product stops once it is out of range."""
    import time

    _, data = mixtral
    doc = _raw_doc(data)
    doc["tensors"]["shape"][0] = [(1 << 62) - 1] * 100_000
    p = _write(tmp_path / "s.zmoe", rewrite_index(data, raw_index=json.dumps(doc).encode()))
    t0 = time.perf_counter()
    with pytest.raises(ContainerError, match=f"tensor {doc['tensors']['name'][0]}: nbytes"):
        ContainerReader(p)
    assert time.perf_counter() - t0 < 10


@pytest.fixture(scope="module")
def mixtral_1_0(tmp_path_factory):
    from test_container_helpers import write_mixtral
    from zipmoe.codecs.writer import pack

    d = tmp_path_factory.mktemp("mx10")
    write_mixtral(d / "mx")
    pack(d / "mx", d / "old.zmoe", shard_size=256, workers=1, version="1.0")
    return (d / "old.zmoe").read_bytes()


@pytest.mark.parametrize("field,value,needle", [
    ("dtype", [1, 2], "unknown dtype [1, 2]"), ("dtype", {"a": 1}, "unknown dtype {'a': 1}"), ("dtype", 7, "unknown dtype 7"),
    ("dtype", None, "unknown dtype None"), ("role", ["expert"], "unknown role ['expert']"),
    ("shape", {"a": 1}, "field 'shape' must be"), ("nbytes", [1], "field 'nbytes' must be"),
    ("layer", {"a": 1}, "field 'layer' must be"), ("proj", [1], "field 'proj' must be"),
    ("chunk_kind", [1], "unknown chunk kind [1]"), ("chunk_kind", {"a": 1}, "unknown chunk kind {'a': 1}"),
    ("chunk_codec", ["zstd"], "field 'codec' must be a string"),
])
def test_a_1_0_field_of_the_wrong_type_names_entry_and_field(mixtral_1_0, tmp_path, field, value, needle):
    data = mixtral_1_0
    assert struct.unpack_from("<H", data, 10)[0] == 0
    name = read_index(data)["tensors"][1]["name"]

    def edit(doc):
        e = doc["tensors"][1]
        if field.startswith("chunk_"):
            e["chunks"][0][field[len("chunk_"):]] = value
        else:
            e[field] = value

    p = _write(tmp_path / "o.zmoe", rewrite_index(data, edit))
    with pytest.raises(ContainerError) as exc:
        ContainerReader(p)
    msg = str(exc.value)
    assert "\n" not in msg and f"tensor {name}: " in msg and needle in msg, msg
