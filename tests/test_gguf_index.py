"""The parse index: a second open of a GGUF maps the same model without re-parsing the header;
and no open keeps gguf-py's parse of the header alive."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
from gguf import GGUFReader

from edgetp.model import gguf as gg
from edgetp.model.gguf import open_model


@pytest.fixture
def parses(monkeypatch):
    """A weak reference to each gguf-py reader that edgetp.model.gguf builds, in order."""
    made = []

    made_by = gg._Reader

    def counted(*args, **kwargs):
        reader = made_by(*args, **kwargs)
        made.append(weakref.ref(reader))
        return reader

    monkeypatch.setattr(gg, "_Reader", counted)
    return made


def test_an_indexed_open_gives_what_gguf_py_reads(smollm2_path, tmp_path, parses):
    first = open_model(smollm2_path, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1 and len(parses) == 1
    again = open_model(smollm2_path, tmp_path)
    assert len(parses) == 1, "the second open must not parse the header"
    reader = GGUFReader(smollm2_path)
    assert again.metadata == {k: f.contents() for k, f in reader.fields.items()}
    assert again.config == first.config and again.fingerprint == first.fingerprint
    for t in reader.tensors:
        mine = again.tensors[t.name]
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert np.asarray(mine.data).tobytes() == np.asarray(t.data).tobytes()


@pytest.mark.parametrize("model", ["stories", "smollm2"])
def test_edgetps_reader_parses_each_field_and_tensor_as_gguf_pys_own(model, stories_path, smollm2_path):
    # edgetp's reader is gguf-py's over a plain view of the map (shard files copy its parts)
    path = stories_path if model == "stories" else smollm2_path
    mine, theirs = open_model(path).reader(), GGUFReader(path)
    assert type(mine) is not GGUFReader and not isinstance(mine.data, np.memmap)
    assert (mine.data_offset, mine.alignment, mine.byte_order) == (theirs.data_offset, theirs.alignment,
                                                                   theirs.byte_order)
    assert list(mine.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        other = mine.fields[name]
        assert (other.offset, other.types, other.data) == (field.offset, field.types, field.data), name
        assert [(p.dtype, p.tobytes()) for p in other.parts] == [(p.dtype, p.tobytes()) for p in field.parts], name
        assert other.contents() == field.contents(), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes, t.data.dtype, t.data.shape)
            for t in mine.tensors] == [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes, t.data.dtype,
                                        t.data.shape) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(mine.tensors, theirs.tensors))
    assert not mine.data.flags.writeable  # still the read-only map


def test_a_changed_file_or_a_corrupt_index_means_a_fresh_parse(stories_path, tmp_path, parses):
    model = tmp_path / "m.gguf"
    model.write_bytes(stories_path.read_bytes())
    index = tmp_path / "index"
    open_model(model, index)
    (entry,) = index.iterdir()
    entry.write_bytes(b"\x00garbage")
    open_model(model, index)
    assert len(parses) == 2  # corrupt index: parsed again
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reopened = open_model(model, index)
    assert len(parses) == 3  # new mtime: a new key, parsed again
    assert reopened.config.n_layers == 5


def test_no_open_model_keeps_gguf_pys_parse_of_its_header(smollm2_path, parses):
    # the parse holds a numpy view per header string: 334 MB of RSS for Llama 3's 128k-token
    # vocabulary, which a daemon keeping it would carry for its whole life
    mf = open_model(smollm2_path)
    fields = mf.reader().fields  # a parse of its own, for whoever asks
    assert len(parses) == 2 and fields["general.architecture"].contents() == mf.metadata["general.architecture"]
    del fields
    gc.collect()
    assert [r() for r in parses] == [None, None]
    assert mf.config.vocab == 49152 and mf.weight("token_embd.weight").rows == 49152  # still whole
