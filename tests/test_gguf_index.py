"""The parse index: a second open of a GGUF maps the same model without re-parsing the header."""

from __future__ import annotations

import os

import numpy as np
from gguf import GGUFReader

from edgetp.model.gguf import open_model


def test_an_indexed_open_gives_what_gguf_py_reads(smollm2_path, tmp_path):
    first = open_model(smollm2_path, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    again = open_model(smollm2_path, tmp_path)
    assert "reader" not in again.__dict__, "the second open must not parse the header"
    reader = GGUFReader(smollm2_path)
    assert again.metadata == {k: f.contents() for k, f in reader.fields.items()}
    assert again.config == first.config and again.fingerprint == first.fingerprint
    for t in reader.tensors:
        mine = again.tensors[t.name]
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert np.asarray(mine.data).tobytes() == np.asarray(t.data).tobytes()


def test_a_changed_file_or_a_corrupt_index_means_a_fresh_parse(stories_path, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(stories_path.read_bytes())
    index = tmp_path / "index"
    open_model(model, index)
    (entry,) = index.iterdir()
    entry.write_bytes(b"\x00garbage")
    assert "reader" in open_model(model, index).__dict__  # corrupt index: parsed again
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reopened = open_model(model, index)
    assert "reader" in reopened.__dict__  # new mtime: a new key, parsed again
    assert reopened.config.n_layers == 5
